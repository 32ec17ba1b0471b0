// Engine ce's host steps (the sequence that calls them: engine.cu). Everything that moves bytes
// between GPUs is a copy-engine operation: the plan (each source's counts) goes to every
// destination by a peer copy followed by a stream-ordered flag write (cuStreamBatchMemOp); the
// host then waits, bounded, for every source's plan (one host synchronisation per call, like
// DeepEP's normal mode; its own counts size the copies, the whole plan serves the combine), and
// enqueues each peer's rows as two copies (cudaMemcpyBatchAsync) into the peer's staging, then the
// write of its flag there; the peer's placement kernel puts them at their offsets. No SM touches
// a row in flight between GPUs.
#include "kernels/cuda/ep/copy_engine.h"

#include <cuda.h>  // CUstreamBatchMemOpParams (the function itself comes from the runtime)

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/launch_util.h"

namespace jsm {
namespace ep {

using cuda::EpError;
using cuda::EpWindowLayout;
using cuda::at;

namespace {

using BatchMemOpFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);

BatchMemOpFn batch_mem_op() {
  static BatchMemOpFn fn = cuda::driver_function<BatchMemOpFn>("cuStreamBatchMemOp");
  return fn;
}

// Stream-ordered 32-bit writes (each after everything before it on the stream, with a memory
// barrier: the default cuStreamWriteValue semantics).
std::string write_flags(cudaStream_t st, const std::vector<uint32_t*>& addrs, uint32_t value) {
  BatchMemOpFn fn = batch_mem_op();
  if (!fn) return "jax_sdma_moe dispatch (ce): cuStreamBatchMemOp is not available from the driver";
  for (size_t i = 0; i < addrs.size(); i += 128) {
    const size_t n = std::min<size_t>(128, addrs.size() - i);
    std::vector<CUstreamBatchMemOpParams> ops(n);
    std::memset(ops.data(), 0, n * sizeof(CUstreamBatchMemOpParams));
    for (size_t j = 0; j < n; ++j) {
      ops[j].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      ops[j].writeValue.address = reinterpret_cast<CUdeviceptr>(addrs[i + j]);
      ops[j].writeValue.value = value;
      ops[j].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
    const CUresult r = fn(reinterpret_cast<CUstream>(st), unsigned(n), ops.data(), 0);
    if (r != CUDA_SUCCESS)
      return "jax_sdma_moe dispatch (ce): cuStreamBatchMemOp failed (CUresult " +
             std::to_string(int(r)) + ")";
  }
  return "";
}

struct CopyBatch {
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<size_t> bytes;
  void add(void* d, const void* s, size_t n) {
    if (n == 0) return;
    dst.push_back(d);
    src.push_back(s);
    bytes.push_back(n);
  }
  void clear() { dst.clear(), src.clear(), bytes.clear(); }
};

// The batch on the copy engines, in stream order.
std::string put(CopyBatch& b, cudaStream_t st, RankStats& stats) {
  if (b.dst.empty()) return "";
  stats.copies += b.dst.size();
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  cudaError_t e = cudaMemcpyBatchAsync(b.dst.data(), b.src.data(), b.bytes.data(), b.dst.size(),
                                       &attr, &attr_index, 1, st);
#else
  size_t fail = 0;
  cudaError_t e = cudaMemcpyBatchAsync(b.dst.data(), const_cast<void**>(b.src.data()),
                                       b.bytes.data(), b.dst.size(), &attr, &attr_index, 1, &fail,
                                       st);
#endif
  if (e != cudaSuccess) {  // older drivers: one copy at a time
    cudaGetLastError();
    stats.batch_error = int(e);
    stats.single_copies += b.dst.size();
    for (size_t i = 0; i < b.dst.size(); ++i)
      JSM_CUDA_TRY("dispatch ce copy",
                   cudaMemcpyAsync(b.dst[i], b.src[i], b.bytes[i], cudaMemcpyDefault, st));
  }
  b.clear();
  return "";
}

}  // namespace

// Engine ce, step 1 of the protocol for rank `me`, on XLA's stream `st`: this rank's plan (its
// counts) to every destination by the copy engines, each followed by the write of its flag there.
std::string ce_plan_put(cudaStream_t st, const WindowSet& w, LocalRank& me, const cuda::EpArgs& a,
                        uint32_t epoch) {
  const int64_t R = w.g.R, EL = w.g.EL;
  const int p = int(epoch & 1), rank = me.rank;
  const EpWindowLayout& L = w.L;
  std::vector<uint32_t*> flags;
  for (int64_t d = 0; d < R; ++d) {
    JSM_CUDA_TRY("dispatch ce plan",
                 cudaMemcpyAsync(at<int32_t>(me.peers.base[d], L.plan[p]) + rank * R * EL,
                                 a.counts, size_t(R * EL) * 4, cudaMemcpyDefault, st));
    flags.push_back(at<uint32_t>(me.peers.base[d], L.plan_flag[p]) + rank);
  }
  return write_flags(st, flags, epoch);
}

// Engine ce, step 2: the host's wait for every source's plan (one host synchronisation per call,
// like DeepEP's normal mode): this rank's counts size its copies, and the combine finds its runs
// there. dispatch() calls it once XLA's stream `st` holds this call's steps up to the plan's wait
// (the puts, the own-rows kernel, the layout) and NOTHING that waits for the peers' rows: the fused
// GEMM, the placement's event and the read-out come after the peers' copies. It synchronises `st`:
// the own-rows kernel there has waited (bounded) for every plan and published it to mapped pinned
// memory (me.h_plan, then the epoch in *me.h_ready).
// Why this order: CUDA multiplexes a context's streams onto a few hardware queues
// (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), so work on one stream may queue behind another
// stream's event record or kernel launch that waits for a running kernel. Before, the host polled
// the plan by a copy on the side stream enqueued after the fused GEMM's launch and the GEMM's and
// the placement's event records, all waiting for the peers' rows, which the peers send only after
// their own poll: ranks whose streams met in one queue waited for each other until their timeout
// (the EP8 deadlock on one shared GPU; with CUDA_DEVICE_MAX_CONNECTIONS=1 every time, at R = 2).
// Bounded: every wait of the kernels on `st` is (an expired one is recorded, naming the peer).
std::string ce_plan_wait(cudaStream_t st, const WindowSet& w, LocalRank& me, uint32_t epoch,
                         std::chrono::steady_clock::time_point started) {
  (void)w;
  JSM_CUDA_TRY("dispatch ce plan wait", cudaStreamSynchronize(st));
  if (!cuda::epoch_reached(*static_cast<volatile uint32_t*>(me.h_ready), epoch)) {  // the kernel's wait for a plan expired
    const std::string err = describe(me);
    return err.empty() ? "jax_sdma_moe dispatch (ce): rank " + std::to_string(me.rank) +
                             " found no plan of epoch " + std::to_string(epoch) +
                             " after its own-rows kernel: the Runtime's windows are out of step; "
                             "create a new Runtime."
                       : err;
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // the plan was written before h_ready
  me.stats->calls += 1;
  me.stats->plan_ns += elapsed_ns(started);
  return "";
}

// Engine ce, step 3: each peer's rows in one piece, on the side stream after the fused GEMM's
// launch: the run of this rank's send buffer for that destination (send order: destination, then
// expert, then token) into the peer's staging region for this rank, its values and its meta rows
// (header + scales, made by dispatch() before the fork) as two copies, then the write of this
// rank's stage_flag there. The peer's placement kernel puts the rows at their offsets. So a call
// makes 2 (R - 1) copies whatever the experts. Needs only this rank's own counts of the plan.
// (The rank's own segments are stored by a kernel: engine.cu says why.)
std::string ce_peer_rows(cudaStream_t stream, const WindowSet& w, LocalRank& me,
                         const cuda::EpArgs& a, uint32_t epoch, cudaEvent_t after_first_peer) {
  const int64_t R = w.g.R, EL = w.g.EL, H = w.g.H, meta = cuda::ep_meta_stride(H);
  const int p = int(epoch & 1), rank = me.rank;
  const EpWindowLayout& L = w.L;
  const int32_t* counts = me.h_plan + int64_t(rank) * R * EL;  // this rank's [R dst][EL]
  const uint8_t* send_meta = at<uint8_t>(me.own, L.send_meta);
  const auto started = std::chrono::steady_clock::now();
  CopyBatch batch;
  for (int64_t j = 1; j < R; ++j) {
    const int64_t d = (rank + j) % R;
    int64_t from, n;  // d's run in the send buffer
    cuda::ep_send_run([&](int64_t i) { return counts[i]; }, EL, d, &from, &n);
    const int64_t region = cuda::ep_stage_index(rank, d) * w.g.send_rows;
    uint8_t* dst = me.peers.base[d];
    batch.add(at<uint8_t>(dst, L.stage_values[p]) + region * H, a.values + from * H,
              size_t(n * H));
    batch.add(at<uint8_t>(dst, L.stage_meta[p]) + region * meta, send_meta + from * meta,
              size_t(n * meta));
    std::string err = put(batch, stream, *me.stats);
    if (err.empty()) err = write_flags(stream, {at<uint32_t>(dst, L.stage_flag[p]) + rank}, epoch);
    if (!err.empty()) return err;
    if (after_first_peer) {
      JSM_CUDA_TRY("dispatch mark", cudaEventRecord(after_first_peer, stream));
      after_first_peer = nullptr;
    }
  }
  me.stats->enqueue_ns += elapsed_ns(started);
  return "";
}

// The combine (engine ce), after ep_return_gather_kernel: each peer's run of rows and stamps
// whole, from the return staging to the peer's send positions for this rank (its rows to the
// ranks before this one come first in its send order; the plan of this rank's latest dispatch,
// me.h_plan, gives both), then this rank's flag there; this rank's own rows are in place already
// (stream order: its flag after the gather).
std::string ce_return_rows(cudaStream_t st, const WindowSet& w, LocalRank& me, uint32_t epoch) {
  const int64_t R = w.g.R, EL = w.g.EL, H = w.g.H;
  const int q = int(epoch & 1), rank = me.rank;
  const EpWindowLayout& L = w.L;
  RankStats not_counted;  // the rank's statistics count the dispatch's copies only
  CopyBatch batch;
  for (int64_t j = 1; j <= R; ++j) {  // peers first, this rank's own flag last
    const int64_t s = (rank + j) % R;
    uint8_t* dst = me.peers.base[s];
    if (s != rank) {
      const int32_t* counts = me.h_plan + s * R * EL;  // s's [R dst][EL]
      int64_t start, n;
      cuda::ep_send_run([&](int64_t i) { return counts[i]; }, EL, rank, &start, &n);
      const int64_t from = cuda::ep_stage_index(s, rank) * w.g.send_rows;
      batch.add(at<uint16_t>(dst, L.ret_rows[q]) + start * H,
                at<uint16_t>(me.own, L.ret_stage_rows) + from * H, size_t(n * H) * 2);
      batch.add(at<ReturnMeta>(dst, L.ret_meta[q]) + start,
                at<ReturnMeta>(me.own, L.ret_stage_meta) + from, size_t(n) * sizeof(ReturnMeta));
    }
    std::string err = put(batch, st, not_counted);
    if (err.empty()) err = write_flags(st, {at<uint32_t>(dst, L.ret_flag[q]) + rank}, epoch);
    if (!err.empty()) return err;
  }
  return "";
}

}  // namespace ep
}  // namespace jsm
