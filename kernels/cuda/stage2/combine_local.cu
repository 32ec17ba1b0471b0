// Stage2's combine within one rank (combine_local.h).
#include "kernels/cuda/stage2/combine_local.h"

#include <algorithm>

#include "kernels/cuda/stage2/sum_slots.cuh"

namespace jsm {
namespace cuda {
namespace {

constexpr int kThreads = 256, kCols = kSumCols;

__global__ void index_rows(const CombineLocalArgs a) {
  const CombineView& in = a.in;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < in.m_cap;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (in.src_rank[i] < 0) continue;
    const int32_t t = in.token[i], k = in.slot[i];
    if (t < 0 || t >= in.T || k < 0 || k >= in.K) __trap();  // not a header of this combine
    if (atomicCAS(&a.row_of[int64_t(t) * in.K + k], -1, int32_t(i)) != -1) __trap();  // twice
  }
}

// y[t, c .. c + 7] for t = blockIdx.x (tokens on x: up to 2^31 - 1), c = kCols * (blockIdx.y *
// kThreads + threadIdx.x)
__global__ void __launch_bounds__(kThreads) sum_rows(const CombineLocalArgs a) {
  const CombineView& in = a.in;
  const int64_t t = blockIdx.x, c = kCols * (int64_t(blockIdx.y) * kThreads + threadIdx.x);
  if (c >= in.H) return;
  sum_slots(in.K, [&](int64_t k, const uint16_t*& row, float& w) {
    const int32_t i = a.row_of[t * in.K + k];
    if (i < 0) return false;
    row = in.rows + int64_t(i) * in.H + c;
    w = in.weight[i];
    return true;
  }, in.y + t * in.H + c);
}

}  // namespace

std::string launch_combine_local(const CombineLocalArgs& a, cudaStream_t stream) {
  const CombineView& in = a.in;
  if (in.H % kCols != 0) return "jax_sdma_moe combine (CUDA): H must be a multiple of 8";
  if (in.T > 0) {
    cudaMemsetAsync(a.row_of, 0xFF, size_t(in.T * in.K) * sizeof(int32_t), stream);
    if (in.m_cap > 0)
      index_rows<<<unsigned(std::min<int64_t>((in.m_cap + kThreads - 1) / kThreads, 1024)),
                   kThreads, 0, stream>>>(a);
    const dim3 grid(unsigned(in.T), unsigned((in.H / kCols + kThreads - 1) / kThreads));
    sum_rows<<<grid, kThreads, 0, stream>>>(a);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? "" : std::string("jax_sdma_moe combine (CUDA): ") +
                                       cudaGetErrorString(err);
}

}  // namespace cuda
}  // namespace jsm
