"""Configuration and the shape registry shared by tests, benchmarks and the demo."""
from __future__ import annotations

import dataclasses
from typing import Optional

from . import engines
from .layout import GEMM_TILE_TOKENS

ENGINE_NAMES = (*engines.ENGINES, *engines.NOT_BUILT)
OUT_DTYPES = ("bf16", "mxfp8")
# Bounds the kernels rely on: their row indices and counts are int32, a landing offset is a sum
# of EL aligned counts, and a deadline is now + timeout_s in nanoseconds (64-bit).
INT32_MAX = 2**31 - 1
MAX_ROW_ALIGN = 2**16
MAX_TIMEOUT_S = 1e6  # about 11.6 days


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)



@dataclasses.dataclass(frozen=True)
class MoEShape:
  """One MoE layer's Stage1 shape (DESIGN.md §1)."""
  name: str
  hidden: int            # H
  intermediate: int      # I
  num_experts: int       # E
  topk: int              # K
  swiglu_limit: Optional[float] = None


SHAPES = {
    "dsv3": MoEShape("dsv3", 7168, 2048, 256, 8),
    "v4pro": MoEShape("v4pro", 7168, 3072, 384, 6, 10.0),
    "small": MoEShape("small", 256, 128, 16, 4),
}


@dataclasses.dataclass(frozen=True)
class Stage1Config:
  """Static settings of the layer's calls (stage1, stage2, moe): every option there is (the library reads no environment
  variables), and, being a frozen dataclass, part of the jit cache key.

  engine: how rows move between ranks: "cpu" (memcpy between the virtual CPU devices of one
    process through the Runtime's windows), "local" (one rank: all experts on this device, rows
    placed by a local copy kernel; CPU or CUDA), "xla" (XLA collectives, any platform), and the GPU
    engines "ce", "sm" (CUDA) and "sdma" (ROCm). None picks "cpu" on a CPU mesh of one process whose only
    axis longer than one is the EP axis, "local" on any other one-rank EP axis, "sm" on a CUDA
    mesh whose only axis longer than one is the EP axis, and "xla" otherwise (several CPU
    processes, or other axes longer than one beside the EP axis).
  row_align: every local expert's rows start at a multiple of this (the GEMM M-tile), in
    [1, MAX_ROW_ALIGN].
  max_recv_rows: static landing capacity per rank (M_cap), below 2**31; None (the default) is
    the dropless worst case for any ids, repeated ids included: layout.m_cap.
  out_dtype: "bf16" or "mxfp8" (values + per-32 scales along I).
  swiglu_limit: None, or L > 0 for h = silu(min(g, L)) * clamp(u, -L, L).
  timeout_s: bound on every wait for a peer, in (0, MAX_TIMEOUT_S]; on expiry the call fails
    naming rank and peer.
  sm_dispatch_blocks: thread blocks (one per SM) the "sm" engine spends on storing rows to peers.
  ce_place_blocks: thread blocks (one per SM) the "ce" engine spends on placing the peers' rows
    from its staging at their landing offsets; the fused GEMM runs on the other SMs.
  gemm_tile_tokens: the CUDA bf16 GEMMs' tile width, one of layout.GEMM_TILE_TOKENS (128, 32);
    None picks 32 where experts hold at most 32 rows on average (T*K/E_local: weight-bound
    calls), else 128 (layout.gemm_tile_tokens). Results are the same bytes either way.
  """
  engine: Optional[str] = None
  row_align: int = 128
  max_recv_rows: Optional[int] = None
  out_dtype: str = "bf16"
  swiglu_limit: Optional[float] = None
  timeout_s: float = 60.0
  sm_dispatch_blocks: int = 24
  ce_place_blocks: int = 4
  gemm_tile_tokens: Optional[int] = None

  def __post_init__(self):
    if self.engine is not None and self.engine not in ENGINE_NAMES:
      raise ValueError(f"Stage1Config.engine must be one of {ENGINE_NAMES} or None, got "
                       f"{self.engine!r}")
    if not _is_int(self.row_align) or not 1 <= self.row_align <= MAX_ROW_ALIGN:
      raise ValueError(f"Stage1Config.row_align must be an int in [1, {MAX_ROW_ALIGN}], got "
                       f"{self.row_align!r}")
    if self.max_recv_rows is not None and (not _is_int(self.max_recv_rows)
                                           or not 1 <= self.max_recv_rows <= INT32_MAX):
      raise ValueError(f"Stage1Config.max_recv_rows must be None or an int in [1, 2**31 - 1], "
                       f"got {self.max_recv_rows!r}")
    if self.out_dtype not in OUT_DTYPES:
      raise ValueError(f"Stage1Config.out_dtype must be one of {OUT_DTYPES}, got {self.out_dtype!r}")
    if self.swiglu_limit is not None and not self.swiglu_limit > 0:
      raise ValueError(f"Stage1Config.swiglu_limit must be None or > 0, got {self.swiglu_limit!r}")
    if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
        or not 0 < self.timeout_s <= MAX_TIMEOUT_S):
      raise ValueError(f"Stage1Config.timeout_s must be a number of seconds in (0, "
                       f"{MAX_TIMEOUT_S:g}] (every wait is bounded), got {self.timeout_s!r}")
    for name in ("sm_dispatch_blocks", "ce_place_blocks"):
      blocks = getattr(self, name)
      if not _is_int(blocks) or not 1 <= blocks <= 1024:
        raise ValueError(f"Stage1Config.{name} must be an int in [1, 1024], got {blocks!r}")
    if self.gemm_tile_tokens is not None and self.gemm_tile_tokens not in GEMM_TILE_TOKENS:
      raise ValueError(f"Stage1Config.gemm_tile_tokens must be None or one of "
                       f"{GEMM_TILE_TOKENS}, got {self.gemm_tile_tokens!r}")
