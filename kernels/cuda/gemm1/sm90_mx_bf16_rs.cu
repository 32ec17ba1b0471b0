// Grouped MX-fp8 GEMM1 + SwiGLU on Hopper through bf16 tensor cores (the default where
// H % 512 == 0 and I % 64 == 0). Exact MX arithmetic (DESIGN §3) without a per-block promotion:
// an e4m3 value times its power-of-two scale is exactly a bf16 (float32's exponent range), so the
// products of dequantised values are exact and bf16 `wgmma` sums them in float32 over all of K.
// The fp8 kernel's per-32 promotion (FMUL + FFMA per accumulator and block) capped it near half
// the fp8 rate; here the tensor cores run a plain deep pipeline and the cost moves to the upcasts.
//
// Roles (one CTA per SM, persistent over (expert, column tile, token tile) work items,
// scheduler.cuh):
// - weights are the M side of `wgmma` and come from registers: each consumer warpgroup owns 64 gate
//   + 64 up weight rows (the same 64 output columns, so SwiGLU pairs accumulators of one thread),
//   loads its fragments as fp8 from shared memory and upcasts them (upcast4) just before issuing;
// - tokens are the N side (128 per tile) and come from shared memory as bf16, upcast ONCE per call
//   into the workspace (g.xb) by the producer warpgroup's three transform warps, each CTA taking
//   row tiles round-robin (every column tile of a row tile reads the same bf16 rows: upcasting in
//   each tile cost 16x the work and starved the consumers). A row tile's flag (g.xb_ready)
//   releases it to the loaders of every CTA;
// - the loader warp brings, stage by stage, fp8 weight rows and bf16 token rows by TMA into one
//   ring, and every kScaleStages stages the weights' scales.
// Consumers turn the weights' scale bytes into bf16 factors themselves and free a stage once its
// wgmma have retired. Fused with a dispatch (g.arrival), a row tile is upcast once its expert's
// rows have landed, so each expert still starts as soon as its rows are there.
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "kernels/common/mxfp8.h"
#include "kernels/cuda/gemm1/args.h"
#include "kernels/cuda/gemm1/common.cuh"
#include "kernels/cuda/gemm1/kernels.h"
#include "kernels/cuda/launch_util.h"
#include "kernels/cuda/gemm1/mx_bf16.cuh"
#include "kernels/cuda/gemm1/scheduler.cuh"
#include "kernels/cuda/gemm1/sm90.cuh"
#include "kernels/cuda/gemm1/sm90_mx_bf16_epilogue.cuh"
#include "kernels/cuda/gemm1/sm90_mx_bf16_transform.cuh"

namespace jsm {
namespace cuda {
namespace gemm1 {
namespace sm90_bf16 {

// kTok: tokens per tile (wgmma N), a template parameter of the kernel: kBf16TileTokens;
// kBf16WideTileTokens for an expert's last full tile with its short tail (args.h); or
// kBf16SmallTileTokens where experts hold few rows (weight streaming: a 128-token instruction on 16
// rows spends 8x the tensor time the rows need, which at 16 rows per expert costs more than
// reading the weights). A separate kernel each, since two wgmma shapes in one kernel serialise
// them.
constexpr int COLS = kBf16TileCols;   // output columns per tile: 64 per consumer warpgroup
constexpr int WROWS = 2 * COLS;       // weight rows per tile
// K per stage: four MX blocks (NB), one 128-byte fp8 row. Whole 128-byte rows and few large TMA
// boxes per stage (one of token rows, one of weight rows: launch.cu BoxParts) because the loads
// are bound by TMA requests, not bytes (docs/PERF.md §3).
constexpr int KS = kBf16StageK, NB = KS / kBlock;
constexpr int WBOX = kBf16WeightBoxRows;  // weight rows per box part: a tile's gate or up rows
// Stages of the ring: 3 of the large tile's 64 KB (the wide tile's 70); 4 of the small tile's 40
// KB (what fits).
template <int kTok>
constexpr int kStages = kTok == kBf16SmallTileTokens ? 4 : 3;
// Weight scales come by TMA in super-stages of kScaleStages stages (16 scale bytes per row, the
// smallest TMA box), two super-stages deep.
constexpr int kScaleStages = 4, kScaleBytes = kScaleStages * KS / kBlock;
constexpr int kScaleLead = 2;  // load_stages
static_assert(kScaleLead > 0 && kScaleLead <= kScaleStages, "load_stages: a tile's or the next's");
// Registers per thread of the producer and the consumer warpgroups (the wide tile's consumers hold
// 24 accumulators more).
template <int kTok>
using Registers = std::conditional_t<kTok == kBf16WideTileTokens, WsRegisterSplit<72, 216>,
                                     WsRegisterSplit<88, 208>>;
static_assert(COLS == 128, "two consumer warpgroups");
static_assert(kBf16TileTokens == 128 && kBf16WideTileTokens == 152 && kBf16SmallTileTokens == 32,
              "the wgmma shapes below");

// One stage of the ring, filled by TMA.
// w: fp8 weight rows, 128-byte swizzle (16-byte chunk c of row r at c ^ (r & 7)), one TMA box of
//    256 rows in two parts (tile_weight_row; stage_row says which row a consumer reads).
// x: bf16 token rows (the workspace's K order, mx_bf16.cuh), 128-byte swizzle: the
//    K-major layout of wgmma's B descriptor; two halves of K (64 elements, 128 bytes a row) one
//    after the other.
template <int kTok>
struct alignas(1024) Stage {
  uint8_t w[WROWS * KS];
  uint8_t x[kTok * 2 * KS];
};
// One super-stage's e8m0 scale bytes of the weight rows (as in Stage).
struct alignas(128) ScaleStage {
  uint8_t w[WROWS][kScaleBytes];
};
// The epilogue's staging (sm90_mx_bf16_epilogue.cuh), per consumer warpgroup. The wide tile has
// no room for it beside its ring and stages it in the token rows of the tile's last slot, once
// both warpgroups' wgmma have read them (consume_tile).
template <int kTok>
constexpr bool kEpiInSlot = kTok == kBf16WideTileTokens;
template <int kTok, bool kInSlot = kEpiInSlot<kTok>>
struct EpiStaging {
  float f[2][kEpiFloats];
};
template <int kTok>
struct EpiStaging<kTok, true> {};
template <int kTok>
struct Shared {
  Stage<kTok> s[kStages<kTok>];
  ScaleStage scales[2];
  EpiStaging<kTok> epi;
  int row_bias[kTok];  // the transform's: its row tile's windows (f16 pass)
  // f16 pass: the token rows' window factors (Gemm1Args::row_factor) of the CTA's tiles of even
  // and odd number, copied by the loader with a tile's first stage (load_stages): the epilogue
  // reads them here, with no global load on its path
  float row_factor[2][kTok];
  uint64_t loaded[kStages<kTok>], empty[kStages<kTok>], scales_loaded[2], scales_empty[2];
};
static_assert(sizeof(Stage<kBf16WideTileTokens>::x) >= 2 * kEpiFloats * sizeof(float),
              "the wide tile's staging fits a slot's token rows");
// + the worst alignment pad: dynamic shared memory starts 16-byte aligned at least
template <int kTok>
constexpr int kSmemBytes = int(sizeof(Shared<kTok>)) + 1024 - 16;
template <int kTok>
constexpr bool kFits =
    kSmemBytes<kTok> + int(sizeof(TileSchedulerFor<kTok, COLS>)) <= 227 * 1024;
static_assert(kFits<kBf16TileTokens> && kFits<kBf16WideTileTokens> && kFits<kBf16SmallTileTokens>,
              "shared memory of one CTA (dynamic + the scheduler's static prefix)");

// Consumer warpgroup cw's staging for the epilogue of a tile whose last stage sat in `slot`.
template <int kTok>
__device__ __forceinline__ float* epi_staging(Shared<kTok>& sh, int slot, int cw) {
  if constexpr (kEpiInSlot<kTok>) return reinterpret_cast<float*>(sh.s[slot].x) + cw * kEpiFloats;
  else return sh.epi.f[cw];
}

// The two GEMMs of the layer on this kernel (kSwiglu): GEMM1, output columns = g.I, weight rows
// 2I per expert (gate rows, then up rows), SwiGLU; and GEMM2 (false), output columns = g.I (the
// model's H), weight rows g.I per expert, plain. g.H is the depth (K) of both.
// A consumer warpgroup's output columns per tile: 64 (each with a gate and an up row) or 128.
template <bool kSwiglu>
constexpr int kWgCols = kSwiglu ? 64 : 128;
template <bool kSwiglu, int kTok>
using SchedulerFor = TileSchedulerFor<kTok, 2 * kWgCols<kSwiglu>>;

// The first w1/w2 row of tile t's TMA box: GEMM1 its 128 columns' gate rows (part 0; their up rows,
// I rows on, are part 1, landing at Stage::w row WBOX); GEMM2 its 256 columns' rows (part 1 the
// second 128).
template <bool kSwiglu>
__device__ __forceinline__ int tile_weight_row(const Gemm1Args& g, const Tile& t) {
  return int(int64_t(t.e) * (kSwiglu ? 2 : 1) * g.I + t.n0);
}
// The Stage::w row of row `row` of consumer warpgroup cw's part (GEMM1: gate/up of its 64 columns;
// GEMM2: its first/second 64 columns).
template <bool kSwiglu>
__device__ __forceinline__ int stage_row(int cw, int part, int row) {
  return kSwiglu ? part * WBOX + cw * 64 + row : cw * WBOX + part * 64 + row;
}

// --- producer warpgroup: a loader warp, and three transform warps (sm90_mx_bf16_transform.cuh) -

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The loader warp: stage after stage, once its slot is free, the TMA loads of weights and bf16
// token rows; every kScaleStages stages, once a scale slot is free, the weights' scales of the
// next ones, kScaleLead stages before the first of them (the next tile's first ones from the
// tile before: a tile's scales come from DRAM, and their 16-byte boxes are slow). Lane 0
// issues, after a tile's row tile is flagged upcast (bounded wait); kF16: with a tile's first
// stage, the whole warp copies the tile's row factors (Shared::row_factor).
template <bool kSwiglu, int kTok, bool kF16>
__device__ __forceinline__ void load_stages(const Gemm1Args& g, Shared<kTok>& sh,
                                            const SchedulerFor<kSwiglu, kTok>& sched,
                                            const CUtensorMap* map_xb, const CUtensorMap* map_w,
                                            const CUtensorMap* map_ws, int lane) {
  const int total = sched.total(g), num_k = int(g.H / KS);
  constexpr int STAGES = kStages<kTok>;
  // a tile's weight rows (or their scales) in one TMA box of two parts (launch_bf16_route)
  auto load_weight_box = [&](void* dst, const CUtensorMap* map, uint64_t* b, int x,
                             const Tile& t) {
    tma_load_3d(dst, map, b, x, tile_weight_row<kSwiglu>(g, t), 0);
  };
  // scale super-stage u (of the CTA's, counted as `issued` counts stages): tile t's k super-stage s
  auto load_scales = [&](uint32_t u, const Tile& t, int s) {
    ScaleStage& SS = sh.scales[u % 2];
    uint64_t* sbar = &sh.scales_loaded[u % 2];
    mbar_wait(&sh.scales_empty[u % 2], ((u / 2) & 1) ^ 1);
    if (lane == 0) {
      mbar_arrive_expect_tx(sbar, uint32_t(sizeof(SS.w)));
      load_weight_box(SS.w[0], map_ws, sbar, s * kScaleBytes, t);
    }
  };
  uint32_t issued = 0;
  if (int(blockIdx.x) < total) load_scales(0, sched.tile(g, blockIdx.x), 0);
  for (int w = blockIdx.x, n = 0; w < total; w += gridDim.x, ++n) {
    const Tile t = sched.tile(g, w);
    if (lane == 0) {
      // the row tile's bf16 rows: transitively bounded (the transform's own waits are: fused,
      // at most timeout_ns each, and none after the call's first expired), bounded here too; an
      // expiry is a broken protocol, not a slow peer: fail the launch loudly, never compute on
      // rows that are not there
      const uint32_t* flag = (t.head ? g.head_ready : g.xb_ready) + t.rt;
      const uint64_t deadline =
          timer_now() + (g.timeout_ns ? 2 * g.timeout_ns : 20000000000ull);
      while (ld_acquire_gpu(flag) < uint32_t(kChunks))
        if (timer_now() > deadline) __trap();
        else __nanosleep(128);
      asm volatile("fence.proxy.async.global;" ::: "memory");  // TMA reads what was acquired
    }
    __syncwarp();
    // a stage: one box of the tile's kTok token rows (its two 64-element K halves as parts), one
    // of its weight rows: rows past the tile's (the next tile's or expert's, or zeros past the
    // tensor) are loaded and not used, which costs less than more, smaller boxes
    for (int ks = 0; ks < num_k; ++ks, ++issued) {
      Stage<kTok>& S = sh.s[issued % STAGES];
      uint64_t* bar = &sh.loaded[issued % STAGES];
      mbar_wait(&sh.empty[issued % STAGES], ((issued / STAGES) & 1) ^ 1);
      // the scales of the super-stage kScaleLead stages on (num_k is a multiple of kScaleStages,
      // launch: H % 512 == 0). Its scale slot is free once stage issued + kScaleLead -
      // kScaleStages - 1 is done (the super-stage two before ends there); the ring's slot just
      // freed held stage issued - STAGES, done: the same stage for the 3-stage ring, one before
      // for the 4-stage one, so this wait is short, and no stage it needs is left unissued.
      if ((ks + kScaleLead) % kScaleStages == 0) {
        const uint32_t u = (issued + kScaleLead) / kScaleStages;
        if (ks + kScaleLead < num_k) load_scales(u, t, (ks + kScaleLead) / kScaleStages);
        else if (w + int(gridDim.x) < total) load_scales(u, sched.tile(g, w + gridDim.x), 0);
      }
      if (kF16 && ks == 0) {  // the row factors, on this stage's barrier (before its arrival)
        for (int r = lane; r < t.rows; r += kWarp)
          cp_async_small<4>(&sh.row_factor[n % 2][r], g.row_factor + t.row0 + r, true);
        mbar_arrive_cp_async(bar);
        __syncwarp();
      }
      if (lane == 0) {
        mbar_arrive_expect_tx(bar, uint32_t(sizeof(S.x) + sizeof(S.w)));
        tma_load_3d(S.x, map_xb, bar, 0, int(t.row0), 2 * ks);
        load_weight_box(S.w, map_w, bar, ks * KS, t);
      }
    }
  }
}

// --- consumers ---------------------------------------------------------------------------------

// A position in a ring of kSlots stages: the slot and the phase parity of its mbarriers, kept by
// counting (a division by 3 per stage sat on the consumers' path otherwise).
template <int kSlots>
struct RingPosition {
  int slot = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void next() {
    if (++slot == kSlots) slot = 0, phase ^= 1;
  }
  __device__ __forceinline__ int previous_slot() const {
    return slot == 0 ? kSlots - 1 : slot - 1;
  }
};

__device__ __forceinline__ void consumers_barrier() {  // both consumer warpgroups
  asm volatile("bar.sync 4, 256;" ::: "memory");
}

// A warpgroup's fragments of one MX block: [gate/up][k16 step][the 4 A registers].
struct Frags {
  uint32_t r[2][2][4];
};

// Pins values in registers at this point of the instruction stream: before wgmma's arrive (all
// 16 fragment registers live at once) and after the wait that retires their wgmma (so ptxas keeps
// them apart from the next block's, instead of reusing 4 registers and serialising every wgmma).
__device__ __forceinline__ void fence_frags(Frags& f) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+r"((&f.r[0][0][0])[i])::"memory");
}
template <int M>
__device__ __forceinline__ void fence_acc(float (&a)[M]) {
#pragma unroll
  for (int i = 0; i < M; ++i) asm volatile("" : "+f"(a[i])::"memory");
}

// A thread's weight bytes of one logical block (mx_bf16.cuh, a stage's K order): [gate/up][row g,
// g + 8], the words of its k16 steps 0 and 1; and the factors of its rows' scale bytes of the
// stage.
struct RawBlock {
  uint2 v[2][2];
};
struct StageFactors {
  uint32_t f[2][2];
  bool slow;  // per warp: the two-step multiply (fast_scale)
};

// Rows row_g = warp * 16 + g and row_g + 8 of the warpgroup's gate and up halves: logical block lb
// of the stage, 8 bytes of their block tig (chunk 2 tig + lb / 2 of the 128-byte swizzle, the half
// stage_half(lb, tig): a half warp's 16 lanes, rows g = 0..3 or 4..7, land on 16 distinct 8-byte
// slots of the 128 bytes, so no bank conflicts). One block at a time, so that blocks 2 and 3 are
// loaded a whole block before their upcast (16-byte loads of two blocks, issued just before the
// first one's upcast, held the wgmma issue on shared memory busy with the tensor cores' reads).
// The four rows are row_g's plus multiples of 8, so they share the swizzled chunk: one address,
// and the others at constant offsets.
template <bool kSwiglu>
__device__ __forceinline__ void load_block(RawBlock& raw, uint32_t w_base, int cw, int row_g,
                                           int tig, int lb) {
  static_assert(WBOX % 8 == 0 && 64 % 8 == 0, "stage_row keeps a row's swizzle phase (r & 7)");
  const uint32_t base = w_base + stage_row<kSwiglu>(cw, 0, row_g) * KS +
                        (((2 * tig + lb / 2) ^ (row_g & 7)) << 4) + 8 * stage_half(lb, tig);
#pragma unroll
  for (int part = 0; part < 2; ++part)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      raw.v[part][h] = lds64(base + (stage_row<kSwiglu>(0, part, 8 * h) -
                                     stage_row<kSwiglu>(0, 0, 0)) * KS);
}

// The window biases (mx_bf16.cuh) of the thread's rows [part][h] (see load_block), + kMaxBias, a
// byte each (packed_bias): each placed by the largest scale of the row's first 16 blocks, the
// tile's first scale super-stage.
template <bool kSwiglu>
__device__ __forceinline__ uint32_t weight_biases(const ScaleStage& sc, int cw, int row_g) {
  static_assert(kScaleBytes == 16, "a row's scale bytes of a super-stage: one 16-byte load");
  uint32_t packed = 0;
#pragma unroll
  for (int part = 0; part < 2; ++part)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 v =
          *reinterpret_cast<const uint4*>(sc.w[stage_row<kSwiglu>(cw, part, row_g + 8 * h)]);
      const int b = window_bias(top_scale16(v), kF16TopScale - kWeightHeadroom);
      packed |= uint32_t(b + kMaxBias) << (8 * (2 * part + h));
    }
  return packed;
}
__device__ __forceinline__ int packed_bias(uint32_t packed, int part, int h) {
  return int((packed >> (8 * (2 * part + h))) & 0xFFu) - kMaxBias;
}

// The factors of the rows' scale bytes of the stage (sk: the stage's first in the super-stage
// `sc`). The two-step multiply is chosen per warp: both forms give the same bf16 wherever the
// one-step form applies, so a warp's choice does not change the result. kF16: f16 factors in the
// rows' windows (wbias: weight_biases), and `slow` a scale outside its window, for which the
// caller marks the tile's expert (the bf16 pass redoes it).
template <bool kSwiglu, bool kF16>
__device__ __forceinline__ void stage_factors(StageFactors& sf, const ScaleStage& sc, int sk,
                                              int cw, int row_g, int tig, uint32_t wbias) {
  uint32_t e[2][2];
  bool slow = false;
#pragma unroll
  for (int part = 0; part < 2; ++part)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      e[part][h] = sc.w[stage_row<kSwiglu>(cw, part, row_g + 8 * h)][sk + tig];
      if (kF16) e[part][h] -= uint32_t(packed_bias(wbias, part, h));  // wraps: out of range
      slow |= kF16 ? !f16_scale(e[part][h]) : !fast_scale(e[part][h]);
    }
  sf.slow = __any_sync(0xFFFFFFFFu, slow);
#pragma unroll
  for (int part = 0; part < 2; ++part)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      sf.f[part][h] = kF16 ? factor_f16x2(e[part][h]) : factor_bf16x2(e[part][h], sf.slow);
}

// A logical block's fragments.
template <bool kSlow, bool kF16>
__device__ __forceinline__ void upcast_frags(Frags& f, const RawBlock& raw,
                                             const StageFactors& sf) {
#pragma unroll
  for (int part = 0; part < 2; ++part) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint2& v = raw.v[part][h];
      // A registers: 0 = (row g, k 2tig..), 1 = (row g+8, k 2tig..), 2 = (row g, k 8+2tig..), 3
      if (kF16) {
        upcast4_f16(v.x, sf.f[part][h], f.r[part][0][h], f.r[part][0][2 + h]);
        upcast4_f16(v.y, sf.f[part][h], f.r[part][1][h], f.r[part][1][2 + h]);
      } else {
        upcast4(v.x, sf.f[part][h], kSlow, f.r[part][0][h], f.r[part][0][2 + h]);
        upcast4(v.y, sf.f[part][h], kSlow, f.r[part][1][h], f.r[part][1][2 + h]);
      }
    }
  }
}

// Block blk of one stage: for each k16 step, gate and up rows times all kTok tokens of the tile
// (one m64nkTok each), whatever its rows: one code path per kernel (two shapes in one kernel made
// ptxas serialise every wgmma, C7511/C7512: registers).
// b_desc: the descriptor of the stage's token rows (smem_desc_addr of Stage::x); a block's and
// step's descriptor adds its byte offset / 16 to the address field (no carry: shared memory
// addresses stay below 2^18), a constant, so the loop computes no address per instruction.
template <int kTok, bool kF16>
__device__ __forceinline__ void issue_block(float (&gate)[kTok / 2], float (&up)[kTok / 2],
                                            Frags& f, uint64_t b_desc, int blk) {
  fence_frags(f);
  fence_acc(gate);
  fence_acc(up);
  wgmma_fence();
  // the address field is the low word's (no carry, above), so the offset is added to it alone:
  // the high word stays the constant of smem_desc_addr (a 64-bit add cost ptxas two more moves and
  // a carry per instruction)
  const uint32_t desc_hi = uint32_t(b_desc >> 32), desc_lo = uint32_t(b_desc);
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const uint64_t desc =
        uint64_t(desc_hi) << 32 |
        (desc_lo + uint32_t(((blk / 2) * kTok * KS + (blk % 2) * 64 + s * 32) >> 4));
    wgmma_m64nk16_rs<kTok, kF16>(gate, f.r[0][s], desc);
    wgmma_m64nk16_rs<kTok, kF16>(up, f.r[1][s], desc);
  }
  wgmma_commit();
  fence_acc(gate);
  fence_acc(up);
}

// The warpgroup's output: GEMM1, SwiGLU of its 64 gate/up column pairs; GEMM2, its 128 columns.
// kF16: the sums times the factors of their weight rows' windows (wbias) and tokens' (the
// transform's g.row_factor, copied by the loader: row_factor), before SwiGLU.
template <bool kSwiglu, int kTok, bool kF16>
__device__ __forceinline__ void epilogue(const Gemm1Args& g, const Tile& t, float* epi,
                                         const float* row_factor,
                                         const float (&acc0)[kTok / 2],
                                         const float (&acc1)[kTok / 2], int cw, int tid,
                                         int row_g, int tig, uint32_t wbias) {
  const int64_t col0 = t.n0 + cw * kWgCols<kSwiglu>;
  float wf[2][2];
#pragma unroll
  for (int part = 0; part < 2; ++part)
#pragma unroll
    for (int h = 0; h < 2; ++h) wf[part][h] = kF16 ? pow2(packed_bias(wbias, part, h)) : 1.0f;
  if (kSwiglu) {
    store_columns<kTok, kF16>(
        g, t, epi, row_factor,
        [&](int i, int h, float tf) {
          return swiglu(acc0[i] * wf[0][h] * tf, acc1[i] * wf[1][h] * tf, g.has_limit, g.limit);
        },
        col0, cw, tid, row_g, tig);
  } else {
    store_columns<kTok, kF16>(
        g, t, epi, row_factor, [&](int i, int h, float tf) { return acc0[i] * wf[0][h] * tf; },
        col0, cw, tid, row_g, tig);
    store_columns<kTok, kF16>(
        g, t, epi, row_factor, [&](int i, int h, float tf) { return acc1[i] * wf[1][h] * tf; },
        col0 + 64, cw, tid, row_g, tig);
  }
}

// One tile of one consumer warpgroup. `consumed` counts stages of all tiles.
// Each block's fragments are upcast while the block before it computes (f0 and f1 alternate); a
// stage is freed at block 1 of the next one, once all its blocks have retired (wgmma reads its
// token rows), a scale super-stage once its last fragments are in registers.
// gate, up: [32 * half + the fragment index] for tokens 64 * half ..; f0, f1: the caller's.
template <bool kSwiglu, int kTok, bool kF16>
__device__ __forceinline__ void consume_tile(const Gemm1Args& g, Shared<kTok>& sh, const Tile& t,
                                             int num_k, uint32_t& consumed, int cw, int tid,
                                             float (&gate)[kTok / 2], float (&up)[kTok / 2],
                                             Frags& f0, Frags& f1,
                                             RingPosition<kStages<kTok>>& ring, int n) {
  const int warp = tid / 32, lane = tid % 32;
  const int row_g = warp * 16 + lane / 4, tig = lane % 4;
  const bool active = t.n0 + cw * kWgCols<kSwiglu> < g.I;
  uint32_t wbias = 0;  // kF16: weight_biases, at the tile's first stage
  // kF16: a stage met a scale outside its row's window. The expert is marked once, after the
  // loop: a mark in the loop cost every stage its predicated global stores' waits.
  bool tile_slow = false;
#pragma unroll
  for (int i = 0; i < kTok / 2; ++i) gate[i] = up[i] = 0.0f;
  // per warp: every lane is done with it
  auto release = [&](uint64_t* bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  for (int ks = 0; ks < num_k; ++ks, ++consumed) {
    const uint32_t u = consumed / kScaleStages;
    const int sk = int(consumed % kScaleStages) * NB;  // the stage's scale bytes
    const ScaleStage& sc = sh.scales[u % 2];
    // the ring slot and phase of stage `consumed`, and the slot before it
    const int slot = ring.slot, before = ring.previous_slot();
    // lane 0's (the same on every lane), so that ptxas knows it warp-uniform and keeps the
    // wgmma descriptors in uniform registers: otherwise it moves each into them (R2UR), 32
    // instructions a stage on the consumers' path. Before the waits, which hide the shuffle's
    // latency (right before its use it held the stage's first wgmma).
    const uint32_t x_addr = __shfl_sync(0xFFFFFFFFu, smem_addr(sh.s[slot].x), 0);
    if (sk == 0) mbar_wait(&sh.scales_loaded[u % 2], (u / 2) & 1);
    mbar_wait(&sh.loaded[slot], ring.phase);
    ring.next();
    if (active) {
      const uint32_t w_base = smem_addr(sh.s[slot].w);
      const uint64_t b_desc = smem_desc_addr(x_addr);
      if (kF16 && ks == 0) wbias = weight_biases<kSwiglu>(sc, cw, row_g);
      StageFactors sf;
      stage_factors<kSwiglu, kF16>(sf, sc, sk, cw, row_g, tig, wbias);
      tile_slow |= sf.slow;
      // raw[b % 2]: block b's bytes; blocks 2 and 3 loaded as soon as 0 and 1 are upcast
      RawBlock raw[2];
      load_block<kSwiglu>(raw[0], w_base, cw, row_g, tig, 0);
      load_block<kSwiglu>(raw[1], w_base, cw, row_g, tig, 1);
#pragma unroll
      for (int blk = 0; blk < NB; ++blk) {
        Frags& f = blk % 2 ? f1 : f0;
        wgmma_wait<1>();  // the block before the previous one has retired: f is free
        fence_frags(f);
        // at block 1: the previous stage has retired, its slot is free
        if (blk == 1 && ks > 0) release(&sh.empty[before]);
        // kF16: both branches run the same upcast (its result is redone in bf16 where slow):
        // with one path, ptxas serialises the wgmma (C7513: non-wgmma instructions defining
        // their input registers)
        if (sf.slow) upcast_frags<true, kF16>(f, raw[blk % 2], sf);
        else upcast_frags<false, kF16>(f, raw[blk % 2], sf);
        issue_block<kTok, kF16>(gate, up, f, b_desc, blk);
        if (blk + 2 < NB) load_block<kSwiglu>(raw[blk % 2], w_base, cw, row_g, tig, blk + 2);
      }
    } else if (ks > 0) {
      release(&sh.empty[before]);
    }
    if (sk == NB * (kScaleStages - 1)) release(&sh.scales_empty[u % 2]);
  }
  if (kF16 && tile_slow) mark_fallback(g, t.e);
  wgmma_wait<0>();
  fence_frags(f0);
  fence_frags(f1);
  fence_acc(gate);
  fence_acc(up);
  const int last = ring.previous_slot();
  if constexpr (kEpiInSlot<kTok>) consumers_barrier();  // no wgmma reads the slot's rows now
  else release(&sh.empty[last]);
  if (active)
    epilogue<kSwiglu, kTok, kF16>(g, t, epi_staging(sh, last, cw), sh.row_factor[n % 2], gate, up,
                                  cw, tid, row_g, tig, wbias);
  if constexpr (kEpiInSlot<kTok>) release(&sh.empty[last]);  // the staging is free (its barrier)
}

// The kernel body of both GEMMs (kSwiglu: see SchedulerFor) in f16 or bf16 (kF16; Gemm1Args::
// fallback). maps: see Bf16RsMaps (kernels.h).
template <bool kSwiglu, int kTok, bool kF16>
__device__ __forceinline__ void gemm_body(const Gemm1Args& g_in, const Bf16RsMaps& maps) {
  using Scheduler = SchedulerFor<kSwiglu, kTok>;
  constexpr int STAGES = kStages<kTok>;
  // the bf16 pass after an f16 one runs only where that one met a block outside its window: the
  // words its launches before it wrote, once they have completed (launch: programmatic)
  if (!kF16) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (!kF16 && g_in.redo && g_in.fallback[g_in.EL] == 0) return;
  const Gemm1Args g = resolve_slot(g_in);
  extern __shared__ uint8_t smem_raw[];
  // 1024-aligned (the swizzle patterns), as an offset from smem_raw so that the compiler keeps
  // shared-memory instructions
  Shared<kTok>& sh = *reinterpret_cast<Shared<kTok>*>(
      smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  __shared__ Scheduler sched;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&sh.loaded[s], 1);  // lane 0's expect_tx + the TMA bytes
      mbar_init(&sh.empty[s], 8);   // each consumer warp
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(&sh.scales_loaded[s], 1);
      mbar_init(&sh.scales_empty[s], 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  sched.init(g);  // ends with __syncthreads: the barriers are initialised for everyone
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

  if (wg == 0) {
    Registers<kTok>::producer();
    if (tid < kWarp)
      load_stages<kSwiglu, kTok, kF16>(g, sh, sched, &maps.xb, &maps.w, &maps.w_scales, tid);
    else transform_row_tiles<kF16>(g, sched, sh.row_bias, tid - kWarp);
    return;
  }

  Registers<kTok>::consumer();
  const int cw = wg - 1, total = sched.total(g), num_k = int(g.H / KS);
  uint32_t consumed = 0;
  RingPosition<STAGES> ring;
  float gate[kTok / 2], up[kTok / 2];  // GEMM2: the warpgroup's first and second 64 columns
  Frags f0 = {}, f1 = {};
  for (int w = blockIdx.x, n = 0; w < total; w += gridDim.x, ++n) {
    const Tile t = sched.tile(g, w);
    consume_tile<kSwiglu, kTok, kF16>(g, sh, t, num_k, consumed, cw, tid, gate, up, f0, f1,
                                      ring, n);
  }
}

// One kernel per GEMM (kSwiglu), tile width (kTok) and 16-bit type (kF16).
// A call's launches after its first are programmatic (launch): each may take the SMs that the
// launch before it leaves while that one's last tiles still run. So each launch lets the next one
// start at once, and waits for the one before it to complete before its CTAs exit: a launch's
// completion then implies every earlier launch's, which is what the stream's later work relies
// on (without a launch attribute the wait returns at once).
template <bool kSwiglu, int kTok, bool kF16>
__global__ void __launch_bounds__(kWsThreads, 1)
    gemm_sm90_mx_bf16_rs(const Gemm1Args g, const __grid_constant__ Bf16RsMaps maps) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  gemm_body<kSwiglu, kTok, kF16>(g, maps);
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

template <bool kSwiglu, int kTok, bool kF16>
void launch(const Gemm1Args& g, const Bf16RsMaps& maps, int grid, cudaStream_t stream,
            bool programmatic) {
  auto kernel = gemm_sm90_mx_bf16_rs<kSwiglu, kTok, kF16>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes<kTok>);
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kWsThreads);
  config.dynamicSmemBytes = kSmemBytes<kTok>;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = programmatic ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, g, maps);
}

}  // namespace sm90_bf16

cudaError_t load_sm90_mx_bf16_rs() {
  using namespace sm90_bf16;
  static std::atomic<uint64_t> loaded{0};
  return load_kernels_once(loaded, gemm_sm90_mx_bf16_rs<true, kBf16TileTokens, true>,
                           gemm_sm90_mx_bf16_rs<true, kBf16WideTileTokens, true>,
                           gemm_sm90_mx_bf16_rs<true, kBf16SmallTileTokens, true>,
                           gemm_sm90_mx_bf16_rs<false, kBf16TileTokens, true>,
                           gemm_sm90_mx_bf16_rs<false, kBf16WideTileTokens, true>,
                           gemm_sm90_mx_bf16_rs<false, kBf16SmallTileTokens, true>,
                           gemm_sm90_mx_bf16_rs<true, kBf16SmallTileTokens, false>,
                           gemm_sm90_mx_bf16_rs<false, kBf16SmallTileTokens, false>);
}

void launch_sm90_mx_bf16_rs(const Gemm1Args& g, const Bf16RsMaps& maps, int grid,
                            cudaStream_t stream, bool swiglu, int tile_tokens, bool f16,
                            bool programmatic) {
  using namespace sm90_bf16;
  // the bf16 pass runs the small tile only (launch.cu launch_bf16_route)
  auto launch_type = [&](auto swiglu_tag) {
    constexpr bool kSwiglu = decltype(swiglu_tag)::value;
    if (!f16) launch<kSwiglu, kBf16SmallTileTokens, false>(g, maps, grid, stream, programmatic);
    else if (tile_tokens == kBf16SmallTileTokens)
      launch<kSwiglu, kBf16SmallTileTokens, true>(g, maps, grid, stream, programmatic);
    else if (tile_tokens == kBf16WideTileTokens)
      launch<kSwiglu, kBf16WideTileTokens, true>(g, maps, grid, stream, programmatic);
    else launch<kSwiglu, kBf16TileTokens, true>(g, maps, grid, stream, programmatic);
  };
  if (swiglu) launch_type(std::true_type{});
  else launch_type(std::false_type{});
}

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
