// Engine sdma (ROCm): the HIP kernels of one call and its sequence (protocol: window.h). The plan
// and the rows move by the FlyDSL dispatch kernel (puts.h) on the rank's side stream; these
// kernels stage the call and read the landed slot out.
//   sdma_begin_kernel   the call's epoch (device-side) and the staged rows' 16-byte headers;
//   sdma_layout_kernel  the bounded wait for every peer's plan, this rank's §4 layout;
//   sdma_rows_kernel    the bounded wait for every segment flag of the slot, then the row headers
//                       (and the rows, unless a fused GEMM read them).
#include <hip/hip_runtime.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "kernels/common/gpu_layout.cuh"
#include "kernels/common/gpu_sys.cuh"
#include "kernels/rocm/sdma/engine.h"
#include "kernels/rocm/sdma/puts.h"
#include "kernels/rocm/sdma/state.h"

namespace jsm {
namespace sdma {
namespace {

using gpu::kWarp;

using gpu::ld_acquire_sys;
using gpu::poll_pause;
using gpu::record_wait_error;
using gpu::wait_flags_block;
using gpu::WaitWho;

__device__ __forceinline__ uint32_t call_epoch(const SdmaArgs& a) {
  return *static_cast<volatile const uint32_t*>(at<uint32_t>(a.peers.base[a.rank],
                                                             a.L.ep.epoch_counter));
}

// The first kernel of a call (not of an absent rank's): the epoch, and the headers of the rows
// staged in the window (the values and scales are copied there by the runtime).
__global__ void sdma_begin_kernel(const SdmaArgs a) {
  uint8_t* own = a.peers.base[a.rank];
  if (blockIdx.x == 0 && threadIdx.x == 0) *at<uint32_t>(own, a.L.ep.epoch_counter) += 1;
  RowHeader* out = at<RowHeader>(own, a.L.ep.send_headers);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < a.g.send_rows;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = RowHeader{a.rank, a.send.token[i], a.send.slot[i], a.send.weight[i]};
}

// One block, after the dispatch kernel was launched beside it: wait (bounded) for every source's
// plan, then this rank's §4 layout (expert offsets and counts, rows, overflow). absent: this rank
// takes no part (fault injection): an empty layout, no wait.
__global__ void sdma_layout_kernel(const SdmaArgs a, LandedView out, bool absent) {
  extern __shared__ int32_t smem[];  // totals[EL], offsets[EL], counts[EL] + dropped
  const int R = int(a.g.R), EL = int(a.g.EL);
  uint8_t* own = a.peers.base[a.rank];
  int32_t* totals = smem;
  int32_t* offsets = smem + EL;
  int32_t* counts = smem + 2 * EL;
  const uint32_t epoch = absent ? 0 : call_epoch(a);
  const int p = int(epoch & 1);
  bool plan_ok = false;
  if (!absent) {
    plan_ok = wait_flags_block<0, false>(
        at<const uint32_t>(own, a.L.ep.plan_flag[p]), R, epoch, a.timeout_ticks, a.err, 1,
        [](int s) { return WaitWho{uint32_t(s), 0}; }, [] { __builtin_amdgcn_s_sleep(8); });
  }
  const int32_t* plan = at<const int32_t>(own, a.L.ep.plan[p]);
  for (int e = threadIdx.x; e < EL; e += blockDim.x) {
    int32_t sum = 0;
    for (int s = 0; s < R && plan_ok; ++s) sum += plan[int64_t(s) * R * EL + a.rank * EL + e];
    totals[e] = sum;
  }
  __syncthreads();
  gpu::landing_layout_smem(totals, EL, a.row_align, a.g.m_cap, offsets, counts, counts + EL);
  for (int e = threadIdx.x; e < EL; e += blockDim.x)
    out.expert_offsets[e] = offsets[e], out.expert_counts[e] = counts[e];
  if (threadIdx.x == 0) {
    int32_t rows = 0;
    for (int e = 0; e < EL; ++e) rows += counts[e];
    *out.num_rows = rows;
    *out.overflow = counts[EL];
  }
}

// Last: wait (bounded) for every (expert, source) flag of the slot, then the row headers and,
// unless the fused GEMM read the rows from the slot, the rows; padding rows get -1 / 0. The slot
// holds the §4 layout already (each source put its rows at their final offsets).
__global__ void sdma_rows_kernel(const SdmaArgs a, LandedView out, bool absent, bool copy_rows) {
  extern __shared__ int32_t smem[];  // offsets[EL], counts[EL]
  const int R = int(a.g.R), EL = int(a.g.EL);
  const int64_t H = a.g.H, HS = H / kBlock, m_cap = a.g.m_cap;
  uint8_t* own = a.peers.base[a.rank];
  const uint32_t epoch = absent ? 0 : call_epoch(a);
  const int p = int(epoch & 1);
  int32_t* offsets = smem;
  int32_t* counts = smem + EL;
  for (int e = threadIdx.x; e < EL; e += blockDim.x)
    offsets[e] = out.expert_offsets[e], counts[e] = out.expert_counts[e];
  if (!absent) {
    // warp 0 polls; no wait once the call failed (the plan's wait): as CUDA's ep_rows_kernel
    wait_flags_block<kWarp, true>(
        at<const uint32_t>(own, a.L.ep.seg_flag[p]), R * EL, epoch, a.timeout_ticks, a.err, 2,
        [R](int i) { return WaitWho{uint32_t(i % R), uint32_t(i / R)}; }, [] { poll_pause(); });
  }
  __syncthreads();
  const uint8_t* values = at<const uint8_t>(own, a.L.ep.values[p]);
  const uint8_t* scales = at<const uint8_t>(own, a.L.ep.scales[p]);
  const RowHeader* hdr = at<const RowHeader>(own, a.L.ep.headers[p]);
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; r < m_cap;
       r += int64_t(gridDim.x) * blockDim.x / kWarp) {
    const bool landed = gpu::expert_of_row(offsets, counts, EL, r) >= 0;
    if (copy_rows) {
      uint4* dst = reinterpret_cast<uint4*>(out.values + r * H);
      const uint4* src = reinterpret_cast<const uint4*>(values + r * H);
      for (int64_t c = lane; c < H / 16; c += kWarp) dst[c] = landed ? src[c] : make_uint4(0, 0, 0, 0);
      for (int64_t c = lane; c < HS; c += kWarp)
        out.scales[r * HS + c] = landed ? scales[r * HS + c] : uint8_t(0);
    }
    if (lane == 0) {
      const RowHeader h = landed ? hdr[r] : RowHeader{-1, -1, -1, 0.0f};
      out.src_rank[r] = h.src_rank;
      out.token[r] = h.token;
      out.slot[r] = h.slot;
      out.weight[r] = h.weight;
    }
  }
}

}  // namespace

std::string dispatch(void* stream, const DispatchGeometry& g, const SendView& send,
                     const LandedView& out, const DispatchOptions& opt, GemmLaunch gemm,
                     void* gemm_ctx) {
  std::string err;
  auto w = call_window_set(opt.window_set, "dispatch", &err);
  if (!w) return err;
  if (g.R != w->g.R || g.EL != w->g.EL || g.H != w->g.H || g.m_cap != w->g.m_cap ||
      g.send_rows != w->g.send_rows)
    return "jax_sdma_moe dispatch: the call's shapes differ from its window set's";
  LocalRank* me = rank_on_current_device(*w);
  if (!me) return "jax_sdma_moe dispatch: no rank of this Runtime lives on the current device";
  me->timeout_s = opt.timeout_s;
  err = describe(*me);
  if (!err.empty()) return err;
  hipStream_t st = static_cast<hipStream_t>(stream);
  const SdmaWindowLayout& L = w->L;
  SdmaArgs a{};
  a.peers = me->peers, a.L = L, a.g = w->g, a.rank = me->rank, a.row_align = opt.row_align;
  // bounded_timeout_s: inf or 1e300 waits ~31 years, never a deadline overflowed into the past
  a.timeout_ticks = uint64_t(bounded_timeout_s(opt.timeout_s) * double(me->wall_clock_hz));
  a.err = me->err_dev;
  a.send = send;
  const bool absent = opt.fault_absent_rank == me->rank;
  const int64_t H = w->g.H, S = w->g.send_rows, EL = w->g.EL;
  if (!absent) {
    if (opt.fault_delay_rank == me->rank)  // at most timeout_s
      std::this_thread::sleep_for(std::chrono::milliseconds(bounded_delay_ms(opt)));
    sdma_begin_kernel<<<gpu::grid_for(std::max<int64_t>(S, 1), 256), 256, 0, st>>>(a);
    JSM_HIP_TRY("begin", hipGetLastError());
    // XLA's send buffer is no registered window: the rows are staged into this rank's window (the
    // dispatch kernel stages the counts)
    JSM_HIP_TRY("stage rows", hipMemcpyAsync(me->own + L.send_values, send.values, size_t(S * H),
                                             hipMemcpyDeviceToDevice, st));
    JSM_HIP_TRY("stage scales", hipMemcpyAsync(me->own + L.send_scales, send.scales,
                                               size_t(S * (H / kBlock)), hipMemcpyDeviceToDevice, st));
  }
  if (!absent) {
#ifdef JSM_ROCM_FLYDSL
    JSM_HIP_TRY("fork", hipEventRecord(me->fork, st));
    JSM_HIP_TRY("fork", hipStreamWaitEvent(me->side, me->fork, 0));
    const PutArgs put{me->dev_comm, me->window, send.counts,
                      at<uint32_t>(me->own, L.ep.epoch_counter), me->err_dev, me->rank,
                      int32_t(w->g.R), int32_t(EL), int32_t(H), int32_t(w->g.m_cap),
                      int32_t(opt.row_align), me->queues, int64_t(a.timeout_ticks), L,
                      int32_t(1 + std::min<int64_t>(EL, 16))};
    err = launch_puts(put, me->side);
    if (!err.empty()) return err;
#else
    return "jax_sdma_moe dispatch: this build of engine sdma has no dispatch kernel "
           "(kernels/rocm/flydsl was not built)";
#endif
  }
  sdma_layout_kernel<<<1, 256, int(3 * EL + 1) * 4, st>>>(a, out, absent);
  JSM_HIP_TRY("layout", hipGetLastError());
  if (gemm) {
    SlotView slot{{at<uint8_t>(me->own, L.ep.values[0]), at<uint8_t>(me->own, L.ep.values[1])},
                  {at<uint8_t>(me->own, L.ep.scales[0]), at<uint8_t>(me->own, L.ep.scales[1])},
                  {at<uint32_t>(me->own, L.ep.seg_flag[0]), at<uint32_t>(me->own, L.ep.seg_flag[1])},
                  absent ? nullptr : at<uint32_t>(me->own, L.ep.epoch_counter),
                  int(w->g.R), a.timeout_ticks, me->err_dev, gpu::num_sms() - 1};
    err = gemm(slot, st, gemm_ctx);
    if (!err.empty()) return err;
  }
  const int rows_grid = std::min(gpu::grid_for(w->g.m_cap, 8), 4 * gpu::num_sms());
  sdma_rows_kernel<<<rows_grid, 256, int(2 * EL) * 4, st>>>(a, out, absent, gemm == nullptr);
  JSM_HIP_TRY("rows", hipGetLastError());
  if (!absent) {  // the staged rows may be overwritten by the next call once the puts are quiet
    JSM_HIP_TRY("join", hipEventRecord(me->join, me->side));
    JSM_HIP_TRY("join", hipStreamWaitEvent(st, me->join, 0));
  }
  return "";
}

}  // namespace sdma
}  // namespace jsm
