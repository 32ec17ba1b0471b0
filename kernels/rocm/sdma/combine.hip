// Engine sdma (ROCm): Stage2's way back, one call's sequence on XLA's stream (protocol:
// kernels/common/ep_window.h, "The way back"; kernels: kernels/common/ep_return.cuh, shared with
// CUDA's engine sm). A wave per landed row stores it through the LSA mapping at (token, slot) of
// its source's return slot; after a system fence, each rank's flag goes to every rank; every rank
// waits (bounded, naming the peer) and sums its tokens' slots stamped with this combine's epoch.
// No host step: like the dispatch, the call may be captured in a HIP graph. The rows go back by
// the CUs, not the SDMA queues (SDMA puts of the way back would need the rows staged in a
// registered window first, as the dispatch stages XLA's send buffer).
#include <hip/hip_runtime.h>

#include <algorithm>

#include "kernels/common/ep_return.cuh"
#include "kernels/rocm/sdma/engine.h"
#include "kernels/rocm/sdma/state.h"

namespace jsm {
namespace sdma {

std::string combine(void* stream, const CombineView& in, int32_t* /*row_of: by position only*/,
                    const DispatchOptions& opt) {
  std::string err;
  auto w = call_window_set(opt.window_set, "combine", &err);
  if (!w) return err;
  if (in.H != w->g.H || in.m_cap != w->g.m_cap || in.T * in.K != w->g.send_rows)
    return "jax_sdma_moe combine: the call's shapes differ from its window set's (H " +
           std::to_string(in.H) + ", M_cap " + std::to_string(in.m_cap) + ", T*K " +
           std::to_string(in.T * in.K) + ")";
  LocalRank* me = rank_on_current_device(*w);
  if (!me) return "jax_sdma_moe combine: no rank of this Runtime lives on the current device";
  me->timeout_s = opt.timeout_s;
  err = describe(*me);
  if (!err.empty()) return err;
  hipStream_t st = static_cast<hipStream_t>(stream);
  if (opt.fault_absent_rank == me->rank) {  // takes no part: its tokens get zeros
    JSM_HIP_TRY("combine", hipMemsetAsync(in.y, 0, size_t(in.T * in.H) * 2, st));
    return "";
  }
  const EpWindowLayout& L = w->L.ep;
  uint32_t* counter = at<uint32_t>(me->own, L.ret_epoch_counter);
  // bounded_timeout_s: inf or 1e300 waits ~31 years, never a deadline overflowed into the past
  const uint64_t ticks = uint64_t(bounded_timeout_s(opt.timeout_s) * double(me->wall_clock_hz));
  const gpu::ReturnArgs a{me->peers, L, int(w->g.R), me->rank, counter, ticks, me->err_dev, in,
                          nullptr};
  gpu::ep_return_begin_kernel<<<1, 1, 0, st>>>(counter);
  JSM_HIP_TRY("combine begin", hipGetLastError());
  if (in.m_cap > 0) {
    const int grid = int(std::min<int64_t>(
        gpu::grid_for(in.m_cap, gpu::kReturnThreads / gpu::kWarp), 2 * gpu::num_sms()));
    gpu::ep_return_put_kernel<<<grid, gpu::kReturnThreads, 0, st>>>(a);
    JSM_HIP_TRY("combine put", hipGetLastError());
  }
  gpu::ep_return_flag_kernel<<<1, kMaxRanks, 0, st>>>(a);
  JSM_HIP_TRY("combine flags", hipGetLastError());
  if (in.T > 0) {
    const int grid = int(std::min<int64_t>(in.T, 4 * gpu::num_sms()));
    gpu::ep_return_sum_kernel<<<grid, gpu::kReturnThreads, 0, st>>>(a, /*by_position=*/false);
    JSM_HIP_TRY("combine sum", hipGetLastError());
  }
  return "";
}

}  // namespace sdma
}  // namespace jsm
