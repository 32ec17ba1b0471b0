// The 16-bit GEMM's (sm90_mx_bf16_rs.cu) token transform: the producer warpgroup's three
// transform warps upcast the landed fp8 rows once per call into the workspace (g.xb) in the
// kernel's K order (mx_bf16.cuh upcast_half_stage), row tile by row tile across CTAs, and flag each
// row tile (g.xb_ready) for every CTA's loader.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/common/mxfp8.h"
#include "kernels/cuda/gemm1/args.h"
#include "kernels/cuda/gemm1/kernels.h"
#include "kernels/cuda/gemm1/mx_bf16.cuh"
#include "kernels/cuda/gemm1/scheduler.cuh"

namespace jsm {
namespace cuda {
namespace gemm1 {
namespace sm90_bf16 {

constexpr int kTransformThreads = 96;  // warps 1-3 of the producer warpgroup
static_assert(kTransformThreads % 2 == 0, "transform_row_tiles pairs lanes t, t ^ 1");
// The transform's work items: quarters (kChunks) of a row tile's H (transform_row_tiles).
constexpr int kChunks = 4;

__device__ __forceinline__ void transform_barrier() {
  asm volatile("bar.sync 1, 96;" ::: "memory");
}

// The f16 pass met a block of expert e outside its row's window (mx_bf16.cuh window_bias): the
// bf16 pass redoes expert e's tiles (Gemm1Args::fallback).
__device__ __forceinline__ void mark_fallback(const Gemm1Args& g, int e) {
  g.fallback[e] = 1;
  g.fallback[g.EL] = 1;
}

// The transform warps. Work items: (row tile, quarter of H) in row tile order, CTA b taking
// items b, b + gridDim.x, ...: an item is upcast once its expert's rows have landed (fused: warp
// 1 waits, bounded), then counted on its row tile's flag; kChunks counts release the row tile to
// every CTA's loader. Quarters let 4 CTAs share the first row tiles, which every CTA waits for
// at the start; each lane pair upcasts two (row, stage) items at a time, a lane half of each of
// their blocks (the loads of both items in flight together: the loop is latency-bound). The rows
// come from g.a at their landed row, or in engine local's fused call at their token's row
// (g.source_rows). kF16: first the windows of the row tile's rows (mx_bf16.cuh), in `bias`; the
// item of the first quarter keeps their factors for the epilogue (g.row_factor). t: 0..95.
template <bool kF16, class Scheduler>
__device__ __forceinline__ void transform_row_tiles(const Gemm1Args& g, const Scheduler& sched,
                                                    int* bias, int t) {
  const int items = sched.row_tiles(g) * kChunks, nks = int(g.H / kBf16StageK);
  int ready = -1;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int rt = item / kChunks, chunk = item % kChunks;
    const Tile tile = sched.row_tile(g, rt);
    const int s0 = chunk * nks / kChunks, width = (chunk + 1) * nks / kChunks - s0;
    if (t < kWarp) Scheduler::wait_arrival(g, tile.e, ready, t);
    transform_barrier();
    auto source = [&](int64_t row) { return g.source_rows ? g.source_rows[row] : row; };
    if (kF16) {
      const int n_scales = int(g.H / kBlock);
      for (int r = t; r < tile.rows; r += kTransformThreads) {
        const int64_t row = tile.row0 + r;
        const int b = window_bias(top_scale(g.a_scales + source(row) * n_scales, n_scales),
                                  kF16TopScale);
        bias[r] = b;
        if (chunk == 0) g.row_factor[row] = pow2(b);
      }
      transform_barrier();
    }
    const int n = tile.rows * width;  // (row, stage) pairs i = r * width + stage - s0
    // Lanes t and t ^ 1 share items ix = i0 + (t & ~1) and ix + 1, lane q = t & 1 taking bytes
    // 16 q .. 16 q + 15 of each of their MX blocks (upcast_half_stage): each load instruction then
    // reads whole 32-byte sectors across the pair, and each store instruction writes them (the
    // other lane's chunk of a sector passed by a shuffle). A lane's own 16-byte loads or stores of
    // a whole stage each took half a sector, twice the L2 requests (Nsight; the stores' 2-3% of
    // the call: docs/PERF.md §3). So every lane runs every round (the shuffles), and loads and
    // stores only for an item i < n, the same on both lanes of a pair.
    const int q = t & 1;
    for (int i0 = 0; i0 < n; i0 += kTransformThreads) {
      const int ix = i0 + (t & ~1);
      uint4 in[2][4] = {};
      uint32_t scales[2] = {0x7F7F7F7Fu, 0x7F7F7F7Fu};  // an item past n: factor 1, zeros
      uint4* out[2];
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int64_t row = tile.row0 + (ix + s) / width;
        const int64_t k0 = int64_t(s0 + (ix + s) % width) * kBf16StageK;  // its first element
        out[s] = reinterpret_cast<uint4*>(g.xb + (row * g.H + k0) * 2);
        if (ix + s < n) {
          const int64_t from = source(row) * g.H + k0;
          const uint4* src = reinterpret_cast<const uint4*>(g.a + from);
          // the stage's four scale bytes in one aligned word (H % 512 == 0, 16-byte aligned
          // scales: launch.cu), one L2 request where four byte loads took four
          scales[s] = *reinterpret_cast<const uint32_t*>(g.a_scales + from / kBlock);
#pragma unroll
          for (int b = 0; b < 4; ++b) in[s][b] = src[2 * b + q];
        }
      }
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const bool active = ix + s < n;
        // chunks c, c + 1 of this lane; the pair's sectors (c0, c0 + 1) and (c0 + 8, c0 + 9)
        auto store = [&](int c, const uint4& lo, const uint4& hi) {
          const int c0 = c - 8 * q;
          const uint4 sent = q ? lo : hi;  // lane 0 sends chunk c0 + 1, lane 1 chunk c0 + 8
          uint4 got;
          got.x = __shfl_xor_sync(0xFFFFFFFFu, sent.x, 1);
          got.y = __shfl_xor_sync(0xFFFFFFFFu, sent.y, 1);
          got.z = __shfl_xor_sync(0xFFFFFFFFu, sent.z, 1);
          got.w = __shfl_xor_sync(0xFFFFFFFFu, sent.w, 1);
          if (active) {
            out[s][c0 + q] = q ? got : lo;
            out[s][c0 + 8 + q] = q ? hi : got;
          }
        };
        uint32_t e[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) e[b] = (scales[s] >> (8 * b)) & 0xFFu;
        const int row_bias = kF16 && active ? bias[(ix + s) / width] : 0;
        const bool exact = upcast_half_stage<kF16>(in[s], e, row_bias, q, store);
        if (active && !exact) mark_fallback(g, tile.e);
      }
    }
    asm volatile("fence.proxy.async.global;" ::: "memory");  // other CTAs' TMA reads them next
    transform_barrier();
    if (t == 0) {
      __threadfence();
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(g.xb_ready + rt) : "memory");
    }
  }
}

}  // namespace sm90_bf16
}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
