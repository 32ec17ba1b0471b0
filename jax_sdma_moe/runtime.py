"""Runtime: what a Stage1 engine needs across calls — the mesh axis, the engine it picked, and
that engine's per-Runtime state (its windows)."""
from __future__ import annotations

import atexit
import itertools
import math
import os
import threading
import weakref
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from . import _testing, engines, primitives
from .config import Stage1Config

_runtime_serial = itertools.count(1)  # the same in every process: Runtimes are made in one order
_open_runtimes = weakref.WeakSet()
# A Stage1 call's buffers (landing rows, windows, send buffer, h) may take at most this share of
# a device's memory (on CPU: of the host's memory divided among its devices); beyond it stage1
# refuses the shape at trace time, before anything is allocated, and names max_recv_rows.
MEMORY_SHARE = 0.5


def mesh_platform(mesh: Mesh) -> str:
  dev = mesh.devices.flat[0]
  if dev.platform == "gpu":
    return "rocm" if "rocm" in getattr(dev.client, "platform_version", "").lower() else "cuda"
  return dev.platform


def _wait_for_mesh(mesh: Mesh):
  devices = set(mesh.devices.flat)
  for a in jax.live_arrays():
    try:
      if devices & set(a.devices()):
        a.block_until_ready()
    except Exception:  # a failed or deleted computation: nothing left in flight for it
      pass


def device_memory_bytes(device) -> int:
  """What one device may hold: the allocator's limit on a GPU; on CPU the host's physical memory
  shared by the process's devices. 0 if unknown."""
  stats = None
  try:
    stats = device.memory_stats()
  except Exception:  # some backends do not implement it
    pass
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  if device.platform == "cpu":
    try:
      host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      return 0
    return host // max(1, len(jax.local_devices(backend="cpu")))
  return 0


class Runtime:
  """Create once, outside jit, for a mesh axis; pass to every stage1(), stage2() and moe() call on
  that axis.

  It picks the engine (`Stage1Config.engine`, or the mesh's default: engines.select) and holds
  it as `self.engine`, with the engine's state: the `cpu` engine's window table (two parity slots
  per rank, sized at the first call of each shape), the CUDA engines' device windows on every GPU
  of the axis (made at the first trace of each shape). close() frees them; so does interpreter
  exit. Calls on one Runtime must run in the same order on every rank (they do under shard_map).

  On a mesh with other axes (any names and sizes, the EP axis anywhere among them) every
  combination of the other axes' coordinates is an independent EP group of num_ranks devices:
  `group_axes` ((name, size) of the other axes in mesh order), `num_groups` (G),
  `group_devices` ([G, R] devices), `group_index()` (in the trace), `device_group_rank(d)` (on
  the host). Calls run inside a shard_map over every axis of the mesh.
  """

  def __init__(self, mesh: Mesh, axis_name: str = "ep", config: Stage1Config = Stage1Config(), *,
               lowering_platform: Optional[str] = None):
    if not isinstance(mesh, Mesh):
      raise TypeError(f"Runtime: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
      raise ValueError(f"Runtime: axis {axis_name!r} is not in the mesh axes {mesh.axis_names}")
    if not isinstance(config, Stage1Config):
      raise TypeError(f"Runtime: config must be a Stage1Config, got {type(config).__name__}")
    self.mesh = mesh
    self.axis_name = axis_name
    self.config = config
    self.num_ranks = int(mesh.shape[axis_name])
    self.platform = lowering_platform or mesh_platform(mesh)
    self.lowering_only = self.platform != mesh_platform(mesh)
    self.multi_process = any(d.process_index != jax.process_index() for d in mesh.devices.flat)
    # EP groups (DESIGN.md §2): every combination of the other axes' coordinates is an independent
    # group of num_ranks devices along the EP axis; group_axes are those axes in mesh order
    self.group_axes = tuple((a, int(n)) for a, n in mesh.shape.items() if a != axis_name)
    self.num_groups = math.prod(n for _, n in self.group_axes)
    # [G, R]: the device of each (group, rank); groups_local: every group within one process
    self.group_devices = np.moveaxis(
        mesh.devices, mesh.axis_names.index(axis_name), -1).reshape(self.num_groups,
                                                                    self.num_ranks)
    self.groups_local = all(len({d.process_index for d in g}) == 1 for g in self.group_devices)
    self.serial = next(_runtime_serial)
    if self.lowering_only and self.platform not in primitives.LOWERING_PLATFORMS:
      raise ValueError(f"Runtime: lowering_platform must be one of "
                       f"{primitives.LOWERING_PLATFORMS}, got {lowering_platform!r}")
    if (not self.lowering_only and self.platform != "cpu"
        and self.platform not in primitives.registered_platforms()):
      raise ValueError(f"Runtime: this build of jax_sdma_moe has no {self.platform} kernels "
                       f"(built for {sorted(primitives.registered_platforms())}); rebuild where "
                       f"the toolchain (nvcc, or ROCm's hipcc) is installed")
    if (not self.lowering_only and self.platform == "rocm"
        and not primitives.extension().has_rocm_flydsl()):
      raise ValueError("Runtime: this ROCm build of jax_sdma_moe has no GEMM1 (its FlyDSL "
                       "kernels were not built: install flydsl and rebuild)")
    engine_cls = engines.select(
        config.engine, platform=self.platform, num_ranks=self.num_ranks,
        multi_process=self.multi_process,
        groups_local=self.groups_local,
        has_cuda=self.platform == "cuda" and (self.lowering_only or
                                              primitives.extension().has_cuda()))
    engine_cls.check_mesh(self)
    self._faults = _testing.NO_FAULTS  # the library's own tests set them (_testing.py)
    self._lock = threading.Lock()
    self._closed = False
    self.engine = engine_cls(self)
    _open_runtimes.add(self)
    # the liveness registry: a program of this Runtime fails once it is closed (ffi/
    # runtime_registry.h); the module is kept for _close_at_exit
    self._ext = primitives.extension()
    self._ext.runtime_open(self.serial)

  def group_index(self) -> jax.Array:
    """Inside the shard_map (over every axis of the mesh): this device's EP group, the linear
    index of its coordinates on the other axes in mesh order (row-major), int32 in [0, G)."""
    g = jnp.int32(0)
    for a, n in self.group_axes:
      if n > 1:
        g = g * n + lax.axis_index(a)
    return g

  def device_group_rank(self, device) -> tuple:
    """On the host: (group, rank within the group) of a device of the mesh."""
    where = np.argwhere(self.group_devices == device)
    if not len(where):
      raise ValueError(f"device {device} is not in the Runtime's mesh")
    return int(where[0][0]), int(where[0][1])

  @property
  def closed(self) -> bool:
    """Whether close() has run: every later call fails (at trace time, or for a program compiled
    before, at run time with FAILED_PRECONDITION "Runtime is closed")."""
    return self._closed

  def check_memory(self, what: str, nbytes: int) -> None:
    """Raises ValueError (at trace time) if one call's buffers of nbytes per rank would take more
    than MEMORY_SHARE of a device's memory."""
    limit = device_memory_bytes(self.mesh.devices.flat[0])
    if limit and nbytes > MEMORY_SHARE * limit:
      raise ValueError(
          f"stage1: {what} take {nbytes / 2**30:.2f} GiB per rank, more than {MEMORY_SHARE:.0%} "
          f"of the device's {limit / 2**30:.2f} GiB; lower Stage1Config.max_recv_rows (the "
          f"landing capacity M_cap, dropless worst case by default) or the tokens per call")

  def check(self):
    """Raises if a bounded wait of an earlier call ran out on the device (engines ce, sm: engine
    sm has no host step in the call itself, so such an error surfaces here and at the next
    call)."""
    self.engine.check()

  def shard_w1(self, w1q):
    """Places QuantizedW1 [E, 2I, H] on the mesh, E/R experts per rank along the axis (the same
    in every group: replicated over the other axes)."""
    return self._shard_experts(w1q, "shard_w1")

  def shard_w2(self, w2q):
    """Places QuantizedW2 [E, H, I] on the mesh, E/R experts per rank along the axis (replicated
    over the other axes)."""
    return self._shard_experts(w2q, "shard_w2")

  def _shard_experts(self, wq, what: str):
    from jax.sharding import NamedSharding, PartitionSpec
    E = wq.values.shape[0]
    if E % self.num_ranks:
      raise ValueError(f"{what}: E = {E} experts is not a multiple of the {self.num_ranks} ranks "
                       f"of axis {self.axis_name!r}")
    spec = NamedSharding(self.mesh, PartitionSpec(self.axis_name))
    return jax.tree.map(lambda a: jax.device_put(a, spec), wq)

  def close(self):
    """Frees the engine's state once every call already enqueued on the mesh has finished (a call
    still in flight would otherwise find its windows gone)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      _wait_for_mesh(self.mesh)
      self._ext.runtime_close(self.serial)  # the calls enqueued later fail: Runtime is closed
      self.engine.close()
      _open_runtimes.discard(self)

  def _close_at_exit(self):
    # JAX's backends may be gone (asking for live arrays would start a new one and hang), and
    # nothing can still be in flight: free the engine's state directly.
    with self._lock:
      if not self._closed:
        self._closed = True
        self._ext.runtime_close(self.serial)
        self.engine.close_at_exit()

  def __del__(self):
    if getattr(self, "_closed", True):  # closed, or __init__ did not get that far
      return
    try:
      self.close()
    except Exception:  # a destructor must not raise; the state is freed at exit at the latest
      pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __repr__(self):
    return (f"Runtime(axis={self.axis_name!r}, ranks={self.num_ranks}, platform={self.platform!r}, "
            f"engine={self.engine.name!r}{', lowering only' if self.lowering_only else ''})")


@atexit.register
def _close_open_runtimes():
  """Before the interpreter tears down modules (after which a __del__ would find its globals gone
  and print a traceback per Runtime), free what the open Runtimes hold."""
  for rt in list(_open_runtimes):
    rt._close_at_exit()
