"""Engine `local`: one rank holds every expert; its rows are placed by a copy within the device,
or on CUDA, where the bf16 GEMM runs, read by the GEMM straight from the send buffer."""
from __future__ import annotations

from .. import layout
from .base import FfiDispatchEngine


class LocalEngine(FfiDispatchEngine):
  name = "local"
  platforms = ("cpu", "cuda", "rocm")

  @classmethod
  def check_mesh(cls, runtime):
    super().check_mesh(runtime)
    if runtime.num_ranks != 1:
      raise ValueError(f"Runtime: engine 'local' needs a one-rank axis, {runtime.axis_name!r} has "
                       f"{runtime.num_ranks}")

  def _fused(self, send, w1q):
    """On CUDA with the bf16 GEMM, one call: the landing layout, then the GEMM reading each
    expert's rows from its segment of the send buffer (R = 1: the send buffer is already grouped
    by expert), so no copy of the rows runs before it. Elsewhere dispatch, then gemm1."""
    return self.runtime.platform == "cuda" and layout.gemm1_bf16_applies(
        send.values.shape[1], w1q.values.shape[1] // 2)
