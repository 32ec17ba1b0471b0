// The weighted sum per token that ends every GPU combine (within the rank: gpu_stage2.cuh; the
// window engines' way back: ep_return.cuh): the arithmetic of the host's combine_tokens
// (kernels/cpu/stage2.h), so every engine's y has the CPU backend's bytes.
#pragma once

#include <stdint.h>

#include "kernels/common/gpu_stage2.h"
#include "kernels/common/gpu_sys.cuh"
#include "kernels/common/mxfp8.h"

namespace jsm {
namespace gpu {

// y[0 .. 7] = bf16 of the fma sum in float32, over the slots k = 0 .. K-1 in order, of
// weight * row[0 .. 7]; slot(k, row, weight) -> false where slot k has no row (it adds nothing).
// Rows are read with load_cg (a peer GPU may have stored them).
template <class Slot>
__device__ __forceinline__ void sum_slots(int64_t K, Slot slot, uint16_t* y) {
  float acc[kSumCols] = {};
  for (int64_t k = 0; k < K; ++k) {
    const uint16_t* row = nullptr;
    float w = 0.0f;
    if (!slot(k, row, w)) continue;
    const uint4 v = load_cg(reinterpret_cast<const uint4*>(row));
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < kSumCols; ++j)
      acc[j] = fmaf(w, bf16_to_f32(uint16_t(words[j / 2] >> (16 * (j % 2)))), acc[j]);
  }
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    out[i] = uint32_t(f32_to_bf16(acc[2 * i])) | uint32_t(f32_to_bf16(acc[2 * i + 1])) << 16;
  *reinterpret_cast<uint4*>(y) = make_uint4(out[0], out[1], out[2], out[3]);
}

}  // namespace gpu
}  // namespace jsm
