"""Engine `ce` (CUDA): the rows cross to the peers on the copy engines — each peer's rows in one
piece (two copies: values, and meta rows of header + scales) into the peer's staging, followed in
stream order by its flag, whatever the experts; a placement kernel on a few SMs puts the staged
rows at their offsets beside the fused GEMM — while a kernel stores the rank's own rows; one host
synchronisation per call for the plan. Its combine gathers each peer's GEMM2 rows into that
peer's send order and copies them back in one piece (two copies per peer), with no host wait (the
plan is on the host since the dispatch)."""
from __future__ import annotations

from .base import FfiDispatchEngine
from .cuda_windows import CudaWindowEngine


class CeEngine(CudaWindowEngine):
  name = "ce"
  # the host waits for the plan and enqueues the copies in every call: no CUDA graph
  graph_capturable = False
  # each peer's rows, gathered into its send order, back to its send positions by the copy
  # engines, from the plan of the rank's latest dispatch (kernels/cuda/ep/combine.cu)
  combine = FfiDispatchEngine.combine

  @property
  def _kernel_blocks(self):  # its placement kernel's blocks, SMs the fused GEMM leaves to it
    return self.config.ce_place_blocks

  _HOST_KEYS = ("calls", "plan_us", "plan_stream_us", "enqueue_us", "copies", "single_copies")

  def host_stats(self) -> dict:
    """{rank: {"calls", "plan_us", "plan_stream_us", "enqueue_us", "copies", "single_copies",
    "batch_error"}} over this process's ranks and every call so far (totals): the host time of the
    plan's synchronisation (from the call's start until every source's plan is on the host;
    plan_stream_us: the part spent waiting for the stream's earlier work, the rest waits for the
    peers) and of enqueueing the row copies to the peers; the copies enqueued, those enqueued one
    at a time because cudaMemcpyBatchAsync refused their batch, and the error name of its last
    refusal ("" if none)."""
    return self._rank_stats(self._HOST_KEYS)
