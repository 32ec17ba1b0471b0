#!/usr/bin/env bash
# On a lent GPU machine, from the repository root: build with the machine's jax (no registry there),
# run the CUDA tests, compute-sanitizer on a small case, and the single-GPU benchmark
# (bench/run.py --gpu: table in bench.log, gpu.json and gpu.png in $OUT).
# Usage: bash bench/device_cuda.sh [tests|variants|sanitize|profile|bench|all] ...  (default: all;
# profile: ncu on one launch of the default gemm1, report and per-SASS-line CSV into $OUT)
# bench takes JSM_BENCH_SHAPES (default "dsv3 v4pro"), JSM_BENCH_TOKENS (comma list) and
# JSM_BENCH_ARGS (more bench/run.py flags, e.g. "--skip-native ragged").
source "$(dirname "$0")/device_build.sh"
grep -A3 "gemm1_ws_kernel" "$OUT/build.log" | grep -E "registers|spill" | head -4
cd /tmp
for step in "${@:-all}"; do
  if [[ $step == tests || $step == all ]]; then
    run_gpu_tests test_cuda.py tests.log
    [[ ${JSM_SUBSET_TIMEOUT:-120} == 0 ]] && continue
    echo "-- engine local with qpack storing rows at their landing rows (JSM_LOCAL_FUSED=1)"
    JSM_LOCAL_FUSED=1 timeout ${JSM_SUBSET_TIMEOUT:-120} python3 -m pytest -q -x \
      -p no:cacheprovider "$REPO/tests/test_cuda.py" -k "T128 or T7 or skewed or xla_engine" \
      --tb=short > "$OUT/tests-local-fused.log" 2>&1
    grep -E "Error|passed|failed" "$OUT/tests-local-fused.log" | tail -4
  fi
  if [[ $step == variants ]]; then  # the gemm1 and route variants side by side (quick)
    timeout ${JSM_VARIANTS_TIMEOUT:-300} python3 "$REPO/bench/kernel_variants.py" \
      ${JSM_VARIANTS_ARGS:---tokens 128,1024,4096,8192} 2>&1 | tee "$OUT/variants.log" \
      | grep -v "^- " | tail -24
  fi
  if [[ $step == profile ]]; then  # ncu on one launch of the default gemm1 (dsv3, bf16 out)
    timeout ${JSM_PROFILE_TIMEOUT:-240} ncu --clock-control none -k regex:gemm1_ws_kernel \
      --launch-count 1 --set full --import-source yes -f -o "$OUT/gemm1_ws" \
      python3 "$REPO/bench/kernel_variants.py" --tokens "${JSM_PROFILE_TOKENS:-4096}" --gemm1 ws \
      --route blocks --iters 1 > "$OUT/profile.log" 2>&1
    echo "ncu rc=$?"; tail -3 "$OUT/profile.log"
    ncu --import "$OUT/gemm1_ws.ncu-rep" --page details > "$OUT/gemm1_ws-details.txt" 2>&1
    ncu --import "$OUT/gemm1_ws.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/gemm1_ws-sass.csv" 2>&1
    grep -E "Duration|Issue Slots Busy|Issued Warp|Warp Cycles Per Issued|No Eligible|Memory Throughput|Compute \(SM\)" \
      "$OUT/gemm1_ws-details.txt" | head -24
  fi
  if [[ $step == bench || $step == all ]]; then
    timeout ${JSM_BENCH_TIMEOUT:-540} python3 "$REPO/bench/run.py" --gpu --shapes "$(tr ' ' , <<< "${JSM_BENCH_SHAPES:-dsv3 v4pro}")" \
      ${JSM_BENCH_TOKENS:+--tokens "$JSM_BENCH_TOKENS"} ${JSM_BENCH_ARGS:-} --out "$OUT" 2>&1 \
      | tee "$OUT/bench.log" | grep -v '^- ' | tail -16
  fi
  if [[ $step == sanitize || $step == all ]]; then
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${JSM_SANITIZE_TIMEOUT:-300} compute-sanitizer \
      --tool memcheck --error-exitcode 9 python3 "$REPO/tests/cuda_smoke.py" \
      > "$OUT/sanitize.log" 2>&1
    echo "compute-sanitizer rc=$? (9: memcheck errors; 124: timed out)"; tail -8 "$OUT/sanitize.log"
  fi
done
