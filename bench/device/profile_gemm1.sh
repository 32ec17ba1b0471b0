#!/usr/bin/env bash
# Nsight Compute on one gemm1 launch (bench/gemm1_profile.py: R = 1, bf16 out, rows landed by the
# reference): the full report, its details page, a per-SASS-line CSV, and the headline metrics.
# Usage, from the repository root:
#   bash bench/device/profile_gemm1.sh [--timeout S] [SHAPE [TOKENS]]  (default: dsv3 4096, 240 s)
#   bash bench/device/profile_gemm1.sh dsv3 --rows 32768 --experts 128  (the GEMM1 study's rows)
#   bash bench/device/profile_gemm1.sh dsv3 --rows 32768 --experts 128 --peer torch-bf16
#     (torch's grouped GEMM on the same rows instead: its first 3 launches whose names say GEMM or
#     CUTLASS, which include its data preparation before the GEMM itself; files named after the
#     peer)
# Files in $OUT: gemm1.ncu-rep, gemm1-details.txt, gemm1-sass.csv, profile.log (or <peer>.*).
source "$(dirname "$0")/common.sh"
take_options 240 "$@"
NAME=gemm1 KERNELS=regex:gemm_sm90 LAUNCHES=1
for ((i = 0; i < ${#ARGS[@]}; i++)); do
  [[ ${ARGS[i]} == --peer ]] && NAME=${ARGS[i + 1]} LAUNCHES=3 \
    KERNELS='regex:(?i)gemm|cutlass|xmma|device_kernel'
done
build
cd /tmp  # the installed package, not the checkout's sources
step profile "$TIMEOUT" ncu --clock-control none -k "$KERNELS" --launch-count "$LAUNCHES" \
  --set full --import-source yes -f -o "$OUT/$NAME" \
  python3 "$REPO/bench/gemm1_profile.py" "${ARGS[@]}"
if [[ -f $OUT/$NAME.ncu-rep ]]; then
  ncu --import "$OUT/$NAME.ncu-rep" --page details > "$OUT/$NAME-details.txt" 2>&1
  ncu --import "$OUT/$NAME.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/$NAME-sass.csv" 2>&1
  HEADLINES="  void |  [a-z_:]+<|SM Frequency|Elapsed Cycles|Duration|Issue Slots Busy"
  HEADLINES+="|No Eligible|Memory Throughput|Compute \(SM\)"
  grep -E "$HEADLINES" "$OUT/$NAME-details.txt" | cut -c1-150 | head -$((24 * LAUNCHES))
else
  tail -5 "$OUT/profile.log"
fi
summary
