// Stage2's way back for engine `sm` (protocol: kernels/common/ep_window.h, "The way back"): SMs
// store each landed row's GEMM2 output over NVLink at (token, slot) of its source's return slot,
// then every rank sums its own tokens' slots. No host step.
//   ep_return_put_kernel   a warp per landed row: the row (16-byte stores) and its ReturnMeta;
//                          each block ends with a system fence;
//   ep_return_flag_kernel  after the puts (stream order: every block's fence has run), the
//                          epoch into ret_flag[q][rank] of every rank;
//   ep_return_sum_kernel   waits (bounded) for every rank's flag, then y[t] = bf16 of the fma sum
//                          over k of weight * row in slot order, slots stamped with this epoch
//                          only: the arithmetic and bytes of the combine within a rank
//                          (kernels/cuda/stage2/combine_local.cu), so every engine's y is equal.
#include <cuda_runtime.h>

#include <algorithm>

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

// tokens t = blockIdx.x, + gridDim.x, ...; columns kCols * threadIdx.x, + kCols * blockDim.x, ...
__global__ void __launch_bounds__(kThreads) ep_return_sum_kernel(const ReturnArgs a) {
  const uint32_t epoch = return_epoch(a);
  const int q = int(epoch & 1);
  uint8_t* own = a.peers.base[a.rank];
  const uint32_t* flags = at<const uint32_t>(own, a.L.ret_flag[q]);
  const uint64_t deadline = globaltimer_ns() + a.timeout_ns;
  for (;;) {  // warp 0 polls (see ep_rows_kernel)
    bool ok = true;
    int missing = -1;
    if (threadIdx.x < kWarp)
      for (int d = threadIdx.x; d < a.R; d += kWarp)
        if (!epoch_reached(ld_acquire_sys(flags + d), epoch)) ok = false, missing = d;
    if (__syncthreads_and(ok)) break;
    if (__syncthreads_or(threadIdx.x == 0 && globaltimer_ns() > deadline)) {
      if (missing >= 0) record_wait_error(a.err, 3, missing, 0, epoch);
      break;  // y is not trusted; the error surfaces at the next host check
    }
    __nanosleep(1000);
  }
  const CombineView& in = a.in;
  const uint16_t* rows = at<const uint16_t>(own, a.L.ret_rows[q]);
  const ReturnMeta* meta = at<const ReturnMeta>(own, a.L.ret_meta[q]);
  for (int64_t t = blockIdx.x; t < in.T; t += gridDim.x)
    for (int64_t c = kCols * int64_t(threadIdx.x); c < in.H; c += kCols * int64_t(blockDim.x))
      sum_slots(in.K, [&](int64_t k, const uint16_t*& row, float& w) {
        const int2 m = __ldcg(reinterpret_cast<const int2*>(meta + t * in.K + k));
        if (uint32_t(m.x) != epoch) return false;  // no row for this slot in this epoch
        row = rows + (t * in.K + k) * in.H + c;
        w = __int_as_float(m.y);
        return true;
      }, in.y + t * in.H + c);
}

}  // namespace
}  // namespace cuda

namespace ep {

std::string combine(void* stream, const CombineView& in, const DispatchOptions& opt) {
  auto w = find_set(opt.window_set);
  if (!w) return "jax_sdma_moe combine: unknown or closed Runtime window set (" +
                 std::to_string(opt.window_set) + ")";
  if (w->engine != EngineId::kSm || opt.engine != EngineId::kSm)
    return "jax_sdma_moe combine: the CUDA window engines' combine is engine sm's only";
  if (!w->connected) return "jax_sdma_moe combine: the Runtime's windows are not connected";
  if (w->L.ret_rows[0] == 0 && w->g.send_rows > 0)
    return "jax_sdma_moe combine: the window set has no return regions";
  if (in.H != w->g.H || in.m_cap != w->g.m_cap || in.T * in.K != w->g.send_rows)
    return "jax_sdma_moe combine: the call's shapes differ from its window set's (H " +
           std::to_string(in.H) + ", M_cap " + std::to_string(in.m_cap) + ", T*K " +
           std::to_string(in.T * in.K) + ")";
  if (in.H % cuda::kCols != 0) return "jax_sdma_moe combine: H must be a multiple of 8";
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
                     uint64_t(opt.timeout_s * 1e9), me->err_dev, in};
  cuda::ep_return_begin_kernel<<<1, 1, 0, st>>>(counter);
  JSM_CUDA_TRY("combine begin", cudaGetLastError());
  if (in.m_cap > 0) {
    const int grid = int(std::min<int64_t>(cuda::grid_for(in.m_cap, cuda::kThreads / cuda::kWarp),
                                           2 * cuda::num_sms()));
    cuda::ep_return_put_kernel<<<grid, cuda::kThreads, 0, st>>>(a);
    JSM_CUDA_TRY("combine put", cudaGetLastError());
  }
  cuda::ep_return_flag_kernel<<<1, cuda::kMaxRanks, 0, st>>>(a);
  JSM_CUDA_TRY("combine flags", cudaGetLastError());
  if (in.T > 0) {
    const int grid = int(std::min<int64_t>(in.T, 4 * cuda::num_sms()));
    cuda::ep_return_sum_kernel<<<grid, cuda::kThreads, 0, st>>>(a);
    JSM_CUDA_TRY("combine sum", cudaGetLastError());
  }
  return "";
}

}  // namespace ep
}  // namespace jsm
