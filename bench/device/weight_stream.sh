#!/usr/bin/env bash
# bench/stream_pattern.cu: how fast a persistent grid streams w1-like rows from HBM, by access
# pattern (row-wise K-major tiles as gemm1 reads them, or pre-packed contiguous tiles). One GPU.
# Usage, from the repository root: bash bench/device/weight_stream.sh [--timeout S]  (default 120)
# Logs: $OUT/weight-stream-build.log, $OUT/weight-stream.log (the table).
source "$(dirname "$0")/common.sh"
take_options 120 "$@"
step weight-stream-build 180 nvcc -O3 -arch=sm_90a -o /tmp/jsm-weight-stream \
    "$REPO/bench/stream_pattern.cu" \
  && step weight-stream "$TIMEOUT" /tmp/jsm-weight-stream
cat "$OUT/weight-stream.log" 2>/dev/null || tail -20 "$OUT/weight-stream-build.log"
summary
