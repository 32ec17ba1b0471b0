// The `cpu` dispatch engine: symmetric landing windows of the R virtual devices of one process in a
// process-global table, rows moved by memcpy, and the same signal protocol the GPU engines use:
//
//   epoch n (1, 2, ...) of a (runtime, geometry) uses window slot n % 2 on every rank.
//   1. plan:  source s writes its send counts [R][EL] into slot.plan[s] of every destination, then
//             raises slot.plan_flag[s] = n there.
//   2. wait until plan_flag[s] >= n for every s: now every rank knows the whole R x R x EL plan, so
//             each source computes where its segments land in each destination (§4 order).
//   3. data:  for each destination and local expert, put the segment at its landing offset and
//             raise slot.seg_flag[s][e] = n there (a GEMM may start expert e once all R are up).
//   4. wait until seg_flag[s][e] >= n for all s, e; read the landed rows out.
// Two slots suffice: a source reaches epoch n + 2 only after receiving every peer's epoch n + 1
// plan, which each peer sends after it has read out its epoch n slot. Every wait is bounded and
// names rank, peer and segment on timeout.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/common/dispatch_io.h"
#include "kernels/cpu/stage.h"

namespace jsm {

// Engine cpu: runs the protocol above for the rank in table slot `slot` (group * R + rank, with
// the group's peers) through the window table opt.window_set (kernels/cpu/window_table.h: one
// per Runtime, holding the windows of every geometry and group). Returns "" on success, else an
// error message.
std::string dispatch_cpu(int64_t slot, const DispatchGeometry& g, const DispatchOptions& opt,
                         const SendView& send, const LandedView& out);

// Engine local (R = 1, no windows): the landed rows straight from the send buffer; the same
// result as the protocol with one rank.
std::string dispatch_local_cpu(const DispatchGeometry& g, const DispatchOptions& opt,
                               const SendView& send, const LandedView& out);

}  // namespace jsm
