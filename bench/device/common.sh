# Sourced by the scripts in bench/device/, which run from the repository root on a lent GPU machine:
# a strict-ish shell, $OUT (the folder the device tool brings back; /tmp/jsm-out elsewhere), the
# package built with the machine's own jax (the lent machines reach no package registry), and
# helpers that run each step under `timeout` with its log in $OUT and print a summary at the end.
set -uo pipefail
REPO=$(pwd)
[[ -f $REPO/pyproject.toml && -d $REPO/bench/device ]] || {
  echo "run bench/device/*.sh from the repository root" >&2; exit 2; }
mkdir -p "${OUT:=/tmp/jsm-out}"
OUT=$(cd "$OUT" && pwd)  # absolute: the scripts run their steps from /tmp
# JSM_REQUIRE_CUDA=1: the CUDA tests fail instead of skipping where no GPU or CUDA build is found
export JSM_REQUIRE_CUDA=1 PYTHONUNBUFFERED=1
SUMMARY=()

# take_options DEFAULT_TIMEOUT "$@": sets TIMEOUT (seconds per step; --timeout S overrides it) and
# ARGS (every other argument, in order, for the step's own command).
take_options() {
  TIMEOUT=$1
  shift
  ARGS=()
  while (($#)); do
    if [[ $1 == --timeout ]]; then
      TIMEOUT=$2
      shift 2
    else
      ARGS+=("$1")
      shift
    fi
  done
}

# step NAME SECONDS COMMAND...: runs COMMAND with stdout and stderr in $OUT/NAME.log, bounded by
# SECONDS (then SIGTERM to it and every process it started, SIGKILL 10 s later); records the
# outcome for `summary`. Returns COMMAND's status (124 or 137: timed out).
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name (at most $limit s): $*"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local what="ok"
  ((rc != 0)) && what="FAILED (rc $rc)"
  ((rc == 124 || rc == 137)) && what="TIMED OUT after $limit s"
  ((rc == 125)) && what="STOPPED: no output for a while (idle_guard.sh; a hang?)"
  SUMMARY+=("$name: $what in $((SECONDS - t0)) s, log $OUT/$name.log")
  return $rc
}

# note LINE...: a line for the summary.
note() { SUMMARY+=("$@"); }

# summary: what every step did, printed last (the device tool shows the output's tail).
summary() {
  echo "== summary"
  printf '%s\n' "${SUMMARY[@]}"
}

# pytest_outcome LOG: pytest's final count line (or, cut short, the tests passed so far) and the
# first failures.
pytest_outcome() {
  local log=$1 last
  last=$(grep -E "^=+ .*(passed|failed|error|skipped).* in [0-9.]+s" "$log" | tail -1)
  note "  ${last:-cut short: $(grep -c " PASSED" "$log") passed, $(grep -c " FAILED" "$log") failed so far}"
  while IFS= read -r line; do note "  $line"; done < <(grep -E "^(FAILED|ERROR) " "$log" | head -10)
}

# gpu_count: the machine's GPUs.
gpu_count() { nvidia-smi -L 2>/dev/null | grep -c "^GPU"; }

# tree_hash PATH...: a hash of the files under PATH (no .pyc).
tree_hash() {
  find "$@" -type f ! -name '*.pyc' -print0 | sort -z | xargs -0 sha1sum | sha1sum | cut -c1-16
}

# build: installs the package from this tree with the machine's jax, once per machine and source
# state (a hash of the sources; a later step or call on the same machine reuses it). A wheel of
# the same native sources built by an earlier call (brought back from its $OUT/wheel/HASH and
# carried as .device-wheel/HASH/) is installed instead of building, with this tree's Python
# files over it: minutes sooner.
build() {
  local stamp=/tmp/jsm-built hash native carried pkg
  hash=$(tree_hash jax_sdma_moe ffi kernels CMakeLists.txt pyproject.toml)
  native=$(tree_hash ffi kernels CMakeLists.txt pyproject.toml)
  if [[ -f $stamp && $(cat $stamp) == "$hash" ]]; then
    note "build: up to date ($hash)"
    return 0
  fi
  carried=$(ls "$REPO"/.device-wheel/"$native"/*.whl 2>/dev/null | head -1)
  if [[ -n $carried ]]; then
    step build 120 python3 -m pip install --no-deps --no-index --force-reinstall "$carried" ||
      { tail -30 "$OUT/build.log"; summary; exit 1; }
    pkg=$(cd /tmp && python3 -c "import jax_sdma_moe, os; print(os.path.dirname(jax_sdma_moe.__file__))")
    (cd jax_sdma_moe && find . -name '*.py' -exec cp --parents {} "$pkg" \;)
    echo "$hash" > $stamp
    note "build: the carried wheel $carried, this tree's Python files over it"
    return 0
  fi
  # a clean build tree: the device keeps ignored folders (build/) between calls while the copied
  # sources may carry older mtimes than its objects, so an incremental build can keep stale code
  rm -rf "$REPO/build"
  if ! step build 480 python3 -m pip wheel -v --no-build-isolation --no-deps --no-index \
      -w "$OUT/wheel/$native" . ||
     ! python3 -m pip install --no-deps --no-index --force-reinstall "$OUT"/wheel/"$native"/*.whl \
       >> "$OUT/build.log" 2>&1; then
    tail -30 "$OUT/build.log"
    summary
    exit 1
  fi
  echo "$hash" > $stamp
  # registers and spills of the gemm1 kernels (ptxas -v)
  while IFS= read -r line; do note "  $line"; done < <(
      grep -A3 "gemm1" "$OUT/build.log" | grep -E "registers|spill" | sort -u | head -4)
}
