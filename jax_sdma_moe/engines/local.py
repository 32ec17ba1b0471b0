"""Engine `local`: one rank holds every expert; its rows are placed by a copy within the device,
or on CUDA, where the bf16 GEMM runs, read by the GEMM straight from the send buffer's token
rows."""
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

  def send_token_rows(self, H, I):
    """On CUDA with the bf16 GEMM, Stage1 is one call: the landing layout, then the GEMM reading
    each landed row from its token's row of the send buffer, which holds one row per token (qpack
    quantises and stores each token once, not once per expert), so no copy of the rows runs before
    the GEMM. Elsewhere dispatch, then gemm1, on send rows."""
    return self.runtime.platform == "cuda" and layout.gemm1_bf16_applies(H, I)

  def _fused(self, send, w1q):
    return self.send_token_rows(send.values.shape[1], w1q.values.shape[1] // 2)
