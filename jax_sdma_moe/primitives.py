"""One JAX primitive per custom call of Stage1 and Stage2 (docs/DESIGN.md §5): abstract evaluation, and lowering
to the FFI target of the same stage through jax.ffi.ffi_lowering on every platform that has it.

Static sizes travel as primitive parameters. The options a handler reads travel as one struct per
concern (`DispatchOptions`, `Gemm1Options`), lowered to one XLA FFI dictionary attribute each and
decoded by the handlers into the C++ struct of the same name (kernels/common/options.h). The rank
is an operand.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from .layout import (BLOCK, GEMM_TILE_TOKENS, combine_workspace, gemm1_workspace,
                     gemm2_workspace)
from .types import MXFP8, Landed, Route, SendBuffer

F8 = jnp.float8_e4m3fn
TARGET_PREFIX = "jsm_"
# calls XLA must neither drop nor merge
SIDE_EFFECTS = frozenset({"dispatch", "check_overflow", "dispatch_gemm1", "combine"})
# stages with a second target, the same handler registered as safe for XLA's command buffers
# (CUDA graphs); the primitive's `graph` parameter picks it at lowering
GRAPH_TARGET = "_graph"
# the platforms every primitive lowers for (to the same target names; registered_platforms says
# which of them this build has handlers for)
LOWERING_PLATFORMS = ("cpu", "cuda", "rocm")


@functools.cache
def extension():
  """The compiled module (_jsm_ffi): FFI handler capsules and the window registries."""
  try:
    from . import _jsm_ffi
  except ImportError as e:  # pragma: no cover - an install problem, not a runtime path
    raise ImportError(
        "jax_sdma_moe's compiled extension _jsm_ffi is missing; install the package with "
        "`pip install .` (it builds the C++/CUDA handlers)") from e
  return _jsm_ffi


@functools.cache
def registered_platforms() -> frozenset:
  """Registers every FFI target once (after the backends exist) and names the platforms."""
  jax.devices()  # FFI types must be registered after the backend is created
  ext = extension()
  platforms = {"cpu"}
  for stage, capsule in ext.cpu_targets().items():
    jax.ffi.register_ffi_target(TARGET_PREFIX + stage, capsule, platform="cpu")
  if ext.has_cuda():
    for stage, capsule in ext.cuda_targets().items():
      jax.ffi.register_ffi_target(TARGET_PREFIX + stage, capsule, platform="CUDA")
    platforms.add("cuda")
  if ext.has_rocm():
    for stage, capsule in ext.rocm_targets().items():
      jax.ffi.register_ffi_target(TARGET_PREFIX + stage, capsule, platform="ROCM")
    platforms.add("rocm")
  return frozenset(platforms)


@functools.cache
def built_stages(platform: str) -> frozenset:
  """The custom calls this build has handlers for on `platform` ("cpu", "cuda", "rocm"), by stage
  name (`gemm2`, `combine`, ...): a stage missing here fails at compile time on that platform."""
  ext = extension()
  if platform == "cpu":
    return frozenset(ext.cpu_targets())
  if platform == "cuda" and ext.has_cuda():
    return frozenset(ext.cuda_targets())
  if platform == "rocm" and ext.has_rocm():
    return frozenset(ext.rocm_targets())
  return frozenset()


# --- options: one struct per concern, one FFI dictionary attribute each -----------------------


@dataclasses.dataclass(frozen=True)
class DispatchOptions:
  """What a dispatch handler reads (C++: jsm::DispatchOptions). engine: the engine's name;
  window_set: the Runtime's handle in the engine's window registry (0: none, engine local)."""
  engine: str
  window_set: int
  row_align: int
  timeout_s: float
  fault_absent_rank: int = -1
  fault_delay_rank: int = -1
  fault_delay_ms: int = 0
  runtime: int = 0               # the Runtime's liveness-registry entry (0: not checked)
  global_overflow: bool = False  # engines ce, sm: `overflow` counts the rows dropped axis-wide

  def ffi_attr(self) -> dict:
    ids = extension().ENGINE_IDS
    if self.engine not in ids:
      raise ValueError(f"engine {self.engine!r} has no dispatch custom call (those: {sorted(ids)})")
    return {"engine": np.int64(ids[self.engine]), "window_set": np.int64(self.window_set),
            "row_align": np.int64(self.row_align), "timeout_s": np.float64(self.timeout_s),
            "fault_absent_rank": np.int64(self.fault_absent_rank),
            "fault_delay_rank": np.int64(self.fault_delay_rank),
            "fault_delay_ms": np.int64(self.fault_delay_ms), "runtime": np.int64(self.runtime),
            "global_overflow": np.bool_(self.global_overflow)}


@dataclasses.dataclass(frozen=True)
class Gemm1Options:
  """What a gemm1 handler reads (C++: jsm::Gemm1Options): the SwiGLU clamp, the output, and the
  CUDA bf16 kernel's tile width (layout.GEMM_TILE_TOKENS; the other kernels ignore it)."""
  swiglu_limit: Optional[float] = None
  out_dtype: str = "bf16"
  tile_tokens: int = GEMM_TILE_TOKENS[0]

  def ffi_attr(self) -> dict:
    return {"has_limit": np.bool_(self.swiglu_limit is not None),
            "swiglu_limit": np.float32(self.swiglu_limit or 0.0),
            "tile_tokens": np.int64(self.tile_tokens)}


def _aval(shape, dtype):
  return jax.core.ShapedArray(tuple(int(s) for s in shape), dtype)


def _forward_only(name, primals, tangents, **params):
  """Every primitive's JVP rule: the layer is forward-only (inference), and says so."""
  raise NotImplementedError(
      f"jax_sdma_moe is forward-only (inference): {name} has no derivative, so jax.grad, "
      f"jax.jvp and jax.vjp cannot differentiate through jsm.stage1, stage2, moe or quantize. "
      f"Keep the layer out of the differentiated path (jax.lax.stop_gradient on its inputs), or "
      f"train with a differentiable MoE")


def _make(stage: str, abstract_eval, attrs=lambda params: {}, graph_target: bool = False,
          gpu_workspace=None, workspace_platforms=("cuda",), aliases=lambda params: None):
  """The primitive of one stage. attrs(params) -> the FFI attributes of a lowering.
  gpu_workspace(*avals_in, **params) -> ((shape, dtype), ...): results the GPU handler writes as
  scratch after the primitive's own, allocated by XLA and dropped at lowering, on the platforms
  of workspace_platforms. aliases(params) -> {operand: result} buffers shared (or None)."""
  prim = Primitive(TARGET_PREFIX + stage)
  prim.multiple_results = True
  prim.def_abstract_eval(abstract_eval)
  # eager calls run the primitive as a one-op jit
  prim.def_impl(lambda *args, **params: jax.jit(functools.partial(prim.bind, **params))(*args))
  ad.primitive_jvps[prim] = functools.partial(_forward_only, prim.name)
  side_effect = stage in SIDE_EFFECTS
  targets = {False: TARGET_PREFIX + stage}
  if graph_target:
    targets[True] = TARGET_PREFIX + stage + GRAPH_TARGET

  def lowering(ctx, *args, **params):
    rule = jax.ffi.ffi_lowering(targets[bool(params.get("graph", False))],
                                has_side_effect=side_effect,
                                operand_output_aliases=aliases(params))
    return rule(ctx, *args, **attrs(params))

  def workspace_lowering(ctx, *args, **params):
    extra = tuple(_aval(shape, dtype) for shape, dtype in gpu_workspace(*ctx.avals_in, **params))
    ctx_ws = ctx.replace(avals_out=(*ctx.avals_out, *extra))
    return lowering(ctx_ws, *args, **params)[:len(ctx.avals_out)]

  for platform in LOWERING_PLATFORMS:
    rule = workspace_lowering if gpu_workspace and platform in workspace_platforms else lowering
    mlir.register_lowering(prim, rule, platform=platform)
  return prim


def _bind(prim, *args, **params):
  registered_platforms()
  return prim.bind(*args, **params)


# --- quantize --------------------------------------------------------------------------------

_quantize_p = _make("quantize", lambda x: (
    _aval(x.shape, F8), _aval((*x.shape[:-1], x.shape[-1] // BLOCK), jnp.uint8)))


def quantize(x: jax.Array) -> MXFP8:
  return MXFP8(*_bind(_quantize_p, x))


# --- route -----------------------------------------------------------------------------------

_route_p = _make("route", lambda ids, *, num_ranks, experts_per_rank, runtime: (
    _aval((num_ranks, experts_per_rank), jnp.int32), _aval(ids.shape, jnp.int32),
    _aval((), jnp.int32)), lambda p: {"runtime": np.int64(p["runtime"])})


def route(ids: jax.Array, num_ranks: int, experts_per_rank: int, *, runtime: int = 0) -> Route:
  """runtime: the Runtime's serial in the liveness registry (a closed one fails the call); 0: no
  Runtime (not checked)."""
  return Route(*_bind(_route_p, ids, num_ranks=int(num_ranks),
                      experts_per_rank=int(experts_per_rank), runtime=int(runtime)))


# --- qpack / pack ----------------------------------------------------------------------------


def _send_avals(send_pos, H, token_rows):
  T, S = send_pos.shape[0], send_pos.shape[0] * send_pos.shape[1]
  rows = T if token_rows else S
  return (_aval((rows, H), F8), _aval((rows, H // BLOCK), jnp.uint8), _aval((S,), jnp.int32),
          _aval((S,), jnp.int32), _aval((S,), jnp.float32))


def _token_rows_attr(params):
  return {"token_rows": np.bool_(params["token_rows"])}


_qpack_p = _make("qpack", lambda x, weights, send_pos, *, token_rows: _send_avals(
    send_pos, x.shape[-1], token_rows), _token_rows_attr)
_pack_p = _make("pack", lambda values, scales, weights, send_pos, *, token_rows: _send_avals(
    send_pos, values.shape[-1], token_rows), _token_rows_attr)


def qpack(x: jax.Array, weights: jax.Array, send_pos: jax.Array, *,
          token_rows: bool = False) -> SendBuffer:
  """x quantised into the send buffer: its rows at their send positions, or with token_rows one
  row per token (engine local's fused call: DESIGN.md §5), the headers at the send positions."""
  return SendBuffer(*_bind(_qpack_p, x, weights, send_pos, token_rows=bool(token_rows)))


def pack(x: MXFP8, weights: jax.Array, send_pos: jax.Array, *,
         token_rows: bool = False) -> SendBuffer:
  """qpack of an x already quantised."""
  return SendBuffer(*_bind(_pack_p, x.values, x.scales, weights, send_pos,
                           token_rows=bool(token_rows)))


# --- dispatch --------------------------------------------------------------------------------


def _layout_avals(cap, EL):
  """src_rank, token, slot, weight, expert_offsets, expert_counts, num_rows, overflow."""
  return (*[_aval((cap,), jnp.int32)] * 3, _aval((cap,), jnp.float32), _aval((EL,), jnp.int32),
          _aval((EL,), jnp.int32), _aval((), jnp.int32), _aval((), jnp.int32))


def _dispatch_abstract(values, scales, token, slot, weight, send_counts, rank, *, cap, **_):
  H = values.shape[-1]
  return (_aval((cap, H), F8), _aval((cap, H // BLOCK), jnp.uint8),
          *_layout_avals(cap, send_counts.shape[1]))


_dispatch_p = _make("dispatch", _dispatch_abstract,
                    lambda p: {"dispatch": p["options"].ffi_attr()}, graph_target=True)


def dispatch(send: SendBuffer, send_counts: jax.Array, rank: jax.Array, *, cap: int,
             options: DispatchOptions, graph: bool = False) -> Landed:
  """graph: lower to the command-buffer-compatible target (engines whose calls have no host
  step)."""
  return Landed(*_bind(_dispatch_p, *send, send_counts, rank.astype(jnp.int32), cap=int(cap),
                       options=options, graph=bool(graph)))


# --- gemm1 -----------------------------------------------------------------------------------


def _h_avals(M, I, out_dtype):
  if out_dtype == "mxfp8":
    return _aval((M, I), F8), _aval((M, I // BLOCK), jnp.uint8)
  return (_aval((M, I), jnp.bfloat16),)


def _gemm1_abstract(values, scales, offsets, counts, w_values, w_scales, *, options):
  return _h_avals(values.shape[0], w_values.shape[1] // 2, options.out_dtype)


_gemm1_p = _make("gemm1", _gemm1_abstract, lambda p: {"gemm1": p["options"].ffi_attr()},
                 gpu_workspace=lambda values, scales, offsets, counts, w_values, w_scales, **_:
                 gemm1_workspace(values.shape[0], values.shape[1], w_values.shape[1] // 2,
                                 w_values.shape[0]))


def _h(outs, options: Gemm1Options):
  return MXFP8(*outs) if options.out_dtype == "mxfp8" else outs[0]


def gemm1(landed_values: jax.Array, landed_scales: jax.Array, expert_offsets: jax.Array,
          expert_counts: jax.Array, w1, *, options: Gemm1Options):
  return _h(_bind(_gemm1_p, landed_values, landed_scales, expert_offsets, expert_counts,
                  w1.values, w1.scales, options=options), options)


# --- dispatch_gemm1 (engines ce, sm, sdma: the GEMM starts each expert as its rows land) ----


def _dispatch_gemm1_abstract(values, scales, token, slot, weight, send_counts, rank, w_values,
                             w_scales, *, cap, gemm1_options, **_):
  return (*_layout_avals(cap, send_counts.shape[1]),
          *_h_avals(cap, w_values.shape[1] // 2, gemm1_options.out_dtype))


_dispatch_gemm1_p = _make(
    "dispatch_gemm1", _dispatch_gemm1_abstract,
    lambda p: {"dispatch": p["options"].ffi_attr(), "gemm1": p["gemm1_options"].ffi_attr(),
               **_token_rows_attr(p)},
    graph_target=True,
    gpu_workspace=lambda values, scales, token, slot, weight, send_counts, rank, w_values,
    w_scales, *, cap, **_: gemm1_workspace(cap, values.shape[1], w_values.shape[1] // 2,
                                           w_values.shape[0]))


def dispatch_gemm1(send: SendBuffer, send_counts: jax.Array, rank: jax.Array, w1, *, cap: int,
                   options: DispatchOptions, gemm1_options: Gemm1Options, graph: bool = False,
                   token_rows: bool = False):
  """dispatch and gemm1 as one call: (Landed without the rows, h). token_rows: the send buffer
  holds one row per token (qpack token_rows; engine local's call, the others' send rows)."""
  outs = _bind(_dispatch_gemm1_p, *send, send_counts, rank.astype(jnp.int32), w1.values,
               w1.scales, cap=int(cap), options=options, gemm1_options=gemm1_options,
               graph=bool(graph), token_rows=bool(token_rows))
  landed = Landed(None, None, *outs[:8])
  return landed, _h(outs[8:], gemm1_options)


# --- gemm2 (Stage2) --------------------------------------------------------------------------

_gemm2_p = _make(
    "gemm2", lambda h, offsets, counts, w_values, w_scales, *h_scales, tile_tokens: (
        _aval((h.shape[0], w_values.shape[1]), jnp.bfloat16),),
    lambda p: {"tile_tokens": np.int64(p["tile_tokens"])},
    gpu_workspace=lambda h, offsets, counts, w_values, w_scales, *h_scales, **_: gemm2_workspace(
        h.shape[0], w_values.shape[1], w_values.shape[2], w_values.shape[0]))


def gemm2(h, expert_offsets: jax.Array, expert_counts: jax.Array, w2, *,
          tile_tokens: int = GEMM_TILE_TOKENS[0]) -> jax.Array:
  """GEMM2 of the landed rows: h [M_cap, I] (bf16, quantised along I in the call — CPU only; the
  CUDA handler takes MXFP8 rows, see jsm.stage2 — or MXFP8), w2 QuantizedW2 [EL, H, I] ->
  [M_cap, H] bf16, padding rows 0. tile_tokens: the CUDA bf16 kernel's tile (as Gemm1Options)."""
  values, scales = (h.values, (h.scales,)) if isinstance(h, MXFP8) else (h, ())
  return _bind(_gemm2_p, values, expert_offsets, expert_counts, w2.values, w2.scales, *scales,
               tile_tokens=int(tile_tokens))[0]


# --- combine (Stage2) ------------------------------------------------------------------------

_combine_p = _make(
    "combine", lambda rows, src_rank, token, slot, weight, rank, *, num_tokens, topk, options: (
        _aval((num_tokens, rows.shape[1]), jnp.bfloat16),),
    lambda p: {"dispatch": p["options"].ffi_attr(), "topk": np.int64(p["topk"])},
    gpu_workspace=lambda *avals, num_tokens, topk, **_: combine_workspace(num_tokens, topk),
    workspace_platforms=("cuda", "rocm"))  # both GPU handlers: gpu_handlers.h CombineImpl


def combine(rows: jax.Array, src_rank: jax.Array, token: jax.Array, slot: jax.Array,
            weight: jax.Array, rank: jax.Array, *, num_tokens: int, topk: int,
            options: DispatchOptions) -> jax.Array:
  """Each row [M_cap, H] bf16 back to its source rank's token and slot (headers src_rank, token,
  slot, weight [M_cap]), weighted and summed there: y [num_tokens, H] bf16. options.engine: "cpu"
  (the return protocol through the Runtime's windows) or "local" (every row is this rank's)."""
  return _bind(_combine_p, rows, src_rank.astype(jnp.int32), token.astype(jnp.int32),
               slot.astype(jnp.int32), weight.astype(jnp.float32), rank.astype(jnp.int32),
               num_tokens=int(num_tokens), topk=int(topk), options=options)[0]


# --- check_overflow: an axis-wide check (stage1(check=True); stage2 on engine xla) ----------

# what the count of an axis-wide check counts (ffi/handler_util.h AxisCheck)
AXIS_CHECKS = {"overflow": 0, "peer_layout": 1}

_check_overflow_p = _make(
    "check_overflow", lambda count, rank, *guarded, cap, what, num_guarded: (
        _aval((), jnp.int32), *guarded),
    lambda p: {"cap": np.int64(p["cap"]), "what": np.int64(AXIS_CHECKS[p["what"]])},
    aliases=lambda p: {2 + i: 1 + i for i in range(p["num_guarded"])})


def check_overflow(count: jax.Array, rank: jax.Array, cap: int, guarded=(),
                   what: str = "overflow"):
  """An axis-wide check: fails at run time if `count` is > 0 — what="overflow": the rows dropped
  over the whole axis (stage1(check=True)); what="peer_layout": the ranks whose Stage1Output fails
  its layout check (stage2, engine xla) — naming `rank` (one concerned; -1 if unknown). Every rank
  checks the same count, so all fail at the same point. Returns (count, guarded): the arrays of
  `guarded` pass through, their buffers aliased (no copy), so that whichever of them the caller
  uses, XLA runs the check first — a check tied to the count alone would be dropped with it where
  the caller does not use it."""
  guarded = tuple(guarded)
  outs = _bind(_check_overflow_p, count, rank.astype(jnp.int32), *guarded, cap=int(cap),
               what=what, num_guarded=len(guarded))
  return outs[0], tuple(outs[1:])


# --- check_layout (stage2: out1's layout checked before gemm2 and the combine index with it) ---


def check_layout_words(num_ranks: int, num_tokens: int, topk: int) -> int:
  """The GPU check's workspace, uint32 words (kernels/common/gpu_stage2.h check_layout_words):
  its header, then one bit per (src_rank, src_token, topk_slot)."""
  return 8 + (num_ranks * num_tokens * topk + 31) // 32


_check_layout_p = _make(
    "check_layout", lambda offsets, counts, src_rank, token, slot, *, num_ranks, num_tokens, topk: (
        _aval(offsets.shape, jnp.int32), _aval(counts.shape, jnp.int32)),
    lambda p: {"num_ranks": np.int64(p["num_ranks"]), "num_tokens": np.int64(p["num_tokens"]),
               "topk": np.int64(p["topk"])},
    gpu_workspace=lambda *avals, num_ranks, num_tokens, topk: (
        ((check_layout_words(num_ranks, num_tokens, topk),), jnp.uint32),),
    workspace_platforms=("cuda", "rocm"))  # both GPU handlers: gpu_handlers.h CheckLayoutImpl


def check_layout(expert_offsets: jax.Array, expert_counts: jax.Array, src_rank: jax.Array,
                 src_token: jax.Array, topk_slot: jax.Array, *, num_ranks: int, num_tokens: int,
                 topk: int):
  """Checks a Stage1Output's §4 layout before Stage2 indexes with it: the call fails at run time
  (InvalidArgument naming the field, index and value: kernels/common/layout_check.h) where an
  expert's rows leave [0, M_cap), decrease or overlap the next's, or a row's src_rank is outside
  [-1, num_ranks), its src_token outside [0, num_tokens) or topk_slot outside [0, topk) (rows
  with src_rank >= 0), or two rows return to one (src_rank, src_token, topk_slot). Returns
  copies of (expert_offsets, expert_counts): feed them to gemm2 so that the check runs first."""
  offsets, counts = _bind(_check_layout_p, expert_offsets.astype(jnp.int32),
                          expert_counts.astype(jnp.int32), src_rank.astype(jnp.int32),
                          src_token.astype(jnp.int32), topk_slot.astype(jnp.int32),
                          num_ranks=int(num_ranks), num_tokens=int(num_tokens), topk=int(topk))
  return offsets, counts
