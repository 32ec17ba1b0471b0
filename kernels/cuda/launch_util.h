// Host helpers of every CUDA launcher (kernels/cuda, ffi/cuda_handlers.cu): launch sizes for the
// current device, and driver functions found at run time.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/gpu_compat.h"

namespace jsm {
namespace cuda {

// launch sizes of the current device (kernels/common/gpu_compat.h, shared with the HIP launchers)
using gpu::grid_for;
using gpu::num_sms;

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
