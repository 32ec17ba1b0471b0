"""Runtime: what a Stage1 engine needs across calls (the mesh axis, the engine, its windows)."""
from __future__ import annotations

import itertools
import sys
import threading

import jax
from jax.sharding import Mesh

from . import primitives
from .config import Stage1Config

# engine -> platforms it runs on, and the engines built so far
_ENGINE_PLATFORMS = {"cpu": ("cpu",), "local": ("cpu", "cuda"), "xla": ("cpu", "cuda", "rocm"),
                     "ce": ("cuda",), "sm": ("cuda",), "sdma": ("rocm",)}
_BUILT_ENGINES = ("cpu", "local", "xla", "ce", "sm")
# engines whose dispatch is the `dispatch` custom call (the others are built from collectives)
FFI_DISPATCH_ENGINES = ("cpu", "local", "ce", "sm")
# engines with symmetric device windows (created per dispatch geometry, see Runtime.dispatch_window)
WINDOW_ENGINES = ("ce", "sm")
_runtime_serial = itertools.count(1)  # the same in every process: Runtimes are made in one order


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


class Runtime:
  """Create once, outside jit, for a mesh axis; pass to every stage1() call on that axis.

  With the `cpu` engine it owns symmetric landing windows (two parity slots per rank, sized at the
  first call of each shape) in a process-global table; with the CUDA engines `ce` and `sm`, device
  windows on every GPU of the axis (peer access in one process, CUDA IPC across processes), made at
  the first trace of each shape. close() frees them. Calls on one Runtime must run in the same
  order on every rank (they do under shard_map).
  """

  def __init__(self, mesh: Mesh, axis_name: str = "ep", config: Stage1Config = Stage1Config()):
    if not isinstance(mesh, Mesh):
      raise TypeError(f"Runtime: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
      raise ValueError(f"Runtime: axis {axis_name!r} is not in the mesh axes {mesh.axis_names}")
    if not isinstance(config, Stage1Config):
      raise TypeError(f"Runtime: config must be a Stage1Config, got {type(config).__name__}")
    self.mesh = mesh
    self.axis_name = axis_name
    self.num_ranks = int(mesh.shape[axis_name])
    self.platform = mesh_platform(mesh)
    self.multi_process = any(d.process_index != jax.process_index() for d in mesh.devices.flat)
    # the window engines need the axis to be the mesh's only axis longer than one
    only_axis = all(n == 1 for a, n in mesh.shape.items() if a != axis_name)
    if config.engine is not None:
      engine = config.engine
    elif self.platform == "cpu":
      engine = "xla" if self.multi_process else "cpu"
    elif self.num_ranks == 1:
      engine = "local"
    elif self.platform == "cuda" and primitives._extension().has_cuda() and only_axis:
      engine = "sm"  # the fastest measured on 2xH200, in both launch modes (docs/PERF.md)
    else:
      engine = "xla"
    if self.platform not in _ENGINE_PLATFORMS[engine]:
      raise ValueError(f"Runtime: engine {engine!r} runs on {_ENGINE_PLATFORMS[engine]}, "
                       f"but the mesh is on {self.platform!r}")
    if engine not in _BUILT_ENGINES:
      raise NotImplementedError(f"Runtime: engine {engine!r} is not built yet in this version "
                                f"(built: {_BUILT_ENGINES})")
    if engine == "cpu" and self.multi_process:
      raise ValueError("Runtime: engine 'cpu' moves rows between the devices of one process; this "
                       "mesh spans several processes (jax.distributed): use engine 'xla'")
    if engine == "xla" and self.multi_process and self.platform != "cpu":
      # ragged_all_to_all across processes is XLA's NCCL send/recv fallback (refused unless
      # --xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback); with it, on jax 0.11.2 and
      # 2xH200, the rows from the other process read as zeros at the dsv3 shape (docs/PERF.md)
      raise ValueError("Runtime: engine 'xla' is not supported across GPU processes (XLA's "
                       "ragged_all_to_all falls back to NCCL there and lost rows when we tried "
                       "it); use engine 'ce' or 'sm'")
    if engine == "local" and self.num_ranks != 1:
      raise ValueError(f"Runtime: engine 'local' needs a one-rank axis, {axis_name!r} has "
                       f"{self.num_ranks}")
    if engine in WINDOW_ENGINES:
      if self.num_ranks < 2:
        raise ValueError(f"Runtime: engine {engine!r} moves rows between GPUs; axis "
                         f"{axis_name!r} has one rank: use engine 'local'")
      if not only_axis:
        raise ValueError(f"Runtime: engine {engine!r} needs a mesh whose only axis longer than "
                         f"one is {axis_name!r}, got {dict(mesh.shape)}")
    if self.platform != "cpu" and self.platform not in primitives.registered_platforms():
      raise ValueError(f"Runtime: this build of jax_sdma_moe has no {self.platform} kernels "
                       f"(built for {sorted(primitives.registered_platforms())}); rebuild where "
                       f"the toolchain (nvcc) is installed")
    if not -1 <= config.fault_absent_rank < self.num_ranks or not (
        -1 <= config.fault_delay_rank < self.num_ranks):
      raise ValueError("Runtime: fault_*_rank must be -1 or a rank of the axis")
    self.engine = engine
    self.config = config
    self._lock = threading.Lock()
    self._id = None
    self._windows = {}  # (H, EL, M_cap, send rows) -> window set id (engines ce, sm)
    self._closed_windows = False
    self._serial = next(_runtime_serial)
    if self.platform == "cpu" and engine in FFI_DISPATCH_ENGINES:
      primitives.registered_platforms()
      self._id = primitives._extension().runtime_create(self.num_ranks)
    if engine in WINDOW_ENGINES and not hasattr(primitives._extension(), "ep_windows_create"):
      raise ValueError("Runtime: this build of jax_sdma_moe has no CUDA engines; rebuild where "
                       "nvcc is installed")

  def _axis_devices(self):
    return list(self.mesh.devices.reshape(-1))  # the other axes have length 1 (checked)

  def dispatch_window(self, hidden: int, local_experts: int, cap: int, send_rows: int) -> int:
    """The symmetric windows of engines ce/sm for one dispatch geometry, created at the first
    trace that needs them (on the host, outside any computation) and kept until close(). Every
    process of a multi-process mesh must trace the same calls: they exchange CUDA IPC handles
    through jax.distributed's key-value store here."""
    key = (int(hidden), int(local_experts), int(cap), int(send_rows))
    with self._lock:
      if self._closed_windows:
        raise ValueError("Runtime is closed")
      if key in self._windows:
        return self._windows[key]
      ext = primitives._extension()
      devices = self._axis_devices()
      me = jax.process_index()
      local = [(r, d.local_hardware_id) for r, d in enumerate(devices) if d.process_index == me]
      wid = ext.ep_windows_create(self.num_ranks, ext.EP_ENGINES[self.engine],
                                  self.config.sm_dispatch_blocks, *key, [r for r, _ in local],
                                  [d for _, d in local])
      try:
        if len(local) == self.num_ranks:
          ext.ep_windows_connect_local(wid)
        else:
          self._exchange_ipc_handles(ext, wid, key, [r for r, _ in local])
      except Exception:
        ext.ep_windows_destroy(wid)
        raise
      self._windows[key] = wid
      return wid

  def _exchange_ipc_handles(self, ext, wid: int, key: tuple, local_ranks: list):
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
      raise ValueError("Runtime: a mesh spanning processes needs jax.distributed.initialize()")
    prefix = f"jax_sdma_moe/{self._serial}/{'x'.join(map(str, key))}"
    for r in local_ranks:
      client.key_value_set_bytes(f"{prefix}/{r}", ext.ep_window_ipc_handle(wid, r))
    timeout_ms = int(max(self.config.timeout_s, 1.0) * 1000)
    try:
      handles = [client.blocking_key_value_get_bytes(f"{prefix}/{s}", timeout_ms)
                 for s in range(self.num_ranks)]
    except Exception as e:
      raise TimeoutError(f"Runtime: the peers' windows ({prefix}) did not arrive within "
                         f"{timeout_ms / 1000} s: {e}") from e
    for r in local_ranks:
      ext.ep_windows_open(wid, r, handles)

  def check(self):
    """Raises if a bounded wait of a ce/sm kernel ran out (the sm engine has no host step in the
    call itself, so such an error surfaces here and at the next call)."""
    if self.engine not in WINDOW_ENGINES:
      return
    ext = primitives._extension()
    for wid in list(self._windows.values()):
      msg = ext.ep_error(wid)
      if msg:
        raise TimeoutError(msg)

  _CE_HOST_KEYS = ("calls", "plan_us", "plan_stream_us", "enqueue_us", "own_enqueue_us",
                   "copies", "single_copies", "own_copies")
  _TIMELINE_KEYS = ("timed_calls", "first_chunk_calls", "gemm_start_us", "gemm_end_us",
                    "side_end_us", "first_chunk_us")

  def _rank_stats(self, keys) -> dict:
    """{rank: {key: total over every window set of this Runtime, "batch_error": the last}} for
    this process's ranks."""
    ext = primitives._extension()
    out = {}
    for wid in list(self._windows.values()):
      for st in ext.ep_host_stats(wid):
        acc = out.setdefault(st["rank"], {**dict.fromkeys(keys, 0), "batch_error": ""})
        for k in keys:
          acc[k] += st[k]
        acc["batch_error"] = st["batch_error"] or acc["batch_error"]
    return out

  def ce_host_stats(self) -> dict:
    """Engine ce: {rank: {"calls", "plan_us", "plan_stream_us", "enqueue_us", "own_enqueue_us",
    "copies", "single_copies", "own_copies", "batch_error"}} over this process's ranks and every
    call so far (totals): the host time of the plan's synchronisation (from the call's start until
    every source's plan is on the host; plan_stream_us: the part spent waiting for the stream's
    earlier work, the rest waits for the peers) and of enqueueing the row copies (own_: the part
    that stays on the rank's GPU); the copies enqueued, those enqueued one at a time because
    cudaMemcpyBatchAsync refused their batch, and the error name of its last refusal ("" if
    none). {} for other engines."""
    if self.engine != "ce":
      return {}
    return self._rank_stats(self._CE_HOST_KEYS)

  def dispatch_timeline(self) -> dict:
    """Engines ce and sm: {rank: {"calls", "gemm_start_ms", "gemm_end_ms", "side_end_ms",
    "first_chunk_ms"}}: the device-side timeline of the fused calls (dispatch + GEMM, outside CUDA
    graphs) so far, means over the calls whose events had completed by the rank's next call, in ms
    after the dispatch's start on XLA's stream: XLA's stream reaching the fused GEMM (the
    dispatch's earlier steps done: for ce the host's plan wait and the own copies) and leaving it,
    the side stream done (ce: the peers' copies; sm: its kernel), and for ce the first chunk of
    the peers' copies landed (None for sm). {} for other engines or before a timed call."""
    if self.engine not in ("ce", "sm"):
      return {}
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

  def shard_w1(self, w1q):
    """Places QuantizedW1 [E, 2I, H] on the mesh, E/R experts per rank along the axis."""
    from jax.sharding import NamedSharding, PartitionSpec
    E = w1q.values.shape[0]
    if E % self.num_ranks:
      raise ValueError(f"shard_w1: E = {E} experts is not a multiple of the {self.num_ranks} ranks "
                       f"of axis {self.axis_name!r}")
    spec = NamedSharding(self.mesh, PartitionSpec(self.axis_name))
    return jax.tree.map(lambda a: jax.device_put(a, spec), w1q)

  @property
  def runtime_id(self) -> int:
    if self._id is None:
      if self.platform == "cpu" and self.engine in FFI_DISPATCH_ENGINES:
        raise ValueError("Runtime is closed")
      return 0  # GPU engine "local": no windows
    return self._id

  def close(self):
    """Frees the windows once every call already enqueued on the mesh has finished (a call still
    in flight would otherwise find its windows gone)."""
    with self._lock:
      if self._windows:
        _wait_for_mesh(self.mesh)
        for wid in self._windows.values():
          primitives._extension().ep_windows_destroy(wid)
        self._windows = {}
      if self.engine in WINDOW_ENGINES:
        self._closed_windows = True
      if self._id is None:
        return
      _wait_for_mesh(self.mesh)
      primitives._extension().runtime_destroy(self._id)
      self._id = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    # At interpreter exit JAX's backends are gone (asking for live arrays would start a new one and
    # hang), and nothing can still be in flight: free the windows directly.
    if sys.is_finalizing():
      if self._id is not None:
        primitives._extension().runtime_destroy(self._id)
        self._id = None
      for wid in getattr(self, "_windows", {}).values():
        primitives._extension().ep_windows_destroy(wid)
      self._windows = {}
      return
    try:
      self.close()
    except Exception:
      pass

  def __repr__(self):
    return (f"Runtime(axis={self.axis_name!r}, ranks={self.num_ranks}, platform={self.platform!r}, "
            f"engine={self.engine!r})")
