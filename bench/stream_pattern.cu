// How fast can a persistent GEMM stream its weights from HBM, by access pattern? Each CTA of a
// persistent grid takes tiles of 128 weight rows (rows of H bytes, like w1) and reads them stage by
// stage into a ring of shared-memory buffers with cp.async: "rows" reads P bytes of each of the 128
// rows per stage (the K-major tile walk of gemm1), "blocked" reads the same 128 * P bytes as one
// contiguous block (a tile-major pre-packed weight layout).
// It includes no header of the library.
//   nvcc -O3 -arch=sm_90a -o /tmp/stream bench/stream_pattern.cu && /tmp/stream
//   (or: bash bench/device/weight_stream.sh)
#include <cstdio>
#include <cuda_runtime.h>
#include <stdint.h>

constexpr int ROWS = 128, THREADS = 256;
constexpr int64_t H = 7168, NROWS = 256 * 2048;  // 3.76 GB: half of dsv3's w1

__device__ __forceinline__ void cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                   uint32_t(__cvta_generic_to_shared(dst))), "l"(src));
}

template <int P, int D, bool kBlocked>
__global__ void __launch_bounds__(THREADS, 1) stream(const uint8_t* w, int64_t tiles) {
  extern __shared__ uint8_t smem[];
  constexpr int CH = P / 16, PER = ROWS * CH / THREADS, NK = int(H / P);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const uint8_t* base = w + t * ROWS * H;
    for (int k = 0; k < NK + D - 1; ++k) {
      if (k < NK) {
        uint8_t* buf = smem + (k % D) * ROWS * P;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          const int idx = threadIdx.x + THREADS * i, r = idx / CH, c = idx % CH;
          const uint8_t* src = kBlocked ? base + int64_t(k) * ROWS * P + int64_t(idx) * 16
                                        : base + r * H + int64_t(k) * P + c * 16;
          cp16(buf + idx * 16, src);
        }
      }
      asm volatile("cp.async.commit_group;\n");
      asm volatile("cp.async.wait_group %0;\n" ::"n"(D - 1));
      __syncthreads();
    }
  }
}

template <int P, int D, bool kBlocked>
void run(const uint8_t* w, int sms) {
  auto k = stream<P, D, kBlocked>;
  const int smem = D * ROWS * P;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  const int64_t tiles = NROWS / ROWS;
  k<<<sms, THREADS, smem>>>(w, tiles);
  cudaEventRecord(a);
  for (int i = 0; i < 5; ++i) k<<<sms, THREADS, smem>>>(w, tiles);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms;
  cudaEventElapsedTime(&ms, a, b);
  ms /= 5;
  printf("%-8s P=%4d B/row/stage, %d stages (%3d KB in flight): %6.3f ms, %5.0f GB/s  %s\n",
         kBlocked ? "blocked" : "rows", P, D, (D - 1) * ROWS * P / 1024, ms,
         NROWS * H / ms / 1e6, cudaGetErrorString(cudaGetLastError()));
}

int main() {
  uint8_t* w;
  cudaMalloc(&w, NROWS * H);
  cudaMemset(w, 1, NROWS * H);
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  run<64, 8, false>(w, sms);  // gemm1's stages: 64 bytes of each row (KS)
  run<64, 16, false>(w, sms);
  run<128, 4, false>(w, sms);
  run<128, 8, false>(w, sms);
  run<256, 4, false>(w, sms);
  run<512, 3, false>(w, sms);
  run<1024, 2, false>(w, sms);
  run<128, 4, true>(w, sms);
  run<128, 8, true>(w, sms);
  run<256, 4, true>(w, sms);
  run<128, 4, false>(w, 2 * sms);
  cudaFree(w);
  return 0;
}
