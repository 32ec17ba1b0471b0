"""What engines `ce` and `sm` share: symmetric device windows on every GPU of the axis (peer
access within one process, CUDA IPC handles across processes), made per dispatch geometry at the
first trace that needs them, and the dispatch fused with GEMM1."""
from __future__ import annotations

from .. import primitives
from ..layout import BLOCK
from .windows import WindowEngine


def fused_gemm1_ok(hidden: int, row_align: int) -> bool:
  """Whether gemm1 runs fused with the dispatch (reading each expert's rows from the landing
  window as they arrive). The GEMM caches scale rows in L1, so an expert's scale rows must not
  share a 128-byte line with another expert's: row_align * H/32 % 128 == 0 (true for the default
  row_align of 128). Otherwise the rows are copied out first (dispatch, then gemm1)."""
  return row_align * (hidden // BLOCK) % 128 == 0


class CudaWindowEngine(WindowEngine):
  platforms = ("cuda",)
  counts_overflow_axis_wide = True  # every rank holds every rank's plan (ep_layout_kernel)
  # the thread blocks of the engine's own kernel (SMs the fused GEMM leaves to it): each
  # subclass's property, from its Stage1Config field
  _kernel_blocks: int

  @classmethod
  def check_mesh(cls, runtime):
    super().check_mesh(runtime)
    if not runtime.lowering_only and not hasattr(primitives.extension(), "ep_windows_create"):
      raise ValueError("Runtime: this build of jax_sdma_moe has no CUDA engines; rebuild where "
                       "nvcc is installed")

  def _create(self, key, local):
    """Device windows on this process's GPUs (one set holding every EP group's ranks here; a
    rank's peers are its group's), then peer access within the process where every group here
    lies in it, or CUDA IPC handles exchanged with the other processes of the groups."""
    rt, ext = self.runtime, self._ext
    wid = ext.ep_windows_create(rt.num_ranks, ext.ENGINE_IDS[self.name], self._kernel_blocks,
                                *key, rt.num_groups, *map(list, zip(*local)))
    try:
      groups = sorted({g for g, _, _ in local})
      if len(local) == len(groups) * rt.num_ranks:
        ext.ep_windows_connect_local(wid)
      else:
        handles = self._exchange(
            "x".join(map(str, key)),
            {f"{g}/{r}": ext.ep_window_ipc_handle(wid, g, r) for g, r, _ in local},
            [f"{g}/{s}" for g in groups for s in range(rt.num_ranks)])
        for g, r, _ in local:
          i = groups.index(g) * rt.num_ranks
          ext.ep_windows_open(wid, g, r, handles[i:i + rt.num_ranks])
    except Exception:
      ext.ep_windows_destroy(wid)
      raise
    return wid

  def _error(self, wid):
    return self._ext.ep_error(wid)

  def _destroy(self, wid):
    self._ext.ep_windows_destroy(wid)

  def _fused(self, send, w1q):
    return fused_gemm1_ok(send.values.shape[1], self.config.row_align)

  _TIMELINE_KEYS = ("timed_calls", "first_chunk_calls", "gemm_start_us", "gemm_end_us",
                    "side_end_us", "first_chunk_us")

  def _rank_stats(self, keys) -> dict:
    """{rank: {key: total over every window set of this Runtime, "batch_error": the last}} for
    this process's ranks."""
    out = {}
    for wid in list(self._windows.values()):
      for st in self._ext.ep_host_stats(wid):
        acc = out.setdefault(st["rank"], {**dict.fromkeys(keys, 0), "batch_error": ""})
        for k in keys:
          acc[k] += st[k]
        acc["batch_error"] = st["batch_error"] or acc["batch_error"]
    return out

  def timeline(self) -> dict:
    """{rank: {"calls", "gemm_start_ms", "gemm_end_ms", "side_end_ms", "first_chunk_ms"}}: the
    device-side timeline of the fused calls (dispatch + GEMM, outside CUDA graphs) so far, means
    over the calls whose events had completed by the rank's next call, in ms after the dispatch's
    start on XLA's stream: XLA's stream reaching the fused GEMM and leaving it, the side stream
    done (ce: the peers' copies; sm: its kernel), and for ce the first peer's copies
    landed (None for sm). {} before a timed call."""
    out = {}
    for rank, t in self._rank_stats(self._TIMELINE_KEYS).items():
      n, n1 = t["timed_calls"], t["first_chunk_calls"]
      if not n:
        continue
      out[rank] = {"calls": n, "gemm_start_ms": t["gemm_start_us"] / n / 1e3,
                   "gemm_end_ms": t["gemm_end_us"] / n / 1e3,
                   "side_end_ms": t["side_end_us"] / n / 1e3,
                   "first_chunk_ms": t["first_chunk_us"] / n1 / 1e3 if n1 else None}
    return out
