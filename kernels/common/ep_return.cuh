// Stage2's way back through the window engines' return regions (protocol: ep_window.h, "The way
// back"), the device side shared by CUDA (engines sm and ce: kernels/cuda/ep/combine.cu) and HIP
// (engine sdma: kernels/rocm/sdma/combine.hip), included by one translation unit each:
//   ep_return_begin_kernel  the combine's epoch (device-side);
//   ep_return_put_kernel    a wave per landed row: the row (16-byte stores over the peer mapping)
//                           and its ReturnMeta at its (token, slot) of the source's slot; each
//                           block ends with a system fence;
//   ep_return_flag_kernel   after the puts (stream order: every block's fence has run), the epoch
//                           into ret_flag[q][rank] of every rank;
//   wait_returns            the bounded wait for every rank's flag;
//   ep_return_sum_kernel    waits, then y[t] = bf16 of the fma sum over k of weight * row in slot
//                           order over the slots stamped with this epoch (gpu_sum_slots.cuh: the
//                           bytes of the combine within a rank). by_position (CUDA's engine ce):
//                           slot (t, k) is the row at row_of[t * K + k], its send position.
#pragma once

#include <stdint.h>

#include "kernels/common/ep_window.h"
#include "kernels/common/gpu_sum_slots.cuh"
#include "kernels/common/gpu_sys.cuh"

namespace jsm {
namespace gpu {

struct ReturnArgs {
  PeerTable peers;
  EpWindowLayout L;
  int R, rank;
  const uint32_t* epoch_counter;  // the combine's, once ep_return_begin_kernel has run
  uint64_t timeout;               // in timer_now()'s unit
  EpError* err;
  CombineView in;
  int32_t* row_of;  // by position: [T * K] the send position of each (token, slot), -1 where none
};

constexpr int kReturnThreads = 256;

__device__ __forceinline__ uint32_t return_epoch(const ReturnArgs& a) {
  return *static_cast<volatile const uint32_t*>(a.epoch_counter);
}

__global__ void ep_return_begin_kernel(uint32_t* counter) { *counter += 1; }

__global__ void __launch_bounds__(kReturnThreads) ep_return_put_kernel(const ReturnArgs a) {
  const uint32_t epoch = return_epoch(a);
  const int q = int(epoch & 1), lane = threadIdx.x % kWarp;
  const CombineView& in = a.in;
  const int64_t vecs = in.H / 8;  // 16-byte vectors of a bf16 row
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; r < in.m_cap;
       r += int64_t(gridDim.x) * blockDim.x / kWarp) {
    const int32_t src = in.src_rank[r];
    if (src < 0) continue;
    const int32_t t = in.token[r], k = in.slot[r];
    // A header outside this combine is skipped, never written out of bounds: jsm.stage2's
    // check_layout call (kernels/common/gpu_stage2.h) names it and fails the program before the
    // combine runs.
    if (src >= a.R || t < 0 || t >= in.T || k < 0 || k >= in.K) continue;
    const int64_t at_row = int64_t(t) * in.K + k;
    uint4* dst = at<uint4>(a.peers.base[src], a.L.ret_rows[q]) + at_row * vecs;
    const uint4* row = reinterpret_cast<const uint4*>(in.rows) + r * vecs;
    int64_t c = lane;
    for (; c + 3 * kWarp < vecs; c += 4 * kWarp) {  // four loads in flight before the stores
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = load_cg(row + c + u * kWarp);
#pragma unroll
      for (int u = 0; u < 4; ++u) dst[c + u * kWarp] = v[u];
    }
    for (; c < vecs; c += kWarp) dst[c] = load_cg(row + c);
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
// epoch for every rank d (the first wave polls); an expiry is recorded (code 3) and the caller
// goes on: its results are not trusted, and the error surfaces at the next host check.
__device__ void wait_returns(const ReturnArgs& a, uint32_t epoch) {
  const uint32_t* flags = at<const uint32_t>(a.peers.base[a.rank], a.L.ret_flag[epoch & 1]);
  const uint64_t deadline = timer_now() + a.timeout;
  for (;;) {
    bool ok = true;
    int missing = -1;
    if (threadIdx.x < kWarp)
      for (int d = threadIdx.x; d < a.R; d += kWarp)
        if (!epoch_reached(ld_acquire_sys(flags + d), epoch)) ok = false, missing = d;
    if (__syncthreads_and(ok)) return;
    if (__syncthreads_or(threadIdx.x == 0 && timer_now() > deadline)) {
      if (missing >= 0) record_wait_error(a.err, 3, missing, 0, epoch);
      return;
    }
    poll_pause();
  }
}

// tokens t = blockIdx.x, + gridDim.x, ...; columns kSumCols * threadIdx.x, + ... (see the top)
__global__ void __launch_bounds__(kReturnThreads) ep_return_sum_kernel(const ReturnArgs a,
                                                                      bool by_position) {
  const uint32_t epoch = return_epoch(a);
  const int q = int(epoch & 1);
  uint8_t* own = a.peers.base[a.rank];
  if (!by_position) wait_returns(a, epoch);
  const CombineView& in = a.in;
  const uint16_t* rows = at<const uint16_t>(own, a.L.ret_rows[q]);
  const ReturnMeta* meta = at<const ReturnMeta>(own, a.L.ret_meta[q]);
  for (int64_t t = blockIdx.x; t < in.T; t += gridDim.x)
    for (int64_t c = kSumCols * int64_t(threadIdx.x); c < in.H;
         c += kSumCols * int64_t(blockDim.x))
      sum_slots(in.K, [&](int64_t k, const uint16_t*& row, float& w) {
        int64_t i = t * in.K + k;
        if (by_position) {
          i = a.row_of[i];
          if (i < 0) return false;  // no row for this slot in this epoch
        }
        const int2 m = load_cg(reinterpret_cast<const int2*>(meta + i));
        if (uint32_t(m.x) != epoch) return false;  // no row for this slot in this epoch
        row = rows + i * in.H + c;
        w = __int_as_float(m.y);
        return true;
      }, in.y + t * in.H + c);
}

}  // namespace gpu
}  // namespace jsm
