// Stage2's kernels within one rank (launchers: gpu_stage2.h), one source for CUDA
// (kernels/cuda/stage2.cu) and HIP (kernels/rocm/stage2.hip).
#include "kernels/common/gpu_stage2.h"

#include <algorithm>

#include "kernels/common/gpu_layout.cuh"
#include "kernels/common/gpu_sum_slots.cuh"
#include "kernels/common/layout_check.h"

namespace jsm {
namespace gpu {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) index_rows(const CombineLocalArgs a) {
  const CombineView& in = a.in;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < in.m_cap;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (in.src_rank[i] < 0) continue;
    const int32_t t = in.token[i], k = in.slot[i];
    // A header outside this combine, or a second row for one (token, slot), is skipped, never
    // written out of bounds: jsm.stage2's check_layout call (launch_check_layout) names such a
    // layout and fails the program before this kernel runs.
    if (t < 0 || t >= in.T || k < 0 || k >= in.K) continue;
    atomicCAS(&a.row_of[int64_t(t) * in.K + k], -1, int32_t(i));
  }
}

// y[t, c .. c + 7] for t = blockIdx.x (tokens on x: up to 2^31 - 1), c = kSumCols * (blockIdx.y *
// kThreads + threadIdx.x)
__global__ void __launch_bounds__(kThreads) sum_rows(const CombineLocalArgs a) {
  const CombineView& in = a.in;
  const int64_t t = blockIdx.x, c = kSumCols * (int64_t(blockIdx.y) * kThreads + threadIdx.x);
  if (c >= in.H) return;
  sum_slots(in.K, [&](int64_t k, const uint16_t*& row, float& w) {
    const int32_t i = a.row_of[t * in.K + k];
    if (i < 0) return false;
    row = in.rows + int64_t(i) * in.H + c;
    w = in.weight[i];
    return true;
  }, in.y + t * in.H + c);
}

// One block per landed row: the row dequantised into shared memory (DESIGN §3: exact values in
// float32), then one wave per output column at a time, its lanes over K, a float32 sum across
// the wave.
__global__ void __launch_bounds__(kThreads) generic_gemm2(const Gemm2Rows g) {
  extern __shared__ float row[];  // [g.K]
  const int64_t r = blockIdx.x;
  const int e = g.EL > 0 ? expert_of_row(g.offsets, g.counts, g.EL, r) : -1;
  if (e < 0) return;  // padding: the caller zeroes it
  const int64_t K = g.K, KS = K / kBlock;
  for (int64_t k = threadIdx.x; k < K; k += kThreads)
    row[k] = e4m3fn_to_f32(g.a[r * K + k]) * e8m0_to_f32(g.a_scales[r * KS + k / kBlock]);
  __syncthreads();
  const int wave = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int64_t n = wave; n < g.N; n += kThreads / kWarp) {
    const int64_t w_row = int64_t(e) * g.N + n;
    const uint8_t* w = g.w + w_row * K;
    const uint8_t* ws = g.w_scales + w_row * KS;
    float acc = 0.0f;
    for (int64_t k = lane; k < K; k += kWarp)
      acc = fmaf(row[k], e4m3fn_to_f32(w[k]) * e8m0_to_f32(ws[k / kBlock]), acc);
    acc = wave_sum(acc);
    if (lane == 0) g.y[r * g.N + n] = f32_to_bf16(acc);
  }
}

// Every expert and row once (grid-stride over EL + m_cap places: experts first, then rows); the
// first fault (the least key: place, then rule) wins an atomicMax of the key's complement, and the
// last block to finish writes it out as a LayoutFault.
__global__ void __launch_bounds__(kThreads) check_layout_kernel(const CheckLayoutArgs a) {
  auto* best = reinterpret_cast<unsigned long long*>(a.words);  // ~key of the first fault; 0: none
  uint32_t* bits = a.words + kCheckLayoutHeaderWords;
  const int64_t places = a.EL + a.m_cap;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < places;
       p += int64_t(gridDim.x) * blockDim.x) {
    LayoutFault f;
    int32_t rule;
    if (p < a.EL) {
      rule = expert_fault(a.offsets, a.counts, p, a.m_cap, &f);
    } else {
      const int64_t i = p - a.EL;
      rule = row_fault(a.src_rank, a.token, a.slot, i, a.R, a.T, a.K, &f);
      if (rule == kLayoutOk && a.src_rank[i] >= 0) {
        const int64_t b = row_place(a.src_rank, a.token, a.slot, i, a.T, a.K);
        const uint32_t bit = 1u << (b % 32);
        if (atomicOr(bits + b / 32, bit) & bit) rule = kRowTwice;  // another row set it first
      }
    }
    if (rule != kLayoutOk) atomicMax(best, ~(static_cast<unsigned long long>(p) << 4 | rule));
  }
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(a.words + 2, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last || threadIdx.x != 0) return;
  const unsigned long long inv = atomicMax(best, 0ull);
  if (inv == 0) return;  // the fault's words stay zero: kLayoutOk
  const unsigned long long key = ~inv;
  const int64_t p = int64_t(key >> 4);
  LayoutFault f{int32_t(key & 15), 0, 0, 0};
  if (p < a.EL) {
    expert_fault(a.offsets, a.counts, p, a.m_cap, &f);
  } else if (f.rule != kRowTwice) {
    row_fault(a.src_rank, a.token, a.slot, p - a.EL, a.R, a.T, a.K, &f);
  } else {  // the first two rows (in index order) with the flagged row's place, as the host names
    const int64_t want = row_place(a.src_rank, a.token, a.slot, p - a.EL, a.T, a.K);
    int64_t first = -1;
    for (int64_t i = 0; i < a.m_cap; ++i) {
      LayoutFault g;
      if (a.src_rank[i] < 0 || row_fault(a.src_rank, a.token, a.slot, i, a.R, a.T, a.K, &g) ||
          row_place(a.src_rank, a.token, a.slot, i, a.T, a.K) != want)
        continue;
      if (first >= 0) {
        f = LayoutFault{kRowTwice, int32_t(i), a.token[i], int32_t(first)};
        break;
      }
      first = i;
    }
  }
  *reinterpret_cast<LayoutFault*>(a.words + kCheckLayoutFault) = f;
}

}  // namespace

void launch_check_layout(const CheckLayoutArgs& a, Stream stream) {
  memset_async(a.words, 0, size_t(check_layout_words(a.R, a.T, a.K)) * sizeof(uint32_t), stream);
  check_layout_kernel<<<unsigned(grid_for(a.EL + a.m_cap, kThreads)), kThreads, 0, stream>>>(a);
}

void launch_combine_local(const CombineLocalArgs& a, Stream stream) {
  const CombineView& in = a.in;
  if (in.T == 0) return;
  memset_async(a.row_of, 0xFF, size_t(in.T * in.K) * sizeof(int32_t), stream);
  if (in.m_cap > 0)
    index_rows<<<unsigned(std::min<int64_t>((in.m_cap + kThreads - 1) / kThreads, 1024)),
                 kThreads, 0, stream>>>(a);
  const dim3 grid(unsigned(in.T), unsigned((in.H / kSumCols + kThreads - 1) / kThreads));
  sum_rows<<<grid, kThreads, 0, stream>>>(a);
}

void launch_generic_gemm2(const Gemm2Rows& g, Stream stream) {
  if (g.m_cap == 0) return;
  const size_t smem = size_t(g.K) * sizeof(float);
  allow_dynamic_smem(generic_gemm2, smem);
  generic_gemm2<<<unsigned(g.m_cap), kThreads, smem, stream>>>(g);
}

}  // namespace gpu
}  // namespace jsm
