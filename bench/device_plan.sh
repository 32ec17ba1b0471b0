#!/usr/bin/env bash
# The device runs that validate and measure issues 3 and 4, in three calls that each fit the
# 600 s limit of one device call (every step has its own timeout; logs land in $OUT even when a
# step runs out; with ~30 s to start each machine the three take ~29 min of the 30). From the
# repository root:
#   run A on nvidia-h200:    bash bench/device_plan.sh A   # gemm1 variants + ablations, CUDA tests
#   run B on nvidia-h200-x2: bash bench/device_plan.sh B   # multi-GPU tests (both launch modes), R = 2 benches
#   run C on nvidia-h200:    bash bench/device_plan.sh C   # bench/run.py --gpu (R = 1, dsv3, v4pro), sanitizer
set -uo pipefail
export OUT=${OUT:-/tmp/jsm-out}
case "${1:-}" in
  A)
    JSM_VARIANTS_TIMEOUT=150 JSM_VARIANTS_ARGS="--tokens 1024,4096 --iters 5" \
      bash bench/device_cuda.sh variants
    JSM_TEST_TIMEOUT=260 JSM_SUBSET_TIMEOUT=100 bash bench/device_cuda.sh tests
    ;;
  B)
    bash bench/device_multigpu.sh copies
    JSM_PYTEST_ARGS="" JSM_TEST_TIMEOUT=260 bash bench/device_multigpu.sh tests
    JSM_BENCH_TIMEOUT=140 JSM_BENCH_SHAPES=dsv3 JSM_BENCH_TOKENS=1024,4096,8192 \
      JSM_BENCH_ARGS="--iters 10 --warmup 2" bash bench/device_multigpu.sh bench
    JSM_BENCH_TIMEOUT=80 JSM_BENCH_SHAPES=dsv3 JSM_BENCH_TOKENS=4096 \
      JSM_BENCH_ARGS="--iters 10 --warmup 2" bash bench/device_multigpu.sh mpibench
    ;;
  C)
    JSM_BENCH_TIMEOUT=300 JSM_BENCH_SHAPES="dsv3 v4pro" JSM_BENCH_ARGS="--iters 10 --warmup 2" \
      bash bench/device_cuda.sh bench
    JSM_SANITIZE_TIMEOUT=90 bash bench/device_cuda.sh sanitize
    JSM_TEST_FILTER="equals_cpu or xla_engine" JSM_TEST_TIMEOUT=80 JSM_SUBSET_TIMEOUT=0 \
      bash bench/device_cuda.sh tests
    ;;
  *)
    echo "usage: bash bench/device_plan.sh A|B|C" >&2
    exit 2
    ;;
esac
