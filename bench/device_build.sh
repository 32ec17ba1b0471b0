# Sourced by the device scripts: strict-ish shell, the repository and output folders, and the
# package built with the machine's own jax (the lent machines have no package registry).
set -uo pipefail
REPO=$PWD
export JSM_REQUIRE_CUDA=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jsm-out}
mkdir -p "$OUT"
# once per machine: a second device script in the same call reuses the installed package
[[ -f /tmp/jsm-built ]] || { python3 -m pip install --no-build-isolation --no-deps --no-index . \
  > "$OUT/build.log" 2>&1 && touch /tmp/jsm-built; } || { tail -40 "$OUT/build.log"; exit 1; }

# Runs tests/FILE (-v into $OUT/LOG, which comes back even when the device call runs out of
# time) under JSM_TEST_TIMEOUT, with JSM_TEST_FILTER as -k and any further pytest arguments,
# then prints how many passed, what failed and the log's tail.
run_gpu_tests() {
  local file=$1 log=$2
  shift 2
  timeout ${JSM_TEST_TIMEOUT:-480} python3 -m pytest -v "$@" -p no:cacheprovider --durations=8 \
    "$REPO/tests/$file" ${JSM_TEST_FILTER:+-k "$JSM_TEST_FILTER"} > "$OUT/$log" 2>&1
  grep -c PASSED "$OUT/$log" | sed 's/^/passed: /'
  pkill -9 -f "tests/(mp_gpu_worker|graph_worker|mp_worker)\.py" || true  # a timeout's orphans
  grep -E "FAILED|ERROR|Error:|assert" "$OUT/$log" | head -10
  tail -14 "$OUT/$log"
}
