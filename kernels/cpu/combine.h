// The `cpu` engine's combine (Stage2): each landed row's GEMM2 output goes back to the rank and
// place it came from, through the Runtime's windows (kernels/cpu/window_table.h), with the
// dispatch's epochs, parity slots and bounded waits (kernels/cpu/dispatch.h):
//
//   epoch n (1, 2, ...) of a (runtime, combine geometry) uses return slot n % 2 on every rank.
//   Each rank's return window holds T*K rows [H] bf16, one per (token, slot) of its own tokens,
//   each with its top-k weight and a stamp: the epoch that wrote it.
//   1. rows:  for each source rank s (starting after this rank), put every landed row that came
//             from s at (token, slot) of s's return slot, stamped n; then raise
//             done_flag[this rank] = n there.
//   2. wait until done_flag[d] >= n for every rank d.
//   3. y[t] = the weighted sum over the slots k of t whose stamp is n (stage2.h combine_tokens):
//             a slot with no route, an invalid id or a row dropped by overflow has no row of
//             epoch n and adds nothing; nothing needs clearing between calls.
// Two slots suffice: a rank reaches epoch n + 2 only after every rank raised its done flag of
// epoch n + 1, which each does after reading out its epoch n slot.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/common/options.h"
#include "kernels/cpu/stage2.h"

namespace jsm {

// Engine cpu: the protocol above for the rank in table slot `slot` (group * R + rank, with the
// group's peers; src_rank names ranks within the group) through the window table
// opt.window_set. y: [T, H] bf16. Returns "" on success, else an error message (a wait ran out).
std::string combine_cpu(int64_t slot, const CombineGeometry& g, const DispatchOptions& opt,
                        const ReturnRows& in, uint16_t* y);

}  // namespace jsm
