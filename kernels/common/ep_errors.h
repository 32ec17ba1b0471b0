// The message of an expired bounded wait of the window engines (ce, sm on CUDA; sdma on ROCm),
// from what the kernel recorded (EpError, kernels/common/ep_window.h). Host code.
#pragma once

#include <string>

#include "kernels/common/ep_window.h"

namespace jsm {

// "" when nothing was recorded (code 0); else names rank, peer, what was waited for and the epoch.
// group, num_groups: the rank's EP group, named where the mesh has several (DESIGN.md §2).
inline std::string describe_wait_error(const EpError& e, int rank, double timeout_s,
                                       int group = 0, int num_groups = 1) {
  if (e.code == 0) return "";
  const std::string what = e.code == 1   ? "the plan (send counts)"
                           : e.code == 3 ? "the rows it returns (combine)"
                           : e.code == 4 ? "its staged rows (engine ce's placement, local expert " +
                                               std::to_string(e.expert) + ")"
                                         : "the rows of local expert " + std::to_string(e.expert);
  return std::string("jax_sdma_moe ") + (e.code == 3 ? "combine" : "dispatch") + ": rank " +
         std::to_string(rank) + (num_groups > 1 ? " of group " + std::to_string(group) : "") +
         " timed out after " +
         std::to_string(timeout_s) + " s waiting for " + what + " from peer rank " +
         std::to_string(e.peer) + " (epoch " + std::to_string(e.epoch) +
         "); the peer did not arrive. The Runtime's windows are now out of step: create a new "
         "Runtime.";
}

}  // namespace jsm
