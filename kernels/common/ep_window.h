// The symmetric landing window of one rank for the multi-GPU engines (`ce`, `sm` on CUDA, `sdma`
// on ROCm): one device allocation per rank, the same layout on every rank, so a source computes
// any destination's addresses from that destination's base pointer. Plain data, for the host and
// for CUDA and HIP device code; the CUDA engines' device helpers are in kernels/cuda/ep/window.h.
//
// Protocol of epoch n (1, 2, ...; each rank counts its own calls, which run in program order, in
// epoch_counter on its device: the first kernel of a call increments it and the others read it),
// on parity p = n & 1 — the protocol of kernels/cpu/dispatch.h, with device memory and signals:
//   1. source s puts its send counts [R][EL] into plan[p][s] of every destination, then writes
//      plan_flag[p][s] = n there (after the counts, in stream order / with a system fence);
//   2. every rank waits until plan_flag[p][s] has reached n for all s (bounded), so each knows the
//      whole plan and hence every segment's landing offset (DESIGN.md §4);
//   3. source s puts each (destination d, local expert e) segment — values, scales and the 16-byte
//      row header {src rank, token, slot, weight} — at its offset in d's slot p, then writes
//      seg_flag[p][e][s] = n at d (flags of one expert are contiguous: one load reads all R);
//      Engine ce puts instead each destination's rows in one piece: its values and its meta rows
//      (header + scales, send_meta) into stage_values/stage_meta[p] of d at this source's region,
//      then writes stage_flag[p][s] = n there; d's placement kernel waits for that flag
//      (bounded), copies each (expert, source) segment to its offset in slot p and raises
//      seg_flag[p][e][s] = n itself. So the copies per call do not grow with the experts.
//   4. the destination waits for seg_flag[p][e][s] >= n (bounded) before reading expert e.
// Two parities suffice: a source sends epoch n + 2 only after seeing every peer's epoch n + 1
// plan, which each peer sends after it has read out its epoch n slot (stream order).
// Flags are compared as (int32_t)(flag - n) >= 0, so epochs may wrap.
//
// The way back (Stage2's combine; CUDA engines sm and ce), in a window made with the return
// regions, has its own epochs m (ret_epoch_counter, one per combine call) on parity q = m & 1:
//   1. every rank puts each landed row's GEMM2 output into its source's ret_rows[q], with
//      ret_meta[q] {m, the row's top-k weight}, then (once all its rows are there: a system fence,
//      or stream order) writes ret_flag[q][r] = m at every rank (its own included). Engine sm
//      stores each row at its (token * K + slot); engine ce gathers each source's rows, with their
//      stamps, into that source's send order (its own straight into its return slot, the peers'
//      into ret_stage_rows/ret_stage_meta, dropped rows' positions stamped with another epoch),
//      then copies each peer's run whole to the peer's send positions for this rank (contiguous;
//      the host knows them from the dispatch's plan): two copies per peer;
//   2. every rank waits until ret_flag[q][d] has reached m for all d (bounded), then sums, per
//      token, the slots whose ret_meta stamp is m (slots with no row keep an older stamp); engine
//      ce finds a send position's (token, slot) in its own send_headers (its latest dispatch's).
// Engine ce's combine thus belongs to the rank's latest dispatch through the window set (its plan
// and send headers): stage2 runs on the latest stage1's output, as jsm.moe does.
// Two parities suffice for the same reason as the dispatch's: a rank stores epoch m + 2 only
// after every peer's epoch m + 1 flag, which each peer raises after it has summed epoch m.
#pragma once

#include <stdint.h>

#include "kernels/common/dispatch_io.h"
#include "kernels/common/mxfp8.h"
#include "kernels/common/options.h"

namespace jsm {

constexpr int kMaxRanks = 16;

// A landed or sent row's header: 16 bytes, so a segment's headers are one contiguous copy.
struct RowHeader {
  int32_t src_rank, token, slot;
  float weight;
};

// A returned row's stamp: the combine epoch that stored it, and its top-k weight.
struct ReturnMeta {
  uint32_t epoch;
  float weight;
};

struct EpWindowLayout {
  int64_t values[2], scales[2], headers[2];  // slot p: [m_cap, H], [m_cap, H/32], [m_cap]
  int64_t plan[2];                           // [R src][R dst * EL] int32
  int64_t plan_flag[2];                      // [R src] uint32
  int64_t seg_flag[2];                       // [EL][R src] uint32
  int64_t send_headers;                      // [send_rows] RowHeader, this rank's outgoing rows
  int64_t epoch_counter;                     // uint32: this rank's calls so far (device-side, so a
                                             // captured CUDA graph replays correctly)
  // the return regions (0 where the window has none): slot q [send_rows, H] bf16 rows, indexed
  // token * K + slot (sm) or by send position (ce), and their [send_rows] ReturnMeta; ret_flag[q]
  // [R] uint32; the combine's own call count (uint32)
  int64_t ret_rows[2], ret_meta[2], ret_flag[2], ret_epoch_counter;
  // engine ce's staging (0 where the window has none): send_meta [send_rows] rows of
  // ep_meta_stride(H) bytes, each outgoing row's header then its scale bytes (so one copy per
  // destination carries both); slot p: stage_values [R - 1 sources][send_rows, H] and stage_meta
  // [R - 1][send_rows] meta rows, each source's rows to this rank in its send order (expert, then
  // token; ep_stage_index), and stage_flag [R src] uint32; with the return regions also the
  // combine's staging: ret_stage_rows [R - 1 peers][send_rows, H] bf16 and ret_stage_meta
  // [R - 1][send_rows] ReturnMeta, each peer's rows back in that peer's send order, one run each
  int64_t send_meta, stage_values[2], stage_meta[2], stage_flag[2];
  int64_t ret_stage_rows, ret_stage_meta;
  int64_t bytes;
};

// A meta row (engine ce's staging): the 16-byte RowHeader, then the row's H / 32 scale bytes,
// padded to 16 bytes.
JSM_HD int64_t ep_meta_stride(int64_t H) {
  return (int64_t(sizeof(RowHeader)) + H / kBlock + 15) / 16 * 16;
}

// Where source s's rows sit in destination d's staging (s != d): one region per peer.
JSM_HD int64_t ep_stage_index(int64_t s, int64_t d) { return s < d ? s : s - 1; }

// A source's run of rows for destination d in its send buffer (send order: destination, expert,
// token), from its row counts of the plan, [R dst][EL] (count(i) reads entry i): the run's first
// row (*start) and its rows (*n).
template <class Count>
JSM_HD void ep_send_run(Count count, int64_t EL, int64_t d, int64_t* start, int64_t* n) {
  int64_t before = 0, rows = 0;
  for (int64_t i = 0; i < d * EL; ++i) before += count(i);
  for (int64_t e = 0; e < EL; ++e) rows += count(d * EL + e);
  *start = before;
  *n = rows;
}

JSM_HD int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// with_return: also the return regions of the combine (2 * send_rows * (2 H + 8) bytes more);
// with_staging: engine ce's staging (about 2 (R - 1) + 1 times the send buffer's bytes, and
// (R - 1) times a return slot's with the return regions).
JSM_HD EpWindowLayout ep_window_layout(const DispatchGeometry& g, bool with_return = false,
                                       bool with_staging = false) {
  EpWindowLayout w{};
  int64_t off = 0;
  auto take = [&off](int64_t bytes) {
    const int64_t at = off;
    off = align_up(off + bytes, 256);
    return at;
  };
  for (int p = 0; p < 2; ++p) {
    w.values[p] = take(g.m_cap * g.H);
    w.scales[p] = take(g.m_cap * (g.H / kBlock));
    w.headers[p] = take(g.m_cap * int64_t(sizeof(RowHeader)));
    w.plan[p] = take(g.R * g.R * g.EL * 4);
    w.plan_flag[p] = take(g.R * 4);
    w.seg_flag[p] = take(g.EL * g.R * 4);
  }
  w.send_headers = take(g.send_rows * int64_t(sizeof(RowHeader)));
  w.epoch_counter = take(4);
  if (with_return) {
    for (int q = 0; q < 2; ++q) {
      w.ret_rows[q] = take(g.send_rows * g.H * 2);
      w.ret_meta[q] = take(g.send_rows * int64_t(sizeof(ReturnMeta)));
      w.ret_flag[q] = take(g.R * 4);
    }
    w.ret_epoch_counter = take(4);
  }
  if (with_staging) {
    const int64_t meta = ep_meta_stride(g.H);
    w.send_meta = take(g.send_rows * meta);
    for (int p = 0; p < 2; ++p) {
      w.stage_values[p] = take((g.R - 1) * g.send_rows * g.H);
      w.stage_meta[p] = take((g.R - 1) * g.send_rows * meta);
      w.stage_flag[p] = take(g.R * 4);
    }
    if (with_return) {
      w.ret_stage_rows = take((g.R - 1) * g.send_rows * g.H * 2);
      w.ret_stage_meta = take((g.R - 1) * g.send_rows * int64_t(sizeof(ReturnMeta)));
    }
  }
  w.bytes = off;
  return w;
}

// The window of the CUDA engine `engine`: the combine's return regions, and engine ce's staging.
JSM_HD EpWindowLayout ep_window_layout_of(EngineId engine, const DispatchGeometry& g) {
  return ep_window_layout(g, /*with_return=*/true, /*with_staging=*/engine == EngineId::kCe);
}

// The section at `offset` of a window.
template <class T>
JSM_HD T* at(uint8_t* base, int64_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

// Every rank's window base as this device addresses it (own allocation, peer-mapped or IPC-opened).
struct PeerTable {
  uint8_t* base[kMaxRanks];
};

// Written by a kernel whose bounded wait ran out (host-mapped memory, read by the next call's
// handler and by Runtime.check()). code: 0 none, 1 plan, 2 rows of an expert, 3 the rows a peer
// returns (combine), 4 a peer's staged rows (engine ce's placement).
struct EpError {
  uint32_t code, peer, expert, epoch;
};

JSM_HD bool epoch_reached(uint32_t flag, uint32_t epoch) { return int32_t(flag - epoch) >= 0; }

}  // namespace jsm
