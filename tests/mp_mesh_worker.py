"""One process of a multi-process run on a (dp, ep) mesh on CPU (jax.distributed + gloo), started
by test_multiprocess.py: python mp_mesh_worker.py PROCESS_ID NUM_PROCESSES PORT SEED. Each process
holds 4 CPU devices: one EP group of the mesh (dp = NUM_PROCESSES across the processes, ep = 4
inside each). With the default engine (cpu: every group within one process) it runs stage1 and
moe, and checks its own group against the references of that group's tokens (computed locally
from the same seed); a mesh whose groups span the processes gets engine xla and refuses engine
cpu. Exit 0 and 'OK' on success."""
import os
import sys

pid, nproc, port, seed = (int(a) for a in sys.argv[1:5])
EP = 4
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={EP}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402

T, H, I, E, K = 16, 64, 32, 8, 3
N = nproc * EP
devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
explicit = (jax.sharding.AxisType.Explicit,) * 2
mesh = jax.sharding.Mesh(devices.reshape(nproc, EP), ("dp", "ep"), axis_types=explicit)

r = np.random.default_rng(seed)
with jax.default_device(jax.local_devices()[0]):
  x, ids, w, w1q = _util.make_problem(r, N, T, H, I, E, K, "masked")
  w2q = _util.make_w2q(r, E, H, I)
  x, ids, w = (np.asarray(a) for a in (x, ids, w))

# a group spanning the processes: engine cpu refused, the default is xla
across = jax.sharding.Mesh(devices.reshape(nproc, EP), ("ep", "dp"), axis_types=explicit)
try:
  jsm.Runtime(across, "ep", jsm.Stage1Config(engine="cpu"))
  raise SystemExit("engine cpu must be refused where a group spans processes")
except ValueError as e:
  assert "spans several processes" in str(e), e
with jsm.Runtime(across, "ep") as rt:
  assert rt.engine.name == "xla", rt.engine.name

rt = jsm.Runtime(mesh, "ep", jsm.Stage1Config(row_align=8, timeout_s=60.0))
assert rt.engine.name == "cpu", rt.engine.name
assert rt.num_groups == nproc and rt.groups_local
cfg = rt.config
rows = NamedSharding(mesh, P(mesh.axis_names))
mine = slice(pid * EP * T, (pid + 1) * EP * T)  # this process's devices: group pid, ranks in order
put = lambda a: jax.make_array_from_process_local_data(rows, a[mine])
wspec = NamedSharding(mesh, P("ep"))
putw = lambda tree: jax.tree.map(lambda a: jax.make_array_from_process_local_data(
    wspec, np.asarray(a)), tree)


def body(x, i, w, a, b):
  out1 = jsm.stage1(x, (i, w), a, runtime=rt)
  return jax.tree.map(lambda v: v[None], out1), jsm.moe(x, (i, w), a, b, runtime=rt)


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(mesh.axis_names),) * 3 + (P("ep"),) * 2,
                          out_specs=P(mesh.axis_names)))
out1, y = f(put(x), put(ids), put(w), putw(w1q), putw(w2q))


def local(a):
  """This process's rows of a P(("dp", "ep")) output, in device order."""
  shards = sorted(a.addressable_shards, key=lambda s: s.index[0].start)
  return np.concatenate([np.asarray(s.data) for s in shards])


out1, y = jax.tree.map(local, out1), local(y)
with jax.default_device(jax.local_devices()[0]):
  ref, h32 = _util.reference(x[mine], ids[mine], w[mine], w1q, EP, cfg, T)
  _util.check_stage1(_util.Asserts(), out1, ref, h32, cfg.out_dtype)
  want = _util.reference_y(x[mine], ids[mine], w[mine], w1q, w2q, EP, cfg, T)
  _util.check_y(_util.Asserts(), y, want, ids[mine], E)
rt.close()
print(f"OK rank {pid}: group {pid}, {int(out1.num_rows.sum())} rows", flush=True)
