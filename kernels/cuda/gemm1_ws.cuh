// Grouped MX-fp8 GEMM1 + SwiGLU, warp-specialised (the default where H % 128 == 0): the tiles,
// stage layout and wgmma + promotion of gemm1_wgmma.cuh, without any CTA-wide barrier in the main
// loop. Measured there (docs/PERF.md): every stage paid a fixed ~1.6 µs whatever its work, the
// chain barrier -> convert -> issue -> four dependent wgmma -> drain -> barrier of one CTA per SM.
// Here one producer warpgroup (40 registers) streams stages ahead through a ring of STAGES
// buffers: thread 0 loads A and B tiles by TMA (128-byte swizzle, the layout wgmma reads), and all
// 128 threads copy the scale bytes by cp.async and convert them to floats LAG stages later, then
// arrive on the stage's `full` mbarrier (128 arrivals + the TMA bytes). Two consumer warpgroups
// (232 registers), 64 rows each, wait on `full`, run mma_stage and release the buffer on `empty`;
// they never wait for each other, so one's promotion overlaps the other's wgmma.
// Fused with a dispatch (g.arrival), the producer waits for the expert's rows before its first load.
#pragma once

#include <cuda.h>  // CUtensorMap (the encoder is fetched from the driver at run time)

#include "kernels/cuda/gemm1_wgmma.cuh"

namespace jsm {
namespace cuda {
namespace gemm1_ws {

using namespace gemm1_v1;
using gemm1_v3::Scales;
using gemm1_v3::KB;
constexpr int KBYTES = KB * kBlock;  // 128: one SW128 atom row
constexpr int STAGES = 5, LAG = 2;   // ring depth; stages between a scale copy and its conversion
constexpr int THREADS = 384;         // producer warpgroup + two consumer warpgroups
constexpr int kABoxRows = 16;  // A is loaded in boxes of 16 rows: only the tile's valid rows
                               // (rounded up) cost memory traffic, as cp.async's zero-fill did

struct alignas(1024) Tiles {
  uint8_t a[BM * KBYTES];
  uint8_t b[BNW * KBYTES];
};

struct Shared {
  Tiles tiles[STAGES];
  Scales scales[STAGES];
  uint32_t scale_bytes[STAGES][2 * BM];
  uint64_t full[STAGES], empty[STAGES];
};
constexpr int kSmemBytes = int(sizeof(Shared)) + 1024;
// JSM_GEMM1=ws-ksplit: a tile of <= 64 rows (small experts, the last tile of an expert) has both
// consumer warpgroups on the same 64 rows, each on every other K stage, instead of one on the rows
// and one idle; the second hands its accumulators to the first through this scratch, half of
// them at a time (32 floats per thread), after the tile's last stage.
constexpr int kScratchBytes = 32 * 128 * 4;
constexpr int smem_bytes(bool k_split) { return kSmemBytes + (k_split ? kScratchBytes : 0); }
static_assert(smem_bytes(true) + int(sizeof(int32_t)) * (kMaxExperts + 1) <= 227 * 1024,
              "shared memory of one CTA (dynamic + the scheduler's static prefix)");
static_assert(LAG < STAGES && 4 < STAGES,
              "the producer converts a stage before it needs that buffer again");

__device__ __forceinline__ void mbar_init(uint64_t* b, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)),
               "r"(bytes)
               : "memory");
}
// Waits for the completion of the phase with the given parity (a fresh barrier counts its phase
// "-1", parity 1, as complete). Pipeline-internal: it ends when the other role makes progress.
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(smem_addr(b)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(x), "r"(y)
      : "memory");
}

__device__ __forceinline__ void producer_barrier() {  // the 128 producer threads only
  asm volatile("bar.sync 1, 128;" ::: "memory");
}
__device__ __forceinline__ void consumer_barrier(int cw) {  // one consumer warpgroup
  asm volatile("bar.sync %0, 128;" ::"r"(2 + cw) : "memory");
}
__device__ __forceinline__ void consumers_barrier() {  // both consumer warpgroups
  asm volatile("bar.sync 4, 256;" ::: "memory");
}

// Timing ablations (JSM_GEMM1=ws-nopromote|-nomma|-noload|-noscale; wrong results, never checked):
// what each part of the pipeline costs, by leaving it out (bench/kernel_variants.py).
enum Ablation : int {
  kFull = 0,
  kNoPromote = 1,  // wgmma without the float32 promotion
  kNoMma = 2,      // the loads and the ring only
  kNoLoad = 3,     // A and B loaded by the first pass over the ring only, then reused; no scales
  kNoScale = 4,    // A and B by TMA as always, the scale bytes not loaded (constant)
};

// map_a: landed rows [m_cap, H] bytes, box kABoxRows rows x 128 B (fused: one map per slot
// parity, else map_a1 is unused); map_b: w1 [EL * 2I, H], box 64 rows. A rows of the tile past
// its valid ones (rounded up to a box) keep stale data: they are never stored.
// kKSplit: tiles of <= 64 rows split their K stages between the two consumer warpgroups.
template <int kAblation = kFull, bool kKSplit = false>
__global__ void __launch_bounds__(THREADS, 1)
    gemm1_ws_kernel(const Gemm1Args g_in, const __grid_constant__ CUtensorMap map_a0,
                    const __grid_constant__ CUtensorMap map_a1,
                    const __grid_constant__ CUtensorMap map_b) {
  const Gemm1Args g = resolve_slot(g_in);
  const CUtensorMap* map_a = g.epoch_counter && (g.epoch & 1) ? &map_a1 : &map_a0;
  extern __shared__ uint8_t smem_raw[];
  Shared& sh = *reinterpret_cast<Shared*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                          ~uintptr_t(1023));
  __shared__ TileScheduler sched;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&sh.full[s], 128 + 1);  // the producer threads + thread 0's expect_tx arrival
      mbar_init(&sh.empty[s], 2);       // one arrival per consumer warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  sched.init(g);  // ends with __syncthreads: the barriers are initialised for everyone
  const int total = sched.total(g);
  const int num_k = TileScheduler::k_stages(g, KB);
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    int ready = -1;
    uint32_t issued = 0;  // stages issued so far (all tiles), ring position issued % STAGES
    auto finish = [&](uint32_t i) {  // stage i's scale bytes have landed: floats, then arrive
      const int b = int(i % STAGES);
      store_scale_row(sh.scales[b], tid, sh.scale_bytes[b][tid]);
      store_scale_row(sh.scales[b], BM + tid, sh.scale_bytes[b][BM + tid]);
      mbar_arrive(&sh.full[b]);
    };
    for (int w = blockIdx.x; w < total; w += gridDim.x) {
      const Tile t = sched.tile(g, w);
      TileScheduler::wait_arrival(g, t.e, ready);  // warp 0; the barrier below releases the rest
      producer_barrier();
      const int b_row = int(int64_t(t.e) * 2 * g.I + t.n0);
      for (int ks = 0; ks < num_k; ++ks, ++issued) {
        const int b = int(issued % STAGES);
        mbar_wait(&sh.empty[b], ((issued / STAGES) & 1) ^ 1);
        if (kAblation == kNoLoad && issued >= STAGES) {
          if (tid == 0) mbar_arrive_expect_tx(&sh.full[b], 0);
        } else if (tid == 0) {
          const int a_boxes = (t.rows + kABoxRows - 1) / kABoxRows;
          mbar_arrive_expect_tx(&sh.full[b], uint32_t(a_boxes * kABoxRows + BNW) * KBYTES);
          for (int i = 0; i < a_boxes; ++i)
            tma_load_2d(sh.tiles[b].a + i * kABoxRows * KBYTES, map_a, &sh.full[b], ks * KBYTES,
                        int(t.row0) + i * kABoxRows);
          tma_load_2d(sh.tiles[b].b, &map_b, &sh.full[b], ks * KBYTES, b_row);
          tma_load_2d(sh.tiles[b].b + BN * KBYTES, &map_b, &sh.full[b], ks * KBYTES,
                      b_row + int(g.I));
        }
        if (kAblation == kNoLoad || kAblation == kNoScale) {
          sh.scale_bytes[b][tid] = sh.scale_bytes[b][BM + tid] = 0x7F7F7F7Fu;  // scales 1.0
        } else {
          gemm1_v3::issue_scale_row(g, t, ks, tid, &sh.scale_bytes[b][tid]);
          gemm1_v3::issue_scale_row(g, t, ks, BM + tid, &sh.scale_bytes[b][BM + tid]);
        }
        cp_async_commit();
        if (issued >= LAG) {
          cp_async_wait<LAG>();
          finish(issued - LAG);
        }
      }
    }
    cp_async_wait<0>();
    for (uint32_t i = issued >= LAG ? issued - LAG : 0; i < issued; ++i) finish(i);
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int cw = wg - 1, warp = tid / 32, lane = tid % 32;
  const int grp = lane >> 2, tig = lane & 3;
  float* scratch = reinterpret_cast<float*>(&sh + 1);  // kKSplit only (see smem_bytes)
  uint32_t consumed = 0;
  for (int w = blockIdx.x; w < total; w += gridDim.x) {
    const Tile t = sched.tile(g, w);
    // split: both warpgroups on rows 0-63, warpgroup cw on the K stages ks % 2 == cw
    const bool split = kKSplit && t.rows <= 64;
    const int rows_at = split ? 0 : cw * 64;   // this warpgroup's first tile row
    const int row0 = rows_at + warp * 16 + grp;  // this thread's rows: row0, row0 + 8
    const bool wg_active = rows_at < t.rows;
    const bool warp_active = rows_at + warp * 16 < t.rows;
    float acc[64], da[64], db[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    for (int ks = 0; ks < num_k; ++ks, ++consumed) {
      const int b = int(consumed % STAGES);
      // also for a stage this warpgroup skips: arriving on `empty` only after `full` keeps each
      // warpgroup's arrivals in the barrier's current phase
      mbar_wait(&sh.full[b], (consumed / STAGES) & 1);
      if (wg_active && kAblation != kNoMma && (!split || (ks & 1) == cw))
        gemm1_v3::mma_stage<kAblation != kNoPromote>(acc, da, db,
                                                      sh.tiles[b].a + rows_at * KBYTES,
                                                      sh.tiles[b].b, sh.scales[b], row0, tig,
                                                      warp_active);
      consumer_barrier(cw);  // every thread of the warpgroup is done with buffer b
      if (tid == 0) mbar_arrive(&sh.empty[b]);
    }
    if (split) {  // warpgroup 1's sums into warpgroup 0's (same fragment layout), in two halves
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (cw == 1) {
#pragma unroll
          for (int i = 0; i < 32; ++i) scratch[i * 128 + tid] = acc[half * 32 + i];
        }
        consumers_barrier();
        if (cw == 0) {
#pragma unroll
          for (int i = 0; i < 32; ++i) acc[half * 32 + i] += scratch[i * 128 + tid];
        }
        consumers_barrier();  // the scratch is free again
      }
      if (cw == 0) gemm1_v3::epilogue(g, t, acc, row0, tig);
    } else {
      gemm1_v3::epilogue(g, t, acc, row0, tig);
    }
  }
}

}  // namespace gemm1_ws
}  // namespace cuda
}  // namespace jsm
