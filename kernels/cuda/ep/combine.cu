// Stage2's way back for engines `sm` and `ce` (protocol: kernels/common/ep_window.h, "The way
// back"), then every rank sums its own tokens' slots.
// Engine sm (no host step):
//   ep_return_put_kernel   a warp per landed row: the row (16-byte stores over NVLink) and its
//                          ReturnMeta at its (token, slot) of the source's slot; each block ends
//                          with a system fence;
//   ep_return_flag_kernel  after the puts (stream order: every block's fence has run), the
//                          epoch into ret_flag[q][rank] of every rank;
//   ep_return_sum_kernel   waits (bounded) for every rank's flag, then sums.
// Engine ce (the host enqueues, with no wait: the plan is on the host since the dispatch):
//   ep_return_gather_kernel each source's rows and their stamps in that source's send order:
//                          its own into this rank's return slot, the peers' into the staging;
//   ce_return_rows         (copy_engine.cu) each peer's run of rows and stamps whole to the
//                          peer's send positions by the copy engines (two copies), then the
//                          flags;
//   ep_return_index_kernel waits (bounded) for every rank's flag, then the send position of each
//                          (token, slot) returned this epoch, from the rank's send headers;
//   ep_return_sum_kernel   sums through that index.
// The kernels shared with ROCm's engine sdma (put, flag, sum and the wait) are in
// kernels/common/ep_return.cuh.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/ep/copy.cuh"
#include "kernels/cuda/ep/copy_engine.h"
#include "kernels/cuda/ep/engine.h"
#include "kernels/cuda/ep/received.cuh"
#include "kernels/cuda/ep/state.h"
#include "kernels/common/ep_return.cuh"
#include "kernels/cuda/launch_util.h"
#include "kernels/cuda/layout.cuh"

namespace jsm {
namespace cuda {
namespace {

using gpu::ReturnArgs;
using gpu::return_epoch;
using gpu::wait_returns;

// Engine ce: GEMM2's rows of this rank's latest dispatch (in.rows, §4 order), each (expert e,
// source s) segment to its place in s's send order for this rank (ReceivedSegments, from the
// dispatch's plan in the window) with its stamps: s = this rank straight into its own return slot
// q at its send positions, a peer into the return staging (ep_stage_index), whose run the host
// then copies whole. The positions of rows the dispatch dropped (overflow) get a stamp of another
// epoch, so that a copied run carries no stale stamp of this one. Blocks take the segments.
__global__ void __launch_bounds__(512)
    ep_return_gather_kernel(const ReturnArgs a, int EL, int64_t row_align, int64_t send_rows) {
  extern __shared__ int32_t smem[];  // ReceivedSegments: 3 * EL + 1
  const uint32_t epoch = return_epoch(a);
  const int q = int(epoch & 1), R = a.R, me = a.rank;
  uint8_t* own = a.peers.base[me];
  const int64_t H = a.in.H;
  // the plan of the latest dispatch through this window set (its parity slot)
  const uint32_t dispatch = *at<const volatile uint32_t>(own, a.L.epoch_counter);
  ReceivedSegments segs{at<const int32_t>(own, a.L.plan[dispatch & 1]), R, EL, me};
  segs.build(smem, row_align, a.in.m_cap);
  // this rank's own send run starts past its rows to the ranks before it
  __shared__ int64_t own_start;
  if (threadIdx.x == 0) {
    const int32_t* mine = segs.plan + int64_t(me) * R * EL;
    int64_t n;
    ep_send_run([&](int64_t i) { return __ldcg(mine + i); }, EL, me, &own_start, &n);
  }
  __syncthreads();
  __shared__ ReceivedSegment seg;
  for (int i = blockIdx.x; i < EL * R; i += gridDim.x) {
    const int e = i / R, s = i % R;
    if (threadIdx.x == 0) seg = segs.of(e, s);
    __syncthreads();
    uint16_t* rows;
    ReturnMeta* stamps;
    if (s == me) {
      rows = at<uint16_t>(own, a.L.ret_rows[q]) + (own_start + seg.from) * H;
      stamps = at<ReturnMeta>(own, a.L.ret_meta[q]) + own_start + seg.from;
    } else {
      const int64_t at_row = ep_stage_index(s, me) * send_rows + seg.from;
      rows = at<uint16_t>(own, a.L.ret_stage_rows) + at_row * H;
      stamps = at<ReturnMeta>(own, a.L.ret_stage_meta) + at_row;
    }
    block_copy(reinterpret_cast<uint8_t*>(rows),
               reinterpret_cast<const uint8_t*>(a.in.rows + seg.base * H), seg.keep * H * 2);
    for (int64_t r = threadIdx.x; r < seg.n; r += blockDim.x)
      stamps[r] = r < seg.keep ? ReturnMeta{epoch, a.in.weight[seg.base + r]}
                               : ReturnMeta{epoch - 1, 0.0f};
    __syncthreads();  // seg is read before the next segment's thread 0 writes it
  }
}

// Engine ce: row_of[t * K + k] = the send position i of (t, k) where i was returned this epoch
// (row_of is -1 before). The send headers are this rank's own, from its latest dispatch.
__global__ void __launch_bounds__(gpu::kReturnThreads)
    ep_return_index_kernel(const ReturnArgs a, int64_t send_rows) {
  const uint32_t epoch = return_epoch(a);
  wait_returns(a, epoch);
  uint8_t* own = a.peers.base[a.rank];
  const ReturnMeta* meta = at<const ReturnMeta>(own, a.L.ret_meta[epoch & 1]);
  const RowHeader* hdr = at<const RowHeader>(own, a.L.send_headers);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < send_rows;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (uint32_t(__ldcg(reinterpret_cast<const int2*>(meta + i)).x) != epoch) continue;
    const RowHeader h = hdr[i];
    if (h.token < 0 || h.token >= a.in.T || h.slot < 0 || h.slot >= a.in.K) __trap();
    a.row_of[int64_t(h.token) * a.in.K + h.slot] = int32_t(i);
  }
}

}  // namespace
}  // namespace cuda

namespace ep {

std::string combine(void* stream, const CombineView& in, int32_t* row_of,
                    const DispatchOptions& opt) {
  std::string err;
  auto w = call_window_set(opt, "combine", &err);
  if (!w) return err;
  if (w->L.ret_rows[0] == 0 && w->g.send_rows > 0)
    return "jax_sdma_moe combine: the window set has no return regions";
  if (in.H != w->g.H || in.m_cap != w->g.m_cap || in.T * in.K != w->g.send_rows)
    return "jax_sdma_moe combine: the call's shapes differ from its window set's (H " +
           std::to_string(in.H) + ", M_cap " + std::to_string(in.m_cap) + ", T*K " +
           std::to_string(in.T * in.K) + ")";
  const bool ce = w->engine == EngineId::kCe;
  if (ce && !row_of && in.T * in.K > 0)
    return "jax_sdma_moe combine (ce): no (token, slot) index workspace";
  LocalRank* me = rank_on_current_device(*w);
  if (!me) return "jax_sdma_moe combine: no rank of this Runtime lives on the current device";
  static std::atomic<uint64_t> loaded{0};  // launch_util.h: kernels spin beside later launches
  JSM_CUDA_TRY("combine: loading its kernels",
               cuda::load_kernels_once(loaded, gpu::ep_return_begin_kernel,
                                       cuda::ep_return_gather_kernel, cuda::ep_return_index_kernel,
                                       gpu::ep_return_put_kernel, gpu::ep_return_flag_kernel,
                                       gpu::ep_return_sum_kernel));
  me->timeout_s = opt.timeout_s;
  err = describe(*me);
  if (!err.empty()) return err;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (opt.fault_absent_rank == me->rank) {  // takes no part: its tokens get zeros
    JSM_CUDA_TRY("combine", cudaMemsetAsync(in.y, 0, size_t(in.T * in.H) * 2, st));
    return "";
  }
  uint32_t* counter = at<uint32_t>(me->own, w->L.ret_epoch_counter);
  gpu::ReturnArgs a{me->peers, w->L, int(w->g.R), me->rank, counter,
                     uint64_t(opt.timeout_s * 1e9), me->err_dev, in, row_of};
  gpu::ep_return_begin_kernel<<<1, 1, 0, st>>>(counter);
  JSM_CUDA_TRY("combine begin", cudaGetLastError());
  const uint32_t epoch = ++me->ret_epoch;  // in step with the device's count (engine ce's host)
  const int rows_grid = int(std::min<int64_t>(
      cuda::grid_for(std::max<int64_t>(in.m_cap, 1), gpu::kReturnThreads / cuda::kWarp),
      2 * cuda::num_sms()));
  if (ce) {
    const int EL = int(w->g.EL);
    cuda::ep_return_gather_kernel<<<int(std::min<int64_t>(EL * w->g.R, 2 * cuda::num_sms())), 512,
                                    int(3 * EL + 1) * 4, st>>>(a, EL, opt.row_align,
                                                               w->g.send_rows);
    JSM_CUDA_TRY("combine gather", cudaGetLastError());
    err = ce_return_rows(st, *w, *me, epoch);
    if (!err.empty()) return err;
    if (in.T * in.K > 0) {
      JSM_CUDA_TRY("combine index",
                   cudaMemsetAsync(row_of, 0xFF, size_t(in.T * in.K) * sizeof(int32_t), st));
      cuda::ep_return_index_kernel<<<int(std::min<int64_t>(cuda::grid_for(in.T * in.K,
                                                                          gpu::kReturnThreads),
                                                           4 * cuda::num_sms())),
                                     gpu::kReturnThreads, 0, st>>>(a, w->g.send_rows);
      JSM_CUDA_TRY("combine index", cudaGetLastError());
    }
  } else {
    if (in.m_cap > 0) {
      gpu::ep_return_put_kernel<<<rows_grid, gpu::kReturnThreads, 0, st>>>(a);
      JSM_CUDA_TRY("combine put", cudaGetLastError());
    }
    gpu::ep_return_flag_kernel<<<1, cuda::kMaxRanks, 0, st>>>(a);
    JSM_CUDA_TRY("combine flags", cudaGetLastError());
  }
  if (in.T > 0) {
    const int grid = int(std::min<int64_t>(in.T, 4 * cuda::num_sms()));
    gpu::ep_return_sum_kernel<<<grid, gpu::kReturnThreads, 0, st>>>(a, /*by_position=*/ce);
    JSM_CUDA_TRY("combine sum", cudaGetLastError());
  }
  return "";
}

}  // namespace ep
}  // namespace jsm
