"""One gemm1 launch at a benchmark shape (R = 1), for ncu:
  ncu --kernel-name regex:gemm1_kernel --launch-count 1 python3 bench/gemm1_profile.py dsv3 4096"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdma_moe as jsm
from jax_sdma_moe import primitives, reference

name, T = (sys.argv[1:] + ["dsv3", "4096"])[:2]
s, T = jsm.SHAPES[name], int(T)
E, K, H, I = s.num_experts, s.topk, s.hidden, s.intermediate
r = np.random.default_rng(0)
w1q = jax.jit(jsm.quantize_w1)(jax.random.normal(jax.random.key(0), (E, 2 * I, H), jnp.bfloat16) * 0.02)
x = jnp.asarray(r.standard_normal((T, H)), jnp.bfloat16)
ids = jnp.asarray(np.stack([r.permutation(E)[:K] for _ in range(T)]), jnp.int32)
cap = jsm.layout.m_cap(1, T, K, E, 128)
landed = jax.jit(reference.dispatch, static_argnums=(3, 4, 5))(
    jax.tree.map(lambda a: a[None], jsm.quantize(x)), ids[None], jnp.ones((1, T, K)), E, 128, cap)
f = jax.jit(lambda v, sc, o, c, q: primitives.gemm1(v, sc, o, c, q, swiglu_limit=s.swiglu_limit,
                                                    out_dtype="bf16"))
h = jax.block_until_ready(f(landed.values[0], landed.scales[0], landed.expert_offsets[0],
                            landed.expert_counts[0], w1q))
print("gemm1 done", h.shape)
