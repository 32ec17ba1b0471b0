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
//   ep_return_stamp_kernel the landed rows' ReturnMeta into ret_out_meta;
//   ce_return_rows         (copy_engine.cu) each (expert, source) run of rows and stamps to the
//                          source's send positions by the copy engines, then the flags;
//   ep_return_index_kernel waits (bounded) for every rank's flag, then the send position of each
//                          (token, slot) returned this epoch, from the rank's send headers;
//   ep_return_sum_kernel   sums through that index.
// The sum: y[t] = bf16 of the fma sum over k of weight * row in slot order, slots stamped with
// this epoch only: the arithmetic and bytes of the combine within a rank (sum_slots.cuh), so
// every engine's y is equal.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/ep/copy_engine.h"
#include "kernels/cuda/ep/engine.h"
#include "kernels/cuda/ep/state.h"
#include "kernels/cuda/launch_util.h"
#include "kernels/cuda/layout.cuh"
#include "kernels/cuda/stage2/sum_slots.cuh"

namespace jsm {
namespace cuda {
namespace {

struct ReturnArgs {
  PeerTable peers;
  EpWindowLayout L;
  int R, rank;
  const uint32_t* epoch_counter;  // the combine's, once ep_return_begin_kernel has run
  uint64_t timeout_ns;
  EpError* err;
  CombineView in;
  int32_t* row_of;  // engine ce: [T * K] the send position of each (token, slot), -1 where none
};

constexpr int kThreads = 256, kCols = kSumCols;

__device__ __forceinline__ uint32_t return_epoch(const ReturnArgs& a) {
  return *static_cast<volatile const uint32_t*>(a.epoch_counter);
}

__global__ void ep_return_begin_kernel(uint32_t* counter) { *counter += 1; }

__global__ void __launch_bounds__(kThreads) ep_return_put_kernel(const ReturnArgs a) {
  const uint32_t epoch = return_epoch(a);
  const int q = int(epoch & 1), lane = threadIdx.x % kWarp;
  const CombineView& in = a.in;
  const int64_t vecs = in.H / 8;  // 16-byte vectors of a bf16 row
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; r < in.m_cap;
       r += int64_t(gridDim.x) * blockDim.x / kWarp) {
    const int32_t src = in.src_rank[r];
    if (src < 0) continue;
    const int32_t t = in.token[r], k = in.slot[r];
    // the headers are the dispatch's, never a user's: one outside this combine is a broken call
    if (src >= a.R || t < 0 || t >= in.T || k < 0 || k >= in.K) __trap();
    const int64_t at_row = int64_t(t) * in.K + k;
    uint4* dst = at<uint4>(a.peers.base[src], a.L.ret_rows[q]) + at_row * vecs;
    const uint4* row = reinterpret_cast<const uint4*>(in.rows) + r * vecs;
    int64_t c = lane;
    for (; c + 3 * kWarp < vecs; c += 4 * kWarp) {  // four loads in flight before the stores
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = __ldcg(row + c + u * kWarp);
#pragma unroll
      for (int u = 0; u < 4; ++u) dst[c + u * kWarp] = v[u];
    }
    for (; c < vecs; c += kWarp) dst[c] = __ldcg(row + c);
    if (lane == 0)
      at<ReturnMeta>(a.peers.base[src], a.L.ret_meta[q])[at_row] = ReturnMeta{epoch, in.weight[r]};
  }
  __threadfence_system();
}

__global__ void ep_return_flag_kernel(const ReturnArgs a) {
  const uint32_t epoch = return_epoch(a);
  __threadfence_system();
  if (int(threadIdx.x) < a.R)
    st_release_sys(at<uint32_t>(a.peers.base[threadIdx.x], a.L.ret_flag[epoch & 1]) + a.rank,
                   epoch);
}

// Every thread of a block: waits (bounded) until ret_flag[q][d] of this rank has reached the
// epoch for every rank d (warp 0 polls, see ep_rows_kernel); an expiry is recorded (code 3) and
// the caller goes on: its results are not trusted, and the error surfaces at the next host check.
__device__ void wait_returns(const ReturnArgs& a, uint32_t epoch) {
  const uint32_t* flags = at<const uint32_t>(a.peers.base[a.rank], a.L.ret_flag[epoch & 1]);
  const uint64_t deadline = globaltimer_ns() + a.timeout_ns;
  for (;;) {
    bool ok = true;
    int missing = -1;
    if (threadIdx.x < kWarp)
      for (int d = threadIdx.x; d < a.R; d += kWarp)
        if (!epoch_reached(ld_acquire_sys(flags + d), epoch)) ok = false, missing = d;
    if (__syncthreads_and(ok)) return;
    if (__syncthreads_or(threadIdx.x == 0 && globaltimer_ns() > deadline)) {
      if (missing >= 0) record_wait_error(a.err, 3, missing, 0, epoch);
      return;
    }
    __nanosleep(1000);
  }
}

// Engine ce: stamps of the landed rows (padding rows too: they are never copied).
__global__ void ep_return_stamp_kernel(const ReturnArgs a) {
  const uint32_t epoch = return_epoch(a);
  ReturnMeta* out = at<ReturnMeta>(a.peers.base[a.rank], a.L.ret_out_meta);
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < a.in.m_cap;
       r += int64_t(gridDim.x) * blockDim.x)
    out[r] = ReturnMeta{epoch, a.in.weight[r]};
}

// Engine ce: row_of[t * K + k] = the send position i of (t, k) where i was returned this epoch
// (row_of is -1 before). The send headers are this rank's own, from its latest dispatch.
__global__ void __launch_bounds__(kThreads) ep_return_index_kernel(const ReturnArgs a,
                                                                  int64_t send_rows) {
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

// tokens t = blockIdx.x, + gridDim.x, ...; columns kCols * threadIdx.x, + kCols * blockDim.x, ...
// by_position (engine ce): slot (t, k) is ret_rows[row_of[t * K + k]] (after
// ep_return_index_kernel's wait); else (engine sm) ret_rows[t * K + k], after this kernel's wait.
__global__ void __launch_bounds__(kThreads) ep_return_sum_kernel(const ReturnArgs a,
                                                                bool by_position) {
  const uint32_t epoch = return_epoch(a);
  const int q = int(epoch & 1);
  uint8_t* own = a.peers.base[a.rank];
  if (!by_position) wait_returns(a, epoch);
  const CombineView& in = a.in;
  const uint16_t* rows = at<const uint16_t>(own, a.L.ret_rows[q]);
  const ReturnMeta* meta = at<const ReturnMeta>(own, a.L.ret_meta[q]);
  for (int64_t t = blockIdx.x; t < in.T; t += gridDim.x)
    for (int64_t c = kCols * int64_t(threadIdx.x); c < in.H; c += kCols * int64_t(blockDim.x))
      sum_slots(in.K, [&](int64_t k, const uint16_t*& row, float& w) {
        int64_t i = t * in.K + k;
        if (by_position) {
          i = a.row_of[i];
          if (i < 0) return false;  // no row for this slot in this epoch
        }
        const int2 m = __ldcg(reinterpret_cast<const int2*>(meta + i));
        if (uint32_t(m.x) != epoch) return false;  // no row for this slot in this epoch
        row = rows + i * in.H + c;
        w = __int_as_float(m.y);
        return true;
      }, in.y + t * in.H + c);
}

}  // namespace
}  // namespace cuda

namespace ep {

std::string combine(void* stream, const CombineView& in, int32_t* row_of,
                    const DispatchOptions& opt) {
  auto w = find_set(opt.window_set);
  if (!w) return "jax_sdma_moe combine: unknown or closed Runtime window set (" +
                 std::to_string(opt.window_set) + ")";
  if (w->engine != opt.engine)
    return std::string("jax_sdma_moe combine: a call of engine ") + engine_name(opt.engine) +
           " on a window set of engine " + engine_name(w->engine);
  if (!w->connected) return "jax_sdma_moe combine: the Runtime's windows are not connected";
  if (w->L.ret_rows[0] == 0 && w->g.send_rows > 0)
    return "jax_sdma_moe combine: the window set has no return regions";
  if (in.H != w->g.H || in.m_cap != w->g.m_cap || in.T * in.K != w->g.send_rows)
    return "jax_sdma_moe combine: the call's shapes differ from its window set's (H " +
           std::to_string(in.H) + ", M_cap " + std::to_string(in.m_cap) + ", T*K " +
           std::to_string(in.T * in.K) + ")";
  if (in.H % cuda::kCols != 0) return "jax_sdma_moe combine: H must be a multiple of 8";
  const bool ce = w->engine == EngineId::kCe;
  if (ce && !row_of && in.T * in.K > 0)
    return "jax_sdma_moe combine (ce): no (token, slot) index workspace";
  LocalRank* me = rank_on_current_device(*w);
  if (!me) return "jax_sdma_moe combine: no rank of this Runtime lives on the current device";
  me->timeout_s = opt.timeout_s;
  std::string err = describe(*me);
  if (!err.empty()) return err;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (opt.fault_absent_rank == me->rank) {  // takes no part: its tokens get zeros
    JSM_CUDA_TRY("combine", cudaMemsetAsync(in.y, 0, size_t(in.T * in.H) * 2, st));
    return "";
  }
  uint32_t* counter = at<uint32_t>(me->own, w->L.ret_epoch_counter);
  cuda::ReturnArgs a{me->peers, w->L, int(w->g.R), me->rank, counter,
                     uint64_t(opt.timeout_s * 1e9), me->err_dev, in, row_of};
  cuda::ep_return_begin_kernel<<<1, 1, 0, st>>>(counter);
  JSM_CUDA_TRY("combine begin", cudaGetLastError());
  const uint32_t epoch = ++me->ret_epoch;  // in step with the device's count (engine ce's host)
  const int rows_grid = int(std::min<int64_t>(
      cuda::grid_for(std::max<int64_t>(in.m_cap, 1), cuda::kThreads / cuda::kWarp),
      2 * cuda::num_sms()));
  if (ce) {
    cuda::ep_return_stamp_kernel<<<rows_grid, cuda::kThreads, 0, st>>>(a);
    JSM_CUDA_TRY("combine stamps", cudaGetLastError());
    err = ce_return_rows(st, *w, *me, in, epoch, opt);
    if (!err.empty()) return err;
    if (in.T * in.K > 0) {
      JSM_CUDA_TRY("combine index",
                   cudaMemsetAsync(row_of, 0xFF, size_t(in.T * in.K) * sizeof(int32_t), st));
      cuda::ep_return_index_kernel<<<int(std::min<int64_t>(cuda::grid_for(in.T * in.K,
                                                                          cuda::kThreads),
                                                           4 * cuda::num_sms())),
                                     cuda::kThreads, 0, st>>>(a, w->g.send_rows);
      JSM_CUDA_TRY("combine index", cudaGetLastError());
    }
  } else {
    if (in.m_cap > 0) {
      cuda::ep_return_put_kernel<<<rows_grid, cuda::kThreads, 0, st>>>(a);
      JSM_CUDA_TRY("combine put", cudaGetLastError());
    }
    cuda::ep_return_flag_kernel<<<1, cuda::kMaxRanks, 0, st>>>(a);
    JSM_CUDA_TRY("combine flags", cudaGetLastError());
  }
  if (in.T > 0) {
    const int grid = int(std::min<int64_t>(in.T, 4 * cuda::num_sms()));
    cuda::ep_return_sum_kernel<<<grid, cuda::kThreads, 0, st>>>(a, /*by_position=*/ce);
    JSM_CUDA_TRY("combine sum", cudaGetLastError());
  }
  return "";
}

}  // namespace ep
}  // namespace jsm
