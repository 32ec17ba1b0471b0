"""A decoder block in Flax NNX on a (dp, ep) mesh: causal self-attention, data-parallel over the
sequences, then the mixture of experts through jsm.moe, expert-parallel over "ep" within each "dp"
group — one jitted shard_map over both axes — checked against the same block with a dense jnp MoE
(each token's top-k experts in float32 from the same MX-fp8 weights, on every device).

Needs flax (`pip install "jax_sdma_moe[flax]"`). Runs on 8 virtual CPU devices (dp=2, ep=4), and
first on the GPUs when there are some (dp=2 from two GPUs on; where a part of the layer is not built
for the platform, the run says what is missing and goes on with the CPU devices). Run:
python examples/flax_decoder_block.py [--seqs 2] [--seq-len 8] [--platform cpu]
"""
import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import flax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402
from jax_sdma_moe import reference  # noqa: E402

from moe_block import compare  # noqa: E402  (beside this file; its tolerances: DESIGN.md §3)

HIGHEST = lax.Precision.HIGHEST
HEADS = 4


class ExpertWeight(nnx.Variable):
  """A quantised expert weight (jsm.QuantizedW1 or QuantizedW2, all E experts): on the mesh it is
  split over the EP axis, E/R experts per rank, the same on every other axis (Runtime.shard_w1)."""


class MoE(nnx.Module):
  """Router -> softmax -> top-k -> jsm.moe. State: the router (bf16) and the MX-fp8 expert weights;
  call it inside a shard_map over every axis of `runtime`'s mesh, on one device's tokens [T, H]."""

  def __init__(self, hidden, intermediate, experts, topk, *, runtime, rngs):
    k1, k2 = jax.random.split(rngs.params())
    self.router = nnx.Linear(hidden, experts, use_bias=False, dtype=jnp.float32,
                             param_dtype=jnp.bfloat16, precision=HIGHEST, rngs=rngs)
    w1 = jax.random.normal(k1, (experts, 2 * intermediate, hidden)) / np.sqrt(hidden)  # gate, up
    w2 = jax.random.normal(k2, (experts, hidden, intermediate)) / np.sqrt(intermediate)
    self.w1 = ExpertWeight(jsm.quantize_w1(w1.astype(jnp.bfloat16)))
    self.w2 = ExpertWeight(jsm.quantize_w2(w2.astype(jnp.bfloat16)))
    self.topk, self.runtime = topk, runtime

  def route(self, x):
    """ids, weights [T, K]: the top K of the softmax over the experts, renormalised."""
    weights, ids = lax.top_k(jax.nn.softmax(self.router(x), axis=-1), self.topk)
    return ids, weights / weights.sum(-1, keepdims=True)

  def experts(self, x, ids, weights):
    return jsm.moe(x, (ids, weights), self.w1.get_value(), self.w2.get_value(),
                   runtime=self.runtime)

  def __call__(self, x):
    """x [T, H] bf16 -> (y [T, H] bf16, ids [T, K])."""
    ids, weights = self.route(x)
    return self.experts(x, ids, weights), ids


class DenseMoE(MoE):
  """The same router and weights (shared with `moe`), the experts dense in jnp on the device's own
  tokens (this module's expert weights replicated, all E on every device): each token's top-k
  experts in float32 from the MX-fp8 values — q(x), GEMM1, SwiGLU, h rounded to bf16 and
  quantised along I, GEMM2 — then its weighted sum (DESIGN.md §3). The check, with no exchange."""

  def __init__(self, moe: MoE):
    self.router, self.w1, self.w2, self.topk = moe.router, moe.w1, moe.w2, moe.topk
    self.swiglu_limit = moe.runtime.config.swiglu_limit

  def experts(self, x, ids, weights):
    w1, w2 = (reference.dequantize(*w.get_value()) for w in (self.w1, self.w2))
    xq = reference.dequantize(*reference.quantize(x))                             # [T, H]
    gu = jnp.einsum("th,tkih->tki", xq, w1[ids], precision=HIGHEST)             # [T, K, 2I]
    I = gu.shape[-1] // 2
    h = reference.swiglu(gu[..., :I], gu[..., I:], self.swiglu_limit).astype(jnp.bfloat16)
    hq = reference.dequantize(*reference.quantize(h))
    y = jnp.einsum("tki,tkhi->tkh", hq, w2[ids], precision=HIGHEST)             # [T, K, H]
    return jnp.einsum("tk,tkh->th", weights, y, precision=HIGHEST)


class DecoderBlock(nnx.Module):
  """Pre-norm decoder block: x + attention(norm(x)), then + MoE(norm(.)) on every token.
  __call__: x [B, S, H] bf16 (a device's sequences) -> (out [B, S, H], (MoE's y [B*S, H], ids))."""

  def __init__(self, hidden, intermediate, experts, topk, *, runtime, rngs):
    self.attn_norm = nnx.RMSNorm(hidden, dtype=jnp.bfloat16, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, hidden, use_bias=False, dtype=jnp.bfloat16,
                                       param_dtype=jnp.bfloat16, decode=False, rngs=rngs)
    self.moe_norm = nnx.RMSNorm(hidden, dtype=jnp.bfloat16, rngs=rngs)
    self.moe = MoE(hidden, intermediate, experts, topk, runtime=runtime, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.attn_norm(x), mask=nnx.make_causal_mask(x[..., 0]))
    B, S, H = x.shape
    y, ids = self.moe(self.moe_norm(x).reshape(B * S, H))
    return x + y.astype(x.dtype).reshape(B, S, H), (y, ids)


def on_mesh(model, mesh, expert_spec):
  """model's call jitted over every axis of the mesh: sequences (and the outputs' rows) split over
  all axes, the ExpertWeight variables by expert_spec, every other variable replicated."""
  graphdef, experts, rest = nnx.split(model, ExpertWeight, ...)
  experts = jax.device_put(experts, NamedSharding(mesh, expert_spec))
  rest = jax.device_put(rest, NamedSharding(mesh, P()))
  rows = P(mesh.axis_names)  # ("dp", "ep"): each device a slice of the sequences

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(expert_spec, P(), rows), out_specs=rows)
  def forward(experts, rest, x):
    return nnx.merge(graphdef, experts, rest)(x)

  return lambda x: forward(experts, rest, jax.device_put(x, NamedSharding(mesh, rows)))


def run(devices, dp: int, x, seed: int) -> bool:
  """The block on `devices` as a (dp, ep) mesh against the same block with DenseMoE; whether it
  passed."""
  s = jsm.SHAPES["small"]
  ep = len(devices) // dp
  mesh = jax.make_mesh((dp, ep), ("dp", "ep"), devices=devices)
  with jsm.Runtime(mesh, "ep", jsm.Stage1Config(swiglu_limit=s.swiglu_limit)) as rt:
    block = DecoderBlock(s.hidden, s.intermediate, s.num_experts, s.topk, runtime=rt,
                         rngs=nnx.Rngs(seed))
    dense = nnx.clone(block)
    dense.moe = DenseMoE(block.moe)
    out, (y, ids) = on_mesh(block, mesh, P("ep"))(x)
    want_out, (want_y, want_ids) = on_mesh(dense, mesh, P())(x)
    out, y, want_out, want_y = (np.asarray(a, np.float32) for a in (out, y, want_out, want_y))
    engine = rt.engine.name
  same_routing = np.array_equal(np.asarray(ids), np.asarray(want_ids))
  return compare(f"dp x ep = {dp} x {ep} {devices[0].platform}", engine, same_routing, out, y,
                 want_out, want_y, len(devices))  # y's rows: each device's tokens


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seqs", type=int, default=2, help="sequences per CPU device (default: "
                  "%(default)s)")
  ap.add_argument("--seq-len", type=int, default=8, help="tokens per sequence (default: "
                  "%(default)s)")
  ap.add_argument("--seed", type=int, default=0, help="of the inputs and the block's weights")
  ap.add_argument("--platform", default="auto", choices=("auto", "cpu"),
                  help="auto: the GPUs when there are some, then the CPU devices")
  args = ap.parse_args()
  s = jsm.SHAPES["small"]
  cpus = jax.devices("cpu")[:8]
  B = len(cpus) * args.seqs  # the same sequences on every platform: 8 devices' worth
  x = jax.random.normal(jax.random.key(args.seed), (B, args.seq_len, s.hidden), jnp.bfloat16)
  print(f"jax {jax.__version__}, flax {flax.__version__}; block: causal attention ({HEADS} heads) "
        f"-> router -> top-{s.topk} of E={s.num_experts} -> jsm.moe (H={s.hidden}, "
        f"I={s.intermediate}), {B} sequences of {args.seq_len} tokens")
  ok = True
  gpus = [d for d in jax.devices() if d.platform == "gpu"] if args.platform == "auto" else []
  if gpus:
    dp = 2 if len(gpus) >= 2 else 1
    ep = max(r for r in (1, 2, 4, 8) if dp * r <= len(gpus) and s.num_experts % r == 0
             and B % (dp * r) == 0)
    try:
      ok &= run(gpus[:dp * ep], dp, x, args.seed)
    except NotImplementedError as e:
      print(f"  dp x ep = {dp} x {ep} gpu: not built yet: {e}")
  ok &= run(cpus, 2, x, args.seed)
  print("PASS" if ok else "FAIL")
  raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
  main()
