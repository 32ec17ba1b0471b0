// The device-side tile scheduler of the persistent GEMM1 kernels: work items (expert, row tile,
// column tile) from the device-side expert counts, and the bounded wait for an expert's arrival
// signals when the GEMM is fused with a dispatch.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/ep/window.h"
#include "kernels/cuda/gemm1/args.h"
#include "kernels/cuda/layout.cuh"

namespace jsm {
namespace cuda {
namespace gemm1 {

// The kernel's view of its arguments: a fused call's slot of this epoch.
__device__ __forceinline__ Gemm1Args resolve_slot(const Gemm1Args& in) {
  Gemm1Args g = in;
  if (in.epoch_counter) {
    g.epoch = *static_cast<volatile const uint32_t*>(in.epoch_counter);
    const int p = int(g.epoch & 1);
    g.a = in.slot_values[p];
    g.a_scales = in.slot_scales[p];
    g.arrival = in.slot_arrival[p];
  }
  return g;
}

struct Tile {
  int e;
  int64_t row0;  // first landed row of the tile
  int rows;      // valid rows in the tile
  int64_t n0;    // first output column
  int rt;        // the row tile's number in the call (experts in order, then row tiles)
};

// Work items (expert, column tile, row tile) numbered from the device-side expert counts: one
// launch covers every expert with no host round trip. Within an expert the row tiles of one
// column tile are consecutive items, so the CTAs that read the same weight rows run side by side
// and all but the first find them in L2 (row tiles first let them drift apart: at dsv3, 256 rows
// per expert, the weights came from DRAM ~1.8 times, docs/PERF.md §3). Fused with a dispatch, a
// CTA waits (bounded) for an expert's arrival signals before the expert's first tile: each
// expert starts as soon as its rows have landed.
static_assert(kMaxRanks <= kWarp, "wait_arrival reads one source per lane of a warp");

// kRows landed rows x kCols output columns per tile.
template <int kRows, int kCols>
struct TileSchedulerFor {
  int32_t tile_start[kMaxExperts + 1];

  static __device__ __forceinline__ int n_tiles(const Gemm1Args& g) {
    return int((g.I + kCols - 1) / kCols);
  }

  // Pipeline stages per tile, kb MX blocks (kb * 32 bytes of K per row) each.
  static __device__ __forceinline__ int k_stages(const Gemm1Args& g, int kb) {
    return int((g.H / kBlock + kb - 1) / kb);
  }

  __device__ __forceinline__ void init(const Gemm1Args& g) {
    exclusive_scan_smem(g.EL, tile_start, [&](int e) {
      int first;
      return (launch_rows(g, e, first) + kRows - 1) / kRows * n_tiles(g);
    });
  }

  // The rows of expert e this launch covers: [first, first + the result) of its landed rows
  // (Gemm1Args.row_part; args.h kBf16WideTileTokens: the tails of the large tile's launches).
  // The bf16 redo (Gemm1Args::redo) covers only the experts the f16 pass marked.
  static __device__ __forceinline__ int launch_rows(const Gemm1Args& g, int e, int& first) {
    const int count = g.redo && g.fallback[e] == 0 ? 0 : g.counts[e];
    const int tail = count % kBf16TileTokens;
    first = 0;
    if (g.row_part == kAllRows) return count;
    const bool wide =
        count > kBf16TileTokens && tail >= 1 && tail <= kBf16WideTileTokens - kBf16TileTokens;
    const bool small = !wide && tail >= 1 && tail <= kBf16TailMax;
    const int head = count - (wide ? kBf16TileTokens + tail : small ? tail : 0);
    if (g.row_part == kHeadRows) return head;
    first = head;
    return (wide && g.row_part == kWideRows) || (small && g.row_part == kTailRows) ? count - head
                                                                                   : 0;
  }

  __device__ __forceinline__ int total(const Gemm1Args& g) const { return tile_start[g.EL]; }

  // One warp (every lane calls this, `lane` its lane) waits (bounded) until every source's rows of
  // expert e have landed, lane s reading source s's signal, so all signals come in one round trip
  // per poll; the caller's next barrier releases the threads that read the rows. `ready` caches
  // the last expert seen complete.
  static __device__ __forceinline__ void wait_arrival(const Gemm1Args& g, int e, int& ready,
                                                      int lane) {
    if (!g.arrival || e == ready) return;
    ready = e;
    const bool mine = lane < g.arrival_ranks;  // kMaxRanks <= kWarp: one source per lane
    const uint32_t* flags = g.arrival + int64_t(e) * g.arrival_ranks;
    const uint64_t deadline = timer_now() + g.timeout_ns;
    for (bool first = true;; first = false) {
      const bool ok = !mine || epoch_reached(ld_acquire_sys(flags + lane), g.epoch);
      const unsigned missing = __ballot_sync(0xFFFFFFFFu, !ok);
      if (missing == 0) return;
      // not there yet: if a wait of this call already ran out (any CTA, or the dispatch), the
      // call is failed and its rows are not trusted, so don't wait (else every expert of every
      // CTA would wait out its own timeout). Read only here: the error word is host memory.
      if (first && __shfl_sync(0xFFFFFFFFu, lane == 0 && static_cast<volatile EpError*>(
                                                             g.err)->code != 0, 0))
        return;
      if (__shfl_sync(0xFFFFFFFFu, int(timer_now() > deadline), 0)) {
        // bounded: the rows are not trusted, the error surfaces at the host
        if (lane == __ffs(int(missing)) - 1)
          record_wait_error(g.err, 2, uint32_t(lane), uint32_t(e), g.epoch);
        return;
      }
      __nanosleep(256);
    }
  }

  // Work item w.
  __device__ __forceinline__ Tile tile(const Gemm1Args& g, int w) const {
    const int e = expert_of(g, w), local = w - tile_start[e];
    const int row_tiles = (tile_start[e + 1] - tile_start[e]) / n_tiles(g);
    return row_tile_of(g, e, local % row_tiles, int64_t(local / row_tiles) * kCols);
  }

  // Row tile rt of the call (numbered expert by expert) with n0 = 0.
  __device__ __forceinline__ Tile row_tile(const Gemm1Args& g, int rt) const {
    const int e = expert_of(g, rt * n_tiles(g));
    return row_tile_of(g, e, rt - tile_start[e] / n_tiles(g), 0);
  }

 private:
  // The expert of work item w: the last whose first item is <= w.
  __device__ __forceinline__ int expert_of(const Gemm1Args& g, int w) const {
    int lo = 0, hi = g.EL - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tile_start[mid] <= w) lo = mid; else hi = mid - 1;
    }
    return lo;
  }

  __device__ __forceinline__ Tile row_tile_of(const Gemm1Args& g, int e, int mt,
                                              int64_t n0) const {
    int first;
    const int rows = launch_rows(g, e, first);
    Tile t;
    t.e = e;
    t.row0 = g.offsets[e] + first + int64_t(mt) * kRows;
    t.rows = min(kRows, rows - mt * kRows);
    t.n0 = n0;
    t.rt = tile_start[e] / n_tiles(g) + mt;
    return t;
  }
};
using TileScheduler = TileSchedulerFor<BM, BN>;

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
