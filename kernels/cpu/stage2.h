// Host implementations of the local Stage2 stages: gemm2 (the grouped MX-fp8 GEMM of the landed
// h rows with w2) and the weighted sum per token that ends every combine. Plain C++17 over raw
// pointers, like stage.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/common/dispatch_io.h"  // ReturnRows
#include "kernels/common/mxfp8.h"
#include "kernels/cpu/grouped_gemm.h"

namespace jsm {

// gemm2's sizes: landed rows, hidden (GEMM2's output columns), intermediate (its depth), local
// experts.
struct Gemm2Problem {
  int64_t m_cap, H, I, EL;
};

// gemm2: y[row] = bf16(deq(q(h[row])) @ deq(w2[e]).T) for the landed rows of each local expert
// (DESIGN.md §3, Stage2), 0 on every other row. h is Stage1's output: bf16 rows (h_scales null),
// quantised here along I with the §3 arithmetic, or MX-fp8 rows (values, scales) used as they are.
// w2: MX-fp8 [EL, H, I]. y: [m_cap, H] bf16.
inline void gemm2(const void* h, const uint8_t* h_scales, const int32_t* offsets,
                  const int32_t* counts, const uint8_t* w_values, const uint8_t* w_scales,
                  const Gemm2Problem& p, uint16_t* y) {
  const int64_t H = p.H, I = p.I, IS = I / kBlock;
  std::vector<uint8_t> qv(static_cast<size_t>(I)), qs(static_cast<size_t>(IS));
  grouped_mx_gemm(
      offsets, counts, w_values, w_scales, GroupedGemm{p.EL, H, I, (H + kPanel - 1) / kPanel},
      [&](int64_t n, int64_t* panel, int64_t* column) {  // output column n
        *panel = n / kPanel;
        *column = n % kPanel;
      },
      [&](int64_t r, float* dst) {
        if (h_scales) {
          dequantize_row(static_cast<const uint8_t*>(h) + r * I, h_scales + r * IS, I, dst);
        } else {  // q(h): the bf16 row's MX-fp8 bytes, then their exact values
          quantize_row_bf16(static_cast<const uint16_t*>(h) + r * I, I, qv.data(), qs.data());
          dequantize_row(qv.data(), qs.data(), I, dst);
        }
      },
      [&](int64_t r, int64_t panel, const float* acc) {
        const int64_t c0 = panel * kPanel, n = std::min<int64_t>(kPanel, H - c0);
        for (int64_t c = 0; c < n; ++c) y[r * H + c0 + c] = f32_to_bf16(acc[c]);
      });
  for_each_padding_row(offsets, counts, p.EL, p.m_cap,
                       [&](int64_t r) { std::fill_n(y + r * H, H, uint16_t(0)); });
}

// The end of every combine: y[t] = bf16(acc) where acc starts at 0 and, for k = 0 .. K-1 in
// order, over the (token t, slot k) that have a row, acc = fma(weight, row, acc) in float32. A
// fixed order and one rounding per term (the fused multiply-add, which a GPU has too), so every
// engine, and every backend that follows this, gives the same bytes. A token with no row gets
// +0. row_of(t, k, &row, &weight) -> whether (t, k) has a row (bf16 [H]) and its top-k weight.
template <class RowOf>
void combine_tokens(int64_t T, int64_t K, int64_t H, RowOf row_of, uint16_t* y) {
  std::vector<float> acc(static_cast<size_t>(H));
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const uint16_t* row = nullptr;
      float w = 0.0f;
      if (!row_of(t, k, &row, &w)) continue;
      for (int64_t c = 0; c < H; ++c) acc[c] = std::fma(w, bf16_to_f32(row[c]), acc[c]);
    }
    for (int64_t c = 0; c < H; ++c) y[t * H + c] = f32_to_bf16(acc[c]);
  }
}

// The combine's static sizes: ranks, tokens per rank (T) and top-k (K) of the sources, hidden,
// landed rows.
struct CombineGeometry {
  int64_t R, T, K, H, m_cap;
};

// The combine within one rank (engine local, and engine xla after its exchange): every row with
// src_rank >= 0 belongs to this rank's token `token` and slot `slot`. y: [T, H] bf16. Returns ""
// or what is wrong (two rows for one token and slot).
inline std::string combine_local(const CombineGeometry& g, const ReturnRows& in, uint16_t* y) {
  std::vector<int64_t> row_of(static_cast<size_t>(g.T * g.K), -1);
  for (int64_t i = 0; i < g.m_cap; ++i) {
    if (in.src_rank[i] < 0) continue;
    int64_t& at = row_of[size_t(in.token[i] * g.K + in.slot[i])];
    if (at >= 0)
      return "rows " + std::to_string(at) + " and " + std::to_string(i) + " both return token " +
             std::to_string(in.token[i]) + ", slot " + std::to_string(in.slot[i]);
    at = i;
  }
  combine_tokens(g.T, g.K, g.H, [&](int64_t t, int64_t k, const uint16_t** row, float* w) {
    const int64_t i = row_of[size_t(t * g.K + k)];
    if (i < 0) return false;
    *row = in.rows + i * g.H;
    *w = in.weight[i];
    return true;
  }, y);
  return "";
}

}  // namespace jsm
