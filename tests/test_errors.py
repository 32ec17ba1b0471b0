"""Bad input raises a clear Python error at trace time (DESIGN.md §2)."""
import _util

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm
from jax_sdma_moe._testing import inject_faults

R, T, H, I, E, K = 8, 4, 64, 32, 16, 2


class ErrorsTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    r = _util.rng()
    cls.mesh = _util.mesh(R)
    cls.rt = jsm.Runtime(cls.mesh, "ep", jsm.Stage1Config(engine="cpu"))
    cls.x, cls.ids, cls.w, cls.w1q = _util.make_problem(r, R, T, H, I, E, K)

  @classmethod
  def tearDownClass(cls):
    cls.rt.close()

  def trace(self, body, *args):
    f = jax.shard_map(body, mesh=self.mesh, in_specs=P("ep"), out_specs=P("ep"))
    return jax.eval_shape(f, *_util.shard(self.mesh, args))  # tracing is enough: errors must come before any run

  def stage1_with(self, x=None, topk=None, w1q=None, **kw):
    x = self.x if x is None else x
    topk = (self.ids, self.w) if topk is None else topk
    w1q = self.w1q if w1q is None else w1q
    kw.setdefault("runtime", self.rt)
    body = lambda x, topk, w1q: jax.tree.map(lambda a: a[None], jsm.stage1(x, topk, w1q, **kw))
    return self.trace(body, x, topk, w1q)

  def test_valid_call_traces(self):
    out = self.stage1_with()
    self.assertEqual(out.h.shape[-1], I)

  @parameterized.named_parameters(
      ("x_float32", dict(x=jnp.zeros((R * T, H), jnp.float32)), TypeError, "bfloat16"),
      ("x_rank3", dict(x=jnp.zeros((R, T, H), jnp.bfloat16)), ValueError, r"\[T, H\]"),
      ("H_not_32", dict(x=jnp.zeros((R * T, 48), jnp.bfloat16)), ValueError, "multiple of 32"),
      ("ids_float", dict(topk=jnp.zeros((R * T, K), jnp.float32)), TypeError, "ids must be an integer array"),
      ("ids_wrong_T", dict(topk=jnp.zeros((R * T * 2, K), jnp.int32)), ValueError, "ids must be"),
      ("weights_shape", dict(topk=(jnp.zeros((R * T, K), jnp.int32), jnp.zeros((R * T, K + 1)))),
       ValueError, "weights must be"),
      ("topk_triple", dict(topk=(jnp.zeros((R * T, K), jnp.int32),) * 3), ValueError, "topk must be"),
  )
  def test_bad_tokens(self, kw, exc, pattern):
    with self.assertRaisesRegex(exc, pattern):
      self.stage1_with(**kw)

  def test_bad_weights(self):
    v, s = self.w1q
    bad = {
        "not_quantized": (jnp.zeros((E, 2 * I, H), jnp.bfloat16), TypeError, "QuantizedW1"),
        "bf16_values": (jsm.QuantizedW1(v.astype(jnp.bfloat16), s), TypeError, "float8_e4m3fn"),
        "H_mismatch": (jsm.QuantizedW1(v[..., :32], s[..., :1]), ValueError, "H=64"),
        "scales_shape": (jsm.QuantizedW1(v, s[:, :, :1]), ValueError, "scales must be"),
        "odd_2I": (jsm.QuantizedW1(v[:, :33], s[:, :33]), ValueError, r"\[E/R, 2I, H"),
        "I_not_32": (jsm.QuantizedW1(v[:, :48], s[:, :48]), ValueError, "I = 24"),
    }
    for name, (w1q, exc, pattern) in bad.items():
      with self.subTest(name), self.assertRaisesRegex(exc, pattern):
        self.stage1_with(w1q=w1q)

  def test_missing_or_wrong_runtime(self):
    with self.assertRaisesRegex(TypeError, "Runtime"):
      self.stage1_with(runtime=None)
    other = jsm.Runtime(_util.mesh(4), "ep", jsm.Stage1Config(engine="cpu"))
    with self.assertRaisesRegex(ValueError, "has 8 ranks but the Runtime has 4"):
      self.stage1_with(runtime=other)
    other.close()

  def test_outside_shard_map(self):
    with self.assertRaisesRegex(ValueError, "inside jax.shard_map"):
      jax.eval_shape(lambda: jsm.stage1(self.x[:T], self.ids[:T], jax.tree.map(
          lambda a: a[:2], self.w1q), runtime=self.rt))

  def test_bad_runtime_and_config(self):
    with self.assertRaisesRegex(ValueError, "not in the mesh"):
      jsm.Runtime(self.mesh, "tp")
    with self.assertRaisesRegex(TypeError, "Mesh"):
      jsm.Runtime("mesh")
    with self.assertRaisesRegex(ValueError, "runs on"):
      jsm.Runtime(self.mesh, "ep", jsm.Stage1Config(engine="ce"))  # a CUDA engine on CPU
    with self.assertRaisesRegex(ValueError, "runs on"):
      jsm.Runtime(self.mesh, "ep", jsm.Stage1Config(engine="sdma"))
    with jsm.Runtime(self.mesh, "ep") as rt, self.assertRaisesRegex(ValueError, "absent_rank"):
      inject_faults(rt, absent_rank=8)  # the test-only hook checks its rank too
    for kw, pattern in [({"engine": "nccl"}, "engine"), ({"row_align": 0}, "row_align"),
                        ({"max_recv_rows": 0}, "max_recv_rows"), ({"out_dtype": "fp4"}, "out_dtype"),
                        ({"swiglu_limit": -1.0}, "swiglu_limit"), ({"timeout_s": 0}, "timeout_s"),
                        ({"gemm_tile_tokens": 64}, "gemm_tile_tokens"),
                        ({"sm_dispatch_blocks": 0}, "sm_dispatch_blocks"),
                        ({"ce_place_blocks": 2.5}, "ce_place_blocks"),
                        ({"ce_place_blocks": 1025}, "ce_place_blocks")]:
      with self.subTest(str(kw)), self.assertRaisesRegex(ValueError, pattern):
        jsm.Stage1Config(**kw)

  def test_gemm_tile_choice(self):
    """The CUDA GEMM's tile: the small one up to its width in rows per expert, else the large;
    an explicit choice wins; anything else is refused."""
    large, small = jsm.layout.GEMM_TILE_TOKENS
    self.assertEqual(jsm.layout.gemm_tile_tokens(small), small)
    self.assertEqual(jsm.layout.gemm_tile_tokens(small + 0.5), large)
    self.assertEqual(jsm.layout.gemm_tile_tokens(1000, small), small)
    self.assertEqual(jsm.layout.gemm_tile_tokens(1, large), large)
    with self.assertRaisesRegex(ValueError, "gemm_tile_tokens"):
      jsm.layout.gemm_tile_tokens(16, 16)

  def test_E_not_multiple_of_R(self):
    w1q = jsm.QuantizedW1(self.w1q.values[:E - 3], self.w1q.scales[:E - 3])
    with self.assertRaisesRegex(ValueError, "not a multiple"):
      self.rt.shard_w1(w1q)
    with self.assertRaisesRegex(ValueError, "not a multiple"):
      jsm.reference.stage1(self.x.reshape(R, T, H), self.ids.reshape(R, T, K), None, w1q,
                           row_align=8, cap=64)

  def test_capacity_beyond_device_memory(self):
    """A landing capacity the device cannot hold is refused at trace time, naming the knob."""
    rows = int(jsm.runtime.device_memory_bytes(jax.devices()[0]) // H) + 1
    with jsm.Runtime(self.mesh, "ep", jsm.Stage1Config(engine="cpu", max_recv_rows=rows)) as rt:
      with self.assertRaisesRegex(ValueError, r"GiB per rank.*lower Stage1Config\.max_recv_rows"):
        self.stage1_with(runtime=rt)

  def test_closed_runtime(self):
    rt = jsm.Runtime(self.mesh, "ep", jsm.Stage1Config(engine="cpu"))
    rt.close()
    with self.assertRaisesRegex(ValueError, "closed"):
      self.stage1_with(runtime=rt)

  def test_shard_w1_places_experts(self):
    placed = self.rt.shard_w1(self.w1q)
    self.assertEqual(placed.values.sharding.spec, P("ep"))
    np.testing.assert_array_equal(_util.as_bytes(placed.values), _util.as_bytes(self.w1q.values))


if __name__ == "__main__":
  absltest.main()
