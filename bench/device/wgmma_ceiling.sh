#!/usr/bin/env bash
# bench/wgmma_ceiling.cu: the tensor rate of each wgmma form of gemm1's consumers with no loads,
# with the SM clock and board power that nvidia-smi samples meanwhile (each form ~2 s). gemm1's
# and its peers' clocks in steady state: bench_gpu.sh --gemm1-rows ... --sustain S. One GPU.
# Usage, from the repository root: bash bench/device/wgmma_ceiling.sh [--timeout S]  (default 120)
# Logs: $OUT/wgmma-build.log, $OUT/wgmma.log (the table), $OUT/wgmma-smi.log.
source "$(dirname "$0")/common.sh"
take_options 120 "$@"
step wgmma-build 180 nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I "$REPO" \
    -o /tmp/jsm-wgmma "$REPO/bench/wgmma_ceiling.cu" || { tail -20 "$OUT/wgmma-build.log"; exit 1; }
nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 \
  > "$OUT/wgmma-smi.log" 2>&1 &
SMI=$!
step wgmma "$TIMEOUT" /tmp/jsm-wgmma 400
kill $SMI
cat "$OUT/wgmma.log"
# the samples while the GPU was busy (over 300 W): median SM MHz and board power
awk -F, '$2 > 300' "$OUT/wgmma-smi.log" | sort -t, -k1n | awk -F, '{ m[NR] = $1 } END {
  if (NR) printf "busy samples %d: median %d MHz\n", NR, m[int((NR + 1) / 2)] }'
awk -F, '$2 > 300 { print $2 }' "$OUT/wgmma-smi.log" | sort -n | awk '{ w[NR] = $1 } END {
  if (NR) printf "median board power %.0f W\n", w[int((NR + 1) / 2)] }'
summary
