// The 16-bit GEMM's (sm90_mx_bf16_rs.cu) output stores: a consumer warpgroup's 64 columns of a
// tile, staged through shared memory so that each thread stores half an MX block of one token row,
// as bf16 or MX-fp8.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/common/mxfp8.h"
#include "kernels/cuda/gemm1/args.h"
#include "kernels/cuda/gemm1/common.cuh"
#include "kernels/cuda/gemm1/scheduler.cuh"

namespace jsm {
namespace cuda {
namespace gemm1 {
namespace sm90_bf16 {

constexpr int kEpiTokens = 32;  // tokens per pass through the epilogue's staging
constexpr int kEpiStride = 68;  // floats per staged token row: 8 * tig + g spreads a warp's stores
// The epilogue's staging, per consumer warpgroup: h of 32 tokens x 64 columns.
constexpr int kEpiFloats = kEpiTokens * kEpiStride;

__device__ __forceinline__ void consumer_barrier(int cw) {  // one consumer warpgroup
  asm volatile("bar.sync %0, 128;" ::"r"(2 + cw) : "memory");
}

// Half of an MX block of h (16 columns col0 .. of one token row) from 16 float32 values: bf16, or
// MX-fp8 with the block's maximum taken over this lane and its partner (lane ^ 1, the other half;
// both lanes call, valid or not); `valid` stores.
__device__ __forceinline__ void store_h_half(const Gemm1Args& g, int64_t row, int64_t col0,
                                             const float (&v)[16], int half, bool valid) {
  if (g.h_bf16) {
    if (!valid) return;
    uint4* dst = reinterpret_cast<uint4*>(g.h_bf16 + row * g.I + col0);
#pragma unroll
    for (int q = 0; q < 2; ++q)
      dst[q] = make_uint4(pack_bf16x2(v[8 * q], v[8 * q + 1]),
                          pack_bf16x2(v[8 * q + 2], v[8 * q + 3]),
                          pack_bf16x2(v[8 * q + 4], v[8 * q + 5]),
                          pack_bf16x2(v[8 * q + 6], v[8 * q + 7]));
    return;
  }
  float amax;
  bool finite;
  block_amax<2, 16>(v, amax, finite);
  if (!valid) return;
  const uint32_t e = finite ? e8m0_for_amax(amax) : kScaleNaN;
  const float mul = quant_multiplier(e);
  uint32_t p[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    p[i] = e4m3x2(v[4 * i], v[4 * i + 1], mul, finite) |
           e4m3x2(v[4 * i + 2], v[4 * i + 3], mul, finite) << 16;
  *reinterpret_cast<uint4*>(g.h_values + row * g.I + col0) = make_uint4(p[0], p[1], p[2], p[3]);
  if (half == 0) g.h_scales[row * (g.I / kBlock) + col0 / kBlock] = uint8_t(e);
}

// 64 columns of the output, col0 .., x the tile's tokens from the warpgroup's fragments
// (value(i, h, tf): fragment index i's float, of row half h, with the token row's factor tf: its
// window's in the f16 pass, row_factor[the token's row in the tile], else 1), staged through
// shared memory 32 tokens at a time, so that each thread stores 16 consecutive columns of one
// token (half an MX block; its partner lane the other half): all 128 threads store.
template <int kTok, bool kF16, class Value>
__device__ __forceinline__ void store_columns(const Gemm1Args& g, const Tile& t, float* epi,
                                              const float* row_factor, Value value,
                                              int64_t col0, int cw, int tid, int row_g, int tig) {
  constexpr int kPass = kTok < kEpiTokens ? kTok : kEpiTokens;  // tokens per pass
  static_assert(kPass == 32 && kTok % 8 == 0, "128 threads: 32 tokens x 2 MX blocks x 2 halves");
  // thread (blk, tok, half): 8 consecutive threads read 8 distinct 16-byte bank groups
  const int half = tid % 2, tok = tid / 2 % 32, blk = tid / 64;
#pragma unroll
  for (int pass = 0; pass < (kTok + kPass - 1) / kPass; ++pass) {
    if (pass > 0 && t.rows <= pass * kPass) break;
#pragma unroll
    for (int j = 0; j < kPass / 8; ++j) {
      if (pass * kPass + j * 8 >= kTok) break;  // the wide tile's last pass: 24 tokens
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int tok = pass * kPass + j * 8 + 2 * tig + c;
        // 0 past the tile's rows (never stored; row_factor holds no factor there)
        const float tf = !kF16 ? 1.0f : tok < t.rows ? row_factor[tok] : 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = pass * (kPass / 2) + j * 4 + 2 * h + c;
          epi[(j * 8 + 2 * tig + c) * kEpiStride + row_g + 8 * h] = value(i, h, tf);
        }
      }
    }
    consumer_barrier(cw);
    float v[16];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 x = *reinterpret_cast<const float4*>(epi + tok * kEpiStride + blk * 32 +
                                                        half * 16 + 4 * q);
      v[4 * q] = x.x, v[4 * q + 1] = x.y, v[4 * q + 2] = x.z, v[4 * q + 3] = x.w;
    }
    store_h_half(g, t.row0 + pass * kPass + tok, col0 + blk * 32 + half * 16, v, half,
                 pass * kPass + tok < t.rows);
    consumer_barrier(cw);  // the staging is free again
  }
}

}  // namespace sm90_bf16
}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
