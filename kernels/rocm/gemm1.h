// GEMM1 + SwiGLU and GEMM2 on ROCm (DESIGN.md §3): the FlyDSL kernel of kernels/rocm/flydsl/
// gemm1.py (gfx950: MX-scaled MFMA; gfx942: its fp8 MFMA reads e4m3fnuz, so the kernel converts
// the contract's e4m3fn bytes), with and without SwiGLU, one code object per target linked into
// the extension and chosen by the device's gcnArchName. launch_gemm1 and launch_gemm2
// (kernels/rocm/flydsl_calls.cc) adapt them; they exist in builds where those objects were built
// (JSM_ROCM_FLYDSL).
#pragma once

#include <hip/hip_runtime_api.h>

#include <stdint.h>

#include <string>

#include "kernels/common/gpu_stage2.h"
#include "kernels/common/options.h"
#include "kernels/rocm/sdma/engine.h"

namespace jsm {
namespace rocm {

struct Gemm1Call {
  // landed rows (§4 layout): values [m_cap, H], scales [m_cap, H/32]; expert offsets and counts
  const uint8_t* a;
  const uint8_t* a_scales;
  const int32_t* offsets;
  const int32_t* counts;
  // this rank's experts: values [EL, 2I, H], scales [EL, 2I, H/32]
  const uint8_t* w;
  const uint8_t* w_scales;
  int EL;
  int64_t I, H, m_cap;
  // h: bf16 [m_cap, I], or MX-fp8 values [m_cap, I] and scales [m_cap, I/32]
  uint16_t* h_bf16;
  uint8_t* h_values;
  uint8_t* h_scales;
  Gemm1Options opt;
  // fused with engine sdma: the landing slot, read per expert as its rows land (null: the rows
  // are `a`)
  const sdma::SlotView* slot;
};

// Enqueues GEMM1 on `stream` for the device's architecture (its padding rows are the caller's);
// "" or an error.
std::string launch_gemm1(const Gemm1Call& c, hipStream_t stream);

// Enqueues GEMM2 (g.y's padding rows are the caller's) on `stream`; "" or an error.
std::string launch_gemm2(const gpu::Gemm2Rows& g, hipStream_t stream);

}  // namespace rocm
}  // namespace jsm
