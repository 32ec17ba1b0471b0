#!/usr/bin/env bash
# On a lent machine of R GPUs (nvidia-h200-x2, -x4, -x8; R = every GPU, or JSM_RANKS), from the
# repository root: build with the machine's jax, run the multi-GPU tests (one process with every
# GPU, and R processes with one each), then the benchmark at R ranks (engines ce, sm, xla and the
# JAX-native paths; table in bench.log, JSON and PNG in $OUT). Usage: bash
# bench/device_multigpu.sh [tests|bench|mpibench|copies|all] ... (default: all; mpibench: the
# benchmark under mpirun -n R, one GPU per process; copies: bench/peer_copy_pattern.cu, the row
# bytes between GPUs 0 and 1 cut as the engines cut them, without JAX).
# JSM_TEST_FILTER selects tests (-k); JSM_BENCH_SHAPES, JSM_BENCH_TOKENS, JSM_BENCH_ARGS as in
# device_cuda.sh.
source "$(dirname "$0")/device_build.sh"
RANKS=${JSM_RANKS:-$(nvidia-smi -L | wc -l)}  # R: every GPU of the machine (2, 4 or 8)
nvidia-smi topo -m 2>/dev/null | head -$((RANKS + 2))
cd /tmp
for step in "${@:-all}"; do
  if [[ $step == copies ]]; then  # how the dispatch's bytes are cut, alone (no JAX)
    nvcc -O3 -std=c++17 -arch=sm_90a -I"$REPO" -o /tmp/peer "$REPO/bench/peer_copy_pattern.cu" \
      && timeout 120 /tmp/peer 2>&1 | tee "$OUT/peer_copy_pattern.txt"
  fi
  if [[ $step == tests || $step == all ]]; then
    run_gpu_tests test_multigpu.py tests-multigpu.log ${JSM_PYTEST_ARGS--x}  # default: stop at
    # the first failure; JSM_PYTEST_ARGS="" runs them all
  fi
  if [[ $step == mpibench ]]; then  # the same under mpirun, one GPU per process (XLA refuses
    # ragged_all_to_all across processes without its NCCL fallback, which lost rows: skipped)
    timeout ${JSM_BENCH_TIMEOUT:-540} mpirun --allow-run-as-root -n "$RANKS" -x PYTHONUNBUFFERED python3 "$REPO/bench/run.py" --gpu \
      --shapes "$(tr ' ' , <<< "${JSM_BENCH_SHAPES:-dsv3}")" \
      --tokens "${JSM_BENCH_TOKENS:-128,1024,2048,4096,8192}" --skip-native ragged \
      ${JSM_BENCH_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench-mpi.log" | grep -v '^- ' | tail -24
  fi
  if [[ $step == bench || $step == all ]]; then
    # ragged_all_to_all + ragged_dot included (it runs out of memory from ~2048 tokens: reported)
    timeout ${JSM_BENCH_TIMEOUT:-540} python3 "$REPO/bench/run.py" --gpu --devices "$RANKS" \
      --shapes "$(tr ' ' , <<< "${JSM_BENCH_SHAPES:-dsv3 v4pro}")" \
      --tokens "${JSM_BENCH_TOKENS:-128,1024,2048,4096,8192}" \
      ${JSM_BENCH_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench-x2.log" | grep -v '^- ' | tail -24
  fi
done
