// The checks of a landed layout (DESIGN.md §4) that a caller may have changed: Stage2 indexes rows
// with Stage1Output's expert_offsets / expert_counts (gemm2) and its src_rank / src_token /
// topk_slot headers (the combine), and jsm.stage2 takes any Stage1Output. One definition of the
// rules for the host (jsm_check_layout and the CPU handlers of gemm1, gemm2 and combine) and the
// device (the GPU jsm_check_layout, kernels/common/gpu_stage2.cuh), so both name the same first
// fault; the message is formatted on the host.
//
// Rules, in the order faults are reported (experts first, by index; then rows, by index):
//   expert e: offsets[e] in [0, M_cap]; counts[e] >= 0; offsets[e] + counts[e] <= M_cap;
//             offsets[e] >= offsets[e - 1]; offsets[e - 1] + counts[e - 1] <= offsets[e]
//   row i:    src_rank[i] in [-1, R); where src_rank[i] >= 0: src_token[i] in [0, T),
//             topk_slot[i] in [0, K), and no earlier row with the same (src_rank, src_token,
//             topk_slot) (the combine returns each to one place).
#pragma once

#include <stdint.h>

#include "kernels/common/mxfp8.h"  // JSM_HD

#include <string>
#include <vector>

namespace jsm {

enum LayoutRule : int32_t {
  kLayoutOk = 0,
  kOffsetRange = 1,      // expert_offsets[index] = value outside [0, M_cap]
  kCountNegative = 2,    // expert_counts[index] = value < 0
  kCountPastCap = 3,     // expert_counts[index] = value: offsets[index] (other) + value > M_cap
  kOffsetDecreases = 4,  // expert_offsets[index] = value < expert_offsets[index - 1] (other)
  kExpertsOverlap = 5,   // expert_counts[index] = value > other, the room before offsets[index + 1]
  kSrcRankRange = 6,     // src_rank[index] = value outside [-1, R)
  kSrcTokenRange = 7,    // src_token[index] = value outside [0, T) (src_rank[index] = other)
  kTopkSlotRange = 8,    // topk_slot[index] = value outside [0, K)
  kRowTwice = 9,         // row index returns what row other (< index) returns; value: its token
};

// The first fault (rule kLayoutOk: none): 16 bytes, what the GPU check hands the host.
struct LayoutFault {
  int32_t rule, index, value, other;
};

// The first rule of expert e's (in the order above) that the layout breaks, with *f; rules 4 and
// 5 are checked at e against e - 1 (so that a decreasing offset is named as one, not as an
// overlap of the expert before).
JSM_HD int32_t expert_fault(const int32_t* offsets, const int32_t* counts, int64_t e,
                            int64_t m_cap, LayoutFault* f) {
  const int64_t off = offsets[e], cnt = counts[e];
  *f = LayoutFault{kLayoutOk, int32_t(e), 0, 0};
  if (off < 0 || off > m_cap) *f = LayoutFault{kOffsetRange, int32_t(e), int32_t(off), 0};
  else if (cnt < 0) *f = LayoutFault{kCountNegative, int32_t(e), int32_t(cnt), 0};
  else if (off + cnt > m_cap) *f = LayoutFault{kCountPastCap, int32_t(e), int32_t(cnt), int32_t(off)};
  else if (e > 0 && off < offsets[e - 1])
    *f = LayoutFault{kOffsetDecreases, int32_t(e), int32_t(off), offsets[e - 1]};
  else if (e > 0 && int64_t(offsets[e - 1]) + counts[e - 1] > off)
    *f = LayoutFault{kExpertsOverlap, int32_t(e - 1), counts[e - 1],
                     int32_t(off - offsets[e - 1])};
  return f->rule;
}

// The first range rule row i breaks (rules 6-8), with *f; R, T, K: the ranks, the sources' tokens
// and their top-k.
JSM_HD int32_t row_fault(const int32_t* src_rank, const int32_t* token, const int32_t* slot,
                         int64_t i, int64_t R, int64_t T, int64_t K, LayoutFault* f) {
  const int32_t s = src_rank[i];
  *f = LayoutFault{kLayoutOk, int32_t(i), 0, 0};
  if (s < -1 || s >= R) *f = LayoutFault{kSrcRankRange, int32_t(i), s, 0};
  else if (s >= 0 && (token[i] < 0 || token[i] >= T))
    *f = LayoutFault{kSrcTokenRange, int32_t(i), token[i], s};
  else if (s >= 0 && (slot[i] < 0 || slot[i] >= K))
    *f = LayoutFault{kTopkSlotRange, int32_t(i), slot[i], 0};
  return f->rule;
}

// The place of row i's (src_rank, src_token, topk_slot) among R * T * K (row i in range, src_rank
// >= 0): the bit the duplicate check sets.
JSM_HD int64_t row_place(const int32_t* src_rank, const int32_t* token, const int32_t* slot,
                         int64_t i, int64_t T, int64_t K) {
  return (int64_t(src_rank[i]) * T + token[i]) * K + slot[i];
}

// Host: the first fault of EL experts' rows in [0, m_cap).
inline LayoutFault check_experts(const int32_t* offsets, const int32_t* counts, int64_t EL,
                                 int64_t m_cap) {
  LayoutFault f{};
  for (int64_t e = 0; e < EL; ++e)
    if (expert_fault(offsets, counts, e, m_cap, &f)) return f;
  return LayoutFault{};
}

// Host: the first fault of m_cap rows' headers, duplicates included.
inline LayoutFault check_rows(const int32_t* src_rank, const int32_t* token, const int32_t* slot,
                              int64_t m_cap, int64_t R, int64_t T, int64_t K) {
  LayoutFault f{};
  std::vector<int32_t> first;  // per place, the first row that returns there (+1; 0: none)
  for (int64_t i = 0; i < m_cap; ++i) {
    if (row_fault(src_rank, token, slot, i, R, T, K, &f)) return f;
    if (src_rank[i] < 0) continue;
    if (first.empty()) first.assign(size_t(R * T * K), 0);
    int32_t& at = first[size_t(row_place(src_rank, token, slot, i, T, K))];
    if (at) return LayoutFault{kRowTwice, int32_t(i), token[i], at - 1};
    at = int32_t(i + 1);
  }
  return LayoutFault{};
}

// Host: the error message of fault f (rule != kLayoutOk). prefix: what the fields are called in
// the caller's terms ("out1." for jsm.stage2's Stage1Output, "" for a stage's own operands).
inline std::string layout_fault_message(const LayoutFault& f, const std::string& prefix,
                                        int64_t m_cap, int64_t R, int64_t T, int64_t K) {
  const std::string i = "[" + std::to_string(f.index) + "] = " + std::to_string(f.value);
  const std::string cap = "M_cap = " + std::to_string(m_cap);
  switch (f.rule) {
    case kOffsetRange:
      return prefix + "expert_offsets" + i + " is outside [0, " + cap + "]";
    case kCountNegative:
      return prefix + "expert_counts" + i + " is negative";
    case kCountPastCap:
      return prefix + "expert_counts" + i + ": expert " + std::to_string(f.index) +
             "'s rows from " + prefix + "expert_offsets[" + std::to_string(f.index) + "] = " +
             std::to_string(f.other) + " end past " + cap;
    case kOffsetDecreases:
      return prefix + "expert_offsets" + i + " is below " + prefix + "expert_offsets[" +
             std::to_string(f.index - 1) + "] = " + std::to_string(f.other) +
             " (the offsets must not decrease)";
    case kExpertsOverlap:
      return prefix + "expert_counts" + i + " overlaps expert " + std::to_string(f.index + 1) +
             "'s rows: " + std::to_string(f.other) + " rows lie between " + prefix +
             "expert_offsets[" + std::to_string(f.index) + "] and " + prefix + "expert_offsets[" +
             std::to_string(f.index + 1) + "]";
    case kSrcRankRange:
      return prefix + "src_rank" + i + " is outside [-1, num_ranks = " + std::to_string(R) + ")";
    case kSrcTokenRange:
      return prefix + "src_token" + i + " is outside [0, num_tokens = " + std::to_string(T) +
             ") (row " + std::to_string(f.index) + " has src_rank " + std::to_string(f.other) +
             ")";
    case kTopkSlotRange:
      return prefix + "topk_slot" + i + " is outside [0, topk = " + std::to_string(K) + ")";
    case kRowTwice:
      return prefix + "src_token" + i + ": row " + std::to_string(f.index) +
             " returns the same (src_rank, src_token, topk_slot) as row " +
             std::to_string(f.other) + " (each is returned to one place once)";
  }
  return prefix + "layout: unknown fault " + std::to_string(f.rule);
}

}  // namespace jsm
