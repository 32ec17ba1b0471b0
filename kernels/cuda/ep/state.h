// Internal to kernels/cuda/ep: the host state of a window set (one per Runtime and dispatch
// geometry) and of each of its ranks in this process, shared by windows.cu (the registry and the
// windows' lifetime), engine.cu (the dispatch sequence) and copy_engine.cu (engine ce's host
// steps).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kernels/common/ep_errors.h"
#include "kernels/common/options.h"
#include "kernels/cuda/ep/window.h"

namespace jsm {
namespace ep {

// Where a fused call's time goes on the device, from CUDA events on its two streams (read back at
// the rank's next call, once they have completed): the dispatch's start on XLA's stream; XLA's
// stream reaching the fused GEMM (every earlier step of the dispatch done: for ce the plan's host
// wait and the own copies) and leaving it; the side stream done (ce: the peers' copies; sm: its
// kernel); ce: the first peer's copies landed.
enum Mark { kStart, kGemmStart, kGemmEnd, kSideEnd, kFirstChunk, kMarks };

// plan_stream_ns: no longer measured (0): the host waits for its stream's earlier work and the
// peers' plans in one synchronisation, counted in plan_ns.
struct RankStats {  // written by the rank's calls, read by host_stats() from another thread
  std::atomic<uint64_t> calls{0}, plan_ns{0}, plan_stream_ns{0}, enqueue_ns{0};
  // row copies enqueued, those enqueued one at a time because cudaMemcpyBatchAsync refused the
  // batch, and its last refusal (a cudaError_t; 0: none)
  std::atomic<uint64_t> copies{0}, single_copies{0};
  std::atomic<int> batch_error{0};
  // the timeline: calls counted, and per mark (kGemmStart..) the total ns after kStart
  std::atomic<uint64_t> timed_calls{0}, first_chunk_calls{0}, mark_ns[kMarks]{};
};

struct LocalRank {
  // its EP group (DESIGN.md §2: one per combination of the mesh's other axes' coordinates; a
  // set holds this process's ranks of every group), its rank within the group, its CUDA device
  int group = 0, rank = -1, device = -1;
  int num_groups = 1;  // the mesh's groups (messages name the group where there are several)
  std::shared_ptr<RankStats> stats = std::make_shared<RankStats>();
  uint8_t* own = nullptr;
  cuda::PeerTable peers{};
  std::vector<void*> opened;  // IPC-opened peer windows
  bool connected = false;     // every peer of its group is in `peers`
  uint32_t epoch = 0;
  uint32_t ret_epoch = 0;  // the combine's calls, in step with ret_epoch_counter (engine ce)
  double timeout_s = 0;
  cuda::EpError* err_host = nullptr;  // mapped pinned memory
  cuda::EpError* err_dev = nullptr;
  // engine ce: the plan of the latest dispatch [R src][R dst * EL], and the epoch whose plan it
  // holds: mapped pinned memory its own-rows kernel writes (d_plan, d_ready: the device's
  // addresses), read by the host after synchronising XLA's stream
  int32_t* h_plan = nullptr;
  int32_t* d_plan = nullptr;
  uint32_t* h_ready = nullptr;
  uint32_t* d_ready = nullptr;
  // engine ce's combine: its check of the Stage1Output against the latest dispatch (kCheckWords
  // int32, on the device and its pinned copy on the host)
  int32_t* check_dev = nullptr;
  int32_t* check_host = nullptr;
  cudaStream_t side = nullptr;  // row copies (ce) or the sm kernel, beside XLA's stream
  cudaEvent_t fork = nullptr, join = nullptr;
  // engine ce: the placement kernel's stream (it waits for the peers' rows on the device, so it
  // may not sit behind the host's steps on `side`: those wait for this rank's own plan only, but
  // a placement queued before them would hold this rank's copies until the peers' rows came)
  cudaStream_t place = nullptr;
  cudaEvent_t placed = nullptr;
  cudaEvent_t marks[kMarks] = {};
  bool marks_pending = false;  // the last call's marks, not yet read
};

struct WindowSet {
  EngineId engine = EngineId::kCe;
  int kernel_blocks = 0;  // the engine kernel's blocks: sm's stores, ce's placement
  DispatchGeometry g{};
  cuda::EpWindowLayout L{};
  std::vector<LocalRank> local;  // g.R is a group's size: the ranks of one group see each other
  bool connected = false;        // every local rank is
};

// The registered set `id`, or null (windows.cu).
std::shared_ptr<WindowSet> find_set(int64_t id);

// The window set of a call (`what`: "dispatch", "combine"), checked to be registered, of the call's
// engine and connected; null with *err set.
inline std::shared_ptr<WindowSet> call_window_set(const DispatchOptions& opt, const char* what,
                                                  std::string* err) {
  auto w = find_set(opt.window_set);
  const std::string call = std::string("jax_sdma_moe ") + what + ": ";
  if (!w)
    *err = call + "unknown or closed Runtime window set (" + std::to_string(opt.window_set) + ")";
  else if (w->engine != opt.engine)
    *err = call + "a call of engine " + engine_name(opt.engine) + " on a window set of engine " +
           engine_name(w->engine);
  else if (!w->connected)
    *err = call + "the Runtime's windows are not connected";
  else
    return w;
  return nullptr;
}

inline LocalRank* rank_on_current_device(WindowSet& w) {
  int dev = -1;
  cudaGetDevice(&dev);
  for (auto& l : w.local)
    if (l.device == dev) return &l;
  return nullptr;
}

// The call's timeout in ns (options.h bounds it: the device's deadline never overflows).
inline uint64_t timeout_ns(double s) { return uint64_t(bounded_timeout_s(s) * 1e9); }

// engine ce's combine check (combine.cu ep_return_check_kernel): the rows that differ, the first
// of them (-1: none), its (src_rank, token, slot) in the Stage1Output and in the latest dispatch
constexpr int kCheckWords = 8;

inline uint64_t elapsed_ns(std::chrono::steady_clock::time_point since) {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - since)
                      .count());
}

inline std::string cuda_error(const std::string& what, cudaError_t e) {
  return "jax_sdma_moe (" + what + "): " + cudaGetErrorString(e);
}

#define JSM_CUDA_TRY(what, expr)                                   \
  do {                                                             \
    cudaError_t _e = (expr);                                       \
    if (_e != cudaSuccess) return ::jsm::ep::cuda_error(what, _e); \
  } while (0)

// Codes of the device error word beyond the bounded waits' (ep_errors.h: 1 to 4): engine ce's
// combine found a send header of this rank outside [T, K) (peer: the send position, expert: the
// token, epoch: the combine's): a Stage1Output or combine shapes not of the latest dispatch.
constexpr uint32_t kErrReturnHeader = 5;

// "" or the error a kernel recorded for this rank: a bounded wait's, naming rank, peer and
// epoch, or a header check's.
inline std::string describe(const LocalRank& me) {
  volatile cuda::EpError* v = me.err_host;  // the code is written last (after a system fence)
  const cuda::EpError e{v->code, v->peer, v->expert, v->epoch};
  if (e.code == kErrReturnHeader)
    return "jax_sdma_moe combine (engine ce): rank " + std::to_string(me.rank) +
           "'s send row " + std::to_string(e.peer) + " names token " +
           std::to_string(int32_t(e.expert)) +
           ", outside the combine's tokens or slots (combine epoch " + std::to_string(e.epoch) +
           "): stage2 got a Stage1Output whose shapes are not those of the latest stage1 on this "
           "rank. Its rows were not returned; the Runtime's windows may be out of step: create a "
           "new Runtime.";
  return describe_wait_error(e, me.rank, me.timeout_s, me.group, me.num_groups);
}

}  // namespace ep
}  // namespace jsm
