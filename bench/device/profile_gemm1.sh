#!/usr/bin/env bash
# Nsight Compute on one gemm1 launch (bench/gemm1_profile.py: R = 1, bf16 out, rows landed by the
# reference): the full report, its details page, a per-SASS-line CSV, and the headline metrics.
# Usage, from the repository root:
#   bash bench/device/profile_gemm1.sh [--timeout S] [SHAPE [TOKENS]]  (default: dsv3 4096, 240 s)
#   bash bench/device/profile_gemm1.sh dsv3 --rows 32768 --experts 128  (the GEMM1 study's rows)
# Files in $OUT: gemm1.ncu-rep, gemm1-details.txt, gemm1-sass.csv, profile.log.
source "$(dirname "$0")/common.sh"
take_options 240 "$@"
build
cd /tmp  # the installed package, not the checkout's sources
step profile "$TIMEOUT" ncu --clock-control none -k regex:gemm_sm90 --launch-count 1 --set full \
  --import-source yes -f -o "$OUT/gemm1" python3 "$REPO/bench/gemm1_profile.py" "${ARGS[@]}"
if [[ -f $OUT/gemm1.ncu-rep ]]; then
  ncu --import "$OUT/gemm1.ncu-rep" --page details > "$OUT/gemm1-details.txt" 2>&1
  ncu --import "$OUT/gemm1.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/gemm1-sass.csv" 2>&1
  grep -E "Duration|Issue Slots Busy|Issued Warp|Warp Cycles Per Issued|No Eligible|Memory Throughput|Compute \(SM\)" \
    "$OUT/gemm1-details.txt" | head -24
else
  tail -5 "$OUT/profile.log"
fi
summary
