// Grouped MX-fp8 GEMM1 + SwiGLU, version 3 (EXPERIMENTAL, not yet run on a GPU; JSM_GEMM1=wgmma):
// the stages, tiles and scheduler of gemm1.cuh, but each warpgroup (64 rows) issues one
// asynchronous `wgmma.m64n128k32` per MX block straight from the swizzled shared-memory tiles (the
// 128-byte rows with chunk c at c ^ (row & 7) are the SW128 K-major layout), and the float32
// promotion of block k runs while the tensor cores compute block k + 1 (two staging accumulators).
#pragma once

#include "kernels/cuda/gemm1.cuh"

namespace jsm {
namespace cuda {
namespace gemm1_v3 {

using namespace gemm1_v1;
using C = Cfg<4, 4>;  // 128 B of K per row per stage: one SW128 atom row
constexpr int kAlign = 1024;  // SW128 atoms (8 rows x 128 B) must start 1024-byte aligned
constexpr int kSmemBytes = C::kSmemBytes + kAlign;
static_assert(sizeof(C::Stage) % kAlign == 0 && BM * C::KBYTES % kAlign == 0, "stage alignment");

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

// acc += d * sa[row] * sb[col] for this thread's 64 accumulators of MX block kb.
__device__ __forceinline__ void promote(float* acc, const float* d, const C::Stage& s, int kb,
                                        int row0, int tig) {
  const float sa0 = e8m0_to_f32(s.sa[row0][kb]), sa1 = e8m0_to_f32(s.sa[row0 + 8][kb]);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int col = (j < 8 ? 0 : BN) + (j & 7) * 8 + tig * 2;
    const float sb0 = e8m0_to_f32(s.sb[col][kb]), sb1 = e8m0_to_f32(s.sb[col + 1][kb]);
    acc[j * 4 + 0] += d[j * 4 + 0] * (sa0 * sb0);
    acc[j * 4 + 1] += d[j * 4 + 1] * (sa0 * sb1);
    acc[j * 4 + 2] += d[j * 4 + 2] * (sa1 * sb0);
    acc[j * 4 + 3] += d[j * 4 + 3] * (sa1 * sb1);
  }
}

__global__ void __launch_bounds__(THREADS, 1) gemm1_kernel(const Gemm1Args g) {
  extern __shared__ uint8_t smem_raw[];
  C::Stage* stages = reinterpret_cast<C::Stage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + kAlign - 1) & ~uintptr_t(kAlign - 1));
  __shared__ TileScheduler sched;
  sched.init(g);
  const int total = sched.total(g);
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int grp = lane >> 2, tig = lane & 3;
  const int row0 = wg * 64 + warp * 16 + grp;  // this thread's rows: row0, row0 + 8
  const int64_t HS = g.H / kBlock;
  const int num_k = int((HS + C::KB - 1) / C::KB);

  for (int w = blockIdx.x; w < total; w += gridDim.x) {
    const Tile t = sched.tile(g, w);
    const bool active = wg * 64 < t.rows;  // warpgroup-uniform

    float acc[64], da[64], db[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;

    __syncthreads();
    ScaleRegs<C> sr;
#pragma unroll
    for (int s = 0; s < C::STAGES - 1; ++s) {
      if (s < num_k) {
        issue_stage<C>(g, t, s, stages[s], sr);
        store_scales<C>(g, stages[s], sr);
      }
      cp_async_commit();
    }
    for (int ks = 0; ks < num_k; ++ks) {
      cp_async_wait<C::STAGES - 2>();
      fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads the async one
      __syncthreads();
      const int next = ks + C::STAGES - 1;
      const bool has_next = next < num_k;
      if (has_next) issue_stage<C>(g, t, next, stages[next % C::STAGES], sr);
      cp_async_commit();
      const C::Stage& s = stages[ks % C::STAGES];
      if (active) {
        const uint8_t* a = s.a + wg * 64 * C::KBYTES;
        wgmma_fence();
        wgmma_m64n128k32(da, smem_desc(a), smem_desc(s.b));
        wgmma_commit();
        wgmma_fence();
        wgmma_m64n128k32(db, smem_desc(a + 32), smem_desc(s.b + 32));
        wgmma_commit();
        wgmma_wait<1>();
        promote(acc, da, s, 0, row0, tig);
        wgmma_fence();
        wgmma_m64n128k32(da, smem_desc(a + 64), smem_desc(s.b + 64));
        wgmma_commit();
        wgmma_wait<1>();
        promote(acc, db, s, 1, row0, tig);
        wgmma_fence();
        wgmma_m64n128k32(db, smem_desc(a + 96), smem_desc(s.b + 96));
        wgmma_commit();
        wgmma_wait<1>();
        promote(acc, da, s, 2, row0, tig);
        wgmma_wait<0>();
        promote(acc, db, s, 3, row0, tig);
      }
      if (has_next) store_scales<C>(g, stages[next % C::STAGES], sr);
    }
    cp_async_wait<0>();

    // epilogue: rows row0 (+8), output columns n0 + j * 8 + tig * 2 + c: gate tile j, up tile j + 8
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
}

}  // namespace gemm1_v3
}  // namespace cuda
}  // namespace jsm
