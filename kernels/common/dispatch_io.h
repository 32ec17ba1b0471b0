// What every dispatch engine reads and writes on one rank (framework-agnostic, host and device
// pointers alike): the send buffer from qpack/pack, the landed rows in DESIGN.md §4 layout, and
// the options that come in as FFI attributes.
#pragma once

#include <stdint.h>

namespace jsm {

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

struct DispatchOptions {
  int64_t row_align;
  double timeout_s;
  int64_t fault_absent_rank;  // this rank never takes part (tests the timeout path)
  int64_t fault_delay_rank;   // this rank starts late by fault_delay_ms
  int64_t fault_delay_ms;
};

}  // namespace jsm
