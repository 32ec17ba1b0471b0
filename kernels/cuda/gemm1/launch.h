// The one host entry of GEMM1 on CUDA: picks the kernel variant (kernels.h) for the problem and
// launches it, after zeroing h's padding rows.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kernels/common/options.h"
#include "kernels/cuda/gemm1/args.h"

namespace jsm {
namespace cuda {
namespace gemm1 {

// g's rows, layout, weights and h outputs are set (the epilogue's limit comes from opt). Zeroes
// h's padding rows, then runs the persistent GEMM on `grid` CTAs (one per SM it may use): the
// bf16-route kernel where H % 512 == 0, I % 64 == 0 and the scale arrays are 16-byte aligned
// (measured fastest, docs/PERF.md), else the fp8 wgmma kernel where H % 128 == 0, else the
// mma.sync kernel (any H % 32 == 0). The bf16-route kernel's tile is opt.tile_tokens tokens
// (kBf16TileTokens or kBf16SmallTileTokens, args.h). Returns "" or an error message.
std::string launch_gemm1(Gemm1Args g, int grid, cudaStream_t stream, const Gemm1Options& opt);

// GEMM2 (Stage2) on the same machinery: g's fields as for GEMM1 with g.H the depth (the model's
// I), g.I the output columns (the model's H), g.w/g.w_scales w2 [EL, H, I] (g.I weight rows per
// expert), g.a/g.a_scales the MX-fp8 rows of h, g.h_bf16 the output y2 [m_cap, g.I]. Zeroes the
// padding rows, then runs the bf16-route kernel without SwiGLU where g.H % 512 == 0, g.I % 256
// == 0 and the workspace is given, else a generic kernel (a correctness fallback for small
// shapes: one row per block, float32 dot products); tile_tokens as GEMM1's. Returns "" or an
// error message.
std::string launch_gemm2(Gemm1Args g, int grid, cudaStream_t stream, int64_t tile_tokens);

// Every kernel the two launches above may run, loaded into the current device's context: a fused
// call loads them before its dispatch's first kernel (load_kernels_once, launch_util.h, says why).
std::string load_gemm_kernels();

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
