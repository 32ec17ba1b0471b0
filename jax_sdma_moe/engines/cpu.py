"""Engine `cpu`: memcpy between the virtual CPU devices of one process through the Runtime's
windows, with the same plan, signals and bounded waits as the GPU engines (the protocol's
executable specification, kernels/cpu/dispatch.h)."""
from __future__ import annotations

from .. import primitives
from .base import FfiDispatchEngine


class CpuEngine(FfiDispatchEngine):
  name = "cpu"
  platforms = ("cpu",)

  @classmethod
  def check_mesh(cls, runtime):
    super().check_mesh(runtime)
    if runtime.multi_process:
      raise ValueError("Runtime: engine 'cpu' moves rows between the devices of one process; this "
                       "mesh spans several processes (jax.distributed): use engine 'xla'")
    if not runtime.only_axis:
      # its window table holds one set of windows per rank of the axis: two groups' ranks of
      # the same index would share one
      raise ValueError(f"Runtime: engine 'cpu' needs a mesh whose only axis longer than one is "
                       f"{runtime.axis_name!r}, got {dict(runtime.mesh.shape)}; use engine 'xla' "
                       f"(the default on such a mesh)")

  def __init__(self, runtime):
    super().__init__(runtime)
    primitives.registered_platforms()
    self._ext = primitives.extension()  # kept: close_at_exit runs when module globals are gone
    # the window table (two parity slots per rank, sized at the first call of each shape)
    self._table = self._ext.cpu_windows_create(runtime.num_ranks)

  def window_set(self, send, send_counts, cap):
    if self._table is None:
      raise ValueError("Runtime is closed")
    return self._table

  def combine_window_set(self, rows, out1, num_tokens, topk):
    return self.window_set(None, None, None)  # the same table: it holds every geometry's windows

  def close(self):
    if self._table is not None:
      self._ext.cpu_windows_destroy(self._table)
      self._table = None
