// Device helpers of the window engines' protocols (kernels/common/ep_window.h), one source for
// CUDA (engines ce, sm) and HIP (engine sdma): system-scope acquire / release of a flag, the
// clock of the bounded waits, the pause between polls, the record of an expired wait, and 16-byte
// and 8-byte loads of what another GPU may have stored.
#pragma once

#include <stdint.h>

#include "kernels/common/ep_window.h"
#include "kernels/common/gpu_compat.h"

namespace jsm {
namespace gpu {

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
#ifdef JSM_GPU_HIP
// The device's constant-rate wall clock (s_memrealtime): the unit of every HIP kernel's timeout,
// converted on the host from hipDeviceAttributeWallClockRate.
__device__ __forceinline__ uint64_t timer_now() { return uint64_t(wall_clock64()); }
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
// Between two polls of a flag (s_sleep 16: ~1000 clocks).
__device__ __forceinline__ void poll_pause() { __builtin_amdgcn_s_sleep(16); }
// Rows are read after a system-scope acquire, which invalidates the CU's caches: plain loads.
__device__ __forceinline__ uint4 load_cg(const uint4* p) { return *p; }
__device__ __forceinline__ int2 load_cg(const int2* p) { return *p; }
__device__ __forceinline__ void trap() { __builtin_trap(); }
#else
// The global timer, in ns: the unit of every CUDA kernel's timeout.
__device__ __forceinline__ uint64_t timer_now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void poll_pause() { __nanosleep(1000); }
// Through L2 only (a peer GPU may have stored the row after this SM's L1 saw the line).
__device__ __forceinline__ uint4 load_cg(const uint4* p) { return __ldcg(p); }
__device__ __forceinline__ int2 load_cg(const int2* p) { return __ldcg(p); }
__device__ __forceinline__ void trap() { __trap(); }
#endif

// Records the first expired wait (the code is written last, after a system fence), for the host
// to name rank, peer and epoch (ep_errors.h).
__device__ __forceinline__ void record_wait_error(EpError* err, uint32_t code, uint32_t peer,
                                                  uint32_t expert, uint32_t epoch) {
  volatile EpError* e = err;
  if (e->code != 0) return;
  e->peer = peer;
  e->expert = expert;
  e->epoch = epoch;
  __threadfence_system();
  e->code = code;
}
#endif

}  // namespace gpu
}  // namespace jsm
