"""One (shape, tokens) configuration: its inputs, the reference, every path checked (all before any
timing), then timed; one result row per path.

host_config: CPU mode (R host devices, or one per process): inputs made on the host, every path
checked against the full reference.stage1, which is timed too (native:jnp-reference).
device_config: --gpu: inputs made on the devices, the sampled check, and XLA's dense bf16 matmul of
one rank's gemm1 FLOPs as this configuration's matmul ceiling; then gemm1's peers (gemm_peers.py)
on rank 0's rows per expert.
gemm1_config: --gemm1-rows: gemm1 alone on one device at given rows, checked, timed, and its
peers on the same rows per expert; with --rounds, then ours and each grouped peer alternately."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdma_moe as jsm
from jax_sdma_moe import layout, primitives, reference

from bench import gemm_peers, inputs
from bench.checks import Reference, check_gemm1, full_reference, sampled_reference
from bench.natives import NativeOut, native_paths
from bench.paths import STAGES, BenchPath, engine_paths, engine_stats
from bench.processes import (RUN_FAILURES, CheckError, all_processes, local_ranks, progress,
                             same_outcome, slowest, to_host)
from bench.timing import (add_rates, burst_seconds, dense_bf16_matmul, first_call, sustained,
                          time_calls)
from bench.trace import kernel_table

REFERENCE_PATH = "native:jnp-reference(1 dev)"


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


def timed_row(name: str, kind: str, baseline, dropped: int, capacity, fn, args: tuple,
              first_s: float, iters: int, warmup: int) -> dict:
  """A result row with the whole call timed (stage1); the stages are added by the caller."""
  return {"path": name, "kind": kind, "baseline": baseline, "dropped": dropped,
          "capacity": capacity, "stage1": {**time_calls(fn, args, iters, warmup),
                                           "first_call_s": slowest(first_s)}, "stages": {}}


def time_path(c: Checked, iters: int, warmup: int) -> dict:
  path = c.path
  row = timed_row(path.name, path.kind, path.baseline, c.dropped, path.capacity, path.full,
                  (path.inputs, path.w), c.first_call_s, iters, warmup)
  for name, stage, inp in zip(STAGES, path.stages, c.stage_inputs):
    row["stages"][name] = time_calls(stage, (inp, path.w), iters, warmup)
  row.update(engine_stats(path.runtime))
  return row


def trace_path(c: Checked, iters: int, tag: str) -> str:
  """--trace: the kernels per call of the full path and of each stage run alone (bench/trace.py)."""
  path = c.path
  tables = [kernel_table(path.full, (path.inputs, path.w), iters, f"{tag} {path.name} stage1")]
  for name, stage, inp in zip(STAGES, path.stages, c.stage_inputs):
    tables.append(kernel_table(stage, (inp, path.w), iters, f"{tag} {path.name} {name}"))
  return "\n".join(tables)


def failed_row(path: BenchPath, error: Exception) -> dict:
  """The row of a path that failed at run time: why, in a line."""
  return {"path": path.name, "kind": path.kind, "baseline": path.baseline,
          "capacity": path.capacity, **why_failed(error)}


def why_failed(error: Exception) -> dict:
  lines = str(error).strip().splitlines() or [type(error).__name__]
  return {"failed": lines[0][:100], "error": str(error)[:2000]}


def check_and_time(args, paths: Sequence[BenchPath], ref: Reference, shape: jsm.MoEShape,
                   T: int, ceilings: dict, tag: str) -> list:
  """Checks every path (all before any timing), then times those that passed; one row per path.
  A path that fails at run time gets a failed row; a wrong result raises CheckError."""
  N = ref.layout.num_rows.shape[0]  # devices: every group's ranks
  rows_total = int(np.sum(ref.layout.num_rows))
  rows, checked = [], []

  def failed(path, error):
    rows.append(failed_row(path, error))
    progress(f"{tag} {path.name}: FAILED: {rows[-1]['failed']}")

  for path in paths:
    progress(f"{tag} {path.name}: checking")
    try:
      checked.append(check_path(path, ref))
    except CheckError as e:
      raise CheckError(f"{tag} {e}") from None
    except RUN_FAILURES as e:
      failed(path, e)
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
      if args.trace:
        row["trace"] = trace_path(c, args.iters, tag)
        progress(row["trace"])
    except RUN_FAILURES as e:
      failed(c.path, e)
      continue
    add_rates(row, rows_total - c.dropped, N * T, c.path.row_bytes, c.path.compute_dtype, shape,
              ceilings)
    rows.append(row)
  return rows


def run_paths(args, skip: set, mesh, shape: jsm.MoEShape, T: int, cap: int, ref: Reference,
              engines: Sequence[str], engine_data: tuple, native_data: tuple, compute_dtype: str,
              ceilings: dict, tag: str) -> list:
  """The engine paths (inputs, w1q = engine_data) and the JAX-native ones (inputs, bf16 w =
  native_data), checked and timed; the engines' Runtimes closed after."""
  with contextlib.ExitStack() as closing:
    paths = engine_paths(args, mesh, shape, cap, *engine_data, engines, compute_dtype, closing)
    paths += native_paths(args, skip, mesh, shape, T, *native_data)
    return check_and_time(args, paths, ref, shape, T, ceilings, tag)


def finish_rows(rows: list, shape: jsm.MoEShape, T: int, R: int, cap: int, rows_total: int,
                **extra) -> list:
  """Tags a configuration's rows (R: the ranks of an EP group; rows_total: over every group) and
  sets each one's speed against the fastest JAX-native path."""
  jax.clear_caches()  # the next configuration compiles its own; the memory goes back
  natives = [r["stage1"]["median_ms"] for r in rows if r["kind"] == "native" and "failed" not in r]
  best_native = min(natives, default=None)
  for r in rows:
    r.update(shape=shape.name, tokens=T, ranks=R, m_cap=cap, rows_total=rows_total, **extra)
    r["vs_best_native"] = (best_native / r["stage1"]["median_ms"]
                           if best_native is not None and "failed" not in r else None)
  return rows


def host_config(args, skip: set, mesh, shape: jsm.MoEShape, T: int, engines: Sequence[str],
                ceilings: dict, rng: np.random.Generator) -> list:
  """R ranks of each EP group on host devices (N = R * groups): checks every path on fresh inputs
  against the full reference, then times them and the reference itself; returns one result row
  per path."""
  R, N = mesh.shape[inputs.AXIS], mesh.size
  E, K = shape.num_experts, shape.topk
  if E % R:
    raise SystemExit(f"shape {shape.name}: E = {E} is not a multiple of {R} ranks")
  cap = layout.m_cap(R, T, K, E // R, args.row_align)
  tag = f"[{shape.name} T={T}]"
  host = inputs.make_inputs(shape, N, T, rng)
  w1q = jsm.quantize_w1(jnp.asarray(host.w1))

  # the reference (one device): the check target, and a JAX-native baseline timed below
  ref_fn = inputs.per_group(functools.partial(reference.stage1, row_align=args.row_align, cap=cap,
                                              swiglu_limit=shape.swiglu_limit), R)
  ref_args = jax.device_put((host.x, host.ids, host.weights, w1q), jax.local_devices()[0])
  (ref, h32), _ = first_call(jax.jit(functools.partial(ref_fn, return_f32=True)), *ref_args)
  ref = full_reference(to_host(ref), np.asarray(h32))
  rows_total = int(ref.layout.num_rows.sum())
  progress(f"{tag} reference: {rows_total} rows over {R} ranks" +
           (f" in each of {N // R} EP groups" if N > R else "") + f", M_cap {cap}")

  engine_data, native_data = inputs.host_inputs_on_mesh(mesh, host, w1q)
  rows = run_paths(args, skip, mesh, shape, T, cap, ref, engines, engine_data, native_data, "f32",
                   ceilings, tag)

  progress(f"{tag} {REFERENCE_PATH}: timing")
  ref_jit = jax.jit(ref_fn)
  _, first_s = first_call(ref_jit, *ref_args)
  ref_row = timed_row(REFERENCE_PATH, "native", None, 0, None, ref_jit, ref_args, first_s,
                      args.iters, args.warmup)
  add_rates(ref_row, rows_total, N * T, None, "f32", shape, ceilings)
  return finish_rows(rows + [ref_row], shape, T, R, cap, rows_total)


def device_config(args, skip: set, mesh, shape: jsm.MoEShape, T: int, weights: tuple,
                  engines: Sequence[str], ceilings: dict, key, rng: np.random.Generator) -> list:
  """--gpu, the mesh's devices (of one process or one per process; R ranks of AXIS in each EP
  group): inputs made on the devices, the sampled check, XLA's dense bf16 matmul of one rank's
  gemm1 FLOPs as this configuration's matmul ceiling, then every path timed. weights:
  device_weights(shape)."""
  E, K, H, I = shape.num_experts, shape.topk, shape.hidden, shape.intermediate
  R = mesh.shape[inputs.AXIS]
  cap = layout.m_cap(R, T, K, E // R, args.row_align)
  tag = f"[{shape.name} T={T}]"
  k_inputs, k_dense = jax.random.split(key)
  engine_inputs, native_inputs = inputs.device_inputs(mesh, shape, T, k_inputs)
  w1q, w_native = weights
  ref, experts = sampled_reference(shape, args.row_align, cap, engine_inputs, w1q, rng)
  rows_total = int(ref.layout.num_rows.sum())
  progress(f"{tag} reference layout: {rows_total} rows, M_cap {cap}; h checked for experts "
           f"{experts}")

  progress(f"{tag} dense bf16 matmul [{T * K}, {H}] x [{H}, {2 * I}]: timing")
  dense = {"shape": shape.name, "tokens": T,
           **dense_bf16_matmul(T * K, H, 2 * I, args.iters, args.warmup, k_dense)}
  ceilings["dense_bf16"].append(dense)
  config_ceilings = {**ceilings, "matmul_gflops": {"bf16": dense["gflops"]},
                     "rate_devices": mesh.size}

  rows = run_paths(args, skip, mesh, shape, T, cap, ref, engines, (engine_inputs, w1q),
                   (native_inputs, w_native), "bf16", config_ceilings, tag)
  progress(f"{tag} gemm1 peers on rank 0's rows per expert")
  peers = measure_peers(args, mesh.devices.flat[0], shape, ref.layout.expert_counts[0], ceilings)
  return finish_rows(rows, shape, T, R, cap, rows_total, checked_experts=experts,
                     dense_bf16_gflops=dense["gflops"], gemm1_peers=peers)


def measure_peers(args, device, shape: jsm.MoEShape, counts, ceilings: dict,
                  sustain_s: float = 0.0) -> dict:
  """gemm1's peers on `counts` rows per local expert (gemm_peers.measure; sustain_s: also their
  steady state, as --sustain); in a multi-process run only the floor (each process would measure
  its own GPU)."""
  timing = gemm_peers.Timing(args.iters, args.warmup, sustain_s)
  skip, why = peer_skip(args)
  return gemm_peers.measure(peer_problem(shape, counts), device, ceilings["copy_gbps"], timing,
                            skip, args.seed, why)


def peer_problem(shape: jsm.MoEShape, counts) -> gemm_peers.Problem:
  return gemm_peers.Problem(shape.hidden, 2 * shape.intermediate, tuple(int(c) for c in counts))


def peer_skip(args) -> tuple:
  """(the peers not to run, why): --skip-peers; every peer in a multi-process run (each process
  would measure its own GPU)."""
  if jax.process_count() > 1:
    return gemm_peers.PEERS, "multi-process run (a GPU per process)"
  return gemm_peers.parse_skip(args.skip_peers), "--skip-peers"


def gemm1_config(args, device, shape: jsm.MoEShape, rows: int, experts: int, ceilings: dict,
                 key, rng: np.random.Generator) -> dict:
  """--gemm1-rows, on `device` (the default device): gemm1 alone (the call the gemm1 stage of
  engine local makes) on `rows` rows spread evenly over `experts` local experts, checked on a
  sample of experts against a float32 reference, timed, then its peers on the same rows per
  expert; one result row."""
  tag = f"[{shape.name} rows={rows} experts={experts}]"
  counts = inputs.balanced_counts(rows, experts)
  flops = 2 * rows * shape.hidden * 2 * shape.intermediate
  w1_std = args.w1_std or inputs.W1_SCALE
  row = {"path": "gemm1 alone", "kind": "gemm1", "shape": shape.name, "tokens": None,
         "rows_total": rows, "experts": experts, "gemm1_flops": flops, "w1_std": w1_std}
  progress(f"{tag} making inputs")
  landed, w1q = inputs.gemm1_inputs(shape, counts, args.row_align, key, w1_std)
  options = primitives.Gemm1Options(
      swiglu_limit=shape.swiglu_limit, out_dtype="bf16",
      tile_tokens=layout.gemm_tile_tokens(rows / experts, args.gemm_tile_tokens))
  row["tile_tokens"] = options.tile_tokens
  fn = jax.jit(lambda landed, w: primitives.gemm1(*landed, w, options=options))
  try:
    progress(f"{tag} gemm1: checking")
    h, first_s = first_call(fn, landed, w1q)
    row["checked_experts"] = check_gemm1(h, landed, w1q, shape.swiglu_limit, rng)
    del h
    progress(f"{tag} gemm1: timing")
    t = time_calls(fn, (landed, w1q), args.iters, args.warmup)
    row["gemm1"] = {**t, "first_call_s": first_s,
                    "tflops": flops / (t["pipelined_ms"] * 1e-3) / 1e12}
    if args.sustain > 0:
      progress(f"{tag} gemm1: {args.sustain} s back to back")
      row["gemm1"]["sustained"] = sustained(lambda: fn(landed, w1q), jax.block_until_ready,
                                            args.sustain, device.local_hardware_id)
  except RUN_FAILURES as e:
    row.update(why_failed(e))
    progress(f"{tag} gemm1: FAILED: {row['failed']}")
  progress(f"{tag} gemm1 peers")
  row["gemm1_peers"] = measure_peers(args, device, shape, counts, ceilings, args.sustain)
  if args.rounds and "gemm1" in row:
    progress(f"{tag} gemm1 and each grouped peer alternately, {args.rounds} rounds")
    skip, why = peer_skip(args)
    row["gemm1_rounds"] = gemm_peers.measure_rounds(
        peer_problem(shape, counts), device,
        lambda: burst_seconds(fn, (landed, w1q), args.iters, args.warmup) * 1e3, args.rounds,
        gemm_peers.Timing(args.iters, args.warmup), skip, args.seed, why)
  del landed, w1q
  jax.clear_caches()
  return row
