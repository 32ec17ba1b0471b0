"""One gemm1 launch at a benchmark shape (R = 1, bf16 out), the target of Nsight Compute in
bench/device/profile_gemm1.sh:
  ncu -k regex:gemm1 --launch-count 1 --set full python3 bench/gemm1_profile.py dsv3 4096

The rows are landed by reference.dispatch (no dispatch kernel runs), so the only CUDA kernels
launched are the quantisation's and this gemm1."""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdma_moe as jsm
from jax_sdma_moe import layout, primitives, reference

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("shape", nargs="?", default="dsv3", help="a jax_sdma_moe.SHAPES name")
p.add_argument("tokens", nargs="?", type=int, default=4096)
p.add_argument("--row-align", type=int, default=128)
a = p.parse_args()

s, T = jsm.SHAPES[a.shape], a.tokens
E, K, H, I = s.num_experts, s.topk, s.hidden, s.intermediate
rng = np.random.default_rng(0)
w1q = jax.jit(jsm.quantize_w1)(
    jax.random.normal(jax.random.key(0), (E, 2 * I, H), jnp.bfloat16) * 0.02)
x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(T)]), jnp.int32)
cap = layout.m_cap(1, T, K, E, a.row_align)
landed = jax.jit(reference.dispatch, static_argnums=(3, 4, 5))(
    jax.tree.map(lambda t: t[None], jsm.quantize(x)), ids[None], jnp.ones((1, T, K)), E,
    a.row_align, cap)
options = primitives.Gemm1Options(swiglu_limit=s.swiglu_limit, out_dtype="bf16")
gemm1 = jax.jit(lambda v, sc, o, c, w: primitives.gemm1(v, sc, o, c, w, options=options))
h = jax.block_until_ready(gemm1(landed.values[0], landed.scales[0], landed.expert_offsets[0],
                                landed.expert_counts[0], w1q))
print(f"gemm1 done: {a.shape} T={T}, h {h.shape} {h.dtype}")
