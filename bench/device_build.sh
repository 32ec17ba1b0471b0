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
