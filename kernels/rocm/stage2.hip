// The HIP translation unit of Stage2's kernels within one rank (the combine within a rank, the
// generic GEMM2) for AMD CDNA (gfx942, gfx950; wave64): their one source, shared with CUDA, is
// kernels/common/gpu_stage2.cuh; launchers declared in kernels/common/gpu_stage2.h.
#include "kernels/common/gpu_stage2.cuh"
