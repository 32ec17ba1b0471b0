"""A small MoE model block on an expert-parallel mesh — router logits -> top-k -> jsm.moe ->
residual, all inside one shard_map — checked against a dense jnp computation of the same block
(every token through every expert, weighted by its router's top-k).

Runs on 8 virtual CPU devices, and first on the GPUs when there are some (the default engine:
`local` on one GPU, `sm` on several; where a part of Stage2 is not built for the platform, the run
says what is missing and goes on with the CPU devices). Run:
python examples/moe_block.py [--tokens 32] [--platform cpu]
"""
import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402
from jax_sdma_moe import reference  # noqa: E402

HIGHEST = lax.Precision.HIGHEST
# DESIGN.md §3 (Stage2): the layer against a float32 computation of the same arithmetic
REL_TOL, MAX_TOL = 1e-2, 3e-2


def route(x, w_router, K):
  """The router: softmax over the experts' logits, the top K, their weights renormalised."""
  logits = jnp.dot(x, w_router, precision=HIGHEST, preferred_element_type=jnp.float32)
  weights, ids = lax.top_k(jax.nn.softmax(logits, axis=-1), K)
  return ids, weights / weights.sum(-1, keepdims=True)


def block(x, w_router, w1q, w2q, *, rt, K):
  """One rank's block: x [T, H] bf16 -> (x + MoE(x) [T, H] bf16, MoE(x), the router's ids)."""
  ids, weights = route(x, w_router, K)
  y = jsm.moe(x, (ids, weights), w1q, w2q, runtime=rt)
  return x + y, y, ids


def dense_block(x, w_router, w1q, w2q, *, K, swiglu_limit):
  """The same block on all tokens at once, dense over the experts, in float32 from the same
  MX-fp8 values: q(x) through every expert's GEMM1 + SwiGLU, h rounded to bf16 and quantised
  along I, GEMM2, then each token's sum over its top-k experts. Returns (x + y, y, ids)."""
  ids, weights = route(x, w_router, K)
  E = w1q.values.shape[0]
  combine = jnp.sum(jax.nn.one_hot(ids, E) * weights[..., None], axis=1)         # [N, E]
  xq = reference.dequantize(*reference.quantize(x))
  gu = jnp.einsum("nh,eih->nei", xq, reference.dequantize(*w1q), precision=HIGHEST)
  I = gu.shape[-1] // 2
  h = reference.swiglu(gu[..., :I], gu[..., I:], swiglu_limit).astype(jnp.bfloat16)
  hq = reference.dequantize(*reference.quantize(h))
  y_e = jnp.einsum("nei,ehi->neh", hq, reference.dequantize(*w2q), precision=HIGHEST)
  y = jnp.einsum("ne,neh->nh", combine, y_e, precision=HIGHEST)
  return x.astype(jnp.float32) + y, y, ids


def compare(label: str, engine: str, same_routing: bool, out, y, want_out, want_y,
            ranks: int) -> bool:
  """A block's output and MoE(x) y against the dense block's (host float32 arrays; y's rows in
  `ranks` equal parts, one per rank), printed in a line: whether the routing was the same, y within
  REL_TOL and MAX_TOL on every rank and the output within REL_TOL."""
  ok, worst = same_routing, 0.0
  for rows in np.split(np.arange(len(y)), ranks):
    rel = np.linalg.norm(y[rows] - want_y[rows]) / np.linalg.norm(want_y[rows])
    mx = np.max(np.abs(y[rows] - want_y[rows])) / np.max(np.abs(want_y[rows]))
    ok &= bool(rel <= REL_TOL and mx <= MAX_TOL)
    worst = max(worst, rel)
  block_rel = np.linalg.norm(out - want_out) / np.linalg.norm(want_out)
  ok &= bool(block_rel <= REL_TOL)
  print(f"  {label}, engine {engine}: routing {'==' if same_routing else '!='} dense; MoE(x) "
        f"worst rank ||y-dense||/||dense|| = {worst:.2e}; block output {block_rel:.2e}  "
        f"{'OK' if ok else 'FAIL'}")
  return ok


def run(devices, params) -> bool:
  """The block on `devices` against the dense computation; whether it passed."""
  x, w_router, w1q, w2q = params
  R = len(devices)
  shape = jsm.SHAPES["small"]
  mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=devices)
  on_ranks = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
  replicated = lambda a: jax.device_put(a, NamedSharding(mesh, P()))
  with jsm.Runtime(mesh, "ep", jsm.Stage1Config(swiglu_limit=shape.swiglu_limit)) as rt:
    f = jax.jit(jax.shard_map(
        lambda x, wr, w1q, w2q: block(x, wr, w1q, w2q, rt=rt, K=shape.topk), mesh=mesh,
        in_specs=(P("ep"), P(), P("ep"), P("ep")), out_specs=P("ep")))
    out, y, ids = f(on_ranks(x), replicated(w_router), rt.shard_w1(w1q), rt.shard_w2(w2q))
    engine = rt.engine.name
  want_out, want_y, want_ids = jax.jit(lambda *a: dense_block(
      *a, K=shape.topk, swiglu_limit=shape.swiglu_limit))(x, w_router, w1q, w2q)
  out, y, want_out, want_y = (np.asarray(a, np.float32) for a in (out, y, want_out, want_y))
  same_routing = np.array_equal(np.sort(np.asarray(ids), -1), np.sort(np.asarray(want_ids), -1))
  return compare(f"{R} x {devices[0].platform}", engine, same_routing, out, y, want_out, want_y,
                 R)


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tokens", type=int, default=32, help="tokens per rank (default: %(default)s)")
  ap.add_argument("--platform", default="auto", choices=("auto", "cpu"),
                  help="auto: the GPUs when there are some, then the CPU devices")
  args = ap.parse_args()
  s = jsm.SHAPES["small"]
  H, I, E = s.hidden, s.intermediate, s.num_experts
  cpus = jax.devices("cpu")[:8]
  rng = np.random.default_rng()
  n = len(cpus) * args.tokens  # the same tokens on every platform: 8 ranks' worth
  x = jnp.asarray(rng.standard_normal((n, H)), jnp.bfloat16)
  w_router = jnp.asarray(rng.standard_normal((H, E)) / np.sqrt(H), jnp.bfloat16)
  w1q = jsm.quantize_w1(jnp.asarray(rng.standard_normal((E, 2 * I, H)) / np.sqrt(H), jnp.bfloat16))
  w2q = jsm.quantize_w2(jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(I), jnp.bfloat16))
  params = (x, w_router, w1q, w2q)
  print(f"jax {jax.__version__}; block: router -> top-{s.topk} of E={E} -> jsm.moe (H={H}, I={I})"
        f" -> residual, {n} tokens")
  ok = True
  gpus = [d for d in jax.devices() if d.platform == "gpu"] if args.platform == "auto" else []
  if gpus:
    ranks = max(r for r in (1, 2, 4, 8) if r <= len(gpus) and E % r == 0 and n % r == 0)
    try:
      ok &= run(gpus[:ranks], params)
    except NotImplementedError as e:
      print(f"  {ranks} x gpu: not built yet: {e}")
  ok &= run(cpus, params)
  print("PASS" if ok else "FAIL")
  raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
  main()
