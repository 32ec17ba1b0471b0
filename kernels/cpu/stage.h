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
#include "kernels/cpu/grouped_gemm.h"  // grouped_mx_gemm, for_each_padding_row

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

// Whether send position p (of a send_pos) is one of the S send rows: -1 is unrouted, and a
// position past the buffer stores nothing.
inline bool is_send_row(int32_t p, int64_t S) { return p >= 0 && p < S; }

// Stores each token's quantised row to every send position it has (token_rows: once, at the
// token's row; DESIGN.md §5) and the headers at its send positions; unused rows are zero with
// headers -1 so the buffer is deterministic.
inline void pack_rows(const uint8_t* values, const uint8_t* scales, const float* weights,
                      const int32_t* send_pos, int64_t T, int64_t K, int64_t H,
                      int64_t S, bool token_rows, uint8_t* out_values, uint8_t* out_scales,
                      RowHeaders out) {
  const int64_t HS = H / kBlock, rows = token_rows ? T : S;
  std::memset(out_values, 0, size_t(rows * H));
  std::memset(out_scales, 0, size_t(rows * HS));
  std::fill(out.token, out.token + S, -1);
  std::fill(out.slot, out.slot + S, -1);
  std::fill(out.weight, out.weight + S, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t p = send_pos[t * K + k];
      if (!is_send_row(p, S)) continue;
      const int64_t row = token_rows ? t : p;
      std::memcpy(out_values + row * H, values + t * H, size_t(H));
      std::memcpy(out_scales + row * HS, scales + t * HS, size_t(HS));
      out.token[p] = int32_t(t);
      out.slot[p] = int32_t(k);
      out.weight[p] = weights[t * K + k];
    }
}

// qpack: quantise each bf16 row once, then store it like pack_rows.
inline void qpack_rows(const uint16_t* x, const float* weights, const int32_t* send_pos, int64_t T,
                       int64_t K, int64_t H, int64_t S, bool token_rows, uint8_t* out_values,
                       uint8_t* out_scales, RowHeaders out) {
  const int64_t HS = H / kBlock;
  std::vector<uint8_t> qv(static_cast<size_t>(T * H)), qs(static_cast<size_t>(T * HS));
  for (int64_t t = 0; t < T; ++t) {
    bool routed = false;
    for (int64_t k = 0; k < K; ++k) routed |= is_send_row(send_pos[t * K + k], S);
    if (routed) quantize_row_bf16(x + t * H, H, qv.data() + t * H, qs.data() + t * HS);
  }
  pack_rows(qv.data(), qs.data(), weights, send_pos, T, K, H, S, token_rows, out_values,
            out_scales, out);
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

// gemm1: h[row] = SwiGLU(deq(a[row]) @ deq(w[e]).T) for the landed rows of each local expert
// (the grouped GEMM of grouped_gemm.h); every other row is 0. The output is delivered a 32-column
// block at a time (one MX block) through `store(row, col0, h[32])`: each panel holds 32 gate
// columns and the 32 up columns of the same outputs, so SwiGLU runs on one panel's accumulators.
template <class Store>
void gemm1(const uint8_t* a_values, const uint8_t* a_scales, const int32_t* offsets,
           const int32_t* counts, const uint8_t* w_values, const uint8_t* w_scales,
           const Gemm1Problem& p, Store store) {
  const int64_t H = p.H, I = p.I, HS = H / kBlock;
  float h[kBlock];
  grouped_mx_gemm(
      offsets, counts, w_values, w_scales, GroupedGemm{p.EL, 2 * I, H, I / kBlock},
      [&](int64_t n, int64_t* panel, int64_t* column) {  // rows [0, I) gate, [I, 2I) up
        const int64_t col = n % I;
        *panel = col / kBlock;
        *column = col % kBlock + (n >= I ? kBlock : 0);
      },
      [&](int64_t r, float* dst) { dequantize_row(a_values + r * H, a_scales + r * HS, H, dst); },
      [&](int64_t r, int64_t panel, const float* acc) {
        for (int n = 0; n < kBlock; ++n) h[n] = swiglu(acc[n], acc[kBlock + n], p);
        store(r, panel * kBlock, h);
      });
}

}  // namespace jsm
