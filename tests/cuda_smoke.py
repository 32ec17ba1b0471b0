"""A small end-to-end CUDA Stage1 (R = 1) for compute-sanitizer: every kernel runs once on odd
sizes (H and I not multiples of the tiles, T not a multiple of anything)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm

gpu = jax.devices("gpu")[0]
r = np.random.default_rng(0)
T, H, I, E, K = 37, 224, 96, 12, 3
x = jax.device_put(jnp.asarray(r.standard_normal((T, H)), jnp.bfloat16), gpu)
ids = jax.device_put(jnp.asarray(np.stack([r.permutation(E)[:K] for _ in range(T)]), jnp.int32), gpu)
w = jax.device_put(jnp.asarray(r.random((T, K)), jnp.float32), gpu)
w1q = jsm.quantize_w1(jax.device_put(jnp.asarray(r.standard_normal((E, 2 * I, H)), jnp.bfloat16), gpu))
mesh = jax.sharding.Mesh(np.array([gpu]), ("ep",))
for out_dtype in ("bf16", "mxfp8"):
  rt = jsm.Runtime(mesh, "ep", jsm.Stage1Config(engine="local", row_align=16, out_dtype=out_dtype))
  f = jax.jit(jax.shard_map(lambda x, i, w, q: jsm.stage1(x, (i, w), q, runtime=rt, check=True),
                            mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
  out = jax.block_until_ready(f(x, ids, w, w1q))
  print(out_dtype, "rows", int(out.num_rows), "overflow", int(out.overflow))
