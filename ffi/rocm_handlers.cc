// XLA FFI handlers of the custom calls on the ROCm platform (HIP streams): the argument, result and
// attribute lists of ffi/signatures.h, as on CUDA. The stages ROCm shares with CUDA are
// ffi/gpu_handlers.h (their kernels: kernels/common/gpu_stages.cuh and gpu_stage2.cuh, compiled
// for HIP by kernels/rocm/stages.hip and stage2.hip); engine sdma's dispatch and combine are
// kernels/rocm/sdma; GEMM1, the fused dispatch + GEMM1 and GEMM2 call the FlyDSL kernels
// (kernels/rocm/gemm1.h), built only with JSM_ROCM_FLYDSL (without them GEMM2 is the generic
// kernel of gpu_stage2.h and GEMM1 is not served).
#include <hip/hip_runtime_api.h>

#include <optional>
#include <string>

#include "ffi/gpu_handlers.h"
#include "ffi/rocm_handlers.h"
#include "kernels/rocm/sdma/engine.h"
#ifdef JSM_ROCM_FLYDSL
#include "kernels/rocm/gemm1.h"
#endif

namespace ffi = xla::ffi;

namespace {

using namespace jsm::sig;  // the buffer aliases
using jsm::EngineId;
using jsm::gpu_handlers::engine_error;
using Stream = ffi::PlatformStream<hipStream_t>;

// The window engine of the ROCm platform, for the shared dispatch handler (gpu_handlers.h).
struct RocmEngines {
  static constexpr const char* kPlatform = "ROCm";
  static constexpr const char* kServes = "engines local and sdma";
  static bool serves(EngineId e) { return e == EngineId::kSdma; }
  static std::string dispatch(void* stream, const jsm::DispatchGeometry& g,
                              const jsm::SendView& send, const jsm::LandedView& out,
                              const jsm::DispatchOptions& opt) {
    return jsm::sdma::dispatch(stream, g, send, out, opt);
  }
  static constexpr const char* kServesCombine = kServes;
  static bool serves_combine(EngineId e) { return serves(e); }
  static std::string combine(void* stream, const jsm::CombineView& in, int32_t* row_of,
                             const jsm::DispatchOptions& opt) {
    return jsm::sdma::combine(stream, in, row_of, opt);
  }
};

// GEMM2 on ROCm, after y's padding rows are zeroed: the FlyDSL GEMM1 kernel without SwiGLU
// (kernels/rocm/gemm1.h), or where those kernels were not built the generic kernel of
// kernels/common/gpu_stage2.h (a correctness path). Like CUDA's, it takes MX-fp8 rows of h
// (jsm.stage2 quantises bf16 h first on every platform).
ffi::Error Gemm2Impl(hipStream_t stream, ffi::AnyBuffer h, S32Vec expert_offsets,
                     S32Vec expert_counts, ffi::AnyBuffer w_values, ffi::AnyBuffer w_scales,
                     std::optional<ffi::AnyBuffer> h_scales, ffi::Result<ffi::AnyBuffer> y,
                     int64_t /*tile_tokens: CUDA's bf16 kernel only*/) {
  JSM_RETURN_IF_ERROR(jsm::gpu_handlers::check_gemm2("ROCm", h, w_values, h_scales, *y));
  const auto wd = w_values.dimensions();  // [EL, H, I]
  using jsm::handler::ptr;
  const jsm::gpu::Gemm2Rows g{ptr<uint8_t>(h), ptr<uint8_t>(*h_scales), expert_offsets.typed_data(),
                              expert_counts.typed_data(), ptr<uint8_t>(w_values),
                              ptr<uint8_t>(w_scales), int(wd[0]), wd[1], wd[2],
                              jsm::handler::rows_of(h), static_cast<uint16_t*>(y->untyped_data())};
  jsm::gpu::launch_zero_padding_rows(g.offsets, g.counts, g.EL, g.m_cap, g.N * 2,
                                     reinterpret_cast<uint8_t*>(g.y), nullptr, 0, stream);
#ifdef JSM_ROCM_FLYDSL
  JSM_RETURN_IF_ERROR(jsm::gpu_handlers::last_error("gemm2 padding (ROCm)"));
  const std::string err = g.m_cap == 0 ? "" : jsm::rocm::launch_gemm2(g, stream);
  if (!err.empty()) return ffi::Error::Internal(err);
#else
  jsm::gpu::launch_generic_gemm2(g, stream);
#endif
  return jsm::gpu_handlers::last_error("gemm2 (ROCm)");
}

#ifdef JSM_ROCM_FLYDSL
using jsm::handler::check_dtype;
using jsm::handler::last_dim;
using jsm::handler::ptr;
using jsm::handler::rows_of;
using jsm::rocm::Gemm1Call;

// h's padding rows (the GEMM writes the landed rows only), then the GEMM.
std::string run_gemm1(const Gemm1Call& c, hipStream_t stream) {
  const int64_t row_bytes = c.h_bf16 ? c.I * 2 : c.I;
  jsm::gpu::launch_zero_padding_rows(
      c.offsets, c.counts, c.EL, c.m_cap, row_bytes,
      c.h_bf16 ? reinterpret_cast<uint8_t*>(c.h_bf16) : c.h_values, c.h_scales,
      c.h_bf16 ? 0 : c.I / jsm::kBlock, stream);
  const hipError_t e = hipGetLastError();
  if (e != hipSuccess) return std::string("jax_sdma_moe gemm1 padding: ") + hipGetErrorString(e);
  return c.m_cap == 0 ? "" : jsm::rocm::launch_gemm1(c, stream);
}

ffi::Error Gemm1Impl(hipStream_t stream, ffi::AnyBuffer a_values, ffi::AnyBuffer a_scales,
                     S32Vec expert_offsets, S32Vec expert_counts, ffi::AnyBuffer w_values,
                     ffi::AnyBuffer w_scales, ffi::RemainingRets rets, jsm::Gemm1Options opt) {
  Gemm1Call c{};
  JSM_RETURN_IF_ERROR(
      jsm::gpu_handlers::decode_gemm1_rows(a_values, a_scales, expert_offsets, expert_counts, &c));
  c.opt = opt;
  JSM_RETURN_IF_ERROR(jsm::gpu_handlers::decode_gemm1(w_values, w_scales, last_dim(a_values),
                                                      rows_of(a_values), rets, &c));
  const std::string err = run_gemm1(c, stream);
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal(err);
}

// engine sdma's fused GEMM: rows straight from the landing slot, each expert when its rows have
// landed (kernels/rocm/sdma/engine.h SlotView).
std::string gemm_on_slot(const jsm::sdma::SlotView& slot, void* stream, void* ctx) {
  Gemm1Call c = *static_cast<const Gemm1Call*>(ctx);
  c.a = slot.values[0];  // resolved per epoch in the kernel; [0] stands for both on the host
  c.a_scales = slot.scales[0];
  c.slot = &slot;
  return run_gemm1(c, static_cast<hipStream_t>(stream));
}

ffi::Error DispatchGemm1Impl(hipStream_t stream, ffi::AnyBuffer values, ffi::AnyBuffer scales,
                             S32Vec token, S32Vec slot, F32Vec weight, S32Mat send_counts,
                             S32Scalar rank, ffi::AnyBuffer w_values, ffi::AnyBuffer w_scales,
                             ffi::Result<S32Vec> src_rank, ffi::Result<S32Vec> out_token,
                             ffi::Result<S32Vec> out_slot, ffi::Result<F32Vec> out_weight,
                             ffi::Result<S32Vec> expert_offsets, ffi::Result<S32Vec> expert_counts,
                             ffi::Result<S32Scalar> num_rows, ffi::Result<S32Scalar> overflow,
                             ffi::RemainingRets rets, jsm::DispatchOptions opt,
                             jsm::Gemm1Options gemm_opt, bool token_rows) {
  JSM_RETURN_IF_ERROR(jsm::runtime_registry::check_open(opt.runtime, "dispatch_gemm1 (ROCm)"));
  if (opt.engine != EngineId::kSdma)
    return jsm::handler::wrong_engine("dispatch_gemm1 (ROCm)", opt.engine, "engine sdma");
  JSM_RETURN_IF_ERROR(check_dtype(values, ffi::DataType::F8E4M3FN, "dispatch_gemm1 rows"));
  JSM_RETURN_IF_ERROR(jsm::handler::check_token_rows(token_rows, false, opt.engine,
                                                     "dispatch_gemm1 (ROCm)"));
  JSM_RETURN_IF_ERROR(jsm::handler::check_send_rows(values, scales, token.element_count(), 0,
                                                    false, "dispatch_gemm1 (ROCm)"));
  const int64_t H = last_dim(values), cap = src_rank->dimensions()[0];
  Gemm1Call c{};
  c.offsets = expert_offsets->typed_data();
  c.counts = expert_counts->typed_data();
  c.opt = gemm_opt;
  JSM_RETURN_IF_ERROR(jsm::gpu_handlers::decode_gemm1(w_values, w_scales, H, cap, rets, &c));
  const jsm::DispatchGeometry geo{send_counts.dimensions()[0], send_counts.dimensions()[1], H, cap,
                                  rows_of(values)};
  const jsm::SendView send =
      jsm::gpu_handlers::send_view(values, scales, token, slot, weight, send_counts);
  const jsm::LandedView out = jsm::gpu_handlers::layout_view(
      src_rank, out_token, out_slot, out_weight, expert_offsets, expert_counts, num_rows, overflow);
  return engine_error(jsm::sdma::dispatch(stream, geo, send, out, opt, gemm_on_slot, &c));
}
#endif  // JSM_ROCM_FLYDSL

}  // namespace

JSM_DEFINE_GPU_HANDLERS(Rocm, Stream, RocmEngines);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmGemm2Rocm, Gemm2Impl,
                              jsm::sig::gemm2(ffi::Ffi::Bind().Ctx<Stream>()));

#ifdef JSM_ROCM_FLYDSL
XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmGemm1Rocm, Gemm1Impl,
                              jsm::sig::gemm1(ffi::Ffi::Bind().Ctx<Stream>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDispatchGemm1Rocm, DispatchGemm1Impl,
                              jsm::sig::dispatch_gemm1(ffi::Ffi::Bind().Ctx<Stream>()));

// engine sdma's fused call has no host step either (gpu_handlers.h, JsmDispatchGraph)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDispatchGemm1GraphRocm, DispatchGemm1Impl,
                              jsm::sig::dispatch_gemm1(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});
#endif
