#!/usr/bin/env bash
# For the day an AMD machine (MI300X gfx942, MI355X gfx950; ROCm, jax's ROCm plugin, amd-mori and
# flydsl installed) is lent: builds the package with the machine's compilers, runs
# tests/test_rocm.py (JSM_REQUIRE_ROCM=1: a missing AMD GPU or ROCm build fails instead of
# skipping), then bench/run.py --gpu on every GPU. MORI_ENABLE_SDMA=1 is mori's own switch for its
# SDMA queues (engine sdma needs them). Never run yet: no AMD machine has been lent.
# Usage, from the repository root: bash bench/device/rocm_tests.sh [--timeout S] [bench/run.py flags]
# Logs: $OUT/build.log, $OUT/tests-rocm.log, $OUT/bench-rocm.log.
source "$(dirname "$0")/common.sh"
take_options 540 "$@"
export JSM_REQUIRE_ROCM=1 MORI_ENABLE_SDMA=1
unset JSM_REQUIRE_CUDA
build
cd /tmp  # the installed package, not the checkout's sources
step tests-rocm "$TIMEOUT" python3 -m pytest -v -rfE -p no:cacheprovider "$REPO/tests/test_rocm.py"
pytest_outcome "$OUT/tests-rocm.log"
gpus=$(python3 -c "import jax; print(len(jax.devices('gpu')))" 2>/dev/null || echo 0)
step bench-rocm "$TIMEOUT" python3 "$REPO/bench/run.py" --gpu --devices "$gpus" "${ARGS[@]}"
summary
