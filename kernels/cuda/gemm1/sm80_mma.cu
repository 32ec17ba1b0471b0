// Persistent grouped MX-fp8 GEMM1 + SwiGLU (DESIGN.md §3) with mma.sync, for sm_89+ (here: Hopper):
// the fallback where the warp-specialised wgmma kernel does not apply (H % 128 != 0).
//
// h[row] = SwiGLU(deq(a[row]) @ deq(w[e]).T) for the landed rows of each local expert. Hopper has
// no block-scaled MMA, so each MX block (K = 32) is one fp8 `mma.sync.m16n8k32` into a fresh
// accumulator, promoted into float32 with the two block scales: acc += tmp * sa[row] * sb[col].
// Products of e4m3 values are exact; the sum of 32 of them is formed inside the tensor core, and
// everything after is float32.
//
// A CTA tile is 128 rows x 64 output columns (64 gate + 64 up weight rows), K = 128 (4 MX blocks)
// per pipeline stage, 4 stages of cp.async; 8 warps, each 32 rows x 32 output columns. Work items
// come from the device-side tile scheduler (scheduler.cuh).
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/common/mxfp8.h"
#include "kernels/cuda/gemm1/args.h"
#include "kernels/cuda/gemm1/common.cuh"
#include "kernels/cuda/gemm1/kernels.h"
#include "kernels/cuda/launch_util.h"
#include "kernels/cuda/gemm1/scheduler.cuh"

namespace jsm {
namespace cuda {
namespace gemm1 {
namespace sm80 {

constexpr int THREADS = 256;

// KB MX blocks (KB * 32 bytes of K per row) per pipeline stage, STAGES stages.
template <int KB_, int STAGES_>
struct Cfg {
  static constexpr int KB = KB_, STAGES = STAGES_, KBYTES = KB * kBlock, CH = KBYTES / 16;
  struct Stage {
    uint8_t a[BM * KBYTES];
    uint8_t b[BNW * KBYTES];
    uint8_t sa[BM][KB];  // e8m0 bytes, converted at use
    uint8_t sb[BNW][KB];
  };
  static constexpr int kSmemBytes = STAGES * int(sizeof(Stage));
  // 16-byte chunk c of smem row r sits at c ^ (r & 7): ldmatrix reads of 8 consecutive rows then
  // hit 8 different bank groups.
  static __device__ __forceinline__ int swz(int r, int c) {
    return r * KBYTES + ((c ^ (r & 7)) << 4);
  }
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_e4m3(float* d, const uint32_t* a, const uint32_t* b) {
  asm(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f), "f"(0.0f),
        "f"(0.0f), "f"(0.0f));
}

// Issues the cp.async copies of stage `ks` of a tile and loads its scale bytes into registers
// (stored to shared memory later, so their latency overlaps the MMAs).
template <class C>
struct ScaleRegs {
  uint8_t a[C::KB / 2], b[C::KB / 2];
};

// The cp.async copies of stage `ks` of a tile's A rows and weight rows into swizzled tiles (rows
// past the valid ones and K past H are zero-filled).
template <class C>
__device__ __forceinline__ void issue_tiles(const Gemm1Args& g, const Tile& t, int ks, uint8_t* a,
                                            uint8_t* b) {
  const int tid = threadIdx.x;
  const uint8_t* wbase = g.w + int64_t(t.e) * 2 * g.I * g.H;
#pragma unroll
  for (int i = 0; i < BM * C::CH / THREADS; ++i) {
    const int idx = tid + THREADS * i, r = idx / C::CH, c = idx % C::CH;
    const int64_t kbyte = int64_t(ks) * C::KBYTES + c * 16;
    const bool kvalid = kbyte < g.H;
    const bool va = kvalid && r < t.rows;
    cp_async16(a + C::swz(r, c), va ? g.a + (t.row0 + r) * g.H + kbyte : g.a, va);
    const int64_t col = t.n0 + (r & (BN - 1));
    const int64_t wrow = (r < BN ? 0 : g.I) + col;
    const bool vb = kvalid && col < g.I;
    cp_async16(b + C::swz(r, c), vb ? wbase + wrow * g.H + kbyte : g.w, vb);
  }
}

template <class C>
__device__ __forceinline__ void issue_stage(const Gemm1Args& g, const Tile& t, int ks,
                                            typename C::Stage& s, ScaleRegs<C>& sr) {
  constexpr int KB = C::KB;
  const int tid = threadIdx.x;
  const int64_t HS = g.H / kBlock;
  issue_tiles<C>(g, t, ks, s.a, s.b);
  // scales. Aligned: one 4-byte cp.async per row (threads 0-127: A rows, 128-255: weight rows).
  const uint8_t* ws = g.w_scales + int64_t(t.e) * 2 * g.I * HS;
  const int64_t kb0 = int64_t(ks) * KB;
  if (g.scales_aligned) {
    const int r = tid & (BM - 1);
    if (tid < BM) {
      const bool v = r < t.rows && kb0 < HS;
      cp_async_small<KB>(s.sa[r], v ? g.a_scales + (t.row0 + r) * HS + kb0 : g.a_scales, v);
    } else {
      const int64_t col = t.n0 + (r & (BN - 1));
      const bool v = col < g.I && kb0 < HS;
      cp_async_small<KB>(s.sb[r], v ? ws + ((r < BN ? 0 : g.I) + col) * HS + kb0 : g.w_scales, v);
    }
    return;
  }
  // otherwise bytes through registers: rows tid / 2, MX blocks (tid & 1) * KB / 2 + j
  const int r = tid >> 1;
#pragma unroll
  for (int j = 0; j < KB / 2; ++j) {
    const int64_t kb = kb0 + (tid & 1) * (KB / 2) + j;
    const bool ka = kb < HS;
    sr.a[j] = (ka && r < t.rows) ? g.a_scales[(t.row0 + r) * HS + kb] : 0;
    const int64_t col = t.n0 + (r & (BN - 1));
    const int64_t wrow = (r < BN ? 0 : g.I) + col;
    sr.b[j] = (ka && col < g.I) ? ws[wrow * HS + kb] : 0;
  }
}

template <class C>
__device__ __forceinline__ void store_scales(const Gemm1Args& g, typename C::Stage& s,
                                             const ScaleRegs<C>& sr) {
  if (g.scales_aligned) return;
  const int tid = threadIdx.x;
  const int r = tid >> 1;
#pragma unroll
  for (int j = 0; j < C::KB / 2; ++j) {
    const int kb = (tid & 1) * (C::KB / 2) + j;
    s.sa[r][kb] = sr.a[j];
    s.sb[r][kb] = sr.b[j];
  }
}

template <class C>
__global__ void __launch_bounds__(THREADS, 1) sm80_mma_kernel(const Gemm1Args g_in) {
  const Gemm1Args g = resolve_slot(g_in);
  constexpr int KB = C::KB, STAGES = C::STAGES;
  using Stage = typename C::Stage;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Stage* stages = reinterpret_cast<Stage*>(smem_raw);
  __shared__ TileScheduler sched;
  sched.init(g);
  const int total = sched.total(g);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp & 3, wn = warp >> 2;  // 4 x 2 warps
  const int grp = lane >> 2, tig = lane & 3;
  const int num_k = TileScheduler::k_stages(g, KB);

  int ready = -1;
  for (int w = blockIdx.x; w < total; w += gridDim.x) {
    const Tile t = sched.tile(g, w);
    if (threadIdx.x < kWarp)  // released by the __syncthreads below
      TileScheduler::wait_arrival(g, t.e, ready, int(threadIdx.x));

    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

    __syncthreads();  // the previous tile's reads of every stage are done
    ScaleRegs<C> sr;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < num_k) {
        issue_stage<C>(g, t, s, stages[s], sr);
        store_scales<C>(g, stages[s], sr);
      }
      cp_async_commit();
    }
    for (int ks = 0; ks < num_k; ++ks) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      const int next = ks + STAGES - 1;
      const bool has_next = next < num_k;
      if (has_next) issue_stage<C>(g, t, next, stages[next % STAGES], sr);
      cp_async_commit();
      const Stage& s = stages[ks % STAGES];
      // rows past the tile's valid ones are zeros: a warp (or m16 tile) with none skips its MMAs
      const bool warp_active = wm * 32 < t.rows;
      const bool m1_active = wm * 32 + 16 < t.rows;
#pragma unroll
      for (int kb = 0; kb < KB && warp_active; ++kb) {
        uint32_t af[2][4], bf[8][2];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int j = lane >> 3, i = lane & 7;
          const int row = wm * 32 + m * 16 + i + 8 * (j & 1);
          ldmatrix_x4(af[m], s.a + C::swz(row, 2 * kb + (j >> 1)));
        }
#pragma unroll
        for (int p = 0; p < 4; ++p) {  // n-tile pairs: gate 0-1, 2-3, then up 0-1, 2-3
          const int j = lane >> 3, i = lane & 7;
          const int nbase = (p < 2 ? 0 : BN) + wn * 32 + (p & 1) * 16;
          uint32_t r[4];
          ldmatrix_x4(r, s.b + C::swz(nbase + i + 8 * (j >> 1), 2 * kb + (j & 1)));
          bf[2 * p][0] = r[0], bf[2 * p][1] = r[1], bf[2 * p + 1][0] = r[2], bf[2 * p + 1][1] = r[3];
        }
        float sa[2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h) sa[m][h] = e8m0_to_f32(s.sa[wm * 32 + m * 16 + grp + 8 * h][kb]);
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const int col = (n < 4 ? 0 : BN) + wn * 32 + (n & 3) * 8 + tig * 2;
          const float sb0 = e8m0_to_f32(s.sb[col][kb]), sb1 = e8m0_to_f32(s.sb[col + 1][kb]);
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            if (m == 1 && !m1_active) continue;
            float d[4];
            mma_e4m3(d, af[m], bf[n]);
            acc[m][n][0] += d[0] * (sa[m][0] * sb0);
            acc[m][n][1] += d[1] * (sa[m][0] * sb1);
            acc[m][n][2] += d[2] * (sa[m][1] * sb0);
            acc[m][n][3] += d[3] * (sa[m][1] * sb1);
          }
        }
      }
      if (has_next) store_scales<C>(g, stages[next % STAGES], sr);
    }
    cp_async_wait<0>();

    // epilogue: this thread holds rows (grp, grp + 8) of each m16 tile, columns tig*2 + {0,1} of
    // each n8 tile; gate tile n pairs with up tile n + 4.
    const int64_t col0 = t.n0 + wn * 32;
    const bool cols_valid = col0 < g.I;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rloc = wm * 32 + m * 16 + grp + 8 * h;
        const bool valid = cols_valid && rloc < t.rows;
        const int64_t row = t.row0 + rloc;
        float v[4][2];
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            v[n][c] = swiglu(acc[m][n][2 * h + c], acc[m][n + 4][2 * h + c], g.has_limit, g.limit);
        store_block(g, row, col0, valid, v, tig);
      }
  }
}

using LaunchedCfg = Cfg<KB, 4>;  // the configuration launched

}  // namespace sm80

cudaError_t load_sm80_mma() {
  static std::atomic<uint64_t> loaded{0};
  return load_kernels_once(loaded, sm80::sm80_mma_kernel<sm80::LaunchedCfg>);
}

void launch_sm80_mma(const Gemm1Args& g, int grid, cudaStream_t stream) {
  using C = sm80::LaunchedCfg;
  auto kernel = sm80::sm80_mma_kernel<C>;
  // per call: the attribute belongs to the current device's context
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  kernel<<<grid, sm80::THREADS, C::kSmemBytes, stream>>>(g);
}

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
