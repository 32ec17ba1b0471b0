#!/usr/bin/env bash
# The benchmark with one GPU per process: mpirun -n R bench/run.py --gpu (engines ce, sm; R = every
# GPU of the machine, or --ranks R). The JAX-native ragged_dot path is skipped by default (it is
# slow to compile and runs out of memory from ~2048 tokens per rank; --skip-native "" runs it).
# Usage, from the repository root:
#   bash bench/device/bench_mpirun.sh [--timeout S] [--ranks R] [bench/run.py flags...]
#   e.g. bash bench/device/bench_mpirun.sh --shapes dsv3 --tokens 1024,4096 --iters 10
#   (default --timeout 540; bench/run.py's flags come after the defaults here: --gpu
#   --skip-native ragged --out $OUT)
# Log: $OUT/bench-mpirun.log; <tag>.json and <tag>.png in $OUT (tag gpu-x<R>-mpi).
source "$(dirname "$0")/common.sh"
take_options 540 "$@"
RANKS=$(gpu_count)
FLAGS=()
for ((i = 0; i < ${#ARGS[@]}; i++)); do
  if [[ ${ARGS[i]} == --ranks ]]; then
    RANKS=${ARGS[i + 1]}
    i=$((i + 1))
  else
    FLAGS+=("${ARGS[i]}")
  fi
done
build
cd /tmp  # the installed package, not the checkout's sources
step bench-mpirun "$TIMEOUT" mpirun --allow-run-as-root -n "$RANKS" -x PYTHONUNBUFFERED \
  -x JSM_REQUIRE_CUDA python3 "$REPO/bench/run.py" --gpu --skip-native ragged --out "$OUT" \
  "${FLAGS[@]}"
sed -n '/^shape  /,/^ceilings/p' "$OUT/bench-mpirun.log"
tail -3 "$OUT/bench-mpirun.log" | sed 's/^/  /'
summary
