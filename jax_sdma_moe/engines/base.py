"""What every engine is: the interface `stage1` and `Runtime` use, and the shared lowering of the
engines whose dispatch is the `dispatch` custom call."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar, Tuple

import jax

from .. import layout, primitives
from ..types import Landed, QuantizedW1, SendBuffer, Stage1Output

# Where Stage2 on GPUs (a CUDA gemm2, the GPU engines' combine) is tracked; the errors of the parts
# not built name it.
STAGE2_ON_GPUS_ISSUE = "issue 16: Stage2 on GPUs"

if TYPE_CHECKING:  # pragma: no cover
  from ..runtime import Runtime


def gemm1_options(config, send: SendBuffer, send_counts: jax.Array) -> primitives.Gemm1Options:
  """The Stage1Config's gemm1 options for a dispatch of this send buffer: its send rows (T*K, its
  headers) over the local experts give the rows per expert that pick the CUDA GEMM's tile."""
  tile = layout.gemm_tile_tokens(send.token.shape[0] / send_counts.shape[1],
                                 config.gemm_tile_tokens)
  return primitives.Gemm1Options(swiglu_limit=config.swiglu_limit, out_dtype=config.out_dtype,
                                 tile_tokens=tile)


class Engine:
  """One Runtime's dispatch engine, and the way back of its dispatch (Stage2's combine).

  name: the Stage1Config.engine value. platforms: where it runs. fuses_gemm1: dispatch and gemm1
  run as one call, the GEMM starting each expert as its rows land. graph_capturable: its calls
  have no host step, so XLA may capture them in command buffers (CUDA graphs).
  counts_overflow_axis_wide: with axis_overflow=True its dispatch's `overflow` result is the rows
  dropped over the whole axis (others: this rank's, and stage1 gathers them).
  """
  name: ClassVar[str]
  platforms: ClassVar[Tuple[str, ...]]
  fuses_gemm1: ClassVar[bool] = False
  graph_capturable: ClassVar[bool] = False
  # its dispatch can count the rows dropped over the whole axis (DispatchOptions.global_overflow:
  # every rank holds every rank's plan), which stage1(check=True) checks on every rank
  counts_overflow_axis_wide: ClassVar[bool] = False
  # its exchanges are XLA collectives, where a rank that fails alone leaves its peers waiting
  # until XLA aborts the process: checks that may fail on one rank are made axis-wide first
  exchanges_through_xla: ClassVar[bool] = False

  @classmethod
  def check_mesh(cls, runtime: "Runtime") -> None:
    """Raises ValueError if this engine cannot serve the Runtime's mesh axis."""
    if runtime.platform not in cls.platforms:
      raise ValueError(f"Runtime: engine {cls.name!r} runs on {cls.platforms}, but the mesh is on "
                       f"{runtime.platform!r}")

  def __init__(self, runtime: "Runtime"):
    self.runtime = runtime

  @property
  def config(self):
    return self.runtime.config

  def dispatch(self, send: SendBuffer, send_counts: jax.Array, rank: jax.Array, *,
               cap: int, axis_overflow: bool = False) -> Landed:
    """This rank's send buffer -> its landed rows (§4 layout). axis_overflow: `overflow` counts
    the rows dropped over the whole axis (engines with counts_overflow_axis_wide only)."""
    raise NotImplementedError

  def send_token_rows(self, H: int, I: int) -> bool:
    """Whether Stage1 hands this engine a send buffer of token rows (qpack token_rows: one row per
    token, which its fused call reads through the landed rows' headers) rather than one row per
    send position. Only engine local's fused call takes them (DESIGN.md §5)."""
    return False

  def dispatch_gemm1(self, send: SendBuffer, send_counts: jax.Array, rank: jax.Array,
                     w1q: QuantizedW1, *, cap: int, token_rows: bool = False,
                     axis_overflow: bool = False):
    """dispatch then gemm1: (Landed, h). Engines that fuse the two override this. token_rows: the
    send buffer's rows are by token (send_token_rows). axis_overflow: as dispatch's."""
    if token_rows:
      raise ValueError(f"engine {self.name!r}: dispatch reads a send buffer of send rows, not "
                       "token rows (qpack token_rows=False)")
    landed = self.dispatch(send, send_counts, rank, cap=cap, axis_overflow=axis_overflow)
    h = primitives.gemm1(landed.values, landed.scales, landed.expert_offsets,
                         landed.expert_counts, w1q,
                         options=gemm1_options(self.config, send, send_counts))
    return landed, h

  def combine(self, rows: jax.Array, out1: Stage1Output, rank: jax.Array, *, num_tokens: int,
              topk: int) -> jax.Array:
    """Stage2's return: each landed row's GEMM2 output (rows [M_cap, H] bf16, in out1's §4
    layout) back to its source rank, token and slot, weighted by its top-k weight and summed per
    token there in slot order: y [num_tokens, H] bf16 (DESIGN.md §3, §6)."""
    raise self.combine_not_built()

  def window_bytes(self, H: int, EL: int, cap: int, send_rows: int) -> int:
    """Device bytes per rank of the engine's windows for one call geometry beyond the two parity
    slots of landing rows that api.call_bytes counts (0: nothing more)."""
    return 0

  @classmethod
  def combine_not_built(cls) -> NotImplementedError:
    return NotImplementedError(
        f"engine {cls.name!r} has no combine yet, so jsm.stage2 and jsm.moe cannot run with it "
        f"({STAGE2_ON_GPUS_ISSUE}); engines with a combine: cpu, local, xla, sm, ce, sdma")

  def check(self) -> None:
    """Raises if a bounded wait of an earlier call ran out (engines with device-side waits)."""

  def host_stats(self) -> dict:
    """Host-side statistics of the calls so far ({} where the engine keeps none)."""
    return {}

  def timeline(self) -> dict:
    """Device-side timeline of the calls so far ({} where the engine keeps none)."""
    return {}

  def close(self) -> None:
    """Frees the engine's per-Runtime state (the Runtime has waited for the calls in flight)."""

  def close_at_exit(self) -> None:
    """close() at interpreter exit, when nothing can be in flight and JAX is gone."""
    self.close()

  def __repr__(self):
    return f"{type(self).__name__}()"


class FfiDispatchEngine(Engine):
  """An engine whose dispatch is the `dispatch` custom call with the Runtime's window set."""

  def window_set(self, send: SendBuffer, send_counts: jax.Array, cap: int) -> int:
    """The handle of the window set this dispatch uses (0: none)."""
    return 0

  def combine_window_set(self, rows: jax.Array, out1: Stage1Output, num_tokens: int,
                         topk: int) -> int:
    """The handle of the window set the combine uses (0: none)."""
    return 0

  def protocol_options(self, window_set: int) -> primitives.DispatchOptions:
    """The `dispatch` attribute of this engine's dispatch and combine calls."""
    cfg, faults = self.config, self.runtime._faults
    return primitives.DispatchOptions(
        engine=self.name, window_set=window_set, row_align=cfg.row_align, timeout_s=cfg.timeout_s,
        fault_absent_rank=faults.absent_rank, fault_delay_rank=faults.delay_rank,
        fault_delay_ms=faults.delay_ms, runtime=self.runtime.serial)

  def dispatch_options(self, send, send_counts, cap,
                       axis_overflow: bool = False) -> primitives.DispatchOptions:
    if axis_overflow and not self.counts_overflow_axis_wide:
      raise ValueError(f"engine {self.name!r} does not count overflow over the axis")
    return dataclasses.replace(self.protocol_options(self.window_set(send, send_counts, cap)),
                               global_overflow=axis_overflow)

  def dispatch(self, send, send_counts, rank, *, cap, axis_overflow=False):
    return primitives.dispatch(send, send_counts, rank, cap=cap,
                               options=self.dispatch_options(send, send_counts, cap,
                                                             axis_overflow),
                               graph=self.graph_capturable)

  def _fused(self, send: SendBuffer, w1q: QuantizedW1) -> bool:
    """Whether dispatch and GEMM1 run as one call (`dispatch_gemm1`) for this shape."""
    return False

  def dispatch_gemm1(self, send, send_counts, rank, w1q, *, cap, token_rows=False,
                     axis_overflow=False):
    if not self._fused(send, w1q):
      return super().dispatch_gemm1(send, send_counts, rank, w1q, cap=cap, token_rows=token_rows,
                                    axis_overflow=axis_overflow)
    takes_token_rows = self.send_token_rows(send.values.shape[1], w1q.values.shape[1] // 2)
    if token_rows != takes_token_rows:
      raise ValueError(f"engine {self.name!r}: its fused call takes a send buffer of "
                       f"{'token' if takes_token_rows else 'send'} rows")
    return primitives.dispatch_gemm1(
        send, send_counts, rank, w1q, cap=cap,
        options=self.dispatch_options(send, send_counts, cap, axis_overflow),
        gemm1_options=gemm1_options(self.config, send, send_counts),
        graph=self.graph_capturable, token_rows=token_rows)

  def combine(self, rows, out1, rank, *, num_tokens, topk):
    return primitives.combine(rows, out1.src_rank, out1.src_token, out1.topk_slot,
                              out1.topk_weight, rank, num_tokens=num_tokens, topk=topk,
                              options=self.protocol_options(
                                  self.combine_window_set(rows, out1, num_tokens, topk)))
