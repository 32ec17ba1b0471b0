// MX-fp8 arithmetic of DESIGN.md §3 (per-1x32 blocks, e8m0 scales, e4m3fn values): the one C++
// definition, compiled for the host and (under nvcc) for the device. Framework-agnostic: no XLA
// types. Every backend must produce these exact bytes.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define JSM_HD __host__ __device__ __forceinline__
#else
#define JSM_HD inline
#endif

namespace jsm {

constexpr int kBlock = 32;             // elements per scale
constexpr uint32_t kInv448Bits = 0x3B124925u;  // float32(1/448)
constexpr uint8_t kScaleNaN = 0xFF;    // e8m0 NaN
constexpr uint8_t kValueNaN = 0x7F;    // e4m3fn NaN (positive)

JSM_HD float bits_to_f32(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}
JSM_HD uint32_t f32_to_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

JSM_HD float bf16_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN with its sign.
JSM_HD uint16_t f32_to_bf16(float f) {
  uint32_t b = f32_to_bits(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((b >> 16) | 0x0040u);
  b += 0x7FFFu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}

// float32 -> float8_e4m3fn, round to nearest even; overflow (> 464) and NaN give NaN (there is no
// infinity in e4m3fn), keeping the sign as ml_dtypes does.
JSM_HD uint8_t f32_to_e4m3fn(float f) {
  uint32_t b = f32_to_bits(f);
  uint8_t sign = uint8_t((b >> 24) & 0x80u);
  uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | kValueNaN;                 // NaN
  if (a >= 0x43E80000u) return sign | kValueNaN;                // >= 464: rounds past 448
  if (a < 0x3C800000u) {                                        // < 2^-6: subnormal quantum 2^-9
    float q = rintf(bits_to_f32(a) * 512.0f);          // exact scaling, RNE
    return sign | uint8_t(q);                                   // q == 8 is the smallest normal
  }
  uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);                 // RNE to 3 mantissa bits
  uint32_t exp = (r >> 23) - 127 + 7;
  uint32_t man = (r >> 20) & 7u;
  return sign | uint8_t((exp << 3) | man);
}

// Exact: every e4m3fn value is a float32.
JSM_HD float e4m3fn_to_f32(uint8_t v) {
  uint32_t sign = uint32_t(v & 0x80) << 24;
  uint32_t exp = (v >> 3) & 0xF, man = v & 7u;
  if (exp == 0xF && man == 7) return bits_to_f32(sign | 0x7FC00000u);
  if (exp == 0) return bits_to_f32(sign) + (v & 0x80 ? -1.0f : 1.0f) * float(man) * (1.0f / 512.0f);
  return bits_to_f32(sign | ((exp - 7 + 127) << 23) | (man << 20));
}

// 2^(e-127) for an e8m0 byte; 0xFF gives +inf, so a NaN block dequantises to NaN.
JSM_HD float e8m0_to_f32(uint8_t e) { return bits_to_f32(uint32_t(e) << 23); }

// The e8m0 scale byte of a finite block with maximum magnitude amax (§3 steps 1-3).
JSM_HD uint32_t e8m0_for_amax(float amax) {
  amax = amax > 1e-10f ? amax : 1e-10f;
  uint32_t w = f32_to_bits(amax * bits_to_f32(kInv448Bits));
  return ((w >> 23) & 0xFFu) + ((w & 0x7FFFFFu) != 0);
}

// 2^(127 - e): the multiplier of §3 step 4.
JSM_HD float quant_multiplier(uint32_t e) { return bits_to_f32((254u - e) << 23); }

// Quantise one block of 32 float32 values (DESIGN.md §3 steps 1-5). Returns the scale byte.
JSM_HD uint8_t quantize_block(const float* x, uint8_t* y) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < kBlock; ++i) {
    float a = fabsf(x[i]);
    finite &= isfinite(x[i]);
    amax = a > amax ? a : amax;
  }
  if (!finite) {
    memset(y, kValueNaN, kBlock);
    return kScaleNaN;
  }
  const uint32_t e = e8m0_for_amax(amax);
  const float mul = quant_multiplier(e);
  for (int i = 0; i < kBlock; ++i) y[i] = f32_to_e4m3fn(x[i] * mul);
  return uint8_t(e);
}

// Quantise a row of n (multiple of 32) bf16 values: n value bytes and n/32 scale bytes.
JSM_HD void quantize_row_bf16(const uint16_t* x, int64_t n, uint8_t* values, uint8_t* scales) {
  float tmp[kBlock];
  for (int64_t b = 0; b < n / kBlock; ++b) {
    for (int i = 0; i < kBlock; ++i) tmp[i] = bf16_to_f32(x[b * kBlock + i]);
    scales[b] = quantize_block(tmp, values + b * kBlock);
  }
}

// Dequantise a row of n values to float32.
JSM_HD void dequantize_row(const uint8_t* values, const uint8_t* scales, int64_t n, float* out) {
  for (int64_t b = 0; b < n / kBlock; ++b) {
    float s = e8m0_to_f32(scales[b]);
    for (int i = 0; i < kBlock; ++i) out[b * kBlock + i] = e4m3fn_to_f32(values[b * kBlock + i]) * s;
  }
}

}  // namespace jsm
