// Host helpers of every CUDA launcher (kernels/cuda, ffi/cuda_handlers.cu): launch sizes for the
// current device, and driver functions found at run time.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
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

// Loads kernels into the current device's context now, before any of them is launched. Under
// CUDA's lazy loading (the default since CUDA 12) a kernel's first launch may wait for the
// context to go idle, which never happens while a kernel already running spins for a peer whose
// progress needs this very launch (engine ce's placement waits for the peer's copies, which the
// peer enqueues after launching its fused GEMM). Each call site loads what it launches, once per
// device (`loaded`: a bit per device ordinal).
template <class... Kernels>
cudaError_t load_kernels_once(std::atomic<uint64_t>& loaded, Kernels... kernels) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (e != cudaSuccess || (loaded.load() & bit)) return e;
  cudaFuncAttributes attr;
  ((e = e == cudaSuccess ? cudaFuncGetAttributes(&attr, kernels) : e), ...);
  if (e == cudaSuccess) loaded.fetch_or(bit);
  return e;
}

}  // namespace cuda
}  // namespace jsm
