"""One process of a multi-process GPU run (the `mpirun -n R` launch mode), started by
test_multigpu.py and test_cuda.py, JAX using one GPU each:

  python mp_gpu_worker.py PROCESS_ID NUM_PROCESSES PORT SEED [GPU] [KEY=VALUE ...]

GPU: the CUDA device of this process (PROCESS_ID by default). test_cuda.py puts every rank on
GPU 0 (R = 2, 4, 8 processes), which checks the protocol's bytes on a one-GPU machine: CUDA IPC
opens a window of the same device from another process, and the processes' kernels take turns on
it; there only the small shapes run (E = 64, and E = 32 for the layer, so that R = 8 has at least
K local experts), beside the test process's memory pool. One launch runs both engines (ce, sm) and
every part:
  stage1    engines ce and sm land the same bytes on this rank, equal to the reference layout,
            with h of sampled experts within §3, calls back to back (uniform, skewed, masked);
  overflow  a small M_cap that drops rows: `overflow` is this rank's dropped rows, or with
            DispatchOptions.global_overflow the rows dropped over every rank (the same number on
            each), the rest of the layout as without it;
  stale     stage2 on an earlier Stage1Output (stage1(a), stage1(b), stage2(out of a)): engine ce
            fails with a clear error on every rank (it returns rows by the plan of its latest
            dispatch) and stays usable, also on an earlier output with the latest one's headers;
            engine sm, whose combine reads the Stage1Output alone, returns what a fresh
            stage1(a) + stage2 does;
  moe       jsm.moe with engines sm and ce (their combines through the IPC-opened windows)
            matches the reference on this rank's tokens in back-to-back calls, byte for byte
            between the engines;
and engine xla is refused with a clear error. Prints 'OK rank N' on success.
KEY=VALUE: groups=G (EP groups, DESIGN.md §2: the mesh (dp = G, ep = NUM_PROCESSES / G), tokens
sharded over both axes, weights over ep; every check above holds per group, against the reference
of the group's tokens alone; default 1, the mesh (ep,)).
Diagnostics (bench/device/ep_probe.sh): engines=ce,sm  parts=stage1,overflow,stale,moe
(`+` separates as `,` does; part `dispatch`: the engines' dispatch alone, no GEMM)  iters=N
(stage1's and moe's calls)
timeout=S (Stage1Config.timeout_s)  repeat=N (each part N times, fresh Runtimes: epoch 1 again).
"""
import dataclasses
import os
import sys
import time

pid, nproc, port, seed = (int(a) for a in sys.argv[1:5])
_rest = sys.argv[5:]
_gpu = [a for a in _rest if "=" not in a]
OPTS = dict(a.split("=", 1) for a in _rest if "=" in a)
shared_gpu = bool(_gpu)  # GPU given: every rank on that one GPU, the small shapes only
gpu = int(_gpu[0]) if shared_gpu else pid

import jax  # noqa: E402

# JAX uses one GPU per process, but CUDA sees both: CUDA IPC between the GPUs needs the peer device
# visible (peer access), so no CUDA_VISIBLE_DEVICES masking
jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid,
                           local_device_ids=[gpu])

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import _util  # noqa: E402
import jax_sdma_moe as jsm  # noqa: E402
from jax_sdma_moe import api, primitives, reference  # noqa: E402

GROUPS = int(OPTS.get("groups", 1))
R = nproc // GROUPS  # an EP group's ranks; this process is rank `rank` of group `group`
group, rank = divmod(pid, R)
ENGINES = tuple(OPTS.get("engines", "ce,sm").replace("+", ",").split(","))
PARTS = tuple(OPTS.get("parts", "stage1,overflow,stale,moe").replace("+", ",").split(","))
ITERS = int(OPTS["iters"]) if "iters" in OPTS else None
TIMEOUT_S = float(OPTS.get("timeout", 60.0))
REPEAT = int(OPTS.get("repeat", 1))
if GROUPS == 1:
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
else:  # the processes in order: group-major, as jax.devices() lists them
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(GROUPS, R), ("dp", "ep"))
TOK = P(mesh.axis_names)  # tokens over every axis (rank pid holds rows pid * T ...)
WGT = P("ep")  # expert weights over ep, replicated over the groups
spec = NamedSharding(mesh, TOK)
local = jax.local_devices()[0]
T0 = time.time()


def log(what):
  print(f"[rank {pid} +{time.time() - T0:.1f}s] {what}", flush=True)


def global_array(host):
  """[nproc * n, ...] tokens on the host -> the global array whose process-pid shard is this
  process's part."""
  host = np.asarray(host)
  n = host.shape[0] // nproc
  return jax.make_array_from_process_local_data(spec, host[pid * n:(pid + 1) * n])


def weight_array(host):
  """[E, ...] expert weights on the host -> the global array sharded over ep (this process
  holds its rank's experts)."""
  host = np.asarray(host)
  n = host.shape[0] // R
  return jax.make_array_from_process_local_data(NamedSharding(mesh, WGT),
                                                host[rank * n:(rank + 1) * n], host.shape)


def of_group(host):
  """The rows of this process's group out of [nproc * n, ...] tokens on the host."""
  host = np.asarray(host)
  n = host.shape[0] // GROUPS
  return host[group * n:(group + 1) * n]


def shard_mapped(fn, in_specs):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=TOK))


def mine(tree):
  return jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data)[0], tree)


def runtime(engine, **cfg):
  return jsm.Runtime(mesh, "ep", jsm.Stage1Config(engine=engine, timeout_s=TIMEOUT_S, **cfg))


def stacked(fn, in_specs=(TOK, TOK, TOK, WGT)):
  """jit(shard_map(fn)) whose outputs gain a leading rank axis (out_specs over every axis)."""
  return shard_mapped(lambda *a: jax.tree.map(lambda o: o[None], fn(*a)), in_specs)


def with_global_overflow(rt):
  """The Runtime's engine sets DispatchOptions.global_overflow while rt.engine.test_global is
  true at trace time (the options are static: each jitted function keeps the value it was traced
  with)."""
  eng = rt.engine
  options = eng.protocol_options

  def patched(*args, **kw):
    return dataclasses.replace(options(*args, **kw),
                               global_overflow=bool(getattr(eng, "test_global", False)))
  eng.protocol_options = patched
  return rt


def stage1_fn(rt, global_overflow=False):
  def body(x, i, w, q):
    rt.engine.test_global = global_overflow
    try:
      return jsm.stage1(x, (i, w), q, runtime=rt)
    finally:
      rt.engine.test_global = False
  return stacked(body)


def small_shape():
  """The small Stage1 shape; on a shared GPU with E = 64, so that R = 8 keeps K <= E/R (skewed
  routing) and a few rows per expert."""
  s = jsm.SHAPES["small"]
  return dataclasses.replace(s, num_experts=64) if shared_gpu else s


def make_w1q(s):
  # each process makes only its own experts' weights, on its GPU (dsv3's whole w1 is 7.5 GB)
  EL = s.num_experts // R
  with jax.default_device(local):  # the same experts in every group
    w1 = jax.random.normal(jax.random.fold_in(jax.random.key(seed), rank),
                           (EL, 2 * s.intermediate, s.hidden), jnp.bfloat16
                           ) * jnp.bfloat16(1.0 / np.sqrt(s.hidden))
    w1q = jax.block_until_ready(jax.jit(jsm.quantize_w1)(w1))  # experts rank * EL ... + EL - 1
  w1s = jax.tree.map(lambda a: jax.make_array_from_single_device_arrays(
      (R * a.shape[0], *a.shape[1:]), NamedSharding(mesh, WGT), [a]), w1q)
  return w1q, w1s


def stage1_inputs(s, T, routing, r):
  x = np.asarray(jnp.asarray(r.standard_normal((nproc * T, s.hidden)), jnp.bfloat16))
  ids = np.asarray(_util.make_ids(r, nproc, T, s.topk, s.num_experts, routing))
  w = r.random((nproc * T, s.topk)).astype(np.float32)
  return x, ids, w


def reference_landed(s, T, x, ids, w, cap):
  """Every rank's landed layout of this process's group (x, ids, w: every process's tokens)."""
  x, ids, w = of_group(x), of_group(ids), of_group(w)
  with jax.default_device(local):
    return jax.jit(reference.dispatch, static_argnums=(3, 4, 5))(
        jax.tree.map(lambda a: a.reshape(R, T, *a.shape[1:]), jsm.quantize(jnp.asarray(x))),
        jnp.asarray(ids).reshape(R, T, s.topk), jnp.asarray(w).reshape(R, T, s.topk),
        s.num_experts, 128, cap)


def same_bytes(outs, what, skip=()):
  """Every engine's output equal byte for byte to the first's (fields in `skip` aside)."""
  first = ENGINES[0]
  for e in ENGINES[1:]:
    if not hasattr(outs[first], "_fields"):  # one array (y)
      np.testing.assert_array_equal(_util.as_bytes(outs[first]), _util.as_bytes(outs[e]),
                                    err_msg=f"{what}: {first} vs {e}")
      continue
    for name, a, b in zip(outs[first]._fields, outs[first], outs[e]):
      if name not in skip:
        np.testing.assert_array_equal(_util.as_bytes(a), _util.as_bytes(b),
                                      err_msg=f"{what}: {name} {first} vs {e}")


def run(s, T, r, iters=1):
  """Part stage1: both engines' fused Stage1 against each other and the reference."""
  EL = s.num_experts // R
  w1q, w1s = make_w1q(s)
  runtimes = {e: runtime(e, swiglu_limit=s.swiglu_limit) for e in ENGINES}
  fns = {e: stage1_fn(rt) for e, rt in runtimes.items()}
  for it in range(iters):
    routing = ("uniform", "skewed", "masked")[it % 3]
    x, ids, w = stage1_inputs(s, T, routing, r)
    outs = {e: mine(f(global_array(x), global_array(ids), global_array(w), w1s))
            for e, f in fns.items()}
    for rt in runtimes.values():  # an expired wait names itself before the bytes are compared
      rt.check()
    same_bytes(outs, f"{s.name} T={T} {routing}")
    cap = jsm.layout.m_cap(R, T, s.topk, EL, 128)
    landed = reference_landed(s, T, x, ids, w, cap)
    out = outs[ENGINES[0]]
    for name in _util.LANDED_FIELDS:
      np.testing.assert_array_equal(getattr(out, name), np.asarray(getattr(landed, name))[rank],
                                    err_msg=name)
    offs, cnts = out.expert_offsets, out.expert_counts
    got = np.asarray(out.h, np.float32)
    nonempty = np.flatnonzero(cnts)  # none on a rank that skewed routing sends nothing
    picked = {int(e) for e in pick.choice(nonempty, min(3, len(nonempty)))}
    # this rank's rows as a one-rank stack, against its own experts' weights (w1q: [EL, ...])
    refs = reference.sampled_h32(landed.values[rank:rank + 1], landed.scales[rank:rank + 1], offs,
                                 cnts, picked, w1q, 0, s.swiglu_limit)
    for e, ref in refs.items():
      _util.check_block(_util.Asserts(), got[offs[e]:offs[e] + cnts[e]], ref, "bf16",
                        f"{s.name} T={T} expert {e}")
  close(runtimes)


def run_overflow(s, T, r):
  """Part overflow: M_cap small enough that rows are dropped (on some ranks more than others):
  `overflow` is this rank's dropped rows, with global_overflow the axis's total on every rank;
  every other field is the same either way and equals the reference."""
  cap = 256
  w1q, w1s = make_w1q(s)
  runtimes = {e: with_global_overflow(runtime(e, swiglu_limit=s.swiglu_limit,
                                              max_recv_rows=cap)) for e in ENGINES}
  fns = {(e, g): stage1_fn(rt, g) for e, rt in runtimes.items() for g in (False, True)}
  for routing in ("skewed", "uniform"):
    x, ids, w = stage1_inputs(s, T, routing, r)
    args = [global_array(a) for a in (x, ids, w)]
    outs = {k: mine(f(*args, w1s)) for k, f in fns.items()}
    for rt in runtimes.values():
      rt.check()
    landed = reference_landed(s, T, x, ids, w, cap)
    dropped = np.asarray(landed.overflow)
    assert dropped.sum() > 0, f"overflow {routing}: the test's M_cap drops no row"
    for g in (False, True):
      same_bytes({e: outs[e, g] for e in ENGINES}, f"overflow {routing} global={g}")
      out = outs[ENGINES[0], g]
      for name in _util.LANDED_FIELDS:
        want = np.asarray(getattr(landed, name))[rank]
        if name == "overflow" and g:
          want = dropped.sum()
        np.testing.assert_array_equal(getattr(out, name), want,
                                      err_msg=f"overflow {routing} global={g}: {name}")
  close(runtimes)


def mid_layer():
  """The mid-size layer (H, I, E, K); on a shared GPU with E = 32 (R = 8: 4 local experts)."""
  H, I, E, K = _util.MID_LAYER
  return (H, I, 32, K) if shared_gpu else (H, I, E, K)


def layer_problem(r, T, routing):
  H, I, E, K = mid_layer()
  with jax.default_device(local):  # the same problem in every process (one seed)
    x, ids, w, w1q = _util.make_problem(r, nproc, T, H, I, E, K, routing)
    w2q = _util.make_w2q(r, E, H, I)
  args = [global_array(np.asarray(a)) for a in (x, ids, w)]
  weights = [jax.tree.map(weight_array, q) for q in (w1q, w2q)]
  return (x, ids, w, w1q, w2q), args, weights


def check_y_of_group(y, x, ids, w, w1q, w2q, cfg, T, E):
  """y [T, H] of this rank against reference.moe of its group's tokens."""
  with jax.default_device(local):
    ref = _util.reference_y(of_group(x), of_group(ids), of_group(w), w1q, w2q, R, cfg, T)
  _util.check_y(_util.Asserts(), y, ref[rank:rank + 1],
                np.asarray(ids)[pid * T:(pid + 1) * T], E)


def run_moe(T, r, iters=4):
  """Part moe: jsm.moe with engines sm and ce on the mid-size layer: y of this rank's tokens
  against reference.moe (computed here from the same seeded problem in every process), the
  engines' y byte for byte, calls back to back."""
  E = mid_layer()[2]
  runtimes = {e: runtime(e) for e in ENGINES}
  fns = {e: shard_mapped(lambda x, i, w, q1, q2, rt=rt: jsm.moe(x, (i, w), q1, q2, runtime=rt),
                        (TOK, TOK, TOK, WGT, WGT)) for e, rt in runtimes.items()}
  for it in range(iters):
    routing = ("masked", "uniform")[it % 2]
    (x, ids, w, w1q, w2q), args, weights = layer_problem(r, T, routing)
    ys = {e: np.asarray(f(*args, *weights).addressable_shards[0].data)  # [T, H] of this rank
          for e, f in fns.items()}
    for rt in runtimes.values():
      rt.check()
    same_bytes(ys, f"moe T={T} {routing}: y")
    check_y_of_group(ys[ENGINES[0]], x, ids, w, w1q, w2q, runtimes[ENGINES[0]].config, T, E)
  close(runtimes)


def run_stale(T, r):
  """Part stale: stage2 on a Stage1Output other than the latest stage1's, on every rank."""
  E = mid_layer()[2]
  runtimes = {e: runtime(e) for e in ENGINES}
  s1 = {e: stacked(lambda x, i, w, q, rt=rt: jsm.stage1(x, (i, w), q, runtime=rt))
        for e, rt in runtimes.items()}
  s2 = {e: shard_mapped(
      lambda o, q, rt=rt: jsm.stage2(jax.tree.map(lambda a: a[0], o), q, runtime=rt), (TOK, WGT))
      for e, rt in runtimes.items()}
  (x, ids, w, w1q, w2q), a_args, (w1s, w2s) = layer_problem(r, T, "uniform")
  _, b_args, _ = layer_problem(r, T, "masked")  # other rows, other routes (b's weights unused)
  ys = {}
  for e in ENGINES:
    y_of = lambda o: np.asarray(s2[e](o, w2s).addressable_shards[0].data)  # noqa: E731
    out_a = s1[e](*a_args, w1s)
    jax.block_until_ready(s1[e](*b_args, w1s))
    if e == "ce":
      try:
        y_of(out_a)
        raise AssertionError("engine ce: stage2 on an earlier Stage1Output was not refused")
      except AssertionError:
        raise
      except Exception as err:  # noqa: BLE001 (XLA's runtime error)
        assert "other than the latest stage1" in str(err), err
      runtimes[e].check()  # nothing moved: the windows are in step
      out_a = s1[e](*a_args, w1s)
      again = s1[e](*a_args, w1s)  # the same rows again: an earlier output with the same headers
      ys[e] = y_of(out_a)
      np.testing.assert_array_equal(_util.as_bytes(y_of(again)), _util.as_bytes(ys[e]),
                                    err_msg="ce: stage2 of two stage1 outputs of the same rows")
    else:
      y_stale = y_of(out_a)
      ys[e] = y_of(s1[e](*a_args, w1s))
      np.testing.assert_array_equal(_util.as_bytes(y_stale), _util.as_bytes(ys[e]),
                                    err_msg=f"{e}: stage2 on an earlier Stage1Output")
    runtimes[e].check()
  same_bytes(ys, f"stale T={T}: y")
  check_y_of_group(ys[ENGINES[0]], x, ids, w, w1q, w2q, runtimes[ENGINES[0]].config, T, E)
  close(runtimes)


def run_dispatch(s, T, r, iters=1):
  """Part dispatch (diagnostics): the engines' dispatch alone (no fused GEMM) against the
  reference layout."""
  EL = s.num_experts // R
  cap = jsm.layout.m_cap(R, T, s.topk, EL, 128)
  runtimes = {e: runtime(e) for e in ENGINES}

  def body(x, i, w, rt):
    route = primitives.route(i, R, EL)
    send = primitives.qpack(x, w, route.send_pos)
    return api.dispatch(send, route.send_counts, runtime=rt, cap=cap)
  fns = {e: stacked(lambda x, i, w, rt=rt: body(x, i, w, rt), (TOK,) * 3)
         for e, rt in runtimes.items()}
  for it in range(iters):
    routing = ("uniform", "skewed", "masked")[it % 3]
    x, ids, w = stage1_inputs(s, T, routing, r)
    outs = {e: mine(f(global_array(x), global_array(ids), global_array(w)))
            for e, f in fns.items()}
    for rt in runtimes.values():
      rt.check()
    same_bytes(outs, f"dispatch T={T} {routing}")
    landed = reference_landed(s, T, x, ids, w, cap)
    for name in _util.LANDED_FIELDS + ("values", "scales"):
      np.testing.assert_array_equal(_util.as_bytes(getattr(outs[ENGINES[0]], name)),
                                    _util.as_bytes(np.asarray(getattr(landed, name))[rank]),
                                    err_msg=name)
  close(runtimes)


def close(runtimes):
  for rt in runtimes.values():
    rt.check()
    rt.close()


try:
  jsm.Runtime(mesh, "ep", jsm.Stage1Config(engine="xla"))
  raise AssertionError("engine xla across GPU processes was not refused")
except ValueError as e:
  assert "not supported across GPU processes" in str(e), e

r = np.random.default_rng(seed)  # the same problems in every process
pick = np.random.default_rng(seed + 1 + pid)  # this rank's sampled experts
for _ in range(REPEAT):
  for part in PARTS:
    log(f"{part}: start")
    if part == "stage1":
      run(small_shape(), 128, r, iters=ITERS or (3 if shared_gpu else 20))
      if not shared_gpu:  # dsv3's windows and weights do not fit beside the test's 75% pool
        run(small_shape(), 1, r)
        run(jsm.SHAPES["dsv3"], 128, r)
        run(jsm.SHAPES["dsv3"], 4096, r)
    elif part == "overflow":
      run_overflow(small_shape(), 32, r)
    elif part == "stale":
      run_stale(64, r)
    elif part == "moe":
      run_moe(64, r, iters=ITERS or (2 if shared_gpu else 4))
    elif part == "dispatch":
      run_dispatch(small_shape(), 128, r, iters=ITERS or 3)
    else:
      raise ValueError(f"unknown part {part!r}")
    log(f"{part}: done")
print(f"OK rank {pid}", flush=True)
