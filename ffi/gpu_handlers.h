// The handlers that the CUDA and ROCm platforms share, as templates over the platform's window
// engines (`Engines`): quantize, route, qpack / pack, check_overflow, check_layout, dispatch and
// combine (engine local everywhere, the platform's window engines through Engines::dispatch /
// ::combine). Each decodes what XLA hands it and calls a launcher of kernels/common/gpu_stages.h
// or gpu_stage2.h on XLA's stream. Included by ffi/cuda_handlers.cu and ffi/rocm_handlers.cc
// only, each with its own Engines:
//   static constexpr const char* kPlatform;           // "CUDA", "ROCm": for messages
//   static bool serves(EngineId);                       // its window engines' dispatch
//   static constexpr const char* kServes;             // "engines local, ce and sm", ...
//   static std::string dispatch(void* stream, const DispatchGeometry&, const SendView&,
//                               const LandedView&, const DispatchOptions&);   // "" or an error
//   static bool serves_combine(EngineId);  static constexpr const char* kServesCombine;
//   static std::string combine(void* stream, const CombineView&, int32_t* row_of,
//                              const DispatchOptions&);                       // "" or an error
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "ffi/handler_util.h"
#include "ffi/runtime_registry.h"
#include "ffi/signatures.h"
#include "kernels/common/gpu_stage2.h"
#include "kernels/common/gpu_stages.h"
#include "kernels/common/layout_check.h"
#include "kernels/common/mxfp8.h"

namespace jsm {
namespace gpu_handlers {

namespace ffi = xla::ffi;
using namespace jsm::sig;  // the buffer aliases
using handler::check_dtype;
using handler::check_send_rows;
using handler::last_dim;
using handler::ptr;
using handler::rows_of;

inline ffi::Error last_error(const char* what) {
  const gpu::Error err = gpu::last_error();
  if (err == gpu::kSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_sdma_moe ") + what + ": " + gpu::error_string(err));
}

// An error message of a window engine (or "") as the call's result.
inline ffi::Error engine_error(const std::string& err) {
  if (err.empty()) return ffi::Error::Success();
  return ffi::Error(err.find("timed out") != std::string::npos ? ffi::ErrorCode::kDeadlineExceeded
                                                               : ffi::ErrorCode::kInternal,
                    err);
}

inline ffi::Error QuantizeImpl(gpu::Stream stream, ffi::AnyBuffer x,
                               ffi::Result<ffi::AnyBuffer> values,
                               ffi::Result<ffi::AnyBuffer> scales) {
  JSM_RETURN_IF_ERROR(check_dtype(*values, ffi::DataType::F8E4M3FN, "quantize values"));
  const int64_t blocks = int64_t(x.element_count()) / kBlock;
  if (blocks == 0) return ffi::Error::Success();
  if (x.element_type() != ffi::DataType::BF16 && x.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("jax_sdma_moe quantize: x must be bfloat16 or float32");
  gpu::launch_quantize(x.untyped_data(), x.element_type() == ffi::DataType::BF16, blocks,
                       ptr<uint8_t>(values), ptr<uint8_t>(scales), stream);
  return last_error("quantize");
}

inline ffi::Error RouteImpl(gpu::Stream stream, S32Mat ids, ffi::Result<S32Mat> send_counts,
                            ffi::Result<S32Mat> send_pos, ffi::Result<S32Scalar> num_invalid,
                            int64_t runtime) {
  JSM_RETURN_IF_ERROR(runtime_registry::check_open(runtime, "route on a GPU"));
  gpu::launch_route(ids.typed_data(), ids.element_count(), int(send_counts->element_count()),
                    send_counts->typed_data(), send_pos->typed_data(), num_invalid->typed_data(),
                    stream);
  return last_error("route");
}

// qpack (x bf16) or pack (x_values, x_scales) into the send buffer.
inline ffi::Error launch_pack(gpu::Stream stream, bool quantize, const uint16_t* x,
                              const uint8_t* xv, const uint8_t* xs, F32Mat weights,
                              S32Mat send_pos, int64_t T, int64_t H, bool token_rows,
                              ffi::Result<ffi::AnyBuffer>& values,
                              ffi::Result<ffi::AnyBuffer>& scales, ffi::Result<S32Vec>& token,
                              ffi::Result<S32Vec>& slot, ffi::Result<F32Vec>& weight) {
  const int K = int(send_pos.dimensions()[1]);
  if (K > 16) return ffi::Error::InvalidArgument("jax_sdma_moe (GPU): top-k above 16");
  const int64_t S = token->element_count();
  JSM_RETURN_IF_ERROR(
      check_send_rows(*values, *scales, S, T, token_rows, quantize ? "qpack" : "pack"));
  const gpu::PackArgs a{x, xv, xs, weights.typed_data(), send_pos.typed_data(), T, K, H, S,
                        token_rows, ptr<uint8_t>(values), ptr<uint8_t>(scales),
                        token->typed_data(), slot->typed_data(), weight->typed_data()};
  gpu::launch_pack(quantize, a, stream);
  return last_error(quantize ? "qpack" : "pack");
}

inline ffi::Error QpackImpl(gpu::Stream stream, BF16Mat x, F32Mat weights, S32Mat send_pos,
                            ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::AnyBuffer> scales,
                            ffi::Result<S32Vec> token, ffi::Result<S32Vec> slot,
                            ffi::Result<F32Vec> weight, bool token_rows) {
  JSM_RETURN_IF_ERROR(check_dtype(*values, ffi::DataType::F8E4M3FN, "qpack values"));
  return launch_pack(stream, true, reinterpret_cast<const uint16_t*>(x.typed_data()), nullptr,
                     nullptr, weights, send_pos, x.dimensions()[0], x.dimensions()[1], token_rows,
                     values, scales, token, slot, weight);
}

inline ffi::Error PackImpl(gpu::Stream stream, ffi::AnyBuffer x_values, ffi::AnyBuffer x_scales,
                           F32Mat weights, S32Mat send_pos, ffi::Result<ffi::AnyBuffer> values,
                           ffi::Result<ffi::AnyBuffer> scales, ffi::Result<S32Vec> token,
                           ffi::Result<S32Vec> slot, ffi::Result<F32Vec> weight,
                           bool token_rows) {
  JSM_RETURN_IF_ERROR(check_dtype(x_values, ffi::DataType::F8E4M3FN, "pack x values"));
  return launch_pack(stream, false, nullptr, ptr<uint8_t>(x_values), ptr<uint8_t>(x_scales),
                     weights, send_pos, rows_of(x_values), last_dim(x_values), token_rows, values,
                     scales, token, slot, weight);
}

// The send buffer and send counts of a dispatch call.
inline SendView send_view(const ffi::AnyBuffer& values, const ffi::AnyBuffer& scales,
                          S32Vec token, S32Vec slot, F32Vec weight, S32Mat send_counts) {
  return SendView{ptr<uint8_t>(values), ptr<uint8_t>(scales), token.typed_data(),
                  slot.typed_data(),    weight.typed_data(),  send_counts.typed_data()};
}

// The landed rows' layout results of a fused dispatch + GEMM1 (no rows: the GEMM reads the slot).
inline LandedView layout_view(ffi::Result<S32Vec>& src_rank, ffi::Result<S32Vec>& token,
                              ffi::Result<S32Vec>& slot, ffi::Result<F32Vec>& weight,
                              ffi::Result<S32Vec>& expert_offsets,
                              ffi::Result<S32Vec>& expert_counts, ffi::Result<S32Scalar>& num_rows,
                              ffi::Result<S32Scalar>& overflow) {
  return LandedView{nullptr,
                    nullptr,
                    src_rank->typed_data(),
                    token->typed_data(),
                    slot->typed_data(),
                    weight->typed_data(),
                    expert_offsets->typed_data(),
                    expert_counts->typed_data(),
                    num_rows->typed_data(),
                    overflow->typed_data()};
}

// A stand-alone gemm1's landed rows (members a, a_scales, offsets, counts of G).
template <class G>
ffi::Error decode_gemm1_rows(ffi::AnyBuffer a_values, ffi::AnyBuffer a_scales,
                             S32Vec expert_offsets, S32Vec expert_counts, G* g) {
  JSM_RETURN_IF_ERROR(check_dtype(a_values, ffi::DataType::F8E4M3FN, "gemm1 rows"));
  g->a = ptr<uint8_t>(a_values);
  g->a_scales = ptr<uint8_t>(a_scales);
  g->offsets = expert_offsets.typed_data();
  g->counts = expert_counts.typed_data();
  return ffi::Error::Success();
}

// The GEMM's weights, sizes and h outputs (rets[0]: bf16 h, or MX-fp8 values with rets[1] its
// scales) into the platform's GEMM arguments G (members w, w_scales, EL, I, H, m_cap, h_bf16,
// h_values, h_scales). *used: how many of rets h took (a platform's workspace may follow).
template <class G>
ffi::Error decode_gemm1(ffi::AnyBuffer w_values, ffi::AnyBuffer w_scales, int64_t H,
                        int64_t m_cap, ffi::RemainingRets& rets, G* g, size_t* used = nullptr) {
  JSM_RETURN_IF_ERROR(check_dtype(w_values, ffi::DataType::F8E4M3FN, "gemm1 weights"));
  const auto wd = w_values.dimensions();
  g->w = ptr<uint8_t>(w_values);
  g->w_scales = ptr<uint8_t>(w_scales);
  g->EL = int(wd[0]);
  g->I = wd[1] / 2;
  g->H = H;
  g->m_cap = m_cap;
  auto h = rets.get<ffi::AnyBuffer>(0);
  if (!h.has_value()) return h.error();
  const bool bf16 = (*h)->element_type() == ffi::DataType::BF16;
  if (used) *used = bf16 ? 1 : 2;
  if (bf16) {
    g->h_bf16 = static_cast<uint16_t*>((*h)->untyped_data());
  } else {
    JSM_RETURN_IF_ERROR(check_dtype(**h, ffi::DataType::F8E4M3FN, "gemm1 output"));
    auto sc = rets.get<ffi::AnyBuffer>(1);
    if (!sc.has_value()) return sc.error();
    g->h_values = static_cast<uint8_t*>((*h)->untyped_data());
    g->h_scales = static_cast<uint8_t*>((*sc)->untyped_data());
  }
  return ffi::Error::Success();
}

// Engine local: R = 1, one copy kernel; the platform's window engines: Engines::dispatch.
template <class Engines>
ffi::Error DispatchImpl(gpu::Stream stream, ffi::AnyBuffer values, ffi::AnyBuffer scales,
                        S32Vec token, S32Vec slot, F32Vec weight, S32Mat send_counts,
                        S32Scalar rank, ffi::Result<ffi::AnyBuffer> out_values,
                        ffi::Result<ffi::AnyBuffer> out_scales, ffi::Result<S32Vec> src_rank,
                        ffi::Result<S32Vec> out_token, ffi::Result<S32Vec> out_slot,
                        ffi::Result<F32Vec> out_weight, ffi::Result<S32Vec> expert_offsets,
                        ffi::Result<S32Vec> expert_counts, ffi::Result<S32Scalar> num_rows,
                        ffi::Result<S32Scalar> overflow, DispatchOptions opt) {
  const std::string where = std::string("dispatch (") + Engines::kPlatform + ")";
  JSM_RETURN_IF_ERROR(runtime_registry::check_open(opt.runtime, where.c_str()));
  if (opt.engine != EngineId::kLocal && !Engines::serves(opt.engine))
    return handler::wrong_engine(where.c_str(), opt.engine, Engines::kServes);
  JSM_RETURN_IF_ERROR(
      check_send_rows(values, scales, token.element_count(), 0, false, where.c_str()));
  const int EL = int(send_counts.dimensions()[1]);
  const int64_t m_cap = rows_of(*out_values), H = last_dim(values);
  const SendView send = send_view(values, scales, token, slot, weight, send_counts);
  const LandedView out{
      ptr<uint8_t>(out_values),     ptr<uint8_t>(out_scales),    src_rank->typed_data(),
      out_token->typed_data(),      out_slot->typed_data(),      out_weight->typed_data(),
      expert_offsets->typed_data(), expert_counts->typed_data(), num_rows->typed_data(),
      overflow->typed_data()};
  if (opt.engine != EngineId::kLocal) {
    const DispatchGeometry g{send_counts.dimensions()[0], EL, H, m_cap, rows_of(values)};
    return engine_error(Engines::dispatch(stream, g, send, out, opt));
  }
  if (send_counts.dimensions()[0] != 1)
    return ffi::Error::InvalidArgument("jax_sdma_moe " + where +
                                       ": engine 'local' moves rows within one GPU only (R = 1)");
  gpu::launch_dispatch_local(send, EL, H, m_cap, opt.row_align, out, stream);
  return last_error("dispatch");
}

// gemm2's operands on both GPUs: MX-fp8 rows of h with their scales (jsm.stage2 quantises bf16 h
// first on every platform), MX-fp8 weights, a bf16 output.
inline ffi::Error check_gemm2(const char* platform, const ffi::AnyBuffer& h,
                              const ffi::AnyBuffer& w_values,
                              const std::optional<ffi::AnyBuffer>& h_scales,
                              const ffi::AnyBuffer& y) {
  JSM_RETURN_IF_ERROR(check_dtype(w_values, ffi::DataType::F8E4M3FN, "gemm2 weights"));
  JSM_RETURN_IF_ERROR(check_dtype(y, ffi::DataType::BF16, "gemm2 output"));
  if (!h_scales.has_value())
    return ffi::Error::InvalidArgument(
        std::string("jax_sdma_moe gemm2 (") + platform + "): takes MX-fp8 rows of h (values and "
        "scales); quantise bf16 h with jax_sdma_moe.primitives.quantize first, as jsm.stage2 does");
  JSM_RETURN_IF_ERROR(check_dtype(h, ffi::DataType::F8E4M3FN, "gemm2 MX-fp8 rows"));
  return check_dtype(*h_scales, ffi::DataType::U8, "gemm2 row scales");
}

// Stage2's combine: engine local (and engine xla's sum after its exchange) within the rank
// (gpu_stage2.h: the CPU backend's arithmetic and bytes); the platform's window engines through
// Engines::combine, the same sum. rets: the (token, slot) index workspace [T * K] int32.
template <class Engines>
ffi::Error CombineImpl(gpu::Stream stream, ffi::AnyBuffer rows, S32Vec src_rank, S32Vec token,
                       S32Vec slot, F32Vec weight, S32Scalar /*rank*/,
                       ffi::Result<ffi::AnyBuffer> y, ffi::RemainingRets rets,
                       DispatchOptions opt, int64_t topk) {
  const std::string where = std::string("combine (") + Engines::kPlatform + ")";
  JSM_RETURN_IF_ERROR(runtime_registry::check_open(opt.runtime, where.c_str()));
  if (opt.engine != EngineId::kLocal && !Engines::serves_combine(opt.engine))
    return handler::wrong_engine(where.c_str(), opt.engine, Engines::kServesCombine);
  JSM_RETURN_IF_ERROR(check_dtype(rows, ffi::DataType::BF16, "combine rows"));
  JSM_RETURN_IF_ERROR(check_dtype(*y, ffi::DataType::BF16, "combine output"));
  const auto yd = y->dimensions();  // [T, H]
  if (yd[1] % gpu::kSumCols != 0)
    return ffi::Error::InvalidArgument("jax_sdma_moe " + where + ": H must be a multiple of 8");
  const CombineView in{{static_cast<const uint16_t*>(rows.untyped_data()), src_rank.typed_data(),
                        token.typed_data(), slot.typed_data(), weight.typed_data()},
                       rows_of(rows),
                       yd[0],
                       topk,
                       yd[1],
                       static_cast<uint16_t*>(y->untyped_data())};
  auto row_of = rets.get<ffi::AnyBuffer>(0);
  if (rets.size() != 1 || !row_of.has_value())
    return ffi::Error::InvalidArgument("jax_sdma_moe " + where + ": expected 1 workspace result");
  if ((*row_of)->size_bytes() != size_t(yd[0] * topk) * sizeof(int32_t))
    return ffi::Error::InvalidArgument("jax_sdma_moe " + where + ": workspace of the wrong size");
  int32_t* index = static_cast<int32_t*>((*row_of)->untyped_data());
  if (opt.engine != EngineId::kLocal)
    return engine_error(Engines::combine(stream, in, index, opt));
  gpu::launch_combine_local({in, index}, stream);
  return last_error(where.c_str());
}

inline ffi::Error CheckOverflowImpl(gpu::Stream stream, S32Scalar overflow, S32Scalar rank,
                                    ffi::RemainingArgs guarded, ffi::Result<S32Scalar> out,
                                    ffi::RemainingRets guarded_out, int64_t cap,
                                    int64_t what) {
  int32_t host[2] = {0, 0};
  (void)gpu::memcpy_device_to_device_async(out->typed_data(), overflow.typed_data(), 4, stream);
  JSM_RETURN_IF_ERROR(handler::pass_through(guarded, guarded_out, [&](void* d, const void* s,
                                                                      size_t n) {
    (void)gpu::memcpy_device_to_device_async(d, s, n, stream);
  }));
  (void)gpu::memcpy_device_to_host_async(&host[0], overflow.typed_data(), 4, stream);
  (void)gpu::memcpy_device_to_host_async(&host[1], rank.typed_data(), 4, stream);
  if (gpu::stream_synchronize(stream) != gpu::kSuccess) return last_error("check_overflow");
  if (host[0] > 0)
    return handler::axis_check_error(handler::AxisCheck(what), host[0], host[1], cap);
  return ffi::Error::Success();
}

// jsm.stage2's check of out1's layout (kernels/common/layout_check.h): the offsets and counts
// copied through (gemm2 takes the copies, so the check runs first), one validation kernel
// (gpu_stage2.h launch_check_layout) writing the first fault to the workspace, one 16-byte copy to
// the host and a synchronize, then the fault named. rets: the workspace, check_layout_words uint32.
inline ffi::Error CheckLayoutImpl(gpu::Stream stream, S32Vec expert_offsets, S32Vec expert_counts,
                                  S32Vec src_rank, S32Vec src_token, S32Vec topk_slot,
                                  ffi::Result<S32Vec> out_offsets, ffi::Result<S32Vec> out_counts,
                                  ffi::RemainingRets rets, int64_t num_ranks, int64_t num_tokens,
                                  int64_t topk) {
  const int64_t EL = expert_offsets.element_count(), M = src_rank.element_count();
  auto words = rets.get<ffi::AnyBuffer>(0);
  if (rets.size() != 1 || !words.has_value())
    return ffi::Error::InvalidArgument("jax_sdma_moe check_layout: expected 1 workspace result");
  if ((*words)->size_bytes() !=
      size_t(gpu::check_layout_words(num_ranks, num_tokens, topk)) * sizeof(uint32_t))
    return ffi::Error::InvalidArgument("jax_sdma_moe check_layout: workspace of the wrong size");
  uint32_t* w = static_cast<uint32_t*>((*words)->untyped_data());
  for (auto [to, from] : {std::pair{out_offsets->typed_data(), expert_offsets.typed_data()},
                          std::pair{out_counts->typed_data(), expert_counts.typed_data()}})
    if (to != from && EL > 0)
      (void)gpu::memcpy_device_to_device_async(to, from, size_t(EL) * sizeof(int32_t), stream);
  gpu::launch_check_layout({expert_offsets.typed_data(), expert_counts.typed_data(),
                            src_rank.typed_data(), src_token.typed_data(), topk_slot.typed_data(),
                            EL, M, num_ranks, num_tokens, topk, w},
                           stream);
  LayoutFault f{};
  (void)gpu::memcpy_device_to_host_async(&f, w + gpu::kCheckLayoutFault, sizeof(f), stream);
  if (gpu::stream_synchronize(stream) != gpu::kSuccess) return last_error("check_layout");
  JSM_RETURN_IF_ERROR(last_error("check_layout"));
  if (f.rule == kLayoutOk) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      "jax_sdma_moe.stage2: " + layout_fault_message(f, "out1.", M, num_ranks, num_tokens, topk));
}

}  // namespace gpu_handlers
}  // namespace jsm

// Defines the shared handlers' symbols of platform P (Cuda, Rocm) for its stream context and
// window engines: JsmQuantizeP, JsmRouteP, JsmQpackP, JsmPackP, JsmDispatchP, JsmCheckOverflowP,
// JsmCombineP, JsmCheckLayoutP, and JsmDispatchGraphP — the dispatch registered as command-buffer compatible, for
// the engines with no host step per call (sm, sdma: their epoch lives on the device), so XLA may
// capture them in CUDA / HIP graphs.
#define JSM_DEFINE_GPU_HANDLERS(P, STREAM, ENGINES)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmQuantize##P, ::jsm::gpu_handlers::QuantizeImpl,            \
                                ::jsm::sig::quantize(::xla::ffi::Ffi::Bind().Ctx<STREAM>()));  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmRoute##P, ::jsm::gpu_handlers::RouteImpl,                  \
                                ::jsm::sig::route(::xla::ffi::Ffi::Bind().Ctx<STREAM>()));     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmQpack##P, ::jsm::gpu_handlers::QpackImpl,                  \
                                ::jsm::sig::qpack(::xla::ffi::Ffi::Bind().Ctx<STREAM>()));     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmPack##P, ::jsm::gpu_handlers::PackImpl,                    \
                                ::jsm::sig::pack(::xla::ffi::Ffi::Bind().Ctx<STREAM>()));      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDispatch##P, ::jsm::gpu_handlers::DispatchImpl<ENGINES>,   \
                                ::jsm::sig::dispatch(::xla::ffi::Ffi::Bind().Ctx<STREAM>()));  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDispatchGraph##P,                                          \
                                ::jsm::gpu_handlers::DispatchImpl<ENGINES>,                   \
                                ::jsm::sig::dispatch(::xla::ffi::Ffi::Bind().Ctx<STREAM>()),   \
                                {::xla::ffi::Traits::kCmdBufferCompatible});                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmCheckOverflow##P, ::jsm::gpu_handlers::CheckOverflowImpl,  \
                                ::jsm::sig::check_overflow(                                   \
                                    ::xla::ffi::Ffi::Bind().Ctx<STREAM>()));                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmCombine##P, ::jsm::gpu_handlers::CombineImpl<ENGINES>,     \
                                ::jsm::sig::combine<true>(::xla::ffi::Ffi::Bind().Ctx<STREAM>())); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmCheckLayout##P, ::jsm::gpu_handlers::CheckLayoutImpl,      \
                                ::jsm::sig::check_layout<true>(                               \
                                    ::xla::ffi::Ffi::Bind().Ctx<STREAM>()))
