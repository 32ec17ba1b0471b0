"""A small end-to-end CUDA Stage1 (R = 1) for compute-sanitizer: every kernel runs once on odd
sizes (I not a multiple of the tiles, T not a multiple of anything), with H = 224 (gemm1 v2, any
H % 32 == 0) and H = 256 (the default warp-specialised gemm1 with TMA, H % 128 == 0)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm

gpu = jax.devices("gpu")[0]
seed = int(np.random.SeedSequence().entropy % 2**31)
print("seed", seed)
r = np.random.default_rng(seed)
T, I, E, K = 37, 96, 12, 3
mesh = jax.sharding.Mesh(np.array([gpu]), ("ep",))
for H in (224, 256):
  x = jax.device_put(jnp.asarray(r.standard_normal((T, H)), jnp.bfloat16), gpu)
  ids = jax.device_put(jnp.asarray(np.stack([r.permutation(E)[:K] for _ in range(T)]), jnp.int32),
                       gpu)
  w = jax.device_put(jnp.asarray(r.random((T, K)), jnp.float32), gpu)
  w1q = jsm.quantize_w1(jax.device_put(jnp.asarray(r.standard_normal((E, 2 * I, H)), jnp.bfloat16),
                                       gpu))
  for out_dtype in ("bf16", "mxfp8"):
    config = jsm.Stage1Config(engine="local", row_align=16, out_dtype=out_dtype)
    rt = jsm.Runtime(mesh, "ep", config)
    f = jax.jit(jax.shard_map(lambda x, i, w, q: jsm.stage1(x, (i, w), q, runtime=rt, check=True),
                              mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    out = jax.block_until_ready(f(x, ids, w, w1q))
    rows, overflow = int(out.num_rows), int(out.overflow)
    print("H", H, out_dtype, "rows", rows, "overflow", overflow)
    assert rows == T * K and overflow == 0
