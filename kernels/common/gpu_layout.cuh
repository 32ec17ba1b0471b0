// Block-wide helpers of the §4 landing layout on the device, for the CUDA and the HIP kernels
// (the arithmetic itself is kernels/common/layout.h, shared with the host): the local dispatch,
// the multi-GPU engines' layout and readout, gemm1's padding rows and its tile scheduler.
#pragma once

#include <stdint.h>

#include "kernels/common/gpu_compat.h"
#include "kernels/common/layout.h"

namespace jsm {
namespace gpu {

// dst[i] = value(0) + ... + value(i - 1) for i <= n (dst: n + 1 ints of shared memory). Every
// thread loads values at once; thread 0's serial pass then reads shared memory only (a serial
// walk over global memory pays a memory latency per element).
template <class Value>
__device__ __forceinline__ void exclusive_scan_smem(int n, int32_t* dst, Value value) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i + 1] = value(i);
  __syncthreads();
  if (threadIdx.x == 0) {
    dst[0] = 0;
    for (int i = 1; i <= n; ++i) dst[i] += dst[i - 1];
  }
  __syncthreads();
}

// §4 offsets of EL experts from per-expert totals (global or shared memory), in shared memory.
// All threads call it; the totals are staged in `counts` first (see exclusive_scan_smem).
__device__ __forceinline__ void landing_layout_smem(const int32_t* total, int EL, int64_t row_align,
                                                    int64_t m_cap, int32_t* offsets,
                                                    int32_t* counts, int32_t* dropped) {
  for (int e = threadIdx.x; e < EL; e += blockDim.x) counts[e] = total[e];
  __syncthreads();
  if (threadIdx.x == 0)
    *dropped = int32_t(landing_layout(counts, EL, row_align, m_cap, offsets, counts));
  __syncthreads();
}

// The expert whose landed rows hold `row`, or -1 for a padding row.
__device__ __forceinline__ int expert_of_row(const int32_t* offsets, const int32_t* counts, int EL,
                                             int64_t row) {
  int lo = 0, hi = EL - 1;  // last expert with offset <= row
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return (row >= offsets[lo] && row < offsets[lo] + counts[lo]) ? lo : -1;
}

}  // namespace gpu
}  // namespace jsm
