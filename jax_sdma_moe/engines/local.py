"""Engine `local`: one rank holds every expert; its rows are placed by a copy within the device."""
from __future__ import annotations

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
