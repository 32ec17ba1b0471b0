"""One process of a multi-process Stage1 run on CPU (jax.distributed + gloo), started by
test_multiprocess.py: python mp_worker.py PROCESS_ID NUM_PROCESSES PORT SEED. Each process holds one
rank, runs stage1 with engine xla on the global mesh and checks its own rank against the reference
of the whole problem (computed locally from the same seed): the layout exactly, h within DESIGN.md
§3 (the reference sums in another order: a bf16 value may round the other way). Exit 0 and 'OK'
on success."""
import os
import sys

pid, nproc, port, seed = (int(a) for a in sys.argv[1:5])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402

R, T, H, I, E, K = nproc, 24, 128, 64, 4 * nproc, 3
r = np.random.default_rng(seed)
x = r.standard_normal((R, T, H)).astype(np.float32)
ids = np.stack([r.permutation(E)[:K] for _ in range(R * T)]).reshape(R, T, K).astype(np.int32)
ids[r.random(ids.shape) < 0.2] = -1
w = r.random((R, T, K)).astype(np.float32)
w1 = (r.standard_normal((E, 2 * I, H)) * 0.1).astype(np.float32)
with jax.default_device(jax.local_devices()[0]):
  x_bf = jnp.asarray(x, jnp.bfloat16)
  w1q = jsm.quantize_w1(jnp.asarray(w1, jnp.bfloat16))
  cfg = jsm.Stage1Config(engine="xla", row_align=16)
  cap = jsm.layout.m_cap(R, T, K, E // R, cfg.row_align)
  ref, h32 = jsm.reference.stage1(x_bf, jnp.asarray(ids), jnp.asarray(w), w1q, row_align=16,
                                  cap=cap, return_f32=True)

mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
spec = NamedSharding(mesh, P("ep"))
EL = E // R
xs = jax.make_array_from_process_local_data(spec, np.asarray(x_bf)[pid])
idss = jax.make_array_from_process_local_data(spec, ids[pid])
ws = jax.make_array_from_process_local_data(spec, w[pid])
w1s = jax.tree.map(lambda a: jax.make_array_from_process_local_data(
    spec, np.asarray(a)[pid * EL:(pid + 1) * EL]), w1q)
try:
  jsm.Runtime(mesh, "ep", jsm.Stage1Config(engine="cpu"))
  raise SystemExit("engine cpu across processes must be refused")
except ValueError as e:
  assert "spans several processes" in str(e), e
rt = jsm.Runtime(mesh, "ep", cfg)
assert jsm.Runtime(mesh, "ep").engine.name == "xla"
f = jax.jit(jax.shard_map(
    lambda x, i, w, q: jax.tree.map(lambda a: a[None], jsm.stage1(x, (i, w), q, runtime=rt)),
    mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
out = f(xs, idss, ws, w1s)
mine = jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data)[0], out)
for name in _util.LAYOUT_FIELDS:
  np.testing.assert_array_equal(getattr(mine, name), np.asarray(getattr(ref, name))[pid], name)
_util.check_h(_util.Asserts(), mine.h[None], mine.expert_offsets[None], mine.expert_counts[None],
              np.asarray(h32)[pid:pid + 1], "bf16")
print(f"OK rank {pid}: {int(mine.num_rows)} rows", flush=True)
