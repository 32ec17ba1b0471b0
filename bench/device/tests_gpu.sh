#!/usr/bin/env bash
# Every GPU test in full, one file after the other (they would compete for the GPUs' memory):
# tests/test_cuda.py, then tests/test_multigpu.py where the machine has two GPUs or more. Fits one
# device call (10 minutes) on nvidia-h200-x2 when the package is built already or builds quickly.
# Usage, from the repository root: bash bench/device/tests_gpu.sh [--timeout S] [pytest args...]
#   (--timeout: per file, default 250 for test_cuda.py and 300 for test_multigpu.py; the pytest
#   args go to both files)
# Logs: $OUT/tests-cuda.log, $OUT/tests-multigpu.log, $OUT/build.log.
source "$(dirname "$0")/common.sh"
take_options "" "$@"
build
GPUS=$(gpu_count)
cd /tmp  # the installed package, not the checkout's sources
step tests-cuda "${TIMEOUT:-250}" python3 -m pytest -v -rfE -p no:cacheprovider --durations=8 \
  "$REPO/tests/test_cuda.py" "${ARGS[@]}"
pytest_outcome "$OUT/tests-cuda.log"
if ((GPUS >= 2)); then
  step tests-multigpu "${TIMEOUT:-300}" python3 -m pytest -v -rfE -p no:cacheprovider \
    --durations=8 "$REPO/tests/test_multigpu.py" "${ARGS[@]}"
  pytest_outcome "$OUT/tests-multigpu.log"
else
  note "tests-multigpu: not run ($GPUS GPU)"
fi
summary
