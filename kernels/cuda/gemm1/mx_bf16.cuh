// Exact MX-fp8 -> bf16 or f16 in registers for the 16-bit GEMM kernel (sm90_mx_bf16_rs.cu): an
// e4m3 byte times its block's E8M0 scale is exactly a bf16 (and, for most scales, an f16), four
// bytes at a time; and the permuted K order of a 128-deep stage, shared by the kernel's consumers
// (weights) and its transform (tokens).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/common/mxfp8.h"

namespace jsm {
namespace cuda {
namespace gemm1 {
namespace sm90_bf16 {

// An e4m3 byte b as bf16 bits (sext16(b) << 4) & 0x87F0 is b's value times 2^-120 exactly: the
// sign in place, the exponent and mantissa in bf16's low exponent bits and top mantissa bits (e4m3
// subnormals become bf16 subnormals). One multiply by 2^(e - 7) then gives value * 2^(e - 127), the
// dequantised element. That factor is a bf16 for e <= 134 (blocks with amax below 448 * 2^7); a
// block with a larger scale or the NaN scale 0xFF multiplies twice (2^120, then 2^(e - 127) or
// NaN).
__device__ __forceinline__ bool fast_scale(uint32_t e) { return e <= 134; }

// The factor of scale byte e in both halves: one multiply-add in the one-step form (2^(e - 7): the
// bf16 exponent field e + 120); 2^(e - 127) for e = 0 is a bf16 subnormal, 0x0040.
__device__ __forceinline__ uint32_t factor_bf16x2(uint32_t e, bool slow) {
  const uint32_t bits =
      !slow ? e * 128 + (120 << 7) : e == 0xFF ? 0x7FC0u : e == 0 ? 0x0040u : e << 7;
  return bits * 0x10001u;
}

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm volatile("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Four e4m3 bytes of w -> bf16x2 lo (bytes 0, 1) and hi (bytes 2, 3), dequantised by `factor`.
__device__ __forceinline__ void upcast4(uint32_t w, uint32_t factor, bool slow, uint32_t& lo,
                                        uint32_t& hi) {
  uint32_t a, b;
  asm volatile("prmt.b32 %0, %1, 0, 0x9180;" : "=r"(a) : "r"(w));  // b0, sign(b0), b1, sign(b1)
  asm volatile("prmt.b32 %0, %1, 0, 0xB3A2;" : "=r"(b) : "r"(w));
  a = (a << 4) & 0x87F087F0u;
  b = (b << 4) & 0x87F087F0u;
  if (slow) {
    constexpr uint32_t k2p120 = 0x7B807B80u;  // bf16x2 2^120
    a = mul_bf16x2(a, k2p120);
    b = mul_bf16x2(b, k2p120);
  }
  lo = mul_bf16x2(a, factor);
  hi = mul_bf16x2(b, factor);
}

// The f16 form (the default pass, gemm1/launch.cu): an e4m3 byte is exactly an f16, two bytes to
// one cvt.rn.f16x2.e4m3x2 (half the instructions of upcast4's bf16 form), and its value times
// 2^(e - 127) is still exactly an f16 where f16_scale(e) holds, 112 <= e <= 134: values from
// 2^-9 * 2^-15 = 2^-24 (f16's least subnormal) to 448 * 2^7 < 65504. f16 wgmma sums the exact
// products in float32 as bf16 wgmma does. Rows shift their scales into that range (the windows
// below); a block outside its row's window, or with the NaN scale, sends its expert to the bf16
// form (Gemm1Args::fallback).
__device__ __forceinline__ bool f16_scale(uint32_t e) { return e - 112u <= 22u; }

// 2^(e - 127) as f16 bits in both halves, for f16_scale(e) (2^-15: the subnormal 0x0200).
__device__ __forceinline__ uint32_t factor_f16x2(uint32_t e) {
  return (e >= 113 ? (e - 112) << 10 : 0x0200u) * 0x10001u;
}

__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm volatile("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Four e4m3 bytes of w -> f16x2 lo (bytes 0, 1) and hi (bytes 2, 3), dequantised by `factor`
// (factor_f16x2).
__device__ __forceinline__ void upcast4_f16(uint32_t w, uint32_t factor, uint32_t& lo,
                                            uint32_t& hi) {
  uint32_t a, b;
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
      "cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(a), "=r"(b)
      : "r"(w));
  lo = mul_f16x2(a, factor);
  hi = mul_f16x2(b, factor);
}

// The f16 pass's exponent windows. Products of dequantised values are exact at any common power of
// two, so each token row and each weight row takes its own window of 23 scale bytes: its blocks
// are upcast at 2^(e - 127 - bias) with e - bias within 112..134 (f16_scale), and the epilogue
// multiplies the float32 sum by 2^(bias_weight_row + bias_token_row), exact in float32 (|bias| <=
// kMaxBias keeps both factors and the scaled sums far from its range's ends). So small weights or
// rows (scale bytes below 112: amax < 0.0068) stay in f16; only a row whose scales span more than
// its window sends its expert to the bf16 pass. A token row's window ends at its largest scale
// (the transform reads all of the row's scales first); a weight row's is placed by the largest
// scale of a tile's first 16 blocks (the first scale super-stage, in shared memory when the tile
// starts), kWeightHeadroom below the window's top. The NaN scale is in no window.
constexpr int kMaxBias = 64, kWeightHeadroom = 8;
constexpr uint32_t kF16TopScale = 134;

// The bias of a window whose top scale byte is top_at (kF16TopScale for the row's largest scale).
__device__ __forceinline__ int window_bias(uint32_t top, uint32_t top_at) {
  return min(max(int(top) - int(top_at), -kMaxBias), kMaxBias);
}
// m's bytes maxed with those of w that are not the NaN scale.
__device__ __forceinline__ uint32_t finite_max4(uint32_t m, uint32_t w) {
  return __vmaxu4(m, w & ~__vcmpeq4(w, 0xFFFFFFFFu));
}
__device__ __forceinline__ uint32_t max_byte(uint32_t m) {
  m = max(m & 0xFFFFu, m >> 16);
  return max(m & 0xFFu, m >> 8);
}
// m's bytes maxed with the 16 of v that are not the NaN scale.
__device__ __forceinline__ uint32_t finite_max16(uint32_t m, uint4 v) {
  return finite_max4(finite_max4(finite_max4(finite_max4(m, v.x), v.y), v.z), v.w);
}
// The largest scale byte other than NaN's among 16 (a 16-byte load).
__device__ __forceinline__ uint32_t top_scale16(uint4 v) { return max_byte(finite_max16(0u, v)); }
// The largest scale byte other than NaN's among n (a multiple of 16) 16-byte-aligned bytes: 16
// at a time, in rounds of 8 loads in flight together (zeros past n change no maximum), so a
// dsv3 row's 224 bytes take two round trips (4-byte loads in a loop took seven).
__device__ __forceinline__ uint32_t top_scale(const uint8_t* s, int n) {
  const uint4* v = reinterpret_cast<const uint4*>(s);
  uint32_t m = 0;
  for (int i0 = 0; i0 < n / 16; i0 += 8) {
    uint4 x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = i0 + j < n / 16 ? v[i0 + j] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = finite_max16(m, x[j]);
  }
  return max_byte(m);
}
// 2^k as a float32, |k| <= 126.
__device__ __forceinline__ float pow2(int k) { return __int_as_float((k + 127) << 23); }

// The K order of a stage (128 elements: four MX blocks). `wgmma` sums over K in any order, so
// a stage's K is permuted such that each consumer thread's A fragments come from ONE MX block of
// its weight rows: thread tig of a quad reads block tig of the stage (one scale byte per row and
// stage). Its fragments of logical block lb (the stage's k 32 lb ..) are 8 bytes of that block:
// those of 8-byte half stage_half(lb, tig) of its 16-byte chunk lb / 2, word 0 of them for k16
// step 0 and word 1 for step 1, bytes 0-1 of a word at k = 2 tig, 2 tig + 1 of the step and bytes
// 2-3 at k = 8 + 2 tig, 9 + 2 tig (the mma A fragment layout). The halves alternate with tig so
// that a block's 8-byte loads are free of bank conflicts (sm90_mx_bf16_rs.cu load_block). The
// tokens (wgmma's B, K-major in shared memory) take the same order: logical block lb, step s, k
// 0-7 (q = 0) or 8-15 (q = 1) of a token row holds bytes 0-1 (q = 0) or 2-3 (q = 1) of word s of
// those 8 bytes of blocks tig = 0..3.
__device__ __forceinline__ int stage_half(int lb, int tig) { return (lb ^ tig) & 1; }

// Half q of one stage of a token row -> its 128 bytes of the stage's 256 of bf16 (kF16: f16, in
// the row's window: bias) in the workspace in that order: in[b], bytes 16 q .. 16 q + 15 of the
// stage's MX block b (32 fp8 values; scale byte e[b]), are logical blocks 2 q and 2 q + 1, so one
// lane of a pair upcasts each half (the transform: whole 32-byte sectors per load across the
// pair). Returns false where kF16 and a block's scale is outside the window and this half's values
// are not all zero: the bytes written are then not the values. An all-zero block (a zero token
// row's: scale byte 85) is zeros at any scale, so it is exact in f16 (its factor taken as 1, never
// inf); the NaN scale is never exact.
// store(c, lo, hi): the 16-byte chunks c and c + 1 of the 256 (a 32-byte sector), c = 8 q + 2 m
// for m = 0..3.
template <bool kF16, class Store>
__device__ __forceinline__ bool upcast_half_stage(const uint4 (&in)[4], const uint32_t (&e)[4],
                                                  int bias, int q, Store&& store) {
  bool slow[4], exact = true;
  uint32_t f[4];
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    slow[b] = !kF16 && !fast_scale(e[b]);
    if (kF16) {
      const uint32_t eb = e[b] - uint32_t(bias);  // wraps below 0: out of range
      const bool in_range = f16_scale(eb);
      if (!in_range) {  // rare: only here are the block's bytes looked at
        const uint4& v = in[b];
        exact &= ((v.x | v.y | v.z | v.w) & 0x7F7F7F7Fu) == 0 && e[b] != kScaleNaN;  // +-0 only
      }
      f[b] = factor_f16x2(in_range ? eb : 127u);
    } else {
      f[b] = factor_bf16x2(e[b], slow[b]);
    }
  }
#pragma unroll
  for (int j = 0; j < 2; ++j)  // logical block 2 q + j
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      uint32_t lo[4], hi[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const uint4& v = in[b];
        const uint32_t w = stage_half(2 * q + j, b) ? (step ? v.w : v.z) : (step ? v.y : v.x);
        if (kF16) upcast4_f16(w, f[b], lo[b], hi[b]);
        else upcast4(w, f[b], slow[b], lo[b], hi[b]);
      }
      store(8 * q + 4 * j + 2 * step, make_uint4(lo[0], lo[1], lo[2], lo[3]),
            make_uint4(hi[0], hi[1], hi[2], hi[3]));
    }
  return exact;
}

}  // namespace sm90_bf16
}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
