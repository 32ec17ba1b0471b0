// Kernels of the memory-bound Stage1 stages and their host launchers (gpu_stages.h): quantize,
// route, qpack / pack, the local (R = 1) dispatch, and the zero padding rows of gemm1's output.
// One source for CUDA and HIP (gpu_compat.h), compiled once per backend by kernels/cuda/stages.cu
// and kernels/rocm/stages.hip; include it in no other file. Same results as kernels/cpu (the §3
// bytes come from the shared kernels/common/mxfp8.h). The lane arithmetic is in units of kWarp
// (32 lanes on NVIDIA, 64 on CDNA) and every wave-level operation spans the whole wave.
#pragma once

#include "kernels/common/gpu_compat.h"
#include "kernels/common/gpu_layout.cuh"
#include "kernels/common/gpu_stages.h"
#include "kernels/common/mxfp8.h"

namespace jsm {
namespace gpu {

// One 32-element block per thread: four 16-byte loads, two 16-byte stores.
template <class In>
__device__ __forceinline__ void load_block(const In* src, float* x);

template <>
__device__ __forceinline__ void load_block<uint16_t>(const uint16_t* src, float* x) {
  const uint4* p = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint4 v = p[q];
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[q * 8 + 2 * j] = bits_to_f32(w[j] << 16);
      x[q * 8 + 2 * j + 1] = bits_to_f32(w[j] & 0xFFFF0000u);
    }
  }
}

template <>
__device__ __forceinline__ void load_block<float>(const float* src, float* x) {
  const float4* p = reinterpret_cast<const float4*>(src);
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    float4 v = p[q];
    x[4 * q] = v.x, x[4 * q + 1] = v.y, x[4 * q + 2] = v.z, x[4 * q + 3] = v.w;
  }
}

__device__ __forceinline__ void quantize_to_words(const float* x, uint4* out, uint8_t* scale) {
  uint8_t y[kBlock];
  *scale = quantize_block(x, y);
  uint32_t w[8];
#pragma unroll
  for (int j = 0; j < 8; ++j)
    w[j] = uint32_t(y[4 * j]) | uint32_t(y[4 * j + 1]) << 8 | uint32_t(y[4 * j + 2]) << 16 |
           uint32_t(y[4 * j + 3]) << 24;
  out[0] = make_uint4(w[0], w[1], w[2], w[3]);
  out[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// quantize: blocks = rows * H / 32, one per thread. Needs 16-byte aligned rows (H % 32 == 0).
template <class In>
__global__ void quantize_kernel(const In* x, int64_t blocks, uint8_t* values, uint8_t* scales) {
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    float v[kBlock];
    load_block<In>(x + b * kBlock, v);
    uint4 q[2];
    quantize_to_words(v, q, scales + b);
    reinterpret_cast<uint4*>(values + b * kBlock)[0] = q[0];
    reinterpret_cast<uint4*>(values + b * kBlock)[1] = q[1];
  }
}

// The sum of v over the block's threads, returned to every thread; warp_sums holds one int per
// wave of the block and is free again on return.
__device__ __forceinline__ int block_sum(int v, int32_t* warp_sums) {
  v = wave_sum(v);
  if (threadIdx.x % kWarp == 0) warp_sums[threadIdx.x / kWarp] = v;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < int(blockDim.x / kWarp); ++w) total += warp_sums[w];
  __syncthreads();
  return total;
}

// route in one launch, grid E + 1, one block per expert: block e scans all ids in order, so
// positions keep the (token, slot) order without a sort. E blocks x T*K ids are L2 reads, four
// ids per 16-byte load where the ids are 16-byte aligned (XLA's buffers are): a block's loads are
// then a few rounds deep, not T*K / blockDim (the scan is latency-bound, not bandwidth-bound).
// Block e < E first counts the ids in [0, e) (its segment's start: a second scan in place of a
// second launch), then places its ids and writes its count; block E counts the ids >= E and
// writes -1 to the send_pos of every id outside [0, E).
constexpr int kRouteThreads = 1024;
// Each thread takes kPlacePerThread consecutive ids of a chunk, so the three block barriers of a
// chunk are paid once per 8192 ids (a chunk of one id per thread paid them per 1024).
constexpr int kPlacePerThread = 8;  // two 16-byte loads of ids
// Two blocks per SM (32 registers a thread on sm_90): dsv3's 257 blocks in one wave of 132 SMs.
__global__ void __launch_bounds__(kRouteThreads, 2)
    route_kernel(const int32_t* ids, int64_t n, int32_t E, int32_t* send_counts,
                 int32_t* send_pos, int32_t* num_invalid) {
  __shared__ int32_t warp_sums[kRouteThreads / kWarp];
  __shared__ int32_t base;
  const int e = blockIdx.x, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  const bool aligned = reinterpret_cast<uintptr_t>(ids) % 16 == 0;
  int count = 0;
  auto visit = [&](int64_t i, int32_t id) {
    if (e < E) {
      count += uint32_t(id) < uint32_t(e);  // 0 <= id < e
    } else {
      count += id >= E;  // num_invalid counts ids past E; masked ids (< 0) are not invalid
      if (id < 0 || id >= E) send_pos[i] = -1;
    }
  };
  const int64_t n4 = aligned ? n / 4 : 0;
  if (e > 0) {  // block 0's segment starts at 0
#pragma unroll 4
    for (int64_t j = threadIdx.x; j < n4; j += blockDim.x) {
      const int4 v = reinterpret_cast<const int4*>(ids)[j];
      visit(4 * j, v.x), visit(4 * j + 1, v.y), visit(4 * j + 2, v.z), visit(4 * j + 3, v.w);
    }
    for (int64_t i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) visit(i, ids[i]);
  }
  const int start = block_sum(count, warp_sums);
  if (e == E) {
    if (threadIdx.x == 0) *num_invalid = start;
    return;
  }
  if (threadIdx.x == 0) base = start;
  __syncthreads();
  const int64_t per_chunk = int64_t(blockDim.x) * kPlacePerThread;
  for (int64_t chunk = 0; chunk < n; chunk += per_chunk) {
    const int64_t i0 = chunk + int64_t(threadIdx.x) * kPlacePerThread;
    bool hit[kPlacePerThread];
    int mine = 0;
    if (aligned && i0 + kPlacePerThread <= n) {  // two 16-byte loads
      const int4 a = reinterpret_cast<const int4*>(ids + i0)[0];
      const int4 b = reinterpret_cast<const int4*>(ids + i0)[1];
      const int32_t v[kPlacePerThread] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int j = 0; j < kPlacePerThread; ++j) hit[j] = v[j] == e;
    } else {
#pragma unroll
      for (int j = 0; j < kPlacePerThread; ++j) hit[j] = i0 + j < n && ids[i0 + j] == e;
    }
#pragma unroll
    for (int j = 0; j < kPlacePerThread; ++j) mine += hit[j];
    int incl = mine;  // inclusive prefix over the warp's threads, in id order
#pragma unroll
    for (int o = 1; o < kWarp; o <<= 1) {
      const int v = shfl_up(incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == kWarp - 1) warp_sums[warp] = incl;
    __syncthreads();
    int warp_before = 0, chunk_total = 0;
    for (int w = 0; w < warps; ++w) {  // at most kRouteThreads / kWarp: a short smem loop
      warp_before += w < warp ? warp_sums[w] : 0;
      chunk_total += warp_sums[w];
    }
    int pos = base + warp_before + incl - mine;
#pragma unroll
    for (int j = 0; j < kPlacePerThread; ++j)
      if (hit[j]) send_pos[i0 + j] = pos++;
    __syncthreads();
    if (threadIdx.x == 0) base += chunk_total;
    __syncthreads();
  }
  if (threadIdx.x == 0) send_counts[e] = base - start;
}

// qpack / pack: one warp per token; lane j handles MX blocks j, j + kWarp, ...; each block is
// quantised (qpack) or read (pack) once and stored to every send row of the token (token_rows:
// once, to the token's row; the headers go to its send rows either way). The kWarp
// blocks of a round (1 KB of fp8 on CUDA, 2 KB on CDNA) go through shared memory so each store
// instruction writes 16 * kWarp contiguous bytes, 16 per lane: stored straight from the lanes,
// each instruction would cover every other 16 bytes of the row (half of every line).
//
// The send rows no (token, slot) goes to get token = slot = -1, weight 0 from the same launch:
// its first header_blocks blocks each take spans of kHeaderSpan send rows, mark in shared memory
// the rows send_pos points into (a scan of send_pos per span, from L2) and write the others'
// headers; the token warps write only marked rows, so the two never meet. With route's one
// launch the stage is two launches, not six (three memsets, route's two passes): docs/PERF.md §3.
constexpr int kPackThreads = 256, kPackWarps = kPackThreads / kWarp;
constexpr int kHeaderSpan = 16384;        // send rows per span: a 2 KB bitmap
constexpr int64_t kMaxHeaderBlocks = 64;  // spans past them loop
__device__ __forceinline__ void unused_row_headers(const int32_t* send_pos, int64_t n, int64_t S,
                                                   int64_t block, int64_t blocks, uint32_t* used,
                                                   int32_t* token, int32_t* slot,
                                                   float* weight) {
  const bool aligned = reinterpret_cast<uintptr_t>(send_pos) % 16 == 0;
  const int64_t n4 = aligned ? n / 4 : 0;
  for (int64_t p0 = block * kHeaderSpan; p0 < S; p0 += blocks * kHeaderSpan) {
    for (int w = threadIdx.x; w < kHeaderSpan / 32; w += blockDim.x) used[w] = 0;
    __syncthreads();
    auto mark = [&](int32_t p) {
      const int64_t q = int64_t(p) - p0;  // p < 0 (unrouted): q < 0
      if (q >= 0 && q < kHeaderSpan) atomicOr(&used[q / 32], 1u << (q % 32));
    };
    for (int64_t j = threadIdx.x; j < n4; j += blockDim.x) {
      const int4 v = reinterpret_cast<const int4*>(send_pos)[j];
      mark(v.x), mark(v.y), mark(v.z), mark(v.w);
    }
    for (int64_t i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) mark(send_pos[i]);
    __syncthreads();
    for (int q = threadIdx.x; q < kHeaderSpan && p0 + q < S; q += blockDim.x)
      if (!(used[q / 32] >> (q % 32) & 1u)) token[p0 + q] = -1, slot[p0 + q] = -1,
                                              weight[p0 + q] = 0.0f;
    __syncthreads();  // `used` is the next span's
  }
}

template <bool kQuantize>
__global__ void pack_kernel(const uint16_t* x, const uint8_t* x_values, const uint8_t* x_scales,
                            const float* weights, const int32_t* send_pos, int64_t T, int K,
                            int64_t H, int64_t S, int header_blocks, bool token_rows,
                            uint8_t* values, uint8_t* scales, int32_t* token, int32_t* slot,
                            float* weight) {
  __shared__ uint4 round_bytes[kPackWarps][2 * kWarp];  // one warp's kWarp blocks of fp8
  static_assert(sizeof(round_bytes) >= kHeaderSpan / 8, "a header block's bitmap");
  if (int(blockIdx.x) < header_blocks) {
    unused_row_headers(send_pos, T * K, S, blockIdx.x, header_blocks,
                       reinterpret_cast<uint32_t*>(round_bytes), token, slot, weight);
    return;
  }
  const int lane = threadIdx.x % kWarp;
  const int64_t t = ((blockIdx.x - header_blocks) * int64_t(blockDim.x) + threadIdx.x) / kWarp;
  if (t >= T) return;
  const int64_t HS = H / kBlock;
  int32_t pos[16];
  int routed = 0;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    pos[k] = k < K ? send_pos[t * K + k] : -1;
    if (pos[k] >= S) pos[k] = -1;  // not a send row: nothing is written for it
    routed |= pos[k] >= 0;
  }
  if (!routed) return;
  if (lane < K && pos[lane] >= 0) {
    token[pos[lane]] = int32_t(t);
    slot[pos[lane]] = lane;
    weight[pos[lane]] = weights[t * K + lane];
  }
  if (token_rows) {  // the rows below: the token's own, once
    pos[0] = int32_t(t);
#pragma unroll
    for (int k = 1; k < 16; ++k) pos[k] = -1;
  }
  uint4* mine = round_bytes[threadIdx.x / kWarp];
  for (int64_t b0 = 0; b0 < HS; b0 += kWarp) {  // warp-uniform rounds of kWarp MX blocks
    const int64_t b = b0 + lane;
    const bool active = b < HS;
    uint8_t s = 0;
    if (active) {
      uint4 q[2];
      if (kQuantize) {
        float v[kBlock];
        load_block<uint16_t>(x + t * H + b * kBlock, v);
        quantize_to_words(v, q, &s);
      } else {
        const uint4* src = reinterpret_cast<const uint4*>(x_values + t * H + b * kBlock);
        q[0] = src[0], q[1] = src[1];
        s = x_scales[t * HS + b];
      }
      mine[2 * lane] = q[0], mine[2 * lane + 1] = q[1];
    }
    syncwarp();
    const int64_t round = kBlock * (HS - b0 < kWarp ? HS - b0 : kWarp);  // bytes this round
    const uint4 lo = mine[lane], hi = mine[kWarp + lane];  // bytes 16 lane, 16 (kWarp + lane)
    syncwarp();  // the next round overwrites `mine`
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      if (pos[k] < 0) continue;
      uint4* dst = reinterpret_cast<uint4*>(values + pos[k] * H + b0 * kBlock);
      if (16 * lane < round) dst[lane] = lo;
      if (16 * (kWarp + lane) < round) dst[kWarp + lane] = hi;
      if (active) scales[pos[k] * HS + b] = s;
    }
  }
}

// dispatch with R = 1: every landing row, landed or padding, written by one warp (kRows), or only
// the layout and the rows' headers, one thread a row (!kRows: the fused GEMM of engine local
// reads the rows from the send buffer).
template <bool kRows>
__global__ void dispatch_local_kernel(const uint8_t* values, const uint8_t* scales,
                                      const int32_t* token, const int32_t* slot,
                                      const float* weight, const int32_t* send_counts, int EL,
                                      int64_t H, int64_t m_cap, int64_t row_align,
                                      uint8_t* out_values, uint8_t* out_scales, int32_t* src_rank,
                                      int32_t* out_token, int32_t* out_slot, float* out_weight,
                                      int32_t* expert_offsets, int32_t* expert_counts,
                                      int32_t* num_rows, int32_t* overflow) {
  extern __shared__ int32_t smem[];  // offsets[EL], counts[EL], seg_start[EL], dropped
  int32_t* offsets = smem;
  int32_t* counts = smem + EL;
  int32_t* seg_start = smem + 2 * EL;
  // the scan's last entry (the total, unused) is overwritten by `dropped` right after
  exclusive_scan_smem(EL, seg_start, [&](int e) { return send_counts[e]; });
  landing_layout_smem(send_counts, EL, row_align, m_cap, offsets, counts, smem + 3 * EL);
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0) {
      int32_t rows = 0;
      for (int e = 0; e < EL; ++e) {
        expert_offsets[e] = offsets[e];
        expert_counts[e] = counts[e];
        rows += counts[e];
      }
      *num_rows = rows;
      *overflow = smem[3 * EL];
    }
  }
  __syncthreads();
  constexpr int kThreadsPerRow = kRows ? kWarp : 1;
  const int lane = threadIdx.x % kThreadsPerRow;
  const int64_t HS = H / kBlock;
  const bool wide_scales = HS % 16 == 0 && reinterpret_cast<uintptr_t>(scales) % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(out_scales) % 16 == 0;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kThreadsPerRow; r < m_cap;
       r += int64_t(gridDim.x) * blockDim.x / kThreadsPerRow) {
    const int e = expert_of_row(offsets, counts, EL, r);
    const int64_t p = e < 0 ? -1 : seg_start[e] + (r - offsets[e]);
    if constexpr (kRows) {
      uint4* dst = reinterpret_cast<uint4*>(out_values + r * H);
      const uint4* src = reinterpret_cast<const uint4*>(values + p * H);
      const uint4 zero = make_uint4(0, 0, 0, 0);
      for (int64_t c = lane; c < H / 16; c += kWarp) dst[c] = p < 0 ? zero : src[c];
      if (wide_scales) {  // 16 bytes a lane, not 1
        uint4* sdst = reinterpret_cast<uint4*>(out_scales + r * HS);
        const uint4* ssrc = reinterpret_cast<const uint4*>(scales + p * HS);
        for (int64_t c = lane; c < HS / 16; c += kWarp) sdst[c] = p < 0 ? zero : ssrc[c];
      } else {
        for (int64_t c = lane; c < HS; c += kWarp)
          out_scales[r * HS + c] = p < 0 ? 0 : scales[p * HS + c];
      }
    }
    if (lane == 0) {
      src_rank[r] = p < 0 ? -1 : 0;
      out_token[r] = p < 0 ? -1 : token[p];
      out_slot[r] = p < 0 ? -1 : slot[p];
      out_weight[r] = p < 0 ? 0.0f : weight[p];
    }
  }
}

// gemm1's padding rows: bf16 zeros, or MX-fp8 zeros (value 0, scale 85 = quantised zero block).
__global__ void zero_padding_rows_kernel(const int32_t* expert_offsets,
                                         const int32_t* expert_counts, int EL, int64_t m_cap,
                                         int64_t row_bytes, uint8_t* h, uint8_t* h_scales,
                                         int64_t scale_bytes) {
  extern __shared__ int32_t smem[];
  for (int e = threadIdx.x; e < EL; e += blockDim.x)
    smem[e] = expert_offsets[e], smem[EL + e] = expert_counts[e];
  __syncthreads();
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; r < m_cap;
       r += int64_t(gridDim.x) * blockDim.x / kWarp) {
    if (expert_of_row(smem, smem + EL, EL, r) >= 0) continue;
    uint4* dst = reinterpret_cast<uint4*>(h + r * row_bytes);
    for (int64_t c = lane; c < row_bytes / 16; c += kWarp) dst[c] = make_uint4(0, 0, 0, 0);
    if (h_scales)
      for (int64_t c = lane; c < scale_bytes; c += kWarp) h_scales[r * scale_bytes + c] = 85;
  }
}

void launch_quantize(const void* x, bool x_bf16, int64_t blocks, uint8_t* values, uint8_t* scales,
                     Stream stream) {
  if (x_bf16)
    quantize_kernel<uint16_t><<<grid_for(blocks, 256), 256, 0, stream>>>(
        static_cast<const uint16_t*>(x), blocks, values, scales);
  else
    quantize_kernel<float><<<grid_for(blocks, 256), 256, 0, stream>>>(
        static_cast<const float*>(x), blocks, values, scales);
}

void launch_route(const int32_t* ids, int64_t n, int32_t E, int32_t* send_counts,
                  int32_t* send_pos, int32_t* num_invalid, Stream stream) {
  route_kernel<<<E + 1, kRouteThreads, 0, stream>>>(ids, n, E, send_counts, send_pos,
                                                   num_invalid);
}

void launch_pack(bool quantize, const PackArgs& a, Stream stream) {
  const int64_t spans = (a.S + kHeaderSpan - 1) / kHeaderSpan;
  const int header_blocks = int(spans < kMaxHeaderBlocks ? spans : kMaxHeaderBlocks);
  const int64_t grid = header_blocks + (a.T + kPackWarps - 1) / kPackWarps;
  if (grid == 0) return;
  if (quantize)
    pack_kernel<true><<<grid, kPackThreads, 0, stream>>>(
        a.x, a.x_values, a.x_scales, a.weights, a.send_pos, a.T, a.K, a.H, a.S, header_blocks,
        a.token_rows, a.values, a.scales, a.token, a.slot, a.weight);
  else
    pack_kernel<false><<<grid, kPackThreads, 0, stream>>>(
        a.x, a.x_values, a.x_scales, a.weights, a.send_pos, a.T, a.K, a.H, a.S, header_blocks,
        a.token_rows, a.values, a.scales, a.token, a.slot, a.weight);
}

template <bool kRows>
void launch_dispatch_local_kernel(const SendView& send, int EL, int64_t H, int64_t m_cap,
                                  int64_t row_align, const LandedView& out, Stream stream) {
  dispatch_local_kernel<kRows>
      <<<grid_for(m_cap, kRows ? 8 : 256), 256, (3 * EL + 1) * sizeof(int32_t), stream>>>(
          send.values, send.scales, send.token, send.slot, send.weight, send.counts, EL, H,
          m_cap, row_align, out.values, out.scales, out.src_rank, out.token, out.slot,
          out.weight, out.expert_offsets, out.expert_counts, out.num_rows, out.overflow);
}

void launch_dispatch_local(const SendView& send, int EL, int64_t H, int64_t m_cap,
                           int64_t row_align, const LandedView& out, Stream stream) {
  if (out.values != nullptr)
    launch_dispatch_local_kernel<true>(send, EL, H, m_cap, row_align, out, stream);
  else
    launch_dispatch_local_kernel<false>(send, EL, H, m_cap, row_align, out, stream);
}

void launch_zero_padding_rows(const int32_t* expert_offsets, const int32_t* expert_counts, int EL,
                              int64_t m_cap, int64_t row_bytes, uint8_t* h, uint8_t* h_scales,
                              int64_t scale_bytes, Stream stream) {
  zero_padding_rows_kernel<<<grid_for(m_cap, 8), 256, 2 * EL * sizeof(int32_t), stream>>>(
      expert_offsets, expert_counts, EL, m_cap, row_bytes, h, h_scales, scale_bytes);
}

}  // namespace gpu
}  // namespace jsm
