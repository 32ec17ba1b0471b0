"""jsm.moe and jsm.stage2 (the whole layer) under shard_map on 8 CPU devices against
reference.moe (DESIGN.md §2, §3 "Stage2", §6), and their trace-time errors."""
import time
from unittest import mock

import _util

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm
from jax_sdma_moe._testing import inject_faults

SMALL = jsm.SHAPES["small"]
R = _util.NUM_DEVICES
def run_moe(tc, *, engine="cpu", num_ranks=R, T=16, H=SMALL.hidden, I=SMALL.intermediate,
            E=SMALL.num_experts, K=SMALL.topk, routing="uniform", prequantized=False,
            with_weights=True, faults=None, **cfg_kw):
  r = _util.rng()
  m = _util.mesh(num_ranks)
  cfg = jsm.Stage1Config(engine=engine, timeout_s=30.0, **{"row_align": 16, **cfg_kw})
  x, ids, w, w1q = _util.make_problem(r, num_ranks, max(T, 1), H, I, E, K, routing)
  x, ids, w = (a[:num_ranks * T] for a in (x, ids, w))  # T = 0: an empty batch
  w2q = _util.make_w2q(r, E, H, I)
  if prequantized:
    x = jsm.quantize(x)
  with jsm.Runtime(m, "ep", cfg) as rt:
    if faults:
      inject_faults(rt, **faults)
    y = _util.moe_fn(m, rt, with_weights)(*_util.shard(m, (x, ids, w)), *_util.shard(m, (w1q, w2q)))
  tc.assertEqual((y.shape, y.dtype), ((num_ranks * T, H), jnp.bfloat16))
  ref = _util.reference_y(x, ids, w if with_weights else None, w1q, w2q, num_ranks, cfg, T)
  _util.check_y(tc, y, ref, ids, E)
  return y, (x, ids, w, w1q, w2q)


class MoeTest(parameterized.TestCase):

  @parameterized.product(engine=("cpu", "xla"), routing=("uniform", "masked", "invalid"))
  def test_routing(self, engine, routing):
    run_moe(self, engine=engine, routing=routing)

  @parameterized.parameters("cpu", "xla")
  def test_skewed_every_token_to_one_rank(self, engine):
    # slot 0 of every token is expert 0 and the other slots rank 0's other experts
    run_moe(self, engine=engine, H=128, I=64, E=64, K=4, routing="skewed")

  @parameterized.named_parameters(
      ("K1", dict(K=1)), ("one_expert_per_rank", dict(E=8, K=3)),
      ("swiglu_limit", dict(swiglu_limit=0.75)), ("mxfp8_stage1", dict(out_dtype="mxfp8")),
      ("mxfp8_stage1_limit", dict(out_dtype="mxfp8", swiglu_limit=2.0)),
      ("prequantized_x", dict(prequantized=True)), ("ids_only", dict(with_weights=False)),
      ("T1", dict(T=1)), ("row_align_1", dict(row_align=1)),
      # H % 64 == 32: GEMM2's last panel of output columns is half full
      ("H96_I32", dict(H=96, I=32, routing="masked")))
  def test_variants(self, kw):
    for engine in ("cpu", "xla"):
      with self.subTest(engine):
        run_moe(self, engine=engine, **kw)

  @parameterized.parameters("cpu", "xla")
  def test_empty_batch(self, engine):
    """T = 0 tokens per rank: y is [0, H], nothing fails."""
    y, _ = run_moe(self, engine=engine, T=0, H=64, I=32, K=2)
    self.assertEqual(y.shape, (0, 64))

  def test_engines_byte_identical(self):
    """cpu and xla on 8 ranks, and cpu, local and xla on one rank, give the same y bytes."""
    r = _util.rng()
    for num_ranks, engines in ((R, ("cpu", "xla")), (1, ("cpu", "local", "xla"))):
      m = _util.mesh(num_ranks)
      x, ids, w, w1q = _util.make_problem(r, num_ranks, 24, SMALL.hidden, SMALL.intermediate,
                                          SMALL.num_experts, SMALL.topk, "masked")
      args = (*_util.shard(m, (x, ids, w)), *_util.shard(
          m, (w1q, _util.make_w2q(r, SMALL.num_experts, SMALL.hidden, SMALL.intermediate))))
      for out_dtype in ("bf16", "mxfp8"):
        ys = {}
        for engine in engines:
          cfg = jsm.Stage1Config(engine=engine, out_dtype=out_dtype, row_align=32)
          with jsm.Runtime(m, "ep", cfg) as rt:
            ys[engine] = _util.as_bytes(_util.moe_fn(m, rt)(*args))
        for engine in engines[1:]:
          np.testing.assert_array_equal(ys[engine], ys[engines[0]], err_msg=(
              f"R = {num_ranks}, {out_dtype}: {engine} vs {engines[0]}"))

  @parameterized.parameters("cpu", "xla")
  def test_overflow_dropped_rows_add_nothing(self, engine):
    """Rows past M_cap add nothing to y and stay counted in overflow; stage2 from stage1's
    output is the layer."""
    r = _util.rng()
    m = _util.mesh(R)
    T, H, I, E, K = 16, 64, 32, 64, 4
    x, ids, w, w1q = _util.make_problem(r, R, T, H, I, E, K, "skewed")
    w2q = _util.make_w2q(r, E, H, I)
    cfg = jsm.Stage1Config(engine=engine, row_align=8, max_recv_rows=100)
    with jsm.Runtime(m, "ep", cfg) as rt:
      def body(x, ids, w, w1q, w2q):
        out1 = jsm.stage1(x, (ids, w), w1q, runtime=rt)
        return out1.overflow[None], jsm.stage2(out1, w2q, runtime=rt)
      f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
      overflow, y = f(*_util.shard(m, (x, ids, w, w1q, w2q)))
    self.assertEqual(int(np.asarray(overflow)[0]), R * T * K - 100)
    _util.check_y(self, y, _util.reference_y(x, ids, w, w1q, w2q, R, cfg, T), ids, E)

  @parameterized.parameters("cpu", "xla")
  def test_check_fails_fast_on_overflow(self, engine):
    """moe(check=True) with rows past M_cap on one rank: the call fails naming the overflow, not
    after a peer's timeout in the combine."""
    r = _util.rng()
    m = _util.mesh(R)
    T, H, I, E, K = 16, 64, 32, 64, 4
    x, ids, w, w1q = _util.make_problem(r, R, T, H, I, E, K, "skewed")  # only rank 0 overflows
    cfg = jsm.Stage1Config(engine=engine, row_align=8, max_recv_rows=100, timeout_s=60.0)
    with jsm.Runtime(m, "ep", cfg) as rt:
      f = _util.moe_fn(m, rt, check=True)
      t0 = time.monotonic()
      with self.assertRaisesRegex(Exception, "did not fit their rank.s M_cap = 100"):
        jax.block_until_ready(f(*_util.shard(m, (x, ids, w, w1q, _util.make_w2q(r, E, H, I)))))
      self.assertLess(time.monotonic() - t0, 30.0, "the check waited for a peer's timeout")

  def test_back_to_back_calls_and_two_layers(self):
    """20 calls on one Runtime with fresh inputs (the combine's epochs and parity slots), then two
    layers in one jit, the second fed by the first."""
    r = _util.rng()
    m = _util.mesh(R)
    T, H, I, E, K = 8, 64, 32, 16, 2
    cfg = jsm.Stage1Config(engine="cpu", row_align=8)
    w1q = jsm.quantize_w1(jnp.asarray(r.standard_normal((E, 2 * I, H)) * 0.1, jnp.bfloat16))
    w2q = _util.make_w2q(r, E, H, I, 0.1)
    weights_on_mesh = _util.shard(m, (w1q, w2q))
    with jsm.Runtime(m, "ep", cfg) as rt:
      f = _util.moe_fn(m, rt)
      for i in range(20):
        x = jnp.asarray(r.standard_normal((R * T, H)), jnp.bfloat16)
        ids = _util.make_ids(r, R, T, K, E, ("uniform", "masked")[i % 2])
        w = jnp.asarray(r.random((R * T, K)), jnp.float32)
        y = f(*_util.shard(m, (x, ids, w)), *weights_on_mesh)
        _util.check_y(self, y, _util.reference_y(x, ids, w, w1q, w2q, R, cfg, T), ids, E)

      def two_layers(x, ids, w, w1q, w2q):
        y1 = jsm.moe(x, (ids, w), w1q, w2q, runtime=rt)
        return y1, jsm.moe(x + y1, (ids, w), w1q, w2q, runtime=rt)
      g = jax.jit(jax.shard_map(two_layers, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
      y1, y2 = g(*_util.shard(m, (x, ids, w)), *weights_on_mesh)
    _util.check_y(self, y1, _util.reference_y(x, ids, w, w1q, w2q, R, cfg, T), ids, E)
    x2 = jnp.asarray(np.asarray(x)) + jnp.asarray(np.asarray(y1))
    _util.check_y(self, y2, _util.reference_y(x2, ids, w, w1q, w2q, R, cfg, T), ids, E)

  def test_delayed_rank(self):
    """One rank starts each exchange 300 ms late: the others wait for it; the result is exact."""
    run_moe(self, engine="cpu", faults=dict(delay_rank=5, delay_ms=300))

  def test_absent_peer_times_out_in_the_combine(self):
    """A rank that never takes part in the combine: its peers' bounded waits run out, naming it."""
    r = _util.rng()
    m = _util.mesh(R)
    T, H, I, E, K = 4, 64, 32, 16, 2
    x, ids, w, w1q = _util.make_problem(r, R, T, H, I, E, K)
    w2q = _util.make_w2q(r, E, H, I)
    with jsm.Runtime(m, "ep", jsm.Stage1Config(engine="cpu")) as rt1, \
        jsm.Runtime(m, "ep", jsm.Stage1Config(engine="cpu", timeout_s=0.5)) as rt2:
      inject_faults(rt2, absent_rank=3)
      def body(x, ids, w, w1q, w2q):
        return jsm.stage2(jsm.stage1(x, (ids, w), w1q, runtime=rt1), w2q, runtime=rt2)
      f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
      with self.assertRaisesRegex(Exception, r"combine \(cpu engine\).*timed out after 0\.5.* "
                                  r"from peer rank 3"):
        jax.block_until_ready(f(*_util.shard(m, (x, ids, w, w1q, w2q))))

  def test_quantize_w2_and_shard_w2(self):
    r = _util.rng()
    w2 = jnp.asarray(r.standard_normal((16, 64, 96)), jnp.bfloat16)
    q = jsm.quantize_w2(w2)
    self.assertIsInstance(q, jsm.QuantizedW2)
    self.assertEqual((q.values.shape, q.scales.shape), ((16, 64, 96), (16, 64, 3)))
    ref = jsm.quantize_w2(w2, impl="reference")
    for a, b in zip(q, ref):
      np.testing.assert_array_equal(_util.as_bytes(a), _util.as_bytes(b))
    with jsm.Runtime(_util.mesh(R), "ep", jsm.Stage1Config(engine="cpu")) as rt:
      placed = rt.shard_w2(q)
      self.assertEqual(placed.values.sharding.spec, P("ep"))
      with self.assertRaisesRegex(ValueError, "shard_w2: E = 12 experts is not a multiple"):
        rt.shard_w2(jax.tree.map(lambda a: a[:12], q))


class Stage2ErrorsTest(parameterized.TestCase):
  """Bad input to stage2 / moe raises a clear Python error at trace time (DESIGN.md §2)."""
  T, H, I, E, K = 4, 64, 32, 16, 2

  @classmethod
  def setUpClass(cls):
    r = _util.rng()
    cls.mesh = _util.mesh(R)
    cls.rt = jsm.Runtime(cls.mesh, "ep", jsm.Stage1Config(engine="cpu"))
    cls.x, cls.ids, cls.w, cls.w1q = _util.make_problem(r, R, cls.T, cls.H, cls.I, cls.E, cls.K)
    cls.w2q = _util.make_w2q(r, cls.E, cls.H, cls.I)

  @classmethod
  def tearDownClass(cls):
    cls.rt.close()

  def trace_moe(self, w2q=None, mesh=None, rt=None, **kw):
    mesh = mesh or self.mesh
    w2q = self.w2q if w2q is None else w2q
    body = lambda x, ids, w, w1q, w2q: jsm.moe(x, (ids, w), w1q, w2q, runtime=rt or self.rt,
                                               **kw)
    f = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    return jax.eval_shape(f, *_util.shard(mesh, (self.x, self.ids, self.w, self.w1q, w2q)))

  def test_valid_call_traces(self):
    self.assertEqual(self.trace_moe().shape, (R * self.T, self.H))

  def test_bad_w2(self):
    v, s = self.w2q
    bad = {
        "not_quantized": (v.astype(jnp.bfloat16), TypeError, "QuantizedW2"),
        "w1_for_w2": (self.w1q, TypeError, "QuantizedW2"),
        "bf16_values": (jsm.QuantizedW2(v.astype(jnp.bfloat16), s), TypeError, "float8_e4m3fn"),
        "H_mismatch": (jsm.QuantizedW2(v[:, :32], s[:, :32]), ValueError, r"H=64, I=32\]"),
        "I_mismatch": (jsm.QuantizedW2(jnp.concatenate([v, v], -1), jnp.concatenate([s, s], -1)),
                       ValueError, "I=32"),
        "scales_shape": (jsm.QuantizedW2(v, s[..., :0]), ValueError, "scales"),
    }
    for name, (w2q, exc, pattern) in bad.items():
      with self.subTest(name), self.assertRaisesRegex(exc, pattern):
        self.trace_moe(w2q=w2q)
    with self.assertRaisesRegex(ValueError, r"quantize_w2: w2 must be \[E, H, I\]"):
      jsm.quantize_w2(jnp.zeros((64, 32), jnp.bfloat16))

  def test_bad_stage1_output(self):
    def trace_stage2(make_out1):
      def body(x, ids, w, w1q, w2q):
        return jsm.stage2(make_out1(jsm.stage1(x, (ids, w), w1q, runtime=self.rt)), w2q,
                          runtime=self.rt)
      f = jax.shard_map(body, mesh=self.mesh, in_specs=P("ep"), out_specs=P("ep"))
      return jax.eval_shape(f, *_util.shard(self.mesh, (self.x, self.ids, self.w, self.w1q,
                                                        self.w2q)))
    with self.assertRaisesRegex(TypeError, "Stage1Output"):
      trace_stage2(lambda out1: tuple(out1))
    with self.assertRaisesRegex(ValueError, "send_pos"):
      trace_stage2(lambda out1: out1._replace(send_pos=None))
    with self.assertRaisesRegex(ValueError, "bf16"):
      trace_stage2(lambda out1: out1._replace(h=out1.h.astype(jnp.float32)))
    with self.assertRaisesRegex(ValueError, "M_cap"):
      trace_stage2(lambda out1: out1._replace(src_rank=out1.src_rank[:3]))

  def test_runtime_and_axis(self):
    with self.assertRaisesRegex(TypeError, "Runtime"):
      self.trace_moe(rt="rt")
    with self.assertRaisesRegex(ValueError, "inside jax.shard_map"):
      jax.eval_shape(lambda: jsm.stage2(jsm.Stage1Output(
          jnp.zeros((8, self.I), jnp.bfloat16), *[jnp.zeros(2, jnp.int32)] * 2,
          *[jnp.zeros(8, jnp.int32)] * 3, jnp.zeros(8, jnp.float32), *[jnp.int32(0)] * 3,
          jnp.zeros((self.T, self.K), jnp.int32)), jax.tree.map(lambda a: a[:2], self.w2q),
          runtime=self.rt))

  def test_gpu_engines_combine(self):
    """Engines sm, ce and xla have a combine on CUDA: the layer traces for CUDA with each, and
    (engine xla) lowers, each CUDA GEMM and the combine with their workspace results (DESIGN §5).
    A Runtime that only lowers for CUDA needs no CUDA kernels in this build (the program never runs
    here), so this holds whether or not nvcc built them."""
    for engine in ("sm", "ce", "xla"):
      with self.subTest(engine), jsm.Runtime(self.mesh, "ep", jsm.Stage1Config(engine=engine),
                                             lowering_platform="cuda") as rt:
        self.assertEqual(self.trace_moe(rt=rt).shape, (R * self.T, self.H))
    with jsm.Runtime(self.mesh, "ep", jsm.Stage1Config(engine="xla"),
                     lowering_platform="cuda") as rt:
      body = lambda x, ids, w, w1q, w2q: jsm.moe(x, (ids, w), w1q, w2q, runtime=rt)
      f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P("ep"), out_specs=P("ep")))
      args = _util.shard(self.mesh, (self.x, self.ids, self.w, self.w1q, self.w2q))
      text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # results per call: gemm1 h + 2, gemm2 y2 + 2, combine y + 1 (the primitives return 1)
    for target, results in (("jsm_gemm1", 3), ("jsm_gemm2", 3), ("jsm_combine", 2)):
      self.assertRegex(text, rf"%\w+:{results} = stablehlo.custom_call @{target}\(", target)
    combine = next(line for line in text.splitlines() if "@jsm_combine(" in line)
    self.assertIn(f"tensor<{self.T * self.ids.shape[1]}xi32>", combine.split("->")[-1])

  def test_stage2_kernels_missing(self):
    """Where a Runtime runs its program and this build lacks the gemm2 / combine handlers of its
    platform (a GPU build from before Stage2, or one whose toolchain skipped them), the layer fails
    at trace time naming what is missing; stands in for such a build by its handler list."""
    with mock.patch.object(jsm.primitives, "built_stages", return_value=frozenset({"gemm1"})):
      with self.assertRaisesRegex(NotImplementedError,
                                  r"no cpu kernels for combine, gemm2 \(issue 16"):
        self.trace_moe()

if __name__ == "__main__":
  absltest.main()
