// Host implementations of the local Stage1 stages (route, qpack/pack, gemm1). Plain C++17 over raw
// pointers, so the FFI handlers stay thin and a test harness or another framework can call them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/common/layout.h"  // landing_layout, segment_puts
#include "kernels/common/mxfp8.h"

namespace jsm {

// route: send buffer grouped by (destination rank, local expert), token then slot inside a segment.
// ids < 0: no route; ids >= E: invalid, no row, counted. Returns the number of invalid ids.
inline int32_t route(const int32_t* ids, int64_t T, int64_t K, int64_t R, int64_t EL,
                     int32_t* send_counts /*[R*EL]*/, int32_t* send_pos /*[T*K]*/) {
  const int64_t E = R * EL;
  int32_t invalid = 0;
  std::fill(send_counts, send_counts + R * EL, 0);
  for (int64_t i = 0; i < T * K; ++i) {
    int32_t id = ids[i];
    if (id >= E) ++invalid;
    if (id >= 0 && id < E) ++send_counts[id];  // global id == dest * EL + local expert
  }
  std::vector<int32_t> cursor(R * EL);
  int32_t run = 0;
  for (int64_t s = 0; s < R * EL; ++s) cursor[s] = run, run += send_counts[s];
  for (int64_t i = 0; i < T * K; ++i) {
    int32_t id = ids[i];
    send_pos[i] = (id >= 0 && id < E) ? cursor[id]++ : -1;
  }
  return invalid;
}

// Route headers of a send (or landing) buffer.
struct RowHeaders {
  int32_t* token;
  int32_t* slot;
  float* weight;
};

// Stores each token's quantised row to every send position it has; unused rows are zero with
// headers -1 so the buffer is deterministic.
inline void pack_rows(const uint8_t* values, const uint8_t* scales, const float* weights,
                      const int32_t* send_pos, int64_t T, int64_t K, int64_t H,
                      int64_t S, uint8_t* out_values, uint8_t* out_scales, RowHeaders out) {
  const int64_t HS = H / kBlock;
  std::memset(out_values, 0, size_t(S * H));
  std::memset(out_scales, 0, size_t(S * HS));
  std::fill(out.token, out.token + S, -1);
  std::fill(out.slot, out.slot + S, -1);
  std::fill(out.weight, out.weight + S, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      int32_t p = send_pos[t * K + k];
      if (p < 0) continue;
      std::memcpy(out_values + p * H, values + t * H, size_t(H));
      std::memcpy(out_scales + p * HS, scales + t * HS, size_t(HS));
      out.token[p] = int32_t(t);
      out.slot[p] = int32_t(k);
      out.weight[p] = weights[t * K + k];
    }
}

// qpack: quantise each bf16 row once, then store it like pack_rows.
inline void qpack_rows(const uint16_t* x, const float* weights, const int32_t* send_pos, int64_t T,
                       int64_t K, int64_t H, int64_t S, uint8_t* out_values, uint8_t* out_scales,
                       RowHeaders out) {
  const int64_t HS = H / kBlock;
  std::vector<uint8_t> qv(static_cast<size_t>(T * H)), qs(static_cast<size_t>(T * HS));
  for (int64_t t = 0; t < T; ++t) {
    bool routed = false;
    for (int64_t k = 0; k < K; ++k) routed |= send_pos[t * K + k] >= 0;
    if (routed) quantize_row_bf16(x + t * H, H, qv.data() + t * H, qs.data() + t * HS);
  }
  pack_rows(qv.data(), qs.data(), weights, send_pos, T, K, H, S, out_values, out_scales, out);
}

struct Gemm1Problem {
  int64_t m_cap, H, I, EL;
  bool has_limit;
  float limit;
};

inline float swiglu(float g, float u, const Gemm1Problem& p) {
  if (p.has_limit) {
    g = std::min(g, p.limit);
    u = std::min(std::max(u, -p.limit), p.limit);
  }
  return g / (1.0f + std::exp(-g)) * u;
}

// gemm1: h[row] = SwiGLU(deq(a[row]) @ deq(w[e]).T) for the landed rows of each local expert;
// every other row is 0. Exact products of dequantised values, float32 accumulation. The output is
// delivered a 32-column block at a time (one MX block) through `store(row, col0, h[32])`.
// Blocking: w[e] is dequantised once into k-major panels of 32 gate + 32 up columns (a panel stays
// in L2 while every row of the expert passes); MB rows x 64 columns of accumulators fill the
// vector registers.
template <class Store>
void gemm1(const uint8_t* a_values, const uint8_t* a_scales, const int32_t* offsets,
           const int32_t* counts, const uint8_t* w_values, const uint8_t* w_scales,
           const Gemm1Problem& p, Store store) {
  constexpr int MB = 6, NB = kBlock, NP = 2 * NB;
  const int64_t H = p.H, I = p.I, HS = H / kBlock, tiles = I / NB;
  std::vector<float> panels(static_cast<size_t>(tiles * H * NP));  // [tile][k][gate 32 | up 32]
  std::vector<float> row(static_cast<size_t>(H));
  std::vector<float> a;
  float h[NB];
  for (int64_t e = 0; e < p.EL; ++e) {
    const int64_t off = offsets[e], cnt = counts[e];
    if (cnt == 0) continue;
    for (int64_t n = 0; n < 2 * I; ++n) {
      const int64_t wr = e * 2 * I + n;
      dequantize_row(w_values + wr * H, w_scales + wr * HS, H, row.data());
      const int64_t col = n % I, t = col / NB, c = col % NB + (n >= I ? NB : 0);
      for (int64_t k = 0; k < H; ++k) panels[(t * H + k) * NP + c] = row[k];
    }
    a.assign(static_cast<size_t>((cnt + MB) * H), 0.0f);  // MB spare zero rows for the last block
    for (int64_t m = 0; m < cnt; ++m)
      dequantize_row(a_values + (off + m) * H, a_scales + (off + m) * HS, H, a.data() + m * H);
    for (int64_t t = 0; t < tiles; ++t) {
      const float* panel = panels.data() + t * H * NP;
      for (int64_t m0 = 0; m0 < cnt; m0 += MB) {
        float acc[MB][NP] = {};
        const float* am = a.data() + m0 * H;
        for (int64_t k = 0; k < H; ++k) {
          const float* wk = panel + k * NP;
          for (int m = 0; m < MB; ++m) {
            const float av = am[m * H + k];
            for (int n = 0; n < NP; ++n) acc[m][n] += av * wk[n];
          }
        }
        const int mb = int(std::min<int64_t>(MB, cnt - m0));
        for (int m = 0; m < mb; ++m) {
          for (int n = 0; n < NB; ++n) h[n] = swiglu(acc[m][n], acc[m][NB + n], p);
          store(off + m0 + m, t * NB, h);
        }
      }
    }
  }
}

// The rows gemm1 does not write: every row outside [offsets[e], offsets[e] + counts[e]).
template <class F>
void for_each_padding_row(const int32_t* offsets, const int32_t* counts, int64_t EL, int64_t m_cap,
                          F f) {
  std::vector<char> landed(static_cast<size_t>(m_cap), 0);
  for (int64_t e = 0; e < EL; ++e)
    std::fill(landed.begin() + offsets[e], landed.begin() + offsets[e] + counts[e], 1);
  for (int64_t r = 0; r < m_cap; ++r)
    if (!landed[r]) f(r);
}

}  // namespace jsm
