// The CUDA translation unit of Stage2's kernels within one rank (the combine within a rank, the
// generic GEMM2): their one source, shared with HIP, is kernels/common/gpu_stage2.cuh; launchers
// declared in kernels/common/gpu_stage2.h.
#include "kernels/common/gpu_stage2.cuh"
