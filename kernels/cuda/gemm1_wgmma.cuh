// Grouped MX-fp8 GEMM1 + SwiGLU with Hopper wgmma (JSM_GEMM1=wgmma while it is being validated):
// the tiles and scheduler of gemm1.cuh, but each warpgroup (64 rows) issues one asynchronous
// `wgmma.m64n128k32` per MX block straight from the swizzled shared-memory tiles (the 128-byte rows
// with chunk c at c ^ (row & 7) are the SW128 K-major layout), and the float32 promotion of block k
// runs while the tensor cores compute block k + 1 (two staging accumulators).
//
// The promotion (acc += d * sa[row] * sb[col], one FMUL + one FFMA per accumulator and block) is
// kept to those two instructions: the e8m0 scale bytes arrive by cp.async with the stage and are
// converted to floats once per stage, laid out so each thread reads its 32 column scales of a
// block with 8 conflict-free 16-byte loads and its two row scales of a stage with 2; warps whose
// 16 rows are all padding skip the promotion.
#pragma once

#include "kernels/cuda/gemm1.cuh"

namespace jsm {
namespace cuda {
namespace gemm1_v3 {

using namespace gemm1_v1;
using C = Cfg<4, 4>;  // 128 B of K per row per stage: one SW128 atom row (C::STAGES unused)
constexpr int KB = C::KB;
constexpr int kAlign = 1024;  // SW128 atoms (8 rows x 128 B) must start 1024-byte aligned
// Column scales of one MX block: the 32 columns j * 8 + tig * 2 + c (j < 16, c < 2) a thread tig
// holds are 32 consecutive floats at tig * kSbStride; the stride of 36 puts the four tig groups of
// a 16-byte load phase on different banks.
constexpr int kSbStride = 36;

struct alignas(kAlign) Stage {
  uint8_t a[BM * C::KBYTES];
  uint8_t b[BNW * C::KBYTES];
  uint32_t scale_bytes[THREADS];  // thread i: the KB scale bytes of tile row i (A rows, then weights)
};
// The scales of the stage being computed, as floats (one buffer: converted once per stage).
struct Scales {
  float4 sa[BM];                 // row r: MX blocks 0..3 of the stage
  float sb[KB][4 * kSbStride];  // see kSbStride
};
constexpr int smem_bytes(int stages) { return stages * int(sizeof(Stage)) + kAlign; }
static_assert(BM * C::KBYTES % kAlign == 0 && BNW == 128 && THREADS == 2 * BM, "tile geometry");

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

__device__ __forceinline__ void issue_scales(const Gemm1Args& g, const Tile& t, int ks, Stage& s) {
  issue_scale_row(g, t, ks, threadIdx.x, &s.scale_bytes[threadIdx.x]);
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

__device__ __forceinline__ void convert_scales(const Stage& s, Scales& f) {
  store_scale_row(f, threadIdx.x, s.scale_bytes[threadIdx.x]);
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 B apart.
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  const uint64_t addr = smem_addr(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// d = A (64 x 32 e4m3, K-major) * B (128 x 32 e4m3, K-major)^T, a fresh float32 accumulator.
__device__ __forceinline__ void wgmma_m64n128k32(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b));
}

__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
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
// kPromote = false leaves the promotion out (a timing ablation: wrong results).
template <bool kPromote = true>
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
  if (kPromote && warp_active) promote<0>(acc, da, fs, sa0.x, sa1.x, tig);
  wgmma_fence();
  wgmma_m64n128k32(da, smem_desc(a + 64), smem_desc(b + 64));
  wgmma_commit();
  wgmma_wait<1>();
  if (kPromote && warp_active) promote<1>(acc, db, fs, sa0.y, sa1.y, tig);
  wgmma_fence();
  wgmma_m64n128k32(db, smem_desc(a + 96), smem_desc(b + 96));
  wgmma_commit();
  wgmma_wait<1>();
  if (kPromote && warp_active) promote<2>(acc, da, fs, sa0.z, sa1.z, tig);
  wgmma_wait<0>();
  if (kPromote && warp_active) promote<3>(acc, db, fs, sa0.w, sa1.w, tig);
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

template <int STAGES>
__global__ void __launch_bounds__(THREADS, 1) gemm1_kernel(const Gemm1Args g_in) {
  const Gemm1Args g = resolve_slot(g_in);
  extern __shared__ uint8_t smem_raw[];
  Stage* stages = reinterpret_cast<Stage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + kAlign - 1) & ~uintptr_t(kAlign - 1));
  __shared__ TileScheduler sched;
  __shared__ Scales fs;
  sched.init(g);
  const int total = sched.total(g);
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane_id = threadIdx.x % 32;
  const int grp = lane_id >> 2, tig = lane_id & 3;
  const int row0 = wg * 64 + warp * 16 + grp;  // this thread's rows: row0, row0 + 8
  const int num_k = TileScheduler::k_stages(g, KB);

  int ready = -1;
  for (int w = blockIdx.x; w < total; w += gridDim.x) {
    const Tile t = sched.tile(g, w);
    TileScheduler::wait_arrival(g, t.e, ready);  // released by the __syncthreads below
    const bool wg_active = wg * 64 < t.rows;                  // warpgroup-uniform: issue wgmma
    const bool warp_active = wg * 64 + warp * 16 < t.rows;  // warp-uniform: promote

    float acc[64], da[64], db[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;

    __syncthreads();  // the previous tile's reads of every stage are done
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < num_k) {
        issue_tiles<C>(g, t, s, stages[s].a, stages[s].b);
        issue_scales(g, t, s, stages[s]);
      }
      cp_async_commit();
    }
    for (int ks = 0; ks < num_k; ++ks) {
      cp_async_wait<STAGES - 2>();
      fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads the async one
      __syncthreads();      // stage ks has landed; every thread is done with stage ks - 1 and fs
      convert_scales(stages[ks % STAGES], fs);
      const int next = ks + STAGES - 1;
      if (next < num_k) {
        issue_tiles<C>(g, t, next, stages[next % STAGES].a, stages[next % STAGES].b);
        issue_scales(g, t, next, stages[next % STAGES]);
      }
      cp_async_commit();
      __syncthreads();  // fs holds stage ks's scales
      const Stage& s = stages[ks % STAGES];
      if (wg_active) mma_stage(acc, da, db, s.a + wg * 64 * C::KBYTES, s.b, fs, row0, tig,
                               warp_active);
    }
    cp_async_wait<0>();

    epilogue(g, t, acc, row0, tig);
  }
}

}  // namespace gemm1_v3
}  // namespace cuda
}  // namespace jsm
