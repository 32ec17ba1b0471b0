"""Engine `xla`: the §4 landing and Stage2's return through XLA collectives (any platform; the
portable path).

On GPUs the rows travel with `ragged_all_to_all` (exact sizes); on CPU, where XLA does not
implement it, an `all_to_all` of fixed-size chunks (one per destination, T*K rows each) emulates
it. Either way each rank receives its rows source-major and places them in §4 order locally.
Stage2's return (`combine`) is one `all_to_all` of fixed-size chunks on every platform.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .. import primitives
from ..layout import landing_layout
from ..types import Landed, SendBuffer, Stage1Output
from .base import Engine

F8 = jnp.float8_e4m3fn


def _exclusive_cumsum(x, axis=-1):
  return jnp.cumsum(x, axis=axis) - x


# Payload rows travel and are gathered as 32-bit words: XLA's GPU gather moves one element per
# thread, so a gather of byte rows runs at a few GB/s (the landing measured 2.5 GB/s on 2xH200).
def _as_words(rows_u8: jax.Array) -> jax.Array:
  """[N, B] uint8 -> [N, ceil(B / 4)] uint32 (zero bytes pad the last word)."""
  n, b = rows_u8.shape
  padded = jnp.pad(rows_u8, ((0, 0), (0, -b % 4)))
  return lax.bitcast_convert_type(padded.reshape(n, (b + 3) // 4, 4), jnp.uint32)


def _as_bytes(words: jax.Array, b: int) -> jax.Array:
  """_as_words' inverse: [N, W] uint32 -> the first b bytes of each row, [N, b] uint8."""
  n, w = words.shape
  return lax.bitcast_convert_type(words, jnp.uint8).reshape(n, 4 * w)[:, :b]


def dispatch(send: SendBuffer, send_counts: jax.Array, *, axis_name: str, num_ranks: int, cap: int,
             row_align: int, ragged: bool) -> Landed:
  R = num_ranks
  S, H = send.values.shape
  me = lax.axis_index(axis_name)
  counts_all = lax.all_gather(send_counts, axis_name)          # [R src, R dst, EL]
  mine = counts_all[:, me, :]                                  # [R src, EL] rows each source sends me
  # one uint8 payload row: values | scales | token, slot, weight (as bytes)
  headers = jnp.stack([send.token, send.slot, lax.bitcast_convert_type(send.weight, jnp.int32)], -1)
  row_bytes = H + H // 32 + 12
  payload = _as_words(jnp.concatenate([
      lax.bitcast_convert_type(send.values, jnp.uint8), send.scales,
      lax.bitcast_convert_type(headers, jnp.uint8).reshape(S, 12)], axis=-1))
  per_dest = send_counts.sum(-1)                               # [R]
  dest_start = _exclusive_cumsum(per_dest)
  recv_n = mine.sum(-1)                                        # [R src]
  if ragged:
    recv_start = _exclusive_cumsum(recv_n)
    # where my chunk goes in each destination's buffer: after the chunks of lower source ranks
    out_off = jnp.sum(jnp.where(jnp.arange(R)[:, None] < me, counts_all.sum(-1), 0), axis=0)
    recv = lax.ragged_all_to_all(payload, jnp.zeros((R * S, payload.shape[-1]), jnp.uint32),
                                 dest_start, per_dest, out_off, recv_n, axis_name=axis_name)
  else:
    recv_start = jnp.arange(R) * S
    idx = jnp.clip(dest_start[:, None] + jnp.arange(S)[None, :], 0, S - 1)
    recv = lax.all_to_all(payload[idx], axis_name, 0, 0).reshape(R * S, payload.shape[-1])
  # each received row: its source s, its index j in s's chunk, its local expert e
  q = jnp.arange(R * S)
  s = jnp.clip(jnp.searchsorted(recv_start, q, side="right") - 1, 0, R - 1)
  j = q - recv_start[s]
  seg_end = jnp.cumsum(mine, -1)                               # [R src, EL]
  e = jnp.sum(seg_end[s] <= j[:, None], axis=-1)
  valid = j < recv_n[s]
  e = jnp.minimum(e, mine.shape[-1] - 1)
  lay = landing_layout(mine.sum(0), row_align, cap)
  before_me = _exclusive_cumsum(mine, axis=0)                  # rows of lower sources, per expert
  pos = lay.unclipped[e] + before_me[s, e] + (j - (seg_end - mine)[s, e])
  keep = valid & (pos < lay.offsets[e] + lay.counts[e])
  # which received row lands at each landing row (R*S: none: padding), then one gather of whole
  # rows instead of a scatter of them: XLA scatters element by element, here bytes (2.5 GB/s on
  # 2xH200 with the scatter; on CPU, R = 8, 1024 rows of dsv3 per rank: 446 -> 341 ms)
  none = R * S
  src_row = jnp.full((cap,), none, jnp.int32).at[jnp.where(keep, pos, cap)].set(
      q.astype(jnp.int32), mode="drop")
  landed_row = src_row < none
  if none:
    pick = jnp.minimum(src_row, none - 1)
    landed = _as_bytes(jnp.where(landed_row[:, None], jnp.take(recv, pick, axis=0),
                                 jnp.uint32(0)), row_bytes)
    source = jnp.where(landed_row, s[pick].astype(jnp.int32), -1)
  else:  # no rows to send anywhere (T = 0)
    landed = jnp.zeros((cap, row_bytes), jnp.uint8)
    source = jnp.full((cap,), -1, jnp.int32)
  # the overflow count needs only the gathered counts; tied to the received rows, a failing
  # stage1(check=True) can only fail after every rank has left the all_to_all (failing before it
  # would leave the other ranks waiting there until XLA's rendezvous aborts the process)
  dropped, landed = lax.optimization_barrier((lay.dropped, landed))
  hdr = lax.bitcast_convert_type(landed[:, -12:].reshape(cap, 3, 4), jnp.int32)
  hs = H // 32
  return Landed(
      lax.bitcast_convert_type(landed[:, :H], F8), landed[:, H:H + hs],
      source,
      jnp.where(landed_row, hdr[:, 0], -1), jnp.where(landed_row, hdr[:, 1], -1),
      lax.bitcast_convert_type(hdr[:, 2], jnp.float32),
      lay.offsets, lay.counts, lay.counts.sum().astype(jnp.int32), dropped)


def combine(rows: jax.Array, out1: Stage1Output, rank: jax.Array, *, axis_name: str,
            num_ranks: int, num_tokens: int, topk: int, sum_options) -> jax.Array:
  """Stage2's return through XLA collectives: each rank sends, to every source rank, the GEMM2
  rows that came from it with their (token, slot, weight) headers in one fixed-size chunk (P rows:
  no source can have more than min(M_cap, T*K) rows here), by one all_to_all; each source then
  sums its rows per token with the `combine` custom call of one rank (sum_options: engine local),
  so the bytes equal engine cpu's."""
  R, T, K = num_ranks, num_tokens, topk
  M, H = rows.shape
  P = min(M, T * K)
  if P == 0:  # no token or no landing row: nothing returns
    return jnp.zeros((T, H), jnp.bfloat16)
  src = out1.src_rank
  onehot = src[:, None] == jnp.arange(R)[None, :]                       # [M, R]
  j = jnp.sum((jnp.cumsum(onehot, 0) - 1) * onehot, axis=1)             # row's place in its chunk
  at = jnp.where(src >= 0, src * P + j, R * P)
  # which landed row goes to each chunk place (M: none), then one gather of whole rows
  pick = jnp.full((R * P,), M, jnp.int32).at[at].set(jnp.arange(M, dtype=jnp.int32), mode="drop")
  has = (pick < M)[:, None]
  pick = jnp.minimum(pick, M - 1)
  headers = jnp.stack([out1.src_token, out1.topk_slot,
                       lax.bitcast_convert_type(out1.topk_weight, jnp.int32)], -1)
  # 32-bit words (see _as_words): a row's H bf16 as H / 2 words, then its 3 header words
  words = lax.bitcast_convert_type(rows.reshape(M, H // 2, 2), jnp.uint32)
  payload = jnp.concatenate([
      jnp.where(has, words[pick], jnp.uint32(0)),
      lax.bitcast_convert_type(jnp.where(has, headers[pick], -1), jnp.uint32)], axis=-1)
  recv = lax.all_to_all(payload.reshape(R, P, -1), axis_name, 0, 0).reshape(R * P, -1)
  back = lax.bitcast_convert_type(recv[:, :H // 2], jnp.bfloat16).reshape(R * P, H)
  hdr = lax.bitcast_convert_type(recv[:, H // 2:], jnp.int32)
  mine = jnp.where(hdr[:, 0] >= 0, 0, -1)  # every returned row is this rank's
  return primitives.combine(back, mine, hdr[:, 0], hdr[:, 1],
                            lax.bitcast_convert_type(hdr[:, 2], jnp.float32), rank,
                            num_tokens=T, topk=K, options=sum_options)


class XlaEngine(Engine):
  name = "xla"
  platforms = ("cpu", "cuda", "rocm")
  exchanges_through_xla = True

  @classmethod
  def check_mesh(cls, runtime):
    super().check_mesh(runtime)
    if runtime.multi_process and runtime.platform != "cpu":
      # ragged_all_to_all across processes is XLA's NCCL send/recv fallback (refused unless
      # --xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback); with it, on jax 0.11.2 and
      # 2xH200, the rows from the other process read as zeros at the dsv3 shape (docs/PERF.md)
      raise ValueError("Runtime: engine 'xla' is not supported across GPU processes (XLA's "
                       "ragged_all_to_all falls back to NCCL there and lost rows when we tried "
                       "it); use engine 'ce' or 'sm'")

  def dispatch(self, send, send_counts, rank, *, cap, axis_overflow=False):
    assert not axis_overflow  # stage1 gathers this engine's counts itself
    rt = self.runtime
    return dispatch(send, send_counts, axis_name=rt.axis_name, num_ranks=rt.num_ranks, cap=cap,
                    row_align=self.config.row_align, ragged=rt.platform != "cpu")

  def combine(self, rows, out1, rank, *, num_tokens, topk):
    rt, cfg = self.runtime, self.config
    sum_options = primitives.DispatchOptions(engine="local", window_set=0,
                                             row_align=cfg.row_align, timeout_s=cfg.timeout_s,
                                             runtime=rt.serial)
    return combine(rows, out1, rank, axis_name=rt.axis_name, num_ranks=rt.num_ranks,
                   num_tokens=num_tokens, topk=topk, sum_options=sum_options)
