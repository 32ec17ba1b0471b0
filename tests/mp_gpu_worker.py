"""One process of a two-process GPU run (the `mpirun -n R` launch mode), started by
test_multigpu.py, JAX using one GPU each: python mp_gpu_worker.py PROCESS_ID NUM_PROCESSES PORT
SEED [GPU] (GPU: the CUDA device of this process, PROCESS_ID by default; test_cuda.py puts both
ranks on GPU 0, which checks the protocol's bytes on a one-GPU machine: CUDA IPC opens a window of
the same device from another process, and the two processes' kernels take turns on it; there only
the small shapes run, beside the test process's memory pool). Each process holds one rank;
engines ce and sm must land the same bytes on it, equal to the reference layout with h of sampled
experts within §3, and 20 back-to-back calls per engine stay correct; jsm.moe with engines sm and
ce (their combines through the IPC-opened windows) matches the reference on this rank's tokens in
back-to-back calls, byte for byte between the engines; engine xla is refused with a clear error.
Prints 'OK rank N' on success."""
import os
import sys

pid, nproc, port, seed = (int(a) for a in sys.argv[1:5])
shared_gpu = len(sys.argv) > 5  # GPU given: every rank on that one GPU, the small shapes only
gpu = int(sys.argv[5]) if shared_gpu else pid

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
from jax_sdma_moe import reference  # noqa: E402

R = nproc
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
spec = NamedSharding(mesh, P("ep"))
local = jax.local_devices()[0]


def global_array(host):
  """[R * n, ...] on the host -> the global array whose rank-pid shard is this process's part."""
  host = np.asarray(host)
  n = host.shape[0] // R
  return jax.make_array_from_process_local_data(spec, host[pid * n:(pid + 1) * n])


def mine(tree):
  return jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data)[0], tree)


def run(shape_name, T, r, iters=1):
  s = jsm.SHAPES[shape_name]
  E, K, EL = s.num_experts, s.topk, s.num_experts // R
  # each process makes only its own experts' weights, on its GPU (dsv3's whole w1 is 7.5 GB)
  with jax.default_device(local):
    w1 = jax.random.normal(jax.random.fold_in(jax.random.key(seed), pid),
                           (EL, 2 * s.intermediate, s.hidden), jnp.bfloat16
                           ) * jnp.bfloat16(1.0 / np.sqrt(s.hidden))
    w1q = jax.block_until_ready(jax.jit(jsm.quantize_w1)(w1))  # experts pid * EL ... + EL - 1
    del w1
  w1s = jax.tree.map(lambda a: jax.make_array_from_single_device_arrays(
      (R * a.shape[0], *a.shape[1:]), spec, [a]), w1q)
  runtimes = {e: jsm.Runtime(mesh, "ep", jsm.Stage1Config(engine=e, swiglu_limit=s.swiglu_limit))
              for e in ("ce", "sm")}
  fns = {e: jax.jit(jax.shard_map(
      lambda x, i, w, q, rt=rt: jax.tree.map(lambda a: a[None], jsm.stage1(x, (i, w), q, runtime=rt)),
      mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))) for e, rt in runtimes.items()}
  for it in range(iters):
    routing = ("uniform", "skewed", "masked")[it % 3]
    x = np.asarray(jnp.asarray(r.standard_normal((R * T, s.hidden)), jnp.bfloat16))
    ids = np.asarray(_util.make_ids(r, R, T, K, E, routing))
    w = r.random((R * T, K)).astype(np.float32)
    outs = {e: mine(f(global_array(x), global_array(ids), global_array(w), w1s))
            for e, f in fns.items()}
    for rt in runtimes.values():  # an expired wait names itself before the bytes are compared
      rt.check()
    for name, a, b in zip(outs["ce"]._fields, outs["ce"], outs["sm"]):
      np.testing.assert_array_equal(_util.as_bytes(a), _util.as_bytes(b),
                                    err_msg=f"{shape_name} T={T} {routing}: {name} ce vs sm")
    cap = jsm.layout.m_cap(R, T, K, EL, 128)
    with jax.default_device(local):
      landed = jax.jit(reference.dispatch, static_argnums=(3, 4, 5))(
          jax.tree.map(lambda a: a.reshape(R, T, *a.shape[1:]), jsm.quantize(jnp.asarray(x))),
          jnp.asarray(ids).reshape(R, T, K), jnp.asarray(w).reshape(R, T, K), E, 128, cap)
      out = outs["ce"]
      for name in _util.LANDED_FIELDS:
        np.testing.assert_array_equal(getattr(out, name), np.asarray(getattr(landed, name))[pid],
                                      err_msg=name)
      offs, cnts = out.expert_offsets, out.expert_counts
      got = np.asarray(out.h, np.float32)
      nonempty = np.flatnonzero(cnts)  # none on a rank that skewed routing sends nothing
      picked = {int(e) for e in pick.choice(nonempty, min(3, len(nonempty)))}
      # this rank's rows as a one-rank stack, against its own experts' weights (w1q: [EL, ...])
      refs = reference.sampled_h32(landed.values[pid:pid + 1], landed.scales[pid:pid + 1], offs,
                                   cnts, picked, w1q, 0, s.swiglu_limit)
      for e, ref in refs.items():
        _util.check_block(_util.Asserts(), got[offs[e]:offs[e] + cnts[e]], ref, "bf16",
                          f"{shape_name} T={T} expert {e}")
  for rt in runtimes.values():
    rt.check()
    rt.close()


def run_moe(T, r, iters=4):
  """jsm.moe with engines sm and ce on the mid-size layer: y of this rank's tokens against
  reference.moe (computed here from the same seeded problem in every process), the engines' y
  byte for byte, calls back to back."""
  H, I, E, K = _util.MID_LAYER
  runtimes = {e: jsm.Runtime(mesh, "ep", jsm.Stage1Config(engine=e)) for e in ("sm", "ce")}
  fns = {e: jax.jit(jax.shard_map(
      lambda x, i, w, q1, q2, rt=rt: jsm.moe(x, (i, w), q1, q2, runtime=rt),
      mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))) for e, rt in runtimes.items()}
  for it in range(iters):
    routing = ("masked", "uniform")[it % 2]
    with jax.default_device(local):  # the same problem in every process (one seed)
      x, ids, w, w1q = _util.make_problem(r, R, T, H, I, E, K, routing)
      w2q = _util.make_w2q(r, E, H, I)
      ref = _util.reference_y(x, ids, w, w1q, w2q, R, runtimes["sm"].config, T)
    args = [global_array(np.asarray(a)) for a in (x, ids, w)]
    weights = [jax.tree.map(lambda a: global_array(np.asarray(a)), q) for q in (w1q, w2q)]
    ys = {e: np.asarray(f(*args, *weights).addressable_shards[0].data)  # [T, H] of this rank
          for e, f in fns.items()}
    for rt in runtimes.values():
      rt.check()
    np.testing.assert_array_equal(_util.as_bytes(ys["ce"]), _util.as_bytes(ys["sm"]),
                                  err_msg=f"moe T={T} {routing}: y of ce vs sm")
    _util.check_y(_util.Asserts(), ys["sm"], ref[pid:pid + 1],
                  np.asarray(ids)[pid * T:(pid + 1) * T], E)
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
run("small", 128, r, iters=20)
run("small", 1, r)
if not shared_gpu:  # dsv3's windows and weights do not fit beside the test process's 75% pool
  run("dsv3", 128, r)
  run("dsv3", 4096, r)
run_moe(64, r)
print(f"OK rank {pid}", flush=True)
