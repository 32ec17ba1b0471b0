// Engine `sdma` (ROCm): the symmetric window of one rank and what one call hands its kernels.
// Plain data, for the host and the HIP kernels, and the contract with the FlyDSL dispatch kernel
// (kernels/rocm/sdma/puts.h).
//
// The window is one mori CCO window per rank (ccoWindowRegister: VMM memory mapped into every
// peer of the node, the SDMA engines' source and destination). Its first part is the landing
// window of the CUDA engines (kernels/common/ep_window.h: two parity slots of rows, scales and
// 16-byte row headers, the plan, plan_flag, seg_flag, this rank's outgoing headers, the epoch
// counter) with the same protocol; after it come what SDMA needs on the sending side: XLA's send
// buffer is not a registered window, so each call first stages its rows into the window
// (send_values, send_scales, and ep.send_headers), and the dispatch kernel stages the counts
// (send_counts) and the call's epoch (epoch_word), the sources of the plan and flag puts.
//
// One call (epoch n, parity p = n & 1; slot 1's sections lie one parity stride after slot 0's):
//   1. on XLA's stream: sdma_begin_kernel (epoch_counter += 1, the staged rows' 16-byte headers),
//      then the send rows' values and scales copied into the window;
//   2. on the rank's side stream, the FlyDSL dispatch kernel (puts.h): stages the counts and the
//      epoch word, puts the counts into plan[p][rank] of every peer and then, on the same SDMA
//      queue (which runs in order), the epoch word into plan_flag[p][rank] there; waits (bounded)
//      for every peer's plan; then for each peer, expert by expert, SDMA puts of the segment's
//      values, scales and headers to the peer's slot p and a 4-byte put of the epoch word into
//      its seg_flag[p][e * R + rank]; this rank's own segments are copied by the kernel's other
//      blocks, each followed by a release store of its flag; quiet at the end (the staged rows
//      may be overwritten by the next call only after that, which the join orders);
//   3. on XLA's stream: sdma_layout_kernel waits (bounded) for every plan and writes this rank's
//      §4 layout; the fused GEMM (gated per expert on seg_flag[p][e][*] >= n), or nothing;
//      sdma_rows_kernel waits (bounded) for every flag of slot p and writes the row headers (and
//      the rows, unless the GEMM read them from the slot); the side stream is joined.
// The way back (Stage2's combine, kernels/rocm/sdma/combine.hip) uses the return regions of the
// landing window and the protocol of ep_window.h with engine sm's kernels
// (kernels/common/ep_return.cuh): the CUs store each row at its (token, slot) of its source's
// return slot through the LSA mapping, not the SDMA queues.
#pragma once

#include <stdint.h>

#include "kernels/common/ep_window.h"

namespace jsm {
namespace sdma {

struct SdmaWindowLayout {
  EpWindowLayout ep;
  int64_t send_values;  // [send_rows, H] this rank's rows, staged from XLA's send buffer
  int64_t send_scales;  // [send_rows, H/32]
  int64_t send_counts;  // [R dst * EL] int32, staged by the dispatch kernel: the plan puts' source
  int64_t epoch_word;   // uint32 [2] (per parity): the call's epoch, the flag puts' source
  int64_t parity_stride;  // slot 1's sections (ep.values[1], ...) minus slot 0's
  int64_t bytes;
};

inline SdmaWindowLayout sdma_window_layout(const DispatchGeometry& g) {
  SdmaWindowLayout w{};
  w.ep = ep_window_layout(g, /*with_return=*/true);  // the combine's (ep_window.h)
  int64_t off = w.ep.bytes;
  auto take = [&off](int64_t bytes) {
    const int64_t at = off;
    off = align_up(off + bytes, 256);
    return at;
  };
  w.send_values = take(g.send_rows * g.H);
  w.send_scales = take(g.send_rows * (g.H / kBlock));
  w.send_counts = take(g.R * g.EL * 4);
  w.epoch_word = take(2 * 4);
  w.parity_stride = w.ep.values[1] - w.ep.values[0];
  w.bytes = off;
  return w;
}

// What one call's HIP kernels read (plain data, passed by value).
struct SdmaArgs {
  PeerTable peers;  // every rank's window base as this device addresses it (LSA mapping)
  SdmaWindowLayout L;
  DispatchGeometry g;
  int rank;
  int64_t row_align;
  uint64_t timeout_ticks;  // the bound of every wait, in ticks of the device's wall clock
  EpError* err;            // host-mapped: the first expired wait
  SendView send;  // this rank's send buffer (qpack / pack) and its counts [R * EL]
};

}  // namespace sdma
}  // namespace jsm
