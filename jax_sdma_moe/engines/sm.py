"""Engine `sm` (CUDA): `Stage1Config.sm_dispatch_blocks` SMs store the rows to the peers' windows
over NVLink, each segment followed by a system fence and a release store of its signal. No host
step per call, so its calls may be captured in XLA's command buffers (CUDA graphs). Its combine
stores each row back at (token, slot) of its source's return slot, then every rank sums its
tokens' slots (kernels/cuda/ep/combine.cu)."""
from __future__ import annotations

from .base import FfiDispatchEngine
from .cuda_windows import CudaWindowEngine


class SmEngine(CudaWindowEngine):
  name = "sm"
  graph_capturable = True
  combine = FfiDispatchEngine.combine

  @property
  def _kernel_blocks(self):  # its dispatch kernel's blocks, SMs the fused GEMM leaves to it
    return self.config.sm_dispatch_blocks
