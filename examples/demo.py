"""Demo: Stage1 of the `small` MoE shape on 8 virtual CPU devices with both CPU engines, checked
against the jnp reference. Run: python examples/demo.py [--tokens 64]"""
import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
  ap.add_argument("--shape", default="small", choices=sorted(jsm.SHAPES))
  args = ap.parse_args()
  shape, T = jsm.SHAPES[args.shape], args.tokens
  R = len(jax.devices())
  H, I, E, K = shape.hidden, shape.intermediate, shape.num_experts, shape.topk
  mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
  rng = np.random.default_rng()
  x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
  ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(R * T)]), jnp.int32)
  weights = jnp.asarray(rng.dirichlet(np.ones(K), R * T), jnp.float32)
  w1 = jnp.asarray(rng.standard_normal((E, 2 * I, H)) / np.sqrt(H), jnp.bfloat16)
  w1q = jsm.quantize_w1(w1)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))

  print(f"jax {jax.__version__}, {R} x {jax.devices()[0].platform} devices; shape {shape.name}: "
        f"T={T}/rank H={H} I={I} E={E} K={K}")
  outs = {}
  for engine in ("cpu", "xla"):
    cfg = jsm.Stage1Config(engine=engine, swiglu_limit=shape.swiglu_limit)
    with jsm.Runtime(mesh, "ep", cfg) as rt:
      f = jax.jit(jax.shard_map(
          lambda x, i, w, wq: jax.tree.map(lambda a: a[None], jsm.stage1(x, (i, w), wq, runtime=rt)),
          mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
      out = jax.block_until_ready(f(put(x), put(ids), put(weights), rt.shard_w1(w1q)))
      t0 = time.perf_counter()
      for _ in range(5):
        jax.block_until_ready(f(put(x), put(ids), put(weights), rt.shard_w1(w1q)))
      outs[engine] = (out, (time.perf_counter() - t0) / 5 * 1e3)

  cap = jsm.layout.m_cap(R, T, K, E // R, cfg.row_align)
  ref, h32 = jsm.reference.stage1(x.reshape(R, T, H), ids.reshape(R, T, K), weights.reshape(R, T, K),
                                  w1q, row_align=cfg.row_align, cap=cap,
                                  swiglu_limit=shape.swiglu_limit, return_f32=True)
  ok = True
  for engine, (out, ms) in outs.items():
    layout_ok = all(np.array_equal(np.asarray(getattr(out, f)), np.asarray(getattr(ref, f)))
                    for f in ("expert_offsets", "expert_counts", "src_rank", "src_token",
                              "topk_slot", "topk_weight", "num_rows", "overflow"))
    h = np.asarray(out.h, np.float32)
    rel = np.linalg.norm(h - np.asarray(h32)) / np.linalg.norm(np.asarray(h32))
    good = layout_ok and rel <= 4e-3
    ok &= good
    print(f"  engine {engine:>3}: {ms:7.1f} ms/call  rows landed {int(np.asarray(out.num_rows).sum()):6d} "
          f"(M_cap {cap}/rank)  layout {'==' if layout_ok else '!='} reference  "
          f"||h-ref||/||ref|| = {rel:.2e}  {'OK' if good else 'FAIL'}")
  same = np.array_equal(np.asarray(outs["cpu"][0].h).view(np.uint16),
                        np.asarray(outs["xla"][0].h).view(np.uint16))
  print(f"  cpu and xla engines byte-identical: {same}")
  ok &= same
  print("PASS" if ok else "FAIL")
  raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
  main()
