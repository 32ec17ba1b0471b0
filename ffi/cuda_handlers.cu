// XLA FFI handlers of the Stage1 custom calls on the CUDA platform: the same argument and result
// lists as cpu_handlers.cc (the primitives' abstract evaluation fixes them), kernels from
// kernels/cuda, launched on XLA's stream.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "cuda_ep.h"
#include "cuda_handlers.h"
#include "cuda_launch.h"
#include "signatures.h"
#include "kernels/cuda/gemm1.cuh"
#include "kernels/cuda/gemm1_wgmma.cuh"
#include "kernels/cuda/gemm1_ws.cuh"
#include "kernels/cuda/stages.cuh"

namespace ffi = xla::ffi;

namespace {

using namespace jsm::sig;  // the buffer aliases

using Stream = ffi::PlatformStream<cudaStream_t>;

#define JSM_RETURN_IF_ERROR(expr) \
  do {                            \
    ffi::Error _e = (expr);       \
    if (!_e.success()) return _e; \
  } while (0)

ffi::Error last_error(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_sdma_moe ") + what + ": " + cudaGetErrorString(err));
}

ffi::Error check_dtype(const ffi::AnyBuffer& b, ffi::DataType want, const char* what) {
  if (b.element_type() != want)
    return ffi::Error::InvalidArgument(std::string("jax_sdma_moe: ") + what +
                                       " has the wrong element type");
  return ffi::Error::Success();
}

int64_t rows_of(const ffi::AnyBuffer& b) { return b.dimensions().size() == 0 ? 1 : b.dimensions()[0]; }
int64_t last_dim(const ffi::AnyBuffer& b) { return b.dimensions().back(); }
template <class T>
T* ptr(ffi::Result<ffi::AnyBuffer>& r) { return static_cast<T*>(r->untyped_data()); }
template <class T>
const T* ptr(const ffi::AnyBuffer& b) { return static_cast<const T*>(b.untyped_data()); }

using jsm::cuda::grid_for;
using jsm::cuda::num_sms;

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> values,
                        ffi::Result<ffi::AnyBuffer> scales) {
  JSM_RETURN_IF_ERROR(check_dtype(*values, ffi::DataType::F8E4M3FN, "quantize values"));
  const int64_t blocks = int64_t(x.element_count()) / jsm::kBlock;
  if (blocks == 0) return ffi::Error::Success();
  if (x.element_type() == ffi::DataType::BF16)
    jsm::cuda::quantize_kernel<uint16_t><<<grid_for(blocks, 256), 256, 0, stream>>>(
        ptr<uint16_t>(x), blocks, ptr<uint8_t>(values), ptr<uint8_t>(scales));
  else if (x.element_type() == ffi::DataType::F32)
    jsm::cuda::quantize_kernel<float><<<grid_for(blocks, 256), 256, 0, stream>>>(
        ptr<float>(x), blocks, ptr<uint8_t>(values), ptr<uint8_t>(scales));
  else
    return ffi::Error::InvalidArgument("jax_sdma_moe quantize: x must be bfloat16 or float32");
  return last_error("quantize");
}

ffi::Error RouteImpl(cudaStream_t stream, S32Mat ids, ffi::Result<S32Mat> send_counts,
                     ffi::Result<S32Mat> send_pos, ffi::Result<S32Scalar> num_invalid) {
  const int64_t n = ids.element_count();
  const int E = int(send_counts->element_count());
  // the parallel two-launch form (tested on an H200, 1.5-2.3x faster); JSM_ROUTE=warp: the
  // one-warp form
  const char* route_env = getenv("JSM_ROUTE");  // read per call: benchmarks switch it in-process
  const bool blocks = !(route_env && std::string(route_env) == "warp");
  if (blocks) {
    jsm::cuda::route_count_kernel<<<E + 1, 256, 0, stream>>>(
        ids.typed_data(), n, E, send_counts->typed_data(), send_pos->typed_data(),
        num_invalid->typed_data());
    if (E > 0)
      jsm::cuda::route_place_kernel<<<E, 1024, 0, stream>>>(ids.typed_data(), n, E,
                                                            send_counts->typed_data(),
                                                            send_pos->typed_data());
  } else {
    jsm::cuda::route_kernel<<<1, 32, 2 * E * sizeof(int32_t), stream>>>(
        ids.typed_data(), n, E, send_counts->typed_data(), send_pos->typed_data(),
        num_invalid->typed_data());
  }
  return last_error("route");
}

template <bool kQuantize>
ffi::Error launch_pack(cudaStream_t stream, const uint16_t* x, const uint8_t* xv, const uint8_t* xs,
                       F32Mat weights, S32Mat send_pos, int64_t T, int64_t H,
                       ffi::Result<ffi::AnyBuffer>& values, ffi::Result<ffi::AnyBuffer>& scales,
                       ffi::Result<S32Vec>& token, ffi::Result<S32Vec>& slot,
                       ffi::Result<F32Vec>& weight,
                       jsm::cuda::LandingMap lm = jsm::cuda::LandingMap{}) {
  const int K = int(send_pos.dimensions()[1]);
  if (K > 16) return ffi::Error::InvalidArgument("jax_sdma_moe (CUDA): top-k above 16");
  const int64_t S = token->element_count();
  // rows past the routed ones: headers -1 (token, slot), weight 0; their payload is unspecified
  cudaMemsetAsync(token->typed_data(), 0xFF, S * sizeof(int32_t), stream);
  cudaMemsetAsync(slot->typed_data(), 0xFF, S * sizeof(int32_t), stream);
  cudaMemsetAsync(weight->typed_data(), 0, S * sizeof(float), stream);
  if (T > 0)
    jsm::cuda::pack_kernel<kQuantize>
        <<<(T + jsm::cuda::kPackWarps - 1) / jsm::cuda::kPackWarps, jsm::cuda::kPackThreads,
           lm.counts ? jsm::cuda::LandingMap::smem_bytes(lm.EL) : 0, stream>>>(
            x, xv, xs, weights.typed_data(), send_pos.typed_data(), T, K, H, ptr<uint8_t>(values),
            ptr<uint8_t>(scales), token->typed_data(), slot->typed_data(), weight->typed_data(),
            lm);
  return last_error(kQuantize ? "qpack" : "pack");
}

ffi::Error QpackImpl(cudaStream_t stream, BF16Mat x, F32Mat weights, S32Mat send_pos,
                     ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::AnyBuffer> scales,
                     ffi::Result<S32Vec> token, ffi::Result<S32Vec> slot,
                     ffi::Result<F32Vec> weight) {
  JSM_RETURN_IF_ERROR(check_dtype(*values, ffi::DataType::F8E4M3FN, "qpack values"));
  return launch_pack<true>(stream, reinterpret_cast<const uint16_t*>(x.typed_data()), nullptr,
                           nullptr, weights, send_pos, x.dimensions()[0], x.dimensions()[1],
                           values, scales, token, slot, weight);
}

ffi::Error PackImpl(cudaStream_t stream, ffi::AnyBuffer x_values, ffi::AnyBuffer x_scales,
                    F32Mat weights, S32Mat send_pos, ffi::Result<ffi::AnyBuffer> values,
                    ffi::Result<ffi::AnyBuffer> scales, ffi::Result<S32Vec> token,
                    ffi::Result<S32Vec> slot, ffi::Result<F32Vec> weight) {
  JSM_RETURN_IF_ERROR(check_dtype(x_values, ffi::DataType::F8E4M3FN, "pack x values"));
  return launch_pack<false>(stream, nullptr, ptr<uint8_t>(x_values), ptr<uint8_t>(x_scales),
                            weights, send_pos, rows_of(x_values), last_dim(x_values), values,
                            scales, token, slot, weight);
}

ffi::Error ep_error(const std::string& err) {
  if (err.empty()) return ffi::Error::Success();
  return ffi::Error(err.find("timed out") != std::string::npos ? ffi::ErrorCode::kDeadlineExceeded
                                                               : ffi::ErrorCode::kInternal,
                    err);
}

// runtime_id 0: engine "local" (R = 1, one copy kernel); otherwise the window set of a Runtime
// with engine "ce" or "sm" (ffi/cuda_ep.cu).
ffi::Error DispatchImpl(cudaStream_t stream, ffi::AnyBuffer values, ffi::AnyBuffer scales, S32Vec token,
                        S32Vec slot, F32Vec weight, S32Mat send_counts, S32Scalar rank,
                        ffi::Result<ffi::AnyBuffer> out_values,
                        ffi::Result<ffi::AnyBuffer> out_scales, ffi::Result<S32Vec> src_rank,
                        ffi::Result<S32Vec> out_token, ffi::Result<S32Vec> out_slot,
                        ffi::Result<F32Vec> out_weight, ffi::Result<S32Vec> expert_offsets,
                        ffi::Result<S32Vec> expert_counts, ffi::Result<S32Scalar> num_rows,
                        ffi::Result<S32Scalar> overflow, int64_t runtime_id, int64_t row_align,
                        double timeout_s, int64_t fault_absent_rank, int64_t fault_delay_rank,
                        int64_t fault_delay_ms) {
  const int EL = int(send_counts.dimensions()[1]);
  const int64_t m_cap = rows_of(*out_values), H = last_dim(values);
  if (runtime_id != 0) {
    const jsm::cuda::EpGeometry g{send_counts.dimensions()[0], EL, H, m_cap, rows_of(values)};
    const jsm::SendView send{ptr<uint8_t>(values), ptr<uint8_t>(scales), token.typed_data(),
                               slot.typed_data(), weight.typed_data(), send_counts.typed_data()};
    const jsm::LandedView out{
        ptr<uint8_t>(out_values),     ptr<uint8_t>(out_scales),        src_rank->typed_data(),
        out_token->typed_data(),      out_slot->typed_data(),          out_weight->typed_data(),
        expert_offsets->typed_data(), expert_counts->typed_data(),     num_rows->typed_data(),
        overflow->typed_data()};
    const std::string err = jsm::ep::dispatch(
        stream, runtime_id, g, send, out,
        jsm::DispatchOptions{row_align, timeout_s, fault_absent_rank, fault_delay_rank,
                         fault_delay_ms});
    return ep_error(err);
  }
  if (send_counts.dimensions()[0] != 1)
    return ffi::Error::InvalidArgument(
        "jax_sdma_moe dispatch (CUDA): engine 'local' moves rows within one GPU only (R = 1)");
  jsm::cuda::dispatch_local_kernel<<<grid_for(m_cap, 8), 256, (3 * EL + 1) * sizeof(int32_t),
                                     stream>>>(
      ptr<uint8_t>(values), ptr<uint8_t>(scales), token.typed_data(), slot.typed_data(),
      weight.typed_data(), send_counts.typed_data(), EL, H, m_cap, row_align,
      ptr<uint8_t>(out_values), ptr<uint8_t>(out_scales), src_rank->typed_data(),
      out_token->typed_data(), out_slot->typed_data(), out_weight->typed_data(),
      expert_offsets->typed_data(), expert_counts->typed_data(), num_rows->typed_data(),
      overflow->typed_data(), false);
  return last_error("dispatch");
}

// Engine local (R = 1), qpack and dispatch in one call: each row quantised once and stored
// straight at its landing row; then only the padding rows and the layout are written.
ffi::Error QpackLocalImpl(cudaStream_t stream, BF16Mat x, F32Mat weights, S32Mat send_pos,
                          S32Mat send_counts, ffi::Result<ffi::AnyBuffer> out_values,
                          ffi::Result<ffi::AnyBuffer> out_scales, ffi::Result<S32Vec> src_rank,
                          ffi::Result<S32Vec> out_token, ffi::Result<S32Vec> out_slot,
                          ffi::Result<F32Vec> out_weight, ffi::Result<S32Vec> expert_offsets,
                          ffi::Result<S32Vec> expert_counts, ffi::Result<S32Scalar> num_rows,
                          ffi::Result<S32Scalar> overflow, int64_t row_align) {
  JSM_RETURN_IF_ERROR(check_dtype(*out_values, ffi::DataType::F8E4M3FN, "qpack_local values"));
  if (send_counts.dimensions()[0] != 1)
    return ffi::Error::InvalidArgument("jax_sdma_moe qpack_local: one rank only (R = 1)");
  const int EL = int(send_counts.dimensions()[1]);
  const int64_t m_cap = rows_of(*out_values), H = x.dimensions()[1];
  JSM_RETURN_IF_ERROR(launch_pack<true>(
      stream, reinterpret_cast<const uint16_t*>(x.typed_data()), nullptr, nullptr, weights,
      send_pos, x.dimensions()[0], H, out_values, out_scales, out_token, out_slot, out_weight,
      jsm::cuda::LandingMap{send_counts.typed_data(), EL, row_align, m_cap}));
  jsm::cuda::dispatch_local_kernel<<<grid_for(m_cap, 8), 256, (3 * EL + 1) * sizeof(int32_t),
                                     stream>>>(
      nullptr, nullptr, nullptr, nullptr, nullptr, send_counts.typed_data(), EL, H, m_cap,
      row_align, ptr<uint8_t>(out_values), ptr<uint8_t>(out_scales), src_rank->typed_data(),
      out_token->typed_data(), out_slot->typed_data(), out_weight->typed_data(),
      expert_offsets->typed_data(), expert_counts->typed_data(), num_rows->typed_data(),
      overflow->typed_data(), true);
  return last_error("qpack_local");
}

// A stage's KB scale bytes of a row can be one cp.async when rows of scales keep them aligned.
bool scales_aligned(const jsm::cuda::Gemm1Args& g, int kb) {
  return (g.H / jsm::kBlock) % kb == 0 && reinterpret_cast<uintptr_t>(g.a_scales) % kb == 0 &&
         reinterpret_cast<uintptr_t>(g.w_scales) % kb == 0;
}

template <class Kernel>
void launch_persistent(Kernel kernel, int threads, int smem, const jsm::cuda::Gemm1Args& g,
                       int grid, cudaStream_t stream) {
  // per call: the attribute belongs to the current device's context
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kernel<<<grid, threads, smem, stream>>>(g);
}

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// A TMA map of a row-major byte matrix [rows, cols]: boxes of box_rows x 128 bytes, 128-byte
// swizzle (the K-major layout wgmma reads), zeros outside.
ffi::Error tensor_map(CUtensorMap* map, const void* base, int64_t cols, int64_t rows,
                      uint32_t box_rows) {
  static EncodeTiledFn encode =
      jsm::cuda::driver_function<EncodeTiledFn>("cuTensorMapEncodeTiled");
  if (!encode) return ffi::Error::Internal("jax_sdma_moe gemm1: no cuTensorMapEncodeTiled");
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols)};
  const cuuint32_t box[2] = {128, box_rows};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims,
                            strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return ffi::Error::Internal("jax_sdma_moe gemm1: cuTensorMapEncodeTiled failed (CUresult " +
                                std::to_string(int(r)) + ")");
  return ffi::Error::Success();
}

// g's rows, layout, weights and h outputs are set. Zeroes h's padding rows, then runs the
// persistent GEMM on `grid` CTAs (one per SM it may use).
ffi::Error launch_gemm1(jsm::cuda::Gemm1Args g, int grid, cudaStream_t stream) {
  namespace v1 = jsm::cuda::gemm1_v1;
  namespace v3 = jsm::cuda::gemm1_v3;
  const int64_t row_bytes = g.h_bf16 ? g.I * 2 : g.I;
  const int64_t scale_bytes = g.h_bf16 ? 0 : g.I / jsm::kBlock;
  jsm::cuda::zero_padding_rows_kernel<<<grid_for(g.m_cap, 8), 256, 2 * g.EL * sizeof(int32_t),
                                        stream>>>(
      g.offsets, g.counts, g.EL, g.m_cap, row_bytes,
      g.h_bf16 ? reinterpret_cast<uint8_t*>(g.h_bf16) : g.h_values, g.h_scales, scale_bytes);
  JSM_RETURN_IF_ERROR(last_error("gemm1 padding"));
  if (g.m_cap == 0) return ffi::Error::Success();
  const char* gemm_env = getenv("JSM_GEMM1");  // read per call: benchmarks switch it in-process
  const std::string gemm_choice = gemm_env ? gemm_env : "";
  // JSM_GEMM1 picks a kernel for comparisons (bench/kernel_variants.py): ws (the default where
  // H % 128 == 0: measured fastest, docs/PERF.md), ws-ksplit (tiles of <= 64 rows split their
  // K stages between the two consumer warpgroups), ws-nopromote / -nomma / -noload / -noscale
  // (its timing ablations: wrong results), wgmma, or v2 (mma.sync, any H % 32 == 0)
  if ((gemm_choice.empty() || gemm_choice.rfind("ws", 0) == 0) && g.H % 128 == 0) {
    namespace ws = jsm::cuda::gemm1_ws;
    CUtensorMap map_a0, map_a1, map_b;
    JSM_RETURN_IF_ERROR(tensor_map(&map_a0, g.epoch_counter ? g.slot_values[0] : g.a, g.H,
                                   g.m_cap, ws::kABoxRows));
    JSM_RETURN_IF_ERROR(tensor_map(&map_a1, g.epoch_counter ? g.slot_values[1] : g.a, g.H,
                                   g.m_cap, ws::kABoxRows));
    JSM_RETURN_IF_ERROR(
        tensor_map(&map_b, g.w, g.H, int64_t(g.EL) * 2 * g.I, jsm::cuda::gemm1_v1::BN));
    g.scales_aligned = scales_aligned(g, jsm::cuda::gemm1_v3::KB);
    auto kernel = gemm_choice == "ws-nopromote" ? ws::gemm1_ws_kernel<ws::kNoPromote>
                  : gemm_choice == "ws-nomma"   ? ws::gemm1_ws_kernel<ws::kNoMma>
                  : gemm_choice == "ws-noload"  ? ws::gemm1_ws_kernel<ws::kNoLoad>
                  : gemm_choice == "ws-noscale" ? ws::gemm1_ws_kernel<ws::kNoScale>
                  : gemm_choice == "ws-ksplit"  ? ws::gemm1_ws_kernel<ws::kFull, true>
                                                : ws::gemm1_ws_kernel<ws::kFull>;
    const int smem = ws::smem_bytes(gemm_choice == "ws-ksplit");
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    kernel<<<grid, ws::THREADS, smem, stream>>>(g, map_a0, map_a1, map_b);
  } else if (gemm_choice.rfind("wgmma", 0) == 0) {
    // JSM_GEMM1=wgmma (or wgmma5: 5 stages): one warpgroup role, CTA-wide barriers per stage
    g.scales_aligned = scales_aligned(g, v3::KB);
    if (gemm_choice == "wgmma5")
      launch_persistent(v3::gemm1_kernel<5>, v3::THREADS, v3::smem_bytes(5), g, grid, stream);
    else
      launch_persistent(v3::gemm1_kernel<4>, v3::THREADS, v3::smem_bytes(4), g, grid, stream);
  } else {
    // stage depth: JSM_GEMM1_KB=4 (128 B of K per row per stage, the default: measured 5-20%
    // faster on an H200, docs/PERF.md) or 8 (256 B)
    const char* kb_env = getenv("JSM_GEMM1_KB");
    if (kb_env && atoi(kb_env) == 8) {
      using C = v1::Cfg<8, 3>;
      g.scales_aligned = scales_aligned(g, C::KB);
      launch_persistent(v1::gemm1_kernel<C>, v1::THREADS, C::kSmemBytes, g, grid, stream);
    } else {
      using C = v1::Cfg<4, 4>;
      g.scales_aligned = scales_aligned(g, C::KB);
      launch_persistent(v1::gemm1_kernel<C>, v1::THREADS, C::kSmemBytes, g, grid, stream);
    }
  }
  return last_error("gemm1");
}

// The GEMM's weights, epilogue and h outputs (rets[0], and rets[1] for MX-fp8 scales).
ffi::Error gemm1_args(ffi::AnyBuffer w_values, ffi::AnyBuffer w_scales, int64_t H, int64_t m_cap,
                      bool has_limit, float swiglu_limit, ffi::RemainingRets& rets,
                      jsm::cuda::Gemm1Args* g) {
  JSM_RETURN_IF_ERROR(check_dtype(w_values, ffi::DataType::F8E4M3FN, "gemm1 weights"));
  const auto wd = w_values.dimensions();
  g->w = ptr<uint8_t>(w_values);
  g->w_scales = ptr<uint8_t>(w_scales);
  g->EL = int(wd[0]);
  g->I = wd[1] / 2;
  g->H = H;
  g->m_cap = m_cap;
  g->has_limit = has_limit;
  g->limit = swiglu_limit;
  if (g->EL > jsm::cuda::gemm1_v1::kMaxExperts)
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

ffi::Error Gemm1Impl(cudaStream_t stream, ffi::AnyBuffer a_values, ffi::AnyBuffer a_scales,
                     S32Vec expert_offsets, S32Vec expert_counts, ffi::AnyBuffer w_values,
                     ffi::AnyBuffer w_scales, ffi::RemainingRets rets, bool has_limit,
                     float swiglu_limit) {
  JSM_RETURN_IF_ERROR(check_dtype(a_values, ffi::DataType::F8E4M3FN, "gemm1 rows"));
  jsm::cuda::Gemm1Args g{};
  g.a = ptr<uint8_t>(a_values);
  g.a_scales = ptr<uint8_t>(a_scales);
  g.offsets = expert_offsets.typed_data();
  g.counts = expert_counts.typed_data();
  JSM_RETURN_IF_ERROR(gemm1_args(w_values, w_scales, last_dim(a_values), rows_of(a_values),
                                 has_limit, swiglu_limit, rets, &g));
  return launch_gemm1(g, num_sms(), stream);
}

// The fused GEMM of engines ce/sm: rows straight from the landing slot, each expert when its rows
// have landed.
std::string gemm_on_slot(const jsm::ep::SlotView& slot, void* stream, void* ctx) {
  jsm::cuda::Gemm1Args g = *static_cast<const jsm::cuda::Gemm1Args*>(ctx);
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
  ffi::Error e = launch_gemm1(g, slot.sms, static_cast<cudaStream_t>(stream));
  return e.success() ? "" : e.message();
}

// dispatch + gemm1 in one call (engines ce, sm): the GEMM overlaps the row copies.
ffi::Error DispatchGemm1Impl(cudaStream_t stream, ffi::AnyBuffer values, ffi::AnyBuffer scales,
                             S32Vec token, S32Vec slot, F32Vec weight, S32Mat send_counts,
                             S32Scalar rank, ffi::AnyBuffer w_values, ffi::AnyBuffer w_scales,
                             ffi::Result<S32Vec> src_rank, ffi::Result<S32Vec> out_token,
                             ffi::Result<S32Vec> out_slot, ffi::Result<F32Vec> out_weight,
                             ffi::Result<S32Vec> expert_offsets, ffi::Result<S32Vec> expert_counts,
                             ffi::Result<S32Scalar> num_rows, ffi::Result<S32Scalar> overflow,
                             ffi::RemainingRets rets, int64_t runtime_id, int64_t row_align,
                             double timeout_s, int64_t fault_absent_rank, int64_t fault_delay_rank,
                             int64_t fault_delay_ms, bool has_limit, float swiglu_limit) {
  JSM_RETURN_IF_ERROR(check_dtype(values, ffi::DataType::F8E4M3FN, "dispatch_gemm1 rows"));
  const int64_t H = last_dim(values), cap = src_rank->dimensions()[0];
  jsm::cuda::Gemm1Args g{};
  g.offsets = expert_offsets->typed_data();
  g.counts = expert_counts->typed_data();
  JSM_RETURN_IF_ERROR(
      gemm1_args(w_values, w_scales, H, cap, has_limit, swiglu_limit, rets, &g));
  const jsm::cuda::EpGeometry geo{send_counts.dimensions()[0], send_counts.dimensions()[1], H, cap,
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
  return ep_error(jsm::ep::dispatch(
      stream, runtime_id, geo, send, out,
      jsm::DispatchOptions{row_align, timeout_s, fault_absent_rank, fault_delay_rank, fault_delay_ms},
      gemm_on_slot, &g));
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmQpackLocalCuda, QpackLocalImpl,
                              jsm::sig::qpack_local(ffi::Ffi::Bind().Ctx<Stream>()));

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
