"""The references the paths are checked against, and the checks (numpy on the host, once per
path before it is timed).

CPU mode checks every row against the full `jax_sdma_moe.reference.stage1`; --gpu checks the layout
arrays in full against `reference.dispatch` and h of a sample of experts per rank against a float32
reference (reference.stage1's GEMM is dense over all experts: far too slow at dsv3)."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple, Sequence

import jax
import numpy as np

import jax_sdma_moe as jsm
from jax_sdma_moe import reference

from bench.inputs import per_group
from bench.processes import CheckError, global_to_host

if TYPE_CHECKING:  # pragma: no cover
  from bench.natives import NativeOut

# Stage1Output fields that are integers or copied floats: every engine must match the reference
# exactly (DESIGN.md §4). h is compared within the §3 tolerance instead.
LAYOUT_FIELDS = ("expert_offsets", "expert_counts", "src_rank", "src_token", "topk_slot",
                 "topk_weight", "num_rows", "num_invalid", "overflow")
REL_TOL = 4e-3      # DESIGN.md §3: ||out - ref|| / ||ref|| per expert block
MAX_ABS_TOL = 1e-2  # DESIGN.md §3: max |out - ref| <= MAX_ABS_TOL * max |ref|
RANDOM_EXPERTS = 4  # --gpu check: random non-empty experts checked besides first, last, largest


class Reference(NamedTuple):
  """What every path's output is checked against."""
  layout: jsm.Stage1Output  # host arrays with a leading [R] axis; only the LAYOUT_FIELDS are used
  h32: dict                 # (rank, local expert) -> float32 reference h [rows of the block, I]


def full_reference(ref: jsm.Stage1Output, h32: np.ndarray) -> Reference:
  """Every non-empty (rank, expert) block of the full reference.stage1 (host arrays)."""
  offsets, counts = ref.expert_offsets, ref.expert_counts
  blocks = {(r, e): h32[r, offsets[r, e]:offsets[r, e] + counts[r, e]]
            for r in range(counts.shape[0]) for e in range(counts.shape[1]) if counts[r, e]}
  return Reference(ref, blocks)


@functools.partial(jax.jit, static_argnames=("E", "R", "row_align", "cap"))
def _reference_layout(x, ids, weights, *, E: int, R: int, row_align: int, cap: int):
  """reference.dispatch of every EP group of R ranks: x, ids, weights [N, ...] (bench/inputs.py
  rows_spec)."""
  return per_group(lambda x, ids, weights: reference.dispatch(
      reference.quantize(x), ids, weights, E, row_align, cap), R)(x, ids, weights)


def sampled_reference(shape: jsm.MoEShape, row_align: int, cap: int, inputs, w1q,
                      rng: np.random.Generator) -> tuple:
  """One process, any size: the full layout of every rank from reference.dispatch (on the
  devices), and the float32 h of a sample of experts per rank only (reference.stage1's GEMM is
  dense over all experts: far too slow at dsv3). The sample: the first, last and largest non-empty
  experts and RANDOM_EXPERTS random non-empty ones. Returns the Reference and the (rank, expert)
  pairs checked (rank: the device, of every EP group, as inputs are stacked; w1q [R, E/R, ...])."""
  x, ids, weights = inputs
  E, R = shape.num_experts, w1q.values.shape[0]
  landed = _reference_layout(x, ids, weights, E=E, R=R, row_align=row_align, cap=cap)
  lay = jsm.Stage1Output(
      None, *global_to_host((landed.expert_offsets, landed.expert_counts, landed.src_rank,
                             landed.src_token, landed.topk_slot, landed.topk_weight,
                             landed.num_rows)),
      np.sum(global_to_host(ids) >= E, axis=(1, 2)).astype(np.int32),
      global_to_host(landed.overflow))
  blocks, checked, group = {}, [], None
  for rank in range(lay.expert_counts.shape[0]):
    offsets, counts = lay.expert_offsets[rank], lay.expert_counts[rank]
    experts = pick_experts(counts, rng)
    if not experts:
      continue
    if rank // R != group:  # the rows landed on the group's ranks (w1q: one group's)
      group = rank // R
      rows = ((landed.values, landed.scales) if len(lay.expert_counts) == R else
              (landed.values[group * R:(group + 1) * R], landed.scales[group * R:(group + 1) * R]))
    h32 = reference.sampled_h32(*rows, offsets, counts, experts, w1q, rank % R,
                                shape.swiglu_limit, host=global_to_host)
    blocks.update({(rank, e): h for e, h in h32.items()})
    checked += [(rank, e) for e in experts]
  return Reference(lay, blocks), checked


def pick_experts(counts: np.ndarray, rng: np.random.Generator) -> list:
  """The experts whose h a --gpu check computes: the first, last and largest non-empty ones and
  RANDOM_EXPERTS random non-empty ones (none if all are empty)."""
  nonempty = np.flatnonzero(counts)
  if not len(nonempty):
    return []
  pick = {nonempty[0], nonempty[-1], int(np.argmax(counts))}
  pick |= set(rng.choice(nonempty, min(RANDOM_EXPERTS, len(nonempty)), replace=False).tolist())
  return sorted(int(e) for e in pick)


def check_gemm1(h: np.ndarray, landed: tuple, w1q, swiglu_limit, rng: np.random.Generator
                ) -> list:
  """gemm1 alone on one device (landed = (values, scales, offsets, counts), w1q [EL, 2I, H]): h
  [M_cap, I] of the picked experts within §3 of the float32 reference. Returns those experts."""
  values, scales, offsets, counts = landed
  offsets, counts = np.asarray(offsets), np.asarray(counts)
  experts = pick_experts(counts, rng)
  want = reference.sampled_h32(values[None], scales[None], offsets, counts, experts, w1q, 0,
                               swiglu_limit)
  for e in experts:
    assert_close(f"gemm1 h of expert {e}",
                 np.asarray(h[offsets[e]:offsets[e] + counts[e]], np.float32), want[e])
  return experts


def assert_close(what: str, out: np.ndarray, ref: np.ndarray) -> None:
  """DESIGN.md §3 tolerance of out against the float32 reference."""
  if out.size == 0:
    return
  if np.isnan(out).any() and not np.isnan(ref).any():
    raise CheckError(f"{what}: NaN in the output where the reference has none")
  diff = out - ref
  rel = np.linalg.norm(diff) / max(float(np.linalg.norm(ref)), 1e-30)
  max_abs = float(np.max(np.abs(diff)))
  if rel > REL_TOL or max_abs > MAX_ABS_TOL * float(np.max(np.abs(ref))):
    raise CheckError(f"{what}: relative error {rel:.2e} (limit {REL_TOL}), max |diff| "
                     f"{max_abs:.3e} "
                     f"(limit {MAX_ABS_TOL} * max |ref| = {MAX_ABS_TOL * np.max(np.abs(ref)):.3e})")


def check_padding_zero(what: str, h: np.ndarray, padding: np.ndarray) -> None:
  if np.any(h[padding].astype(np.float32) != 0):
    raise CheckError(f"{what}: padding rows are not 0")


class Tally(NamedTuple):
  """A check's row counts on the ranks it checked; check_path sums them over processes (a dropped
  row is counted at its source, a missing one at its destination)."""
  dropped: int  # rows the path reports dropped (over capacity; engines: past M_cap, as reference)
  missing: int  # rows the reference routes to these ranks that the path did not land there


def check_engine(out: jsm.Stage1Output, ref: Reference, ranks: Sequence[int]) -> Tally:
  """Layout exactly equal to the reference; h within tolerance per checked (rank, expert) block;
  padding rows 0. out holds the ranks `ranks` along axis 0."""
  lay = ref.layout
  for field in LAYOUT_FIELDS:
    got, want = np.asarray(getattr(out, field)), np.asarray(getattr(lay, field))[ranks]
    if got.shape != want.shape or not np.array_equal(got, want):
      bad = np.argwhere(got != want) if got.shape == want.shape else "shape"
      if not isinstance(bad, str) and len(bad):
        bad[0][0] = ranks[bad[0][0]]  # the rank, not this process's index of it
      raise CheckError(f"{field} differs from the reference: shapes {got.shape} vs {want.shape}, "
                       f"first differing index {bad[0] if len(bad) else bad}")
  h = np.asarray(out.h)
  row_of = {r: i for i, r in enumerate(ranks)}
  for (r, e), want in ref.h32.items():
    if r in row_of:
      start = lay.expert_offsets[r, e]
      assert_close(f"h of rank {r} expert {e}",
                   h[row_of[r], start:start + len(want)].astype(np.float32), want)
  for i, r in enumerate(ranks):
    check_padding_zero(f"h of rank {r}", h[i], lay.src_rank[r] < 0)
  overflow = int(np.sum(lay.overflow[ranks]))  # rows that did not land (engine and reference)
  return Tally(overflow, overflow)


def check_native(out: NativeOut, ref: Reference, ranks: Sequence[int], *, tokens: int,
                 topk: int) -> Tally:
  """Every row a native path produced is a row the reference routes to that rank (no duplicates)
  and the rows of each checked reference block match it. check_path checks that every reference
  row is there except those the path reports dropped. out holds the ranks `ranks` along axis 0."""
  lay = ref.layout
  R, T, K = lay.num_rows.shape[0], tokens, topk
  h = np.asarray(out.h)

  def key(src, tok, slot):  # one integer per (source rank, token, slot)
    return (src.astype(np.int64) * T + tok) * K + slot

  got_rows = 0
  for i, d in enumerate(ranks):
    ref_row_of = np.full(R * T * K, -1, np.int64)
    present = np.nonzero(lay.src_rank[d] >= 0)[0]
    ref_row_of[key(lay.src_rank[d][present], lay.src_token[d][present],
                   lay.topk_slot[d][present])] = present
    mine = np.nonzero(out.src_rank[i] >= 0)[0]
    ref_rows = ref_row_of[key(out.src_rank[i][mine], out.src_token[i][mine],
                              out.topk_slot[i][mine])]
    if np.any(ref_rows < 0) or len(np.unique(ref_rows)) != len(ref_rows):
      raise CheckError(f"rank {d} holds rows the reference does not route to it, or duplicates")
    check_padding_zero(f"h of rank {d}", h[i], out.src_rank[i] < 0)
    for (r, e), want in ref.h32.items():
      if r != d:
        continue
      start = lay.expert_offsets[d, e]
      sel = (ref_rows >= start) & (ref_rows < start + len(want))  # the rows of block e it kept
      assert_close(f"h of rank {d} expert {e}", h[i][mine[sel]].astype(np.float32),
                   want[ref_rows[sel] - start])
    got_rows += len(mine)
  return Tally(int(np.sum(out.dropped)), int(np.sum(lay.num_rows[ranks])) - got_rows)
