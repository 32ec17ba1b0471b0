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
  int rt;        // the row tile's number in its launch (experts in order, then row tiles)
  bool head;     // the row tile is the head launch's (its flag: Gemm1Args::head_ready)
};

// Work items (expert, column tile, row tile) numbered from the device-side expert counts: one
// launch covers every expert with no host round trip. Within an expert the row tiles of one
// column tile are consecutive items, so the CTAs that read the same weight rows run side by side
// and all but the first find them in L2 (row tiles first let them drift apart: at dsv3, 256 rows
// per expert, the weights came from DRAM ~1.8 times, docs/PERF.md §3). Fused with a dispatch, a
// CTA waits (bounded) for an expert's arrival signals before the expert's first tile: each
// expert starts as soon as its rows have landed.
static_assert(kMaxRanks <= kWarp, "wait_arrival reads one source per lane of a warp");

// The large tile's head launch leaves the items of its last partial wave to the tail launch
// (the 32-token kernel), which runs each as kBorrowUnits units of 32 of its rows side by side.
// Otherwise those items keep a few SMs busy for a whole large tile while the rest idle: at dsv3,
// 256 rows per expert, 4096 items on 132 SMs are 31 waves and 4 items, ~3% of the call; a
// 32-token unit takes well under half a large tile's time (its tensor work is a quarter, the
// weights' upcast the same). Tile widths give the same bytes (DESIGN §3), so which launch runs a
// row changes none of them.
constexpr int kBorrowUnits = kBf16TileTokens / kBf16SmallTileTokens;

// The head launch's items that the tail launch runs instead: those of its last partial wave on
// `grid` CTAs, where there are full waves before it and its units fit in one wave.
__device__ __forceinline__ int head_items_left(int items, int grid) {
  const int r = items % grid;
  return items > grid && r * kBorrowUnits <= grid ? r : 0;
}

// kRows landed rows x kCols output columns per tile.
template <int kRows, int kCols>
struct TileSchedulerFor {
  int32_t tile_start[kMaxExperts + 1];
  // This launch's work items: its own (tile_start[EL]), less the head launch's last few
  // (head_items_left), plus, in the tail launch, kBorrowUnits units of each of those.
  int work;
  int head_items;  // the tail launch: the head launch's own items

  static __device__ __forceinline__ int n_tiles(const Gemm1Args& g) {
    return int((g.I + kCols - 1) / kCols);
  }

  // Pipeline stages per tile, kb MX blocks (kb * 32 bytes of K per row) each.
  static __device__ __forceinline__ int k_stages(const Gemm1Args& g, int kb) {
    return int((g.H / kBlock + kb - 1) / kb);
  }

  // All threads call it; it ends with __syncthreads.
  __device__ __forceinline__ void init(const Gemm1Args& g) {
    exclusive_scan_smem(g.EL, tile_start, [&](int e) {
      int first;
      return (launch_rows(g, e, first) + kRows - 1) / kRows * n_tiles(g);
    });
    // the tail launch runs 32-row units (uniform: the barriers below are every thread's)
    const bool borrows = kRows == kBf16SmallTileTokens && g.row_part == kTailRows;
    if (borrows) {
      if (threadIdx.x == 0) head_items = 0;
      __syncthreads();
      int mine = 0;
      for (int e = threadIdx.x; e < g.EL; e += blockDim.x) mine += head_items_of(g, e);
      if (mine) atomicAdd(&head_items, mine);
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      work = tile_start[g.EL];
      if (g.row_part == kHeadRows) work -= head_items_left(work, gridDim.x);
      if (borrows) work += kBorrowUnits * head_items_left(head_items, gridDim.x);
    }
    __syncthreads();
  }

  // The rows of expert e this launch covers: [first, first + the result) of its landed rows
  // (Gemm1Args.row_part; args.h kBf16WideTileTokens: the tails of the large tile's launches).
  // The bf16 redo (Gemm1Args::redo) covers only the experts the f16 pass marked.
  static __device__ __forceinline__ int launch_rows(const Gemm1Args& g, int e, int& first) {
    return part_rows(g, e, first, g.row_part);
  }
  static __device__ __forceinline__ int part_rows(const Gemm1Args& g, int e, int& first,
                                                  int part) {
    const int count = g.redo && g.fallback[e] == 0 ? 0 : g.counts[e];
    const int tail = count % kBf16TileTokens;
    first = 0;
    if (part == kAllRows) return count;
    const bool wide =
        count > kBf16TileTokens && tail >= 1 && tail <= kBf16WideTileTokens - kBf16TileTokens;
    const bool small = !wide && tail >= 1 && tail <= kBf16TailMax;
    const int head = count - (wide ? kBf16TileTokens + tail : small ? tail : 0);
    if (part == kHeadRows) return head;
    first = head;
    return (wide && part == kWideRows) || (small && part == kTailRows) ? count - head : 0;
  }

  // The head launch's items of expert e (its large tiles).
  static __device__ __forceinline__ int head_items_of(const Gemm1Args& g, int e) {
    int first;
    return (part_rows(g, e, first, kHeadRows) + kBf16TileTokens - 1) / kBf16TileTokens *
           n_tiles(g);
  }

  __device__ __forceinline__ int total(const Gemm1Args&) const { return work; }
  // The launch's own row tiles (those its transform upcasts).
  __device__ __forceinline__ int row_tiles(const Gemm1Args& g) const {
    return tile_start[g.EL] / n_tiles(g);
  }

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
    if (w >= tile_start[g.EL]) return borrowed_unit(g, w - tile_start[g.EL]);
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
  // The tail launch's unit u of the head launch's items it runs (init): 32 rows of one of them.
  // Its rows are upcast and flagged by the head launch, which may still run (launch.cu): its
  // row tile's number and flag are the head launch's.
  __device__ __forceinline__ Tile borrowed_unit(const Gemm1Args& g, int u) const {
    const int left = (work - tile_start[g.EL]) / kBorrowUnits;
    const int item = head_items - left + u / kBorrowUnits;
    // its expert: they are the head launch's last items, so walk back from the last expert
    int e = g.EL - 1, start = head_items - head_items_of(g, e);
    while (start > item) start -= head_items_of(g, --e);
    const int row_tiles = head_items_of(g, e) / n_tiles(g), local = item - start;
    int first;
    const int rows = part_rows(g, e, first, kHeadRows);
    const int r0 = (local % row_tiles) * kBf16TileTokens + (u % kBorrowUnits) * kRows;
    Tile t;
    t.e = e;
    t.row0 = g.offsets[e] + first + r0;
    t.rows = max(0, min(kRows, rows - r0));  // 0: a unit past a partial tile's rows stores none
    t.n0 = int64_t(local / row_tiles) * kCols;
    t.rt = start / n_tiles(g) + local % row_tiles;
    t.head = true;
    return t;
  }

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
    t.head = false;
    return t;
  }
};
using TileScheduler = TileSchedulerFor<BM, BN>;

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
