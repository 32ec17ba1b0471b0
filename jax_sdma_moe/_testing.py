"""Fault injection for the library's own tests: not part of the public API.

The protocol's timeout paths need a rank that never takes part, or one that starts late. They
live here, on the Runtime, and not in the public Stage1Config: a model's configuration must not
be able to switch them on."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Faults:
  """absent_rank: this rank of the axis (in every EP group) skips its part of every dispatch and
  combine (-1: none).
  delay_rank: this rank starts each call delay_ms late (-1: none); the delay is slept for at most
  the Runtime's timeout_s."""
  absent_rank: int = -1
  delay_rank: int = -1
  delay_ms: int = 0


NO_FAULTS = Faults()


def inject_faults(runtime, *, absent_rank: int = -1, delay_rank: int = -1,
                  delay_ms: int = 0) -> None:
  """Makes the calls traced on `runtime` from now on carry these faults (calls already compiled
  keep theirs)."""
  for name, rank in (("absent_rank", absent_rank), ("delay_rank", delay_rank)):
    if not isinstance(rank, int) or not -1 <= rank < runtime.num_ranks:
      raise ValueError(f"inject_faults: {name} must be -1 or a rank of the axis "
                       f"(< {runtime.num_ranks}), got {rank!r}")
  if not isinstance(delay_ms, int) or delay_ms < 0:
    raise ValueError(f"inject_faults: delay_ms must be an int >= 0, got {delay_ms!r}")
  runtime._faults = Faults(absent_rank, delay_rank, delay_ms)
