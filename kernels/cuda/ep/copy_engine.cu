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

// Engine ce, step 2: the host's bounded wait for every source's plan (one host synchronisation per
// call, like DeepEP's normal mode): this rank's counts size its copies, and the combine finds its
// runs there. The rank's own-rows kernel, on XLA's stream right after the plan's puts, waits for
// every plan on the device and publishes it to mapped pinned memory (me.h_plan, me.h_ready), which
// the host polls with no stream in between. A poll through a stream (a copy to the host, then a
// synchronisation) could sit behind work that waits for the peers: CUDA multiplexes a context's
// streams onto a few hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), so a copy on
// one stream may queue behind another stream's event record or kernel that waits for a running
// kernel, here the fused GEMM or the placement waiting for the peers' rows, which the peers send
// only after their own such poll: ranks whose streams met in one queue waited for each other
// until their timeout (the EP8 deadlock on one shared GPU; two processes: 1 run in 11).
// plan_stream_ns counts the time until the kernel started (this rank's route and qpack, the
// stream's earlier work); the rest is the peers. Bounded: the kernel's wait records its expiry
// (naming the peer); a kernel that never starts, or never finishes its wait, fails the call after
// the timeout too.
std::string ce_plan_wait(const WindowSet& w, LocalRank& me, uint32_t epoch,
                         std::chrono::steady_clock::time_point started) {
  (void)w;
  using Clock = std::chrono::steady_clock;
  const auto timeout = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(me.timeout_s));
  auto deadline = Clock::now() + timeout;
  volatile uint32_t* ready = me.h_ready;
  volatile cuda::EpError* e = me.err_host;
  bool kernel_started = false;
  for (int64_t polls = 0;; ++polls) {
    if (!kernel_started && cuda::epoch_reached(ready[0], epoch)) {
      kernel_started = true;
      me.stats->plan_stream_ns += elapsed_ns(started);
      trace(me.rank, "dispatch ce: own-rows kernel started", epoch);
      // from here the kernel's own bounded wait runs: give it its whole timeout to record
      // which peer is missing
      deadline = Clock::now() + timeout + std::chrono::seconds(1);
    }
    if (cuda::epoch_reached(ready[1], epoch)) break;
    if (e->code != 0) return describe(me);  // the kernel's wait expired (or an earlier one)
    if (Clock::now() > deadline) {
      trace(me.rank, "dispatch ce: plan wait expired", epoch,
            std::string(kernel_started ? "(kernel started) " : "(kernel not started) ") +
                std::to_string(polls) + " polls");
      if (e->code != 0) return describe(me);
      return "jax_sdma_moe dispatch (ce): rank " + std::to_string(me.rank) + " timed out after " +
             std::to_string(me.timeout_s) + " s waiting for " +
             (kernel_started ? "its own-rows kernel to publish the plan (epoch "
                             : "its own-rows kernel to start (the stream's earlier work; epoch ") +
             std::to_string(epoch) +
             "). The Runtime's windows are now out of step: create a new Runtime.";
    }
    std::this_thread::yield();  // (a sleep would add its ~50 us granularity to the GEMM's start)
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // the plan was written before ready[1]
  me.stats->calls += 1;
  me.stats->plan_ns += elapsed_ns(started);
  return "";
}

// The wait of the engine before this commit (JSM_EP_LEGACY_ORDER=1, diagnostics only): the plan
// read back through stream `st` by a copy and a synchronisation.
std::string ce_plan_wait_stream(cudaStream_t st, const WindowSet& w, LocalRank& me,
                                uint32_t epoch) {
  const int64_t R = w.g.R, EL = w.g.EL;
  const int p = int(epoch & 1);
  const EpWindowLayout& L = w.L;
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(me.timeout_s));
  int64_t polls = 0;
  for (bool first = true;; first = false, ++polls) {
    JSM_CUDA_TRY("dispatch ce plan wait",
                 cudaMemcpyAsync(me.h_flags, at<uint32_t>(me.own, L.plan_flag[p]), size_t(R) * 4,
                                 cudaMemcpyDeviceToHost, st));
    JSM_CUDA_TRY("dispatch ce plan wait", cudaStreamSynchronize(st));
    if (first) trace(me.rank, "dispatch ce (legacy): first plan poll back", epoch);
    int64_t missing = -1;
    for (int64_t s = 0; s < R && missing < 0; ++s)
      if (!cuda::epoch_reached(me.h_flags[s], epoch)) missing = s;
    if (missing < 0) break;
    if (Clock::now() > deadline) {
      volatile EpError* e = me.err_host;
      if (e->code == 0)
        e->peer = uint32_t(missing), e->expert = 0, e->epoch = epoch, e->code = 1;
      return describe(me);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(10));
  }
  JSM_CUDA_TRY("dispatch ce plan read",
               cudaMemcpyAsync(me.h_plan, at<int32_t>(me.own, L.plan[p]),
                               size_t(R * R * EL) * 4, cudaMemcpyDeviceToHost, st));
  JSM_CUDA_TRY("dispatch ce plan read", cudaStreamSynchronize(st));
  me.stats->calls += 1;
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
