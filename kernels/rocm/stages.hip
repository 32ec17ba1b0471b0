// The HIP translation unit of the memory-bound Stage1 stages (quantize, route, qpack / pack, the
// local dispatch, h's padding rows) for AMD CDNA (gfx942, gfx950; wave64): their one source,
// shared with CUDA, is kernels/common/gpu_stages.cuh; launchers declared in
// kernels/common/gpu_stages.h.
#include "kernels/common/gpu_stages.cuh"
