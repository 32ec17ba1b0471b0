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

// route, parallel form (two launches, one block per expert): block e scans all ids in order, so
// positions keep the (token, slot) order without a sort; E blocks x T*K ids are L2 reads, four ids
// per 16-byte load where the ids are 16-byte aligned (XLA's buffers are): a block's loads are then
// a few rounds deep, not T*K / blockDim (the scan is latency-bound, not bandwidth-bound).
// Launch 1, grid E + 1: block e < E counts id == e; block E counts ids >= E and writes -1 to the
// send_pos of every id outside [0, E).
constexpr int kRouteThreads = 1024;
__global__ void route_count_kernel(const int32_t* ids, int64_t n, int32_t E, int32_t* send_counts,
                                   int32_t* send_pos, int32_t* num_invalid) {
  __shared__ int32_t warp_sums[kRouteThreads / kWarp];
  const int e = blockIdx.x;
  int count = 0;
  auto visit = [&](int64_t i, int32_t id) {
    if (e < E) {
      count += id == e;
    } else {
      count += id >= E;
      if (id < 0 || id >= E) send_pos[i] = -1;
    }
  };
  const int64_t n4 = reinterpret_cast<uintptr_t>(ids) % 16 == 0 ? n / 4 : 0;
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < n4; j += blockDim.x) {
    const int4 v = reinterpret_cast<const int4*>(ids)[j];
    visit(4 * j, v.x), visit(4 * j + 1, v.y), visit(4 * j + 2, v.z), visit(4 * j + 3, v.w);
  }
  for (int64_t i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) visit(i, ids[i]);
  count = wave_sum(count);
  if (threadIdx.x % kWarp == 0) warp_sums[threadIdx.x / kWarp] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    int total = 0;
    for (int w = 0; w < int(blockDim.x / kWarp); ++w) total += warp_sums[w];
    if (e < E) send_counts[e] = total; else *num_invalid = total;
  }
}

// Launch 2, grid E, kRouteThreads threads: block e places its ids after the segments of experts
// < e. Each thread takes kPlacePerThread consecutive ids of a chunk, so the three block barriers
// of a chunk are paid once per 8192 ids (a chunk of one id per thread paid them per 1024).
constexpr int kPlacePerThread = 8;  // two 16-byte loads of ids
__global__ void route_place_kernel(const int32_t* ids, int64_t n, int32_t E,
                                   const int32_t* send_counts, int32_t* send_pos) {
  __shared__ int32_t warp_sums[kRouteThreads / kWarp];
  __shared__ int32_t base;
  const int e = blockIdx.x, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  int before = 0;
  for (int j = threadIdx.x; j < e; j += blockDim.x) before += send_counts[j];
  before = wave_sum(before);
  if (lane == 0) warp_sums[warp] = before;
  __syncthreads();
  if (threadIdx.x == 0) {
    int total = 0;
    for (int w = 0; w < warps; ++w) total += warp_sums[w];
    base = total;
  }
  __syncthreads();
  const int64_t per_chunk = int64_t(blockDim.x) * kPlacePerThread;
  const bool aligned = reinterpret_cast<uintptr_t>(ids) % 16 == 0;
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
}

// qpack / pack: one warp per token; lane j handles MX blocks j, j + kWarp, ...; each block is
// quantised (qpack) or read (pack) once and stored to every send row of the token (token_rows:
// once, to the token's row; the headers go to its send rows either way). The kWarp
// blocks of a round (1 KB of fp8 on CUDA, 2 KB on CDNA) go through shared memory so each store
// instruction writes 16 * kWarp contiguous bytes, 16 per lane: stored straight from the lanes,
// each instruction would cover every other 16 bytes of the row (half of every line).
constexpr int kPackThreads = 256, kPackWarps = kPackThreads / kWarp;
template <bool kQuantize>
__global__ void pack_kernel(const uint16_t* x, const uint8_t* x_values, const uint8_t* x_scales,
                            const float* weights, const int32_t* send_pos, int64_t T, int K,
                            int64_t H, bool token_rows, uint8_t* values, uint8_t* scales,
                            int32_t* token, int32_t* slot, float* weight) {
  const int lane = threadIdx.x % kWarp;
  const int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp;
  if (t >= T) return;
  const int64_t HS = H / kBlock;
  int32_t pos[16];
  int routed = 0;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    pos[k] = k < K ? send_pos[t * K + k] : -1;
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
  __shared__ uint4 round_bytes[kPackWarps][2 * kWarp];  // one warp's kWarp blocks of fp8
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
  route_count_kernel<<<E + 1, kRouteThreads, 0, stream>>>(ids, n, E, send_counts, send_pos,
                                                         num_invalid);
  if (E > 0)
    route_place_kernel<<<E, kRouteThreads, 0, stream>>>(ids, n, E, send_counts, send_pos);
}

void launch_pack(bool quantize, const PackArgs& a, Stream stream) {
  // rows past the routed ones: headers -1 (token, slot), weight 0; their payload is unspecified
  // (their errors surface as the runtime's last error, which the caller checks)
  (void)memset_async(a.token, 0xFF, a.S * sizeof(int32_t), stream);
  (void)memset_async(a.slot, 0xFF, a.S * sizeof(int32_t), stream);
  (void)memset_async(a.weight, 0, a.S * sizeof(float), stream);
  if (a.T == 0) return;
  const int64_t grid = (a.T + kPackWarps - 1) / kPackWarps;
  if (quantize)
    pack_kernel<true><<<grid, kPackThreads, 0, stream>>>(
        a.x, a.x_values, a.x_scales, a.weights, a.send_pos, a.T, a.K, a.H, a.token_rows,
        a.values, a.scales, a.token, a.slot, a.weight);
  else
    pack_kernel<false><<<grid, kPackThreads, 0, stream>>>(
        a.x, a.x_values, a.x_scales, a.weights, a.send_pos, a.T, a.K, a.H, a.token_rows,
        a.values, a.scales, a.token, a.slot, a.weight);
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
