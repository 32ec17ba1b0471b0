"""The §4 layout of the landed rows: the one Python definition, used by the reference, the `xla`
engine and the tests (kernels/cpu/stage.h `landing_layout` is its C++ twin)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

BLOCK = 32  # MX block: elements per e8m0 scale


def m_cap(num_ranks: int, tokens: int, topk: int, experts_per_rank: int, row_align: int,
          max_recv_rows: Optional[int] = None) -> int:
  """Landing capacity per rank: max_recv_rows, or the dropless worst case R*T*K +
  EL*(row_align-1) — every row of every source on one rank, each expert's start aligned. It holds
  any ids, repeated ids within a token's top-k included (a token then sends several rows to one
  expert); R*T*min(K, EL) would hold distinct ids only."""
  if max_recv_rows is not None:
    return max_recv_rows
  return num_ranks * tokens * topk + experts_per_rank * (row_align - 1)


def canonical_ids(ids, num_experts: int):
  """Top-k ids of any integer dtype -> int32 in the meaning the custom calls read: -1 (no route)
  stays -1, an id in [0, E) is its expert, and every other value — below -1, at or above E, or
  beyond int32 (wide and unsigned dtypes are compared before the cast) — becomes E: invalid,
  counted in num_invalid, no row made."""
  ids = jnp.asarray(ids)
  E = int(num_experts)
  signed = jnp.issubdtype(ids.dtype, jnp.signedinteger)
  in_range = jnp.ones(ids.shape, bool)
  if signed:
    in_range = ids >= 0
  if E <= jnp.iinfo(ids.dtype).max:  # compared in the ids' own dtype, before any cast
    in_range = in_range & (ids < E)
  out = jnp.where(in_range, ids.astype(jnp.int32), jnp.int32(E))
  return jnp.where(ids == -1, jnp.int32(-1), out) if signed else out


def landing_row_bytes(hidden: int) -> int:
  """A landing row in a window slot: fp8 values, scales and the 16-byte row header."""
  return hidden + hidden // BLOCK + 16


def send_rows(tokens: int, topk: int) -> int:
  """Rows of a source's send buffer: one per (token, slot) at most."""
  return tokens * topk


# The CUDA bf16-route GEMM's tiles (kernels/cuda/gemm1/args.h): tokens per tile, the large one
# first. The small tile serves weight-bound calls, where experts hold few rows.
GEMM_TILE_TOKENS = (128, 32)
# The 16-bit GEMM's launches per call, each with its own row-tile flags (kernels/cuda/gemm1/args.h
# kBf16FlagRegions): the f16 pass's head, tail and wide launches and the bf16 pass's one.
GEMM_FLAG_REGIONS = 4


def gemm_tile_tokens(rows_per_expert: float, override=None) -> int:
  """The CUDA bf16 GEMMs' tile width for a call whose experts hold rows_per_expert rows on average
  (T*K/EL, dropless and uniform): the small tile up to its own width, where the large one would
  spend most of its tensor time on padding and the call streams weights (docs/PERF.md §3);
  `override` (Stage1Config.gemm_tile_tokens) wins when given."""
  if override is not None:
    if override not in GEMM_TILE_TOKENS:
      raise ValueError(f"gemm_tile_tokens must be one of {GEMM_TILE_TOKENS}, got {override!r}")
    return int(override)
  large, small = GEMM_TILE_TOKENS
  return small if rows_per_expert <= small else large


def bf16_gemm_workspace(cap: int, depth: int, experts_per_rank: int, applies: bool):
  """The CUDA 16-bit GEMM's workspace (DESIGN §5), as ((shape, dtype), ...): the landed rows
  upcast to f16 or bf16 once per launch ([cap, 2*depth] bytes), and words: GEMM_FLAG_REGIONS
  regions of one flag per row tile of the smaller tile, the f16 pass's fallback words (one per
  expert and one for any), its row factors (one per landed row): GEMM_FLAG_REGIONS * (cap // 32 +
  experts_per_rank) + experts_per_rank + 1 + cap (kernels/cuda/gemm1/args.h
  bf16_workspace_words). Empty where the kernel does not apply."""
  if not applies:
    return ((0,), jnp.uint8), ((0,), jnp.uint32)
  words = bf16_gemm_fallback_at(cap, experts_per_rank) + experts_per_rank + 1 + cap
  return ((cap, 2 * depth), jnp.uint8), ((words,), jnp.uint32)


def bf16_gemm_fallback_at(cap: int, experts_per_rank: int) -> int:
  """Where the f16 pass's fallback words (one per expert, then one for any) start among the
  16-bit GEMM's workspace words: after GEMM_FLAG_REGIONS regions of one flag per row tile of the
  smaller tile (kernels/cuda/gemm1/args.h bf16_row_tiles_bound)."""
  return GEMM_FLAG_REGIONS * (cap // min(GEMM_TILE_TOKENS) + experts_per_rank)


def gemm1_bf16_applies(hidden: int, intermediate: int) -> bool:
  """Whether CUDA's gemm1 is the bf16 kernel (kernels/cuda/gemm1/launch.cu launch_gemm1)."""
  return hidden % 512 == 0 and intermediate % 64 == 0


def gemm1_workspace(cap: int, hidden: int, intermediate: int, experts_per_rank: int):
  """gemm1's: the bf16 kernel's where it runs (gemm1_bf16_applies)."""
  return bf16_gemm_workspace(cap, hidden, experts_per_rank,
                             gemm1_bf16_applies(hidden, intermediate))


def gemm2_workspace(cap: int, hidden: int, intermediate: int, experts_per_rank: int):
  """gemm2's (depth: intermediate, output columns: hidden): where intermediate % 512 == 0 and
  hidden % 256 == 0 (launch.cu launch_gemm2; elsewhere a generic kernel, no workspace)."""
  return bf16_gemm_workspace(cap, intermediate, experts_per_rank,
                             intermediate % 512 == 0 and hidden % 256 == 0)


def combine_workspace(tokens: int, topk: int):
  """The CUDA combine's workspace (DESIGN §5): the landed row of each (token, slot), [T * K]
  int32."""
  return (((tokens * topk,), jnp.int32),)


def workspace_bytes(workspace) -> int:
  """Bytes of a workspace spec ((shape, dtype), ...)."""
  return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in workspace)


class Layout(NamedTuple):
  offsets: jnp.ndarray   # [..., EL] start of each local expert, clipped to m_cap
  counts: jnp.ndarray    # [..., EL] rows kept (clipped so none lies at or past m_cap)
  unclipped: jnp.ndarray  # [..., EL] aligned start before clipping
  dropped: jnp.ndarray   # [...] rows that did not fit


def landing_layout(total: jnp.ndarray, row_align: int, cap: int) -> Layout:
  """total [..., EL] rows per local expert -> where they land (§4)."""
  total = total.astype(jnp.int32)
  aligned = (total + row_align - 1) // row_align * row_align
  start = jnp.cumsum(aligned, axis=-1) - aligned
  offsets = jnp.minimum(start, cap)
  counts = jnp.clip(total, 0, cap - offsets)
  return Layout(offsets.astype(jnp.int32), counts.astype(jnp.int32), start.astype(jnp.int32),
                (total.sum(-1) - counts.sum(-1)).astype(jnp.int32))


def layout_is_valid(expert_offsets, expert_counts, src_rank, src_token, topk_slot, *,
                    num_ranks: int, num_tokens: int, topk: int) -> jnp.ndarray:
  """[] bool: whether a Stage1Output's layout keeps every rule of stage2's check
  (kernels/common/layout_check.h, whose jsm_check_layout names the first fault): each expert's
  rows [offset, offset + count) within [0, M_cap), in order, not overlapping the next's; each
  row's src_rank in [-1, R), and where >= 0 its src_token in [0, T), topk_slot in [0, K), no two
  rows with one (src_rank, src_token, topk_slot). Engine xla's stage2 gathers it from every rank
  before its exchange, so that all ranks stop together where one's output was modified."""
  o, c = expert_offsets.astype(jnp.int32), expert_counts.astype(jnp.int32)
  M = src_rank.shape[0]
  ok = jnp.all((o >= 0) & (o <= M) & (c >= 0)) & jnp.all(c <= M - jnp.clip(o, 0, M))
  ok &= jnp.all(o[1:] >= o[:-1]) & jnp.all(c[:-1] <= o[1:] - o[:-1])
  s, t, k = (a.astype(jnp.int32) for a in (src_rank, src_token, topk_slot))
  row = s >= 0
  ok &= jnp.all((s >= -1) & (s < num_ranks))
  ok &= jnp.all(~row | ((t >= 0) & (t < num_tokens) & (k >= 0) & (k < topk)))
  places = num_ranks * num_tokens * topk
  at = jnp.where(row & (s < num_ranks) & (t >= 0) & (t < num_tokens) & (k >= 0) & (k < topk),
                 (s * num_tokens + t) * topk + k, places)
  seen = jnp.zeros((places,), jnp.int32).at[at].add(1, mode="drop")
  return ok & jnp.all(seen <= 1)
