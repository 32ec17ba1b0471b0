// Internal to kernels/rocm/sdma: the host state of a window set (one per Runtime and dispatch
// geometry) and of each of its ranks in this process, shared by windows.cc (mori communicators
// and windows, the registry) and engine.hip (the call sequence).
#pragma once

#include <hip/hip_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/rocm/sdma/window.h"

namespace jsm {
namespace sdma {

struct LocalRank {
  int rank = -1, device = -1;
  void* comm = nullptr;        // mori::cco::ccoComm*
  void* window = nullptr;      // mori::cco::ccoWindow_t
  void* dev_comm_host = nullptr;  // mori::cco::ccoDevComm (host struct, for ccoDevCommDestroy)
  void* dev_comm = nullptr;    // its device copy (ccoDevCommCopyToDevice), the put kernel's
  uint8_t* own = nullptr;      // this rank's window (flat VA)
  PeerTable peers{};           // every rank's window through the LSA mapping
  double timeout_s = 0;
  uint64_t wall_clock_hz = 0;  // the device wall clock of the kernels' deadlines
  int queues = 0;              // SDMA queues per peer of the device communicator
  EpError* err_host = nullptr;  // mapped pinned memory
  EpError* err_dev = nullptr;
  hipStream_t side = nullptr;  // the put kernel, beside XLA's stream
  hipEvent_t fork = nullptr, join = nullptr;
};

struct WindowSet {
  DispatchGeometry g{};
  SdmaWindowLayout L{};
  std::vector<LocalRank> local;
};

// The registered set `id`, or null (windows.cc).
std::shared_ptr<WindowSet> find_set(int64_t id);

// "" or the error a bounded wait recorded for this rank, naming rank, peer and epoch.
std::string describe(const LocalRank& me);

// The window set of a call (`what`: "dispatch", "combine"); null with *err set.
inline std::shared_ptr<WindowSet> call_window_set(int64_t id, const char* what, std::string* err) {
  auto w = find_set(id);
  if (!w)
    *err = std::string("jax_sdma_moe ") + what + ": unknown or closed Runtime window set (" +
           std::to_string(id) + ")";
  return w;
}

// The rank of the set that lives on the current HIP device, or null.
inline LocalRank* rank_on_current_device(WindowSet& w) {
  int dev = -1;
  (void)hipGetDevice(&dev);
  for (auto& l : w.local)
    if (l.device == dev) return &l;
  return nullptr;
}

#define JSM_HIP_TRY(what, expr)                                                            \
  do {                                                                                     \
    hipError_t _e = (expr);                                                                \
    if (_e != hipSuccess)                                                                  \
      return std::string("jax_sdma_moe sdma (") + what + "): " + hipGetErrorString(_e);   \
  } while (0)

}  // namespace sdma
}  // namespace jsm
