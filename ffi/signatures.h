// The argument, result and attribute lists of every custom call, shared by the platforms' handlers
// (they are fixed by the primitives' abstract evaluation in jax_sdma_moe/primitives.py). Each
// function extends a binding that already holds the platform's context (none on the CPU, the
// stream on CUDA): XLA_FFI_DEFINE_HANDLER_SYMBOL(Name, Impl, jsm::sig::route(ffi::Ffi::Bind())).
#pragma once

#include <utility>

#include "ffi/options.h"  // the decoding of DispatchOptions and Gemm1Options
#include "xla/ffi/api/ffi.h"

namespace jsm {
namespace sig {

namespace ffi = xla::ffi;
using S32Scalar = ffi::Buffer<ffi::S32, 0>;
using S32Vec = ffi::Buffer<ffi::S32, 1>;
using S32Mat = ffi::Buffer<ffi::S32, 2>;
using F32Vec = ffi::Buffer<ffi::F32, 1>;
using F32Mat = ffi::Buffer<ffi::F32, 2>;
using BF16Mat = ffi::Buffer<ffi::BF16, 2>;
using Any = ffi::AnyBuffer;

// (values, scales) <- x
template <class B>
auto quantize(B b) {
  return std::move(b).template Arg<Any>().template Ret<Any>().template Ret<Any>();
}

// (send_counts [R, EL], send_pos [T, K], num_invalid) <- ids [T, K]; attribute `runtime`: the
// Runtime's serial in the liveness registry (ffi/runtime_registry.h; 0: not checked)
template <class B>
auto route(B b) {
  return std::move(b).template Arg<S32Mat>().template Ret<S32Mat>().template Ret<S32Mat>()
      .template Ret<S32Scalar>().template Attr<int64_t>("runtime");
}

// Helpers take the binding by reference (a Binding cannot be moved into a parameter) and
// extend it.

// the send buffer: values, scales, token, slot, weight
template <class B>
auto send_buffer_rets(B&& b) {
  return std::move(b).template Ret<Any>().template Ret<Any>().template Ret<S32Vec>()
      .template Ret<S32Vec>().template Ret<F32Vec>();
}

// send buffer, send_counts [R, EL], rank: what a dispatch reads
template <class B>
auto dispatch_args(B&& b) {
  return std::move(b)
      .template Arg<Any>().template Arg<Any>().template Arg<S32Vec>().template Arg<S32Vec>()
      .template Arg<F32Vec>().template Arg<S32Mat>().template Arg<S32Scalar>();
}

// the landed rows' layout: src_rank, token, slot, weight, expert_offsets, expert_counts,
// num_rows, overflow
template <class B>
auto layout_rets(B&& b) {
  return std::move(b)
      .template Ret<S32Vec>().template Ret<S32Vec>().template Ret<S32Vec>().template Ret<F32Vec>()
      .template Ret<S32Vec>().template Ret<S32Vec>().template Ret<S32Scalar>()
      .template Ret<S32Scalar>();
}

// attribute `dispatch`: the engine, the Runtime's window set and the protocol's options
template <class B>
auto dispatch_attrs(B&& b) {
  return std::move(b).template Attr<DispatchOptions>("dispatch");
}

// attribute `gemm1`: the epilogue's limit and the kernel variant
template <class B>
auto gemm1_attrs(B&& b) {
  return std::move(b).template Attr<Gemm1Options>("gemm1");
}

// send buffer <- x bf16 [T, H], weights [T, K], send_pos [T, K]; attribute `token_rows`: the
// values hold one row per token (engine local's fused call, DESIGN.md §5), not one per send row
template <class B>
auto qpack(B b) {
  return send_buffer_rets(
      std::move(b).template Arg<BF16Mat>().template Arg<F32Mat>().template Arg<S32Mat>())
      .template Attr<bool>("token_rows");
}

// send buffer <- x values, x scales, weights [T, K], send_pos [T, K]; attribute `token_rows`
template <class B>
auto pack(B b) {
  return send_buffer_rets(std::move(b).template Arg<Any>().template Arg<Any>()
                              .template Arg<F32Mat>().template Arg<S32Mat>())
      .template Attr<bool>("token_rows");
}

// landed rows (values, scales, src_rank, token, slot, weight, expert_offsets, expert_counts,
// num_rows, overflow) <- send buffer, send_counts [R, EL], rank
template <class B>
auto dispatch(B b) {
  return dispatch_attrs(
      layout_rets(dispatch_args(std::move(b)).template Ret<Any>().template Ret<Any>()));
}

// dispatch + gemm1 fused (engines ce, sm, local): (src_rank, token, slot, weight,
// expert_offsets, expert_counts, num_rows, overflow, then h (bf16) or (h values, h scales)) <- send
// buffer, send_counts [R, EL], rank, w1 values, w1 scales; attribute `token_rows` as qpack's
// (engine local's fused call takes them, the others send rows)
template <class B>
auto dispatch_gemm1(B b) {
  return gemm1_attrs(dispatch_attrs(
      layout_rets(dispatch_args(std::move(b)).template Arg<Any>().template Arg<Any>())
          .RemainingRets()))
      .template Attr<bool>("token_rows");
}

// h (bf16) or (h values, h scales) <- landed values, scales, expert_offsets, expert_counts,
// w1 values, w1 scales
template <class B>
auto gemm1(B b) {
  return gemm1_attrs(std::move(b)
                         .template Arg<Any>().template Arg<Any>().template Arg<S32Vec>()
                         .template Arg<S32Vec>().template Arg<Any>().template Arg<Any>()
                         .RemainingRets());
}

// A stage's binding made by `stage()`, then (kWorkspace) the platform's scratch results after its
// own (CUDA: jax_sdma_moe/primitives.py _make(gpu_workspace=...)). (A Binding cannot be moved:
// `stage` makes it in place.)
template <bool kWorkspace, class Stage>
auto with_workspace(Stage stage) {
  if constexpr (kWorkspace) return stage().RemainingRets();
  else return stage();
}

// y [M_cap, H] bf16 <- h (bf16 [M_cap, I], or MX-fp8 values), expert_offsets, expert_counts,
// w2 values [EL, H, I], w2 scales, then h scales when h is MX-fp8; attribute `tile_tokens` (the
// CUDA bf16 kernel's tile, as Gemm1Options.tile_tokens)
template <bool kWorkspace = false, class B>
auto gemm2(B b) {
  return with_workspace<kWorkspace>([&] {
           return std::move(b)
               .template Arg<Any>().template Arg<S32Vec>().template Arg<S32Vec>()
               .template Arg<Any>().template Arg<Any>().template OptionalArg<Any>()
               .template Ret<Any>();
         })
      .template Attr<int64_t>("tile_tokens");
}

// y [T, H] bf16 <- GEMM2's rows [M_cap, H] bf16, src_rank, token, slot, weight (the landed rows'
// headers), rank; attributes `dispatch` (the engine and its protocol options) and `topk` (K)
template <bool kWorkspace = false, class B>
auto combine(B b) {
  return dispatch_attrs(with_workspace<kWorkspace>([&] {
           return std::move(b)
               .template Arg<Any>().template Arg<S32Vec>().template Arg<S32Vec>()
               .template Arg<S32Vec>().template Arg<F32Vec>().template Arg<S32Scalar>()
               .template Ret<Any>();
         }))
      .template Attr<int64_t>("topk");
}

// (expert_offsets, expert_counts) copied <- expert_offsets [EL], expert_counts [EL], src_rank,
// src_token, topk_slot [M_cap], then (kWorkspace: the GPUs') the check's words; attributes
// num_ranks, num_tokens, topk: the call fails naming the first field that breaks the §4 layout
// (kernels/common/layout_check.h), and stage2 feeds the copies to gemm2, so it runs first
template <bool kWorkspace = false, class B>
auto check_layout(B b) {
  return with_workspace<kWorkspace>([&] {
           return std::move(b)
               .template Arg<S32Vec>().template Arg<S32Vec>().template Arg<S32Vec>()
               .template Arg<S32Vec>().template Arg<S32Vec>().template Ret<S32Vec>()
               .template Ret<S32Vec>();
         })
      .template Attr<int64_t>("num_ranks")
      .template Attr<int64_t>("num_tokens")
      .template Attr<int64_t>("topk");
}

// overflow (passed through; the call fails if > 0) <- overflow, rank[, after: any buffer, never
// read: it orders the check after the call that made it (jsm.moe checks after its combine)]
template <class B>
// (count, the arrays it guards) <- count [], rank [], the arrays it guards (aliased: the results
// are the operands' buffers, so every use of them waits for the check); attributes `cap` (M_cap)
// and `what` (handler_util.h AxisCheck: what the axis-wide count counts)
auto check_overflow(B b) {
  return std::move(b).template Arg<S32Scalar>().template Arg<S32Scalar>().RemainingArgs()
      .template Ret<S32Scalar>().RemainingRets().template Attr<int64_t>("cap")
      .template Attr<int64_t>("what");
}

}  // namespace sig
}  // namespace jsm
