// The CUDA engines' (`ce`, `sm`) view of the symmetric landing window: its layout and protocol
// (kernels/common/ep_window.h, shared with ROCm's engine sdma) named in jsm::cuda, and their device
// helpers (PTX: system-scope acquire/release, the global timer).
#pragma once

#include <stdint.h>

#include "kernels/common/ep_window.h"

namespace jsm {
namespace cuda {

using jsm::align_up;
using jsm::at;
using jsm::ep_window_layout;
using jsm::epoch_reached;
using jsm::EpError;
using jsm::EpWindowLayout;
using jsm::kMaxRanks;
using jsm::PeerTable;
using jsm::RowHeader;

#ifdef __CUDACC__
__device__ __forceinline__ uint64_t globaltimer_ns() {
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


// Records the first expired wait (the code is written last, after a system fence).
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

}  // namespace cuda
}  // namespace jsm
