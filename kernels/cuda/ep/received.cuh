// Engine ce's view of what a rank received in a dispatch, from the plan in its own window: the
// (expert, source) segments of its §4 landing layout, and where each sits in its source's run of
// rows for this rank (the source's send order: expert, then token). Shared by the dispatch's
// placement kernel (kernels.cuh) and the combine's gather kernel (combine.cu).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/ep/window.h"
#include "kernels/cuda/layout.cuh"

namespace jsm {
namespace cuda {

struct ReceivedSegment {
  int64_t base;  // its first landing row
  int64_t from;  // its first row in the source's run for this rank
  int64_t n;     // the rows the source sent
  int64_t keep;  // those that landed (the rest past the expert's room: overflow)
};

// smem: 3 * EL + 1 int32 (totals, offsets, counts + dropped).
struct ReceivedSegments {
  const int32_t* plan;  // [R src][R dst * EL]
  int R, EL, me;
  int32_t* offsets;
  int32_t* counts;

  __device__ int32_t count(int s, int e) const {
    return __ldcg(plan + int64_t(s) * R * EL + int64_t(me) * EL + e);
  }

  // Every thread of the block: the landing layout (DESIGN.md §4) into shared memory (with
  // `landed` false: of no rows, the plan not being there).
  __device__ void build(int32_t* smem, int64_t row_align, int64_t m_cap, bool landed = true) {
    int32_t* totals = smem;
    offsets = smem + EL;
    counts = smem + 2 * EL;
    for (int e = threadIdx.x; e < EL; e += blockDim.x) {
      int32_t sum = 0;
      for (int s = 0; s < R && landed; ++s) sum += count(s, e);
      totals[e] = sum;
    }
    __syncthreads();
    landing_layout_smem(totals, EL, row_align, m_cap, offsets, counts, counts + EL);
  }

  // Segment (e, s), by one thread: O(R + EL) loads of the plan.
  __device__ ReceivedSegment of(int e, int s) const {
    ReceivedSegment g;
    g.base = offsets[e];
    for (int t = 0; t < s; ++t) g.base += count(t, e);
    g.from = 0;
    for (int f = 0; f < e; ++f) g.from += count(s, f);
    g.n = count(s, e);
    g.keep = segment_keep(g.n, g.base, offsets[e], counts[e]);
    return g;
  }
};

}  // namespace cuda
}  // namespace jsm
