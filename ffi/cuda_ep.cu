// Host side of the multi-GPU dispatch engines (protocol: kernels/cuda/ep_window.h).
//
// Engine `ce`: everything that moves bytes between GPUs is a copy-engine operation on XLA's stream.
// The plan (each source's counts) goes to every destination by a peer copy followed by a
// stream-ordered flag write (cuStreamBatchMemOp); the host then waits, bounded, for every source's
// plan (one host synchronisation per call, like DeepEP's normal mode), computes every segment's
// landing offset, and enqueues the rows as batched copies (cudaMemcpyBatchAsync), each chunk of
// experts followed by the write of its signals at the destination: its own rows on XLA's stream
// before the fused GEMM, the peers' on a side stream after it. No SM touches a row in flight.
// JSM_CE_OWN=kernel (opt-in, being measured): the own segments are stored by a kernel that waits
// for the plan on the device, so the GEMM is launched before the host's synchronisation, which
// then runs on the side stream while the GEMM waits for (and computes on) the first peers' rows.
// Engine `sm`: one kernel puts the plan, waits for the peers' plans and stores the rows itself
// (kernels/cuda/ep_dispatch.cuh); no host synchronisation.
// Both then run ep_rows_kernel, which waits (bounded) for every signal of this rank's slot.
#include "cuda_ep.h"

#include <cuda.h>  // CUstreamBatchMemOpParams (the function itself comes from the runtime)
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "cuda_launch.h"
#include "kernels/cpu/stage.h"  // segment_puts: the host's §4 offsets
#include "kernels/cuda/ep_dispatch.cuh"

namespace jsm {
namespace ep {
namespace {

using cuda::EpError;
using cuda::EpGeometry;
using cuda::EpWindowLayout;
using cuda::at;

constexpr int kFlagChunk = 16;  // experts per batch of copies before their signals (ce)
constexpr int64_t kMaxSegments = 4096;  // R * EL: the sm kernel keeps its segment table in smem

// Where a fused call's time goes on the device, from CUDA events on its two streams (read back at
// the rank's next call, once they have completed): the dispatch's start on XLA's stream; XLA's
// stream reaching the fused GEMM (every earlier step of the dispatch done: for ce the plan's host
// wait and the own copies) and leaving it; the side stream done (ce: the peers' copies; sm: its
// kernel); ce: the first chunk of peers' copies landed.
enum Mark { kStart, kGemmStart, kGemmEnd, kSideEnd, kFirstChunk, kMarks };

struct RankStats {  // written by the rank's calls, read by host_stats() from another thread
  std::atomic<uint64_t> calls{0}, plan_ns{0}, plan_stream_ns{0}, enqueue_ns{0}, own_enqueue_ns{0},
      own_copies{0};
  // row copies enqueued, those enqueued one at a time because cudaMemcpyBatchAsync refused the
  // batch, and its last refusal (a cudaError_t; 0: none)
  std::atomic<uint64_t> copies{0}, single_copies{0};
  std::atomic<int> batch_error{0};
  // the timeline: calls counted, and per mark (kGemmStart..) the total ns after kStart
  std::atomic<uint64_t> timed_calls{0}, first_chunk_calls{0}, mark_ns[kMarks]{};
};

struct LocalRank {
  int rank = -1, device = -1;
  std::shared_ptr<RankStats> stats = std::make_shared<RankStats>();
  uint8_t* own = nullptr;
  cuda::PeerTable peers{};
  std::vector<void*> opened;  // IPC-opened peer windows
  uint32_t epoch = 0;
  double timeout_s = 0;
  EpError* err_host = nullptr;  // mapped pinned memory
  EpError* err_dev = nullptr;
  uint32_t* h_flags = nullptr;  // pinned
  int32_t* h_plan = nullptr;    // pinned
  cudaStream_t side = nullptr;  // row copies (ce) or the sm kernel, beside XLA's stream
  cudaEvent_t fork = nullptr, join = nullptr;
  cudaEvent_t marks[kMarks] = {};
  bool marks_pending = false;  // the last call's marks, not yet read
};

struct WindowSet {
  int engine = 0, sm_blocks = 0;
  EpGeometry g{};
  EpWindowLayout L{};
  std::vector<LocalRank> local;
  bool connected = false;
};

std::mutex g_mu;
std::map<int64_t, std::shared_ptr<WindowSet>> g_sets;
int64_t g_next_id = 1;

uint64_t elapsed_ns(std::chrono::steady_clock::time_point since) {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - since)
                      .count());
}

std::string cuda_error(const std::string& what, cudaError_t e) {
  return "jax_sdma_moe (" + what + "): " + cudaGetErrorString(e);
}

#define JSM_CUDA_TRY(what, expr)                       \
  do {                                                 \
    cudaError_t _e = (expr);                           \
    if (_e != cudaSuccess) return cuda_error(what, _e); \
  } while (0)

struct DeviceGuard {
  int prev = 0;
  explicit DeviceGuard(int dev) {
    cudaGetDevice(&prev);
    cudaSetDevice(dev);
  }
  ~DeviceGuard() { cudaSetDevice(prev); }
};

std::shared_ptr<WindowSet> find_set(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_sets.find(id);
  return it == g_sets.end() ? nullptr : it->second;
}

LocalRank* local_rank(WindowSet& w, int64_t rank) {
  for (auto& l : w.local)
    if (l.rank == rank) return &l;
  return nullptr;
}

LocalRank* rank_on_current_device(WindowSet& w) {
  int dev = -1;
  cudaGetDevice(&dev);
  for (auto& l : w.local)
    if (l.device == dev) return &l;
  return nullptr;
}

std::string describe(const LocalRank& me) {
  volatile EpError* v = me.err_host;  // the code is written last (after a system fence)
  const EpError e{v->code, v->peer, v->expert, v->epoch};
  if (e.code == 0) return "";
  const std::string what = e.code == 1 ? "the plan (send counts)"
                                       : "the rows of local expert " + std::to_string(e.expert);
  return "jax_sdma_moe dispatch: rank " + std::to_string(me.rank) + " timed out after " +
         std::to_string(me.timeout_s) + " s waiting for " + what + " from peer rank " +
         std::to_string(e.peer) + " (epoch " + std::to_string(e.epoch) +
         "); the peer did not arrive. The Runtime's windows are now out of step: create a new "
         "Runtime.";
}

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

void free_rank(LocalRank& l) {
  DeviceGuard guard(l.device);
  cudaDeviceSynchronize();
  for (void* p : l.opened) cudaIpcCloseMemHandle(p);
  if (l.own) cudaFree(l.own);
  if (l.err_host) cudaFreeHost(l.err_host);
  if (l.h_flags) cudaFreeHost(l.h_flags);
  if (l.h_plan) cudaFreeHost(l.h_plan);
  if (l.side) cudaStreamDestroy(l.side);
  if (l.fork) cudaEventDestroy(l.fork);
  for (cudaEvent_t ev : l.marks)
    if (ev) cudaEventDestroy(ev);
  if (l.join) cudaEventDestroy(l.join);
  l = LocalRank{};
}

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

// Engine ce, step 2: every source's plan read back to the host (me.h_plan) through stream `st`;
// the host waits for it, bounded (one host synchronisation per call, like DeepEP's normal mode),
// then computes where this rank's segments land (`puts`). The first poll also waits for what `st`
// holds before it (XLA's stream: this rank's route and qpack; the side stream: the fork), counted
// apart as plan_stream_ns; the rest is the peers.
std::string ce_plan_wait(cudaStream_t st, const WindowSet& w, LocalRank& me, uint32_t epoch,
                         const DispatchOptions& opt, std::chrono::steady_clock::time_point started,
                         std::vector<SegmentPut>& puts) {
  const int64_t R = w.g.R, EL = w.g.EL;
  const int p = int(epoch & 1);
  const EpWindowLayout& L = w.L;
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(opt.timeout_s));
  for (bool first = true;; first = false) {
    JSM_CUDA_TRY("dispatch ce plan wait",
                 cudaMemcpyAsync(me.h_flags, at<uint32_t>(me.own, L.plan_flag[p]), size_t(R) * 4,
                                 cudaMemcpyDeviceToHost, st));
    JSM_CUDA_TRY("dispatch ce plan wait", cudaStreamSynchronize(st));
    if (first) me.stats->plan_stream_ns += elapsed_ns(started);
    int64_t missing = -1;
    for (int64_t s = 0; s < R && missing < 0; ++s)
      if (!cuda::epoch_reached(me.h_flags[s], epoch)) missing = s;
    if (missing < 0) break;
    if (Clock::now() > deadline) {
      volatile EpError* e = me.err_host;
      e->peer = uint32_t(missing), e->expert = 0, e->epoch = epoch, e->code = 1;
      return describe(me);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(10));
  }
  JSM_CUDA_TRY("dispatch ce plan read",
               cudaMemcpyAsync(me.h_plan, at<int32_t>(me.own, L.plan[p]),
                               size_t(R * R * EL) * 4, cudaMemcpyDeviceToHost, st));
  JSM_CUDA_TRY("dispatch ce plan read", cudaStreamSynchronize(st));
  puts = segment_puts(me.h_plan, R, EL, me.rank, opt.row_align, w.g.m_cap);
  me.stats->calls += 1;
  me.stats->plan_ns += elapsed_ns(started);
  return "";
}

// The previous call's timeline into the statistics, if its events have completed (not when calls
// are enqueued faster than they run: that call is then not counted). first_chunk: engine ce,
// whose calls mark their first chunk of peer copies.
void read_marks(LocalRank& l, bool first_chunk) {
  if (!l.marks_pending) return;
  l.marks_pending = false;
  float ms[kMarks] = {};
  for (int m = kGemmStart; m < kMarks; ++m) {
    if (m == kFirstChunk && !first_chunk) continue;
    if (cudaEventElapsedTime(&ms[m], l.marks[kStart], l.marks[m]) != cudaSuccess) {
      cudaGetLastError();  // cudaErrorNotReady: still running
      return;
    }
  }
  l.stats->timed_calls += 1;
  if (first_chunk) l.stats->first_chunk_calls += 1;
  for (int m = kGemmStart; m < kMarks; ++m)
    l.stats->mark_ns[m] += uint64_t(std::max(0.0f, ms[m]) * 1e6f);
}

// Engine ce: the rank's own segments (a copy within its GPU) stored by a kernel that waits for the
// plan on the device (JSM_CE_OWN=kernel), instead of copies the host enqueues once it knows the
// plan (default). Read per call: benchmarks switch it in-process.
bool ce_own_rows_by_kernel() {
  const char* env = getenv("JSM_CE_OWN");
  return env && std::string(env) == "kernel";
}

// Engine ce, step 3: the rows and their headers (made by dispatch() before the fork), put where
// `puts` says (ce_plan_wait), to the destinations `peers` selects: this
// rank's own segments (peers = false) on XLA's stream before the fused GEMM's launch, the peers'
// (peers = true) on the side stream after it. A copy within one GPU may run as a driver kernel,
// which a persistent GEMM holding every SM (and waiting for these very rows) would never let
// start (measured: dsv3 hung until the timeout).
std::string ce_rows(cudaStream_t stream, const WindowSet& w, LocalRank& me, const cuda::EpArgs& a,
                    uint32_t epoch, const std::vector<SegmentPut>& puts, bool peers,
                    cudaEvent_t after_first_chunk = nullptr) {
  const int64_t R = w.g.R, EL = w.g.EL, H = w.g.H, HS = H / kBlock;
  const int p = int(epoch & 1), rank = me.rank;
  const EpWindowLayout& L = w.L;
  const cuda::RowHeader* headers = at<cuda::RowHeader>(me.own, L.send_headers);
  const auto started = std::chrono::steady_clock::now();
  std::vector<uint32_t*> flags;
  const uint64_t copies_before = me.stats->copies;
  // segments in chunks of experts, each chunk to every destination then its signals: every
  // rank's fused GEMM can start on its first experts while later ones move
  CopyBatch batch;
  for (int64_t e0 = 0; e0 < EL; e0 += kFlagChunk) {
    for (int64_t j = peers ? 1 : R; j <= (peers ? R - 1 : R); ++j) {
      const int64_t d = (rank + j) % R;
      uint8_t* dst = me.peers.base[d];
      flags.clear();
      for (int64_t e = e0; e < std::min<int64_t>(EL, e0 + kFlagChunk); ++e) {
        const SegmentPut& q = puts[size_t(d * EL + e)];
        batch.add(at<uint8_t>(dst, L.values[p]) + q.base * H, a.values + q.from * H,
                  size_t(q.keep * H));
        batch.add(at<uint8_t>(dst, L.scales[p]) + q.base * HS, a.scales + q.from * HS,
                  size_t(q.keep * HS));
        batch.add(at<cuda::RowHeader>(dst, L.headers[p]) + q.base, headers + q.from,
                  size_t(q.keep) * sizeof(cuda::RowHeader));
        flags.push_back(at<uint32_t>(dst, L.seg_flag[p]) + e * R + rank);
      }
      std::string err = put(batch, stream, *me.stats);
      if (err.empty()) err = write_flags(stream, flags, epoch);
      if (!err.empty()) return err;
      if (after_first_chunk) {
        JSM_CUDA_TRY("dispatch mark", cudaEventRecord(after_first_chunk, stream));
        after_first_chunk = nullptr;
      }
    }
  }
  const uint64_t ns = elapsed_ns(started);
  me.stats->enqueue_ns += ns;
  if (!peers) {
    me.stats->own_enqueue_ns += ns;
    me.stats->own_copies += me.stats->copies - copies_before;
  }
  return "";
}

}  // namespace

int64_t windows_create(int engine, int sm_blocks, const EpGeometry& g,
                       const std::vector<int64_t>& ranks, const std::vector<int64_t>& devices,
                       std::string* err) {
  const int64_t R = g.R;
  if (R < 2 || R > cuda::kMaxRanks) {
    *err = "jax_sdma_moe: the ce/sm engines need 2 to " + std::to_string(cuda::kMaxRanks) +
           " ranks, got " + std::to_string(R);
    return 0;
  }
  if (R * g.EL > kMaxSegments) {
    *err = "jax_sdma_moe: ranks x local experts = " + std::to_string(R * g.EL) + " exceeds " +
           std::to_string(kMaxSegments) + " (the sm engine's segment table)";
    return 0;
  }
  if (ranks.size() != devices.size()) {
    *err = "jax_sdma_moe: ranks and devices differ in length";
    return 0;
  }
  auto w = std::make_shared<WindowSet>();
  w->engine = engine, w->sm_blocks = sm_blocks, w->g = g;
  w->L = cuda::ep_window_layout(g);
  for (size_t i = 0; i < ranks.size(); ++i) {
    LocalRank l;
    l.rank = int(ranks[i]), l.device = int(devices[i]);
    DeviceGuard guard(l.device);
    cudaError_t e = cudaMalloc(&l.own, size_t(w->L.bytes));
    if (e == cudaSuccess) e = cudaMemset(l.own, 0, size_t(w->L.bytes));
    if (e == cudaSuccess)
      e = cudaHostAlloc(&l.err_host, sizeof(EpError), cudaHostAllocMapped | cudaHostAllocPortable);
    if (e == cudaSuccess) std::memset(l.err_host, 0, sizeof(EpError));
    if (e == cudaSuccess) e = cudaHostGetDevicePointer(&l.err_dev, l.err_host, 0);
    if (e == cudaSuccess) e = cudaMallocHost(&l.h_flags, size_t(R) * 4);
    if (e == cudaSuccess) e = cudaMallocHost(&l.h_plan, size_t(R * R * g.EL) * 4);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&l.side, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&l.fork, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&l.join, cudaEventDisableTiming);
    for (cudaEvent_t& ev : l.marks)
      if (e == cudaSuccess) e = cudaEventCreate(&ev);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    l.peers.base[l.rank] = l.own;
    w->local.push_back(l);
    if (e != cudaSuccess) {
      *err = cuda_error("window of rank " + std::to_string(l.rank) + " (" +
                            std::to_string(w->L.bytes) + " bytes on device " +
                            std::to_string(l.device) + ")",
                        e);
      for (auto& made : w->local) free_rank(made);
      return 0;
    }
  }
  std::lock_guard<std::mutex> lock(g_mu);
  const int64_t id = g_next_id++;
  g_sets[id] = w;
  return id;
}

std::string windows_connect_local(int64_t id) {
  auto w = find_set(id);
  if (!w) return "jax_sdma_moe: unknown window set";
  if (int64_t(w->local.size()) != w->g.R) return "jax_sdma_moe: not every rank is in this process";
  for (auto& a : w->local) {
    DeviceGuard guard(a.device);
    for (auto& b : w->local) {
      a.peers.base[b.rank] = b.own;
      if (a.device == b.device) continue;
      int can = 0;
      JSM_CUDA_TRY("peer access", cudaDeviceCanAccessPeer(&can, a.device, b.device));
      if (!can)
        return "jax_sdma_moe: device " + std::to_string(a.device) + " cannot access device " +
               std::to_string(b.device) + " (no peer access): use engine 'xla'";
      cudaError_t e = cudaDeviceEnablePeerAccess(b.device, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled)
        cudaGetLastError();
      else if (e != cudaSuccess)
        return cuda_error("peer access", e);
    }
  }
  w->connected = true;
  return "";
}

std::string window_ipc_handle(int64_t id, int64_t rank, std::string* handle) {
  auto w = find_set(id);
  LocalRank* me = w ? local_rank(*w, rank) : nullptr;
  if (!me) return "jax_sdma_moe: rank " + std::to_string(rank) + " has no window here";
  DeviceGuard guard(me->device);
  cudaIpcMemHandle_t h;
  JSM_CUDA_TRY("IPC handle", cudaIpcGetMemHandle(&h, me->own));
  handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  return "";
}

std::string windows_open(int64_t id, int64_t rank, const std::vector<std::string>& handles) {
  auto w = find_set(id);
  LocalRank* me = w ? local_rank(*w, rank) : nullptr;
  if (!me) return "jax_sdma_moe: rank " + std::to_string(rank) + " has no window here";
  if (int64_t(handles.size()) != w->g.R) return "jax_sdma_moe: one IPC handle per rank expected";
  DeviceGuard guard(me->device);
  for (int64_t s = 0; s < w->g.R; ++s) {
    if (s == rank) continue;
    if (handles[size_t(s)].size() != sizeof(cudaIpcMemHandle_t))
      return "jax_sdma_moe: malformed IPC handle from rank " + std::to_string(s);
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[size_t(s)].data(), sizeof(h));
    void* p = nullptr;
    JSM_CUDA_TRY("opening the window of rank " + std::to_string(s),
                 cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    me->opened.push_back(p);
    me->peers.base[s] = static_cast<uint8_t*>(p);
  }
  w->connected = true;
  return "";
}

void windows_destroy(int64_t id) {
  std::shared_ptr<WindowSet> w;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_sets.find(id);
    if (it == g_sets.end()) return;
    w = it->second;
    g_sets.erase(it);
  }
  for (auto& l : w->local) free_rank(l);
}

std::string error_message(int64_t id) {
  auto w = find_set(id);
  if (!w) return "";
  for (auto& l : w->local) {
    std::string m = describe(l);
    if (!m.empty()) return m;
  }
  return "";
}

std::vector<HostStats> host_stats(int64_t id) {
  std::vector<HostStats> out;
  auto w = find_set(id);
  if (!w) return out;
  for (auto& l : w->local)
    out.push_back(HostStats{l.rank, l.stats->calls.load(), l.stats->plan_ns.load() * 1e-3,
                            l.stats->plan_stream_ns.load() * 1e-3,
                            l.stats->enqueue_ns.load() * 1e-3,
                            l.stats->own_enqueue_ns.load() * 1e-3, l.stats->copies.load(),
                            l.stats->single_copies.load(), l.stats->own_copies.load(),
                            l.stats->batch_error ? cudaGetErrorName(cudaError_t(
                                                       l.stats->batch_error.load()))
                                                 : "",
                            l.stats->timed_calls.load(), l.stats->first_chunk_calls.load(),
                            l.stats->mark_ns[kGemmStart].load() * 1e-3,
                            l.stats->mark_ns[kGemmEnd].load() * 1e-3,
                            l.stats->mark_ns[kSideEnd].load() * 1e-3,
                            l.stats->mark_ns[kFirstChunk].load() * 1e-3});
  return out;
}

std::string dispatch(void* stream, int64_t id, const EpGeometry& g, const SendView& send,
                     const LandedView& out, const DispatchOptions& opt, GemmLaunch gemm,
                     void* gemm_ctx) {
  auto w = find_set(id);
  if (!w) return "jax_sdma_moe dispatch: unknown or closed Runtime window set (" +
                 std::to_string(id) + ")";
  if (!w->connected) return "jax_sdma_moe dispatch: the Runtime's windows are not connected";
  if (g.R != w->g.R || g.EL != w->g.EL || g.H != w->g.H || g.m_cap != w->g.m_cap ||
      g.send_rows != w->g.send_rows)
    return "jax_sdma_moe dispatch: the call's shapes differ from its window set's";
  LocalRank* me = rank_on_current_device(*w);
  if (!me) return "jax_sdma_moe dispatch: no rank of this Runtime lives on the current device";
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture);
  if (capture != cudaStreamCaptureStatusNone && w->engine != kSmEngine)
    return "jax_sdma_moe dispatch: engine 'ce' synchronises with the host in every call and "
           "cannot run inside a CUDA graph; use engine 'sm' there";
  me->timeout_s = opt.timeout_s;
  read_marks(*me, w->engine == kCopyEngine);
  std::string err = describe(*me);
  if (!err.empty()) return err;
  cudaStream_t st = static_cast<cudaStream_t>(stream);

  cuda::EpArgs a{};
  a.peers = me->peers, a.L = w->L, a.g = w->g, a.rank = me->rank;
  uint32_t* epoch_counter = at<uint32_t>(me->own, w->L.epoch_counter);
  a.epoch_counter = epoch_counter;
  a.row_align = opt.row_align;
  a.timeout_ns = uint64_t(opt.timeout_s * 1e9);
  a.err = me->err_dev;
  a.counts = send.counts, a.values = send.values, a.scales = send.scales;
  a.token = send.token, a.slot = send.slot, a.weight = send.weight;
  const bool absent = opt.fault_absent_rank == me->rank;
  int busy_sms = 0;  // SMs the fused GEMM leaves to the dispatch
  std::vector<SegmentPut> puts;  // engine ce: where this rank's segments land
  const bool own_kernel = w->engine == kCopyEngine && ce_own_rows_by_kernel();
  // the timeline of fused calls outside CUDA graphs (whose replays never come back here)
  const bool timed = !absent && gemm && capture == cudaStreamCaptureStatusNone;
  auto mark = [&](Mark m, cudaStream_t s) -> cudaError_t {
    return timed ? cudaEventRecord(me->marks[m], s) : cudaSuccess;
  };
  std::chrono::steady_clock::time_point started;  // engine ce's plan statistics
  if (!absent) {
    if (opt.fault_delay_rank == me->rank)
      std::this_thread::sleep_for(std::chrono::milliseconds(opt.fault_delay_ms));
    started = std::chrono::steady_clock::now();
    // the epoch on the device (kernels read it there, also in a replayed CUDA graph); the host's
    // count runs in step for the ce engine's host-side steps (that engine is never captured)
    JSM_CUDA_TRY("dispatch mark", mark(kStart, st));
    cuda::ep_begin_kernel<<<1, 1, 0, st>>>(epoch_counter);
    JSM_CUDA_TRY("dispatch begin", cudaGetLastError());
    const uint32_t epoch = ++me->epoch;
    if (w->engine == kCopyEngine && w->g.send_rows > 0) {
      // the outgoing headers, on XLA's stream before the fork: a kernel on the side stream could
      // find every SM taken by the fused GEMM, which waits for these very rows
      cuda::ep_headers_kernel<<<cuda::grid_for(w->g.send_rows, 256), 256, 0, st>>>(
          a.token, a.slot, a.weight, w->g.send_rows, me->rank,
          at<cuda::RowHeader>(me->own, w->L.send_headers));
      JSM_CUDA_TRY("dispatch ce headers", cudaGetLastError());
    }
    JSM_CUDA_TRY("dispatch fork", cudaEventRecord(me->fork, st));
    JSM_CUDA_TRY("dispatch fork", cudaStreamWaitEvent(me->side, me->fork, 0));
    const int smem = int(cuda::SegmentTable::bytes(w->g.R, w->g.EL));
    if (w->engine == kSmEngine || own_kernel)
      JSM_CUDA_TRY("dispatch sm",
                   cudaFuncSetAttribute(cuda::ep_sm_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    if (w->engine == kSmEngine) {
      busy_sms = std::min(w->sm_blocks, cuda::num_sms() - 1);
      cuda::ep_sm_kernel<<<busy_sms, 512, smem, me->side>>>(a, /*own_only=*/false);
      JSM_CUDA_TRY("dispatch sm", cudaGetLastError());
    } else {
      err = ce_plan_put(st, *w, *me, a, epoch);
      if (err.empty() && own_kernel) {  // the GEMM's launch waits for no host step
        cuda::ep_sm_kernel<<<std::min<int64_t>(w->g.EL, cuda::num_sms()), 512, smem, st>>>(
            a, /*own_only=*/true);
        JSM_CUDA_TRY("dispatch ce own rows", cudaGetLastError());
      } else if (err.empty()) {
        err = ce_plan_wait(st, *w, *me, epoch, opt, started, puts);
        if (err.empty()) err = ce_rows(st, *w, *me, a, epoch, puts, /*peers=*/false);
      }
      if (!err.empty()) return err;
      busy_sms = 1;  // left to the driver (a peer copy's kernel, if it uses one), not the GEMM
    }
  }
  const int64_t EL = w->g.EL;
  cuda::ep_layout_kernel<<<1, 256, int(3 * EL + 1) * 4, st>>>(a, out, absent);
  JSM_CUDA_TRY("dispatch layout", cudaGetLastError());
  if (gemm) {
    const EpWindowLayout& L = w->L;
    SlotView slot{{at<uint8_t>(me->own, L.values[0]), at<uint8_t>(me->own, L.values[1])},
                  {at<uint8_t>(me->own, L.scales[0]), at<uint8_t>(me->own, L.scales[1])},
                  {at<uint32_t>(me->own, L.seg_flag[0]), at<uint32_t>(me->own, L.seg_flag[1])},
                  absent ? nullptr : epoch_counter,
                  int(w->g.R),
                  a.timeout_ns,
                  me->err_dev,
                  cuda::num_sms() - busy_sms};
    JSM_CUDA_TRY("dispatch mark", mark(kGemmStart, st));
    err = gemm(slot, st, gemm_ctx);
    if (!err.empty()) return err;
    JSM_CUDA_TRY("dispatch mark", mark(kGemmEnd, st));
  }
  if (w->engine == kCopyEngine && !absent) {
    if (own_kernel) {  // the plan, on the side stream: XLA's now holds the GEMM
      err = ce_plan_wait(me->side, *w, *me, me->epoch, opt, started, puts);
      if (!err.empty()) return err;
    }
    err = ce_rows(me->side, *w, *me, a, me->epoch, puts, /*peers=*/true,
                  timed ? me->marks[kFirstChunk] : nullptr);
    if (!err.empty()) return err;
  }
  // a few blocks per SM (grid-stride): each block first waits for every signal
  const int rows_grid = std::min(cuda::grid_for(w->g.m_cap, 8), 4 * cuda::num_sms());
  cuda::ep_rows_kernel<<<rows_grid, 256, int(2 * EL) * 4, st>>>(
      a, out, absent, gemm == nullptr);
  JSM_CUDA_TRY("dispatch rows", cudaGetLastError());
  if (!absent) {  // XLA may reuse the send buffer once the call is done on its stream
    JSM_CUDA_TRY("dispatch mark", mark(kSideEnd, me->side));
    JSM_CUDA_TRY("dispatch join", cudaEventRecord(me->join, me->side));
    JSM_CUDA_TRY("dispatch join", cudaStreamWaitEvent(st, me->join, 0));
  }
  me->marks_pending = timed;
  return "";
}

}  // namespace ep
}  // namespace jsm
