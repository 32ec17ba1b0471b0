"""What the window engines share (`ce`, `sm` on CUDA; `sdma` on ROCm): symmetric windows on every
GPU of the axis, one window set per dispatch geometry, made at the first trace that needs it and
kept until close(); the dispatch fused with GEMM1; device-side waits whose expiry is raised by
check(). Subclasses say how a set is made (`_create`), read (`_error`) and freed (`_destroy`)."""
from __future__ import annotations

import threading

import jax

from .. import layout, primitives
from .base import Engine, FfiDispatchEngine


class WindowEngine(FfiDispatchEngine):
  fuses_gemm1 = True

  @classmethod
  def check_mesh(cls, runtime):
    super().check_mesh(runtime)
    if runtime.num_ranks < 2:
      raise ValueError(f"Runtime: engine {cls.name!r} moves rows between GPUs; axis "
                       f"{runtime.axis_name!r} has one rank: use engine 'local'")

  def __init__(self, runtime):
    super().__init__(runtime)
    self._ext = primitives.extension()  # kept: close_at_exit runs when module globals are gone
    self._lock = threading.Lock()
    self._windows = {}  # (H, EL, M_cap, send rows) -> window set id
    self._closed = False

  def window_bytes(self, H, EL, cap, send_rows):
    """The window's bytes as its set allocates them (the extension's window_bytes: ce and sm with
    the combine's return regions, ce also its staging, sdma its staged send rows) beyond its two
    parity slots of landing rows (values, scales, headers)."""
    whole = self._ext.window_bytes(self._ext.ENGINE_IDS[self.name], self.runtime.num_ranks, EL,
                                   H, cap, send_rows)
    return whole - 2 * cap * layout.landing_row_bytes(H)

  def window_set(self, send, send_counts, cap):
    """The windows of one dispatch geometry, created at the first trace that needs them (on the
    host, outside any computation). Every process of a multi-process mesh must trace the same
    calls: they exchange what the windows need through jax.distributed's key-value store here."""
    return self._window_set_of((int(send.values.shape[1]), int(send_counts.shape[1]), int(cap),
                                int(send.values.shape[0])))

  def _window_set_of(self, key: tuple) -> int:
    if self.runtime.lowering_only:
      return 0  # no windows exist; such a program is lowered, never run (the handler refuses 0)
    with self._lock:
      if self._closed:
        raise ValueError("Runtime is closed")
      if key not in self._windows:
        self._windows[key] = self._create(key, self._local_ranks())
      return self._windows[key]

  def _local_ranks(self):
    """[(EP group, rank within it, local device id)] of this process's devices of the mesh."""
    me = jax.process_index()
    return [(g, r, d.local_hardware_id)
            for g, devices in enumerate(self.runtime.group_devices)
            for r, d in enumerate(devices) if d.process_index == me]

  def _exchange(self, name: str, mine: dict, keys: list) -> list:
    """Publishes {key: bytes} of this process under `name` in jax.distributed's key-value store
    and returns the values of `keys` (bounded by timeout_s)."""
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
      raise ValueError("Runtime: a mesh spanning processes needs jax.distributed.initialize()")
    prefix = f"jax_sdma_moe/{self.runtime.serial}/{name}"
    for k, v in mine.items():
      client.key_value_set_bytes(f"{prefix}/{k}", v)
    timeout_ms = int(max(self.config.timeout_s, 1.0) * 1000)
    try:
      return [client.blocking_key_value_get_bytes(f"{prefix}/{k}", timeout_ms) for k in keys]
    except Exception as e:
      raise TimeoutError(f"Runtime: the peers' windows ({prefix}) did not arrive within "
                         f"{timeout_ms / 1000} s: {e}") from e

  def _create(self, key: tuple, local: list) -> int:
    raise NotImplementedError

  def _error(self, wid: int) -> str:
    raise NotImplementedError

  def _destroy(self, wid: int) -> None:
    raise NotImplementedError

  def _fused(self, send, w1q) -> bool:
    return True

  # the window engines' combine is built for engines sm, ce and sdma (DESIGN.md §6):
  # Engine.combine's error for the others
  combine = Engine.combine

  def combine_window_set(self, rows, out1, num_tokens, topk):
    """The dispatch's window set of out1's geometry (H, EL, M_cap, send rows): its return regions
    take the rows back."""
    return self._window_set_of((int(rows.shape[1]), int(out1.expert_offsets.shape[0]),
                                int(out1.src_rank.shape[0]), layout.send_rows(num_tokens, topk)))

  def check(self):
    """Raises if a bounded wait of a kernel ran out (recorded on the device: a call with no host
    step reports it here and at the rank's next call)."""
    for wid in list(self._windows.values()):
      msg = self._error(wid)
      if msg:
        raise TimeoutError(msg)

  def close(self):
    with self._lock:
      for wid in self._windows.values():
        self._destroy(wid)
      self._windows = {}
      self._closed = True
