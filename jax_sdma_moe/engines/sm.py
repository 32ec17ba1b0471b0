"""Engine `sm` (CUDA): `Stage1Config.sm_dispatch_blocks` SMs store the rows to the peers' windows
over NVLink, each segment followed by a system fence and a release store of its signal. No host
step per call, so its calls may be captured in XLA's command buffers (CUDA graphs)."""
from __future__ import annotations

from .cuda_windows import CudaWindowEngine


class SmEngine(CudaWindowEngine):
  name = "sm"
  graph_capturable = True
