"""--trace: where a path's time goes on each GPU, from JAX's profiler (CUPTI), for machines without
Nsight Systems (the lent H200s have none).

`kernel_table` runs a jitted path a few times under `jax.profiler.trace` and reads the trace back
with `jax.profiler.ProfileData`: per device, every kernel and copy on the device's streams summed
over the calls, and the per-call busy time (the union of their intervals) against the per-call
span (first start to last end of calls enqueued back to back: bench's pipelined time), whose
difference is time the device waited: for the host, for a peer, or for a copy on a stream the
trace does not show."""
from __future__ import annotations

import collections
import glob
import os
import tempfile
from typing import Callable, Sequence

import jax

TOP_KERNELS = 12  # rows per device in the printed table


def _device_events(path: str) -> dict:
  """{device plane name: [(name, start_ns, end_ns)]} of the events on its stream lines."""
  data = jax.profiler.ProfileData.from_file(path)
  out = {}
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    events = [(e.name, e.start_ns, e.end_ns) for line in plane.lines
              if line.name.startswith("Stream") for e in line.events]
    if events:
      out[plane.name] = events
  return out


def _busy_ns(events: Sequence[tuple]) -> float:
  """The union of the events' intervals."""
  busy, end = 0.0, float("-inf")
  for _, s, e in sorted(events, key=lambda t: t[1]):
    if s > end:
      busy, end = busy + (e - s), e
    elif e > end:
      busy, end = busy + (e - end), e
  return busy


def _short(name: str, width: int = 60) -> str:
  name = name.split("(")[0] if name.startswith("void ") or "<" in name else name
  return name if len(name) <= width else name[:width - 3] + "..."


def kernel_table(fn: Callable, args: tuple, calls: int, title: str) -> str:
  """`calls` calls of fn(*args) (compiled), enqueued back to back under the profiler; per device the
  kernels' time per call, top TOP_KERNELS by total, then busy and span per call."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as logdir:
    with jax.profiler.trace(logdir):
      jax.block_until_ready([fn(*args) for _ in range(calls)])  # pipelined, as a model's step
    files = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not files:
      return f"{title}: the profiler wrote no trace"
    per_device = _device_events(max(files, key=os.path.getmtime))
  if not per_device:
    return f"{title}: the trace holds no device stream (no CUPTI on this platform?)"
  lines = [f"{title}: kernels per call over {calls} traced calls (ms)"]
  for dev, events in sorted(per_device.items()):
    total = collections.defaultdict(float)
    count = collections.Counter()
    for name, s, e in events:
      total[name] += e - s
      count[name] += 1
    span = max(e for _, _, e in events) - min(s for _, s, _ in events)
    kernels_ms = sum(total.values()) / calls / 1e6
    lines.append(f"  {dev}: busy {_busy_ns(events) / calls / 1e6:.3f} of a span of "
                 f"{span / calls / 1e6:.3f} per call; kernels {kernels_ms:.3f}")
    for name, ns in sorted(total.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]:
      lines.append(f"    {ns / calls / 1e6:8.3f}  x{count[name] / calls:<4g} {_short(name)}")
  return "\n".join(lines)
