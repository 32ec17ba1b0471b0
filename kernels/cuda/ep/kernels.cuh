// Device side of the multi-GPU dispatch engines (protocol: kernels/cuda/ep/window.h), included by
// engine.cu only (its launches are the only ones):
//   ep_begin_kernel    the call's epoch (device-side: CUDA graph replays count too);
//   ep_headers_kernel  engine `ce`: the outgoing rows' 16-byte headers and meta rows (header +
//                      scales), so one copy per destination carries both;
//   ep_place_kernel    engine `ce`: the peers' rows from this rank's staging to their offsets;
//   ep_sm_kernel       engine `sm`: a few blocks put the plan and every segment to the peers with
//                      stores over NVLink and raise the signals (no host involvement); engine
//                      `ce`: only this rank's own segments (within the GPU);
//   ep_layout_kernel   both engines: wait (bounded) for every source's plan, write the §4 layout;
//   ep_rows_kernel     both engines: wait (bounded) for every signal of this rank's slot, then
//                      write the row headers (and the rows, unless a fused GEMM read them).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/ep/args.h"
#include "kernels/cuda/ep/copy.cuh"
#include "kernels/cuda/ep/received.cuh"
#include "kernels/cuda/layout.cuh"

namespace jsm {
namespace cuda {

__device__ __forceinline__ uint32_t call_epoch(const EpArgs& a) {
  return *static_cast<volatile const uint32_t*>(a.epoch_counter);
}

// The first kernel of a call (not of an absent rank's): the call's epoch.
__global__ void ep_begin_kernel(uint32_t* epoch_counter) { *epoch_counter += 1; }

// Engine ce's outgoing rows: their headers (send_headers, read by its combine) and their meta
// rows (send_meta: the header, then the row's scale bytes), so that one copy per destination
// carries both.
__global__ void ep_headers_kernel(const EpArgs a, int64_t n) {
  const int64_t HS = a.g.H / kBlock, stride = ep_meta_stride(a.g.H);
  uint8_t* own = a.peers.base[a.rank];
  RowHeader* headers = at<RowHeader>(own, a.L.send_headers);
  uint8_t* meta = at<uint8_t>(own, a.L.send_meta);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const RowHeader h{a.rank, a.token[i], a.slot[i], a.weight[i]};
    headers[i] = h;
    uint8_t* m = meta + i * stride;
    *reinterpret_cast<RowHeader*>(m) = h;
    copy_scale_row(m + sizeof(RowHeader), a.scales + i * HS, HS);
  }
}

// Waits (bounded) until plan_flag[p][s] of this rank's window has reached the epoch for every
// source; false (and the error recorded) on timeout. All threads of the block call it.
__device__ bool wait_plan(const EpArgs& a, uint32_t epoch) {
  uint8_t* own = a.peers.base[a.rank];
  return wait_flags_block<0, false>(
      at<uint32_t>(own, a.L.plan_flag[epoch & 1]), a.g.R, epoch, a.timeout_ns, a.err, 1,
      [](int s) { return WaitWho{uint32_t(s), 0}; }, [] { __nanosleep(500); });
}

// Shared-memory layout of every destination for this source: base row and rows kept of each
// (destination, expert) segment, and where the segment starts in the send buffer.
struct SegmentTable {
  int32_t* base;   // [R * EL]
  int32_t* keep;   // [R * EL]
  int32_t* start;  // [R * EL + 1]
  int32_t* scratch;  // [3 * EL + 1]: totals, offsets, counts and dropped of one destination
  static __host__ __device__ size_t bytes(int64_t R, int64_t EL) {
    return size_t(3 * R * EL + 1 + 3 * EL + 1) * sizeof(int32_t);
  }
};

__device__ void build_segments(const EpArgs& a, int p, SegmentTable t) {
  const int R = int(a.g.R), EL = int(a.g.EL);
  const int32_t* plan = at<const int32_t>(a.peers.base[a.rank], a.L.plan[p]);
  int32_t* totals = t.scratch;           // [EL]
  int32_t* offsets = t.scratch + EL;     // [EL]
  int32_t* counts = t.scratch + 2 * EL;  // [EL] + dropped
  for (int d = 0; d < R; ++d) {
    for (int e = threadIdx.x; e < EL; e += blockDim.x) {
      int32_t sum = 0;
      for (int s = 0; s < R; ++s) sum += __ldcg(plan + int64_t(s) * R * EL + d * EL + e);
      totals[e] = sum;
    }
    __syncthreads();
    landing_layout_smem(totals, EL, a.row_align, a.g.m_cap, offsets, counts, counts + EL);
    for (int e = threadIdx.x; e < EL; e += blockDim.x) {
      int64_t base = offsets[e];
      for (int s = 0; s < a.rank; ++s) base += __ldcg(plan + int64_t(s) * R * EL + d * EL + e);
      const int64_t n = a.counts[d * EL + e];
      const int64_t room = int64_t(offsets[e]) + counts[e] - base;
      t.base[d * EL + e] = int32_t(base);
      t.keep[d * EL + e] = int32_t(n < room ? n : (room > 0 ? room : 0));
    }
    __syncthreads();
  }
  exclusive_scan_smem(R * EL, t.start, [&](int i) { return a.counts[i]; });
}

// Engine `sm`: block 0 first puts the plan; every block then waits for all plans and stores
// segments q = blockIdx.x, + gridDim.x, ... in expert order (expert q / R to every destination,
// peers first), raising each segment's signal at its destination once its rows are stored: every
// rank's fused GEMM can start on its first experts while the later ones are still moving.
// own_only (engine ce): the copy engines put the plan and the peers' segments; the blocks store
// this rank's own segments (expert q), so the host enqueues no copy within the GPU; block 0 also
// publishes the whole plan to the host (a.host_plan, then the epoch in *a.host_ready), which
// the host reads once it has synchronised the stream (copy_engine.cu ce_plan_wait).
__global__ void __launch_bounds__(512) ep_sm_kernel(const EpArgs a, bool own_only) {
  extern __shared__ int32_t smem[];
  const int R = int(a.g.R), EL = int(a.g.EL);
  const int64_t H = a.g.H, HS = H / kBlock;
  const uint32_t epoch = call_epoch(a);
  const int p = int(epoch & 1);
  const bool publish = own_only && blockIdx.x == 0 && a.host_ready != nullptr;
  if (blockIdx.x == 0 && !own_only) {
    for (int d = 0; d < R; ++d) {
      int32_t* dst = at<int32_t>(a.peers.base[d], a.L.plan[p]) + int64_t(a.rank) * R * EL;
      for (int i = threadIdx.x; i < R * EL; i += blockDim.x) dst[i] = a.counts[i];
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < R)
      st_release_sys(at<uint32_t>(a.peers.base[threadIdx.x], a.L.plan_flag[p]) + a.rank, epoch);
  }
  if (!wait_plan(a, epoch)) return;
  if (publish) {
    const int32_t* plan = at<const int32_t>(a.peers.base[a.rank], a.L.plan[p]);
    for (int i = threadIdx.x; i < R * R * EL; i += blockDim.x) a.host_plan[i] = __ldcg(plan + i);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) st_release_sys(a.host_ready, epoch);
  }
  SegmentTable t{smem, smem + R * EL, smem + 2 * R * EL, smem + 3 * R * EL + 1};
  build_segments(a, p, t);
  for (int q = blockIdx.x; q < (own_only ? EL : R * EL); q += gridDim.x) {
    const int e = own_only ? q : q / R, d = own_only ? a.rank : (a.rank + 1 + q % R) % R;
    const int i = d * EL + e;
    const int64_t keep = t.keep[i], base = t.base[i], from = t.start[i];
    uint8_t* dst = a.peers.base[d];
    block_copy(at<uint8_t>(dst, a.L.values[p]) + base * H, a.values + from * H, keep * H);
    block_copy(at<uint8_t>(dst, a.L.scales[p]) + base * HS, a.scales + from * HS, keep * HS);
    RowHeader* hdr = at<RowHeader>(dst, a.L.headers[p]) + base;
    for (int64_t r = threadIdx.x; r < keep; r += blockDim.x)
      hdr[r] = RowHeader{a.rank, a.token[from + r], a.slot[from + r], a.weight[from + r]};
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0)
      st_release_sys(at<uint32_t>(dst, a.L.seg_flag[p]) + int64_t(e) * R + a.rank, epoch);
  }
}

// Engine ce's placement (on the rank's `place` stream, on SMs the fused GEMM leaves free): the
// peers' rows, each put in one piece into this rank's staging (ep_window.h, step 3), to their §4
// offsets in slot p. Items (expert e, peer s) in expert order, blockIdx.x, + gridDim.x, ...: a
// block waits (bounded, naming the peer) for s's staging flag, copies the segment's values,
// scales and headers (a source's rows to this rank sit in its send order: expert, then token),
// then raises seg_flag[p][e][s] itself, so the fused GEMM starts each expert as its rows are
// placed. Rows past an expert's room (overflow) are not placed: the other engines drop them too.
__global__ void __launch_bounds__(512) ep_place_kernel(const EpArgs a) {
  extern __shared__ int32_t smem[];  // ReceivedSegments: 3 * EL + 1
  const int R = int(a.g.R), me = a.rank;
  const int64_t H = a.g.H, HS = H / kBlock, stride = ep_meta_stride(H);
  const uint32_t epoch = call_epoch(a);
  const int p = int(epoch & 1);
  uint8_t* own = a.peers.base[me];
  if (!wait_plan(a, epoch)) return;
  ReceivedSegments segs{at<const int32_t>(own, a.L.plan[p]), R, int(a.g.EL), me};
  segs.build(smem, a.row_align, a.g.m_cap);
  const uint32_t* flags = at<const uint32_t>(own, a.L.stage_flag[p]);
  __shared__ ReceivedSegment seg;
  for (int q = blockIdx.x; q < segs.EL * (R - 1); q += gridDim.x) {
    const int e = q / (R - 1), s = (me + 1 + q % (R - 1)) % R;
    if (threadIdx.x == 0) seg = segs.of(e, s);
    // (its barriers publish seg)
    if (!wait_flags_block<1, true>(
            flags + s, 1, epoch, a.timeout_ns, a.err, 4,
            [s, e](int) { return WaitWho{uint32_t(s), uint32_t(e)}; }, [] { poll_pause(); }))
      return;
    const int64_t base = seg.base, from = seg.from, keep = seg.keep;
    const int64_t region = ep_stage_index(s, me) * a.g.send_rows;
    const uint8_t* src = at<const uint8_t>(own, a.L.stage_values[p]) + (region + from) * H;
    block_copy(at<uint8_t>(own, a.L.values[p]) + base * H, src, keep * H);
    const uint8_t* meta = at<const uint8_t>(own, a.L.stage_meta[p]) + (region + from) * stride;
    uint8_t* scales = at<uint8_t>(own, a.L.scales[p]) + base * HS;
    RowHeader* hdr = at<RowHeader>(own, a.L.headers[p]) + base;
    for (int64_t r = threadIdx.x; r < keep; r += blockDim.x) {
      const int4 v = __ldcg(reinterpret_cast<const int4*>(meta + r * stride));
      hdr[r] = RowHeader{v.x, v.y, v.z, __int_as_float(v.w)};
      copy_scale_row(scales + r * HS, meta + r * stride + sizeof(RowHeader), HS);
    }
    __threadfence();
    __syncthreads();  // also: seg is read before the next item's thread 0 writes it
    if (threadIdx.x == 0)
      st_release_sys(at<uint32_t>(own, a.L.seg_flag[p]) + int64_t(e) * R + s, epoch);
  }
}

// The rows dropped (past M_cap) over every destination of the axis, from the whole plan
// [R src][R dst][EL] every rank holds: each destination's §4 layout (landing_layout, as that
// destination computes it) in turn. All threads of the block call it; smem: 3 * EL + 1 int32.
// Thread 0's return value is the count.
__device__ int64_t dropped_on_every_rank(const int32_t* plan, int R, int EL, int64_t row_align,
                                         int64_t m_cap, int32_t* smem) {
  int32_t* totals = smem;
  int32_t* offsets = smem + EL;
  int32_t* counts = smem + 2 * EL;  // [EL] + dropped
  int64_t dropped = 0;
  for (int d = 0; d < R; ++d) {
    for (int e = threadIdx.x; e < EL; e += blockDim.x) {
      int32_t sum = 0;
      for (int s = 0; s < R; ++s) sum += __ldcg(plan + (int64_t(s) * R + d) * EL + e);
      totals[e] = sum;
    }
    __syncthreads();
    landing_layout_smem(totals, EL, row_align, m_cap, offsets, counts, counts + EL);
    dropped += counts[EL];
    __syncthreads();  // counts[EL] read before the next destination's layout writes it
  }
  return dropped;
}

// Both engines, first after the puts: wait (bounded) for every source's plan, then write this
// rank's §4 layout (expert offsets and counts, rows, overflow). absent: this rank takes no part
// (fault injection): no rows, no wait. global_overflow (DispatchOptions): `overflow` counts the
// rows dropped on every rank of the axis, the same number on each (stage1(check=True) then fails
// alike on every rank); else this rank's.
__global__ void ep_layout_kernel(const EpArgs a, LandedView out, bool absent,
                                 bool global_overflow) {
  extern __shared__ int32_t smem[];  // ReceivedSegments: 3 * EL + 1
  const int EL = int(a.g.EL);
  const uint32_t epoch = absent ? 0 : call_epoch(a);
  const bool plan_ok = !absent && wait_plan(a, epoch);
  const int32_t* plan = at<const int32_t>(a.peers.base[a.rank], a.L.plan[epoch & 1]);
  int64_t dropped_everywhere = 0;
  if (global_overflow && plan_ok)
    dropped_everywhere =
        dropped_on_every_rank(plan, int(a.g.R), EL, a.row_align, a.g.m_cap, smem);
  ReceivedSegments segs{plan, int(a.g.R), EL, a.rank};
  segs.build(smem, a.row_align, a.g.m_cap, plan_ok);  // no plan: nothing landed
  for (int e = threadIdx.x; e < EL; e += blockDim.x) {
    out.expert_offsets[e] = segs.offsets[e];
    out.expert_counts[e] = segs.counts[e];
  }
  if (threadIdx.x == 0) {
    int32_t rows = 0;
    for (int e = 0; e < EL; ++e) rows += segs.counts[e];
    *out.num_rows = rows;
    *out.overflow = global_overflow ? int32_t(dropped_everywhere) : segs.counts[EL];
  }
}

// Both engines, last: wait (bounded) for every (expert, source) signal of this rank's slot, then
// write the row headers (source rank, token, slot, weight) and, unless the fused GEMM read the
// rows straight from the slot, the rows themselves; padding rows get -1 / 0. The slot already
// holds the §4 layout (each source put its rows at their final offsets): landed row r is slot
// row r. Needs ep_layout_kernel's offsets and counts.
__global__ void ep_rows_kernel(const EpArgs a, LandedView out, bool absent, bool copy_rows) {
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
    // the (expert, source) flags, warp 0 polling; the call already failed (the plan's wait, the
    // GEMM's): no wait (reading the host-memory error word in each of the grid's 528 blocks at
    // every poll cost 0.5 ms per call, 2xH200). On expiry the rows are not trusted; the error
    // surfaces at the next host check.
    wait_flags_block<kWarp, true>(
        at<const uint32_t>(own, a.L.seg_flag[p]), R * EL, epoch, a.timeout_ns, a.err, 2,
        [R](int i) { return WaitWho{uint32_t(i % R), uint32_t(i / R)}; }, [] { poll_pause(); });
  }
  __syncthreads();
  const uint8_t* values = at<const uint8_t>(own, a.L.values[p]);
  const uint8_t* scales = at<const uint8_t>(own, a.L.scales[p]);
  const RowHeader* hdr = at<const RowHeader>(own, a.L.headers[p]);
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; r < m_cap;
       r += int64_t(gridDim.x) * blockDim.x / kWarp) {
    const bool landed = expert_of_row(offsets, counts, EL, r) >= 0;
    if (copy_rows) {
      uint4* dst = reinterpret_cast<uint4*>(out.values + r * H);
      const uint4* src = reinterpret_cast<const uint4*>(values + r * H);
      for (int64_t c = lane; c < H / 16; c += kWarp)
        dst[c] = landed ? __ldcg(src + c) : make_uint4(0, 0, 0, 0);
      for (int64_t c = lane; c < HS; c += kWarp)
        out.scales[r * HS + c] = landed ? __ldcg(scales + r * HS + c) : uint8_t(0);
    }
    if (lane == 0) {
      RowHeader h{-1, -1, -1, 0.0f};
      if (landed) {
        const int4 v = __ldcg(reinterpret_cast<const int4*>(hdr + r));
        h = RowHeader{v.x, v.y, v.z, __int_as_float(v.w)};
      }
      out.src_rank[r] = h.src_rank;
      out.token[r] = h.token;
      out.slot[r] = h.slot;
      out.weight[r] = h.weight;
    }
  }
}

}  // namespace cuda
}  // namespace jsm
