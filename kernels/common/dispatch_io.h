// What every dispatch engine reads and writes on one rank (framework-agnostic, host and device
// pointers alike): the dispatch geometry, the send buffer from qpack/pack and the landed rows in
// DESIGN.md §4 layout. The options that come in as FFI attributes are in options.h.
#pragma once

#include <stdint.h>

#include "kernels/common/options.h"

namespace jsm {

// The static sizes of a dispatch: ranks, local experts, hidden, landed rows (M_cap), send rows.
struct DispatchGeometry {
  int64_t R, EL, H, m_cap, send_rows;
};

// A source rank's send buffer (from qpack/pack) and counts.
struct SendView {
  const uint8_t* values;
  const uint8_t* scales;
  const int32_t* token;
  const int32_t* slot;
  const float* weight;
  const int32_t* counts;  // [R * EL]
};

// The landed rows of one rank in §4 layout.
struct LandedView {
  uint8_t* values;
  uint8_t* scales;
  int32_t* src_rank;
  int32_t* token;
  int32_t* slot;
  float* weight;
  int32_t* expert_offsets;
  int32_t* expert_counts;
  int32_t* num_rows;
  int32_t* overflow;
};

// What the combine reads on one rank: GEMM2's output rows [m_cap, H] bf16 with the landed rows'
// headers (DESIGN.md §4; src_rank -1 on padding rows).
struct ReturnRows {
  const uint16_t* rows;
  const int32_t* src_rank;
  const int32_t* token;
  const int32_t* slot;
  const float* weight;
};

// The GPU combines' whole view on one rank: the rows and headers, their sizes, and y [T, H] bf16
// of this rank's tokens (K slots each).
struct CombineView : ReturnRows {
  int64_t m_cap, T, K, H;
  uint16_t* y;
};

}  // namespace jsm
