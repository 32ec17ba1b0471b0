// Host launchers of Stage2's kernels within one rank, one source for CUDA and HIP
// (kernels/common/gpu_stage2.cuh, compiled by kernels/cuda/stage2.cu and kernels/rocm/stage2.hip):
// the combine within a rank (engine local, and engine xla's sum after its exchange) and the
// generic GEMM2 (a correctness path: CUDA's fast one is GEMM1's bf16-route kernel). Each only
// enqueues on `stream`; the caller checks the runtime's last error.
#pragma once

#include <stdint.h>

#include "kernels/common/dispatch_io.h"
#include "kernels/common/gpu_compat.h"

namespace jsm {
namespace gpu {

constexpr int kSumCols = 8;  // columns per thread of the weighted sums: one 16-byte bf16 load

// The combine within one rank: row_of (workspace [T * K]) filled from the headers (a header
// outside T x K, or a second row for one (token, slot), is skipped: jsm.stage2's check_layout
// call has failed the program on it before the combine runs), then y[t] = bf16 of the fma sum over k = 0 .. K-1 of weight * row (float32, in slot
// order): the host's combine_tokens (kernels/cpu/stage2.h), so y has the CPU backend's bytes.
// in.H % kSumCols == 0 (the caller checks).
struct CombineLocalArgs {
  CombineView in;
  int32_t* row_of;
};
void launch_combine_local(const CombineLocalArgs& a, Stream stream);

// GEMM2 of the landed rows: y[r] = bf16 of sum_k dequant(a[r, k]) * dequant(w[e, n, k]) in float32
// for each landed row r of expert e (§4 layout: offsets, counts) and output column n < N; rows
// outside every expert's are left as they are (the caller zeroes them). a [m_cap, K] MX-fp8
// (scales per 32 of K), w [EL, N, K] MX-fp8.
struct Gemm2Rows {
  const uint8_t* a;
  const uint8_t* a_scales;
  const int32_t* offsets;
  const int32_t* counts;
  const uint8_t* w;
  const uint8_t* w_scales;
  int EL;
  int64_t N, K, m_cap;
  uint16_t* y;  // [m_cap, N] bf16
};
void launch_generic_gemm2(const Gemm2Rows& g, Stream stream);

// jsm_check_layout on the device (kernels/common/layout_check.h: the rules and their order): one
// kernel over the EL experts and the m_cap rows writes the first fault as a LayoutFault (16 bytes)
// at words + kCheckLayoutFault, for the host to copy and name. words: the workspace,
// check_layout_words(R, T, K) uint32, zeroed by the launcher: the first fault's key, the count of
// blocks done, the fault, then one bit per (src_rank, src_token, topk_slot) (duplicates).
constexpr int64_t kCheckLayoutFault = 4;
constexpr int64_t kCheckLayoutHeaderWords = 8;
inline int64_t check_layout_words(int64_t R, int64_t T, int64_t K) {
  return kCheckLayoutHeaderWords + (R * T * K + 31) / 32;
}
struct CheckLayoutArgs {
  const int32_t* offsets;  // [EL]
  const int32_t* counts;   // [EL]
  const int32_t* src_rank;  // [m_cap]
  const int32_t* token;     // [m_cap]
  const int32_t* slot;      // [m_cap]
  int64_t EL, m_cap, R, T, K;
  uint32_t* words;
};
void launch_check_layout(const CheckLayoutArgs& a, Stream stream);

}  // namespace gpu
}  // namespace jsm
