// The §4 layout's block-wide device helpers for the CUDA kernels (engines ce/sm, gemm1): defined
// once for CUDA and HIP in kernels/common/gpu_layout.cuh, named here in jsm::cuda.
#pragma once

#include "kernels/common/gpu_layout.cuh"

namespace jsm {
namespace cuda {

using gpu::exclusive_scan_smem;
using gpu::expert_of_row;
using gpu::kWarp;
using gpu::landing_layout_smem;

}  // namespace cuda
}  // namespace jsm
