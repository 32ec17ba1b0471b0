"""Public entry points: stage1, stage2, moe, quantize, quantize_w1, quantize_w2 (DESIGN.md §2)."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
from jax import lax

from . import layout, primitives, reference
from .config import INT32_MAX
from .layout import BLOCK
from .engines.base import STAGE2_ON_GPUS_ISSUE, Engine
from .runtime import Runtime
from .types import (MXFP8, Landed, MoEStats, QuantizedW1, QuantizedW2, SendBuffer,
                    Stage1Output)

F8 = jnp.dtype(jnp.float8_e4m3fn)


def quantize(x: jax.Array, impl: str = "ffi") -> MXFP8:
  """MX-fp8 along the last axis (DESIGN.md §3). impl="ffi" runs the backend's kernel,
  impl="reference" the jnp reference; both give the same bytes."""
  x = jnp.asarray(x)
  if x.dtype not in (jnp.bfloat16, jnp.float32):
    raise TypeError(f"quantize: x must be bfloat16 or float32, got {x.dtype}")
  if x.ndim < 1 or x.shape[-1] % BLOCK:
    raise ValueError(f"quantize: last dimension must be a multiple of {BLOCK}, got {x.shape}")
  if impl == "reference":
    return reference.quantize(x)
  if impl != "ffi":
    raise ValueError(f"quantize: impl must be 'ffi' or 'reference', got {impl!r}")
  return primitives.quantize(x)


def quantize_w1(w1: jax.Array, impl: str = "ffi") -> QuantizedW1:
  """w1 [E, 2I, H] (gate rows then up rows) -> MX-fp8 weights along H."""
  w1 = jnp.asarray(w1)
  if w1.ndim != 3 or w1.shape[1] % 2:
    raise ValueError(f"quantize_w1: w1 must be [E, 2I, H], got shape {w1.shape}")
  return QuantizedW1(*quantize(w1, impl))


def quantize_w2(w2: jax.Array, impl: str = "ffi") -> QuantizedW2:
  """w2 [E, H, I] (the down projection) -> MX-fp8 weights along I: the same §3 quantisation as
  quantize_w1, along the reduction axis of GEMM2."""
  w2 = jnp.asarray(w2)
  if w2.ndim != 3:
    raise ValueError(f"quantize_w2: w2 must be [E, H, I], got shape {w2.shape}")
  return QuantizedW2(*quantize(w2, impl))


def _split_topk(topk) -> Tuple[jax.Array, Optional[jax.Array]]:
  if isinstance(topk, (tuple, list)):
    if len(topk) != 2:
      raise ValueError("stage1: topk must be ids or (ids, weights)")
    return topk[0], topk[1]
  return topk, None


def _check_inputs(x, ids, weights, w1q):
  if isinstance(x, MXFP8):
    if x.values.dtype != F8 or x.scales.dtype != jnp.uint8:
      raise TypeError("stage1: MX-fp8 x must be (float8_e4m3fn values, uint8 scales)")
    if x.values.ndim != 2 or x.scales.shape != (*x.values.shape[:-1], x.values.shape[-1] // BLOCK):
      raise ValueError(f"stage1: MX-fp8 x must be values [T, H], scales [T, H/32]; got "
                       f"{x.values.shape}, {x.scales.shape}")
    xshape = x.values.shape
  else:
    if not hasattr(x, "dtype") or x.dtype != jnp.bfloat16:
      raise TypeError(f"stage1: x must be bfloat16 [T, H] (or MXFP8), got "
                      f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim != 2:
      raise ValueError(f"stage1: x must be [T, H] per shard, got shape {x.shape}")
    xshape = x.shape
  T, H = xshape
  if H % BLOCK:
    raise ValueError(f"stage1: H = {H} must be a multiple of {BLOCK}")
  if not hasattr(ids, "dtype") or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"stage1: ids must be an integer array [T={T}, K] (int32; other integer "
                    f"dtypes are range-checked), got {getattr(ids, 'dtype', type(ids).__name__)}")
  if ids.ndim != 2 or ids.shape[0] != T:
    raise ValueError(f"stage1: ids must be integer [T={T}, K], got {ids.dtype}{list(ids.shape)}")
  if weights is not None and (weights.shape != ids.shape or
                              not jnp.issubdtype(weights.dtype, jnp.floating)):
    raise ValueError(f"stage1: weights must be float [T, K] = {list(ids.shape)}, got "
                     f"{weights.dtype}{list(weights.shape)}")
  if not isinstance(w1q, QuantizedW1):
    raise TypeError("stage1: w1q must be a QuantizedW1 (use jax_sdma_moe.quantize_w1)")
  if w1q.values.dtype != F8 or w1q.scales.dtype != jnp.uint8:
    raise TypeError("stage1: w1q must hold float8_e4m3fn values and uint8 scales")
  if w1q.values.ndim != 3 or w1q.values.shape[2] != H or w1q.values.shape[1] % 2:
    raise ValueError(f"stage1: w1q.values must be [E/R, 2I, H={H}] per shard, got "
                     f"{list(w1q.values.shape)}")
  EL, two_i, _ = w1q.values.shape
  if EL < 1:
    raise ValueError(f"stage1: w1q holds no experts on this rank ({list(w1q.values.shape)}): "
                     f"every rank of the EP axis needs E/R >= 1 experts")
  if w1q.scales.shape != (EL, two_i, H // BLOCK):
    raise ValueError(f"stage1: w1q.scales must be {[EL, two_i, H // BLOCK]}, got "
                     f"{list(w1q.scales.shape)}")
  if (two_i // 2) % BLOCK:
    raise ValueError(f"stage1: I = {two_i // 2} must be a multiple of {BLOCK}")
  return T, H, ids.shape[1], EL


def dispatch(send: SendBuffer, send_counts: jax.Array, *, runtime: Runtime, cap: int) -> Landed:
  """The dispatch stage alone with the Runtime's engine (inside shard_map): this rank's send
  buffer -> its landed rows. stage1 runs it fused with gemm1 where the engine does."""
  return runtime.engine.dispatch(send, send_counts, lax.axis_index(runtime.axis_name), cap=cap)


def call_bytes(R: int, T: int, H: int, I: int, K: int, cap: int, out_dtype: str,
               token_rows: bool = False) -> int:
  """Device bytes one stage1 call holds per rank at most: the send buffer (one row per send row,
  or with token_rows per token, and the headers), the landed rows with their headers, two parity
  slots of landing windows (engines with windows; engine xla's received rows take as much), and
  h."""
  row = layout.landing_row_bytes(H)
  h_row = I * 2 if out_dtype == "bf16" else I + I // BLOCK
  send = (T * (H + H // BLOCK) + T * K * (row - H - H // BLOCK) if token_rows
          else T * K * row)
  return send + cap * (3 * row + h_row)


def stage1(x: Union[jax.Array, MXFP8], topk, w1q: QuantizedW1, *, runtime: Runtime,
           check: bool = False) -> Stage1Output:
  """Expert-parallel MoE Stage1 of this rank, forward only (inference); call inside
  jax.shard_map over runtime.axis_name (the Runtime's mesh).

  Args:
    x: this rank's tokens, [T, H] bfloat16 (quantised here to MX-fp8), or an MXFP8 already
      quantised (jsm.quantize).
    topk: ids [T, K], or (ids, weights [T, K] float). ids are int32 (any integer dtype is
      accepted and range-checked): -1 means no route; an id in [0, E) is an expert; any other
      value is invalid — no row is made and it is counted in num_invalid. Repeated ids in a
      token's top-k each make a row. weights default to 1.
    w1q: this rank's experts, QuantizedW1 [E/R, 2I, H] (jsm.quantize_w1, then
      runtime.shard_w1).
    runtime: the jsm.Runtime made for this mesh axis (outside jit).
    check: fail at run time, on every rank, if any rank's rows did not fit M_cap (only possible
      with Stage1Config.max_recv_rows set: the default M_cap holds every row). The check is
      kept whichever outputs the caller uses.

  Returns:
    Stage1Output: h [M_cap, I] (bf16, or MXFP8 with out_dtype="mxfp8") in the landing layout,
    with its row headers, per-expert offsets and counts, and this rank's counts (num_rows,
    num_invalid, overflow: rows routed here that did not fit M_cap).

  Raises:
    TypeError, ValueError: at trace time, for inputs of the wrong dtype or shape, a closed or
    mismatched Runtime, sizes beyond the kernels' int32 indices, or buffers beyond the device's
    memory. At run time (XlaRuntimeError): RESOURCE_EXHAUSTED from check=True;
    DEADLINE_EXCEEDED when a peer does not arrive within Stage1Config.timeout_s;
    FAILED_PRECONDITION when the Runtime was closed after compilation. jax.grad / jax.jvp
    through it raise NotImplementedError: the layer has no derivative.
  """
  _check_runtime(runtime, "stage1")
  cfg, R, axis = runtime.config, runtime.num_ranks, runtime.axis_name
  ids, weights = _split_topk(topk)
  T, H, K, EL = _check_inputs(x, ids, weights, w1q)
  _check_axis(runtime, "stage1")
  cap = layout.m_cap(R, T, K, EL, cfg.row_align, cfg.max_recv_rows)
  _check_int32(what="stage1", send_rows=T * K, m_cap=cap, rows_to_one_rank=R * T * K)
  I = w1q.values.shape[1] // 2
  workspace = (layout.workspace_bytes(layout.gemm1_workspace(cap, H, I, EL))
               if runtime.platform == "cuda" else 0)  # (the CUDA gemm1's, DESIGN §5)
  # the engine's windows beyond their landing slots (ce, sm, sdma: the combine's return slots; ce
  # also its staging of the peers' rows, sdma its staged send rows: DESIGN §2, §6)
  windows = runtime.engine.window_bytes(H, EL, cap, layout.send_rows(T, K))
  token_rows = runtime.engine.send_token_rows(H, I)
  runtime.check_memory(f"T = {T} tokens of H = {H} with M_cap = {cap} landing rows",
                       call_bytes(R, T, H, I, K, cap, cfg.out_dtype, token_rows) + workspace +
                       windows)
  ids = layout.canonical_ids(ids, R * EL)
  weights = jnp.ones(ids.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
  rank = lax.axis_index(axis)

  route = primitives.route(ids, R, EL, runtime=runtime.serial)
  if isinstance(x, MXFP8):
    send = primitives.pack(x, weights, route.send_pos, token_rows=token_rows)
  else:
    send = primitives.qpack(x, weights, route.send_pos, token_rows=token_rows)
  axis_wide = check and runtime.engine.counts_overflow_axis_wide
  landed, h = runtime.engine.dispatch_gemm1(send, route.send_counts, rank, w1q, cap=cap,
                                            token_rows=token_rows, axis_overflow=axis_wide)
  out = Stage1Output(h, landed.expert_offsets, landed.expert_counts, landed.src_rank,
                     landed.src_token, landed.topk_slot, landed.topk_weight, landed.num_rows,
                     route.num_invalid, landed.overflow, route.send_pos)
  return _check_overflow(runtime, out, rank, cap, axis_wide) if check else out


def _check_overflow(runtime: Runtime, out: Stage1Output, rank: jax.Array, cap: int,
                    axis_wide: bool) -> Stage1Output:
  """stage1(check=True): the rows dropped over the whole axis, checked on every rank, with every
  array of `out` passing through the check (aliased, no copy) so that it runs whichever of them
  the caller uses. Every rank fails at the same point of the same program, so none is left
  waiting in a later exchange (stage2's combine, an XLA collective) for a rank that has left.
  Engines whose dispatch holds every rank's plan count the axis-wide drop there
  (counts_overflow_axis_wide); for the others stage1 gathers the ranks' counts. The checked
  count, out.overflow, is 0 whenever the call succeeds."""
  if axis_wide:
    dropped, first = out.overflow, jnp.int32(-1)
  else:
    each = lax.all_gather(out.overflow, runtime.axis_name)  # [R]
    dropped = jnp.sum(each).astype(jnp.int32)
    first = jnp.where(jnp.any(each > 0), jnp.argmax(each > 0), -1).astype(jnp.int32)
  leaves, tree = jax.tree.flatten(out._replace(overflow=None))
  checked, leaves = primitives.check_overflow(dropped, first, cap, leaves)
  return jax.tree.unflatten(tree, leaves)._replace(overflow=checked)


def _check_int32(what: str, **sizes: int) -> None:
  """The kernels index rows with int32: refuse a call whose sizes would not fit."""
  for name, n in sizes.items():
    if n > INT32_MAX:
      raise ValueError(f"{what}: {name} = {n} exceeds the kernels' int32 row indices "
                       f"(2**31 - 1); use fewer tokens per call or a smaller max_recv_rows")


def _check_runtime(runtime, what: str) -> None:
  if not isinstance(runtime, Runtime):
    raise TypeError(f"{what}: runtime= must be a jax_sdma_moe.Runtime")
  if runtime.closed:
    raise ValueError(f"{what}: the Runtime is closed ({runtime!r}); make a new one")


def _check_axis(runtime: Runtime, what: str) -> None:
  """Raises ValueError unless called inside shard_map over the Runtime's axis, of its size, and
  manual over every other axis of its mesh longer than one."""
  R, axis = runtime.num_ranks, runtime.axis_name
  try:
    axis_size = lax.axis_size(axis)
  except NameError:
    try:  # the axes in scope, for the message only
      from jax._src import core
      axes = tuple(core.unsafe_get_axis_names())
    except Exception:  # pragma: no cover - a jax without it: the message names ours alone
      axes = None
    seen = (f"the axes in scope are {axes}" if axes else "no named axis is in scope (not inside "
            "jax.shard_map?)")
    raise ValueError(f"{what}: the Runtime is for mesh axis {axis!r}, but {seen}; call it inside "
                     f"jax.shard_map over the Runtime's mesh, or make the Runtime with "
                     f"axis_name= the shard_map's EP axis") from None
  if axis_size != R:
    raise ValueError(f"{what}: axis {axis!r} has {axis_size} ranks but the Runtime has {R}")
  # the other axes of the mesh (its EP groups, DESIGN.md §2) must be manual too: a shard_map
  # manual over the EP axis only (axis_names={axis}) leaves them to XLA's partitioner, which
  # would run one group's exchange on devices of several
  for other, n in runtime.group_axes:
    if n == 1:
      continue
    try:
      size = lax.axis_size(other)
    except NameError:
      raise ValueError(f"{what}: the Runtime's mesh {dict(runtime.mesh.shape)} has axis "
                       f"{other!r} beside the EP axis {axis!r}, but the shard_map is not manual "
                       f"over it; shard_map over every axis of the mesh (leave axis_names out, "
                       f"or name them all)") from None
    if size != n:
      raise ValueError(f"{what}: axis {other!r} has {size} devices but the Runtime's mesh has {n}")


def _check_w2(w2q, EL: int, I: int, what: str, H: Optional[int] = None) -> int:
  """w2q must be this rank's QuantizedW2 [EL, H, I] of the layer's sizes (H: any, if None).
  Returns H."""
  if not isinstance(w2q, QuantizedW2):
    raise TypeError(f"{what}: w2q must be a QuantizedW2 (use jax_sdma_moe.quantize_w2)")
  if w2q.values.dtype != F8 or w2q.scales.dtype != jnp.uint8:
    raise TypeError(f"{what}: w2q must hold float8_e4m3fn values and uint8 scales")
  shape = w2q.values.shape
  if H is None and len(shape) == 3:
    H = shape[1]
  if shape != (EL, H, I) or w2q.scales.shape != (EL, H, I // BLOCK):
    raise ValueError(f"{what}: w2q must be values [E/R={EL}, H={H}, I={I}] and scales "
                     f"[{EL}, {H}, {I // BLOCK}] per shard, got {list(shape)}, "
                     f"{list(w2q.scales.shape)}")
  return H


def _check_stage1_output(out1) -> Tuple[int, int, int, int, int]:
  """(M_cap, I, EL, T, K) of a Stage1Output; TypeError/ValueError if it is not one jsm.stage1
  made."""
  if not isinstance(out1, Stage1Output):
    raise TypeError(f"stage2: out1 must be the Stage1Output of jsm.stage1, got "
                    f"{type(out1).__name__}")
  if out1.send_pos is None or out1.send_pos.ndim != 2:
    raise ValueError("stage2: out1.send_pos must be this rank's [T, K] send positions (a "
                     "Stage1Output made by jsm.stage1 inside the same shard_map)")
  h = out1.h
  if isinstance(h, MXFP8):
    if h.values.dtype != F8 or h.scales.dtype != jnp.uint8 or h.values.ndim != 2 or (
        h.scales.shape != (h.values.shape[0], h.values.shape[1] // BLOCK)):
      raise ValueError("stage2: an MX-fp8 out1.h must be values [M_cap, I] float8_e4m3fn and "
                       "scales [M_cap, I/32] uint8")
    shape = h.values.shape
  else:
    if getattr(h, "dtype", None) != jnp.bfloat16 or h.ndim != 2:
      raise ValueError(f"stage2: out1.h must be bf16 [M_cap, I] or MXFP8, got "
                       f"{getattr(h, 'dtype', type(h).__name__)}{list(getattr(h, 'shape', []))}")
    shape = h.shape
  M, I = shape
  if getattr(out1.expert_offsets, "ndim", None) != 1 or out1.expert_offsets.shape[0] < 1:
    raise ValueError(f"stage2: out1.expert_offsets must be [E/R >= 1] int32, got "
                     f"{list(getattr(out1.expert_offsets, 'shape', []))}")
  EL = out1.expert_offsets.shape[0]
  want = {"expert_offsets": ((EL,), jnp.int32), "expert_counts": ((EL,), jnp.int32),
          "src_rank": ((M,), jnp.int32), "src_token": ((M,), jnp.int32),
          "topk_slot": ((M,), jnp.int32), "topk_weight": ((M,), jnp.float32),
          "send_pos": (tuple(out1.send_pos.shape), jnp.int32)}
  for f, (shp, dtype) in want.items():
    a = getattr(out1, f)
    if getattr(a, "shape", None) != shp or getattr(a, "dtype", None) != dtype:
      raise ValueError(f"stage2: out1.{f} must be {jnp.dtype(dtype).name}{list(shp)} (M_cap = "
                       f"{M} rows like out1.h, E/R = {EL} experts), got "
                       f"{getattr(a, 'dtype', type(a).__name__)}{list(getattr(a, 'shape', []))}")
  return M, I, EL, *out1.send_pos.shape


def stage2_bytes(M: int, T: int, K: int, H: int, I: int) -> int:
  """Device bytes one stage2 call holds per rank at most: q(h), GEMM2's rows, the return rows
  (two parity slots of windows for engine cpu; engine xla's chunks take as much) and y."""
  row = 2 * H + 12
  return M * I * (BLOCK + 1) // BLOCK + M * 2 * H + 3 * T * K * row + T * 2 * H


def stage2(out1: Stage1Output, w2q: QuantizedW2, *, runtime: Runtime) -> jax.Array:
  """Expert-parallel MoE Stage2 of this rank, forward only (inference); call inside
  jax.shard_map over runtime.axis_name, on the Stage1Output of jsm.stage1 (by a Runtime of the
  same axis) in the same shard_map.

  GEMM2 of every landed row (q(h) along I, or Stage1's MX-fp8 bytes, times its expert's w2), then
  the combine: each row back to its source rank, weighted by its top-k weight and summed per token
  in float32.

  Args:
    out1: this rank's Stage1Output. Its layout (expert offsets and counts, row headers) is
      checked before anything indexes with it: a modified one fails with an error naming the
      field. Engine ce returns rows by the plan of its latest dispatch of that geometry, and
      fails on any other Stage1Output whose rows differ.
    w2q: this rank's experts, QuantizedW2 [E/R, H, I] (jsm.quantize_w2, then runtime.shard_w2).
    runtime: the Runtime stage1 ran with.

  Returns:
    y [T, H] bf16 of this rank's tokens; a token with no routed row gets exact zeros.

  Raises:
    TypeError, ValueError: at trace time (as stage1). At run time (XlaRuntimeError):
    INVALID_ARGUMENT for a modified Stage1Output; DEADLINE_EXCEEDED when a peer does not return
    its rows within timeout_s; FAILED_PRECONDITION for a Runtime closed after compilation.
  """
  _check_runtime(runtime, "stage2")
  M, I, EL, T, K = _check_stage1_output(out1)
  H = _check_w2(w2q, EL, I, "stage2")
  if H % BLOCK:
    raise ValueError(f"stage2: H = {H} must be a multiple of {BLOCK}")
  _check_axis(runtime, "stage2")
  _check_stage2_built(runtime)
  workspace = (layout.workspace_bytes(layout.gemm2_workspace(M, H, I, EL) +
                                      layout.combine_workspace(T, K))
               if runtime.platform == "cuda" else 0)  # (CUDA gemm2's and combine's, DESIGN §5)
  runtime.check_memory(f"stage2 of T = {T} tokens of H = {H} from M_cap = {M} landing rows",
                       stage2_bytes(M, T, K, H, I) + workspace)
  out1 = _check_layout(runtime, out1, T, K)
  return combine(gemm2_rows(out1, w2q, runtime=runtime), out1, runtime=runtime)


def _check_layout(runtime: Runtime, out1: Stage1Output, T: int, K: int) -> Stage1Output:
  """out1's layout checked before GEMM2 and the combine index with it (a modified Stage1Output
  fails naming the field, never reads out of bounds); the checked offsets and counts replace
  out1's, so the check runs first. Engine xla exchanges through XLA collectives, where a rank
  that failed alone would leave its peers in the exchange (XLA aborts the process there): every
  rank first gathers every rank's verdict, and all stop together where any output is bad."""
  R, M = runtime.num_ranks, out1.src_rank.shape[0]
  offsets, counts = out1.expert_offsets, out1.expert_counts
  if runtime.engine.exchanges_through_xla:
    bad = lax.all_gather(~layout.layout_is_valid(
        offsets, counts, out1.src_rank, out1.src_token, out1.topk_slot, num_ranks=R,
        num_tokens=T, topk=K), runtime.axis_name)
    first = jnp.where(jnp.any(bad), jnp.argmax(bad), -1).astype(jnp.int32)
    _, (offsets, counts) = primitives.check_overflow(jnp.sum(bad).astype(jnp.int32), first, M,
                                                     (offsets, counts), what="peer_layout")
  offsets, counts = primitives.check_layout(offsets, counts, out1.src_rank, out1.src_token,
                                            out1.topk_slot, num_ranks=R, num_tokens=T, topk=K)
  return out1._replace(expert_offsets=offsets, expert_counts=counts)


def gemm2_rows(out1: Stage1Output, w2q: QuantizedW2, *, runtime: Runtime) -> jax.Array:
  """Stage2's GEMM alone (inside shard_map; stage2 runs it after its checks): GEMM2 of every
  landed row of out1 -> rows [M_cap, H] bf16 in out1's §4 layout, what combine takes."""
  # q(h) along I (§3 Stage2) as its own call on every platform: the same bytes as the CPU gemm2's
  # own quantisation of bf16 rows, and the CUDA gemm2 takes MX-fp8 rows only
  h = out1.h if isinstance(out1.h, MXFP8) else primitives.quantize(out1.h)
  T, K = out1.send_pos.shape
  EL = out1.expert_offsets.shape[0]
  return primitives.gemm2(h, out1.expert_offsets, out1.expert_counts, w2q,
                          tile_tokens=layout.gemm_tile_tokens(T * K / EL,
                                                              runtime.config.gemm_tile_tokens))


def combine(rows: jax.Array, out1: Stage1Output, *, runtime: Runtime) -> jax.Array:
  """Stage2's way back alone with the Runtime's engine (inside shard_map; stage2 runs it after its
  checks): rows [M_cap, H] bf16 of gemm2_rows -> y [T, H] bf16 of this rank's tokens."""
  T, K = out1.send_pos.shape
  return runtime.engine.combine(rows, out1, lax.axis_index(runtime.axis_name), num_tokens=T,
                                topk=K)


def _check_stage2_built(runtime: Runtime) -> None:
  """Raises NotImplementedError (at trace time) where Stage2 is not built: the Runtime's engine
  has no combine, or this build has no gemm2/combine kernels for the platform."""
  engine = runtime.engine
  if type(engine).combine is Engine.combine:
    raise engine.combine_not_built()
  missing = sorted({"gemm2", "combine"} - primitives.built_stages(runtime.platform))
  if missing and not runtime.lowering_only:  # a lowered-only program never runs here
    raise NotImplementedError(
        f"stage2: this build of jax_sdma_moe has no {runtime.platform} kernels for "
        f"{', '.join(missing)} ({STAGE2_ON_GPUS_ISSUE}; built on cpu)")


def moe(x: Union[jax.Array, MXFP8], topk, w1q: QuantizedW1, w2q: QuantizedW2, *,
        runtime: Runtime, check: bool = False, return_stats: bool = False):
  """The whole expert-parallel MoE layer of this rank, forward only (inference):
  stage2(stage1(x, topk, w1q), w2q) in one call inside jax.shard_map over runtime.axis_name.

  Args:
    x, topk, w1q, runtime, check: as jsm.stage1.
    w2q: this rank's experts of the down projection, QuantizedW2 [E/R, H, I] (quantize_w2, then
      runtime.shard_w2), checked against x and w1q.
    return_stats: also return this rank's MoEStats (rows landed, invalid ids, overflow, rows per
      local expert) as device arrays, with no host synchronisation.

  Returns:
    y [T, H] bf16: y[t] = sum over the valid slots k of weights[t, k] * expert(ids[t, k])(x[t]),
    in float32, rounded once (a token with no valid slot gets zeros); or (y, MoEStats) with
    return_stats.

  Raises:
    TypeError, ValueError: at trace time, for inputs or a Runtime that cannot work (as stage1).
    At run time (XlaRuntimeError): with check=True, RESOURCE_EXHAUSTED on every rank if any
    rank's rows did not fit M_cap; a peer's wait running past timeout_s (DEADLINE_EXCEEDED,
    naming rank and peer); FAILED_PRECONDITION if the Runtime was closed since compilation.
    jax.grad / jax.jvp through it raise: the layer has no derivative.
  """
  _check_runtime(runtime, "moe")
  ids, weights = _split_topk(topk)
  _, H, _, EL = _check_inputs(x, ids, weights, w1q)
  _check_w2(w2q, EL, w1q.values.shape[1] // 2, "moe", H)
  out1 = stage1(x, topk, w1q, runtime=runtime, check=check)
  y = stage2(out1, w2q, runtime=runtime)
  if return_stats:
    return y, MoEStats(out1.num_rows, out1.num_invalid, out1.overflow, out1.expert_counts)
  return y
