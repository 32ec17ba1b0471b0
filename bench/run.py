"""Stage1 benchmark (DESIGN.md §8): jax_sdma_moe engines against JAX-native paths, in one run.

For each shape and tokens/rank it builds fresh random inputs, checks every path's output against
`jax_sdma_moe.reference` (before any timing), then times:
  * Stage1 through the public API (`jsm.stage1` in a jitted shard_map), one row per engine, and its
    three stages separately (route+qpack, dispatch, gemm1), each its own jitted shard_map over the
    `jax_sdma_moe.primitives` calls;
  * JAX-native baselines: the jnp reference on one device, a capacity-based `all_to_all` + `einsum`
    path, and a dropless `all_to_all` + `ragged_dot` path (XLA:CPU has no `ragged_all_to_all`, so
    fixed-size chunks emulate it);
  * the machine's ceilings (host memcpy bandwidth; float32 and bfloat16 matmul rates), and the
    fraction of them each path reaches.
It prints a table, and writes JSON and (when matplotlib is importable) a PNG to --out.

Usage (from the repository root; `python -m bench.run` works too):
  python bench/run.py               # small shape, T = 128 and 1024, 8 CPU devices
  python bench/run.py --tokens 32 --iters 3 --warmup 1
Only CPU is implemented; --gpu is reserved for the GPU rows (engines ce/sm/sdma/xla on real devices:
configure_platform, measure_ceilings and the default engines are the places that will branch).

Timing: one call is the wall time of the whole SPMD program until `jax.block_until_ready`, i.e. the
max over ranks in this single-process run; statistics are over --iters calls after --warmup more.
"""
from __future__ import annotations

import argparse
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
GPU_NOT_YET = "bench/run.py: --gpu is not implemented yet (CPU rows only)"
STAGES = ("route+qpack", "dispatch", "gemm1")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--shapes", default="small", help="comma list of jax_sdma_moe.SHAPES names")
  p.add_argument("--tokens", default="128,1024", help="comma list of tokens per rank")
  p.add_argument("--engines", default=None,
                 help="comma list of Stage1Config engines (default: cpu,xla on CPU)")
  p.add_argument("--devices", type=int, default=8, help="ranks (virtual CPU devices)")
  p.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
  p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
  p.add_argument("--row-align", type=int, default=128, help="Stage1Config.row_align")
  p.add_argument("--capacity-factor", type=float, default=1.25,
                 help="all_to_all+einsum baseline: capacity / mean rows per (source, expert)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="bench/results", help="folder for the JSON and PNG")
  p.add_argument("--tag", default=None, help="output file name (default: the platform, 'cpu')")
  p.add_argument("--gpu", action="store_true", help="run on the local GPUs (not implemented yet)")
  return p


def configure_platform(args) -> None:
  """What must happen before jax is imported. CPU: the number of virtual devices."""
  if args.gpu:
    raise SystemExit(GPU_NOT_YET)
  force_host_devices(args.devices)


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
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402
from jax_sdma_moe import layout, primitives, reference  # noqa: E402

# Stage1Output fields that are integers or copied floats: every engine must match the reference
# exactly (DESIGN.md §4). h is compared within the §3 tolerance instead.
LAYOUT_FIELDS = ("expert_offsets", "expert_counts", "src_rank", "src_token", "topk_slot",
                 "topk_weight", "num_rows", "num_invalid", "overflow")
REL_TOL = 4e-3      # DESIGN.md §3: ||out - ref|| / ||ref|| per expert block
MAX_ABS_TOL = 1e-2  # DESIGN.md §3: max |out - ref| <= MAX_ABS_TOL * max |ref|
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
  w1 = (rng.standard_normal((E, 2 * I, H), np.float32) * 0.05).astype(jnp.bfloat16)
  return HostInputs(x, ids, weights, w1)


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
  check: Callable[..., int]    # check(out, ref, h32): raises CheckError; returns rows dropped
  capacity: Optional[int] = None  # rows per (source, expert) of a capacity-based path


class CheckError(AssertionError):
  pass


def engine_path(mesh, rt: jsm.Runtime, shape: jsm.MoEShape, cap: int, inputs, w1q) -> BenchPath:
  """jsm.stage1 with one engine, and its stages from jax_sdma_moe.primitives."""
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
                   H + H // layout.BLOCK + 12, "f32", check_engine)


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


def native_path(mesh, name: str, shape: jsm.MoEShape, tokens: int, capacity: Optional[int],
                gemm: Callable, inputs, w) -> BenchPath:
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
                   functools.partial(check_native, tokens=tokens, topk=shape.topk), capacity)


# ------------------------------------------------------------------------------------------------
# Checks (run once before timing; numpy on the host)


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


def check_engine(out: jsm.Stage1Output, ref: jsm.Stage1Output, h32: np.ndarray) -> int:
  """Layout exactly equal to the reference; h within tolerance per (rank, expert); padding 0."""
  for field in LAYOUT_FIELDS:
    got, want = np.asarray(getattr(out, field)), np.asarray(getattr(ref, field))
    if got.shape != want.shape or not np.array_equal(got, want):
      bad = np.argwhere(got != want) if got.shape == want.shape else "shape"
      raise CheckError(f"{field} differs from the reference: shapes {got.shape} vs {want.shape}, "
                       f"first differing index {bad[0] if len(bad) else bad}")
  h = np.asarray(out.h).astype(np.float32)
  offsets, counts, src_rank = ref.expert_offsets, ref.expert_counts, ref.src_rank
  for r in range(h.shape[0]):
    for e in range(offsets.shape[1]):
      rows = slice(offsets[r, e], offsets[r, e] + counts[r, e])
      assert_close(f"h of rank {r} expert {e}", h[r, rows], h32[r, rows])
    if np.any(h[r][src_rank[r] < 0] != 0):
      raise CheckError(f"h of rank {r}: padding rows are not 0")
  return int(np.sum(ref.overflow))


def check_native(out: NativeOut, ref: jsm.Stage1Output, h32: np.ndarray, *, tokens: int,
                 topk: int) -> int:
  """Every row a native path produced matches the reference row of the same (source, token, slot),
  and all reference rows are there except those the path reports dropped."""
  R, T, K = ref.num_rows.shape[0], tokens, topk
  dropped = int(np.sum(out.dropped))
  h = np.asarray(out.h).astype(np.float32)

  def key(src, tok, slot):  # one integer per (source rank, token, slot)
    return (src.astype(np.int64) * T + tok) * K + slot

  got_rows = 0
  for d in range(R):
    ref_row_of = np.full(R * T * K, -1, np.int64)
    present = np.nonzero(ref.src_rank[d] >= 0)[0]
    ref_row_of[key(ref.src_rank[d][present], ref.src_token[d][present],
                   ref.topk_slot[d][present])] = present
    mine = np.nonzero(out.src_rank[d] >= 0)[0]
    ref_rows = ref_row_of[key(out.src_rank[d][mine], out.src_token[d][mine],
                              out.topk_slot[d][mine])]
    if np.any(ref_rows < 0) or len(np.unique(ref_rows)) != len(ref_rows):
      raise CheckError(f"rank {d} holds rows the reference does not route to it, or duplicates")
    if np.any(h[d][out.src_rank[d] < 0] != 0):
      raise CheckError(f"h of rank {d}: padding rows are not 0")
    assert_close(f"h of rank {d}", h[d][mine], h32[d][ref_rows])
    got_rows += len(mine)
  if got_rows + dropped != int(np.sum(ref.num_rows)):
    raise CheckError(f"{got_rows} rows + {dropped} dropped != {int(np.sum(ref.num_rows))} routed")
  return dropped


def to_host(tree):
  return jax.tree.map(np.asarray, tree)


# ------------------------------------------------------------------------------------------------
# Timing


def time_calls(fn: Callable, args: tuple, iters: int, warmup: int) -> dict:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  ms = np.asarray(times) * 1e3
  return {"median_ms": float(np.median(ms)), "min_ms": float(ms.min()),
          "p90_ms": float(np.percentile(ms, 90))}


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


def check_path(path: BenchPath, ref, h32) -> Checked:
  """Runs the full path once and checks it; runs the stage chain once and checks it does the same
  work (same h bytes), keeping each stage's input so that stage can be timed alone."""
  out, first_s = first_call(path.full, path.inputs, path.w)
  out = to_host(out)
  try:
    dropped = path.check(out, ref, h32)
  except CheckError as e:
    raise CheckError(f"{path.name}: output does not match jax_sdma_moe.reference: {e}") from None
  carry, stage_inputs = path.inputs, []
  for stage in path.stages:
    stage_inputs.append(carry)
    carry = jax.block_until_ready(stage(carry, path.w))
  chain_h = np.asarray(carry.h if isinstance(carry, NativeOut) else carry)
  if chain_h.tobytes() != out.h.tobytes():
    raise CheckError(f"{path.name}: the three stages run apart give a different h than the full "
                     "path, so their times would not add up to the same work")
  return Checked(path, out.h, dropped, first_s, stage_inputs)


def time_path(c: Checked, iters: int, warmup: int) -> dict:
  path = c.path
  row = {"path": path.name, "kind": path.kind, "dropped": c.dropped, "capacity": path.capacity,
         "stage1": {**time_calls(path.full, (path.inputs, path.w), iters, warmup),
                    "first_call_s": c.first_call_s}, "stages": {}}
  for name, stage, inp in zip(STAGES, path.stages, c.stage_inputs):
    row["stages"][name] = time_calls(stage, (inp, path.w), iters, warmup)
  return row


def add_rates(row: dict, useful_rows: int, row_bytes: Optional[int], compute_dtype: str,
              shape: jsm.MoEShape, ceilings: dict) -> None:
  """Useful GB/s and GFLOP/s of a measured row, and the fraction of the ceilings it reaches."""
  flops = 2 * useful_rows * shape.hidden * 2 * shape.intermediate
  wire = useful_rows * row_bytes if row_bytes else 0
  copy_bound_s = 2 * wire / (ceilings["copy_gbps"] * 1e9)
  mm_bound_s = flops / (ceilings["matmul_gflops"][compute_dtype] * 1e9)
  row["compute_dtype"] = compute_dtype
  row["useful_rows"], row["wire_bytes"], row["gemm1_flops"] = useful_rows, wire, flops
  frac = {"stage1": max(copy_bound_s, mm_bound_s) / (row["stage1"]["median_ms"] * 1e-3)}
  if row["stages"]:
    d, g = row["stages"]["dispatch"], row["stages"]["gemm1"]
    d["gbps"] = wire / (d["median_ms"] * 1e-3) / 1e9
    g["gflops"] = flops / (g["median_ms"] * 1e-3) / 1e9
    frac["dispatch"] = copy_bound_s / (d["median_ms"] * 1e-3)
    frac["gemm1"] = mm_bound_s / (g["median_ms"] * 1e-3)
  row["ceiling_fraction"] = frac


# ------------------------------------------------------------------------------------------------
# One (shape, tokens) configuration


def progress(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def build_paths(args, mesh, shape: jsm.MoEShape, T: int, cap: int, host: HostInputs, w1q,
                engines: Sequence[str], runtimes: list) -> list:
  """The engine paths (their Runtimes go to `runtimes`, for the caller to close) and the JAX-native
  all_to_all paths, with their inputs placed on the mesh."""
  R = mesh.shape[AXIS]
  H, I, E, K = shape.hidden, shape.intermediate, shape.num_experts, shape.topk
  EL = E // R
  put = functools.partial(jax.device_put, device=NamedSharding(mesh, P(AXIS)))
  paths = []
  engine_inputs = tuple(put(a) for a in (host.x, host.ids, host.weights))
  per_rank_w1q = jax.tree.map(lambda a: put(a.reshape(R, EL, *a.shape[1:])), w1q)
  for engine in engines:
    rt = jsm.Runtime(mesh, AXIS, jsm.Stage1Config(engine=engine, row_align=args.row_align,
                                                  swiglu_limit=shape.swiglu_limit))
    runtimes.append(rt)
    paths.append(engine_path(mesh, rt, shape, cap, engine_inputs, per_rank_w1q))
  # JAX-native paths: bf16 copies of the dequantised MX-fp8 data (exact), weights as [E, H, 2I]
  x_deq = reference.dequantize(*reference.quantize(jnp.asarray(host.x))).astype(jnp.bfloat16)
  w1_deq = jnp.swapaxes(reference.dequantize(*w1q), 1, 2).astype(jnp.bfloat16)
  native_inputs = (put(x_deq), put(host.ids))
  native_w = put(w1_deq.reshape(R, EL, H, 2 * I))
  capacity = max(1, math.ceil(args.capacity_factor * T * K / E))
  paths.append(native_path(mesh, f"native:a2a+einsum(cf={args.capacity_factor:g})", shape, T,
                           capacity, capacity_gemm, native_inputs, native_w))
  paths.append(native_path(mesh, "native:a2a+ragged_dot", shape, T, None, ragged_gemm,
                           native_inputs, native_w))
  return paths


def bench_config(args, mesh, shape: jsm.MoEShape, T: int, engines: Sequence[str],
                 ceilings: dict, rng: np.random.Generator) -> list:
  """Checks every path on fresh inputs, then times them; returns one result row per path."""
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
  ref_args = jax.device_put((host.x, host.ids, host.weights, w1q), jax.devices()[0])
  (ref, h32), _ = first_call(jax.jit(functools.partial(ref_fn, return_f32=True)), *ref_args)
  ref, h32 = to_host(ref), np.asarray(h32)
  rows_total = int(ref.num_rows.sum())
  progress(f"{tag} reference: {rows_total} rows over {R} ranks, M_cap {cap}")

  rows, runtimes = [], []
  try:
    checked = []
    for path in build_paths(args, mesh, shape, T, cap, host, w1q, engines, runtimes):
      progress(f"{tag} {path.name}: checking")
      try:
        checked.append(check_path(path, ref, h32))
      except CheckError as e:
        raise CheckError(f"{tag} {e}") from None
    engines_checked = [c for c in checked if c.path.kind == "engine"]
    for c in engines_checked[1:]:
      if c.h.tobytes() != engines_checked[0].h.tobytes():
        raise CheckError(f"{tag} {c.path.name} and {engines_checked[0].path.name} give different "
                         "h bytes (DESIGN §3: engines sharing a GEMM kernel are byte-identical)")
    for c in checked:
      progress(f"{tag} {c.path.name}: timing")
      row = time_path(c, args.iters, args.warmup)
      add_rates(row, rows_total - c.dropped, c.path.row_bytes, c.path.compute_dtype, shape,
                ceilings)
      rows.append(row)
  finally:
    for rt in runtimes:
      rt.close()

  progress(f"{tag} native:jnp-reference: timing")
  ref_jit = jax.jit(ref_fn)
  _, first_s = first_call(ref_jit, *ref_args)
  ref_row = {"path": "native:jnp-reference(1 dev)", "kind": "native", "dropped": 0,
             "capacity": None, "stages": {},
             "stage1": {**time_calls(ref_jit, ref_args, args.iters, args.warmup),
                        "first_call_s": first_s}}
  add_rates(ref_row, rows_total, None, "f32", shape, ceilings)
  rows.append(ref_row)

  best_native = min(r["stage1"]["median_ms"] for r in rows if r["kind"] == "native")
  for r in rows:
    r.update(shape=shape.name, tokens=T, ranks=R, m_cap=cap, rows_total=rows_total,
             vs_best_native=best_native / r["stage1"]["median_ms"])
  jax.clear_caches()
  return rows


# ------------------------------------------------------------------------------------------------
# Output


def format_table(rows: Sequence[dict], ceilings: dict) -> str:
  cols = [("shape", 6, "{}"), ("T", 5, "{}"), ("path", 28, "{}"), ("stage1 ms", 9, "{:.2f}"),
          ("rt+qpack", 8, "{:.2f}"), ("disp ms", 8, "{:.2f}"), ("GB/s", 6, "{:.2f}"),
          ("%bw", 5, "{:.0%}"), ("gemm1 ms", 8, "{:.2f}"), ("GFLOP/s", 7, "{:.1f}"),
          ("%mm", 5, "{:.0%}"), ("%ceil", 5, "{:.0%}"), ("vs nat", 6, "{:.2f}x"), ("drop", 5, "{}")]
  lines = ["  ".join(f"{name:>{w}}" if i > 2 else f"{name:<{w}}" for i, (name, w, _) in
                     enumerate(cols))]
  for r in rows:
    st, frac = r["stages"], r["ceiling_fraction"]

    def get(stage, field):  # the reference row has no stages
      return st[stage][field] if st else None

    vals = [r["shape"], r["tokens"], r["path"], r["stage1"]["median_ms"],
            get("route+qpack", "median_ms"), get("dispatch", "median_ms"), get("dispatch", "gbps"),
            frac.get("dispatch"), get("gemm1", "median_ms"), get("gemm1", "gflops"),
            frac.get("gemm1"), frac["stage1"], r["vs_best_native"], r["dropped"]]
    lines.append("  ".join(
        (fmt.format(v) if v is not None else "-").rjust(w) if i > 2 else f"{v:<{w}}"
        for i, ((_, w, fmt), v) in enumerate(zip(cols, vals))))
  for shape, T in sorted({(r["shape"], r["tokens"]) for r in rows}):
    lines.append(f"{shape:<6}  {T:<5}  {'native:ragged_a2a+ragged_dot':<28}  n/a on CPU "
                 "(XLA:CPU has no ragged_all_to_all)")
  mm = ceilings["matmul_gflops"]
  lines.append(f"ceilings: memcpy {ceilings['copy_gbps']:.1f} GB/s, matmul f32 {mm['f32']:.0f} / "
               f"bf16 {mm['bf16']:.0f} GFLOP/s ({ceilings['how']})")
  lines += [f"- {n}" for n in NOTES]
  return "\n".join(lines)


def write_plot(rows: Sequence[dict], path: Path) -> Optional[str]:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
  except ImportError:
    return "matplotlib is not importable: no plot written (pip install matplotlib)"
  shapes = sorted({r["shape"] for r in rows})
  fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
  for ax, shape in zip(axes[0], shapes):
    for name in dict.fromkeys(r["path"] for r in rows if r["shape"] == shape):
      pts = sorted((r["tokens"], r["stage1"]["median_ms"]) for r in rows
                   if r["shape"] == shape and r["path"] == name)
      ax.plot(*zip(*pts), marker="o", label=name, linestyle="-" if name.startswith("engine")
              else "--")
    ax.set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel="Stage1 ms (median)",
           title=f"{shape}, {rows[0]['ranks']} ranks")
    ax.set_xticks(sorted({r["tokens"] for r in rows if r["shape"] == shape}))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return None


def metadata(args, engines) -> dict:
  devices = jax.devices()
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
          "args": vars(args), "argv": sys.argv}


def main(args) -> None:
  shapes = [s for s in args.shapes.split(",") if s]
  unknown = [s for s in shapes if s not in jsm.SHAPES]
  if unknown:
    raise SystemExit(f"unknown shape(s) {unknown}; known: {sorted(jsm.SHAPES)}")
  tokens = [int(t) for t in args.tokens.split(",") if t]
  if args.gpu:
    raise SystemExit(GPU_NOT_YET)
  engines = [e for e in (args.engines or "cpu,xla").split(",") if e]
  if len(jax.devices()) < args.devices:
    raise SystemExit(f"{args.devices} devices requested, jax sees {len(jax.devices())}: set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={args.devices} before "
                     "jax is imported (running bench/run.py as a script does)")
  mesh = jax.make_mesh((args.devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:args.devices])
  progress("measuring ceilings")
  ceilings = measure_ceilings()
  rng = np.random.default_rng(args.seed)
  rows = []
  try:
    for name in shapes:
      for T in tokens:
        rows += bench_config(args, mesh, jsm.SHAPES[name], T, engines, ceilings, rng)
  except CheckError as e:
    raise SystemExit(f"CHECK FAILED (aborted before timing it; no results written): {e}")

  print(format_table(rows, ceilings))
  out_dir = Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = args.tag or "cpu"
  report = {"meta": metadata(args, engines), "ceilings": ceilings, "notes": list(NOTES),
            "results": rows}
  (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
  print(f"wrote {out_dir / f'{stem}.json'}")
  note = write_plot(rows, out_dir / f"{stem}.png")
  print(note or f"wrote {out_dir / f'{stem}.png'}")


if __name__ == "__main__":
  main(ARGS)
