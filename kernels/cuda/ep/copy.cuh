// Block-cooperative copies of the engines' kernels (kernels.cuh, combine.cu): rows within a GPU
// or to a peer's window.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace jsm {
namespace cuda {

// Block-cooperative copy of n bytes at the widest width both ends' alignment allows. The 16-byte
// path keeps U loads in flight per thread before their stores (a load after a store to memory
// that may alias would otherwise wait for it: one load in flight per thread).
constexpr int kCopyUnroll = 4;
template <int U = kCopyUnroll>
__device__ __forceinline__ void block_copy(uint8_t* __restrict__ dst,
                                           const uint8_t* __restrict__ src, int64_t n) {
  const uintptr_t mis = (reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         uintptr_t(n));
  if ((mis & 15) == 0) {
    uint4* __restrict__ d = reinterpret_cast<uint4*>(dst);
    const uint4* __restrict__ s = reinterpret_cast<const uint4*>(src);
    const int64_t n16 = n / 16, step = int64_t(blockDim.x) * U;
    int64_t i = threadIdx.x;
    for (; i + (U - 1) * int64_t(blockDim.x) < n16; i += step) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = __ldcg(s + i + u * int64_t(blockDim.x));
#pragma unroll
      for (int u = 0; u < U; ++u) d[i + u * int64_t(blockDim.x)] = v[u];
    }
    for (; i < n16; i += blockDim.x) d[i] = __ldcg(s + i);
  } else if ((mis & 3) == 0) {
    for (int64_t i = threadIdx.x; i < n / 4; i += blockDim.x)
      reinterpret_cast<uint32_t*>(dst)[i] = __ldcg(reinterpret_cast<const unsigned int*>(src) + i);
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }
}

// One row's scale bytes (a meta row's start at 16 bytes, and a scales row, are 16-byte aligned
// where HS is a multiple of 16, as at every shape of jsm.SHAPES).
__device__ __forceinline__ void copy_scale_row(uint8_t* dst, const uint8_t* src, int64_t HS) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | uintptr_t(HS)) &
       15) == 0) {
    for (int64_t c = 0; c < HS / 16; ++c)
      reinterpret_cast<uint4*>(dst)[c] = __ldcg(reinterpret_cast<const uint4*>(src) + c);
  } else {
    for (int64_t c = 0; c < HS; ++c) dst[c] = src[c];
  }
}

}  // namespace cuda
}  // namespace jsm
