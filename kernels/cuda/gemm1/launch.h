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
// mma.sync kernel (any H % 32 == 0).
// Returns "" or an error message.
std::string launch_gemm1(Gemm1Args g, int grid, cudaStream_t stream, const Gemm1Options& opt);

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
