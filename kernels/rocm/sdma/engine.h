// Host side of engine `sdma` (ROCm): the window sets of the Runtimes (mori CCO communicators and
// windows; windows.cc) and one call's sequence (engine.hip; protocol in window.h). No HIP types
// here, so the pybind11 module (a plain C++ translation unit) can call it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/common/dispatch_io.h"
#include "kernels/common/ep_window.h"

namespace jsm {
namespace sdma {

// mori's 128-byte communicator id (ccoUniqueId), made by the process holding rank 0 and handed to
// every process of the axis (jax.distributed's key-value store) before windows_create.
std::string unique_id(std::string* err);

// Creates the window set of one dispatch geometry for the `ranks` of the axis that live in this
// process (each on its HIP device): per rank a mori communicator of R ranks (collective: every
// rank of the axis must call this with the same id; the ranks of this process are created on a
// thread each), a registered window of the layout of window.h, and a device communicator with
// `queues` SDMA queues per peer. Returns the set's id > 0, or 0 with *err set.
int64_t windows_create(const DispatchGeometry& g, const std::string& id,
                       const std::vector<int64_t>& ranks, const std::vector<int64_t>& devices,
                       int queues, std::string* err);
void windows_destroy(int64_t id);
// "" or the error a bounded wait of a kernel recorded (first local rank that has one).
std::string error_message(int64_t id);

// The landing slots as the fused GEMM reads them (as jsm::ep::SlotView on CUDA): the call's epoch
// is *epoch_counter; rows of expert e in slot p = epoch & 1 may be read once
// arrival[p][e * R + s] has reached the epoch for every source s. arrival null: nothing to wait
// for (an absent rank).
struct SlotView {
  const uint8_t* values[2];
  const uint8_t* scales[2];
  const uint32_t* arrival[2];
  const uint32_t* epoch_counter;
  int R;
  uint64_t timeout_ticks;
  EpError* err;
  int cus;  // compute units the GEMM may occupy (one is left to the put kernel)
};
using GemmLaunch = std::string (*)(const SlotView& slot, void* stream, void* ctx);

// One epoch of the protocol for the rank whose device is current, through window set
// opt.window_set, on `stream` (XLA's; the puts on the rank's side stream, joined back before
// returning). Without gemm the landed rows are copied to out.values / out.scales; with it, it runs
// between the layout and the headers, reading the rows from the slot as they land. "" or an
// error.
std::string dispatch(void* stream, const DispatchGeometry& g, const SendView& send,
                     const LandedView& out, const DispatchOptions& opt, GemmLaunch gemm = nullptr,
                     void* gemm_ctx = nullptr);

// Stage2's way back for the rank whose device is current (combine.hip; protocol: the way back of
// kernels/common/ep_window.h): each row of `in` to its source's return slot, then y of this
// rank's tokens, on `stream`, with no host step. "" or an error.
std::string combine(void* stream, const CombineView& in, int32_t* row_of,
                    const DispatchOptions& opt);

}  // namespace sdma
}  // namespace jsm
