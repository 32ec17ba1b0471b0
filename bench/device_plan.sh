#!/usr/bin/env bash
# The device runs that validate and measure the open issues, each fitting the 600 s limit of one
# device call (every step has its own timeout; logs land in $OUT even when a step runs out). Run
# them back to back on one warm machine (it is given back after 30 s idle; the package is built
# once per machine). Session 5 (2xH200): D took 294 s; E and F each ran out of their 530 s at
# v4pro T = 2048 (the JAX-native ragged path's autotuning and out-of-memory failures are slow), so
# v4pro 2048-8192 took two more calls: split E and F by shape (JSM_BENCH_SHAPES) next time, and
# merge the JSON files with `bench/run.py --merge`. From the repository root:
#   run A on nvidia-h200:    bash bench/device_plan.sh A  # gemm1: ncu profile + variants/ablations
#   run C on nvidia-h200:    bash bench/device_plan.sh C  # R = 1: CUDA tests, sanitizer, bench table
#   run D on nvidia-h200-x2: bash bench/device_plan.sh D  # all multi-GPU tests (both launch modes)
#   run E on nvidia-h200-x2: bash bench/device_plan.sh E  # bench, one process, dsv3 + v4pro sweep
#   run F on nvidia-h200-x2: bash bench/device_plan.sh F  # bench under mpirun -n 2, same sweep
#   run G on nvidia-h200-x2: bash bench/device_plan.sh G  # session 5's changes, not yet run: ~5 min
#   run H on nvidia-h200-x2: bash bench/device_plan.sh H  # ce with JSM_CE_OWN=kernel: ~5 min
set -uo pipefail
export OUT=${OUT:-/tmp/jsm-out}
case "${1:-}" in
  A)
    JSM_PROFILE_TIMEOUT=240 bash bench/device_cuda.sh profile
    JSM_VARIANTS_TIMEOUT=200 JSM_VARIANTS_ARGS="--tokens 1024,4096 --iters 5" \
      bash bench/device_cuda.sh variants
    ;;
  C)
    JSM_TEST_TIMEOUT=260 JSM_SUBSET_TIMEOUT=0 bash bench/device_cuda.sh tests
    JSM_SANITIZE_TIMEOUT=60 bash bench/device_cuda.sh sanitize
    JSM_BENCH_TIMEOUT=200 JSM_BENCH_SHAPES="dsv3 v4pro" JSM_BENCH_ARGS="--iters 10 --warmup 2" \
      bash bench/device_cuda.sh bench
    ;;
  D)
    bash bench/device_multigpu.sh copies  # ~40 s: fewer sm blocks (8, 12) against 24
    JSM_PYTEST_ARGS="" JSM_TEST_TIMEOUT=480 bash bench/device_multigpu.sh tests
    ;;
  E)
    JSM_BENCH_TIMEOUT=530 JSM_BENCH_ARGS="--iters 20 --warmup 3" bash bench/device_multigpu.sh bench
    ;;
  F)
    JSM_BENCH_TIMEOUT=530 JSM_BENCH_SHAPES="dsv3 v4pro" JSM_BENCH_ARGS="--iters 20 --warmup 3" \
      bash bench/device_multigpu.sh mpibench
    ;;
  G)  # engine xla's gather (was 2.5 GB/s), ce's own-GPU share of the host enqueue, local copies,
      # sm with 8 / 12 / 24 blocks
    bash bench/device_multigpu.sh copies
    JSM_TEST_TIMEOUT=200 JSM_TEST_FILTER="200_back_to_back or dsv3_uniform" bash \
      bench/device_multigpu.sh tests
    # engine sm with fewer SMs taken from the GEMM (model: 12 blocks, dsv3 4096: 9.5 -> ~8.1 ms)
    JSM_BENCH_TIMEOUT=260 JSM_BENCH_SHAPES=dsv3 JSM_BENCH_TOKENS=1024,4096 \
      JSM_BENCH_ARGS="--iters 20 --warmup 3 --skip-native ragged --sm-blocks 8,12,24" \
      bash bench/device_multigpu.sh bench
    ;;
  H)  # engine ce, own rows by a kernel and the GEMM launched before the host's plan wait
    export JSM_CE_OWN=kernel
    JSM_TEST_TIMEOUT=240 JSM_TEST_FILTER="back_to_back0 or delayed_rank0 or times_out0 or dsv3_uniform or dsv3_masked_T4096 or two_processes" bash \
      bench/device_multigpu.sh tests
    JSM_BENCH_TIMEOUT=240 JSM_BENCH_SHAPES=dsv3 JSM_BENCH_TOKENS=1024,4096,8192 \
      JSM_BENCH_ARGS="--iters 20 --warmup 3 --skip-native ragged --engines ce --tag gpu-x2-ce-own" \
      bash bench/device_multigpu.sh bench
    ;;
  *)
    echo "usage: bash bench/device_plan.sh A|C|D|E|F|G|H" >&2
    exit 2
    ;;
esac
