#!/usr/bin/env bash
# bench/wgmma_ceiling.cu: the tensor rate of each wgmma form of gemm1's consumers with no loads,
# and for each form the SM clock and board power that nvidia-smi samples while it runs (each form
# ~5 s, one process per form). gemm1's and its peers' clocks in steady state: bench_gpu.sh
# --gemm1-rows ... --sustain S. One GPU.
# Usage, from the repository root: bash bench/device/wgmma_ceiling.sh [--timeout S]  (default 150)
# Logs: $OUT/wgmma-build.log, $OUT/wgmma.log (the table), $OUT/wgmma-smi-<form>.log.
source "$(dirname "$0")/common.sh"
take_options 150 "$@"
step wgmma-build 180 nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I "$REPO" \
    -o /tmp/jsm-wgmma "$REPO/bench/wgmma_ceiling.cu" || { tail -20 "$OUT/wgmma-build.log"; exit 1; }
# the median of column $2 over the later half of the samples (nvidia-smi's power.draw averages the
# last second: its first samples of a form still ramp up)
late_median() {
  awk -F, -v c="$2" '{ v[NR] = $c } END { for (i = int(NR / 2) + 1; i <= NR; ++i) print v[i] }' \
    "$1" | sort -n | awk '{ v[NR] = $1 } END { if (NR) printf "%.0f", v[int((NR + 1) / 2)];
    else printf "-" }'
}
run_forms() {
  printf '%-54s %8s %6s\n' "form, type, weights, time, rate" "MHz" "W"
  local forms
  forms=$(/tmp/jsm-wgmma --forms) || return 1
  for ((form = 0; form < forms; ++form)); do
    nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 \
      > "$OUT/wgmma-smi-$form.log" 2>&1 &
    local smi=$!
    local line
    line=$(/tmp/jsm-wgmma 1000 "$form") || { kill $smi; echo "form $form failed: $line"; return 1; }
    kill $smi
    printf '%-54s %8s %6s\n' "$line" "$(late_median "$OUT/wgmma-smi-$form.log" 1)" \
      "$(late_median "$OUT/wgmma-smi-$form.log" 2)"
  done
}
export OUT
export -f late_median run_forms
step wgmma "$TIMEOUT" bash -c run_forms
cat "$OUT/wgmma.log"
summary
