"""Each custom call of DESIGN.md §5 alone against its jnp reference."""
import _util

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm
from jax_sdma_moe import api, primitives, reference
from jax_sdma_moe.types import Landed, SendBuffer


def assert_tree_equal(a, b):
  for name, x, y in zip(a._fields, a, b):
    np.testing.assert_array_equal(_util.as_bytes(x), _util.as_bytes(y), err_msg=name)


class LocalStagesTest(parameterized.TestCase):

  @parameterized.parameters(("uniform", 8, 16, 4), ("masked", 2, 8, 1), ("invalid", 4, 32, 6),
                            ("uniform", 1, 8, 3))
  def test_route(self, routing, R, E, K):
    r = _util.rng()
    ids = _util.make_ids(r, R, 37, K, E, routing)  # [R*37, K], one rank's ids
    got = jax.jit(primitives.route, static_argnums=(1, 2))(ids, R, E // R)
    want = reference.route(ids, R, E // R)
    assert_tree_equal(got, want)
    self.assertEqual(int(got.num_invalid), int(np.sum(np.asarray(ids) >= E)))
    self.assertEqual(int(got.send_counts.sum()), int(np.sum((np.asarray(ids) >= 0) & (np.asarray(ids) < E))))

  @parameterized.parameters("uniform", "masked", "invalid")
  def test_qpack_and_pack(self, routing):
    r = _util.rng()
    T, K, H, R, E = 53, 4, 192, 4, 16
    x = jnp.asarray(r.standard_normal((T, H)) * 3, jnp.bfloat16)
    x = x.at[5, 7].set(jnp.nan)  # a non-finite block travels as MX NaN
    ids = _util.make_ids(r, R, T // R + 1, K, E, routing)[:T]
    w = jnp.asarray(r.random((T, K)), jnp.float32)
    rt = reference.route(ids, R, E // R)
    want = reference.pack(reference.quantize(x), w, rt.send_pos)
    got = jax.jit(primitives.qpack)(x, w, rt.send_pos)
    assert_tree_equal(got, want)
    got = jax.jit(primitives.pack)(jsm.quantize(x), w, rt.send_pos)
    assert_tree_equal(got, want)

  def test_qpack_any_send_pos(self):
    """send_pos need not be route's: gaps between used rows, positions past S (stored nowhere)."""
    r = _util.rng()
    T, K, H = 301, 4, 64
    send_pos, used = _util.scattered_send_pos(r, T, K)
    x = jnp.asarray(r.standard_normal((T, H)), jnp.bfloat16)
    w = jnp.asarray(r.random((T, K)), jnp.float32)
    want = reference.pack(reference.quantize(x), w, send_pos)
    _util.assert_send_buffers_equal(jax.jit(primitives.qpack)(x, w, send_pos), want, used)

  @parameterized.parameters("uniform", "masked")
  def test_token_rows(self, routing):
    """qpack / pack with token_rows (engine local's fused call on CUDA): one row per token, the
    token's quantised row where it has a route (zeros elsewhere on CPU), the headers as with send
    rows; dispatch refuses such a buffer."""
    r = _util.rng()
    T, K, H, R, E = 53, 4, 192, 1, 16
    x = jnp.asarray(r.standard_normal((T, H)) * 3, jnp.bfloat16)
    ids = jnp.asarray(_util.make_ids(r, R, T, K, E, routing)).at[::7].set(-1)  # some: no route
    w = jnp.asarray(r.random((T, K)), jnp.float32)
    rt = reference.route(ids, R, E // R)
    rows = reference.pack(reference.quantize(x), w, rt.send_pos)
    q = reference.quantize(x)
    routed = (np.asarray(rt.send_pos) >= 0).any(1)
    qpack = jax.jit(primitives.qpack, static_argnames="token_rows")
    pack = jax.jit(primitives.pack, static_argnames="token_rows")
    for got in (qpack(x, w, rt.send_pos, token_rows=True),
                pack(jsm.quantize(x), w, rt.send_pos, token_rows=True)):
      self.assertEqual(got.values.shape, (T, H))
      for name in ("values", "scales"):
        want = np.where(routed[:, None], _util.as_bytes(getattr(q, name)), 0)
        np.testing.assert_array_equal(_util.as_bytes(getattr(got, name)), want, err_msg=name)
      for name in ("token", "slot", "weight"):
        np.testing.assert_array_equal(getattr(got, name), getattr(rows, name), err_msg=name)
    send = qpack(x, w, rt.send_pos, token_rows=True)
    options = primitives.DispatchOptions(engine="local", window_set=0, row_align=16,
                                         timeout_s=5.0)
    with self.assertRaisesRegex(Exception, "one per send row"):
      jax.jit(lambda s, c: primitives.dispatch(s, c, jnp.int32(0), cap=T * K, options=options))(
          send, rt.send_counts).values.block_until_ready()

  def random_landed(self, r, EL, H, row_align, cap_extra=40, empty=(1,)):
    counts = r.integers(1, 70, EL)
    counts[list(empty)] = 0
    lay = jsm.layout.landing_layout(jnp.asarray(counts), row_align, 10**9)
    cap = int(lay.unclipped[-1] + counts[-1]) + cap_extra
    a = reference.quantize(jnp.asarray(r.standard_normal((cap, H)) * 2, jnp.float32))
    rows = np.arange(cap)
    member = ((rows[None] >= np.asarray(lay.offsets)[:, None]) &
              (rows[None] < np.asarray(lay.offsets + lay.counts)[:, None])).any(0)
    values = jnp.where(member[:, None], a.values, jnp.zeros_like(a.values))
    scales = jnp.where(member[:, None], a.scales, 0)
    return values, scales, lay.offsets, lay.counts

  @parameterized.product(out_dtype=("bf16", "mxfp8"), limit=(None, 1.5))
  def test_gemm1(self, out_dtype, limit):
    r = _util.rng()
    EL, H, I = 5, 160, 96
    values, scales, offs, cnts = self.random_landed(r, EL, H, row_align=16)
    w1 = jsm.quantize_w1(jnp.asarray(r.standard_normal((EL, 2 * I, H)) * 0.1, jnp.bfloat16))
    got = jax.jit(lambda *a: primitives.gemm1(*a, options=primitives.Gemm1Options(limit, out_dtype)))(
        values, scales, offs, cnts, w1)
    h32 = reference.gemm1_f32(values, scales, offs, cnts, w1, limit)
    if limit is not None:
      self.assertGreater(np.abs(np.asarray(h32)).max(), 0.5, "the limit must matter in this test")
    _util.check_h(self, jax.tree.map(lambda a: a[None], got), offs[None], cnts[None], h32[None],
                  out_dtype)

  def test_gemm1_nan_row_stays_in_its_row(self):
    r = _util.rng()
    EL, H, I = 2, 64, 32
    values, scales, offs, cnts = self.random_landed(r, EL, H, row_align=8, empty=())
    bad = int(offs[1])
    values = values.at[bad, 3].set(jnp.nan)
    scales = scales.at[bad, 0].set(0xFF)
    w1 = jsm.quantize_w1(jnp.asarray(r.standard_normal((EL, 2 * I, H)), jnp.bfloat16))
    h = np.asarray(primitives.gemm1(values, scales, offs, cnts, w1,
                                    options=primitives.Gemm1Options()), np.float32)
    self.assertTrue(np.isnan(h[bad]).all())
    self.assertFalse(np.isnan(np.delete(h, bad, axis=0)).any())


class DispatchTest(parameterized.TestCase):
  """dispatch alone on 8 CPU devices, fed with reference send buffers, against reference.dispatch."""

  @parameterized.product(engine=("cpu", "xla"), routing=("uniform", "skewed", "masked"),
                         max_recv_rows=(None, 150))
  def test_dispatch(self, engine, routing, max_recv_rows):
    r = _util.rng()
    R, T, K, E, H, row_align = 8, 24, 4, 32, 64, 16
    EL = E // R
    ids = _util.make_ids(r, R, T, K, E, routing).reshape(R, T, K)
    x = reference.quantize(jnp.asarray(r.standard_normal((R, T, H)), jnp.bfloat16))
    w = jnp.asarray(r.random((R, T, K)), jnp.float32)
    cap = jsm.layout.m_cap(R, T, K, EL, row_align, max_recv_rows)
    routes = jax.vmap(reference.route, in_axes=(0, None, None))(ids, R, EL)
    sends = jax.vmap(reference.pack)(x, w, routes.send_pos)
    want = reference.dispatch(x, ids, w, E, row_align, cap)
    m = _util.mesh(R)
    cfg = jsm.Stage1Config(engine=engine, row_align=row_align, timeout_s=20.0)
    with jsm.Runtime(m, "ep", cfg) as rt:
      def body(send, counts):
        send = jax.tree.map(lambda a: a[0], send)
        landed = api.dispatch(send, counts[0], runtime=rt, cap=cap)
        return jax.tree.map(lambda a: a[None], landed)
      f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
      got = f(_util.shard(m, SendBuffer(*sends)), _util.shard(m, routes.send_counts))
    assert_tree_equal(Landed(*got), Landed(*want))
    if max_recv_rows is not None and routing == "skewed":
      self.assertGreater(int(np.asarray(got.overflow)[0]), 0, "rank 0 must overflow in this case")


if __name__ == "__main__":
  absltest.main()
