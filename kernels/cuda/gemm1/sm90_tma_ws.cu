// Grouped MX-fp8 GEMM1 + SwiGLU, warp-specialised with TMA and wgmma (the default where
// H % 128 == 0): each warpgroup (64 rows) issues one asynchronous `wgmma.m64n128k32` per MX block
// straight from the swizzled shared-memory tiles (the 128-byte rows with chunk c at c ^ (row & 7)
// are the SW128 K-major layout), and the float32 promotion of block k runs while the tensor cores
// compute block k + 1 (two staging accumulators). No CTA-wide barrier in the main loop: a kernel
// with one warpgroup role and CTA-wide barriers per stage (since removed) paid a fixed ~1.6 µs per
// stage whatever its work (docs/PERF.md), the chain barrier -> convert -> issue -> four dependent
// wgmma -> drain -> barrier of one CTA per SM.
// Here one producer warpgroup (40 registers) streams stages ahead through a ring of STAGES
// buffers: thread 0 loads A and B tiles by TMA (128-byte swizzle, the layout wgmma reads), and all
// 128 threads copy the scale bytes by cp.async and convert them to floats LAG stages later, then
// arrive on the stage's `full` mbarrier (128 arrivals + the TMA bytes). Two consumer warpgroups
// (232 registers), 64 rows each, wait on `full`, run mma_stage and release the buffer on `empty`;
// they never wait for each other, so one's promotion overlaps the other's wgmma.
// Fused with a dispatch (g.arrival), the producer waits for the expert's rows before its first load.
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/common/mxfp8.h"
#include "kernels/cuda/gemm1/args.h"
#include "kernels/cuda/gemm1/common.cuh"
#include "kernels/cuda/gemm1/kernels.h"
#include "kernels/cuda/launch_util.h"
#include "kernels/cuda/gemm1/scheduler.cuh"
#include "kernels/cuda/gemm1/sm90.cuh"

namespace jsm {
namespace cuda {
namespace gemm1 {
namespace sm90_ws {

constexpr int KBYTES = KB * kBlock;  // 128: one SW128 atom row
constexpr int STAGES = 5, LAG = 2;   // ring depth; stages between a scale copy and its conversion
using Registers = WsRegisterSplit<40, 232>;  // producer, consumer warpgroups
static_assert(BM * KBYTES % 1024 == 0 && BNW == 128,
              "tile geometry: SW128 atoms 1024-byte aligned, one wgmma n128 per stage and block");

// Column scales of one MX block: the 32 columns j * 8 + tig * 2 + c (j < 16, c < 2) a thread tig
// holds are 32 consecutive floats at tig * kSbStride; the stride of 36 puts the four tig groups of
// a 16-byte load phase on different banks.
constexpr int kSbStride = 36;

// A stage's scales as floats, converted by the producer. The promotion (acc += d * sa[row] *
// sb[col], one FMUL + one FFMA per accumulator and block) is kept to those two instructions: each
// thread reads its 32 column scales of a block with 8 conflict-free 16-byte loads and its two row
// scales of a stage with 2.
struct Scales {
  float4 sa[BM];                 // row r: MX blocks 0..3 of the stage
  float sb[KB][4 * kSbStride];  // see kSbStride
};

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
// K split: a tile of <= 64 rows (small experts, the last tile of an expert) has both consumer
// warpgroups on the same 64 rows, each on every other K stage, instead of one on the rows and one
// idle (measured on an H200 at dsv3, R = 1: 13-15% faster at 128 and 1024 tokens, within 2% at
// 4096); the second hands its accumulators to the first through this scratch, half of them at a
// time (32 floats per thread), after the tile's last stage.
constexpr int kScratchBytes = 32 * 128 * 4;
constexpr int kSmemTotalBytes = kSmemBytes + kScratchBytes;
static_assert(kSmemTotalBytes + int(sizeof(int32_t)) * (kMaxExperts + 1) <= 227 * 1024,
              "shared memory of one CTA (dynamic + the scheduler's static prefix)");
static_assert(LAG < STAGES && 4 < STAGES,
              "the producer converts a stage before it needs that buffer again");

__device__ __forceinline__ int sb_index(int col) {  // col < 128 within the weight tile
  return (col & 7) / 2 * kSbStride + (col >> 3) * 2 + (col & 1);
}

// Copies the KB scale bytes of tile row r (0-127: A rows, 128-255: weight rows) of stage ks to
// *dst: one 4-byte cp.async when aligned (so nothing waits on it before the stage's data has
// landed), plain loads otherwise (rare shapes: H % 128 != 0); zeros past the valid rows and H.
__device__ __forceinline__ void issue_scale_row(const Gemm1Args& g, const Tile& t, int ks, int r,
                                                uint32_t* dst) {
  const int64_t HS = g.H / kBlock, kb0 = int64_t(ks) * KB;
  const uint8_t* src = nullptr;
  if (r < BM) {
    if (r < t.rows) src = g.a_scales + (t.row0 + r) * HS;
  } else {
    const int w = r - BM;
    const int64_t col = t.n0 + (w & (BN - 1));
    if (col < g.I) src = g.w_scales + (int64_t(t.e) * 2 * g.I + (w < BN ? 0 : g.I) + col) * HS;
  }
  if (g.scales_aligned) {
    const bool v = src && kb0 < HS;
    cp_async_small<4>(dst, v ? src + kb0 : g.w_scales, v);
    return;
  }
  uint32_t v = 0;
#pragma unroll
  for (int j = 0; j < KB; ++j)
    if (src && kb0 + j < HS) v |= uint32_t(src[kb0 + j]) << (8 * j);
  *dst = v;
}

// Tile row r's KB scale bytes v (rows 0-127: A rows, 128-255: weight rows) as floats in f.
__device__ __forceinline__ void store_scale_row(Scales& f, int r, uint32_t v) {
  float x[KB];
#pragma unroll
  for (int j = 0; j < KB; ++j) x[j] = e8m0_to_f32(uint8_t(v >> (8 * j)));
  if (r < BM) {
    f.sa[r] = make_float4(x[0], x[1], x[2], x[3]);
  } else {
#pragma unroll
    for (int j = 0; j < KB; ++j) f.sb[j][sb_index(r - BM)] = x[j];
  }
}

// acc += d * sa[row] * sb[col] for this thread's 64 accumulators of MX block kb (rows row0 and
// row0 + 8 with scales sa0, sa1; columns j * 8 + tig * 2 + c).
template <int kb>
__device__ __forceinline__ void promote(float* acc, const float* d, const Scales& s, float sa0,
                                        float sa1, int tig) {
  const float4* sb = reinterpret_cast<const float4*>(&s.sb[kb][tig * kSbStride]);
#pragma unroll
  for (int q = 0; q < 8; ++q) {  // columns of n8 blocks j = 2q, 2q + 1
    const float4 b = sb[q];
    const float sbv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const int j = 2 * q + jj;
      acc[j * 4 + 0] = fmaf(d[j * 4 + 0], sa0 * sbv[2 * jj], acc[j * 4 + 0]);
      acc[j * 4 + 1] = fmaf(d[j * 4 + 1], sa0 * sbv[2 * jj + 1], acc[j * 4 + 1]);
      acc[j * 4 + 2] = fmaf(d[j * 4 + 2], sa1 * sbv[2 * jj], acc[j * 4 + 2]);
      acc[j * 4 + 3] = fmaf(d[j * 4 + 3], sa1 * sbv[2 * jj + 1], acc[j * 4 + 3]);
    }
  }
}

// One stage (KB = 4 MX blocks) of a warpgroup's 64 rows: four wgmma, each block promoted while the
// next one computes; every wgmma of the stage has completed on return. a: the warpgroup's rows.
__device__ __forceinline__ void mma_stage(float* acc, float* da, float* db, const uint8_t* a,
                                          const uint8_t* b, const Scales& fs, int row0, int tig,
                                          bool warp_active) {
  const float4 sa0 = fs.sa[row0], sa1 = fs.sa[row0 + 8];
  wgmma_fence();
  wgmma_m64n128k32(da, smem_desc(a), smem_desc(b));
  wgmma_commit();
  wgmma_fence();
  wgmma_m64n128k32(db, smem_desc(a + 32), smem_desc(b + 32));
  wgmma_commit();
  wgmma_wait<1>();
  if (warp_active) promote<0>(acc, da, fs, sa0.x, sa1.x, tig);
  wgmma_fence();
  wgmma_m64n128k32(da, smem_desc(a + 64), smem_desc(b + 64));
  wgmma_commit();
  wgmma_wait<1>();
  if (warp_active) promote<1>(acc, db, fs, sa0.y, sa1.y, tig);
  wgmma_fence();
  wgmma_m64n128k32(db, smem_desc(a + 96), smem_desc(b + 96));
  wgmma_commit();
  wgmma_wait<1>();
  if (warp_active) promote<2>(acc, da, fs, sa0.z, sa1.z, tig);
  wgmma_wait<0>();
  if (warp_active) promote<3>(acc, db, fs, sa0.w, sa1.w, tig);
}

// SwiGLU and the stores of a warpgroup's rows row0 (+8); output columns n0 + j * 8 + tig * 2 + c
// pair gate tile j with up tile j + 8.
__device__ __forceinline__ void epilogue(const Gemm1Args& g, const Tile& t, const float* acc,
                                         int row0, int tig) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rloc = row0 + 8 * h;
    const bool row_valid = rloc < t.rows;
    const int64_t row = t.row0 + rloc;
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {  // two 32-column MX blocks per tile
      const int64_t col0 = t.n0 + blk * 32;
      const bool valid = row_valid && col0 < g.I;
      float v[4][2];
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int j = blk * 4 + n;
          v[n][c] = swiglu(acc[j * 4 + 2 * h + c], acc[(j + 8) * 4 + 2 * h + c], g.has_limit,
                           g.limit);
        }
      store_block(g, row, col0, valid, v, tig);
    }
  }
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

// map_a0, map_a1, map_b: see launch_sm90_tma_ws (kernels.h). A rows of the tile past its valid
// ones (rounded up to a box) keep stale data: they are never stored.
// Tiles of <= 64 rows split their K stages between the two consumer warpgroups (kScratchBytes).
__global__ void __launch_bounds__(kWsThreads, 1)
    sm90_tma_ws_kernel(const Gemm1Args g_in, const __grid_constant__ CUtensorMap map_a0,
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
    Registers::producer();
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
      if (tid < kWarp)  // warp 0; the barrier below releases the rest
        TileScheduler::wait_arrival(g, t.e, ready, tid);
      producer_barrier();
      const int b_row = int(int64_t(t.e) * 2 * g.I + t.n0);
      for (int ks = 0; ks < num_k; ++ks, ++issued) {
        const int b = int(issued % STAGES);
        mbar_wait(&sh.empty[b], ((issued / STAGES) & 1) ^ 1);
        if (tid == 0) {
          const int a_boxes = (t.rows + kTmaABoxRows - 1) / kTmaABoxRows;
          mbar_arrive_expect_tx(&sh.full[b], uint32_t(a_boxes * kTmaABoxRows + BNW) * KBYTES);
          for (int i = 0; i < a_boxes; ++i)
            tma_load_2d(sh.tiles[b].a + i * kTmaABoxRows * KBYTES, map_a, &sh.full[b], ks * KBYTES,
                        int(t.row0) + i * kTmaABoxRows);
          tma_load_2d(sh.tiles[b].b, &map_b, &sh.full[b], ks * KBYTES, b_row);
          tma_load_2d(sh.tiles[b].b + BN * KBYTES, &map_b, &sh.full[b], ks * KBYTES,
                      b_row + int(g.I));
        }
        issue_scale_row(g, t, ks, tid, &sh.scale_bytes[b][tid]);
        issue_scale_row(g, t, ks, BM + tid, &sh.scale_bytes[b][BM + tid]);
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

  Registers::consumer();
  const int cw = wg - 1, warp = tid / 32, lane = tid % 32;
  const int grp = lane >> 2, tig = lane & 3;
  float* scratch = reinterpret_cast<float*>(&sh + 1);  // the K split's (kScratchBytes)
  uint32_t consumed = 0;
  for (int w = blockIdx.x; w < total; w += gridDim.x) {
    const Tile t = sched.tile(g, w);
    // split: both warpgroups on rows 0-63, warpgroup cw on the K stages ks % 2 == cw
    const bool split = t.rows <= 64;
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
      if (wg_active && (!split || (ks & 1) == cw))
        mma_stage(acc, da, db, sh.tiles[b].a + rows_at * KBYTES, sh.tiles[b].b, sh.scales[b], row0,
                  tig, warp_active);
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
      if (cw == 0) epilogue(g, t, acc, row0, tig);
    } else {
      epilogue(g, t, acc, row0, tig);
    }
  }
}

}  // namespace sm90_ws

cudaError_t load_sm90_tma_ws() {
  static std::atomic<uint64_t> loaded{0};
  return load_kernels_once(loaded, sm90_ws::sm90_tma_ws_kernel);
}

void launch_sm90_tma_ws(const Gemm1Args& g, const CUtensorMap& map_a0, const CUtensorMap& map_a1,
                        const CUtensorMap& map_b, int grid, cudaStream_t stream) {
  auto kernel = sm90_ws::sm90_tma_ws_kernel;
  const int smem = sm90_ws::kSmemTotalBytes;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kernel<<<grid, kWsThreads, smem, stream>>>(g, map_a0, map_a1, map_b);
}

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
