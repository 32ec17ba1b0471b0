"""Engine `sdma` (ROCm): the rows move on the GPUs' SDMA engines (DMA copy engines), driven from a
kernel through mori's CCO device API, between symmetric windows of mori communicators, with the
plan, epochs and bounded waits of the CUDA window engines (kernels/rocm/sdma/window.h); GEMM1 runs
fused, starting each expert as its rows land. No host step per call, so XLA may capture its calls
in command buffers (HIP graphs). Stage2's combine returns the rows by CU stores (engine sm's way
back) and GEMM2 is a generic kernel: the layer is complete, not yet fast.

Built, compiled for gfx942 and gfx950, and lowered; never run on AMD hardware (DESIGN.md §6)."""
from __future__ import annotations

from .. import primitives
from .base import FfiDispatchEngine
from .windows import WindowEngine


class SdmaEngine(WindowEngine):
  name = "sdma"
  platforms = ("rocm",)
  graph_capturable = True
  # the way back: the CUs store each row at (token, slot) of its source's return slot through the
  # LSA mapping, engine sm's protocol and kernels (kernels/rocm/sdma/combine.hip)
  combine = FfiDispatchEngine.combine

  @classmethod
  def check_mesh(cls, runtime):
    super().check_mesh(runtime)
    if runtime.lowering_only:
      return
    if runtime.num_groups > 1:
      # its mori communicators span one group; several per process is not built (the CUDA
      # engines' window sets hold every group's ranks)
      raise ValueError(f"Runtime: engine 'sdma' runs one EP group per mesh in this version; mesh "
                       f"{dict(runtime.mesh.shape)} has {runtime.num_groups} groups of axis "
                       f"{runtime.axis_name!r}: use engine 'xla' (lowering with "
                       f"lowering_only=True serves any mesh)")
    ext = primitives.extension()
    if not ext.has_rocm() or not ext.has_rocm_flydsl():
      raise ValueError("Runtime: this build of jax_sdma_moe has no engine sdma (its dispatch "
                       "kernel and GEMM1 are FlyDSL kernels, built by `pip install .` on a ROCm "
                       "machine with flydsl installed)")

  def _create(self, key, local):
    """A mori communicator per rank (its id made by the process holding rank 0 and passed through
    jax.distributed's key-value store across processes), a registered window each, SDMA queues
    (mori's default count)."""
    rt, ext = self.runtime, self._ext
    if len(local) == rt.num_ranks:
      uid = ext.sdma_unique_id()
    else:
      holds_rank0 = local[0][1] == 0
      uid, = self._exchange("sdma/" + "x".join(map(str, key)),
                            {"id": ext.sdma_unique_id()} if holds_rank0 else {}, ["id"])
    H, EL, cap, send_rows = key
    return ext.sdma_windows_create(rt.num_ranks, H, EL, cap, send_rows, uid,
                                   [r for _, r, _ in local], [d for _, _, d in local], 0)

  def _error(self, wid):
    return self._ext.sdma_error(wid)

  def _destroy(self, wid):
    self._ext.sdma_windows_destroy(wid)
