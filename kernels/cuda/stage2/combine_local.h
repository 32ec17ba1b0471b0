// Stage2's combine within one rank on CUDA (engine local, and engine xla after its exchange): the
// same arithmetic as the host's combine_local (kernels/cpu/stage2.h combine_tokens), so the bytes
// of y match the CPU backend's.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <string>

#include "kernels/common/dispatch_io.h"

namespace jsm {
namespace cuda {

struct CombineLocalArgs {
  CombineView in;
  int32_t* row_of;  // workspace [T * K]: the row of each (token, slot), -1 where none
};

// Enqueues on `stream`: row_of filled from the headers (a header outside T x K, or two rows for
// one (token, slot), fails the launch: the headers are the dispatch's, never a user's), then
// y[t] = bf16 of the fma sum over k = 0 .. K-1 of weight * row (float32, in slot order). Returns ""
// or the launch error.
std::string launch_combine_local(const CombineLocalArgs& a, cudaStream_t stream);

}  // namespace cuda
}  // namespace jsm
