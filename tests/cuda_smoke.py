"""A small end-to-end CUDA Stage1 and MoE layer (R = 1) for compute-sanitizer: every kernel runs
once on odd sizes (T not a multiple of anything, I not a multiple of the column tiles), on each
GEMM route: H = 224 (the mma.sync kernel, any H % 32 == 0), H = 256 (the fp8 warp-specialised
kernel with TMA, H % 128 == 0), H = 512 (the bf16 wgmma kernel, H % 512 == 0 and I % 64 == 0) with
a few rows per expert (its 32-token tile), ~140 (most experts' last full tile and tail in its wide
152-token tile), hundreds (its 128-token tile; GEMM2 on the same kernel where I % 256 == 0) and
~2350 (on 132 SMs, the 128-token tiles end in a partial wave, run in 32-token units),
each with bf16 and MX-fp8 Stage1 output; on the 16-bit kernel also weights whose scales are all
below f16's own range (the f16 pass in each row's window), and weights whose rows' first blocks lie
outside their windows, so the bf16 pass redoes every expert."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm

gpu = jax.devices("gpu")[0]
seed = int(np.random.SeedSequence().entropy % 2**31)
print("seed", seed)
r = np.random.default_rng(seed)
mesh = jax.sharding.Mesh(np.array([gpu]), ("ep",))


def put(a, dtype):
  return jax.device_put(jnp.asarray(a, dtype), gpu)


CASES = ((37, 224, 96, 12, 3), (37, 256, 96, 12, 3), (37, 512, 192, 12, 3), (281, 512, 256, 4, 2),
         (515, 512, 256, 4, 2), (4700, 512, 256, 4, 2))
for T, H, I, E, K in CASES:
  x = put(r.standard_normal((T, H)), jnp.bfloat16)
  ids = put(np.stack([r.permutation(E)[:K] for _ in range(T)]), jnp.int32)
  w = put(r.random((T, K)), jnp.float32)
  w1 = put(r.standard_normal((E, 2 * I, H)), jnp.bfloat16)
  w1q = jsm.quantize_w1(w1)
  w2q = jsm.quantize_w2(put(r.standard_normal((E, H, I)) * 0.05, jnp.bfloat16))
  for out_dtype in ("bf16", "mxfp8"):
    config = jsm.Stage1Config(engine="local", row_align=16, out_dtype=out_dtype)
    rt = jsm.Runtime(mesh, "ep", config)
    f = jax.jit(jax.shard_map(lambda x, i, w, q: jsm.stage1(x, (i, w), q, runtime=rt, check=True),
                              mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    out = jax.block_until_ready(f(x, ids, w, w1q))
    rows, overflow = int(out.num_rows), int(out.overflow)
    print("H", H, "I", I, "T", T, out_dtype, "rows", rows, "overflow", overflow)
    assert rows == T * K and overflow == 0
    if H % 512 == 0 and out_dtype == "bf16":
      # scale bytes ~30 below f16's own range: the f16 pass, each row in its window
      tiny = jax.block_until_ready(f(x, ids, w, jsm.quantize_w1(w1 * 2.0**-30)))
      # each row's first block 2^-30 below its others, outside the window: the bf16 pass
      split = jsm.quantize_w1(w1.at[:, :, :32].multiply(2.0**-30))
      redo = jax.block_until_ready(f(x, ids, w, split))
      print("  windows: rows", int(tiny.num_rows), "; bf16 pass: rows", int(redo.num_rows))
    if H % 512 == 0:  # the layer: GEMM2 and the combine
      layer = jax.jit(jax.shard_map(
          lambda x, i, w, q1, q2: jsm.moe(x, (i, w), q1, q2, runtime=rt, check=True),
          mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
      y = np.asarray(jax.block_until_ready(layer(x, ids, w, w1q, w2q)), np.float32)
      print("  moe y", y.shape, "finite", bool(np.isfinite(y).all()))
      assert y.shape == (T, H) and np.isfinite(y).all()
