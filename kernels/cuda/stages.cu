// The CUDA translation unit of the memory-bound Stage1 stages (quantize, route, qpack / pack, the
// local dispatch, h's padding rows): their one source, shared with HIP, is
// kernels/common/gpu_stages.cuh; launchers declared in kernels/common/gpu_stages.h.
#include "kernels/common/gpu_stages.cuh"
