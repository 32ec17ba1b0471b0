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
// (row_of is -1 before). The send headers are this rank's own, from its latest dispatch; one
// outside this combine's [T, K) (a Stage1Output of other shapes than that dispatch's) is skipped
// and recorded in the rank's error word (kErrReturnHeader), which the rank's next call and
// Runtime.check() report: no trap, which would take the whole process (and its peers' waits).
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
    if (h.token < 0 || h.token >= a.in.T || h.slot < 0 || h.slot >= a.in.K) {
      record_wait_error(a.err, ep::kErrReturnHeader, uint32_t(i), uint32_t(h.token), epoch);
      continue;
    }
    a.row_of[int64_t(h.token) * a.in.K + h.slot] = int32_t(i);
  }
}

// Engine ce, before its combine moves anything: does the Stage1Output's row headers (in.src_rank,
// in.token, in.slot) equal what the rank's latest dispatch landed (`dispatch`: its epoch)? That
// dispatch's parity slot of the landing window still holds its plan and landed headers (a peer
// writes that slot again only in the dispatch after next, which needs this rank's next plan), so
// its §4 layout (ReceivedSegments) gives the landed rows, whose headers are those of the slot, and
// every other row of a Stage1Output has -1. Identical headers mean the identical plan on this rank,
// so the combine, which returns rows by that plan, is right. One block; result[kCheckWords]: the
// rows that differ, the first of them (-1: none), its (src_rank, token, slot) in the Stage1Output,
// then in the dispatch.
__global__ void __launch_bounds__(1024)
    ep_return_check_kernel(const ReturnArgs a, int EL, int64_t row_align, uint32_t dispatch,
                           int32_t* result) {
  extern __shared__ int32_t smem[];  // ReceivedSegments: 3 * EL + 1
  __shared__ int32_t bad, first;
  uint8_t* own = a.peers.base[a.rank];
  const int p = int(dispatch & 1);
  const CombineView& in = a.in;
  if (threadIdx.x == 0) bad = 0, first = INT32_MAX;
  ReceivedSegments segs{at<const int32_t>(own, a.L.plan[p]), a.R, EL, a.rank};
  segs.build(smem, row_align, in.m_cap);  // (its barriers publish bad and first)
  const RowHeader* hdr = at<const RowHeader>(own, a.L.headers[p]);
  auto landed = [&](int64_t r) {
    if (expert_of_row(segs.offsets, segs.counts, EL, r) < 0) return make_int4(-1, -1, -1, 0);
    return __ldcg(reinterpret_cast<const int4*>(hdr + r));
  };
  int32_t mine = 0, mine_first = INT32_MAX;
  for (int64_t r = threadIdx.x; r < in.m_cap; r += blockDim.x) {
    const int4 h = landed(r);
    if (in.src_rank[r] != h.x || in.token[r] != h.y || in.slot[r] != h.z) {
      ++mine;
      if (mine_first == INT32_MAX) mine_first = int32_t(r);
    }
  }
  if (mine) {
    atomicAdd(&bad, mine);
    atomicMin(&first, mine_first);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    result[0] = bad;
    result[1] = bad ? first : -1;
    if (bad) {
      const int4 h = landed(first);
      result[2] = in.src_rank[first], result[3] = in.token[first], result[4] = in.slot[first];
      result[5] = h.x, result[6] = h.y, result[7] = h.z;
    }
  }
}

}  // namespace
}  // namespace cuda

namespace ep {
namespace {

// Engine ce returns rows by the plan of the rank's latest dispatch on its window set (and the
// peers find each returned row's (token, slot) in their latest send headers), so it can serve only
// that dispatch's Stage1Output: its row headers against the dispatch's landed ones
// (ep_return_check_kernel), one small copy to the host and a synchronisation of the stream, before
// the combine moves anything. Returns "" or the error.
std::string ce_check_stage1_output(cudaStream_t st, const WindowSet& w, LocalRank& me,
                                   const gpu::ReturnArgs& a, const DispatchOptions& opt) {
  if (me.epoch == 0)
    return "jax_sdma_moe combine (engine ce): stage2 before any stage1 of this geometry on rank " +
           std::to_string(me.rank) + " (engine ce returns rows by the plan of its latest dispatch)";
  if (a.in.m_cap == 0) return "";
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(st, &capture);
  if (capture != cudaStreamCaptureStatusNone)
    return "jax_sdma_moe combine: engine 'ce' synchronises with the host in every call and cannot "
           "run inside a CUDA graph; use engine 'sm' there";
  const int EL = int(w.g.EL);
  cuda::ep_return_check_kernel<<<1, 1024, int(3 * EL + 1) * 4, st>>>(a, EL, opt.row_align,
                                                                      me.epoch, me.check_dev);
  JSM_CUDA_TRY("combine check", cudaGetLastError());
  JSM_CUDA_TRY("combine check", cudaMemcpyAsync(me.check_host, me.check_dev,
                                                kCheckWords * sizeof(int32_t),
                                                cudaMemcpyDeviceToHost, st));
  JSM_CUDA_TRY("combine check", cudaStreamSynchronize(st));
  const int32_t* c = me.check_host;
  if (c[0] == 0) return "";
  auto header = [](const int32_t* h) {
    return "(src_rank " + std::to_string(h[0]) + ", src_token " + std::to_string(h[1]) +
           ", topk_slot " + std::to_string(h[2]) + ")";
  };
  return "jax_sdma_moe combine (engine ce): stage2 got a Stage1Output other than the latest stage1 "
         "of this geometry on this rank; engine ce returns rows by the plan of its latest "
         "dispatch, so it can combine only that dispatch's output (rank " +
         std::to_string(me.rank) + ": " + std::to_string(c[0]) + " of " +
         std::to_string(a.in.m_cap) + " rows differ, the first, row " + std::to_string(c[1]) +
         ", is " + header(c + 2) + " in the Stage1Output and " + header(c + 5) +
         " in the latest dispatch). Run stage2 on the output of the latest stage1 (as jsm.moe "
         "does), or use engine 'sm', whose combine reads the Stage1Output alone. Nothing was "
         "moved: if every rank failed here, the Runtime's windows are still in step.";
}

}  // namespace

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
                                       cuda::ep_return_check_kernel,
                                       cuda::ep_return_gather_kernel, cuda::ep_return_index_kernel,
                                       gpu::ep_return_put_kernel, gpu::ep_return_flag_kernel,
                                       gpu::ep_return_sum_kernel));
  me->timeout_s = bounded_timeout_s(opt.timeout_s);
  err = describe(*me);
  if (!err.empty()) return err;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (opt.fault_absent_rank == me->rank) {  // takes no part: its tokens get zeros
    JSM_CUDA_TRY("combine", cudaMemsetAsync(in.y, 0, size_t(in.T * in.H) * 2, st));
    return "";
  }
  uint32_t* counter = at<uint32_t>(me->own, w->L.ret_epoch_counter);
  gpu::ReturnArgs a{me->peers, w->L, int(w->g.R), me->rank, counter,
                     timeout_ns(opt.timeout_s), me->err_dev, in, row_of};
  if (ce) {
    // before any epoch moves: a combine that fails here on every rank leaves the windows in step
    err = ce_check_stage1_output(st, *w, *me, a, opt);
    if (!err.empty()) return err;
  }
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
