// Device helpers of the window engines' protocols (kernels/common/ep_window.h), one source for
// CUDA (engines ce, sm) and HIP (engine sdma): system-scope acquire / release of a flag, the
// clock of the bounded waits, the pause between polls, the record of an expired wait, a block's
// bounded wait for a set of flags, and 16-byte and 8-byte loads of what another GPU may have
// stored.
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

// Who a flag stands for in an expired wait's record (ep_errors.h: peer, expert).
struct WaitWho {
  uint32_t peer, expert;
};

// Every thread of a block calls it: waits (bounded) until flags[i] has reached `epoch` for every
// i < n. The first kPollers threads poll (0: every thread; one warp keeps a grid of blocks from
// flooding L2 with system-scope loads while the rows they wait for are still being stored), with
// pause() between polls. True once all have. False once `timeout` (timer_now()'s unit) has passed,
// the first missing i recorded as `code` with who(i); with kStopIfFailed, false also at the first
// miss if a wait of this call already ran out (err->code != 0: host memory, read once, not by
// every block at every poll): the call is failed, and waiting again would only delay the error.
template <int kPollers, bool kStopIfFailed, class N, class Who, class Pause>
__device__ __forceinline__ bool wait_flags_block(const uint32_t* flags, N n, uint32_t epoch,
                                                 uint64_t timeout, EpError* err, uint32_t code,
                                                 Who who, Pause pause) {
  const uint64_t deadline = timer_now() + timeout;
  for (bool first = true;; first = false) {
    bool ok = true;
    int missing = -1;
    if constexpr (kPollers == 0) {
      for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (!epoch_reached(ld_acquire_sys(flags + i), epoch)) ok = false, missing = i;
    } else {
      for (int i = threadIdx.x; i < n && threadIdx.x < kPollers; i += kPollers)
        if (!epoch_reached(ld_acquire_sys(flags + i), epoch)) ok = false, missing = i;
    }
    if (__syncthreads_and(ok)) return true;
    if (kStopIfFailed && first &&
        __syncthreads_or(threadIdx.x == 0 && static_cast<volatile EpError*>(err)->code != 0))
      return false;
    if (__syncthreads_or(threadIdx.x == 0 && timer_now() > deadline)) {
      if (missing >= 0) {
        const WaitWho w = who(missing);
        record_wait_error(err, code, w.peer, w.expert, epoch);
      }
      return false;
    }
    pause();
  }
}
#endif

}  // namespace gpu
}  // namespace jsm
