#!/usr/bin/env bash
# tests/test_multigpu.py (engines ce, sm, xla across every GPU of the machine: one process holding
# them all, and one process per GPU) in full.
# Usage, from the repository root: bash bench/device/tests_multigpu.sh [--timeout S] [pytest args...]
#   e.g. bash bench/device/tests_multigpu.sh -x -k "dsv3_uniform or two_processes"
#   (default --timeout 420; JSM_TEST_RANKS=R, read by the tests, uses R of the GPUs)
# Log: $OUT/tests-multigpu.log, and the GPUs' topology in $OUT/topology.log.
source "$(dirname "$0")/common.sh"
take_options 420 "$@"
build
nvidia-smi topo -m > "$OUT/topology.log" 2>&1
cd /tmp  # the installed package, not the checkout's sources
step tests-multigpu "$TIMEOUT" python3 -m pytest -v -rfE -p no:cacheprovider --durations=8 \
  "$REPO/tests/test_multigpu.py" "${ARGS[@]}"
pytest_outcome "$OUT/tests-multigpu.log"
summary
