// The host's grouped MX-fp8 GEMM over landed rows, shared by GEMM1 (+ SwiGLU, kernels/cpu/stage.h)
// and GEMM2 (kernels/cpu/stage2.h): for the rows of each local expert e,
//   acc[row][n] = sum_k a[row][k] * w[e][n][k]
// with exact products of dequantised values and float32 accumulation. Plain C++17 over raw
// pointers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/common/mxfp8.h"

namespace jsm {

// An expert's weight rows go through the GEMM a panel of kPanel rows at a time (the accumulators
// of kRowBlock rows x one panel fill the vector registers; a panel stays in L2 while every row of
// the expert passes).
constexpr int kPanel = 2 * kBlock;
constexpr int kRowBlock = 6;

// The grouped GEMM's sizes: local experts, weight rows per expert (N), reduction length (the
// rows' and weight rows' length), panels per expert.
struct GroupedGemm {
  int64_t EL, N, depth, panels;
};

// offsets/counts: the landed rows of each local expert (DESIGN.md §4); w_values/w_scales: MX-fp8
// weights [EL, N, depth]. place(n, &panel, &column): where weight row n goes (the caller groups
// the rows its epilogue needs together; panel columns nobody places stay 0). load_row(row, dst):
// the landed row's `depth` float32 values. epilogue(row, panel, acc): the row's kPanel
// accumulators of one panel.
template <class Place, class LoadRow, class Epilogue>
void grouped_mx_gemm(const int32_t* offsets, const int32_t* counts, const uint8_t* w_values,
                     const uint8_t* w_scales, const GroupedGemm& p, Place place, LoadRow load_row,
                     Epilogue epilogue) {
  constexpr int MB = kRowBlock, NP = kPanel;
  const int64_t D = p.depth, DS = D / kBlock;
  // [panel][k][column], k-major so that the inner loop reads one contiguous panel row
  std::vector<float> panels(static_cast<size_t>(p.panels * D * NP), 0.0f);
  std::vector<float> row(static_cast<size_t>(D));
  std::vector<float> a;
  for (int64_t e = 0; e < p.EL; ++e) {
    const int64_t off = offsets[e], cnt = counts[e];
    if (cnt == 0) continue;
    for (int64_t n = 0; n < p.N; ++n) {
      const int64_t wr = e * p.N + n;
      dequantize_row(w_values + wr * D, w_scales + wr * DS, D, row.data());
      int64_t t = 0, c = 0;
      place(n, &t, &c);
      for (int64_t k = 0; k < D; ++k) panels[(t * D + k) * NP + c] = row[k];
    }
    a.assign(static_cast<size_t>((cnt + MB) * D), 0.0f);  // MB spare zero rows for the last block
    for (int64_t m = 0; m < cnt; ++m) load_row(off + m, a.data() + m * D);
    for (int64_t t = 0; t < p.panels; ++t) {
      const float* panel = panels.data() + t * D * NP;
      for (int64_t m0 = 0; m0 < cnt; m0 += MB) {
        float acc[MB][NP] = {};
        const float* am = a.data() + m0 * D;
        for (int64_t k = 0; k < D; ++k) {
          const float* wk = panel + k * NP;
          for (int m = 0; m < MB; ++m) {
            const float av = am[m * D + k];
            for (int n = 0; n < NP; ++n) acc[m][n] += av * wk[n];
          }
        }
        const int mb = int(std::min<int64_t>(MB, cnt - m0));
        for (int m = 0; m < mb; ++m) epilogue(off + m0 + m, t, acc[m]);
      }
    }
  }
}

// The rows a grouped GEMM does not write: every row outside [offsets[e], offsets[e] + counts[e])
// (clipped to [0, m_cap): the handlers have checked the layout, kernels/common/layout_check.h).
template <class F>
void for_each_padding_row(const int32_t* offsets, const int32_t* counts, int64_t EL, int64_t m_cap,
                          F f) {
  std::vector<char> landed(static_cast<size_t>(m_cap), 0);
  for (int64_t e = 0; e < EL; ++e) {
    const int64_t lo = std::clamp<int64_t>(offsets[e], 0, m_cap);
    const int64_t hi = std::clamp<int64_t>(int64_t(offsets[e]) + counts[e], lo, m_cap);
    std::fill(landed.begin() + lo, landed.begin() + hi, 1);
  }
  for (int64_t r = 0; r < m_cap; ++r)
    if (!landed[r]) f(r);
}

}  // namespace jsm
