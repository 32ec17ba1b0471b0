"""One JAX primitive per Stage1 custom call (DESIGN.md §5): abstract evaluation, and lowering to
the FFI target of the same stage through jax.ffi.ffi_lowering on every platform that has it.

Static sizes travel as primitive parameters; only the ones a handler reads become FFI attributes
(NumPy scalars, identical on every shard). The rank is an operand.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from .layout import BLOCK
from .types import MXFP8, Landed, Route, SendBuffer

F8 = jnp.float8_e4m3fn
TARGET_PREFIX = "jsm_"
STAGES = ("quantize", "route", "qpack", "pack", "dispatch", "gemm1", "check_overflow",
          "dispatch_gemm1", "dispatch_graph", "dispatch_gemm1_graph", "qpack_local")
# calls XLA must neither drop nor merge
SIDE_EFFECTS = frozenset({"dispatch", "check_overflow", "dispatch_gemm1", "dispatch_graph",
                          "dispatch_gemm1_graph"})


@functools.cache
def _extension():
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
  ext = _extension()
  platforms = {"cpu"}
  for stage, capsule in ext.cpu_targets().items():
    jax.ffi.register_ffi_target(TARGET_PREFIX + stage, capsule, platform="cpu")
  if ext.has_cuda():
    for stage, capsule in ext.cuda_targets().items():
      jax.ffi.register_ffi_target(TARGET_PREFIX + stage, capsule, platform="CUDA")
    platforms.add("cuda")
  return frozenset(platforms)


def _aval(shape, dtype):
  return jax.core.ShapedArray(tuple(int(s) for s in shape), dtype)


def _make(stage: str, abstract_eval, attrs: Sequence[str] = ()):
  prim = Primitive(TARGET_PREFIX + stage)
  prim.multiple_results = True
  prim.def_abstract_eval(abstract_eval)
  # eager calls run the primitive as a one-op jit
  prim.def_impl(lambda *args, **params: jax.jit(functools.partial(prim.bind, **params))(*args))
  rule = jax.ffi.ffi_lowering(TARGET_PREFIX + stage, has_side_effect=stage in SIDE_EFFECTS)

  def lowering(ctx, *args, **params):
    return rule(ctx, *args, **{k: params[k] for k in attrs})

  for platform in ("cpu", "cuda"):
    mlir.register_lowering(prim, lowering, platform=platform)
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

_route_p = _make("route", lambda ids, *, num_ranks, experts_per_rank: (
    _aval((num_ranks, experts_per_rank), jnp.int32), _aval(ids.shape, jnp.int32),
    _aval((), jnp.int32)))


def route(ids: jax.Array, num_ranks: int, experts_per_rank: int) -> Route:
  return Route(*_bind(_route_p, ids, num_ranks=int(num_ranks),
                      experts_per_rank=int(experts_per_rank)))


# --- qpack / pack ----------------------------------------------------------------------------


def _send_avals(send_pos, H):
  S = send_pos.shape[0] * send_pos.shape[1]
  return (_aval((S, H), F8), _aval((S, H // BLOCK), jnp.uint8), _aval((S,), jnp.int32),
          _aval((S,), jnp.int32), _aval((S,), jnp.float32))


_qpack_p = _make("qpack", lambda x, weights, send_pos: _send_avals(send_pos, x.shape[-1]))
_pack_p = _make("pack", lambda values, scales, weights, send_pos: _send_avals(
    send_pos, values.shape[-1]))


def qpack(x: jax.Array, weights: jax.Array, send_pos: jax.Array) -> SendBuffer:
  return SendBuffer(*_bind(_qpack_p, x, weights, send_pos))


def pack(x: MXFP8, weights: jax.Array, send_pos: jax.Array) -> SendBuffer:
  return SendBuffer(*_bind(_pack_p, x.values, x.scales, weights, send_pos))


# --- dispatch --------------------------------------------------------------------------------

_DISPATCH_ATTRS = ("runtime_id", "row_align", "timeout_s", "fault_absent_rank",
                   "fault_delay_rank", "fault_delay_ms")


def _dispatch_abstract(values, scales, token, slot, weight, send_counts, rank, *, cap, **_):
  EL, H = send_counts.shape[1], values.shape[-1]
  return (_aval((cap, H), F8), _aval((cap, H // BLOCK), jnp.uint8),
          *[_aval((cap,), jnp.int32)] * 3, _aval((cap,), jnp.float32),
          _aval((EL,), jnp.int32), _aval((EL,), jnp.int32), _aval((), jnp.int32),
          _aval((), jnp.int32))


_dispatch_p = _make("dispatch", _dispatch_abstract, _DISPATCH_ATTRS)
# engine sm (CUDA): the same handler, declared safe for XLA's command buffers (CUDA graphs)
_dispatch_graph_p = _make("dispatch_graph", _dispatch_abstract, _DISPATCH_ATTRS)


def dispatch(send: SendBuffer, send_counts: jax.Array, rank: jax.Array, *, runtime_id: int,
             cap: int, row_align: int, timeout_s: float, fault_absent_rank: int = -1,
             fault_delay_rank: int = -1, fault_delay_ms: int = 0, graph: bool = False) -> Landed:
  """graph: the command-buffer-compatible target (engine sm only)."""
  return Landed(*_bind(
      _dispatch_graph_p if graph else _dispatch_p, *send, send_counts, rank.astype(jnp.int32), cap=int(cap),
      runtime_id=np.int64(runtime_id), row_align=np.int64(row_align),
      timeout_s=np.float64(timeout_s), fault_absent_rank=np.int64(fault_absent_rank),
      fault_delay_rank=np.int64(fault_delay_rank), fault_delay_ms=np.int64(fault_delay_ms)))


# --- gemm1 -----------------------------------------------------------------------------------


def _gemm1_abstract(values, scales, offsets, counts, w_values, w_scales, *, out_mxfp8, **_):
  M, I = values.shape[0], w_values.shape[1] // 2
  if out_mxfp8:
    return _aval((M, I), F8), _aval((M, I // BLOCK), jnp.uint8)
  return (_aval((M, I), jnp.bfloat16),)


_gemm1_p = _make("gemm1", _gemm1_abstract, ("has_limit", "swiglu_limit"))


def gemm1(landed_values: jax.Array, landed_scales: jax.Array, expert_offsets: jax.Array,
          expert_counts: jax.Array, w1, *, swiglu_limit: Optional[float], out_dtype: str):
  outs = _bind(_gemm1_p, landed_values, landed_scales, expert_offsets, expert_counts, w1.values,
               w1.scales, out_mxfp8=out_dtype == "mxfp8",
               has_limit=np.bool_(swiglu_limit is not None),
               swiglu_limit=np.float32(swiglu_limit or 0.0))
  return MXFP8(*outs) if out_dtype == "mxfp8" else outs[0]


# --- qpack_local (engine local on CUDA: qpack + dispatch, rows stored at their landing rows) --


def _qpack_local_abstract(x, weights, send_pos, send_counts, *, cap, **_):
  H = x.shape[-1]
  return _dispatch_abstract(_aval((1, H), F8), None, None, None, None, send_counts, None, cap=cap)


_qpack_local_p = _make("qpack_local", _qpack_local_abstract, ("row_align",))


def qpack_local(x: jax.Array, weights: jax.Array, send_pos: jax.Array, send_counts: jax.Array, *,
                cap: int, row_align: int) -> Landed:
  """R = 1 (CUDA): each row quantised once and stored straight at its landing row."""
  return Landed(*_bind(_qpack_local_p, x, weights, send_pos, send_counts, cap=int(cap),
                       row_align=np.int64(row_align)))


# --- dispatch_gemm1 (engines ce, sm: the GEMM starts each expert as its rows land) ----------


def _dispatch_gemm1_abstract(values, scales, token, slot, weight, send_counts, rank, w_values,
                             w_scales, *, cap, out_mxfp8, **_):
  EL, I = send_counts.shape[1], w_values.shape[1] // 2
  h = ((_aval((cap, I), F8), _aval((cap, I // BLOCK), jnp.uint8)) if out_mxfp8
       else (_aval((cap, I), jnp.bfloat16),))
  return (*[_aval((cap,), jnp.int32)] * 3, _aval((cap,), jnp.float32), _aval((EL,), jnp.int32),
          _aval((EL,), jnp.int32), _aval((), jnp.int32), _aval((), jnp.int32), *h)


_dispatch_gemm1_p = _make("dispatch_gemm1", _dispatch_gemm1_abstract,
                          _DISPATCH_ATTRS + ("has_limit", "swiglu_limit"))
_dispatch_gemm1_graph_p = _make("dispatch_gemm1_graph", _dispatch_gemm1_abstract,
                                _DISPATCH_ATTRS + ("has_limit", "swiglu_limit"))


def dispatch_gemm1(send: SendBuffer, send_counts: jax.Array, rank: jax.Array, w1, *,
                   runtime_id: int, cap: int, row_align: int, timeout_s: float,
                   swiglu_limit: Optional[float], out_dtype: str, fault_absent_rank: int = -1,
                   fault_delay_rank: int = -1, fault_delay_ms: int = 0, graph: bool = False):
  """dispatch and gemm1 as one call (CUDA engines ce, sm): (Landed without the rows, h). graph:
  the command-buffer-compatible target (engine sm only)."""
  outs = _bind(
      _dispatch_gemm1_graph_p if graph else _dispatch_gemm1_p, *send, send_counts, rank.astype(jnp.int32), w1.values, w1.scales,
      cap=int(cap), out_mxfp8=out_dtype == "mxfp8", runtime_id=np.int64(runtime_id),
      row_align=np.int64(row_align), timeout_s=np.float64(timeout_s),
      fault_absent_rank=np.int64(fault_absent_rank), fault_delay_rank=np.int64(fault_delay_rank),
      fault_delay_ms=np.int64(fault_delay_ms), has_limit=np.bool_(swiglu_limit is not None),
      swiglu_limit=np.float32(swiglu_limit or 0.0))
  src_rank, token, slot, weight, offsets, counts, num_rows, overflow = outs[:8]
  landed = Landed(None, None, src_rank, token, slot, weight, offsets, counts, num_rows, overflow)
  h = MXFP8(*outs[8:]) if out_dtype == "mxfp8" else outs[8]
  return landed, h


# --- check_overflow (stage1(check=True)) -----------------------------------------------------

_check_overflow_p = _make("check_overflow", lambda overflow, rank, *, cap: (
    _aval((), jnp.int32),), ("cap",))


def check_overflow(overflow: jax.Array, rank: jax.Array, cap: int) -> jax.Array:
  """Passes `overflow` through; the call fails at run time, naming the rank, if it is > 0."""
  return _bind(_check_overflow_p, overflow, rank.astype(jnp.int32), cap=np.int64(cap))[0]
