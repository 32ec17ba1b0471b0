// Stage2's combine within one rank (combine_local.h).
#include "kernels/cuda/stage2/combine_local.h"

#include <algorithm>

#include "kernels/common/mxfp8.h"

namespace jsm {
namespace cuda {
namespace {

constexpr int kThreads = 256, kCols = 8;  // columns per thread: one 16-byte load of a row

__global__ void index_rows(const CombineLocalArgs a) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < a.m_cap;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (a.src_rank[i] < 0) continue;
    const int32_t t = a.token[i], k = a.slot[i];
    if (t < 0 || t >= a.T || k < 0 || k >= a.K) __trap();  // not a header of this combine
    if (atomicCAS(&a.row_of[int64_t(t) * a.K + k], -1, int32_t(i)) != -1) __trap();  // twice
  }
}

// y[t, c .. c + 7] for t = blockIdx.x (tokens on x: up to 2^31 - 1), c = kCols * (blockIdx.y *
// kThreads + threadIdx.x)
__global__ void __launch_bounds__(kThreads) sum_rows(const CombineLocalArgs a) {
  const int64_t t = blockIdx.x, c = kCols * (int64_t(blockIdx.y) * kThreads + threadIdx.x);
  if (c >= a.H) return;
  float acc[kCols] = {};
  for (int64_t k = 0; k < a.K; ++k) {
    const int32_t i = a.row_of[t * a.K + k];
    if (i < 0) continue;
    const float w = a.weight[i];
    const uint4 v = *reinterpret_cast<const uint4*>(a.rows + int64_t(i) * a.H + c);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < kCols; ++j)
      acc[j] = fmaf(w, bf16_to_f32(uint16_t(words[j / 2] >> (16 * (j % 2)))), acc[j]);
  }
  uint32_t out[4];
#pragma unroll
  for (int q = 0; q < 4; ++q)
    out[q] = uint32_t(f32_to_bf16(acc[2 * q])) | uint32_t(f32_to_bf16(acc[2 * q + 1])) << 16;
  *reinterpret_cast<uint4*>(a.y + t * a.H + c) = make_uint4(out[0], out[1], out[2], out[3]);
}

}  // namespace

std::string launch_combine_local(const CombineLocalArgs& a, cudaStream_t stream) {
  if (a.H % kCols != 0) return "jax_sdma_moe combine (CUDA): H must be a multiple of 8";
  if (a.T > 0) {
    cudaMemsetAsync(a.row_of, 0xFF, size_t(a.T * a.K) * sizeof(int32_t), stream);
    if (a.m_cap > 0)
      index_rows<<<unsigned(std::min<int64_t>((a.m_cap + kThreads - 1) / kThreads, 1024)),
                   kThreads, 0, stream>>>(a);
    const dim3 grid(unsigned(a.T), unsigned((a.H / kCols + kThreads - 1) / kThreads));
    sum_rows<<<grid, kThreads, 0, stream>>>(a);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? "" : std::string("jax_sdma_moe combine (CUDA): ") +
                                       cudaGetErrorString(err);
}

}  // namespace cuda
}  // namespace jsm
