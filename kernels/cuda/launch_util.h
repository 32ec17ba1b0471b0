// Host helpers of every CUDA launcher (kernels/cuda, ffi/cuda_handlers.cu): launch sizes for the
// current device, and driver functions found at run time.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jsm {
namespace cuda {

inline int num_sms() {
  static int cached[64] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 64 && cached[dev]) return cached[dev];
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  if (dev < 64) cached[dev] = n;
  return n;
}

// Blocks for `items` work items, `per_block` each, at most 16 blocks per SM (grid-stride loops).
inline int grid_for(int64_t items, int per_block) {
  int64_t blocks = (items + per_block - 1) / per_block;
  int64_t cap = int64_t(num_sms()) * 16;
  return int(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

// A driver API function by name (the static runtime links no libcuda; the driver is found at run
// time), or null.
template <class Fn>
Fn driver_function(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess)
    return nullptr;
  return reinterpret_cast<Fn>(p);
}

}  // namespace cuda
}  // namespace jsm
