"""ROCm backend. On any machine: stage1 lowered for platform "rocm" under shard_map with every
engine that serves ROCm (no AMD GPU needed: nothing runs). On an AMD GPU (gfx942, gfx950): the
CUDA suites' cases — quantize bytes, route/qpack/pack against the reference, stage1 with engine
local against the reference, engine xla against local, and engine sdma across every GPU against
the reference — skipped without one. JSM_REQUIRE_ROCM=1 (bench/device/rocm_tests.sh) turns a
missing AMD GPU or ROCm build into a failure instead of a skip.
"""
import os
import sys

import _util

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_sdma_moe as jsm
from jax_sdma_moe import primitives, reference, runtime
from test_quantize import special_blocks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import rocm_lower  # noqa: E402


def _amd_gpus():
  try:
    gpus = [d for d in jax.devices("gpu") if runtime.mesh_platform(
        jax.sharding.Mesh(np.array([d]), ("x",))) == "rocm"]
  except RuntimeError:
    gpus = []
  if not gpus:
    return [], "no AMD GPU"
  if "rocm" not in primitives.registered_platforms():
    return [], "jax_sdma_moe was built without the ROCm backend"
  if not primitives.extension().has_rocm_flydsl():
    return [], "jax_sdma_moe's ROCm build has no FlyDSL kernels (GEMM1, sdma puts)"
  return gpus, None


GPUS, WHY = _amd_gpus()
if not GPUS and os.environ.get("JSM_REQUIRE_ROCM") == "1":
  raise RuntimeError(f"JSM_REQUIRE_ROCM=1 but {WHY}")
CPU = jax.devices("cpu")[0]


class RocmLoweringTest(parameterized.TestCase):
  """Lowering only: the programs name the jsm_* targets each engine needs on ROCm."""

  @parameterized.parameters(*[(e, d) for e in rocm_lower.ENGINES for d in ("bf16", "mxfp8")])
  def test_stage1_lowers_for_rocm(self, engine, out_dtype):
    text, targets = rocm_lower.lower_stage1(engine, out_dtype)
    want = rocm_lower.ENGINES[engine][1]
    self.assertLessEqual(want, set(targets), f"lowered targets: {targets}")
    if engine == "sdma":  # the fused call carries engine sdma's id in its `dispatch` attribute
      self.assertIn(f"engine = {primitives.extension().ENGINE_IDS['sdma']}", text)

  @parameterized.parameters(*[(e, d) for e in rocm_lower.ENGINES for d in ("bf16", "mxfp8")])
  def test_moe_lowers_for_rocm(self, engine, out_dtype):
    text, targets = rocm_lower.lower_stage1(engine, out_dtype, layer=True)
    want = rocm_lower.ENGINES[engine][1] | rocm_lower.LAYER_TARGETS
    self.assertLessEqual(want, set(targets), f"lowered targets: {targets}")
    if engine == "sdma":  # the way back carries engine sdma's id too (its window set's combine)
      self.assertGreaterEqual(
          text.count(f"engine = {primitives.extension().ENGINE_IDS['sdma']}"), 2)

  def test_runtime_refuses_to_run_sdma_elsewhere(self):
    with self.assertRaisesRegex(ValueError, "runs on"):
      jsm.Runtime(_util.mesh(), "ep", jsm.Stage1Config(engine="sdma"))


def _stage1(mesh, cfg):
  rt = jsm.Runtime(mesh, "ep", cfg)
  return rt, _util.stage1_fn(mesh, rt, check=True)


@absltest.skipIf(not GPUS, WHY or "")
class RocmGpuTest(parameterized.TestCase):

  @parameterized.parameters(jnp.bfloat16, jnp.float32)
  def test_quantize_bytes(self, dtype):
    r = _util.rng()
    x = np.concatenate([r.standard_normal((64, 512)), special_blocks(r).repeat(16, 0)[:64]], 0)
    got = jax.jit(jsm.quantize)(jax.device_put(jnp.asarray(x, dtype), GPUS[0]))
    want = reference.quantize(jax.device_put(jnp.asarray(x, dtype), CPU))
    np.testing.assert_array_equal(_util.as_bytes(got.values), _util.as_bytes(want.values))
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))

  def test_route_qpack_pack(self):
    r = _util.rng()
    R, E, K, T, H = 4, 32, 4, 777, 1536
    ids = _util.make_ids(r, R, -(-T // R), K, E, "masked")[:T]
    x = jnp.asarray(r.standard_normal((T, H)), jnp.bfloat16)
    w = jnp.asarray(r.random((T, K)), jnp.float32)
    on = lambda a: jax.device_put(a, GPUS[0])  # noqa: E731
    got_r = jax.jit(primitives.route, static_argnums=(1, 2))(on(ids), R, E // R)
    want_r = reference.route(ids, R, E // R)
    for name, a, b in zip(got_r._fields, got_r, want_r):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    used = int(np.asarray(want_r.send_counts).sum())
    want = reference.pack(reference.quantize(x), w, want_r.send_pos)
    for got in (jax.jit(primitives.qpack)(on(x), on(w), got_r.send_pos),
                jax.jit(primitives.pack)(jsm.quantize(on(x)), on(w), got_r.send_pos)):
      for name, a, b in zip(got._fields, got, want):
        a, b = _util.as_bytes(a), _util.as_bytes(b)
        if name not in ("token", "slot", "weight"):
          a, b = a[:used], b[:used]
        np.testing.assert_array_equal(a, b, err_msg=name)

  @parameterized.parameters("bf16", "mxfp8")
  def test_stage1_local_and_xla(self, out_dtype):
    """R = 1: engine local against the reference; engine xla lands the same bytes."""
    r = _util.rng()
    s = jsm.SHAPES["small"]
    T = 200
    x, ids, w, w1q = _util.make_problem(r, 1, T, s.hidden, s.intermediate, s.num_experts, s.topk,
                                        "masked")
    mesh = jax.sharding.Mesh(np.array(GPUS[:1]), ("ep",))
    outs = []
    for engine in ("local", "xla"):
      cfg = jsm.Stage1Config(engine=engine, out_dtype=out_dtype, row_align=64)
      rt, f = _stage1(mesh, cfg)
      outs.append(jax.tree.map(np.asarray, f(*_util.shard(mesh, (x, ids, w, w1q)))))
      rt.close()
    ref, h32 = _util.reference(x, ids, w, w1q, 1, cfg, T)
    _util.check_stage1(self, outs[0], ref, h32, out_dtype)
    for name, a, b in zip(outs[0]._fields, outs[0], outs[1]):
      np.testing.assert_array_equal(_util.as_bytes(a), _util.as_bytes(b), err_msg=name)

  @parameterized.named_parameters(
      ("mid_uniform", _util.MID_LAYER, 256, "uniform", None),
      ("mid_skewed_limit", _util.MID_LAYER, 512, "skewed", 7.0),
      ("small_masked", None, 128, "masked", None))
  def test_moe_local(self, dims, T, routing, limit):
    """R = 1: jsm.moe with engine local (the FlyDSL GEMM1 and GEMM2, the combine within the
    rank) against reference.moe."""
    s = jsm.SHAPES["small"]
    H, I, E, K = dims or (s.hidden, s.intermediate, s.num_experts, s.topk)
    mesh = jax.sharding.Mesh(np.array(GPUS[:1]), ("ep",))
    _util.run_moe_on(self, mesh, "local", T, H, I, E, K, routing, limit)

  @absltest.skipIf(len(GPUS) < 2, "engine sdma needs two AMD GPUs or more")
  def test_stage1_sdma(self):
    """Every GPU of the machine: engine sdma against the reference, back to back (epochs and
    both parity slots)."""
    r = _util.rng()
    s = jsm.SHAPES["small"]
    R, T = len(GPUS), 96
    mesh = jax.sharding.Mesh(np.array(GPUS), ("ep",))
    cfg = jsm.Stage1Config(engine="sdma", timeout_s=20.0)
    rt, f = _stage1(mesh, cfg)
    for routing in ("uniform", "masked", "invalid"):
      x, ids, w, w1q = _util.make_problem(r, R, T, s.hidden, s.intermediate, s.num_experts,
                                          s.topk, routing)
      out = jax.tree.map(np.asarray, f(*_util.shard(mesh, (x, ids, w, w1q))))
      ref, h32 = _util.reference(x, ids, w, w1q, R, cfg, T)
      _util.check_stage1(self, out, ref, h32, "bf16")
    rt.check()
    rt.close()


if __name__ == "__main__":
  absltest.main()
