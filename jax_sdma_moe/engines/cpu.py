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
    if not runtime.groups_local:
      # its windows are the process's memory: every group's ranks must be in one process (a mesh
      # across processes whose groups each lie in one, e.g. dp across them, is served)
      raise ValueError(f"Runtime: engine 'cpu' moves rows between the devices of one process; an "
                       f"EP group of axis {runtime.axis_name!r} on this mesh "
                       f"{dict(runtime.mesh.shape)} spans several processes (jax.distributed): "
                       f"use engine 'xla'")

  def __init__(self, runtime):
    super().__init__(runtime)
    primitives.registered_platforms()
    self._ext = primitives.extension()  # kept: close_at_exit runs when module globals are gone
    # the window table: G * R rank slots (two parity slots each, sized at the first call of each
    # shape; a group's windows made by its first call, so a process makes only its own groups')
    self._table = self._ext.cpu_windows_create(runtime.num_ranks, runtime.num_groups)

  def table_slot(self, rank):
    """The rank operand of this engine's calls: the table slot group * R + rank (rank: within the
    group, lax.axis_index of the EP axis)."""
    rt = self.runtime
    if rt.num_groups == 1:
      return rank
    return rt.group_index() * rt.num_ranks + rank

  def dispatch(self, send, send_counts, rank, *, cap, axis_overflow=False):
    return super().dispatch(send, send_counts, self.table_slot(rank), cap=cap,
                            axis_overflow=axis_overflow)

  def combine(self, rows, out1, rank, *, num_tokens, topk):
    return super().combine(rows, out1, self.table_slot(rank), num_tokens=num_tokens, topk=topk)

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
