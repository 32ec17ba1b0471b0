"""Lowers jax_sdma_moe.stage1 and the whole layer (jsm.moe) for platform "rocm" under shard_map
with every engine that serves ROCm (local on one rank; xla and sdma across ranks), from a machine
without an AMD GPU, and returns the custom-call targets of each lowered program.

    python tools/rocm_lower.py [--register]

--register first registers the extension's ROCm FFI targets for platform "ROCM" (an extension
built with the ROCm backend, tools/rocm_build.py) and fails if any stage is missing. The programs
are built with Runtime(lowering_platform="rocm"): no device state, never run. tests/test_rocm.py
runs lower_stage1 too.
"""
from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402

# per engine: the ranks of its mesh and the custom calls its stage1(check=True) must lower to
ENGINES = {
    "local": (1, {"jsm_route", "jsm_qpack", "jsm_dispatch", "jsm_gemm1", "jsm_check_overflow"}),
    "xla": (8, {"jsm_route", "jsm_qpack", "jsm_gemm1", "jsm_check_overflow", "ragged_all_to_all"}),
    "sdma": (8, {"jsm_route", "jsm_qpack", "jsm_dispatch_gemm1_graph", "jsm_check_overflow"}),
}
# and what jsm.moe adds to them (Stage2: GEMM2, the way back and its sum)
LAYER_TARGETS = {"jsm_gemm2", "jsm_combine"}


def lower_stage1(engine: str, out_dtype: str = "bf16", shape: str = "small", tokens: int = 64,
                 layer: bool = False):
  """The StableHLO text of stage1 (layer: of jsm.moe) with `engine` lowered for ROCm, and its
  custom-call targets."""
  R = ENGINES[engine][0]
  s = jsm.SHAPES[shape]
  mesh = jax.make_mesh((R,), ("ep",), devices=jax.devices()[:R])
  cfg = jsm.Stage1Config(engine=engine, out_dtype=out_dtype, swiglu_limit=s.swiglu_limit)
  rt = jsm.Runtime(mesh, "ep", cfg, lowering_platform="rocm")

  def body(x, ids, weights, w_values, w_scales, w2_values, w2_scales):
    w1q = jsm.QuantizedW1(w_values, w_scales)
    if layer:
      return jsm.moe(x, (ids, weights), w1q, jsm.QuantizedW2(w2_values, w2_scales), runtime=rt,
                     check=True)
    out = jsm.stage1(x, (ids, weights), w1q, runtime=rt, check=True)
    return jax.tree.map(lambda a: a[None], out)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  spec = NamedSharding(mesh, P("ep"))
  T, H, I, E, K = tokens, s.hidden, s.intermediate, s.num_experts, s.topk
  args = [jax.ShapeDtypeStruct(shp, dt, sharding=spec) for shp, dt in [
      ((R * T, H), jnp.bfloat16), ((R * T, K), jnp.int32), ((R * T, K), jnp.float32),
      ((E, 2 * I, H), jnp.float8_e4m3fn), ((E, 2 * I, H // 32), jnp.uint8),
      ((E, H, I), jnp.float8_e4m3fn), ((E, H, I // 32), jnp.uint8)]]
  text = f.trace(*args).lower(lowering_platforms=("rocm",)).as_text()
  rt.close()
  return text, sorted(set(re.findall(r"stablehlo\.custom_call @([A-Za-z0-9_]+)", text))
                      | set(re.findall(r'call_target_name = "([A-Za-z0-9_]+)"', text))
                      | ({"ragged_all_to_all"} if "ragged_all_to_all" in text else set()))


def register_rocm_targets():
  """Registers the extension's ROCm handlers for "ROCM"; returns their stage names."""
  from jax_sdma_moe import primitives
  ext = primitives.extension()
  if not ext.has_rocm():
    raise SystemExit("the extension was built without the ROCm backend")
  jax.devices()
  stages = ext.rocm_targets()
  for stage, capsule in stages.items():
    jax.ffi.register_ffi_target(primitives.TARGET_PREFIX + stage, capsule, platform="ROCM")
  return sorted(stages), ext.has_rocm_flydsl()


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--register", action="store_true")
  args = p.parse_args()
  if args.register:
    stages, flydsl = register_rocm_targets()
    print(f"registered for ROCM: {', '.join('jsm_' + s for s in stages)}")
    want = {"quantize", "route", "qpack", "pack", "dispatch", "dispatch_graph", "check_overflow",
            "gemm2", "combine"}
    if flydsl:
      want |= {"gemm1", "dispatch_gemm1", "dispatch_gemm1_graph"}
    missing = want - set(stages)
    if missing:
      raise SystemExit(f"ROCm targets missing: {sorted(missing)}")
    if not flydsl:
      print("not registered (no FlyDSL kernels in this build): jsm_gemm1, jsm_dispatch_gemm1, "
            "jsm_dispatch_gemm1_graph")
  failed = []
  for engine, (R, want) in ENGINES.items():
    for out_dtype in ("bf16", "mxfp8"):
      for layer in (False, True):
        what = "moe" if layer else "stage1"
        _, targets = lower_stage1(engine, out_dtype, layer=layer)
        print(f"{what} for rocm, engine {engine} (R = {R}, h {out_dtype}): {', '.join(targets)}")
        need = want | (LAYER_TARGETS if layer else set())
        if not need <= set(targets):
          failed.append(f"{what} {engine}/{out_dtype}: missing {sorted(need - set(targets))}")
  if failed:
    raise SystemExit("lowering for rocm: " + "; ".join(failed))
  print("lowered stage1 and moe for rocm with engines " + ", ".join(ENGINES))


if __name__ == "__main__":
  main()
