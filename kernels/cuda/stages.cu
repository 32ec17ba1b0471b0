// The CUDA translation unit of the memory-bound Stage1 stages (quantize, route, qpack / pack, the
// local dispatch, h's padding rows): their one source, shared with HIP, is
// kernels/common/gpu_stages.cuh; launchers declared in kernels/common/gpu_stages.h.
#include "kernels/common/gpu_stages.cuh"

#include "kernels/cuda/launch_util.h"

namespace jsm {
namespace gpu {

Error load_zero_padding_rows() {
  static std::atomic<uint64_t> loaded{0};
  return cuda::load_kernels_once(loaded, zero_padding_rows_kernel);
}

}  // namespace gpu
}  // namespace jsm
