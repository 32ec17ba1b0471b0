"""Pytrees of the public API."""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax


class MXFP8(NamedTuple):
  """MX-fp8 tensor: values float8_e4m3fn [..., N], e8m0 scales uint8 [..., N // 32]."""
  values: jax.Array
  scales: jax.Array


class QuantizedW1(NamedTuple):
  """MX-fp8 w1: values [E, 2I, H] (rows [0, I) gate, [I, 2I) up), scales [E, 2I, H // 32]."""
  values: jax.Array
  scales: jax.Array


class QuantizedW2(NamedTuple):
  """MX-fp8 w2 (the down projection): values [E, H, I], scales [E, H, I // 32] (blocks along I)."""
  values: jax.Array
  scales: jax.Array


class Stage1Output(NamedTuple):
  """Stage1 result of one rank (DESIGN.md §2, §4); static capacity M_cap rows.

  h: [M_cap, I] bfloat16, or MXFP8 when out_dtype="mxfp8". Padding rows are 0.
  expert_offsets, expert_counts: [EL] int32; local expert e owns rows
    [expert_offsets[e], expert_offsets[e] + expert_counts[e]).
  src_rank, src_token, topk_slot: [M_cap] int32 (-1 on padding rows); topk_weight [M_cap] f32.
  num_rows: rows landed here. num_invalid: ids outside [-1, E) among this rank's own tokens (no
  row made). overflow: rows routed here that did not fit M_cap (always 0 with the default M_cap,
  which holds every row of any ids; with stage1(check=True), the rows dropped over the whole
  axis, which the check requires to be 0).
  send_pos: [T, K] int32, this rank's own (token, slot)s: the row of each in its send buffer, -1
    where it made none (no route, invalid id). Stage2 reads T and K from it.
  """
  h: Union[jax.Array, MXFP8]
  expert_offsets: jax.Array
  expert_counts: jax.Array
  src_rank: jax.Array
  src_token: jax.Array
  topk_slot: jax.Array
  topk_weight: jax.Array
  num_rows: jax.Array
  num_invalid: jax.Array
  overflow: jax.Array
  send_pos: Optional[jax.Array] = None


class SendBuffer(NamedTuple):
  """A source rank's rows, grouped by (destination, local expert) (output of qpack / pack)."""
  values: jax.Array   # [S, H] float8_e4m3fn
  scales: jax.Array   # [S, H // 32] uint8
  token: jax.Array    # [S] int32, -1 on unused rows
  slot: jax.Array     # [S] int32
  weight: jax.Array   # [S] float32


class Route(NamedTuple):
  """Output of route for one source rank."""
  send_counts: jax.Array  # [R, EL] int32 rows to (destination, local expert)
  send_pos: jax.Array     # [T, K] int32 row of (token, slot) in the send buffer, -1 if none
  num_invalid: jax.Array  # [] int32 ids >= E


class Landed(NamedTuple):
  """Rows landed on one rank in §4 layout (output of dispatch)."""
  values: jax.Array          # [M_cap, H] float8_e4m3fn, 0 on padding rows
  scales: jax.Array          # [M_cap, H // 32] uint8, 0 on padding rows
  src_rank: jax.Array        # [M_cap] int32
  src_token: jax.Array       # [M_cap] int32
  topk_slot: jax.Array       # [M_cap] int32
  topk_weight: jax.Array     # [M_cap] float32
  expert_offsets: jax.Array  # [EL] int32
  expert_counts: jax.Array   # [EL] int32
  num_rows: jax.Array        # [] int32
  overflow: jax.Array        # [] int32


class MoEStats(NamedTuple):
  """What jsm.moe(..., return_stats=True) returns beside y: this rank's Stage1 counts, as device
  arrays (no host synchronisation; usable inside CUDA graphs and jit).

  num_rows: [] int32, rows landed on this rank. num_invalid: [] int32, this rank's (token, slot)s
  whose id was outside [-1, E) (no row made). overflow: [] int32, rows routed here that did not
  fit M_cap (always 0 with the default, dropless M_cap). expert_counts: [E/R] int32, rows per
  local expert.
  """
  num_rows: jax.Array
  num_invalid: jax.Array
  overflow: jax.Array
  expert_counts: jax.Array
