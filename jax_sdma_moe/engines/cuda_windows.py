"""What engines `ce` and `sm` share: symmetric device windows on every GPU of the axis (peer
access within one process, CUDA IPC handles across processes), made per dispatch geometry at the
first trace that needs them, and the dispatch fused with GEMM1."""
from __future__ import annotations

import threading

import jax

from .. import primitives
from ..layout import BLOCK
from .base import FfiDispatchEngine, gemm1_options


def fused_gemm1_ok(hidden: int, row_align: int) -> bool:
  """Whether gemm1 runs fused with the dispatch (reading each expert's rows from the landing
  window as they arrive). The GEMM caches scale rows in L1, so an expert's scale rows must not
  share a 128-byte line with another expert's: row_align * H/32 % 128 == 0 (true for the default
  row_align of 128). Otherwise the rows are copied out first (dispatch, then gemm1)."""
  return row_align * (hidden // BLOCK) % 128 == 0


class CudaWindowEngine(FfiDispatchEngine):
  platforms = ("cuda",)
  fuses_gemm1 = True

  @classmethod
  def check_mesh(cls, runtime):
    super().check_mesh(runtime)
    if runtime.num_ranks < 2:
      raise ValueError(f"Runtime: engine {cls.name!r} moves rows between GPUs; axis "
                       f"{runtime.axis_name!r} has one rank: use engine 'local'")
    if not runtime.only_axis:
      raise ValueError(f"Runtime: engine {cls.name!r} needs a mesh whose only axis longer than "
                       f"one is {runtime.axis_name!r}, got {dict(runtime.mesh.shape)}")
    if not hasattr(primitives.extension(), "ep_windows_create"):
      raise ValueError("Runtime: this build of jax_sdma_moe has no CUDA engines; rebuild where "
                       "nvcc is installed")

  def __init__(self, runtime):
    super().__init__(runtime)
    self._ext = primitives.extension()  # kept: close_at_exit runs when module globals are gone
    self._lock = threading.Lock()
    self._windows = {}  # (H, EL, M_cap, send rows) -> window set id
    self._closed = False

  def window_set(self, send, send_counts, cap):
    return self._window_set(send.values.shape[1], send_counts.shape[1], cap,
                            send.values.shape[0])

  def _window_set(self, hidden: int, local_experts: int, cap: int, send_rows: int) -> int:
    """The windows of one dispatch geometry, created at the first trace that needs them (on the
    host, outside any computation) and kept until close(). Every process of a multi-process mesh
    must trace the same calls: they exchange CUDA IPC handles through jax.distributed's key-value
    store here."""
    key = (int(hidden), int(local_experts), int(cap), int(send_rows))
    rt = self.runtime
    with self._lock:
      if self._closed:
        raise ValueError("Runtime is closed")
      if key in self._windows:
        return self._windows[key]
      ext = self._ext
      devices = list(rt.mesh.devices.reshape(-1))  # the other axes have length 1 (check_mesh)
      me = jax.process_index()
      local = [(r, d.local_hardware_id) for r, d in enumerate(devices) if d.process_index == me]
      wid = ext.ep_windows_create(rt.num_ranks, ext.ENGINE_IDS[self.name],
                                  self.config.sm_dispatch_blocks, *key, [r for r, _ in local],
                                  [d for _, d in local])
      try:
        if len(local) == rt.num_ranks:
          ext.ep_windows_connect_local(wid)
        else:
          self._exchange_ipc_handles(wid, key, [r for r, _ in local])
      except Exception:
        ext.ep_windows_destroy(wid)
        raise
      self._windows[key] = wid
      return wid

  def _exchange_ipc_handles(self, wid: int, key: tuple, local_ranks: list):
    from jax._src import distributed
    rt = self.runtime
    client = distributed.global_state.client
    if client is None:
      raise ValueError("Runtime: a mesh spanning processes needs jax.distributed.initialize()")
    prefix = f"jax_sdma_moe/{rt.serial}/{'x'.join(map(str, key))}"
    for r in local_ranks:
      client.key_value_set_bytes(f"{prefix}/{r}", self._ext.ep_window_ipc_handle(wid, r))
    timeout_ms = int(max(self.config.timeout_s, 1.0) * 1000)
    try:
      handles = [client.blocking_key_value_get_bytes(f"{prefix}/{s}", timeout_ms)
                 for s in range(rt.num_ranks)]
    except Exception as e:
      raise TimeoutError(f"Runtime: the peers' windows ({prefix}) did not arrive within "
                         f"{timeout_ms / 1000} s: {e}") from e
    for r in local_ranks:
      self._ext.ep_windows_open(wid, r, handles)

  def dispatch_gemm1(self, send, send_counts, rank, w1q, *, cap):
    if not fused_gemm1_ok(send.values.shape[1], self.config.row_align):
      return super().dispatch_gemm1(send, send_counts, rank, w1q, cap=cap)
    return primitives.dispatch_gemm1(
        send, send_counts, rank, w1q, cap=cap,
        options=self.dispatch_options(send, send_counts, cap),
        gemm1_options=gemm1_options(self.config), graph=self.graph_capturable)

  def check(self):
    """Raises if a bounded wait of a kernel ran out (engine sm has no host step in the call
    itself, so such an error surfaces here and at the next call)."""
    for wid in list(self._windows.values()):
      msg = self._ext.ep_error(wid)
      if msg:
        raise TimeoutError(msg)

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
    done (ce: the peers' copies; sm: its kernel), and for ce the first chunk of the peers' copies
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

  def close(self):
    with self._lock:
      for wid in self._windows.values():
        self._ext.ep_windows_destroy(wid)
      self._windows = {}
      self._closed = True
