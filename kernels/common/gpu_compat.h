// The thin layer that lets one kernel source compile as CUDA (nvcc) and as HIP (clang -x hip, for
// AMD CDNA): the runtime header, the stream type, the wave width and the wave-level operations,
// and the launch sizes of the current device. Only what the shared sources use (gpu_stages.cuh,
// gpu_layout.cuh) lives here.
//
// The wave width differs: 32 lanes on NVIDIA, 64 on CDNA (gfx942, gfx950). Code that uses kWarp
// for its lane arithmetic and these shuffles (which span the whole wave) is correct for both.
#pragma once

#include <stdint.h>

#if defined(__HIPCC__) || defined(__HIP__)
#include <hip/hip_runtime.h>
#define JSM_GPU_HIP 1
#elif defined(__HIP_PLATFORM_AMD__)  // host C++ of the ROCm backend (ffi/rocm_handlers.cc)
#include <hip/hip_runtime_api.h>
#define JSM_GPU_HIP 1
#else
#include <cuda_runtime.h>
#endif

namespace jsm {
namespace gpu {

#ifdef JSM_GPU_HIP
using Stream = hipStream_t;
using Error = hipError_t;
constexpr Error kSuccess = hipSuccess;
constexpr int kWarp = 64;  // CDNA's wavefront (gfx942, gfx950); RDNA's wave32 is not a target
#else
using Stream = cudaStream_t;
using Error = cudaError_t;
constexpr Error kSuccess = cudaSuccess;
constexpr int kWarp = 32;
#endif

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
// Every lane of the wave takes part (the callers keep the whole wave converged).
#ifdef JSM_GPU_HIP
__device__ __forceinline__ int shfl_xor(int v, int lane_mask) { return __shfl_xor(v, lane_mask); }
__device__ __forceinline__ int shfl_up(int v, int delta) { return __shfl_up(v, delta); }
// Orders the wave's shared-memory accesses around an execution barrier of the wave (HIP's
// __syncwarp, which HIP declares only under HIP_ENABLE_WARP_SYNC_BUILTINS).
__device__ __forceinline__ void syncwarp() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
#else
__device__ __forceinline__ int shfl_xor(int v, int lane_mask) {
  return __shfl_xor_sync(0xFFFFFFFFu, v, lane_mask);
}
__device__ __forceinline__ int shfl_up(int v, int delta) {
  return __shfl_up_sync(0xFFFFFFFFu, v, delta);
}
__device__ __forceinline__ void syncwarp() { __syncwarp(); }
#endif

#ifdef JSM_GPU_HIP
__device__ __forceinline__ float shfl_xor(float v, int lane_mask) {
  return __shfl_xor(v, lane_mask);
}
#else
__device__ __forceinline__ float shfl_xor(float v, int lane_mask) {
  return __shfl_xor_sync(0xFFFFFFFFu, v, lane_mask);
}
#endif

// The sum of v over the wave (int, or float in a butterfly order), in every lane.
template <class T>
__device__ __forceinline__ T wave_sum(T v) {
  for (int o = kWarp / 2; o; o >>= 1) v += shfl_xor(v, o);
  return v;
}

// Lets `kernel` take `bytes` of dynamic shared memory (beyond the default 48 KB on CUDA).
template <class Kernel>
inline Error allow_dynamic_smem(Kernel kernel, size_t bytes) {
#ifdef JSM_GPU_HIP
  return hipFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                             hipFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
#else
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
#endif
}
#endif

// Runtime calls of the shared launchers.
inline Error memset_async(void* p, int byte, size_t n, Stream s) {
#ifdef JSM_GPU_HIP
  return hipMemsetAsync(p, byte, n, s);
#else
  return cudaMemsetAsync(p, byte, n, s);
#endif
}

inline Error memcpy_device_to_device_async(void* dst, const void* src, size_t n, Stream s) {
#ifdef JSM_GPU_HIP
  return hipMemcpyAsync(dst, src, n, hipMemcpyDeviceToDevice, s);
#else
  return cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s);
#endif
}

inline Error memcpy_device_to_host_async(void* dst, const void* src, size_t n, Stream s) {
#ifdef JSM_GPU_HIP
  return hipMemcpyAsync(dst, src, n, hipMemcpyDeviceToHost, s);
#else
  return cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s);
#endif
}

inline Error stream_synchronize(Stream s) {
#ifdef JSM_GPU_HIP
  return hipStreamSynchronize(s);
#else
  return cudaStreamSynchronize(s);
#endif
}

// The runtime's last error (cleared), or kSuccess, and its name.
inline Error last_error() {
#ifdef JSM_GPU_HIP
  return hipGetLastError();
#else
  return cudaGetLastError();
#endif
}
inline const char* error_string(Error e) {
#ifdef JSM_GPU_HIP
  return hipGetErrorString(e);
#else
  return cudaGetErrorString(e);
#endif
}

// The current device's multiprocessors (SMs on NVIDIA, CUs on AMD), cached per device.
inline int num_sms() {
  static int cached[64] = {};
  int dev = 0, n = 0;
#ifdef JSM_GPU_HIP
  (void)hipGetDevice(&dev);
  if (dev < 64 && cached[dev]) return cached[dev];
  (void)hipDeviceGetAttribute(&n, hipDeviceAttributeMultiprocessorCount, dev);
#else
  cudaGetDevice(&dev);
  if (dev < 64 && cached[dev]) return cached[dev];
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
#endif
  if (dev < 64) cached[dev] = n;
  return n;
}

// Blocks for `items` work items, `per_block` each, at most 16 blocks per multiprocessor
// (grid-stride loops).
inline int grid_for(int64_t items, int per_block) {
  int64_t blocks = (items + per_block - 1) / per_block;
  int64_t cap = int64_t(num_sms()) * 16;
  return int(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

}  // namespace gpu
}  // namespace jsm
