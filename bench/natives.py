"""The JAX-native baselines, on the same inputs as the engines (bf16 copies of the dequantised
MX-fp8 data, exact) and checked against the same reference:
  * native:a2a+einsum(cf=..): capacity-based. Rows sorted per (destination, expert) into
    fixed-size buffers of C = ceil(cf * T*K/E) rows per (source, expert), sent in bf16 with
    all_to_all, einsum per expert; rows past C are dropped.
  * native:a2a+ragged_dot: dropless. Fixed chunks of T*min(K, EL) rows per destination with
    all_to_all (XLA:CPU has no ragged_all_to_all; GPUs run the same code), then one lax.ragged_dot
    over the rows sorted by expert.
Each is a BenchPath whose three stages are pack (route + bf16 pack), exchange (all_to_all) and
gemm (GEMM1 + SwiGLU)."""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

import jax_sdma_moe as jsm
from jax_sdma_moe import reference

from bench.checks import check_native
from bench.inputs import AXIS
from bench.paths import BenchPath, per_rank_jit


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


def native_paths(args, skip: set, mesh, shape: jsm.MoEShape, T: int, inputs, w) -> list:
  """The JAX-native baselines not in `skip` (--skip-native): inputs (bf16 x, ids) and
  w [R, EL, H, 2I] bf16, both sharded."""
  paths = []
  if "einsum" not in skip:
    capacity = max(1, math.ceil(args.capacity_factor * T * shape.topk / shape.num_experts))
    paths.append(native_path(mesh, f"native:a2a+einsum(cf={args.capacity_factor:g})", "einsum",
                             shape, T, capacity, capacity_gemm, inputs, w))
  if "ragged" not in skip:
    paths.append(native_path(mesh, "native:a2a+ragged_dot", "ragged", shape, T, None, ragged_gemm,
                             inputs, w))
  return paths
