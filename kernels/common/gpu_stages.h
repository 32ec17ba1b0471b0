// Host launchers of the memory-bound Stage1 kernels, one source for CUDA and HIP
// (kernels/common/gpu_stages.cuh, compiled by kernels/cuda/stages.cu and kernels/rocm/stages.hip):
// quantize, route, qpack / pack, the local (R = 1) dispatch and the zero padding rows of gemm1's
// output. Each one only enqueues on `stream`; the caller checks the runtime's last error.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "kernels/common/dispatch_io.h"
#include "kernels/common/gpu_compat.h"

namespace jsm {
namespace gpu {

// quantize: x [rows, H] bf16 (x_bf16) or float32; blocks = rows * H / 32 MX blocks (> 0).
void launch_quantize(const void* x, bool x_bf16, int64_t blocks, uint8_t* values, uint8_t* scales,
                     Stream stream);

// route over n = T * K ids, E = R * EL experts: the parallel two-launch form (measured on an
// H200 1.5-2.3x faster than one warp walking the ids).
void launch_route(const int32_t* ids, int64_t n, int32_t E, int32_t* send_counts,
                  int32_t* send_pos, int32_t* num_invalid, Stream stream);

// qpack (quantize: bf16 rows x) or pack (MX-fp8 rows x_values, x_scales): each token's row to every
// send position it has (top-k K <= 16), and the S rows' headers (token, slot, weight; -1, -1, 0
// where no token lands).
struct PackArgs {
  const uint16_t* x;
  const uint8_t* x_values;
  const uint8_t* x_scales;
  const float* weights;     // [T, K]
  const int32_t* send_pos;  // [T, K]
  int64_t T;
  int K;
  int64_t H, S;
  bool token_rows;  // values hold one row per token, not one per send row (DESIGN.md §5)
  uint8_t* values;  // [S, H], or [T, H] with token_rows
  uint8_t* scales;  // [S, H/32], or [T, H/32]
  int32_t* token;
  int32_t* slot;
  float* weight;
};
void launch_pack(bool quantize, const PackArgs& a, Stream stream);

// dispatch with R = 1 (engine local): every landing row of `out` (its §4 layout from send.counts,
// EL experts); with out.values null only the layout and the rows' headers (engine local's fused
// GEMM reads the rows from the send buffer).
void launch_dispatch_local(const SendView& send, int EL, int64_t H, int64_t m_cap,
                           int64_t row_align, const LandedView& out, Stream stream);

// gemm1's padding rows (outside every expert's landed rows): bf16 zeros (h_scales null), or
// MX-fp8 zeros (value 0, scale 85).
void launch_zero_padding_rows(const int32_t* expert_offsets, const int32_t* expert_counts, int EL,
                              int64_t m_cap, int64_t row_bytes, uint8_t* h, uint8_t* h_scales,
                              int64_t scale_bytes, Stream stream);
#ifndef JSM_GPU_HIP
// CUDA: the padding kernel loaded into the current device's context (a fused GEMM's launch runs
// it; kernels/cuda/launch_util.h's load_kernels_once says why).
Error load_zero_padding_rows();
#endif

}  // namespace gpu
}  // namespace jsm
