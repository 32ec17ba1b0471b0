"""Stage1 across GPUs (engines ce, sm and xla), one process holding R GPUs, and R processes with
one GPU each (the `mpirun -n R` launch mode, started here through jax.distributed flags). R is
every visible GPU (EP2 on two, EP4 / EP8 on four / eight), or JSM_TEST_RANKS. Skipped without two
CUDA GPUs; JSM_REQUIRE_CUDA=1 turns that skip into a failure (device runs)."""
import os

import _util

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm
from jax_sdma_moe._testing import inject_faults
from jax_sdma_moe import reference

HERE = os.path.dirname(os.path.abspath(__file__))
try:
  GPUS = jax.devices("gpu")
except RuntimeError:
  GPUS = []
ENOUGH = len(GPUS) >= 2 and jsm.primitives.extension().has_cuda()
WHY = None if ENOUGH else "needs two CUDA GPUs and a build with the CUDA kernels"
if not ENOUGH and os.environ.get("JSM_REQUIRE_CUDA") == "1":
  raise RuntimeError(f"JSM_REQUIRE_CUDA=1 but {WHY} ({len(GPUS)} GPUs)")

R = int(os.environ.get("JSM_TEST_RANKS", "0")) or max(2, len(GPUS))
if ENOUGH and not 2 <= R <= len(GPUS):
  raise ValueError(f"JSM_TEST_RANKS={R}: needs 2 to {len(GPUS)} (the visible GPUs)")
ENGINES = ("ce", "sm", "xla")
LANDED = _util.LANDED_FIELDS
CASES = [(f"{s}_{routing}_T{T}", s, routing, T) for s in ("small", "dsv3")
         for routing in ("uniform", "skewed", "masked") for T in (1, 128, 4096)]


def gpu_mesh():
  return jax.sharding.Mesh(np.array(GPUS[:R]), ("ep",))


# One Runtime and one jitted stage1 per (engine, shape) for the tests with the default
# configuration: the cases of one shape and T then compile once (a compile per engine and case
# was most of this suite's time on the device), and the Runtime's reuse across tests is itself
# what users do.
_STAGE1 = {}


def default_stage1(engine, shape_name):
  if (engine, shape_name) not in _STAGE1:
    mesh = gpu_mesh()
    cfg = jsm.Stage1Config(engine=engine, swiglu_limit=jsm.SHAPES[shape_name].swiglu_limit)
    rt = jsm.Runtime(mesh, "ep", cfg)
    _STAGE1[engine, shape_name] = (rt, _util.stage1_fn(mesh, rt))
  return _STAGE1[engine, shape_name]


def tearDownModule():
  for rt, _ in _STAGE1.values():
    rt.close()


def problem(r, shape, T, routing):
  """Inputs of all ranks, stacked [R*T, ...], on the host (sharded by _util.shard)."""
  x = jnp.asarray(r.standard_normal((R * T, shape.hidden)) * r.uniform(0.5, 2, (R * T, 1)),
                  jnp.bfloat16)
  ids = _util.make_ids(r, R, T, shape.topk, shape.num_experts, routing)
  w = jnp.asarray(r.random((R * T, shape.topk)), jnp.float32)
  return x, ids, w


def check_against_reference(tc, out, x, ids, w, w1q, shape, cfg, T, r):
  """Layout equal to reference.dispatch for every rank; h of sampled experts within §3."""
  E, K = shape.num_experts, shape.topk
  EL = E // R
  cap = jsm.layout.m_cap(R, T, K, EL, cfg.row_align)
  with jax.default_device(GPUS[0]):
    landed = jax.jit(reference.dispatch, static_argnums=(3, 4, 5))(
        jax.tree.map(lambda a: a.reshape(R, T, *a.shape[1:]), jsm.quantize(x)),
        ids.reshape(R, T, K), w.reshape(R, T, K), E, cfg.row_align, cap)
    for name in LANDED:
      np.testing.assert_array_equal(np.asarray(getattr(out, name)),
                                    np.asarray(getattr(landed, name)), err_msg=name)
    h = out.h
    got = _util.h_float(h)
    for rank in range(R):
      offs, cnts = np.asarray(out.expert_offsets[rank]), np.asarray(out.expert_counts[rank])
      rows_landed = np.zeros(got.shape[1], bool)
      for e in range(EL):
        rows_landed[offs[e]:offs[e] + cnts[e]] = True
      tc.assertTrue((got[rank][~rows_landed] == 0).all(), f"rank {rank}: padding rows must be 0")
      nonempty = np.flatnonzero(cnts)
      pick = set(nonempty[:1]) | set(nonempty[-1:]) | set(r.choice(nonempty, min(3, len(nonempty)),
                                                                   replace=False))
      refs = reference.sampled_h32(landed.values, landed.scales, offs, cnts, pick, w1q, rank,
                                   cfg.swiglu_limit)
      for e, ref in refs.items():
        _util.check_block(tc, got[rank, offs[e]:offs[e] + cnts[e]], ref, cfg.out_dtype,
                          f"rank {rank} expert {e}")


@absltest.skipIf(not ENOUGH, WHY or "")
class MultiGpuStage1Test(parameterized.TestCase):
  def w1q(self, name):
    return _util.random_w1q(name, GPUS[0])

  def run_engines(self, shape_name, inputs, engines=ENGINES, faults=None):
    s = jsm.SHAPES[shape_name]
    mesh = gpu_mesh()
    w1q = self.w1q(shape_name)
    outs = {}
    for engine in engines:
      if faults:  # fault injection: a Runtime of its own
        cfg = jsm.Stage1Config(engine=engine, swiglu_limit=s.swiglu_limit)
        rt = jsm.Runtime(mesh, "ep", cfg)
        inject_faults(rt, **faults)
        f = _util.stage1_fn(mesh, rt)
      else:
        rt, f = default_stage1(engine, shape_name)
        cfg = rt.config
      outs[engine] = jax.tree.map(np.asarray, f(*_util.shard(mesh, inputs), rt.shard_w1(w1q)))
      rt.check()
      if faults:
        rt.close()
    return outs, cfg

  @parameterized.named_parameters(*CASES)
  def test_engines_against_reference(self, shape_name, routing, T):
    """ce, sm and xla land the same bytes (h included: same GEMM); the layout equals the
    reference's and h of sampled experts is within the §3 tolerance."""
    r = _util.rng()
    s = jsm.SHAPES[shape_name]
    x, ids, w = problem(r, s, T, routing)
    outs, cfg = self.run_engines(shape_name, (x, ids, w))
    for engine in ENGINES[1:]:
      for name, a, b in zip(outs["ce"]._fields, outs["ce"], outs[engine]):
        np.testing.assert_array_equal(_util.as_bytes(a), _util.as_bytes(b),
                                      err_msg=f"{name}: ce vs {engine}")
    check_against_reference(self, outs["ce"], x, ids, w, self.w1q(shape_name), s, cfg, T, r)

  @parameterized.parameters(("small", 128), ("dsv3", 1024))
  def test_dispatch_alone(self, shape_name, T):
    """The dispatch stage by itself (rows copied out of the window into XLA's buffers, as the
    benchmark times it): every landed array, rows included, byte-identical to engine xla's."""
    r = _util.rng()
    s = jsm.SHAPES[shape_name]
    x, ids, w = problem(r, s, T, "masked")
    mesh = gpu_mesh()
    EL = s.num_experts // R
    landed = {}
    for engine in ENGINES:
      with jsm.Runtime(mesh, "ep", jsm.Stage1Config(engine=engine)) as rt:
        cap = jsm.layout.m_cap(R, T, s.topk, EL, rt.config.row_align)

        def body(x, ids, w, rt=rt, cap=cap):
          route = jsm.primitives.route(ids, R, EL)
          send = jsm.primitives.qpack(x, w, route.send_pos)
          out = jsm.api.dispatch(send, route.send_counts, runtime=rt, cap=cap)
          return jax.tree.map(lambda a: a[None], out)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        landed[engine] = jax.tree.map(np.asarray, f(*_util.shard(mesh, (x, ids, w))))
        rt.check()
    for engine in ("ce", "sm"):
      for name, a, b in zip(landed["xla"]._fields, landed["xla"], landed[engine]):
        np.testing.assert_array_equal(_util.as_bytes(a), _util.as_bytes(b),
                                      err_msg=f"{name}: xla vs {engine}")

  @parameterized.parameters("ce", "sm")
  def test_200_back_to_back(self, engine):
    """200 calls, fresh inputs each, every one checked against the reference."""
    r = _util.rng()
    s = jsm.SHAPES["small"]
    T = 64
    mesh = gpu_mesh()
    _, _, _, w1q = _util.make_problem(r, R, 1, s.hidden, s.intermediate, s.num_experts, s.topk)
    cfg = jsm.Stage1Config(engine=engine)
    with jsm.Runtime(mesh, "ep", cfg) as rt:
      f = _util.stage1_fn(mesh, rt)
      w1s = rt.shard_w1(w1q)
      ref_fn = jax.jit(lambda x, i, w: _util.reference(x, i, w, w1q, R, cfg, T))
      for i in range(200):
        x, ids, w = problem(r, s, T, ("uniform", "masked", "skewed")[i % 3])
        out = jax.tree.map(np.asarray, f(*_util.shard(mesh, (x, ids, w)), w1s))
        ref, h32 = ref_fn(x, ids, w)
        _util.check_stage1(self, out, ref, h32, "bf16")
      rt.check()
      # each call was waited for before the next: all but the last one's timeline is read back
      timeline = rt.engine.timeline()
      self.assertEqual(sorted(timeline), list(range(R)))
      for rank, t in timeline.items():
        self.assertEqual(t["calls"], 199, f"rank {rank}")
        self.assertLessEqual(0, t["gemm_start_ms"], f"rank {rank}")
        self.assertLessEqual(t["gemm_start_ms"], t["gemm_end_ms"], f"rank {rank}")
        self.assertGreater(t["side_end_ms"], 0, f"rank {rank}")
        if engine == "ce":
          self.assertLessEqual(t["first_chunk_ms"], t["side_end_ms"], f"rank {rank}")
        else:
          self.assertIsNone(t["first_chunk_ms"])
      if engine == "ce":  # the host's share of each call is counted for every rank
        stats = rt.engine.host_stats()
        self.assertEqual(sorted(stats), list(range(R)))
        for rank, st in stats.items():
          self.assertEqual(st["calls"], 200, f"rank {rank}")
          self.assertGreater(st["plan_us"], 0)
          self.assertGreater(st["enqueue_us"], 0)
          self.assertGreaterEqual(st["copies"], 200, f"rank {rank}: every call copies rows")
          # each peer's rows in one piece (values, then meta rows), whatever the experts
          self.assertLessEqual(st["copies"], 200 * 2 * (R - 1), f"rank {rank}")
          self.assertLessEqual(st["single_copies"], st["copies"])

  @parameterized.parameters("ce", "sm")
  def test_delayed_rank(self, engine):
    """Rank 1 starts 300 ms late: rank 0 waits for it, and both finish correctly."""
    r = _util.rng()
    x, ids, w = problem(r, jsm.SHAPES["small"], 128, "uniform")
    outs, _ = self.run_engines("small", (x, ids, w), engines=("xla", engine),
                               faults=dict(delay_rank=1, delay_ms=300))
    for name, a, b in zip(outs["xla"]._fields, outs["xla"], outs[engine]):
      np.testing.assert_array_equal(_util.as_bytes(a), _util.as_bytes(b), err_msg=name)

  def test_default_engine(self):
    """Stage1Config() on a CUDA "ep" axis of R GPUs picks engine sm; with 4 GPUs, a 2 x 2 mesh
    (another axis longer than one, which the window engines refuse) falls back to xla."""
    self.assertEqual(jsm.Runtime(gpu_mesh(), "ep", jsm.Stage1Config()).engine.name, "sm")
    if len(GPUS) >= 4:
      mesh2 = jax.sharding.Mesh(np.array(GPUS[:4]).reshape(2, 2), ("ep", "dp"))
      self.assertEqual(jsm.Runtime(mesh2, "ep", jsm.Stage1Config()).engine.name, "xla")

  @parameterized.parameters("ce", "sm")
  def test_absent_peer_times_out(self, engine):
    """Rank 1 never takes part: rank 0 gives up after timeout_s with an error naming rank 1
    (engine ce: the call fails; engine sm, which has no host step: Runtime.check() and the next
    call fail), never a hang."""
    r = _util.rng()
    s = jsm.SHAPES["small"]
    mesh = gpu_mesh()
    cfg = jsm.Stage1Config(engine=engine, timeout_s=0.5)
    x, ids, w = problem(r, s, 32, "uniform")
    _, _, _, w1q = _util.make_problem(r, R, 1, s.hidden, s.intermediate, s.num_experts, s.topk)
    rt = jsm.Runtime(mesh, "ep", cfg)
    inject_faults(rt, absent_rank=1)
    f = _util.stage1_fn(mesh, rt)
    args = (*_util.shard(mesh, (x, ids, w)), rt.shard_w1(w1q))
    with self.assertRaisesRegex(Exception, r"rank 0 timed out .* from peer rank 1"):
      jax.block_until_ready(f(*args))
      rt.check()
    if engine == "sm":
      with self.assertRaisesRegex(Exception, r"peer rank 1"):
        jax.block_until_ready(f(*args))


@absltest.skipIf(not ENOUGH, WHY or "")
class CommandBufferTest(absltest.TestCase):

  def test_sm_engine_in_cuda_graphs(self):
    """Engine sm's calls declare themselves command-buffer compatible; with XLA told to capture
    custom calls into CUDA graphs, 50 back-to-back calls stay correct (the epoch is on the
    device, so replays count)."""
    _util.run_processes(
        self, os.path.join(HERE, "graph_worker.py"), 1,
        int(np.random.SeedSequence().entropy % (2**31)), timeout=400,
        env_of=lambda i: {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                                       "--xla_gpu_graph_min_graph_size=1"})


@absltest.skipIf(not ENOUGH, WHY or "")
class TwoProcessTest(absltest.TestCase):

  def test_two_processes_one_gpu_each(self):
    """The mpirun launch mode: each process owns one GPU and one rank; windows are opened from
    CUDA IPC handles exchanged through jax.distributed; engines ce and sm checked on every rank
    (engine xla is refused there)."""
    _util.run_mp_gpu_workers(self, R, timeout=400)


if __name__ == "__main__":
  absltest.main()


@absltest.skipIf(not ENOUGH, WHY or "")
class MultiGpuMoeTest(parameterized.TestCase):
  """jsm.moe across the GPUs: engines xla (its all_to_all back, then the CUDA combine within each
  rank), sm and ce (their combines through the windows) against reference.moe and byte for byte
  against each other."""

  @parameterized.named_parameters(
      ("uniform", "uniform", 256), ("skewed", "skewed", 256), ("masked", "masked", 64),
      ("T1", "uniform", 1))
  def test_moe_engines(self, routing, T):
    _util.run_moe_on(self, gpu_mesh(), ("xla", "sm", "ce"), T, *_util.MID_LAYER, routing)

  @parameterized.parameters("sm", "ce")
  def test_moe_back_to_back(self, engine):
    """Repeated moe calls (the return slots' parities and stamps): every y equal to the first; a
    slot left from an earlier epoch is never summed (masked routing)."""
    r = _util.rng()
    m = gpu_mesh()
    R = m.devices.size
    H, I, E, K = _util.MID_LAYER
    x, ids, w, w1q = _util.make_problem(r, R, 64, H, I, E, K, "masked")
    x2, ids2, w2, _ = _util.make_problem(r, R, 64, H, I, E, K, "uniform")
    w2q = _util.make_w2q(r, E, H, I)
    with jsm.Runtime(m, "ep", jsm.Stage1Config(engine=engine)) as rt:
      fn = _util.moe_fn(m, rt)
      args = _util.shard(m, (x, ids, w)) + _util.shard(m, (w1q, w2q))
      args2 = _util.shard(m, (x2, ids2, w2)) + _util.shard(m, (w1q, w2q))
      first = _util.as_bytes(fn(*args))
      for i in range(5):  # masked after uniform: stale rows of every slot in the other parity
        fn(*args2)
        np.testing.assert_array_equal(_util.as_bytes(fn(*args)), first, f"call {i}")
    ref = _util.reference_y(x, ids, w, w1q, w2q, R, jsm.Stage1Config(engine=engine), 64)
    _util.check_y(self, first.view(jnp.bfloat16), ref, ids, E)
