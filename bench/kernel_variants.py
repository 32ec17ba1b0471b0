"""The CUDA kernel variants side by side on one GPU (R = 1), for choosing defaults:
  python3 bench/kernel_variants.py [--shapes dsv3] [--tokens 128,4096] [--gemm1 ws,wgmma]

Each gemm1 variant (JSM_GEMM1, read per call by the handler) runs on the same landed rows; its h
must match the first variant's within the §3 tolerance (every row, every column) before it is
timed, and its worst relative error (Frobenius, §3 bound 4e-3) over a sample of experts against
reference.sampled_h32 is printed. The timing ablations 'ws-no*' leave a part of the kernel out
(wrong results, only timed). The route variants (JSM_ROUTE) must produce identical counts and
positions. Prints one table: median ms over --iters calls and useful TFLOP/s."""
import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdma_moe as jsm
from jax_sdma_moe import layout, primitives, reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import time_calls  # noqa: E402  (bench/run.py: one timing protocol)


def median_ms(fn, args, iters):
  return time_calls(fn, args, iters, warmup=1)["median_ms"]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", default="dsv3")
  p.add_argument("--tokens", default="128,4096,8192")
  p.add_argument("--gemm1", default="ws,ws-ksplit,wgmma,ws-nopromote,ws-nomma,ws-noload,ws-noscale",
                 help="JSM_GEMM1 values; the first is the reference for the others' values; "
                      "'ws-no*' are timing ablations (a part left out: wrong results, not checked)")
  p.add_argument("--route", default="warp,blocks")
  p.add_argument("--iters", type=int, default=10)
  a = p.parse_args()
  rows = []

  def emit(row):  # printed as it comes (a device call cut short keeps what ran), table at the end
    rows.append(row)
    print("- " + " ".join(str(c) for c in row), flush=True)

  for name in a.shapes.split(","):
    s = jsm.SHAPES[name]
    E, K, H, I = s.num_experts, s.topk, s.hidden, s.intermediate
    w1q = jax.jit(jsm.quantize_w1)(
        jax.random.normal(jax.random.key(1), (E, 2 * I, H), jnp.bfloat16) * 0.02)
    for T in (int(t) for t in a.tokens.split(",")):
      r = np.random.default_rng(T)
      x = jnp.asarray(r.standard_normal((T, H)), jnp.bfloat16)
      ids = jnp.asarray(np.stack([r.permutation(E)[:K] for _ in range(T)]), jnp.int32)
      weights = jnp.asarray(r.random((T, K)), jnp.float32)
      cap = layout.m_cap(1, T, K, E, 128)

      route_qpack = jax.jit(lambda x, ids, w: (lambda rt: (
          rt, primitives.qpack(x, w, rt.send_pos)))(primitives.route(ids, 1, E)))
      first = None
      for v in a.route.split(","):
        os.environ["JSM_ROUTE"] = v
        out = jax.device_get(route_qpack(x, ids, weights))
        if first is None:
          first = out
        else:
          for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(first)):
            np.testing.assert_array_equal(np.atleast_1d(got).view(np.uint8),
                                          np.atleast_1d(want).view(np.uint8))
        ms = median_ms(route_qpack, (x, ids, weights), a.iters)
        emit((name, T, f"route={v}+qpack", ms, "", ""))
      os.environ.pop("JSM_ROUTE")

      landed = jax.jit(reference.dispatch, static_argnums=(3, 4, 5))(
          jax.tree.map(lambda t: t[None], jsm.quantize(x)), ids[None], weights[None], E, 128, cap)
      args = (landed.values[0], landed.scales[0], landed.expert_offsets[0],
              landed.expert_counts[0], w1q)
      gemm1 = jax.jit(lambda v, sc, o, c, q: primitives.gemm1(
          v, sc, o, c, q, swiglu_limit=s.swiglu_limit, out_dtype="bf16"))
      flops = 2.0 * T * K * H * 2 * I
      offs, cnts = np.asarray(landed.expert_offsets[0]), np.asarray(landed.expert_counts[0])
      nonempty = np.flatnonzero(cnts)
      picks = sorted({int(nonempty[0]), int(nonempty[-1]), int(np.argmax(cnts))}
                     | {int(e) for e in r.choice(nonempty, 3, replace=False)})
      refs = reference.sampled_h32(landed.values, landed.scales, offs, cnts, picks, w1q, 0,
                                   s.swiglu_limit)
      base = None
      for v in a.gemm1.split(","):
        os.environ["JSM_GEMM1"] = v
        h = np.asarray(jax.device_get(gemm1(*args)), np.float32)
        if "-no" in v:  # an ablation: only its time means something
          ms = median_ms(gemm1, args, a.iters)
          emit((name, T, f"gemm1 {v}", ms, f"{flops / ms / 1e9:.0f}", "ablation"))
          continue
        if base is None:
          base = h
        else:
          err = np.abs(h - base)
          tol = 2e-2 * np.abs(base) + 1e-2 * float(np.abs(base).max())
          bad = int((err > tol).sum())
          if bad:  # reported in the table, not timed: the other variants still run
            emit((name, T, f"gemm1 {v} WRONG", float("nan"), f"{bad}/{err.size} bad",
                  f"{err.max():.2g}"))
            continue
        rel = max(np.linalg.norm(h[offs[e]:offs[e] + cnts[e]] - ref) / np.linalg.norm(ref)
                  for e, ref in refs.items())
        ms = median_ms(gemm1, args, a.iters)
        emit((name, T, f"gemm1 {v}", ms, f"{flops / ms / 1e9:.0f}", f"{rel:.1e}"))
      os.environ.pop("JSM_GEMM1")
  print(f"{'shape':6} {'T':>5} {'what':22} {'ms':>8} {'TFLOP/s':>8} {'rel err':>8}")
  for name, T, what, ms, tf, rel in rows:
    print(f"{name:6} {T:5d} {what:22} {ms:8.3f} {tf:>8} {rel:>8}")


if __name__ == "__main__":
  main()
