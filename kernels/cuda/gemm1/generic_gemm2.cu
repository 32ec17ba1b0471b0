// GEMM2 where the bf16-route kernel does not apply (its depth not a multiple of 512 or its output
// columns not of 256: the small test shapes): a correctness fallback, not a fast path. One block
// per landed row: the row dequantised into shared memory (DESIGN §3: exact values in float32), then
// one warp per output column at a time, its lanes over K and a float32 sum across the warp.
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/common/mxfp8.h"
#include "kernels/cuda/gemm1/args.h"
#include "kernels/cuda/gemm1/kernels.h"

namespace jsm {
namespace cuda {
namespace gemm1 {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;

// The expert whose rows [offsets[e], offsets[e] + counts[e]) hold row r, or -1 (a padding row).
__device__ int expert_of_row(const Gemm1Args& g, int64_t r) {
  int lo = 0, hi = g.EL - 1;  // last expert starting at or before r (offsets ascend, §4)
  if (g.EL == 0 || g.offsets[0] > r) return -1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (g.offsets[mid] <= r) lo = mid; else hi = mid - 1;
  }
  // experts with no rows share their offset with the next: the last one at r is the one with r
  return r < int64_t(g.offsets[lo]) + g.counts[lo] ? lo : -1;
}

__global__ void __launch_bounds__(kThreads) generic_gemm2(const Gemm1Args g) {
  extern __shared__ float row[];  // [g.H]
  const int64_t r = blockIdx.x;
  const int e = expert_of_row(g, r);
  if (e < 0) return;  // padding: zeroed before the launch
  const int64_t K = g.H, KS = K / kBlock;
  for (int64_t k = threadIdx.x; k < K; k += kThreads)
    row[k] = e4m3fn_to_f32(g.a[r * K + k]) * e8m0_to_f32(g.a_scales[r * KS + k / kBlock]);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t n = warp; n < g.I; n += kWarps) {
    const int64_t w_row = int64_t(e) * g.I + n;
    const uint8_t* w = g.w + w_row * K;
    const uint8_t* ws = g.w_scales + w_row * KS;
    float acc = 0.0f;
    for (int64_t k = lane; k < K; k += 32)
      acc = fmaf(row[k], e4m3fn_to_f32(w[k]) * e8m0_to_f32(ws[k / kBlock]), acc);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, off);
    if (lane == 0) g.h_bf16[r * g.I + n] = f32_to_bf16(acc);
  }
}

}  // namespace

void launch_generic_gemm2(const Gemm1Args& g, cudaStream_t stream) {
  const size_t smem = size_t(g.H) * sizeof(float);
  cudaFuncSetAttribute(generic_gemm2, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  generic_gemm2<<<unsigned(g.m_cap), kThreads, smem, stream>>>(g);
}

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
