"""The benchmark's inputs and weights: random tokens, expert choices and w1 per (shape, tokens),
made on the host (CPU mode: every path and the full reference get the same arrays) or on the
devices (--gpu: nothing of dsv3's size passes through the host).

Every token array carries a leading device axis [N, ...] split over every axis of the mesh
(rows_spec: N = R ranks of AXIS times the groups of the other axes, --mesh), so each shard sees
[1, ...] and all stages (whose outputs are stacked the same way) compose uniformly; the expert
weights carry a leading rank axis [R, ...] split over AXIS alone (the same on every group)."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_sdma_moe as jsm
from jax_sdma_moe import layout, reference

AXIS = "ep"
W1_SCALE = 0.05  # w1 ~ N(0, 1) * W1_SCALE; x ~ N(0, 1)


def rows_spec(mesh) -> P:
  """The token arrays' [N, ...] axis split over every axis of the mesh, AXIS innermost: device
  n = g * R + r is rank r of EP group g (each combination of the other axes' coordinates is one
  group, e.g. g the "dp" coordinate of a (dp, ep) mesh)."""
  return P((*[a for a in mesh.axis_names if a != AXIS], AXIS))


def per_group(fn, R: int, token_args: int = 3):
  """fn(*tokens, *rest, **kw) of one EP group's R ranks (the first token_args arguments [R, ...])
  -> the same of every group at once: those [N, ...], device n = g * R + r (rows_spec), every
  result [N, ...], each group on its own (one group: fn itself)."""
  def grouped(*args, **kw):
    tokens, rest = args[:token_args], args[token_args:]
    N = tokens[0].shape[0]
    if N == R:
      return fn(*args, **kw)
    split = lambda a: a.reshape(N // R, R, *a.shape[1:])
    out = jax.vmap(lambda *t: fn(*t, *rest, **kw))(*map(split, tokens))
    return jax.tree.map(lambda a: a.reshape(N, *a.shape[2:]), out)
  return grouped


class HostInputs(NamedTuple):
  x: np.ndarray        # [N, T, H] bf16 (N devices: rows_spec)
  ids: np.ndarray      # [N, T, K] int32, K distinct experts per token
  weights: np.ndarray  # [N, T, K] f32
  w1: np.ndarray       # [E, 2I, H] bf16


def make_tokens(shape: jsm.MoEShape, N: int, T: int, rng: np.random.Generator) -> tuple:
  """(x [N, T, H] bf16, ids [N, T, K] int32 with K distinct experts per token, weights [N, T, K]
  f32) of N devices on the host."""
  H, E, K = shape.hidden, shape.num_experts, shape.topk
  x = rng.standard_normal((N, T, H), np.float32).astype(jnp.bfloat16)
  ids = np.argsort(rng.random((N, T, E)), axis=-1)[..., :K].astype(np.int32)
  return x, ids, rng.random((N, T, K), np.float32)


def make_inputs(shape: jsm.MoEShape, N: int, T: int, rng: np.random.Generator) -> HostInputs:
  H, I, E = shape.hidden, shape.intermediate, shape.num_experts
  x, ids, weights = make_tokens(shape, N, T, rng)
  w1 = (rng.standard_normal((E, 2 * I, H), np.float32) * W1_SCALE).astype(jnp.bfloat16)
  return HostInputs(x, ids, weights, w1)


def native_w1(w1q: jsm.QuantizedW1) -> jax.Array:
  """MX-fp8 [..., 2I, H] -> the JAX-native paths' bf16 weights [..., H, 2I] (exact: an e4m3 value
  times a power of two fits bf16). A few experts at a time, so the float32 dequantised temporaries
  stay small next to dsv3's 15 GB of bf16 weights."""
  *lead, two_i, H = w1q.values.shape
  flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[-2:]), w1q)
  w = lax.map(lambda q: jnp.swapaxes(reference.dequantize(*q), -1, -2).astype(jnp.bfloat16),
              flat, batch_size=8)
  return w.reshape(*lead, H, two_i)


def random_w1q(key, E: int, I: int, H: int, std: float = W1_SCALE) -> jsm.QuantizedW1:
  """w1 [E, 2I, H] ~ N(0, 1) * std drawn in bf16, quantised to MX-fp8 (inside a caller's jit, the
  bf16 copy is freed when it returns)."""
  return jsm.quantize_w1(jax.random.normal(key, (E, 2 * I, H), jnp.bfloat16) * std)


def random_w2q(key, E: int, I: int, H: int) -> jsm.QuantizedW2:
  """w2 [E, H, I] ~ N(0, 1) / sqrt(I) drawn in bf16, quantised to MX-fp8 (as random_w1q)."""
  return jsm.quantize_w2(jax.random.normal(key, (E, H, I), jnp.bfloat16) * (1 / np.sqrt(I)))


def to_ranks(a, mesh, spec=P(AXIS)):
  """a [R, ...] (the same whole array in every process: host data, or drawn on this process's
  default device from the same key) split over the mesh's ranks (spec; rows_spec(mesh): a [N, ...]
  over every device), each process placing only its own pieces, so no data moves between
  processes. (With jax.device_put of the device arrays to the mesh's sharding instead, the layer
  under mpirun on 2xH200 printed nothing in 6 minutes.)"""
  sharding = NamedSharding(mesh, spec)
  pieces = [jax.device_put(a[index], device)
            for device, index in sharding.addressable_devices_indices_map(a.shape).items()]
  return jax.make_array_from_single_device_arrays(a.shape, sharding, pieces)


def default_device_weights(shape: jsm.MoEShape, key) -> tuple:
  """(w1q [E, 2I, H], w2q [E, H, I]) of the whole layer on the default device, drawn there (the
  host's generator takes minutes for dsv3's 45 GB of float32 draws)."""
  E, H, I = shape.num_experts, shape.hidden, shape.intermediate
  k1, k2 = jax.random.split(key)
  make = jax.jit(lambda k1, k2: (random_w1q(k1, E, I, H), random_w2q(k2, E, I, H)))
  return jax.block_until_ready(make(k1, k2))


def device_weights(mesh, shape: jsm.MoEShape, key) -> tuple:
  """The ranks' weights made on their devices: w1q [R, E/R, 2I, H] (w1 drawn in bf16 and quantised
  inside one jit, so the bf16 copy is freed when it returns) and the JAX-native bf16 weights
  [R, E/R, H, 2I] made from w1q."""
  E, H, I = shape.num_experts, shape.hidden, shape.intermediate
  R = mesh.shape[AXIS]
  on_mesh = NamedSharding(mesh, P(AXIS))

  @functools.partial(jax.jit, out_shardings=on_mesh)
  def make_w1q(key):
    return jax.tree.map(lambda a: a.reshape(R, E // R, *a.shape[1:]), random_w1q(key, E, I, H))

  w1q = jax.block_until_ready(make_w1q(key))
  return w1q, jax.block_until_ready(jax.jit(native_w1, out_shardings=on_mesh)(w1q))


def device_inputs(mesh, shape: jsm.MoEShape, T: int, key) -> tuple:
  """The devices' tokens made on them: (x [N, T, H] bf16, ids [N, T, K] (K distinct experts per
  token), weights [N, T, K] f32) for the engines, and (bf16 copy of the dequantised MX-fp8 x, ids)
  for the JAX-native paths; N: every device of the mesh (rows_spec)."""
  H, E, K = shape.hidden, shape.num_experts, shape.topk
  N = mesh.size

  @functools.partial(jax.jit, out_shardings=NamedSharding(mesh, rows_spec(mesh)))
  def make(key):
    kx, ki, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (N, T, H), jnp.bfloat16)
    ids = lax.top_k(jax.random.uniform(ki, (N, T, E)), K)[1].astype(jnp.int32)
    weights = jax.random.uniform(kw, (N, T, K), jnp.float32)
    x = lax.optimization_barrier(x)
    return (x, ids, weights), (native_x(x), ids)

  return jax.block_until_ready(make(key))


def native_x(x: jax.Array) -> jax.Array:
  """The JAX-native paths' tokens: a bf16 copy of the dequantised MX-fp8 x (exact in bf16), so
  they compute on the values the engines compute on. XLA may skip a rounding as "excess
  precision" (XLA:CPU recomputed x in f32 inside the fusion that quantises it, and the native
  paths got other values than the engines): the barriers pin x to its bf16 values and xq to its
  fp8 bytes, so the result is exactly dequantize(quantize(x)), inside a jit or not."""
  xq = lax.optimization_barrier(reference.quantize(lax.optimization_barrier(x)))
  return reference.dequantize(*xq).astype(jnp.bfloat16)


def host_inputs_on_mesh(mesh, host: HostInputs, w1q: jsm.QuantizedW1) -> tuple:
  """CPU mode: the host inputs placed on the devices as device_inputs and device_weights make them
  (w1q [E, 2I, H] quantised from host.w1): ((x, ids, weights), w1q [R, E/R, 2I, H]) for the
  engines and ((bf16 x, ids), bf16 w1 [R, E/R, H, 2I]) for the JAX-native paths."""
  R = mesh.shape[AXIS]
  put = functools.partial(jax.device_put, device=NamedSharding(mesh, rows_spec(mesh)))
  put_w = functools.partial(jax.device_put, device=NamedSharding(mesh, P(AXIS)))
  per_rank_w1q = jax.tree.map(lambda a: a.reshape(R, a.shape[0] // R, *a.shape[1:]), w1q)
  return (((put(host.x), put(host.ids), put(host.weights)), jax.tree.map(put_w, per_rank_w1q)),
          ((put(native_x(jnp.asarray(host.x))), put(host.ids)), put_w(native_w1(per_rank_w1q))))


# ------------------------------------------------------------------------------------------------
# gemm1 alone (--gemm1-rows): one device, rows spread evenly over some local experts

STUDY_RANKS = 2  # --experts defaults to one of 2 ranks' local experts, E / STUDY_RANKS


def study_rows(entry: str, shape: jsm.MoEShape) -> int:
  """A --gemm1-rows entry: rows ("32768"), or "TxR": T tokens per rank on R ranks' rows, T*R*K."""
  tokens, sep, ranks = entry.partition("x")
  return int(tokens) * int(ranks) * shape.topk if sep else int(entry)


def balanced_counts(rows: int, experts: int) -> np.ndarray:
  """rows spread over the experts as evenly as they go (the first ones get one more)."""
  base, extra = divmod(rows, experts)
  return (base + (np.arange(experts) < extra)).astype(np.int32)


def gemm1_inputs(shape: jsm.MoEShape, counts: np.ndarray, row_align: int, key,
                 w1_std: float = W1_SCALE) -> tuple:
  """gemm1's inputs on the default device, as a dispatch lands them (§4): (values [M_cap, H] fp8,
  scales [M_cap, H/32], expert_offsets, expert_counts) with counts[e] rows of random MX-fp8 tokens
  per local expert at its aligned offset (M_cap: their aligned total), and w1q [EL, 2I, H] of
  standard deviation w1_std."""
  H, I = shape.hidden, shape.intermediate
  aligned = -(-counts // row_align) * row_align
  cap = max(row_align, int(aligned.sum()))
  lay = layout.landing_layout(jnp.asarray(counts), row_align, cap)

  @jax.jit
  def make(key):
    kx, kw = jax.random.split(key)
    xq = jsm.quantize(jax.random.normal(kx, (cap, H), jnp.bfloat16))
    return (xq.values, xq.scales, lay.offsets, lay.counts), random_w1q(kw, len(counts), I, H,
                                                                    w1_std)

  return jax.block_until_ready(make(key))
