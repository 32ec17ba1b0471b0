// Hopper (sm_90a) primitives of the warp-specialised GEMM1 kernel: wgmma (asynchronous warpgroup
// MMA from shared-memory descriptors), mbarriers and TMA tensor loads.
#pragma once

#include <cuda.h>  // CUtensorMap (the encoder is fetched from the driver at run time: launch.cu)
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/gemm1/common.cuh"  // smem_addr

namespace jsm {
namespace cuda {
namespace gemm1 {

// The warp-specialised CTA of the sm90 kernels: a producer warpgroup and two consumer warpgroups,
// one CTA per SM, so __launch_bounds__(kWsThreads, 1) gives each thread kWsLaunchRegs registers.
constexpr int kWsThreads = 384;
constexpr int kWsLaunchRegs = 65536 / kWsThreads / 8 * 8;

// Moves registers from the producer warpgroup to the consumers (setmaxnreg). The consumers'
// increase waits until the CTA's pool holds what it asks for, and the pool is the launch
// allocation: a split that overdraws it never completes (a hang, not an error).
template <int kProducerRegs, int kConsumerRegs>
struct WsRegisterSplit {
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 &&
                    kConsumerRegs <= 256,
                "setmaxnreg takes multiples of 8 in [24, 256]");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 2 * 128 <= kWsLaunchRegs * kWsThreads,
                "the split overdraws the CTA's registers: setmaxnreg.inc would wait forever");
  static __device__ __forceinline__ void producer() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
  }
  static __device__ __forceinline__ void consumer() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
  }
};

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 B apart.
__device__ __forceinline__ uint64_t smem_desc_addr(uint32_t addr) {
  return ((uint64_t(addr) & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

__device__ __forceinline__ uint64_t smem_desc(const void* p) { return smem_desc_addr(smem_addr(p)); }

// A shared-memory load by 32-bit shared address.
__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// wgmma operand lists. JSM_WGMMA_D<n> names the accumulator operands %0 .. %(n - 1) (n = N / 2
// floats per thread of an m64nN accumulator), JSM_WGMMA_IN<n> the five input operands after
// them (register-sourced A, B's descriptor), JSM_WGMMA_ACC<n> binds d[0 .. n - 1] to them.
#define JSM_WGMMA_D8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define JSM_WGMMA_D16 JSM_WGMMA_D8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define JSM_WGMMA_D24 JSM_WGMMA_D16 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define JSM_WGMMA_D32 JSM_WGMMA_D24 ", %24, %25, %26, %27, %28, %29, %30, %31"
#define JSM_WGMMA_D40 JSM_WGMMA_D32 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define JSM_WGMMA_D48 JSM_WGMMA_D40 ", %40, %41, %42, %43, %44, %45, %46, %47"
#define JSM_WGMMA_D56 JSM_WGMMA_D48 ", %48, %49, %50, %51, %52, %53, %54, %55"
#define JSM_WGMMA_D64 JSM_WGMMA_D56 ", %56, %57, %58, %59, %60, %61, %62, %63"
#define JSM_WGMMA_D76 JSM_WGMMA_D64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75"
#define JSM_WGMMA_D88 JSM_WGMMA_D76 ", %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87"
#define JSM_WGMMA_D100 JSM_WGMMA_D88 ", %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99"
#define JSM_WGMMA_D108 JSM_WGMMA_D100 ", %100, %101, %102, %103, %104, %105, %106, %107"
#define JSM_WGMMA_D116 JSM_WGMMA_D108 ", %108, %109, %110, %111, %112, %113, %114, %115"
#define JSM_WGMMA_D124 JSM_WGMMA_D116 ", %116, %117, %118, %119, %120, %121, %122, %123"
#define JSM_WGMMA_D128 JSM_WGMMA_D124 ", %124, %125, %126, %127"
#define JSM_WGMMA_IN16 "{%16, %17, %18, %19}, %20"
#define JSM_WGMMA_IN64 "{%64, %65, %66, %67}, %68"
#define JSM_WGMMA_IN76 "{%76, %77, %78, %79}, %80"
#define JSM_WGMMA_ACC4(i) "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
#define JSM_WGMMA_ACC16_AT(i) \
  JSM_WGMMA_ACC4(i), JSM_WGMMA_ACC4((i) + 4), JSM_WGMMA_ACC4((i) + 8), JSM_WGMMA_ACC4((i) + 12)
#define JSM_WGMMA_ACC64_AT(i) \
  JSM_WGMMA_ACC16_AT(i), JSM_WGMMA_ACC16_AT((i) + 16), JSM_WGMMA_ACC16_AT((i) + 32), \
      JSM_WGMMA_ACC16_AT((i) + 48)
#define JSM_WGMMA_ACC16 JSM_WGMMA_ACC16_AT(0)
#define JSM_WGMMA_ACC64 JSM_WGMMA_ACC64_AT(0)
#define JSM_WGMMA_ACC76 \
  JSM_WGMMA_ACC64, JSM_WGMMA_ACC4(64), JSM_WGMMA_ACC4(68), JSM_WGMMA_ACC4(72)
#define JSM_WGMMA_ACC128 JSM_WGMMA_ACC64, JSM_WGMMA_ACC64_AT(64)
// An m64nNk16 TYPE x TYPE += float32 wgmma (scale-d 1; TYPE bf16 or f16): D its accumulators'
// names, A the A operand's and B's descriptor's, TRANS the transpose flags after the scales
// (", 0, 0" with A from shared memory, ", 0" from registers).
#define JSM_WGMMA_16(N, TYPE, D, A, TRANS)                                          \
  "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n" #N   \
  "k16.f32." TYPE "." TYPE " {" D "}, " A ", p, 1, 1" TRANS ";\n}\n"
#define JSM_WGMMA_BF16(N, D, A, TRANS) JSM_WGMMA_16(N, "bf16", D, A, TRANS)

// d = A (64 x 32 e4m3, K-major) * B (128 x 32 e4m3, K-major)^T, a fresh float32 accumulator.
__device__ __forceinline__ void wgmma_m64n128k32(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" JSM_WGMMA_D64
               "}, %64, %65, p, 1, 1;\n}\n"
               : JSM_WGMMA_ACC64
               : "l"(desc_a), "l"(desc_b));
}

// d (64 x N float32) += A (64 x 16 bf16 from registers: each warp's 16 rows as the mma.m16n8k16
// A fragment) * B (N x 16 bf16, K-major in shared memory, `desc_b`)^T. d[4 j + 2 h + c] is row
// g + 8 h, B row 8 j + 2 tig + c. N: 128, 152 (a tile and a tail of up to 24) or 32. kF16: A and
// B f16, else bf16.
#define JSM_WGMMA_RS(N, n, TYPE)                                                  \
  asm volatile(JSM_WGMMA_16(N, TYPE, JSM_WGMMA_D##n, JSM_WGMMA_IN##n, ", 0")       \
               : JSM_WGMMA_ACC##n                                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
template <int N, bool kF16 = false>
__device__ __forceinline__ void wgmma_m64nk16_rs(float* d, const uint32_t (&a)[4],
                                                 uint64_t desc_b) {
  static_assert(N == 128 || N == 152 || N == 32, "the wgmma shapes wrapped here");
  static_assert(kF16 || N == 32, "the bf16 pass runs the small tile only (launch.cu)");
  if constexpr (N == 128) JSM_WGMMA_RS(128, 64, "f16");
  else if constexpr (N == 152) JSM_WGMMA_RS(152, 76, "f16");
  else if constexpr (kF16) JSM_WGMMA_RS(32, 16, "f16");
  else JSM_WGMMA_RS(32, 16, "bf16");
}

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
// The phase of b also waits for the completion of this thread's cp.async copies issued before
// (the pending count is raised now and lowered when they land: no change to b's arrival count).
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* b) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(smem_addr(b)) : "memory");
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

// A 3D map's box (launch.cu tensor_map's BoxParts: z the first part).
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int x, int y, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(x), "r"(y), "r"(z)
      : "memory");
}

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
