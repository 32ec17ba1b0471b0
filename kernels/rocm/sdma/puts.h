// Engine `sdma`: the contract of the FlyDSL dispatch kernel (step 2 of kernels/rocm/sdma/window.h;
// kernels/rocm/flydsl/sdma_dispatch.py, over mori's CCO device API, one code object per target).
// launch_puts adapts it (kernels/rocm/flydsl_calls.cc, compiled where those objects were built:
// JSM_ROCM_FLYDSL).
#pragma once

#include <hip/hip_runtime_api.h>

#include <string>

#include "kernels/rocm/sdma/window.h"

namespace jsm {
namespace sdma {

struct PutArgs {
  void* dev_comm;  // mori::cco::ccoDevComm* in device memory (ccoDevCommCopyToDevice)
  void* window;    // this rank's mori::cco::ccoWindow_t: source and (through the LSA mapping of
                   // each peer) destination of every put
  const int32_t* send_counts;  // XLA's send counts [R * EL] (the kernel stages them)
  const uint32_t* epoch_counter;  // the call's epoch (device memory, sdma_begin_kernel's)
  EpError* err;                   // the first expired wait
  int32_t rank, R, EL, H, m_cap, row_align;
  int32_t num_queues;  // SDMA queues per peer of the device communicator
  int64_t timeout_ticks;  // device wall-clock ticks
  SdmaWindowLayout L;  // byte offsets in the window
  int32_t num_blocks;  // block 0 drives the SDMA queues, the others copy the own segments
};

// Enqueues the dispatch kernel on `stream` for the device's architecture; "" or an error.
std::string launch_puts(const PutArgs& a, hipStream_t stream);

}  // namespace sdma
}  // namespace jsm
