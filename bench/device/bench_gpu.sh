#!/usr/bin/env bash
# The benchmark on the GPUs of one process: bench/run.py --gpu --devices R (R = every GPU of the
# machine unless the flags say otherwise; R = 1: engine local; more: engines ce, sm, xla).
# Usage, from the repository root: bash bench/device/bench_gpu.sh [--timeout S] [bench/run.py flags...]
#   e.g. bash bench/device/bench_gpu.sh --shapes dsv3 --tokens 128,1024,4096 --iters 10
#        bash bench/device/bench_gpu.sh --gemm1-rows 128x2,32768,65536 --experts 128 \
#          --rounds 6   (issue 13)
#   (default --timeout 540; every flag of bench/run.py, which come after the defaults here:
#   --gpu --devices <GPUs> --out $OUT)
# Log: $OUT/bench-gpu.log (the table and its notes); <tag>.json and <tag>.png in $OUT, written
# after every configuration: merge a run cut short with the rest by bench/run.py --merge.
source "$(dirname "$0")/common.sh"
take_options 540 "$@"
build
cd /tmp  # the installed package, not the checkout's sources
step bench-gpu "$TIMEOUT" python3 "$REPO/bench/run.py" --gpu --devices "$(gpu_count)" \
  --out "$OUT" "${ARGS[@]}"
sed -n '/^shape  /,/^ceilings/p' "$OUT/bench-gpu.log"
tail -3 "$OUT/bench-gpu.log" | sed 's/^/  /'
summary
