"""The layer's guarantees under real use, on 8 CPU devices (DESIGN.md §2 "Guarantees"): nothing
is lost silently (check=True holds whatever the caller uses, overflow is visible, repeated ids
are dropless, every id outside [-1, E) is counted), every wait is bounded, bad input fails at
trace time with the library's own words, and the layer says it is forward-only."""
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import _util  # noqa: E402
import jax_sdma_moe as jsm  # noqa: E402
from jax_sdma_moe._testing import inject_faults  # noqa: E402

R = _util.NUM_DEVICES
T, H, I, E, K = 16, 64, 32, 16, 4
ENGINES = ("cpu", "xla")


def problem(routing="uniform"):
  r = _util.rng()
  x, ids, w, w1q = _util.make_problem(r, R, T, H, I, E, K, routing)
  return r, x, ids, w, w1q, _util.make_w2q(r, E, H, I)


def to_rank0(T_, K_):
  """[R*T, K] ids sending every slot of every token to rank 0's experts (EL = E/R of them,
  repeated within a token's top-k when K > EL): rank 0 receives every row of the axis."""
  return jnp.asarray(_util.rng().integers(0, E // R, (R * T_, K_)), jnp.int32)


def run(f, *args):
  return jax.block_until_ready(f(*args))


class CheckHoldsTest(parameterized.TestCase):
  """stage1(check=True) cannot be compiled away, and fails on every rank alike, fast."""

  def cfg(self, engine, timeout_s=30.0):
    # rank 0 receives all R*T*K rows, far past 40: it alone overflows
    return jsm.Stage1Config(engine=engine, row_align=8, max_recv_rows=40, timeout_s=timeout_s)

  @parameterized.parameters(*ENGINES)
  def test_only_h_used(self, engine):
    _, x, _, w, w1q, _ = problem()
    ids = to_rank0(T, K)
    m = _util.mesh(R)
    with jsm.Runtime(m, "ep", self.cfg(engine)) as rt:
      def body(x, ids, w, w1q):
        return jsm.stage1(x, (ids, w), w1q, runtime=rt, check=True).h * 2  # only h kept
      f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
      args = (*_util.shard(m, (x, ids, w)), _util.shard(m, w1q))
      self.assertIn("jsm_check_overflow", f.lower(*args).as_text())
      with self.assertRaisesRegex(Exception, r"RESOURCE_EXHAUSTED.*did not fit their rank's "
                                  r"M_cap = 40 \(rank 0 dropped some\)"):
        run(f, *args)

  @parameterized.parameters(*ENGINES)
  def test_stage2_follows_and_every_rank_fails_fast(self, engine):
    """stage2(stage1(check=True)): the check holds, and the ranks that did not overflow fail with
    the same error at once instead of waiting timeout_s in the combine for rank 0 (engine xla: no
    abort in XLA's rendezvous)."""
    _, x, _, w, w1q, w2q = problem()
    ids = to_rank0(T, K)
    m = _util.mesh(R)
    with jsm.Runtime(m, "ep", self.cfg(engine, timeout_s=20.0)) as rt:
      def body(x, ids, w, w1q, w2q):
        out1 = jsm.stage1(x, (ids, w), w1q, runtime=rt, check=True)
        return jsm.stage2(out1, w2q, runtime=rt) + 1
      f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
      args = (*_util.shard(m, (x, ids, w)), *_util.shard(m, (w1q, w2q)))
      f.lower(*args).compile()
      t0 = time.monotonic()
      with self.assertRaisesRegex(Exception, "did not fit their rank's M_cap"):
        run(f, *args)
      self.assertLess(time.monotonic() - t0, 10.0, "a rank waited for the one that failed")

  def test_local_engine(self):
    """Engine local (one rank, here beside nothing else): the check holds where only h is used
    and where stage2 follows."""
    r = _util.rng()
    x, ids, w, w1q = _util.make_problem(r, 1, T, H, I, E, K)
    w2q = _util.make_w2q(r, E, H, I)
    m = _util.mesh(1)
    cfg = jsm.Stage1Config(engine="local", row_align=8, max_recv_rows=T * K // 2)
    with jsm.Runtime(m, "ep", cfg) as rt:
      for keep in ("h", "y"):
        def body(x, ids, w, w1q, w2q, keep=keep):
          out1 = jsm.stage1(x, (ids, w), w1q, runtime=rt, check=True)
          return out1.h if keep == "h" else jsm.stage2(out1, w2q, runtime=rt)
        f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
        with self.subTest(keep), self.assertRaisesRegex(Exception, "did not fit their rank's"):
          run(f, *_util.shard(m, (x, ids, w, w1q, w2q)))

  def test_check_passes_when_nothing_drops(self):
    _, x, ids, w, w1q, w2q = problem()
    m = _util.mesh(R)
    cfg = jsm.Stage1Config(engine="cpu", row_align=8)
    with jsm.Runtime(m, "ep", cfg) as rt:
      y = run(_util.moe_fn(m, rt, check=True), *_util.shard(m, (x, ids, w)),
              *_util.shard(m, (w1q, w2q)))
    _util.check_y(self, y, _util.reference_y(x, ids, w, w1q, w2q, R, cfg, T), ids, E)


class StatsTest(parameterized.TestCase):

  @parameterized.parameters(*ENGINES)
  def test_moe_returns_stats(self, engine):
    """return_stats: this rank's counts, as arrays inside the jit, with a max_recv_rows that
    drops rows on rank 0: the drop is visible, and every routed row is landed or counted."""
    _, x, _, w, w1q, w2q = problem()
    ids = to_rank0(T, K)
    bad = np.asarray(ids).copy()
    bad[0, 0], bad[1, 1], bad[2, 2] = E + 3, -7, -1  # two invalid, one no-route
    ids = jnp.asarray(bad)
    m = _util.mesh(R)
    cfg = jsm.Stage1Config(engine=engine, row_align=8, max_recv_rows=40)
    with jsm.Runtime(m, "ep", cfg) as rt:
      def body(x, ids, w, w1q, w2q):
        y, stats = jsm.moe(x, (ids, w), w1q, w2q, runtime=rt, return_stats=True)
        self.assertIsInstance(stats, jsm.MoEStats)
        return y, jax.tree.map(lambda a: a[None], stats)
      f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
      _, stats = run(f, *_util.shard(m, (x, ids, w)), *_util.shard(m, (w1q, w2q)))
    rows, overflow = np.asarray(stats.num_rows), np.asarray(stats.overflow)
    self.assertGreater(overflow[0], 0)
    self.assertTrue((overflow[1:] == 0).all() and (rows[1:] == 0).all())
    self.assertEqual(np.asarray(stats.num_invalid)[0], 2)
    self.assertEqual(rows[0] + overflow[0], R * T * K - 3, "every routed row landed or counted")
    self.assertEqual(int(np.asarray(stats.expert_counts)[0].sum()), rows[0])


class DroplessTest(parameterized.TestCase):

  @parameterized.parameters(*ENGINES)
  def test_repeated_ids_default_cap(self, engine):
    """Every slot of every token on rank 0's EL = 2 experts (K = 4 > EL: ids repeat within a
    top-k): the default M_cap holds every row; y is the reference's and nothing overflows."""
    _, x, _, w, w1q, w2q = problem()
    ids = to_rank0(T, K)
    self.assertTrue((np.diff(np.sort(np.asarray(ids), -1), axis=-1) == 0).any(),
                    "the case needs repeated ids")
    m = _util.mesh(R)
    cfg = jsm.Stage1Config(engine=engine, row_align=8)
    with jsm.Runtime(m, "ep", cfg) as rt:
      def body(x, ids, w, w1q, w2q):
        y, stats = jsm.moe(x, (ids, w), w1q, w2q, runtime=rt, check=True, return_stats=True)
        return y, stats.overflow[None]
      f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
      y, overflow = run(f, *_util.shard(m, (x, ids, w, w1q, w2q)))
    self.assertEqual(int(np.asarray(overflow).sum()), 0)
    _util.check_y(self, y, _util.reference_y(x, ids, w, w1q, w2q, R, cfg, T), ids, E)

  def test_ids_of_other_dtypes(self):
    """uint32 ids >= 2**31 and signed ids below -1 are invalid (counted), -1 is no route; small
    integer dtypes work as int32; float ids are refused at trace time."""
    _, x, ids, w, w1q, _ = problem()
    m = _util.mesh(R)
    cfg = jsm.Stage1Config(engine="cpu", row_align=8)
    with jsm.Runtime(m, "ep", cfg) as rt:
      f = _util.stage1_fn(m, rt)
      u = np.asarray(ids).astype(np.uint32)
      u[0, 0], u[1, 1] = 2**31 + 3, 2**32 - 1
      out_u = run(f, *_util.shard(m, (x, jnp.asarray(u), w)), _util.shard(m, w1q))
      self.assertEqual(int(np.asarray(out_u.num_invalid)[0]), 2)
      s8 = np.asarray(ids).astype(np.int8)
      s8[0, 0], s8[0, 1] = -5, -1
      out_s = run(f, *_util.shard(m, (x, jnp.asarray(s8), w)), _util.shard(m, w1q))
      self.assertEqual(int(np.asarray(out_s.num_invalid)[0]), 1)
      ref, h32 = _util.reference(x, jnp.asarray(s8), w, w1q, R, cfg, T)
      _util.check_stage1(self, out_s, ref, h32, "bf16")
      with self.assertRaisesRegex(TypeError, "ids must be an integer array"):
        f(*_util.shard(m, (x, ids.astype(jnp.float32), w)), _util.shard(m, w1q))


class BoundsTest(parameterized.TestCase):

  @parameterized.parameters(
      dict(row_align=2**62), dict(row_align=0), dict(row_align=True),
      dict(max_recv_rows=2**31), dict(timeout_s=float("inf")), dict(timeout_s=1e300),
      dict(timeout_s=float("nan")), dict(timeout_s=0))
  def test_config_bounds(self, **kw):
    with self.assertRaises(ValueError):
      jsm.Stage1Config(**kw)

  def test_fault_hooks_are_not_config(self):
    with self.assertRaises(TypeError):
      jsm.Stage1Config(fault_delay_ms=10**8)  # pylint: disable=unexpected-keyword-arg

  def sds(self, m, shape, dtype):  # an abstract array sharded over "ep"
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(m, P("ep")))

  def test_int32_limits_checked_at_trace_time(self):
    m = _util.mesh(R)
    with jsm.Runtime(m, "ep", jsm.Stage1Config(engine="xla")) as rt:
      big = self.sds(m, (R * 2**26, 32), jnp.bfloat16)  # T*K = 2**26 * 40 > 2**31
      ids = self.sds(m, (R * 2**26, 40), jnp.int32)
      w1q = jsm.QuantizedW1(self.sds(m, (E, 2 * I, 32), jnp.float8_e4m3fn),
                            self.sds(m, (E, 2 * I, 1), jnp.uint8))
      f = jax.jit(jax.shard_map(lambda x, i, w: jsm.stage1(x, i, w, runtime=rt).h, mesh=m,
                                in_specs=P("ep"), out_specs=P("ep")))
      with self.assertRaisesRegex(ValueError, "int32"):
        f.trace(big, ids, w1q)

  def test_no_experts(self):
    m = _util.mesh(R)
    with jsm.Runtime(m, "ep", jsm.Stage1Config(engine="xla")) as rt:
      w1q = jsm.QuantizedW1(self.sds(m, (0, 2 * I, H), jnp.float8_e4m3fn),
                            self.sds(m, (0, 2 * I, H // 32), jnp.uint8))
      f = jax.jit(jax.shard_map(lambda x, i, w: jsm.stage1(x, i, w, runtime=rt).h, mesh=m,
                                in_specs=P("ep"), out_specs=P("ep")))
      with self.assertRaisesRegex(ValueError, "no experts"):
        f.trace(self.sds(m, (R * T, H), jnp.bfloat16), self.sds(m, (R * T, K), jnp.int32), w1q)

  def test_delay_is_bounded_by_timeout(self):
    """A fault delay far past timeout_s is slept for at most timeout_s: the call ends (here with
    the peers' timeout) within a few timeouts, not after the delay."""
    _, x, ids, w, w1q, _ = problem()
    m = _util.mesh(R)
    with jsm.Runtime(m, "ep", jsm.Stage1Config(engine="cpu", timeout_s=1.0)) as rt:
      inject_faults(rt, delay_rank=2, delay_ms=10**8)
      t0 = time.monotonic()
      try:
        run(_util.stage1_fn(m, rt), *_util.shard(m, (x, ids, w)), _util.shard(m, w1q))
      except Exception as e:  # noqa: BLE001 - either outcome is bounded; the time is the test
        self.assertIn("timed out", str(e))
      self.assertLess(time.monotonic() - t0, 10.0)


class Stage2OfEarlierOutputTest(parameterized.TestCase):

  @parameterized.parameters(*ENGINES, "local")
  def test_stage2_of_the_first_of_two_stages1(self, engine):
    """stage2 depends only on the Stage1Output it is given, not on the engine's latest
    dispatch."""
    R = 1 if engine == "local" else _util.NUM_DEVICES  # noqa: N806 - the suite's name for it
    r = _util.rng()
    x, ids, w, w1q = _util.make_problem(r, R, T, H, I, E, K)
    x2, ids2, w2, _ = _util.make_problem(r, R, T, H, I, E, K)
    w2q = _util.make_w2q(r, E, H, I)
    m = _util.mesh(R)
    cfg = jsm.Stage1Config(engine=engine, row_align=8)
    with jsm.Runtime(m, "ep", cfg) as rt:
      def body(x, ids, w, x2, ids2, w2, w1q, w2q):
        o1 = jsm.stage1(x, (ids, w), w1q, runtime=rt)
        o2 = jsm.stage1(x2 + 0 * o1.h[0, 0], (ids2, w2), w1q, runtime=rt)  # after o1
        y1 = jsm.stage2(o1, w2q, runtime=rt)
        return y1, jsm.stage2(o2, w2q, runtime=rt)
      f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
      y1, y2 = run(f, *_util.shard(m, (x, ids, w, x2, ids2, w2, w1q, w2q)))
    _util.check_y(self, y1, _util.reference_y(x, ids, w, w1q, w2q, R, cfg, T), ids, E)
    _util.check_y(self, y2, _util.reference_y(x2, ids2, w2, w1q, w2q, R, cfg, T), ids2, E)


class ModifiedOutputTest(parameterized.TestCase):
  """A Stage1Output altered between stage1 and stage2 — here on rank 3 alone — fails with an
  error naming the field on that rank; the others stop too (engine xla: at once, before its
  exchange, not in an abort of XLA's rendezvous; engine cpu: their waits for rank 3 are
  bounded)."""

  @parameterized.product(engine=ENGINES, field=("expert_offsets", "expert_counts", "src_token"))
  def test_one_rank_modified(self, engine, field):
    _, x, ids, w, w1q, w2q = problem()
    m = _util.mesh(R)
    cfg = jsm.Stage1Config(engine=engine, row_align=8, timeout_s=5.0)
    bump = {"expert_offsets": -5, "expert_counts": 10**6, "src_token": 10**6}[field]
    with jsm.Runtime(m, "ep", cfg) as rt:
      def body(x, ids, w, w1q, w2q):
        out1 = jsm.stage1(x, (ids, w), w1q, runtime=rt)
        a = getattr(out1, field)
        a = a.at[0].add(jnp.where(jax.lax.axis_index("ep") == 3, bump, 0))
        return jsm.stage2(out1._replace(**{field: a}), w2q, runtime=rt)
      f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
      args = _util.shard(m, (x, ids, w, w1q, w2q))
      f.lower(*args).compile()
      t0 = time.monotonic()
      want = (r"INVALID_ARGUMENT.*(Stage1Output given on 1 rank\(s\) of the axis \(rank 3|"
              rf"out1\.{field}\[0\])" if engine == "xla" else
              rf"INVALID_ARGUMENT.*out1\.{field}\[0\]|timed out .* from peer rank 3")
      with self.assertRaisesRegex(Exception, want):
        run(f, *args)
      self.assertLess(time.monotonic() - t0, 4 * cfg.timeout_s)


class RuntimeUseTest(parameterized.TestCase):

  def test_closed_runtime_fails_at_trace_time(self):
    _, x, ids, w, w1q, _ = problem()
    m = _util.mesh(R)
    rt = jsm.Runtime(m, "ep", jsm.Stage1Config(engine="xla"))
    rt.close()
    self.assertTrue(rt.closed)
    with self.assertRaisesRegex(ValueError, "Runtime is closed"):
      _util.stage1_fn(m, rt)(*_util.shard(m, (x, ids, w)), _util.shard(m, w1q))

  def test_wrong_axis_names_both(self):
    _, x, ids, w, w1q, _ = problem()
    m = _util.mesh(R)
    mx = jax.sharding.Mesh(m.devices, ("x",))
    with jsm.Runtime(mx, "x", jsm.Stage1Config(engine="xla")) as rt:
      with self.assertRaisesRegex(ValueError, r"axis 'x'.*'ep'") as cm:
        _util.stage1_fn(m, rt)(*_util.shard(m, (x, ids, w)), _util.shard(m, w1q))
      self.assertIsNone(cm.exception.__cause__)
      self.assertTrue(cm.exception.__suppress_context__)

  def test_engine_cpu_serves_ep_groups(self):
    # a second axis: one EP group per dp coordinate, each with its own windows (tests/test_mesh.py)
    devs = np.array(jax.devices()[:R]).reshape(2, R // 2)
    m2 = jax.sharding.Mesh(devs, ("dp", "ep"))
    with jsm.Runtime(m2, "ep", jsm.Stage1Config()) as rt:
      self.assertEqual((rt.engine.name, rt.num_groups, rt.num_ranks), ("cpu", 2, R // 2))


class ForwardOnlyTest(absltest.TestCase):

  def test_grad_says_forward_only(self):
    _, x, ids, w, w1q, w2q = problem()
    m = _util.mesh(R)
    with jsm.Runtime(m, "ep", jsm.Stage1Config(engine="cpu", row_align=8)) as rt:
      f = _util.moe_fn(m, rt)
      args = _util.shard(m, (ids, w, w1q, w2q))
      loss = lambda x: f(x, *args).astype(jnp.float32).sum()
      with self.assertRaisesRegex(NotImplementedError, "forward-only"):
        jax.grad(loss)(_util.shard(m, x))
      with self.assertRaisesRegex(NotImplementedError, "forward-only"):
        jax.jvp(loss, (_util.shard(m, x),), (_util.shard(m, x),))


if __name__ == "__main__":
  absltest.main()
