#!/usr/bin/env bash
# compute-sanitizer memcheck over tests/cuda_smoke.py: every CUDA kernel of an R = 1 Stage1 once,
# on odd sizes. Exit status 9 in the summary: memcheck found errors (listed in the log).
# Usage, from the repository root: bash bench/device/sanitize.sh [--timeout S]  (default 300)
# Log: $OUT/sanitize.log.
source "$(dirname "$0")/common.sh"
take_options 300 "$@"
build
cd /tmp  # the installed package, not the checkout's sources
# no preallocation: memcheck tracks every allocation, and a 75% pool hides out-of-bounds accesses
XLA_PYTHON_CLIENT_PREALLOCATE=false step sanitize "$TIMEOUT" compute-sanitizer --tool memcheck \
  --error-exitcode 9 python3 "$REPO/tests/cuda_smoke.py"
tail -8 "$OUT/sanitize.log"
summary
