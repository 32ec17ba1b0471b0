"""The dispatch engines: how a rank's rows reach the ranks that own their experts.

One module per engine. Each is a class that says which platforms it serves, whether it fuses
GEMM1 with the dispatch, whether its calls may be captured in CUDA graphs, and how it lowers
(`Engine.dispatch`, `Engine.dispatch_gemm1`, and Stage2's way back, `Engine.combine`). `Runtime`
picks one (`select`) and holds one instance, which owns the engine's per-Runtime state
(windows)."""
from __future__ import annotations

from typing import Optional

from .base import Engine
from .ce import CeEngine
from .cpu import CpuEngine
from .local import LocalEngine
from .sdma import SdmaEngine
from .sm import SmEngine
from .xla import XlaEngine

# every engine built, by Stage1Config.engine name
ENGINES = {e.name: e for e in (CpuEngine, LocalEngine, XlaEngine, CeEngine, SmEngine, SdmaEngine)}
# named in the design but not built in this version: {name: platforms}
NOT_BUILT = {}


def select(name, *, platform: str, num_ranks: int, multi_process: bool, has_cuda: bool,
           groups_local: Optional[bool] = None) -> type:
  """The engine class for Stage1Config.engine = name (None: the default for the mesh).
  groups_local: every EP group of the mesh lies within one process (None: not multi_process)."""
  if groups_local is None:
    groups_local = not multi_process
  if name is None:
    if platform == "cpu" and groups_local:
      name = "cpu"
    elif num_ranks == 1:
      name = "local"
    elif platform == "cpu":
      name = "xla"
    elif platform == "cuda" and has_cuda:
      # the fastest measured on 2xH200, in both launch modes (docs/PERF.md); per EP group
      name = "sm"
    else:
      name = "xla"  # also on ROCm: engine sdma has not run on AMD hardware yet (DESIGN.md §6)
  if name in NOT_BUILT and platform not in NOT_BUILT[name]:
    raise ValueError(f"Runtime: engine {name!r} runs on {NOT_BUILT[name]}, but the mesh is on "
                     f"{platform!r}")
  if name in NOT_BUILT:
    raise NotImplementedError(f"Runtime: engine {name!r} (for {NOT_BUILT[name]}) is not built in "
                              f"this version (built: {sorted(ENGINES)})")
  return ENGINES[name]


__all__ = ["Engine", "ENGINES", "select", "CpuEngine", "LocalEngine", "XlaEngine", "CeEngine",
           "SmEngine", "SdmaEngine"]
