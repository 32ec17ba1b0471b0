"""Expert parallelism inside a model's mesh (DESIGN.md §2 "EP groups"): on 8 CPU devices, meshes
with another axis beside "ep" (inner or outer), tokens sharded over every axis, the weights over
"ep" (replicated over the others). Every combination of the other axes' coordinates is an
independent EP group: stage1 and moe of each group against the references of that group's tokens
alone, for engines cpu, xla and local (ep = 1); groups never see each other's rows; the default
engine; a shard_map manual over "ep" only is refused at trace time."""
import _util
import re
from unittest import mock

import jax
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm
from jax_sdma_moe._testing import inject_faults

T, H, I, E, K = 16, 64, 32, 8, 3
# (shape, axis names)
MESHES = {"dp2_ep4": ((2, 4), ("dp", "ep")), "ep4_dp2": ((4, 2), ("ep", "dp")),
          "dp4_ep2": ((4, 2), ("dp", "ep")), "dp8_ep1": ((8, 1), ("dp", "ep"))}


def make_mesh(name, axis_types=jax.sharding.AxisType.Explicit):
  shape, names = MESHES[name]
  return jax.make_mesh(shape, names, axis_types=(axis_types,) * 2)


def group_rows(m, rt):
  """[G, R*T] the rows of x (sharded P(mesh.axis_names): device k of the mesh in row-major order
  holds rows [k*T, (k+1)*T)) of each group, its ranks in order."""
  devs = list(m.devices.flat)
  return np.array([np.concatenate([np.arange(devs.index(d) * T, (devs.index(d) + 1) * T)
                                   for d in g]) for g in rt.group_devices])


def layer_fn(m, rt):
  """jit(shard_map) over every axis: (stage1's output stacked per device, moe's y)."""
  rows = P(m.axis_names)

  def body(x, ids, w, w1q, w2q):
    out1 = jsm.stage1(x, (ids, w), w1q, runtime=rt)
    y = jsm.moe(x, (ids, w), w1q, w2q, runtime=rt)
    return jax.tree.map(lambda a: a[None], out1), y, rt.group_index()[None]
  return jax.jit(jax.shard_map(body, mesh=m, in_specs=(rows, rows, rows, P("ep"), P("ep")),
                               out_specs=rows))


def run_layer(tc, m, engine, x, ids, w, w1q, w2q):
  """Runs layer_fn on the mesh; checks every group against the references of its tokens."""
  cfg = jsm.Stage1Config(engine=engine, row_align=8, timeout_s=30.0)
  rows = NamedSharding(m, P(m.axis_names))
  with jsm.Runtime(m, "ep", cfg) as rt:
    put = lambda a: jax.device_put(a, rows)
    out1, y, gidx = layer_fn(m, rt)(put(x), put(ids), put(w), rt.shard_w1(w1q),
                                    rt.shard_w2(w2q))
    R, G = rt.num_ranks, rt.num_groups
    tc.assertEqual(G * R, 8)
    out1, y, gidx = jax.tree.map(np.asarray, (out1, y, gidx))
    devs = list(m.devices.flat)
    # the group index in the trace is the host's (group, rank) of each device
    for k, d in enumerate(devs):
      tc.assertEqual(int(gidx[k]), rt.device_group_rank(d)[0])
    for g, sel in enumerate(group_rows(m, rt)):
      at = [devs.index(d) for d in rt.group_devices[g]]  # the group's devices, by rank
      tc.assertEqual([rt.device_group_rank(devs[k]) for k in at], [(g, r) for r in range(R)])
      ref, h32 = _util.reference(x[sel], ids[sel], w[sel], w1q, R, cfg, T)
      _util.check_stage1(tc, jax.tree.map(lambda a: a[at], out1), ref, h32, cfg.out_dtype)
      want = _util.reference_y(x[sel], ids[sel], w[sel], w1q, w2q, R, cfg, T)
      _util.check_y(tc, y[sel], want, ids[sel], E)
    return rt.engine.name, out1, y


def problem(r):
  x, ids, w, w1q = _util.make_problem(r, 8, T, H, I, E, K, "masked")
  return np.asarray(x), np.array(ids), np.asarray(w), w1q, _util.make_w2q(r, E, H, I)


class MeshTest(parameterized.TestCase):

  @parameterized.product(mesh=tuple(MESHES), engine=("cpu", "xla", "local"))
  def test_groups_against_reference(self, mesh, engine):
    m = make_mesh(mesh)
    if engine == "local" and m.shape["ep"] != 1:
      self.skipTest("engine local needs ep = 1")
    name, _, _ = run_layer(self, m, engine, *problem(_util.rng()))
    self.assertEqual(name, engine)

  @parameterized.parameters("cpu", "xla")
  def test_groups_never_see_each_others_rows(self, engine):
    """Group 0's tokens route nowhere (ids -1): it lands no row, its y is exact zeros, while the
    other group's, with the same row indices, land and return theirs."""
    m = make_mesh("dp2_ep4")
    x, ids, w, w1q, w2q = problem(_util.rng())
    with jsm.Runtime(m, "ep") as rt:
      first = group_rows(m, rt)[0]
    ids[first] = -1
    _, out1, y = run_layer(self, m, engine, x, ids, w, w1q, w2q)
    devs = list(m.devices.flat)
    for k, d in enumerate(devs):
      g, _ = rt.device_group_rank(d)
      self.assertEqual(int(out1.num_rows[k]) == 0, g == 0, f"device {k} of group {g}")
    self.assertTrue((y[first] == 0).all())

  @parameterized.parameters(*MESHES)
  def test_default_engine(self, mesh):
    with jsm.Runtime(make_mesh(mesh), "ep") as rt:
      self.assertEqual(rt.engine.name, "cpu")  # every group is within this one process
      self.assertEqual(rt.num_groups, 8 // rt.num_ranks)
      self.assertEqual(rt.group_axes, (("dp", 8 // rt.num_ranks),))

  def test_absent_rank_times_out_naming_its_group(self):
    m = make_mesh("dp2_ep4")
    x, ids, w, w1q, w2q = problem(_util.rng())
    rows = NamedSharding(m, P(m.axis_names))
    with jsm.Runtime(m, "ep", jsm.Stage1Config(row_align=8, timeout_s=0.3)) as rt:
      inject_faults(rt, absent_rank=1)
      with self.assertRaisesRegex(Exception, r"rank \d of group \d timed out .* peer rank 1"):
        jax.block_until_ready(layer_fn(m, rt)(
            *(jax.device_put(a, rows) for a in (x, ids, w)), rt.shard_w1(w1q), rt.shard_w2(w2q)))

  @parameterized.parameters(("sm", "cuda"), ("ce", "cuda"), ("sdma", "rocm"))
  def test_window_engines_lower_on_groups(self, engine, platform):
    """The GPU window engines on a (dp 2, ep 4) mesh (lowered for their platform: no GPU here):
    the layer lowers with the engine's dispatch and combine; the rank operand
    is the rank within the group, each group's rank finding its windows by its device on the GPU
    (tests/test_cuda.py runs ce and sm as (dp 2, ep 2) in 4 processes on one GPU)."""
    m = make_mesh("dp2_ep4")
    x, ids, w, w1q, w2q = problem(_util.rng())
    rows = NamedSharding(m, P(m.axis_names))
    with jsm.Runtime(m, "ep", jsm.Stage1Config(engine=engine),
                     lowering_platform=platform) as rt:
      self.assertEqual((rt.engine.name, rt.num_groups), (engine, 2))
      text = layer_fn(m, rt).trace(
          *(jax.device_put(a, rows) for a in (x, ids, w)), rt.shard_w1(w1q),
          rt.shard_w2(w2q)).lower(lowering_platforms=(platform,)).as_text()
    self.assertRegex("".join(sorted(set(re.findall(r"@jsm_\w+\(", text)))),
                     r"@jsm_combine\(.*@jsm_dispatch(_gemm1)?(_graph)?\(")

  def test_sdma_runs_one_group(self):
    """Engine sdma serves one group per mesh when it runs (its mori communicators span one group):
    any other mesh is refused naming the groups; lowering serves any mesh (above)."""
    with self.assertRaisesRegex(ValueError, r"one EP group per mesh.*2 groups"):
      jsm.engines.SdmaEngine.check_mesh(
          mock.Mock(num_ranks=4, num_groups=2, lowering_only=False, axis_name="ep",
                    mesh=make_mesh("dp2_ep4"), platform="rocm"))

  @parameterized.parameters("cpu", "xla")
  def test_shard_map_over_ep_only_is_refused(self, engine):
    """Manual over "ep" only (the other axis left to XLA's partitioner): refused at trace time,
    naming the axis and what to do."""
    m = make_mesh("dp2_ep4", jax.sharding.AxisType.Auto)
    x, ids, w, w1q, w2q = problem(_util.rng())
    with jsm.Runtime(m, "ep", jsm.Stage1Config(engine=engine, row_align=8)) as rt:
      for call in (lambda x, i, w, a, b: jsm.stage1(x, (i, w), a, runtime=rt).h,
                   lambda x, i, w, a, b: jsm.moe(x, (i, w), a, b, runtime=rt)):
        f = jax.jit(jax.shard_map(call, mesh=m, in_specs=P("ep"), out_specs=P("ep"),
                                  axis_names={"ep"}))
        with self.assertRaisesRegex(ValueError, r"axis 'dp'.*shard_map over every axis"):
          f(x, ids, w, rt.shard_w1(w1q), rt.shard_w2(w2q))


if __name__ == "__main__":
  absltest.main()
