"""Quick single-GPU timing of the CUDA stages (R = 1, engine local) against XLA's dense bf16
matmul of the same FLOPs; the full GPU benchmark is bench/run.py --gpu (next step)."""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm
from jax_sdma_moe import primitives

gpu = jax.devices("gpu")[0]


def bench(f, *args, n=20):
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts)) * 1e3


rows = []
for name in sys.argv[1:] or ["dsv3"]:
  s = jsm.SHAPES[name]
  E, K, H, I = s.num_experts, s.topk, s.hidden, s.intermediate
  key = jax.random.key(0)
  w1q = jax.jit(jsm.quantize_w1)(jax.random.normal(key, (E, 2 * I, H), jnp.bfloat16) * 0.02)
  for T in (128, 1024, 4096, 8192):
    r = np.random.default_rng(T)
    x = jax.device_put(jnp.asarray(r.standard_normal((T, H)), jnp.bfloat16), gpu)
    ids = jax.device_put(jnp.asarray(np.stack([r.permutation(E)[:K] for _ in range(T)]), jnp.int32), gpu)
    w = jax.device_put(jnp.asarray(r.random((T, K)), jnp.float32), gpu)
    mesh = jax.sharding.Mesh(np.array([gpu]), ("ep",))
    rt = jsm.Runtime(mesh, "ep", jsm.Stage1Config(engine="local", swiglu_limit=s.swiglu_limit))
    sm = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    cap = jsm.layout.m_cap(1, T, K, E, 128)
    stage1 = sm(lambda x, i, w, q: jsm.stage1(x, (i, w), q, runtime=rt))
    def front(x, i, w):
      route = primitives.route(i, 1, E)
      return primitives.qpack(x, w, route.send_pos), route.send_counts
    front_f = sm(front)
    send, counts = front_f(x, ids, w)
    disp_f = sm(lambda s, c: jsm.api.dispatch(s, c, runtime=rt, cap=cap))
    landed = disp_f(send, counts)
    gemm_f = sm(lambda l, q: primitives.gemm1(l.values, l.scales, l.expert_offsets, l.expert_counts,
                                              q, swiglu_limit=s.swiglu_limit, out_dtype="bf16"))
    t_s1, t_front, t_disp, t_gemm = (bench(stage1, x, ids, w, w1q), bench(front_f, x, ids, w),
                                     bench(disp_f, send, counts), bench(gemm_f, landed, w1q))
    flops = 2.0 * T * K * H * 2 * I
    a = jnp.ones((T * K, H), jnp.bfloat16)
    b = jax.random.normal(key, (H, 2 * I), jnp.bfloat16)
    t_dense = bench(jax.jit(lambda a, b: a @ b), a, b)
    qbytes = T * H * 2 + T * K * (H + H // 32 + 12)
    rows.append((name, T, t_s1, t_front, qbytes / t_front / 1e6, t_disp, t_gemm, flops / t_gemm / 1e9,
                 t_dense, flops / t_dense / 1e9))
    print(rows[-1], flush=True)
print(f"{'shape':6} {'T':>5} {'stage1':>8} {'rt+qpack':>8} {'GB/s':>6} {'disp':>7} {'gemm1':>8} "
      f"{'TFLOP/s':>8} {'bf16 mm':>8} {'TFLOP/s':>8}")
for r in rows:
  print(f"{r[0]:6} {r[1]:5d} {r[2]:8.3f} {r[3]:8.3f} {r[4]:6.0f} {r[5]:7.3f} {r[6]:8.3f} {r[7]:8.0f} "
        f"{r[8]:8.3f} {r[9]:8.0f}")
