// The FlyDSL kernels' exported C functions (kernels/rocm/flydsl/, one object per target, each
// embedding its code object) behind the contracts the handlers use: GEMM1 and GEMM2
// (kernels/rocm/gemm1.h) and engine sdma's dispatch kernel (kernels/rocm/sdma/puts.h). The target
// is the current device's gcnArchName ("gfx950:sramecc+:xnack-" -> gfx950); each call loads its
// module on the device the first time (the exports' call_auto). Compiled where those objects were
// built (JSM_ROCM_FLYDSL), against their generated headers.
#include <hip/hip_runtime_api.h>

#include <mutex>
#include <string>

#include "gemm1_gfx942.h"
#include "gemm1_gfx950.h"
#include "gemm2_gfx942.h"
#include "gemm2_gfx950.h"
#include "kernels/common/gpu_compat.h"
#include "kernels/rocm/gemm1.h"
#include "kernels/rocm/sdma/puts.h"
#include "sdma_dispatch_gfx942.h"
#include "sdma_dispatch_gfx950.h"

namespace jsm {
namespace {

constexpr int kMaxDevices = 64;
constexpr int64_t kMaxSegments = 2048;  // R * EL: the dispatch kernel's segment table (in LDS)

// The current device's target ("gfx942", "gfx950", ...), or "" if the runtime cannot tell.
std::string device_arch() {
  static std::mutex mu;
  static std::string cached[kMaxDevices];
  int dev = 0;
  if (hipGetDevice(&dev) != hipSuccess || dev < 0 || dev >= kMaxDevices) return "";
  std::lock_guard<std::mutex> lock(mu);
  if (cached[dev].empty()) {
    hipDeviceProp_t p;
    if (hipGetDeviceProperties(&p, dev) != hipSuccess) return "";
    const std::string name(p.gcnArchName);
    cached[dev] = name.substr(0, name.find(':'));
  }
  return cached[dev];
}

std::string launch_status(const char* what, int32_t status, const std::string& arch) {
  if (status == 0) return "";
  return std::string("jax_sdma_moe ") + what + " (FlyDSL, " + arch + "): launch failed (" +
         std::to_string(status) + ")";
}

std::string no_build(const char* what, const std::string& arch) {
  return std::string("jax_sdma_moe ") + what + ": no FlyDSL build for this device's target '" +
         arch + "' (built: gfx942, gfx950)";
}

// gemm1.py's kernel for this device's target with SwiGLU (GEMM1) or without (GEMM2): the four
// exports take the same arguments. "" or an error.
template <class... Args>
std::string call_gemm(const char* what, bool swiglu, Args... args) {
  const std::string arch = device_arch();
  int32_t status;
  if (arch == "gfx950")
    status = swiglu ? gemm1_gfx950_call_auto(args...) : gemm2_gfx950_call_auto(args...);
  else if (arch == "gfx942")
    status = swiglu ? gemm1_gfx942_call_auto(args...) : gemm2_gfx942_call_auto(args...);
  else
    return no_build(what, arch);
  return launch_status(what, status, arch);
}

}  // namespace

namespace rocm {

std::string launch_gemm1(const Gemm1Call& c, hipStream_t stream) {
  const sdma::SlotView* s = c.slot;
  void* a0 = const_cast<uint8_t*>(s ? s->values[0] : c.a);
  void* a1 = const_cast<uint8_t*>(s ? s->values[1] : c.a);
  void* as0 = const_cast<uint8_t*>(s ? s->scales[0] : c.a_scales);
  void* as1 = const_cast<uint8_t*>(s ? s->scales[1] : c.a_scales);
  void* offsets = const_cast<int32_t*>(c.offsets);
  void* counts = const_cast<int32_t*>(c.counts);
  void* w = const_cast<uint8_t*>(c.w);
  void* ws = const_cast<uint8_t*>(c.w_scales);
  void* h = c.h_bf16 ? static_cast<void*>(c.h_bf16) : static_cast<void*>(c.h_values);
  void* hs = c.h_bf16 ? nullptr : static_cast<void*>(c.h_scales);  // null: bf16 h
  void* epoch = const_cast<uint32_t*>(s ? s->epoch_counter : nullptr);
  void* arrival0 = const_cast<uint32_t*>(s ? s->arrival[0] : nullptr);
  void* arrival1 = const_cast<uint32_t*>(s ? s->arrival[1] : nullptr);
  const int32_t ranks = s ? s->R : 0;
  const int64_t ticks = s ? int64_t(s->timeout_ticks) : 0;
  void* err = s ? static_cast<void*>(s->err) : nullptr;
  const int32_t blocks = s ? s->cus : gpu::num_sms();
  // h's padding rows are written by the caller (kernels/common/gpu_stages.h, the bytes CUDA
  // writes), so zero_padding = 0
  return call_gemm("gemm1", true, a0, a1, as0, as1, offsets, counts, w, ws, h, hs, c.EL,
                   int32_t(c.H), int32_t(c.I), int32_t(c.m_cap), int32_t(c.opt.has_limit),
                   c.opt.swiglu_limit, int32_t(0), epoch, arrival0, arrival1, ranks, ticks, err,
                   blocks, stream);
}

std::string launch_gemm2(const gpu::Gemm2Rows& g, hipStream_t stream) {
  // the kernel's depth H is GEMM2's K, its output columns I are N; bf16 y (no scales), no limit,
  // not fused, y's padding rows the caller's (zero_padding = 0)
  void* a = const_cast<uint8_t*>(g.a);
  void* as = const_cast<uint8_t*>(g.a_scales);
  return call_gemm("gemm2", false, a, a, as, as, const_cast<int32_t*>(g.offsets),
                   const_cast<int32_t*>(g.counts), const_cast<uint8_t*>(g.w),
                   const_cast<uint8_t*>(g.w_scales), static_cast<void*>(g.y),
                   static_cast<void*>(nullptr), int32_t(g.EL), int32_t(g.K), int32_t(g.N),
                   int32_t(g.m_cap), int32_t(0), 0.0f, int32_t(0), static_cast<void*>(nullptr),
                   static_cast<void*>(nullptr), static_cast<void*>(nullptr), int32_t(0),
                   int64_t(0), static_cast<void*>(nullptr), gpu::num_sms(), stream);
}

}  // namespace rocm

namespace sdma {

std::string launch_puts(const PutArgs& a, hipStream_t stream) {
  if (int64_t(a.R) * a.EL > kMaxSegments)
    return "jax_sdma_moe dispatch (sdma): ranks x local experts = " +
           std::to_string(int64_t(a.R) * a.EL) + " exceeds " + std::to_string(kMaxSegments) +
           " (the dispatch kernel's segment table)";
  const std::string arch = device_arch();
  const SdmaWindowLayout& L = a.L;
  const int64_t comm = int64_t(reinterpret_cast<uintptr_t>(a.dev_comm));
  const int64_t window = int64_t(reinterpret_cast<uintptr_t>(a.window));
  void* counts = const_cast<int32_t*>(a.send_counts);
  void* epoch = const_cast<uint32_t*>(a.epoch_counter);
  int32_t status;
  if (arch == "gfx950")
    status = sdma_dispatch_gfx950_call_auto(
        comm, window, counts, epoch, a.err, a.rank, a.R, a.EL, a.H, a.m_cap, a.row_align,
        a.num_queues, a.timeout_ticks, L.ep.values[0], L.ep.scales[0], L.ep.headers[0],
        L.ep.plan[0], L.ep.plan_flag[0], L.ep.seg_flag[0], L.parity_stride, L.send_values,
        L.send_scales, L.ep.send_headers, L.send_counts, L.epoch_word, a.num_blocks, stream);
  else if (arch == "gfx942")
    status = sdma_dispatch_gfx942_call_auto(
        comm, window, counts, epoch, a.err, a.rank, a.R, a.EL, a.H, a.m_cap, a.row_align,
        a.num_queues, a.timeout_ticks, L.ep.values[0], L.ep.scales[0], L.ep.headers[0],
        L.ep.plan[0], L.ep.plan_flag[0], L.ep.seg_flag[0], L.parity_stride, L.send_values,
        L.send_scales, L.ep.send_headers, L.send_counts, L.epoch_word, a.num_blocks, stream);
  else
    return no_build("dispatch (sdma)", arch);
  return launch_status("dispatch (sdma)", status, arch);
}

}  // namespace sdma
}  // namespace jsm
