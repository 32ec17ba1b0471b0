#!/usr/bin/env bash
# Engine local on one GPU as the mesh (ep,) and as (dp 1, ep 1): the EP groups' machinery (the
# group index, the other axes' checks) must cost nothing. bench/run.py's Stage1 at dsv3 (gemm1-heavy)
# alternately on the two meshes, ROUNDS rounds each, the JAX-native baselines and peers skipped.
# Usage, from the repository root: bash bench/device/mesh_speed.sh [--timeout S] [ROUNDS [TOKENS]]
#   (default --timeout 120 per run, 2 rounds, 4096 tokens)
# Log: $OUT/mesh-<mesh>-<round>.log each; a line per run (ours, ms) and the table last.
source "$(dirname "$0")/common.sh"
take_options 120 "$@"
ROUNDS=${ARGS[0]:-2}
TOKENS=${ARGS[1]:-4096}
build
cd /tmp  # the installed package, not the checkout's sources
for ((i = 1; i <= ROUNDS; ++i)); do
  for mesh in ep=1 dp=1,ep=1; do
    name=mesh-${mesh//[=,]/}-$i
    step "$name" "$TIMEOUT" python3 "$REPO/bench/run.py" --gpu --devices 1 --mesh "$mesh" \
      --shapes dsv3 --tokens "$TOKENS" --engines local --skip-native einsum,ragged \
      --skip-peers all --iters 30 --out "$OUT" --tag "$name"
    note "  $name: $(grep -E '^dsv3 ' "$OUT/$name.log" | head -3 | tr -s ' ' | tr '\n' '|')"
  done
done
summary
