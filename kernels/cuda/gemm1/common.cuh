// Device helpers both GEMM1 kernels share: cp.async copies into shared memory, and the epilogue
// (SwiGLU, then bf16 or MX-fp8 stores of one 32-column MX block of h).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/common/mxfp8.h"
#include "kernels/cuda/gemm1/args.h"

namespace jsm {
namespace cuda {
namespace gemm1 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int N>
__device__ __forceinline__ void cp_async_small(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src),
               "n"(N), "r"(valid ? N : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float swiglu(float g, float u, bool has_limit, float limit) {
  if (has_limit) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
  }
  // The hardware's approximate exp2 and reciprocal, no branch: the IEEE forms (__frcp_rn, __expf
  // without ftz) branch per value, which serialised the epilogue's 64 values per thread (the
  // tensor pipe idles through it); within DESIGN §3's tolerance. Where exp(-g) overflows, r = 0:
  // -0 * u, as g / (1 + exp(-g)) gives.
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return g * r * u;
}

// bf16x2 of two float32 (RNE; lo in the low half), one instruction.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// The maximum |value| of an MX block whose kN values per thread are spread over kLanes
// consecutive lanes (all of them must call), and whether all are finite.
template <int kLanes, int kN>
__device__ __forceinline__ void block_amax(const float* v, float& amax, bool& finite) {
  amax = 0.0f;
  finite = true;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    amax = fmaxf(amax, fabsf(v[i]));
    finite &= isfinite(v[i]);
  }
#pragma unroll
  for (int o = 1; o < kLanes; o <<= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    finite = __shfl_xor_sync(0xFFFFFFFFu, int(finite), o) && finite;
  }
}

// Two values of a block as e4m3 bytes (lo in the low byte), times the block's quantisation
// multiplier; every value NaN where the block holds a non-finite one (DESIGN §3).
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi, float mul, bool finite) {
  if (!finite) return uint32_t(kValueNaN) * 0x0101u;
  return uint32_t(f32_to_e4m3fn(lo * mul)) | uint32_t(f32_to_e4m3fn(hi * mul)) << 8;
}

// One row's 32-column MX block of h, this thread's 8 values v[n][c] at columns n * 8 + tig * 2 + c:
// bf16 stores, or MX-fp8 with the block maximum reduced over the quad (all 4 lanes must call).
__device__ __forceinline__ void store_block(const Gemm1Args& g, int64_t row, int64_t col0,
                                            bool valid, const float (&v)[4][2], int tig) {
  if (g.h_bf16) {
    if (!valid) return;
#pragma unroll
    for (int n = 0; n < 4; ++n)
      *reinterpret_cast<uint32_t*>(g.h_bf16 + row * g.I + col0 + n * 8 + tig * 2) =
          pack_bf16x2(v[n][0], v[n][1]);
    return;
  }
  float amax;
  bool finite;
  block_amax<4, 8>(&v[0][0], amax, finite);
  if (!valid) return;
  const uint32_t e = finite ? e8m0_for_amax(amax) : kScaleNaN;
  const float mul = quant_multiplier(e);
#pragma unroll
  for (int n = 0; n < 4; ++n)
    *reinterpret_cast<uint16_t*>(g.h_values + row * g.I + col0 + n * 8 + tig * 2) =
        uint16_t(e4m3x2(v[n][0], v[n][1], mul, finite));
  if (tig == 0) g.h_scales[row * (g.I / kBlock) + col0 / kBlock] = uint8_t(e);
}

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
