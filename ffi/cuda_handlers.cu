// XLA FFI handlers of the Stage1 custom calls on the CUDA platform: the same argument and result
// lists as cpu_handlers.cc (the primitives' abstract evaluation fixes them). Each one checks what
// it is handed and calls a host launcher of kernels/cuda on XLA's stream.
#include <cuda_runtime.h>

#include <string>

#include "ffi/cuda_handlers.h"
#include "ffi/handler_util.h"
#include "ffi/signatures.h"
#include "kernels/cuda/ep/engine.h"
#include "kernels/cuda/gemm1/launch.h"
#include "kernels/cuda/launch_util.h"
#include "kernels/cuda/stages.h"

namespace ffi = xla::ffi;

namespace {

using namespace jsm::sig;  // the buffer aliases
using jsm::EngineId;
using jsm::handler::check_dtype;
using jsm::handler::last_dim;
using jsm::handler::ptr;
using jsm::handler::rows_of;
using jsm::cuda::gemm1::Gemm1Args;

using Stream = ffi::PlatformStream<cudaStream_t>;

ffi::Error last_error(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_sdma_moe ") + what + ": " + cudaGetErrorString(err));
}

// An error message of the ce/sm engines (or "") as the call's result.
ffi::Error ep_error(const std::string& err) {
  if (err.empty()) return ffi::Error::Success();
  return ffi::Error(err.find("timed out") != std::string::npos ? ffi::ErrorCode::kDeadlineExceeded
                                                               : ffi::ErrorCode::kInternal,
                    err);
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> values,
                        ffi::Result<ffi::AnyBuffer> scales) {
  JSM_RETURN_IF_ERROR(check_dtype(*values, ffi::DataType::F8E4M3FN, "quantize values"));
  const int64_t blocks = int64_t(x.element_count()) / jsm::kBlock;
  if (blocks == 0) return ffi::Error::Success();
  if (x.element_type() != ffi::DataType::BF16 && x.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("jax_sdma_moe quantize: x must be bfloat16 or float32");
  jsm::cuda::launch_quantize(x.untyped_data(), x.element_type() == ffi::DataType::BF16, blocks,
                             ptr<uint8_t>(values), ptr<uint8_t>(scales), stream);
  return last_error("quantize");
}

ffi::Error RouteImpl(cudaStream_t stream, S32Mat ids, ffi::Result<S32Mat> send_counts,
                     ffi::Result<S32Mat> send_pos, ffi::Result<S32Scalar> num_invalid) {
  jsm::cuda::launch_route(ids.typed_data(), ids.element_count(),
                          int(send_counts->element_count()), send_counts->typed_data(),
                          send_pos->typed_data(), num_invalid->typed_data(), stream);
  return last_error("route");
}

// qpack (x bf16) or pack (x_values, x_scales) into the send buffer.
ffi::Error launch_pack(cudaStream_t stream, bool quantize, const uint16_t* x, const uint8_t* xv,
                       const uint8_t* xs, F32Mat weights, S32Mat send_pos, int64_t T, int64_t H,
                       ffi::Result<ffi::AnyBuffer>& values, ffi::Result<ffi::AnyBuffer>& scales,
                       ffi::Result<S32Vec>& token, ffi::Result<S32Vec>& slot,
                       ffi::Result<F32Vec>& weight) {
  const int K = int(send_pos.dimensions()[1]);
  if (K > 16) return ffi::Error::InvalidArgument("jax_sdma_moe (CUDA): top-k above 16");
  const jsm::cuda::PackArgs a{x, xv, xs, weights.typed_data(), send_pos.typed_data(), T, K, H,
                              int64_t(token->element_count()), ptr<uint8_t>(values),
                              ptr<uint8_t>(scales), token->typed_data(), slot->typed_data(),
                              weight->typed_data()};
  jsm::cuda::launch_pack(quantize, a, stream);
  return last_error(quantize ? "qpack" : "pack");
}

ffi::Error QpackImpl(cudaStream_t stream, BF16Mat x, F32Mat weights, S32Mat send_pos,
                     ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::AnyBuffer> scales,
                     ffi::Result<S32Vec> token, ffi::Result<S32Vec> slot,
                     ffi::Result<F32Vec> weight) {
  JSM_RETURN_IF_ERROR(check_dtype(*values, ffi::DataType::F8E4M3FN, "qpack values"));
  return launch_pack(stream, true, reinterpret_cast<const uint16_t*>(x.typed_data()), nullptr,
                     nullptr, weights, send_pos, x.dimensions()[0], x.dimensions()[1], values,
                     scales, token, slot, weight);
}

ffi::Error PackImpl(cudaStream_t stream, ffi::AnyBuffer x_values, ffi::AnyBuffer x_scales,
                    F32Mat weights, S32Mat send_pos, ffi::Result<ffi::AnyBuffer> values,
                    ffi::Result<ffi::AnyBuffer> scales, ffi::Result<S32Vec> token,
                    ffi::Result<S32Vec> slot, ffi::Result<F32Vec> weight) {
  JSM_RETURN_IF_ERROR(check_dtype(x_values, ffi::DataType::F8E4M3FN, "pack x values"));
  return launch_pack(stream, false, nullptr, ptr<uint8_t>(x_values), ptr<uint8_t>(x_scales),
                     weights, send_pos, rows_of(x_values), last_dim(x_values), values, scales,
                     token, slot, weight);
}

// Engine local: R = 1, one copy kernel; engines ce, sm: the Runtime's window set
// (kernels/cuda/ep).
ffi::Error DispatchImpl(cudaStream_t stream, ffi::AnyBuffer values, ffi::AnyBuffer scales,
                        S32Vec token, S32Vec slot, F32Vec weight, S32Mat send_counts,
                        S32Scalar rank, ffi::Result<ffi::AnyBuffer> out_values,
                        ffi::Result<ffi::AnyBuffer> out_scales, ffi::Result<S32Vec> src_rank,
                        ffi::Result<S32Vec> out_token, ffi::Result<S32Vec> out_slot,
                        ffi::Result<F32Vec> out_weight, ffi::Result<S32Vec> expert_offsets,
                        ffi::Result<S32Vec> expert_counts, ffi::Result<S32Scalar> num_rows,
                        ffi::Result<S32Scalar> overflow, jsm::DispatchOptions opt) {
  if (opt.engine != EngineId::kLocal && opt.engine != EngineId::kCe &&
      opt.engine != EngineId::kSm)
    return jsm::handler::wrong_engine("dispatch (CUDA)", opt.engine, "engines local, ce and sm");
  const int EL = int(send_counts.dimensions()[1]);
  const int64_t m_cap = rows_of(*out_values), H = last_dim(values);
  const jsm::SendView send{ptr<uint8_t>(values), ptr<uint8_t>(scales), token.typed_data(),
                           slot.typed_data(), weight.typed_data(), send_counts.typed_data()};
  const jsm::LandedView out{
      ptr<uint8_t>(out_values),     ptr<uint8_t>(out_scales),    src_rank->typed_data(),
      out_token->typed_data(),      out_slot->typed_data(),      out_weight->typed_data(),
      expert_offsets->typed_data(), expert_counts->typed_data(), num_rows->typed_data(),
      overflow->typed_data()};
  if (opt.engine != EngineId::kLocal) {
    const jsm::DispatchGeometry g{send_counts.dimensions()[0], EL, H, m_cap, rows_of(values)};
    return ep_error(jsm::ep::dispatch(stream, g, send, out, opt));
  }
  if (send_counts.dimensions()[0] != 1)
    return ffi::Error::InvalidArgument(
        "jax_sdma_moe dispatch (CUDA): engine 'local' moves rows within one GPU only (R = 1)");
  jsm::cuda::launch_dispatch_local(send, EL, H, m_cap, opt.row_align, out, stream);
  return last_error("dispatch");
}

// The GEMM's weights and h outputs (rets[0], and rets[1] for MX-fp8 scales).
ffi::Error gemm1_args(ffi::AnyBuffer w_values, ffi::AnyBuffer w_scales, int64_t H, int64_t m_cap,
                      ffi::RemainingRets& rets, Gemm1Args* g) {
  JSM_RETURN_IF_ERROR(check_dtype(w_values, ffi::DataType::F8E4M3FN, "gemm1 weights"));
  const auto wd = w_values.dimensions();
  g->w = ptr<uint8_t>(w_values);
  g->w_scales = ptr<uint8_t>(w_scales);
  g->EL = int(wd[0]);
  g->I = wd[1] / 2;
  g->H = H;
  g->m_cap = m_cap;
  if (g->EL > jsm::cuda::gemm1::kMaxExperts)
    return ffi::Error::InvalidArgument("jax_sdma_moe gemm1 (CUDA): more than 1024 local experts");
  auto h = rets.get<ffi::AnyBuffer>(0);
  if (!h.has_value()) return h.error();
  if (rets.size() == 1) {
    JSM_RETURN_IF_ERROR(check_dtype(**h, ffi::DataType::BF16, "gemm1 output"));
    g->h_bf16 = static_cast<uint16_t*>((*h)->untyped_data());
  } else {
    auto sc = rets.get<ffi::AnyBuffer>(1);
    if (!sc.has_value()) return sc.error();
    g->h_values = static_cast<uint8_t*>((*h)->untyped_data());
    g->h_scales = static_cast<uint8_t*>((*sc)->untyped_data());
  }
  return ffi::Error::Success();
}

ffi::Error gemm1_error(const std::string& err) {
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal(err);
}

ffi::Error Gemm1Impl(cudaStream_t stream, ffi::AnyBuffer a_values, ffi::AnyBuffer a_scales,
                     S32Vec expert_offsets, S32Vec expert_counts, ffi::AnyBuffer w_values,
                     ffi::AnyBuffer w_scales, ffi::RemainingRets rets, jsm::Gemm1Options opt) {
  JSM_RETURN_IF_ERROR(check_dtype(a_values, ffi::DataType::F8E4M3FN, "gemm1 rows"));
  Gemm1Args g{};
  g.a = ptr<uint8_t>(a_values);
  g.a_scales = ptr<uint8_t>(a_scales);
  g.offsets = expert_offsets.typed_data();
  g.counts = expert_counts.typed_data();
  JSM_RETURN_IF_ERROR(gemm1_args(w_values, w_scales, last_dim(a_values), rows_of(a_values), rets,
                                 &g));
  return gemm1_error(jsm::cuda::gemm1::launch_gemm1(g, jsm::cuda::num_sms(), stream, opt));
}

// The fused GEMM of engines ce/sm (what gemm_on_slot reads through its context).
struct FusedGemm {
  Gemm1Args g;
  jsm::Gemm1Options opt;
};

// The fused GEMM of engines ce/sm: rows straight from the landing slot, each expert when its rows
// have landed.
std::string gemm_on_slot(const jsm::ep::SlotView& slot, void* stream, void* ctx) {
  const FusedGemm& fused = *static_cast<const FusedGemm*>(ctx);
  Gemm1Args g = fused.g;
  g.a = slot.values[0];  // resolved per epoch in the kernel; [0] stands for both on the host
  g.a_scales = slot.scales[0];
  g.epoch_counter = slot.epoch_counter;
  for (int p = 0; p < 2; ++p) {
    g.slot_values[p] = slot.values[p];
    g.slot_scales[p] = slot.scales[p];
    g.slot_arrival[p] = slot.arrival[p];
  }
  g.arrival_ranks = slot.R;
  g.timeout_ns = slot.timeout_ns;
  g.err = slot.err;
  return jsm::cuda::gemm1::launch_gemm1(g, slot.sms, static_cast<cudaStream_t>(stream),
                                        fused.opt);
}

// dispatch + gemm1 in one call (engines ce, sm): the GEMM overlaps the row copies.
ffi::Error DispatchGemm1Impl(cudaStream_t stream, ffi::AnyBuffer values, ffi::AnyBuffer scales,
                             S32Vec token, S32Vec slot, F32Vec weight, S32Mat send_counts,
                             S32Scalar rank, ffi::AnyBuffer w_values, ffi::AnyBuffer w_scales,
                             ffi::Result<S32Vec> src_rank, ffi::Result<S32Vec> out_token,
                             ffi::Result<S32Vec> out_slot, ffi::Result<F32Vec> out_weight,
                             ffi::Result<S32Vec> expert_offsets, ffi::Result<S32Vec> expert_counts,
                             ffi::Result<S32Scalar> num_rows, ffi::Result<S32Scalar> overflow,
                             ffi::RemainingRets rets, jsm::DispatchOptions opt,
                             jsm::Gemm1Options gemm_opt) {
  if (opt.engine != EngineId::kCe && opt.engine != EngineId::kSm)
    return jsm::handler::wrong_engine("dispatch_gemm1 (CUDA)", opt.engine, "engines ce and sm");
  JSM_RETURN_IF_ERROR(check_dtype(values, ffi::DataType::F8E4M3FN, "dispatch_gemm1 rows"));
  const int64_t H = last_dim(values), cap = src_rank->dimensions()[0];
  FusedGemm fused{Gemm1Args{}, gemm_opt};
  fused.g.offsets = expert_offsets->typed_data();
  fused.g.counts = expert_counts->typed_data();
  JSM_RETURN_IF_ERROR(gemm1_args(w_values, w_scales, H, cap, rets, &fused.g));
  const jsm::DispatchGeometry geo{send_counts.dimensions()[0], send_counts.dimensions()[1], H, cap,
                                  rows_of(values)};
  const jsm::SendView send{ptr<uint8_t>(values), ptr<uint8_t>(scales), token.typed_data(),
                           slot.typed_data(), weight.typed_data(), send_counts.typed_data()};
  const jsm::LandedView out{nullptr,
                            nullptr,
                            src_rank->typed_data(),
                            out_token->typed_data(),
                            out_slot->typed_data(),
                            out_weight->typed_data(),
                            expert_offsets->typed_data(),
                            expert_counts->typed_data(),
                            num_rows->typed_data(),
                            overflow->typed_data()};
  return ep_error(jsm::ep::dispatch(stream, geo, send, out, opt, gemm_on_slot, &fused));
}

ffi::Error CheckOverflowImpl(cudaStream_t stream, S32Scalar overflow, S32Scalar rank,
                             ffi::Result<S32Scalar> out, int64_t cap) {
  int32_t host[2] = {0, 0};
  cudaMemcpyAsync(out->typed_data(), overflow.typed_data(), 4, cudaMemcpyDeviceToDevice, stream);
  cudaMemcpyAsync(&host[0], overflow.typed_data(), 4, cudaMemcpyDeviceToHost, stream);
  cudaMemcpyAsync(&host[1], rank.typed_data(), 4, cudaMemcpyDeviceToHost, stream);
  if (cudaStreamSynchronize(stream) != cudaSuccess) return last_error("check_overflow");
  if (host[0] > 0)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jax_sdma_moe.stage1: " + std::to_string(host[0]) + " rows routed to rank " +
                          std::to_string(host[1]) + " did not fit M_cap = " + std::to_string(cap) +
                          "; raise Stage1Config.max_recv_rows");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmQuantizeCuda, QuantizeImpl,
                              jsm::sig::quantize(ffi::Ffi::Bind().Ctx<Stream>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmRouteCuda, RouteImpl,
                              jsm::sig::route(ffi::Ffi::Bind().Ctx<Stream>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmQpackCuda, QpackImpl,
                              jsm::sig::qpack(ffi::Ffi::Bind().Ctx<Stream>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmPackCuda, PackImpl,
                              jsm::sig::pack(ffi::Ffi::Bind().Ctx<Stream>()));


XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDispatchCuda, DispatchImpl,
                              jsm::sig::dispatch(ffi::Ffi::Bind().Ctx<Stream>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDispatchGemm1Cuda, DispatchGemm1Impl,
                              jsm::sig::dispatch_gemm1(ffi::Ffi::Bind().Ctx<Stream>()));

// The same two calls for engine sm, which needs no host step per call (its epoch lives on the
// device): XLA may capture them into command buffers (CUDA graphs) and replay them.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDispatchGraphCuda, DispatchImpl,
                              jsm::sig::dispatch(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDispatchGemm1GraphCuda, DispatchGemm1Impl,
                              jsm::sig::dispatch_gemm1(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmGemm1Cuda, Gemm1Impl,
                              jsm::sig::gemm1(ffi::Ffi::Bind().Ctx<Stream>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmCheckOverflowCuda, CheckOverflowImpl,
                              jsm::sig::check_overflow(ffi::Ffi::Bind().Ctx<Stream>()));
