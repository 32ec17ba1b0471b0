// What the tensor pipe of one H200 gives each wgmma form of gemm1's consumers, with no loads:
// every SM runs two consumer warpgroups over a fixed stage in shared memory (bf16 token rows, fp8
// weight rows), as sm90_mx_bf16_rs's consume_tile does (one wgmma group in flight while the next
// MX block's fragments are made; each block's weight bytes loaded, 8 bytes a row, two blocks
// ahead of its upcast), minus the TMA ring, its barriers and the epilogue. Forms:
//   rs128x2      gate and up rows (A from registers) x 128 tokens: two m64n128k16 per k16 step
//   rs256        64 rows (32 gate + 32 up) x 256 tokens: one m64n256k16 per k16 step
//   ss128x2, ss256  the same with A from shared memory (cuBLAS's form; the bf16 ceiling)
// each with the weights' upcast (fp8 from shared memory -> bf16 fragments, as upcast4; f16 ones
// as upcast4_f16, the default pass's) or without (the fragments reused), in bf16 or f16. The
// 16-bit operands hold e4m3 values (3 mantissa bits), as the GEMM's do: the tensor pipe's power,
// and so the clock under the board's cap, depends on the bits it multiplies. The A/B of the GEMM's
// tile shape and type: how much tensor rate and power the upcast costs at each width and type
// (docs/PERF.md §3), with the GEMM's own wgmma and upcast primitives.
// From the repository root (or: bash bench/device/wgmma_ceiling.sh):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I. -o /tmp/wgmma \
//     bench/wgmma_ceiling.cu && /tmp/wgmma [launches per form] [form number: that one only]
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/gemm1/mx_bf16.cuh"  // upcast4, factor_bf16x2: the GEMM's own
#include "kernels/cuda/gemm1/sm90.cuh"     // wgmma_*, lds64, smem_desc_addr

using namespace jsm::cuda::gemm1;
using sm90_bf16::upcast4;
using sm90_bf16::upcast4_f16;

constexpr int kThreads = 256, KS = 128;  // two consumer warpgroups; K per stage (fp8 bytes)

// The other forms' wrappers (sm90.cuh has the GEMM's: f16 from registers, up to m64n152k16), on
// sm90.cuh's operand lists.
template <bool kF16>
__device__ __forceinline__ void rs_m64n128k16(float* d, const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (kF16) JSM_WGMMA_RS(128, 64, "f16");  // sm90.cuh's, as wgmma_m64nk16_rs issues it
  else JSM_WGMMA_RS(128, 64, "bf16");
}
template <bool kF16>
__device__ __forceinline__ void ss_m64n128k16(float* d, uint64_t desc_a, uint64_t desc_b) {
  if constexpr (kF16)
    asm volatile(JSM_WGMMA_16(128, "f16", JSM_WGMMA_D64, "%64, %65", ", 0, 0")
                 : JSM_WGMMA_ACC64 : "l"(desc_a), "l"(desc_b));
  else
    asm volatile(JSM_WGMMA_BF16(128, JSM_WGMMA_D64, "%64, %65", ", 0, 0")
                 : JSM_WGMMA_ACC64 : "l"(desc_a), "l"(desc_b));
}
__device__ __forceinline__ void ss_m64n256k16(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(JSM_WGMMA_BF16(256, JSM_WGMMA_D128, "%128, %129", ", 0, 0")
               : JSM_WGMMA_ACC128 : "l"(desc_a), "l"(desc_b));
}
__device__ __forceinline__ void rs_m64n256k16(float* d, const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(JSM_WGMMA_BF16(256, JSM_WGMMA_D128, "{%128, %129, %130, %131}, %132", ", 0")
               : JSM_WGMMA_ACC128
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// f16: only the 128-token forms (the GEMM's)
template <int N, bool kRS, bool kF16>
__device__ __forceinline__ void mma(float* d, const uint32_t (&a)[4], uint64_t desc_a,
                                    uint64_t desc_b) {
  static_assert(N == 128 || !kF16, "f16 forms of m64n128k16 only");
  if constexpr (kRS) {
    if constexpr (N == 128) rs_m64n128k16<kF16>(d, a, desc_b);
    else rs_m64n256k16(d, a, desc_b);
  } else {
    if constexpr (N == 128) ss_m64n128k16<kF16>(d, desc_a, desc_b);
    else ss_m64n256k16(d, desc_a, desc_b);
  }
}

template <int M>
__device__ __forceinline__ void pin(float (&a)[M]) {
#pragma unroll
  for (int i = 0; i < M; ++i) asm volatile("" : "+f"(a[i])::"memory");
}
__device__ __forceinline__ void pin(uint32_t (&f)[2][2][4]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+r"((&f[0][0][0])[i])::"memory");
}

// Shared memory: the token rows (N x 128 bf16 as two 64-element halves), each warpgroup's A rows
// for ss (64 x 128 bf16 a part) and its fp8 weight rows (128 x 128 bytes).
template <int N>
struct Smem {
  alignas(1024) uint8_t x[N * 2 * KS];
  alignas(1024) uint8_t a[2][2][64 * 2 * KS];
  alignas(1024) uint8_t w[2][128 * KS];
};

// kParts wgmma per k16 step (gate, up) of N tokens each; `stages` stages of 4 MX blocks.
template <int N, int kParts, bool kRS, bool kUpcast, bool kF16>
__global__ void __launch_bounds__(kThreads, 1) run(int stages, float* sink) {
  extern __shared__ uint8_t raw[];
  Smem<N>& sh = *reinterpret_cast<Smem<N>*>(raw + ((1024 - (smem_addr(raw) & 1023)) & 1023));
  // fill: 16-bit values in [0.5, 1) with random signs and 3 random mantissa bits (e4m3 values,
  // as the GEMM's upcast ones); fp8 bytes avoiding NaN (0x7F/0xFF)
  uint32_t seed = 0x9E3779B9u * (threadIdx.x + 1) + blockIdx.x;
  for (int i = threadIdx.x; i < int(sizeof(Smem<N>)) / 4; i += blockDim.x) {
    seed = seed * 1664525u + 1013904223u;
    uint32_t v = kF16 ? (seed & 0x83808380u) | 0x38003800u : (seed & 0x80708070u) | 0x3F003F00u;
    if (i * 4 >= int(offsetof(Smem<N>, w))) v = seed & 0xBEBEBEBEu;
    reinterpret_cast<uint32_t*>(&sh)[i] = v;
  }
  __syncthreads();
  const int cw = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int row_g = warp * 16 + lane / 4, tig = lane % 4;
  float acc0[N / 2], acc1[kParts == 2 ? N / 2 : 1];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc0[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < (kParts == 2 ? N / 2 : 1); ++i) acc1[i] = 0.0f;
  uint32_t f[2][2][2][4];  // [f0/f1][part][k16 step][A register]
#pragma unroll
  for (int i = 0; i < 32; ++i) (&f[0][0][0][0])[i] = (kF16 ? 0x3A003A00u : 0x3F403F40u) ^ (i << 4);
  // a scale byte read at run time, as the GEMM's (a constant factor would fold into HMUL2)
  const uint32_t e = 126 + (*reinterpret_cast<volatile const uint8_t*>(sh.x) & 1);
  const uint32_t factor = kF16 ? sm90_bf16::factor_f16x2(e) : sm90_bf16::factor_bf16x2(e, false);
  const uint64_t b_desc = smem_desc_addr(smem_addr(sh.x));
  const uint32_t w_base = smem_addr(sh.w[cw]) + row_g * KS;
  // block lb's 8 bytes of rows row_g + 64 p + 8 h, as load_block reads them (the swizzled chunk
  // 2 tig + lb / 2, its half stage_half)
  auto load = [&](uint2 (&v)[2][2], int lb) {
    const uint32_t a = w_base + (((2 * tig + lb / 2) ^ (row_g & 7)) << 4) +
                       8 * sm90_bf16::stage_half(lb, tig);
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int h = 0; h < 2; ++h) v[p][h] = lds64(a + (p * 64 + 8 * h) * KS);
  };
  uint2 rv[2][2][2];  // [block % 2][part][h]
  for (int s = 0; s < stages; ++s) {
    if (kUpcast) load(rv[0], 0), load(rv[1], 1);
#pragma unroll
    for (int blk = 0; blk < 4; ++blk) {
      uint32_t (&fr)[2][2][4] = f[blk % 2];
      wgmma_wait<1>();
      pin(fr);
      if (kUpcast)
#pragma unroll
        for (int p = 0; p < kParts; ++p)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint2& v = rv[blk % 2][p][h];
            if constexpr (kF16) {
              upcast4_f16(v.x, factor, fr[p][0][h], fr[p][0][2 + h]);
              upcast4_f16(v.y, factor, fr[p][1][h], fr[p][1][2 + h]);
            } else {
              upcast4(v.x, factor, false, fr[p][0][h], fr[p][0][2 + h]);
              upcast4(v.y, factor, false, fr[p][1][h], fr[p][1][2 + h]);
            }
          }
      pin(fr);
      pin(acc0);
      pin(acc1);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const uint32_t off = ((blk / 2) * N * KS + (blk % 2) * 64 + k * 32) >> 4;
        const uint32_t a_off = ((blk / 2) * 64 * KS + (blk % 2) * 64 + k * 32) >> 4;
        const uint64_t a0 = smem_desc_addr(smem_addr(sh.a[cw][0])) + a_off;
        mma<N, kRS, kF16>(acc0, fr[0][k], a0, b_desc + off);
        if constexpr (kParts == 2) {
          const uint64_t a1 = smem_desc_addr(smem_addr(sh.a[cw][1])) + a_off;
          mma<N, kRS, kF16>(acc1, fr[1][k], a1, b_desc + off);
        }
      }
      wgmma_commit();
      pin(acc0);
      pin(acc1);
      if (kUpcast && blk + 2 < 4) load(rv[blk % 2], blk + 2);
    }
  }
  wgmma_wait<0>();
  float sum = acc1[0];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) sum += acc0[i];
  if (sum == 1.2345f) sink[blockIdx.x * kThreads + threadIdx.x] = sum;  // keeps the work
}

template <int N, int kParts, bool kRS, bool kUpcast, bool kF16 = false>
void time_form(const char* name, int sms, float* sink, int reps) {
  auto k = run<N, kParts, kRS, kUpcast, kF16>;
  const int smem = int(sizeof(Smem<N>)) + 1024;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int stages = 4000;
  k<<<sms, kThreads, smem>>>(stages / 10, sink);  // warm-up (and clocks)
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  float best = 1e30f;
  for (int rep = 0; rep < reps; ++rep) {
    cudaEventRecord(a);
    k<<<sms, kThreads, smem>>>(stages, sink);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    best = ms < best ? ms : best;
  }
  const cudaError_t e = cudaGetLastError();
  // per stage and warpgroup: 8 k16 steps x kParts wgmma of 64 x N x 16
  const double flop = 2.0 * 64 * N * 16 * 8 * kParts * stages * 2.0 * sms;
  printf("%-8s %-4s %-10s %8.3f ms %7.1f TFLOP/s  %s\n", name, kF16 ? "f16" : "bf16",
         kUpcast ? "upcast" : "no upcast", best, flop / best / 1e9,
         e == cudaSuccess ? "" : cudaGetErrorString(e));
}

// argv[1]: launches timed per form (default 5; more keep the tensor pipe busy for a clock
// reading); argv[2]: run only form number argv[2] (the order below), so that a clock and power
// reading taken meanwhile is that form's (wgmma_ceiling.sh). `--forms`: print how many forms
// there are (wgmma_ceiling.sh runs each by number), touching no GPU.
int main(int argc, char** argv) {
  void (*forms[])(const char*, int, float*, int) = {
      time_form<128, 2, true, true>,         time_form<128, 2, true, false>,
      time_form<128, 2, true, true, true>,   time_form<128, 2, true, false, true>,
      time_form<256, 1, true, true>,         time_form<256, 1, true, false>,
      time_form<128, 2, false, false>,       time_form<128, 2, false, false, true>,
      time_form<256, 1, false, false>};
  const char* names[] = {"rs128x2", "rs128x2", "rs128x2", "rs128x2", "rs256",
                         "rs256",   "ss128x2", "ss128x2", "ss256"};
  constexpr int n = sizeof(names) / sizeof(names[0]);
  static_assert(sizeof(forms) / sizeof(forms[0]) == n, "a name per form");
  if (argc > 1 && strcmp(argv[1], "--forms") == 0) {
    printf("%d\n", n);
    return 0;
  }
  const int reps = argc > 1 ? atoi(argv[1]) : 5;
  const int only = argc > 2 ? atoi(argv[2]) : -1;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink;
  cudaMalloc(&sink, sizeof(float) * sms * kThreads);
  if (only < 0)
    printf("form     type weights       time      rate (%d SMs, 2 consumer warpgroups each, no "
           "loads)\n", sms);
  for (int i = 0; i < n; ++i)
    if (only < 0 || only == i) forms[i](names[i], sms, sink, reps);
  return 0;
}
