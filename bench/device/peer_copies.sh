#!/usr/bin/env bash
# bench/peer_copy_pattern.cu: one dispatch's bytes between GPUs 0 and 1, cut as the engines cut
# them (copy-engine batches, single copies, signalled chunks, an SM copy kernel), without JAX.
# Needs two GPUs; builds against the library's headers (kernels/cuda/...), not the package.
# Usage, from the repository root: bash bench/device/peer_copies.sh [--timeout S]  (default 120)
# Logs: $OUT/peer-copies-build.log, $OUT/peer-copies.log (the table).
source "$(dirname "$0")/common.sh"
take_options 120 "$@"
step peer-copies-build 180 nvcc -O3 -std=c++17 -arch=sm_90a -I"$REPO" -o /tmp/jsm-peer-copies \
    "$REPO/bench/peer_copy_pattern.cu" \
  && step peer-copies "$TIMEOUT" /tmp/jsm-peer-copies
cat "$OUT/peer-copies.log" 2>/dev/null || tail -20 "$OUT/peer-copies-build.log"
summary
