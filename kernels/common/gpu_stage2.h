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
// outside T x K, or two rows for one (token, slot), traps: the headers are the dispatch's, never
// a user's), then y[t] = bf16 of the fma sum over k = 0 .. K-1 of weight * row (float32, in slot
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

}  // namespace gpu
}  // namespace jsm
