"""The whole MoE layer (`python bench/run.py --layer`, issue 16): jsm.moe with each engine and the
JAX-native capacity layer, each checked against a float32 reference, then timed, in the same run.

  engine:<name>      jsm.moe (Stage1 + Stage2) in a jitted shard_map, dropless.
  native:layer(cf=)  the JAX-native layer: rows bucketed per (destination, expert) into C =
                     ceil(cf * T*K/E) rows per (source, expert) (bench/natives.native_pack), sent
                     in bf16 with all_to_all, einsum GEMM1 + SwiGLU, h rounded to bf16 and to its
                     MX-fp8 values along I (Stage2's arithmetic, DESIGN.md §3), einsum GEMM2, the
                     rows back with all_to_all, each token's weighted sum over its slots in
                     float32; rows past C are dropped and their slots add nothing.
Both compute on the same values: the native paths get bf16 copies of the dequantised MX-fp8 x and
weights (exact). The check: per rank, on a sample of tokens, relative norm <= 1e-2 and max error
<= 3e-2 * max |ref| against reference tokens computed expert by expert in float32 (the native
path's dropped slots masked out); tokens with no slot exactly 0; the engines' y byte-identical.
One rank per device: CPU devices (--devices, 8), or with --gpu the devices of --platform (--mesh,
e.g. dp=2,ep=4: the ranks of "ep" in each of the other axes' groups, T tokens per device); in a
multi-process launch (mpirun, or --coordinator/--num-processes/--process-id) every process's
devices, each process holding the same host inputs (one seed) and checking the whole y.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_sdma_moe as jsm
from jax_sdma_moe import primitives, reference

from bench import inputs
from bench.inputs import AXIS
from bench.natives import native_exchange, native_pack
from bench.paths import dispatch_row_bytes, per_rank_jit
from bench.processes import RUN_FAILURES, CheckError, global_to_host, progress, same_outcome
from bench.report import metadata
from bench.tables import render_table
from bench.timing import first_call, time_calls
from bench.trace import kernel_table

REL_TOL, MAX_TOL = 1e-2, 3e-2  # DESIGN.md §3, Stage2: per rank against the float32 reference
SAMPLE_TOKENS = 32             # tokens per rank checked against the reference
NOTES = (
    "layer ms: median wall time of one jsm.moe call (Stage1 + Stage2) of the whole SPMD program "
    "until block_until_ready (the max over ranks); pipe ms: --iters calls enqueued back to back "
    "/ iters; vs nat = native:layer ms / this path's ms (>1: faster than JAX-native).",
    "native:layer: capacity C = ceil(cf * T*K/E) rows per (source, expert), bf16 all_to_all, "
    "einsum GEMM1 + SwiGLU, h to its MX-fp8 values, einsum GEMM2, all_to_all back, weighted sum; "
    "rows past C are dropped ('drop') and their slots add nothing.",
    "checked before timing: y of a sample of tokens per rank within DESIGN §3 (Stage2) of a "
    "float32 reference computed expert by expert; the engines' y byte-identical.",
    "disp ms / comb ms: an engine's dispatch alone (jsm.api.dispatch of this call's send buffer) "
    "and combine alone (jsm.api.combine of this call's GEMM2 rows), median per call; comb/disp "
    "per B: the combine's time per wire byte over the dispatch's (both move every routed row "
    "once: a landed row H + H/32 + 12 bytes, a returned row 2H + 8).",
)


def combine_row_bytes(H: int) -> int:
  """A returned row on the wire: bf16 values, its stamp and weight."""
  return 2 * H + 8


def gemm2_operand(h32: jax.Array, stage1_out: str) -> jax.Array:
  """float32 h -> the values GEMM2 multiplies (DESIGN §3, Stage2): q(bf16 h) where Stage1 emits
  bf16; where it emits MX-fp8, its quantisation of the float32 h (where rounding to bf16 first
  moves a value across an e4m3 rounding boundary the bytes differ by a step: against q(bf16 h),
  jsm.moe with MX-fp8 Stage1 measured 1.7e-2 relative in y on 2xH200, so each is held to its
  own)."""
  h = reference.finish_h(h32, stage1_out)
  return reference.dequantize(*(h if stage1_out == "mxfp8" else reference.quantize(h)))


def native_layer(inp, w, *, num_ranks: int, experts_per_rank: int, capacity: int,
                 swiglu_limit: Optional[float], stage1_out: str):
  """One rank of the JAX-native capacity layer: inp (x [T, H] bf16, ids, weights [T, K]), w (w1
  [EL, H, 2I], w2 [EL, I, H] bf16) -> (y [T, H] bf16, kept [T, K]: the slots that were computed).
  h goes to GEMM2 as the engines' Stage2 takes it (gemm2_operand)."""
  x, ids, weights = inp
  w1, w2 = w
  R, EL = num_ranks, experts_per_rank
  T, K = ids.shape
  packed = native_pack(x, ids, R, EL, capacity)                # rows [R, EL*C, H], headers
  rows, _, _ = native_exchange(packed)
  _, P, H = rows.shape
  C = P // EL

  def expert_major(a):  # [R, EL*C, ...] <-> [EL, R*C, ...]
    return jnp.swapaxes(a.reshape(R, EL, C, *a.shape[2:]), 0, 1).reshape(EL, R * C, *a.shape[2:])

  gu = jnp.einsum("emh,ehn->emn", expert_major(rows), w1, preferred_element_type=jnp.float32)
  I = gu.shape[-1] // 2
  h = gemm2_operand(reference.swiglu(gu[..., :I], gu[..., I:], swiglu_limit), stage1_out)
  h = h.astype(jnp.bfloat16)  # exact in bf16
  y_e = jnp.einsum("emi,eih->emh", h, w2, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  back = jnp.swapaxes(y_e.reshape(EL, R, C, H), 0, 1).reshape(R, P, H)  # source-major again
  returned = lax.all_to_all(back, AXIS, 0, 0).reshape(R * P, H)  # in the places this rank packed
  headers = packed[1].reshape(R * P, 3)
  tok, slot = headers[:, 0], headers[:, 1]
  at = jnp.where(tok >= 0, tok, T)
  weight = weights[jnp.clip(tok, 0, T - 1), jnp.clip(slot, 0, K - 1)]
  y = jnp.zeros((T, H), jnp.float32).at[at].add(
      returned.astype(jnp.float32) * weight[:, None], mode="drop")
  kept = jnp.zeros((T, K), bool).at[at, jnp.clip(slot, 0, K - 1)].set(True, mode="drop")
  return y.astype(jnp.bfloat16), kept


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "stage1_out"))
def token_reference(x, ids, weights, w1q: jsm.QuantizedW1, w2q: jsm.QuantizedW2, *,
                    swiglu_limit: Optional[float], stage1_out: str) -> jax.Array:
  """float32 y [N, H] of N tokens (x [N, H] bf16, ids/weights [N, K], global weights), computed
  one (token, slot) at a time through its expert: the layer's arithmetic of DESIGN.md §3 with h
  as Stage1 emits it (gemm2_operand); ids outside [0, E) add nothing."""
  N, K = ids.shape
  E = w1q.values.shape[0]
  xq = reference.dequantize(*reference.quantize(x))

  def one(args):
    xrow, e, weight = args
    ec = jnp.clip(e, 0, E - 1)
    gu = reference.dequantize(w1q.values[ec], w1q.scales[ec]) @ xrow
    I = gu.shape[0] // 2
    y = reference.dequantize(w2q.values[ec], w2q.scales[ec]) @ gemm2_operand(
        reference.swiglu(gu[:I], gu[I:], swiglu_limit), stage1_out)
    return jnp.where((e >= 0) & (e < E), weight, 0.0) * y

  terms = lax.map(one, (jnp.repeat(xq, K, axis=0), ids.reshape(-1), weights.reshape(-1)),
                  batch_size=8)
  return terms.reshape(N, K, -1).sum(1)


def check_y(name: str, y: np.ndarray, ref: np.ndarray, sample: np.ndarray) -> float:
  """y [R, T, H] of a path against ref [R, S, H] of the sampled tokens `sample` [R, S]; returns
  the worst rank's relative error."""
  worst = 0.0
  for r in range(y.shape[0]):
    got, want = y[r, sample[r]].astype(np.float32), ref[r]
    if np.isnan(got).any():
      raise CheckError(f"{name}: NaN in y of rank {r}")
    norm = np.linalg.norm(want)
    if norm == 0:
      if np.any(got != 0):
        raise CheckError(f"{name}: rank {r}: y must be 0 where the reference is")
      continue
    rel, max_abs = np.linalg.norm(got - want) / norm, np.max(np.abs(got - want))
    if rel > REL_TOL or max_abs > MAX_TOL * np.max(np.abs(want)):
      raise CheckError(f"{name}: rank {r}: relative error {rel:.2e} (limit {REL_TOL}), max "
                       f"|diff| {max_abs:.3e} (limit {MAX_TOL} * max |ref|)")
    zero = np.all(want == 0, axis=-1)
    if np.any(got[zero] != 0):
      raise CheckError(f"{name}: rank {r}: a token with no slot is not exactly 0")
    worst = max(worst, float(rel))
  return worst


def stage_times(args, mesh, rt: jsm.Runtime, shape: jsm.MoEShape, T: int, inp, w) -> dict:
  """An engine's dispatch alone and combine alone on the rows of this call's inputs (inp, w as
  the layer's), and the combine's time per wire byte over the dispatch's."""
  R = mesh.shape[AXIS]
  EL, K, H = shape.num_experts // R, shape.topk, shape.hidden
  cap = jsm.layout.m_cap(R, T, K, EL, rt.config.row_align, rt.config.max_recv_rows)

  def send(inp):
    x, ids, weights = inp
    route = primitives.route(ids, R, EL)
    return primitives.qpack(x, weights, route.send_pos), route.send_counts

  fn = {name: per_rank_jit(mesh, f, expert_args) for name, f, expert_args in (  # (w1q, w2q: 1)
      ("send", send, ()),
      ("dispatch", lambda carry: jsm.api.dispatch(*carry, runtime=rt, cap=cap), ()),
      ("stage1", lambda inp, w1q: jsm.stage1(inp[0], inp[1:], w1q, runtime=rt), (1,)),
      ("rows", lambda out1, w2q: jsm.api.gemm2_rows(out1, w2q, runtime=rt), (1,)),
      ("combine", lambda rows, out1: jsm.api.combine(rows, out1, runtime=rt), ()))}
  carry = fn["send"](inp)
  out1 = fn["stage1"](inp, w[0])
  rows = fn["rows"](out1, w[1])
  dispatch = time_calls(fn["dispatch"], (carry,), args.iters, args.warmup)["median_ms"]
  combine = time_calls(fn["combine"], (rows, out1), args.iters, args.warmup)["median_ms"]
  return {"dispatch_ms": dispatch, "combine_ms": combine,
          "combine_vs_dispatch_per_byte": (combine / combine_row_bytes(H)) /
                                          (dispatch / dispatch_row_bytes(H))}


def layer_paths(args, mesh, shape: jsm.MoEShape, T: int, host: inputs.HostInputs, w1q, w2q,
                engines: Sequence[str], skip: set, closing: contextlib.ExitStack) -> list:
  """(name, kind, jitted fn(inp, w), inp, w, Runtime or None) of jsm.moe per engine (`closing`
  closes their Runtimes) and of the JAX-native layer unless --skip-native names einsum."""
  R = mesh.shape[AXIS]
  E, K = shape.num_experts, shape.topk
  EL = E // R
  put = functools.partial(inputs.to_ranks, mesh=mesh, spec=inputs.rows_spec(mesh))  # tokens
  put_w = functools.partial(inputs.to_ranks, mesh=mesh)  # experts, over AXIS alone
  by_rank = lambda q: jax.tree.map(lambda a: a.reshape(R, EL, *a.shape[1:]), q)  # on the host
  per_rank = lambda q: jax.tree.map(put_w, by_rank(q))
  ids, weights = put(host.ids), put(host.weights)
  paths = []
  for engine in engines:
    rt = jsm.Runtime(mesh, AXIS, jsm.Stage1Config(engine=engine, row_align=args.row_align,
                                                  swiglu_limit=shape.swiglu_limit,
                                                  gemm_tile_tokens=args.gemm_tile_tokens,
                                                  out_dtype=args.stage1_out))
    closing.callback(rt.close)
    fn = per_rank_jit(mesh, lambda inp, w, rt=rt: jsm.moe(inp[0], inp[1:], *w, runtime=rt))
    paths.append((f"engine:{engine}", "engine", fn, (put(host.x), ids, weights),
                  (per_rank(w1q), per_rank(w2q)), rt))
  if "einsum" not in skip:
    capacity = max(1, math.ceil(args.capacity_factor * T * K / E))
    fn = per_rank_jit(mesh, functools.partial(
        native_layer, num_ranks=R, experts_per_rank=EL, capacity=capacity,
        swiglu_limit=shape.swiglu_limit, stage1_out=args.stage1_out))
    paths.append((f"native:layer(cf={args.capacity_factor:g})", "native", fn,
                  (put(inputs.native_x(jnp.asarray(host.x))), ids, weights),
                  (put_w(inputs.native_w1(by_rank(w1q))), put_w(inputs.native_w1(by_rank(w2q)))),
                  None))
  return paths


def layer_config(args, mesh, shape: jsm.MoEShape, T: int, engines: Sequence[str], skip: set,
                 rng: np.random.Generator, traces: list) -> list:
  """One (shape, tokens): inputs (T tokens on each device of the mesh), the paths, each checked,
  then each timed; a row per path. --trace: each path's kernel table (bench/trace.py) appended to
  `traces`."""
  R, N = mesh.shape[AXIS], mesh.size
  E, H = shape.num_experts, shape.hidden
  if E % R:
    raise SystemExit(f"shape {shape.name}: E = {E} is not a multiple of {R} ranks")
  tag = f"[{shape.name} T={T}]"
  x, ids, weights = inputs.make_tokens(shape, N, T, rng)
  host = inputs.HostInputs(x, ids, weights, None)  # (the weights are made on the device)
  w1q, w2q = inputs.default_device_weights(shape, jax.random.key(int(rng.integers(2**31))))
  sample = np.stack([np.sort(rng.choice(T, min(T, SAMPLE_TOKENS), replace=False))
                     for _ in range(N)]) if T else np.zeros((N, 0), int)

  def ref_for(ids_used) -> np.ndarray:  # the sampled tokens' float32 y [N, S, H]
    take = lambda a: np.take_along_axis(np.asarray(a), sample[..., None], 1).reshape(
        -1, *np.shape(a)[2:])
    y = token_reference(jnp.asarray(take(host.x)), jnp.asarray(take(ids_used)),
                        jnp.asarray(take(host.weights)), w1q, w2q,
                        swiglu_limit=shape.swiglu_limit, stage1_out=args.stage1_out)
    return np.asarray(y).reshape(N, sample.shape[1], H)

  engine_ref = ref_for(host.ids)
  rows, engine_y = [], {}
  with contextlib.ExitStack() as closing:
    for name, kind, fn, inp, w, rt in layer_paths(args, mesh, shape, T, host, w1q, w2q,
                                                  engines, skip, closing):
      progress(f"{tag} {name}: checking")
      row = {"shape": shape.name, "tokens": T, "ranks": R, "path": name, "kind": kind}
      try:
        out, first_s = first_call(fn, inp, w)
      except (NotImplementedError, *RUN_FAILURES) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:100]
        rows.append({**row, "failed": why})
        progress(f"{tag} {name}: FAILED: {why}")
        continue
      with same_outcome():  # a failed check on one process fails every process
        if kind == "native":
          y, kept = global_to_host(out)
          row["dropped"] = int(np.sum((host.ids >= 0) & (host.ids < E)) - kept.sum())
          row["max_rel_err"] = check_y(name, y, ref_for(np.where(kept, host.ids, -1)), sample)
        else:
          y = engine_y[name] = global_to_host(out)
          row["dropped"] = 0
          row["max_rel_err"] = check_y(name, y, engine_ref, sample)
      progress(f"{tag} {name}: timing")
      row.update(time_calls(fn, (inp, w), args.iters, args.warmup), first_call_s=first_s)
      if rt is not None:
        progress(f"{tag} {name}: dispatch alone, combine alone")
        row.update(stage_times(args, mesh, rt, shape, T, inp, w))
      if args.trace:
        traces.append(kernel_table(fn, (inp, w), args.iters, f"{tag} {name}"))
        progress(traces[-1])
      rows.append(row)
  names = list(engine_y)
  for name in names[1:]:
    if engine_y[name].tobytes() != engine_y[names[0]].tobytes():
      raise CheckError(f"{tag} {name} and {names[0]} give different y bytes (DESIGN §3: the "
                       "engines are byte-identical)")
  native_ms = next((r["median_ms"] for r in rows if r["kind"] == "native" and "failed" not in r),
                   None)
  for r in rows:
    r["vs_native"] = native_ms / r["median_ms"] if native_ms and "median_ms" in r else None
  jax.clear_caches()
  return rows


def format_layer_table(rows: Sequence[dict]) -> str:
  cols = [("shape", 6, "{}"), ("T", 5, "{}"), ("path", 22, "{}"), ("layer ms", 9, "{:.3f}"),
          ("p90 ms", 8, "{:.3f}"), ("pipe ms", 8, "{:.3f}"), ("vs nat", 7, "{:.2f}x"),
          ("drop", 6, "{}"), ("max rel err", 11, "{:.1e}"), ("disp ms", 8, "{:.3f}"),
          ("comb ms", 8, "{:.3f}"), ("comb/disp per B", 15, "{:.2f}")]
  table = [[r["shape"], r["tokens"], r["path"], *(
      [f"failed: {r['failed']}"] + [None] * 8 if "failed" in r else
      [r["median_ms"], r["p90_ms"], r["pipelined_ms"], r["vs_native"], r["dropped"],
       r["max_rel_err"], r.get("dispatch_ms"), r.get("combine_ms"),
       r.get("combine_vs_dispatch_per_byte")])] for r in rows]
  return "\n".join(render_table(cols, table, left=3) + [f"- {n}" for n in NOTES])


def layer_main(args, skip: set, shapes: Sequence[str], tokens: Sequence[int],
               engines: Sequence[str], launch: str, mesh) -> list:
  """--layer: every (shape, tokens) on the mesh's devices (of this process, or of every process
  in a multi-process launch; bench/run.py layer_mesh); process 0 prints the table and writes
  <tag>.json under --out."""
  platform = args.platform if args.gpu else "cpu"
  devices = list(mesh.devices.flat)
  rng = np.random.default_rng(args.seed)
  out = Path(args.out) / f"{args.tag or 'layer-' + platform}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  meta = metadata(args, engines, devices, launch)
  rows, writes, traces = [], jax.process_index() == 0, []
  trace_out = out.with_name(out.stem + "-trace.txt")
  with jax.default_device(jax.local_devices(backend=platform)[0]):
    for name in shapes:
      for T in tokens:
        rows += layer_config(args, mesh, jsm.SHAPES[name], T, engines, skip, rng, traces)
        if writes and traces:
          trace_out.write_text("\n\n".join(traces) + "\n")
        if writes:
          out.write_text(json.dumps({"meta": meta, "notes": list(NOTES), "results": rows},
                                    indent=1) + "\n")
  if writes:
    print(format_layer_table(rows))
    print(f"wrote {out}")
  return rows
