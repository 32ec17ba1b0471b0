// What one call of the ce/sm engines hands its kernels and host steps: the rank's window table,
// the call's epoch (on the device) and its send buffer. Plain data, host and device.
#pragma once

#include <stdint.h>

#include "kernels/cuda/ep/window.h"

namespace jsm {
namespace cuda {

struct EpArgs {
  PeerTable peers;
  EpWindowLayout L;
  DispatchGeometry g;
  int rank;
  const uint32_t* epoch_counter;  // this call's epoch, once ep_begin_kernel has run
  int64_t row_align;
  uint64_t timeout_ns;
  EpError* err;  // host-mapped
  // this rank's send buffer (qpack / pack) and its counts [R * EL]
  const int32_t* counts;
  const uint8_t* values;
  const uint8_t* scales;
  const int32_t* token;
  const int32_t* slot;
  const float* weight;
  // engine ce: where its own-rows kernel publishes the whole plan to the host (mapped pinned
  // memory, [R src][R dst * EL]), then in *host_ready the epoch whose plan is there; null for
  // engine sm
  int32_t* host_plan;
  uint32_t* host_ready;
};

}  // namespace cuda
}  // namespace jsm
