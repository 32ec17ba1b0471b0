#!/usr/bin/env bash
# A/B of kernel variants in one device call: each VARIANT is `base` (the tree as it is) or patch
# files joined by `+` (paths from the repository root, applied in order with `git apply`); for
# each, a build of the patched sources (one clean build first, then only what the patches and the
# variant before changed: their files are touched, since the restored copies keep older mtimes
# than the objects), then gemm1 alone on the GEMM1 study's rows
# (bench/run.py --gemm1-rows, peers skipped), and the sources restored. A variant's results are
# timing only until its tests pass (tests_cuda.sh on the patched tree).
# Usage, from the repository root:
#   bash bench/device/ab_gemm1.sh [--timeout S] [--rows ROWS] [--shapes S] [--FLAG VALUE...]
#                                 VARIANT...   (--FLAG VALUE: more bench/run.py flags)
#   e.g. bash bench/device/ab_gemm1.sh base scratch/prefetch.patch scratch/a.patch+scratch/b.patch
# (default --timeout 150 per variant, --rows 128x2,32768, --shapes dsv3). Logs: $OUT/ab-<n>-*.log
# (ab2-<n>-*.log, ... for a second run in the same device call);
# the last lines: one `gemm1 alone` row per variant and rows entry.
# --unchecked: time with bench/gemm1_profile.py --time 10 instead (pipelined ms; R = 1 rows of
# --rows over 128 experts, one TIMING line per variant and rows entry; the --FLAG VALUE pairs go
# to it, e.g. --sustain 3 for a SUSTAINED line, the steady state at the power cap), whose output
# is NOT checked: for diagnostic variants that compute wrong results on purpose (bench/run.py
# stops at its check).
# --tokens T1,T2: Stage1 at R = 1 (engine local, random routing: the experts' tails; every path
# checked) at those tokens instead of gemm1 alone, beside the JAX capacity path; one Stage1 row
# per variant and tokens entry.
source "$(dirname "$0")/common.sh"
ROWS=128x2,32768
SHAPES=dsv3
TIMEOUT=150
UNCHECKED=0
TOKENS=
VARIANTS=()
ARGS=()
while (($#)); do
  case $1 in
    --timeout) TIMEOUT=$2; shift 2 ;;
    --rows) ROWS=$2; shift 2 ;;
    --shapes) SHAPES=$2; shift 2 ;;
    --unchecked) UNCHECKED=1; shift ;;
    --tokens) TOKENS=$2; shift 2 ;;
    --*) ARGS+=("$1" "$2"); shift 2 ;;  # more bench/run.py flags (with a value)
    *) VARIANTS+=("$1"); shift ;;
  esac
done
((${#VARIANTS[@]})) || { echo "ab_gemm1.sh: name at least one VARIANT (base, or patches)" >&2; exit 2; }

# a variant that hangs (no output for 60 s: bench/run.py prints progress every ~10 s, the
# unchecked timing one line per ~20 s) is stopped there, not at --timeout
GUARD=("bash" "$REPO/bench/device/idle_guard.sh" 60)
# this run's logs: $OUT/ab-<n>-*, or ab2-<n>-*, ... after an earlier run of the same device call
RUN=ab
for ((k = 2; ; k++)); do compgen -G "$OUT/$RUN-1-*" > /dev/null || break; RUN=ab$k; done
pristine=$(mktemp -d)
# what a variant's patches may change (tests too: a patch that brings its test must apply again
# in a second run of the same device call)
SOURCES=(kernels ffi jax_sdma_moe tests)
cp -a "${SOURCES[@]}" "$pristine"/
restore() { rm -rf "${SOURCES[@]}" && for d in "${SOURCES[@]}"; do cp -a "$pristine/$d" .; done; }
TABLE=()
n=0
rm -rf build  # one clean build (see common.sh build), then incremental ones
touched=()    # the files the variant before patched: restored now, rebuilt too
for variant in "${VARIANTS[@]}"; do
  n=$((n + 1))
  restore
  ok=1
  patched=()
  if [[ $variant != base ]]; then
    IFS=+ read -ra patches <<< "$variant"
    for p in "${patches[@]}"; do
      mapfile -t -O "${#patched[@]}" patched < <(git apply --numstat "$p" | cut -f3)
      git apply "$p" > "$OUT/$RUN-$n-apply.log" 2>&1 || { ok=0; note "$variant: $p does not apply"; }
    done
  fi
  ((${#touched[@]} + ${#patched[@]})) && touch "${touched[@]}" "${patched[@]}"
  touched=("${patched[@]}")
  if ((ok)); then
    if step "$RUN-$n-build" 480 python3 -m pip install -v --no-build-isolation --no-deps \
         --no-index .; then
      cd /tmp  # the installed package, not the checkout's sources
      if [[ -n $TOKENS ]]; then
        step "$RUN-$n-time" "$TIMEOUT" "${GUARD[@]}" "$OUT/$RUN-$n-time.log" \
          python3 "$REPO/bench/run.py" --gpu --devices 1 --tokens "$TOKENS" --shapes "$SHAPES" \
          --skip-peers all --skip-native ragged --iters 10 --warmup 2 --out "$OUT/$RUN-$n" \
          "${ARGS[@]}"
      elif ((UNCHECKED)); then
        step "$RUN-$n-time" "$TIMEOUT" "${GUARD[@]}" "$OUT/$RUN-$n-time.log" \
          bash -c 'for s in ${1//,/ }; do for r in ${2//,/ }; do
            python3 "$3/bench/gemm1_profile.py" "$s" --rows "$r" --experts 128 --time 10 \
              "${@:4}" || exit
          done; done' _ "$SHAPES" "$ROWS" "$REPO" "${ARGS[@]}"
      else
        step "$RUN-$n-time" "$TIMEOUT" "${GUARD[@]}" "$OUT/$RUN-$n-time.log" \
          python3 "$REPO/bench/run.py" --gpu --devices 1 \
          --gemm1-rows "$ROWS" --experts 128 --shapes "$SHAPES" --skip-peers all --iters 10 \
          --warmup 2 --out "$OUT/$RUN-$n" "${ARGS[@]}"
      fi
      cd "$REPO"
    fi
    while IFS= read -r line; do TABLE+=("$(printf '%-40s %s' "$variant" "$line")"); done < <(
        grep -E "gemm1 alone|^TIMING|^SUSTAINED|engine:local " "$OUT/$RUN-$n-time.log")
  fi
done
restore
rm -f /tmp/jsm-built  # the installed package is the last variant's: later scripts rebuild
summary
printf '%-40s %s\n' variant "$(grep -m1 "^shape " "$OUT/$RUN-1-time.log" 2>/dev/null)"
printf '%s\n' "${TABLE[@]}"
