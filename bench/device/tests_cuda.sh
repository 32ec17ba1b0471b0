#!/usr/bin/env bash
# tests/test_cuda.py (one GPU: the CUDA kernels, engine local, the xla engine on one GPU) in full.
# Usage, from the repository root: bash bench/device/tests_cuda.sh [--timeout S] [pytest args...]
#   e.g. bash bench/device/tests_cuda.sh -k "T128 or skewed"      (default --timeout 300)
# Log: $OUT/tests-cuda.log.
source "$(dirname "$0")/common.sh"
take_options 300 "$@"
build
cd /tmp  # the installed package, not the checkout's sources
step tests-cuda "$TIMEOUT" python3 -m pytest -v -rfE -p no:cacheprovider --durations=8 \
  "$REPO/tests/test_cuda.py" "${ARGS[@]}"
pytest_outcome "$OUT/tests-cuda.log"
summary
