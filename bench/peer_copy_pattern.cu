// What does moving one dispatch's rows between two GPUs cost, by how it is cut? The same ~120 MB
// (dsv3, 4096 tokens/rank, R = 2: the half of 32768 rows of 7408 bytes that goes to the peer) is
// sent GPU0 -> GPU1 and GPU1 -> GPU0 at once, as N segments (N = 768: one per expert and array, as
// engine ce cuts them; N = 6: one per array and destination), by:
//   batch   cudaMemcpyBatchAsync calls of up to 128 copies each
//   single  N cudaMemcpyAsync calls
//   flags   batch in chunks of 48 copies, each chunk followed by a cuStreamWriteValue32 (a signal
//           per chunk, the peer's cue that the chunk has landed)
//   local   flags, but each GPU copies into its own landing buffer (engine ce's own segments: is a
//           copy within one GPU dearer to enqueue than a peer copy?)
//   sm/B/U  a copy kernel of B blocks x 512 threads, U 16-byte loads in flight per thread before
//           their stores (engine sm's copy loop: B = 24, U = 4; U = 1 shows what the unroll buys)
// Per line: GB/s per direction (max of the two directions' event times) and the host's time to
// enqueue one direction's work (engine ce pays it on XLA's thread every call).
// It includes two of the library's headers (so it measures the library's own copy loop):
// kernels/cuda/launch_util.h (driver_function) and kernels/cuda/ep/kernels.cuh (block_copy).
//   nvcc -O3 -std=c++17 -arch=sm_90a -I. -o /tmp/peer bench/peer_copy_pattern.cu && /tmp/peer
//   (or: bash bench/device/peer_copies.sh)
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/ep/kernels.cuh"  // block_copy: engine sm's copy loop
#include "kernels/cuda/launch_util.h"   // driver_function: the driver API without linking libcuda

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                       \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

constexpr int64_t kTotal = 16384LL * 7408;  // bytes each way

struct Segments {
  std::vector<int64_t> offset, bytes;  // the same offsets at source and destination
};

// n segments of nearly equal size (multiples of 16 bytes) covering kTotal.
Segments cut(int n) {
  Segments s;
  int64_t at = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t end = (kTotal * (i + 1) / n) / 16 * 16;
    s.offset.push_back(at);
    s.bytes.push_back(end - at);
    at = end;
  }
  return s;
}

template <int U>
__global__ void __launch_bounds__(512) copy_kernel(const int64_t* offset, const int64_t* bytes,
                                                    int n, const uint8_t* src, uint8_t* dst) {
  for (int q = blockIdx.x; q < n; q += gridDim.x) {
    jsm::cuda::block_copy<U>(dst + offset[q], src + offset[q], bytes[q]);
    __threadfence_system();  // as engine sm does before each segment's signal
  }
}

struct Side {  // one direction: device `dev` sends its buffer to the peer's
  int dev;
  uint8_t *src, *dst;  // dst lives on the peer
  uint8_t* local;      // this device's own landing buffer (mode local)
  cudaStream_t st;
  cudaEvent_t start, stop;
  int64_t *d_offset, *d_bytes;
  uint32_t* flag;  // on the peer
};

void put_batch(Side& s, const Segments& g, size_t first, size_t count) {
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<size_t> bytes;
  for (size_t i = first; i < first + count; ++i) {
    dst.push_back(s.dst + g.offset[i]);
    src.push_back(s.src + g.offset[i]);
    bytes.push_back(size_t(g.bytes[i]));
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  CHECK(cudaMemcpyBatchAsync(dst.data(), src.data(), bytes.data(), dst.size(), &attr, &attr_index,
                             1, s.st));
#else
  size_t fail = 0;
  CHECK(cudaMemcpyBatchAsync(dst.data(), const_cast<void**>(src.data()), bytes.data(), dst.size(),
                             &attr, &attr_index, 1, &fail, s.st));
#endif
}

enum Mode { kBatch, kSingle, kFlags, kLocal, kSm };

void issue(Side& peer, const Segments& g, Mode mode, int blocks, int unroll, uint32_t value) {
  Side local = peer;
  local.dst = peer.local;
  Side& s = mode == kLocal ? local : peer;
  const size_t n = g.offset.size();
  if (mode == kBatch) {
    for (size_t i = 0; i < n; i += 128) put_batch(s, g, i, std::min<size_t>(128, n - i));
  } else if (mode == kSingle) {
    for (size_t i = 0; i < n; ++i)
      CHECK(cudaMemcpyAsync(s.dst + g.offset[i], s.src + g.offset[i], size_t(g.bytes[i]),
                            cudaMemcpyDefault, s.st));
  } else if (mode == kFlags || mode == kLocal) {
    for (size_t i = 0; i < n; i += 48) {
      put_batch(s, g, i, std::min<size_t>(48, n - i));
      using WriteValue = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned);
      static const auto write_value =
          jsm::cuda::driver_function<WriteValue>("cuStreamWriteValue32");
      if (!write_value || write_value(reinterpret_cast<CUstream>(s.st), CUdeviceptr(s.flag),
                                      value, 0) != CUDA_SUCCESS) {
        std::fprintf(stderr, "cuStreamWriteValue32 failed\n");
        std::exit(1);
      }
    }
  } else if (unroll == 4) {
    copy_kernel<4><<<blocks, 512, 0, s.st>>>(s.d_offset, s.d_bytes, int(n), s.src, s.dst);
  } else {
    copy_kernel<1><<<blocks, 512, 0, s.st>>>(s.d_offset, s.d_bytes, int(n), s.src, s.dst);
  }
}

struct Timing {
  double ms, host_ms;  // device time (slower direction) and host time to enqueue one side's work
};

// Medians over reps of the slower direction's device time and of the host's enqueue time, in ms.
Timing measure(Side (&sides)[2], const Segments& g, Mode mode, int blocks, int unroll) {
  for (Side& s : sides) {
    CHECK(cudaSetDevice(s.dev));
    CHECK(cudaMemcpy(s.d_offset, g.offset.data(), g.offset.size() * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(s.d_bytes, g.bytes.data(), g.bytes.size() * 8, cudaMemcpyHostToDevice));
  }
  std::vector<double> ms, host_ms;
  for (int rep = 0; rep < 12; ++rep) {
    double host = 0;
    for (Side& s : sides) {
      CHECK(cudaSetDevice(s.dev));
      CHECK(cudaEventRecord(s.start, s.st));
      const auto t0 = std::chrono::steady_clock::now();
      issue(s, g, mode, blocks, unroll, uint32_t(rep + 1));
      host = std::max(host, std::chrono::duration<double, std::milli>(
                                std::chrono::steady_clock::now() - t0).count());
      CHECK(cudaEventRecord(s.stop, s.st));
    }
    double worst = 0;
    for (Side& s : sides) {
      CHECK(cudaSetDevice(s.dev));
      CHECK(cudaEventSynchronize(s.stop));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, s.start, s.stop));
      worst = std::max(worst, double(t));
    }
    if (rep >= 2) ms.push_back(worst), host_ms.push_back(host);  // two warm-up repetitions
  }
  std::sort(ms.begin(), ms.end());
  std::sort(host_ms.begin(), host_ms.end());
  return {ms[ms.size() / 2], host_ms[host_ms.size() / 2]};
}

int main() {
  int n_dev = 0;
  CHECK(cudaGetDeviceCount(&n_dev));
  if (n_dev < 2) {
    std::fprintf(stderr, "needs two GPUs\n");
    return 1;
  }
  Side sides[2];
  uint8_t* buf[2][2];  // [device][0: source, 1: landing]
  uint32_t* flags[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    cudaError_t e = cudaDeviceEnablePeerAccess(1 - d, 0);
    if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CHECK(e);
    cudaGetLastError();
    CHECK(cudaMalloc(&buf[d][0], kTotal));
    CHECK(cudaMalloc(&buf[d][1], kTotal));
    CHECK(cudaMemset(buf[d][0], d + 1, kTotal));
    CHECK(cudaMalloc(&flags[d], 4));
  }
  for (int d = 0; d < 2; ++d) {
    Side& s = sides[d];
    s.dev = d, s.src = buf[d][0], s.dst = buf[1 - d][1], s.flag = flags[1 - d];
    s.local = buf[d][1];
    CHECK(cudaSetDevice(d));
    CHECK(cudaStreamCreateWithFlags(&s.st, cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&s.start));
    CHECK(cudaEventCreate(&s.stop));
    CHECK(cudaMalloc(&s.d_offset, 1024 * 8));
    CHECK(cudaMalloc(&s.d_bytes, 1024 * 8));
  }
  std::printf("%-12s %6s %10s %9s %9s %9s\n", "how", "N", "seg KB", "ms", "GB/s", "host ms");
  struct Row {
    const char* name;
    Mode mode;
    int blocks, unroll;
  };
  const Row rows[] = {{"batch", kBatch, 0, 0},   {"single", kSingle, 0, 0},
                      {"flags", kFlags, 0, 0},   {"local", kLocal, 0, 0},
                      {"sm/24/U1", kSm, 24, 1},
                      {"sm/8/U4", kSm, 8, 4},    {"sm/12/U4", kSm, 12, 4},
                      {"sm/24/U4", kSm, 24, 4},  {"sm/64/U4", kSm, 64, 4},
                      {"sm/132/U4", kSm, 132, 4}};
  double best_gbps = 0;
  for (const Row& r : rows) {
    for (int n : {768, 256, 48, 6}) {
      const Segments g = cut(n);
      const Timing t = measure(sides, g, r.mode, r.blocks, r.unroll);
      const double gbps = kTotal / (t.ms * 1e6);
      best_gbps = std::max(best_gbps, gbps);
      std::printf("%-12s %6d %10.0f %9.3f %9.1f %9.3f\n", r.name, n, kTotal / 1024.0 / n, t.ms,
                  gbps, t.host_ms);
    }
  }
  std::printf("best %.1f GB/s per direction; a line's overhead per segment = (ms - %.3f) / N\n",
              best_gbps, kTotal / (best_gbps * 1e6));
  // the landed bytes of the last run are the source's
  std::vector<uint8_t> check(4096);
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(1 - d));
    CHECK(cudaMemcpy(check.data(), buf[1 - d][1] + kTotal - 4096, 4096, cudaMemcpyDeviceToHost));
    for (uint8_t b : check)
      if (b != d + 1) {
        std::printf("WRONG bytes landed from device %d\n", d);
        return 1;
      }
  }
  std::printf("landed bytes checked\n");
  return 0;
}
