// XLA FFI handlers of the Stage1 custom calls on the CUDA platform: the same argument and result
// lists as cpu_handlers.cc (the primitives' abstract evaluation fixes them). Each one checks what
// it is handed and calls a host launcher of kernels/cuda on XLA's stream. The stages CUDA shares
// with ROCm (quantize, route, qpack/pack, dispatch, check_overflow) are ffi/gpu_handlers.h.
#include <cuda_runtime.h>

#include <optional>
#include <string>

#include "ffi/cuda_handlers.h"
#include "ffi/gpu_handlers.h"
#include "ffi/handler_util.h"
#include "ffi/runtime_registry.h"
#include "ffi/signatures.h"
#include "kernels/cuda/ep/engine.h"
#include "kernels/cuda/gemm1/launch.h"
#include "kernels/cuda/launch_util.h"

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

using jsm::gpu_handlers::engine_error;
using jsm::gpu_handlers::last_error;

// The window engines of the CUDA platform, for the shared dispatch handler (gpu_handlers.h).
struct CudaEngines {
  static constexpr const char* kPlatform = "CUDA";
  static constexpr const char* kServes = "engines local, ce and sm";
  static bool serves(EngineId e) { return e == EngineId::kCe || e == EngineId::kSm; }
  static std::string dispatch(void* stream, const jsm::DispatchGeometry& g,
                              const jsm::SendView& send, const jsm::LandedView& out,
                              const jsm::DispatchOptions& opt) {
    return jsm::ep::dispatch(stream, g, send, out, opt);
  }
  static constexpr const char* kServesCombine = kServes;
  static bool serves_combine(EngineId e) { return serves(e); }
  static std::string combine(void* stream, const jsm::CombineView& in, int32_t* row_of,
                             const jsm::DispatchOptions& opt) {
    return jsm::ep::combine(stream, in, row_of, opt);
  }
};

// The bf16 kernel's workspace: rets[first] the bf16 rows as bytes [m_cap, 2H], rets[first + 1]
// the row-tile flags (jax_sdma_moe/layout.py bf16_gemm_workspace; both empty where the kernel
// does not apply: g->xb stays null).
ffi::Error decode_workspace(ffi::RemainingRets& rets, size_t first, int64_t m_cap, int64_t H,
                            Gemm1Args* g) {
  if (rets.size() != first + 2)
    return ffi::Error::InvalidArgument("jax_sdma_moe GEMM (CUDA): expected 2 workspace results");
  auto xb = rets.get<ffi::AnyBuffer>(first);
  auto flags = rets.get<ffi::AnyBuffer>(first + 1);
  if (!xb.has_value()) return xb.error();
  if (!flags.has_value()) return flags.error();
  if ((*xb)->element_count() > 0) {
    if ((*xb)->size_bytes() != size_t(m_cap * 2 * H))
      return ffi::Error::InvalidArgument("jax_sdma_moe GEMM (CUDA): workspace of the wrong size");
    g->xb = static_cast<uint8_t*>((*xb)->untyped_data());
    g->xb_ready = static_cast<uint32_t*>((*flags)->untyped_data());
    g->xb_ready_count = int64_t((*flags)->size_bytes() / sizeof(uint32_t));
  }
  return ffi::Error::Success();
}

ffi::Error check_experts(const Gemm1Args& g) {
  if (g.EL > jsm::cuda::gemm1::kMaxExperts)
    return ffi::Error::InvalidArgument("jax_sdma_moe GEMM (CUDA): more than 1024 local experts");
  return ffi::Error::Success();
}

// The GEMM's weights and h outputs (gpu_handlers.h), the CUDA kernels' limit on experts, and the
// workspace results that follow h.
ffi::Error gemm1_args(ffi::AnyBuffer w_values, ffi::AnyBuffer w_scales, int64_t H, int64_t m_cap,
                      ffi::RemainingRets& rets, Gemm1Args* g) {
  size_t used = 0;
  JSM_RETURN_IF_ERROR(
      jsm::gpu_handlers::decode_gemm1(w_values, w_scales, H, m_cap, rets, g, &used));
  JSM_RETURN_IF_ERROR(check_experts(*g));
  return decode_workspace(rets, used, m_cap, H, g);
}

ffi::Error launch_error(const std::string& err) {
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal(err);
}

ffi::Error Gemm1Impl(cudaStream_t stream, ffi::AnyBuffer a_values, ffi::AnyBuffer a_scales,
                     S32Vec expert_offsets, S32Vec expert_counts, ffi::AnyBuffer w_values,
                     ffi::AnyBuffer w_scales, ffi::RemainingRets rets, jsm::Gemm1Options opt) {
  Gemm1Args g{};
  JSM_RETURN_IF_ERROR(
      jsm::gpu_handlers::decode_gemm1_rows(a_values, a_scales, expert_offsets, expert_counts, &g));
  JSM_RETURN_IF_ERROR(gemm1_args(w_values, w_scales, last_dim(a_values), rows_of(a_values), rets,
                                 &g));
  return launch_error(jsm::cuda::gemm1::launch_gemm1(g, jsm::cuda::num_sms(), stream, opt));
}

// GEMM2 (Stage2): MX-fp8 rows of h only (jsm.stage2 quantises bf16 h first, with the same §3
// bytes as the CPU gemm2's own quantisation); y [M_cap, H] bf16, then the workspace.
ffi::Error Gemm2Impl(cudaStream_t stream, ffi::AnyBuffer h, S32Vec expert_offsets,
                     S32Vec expert_counts, ffi::AnyBuffer w_values, ffi::AnyBuffer w_scales,
                     std::optional<ffi::AnyBuffer> h_scales, ffi::Result<ffi::AnyBuffer> y,
                     ffi::RemainingRets rets, int64_t tile_tokens) {
  JSM_RETURN_IF_ERROR(jsm::gpu_handlers::check_gemm2("CUDA", h, w_values, h_scales, *y));
  const auto wd = w_values.dimensions();  // [EL, H, I]
  Gemm1Args g{};
  g.a = ptr<uint8_t>(h);
  g.a_scales = ptr<uint8_t>(*h_scales);
  g.offsets = expert_offsets.typed_data();
  g.counts = expert_counts.typed_data();
  g.w = ptr<uint8_t>(w_values);
  g.w_scales = ptr<uint8_t>(w_scales);
  g.EL = int(wd[0]);
  g.I = wd[1];  // the GEMM's output columns: the model's H
  g.H = wd[2];  // its depth: the model's I
  g.m_cap = rows_of(h);
  g.h_bf16 = static_cast<uint16_t*>(y->untyped_data());
  JSM_RETURN_IF_ERROR(check_experts(g));
  JSM_RETURN_IF_ERROR(decode_workspace(rets, 0, g.m_cap, g.H, &g));
  return launch_error(
      jsm::cuda::gemm1::launch_gemm2(g, jsm::cuda::num_sms(), stream, tile_tokens));
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

// Engine local's dispatch + gemm1 (R = 1): the layout kernel (the landed rows' headers), then the
// bf16 GEMM reading each landed row from its token's row of the send buffer, which holds one row
// per token (qpack token_rows; Gemm1Args::source_rows): no copy of the rows in front of the GEMM
// (0.3-0.45 ms at dsv3 4096-8192 tokens, docs/PERF.md §2), and qpack quantises and stores each
// token once (not once per expert).
ffi::Error local_dispatch_gemm1(cudaStream_t stream, const jsm::SendView& send, int EL, int64_t H,
                                const jsm::LandedView& out, const jsm::DispatchOptions& opt,
                                FusedGemm& fused) {
  Gemm1Args& g = fused.g;  // launch_gemm1 refuses it where the bf16 kernel does not run
  g.a = send.values;
  g.a_scales = send.scales;
  g.source_rows = out.token;
  jsm::gpu::launch_dispatch_local(send, EL, H, g.m_cap, opt.row_align, out, stream);
  JSM_RETURN_IF_ERROR(last_error("dispatch_gemm1 layout"));
  return launch_error(jsm::cuda::gemm1::launch_gemm1(g, jsm::cuda::num_sms(), stream, fused.opt));
}

// dispatch + gemm1 in one call: engines ce, sm (the GEMM overlaps the row copies), local.
ffi::Error DispatchGemm1Impl(cudaStream_t stream, ffi::AnyBuffer values, ffi::AnyBuffer scales,
                             S32Vec token, S32Vec slot, F32Vec weight, S32Mat send_counts,
                             S32Scalar rank, ffi::AnyBuffer w_values, ffi::AnyBuffer w_scales,
                             ffi::Result<S32Vec> src_rank, ffi::Result<S32Vec> out_token,
                             ffi::Result<S32Vec> out_slot, ffi::Result<F32Vec> out_weight,
                             ffi::Result<S32Vec> expert_offsets, ffi::Result<S32Vec> expert_counts,
                             ffi::Result<S32Scalar> num_rows, ffi::Result<S32Scalar> overflow,
                             ffi::RemainingRets rets, jsm::DispatchOptions opt,
                             jsm::Gemm1Options gemm_opt, bool token_rows) {
  JSM_RETURN_IF_ERROR(jsm::runtime_registry::check_open(opt.runtime, "dispatch_gemm1 (CUDA)"));
  if (opt.engine != EngineId::kCe && opt.engine != EngineId::kSm && opt.engine != EngineId::kLocal)
    return jsm::handler::wrong_engine("dispatch_gemm1 (CUDA)", opt.engine,
                                      "engines local, ce and sm");
  JSM_RETURN_IF_ERROR(check_dtype(values, ffi::DataType::F8E4M3FN, "dispatch_gemm1 rows"));
  const int64_t H = last_dim(values), cap = src_rank->dimensions()[0];
  const bool local = opt.engine == EngineId::kLocal;
  if (local && send_counts.dimensions()[0] != 1)
    return ffi::Error::InvalidArgument(
        "jax_sdma_moe dispatch_gemm1 (CUDA): engine 'local' moves rows within one GPU only "
        "(R = 1)");
  JSM_RETURN_IF_ERROR(
      jsm::handler::check_token_rows(token_rows, local, opt.engine, "dispatch_gemm1 (CUDA)"));
  // token rows: as many as x has tokens, which this call does not see; their scales match them
  JSM_RETURN_IF_ERROR(jsm::handler::check_send_rows(values, scales, token.element_count(),
                                                    rows_of(values), token_rows,
                                                    "dispatch_gemm1 (CUDA)"));
  // before the dispatch's first kernel: its kernels spin beside the GEMM's launch
  const std::string loaded = local ? "" : jsm::cuda::gemm1::load_gemm_kernels();
  if (!loaded.empty()) return launch_error(loaded);
  FusedGemm fused{Gemm1Args{}, gemm_opt};
  fused.g.offsets = expert_offsets->typed_data();
  fused.g.counts = expert_counts->typed_data();
  JSM_RETURN_IF_ERROR(gemm1_args(w_values, w_scales, H, cap, rets, &fused.g));
  const jsm::DispatchGeometry geo{send_counts.dimensions()[0], send_counts.dimensions()[1], H, cap,
                                  rows_of(values)};
  const jsm::SendView send =
      jsm::gpu_handlers::send_view(values, scales, token, slot, weight, send_counts);
  const jsm::LandedView out = jsm::gpu_handlers::layout_view(
      src_rank, out_token, out_slot, out_weight, expert_offsets, expert_counts, num_rows, overflow);
  if (local) return local_dispatch_gemm1(stream, send, int(geo.EL), H, out, opt, fused);
  return engine_error(jsm::ep::dispatch(stream, geo, send, out, opt, gemm_on_slot, &fused));
}

}  // namespace

JSM_DEFINE_GPU_HANDLERS(Cuda, Stream, CudaEngines);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDispatchGemm1Cuda, DispatchGemm1Impl,
                              jsm::sig::dispatch_gemm1(ffi::Ffi::Bind().Ctx<Stream>()));

// engine sm's fused call, which needs no host step per call (its epoch lives on the device): XLA
// may capture it into command buffers (CUDA graphs) and replay it
XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDispatchGemm1GraphCuda, DispatchGemm1Impl,
                              jsm::sig::dispatch_gemm1(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmGemm1Cuda, Gemm1Impl,
                              jsm::sig::gemm1(ffi::Ffi::Bind().Ctx<Stream>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmGemm2Cuda, Gemm2Impl,
                              jsm::sig::gemm2<true>(ffi::Ffi::Bind().Ctx<Stream>()));
