"""A benchmark path: a full Stage1 function and the same work split in three stages, jitted over the
ranks. The engine paths (jsm.stage1 with one engine, and its stages from jax_sdma_moe.primitives)
are here, and with them every place the benchmark reads a Runtime's engine (rt.engine: its name,
device timeline and host statistics) or calls a primitive. The JAX-native baselines are in
bench/natives.py."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm
from jax_sdma_moe import layout, primitives

from bench.checks import check_engine
from bench.inputs import AXIS, rows_spec

STAGES = ("route+qpack", "dispatch", "gemm1")
TIMELINE_FIELDS = ("gemm_start_ms", "gemm_end_ms", "side_end_ms", "first_chunk_ms")
HOST_STAT_FIELDS = ("plan_us", "plan_stream_us", "enqueue_us", "copies", "single_copies")


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
  check: Callable[..., Any]    # check(out, ref, ranks) -> checks.Tally; raises CheckError
  capacity: Optional[int] = None  # rows per (source, expert) of a capacity-based path
  baseline: Optional[str] = None  # a JAX-native path: its --skip-native name
  runtime: Any = None             # an engine path's jsm.Runtime


def dispatch_row_bytes(H: int) -> int:
  """A landed row on the wire: fp8 values, scales, and the 12 bytes of token, slot and weight."""
  return H + H // layout.BLOCK + 12


def per_rank_jit(mesh, fn: Callable, expert_args: Sequence[int] = (1,)) -> Callable:
  """jit(shard_map(fn)) over every axis of the mesh, where every argument and result is stacked
  on axis 0 over the devices (inputs.rows_spec), except the arguments at `expert_args` (those
  there are: the expert weights), stacked over the ranks of AXIS alone."""
  def body(*args):
    out = fn(*jax.tree.map(lambda a: a[0], args))
    return jax.tree.map(lambda a: a[None], out)

  def jitted(*args):
    specs = tuple(P(AXIS) if i in expert_args else rows_spec(mesh) for i in range(len(args)))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=rows_spec(mesh))(*args)
  return jax.jit(jitted)


def engine_path(mesh, rt: jsm.Runtime, shape: jsm.MoEShape, cap: int, inputs, w1q,
                compute_dtype: str) -> BenchPath:
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

  ids = inputs[1]  # [R, T, K]: the tile jsm.stage1 picks for these rows per expert
  options = primitives.Gemm1Options(
      swiglu_limit=cfg.swiglu_limit, out_dtype=cfg.out_dtype,
      tile_tokens=layout.gemm_tile_tokens(ids.shape[1] * ids.shape[2] / EL, cfg.gemm_tile_tokens))

  def gemm1(landed, w):
    return primitives.gemm1(landed.values, landed.scales, landed.expert_offsets,
                            landed.expert_counts, w, options=options)

  H = shape.hidden
  return BenchPath(f"engine:{rt.engine.name}", "engine", per_rank_jit(mesh, stage1),
                   [per_rank_jit(mesh, f) for f in (route_qpack, dispatch, gemm1)], inputs, w1q,
                   dispatch_row_bytes(H), compute_dtype, check_engine, runtime=rt)


def engine_paths(args, mesh, shape: jsm.MoEShape, cap: int, inputs, w1q, engines: Sequence[str],
                 compute_dtype: str, closing: contextlib.ExitStack) -> list:
  """One path per engine of --engines (engine sm: one per --sm-blocks value); `closing` closes
  their Runtimes."""
  paths = []
  for engine in engines:
    for blocks in ([int(b) for b in args.sm_blocks.split(",")] if engine == "sm" else [None]):
      extra = {} if blocks is None else {"sm_dispatch_blocks": blocks}
      rt = jsm.Runtime(mesh, AXIS, jsm.Stage1Config(engine=engine, row_align=args.row_align,
                                                    swiglu_limit=shape.swiglu_limit,
                                                    gemm_tile_tokens=args.gemm_tile_tokens,
                                                    **extra))
      closing.callback(rt.close)
      path = engine_path(mesh, rt, shape, cap, inputs, w1q, compute_dtype)
      if blocks is not None and "," in args.sm_blocks:
        path.name += f"/{blocks}"
      paths.append(path)
  return paths


def engine_stats(rt: Optional[jsm.Runtime]) -> dict:
  """The result row's fields from the engine's own records of the path's calls so far (per rank,
  reduced to the slowest rank): timeline_ms, where a fused call's time goes on the device
  (engines ce, sm), and ce_host_us, the host's share of each call (engine ce). {} when the engine
  records nothing."""
  if rt is None:
    return {}
  row = {}
  timeline = rt.engine.timeline()
  if timeline:
    row["timeline_ms"] = {k: max((t[k] for t in timeline.values() if t[k] is not None),
                                 default=None) for k in TIMELINE_FIELDS}
  host = rt.engine.host_stats()
  if host:
    row["ce_host_us"] = {k: max(v[k] / max(v["calls"], 1) for v in host.values())
                         for k in HOST_STAT_FIELDS}
    row["ce_host_us"]["batch_error"] = next((v["batch_error"] for v in host.values()
                                             if v["batch_error"]), "")
  return row
