// Internal to kernels/cuda/ep: engine ce's host steps (copy_engine.cu), in the order engine.cu's
// dispatch() runs them. Each returns "" or an error message.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <string>

#include "kernels/common/options.h"
#include "kernels/cuda/ep/args.h"
#include "kernels/cuda/ep/state.h"

namespace jsm {
namespace ep {

// 1. this rank's plan (its send counts) to every destination, each followed by its flag there.
std::string ce_plan_put(cudaStream_t st, const WindowSet& w, LocalRank& me, const cuda::EpArgs& a,
                        uint32_t epoch);

// 2. the host's wait for every source's plan: a synchronisation of XLA's stream `st`, which holds
// nothing yet that waits for the peers' rows; the rank's own-rows kernel publishes the plan to
// mapped pinned memory (me.h_plan) there (copy_engine.cu says why).
std::string ce_plan_wait(cudaStream_t st, const WindowSet& w, LocalRank& me, uint32_t epoch,
                         std::chrono::steady_clock::time_point started);

// 3. each peer's rows (values, then meta rows) in one piece into its staging, then its flag
// there (the peer's placement kernel puts them at their offsets). after_first_peer: an event
// recorded once the first peer's copies are enqueued (or null).
std::string ce_peer_rows(cudaStream_t stream, const WindowSet& w, LocalRank& me,
                         const cuda::EpArgs& a, uint32_t epoch,
                         cudaEvent_t after_first_peer = nullptr);

// The combine (engine ce), after ep_return_gather_kernel: each peer's run of GEMM2's rows and
// their stamps whole, from the return staging to the peer's send positions for this rank (from
// the plan of this rank's latest dispatch, me.h_plan), then this rank's ret_flag at every rank.
std::string ce_return_rows(cudaStream_t st, const WindowSet& w, LocalRank& me, uint32_t epoch);

}  // namespace ep
}  // namespace jsm
