"""Stage1 benchmark (DESIGN.md §8): jax_sdma_moe engines against JAX-native paths, in one run.

Two modes, one set of paths, checks and timers:
  * default: R ranks on virtual CPU devices (8). For each shape and tokens/rank it builds fresh
    random inputs on the host, checks every path against the full `jax_sdma_moe.reference.stage1`,
    then times them. A jnp-reference row is timed too.
    Multi-process (`mpirun -n R`, or R processes started with --coordinator/--num-processes/
    --process-id): the same, with one rank per process (on CPU each process holds one CPU device;
    on GPUs, one GPU each) over jax.distributed (gloo collectives on CPU). Every process makes the
    same inputs from the same seed and computes the full reference, checks the outputs of its own
    ranks (a failure on any process fails all), and times every call; a call's time is the max
    over processes. Engines: `xla` by default (engine `cpu` works within one process only).
    Process 0 prints the table and writes the files (tag `<platform>-mpi<R>` under mpirun,
    `<platform>-mp<R>` with --coordinator).
  * --gpu: one device, R = 1, engine `local` (the first GPU; `--platform cpu` runs the same code on
    one CPU device, to try it where there is no GPU); with --devices R > 1, R GPUs of this process
    (engines ce, sm, xla; the peer-copy bandwidth between the first two is measured as the wire
    ceiling); under mpirun (or the explicit flags below), one GPU per process. Inputs and weights are made on the device
    (w1 per shape: jax.random in bf16, quantised by the MX-fp8 kernel inside the same jit, so the
    bf16 copy never outlives it). Checks stay cheap at dsv3 sizes: the layout arrays must equal
    `reference.dispatch`, and h of a sample of experts (first, last, largest, a few random) must
    match a float32 reference within DESIGN §3; padding rows must be 0. Ceilings are measured on
    the device in the same run: copy bandwidth and XLA's dense bf16 matmul of the same FLOPs as
    gemm1 (per shape and tokens value), plus one 8192³.
Timed per path: Stage1 through the public API (`jsm.stage1` in a jitted shard_map) and its three
stages separately (route+qpack, dispatch, gemm1; each its own jitted shard_map over the
`jax_sdma_moe.primitives` calls); the JAX-native baselines: a capacity-based `all_to_all` +
`einsum` path and a dropless `all_to_all` + `ragged_dot` path (XLA:CPU has no `ragged_all_to_all`,
so fixed-size chunks emulate it; at R = 1 the all_to_all moves nothing). A native path that fails
at run time (out of memory, ...) is reported as failed instead of ending the run.
It prints a table, and writes JSON (also after every configuration, so an interrupted run keeps
what it measured) and, when matplotlib is importable, a PNG to --out.

Usage (from the repository root; `python -m bench.run` works too):
  python bench/run.py               # small shape, T = 128 and 1024, 8 CPU devices
  python bench/run.py --tokens 32 --iters 3 --warmup 1
  python bench/run.py --gpu         # one GPU: dsv3, v4pro at T = 128, 1024, 4096, 8192
  python bench/run.py --gpu --platform cpu --shapes small --tokens 32,128 --iters 3 --warmup 1
  python bench/run.py --gpu --skip-native ragged   # ragged_dot is slow / out of memory on GPU
  python bench/run.py --gpu --devices 2 --shapes dsv3 --tokens 128,1024,2048,4096,8192
  mpirun --allow-run-as-root -n 2 python bench/run.py --gpu --shapes dsv3   # one GPU per process
  mpirun --allow-run-as-root -n 2 python bench/run.py --tokens 32,128   # 2 processes, 1 rank each
  python bench/run.py --coordinator localhost:12345 --num-processes 2 --process-id 0 & \
  python bench/run.py --coordinator localhost:12345 --num-processes 2 --process-id 1   # no MPI

Timing: one call is the wall time of the whole SPMD program until `jax.block_until_ready`, i.e. the
max over ranks in a single-process run (multi-process: each process times the call, and the call's
time is the max over processes); statistics are over --iters calls after --warmup more.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

AXIS = "ep"
STAGES = ("route+qpack", "dispatch", "gemm1")
NATIVE_BASELINES = ("einsum", "ragged")  # --skip-native names
# defaults that depend on the mode: (CPU, --gpu)
DEFAULT_SHAPES = ("small", "dsv3,v4pro")
DEFAULT_TOKENS = ("128,1024", "128,1024,4096,8192")
DEFAULT_ENGINES = ("cpu,xla", "local")
DEFAULT_GPU_MULTI_ENGINES = "ce,sm,xla"  # --gpu --devices R > 1
DEFAULT_GPU_MULTI_PROCESS_ENGINES = "ce,sm"  # --gpu under mpirun (Runtime refuses xla there)
MULTI_PROCESS_ENGINES = "xla"  # engine cpu moves rows between the devices of one process only
DEFAULT_DEVICES = 8


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--shapes", default=None, help="comma list of jax_sdma_moe.SHAPES names "
                 f"(default: {DEFAULT_SHAPES[0]}; --gpu: {DEFAULT_SHAPES[1]})")
  p.add_argument("--tokens", default=None, help="comma list of tokens per rank "
                 f"(default: {DEFAULT_TOKENS[0]}; --gpu: {DEFAULT_TOKENS[1]})")
  p.add_argument("--engines", default=None, help="comma list of Stage1Config engines "
                 f"(default: {DEFAULT_ENGINES[0]}; --gpu: {DEFAULT_ENGINES[1]}; multi-process: "
                 f"{MULTI_PROCESS_ENGINES})")
  p.add_argument("--devices", type=int, default=None,
                 help=f"ranks (virtual CPU devices; not --gpu) (default: {DEFAULT_DEVICES}; "
                      "multi-process: every device of every process, one per process)")
  p.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
  p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
  p.add_argument("--row-align", type=int, default=128, help="Stage1Config.row_align")
  p.add_argument("--sm-blocks", default="24",
                 help="engine sm: comma list of Stage1Config.sm_dispatch_blocks, one path each "
                      "(the SMs the dispatch takes from the GEMM)")
  p.add_argument("--capacity-factor", type=float, default=1.25,
                 help="all_to_all+einsum baseline: capacity / mean rows per (source, expert)")
  p.add_argument("--skip-native", default="", help="comma list of JAX-native baselines not to "
                 f"run: {', '.join(NATIVE_BASELINES)}")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="bench/results", help="folder for the JSON and PNG")
  p.add_argument("--tag", default=None,
                 help="output file name (default: 'cpu'; --gpu: 'gpu', or 'gpu-cpu' with "
                      "--platform cpu; multi-process: '<platform>-mpi<processes>' under mpirun, "
                      "'<platform>-mp<processes>' with --coordinator)")
  p.add_argument("--gpu", action="store_true",
                 help="GPUs of this process (--devices, default 1: R = 1, engine local; more: "
                      "engines ce, sm, xla), device-side inputs, sampled checks and ceilings")
  p.add_argument("--platform", default="gpu", choices=("gpu", "cpu"),
                 help="--gpu only: the device to run on (cpu: the same R = 1 code on one CPU "
                      "device, to try the mode without a GPU)")
  p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                 help="run nothing: one table, JSON and PNG (under --out, named --tag) from "
                      "earlier runs' JSON files of one mode, e.g. a run cut short by a time limit "
                      "and the run that measured the rest; a later file's row of the same shape, "
                      "tokens and path replaces an earlier one")
  mp = p.add_argument_group(
      "multi-process", "one rank per process over jax.distributed, without mpirun (under mpirun "
      "it is detected from Open MPI's environment); give all three, the same --coordinator to "
      "every process")
  mp.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                  help="jax.distributed coordinator address (process 0 listens there)")
  mp.add_argument("--num-processes", type=int, default=None)
  mp.add_argument("--process-id", type=int, default=None)
  return p


def launch_mode(args) -> str:
  """'mpirun' (Open MPI's environment with more than one process), 'explicit' (--coordinator,
  --num-processes, --process-id) or 'single' (one process: `mpirun -n 1` too)."""
  explicit = (args.coordinator, args.num_processes, args.process_id)
  if any(a is not None for a in explicit):
    if any(a is None for a in explicit):
      raise SystemExit("--coordinator, --num-processes and --process-id go together")
    return "explicit"
  if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    return "mpirun"
  return "single"


def configure_platform(args) -> None:
  """What must happen before jax is imported. CPU mode: the number of virtual devices (--gpu needs
  one device, which every backend has); multi-process: one CPU device per process."""
  if launch_mode(args) != "single":
    force_host_devices(1)
  elif not args.gpu:
    force_host_devices(args.devices or DEFAULT_DEVICES)


def force_host_devices(n: int) -> None:
  """Ask XLA:CPU for n virtual devices (replacing any device count already in XLA_FLAGS)."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


if __name__ == "__main__":
  # XLA fixes the number of host devices when jax creates its CPU backend, so the flag must be in
  # the environment before jax is imported below.
  ARGS = build_parser().parse_args()
  configure_platform(ARGS)

if importlib.util.find_spec("jax_sdma_moe") is None:  # run as a script from a source checkout
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402
from jax_sdma_moe import layout, primitives, reference  # noqa: E402

# Stage1Output fields that are integers or copied floats: every engine must match the reference
# exactly (DESIGN.md §4). h is compared within the §3 tolerance instead.
LAYOUT_FIELDS = ("expert_offsets", "expert_counts", "src_rank", "src_token", "topk_slot",
                 "topk_weight", "num_rows", "num_invalid", "overflow")
REL_TOL = 4e-3      # DESIGN.md §3: ||out - ref|| / ||ref|| per expert block
MAX_ABS_TOL = 1e-2  # DESIGN.md §3: max |out - ref| <= MAX_ABS_TOL * max |ref|
W1_SCALE = 0.05     # w1 ~ N(0, 1) * W1_SCALE; x ~ N(0, 1)
RANDOM_EXPERTS = 4  # --gpu check: random non-empty experts checked besides first, last, largest


class PeerFailure(RuntimeError):
  """Multi-process: another process's path failed at run time."""


# a path that fails at run time is reported as failed and the run goes on (a wrong result is a
# CheckError and ends it)
RUN_FAILURES = (jax.errors.JaxRuntimeError, MemoryError, PeerFailure)
NOTES = (
    "ms: median wall time of one call of the whole SPMD program (= max over ranks); JSON has "
    "min and p90.",
    "stage columns, each stage its own jitted shard_map: rt+qpack = route + qpack (JAX-native: "
    "route + bf16 pack), disp = dispatch (JAX-native: all_to_all), gemm1 = GEMM1 + SwiGLU.",
    "GB/s: useful landed-row bytes / dispatch time (engines: H + H/32 + 12 bytes a row; "
    "JAX-native: 2H bf16 + 12 header bytes); padding rows are not counted, so paths that move "
    "fixed-size chunks (engine:xla on CPU, both a2a paths) move more bytes than credited.",
    "GFLOP/s: 2 * useful rows * H * 2I / gemm1 time, summed over ranks.",
    "%bw = (2 x row bytes / memcpy bw) / dispatch time (a copy reads and writes each byte); "
    "%mm = gemm1 GFLOP/s / matmul GFLOP/s of the path's arithmetic (engines: the CPU kernel's f32 "
    "on dequantised fp8; JAX-native: bf16 in, f32 accumulation); %ceil = the larger of both "
    "bounds / stage1 time.",
    "vs nat = fastest JAX-native stage1 ms / this path's stage1 ms (>1: faster than JAX-native).",
    "ragged_all_to_all + ragged_dot: n/a on CPU (XLA:CPU does not implement ragged_all_to_all); "
    "native:a2a+ragged_dot sends fixed T*min(K,EL)-row chunks per destination instead (dropless).",
    "native:a2a+einsum: capacity C = ceil(cf * T*K/E) rows per (source, expert) - cf times the "
    "mean - sent in bf16 with all_to_all, einsum per expert; rows past C are dropped ('drop').",
    "native:jnp-reference: jax_sdma_moe.reference.stage1 jitted on one device (all ranks, no "
    "collective; a correctness reference, not a tuned path).",
    "JAX-native paths run on bf16 copies of the dequantised MX-fp8 inputs (exact in bf16), so they "
    "are checked against the same reference at the DESIGN §3 tolerance.",
)
MULTI_PROCESS_NOTE = (
    "{processes} processes ({launch}), one rank each: every process times every call, and a "
    "call's time is the max over processes (= over ranks) before the median over calls; every "
    "process checks its own ranks against the full reference (made from the same seed on every "
    "process), and a failure on any fails all. native:jnp-reference runs on every process's own "
    "device (the max over processes). Ceilings: process 0's, measured while every process "
    "measured its own.")
SINGLE_DEVICE_NOTES = (
    "R devices of one process (R = 1: engine local). ms: median wall time of one jitted call "
    "until block_until_ready (the max over ranks); JSON has min and p90.",
    "Every GB/s and TFLOP/s is per GPU (all ranks' bytes or FLOPs / R), against one GPU's "
    "ceilings. R > 1: disp GB/s = rows landed on a GPU * (H + H/32 + 12) bytes / dispatch time "
    "(including the 1/R that stay on their own GPU), against peer_copy_gbps (one direction). The "
    "dispatch stage alone copies the rows out of the window (engines ce, sm); stage1 runs the GEMM "
    "fused with the dispatch (each expert starts when its rows have landed), so stage1 / gemm1 "
    "measures the overlap.",
    "stage1 = jsm.stage1 (route + qpack + dispatch + gemm1); rt+qp = route + qpack in one jitted "
    "call, disp = dispatch (engine local: a copy into the landing layout), gemm1 = MX-fp8 GEMM1 + "
    "SwiGLU; each stage its own jitted call.",
    "qpack GB/s = (T*H*2 bytes read + rows*(H + H/32 + 12) written) / rt+qp time; %copy = that / "
    "the measured copy bandwidth (read + write); pipe %copy: the same with the calls enqueued "
    "back to back (the kernels' rate, without the per-call host wait).",
    "TFLOP/s = 2 * rows * H * 2I / gemm1 time (rows = T*K, all useful); mm TF/s = XLA's dense bf16 "
    "matmul [T*K, H] x [H, 2I] (f32 accumulation) measured the same way in this run; %mm = "
    "gemm1 / mm. fused TF/s = the same FLOPs / (stage1 - rt+qp): gemm1 with the dispatch it runs "
    "concurrently with (the stage1 GEMM is fused with the dispatch).",
    "einsum = JAX-native capacity path: rows sorted per expert into [E, C, H] bf16 buffers, C = "
    "ceil(cf * T*K/E), einsum, SwiGLU; rows past C dropped ('drop'). ragged = JAX-native dropless "
    "path: rows sorted by expert, lax.ragged_dot with the group sizes. Both run on bf16 copies of "
    "the dequantised MX-fp8 inputs (exact) and are checked like the engine.",
    "vs nat = fastest JAX-native stage1 ms / this path's stage1 ms (>1: faster than JAX-native).",
    "pipe = stage1 with --iters calls enqueued back to back and one wait / iters (no per-call host "
    "synchronisation); every other ms column is per call.",
    "checks before timing: layout arrays equal to reference.dispatch; h of the sampled experts "
    "within DESIGN §3 of a float32 reference; padding rows 0.",
)


# ------------------------------------------------------------------------------------------------
# Ceilings


def _best_seconds(fn: Callable, reps: int) -> float:
  """Fastest of reps calls after one untimed call: a ceiling is the best the machine does (a shared
  machine only ever makes a call slower)."""
  fn()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times)


def measure_ceilings(reps: int = 10, n: int = 1024) -> dict:
  """Host memcpy bandwidth (read + write bytes) and matmul rates per compute dtype: float32 (the CPU
  GEMM1 kernel and the reference accumulate dequantised values in float32) and bfloat16 inputs with
  float32 accumulation (what the JAX-native paths run)."""
  src = np.ones((256 << 20) // 8, np.float64)  # 256 MiB, pages touched before timing
  dst = np.empty_like(src)
  copy_s = _best_seconds(lambda: np.copyto(dst, src), reps)
  a = np.random.default_rng(0).standard_normal((n, n), np.float32)
  dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  a32, a16 = jnp.asarray(a), jnp.asarray(a, jnp.bfloat16)
  flops = 2 * n ** 3
  f32_s = min(_best_seconds(lambda: a @ a, reps),
              _best_seconds(lambda: dot(a32, a32).block_until_ready(), reps))
  bf16_s = _best_seconds(lambda: dot(a16, a16).block_until_ready(), reps)
  return {"copy_gbps": 2 * src.nbytes / copy_s / 1e9,
          "matmul_gflops": {"f32": flops / f32_s / 1e9, "bf16": flops / bf16_s / 1e9},
          "how": f"best of {reps}: numpy copyto of {src.nbytes >> 20} MiB counting read + write; "
                 f"{n}^3 matmul, f32: faster of numpy and jnp.dot, bf16: jnp.dot with f32 "
                 "accumulation"}


def measure_device_ceilings(device, copy_bytes: int, n: int, reps: int = 10) -> dict:
  """On `device` (the default device while this runs): copy bandwidth (read + write bytes of a
  jitted elementwise pass over copy_bytes) and XLA's dense bf16 matmul rate at n³ (f32
  accumulation), best of reps."""
  copy_gbps = device_copy_gbps(copy_bytes, reps)
  mm = dense_bf16_matmul(n, n, n, reps, 1, jax.random.key(0), stat="min_ms")
  return {"copy_gbps": copy_gbps,
          "matmul_gflops": {"bf16": mm["gflops"]},
          "how": f"best of {reps} on {device.device_kind}: jitted a + 1 over "
                 f"{copy_bytes >> 20} MiB (uint32) counting read + write; {n}^3 jnp.dot in bf16 "
                 "with f32 accumulation",
          "dense_bf16": []}  # filled per (shape, tokens) by bench_single_config


def peer_copy_gbps(src, dst, nbytes: int, reps: int = 5) -> float:
  """Bytes per second of one device-to-device copy src -> dst (jax.device_put between the devices
  of one process: PjRt's peer copy), best of reps: the wire ceiling of one direction."""
  a = jax.device_put(jnp.zeros(nbytes // 4, jnp.uint32), src)
  return nbytes / _best_seconds(lambda: jax.device_put(a, dst).block_until_ready(), reps) / 1e9


def device_copy_gbps(nbytes: int, reps: int) -> float:
  """Read + write bytes per second of a jitted elementwise pass over nbytes on the default device
  (`a + 1`, not `a + 0` or a copy XLA could elide: every byte is read and written)."""
  src = jnp.zeros(nbytes // 4, jnp.uint32)
  bump = jax.jit(lambda a: a + 1)
  return 2 * nbytes / _best_seconds(lambda: bump(src).block_until_ready(), reps) / 1e9


def dense_bf16_matmul(m: int, k: int, n: int, iters: int, warmup: int, key,
                      stat: str = "median_ms") -> dict:
  """XLA's (cuBLAS on GPU) dense bf16 [m, k] x [k, n] with f32 accumulation on the default device,
  timed like the paths; gflops from the `stat` time."""
  ka, kb = jax.random.split(key)
  a = jax.random.normal(ka, (m, k), jnp.bfloat16)
  b = jax.random.normal(kb, (k, n), jnp.bfloat16)
  dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  t = time_calls(dot, (a, b), iters, warmup)
  return {"m": m, "k": k, "n": n, **t, "gflops": 2 * m * k * n / (t[stat] * 1e-3) / 1e9}


# ------------------------------------------------------------------------------------------------
# Inputs. Every array carries a leading rank axis [R, ...] sharded over AXIS, so each shard sees
# [1, ...] and all stages (whose outputs are stacked the same way) compose uniformly.


class HostInputs(NamedTuple):
  x: np.ndarray        # [R, T, H] bf16
  ids: np.ndarray      # [R, T, K] int32, K distinct experts per token
  weights: np.ndarray  # [R, T, K] f32
  w1: np.ndarray       # [E, 2I, H] bf16


def make_inputs(shape: jsm.MoEShape, R: int, T: int, rng: np.random.Generator) -> HostInputs:
  H, I, E, K = shape.hidden, shape.intermediate, shape.num_experts, shape.topk
  x = rng.standard_normal((R, T, H), np.float32).astype(jnp.bfloat16)
  ids = np.argsort(rng.random((R, T, E)), axis=-1)[..., :K].astype(np.int32)
  weights = rng.random((R, T, K), np.float32)
  w1 = (rng.standard_normal((E, 2 * I, H), np.float32) * W1_SCALE).astype(jnp.bfloat16)
  return HostInputs(x, ids, weights, w1)


def native_w1(w1q: jsm.QuantizedW1) -> jax.Array:
  """MX-fp8 [..., 2I, H] -> the JAX-native paths' bf16 weights [..., H, 2I] (exact: an e4m3 value
  times a power of two fits bf16). A few experts at a time, so the float32 dequantised temporaries
  stay small next to dsv3's 15 GB of bf16 weights."""
  *lead, two_i, H = w1q.values.shape
  flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[-2:]), w1q)
  w = lax.map(lambda q: jnp.swapaxes(reference.dequantize(*q), -1, -2).astype(jnp.bfloat16),
              flat, batch_size=8)
  return w.reshape(*lead, H, two_i)


def device_weights(mesh, shape: jsm.MoEShape, key) -> tuple:
  """The ranks' weights made on their devices: w1q [R, E/R, 2I, H] (w1 drawn in bf16 and quantised
  inside one jit, so the bf16 copy is freed when it returns) and the JAX-native bf16 weights
  [R, E/R, H, 2I] made from w1q."""
  E, H, I = shape.num_experts, shape.hidden, shape.intermediate
  R = mesh.shape[AXIS]
  on_mesh = NamedSharding(mesh, P(AXIS))

  @functools.partial(jax.jit, out_shardings=on_mesh)
  def make_w1q(key):
    w1 = jax.random.normal(key, (E, 2 * I, H), jnp.bfloat16) * W1_SCALE
    return jax.tree.map(lambda a: a.reshape(R, E // R, *a.shape[1:]), jsm.quantize_w1(w1))

  w1q = jax.block_until_ready(make_w1q(key))
  return w1q, jax.block_until_ready(jax.jit(native_w1, out_shardings=on_mesh)(w1q))


def device_inputs(mesh, shape: jsm.MoEShape, T: int, key) -> tuple:
  """The ranks' tokens made on their devices: (x [R, T, H] bf16, ids [R, T, K] (K distinct
  experts per token), weights [R, T, K] f32) for the engines, and (bf16 copy of the dequantised
  MX-fp8 x, ids) for the JAX-native paths."""
  H, E, K = shape.hidden, shape.num_experts, shape.topk
  R = mesh.shape[AXIS]

  @functools.partial(jax.jit, out_shardings=NamedSharding(mesh, P(AXIS)))
  def make(key):
    kx, ki, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (R, T, H), jnp.bfloat16)
    ids = lax.top_k(jax.random.uniform(ki, (R, T, E)), K)[1].astype(jnp.int32)
    weights = jax.random.uniform(kw, (R, T, K), jnp.float32)
    # XLA may skip a rounding as "excess precision": XLA:CPU recomputed x in f32 inside the fusion
    # that quantises it, so the native paths got other values than the engines. The barriers pin
    # x to its bf16 values and xq to its fp8 bytes: x_native is exactly dequantize(quantize(x)).
    x = lax.optimization_barrier(x)
    xq = lax.optimization_barrier(reference.quantize(x))
    x_native = reference.dequantize(*xq).astype(jnp.bfloat16)
    return (x, ids, weights), (x_native, ids)

  return jax.block_until_ready(make(key))


def per_rank_jit(mesh, fn: Callable) -> Callable:
  """jit(shard_map(fn)) where every argument and result is stacked over ranks on axis 0."""
  def body(*args):
    out = fn(*jax.tree.map(lambda a: a[0], args))
    return jax.tree.map(lambda a: a[None], out)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


# ------------------------------------------------------------------------------------------------
# Paths: a full Stage1 function and the same work split in three stages (each stage(carry, w)).


@dataclasses.dataclass
class BenchPath:
  name: str
  kind: str                    # "engine" or "native"
  full: Callable               # jitted full(inputs, w) -> output with a field h
  stages: Sequence[Callable]   # jitted stage(carry, w) -> carry, one per STAGES entry
  inputs: Any                  # first carry (sharded)
  w: Any                       # weights (sharded)
  row_bytes: Optional[int]     # bytes of one landed row on the wire, None: no wire
  compute_dtype: str           # the matmul ceiling that applies: "f32" or "bf16"
  check: Callable[..., int]    # check(out, ref: Reference): raises CheckError; returns rows dropped
  capacity: Optional[int] = None  # rows per (source, expert) of a capacity-based path
  baseline: Optional[str] = None  # a JAX-native path: its NATIVE_BASELINES name
  runtime: Any = None             # an engine path's jsm.Runtime


class CheckError(AssertionError):
  pass


def engine_path(mesh, rt: jsm.Runtime, shape: jsm.MoEShape, cap: int, inputs, w1q,
                compute_dtype: str = "f32") -> BenchPath:
  """jsm.stage1 with one engine, and its stages from jax_sdma_moe.primitives. compute_dtype: the
  matmul ceiling gemm1 is held against (the CPU kernel computes in f32; --gpu holds the MX-fp8
  kernel against XLA's dense bf16 matmul)."""
  R, EL, cfg = rt.num_ranks, shape.num_experts // rt.num_ranks, rt.config

  def stage1(inp, w):
    x, ids, weights = inp
    return jsm.stage1(x, (ids, weights), w, runtime=rt)

  def route_qpack(inp, w):
    x, ids, weights = inp
    route = primitives.route(ids, R, EL)
    return primitives.qpack(x, weights, route.send_pos), route.send_counts

  def dispatch(carry, w):
    send, send_counts = carry
    return jsm.api.dispatch(send, send_counts, runtime=rt, cap=cap)

  def gemm1(landed, w):
    return primitives.gemm1(landed.values, landed.scales, landed.expert_offsets,
                            landed.expert_counts, w, swiglu_limit=cfg.swiglu_limit,
                            out_dtype=cfg.out_dtype)

  H = shape.hidden
  return BenchPath(f"engine:{rt.engine}", "engine", per_rank_jit(mesh, stage1),
                   [per_rank_jit(mesh, f) for f in (route_qpack, dispatch, gemm1)], inputs, w1q,
                   H + H // layout.BLOCK + 12, compute_dtype, check_engine, runtime=rt)


class NativeOut(NamedTuple):
  """Output of a JAX-native path on one rank: h rows with their source (-1: padding row)."""
  h: jax.Array          # [M, I] bf16
  src_rank: jax.Array   # [M] int32
  src_token: jax.Array  # [M] int32
  topk_slot: jax.Array  # [M] int32
  dropped: jax.Array    # [] int32, rows this rank could not send (over capacity)


def native_pack(x, ids, num_ranks: int, experts_per_rank: int, capacity: Optional[int]):
  """This source's rows in bf16, bucketed per destination: rows [R, P, H] and their header
  (token, slot, local expert) [R, P, 3], -1 on empty rows, plus the number of rows dropped.

  capacity None: dropless buckets of P = T*min(K, EL) rows, in the order of reference.route (by
  local expert, then token, slot). capacity C: one sub-bucket of C rows per local expert, P = EL*C;
  an expert's rows past C are dropped.
  """
  R, EL = num_ranks, experts_per_rank
  T, K = ids.shape
  route = reference.route(ids, R, EL)  # send_pos: place in a buffer grouped by (dest, expert)
  valid = route.send_pos >= 0
  expert = jnp.clip(ids, 0, R * EL - 1)
  dest, local = expert // EL, expert % EL
  if capacity is None:
    P = T * min(K, EL)
    per_dest = route.send_counts.sum(-1)
    row = route.send_pos - (jnp.cumsum(per_dest) - per_dest)[dest]
  else:
    P = EL * capacity
    counts = route.send_counts.reshape(-1)
    rank_in_expert = route.send_pos - (jnp.cumsum(counts) - counts)[expert]
    row = jnp.where(rank_in_expert < capacity, local * capacity + rank_in_expert, P)
  keep = valid & (row < P)
  idx = jnp.where(keep, dest * P + row, R * P).reshape(-1)  # R*P: out of range, dropped
  token = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[:, None], (T, K))
  slot = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32)[None, :], (T, K))
  header = jnp.stack([token, slot, local.astype(jnp.int32)], -1).reshape(-1, 3)
  rows = jnp.zeros((R * P, x.shape[-1]), x.dtype).at[idx].set(x[token.reshape(-1)], mode="drop")
  headers = jnp.full((R * P, 3), -1, jnp.int32).at[idx].set(header, mode="drop")
  dropped = jnp.sum(valid & ~keep).astype(jnp.int32)
  return rows.reshape(R, P, -1), headers.reshape(R, P, 3), dropped


def native_exchange(carry):
  """bf16 rows and headers to their destinations with a fixed-size all_to_all: [R src, P, ...]."""
  rows, headers, dropped = carry
  return lax.all_to_all(rows, AXIS, 0, 0), lax.all_to_all(headers, AXIS, 0, 0), dropped


def native_out(gu, headers, src, dropped, swiglu_limit) -> NativeOut:
  I = gu.shape[-1] // 2
  h = reference.swiglu(gu[:, :I], gu[:, I:], swiglu_limit).astype(jnp.bfloat16)
  present = headers[:, 0] >= 0
  return NativeOut(h, jnp.where(present, src, -1), headers[:, 0], headers[:, 1], dropped)


def capacity_gemm(carry, w, swiglu_limit) -> NativeOut:
  """Per local expert, its R*C capacity rows times w [EL, H, 2I] with einsum (bf16 in, f32 acc)."""
  rows, headers, dropped = carry
  R, P, H = rows.shape
  EL = w.shape[0]
  C = P // EL

  def expert_major(a):  # [R, EL*C, ...] -> [EL, R*C, ...]
    return jnp.swapaxes(a.reshape(R, EL, C, *a.shape[2:]), 0, 1).reshape(EL, R * C, *a.shape[2:])

  gu = jnp.einsum("emh,ehn->emn", expert_major(rows), w, preferred_element_type=jnp.float32)
  src = expert_major(jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32)[:, None], (R, P)))
  return native_out(gu.reshape(EL * R * C, -1), expert_major(headers).reshape(-1, 3),
                    src.reshape(-1), dropped, swiglu_limit)


def ragged_gemm(carry, w, swiglu_limit) -> NativeOut:
  """All received rows sorted by local expert (stable: keeps source, token, slot order), then one
  ragged_dot with w [EL, H, 2I]; empty rows sort last, past every group."""
  rows, headers, dropped = carry
  R, P, H = rows.shape
  EL = w.shape[0]
  headers = headers.reshape(R * P, 3)
  expert = jnp.where(headers[:, 0] >= 0, headers[:, 2], EL)
  order = jnp.argsort(expert, stable=True)
  group_sizes = jnp.bincount(expert, length=EL + 1)[:EL].astype(jnp.int32)
  gu = lax.ragged_dot(rows.reshape(R * P, H)[order], w, group_sizes,
                      preferred_element_type=jnp.float32)
  src = jnp.repeat(jnp.arange(R, dtype=jnp.int32), P)
  return native_out(gu, headers[order], src[order], dropped, swiglu_limit)


def native_path(mesh, name: str, baseline: str, shape: jsm.MoEShape, tokens: int,
                capacity: Optional[int], gemm: Callable, inputs, w) -> BenchPath:
  R, EL = mesh.shape[AXIS], shape.num_experts // mesh.shape[AXIS]
  stages = (lambda inp, w: native_pack(*inp, R, EL, capacity),
            lambda carry, w: native_exchange(carry),
            functools.partial(gemm, swiglu_limit=shape.swiglu_limit))

  def full(inp, w):
    carry = inp
    for stage in stages:
      carry = stage(carry, w)
    return carry

  return BenchPath(name, "native", per_rank_jit(mesh, full),
                   [per_rank_jit(mesh, f) for f in stages], inputs, w, 2 * shape.hidden + 12,
                   "bf16",
                   functools.partial(check_native, tokens=tokens, topk=shape.topk), capacity,
                   baseline)


def native_paths(args, mesh, shape: jsm.MoEShape, T: int, inputs, w) -> list:
  """The JAX-native baselines not in --skip-native: inputs (bf16 x, ids) and w [R, EL, H, 2I]
  bf16, both sharded."""
  skip = skipped_natives(args)
  paths = []
  if "einsum" not in skip:
    capacity = max(1, math.ceil(args.capacity_factor * T * shape.topk / shape.num_experts))
    paths.append(native_path(mesh, f"native:a2a+einsum(cf={args.capacity_factor:g})", "einsum",
                             shape, T, capacity, capacity_gemm, inputs, w))
  if "ragged" not in skip:
    paths.append(native_path(mesh, "native:a2a+ragged_dot", "ragged", shape, T, None, ragged_gemm,
                             inputs, w))
  return paths


def skipped_natives(args) -> set:
  skip = {s for s in args.skip_native.split(",") if s}
  unknown = skip - set(NATIVE_BASELINES)
  if unknown:
    raise SystemExit(f"--skip-native: unknown {sorted(unknown)}; known: {NATIVE_BASELINES}")
  return skip


# ------------------------------------------------------------------------------------------------
# Checks (run once before timing; numpy on the host)


class Reference(NamedTuple):
  """What every path's output is checked against."""
  layout: jsm.Stage1Output  # host arrays with a leading [R] axis; only the LAYOUT_FIELDS are used
  h32: dict                 # (rank, local expert) -> float32 reference h [rows of the block, I]


def full_reference(ref: jsm.Stage1Output, h32: np.ndarray) -> Reference:
  """Every non-empty (rank, expert) block of the full reference.stage1 (host arrays)."""
  offsets, counts = ref.expert_offsets, ref.expert_counts
  blocks = {(r, e): h32[r, offsets[r, e]:offsets[r, e] + counts[r, e]]
            for r in range(counts.shape[0]) for e in range(counts.shape[1]) if counts[r, e]}
  return Reference(ref, blocks)


@functools.partial(jax.jit, static_argnames=("E", "row_align", "cap"))
def _reference_layout(x, ids, weights, *, E: int, row_align: int, cap: int):
  return reference.dispatch(reference.quantize(x), ids, weights, E, row_align, cap)


def sampled_reference(shape: jsm.MoEShape, row_align: int, cap: int, inputs, w1q,
                      rng: np.random.Generator) -> tuple:
  """One process, any size: the full layout of every rank from reference.dispatch (on the
  devices), and the float32 h of a sample of experts per rank only (reference.stage1's GEMM is
  dense over all experts: far too slow at dsv3). The sample: the first, last and largest non-empty
  experts and RANDOM_EXPERTS random non-empty ones. Returns the Reference and the (rank, expert)
  pairs checked."""
  x, ids, weights = inputs
  E = shape.num_experts
  landed = _reference_layout(x, ids, weights, E=E, row_align=row_align, cap=cap)
  lay = jsm.Stage1Output(
      None, *global_to_host((landed.expert_offsets, landed.expert_counts, landed.src_rank,
                             landed.src_token, landed.topk_slot, landed.topk_weight,
                             landed.num_rows)),
      np.sum(global_to_host(ids) >= E, axis=(1, 2)).astype(np.int32),
      global_to_host(landed.overflow))
  blocks, checked = {}, []
  for rank in range(lay.expert_counts.shape[0]):
    offsets, counts = lay.expert_offsets[rank], lay.expert_counts[rank]
    nonempty = np.flatnonzero(counts)
    if not len(nonempty):
      continue
    pick = {nonempty[0], nonempty[-1], int(np.argmax(counts))}
    pick |= set(rng.choice(nonempty, min(RANDOM_EXPERTS, len(nonempty)), replace=False).tolist())
    experts = sorted(int(e) for e in pick)
    h32 = reference.sampled_h32(landed.values, landed.scales, offsets, counts, experts, w1q, rank,
                                shape.swiglu_limit, host=global_to_host)
    blocks.update({(rank, e): h for e, h in h32.items()})
    checked += [(rank, e) for e in experts]
  return Reference(lay, blocks), checked


def assert_close(what: str, out: np.ndarray, ref: np.ndarray) -> None:
  """DESIGN.md §3 tolerance of out against the float32 reference."""
  if out.size == 0:
    return
  if np.isnan(out).any() and not np.isnan(ref).any():
    raise CheckError(f"{what}: NaN in the output where the reference has none")
  diff = out - ref
  rel = np.linalg.norm(diff) / max(float(np.linalg.norm(ref)), 1e-30)
  max_abs = float(np.max(np.abs(diff)))
  if rel > REL_TOL or max_abs > MAX_ABS_TOL * float(np.max(np.abs(ref))):
    raise CheckError(f"{what}: relative error {rel:.2e} (limit {REL_TOL}), max |diff| "
                     f"{max_abs:.3e} "
                     f"(limit {MAX_ABS_TOL} * max |ref| = {MAX_ABS_TOL * np.max(np.abs(ref)):.3e})")


def check_padding_zero(what: str, h: np.ndarray, padding: np.ndarray) -> None:
  if np.any(h[padding].astype(np.float32) != 0):
    raise CheckError(f"{what}: padding rows are not 0")


class Tally(NamedTuple):
  """A check's row counts on the ranks it checked; check_path sums them over processes (a dropped
  row is counted at its source, a missing one at its destination)."""
  dropped: int  # rows the path reports dropped (over capacity; engines: past M_cap, as reference)
  missing: int  # rows the reference routes to these ranks that the path did not land there


def check_engine(out: jsm.Stage1Output, ref: Reference, ranks: Sequence[int]) -> Tally:
  """Layout exactly equal to the reference; h within tolerance per checked (rank, expert) block;
  padding rows 0. out holds the ranks `ranks` along axis 0."""
  lay = ref.layout
  for field in LAYOUT_FIELDS:
    got, want = np.asarray(getattr(out, field)), np.asarray(getattr(lay, field))[ranks]
    if got.shape != want.shape or not np.array_equal(got, want):
      bad = np.argwhere(got != want) if got.shape == want.shape else "shape"
      if not isinstance(bad, str) and len(bad):
        bad[0][0] = ranks[bad[0][0]]  # the rank, not this process's index of it
      raise CheckError(f"{field} differs from the reference: shapes {got.shape} vs {want.shape}, "
                       f"first differing index {bad[0] if len(bad) else bad}")
  h = np.asarray(out.h)
  row_of = {r: i for i, r in enumerate(ranks)}
  for (r, e), want in ref.h32.items():
    if r in row_of:
      start = lay.expert_offsets[r, e]
      assert_close(f"h of rank {r} expert {e}",
                   h[row_of[r], start:start + len(want)].astype(np.float32), want)
  for i, r in enumerate(ranks):
    check_padding_zero(f"h of rank {r}", h[i], lay.src_rank[r] < 0)
  overflow = int(np.sum(lay.overflow[ranks]))  # rows that did not land (engine and reference)
  return Tally(overflow, overflow)


def check_native(out: NativeOut, ref: Reference, ranks: Sequence[int], *, tokens: int,
                 topk: int) -> Tally:
  """Every row a native path produced is a row the reference routes to that rank (no duplicates)
  and the rows of each checked reference block match it. check_path checks that every reference
  row is there except those the path reports dropped. out holds the ranks `ranks` along axis 0."""
  lay = ref.layout
  R, T, K = lay.num_rows.shape[0], tokens, topk
  h = np.asarray(out.h)

  def key(src, tok, slot):  # one integer per (source rank, token, slot)
    return (src.astype(np.int64) * T + tok) * K + slot

  got_rows = 0
  for i, d in enumerate(ranks):
    ref_row_of = np.full(R * T * K, -1, np.int64)
    present = np.nonzero(lay.src_rank[d] >= 0)[0]
    ref_row_of[key(lay.src_rank[d][present], lay.src_token[d][present],
                   lay.topk_slot[d][present])] = present
    mine = np.nonzero(out.src_rank[i] >= 0)[0]
    ref_rows = ref_row_of[key(out.src_rank[i][mine], out.src_token[i][mine],
                              out.topk_slot[i][mine])]
    if np.any(ref_rows < 0) or len(np.unique(ref_rows)) != len(ref_rows):
      raise CheckError(f"rank {d} holds rows the reference does not route to it, or duplicates")
    check_padding_zero(f"h of rank {d}", h[i], out.src_rank[i] < 0)
    for (r, e), want in ref.h32.items():
      if r != d:
        continue
      start = lay.expert_offsets[d, e]
      sel = (ref_rows >= start) & (ref_rows < start + len(want))  # the rows of block e it kept
      assert_close(f"h of rank {d} expert {e}", h[i][mine[sel]].astype(np.float32),
                   want[ref_rows[sel] - start])
    got_rows += len(mine)
  return Tally(int(np.sum(out.dropped)), int(np.sum(lay.num_rows[ranks])) - got_rows)


def to_host(tree):
  return jax.tree.map(np.asarray, tree)


def global_to_host(tree):
  """Whole arrays on the host, also when (multi-process) each process holds only its shards."""
  def one(a):
    if not isinstance(a, jax.Array) or a.is_fully_addressable:
      return np.asarray(a)
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))
  return jax.tree.map(one, tree)


def local_ranks(tree) -> tuple:
  """(the ranks this process holds, their host data) of arrays stacked [R, ...] over the ranks:
  one process holds every rank (the data is np.asarray of the whole array); under jax.distributed
  each process holds its own, [len(ranks), ...]."""
  first = jax.tree.leaves(tree)[0]
  if first.is_fully_addressable:
    return list(range(first.shape[0])), to_host(tree)

  def shards(a):
    return sorted(a.addressable_shards, key=lambda s: s.index[0].indices(a.shape[0])[0])

  ranks = [r for s in shards(first) for r in range(*s.index[0].indices(first.shape[0]))]
  return ranks, jax.tree.map(lambda a: np.concatenate([np.asarray(s.data) for s in shards(a)]),
                             tree)


# ------------------------------------------------------------------------------------------------
# Across processes (jax.distributed; each helper is a no-op in a single-process run). Every process
# runs the same calls in the same order, so the collectives below pair up.


def all_processes(values) -> np.ndarray:
  """A small array (the same shape on every process) from every process, stacked [P, ...]."""
  values = np.atleast_1d(np.asarray(values))
  if jax.process_count() == 1:
    return values[None]
  return np.asarray(multihost_utils.process_allgather(values))


def slowest(seconds: float) -> float:
  """The max over processes of a time each process measured."""
  return float(all_processes(seconds).max())


MESSAGE_BYTES = 2000  # of a failing process's error, sent to the others


@contextlib.contextmanager
def same_outcome():
  """Runs a block of checks on every process; if it raises a CheckError or a run failure on any
  process, it raises on every process: its own error, or that of the first process that failed
  (a run failure there as PeerFailure). A single process just raises its error."""
  error = None
  try:
    yield
  except (CheckError, *RUN_FAILURES) as e:
    if jax.process_count() == 1:
      raise
    error = e
  if jax.process_count() == 1:
    return
  code = 0 if error is None else 1 if isinstance(error, CheckError) else 2
  text = str(error or "").encode()[:MESSAGE_BYTES].ljust(MESSAGE_BYTES, b"\0")
  outcomes = all_processes(np.concatenate([[code], np.frombuffer(text, np.uint8)]).astype(np.int32))
  if error is not None:
    raise error
  failed = np.flatnonzero(outcomes[:, 0])
  if len(failed):
    p = int(failed[0])
    message = f"process {p}: " + bytes(outcomes[p, 1:].astype(np.uint8)).rstrip(b"\0").decode(
        errors="replace")
    raise (CheckError if outcomes[p, 0] == 1 else PeerFailure)(message)


# ------------------------------------------------------------------------------------------------
# Timing


def time_calls(fn: Callable, args: tuple, iters: int, warmup: int) -> dict:
  """Per call (the protocol): wall time of one call until block_until_ready, median over iters.
  Also pipelined_ms: iters calls enqueued back to back, one wait at the end, / iters — what a
  model's step sees, without the ~0.1-0.2 ms of host dispatch and synchronisation per call that
  dominate the small stages."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  t0 = time.perf_counter()
  outs = [fn(*args) for _ in range(iters)]
  jax.block_until_ready(outs)
  pipelined = (time.perf_counter() - t0) / iters
  del outs
  ms = all_processes(times).max(0) * 1e3  # per call, the slowest process
  return {"median_ms": float(np.median(ms)), "min_ms": float(ms.min()),
          "p90_ms": float(np.percentile(ms, 90)), "pipelined_ms": slowest(pipelined) * 1e3}


def first_call(fn: Callable, *args):
  """The first call (compiles); returns its result and wall seconds."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


class Checked(NamedTuple):
  """A path that passed its checks, ready to be timed."""
  path: BenchPath
  h: np.ndarray               # the full path's h, for comparing engines byte for byte
  dropped: int
  first_call_s: float         # the full path's first call, compilation included
  stage_inputs: Sequence[Any]  # each stage's input, from running the chain once


def check_path(path: BenchPath, ref: Reference) -> Checked:
  """Runs the full path once and checks it; runs the stage chain once and checks it does the same
  work (same h bytes), keeping each stage's input so that stage can be timed alone. Each process
  checks the ranks it holds; the outcome is the same on every process."""
  prefix = f"{path.name}: output does not match jax_sdma_moe.reference: "
  with same_outcome():
    out, first_s = first_call(path.full, path.inputs, path.w)
    carry, stage_inputs = path.inputs, []
    for stage in path.stages:
      stage_inputs.append(carry)
      carry = jax.block_until_ready(stage(carry, path.w))
    ranks, out = local_ranks(out)
    try:
      tally = path.check(out, ref, ranks)
    except CheckError as e:
      raise CheckError(prefix + str(e)) from None
    _, chain_h = local_ranks(carry.h if isinstance(carry, NativeOut) else carry)
    if chain_h.tobytes() != out.h.tobytes():
      raise CheckError(f"{path.name}: the three stages run apart give a different h than the "
                       "full path, so their times would not add up to the same work")
  dropped, missing = (int(n) for n in all_processes(tally).sum(0))
  if missing != dropped:
    routed = int(np.sum(ref.layout.num_rows))
    raise CheckError(f"{prefix}{routed - missing} rows + {dropped} dropped != {routed} routed")
  return Checked(path, out.h, dropped, first_s, stage_inputs)


def time_path(c: Checked, iters: int, warmup: int) -> dict:
  path = c.path
  row = {"path": path.name, "kind": path.kind, "baseline": path.baseline, "dropped": c.dropped,
         "capacity": path.capacity,
         "stage1": {**time_calls(path.full, (path.inputs, path.w), iters, warmup),
                    "first_call_s": slowest(c.first_call_s)}, "stages": {}}
  for name, stage, inp in zip(STAGES, path.stages, c.stage_inputs):
    row["stages"][name] = time_calls(stage, (inp, path.w), iters, warmup)
  timeline = path.runtime.dispatch_timeline() if path.runtime is not None else {}
  if timeline:  # engines ce, sm: where a fused call's time goes on the device
    row["timeline_ms"] = {k: max((t[k] for t in timeline.values() if t[k] is not None),
                                 default=None)
                          for k in ("gemm_start_ms", "gemm_end_ms", "side_end_ms",
                                    "first_chunk_ms")}
  host = path.runtime.ce_host_stats() if path.runtime is not None else {}
  if host:  # engine ce: the host's share of its calls (every call of this path so far)
    row["ce_host_us"] = {k: max(v[k] / max(v["calls"], 1) for v in host.values())
                         for k in ("plan_us", "plan_stream_us", "enqueue_us", "own_enqueue_us",
                                   "copies", "single_copies", "own_copies")}
    row["ce_host_us"]["batch_error"] = next((v["batch_error"] for v in host.values()
                                             if v["batch_error"]), "")
  return row


def failed_row(path: BenchPath, error: Exception) -> dict:
  """The row of a path that failed at run time: why, in a line."""
  lines = str(error).strip().splitlines() or [type(error).__name__]
  return {"path": path.name, "kind": path.kind, "baseline": path.baseline,
          "capacity": path.capacity, "failed": lines[0][:100], "error": str(error)[:2000]}


def add_rates(row: dict, useful_rows: int, tokens_total: int, row_bytes: Optional[int],
              compute_dtype: str, shape: jsm.MoEShape, ceilings: dict) -> None:
  """Useful GB/s and GFLOP/s of a measured row, and the fraction of the ceilings it reaches.
  route+qpack bytes: the bf16 tokens read (tokens_total = R*T of them) and the rows written.
  With ceilings["rate_devices"] = R (GPUs, which run in parallel and whose ceilings are one
  GPU's) every rate is per GPU: all ranks' bytes and FLOPs / R (the JSON's totals stay whole)."""
  per = ceilings.get("rate_devices", 1)
  flops = 2 * useful_rows * shape.hidden * 2 * shape.intermediate
  wire = useful_rows * row_bytes if row_bytes else 0
  row["compute_dtype"] = compute_dtype
  row["useful_rows"], row["wire_bytes"], row["gemm1_flops"] = useful_rows, wire, flops
  row["rates_per_device"] = per > 1
  flops, wire, tokens_total = flops / per, wire / per, tokens_total / per
  copy_gbps = ceilings["copy_gbps"]
  copy_bound_s = 2 * wire / (copy_gbps * 1e9)
  mm_bound_s = flops / (ceilings["matmul_gflops"][compute_dtype] * 1e9)
  frac = {"stage1": max(copy_bound_s, mm_bound_s) / (row["stage1"]["median_ms"] * 1e-3)}
  if row["stages"]:
    q, d, g = (row["stages"][s] for s in STAGES)
    q["bytes"] = tokens_total * shape.hidden * 2 + wire
    q["gbps"] = q["bytes"] / (q["median_ms"] * 1e-3) / 1e9
    d["gbps"] = wire / (d["median_ms"] * 1e-3) / 1e9
    g["gflops"] = flops / (g["median_ms"] * 1e-3) / 1e9
    frac["route+qpack"] = q["gbps"] / copy_gbps  # both count bytes read + written
    if q.get("pipelined_ms"):  # calls back to back: the kernels without the per-call host wait
      q["pipelined_gbps"] = q["bytes"] / (q["pipelined_ms"] * 1e-3) / 1e9
      frac["route+qpack pipelined"] = q["pipelined_gbps"] / copy_gbps
    frac["dispatch"] = copy_bound_s / (d["median_ms"] * 1e-3)
    frac["gemm1"] = mm_bound_s / (g["median_ms"] * 1e-3)
  row["ceiling_fraction"] = frac


def check_and_time(args, paths: Sequence[BenchPath], ref: Reference, shape: jsm.MoEShape,
                   T: int, ceilings: dict, tag: str) -> list:
  """Checks every path (all before any timing), then times those that passed; one row per path.
  A path that fails at run time gets a failed row; a wrong result raises CheckError."""
  R = ref.layout.num_rows.shape[0]
  rows_total = int(np.sum(ref.layout.num_rows))
  rows, checked = [], []
  for path in paths:
    progress(f"{tag} {path.name}: checking")
    try:
      checked.append(check_path(path, ref))
    except CheckError as e:
      raise CheckError(f"{tag} {e}") from None
    except RUN_FAILURES as e:
      rows.append(failed_row(path, e))
      progress(f"{tag} {path.name}: FAILED: {rows[-1]['failed']}")
  engines_checked = [c for c in checked if c.path.kind == "engine"]
  with same_outcome():
    for c in engines_checked[1:]:
      if c.h.tobytes() != engines_checked[0].h.tobytes():
        raise CheckError(f"{tag} {c.path.name} and {engines_checked[0].path.name} give different "
                         "h bytes (DESIGN §3: engines sharing a GEMM kernel are byte-identical)")
  for c in checked:
    progress(f"{tag} {c.path.name}: timing")
    try:
      row = time_path(c, args.iters, args.warmup)
    except RUN_FAILURES as e:
      rows.append(failed_row(c.path, e))
      progress(f"{tag} {c.path.name}: FAILED: {rows[-1]['failed']}")
      continue
    add_rates(row, rows_total - c.dropped, R * T, c.path.row_bytes, c.path.compute_dtype, shape,
              ceilings)
    rows.append(row)
  return rows


def finish_rows(rows: list, shape: jsm.MoEShape, T: int, R: int, cap: int, rows_total: int,
                **extra) -> list:
  """Tags a configuration's rows and sets each one's speed against the fastest JAX-native path."""
  natives = [r["stage1"]["median_ms"] for r in rows if r["kind"] == "native" and "failed" not in r]
  best_native = min(natives, default=None)
  for r in rows:
    r.update(shape=shape.name, tokens=T, ranks=R, m_cap=cap, rows_total=rows_total, **extra)
    r["vs_best_native"] = (best_native / r["stage1"]["median_ms"]
                           if best_native is not None and "failed" not in r else None)
  return rows


# ------------------------------------------------------------------------------------------------
# One (shape, tokens) configuration


def progress(msg: str) -> None:
  if jax.process_index() == 0:  # multi-process: process 0 speaks for all
    print(msg, file=sys.stderr, flush=True)


def make_engine_paths(args, mesh, shape: jsm.MoEShape, cap: int, inputs, w1q,
                      engines: Sequence[str], runtimes: list, compute_dtype: str) -> list:
  """One path per engine (their Runtimes go to `runtimes`, for the caller to close)."""
  paths = []
  for engine in engines:
    for blocks in ([int(b) for b in args.sm_blocks.split(",")] if engine == "sm" else [None]):
      extra = {} if blocks is None else {"sm_dispatch_blocks": blocks}
      rt = jsm.Runtime(mesh, AXIS, jsm.Stage1Config(engine=engine, row_align=args.row_align,
                                                    swiglu_limit=shape.swiglu_limit, **extra))
      runtimes.append(rt)
      path = engine_path(mesh, rt, shape, cap, inputs, w1q, compute_dtype)
      if blocks is not None and "," in args.sm_blocks:
        path.name += f"/{blocks}"
      paths.append(path)
  return paths


def build_paths(args, mesh, shape: jsm.MoEShape, T: int, cap: int, host: HostInputs, w1q,
                engines: Sequence[str], runtimes: list) -> list:
  """The engine paths and the JAX-native all_to_all paths, with their inputs placed on the mesh."""
  R = mesh.shape[AXIS]
  EL = shape.num_experts // R
  put = functools.partial(jax.device_put, device=NamedSharding(mesh, P(AXIS)))
  per_rank_w1q = jax.tree.map(lambda a: a.reshape(R, EL, *a.shape[1:]), w1q)
  paths = make_engine_paths(args, mesh, shape, cap,
                            tuple(put(a) for a in (host.x, host.ids, host.weights)),
                            jax.tree.map(put, per_rank_w1q), engines, runtimes, "f32")
  # JAX-native paths: bf16 copies of the dequantised MX-fp8 data (exact), weights as [R, EL, H, 2I]
  x_deq = reference.dequantize(*reference.quantize(jnp.asarray(host.x))).astype(jnp.bfloat16)
  return paths + native_paths(args, mesh, shape, T, (put(x_deq), put(host.ids)),
                              put(native_w1(per_rank_w1q)))


def bench_config(args, mesh, shape: jsm.MoEShape, T: int, engines: Sequence[str],
                 ceilings: dict, rng: np.random.Generator) -> list:
  """R ranks on host devices: checks every path on fresh inputs against the full reference, then
  times them and the reference itself; returns one result row per path."""
  R = mesh.shape[AXIS]
  E, K = shape.num_experts, shape.topk
  if E % R:
    raise SystemExit(f"shape {shape.name}: E = {E} is not a multiple of {R} ranks")
  cap = layout.m_cap(R, T, K, E // R, args.row_align)
  tag = f"[{shape.name} T={T}]"
  host = make_inputs(shape, R, T, rng)
  w1q = jsm.quantize_w1(jnp.asarray(host.w1))

  # the reference (one device): the check target, and a JAX-native baseline timed below
  ref_fn = functools.partial(reference.stage1, row_align=args.row_align, cap=cap,
                             swiglu_limit=shape.swiglu_limit)
  ref_args = jax.device_put((host.x, host.ids, host.weights, w1q), jax.local_devices()[0])
  (ref, h32), _ = first_call(jax.jit(functools.partial(ref_fn, return_f32=True)), *ref_args)
  ref = full_reference(to_host(ref), np.asarray(h32))
  rows_total = int(ref.layout.num_rows.sum())
  progress(f"{tag} reference: {rows_total} rows over {R} ranks, M_cap {cap}")

  runtimes = []
  try:
    rows = check_and_time(args, build_paths(args, mesh, shape, T, cap, host, w1q, engines,
                                            runtimes), ref, shape, T, ceilings, tag)
  finally:
    for rt in runtimes:
      rt.close()

  progress(f"{tag} native:jnp-reference: timing")
  ref_jit = jax.jit(ref_fn)
  _, first_s = first_call(ref_jit, *ref_args)
  ref_row = {"path": "native:jnp-reference(1 dev)", "kind": "native", "baseline": None,
             "dropped": 0, "capacity": None, "stages": {},
             "stage1": {**time_calls(ref_jit, ref_args, args.iters, args.warmup),
                        "first_call_s": slowest(first_s)}}
  add_rates(ref_row, rows_total, R * T, None, "f32", shape, ceilings)
  rows.append(ref_row)
  jax.clear_caches()
  return finish_rows(rows, shape, T, R, cap, rows_total)


def bench_single_config(args, mesh, shape: jsm.MoEShape, T: int, weights: tuple,
                        engines: Sequence[str], ceilings: dict, key,
                        rng: np.random.Generator) -> list:
  """--gpu, R devices of one process: inputs made on the devices, the sampled check, XLA's dense
  bf16 matmul of one rank's gemm1 FLOPs as this configuration's matmul ceiling, then every path
  timed."""
  E, K, H, I = shape.num_experts, shape.topk, shape.hidden, shape.intermediate
  R = mesh.shape[AXIS]
  cap = layout.m_cap(R, T, K, E // R, args.row_align)
  tag = f"[{shape.name} T={T}]"
  k_inputs, k_dense = jax.random.split(key)
  engine_inputs, native_inputs = device_inputs(mesh, shape, T, k_inputs)
  w1q, w_native = weights
  ref, experts = sampled_reference(shape, args.row_align, cap, engine_inputs, w1q, rng)
  rows_total = int(ref.layout.num_rows.sum())
  progress(f"{tag} reference layout: {rows_total} rows, M_cap {cap}; h checked for experts "
           f"{experts}")

  progress(f"{tag} dense bf16 matmul [{T * K}, {H}] x [{H}, {2 * I}]: timing")
  dense = {"shape": shape.name, "tokens": T,
           **dense_bf16_matmul(T * K, H, 2 * I, args.iters, args.warmup, k_dense)}
  ceilings["dense_bf16"].append(dense)
  config_ceilings = {**ceilings, "matmul_gflops": {"bf16": dense["gflops"]}, "rate_devices": R}

  runtimes = []
  try:
    paths = make_engine_paths(args, mesh, shape, cap, engine_inputs, w1q, engines, runtimes,
                              "bf16")
    paths += native_paths(args, mesh, shape, T, native_inputs, w_native)
    rows = check_and_time(args, paths, ref, shape, T, config_ceilings, tag)
  finally:
    for rt in runtimes:
      rt.close()
  jax.clear_caches()
  return finish_rows(rows, shape, T, R, cap, rows_total, checked_experts=experts,
                     dense_bf16_gflops=dense["gflops"])


# ------------------------------------------------------------------------------------------------
# Output


def render_table(cols: Sequence[tuple], rows: Sequence[Sequence], left: int) -> list:
  """Lines of a text table: cols are (name, width, format), the first `left` left-aligned and
  printed as they are, the others right-aligned and formatted ('-' for None). A str value in a
  formatted column (e.g. 'failed: ...') is printed as it is."""
  def cell(i, value):
    name, width, fmt = cols[i]
    if i < left:
      return f"{value:<{width}}"
    text = "-" if value is None else value if isinstance(value, str) else fmt.format(value)
    return text.rjust(width)

  lines = ["  ".join(f"{name:>{w}}" if i >= left else f"{name:<{w}}"
                     for i, (name, w, _) in enumerate(cols))]
  lines += ["  ".join(cell(i, v) for i, v in enumerate(vals)) for vals in rows]
  return lines


def format_table(rows: Sequence[dict], ceilings: dict, notes: Sequence[str] = NOTES) -> str:
  cols = [("shape", 6, "{}"), ("T", 5, "{}"), ("path", 28, "{}"), ("stage1 ms", 9, "{:.2f}"),
          ("rt+qpack", 8, "{:.2f}"), ("disp ms", 8, "{:.2f}"), ("GB/s", 6, "{:.2f}"),
          ("%bw", 5, "{:.0%}"), ("gemm1 ms", 8, "{:.2f}"), ("GFLOP/s", 7, "{:.1f}"),
          ("%mm", 5, "{:.0%}"), ("%ceil", 5, "{:.0%}"), ("vs nat", 6, "{:.2f}x"), ("drop", 5, "{}")]
  table, failed = [], []
  for r in rows:
    if "failed" in r:
      failed.append(f"{r['shape']:<6}  {r['tokens']:<5}  {r['path']:<28}  failed: {r['failed']}")
      continue
    st, frac = r["stages"], r["ceiling_fraction"]

    def get(stage, field):  # the reference row has no stages
      return st[stage][field] if st else None

    table.append([r["shape"], r["tokens"], r["path"], r["stage1"]["median_ms"],
                  get("route+qpack", "median_ms"), get("dispatch", "median_ms"),
                  get("dispatch", "gbps"), frac.get("dispatch"), get("gemm1", "median_ms"),
                  get("gemm1", "gflops"), frac.get("gemm1"), frac["stage1"], r["vs_best_native"],
                  r["dropped"]])
  lines = render_table(cols, table, left=3) + failed
  for shape, T in sorted({(r["shape"], r["tokens"]) for r in rows}):
    lines.append(f"{shape:<6}  {T:<5}  {'native:ragged_a2a+ragged_dot':<28}  n/a on CPU "
                 "(XLA:CPU has no ragged_all_to_all)")
  mm = ceilings["matmul_gflops"]
  lines.append(f"ceilings: memcpy {ceilings['copy_gbps']:.1f} GB/s, matmul f32 {mm['f32']:.0f} / "
               f"bf16 {mm['bf16']:.0f} GFLOP/s ({ceilings['how']})")
  lines += [f"- {n}" for n in notes]
  return "\n".join(lines)


def _rate(v: Optional[float]) -> Optional[str]:
  """A rate with 3 significant digits, without exponents (H200 TFLOP/s run to 4 digits)."""
  return None if v is None else f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def format_single_device_table(rows: Sequence[dict], ceilings: dict, skipped: set,
                               notes: Sequence[str] = SINGLE_DEVICE_NOTES) -> str:
  """--gpu: one line per engine path and (shape, tokens), with the JAX-native baselines of the same
  configuration in its last columns."""
  cols = [("shape", 6, "{}"), ("T", 5, "{}"), ("path", 12, "{}"), ("stage1 ms", 9, "{:.3f}"),
          ("pipe ms", 7, "{:.3f}"), ("rt+qp ms", 8, "{:.3f}"), ("GB/s", 6, "{}"), ("%copy", 5, "{:.0%}"),
          ("pipe %copy", 10, "{:.0%}"),
          ("disp ms", 7, "{:.3f}"), ("GB/s", 6, "{}"), ("gemm1 ms", 8, "{:.3f}"),
          ("TFLOP/s", 7, "{}"), ("fused TF/s", 10, "{}"), ("st1/gemm", 8, "{:.2f}"),
          ("mm TF/s", 7, "{}"), ("%mm", 5, "{:.0%}"), ("einsum ms", 9, "{:.3f}"),
          ("drop", 5, "{}"), ("vs nat", 6, "{:.2f}x"), ("ragged ms", 9, "{:.3f}")]

  def native(shape, T, baseline):
    """(stage1 ms or why there is none, rows dropped) of a baseline in this configuration."""
    if baseline in skipped:
      return "skipped", None
    r = next((r for r in rows if r["shape"] == shape and r["tokens"] == T
              and r.get("baseline") == baseline), None)
    if r is None:
      return None, None
    if "failed" in r:
      return f"failed: {r['failed']}", None
    return r["stage1"]["median_ms"], r["dropped"]

  table = []
  for r in rows:
    if r["kind"] != "engine":
      continue
    shape, T = r["shape"], r["tokens"]
    einsum_ms, drop = native(shape, T, "einsum")
    ragged_ms, _ = native(shape, T, "ragged")
    if "failed" in r:
      natives = [einsum_ms, drop, None, ragged_ms]  # the last four columns
      table.append([shape, T, r["path"], f"failed: {r['failed']}"]
                   + [None] * (len(cols) - 4 - len(natives)) + natives)
      continue
    q, d, g = (r["stages"][s] for s in STAGES)
    frac = r["ceiling_fraction"]
    fused_ms = r["stage1"]["median_ms"] - q["median_ms"]  # gemm1 with the dispatch it overlaps
    fused = g["gflops"] * g["median_ms"] / fused_ms / 1e3 if fused_ms > 0 else None
    table.append([shape, T, r["path"], r["stage1"]["median_ms"], r["stage1"]["pipelined_ms"],
                  q["median_ms"], _rate(q["gbps"]),
                  frac["route+qpack"], frac.get("route+qpack pipelined"), d["median_ms"],
                  _rate(d["gbps"]), g["median_ms"],
                  _rate(g["gflops"] / 1e3), _rate(fused), r["stage1"]["median_ms"] / g["median_ms"],
                  _rate(r["dense_bf16_gflops"] / 1e3), frac["gemm1"], einsum_ms, drop,
                  r["vs_best_native"], ragged_ms])
  lines = render_table(cols, table, left=3)
  peer = (f", peer copy {ceilings['peer_copy_gbps']:.0f} GB/s (jax.device_put GPU0 -> GPU1)"
          if "peer_copy_gbps" in ceilings else "")
  lines.append(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s{peer}, dense bf16 "
               f"{ceilings['matmul_gflops']['bf16'] / 1e3:.3g} TFLOP/s ({ceilings['how']})")
  for r in rows:
    if "timeline_ms" in r:
      t = r["timeline_ms"]
      lines.append(f"{r['shape']} T={r['tokens']} {r['path']}: device timeline of the fused calls "
                   f"(ms after the dispatch's start, mean over calls, max over ranks): GEMM "
                   f"starts {t['gemm_start_ms']:.2f}, ends {t['gemm_end_ms']:.2f}; side stream "
                   f"done {t['side_end_ms']:.2f}"
                   + (f"; first chunk of peer copies landed {t['first_chunk_ms']:.2f}"
                      if t.get("first_chunk_ms") is not None else ""))
    if "ce_host_us" in r:
      h = r["ce_host_us"]
      lines.append(f"{r['shape']} T={r['tokens']} {r['path']}: host per call (mean over the "
                   f"path's calls, max over ranks): plan synchronisation {h['plan_us']:.0f} µs "
                   + (f"({h['plan_stream_us']:.0f} of them waiting for this rank's stream: "
                      "route+qpack; the rest for the slowest peer)"
                      if "plan_stream_us" in h else
                      "(includes waiting for route+qpack and the slowest peer)")
                   + ", copy enqueue "
                   f"{h['enqueue_us']:.0f} µs for {h.get('copies', 0):.0f} copies"
                   + (f" (of them within the GPU: {h['own_enqueue_us']:.0f} µs for "
                      f"{h['own_copies']:.0f})" if "own_copies" in h else "")
                   + (f", {h['single_copies']:.0f} of them one at a time (cudaMemcpyBatchAsync: "
                      f"{h['batch_error']})" if h.get("single_copies") else ""))
  lines += [f"- {n}" for n in notes]
  return "\n".join(lines)


DENSE_LABEL = "XLA dense bf16 matmul, same FLOPs"


def write_plot(rows: Sequence[dict], path: Path, dense: Optional[Sequence[dict]] = None
               ) -> Optional[str]:
  """Stage1 ms against tokens per shape, one line per path; with `dense` (--gpu) a second row of
  panels: gemm1 useful TFLOP/s of every path against XLA's dense bf16 matmul of the same FLOPs."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
  except ImportError:
    return "matplotlib is not importable: no plot written (pip install matplotlib)"
  ok = [r for r in rows if "failed" not in r]
  if not ok:
    return "no measured rows: no plot written"
  shapes = sorted({r["shape"] for r in ok})
  panels = 2 if dense is not None else 1
  fig, axes = plt.subplots(panels, len(shapes), figsize=(6 * len(shapes), 4.5 * panels),
                           squeeze=False)

  def draw(ax, series: dict, ylabel: str, title: str):
    for name, pts in series.items():
      if pts:  # engines solid, JAX-native dashed, the dense matmul ceiling dotted
        ax.plot(*zip(*sorted(pts)), marker="o", label=name,
                linestyle="-" if name.startswith("engine") else ":" if name == DENSE_LABEL
                else "--")
    ax.set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel=ylabel, title=title)
    ax.set_xticks(sorted({T for pts in series.values() for T, _ in pts}))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

  for col, shape in enumerate(shapes):
    mine = [r for r in ok if r["shape"] == shape]
    names = dict.fromkeys(r["path"] for r in mine)
    draw(axes[0][col], {n: [(r["tokens"], r["stage1"]["median_ms"]) for r in mine
                            if r["path"] == n] for n in names},
         "Stage1 ms (median)", f"{shape}, {ok[0]['ranks']} ranks")
    if dense is not None:
      series = {n: [(r["tokens"], r["stages"]["gemm1"]["gflops"] / 1e3) for r in mine
                    if r["path"] == n and r["stages"]] for n in names}
      series[DENSE_LABEL] = [(d["tokens"], d["gflops"] / 1e3) for d in dense
                             if d["shape"] == shape]
      draw(axes[1][col], series, "gemm1 useful TFLOP/s", f"{shape}: gemm1")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return None


def metadata(args, engines, devices, launch: str = "single") -> dict:
  cpu_model = platform.processor()
  if not cpu_model and os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      cpu_model = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), "")
  return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
          "numpy": np.__version__, "jax_sdma_moe": jsm.__version__,
          "python": platform.python_version(),
          "machine": cpu_model or platform.machine(), "nproc": os.cpu_count(),
          "platform": devices[0].platform, "devices": len(devices),
          "device_kind": devices[0].device_kind, "engines": list(engines),
          "launch": launch, "processes": jax.process_count(),
          "args": vars(args), "argv": sys.argv}


class Report:
  """The JSON (rewritten after every configuration, so an interrupted run keeps what it has) and,
  at the end, the PNG, under --out. Multi-process: process 0 writes them, the others nothing."""

  def __init__(self, args, stem: str, meta: dict, ceilings: dict, notes: Sequence[str]):
    self.dir = Path(args.out)
    self.writes = jax.process_index() == 0
    if self.writes:
      self.dir.mkdir(parents=True, exist_ok=True)
    self.json, self.png = self.dir / f"{stem}.json", self.dir / f"{stem}.png"
    self.head = {"meta": meta, "ceilings": ceilings, "notes": list(notes)}

  def write_json(self, rows: Sequence[dict]) -> None:
    if self.writes:
      self.json.write_text(json.dumps({**self.head, "results": list(rows)}, indent=1) + "\n")

  def finish(self, rows: Sequence[dict], dense=None) -> None:
    if not self.writes:
      return
    self.write_json(rows)
    print(f"wrote {self.json}")
    note = write_plot(rows, self.png, dense)
    print(note or f"wrote {self.png}")


def parse_list(text: Optional[str], default: str) -> list:
  return [s for s in (text or default).split(",") if s]


def start_processes(args, launch: str) -> None:
  """Multi-process: joins the other processes (jax.distributed; Open MPI's environment is detected
  by jax itself) with gloo for the CPU collectives. Must run before jax starts a backend."""
  if launch == "single":
    return
  if args.gpu and args.devices not in (None, 1):
    raise SystemExit("--gpu --devices: a multi-process run has one device (rank) per process")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if launch == "explicit":
    # --gpu on one node: JAX uses GPU <process id> (CUDA still sees every GPU: peer access / IPC)
    local = [args.process_id] if args.gpu and args.platform == "gpu" else None
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, local_device_ids=local)
  else:
    jax.distributed.initialize()


def merge_reports(args) -> None:
  """--merge: the rows of several runs' JSON files as one report, each row as it was measured."""
  runs = [(f, json.loads(Path(f).read_text())) for f in args.merge]
  modes = {(d["meta"]["args"].get("gpu"), d["meta"]["launch"], d["meta"]["devices"],
            d["meta"]["device_kind"]) for _, d in runs}
  if len(modes) > 1:
    raise SystemExit(f"--merge: the files come from different modes {sorted(map(str, modes))}")
  rows, dense = {}, {}
  for f, d in runs:
    rows.update({(r["shape"], r["tokens"], r["path"]): {**r, "source": Path(f).name}
                 for r in d["results"]})
    dense.update({(r["shape"], r["tokens"]): r for r in d["ceilings"].get("dense_bf16", [])})
  rows = sorted(rows.values(), key=lambda r: (r["shape"], r["tokens"]))  # stable: path order kept
  first = runs[0][1]
  ceilings = {**first["ceilings"], "dense_bf16": list(dense.values())}
  sources = [f"{Path(f).name} ({d['meta']['date']}, {len(d['results'])} rows, ceilings "
             f"copy {d['ceilings']['copy_gbps']:.0f} GB/s)" for f, d in runs]
  notes = list(first["notes"]) + ["merged from " + "; ".join(sources) + "; the ceilings line is "
                                  "the first file's"]
  gpu_mode, stem = first["meta"]["args"].get("gpu"), args.tag or "merged"
  if gpu_mode:
    skipped = set.intersection(*(set(parse_list(d["meta"]["args"].get("skip_native"), ""))
                                 for _, d in runs))
    text = format_single_device_table(rows, ceilings, skipped, notes)
  else:
    text = format_table(rows, ceilings, notes)
  print(text)
  report = Report(args, stem, {**first["meta"], "merged_from": sources}, ceilings, notes)
  (report.dir / f"{stem}.txt").write_text(text + "\n")
  report.finish(rows, ceilings["dense_bf16"] if gpu_mode else None)


def main(args) -> None:
  if args.merge:
    return merge_reports(args)
  launch = launch_mode(args)
  mode = int(args.gpu)  # index into the DEFAULT_* pairs
  shapes = parse_list(args.shapes, DEFAULT_SHAPES[mode])
  unknown = [s for s in shapes if s not in jsm.SHAPES]
  if unknown:
    raise SystemExit(f"unknown shape(s) {unknown}; known: {sorted(jsm.SHAPES)}")
  tokens = [int(t) for t in parse_list(args.tokens, DEFAULT_TOKENS[mode])]
  default_engines = DEFAULT_ENGINES[mode] if launch == "single" else MULTI_PROCESS_ENGINES
  if args.gpu and ((args.devices or 1) > 1 or launch != "single"):
    default_engines = ("xla" if args.platform != "gpu" else
                       DEFAULT_GPU_MULTI_ENGINES if launch == "single" else
                       DEFAULT_GPU_MULTI_PROCESS_ENGINES)  # Runtime refuses xla across processes
  engines = parse_list(args.engines, default_engines)
  skipped_natives(args)  # reject unknown names before anything runs
  start_processes(args, launch)
  try:
    rows = (main_single_device(args, shapes, tokens, engines, launch) if args.gpu else
            main_host_devices(args, shapes, tokens, engines, launch))
  except CheckError as e:
    raise SystemExit(f"CHECK FAILED (aborted before timing it; results so far in --out): {e}")
  if any("failed" in r for r in rows if r["kind"] == "engine"):
    raise SystemExit("an engine path failed at run time (see the table)")


def main_host_devices(args, shapes, tokens, engines, launch: str = "single") -> list:
  """R ranks: the virtual CPU devices of this process, or (multi-process) every device of every
  process."""
  if launch == "single":
    R = args.devices or DEFAULT_DEVICES
    if len(jax.devices()) < R:
      raise SystemExit(f"{R} devices requested, jax sees {len(jax.devices())}: set "
                       f"XLA_FLAGS=--xla_force_host_platform_device_count={R} before "
                       "jax is imported (running bench/run.py as a script does)")
  else:
    R = jax.device_count()
    if args.devices not in (None, R):
      raise SystemExit(f"--devices {args.devices}: a multi-process run has one rank per device of "
                       f"every process, {R} here")
  devices = jax.devices()[:R]
  mesh = jax.make_mesh((R,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=devices)
  progress("measuring ceilings")
  ceilings = measure_ceilings()
  notes, tag = NOTES, "cpu"
  if launch != "single":
    notes += (MULTI_PROCESS_NOTE.format(processes=jax.process_count(), launch=launch),)
    tag = f"{devices[0].platform}-{'mpi' if launch == 'mpirun' else 'mp'}{jax.process_count()}"
  report = Report(args, args.tag or tag, metadata(args, engines, devices, launch), ceilings, notes)
  rng = np.random.default_rng(args.seed)
  rows = []
  for name in shapes:
    for T in tokens:
      rows += bench_config(args, mesh, jsm.SHAPES[name], T, engines, ceilings, rng)
      report.write_json(rows)
  if jax.process_index() == 0:
    print(format_table(rows, ceilings, notes))
  report.finish(rows)
  return rows


def main_single_device(args, shapes, tokens, engines, launch: str = "single") -> list:
  """--gpu: R = --devices (default 1) devices of --platform in this process, or (multi-process)
  one device per process; everything made and measured on the devices."""
  try:
    if launch == "single":
      R = args.devices or 1
      devices = jax.devices(args.platform)[:R]
    else:
      devices = jax.devices(args.platform)
      R = len(devices)
  except RuntimeError as e:
    raise SystemExit(f"--gpu: no {args.platform} device ({e}); --platform cpu runs the same code "
                     "on the CPU") from None
  if len(devices) < R:
    raise SystemExit(f"--gpu --devices {R}: only {len(devices)} {args.platform} devices")
  device = jax.local_devices(backend=args.platform)[0]
  on_gpu = device.platform != "cpu"
  # Auto axis: the stacked [R, ...] arrays then also feed plain jnp code (the reference), which
  # refuses to reduce over an Explicit-sharded axis
  mesh = jax.make_mesh((R,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
  key = jax.random.key(args.seed)
  rng = np.random.default_rng(args.seed)  # picks the randomly checked experts
  rows = []
  with jax.default_device(device):  # every array this makes, and every jit without inputs
    progress(f"measuring ceilings on {device.device_kind}")
    # a 2 GiB copy and an 8192^3 matmul make the H200's ceilings; a CPU gets a smaller copy and
    # matmul so that trying the mode stays quick
    ceilings = measure_device_ceilings(device, (2 << 30) if on_gpu else (256 << 20),
                                       8192 if on_gpu else 1024)
    if R > 1 and launch == "single":
      ceilings["peer_copy_gbps"] = peer_copy_gbps(devices[0], devices[1],
                                                  (1 << 30) if on_gpu else (64 << 20))
    tag = ("gpu" if on_gpu else "gpu-cpu") + (f"-x{R}" if R > 1 else "")
    notes = SINGLE_DEVICE_NOTES
    if launch != "single":
      tag += "-mpi" if launch == "mpirun" else "-mp"
      notes += (MULTI_PROCESS_NOTE.format(processes=jax.process_count(), launch=launch),)
    report = Report(args, args.tag or tag, metadata(args, engines, devices, launch), ceilings,
                    notes)
    for s, name in enumerate(shapes):
      shape = jsm.SHAPES[name]
      progress(f"[{name}] making w1 on the device")
      weights = device_weights(mesh, shape, jax.random.fold_in(key, 2 * s))
      for T in tokens:
        rows += bench_single_config(args, mesh, shape, T, weights, engines, ceilings,
                                    jax.random.fold_in(jax.random.fold_in(key, 2 * s + 1), T),
                                    rng)
        report.write_json(rows)
      del weights  # the next shape's weights need the memory (v4pro: 17 GB fp8 + 34 GB bf16)
  if jax.process_index() == 0:
    print(format_single_device_table(rows, ceilings, skipped_natives(args), notes))
  report.finish(rows, ceilings["dense_bf16"])
  return rows


if __name__ == "__main__":
  main(ARGS)
