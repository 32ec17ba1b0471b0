"""Pure-jnp reference of DESIGN.md §3 (MX-fp8, byte-exact; the layer's arithmetic) and §4 (Stage1
layout).

Every kernel is checked against these functions. They favour being obviously right over speed:
the whole Stage1 (and the whole layer, `moe`) of all R ranks is computed on one device, with no
collective.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .layout import BLOCK, canonical_ids, landing_layout
from .types import MXFP8, Landed, QuantizedW1, QuantizedW2, Route, SendBuffer, Stage1Output

INV_448 = np.uint32(0x3B124925).view(np.float32)  # float32(1/448), DESIGN.md §3 step 2
SCALE_NAN = 0xFF
VALUE_NAN = 0x7F
F8 = jnp.float8_e4m3fn


def _check_last_dim(x, what="x"):
  if x.ndim < 1 or x.shape[-1] % BLOCK:
    raise ValueError(f"{what}: last dimension must be a multiple of {BLOCK}, got shape {x.shape}")


def quantize(x: jax.Array) -> MXFP8:
  """MX-fp8 along the last axis: (values float8_e4m3fn [..., N], scales uint8 [..., N/32])."""
  x = jnp.asarray(x)
  _check_last_dim(x)
  n = x.shape[-1]
  xf = x.astype(jnp.float32).reshape(*x.shape[:-1], n // BLOCK, BLOCK)
  finite = jnp.all(jnp.isfinite(xf), axis=-1)
  amax = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1), jnp.float32(1e-10))
  w = lax.bitcast_convert_type(amax * INV_448, jnp.uint32)
  e = ((w >> 23) & 0xFF) + ((w & 0x7FFFFF) != 0).astype(jnp.uint32)
  mul = lax.bitcast_convert_type((jnp.uint32(254) - e) << 23, jnp.float32)
  y = lax.bitcast_convert_type((xf * mul[..., None]).astype(F8), jnp.uint8)
  y = jnp.where(finite[..., None], y, jnp.uint8(VALUE_NAN))
  e = jnp.where(finite, e, SCALE_NAN).astype(jnp.uint8)
  return MXFP8(lax.bitcast_convert_type(y, F8).reshape(x.shape), e)


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
  """float32 values * 2^(e - 127), exact."""
  n = values.shape[-1]
  v = values.astype(jnp.float32).reshape(*values.shape[:-1], n // BLOCK, BLOCK)
  s = lax.bitcast_convert_type(scales.astype(jnp.uint32) << 23, jnp.float32)
  return (v * s[..., None]).reshape(values.shape)


def quantize_w1(w1: jax.Array) -> QuantizedW1:
  """w1 [E, 2I, H] -> MX-fp8 along H."""
  if w1.ndim != 3 or w1.shape[1] % 2:
    raise ValueError(f"w1 must be [E, 2I, H], got shape {w1.shape}")
  return QuantizedW1(*quantize(w1))


# ---------------------------------------------------------------------------------------------
# Per-stage references (one source rank, or one destination rank)


def route(ids: jax.Array, num_ranks: int, experts_per_rank: int) -> Route:
  """Send counts per (destination, local expert) and each (token, slot)'s send row."""
  E = num_ranks * experts_per_rank
  flat = canonical_ids(ids, E).reshape(-1)
  valid = (flat >= 0) & (flat < E)
  onehot = (flat[:, None] == jnp.arange(E)[None, :]) & valid[:, None]
  counts = onehot.sum(0).astype(jnp.int32)
  seg_start = jnp.cumsum(counts) - counts
  rank_in_seg = jnp.sum((jnp.cumsum(onehot, 0) - 1) * onehot, axis=1)
  pos = jnp.where(valid, seg_start[jnp.clip(flat, 0, E - 1)] + rank_in_seg, -1)
  return Route(counts.reshape(num_ranks, experts_per_rank), pos.reshape(ids.shape).astype(jnp.int32),
               jnp.sum(flat >= E).astype(jnp.int32))


def pack(x: MXFP8, weights: jax.Array, send_pos: jax.Array) -> SendBuffer:
  """The send buffer: row send_pos[t, k] holds token t's quantised row; unused rows 0 / -1."""
  T, K = send_pos.shape
  S = T * K
  pos = send_pos.reshape(-1)
  idx = jnp.where(pos >= 0, pos, S)  # S: out of range, dropped
  tok = jnp.repeat(jnp.arange(T, dtype=jnp.int32), K)
  slot = jnp.tile(jnp.arange(K, dtype=jnp.int32), T)
  vbytes = lax.bitcast_convert_type(x.values, jnp.uint8)
  values = jnp.zeros((S, x.values.shape[-1]), jnp.uint8).at[idx].set(vbytes[tok], mode="drop")
  scales = jnp.zeros((S, x.scales.shape[-1]), jnp.uint8).at[idx].set(x.scales[tok], mode="drop")
  return SendBuffer(
      lax.bitcast_convert_type(values, F8), scales,
      jnp.full((S,), -1, jnp.int32).at[idx].set(tok, mode="drop"),
      jnp.full((S,), -1, jnp.int32).at[idx].set(slot, mode="drop"),
      jnp.zeros((S,), jnp.float32).at[idx].set(weights.reshape(-1).astype(jnp.float32), mode="drop"))


def dispatch(x: MXFP8, ids: jax.Array, weights: jax.Array, num_experts: int, row_align: int,
             cap: int) -> Landed:
  """The landed rows of every rank, straight from §4: x [R, T, H], ids/weights [R, T, K].

  Flattening (source rank, token, slot) gives exactly the §4 order inside an expert, so a row's
  place is its expert's offset plus the number of earlier flat entries with the same expert.
  Returns a Landed whose arrays have a leading [R] axis (the destination rank).
  """
  R, T, K = ids.shape
  E = num_experts
  EL = E // R
  H = x.values.shape[-1]
  flat = canonical_ids(ids, E).reshape(-1)
  valid = (flat >= 0) & (flat < E)
  gid = jnp.clip(flat, 0, E - 1)
  onehot = (flat[:, None] == jnp.arange(E)[None, :]) & valid[:, None]
  total = onehot.sum(0).reshape(R, EL)
  rank_in_expert = jnp.sum((jnp.cumsum(onehot, 0) - 1) * onehot, axis=1)
  lay = landing_layout(total, row_align, cap)
  pos = lay.unclipped.reshape(-1)[gid] + rank_in_expert
  keep = valid & (pos < (lay.offsets + lay.counts).reshape(-1)[gid])
  dest = gid // EL
  idx = jnp.where(keep, dest * cap + pos, R * cap)
  q = jnp.arange(R * T * K)
  src, tok, slot = q // (T * K), (q // K) % T, q % K
  vbytes = lax.bitcast_convert_type(x.values, jnp.uint8).reshape(R * T, H)
  scales = x.scales.reshape(R * T, H // BLOCK)
  row = src * T + tok

  def scatter(fill, upd, shape=()):
    return jnp.full((R * cap, *shape), fill, upd.dtype).at[idx].set(upd, mode="drop")

  values = scatter(0, vbytes[row], (H,)).reshape(R, cap, H)
  return Landed(
      lax.bitcast_convert_type(values, F8),
      scatter(0, scales[row], (H // BLOCK,)).reshape(R, cap, H // BLOCK),
      scatter(-1, src.astype(jnp.int32)).reshape(R, cap),
      scatter(-1, tok.astype(jnp.int32)).reshape(R, cap),
      scatter(-1, slot.astype(jnp.int32)).reshape(R, cap),
      scatter(0, weights.reshape(-1).astype(jnp.float32)).reshape(R, cap),
      lay.offsets, lay.counts, lay.counts.sum(-1).astype(jnp.int32), lay.dropped)


def swiglu(g: jax.Array, u: jax.Array, limit: Optional[float]) -> jax.Array:
  if limit is not None:
    g = jnp.minimum(g, jnp.float32(limit))
    u = jnp.clip(u, -jnp.float32(limit), jnp.float32(limit))
  return g / (1.0 + jnp.exp(-g)) * u


def expert_h32(values: jax.Array, scales: jax.Array, w1e: QuantizedW1,
               swiglu_limit: Optional[float]) -> jax.Array:
  """float32 h [n, I] of n rows that all belong to one expert with MX-fp8 weights w1e [2I, H]:
  SwiGLU(deq(rows) @ deq(w1e).T) at full float32 precision (the per-expert form of gemm1_f32, cheap
  enough to check a sample of experts at any shape)."""
  a = dequantize(values, scales)
  w = dequantize(w1e.values, w1e.scales)
  gu = jnp.matmul(a, w.T, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  I = w.shape[0] // 2
  return swiglu(gu[..., :I], gu[..., I:], swiglu_limit)


@functools.partial(jax.jit, static_argnames=("rank", "n", "swiglu_limit"))
def experts_h32(values: jax.Array, scales: jax.Array, starts: jax.Array, experts: jax.Array,
                w1q: QuantizedW1, *, rank: int, n: int, swiglu_limit: Optional[float]) -> jax.Array:
  """float32 h [P, n, I] of the n landed rows of `rank` (values, scales: [R, M_cap, ...]) from
  starts[p] through its local expert experts[p] (w1q: [R, E/R, 2I, H], or [E, 2I, H] split over
  the R ranks): expert_h32 of P experts in one program. Rows past an expert's end are read too
  (clamped at M_cap): cut them."""
  R = values.shape[0]
  idx = jnp.minimum(starts[:, None] + jnp.arange(n), values.shape[1] - 1)
  w = jax.tree.map(lambda a: (a if a.ndim == 4 else a.reshape(R, -1, *a.shape[1:]))[rank][experts],
                   w1q)                                                      # [P, 2I, H]
  return jax.vmap(expert_h32, in_axes=(0, 0, 0, None))(
      values[rank][idx], scales[rank][idx], w, swiglu_limit)


def sampled_h32(values: jax.Array, scales: jax.Array, offsets: np.ndarray, counts: np.ndarray,
                experts, w1q: QuantizedW1, rank: int, swiglu_limit: Optional[float],
                bucket: int = 64, host=np.asarray) -> dict:
  """{e: float32 h [counts[e], I]} of some local experts of `rank` (arguments as experts_h32;
  offsets, counts: that rank's §4 layout on the host). The row count is rounded up to `bucket`
  so that checks of many experts and calls share a few compiled programs. host: how the result
  comes to the host (a multi-process caller gathers it)."""
  experts = np.asarray(sorted(int(e) for e in experts), np.int32)
  if not len(experts):
    return {}
  n = -(-max(1, int(np.max(counts[experts]))) // bucket) * bucket
  h = host(experts_h32(values, scales, jnp.asarray(offsets[experts]), jnp.asarray(experts), w1q,
                       rank=rank, n=n, swiglu_limit=swiglu_limit))
  return {int(e): h[p, :counts[e]] for p, e in enumerate(experts)}


def gemm1_f32(values: jax.Array, scales: jax.Array, expert_offsets: jax.Array,
              expert_counts: jax.Array, w1: QuantizedW1, swiglu_limit: Optional[float]) -> jax.Array:
  """float32 h [M_cap, I] of one rank: SwiGLU(deq(a) @ deq(w1[e]).T) per landed row, 0 elsewhere."""
  I = w1.values.shape[1] // 2
  a_e, member = _rows_by_expert(dequantize(values, scales), expert_offsets, expert_counts)
  gu = jnp.einsum("emh,enh->mn", a_e, dequantize(w1.values, w1.scales),
                  precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  h = swiglu(gu[:, :I], gu[:, I:], swiglu_limit)
  return jnp.where(member.any(0)[:, None], h, 0.0)


def _rows_by_expert(a: jax.Array, expert_offsets: jax.Array, expert_counts: jax.Array):
  """a [M, D] of one rank's landed rows -> (a_e [EL, M, D]: expert e's rows of a, 0 elsewhere;
  member [EL, M]: which rows are expert e's), for a dense einsum over the local experts."""
  r = jnp.arange(a.shape[0])
  member = (r[None, :] >= expert_offsets[:, None]) & (
      r[None, :] < (expert_offsets + expert_counts)[:, None])
  return jnp.where(member[:, :, None], a[None], 0.0), member


def finish_h(h: jax.Array, out_dtype: str):
  """float32 h -> the output dtype: bf16 (round to nearest even) or MX-fp8 along I."""
  return h.astype(jnp.bfloat16) if out_dtype == "bf16" else quantize(h)


def stage1(x, ids: jax.Array, weights: Optional[jax.Array], w1: QuantizedW1, *, row_align: int,
           cap: int, swiglu_limit: Optional[float] = None, out_dtype: str = "bf16",
           return_f32: bool = False):
  """Stage1 of all R ranks: x [R, T, H] bf16 (or MXFP8), ids/weights [R, T, K], w1 global [E, ...].

  Returns a Stage1Output with a leading [R] axis (and the float32 h when return_f32).
  """
  R, T, K = ids.shape
  E = w1.values.shape[0]
  if E % R:
    raise ValueError(f"reference.stage1: E = {E} is not a multiple of R = {R}")
  EL = E // R
  ids = canonical_ids(ids, E)
  if weights is None:
    weights = jnp.ones(ids.shape, jnp.float32)
  xq = x if isinstance(x, MXFP8) else quantize(x)
  landed = dispatch(xq, ids, weights, E, row_align, cap)
  w_local = QuantizedW1(w1.values.reshape(R, EL, *w1.values.shape[1:]),
                        w1.scales.reshape(R, EL, *w1.scales.shape[1:]))
  h32 = jax.vmap(gemm1_f32, in_axes=(0, 0, 0, 0, 0, None))(
      landed.values, landed.scales, landed.expert_offsets, landed.expert_counts, w_local,
      swiglu_limit)
  num_invalid = jnp.sum(ids >= E, axis=(1, 2)).astype(jnp.int32)
  send_pos = jax.vmap(lambda i: route(i, R, EL).send_pos)(ids)
  out = Stage1Output(finish_h(h32, out_dtype), landed.expert_offsets, landed.expert_counts,
                     landed.src_rank, landed.src_token, landed.topk_slot, landed.topk_weight,
                     landed.num_rows, num_invalid, landed.overflow, send_pos)
  return (out, h32) if return_f32 else out


# ---------------------------------------------------------------------------------------------
# Stage2 and the whole layer


def gemm2_f32(h, expert_offsets: jax.Array, expert_counts: jax.Array,
              w2: QuantizedW2) -> jax.Array:
  """float32 GEMM2 of one rank [M_cap, H]: deq(q(h[row])) @ deq(w2[e]).T per landed row, 0
  elsewhere. h: Stage1's rows, bf16 (q: quantised along I here) or MXFP8 (those bytes)."""
  hq = h if isinstance(h, MXFP8) else quantize(h)
  a_e, _ = _rows_by_expert(dequantize(hq.values, hq.scales), expert_offsets, expert_counts)
  return jnp.einsum("emi,ehi->mh", a_e, dequantize(w2.values, w2.scales),
                    precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def combine_f32(rows: jax.Array, out1: Stage1Output, num_tokens: int) -> jax.Array:
  """The combine of every rank in float32: rows [R dest, M_cap, H] float32 (GEMM2's), out1 with a
  leading [R dest] axis -> y [R src, T, H] = the sum of topk_weight * row over the rows that came
  from each (source rank, token). Padding rows (src_rank -1) add nothing."""
  R, M, H = rows.shape
  T = num_tokens
  src, tok = out1.src_rank.reshape(-1), out1.src_token.reshape(-1)
  at = jnp.where(src >= 0, src * T + tok, R * T)
  weighted = rows.reshape(-1, H) * out1.topk_weight.reshape(-1, 1)
  return jnp.zeros((R * T, H), jnp.float32).at[at].add(weighted, mode="drop").reshape(R, T, H)


def moe(x, ids: jax.Array, weights: Optional[jax.Array], w1: QuantizedW1, w2: QuantizedW2, *,
        row_align: int, cap: int, swiglu_limit: Optional[float] = None,
        out_dtype: str = "bf16") -> jax.Array:
  """The whole layer of all R ranks in float32 (DESIGN.md §3): x [R, T, H] bf16 (or MXFP8),
  ids/weights [R, T, K], w1, w2 global [E, ...]. y [R, T, H] float32 =
  sum over the slots k that landed of weights[t, k] * deq(q(h)) @ deq(w2[e]).T, where h is
  Stage1's row (reference.stage1: bf16, or MX-fp8 with out_dtype="mxfp8"). Slots with no route,
  an invalid id, or a row dropped by overflow add nothing."""
  R, T, _ = ids.shape
  EL = w2.values.shape[0] // R
  out1 = stage1(x, ids, weights, w1, row_align=row_align, cap=cap, swiglu_limit=swiglu_limit,
                out_dtype=out_dtype)
  w_local = QuantizedW2(*(a.reshape(R, EL, *a.shape[1:]) for a in w2))
  rows = jax.vmap(gemm2_f32)(out1.h, out1.expert_offsets, out1.expert_counts, w_local)
  return combine_f32(rows, out1, T)
