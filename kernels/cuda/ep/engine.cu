// Host side of the multi-GPU dispatch engines (protocol: kernels/cuda/ep/window.h): one call's
// sequence on XLA's stream and the rank's side stream.
//
// Engine `ce`: everything that moves bytes between GPUs is a copy-engine operation
// (copy_engine.cu): the plan by peer copies and stream-ordered flag writes, a bounded host wait
// for every source's plan, then each peer's rows in one piece (two copies) into its staging,
// followed by the write of its staging flag there; each rank's placement kernel (a few SMs beside
// the fused GEMM, on its own stream) puts the staged rows at their offsets and raises their
// segment signals, so the copies per call do not grow with the experts (before: 3 per expert and
// peer, 768 at dsv3 R = 2, at ~0.65 us of device time each). The rank's own segments (within
// its GPU) are stored by a kernel that waits for the plan on the device, on XLA's stream before
// the fused GEMM; so the GEMM is launched before the host's plan synchronisation, which then runs
// on the side stream while the GEMM computes the own experts (measured on 2xH200, dsv3 4096
// tokens: the GEMM starts 0.19 ms after the dispatch instead of 2.16, stage1 8.3 ms instead of
// 10.1). Own rows as copies instead would have to be enqueued before the GEMM too, after the
// host's wait: a copy within one GPU may run as a driver kernel, which a persistent GEMM holding
// every SM (and waiting for these very rows) would never let start.
// Engine `sm`: one kernel puts the plan, waits for the peers' plans and stores the rows itself
// (kernels.cuh); no host synchronisation.
// Both then run ep_rows_kernel, which waits (bounded) for every signal of this rank's slot.
#include "kernels/cuda/ep/engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "kernels/cuda/ep/copy_engine.h"
#include "kernels/cuda/ep/kernels.cuh"
#include "kernels/cuda/ep/state.h"
#include "kernels/cuda/launch_util.h"

namespace jsm {
namespace ep {
namespace {

using cuda::EpWindowLayout;
using cuda::at;

// The previous call's timeline into the statistics, if its events have completed (not when calls
// are enqueued faster than they run: that call is then not counted). first_chunk: engine ce,
// whose calls mark their first peer's copies.
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

}  // namespace

std::string dispatch(void* stream, const DispatchGeometry& g, const SendView& send,
                     const LandedView& out, const DispatchOptions& opt, GemmLaunch gemm,
                     void* gemm_ctx) {
  std::string err;
  auto w = call_window_set(opt, "dispatch", &err);
  if (!w) return err;
  if (g.R != w->g.R || g.EL != w->g.EL || g.H != w->g.H || g.m_cap != w->g.m_cap ||
      g.send_rows != w->g.send_rows)
    return "jax_sdma_moe dispatch: the call's shapes differ from its window set's";
  LocalRank* me = rank_on_current_device(*w);
  if (!me) return "jax_sdma_moe dispatch: no rank of this Runtime lives on the current device";
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture);
  if (capture != cudaStreamCaptureStatusNone && w->engine != EngineId::kSm)
    return "jax_sdma_moe dispatch: engine 'ce' synchronises with the host in every call and "
           "cannot run inside a CUDA graph; use engine 'sm' there";
  static std::atomic<uint64_t> loaded{0};  // launch_util.h: kernels spin beside later launches
  JSM_CUDA_TRY("dispatch: loading its kernels",
               cuda::load_kernels_once(loaded, cuda::ep_begin_kernel, cuda::ep_headers_kernel,
                                       cuda::ep_sm_kernel, cuda::ep_place_kernel,
                                       cuda::ep_layout_kernel, cuda::ep_rows_kernel));
  me->timeout_s = bounded_timeout_s(opt.timeout_s);
  read_marks(*me, w->engine == EngineId::kCe);
  err = describe(*me);
  if (!err.empty()) return err;
  cudaStream_t st = static_cast<cudaStream_t>(stream);

  cuda::EpArgs a{};
  a.peers = me->peers, a.L = w->L, a.g = w->g, a.rank = me->rank;
  uint32_t* epoch_counter = at<uint32_t>(me->own, w->L.epoch_counter);
  a.epoch_counter = epoch_counter;
  a.row_align = opt.row_align;
  a.timeout_ns = timeout_ns(opt.timeout_s);
  a.err = me->err_dev;
  a.counts = send.counts, a.values = send.values, a.scales = send.scales;
  a.token = send.token, a.slot = send.slot, a.weight = send.weight;
  if (w->engine == EngineId::kCe) a.host_plan = me->d_plan, a.host_ready = me->d_ready;
  const bool absent = opt.fault_absent_rank == me->rank;
  int busy_sms = 0;  // SMs the fused GEMM leaves to the dispatch
  // the timeline of fused calls outside CUDA graphs (whose replays never come back here)
  const bool timed = !absent && gemm && capture == cudaStreamCaptureStatusNone;
  auto mark = [&](Mark m, cudaStream_t s) -> cudaError_t {
    return timed ? cudaEventRecord(me->marks[m], s) : cudaSuccess;
  };
  std::chrono::steady_clock::time_point started;  // engine ce's plan statistics
  if (!absent) {
    if (opt.fault_delay_rank == me->rank)
      std::this_thread::sleep_for(std::chrono::milliseconds(bounded_delay_ms(opt)));
    started = std::chrono::steady_clock::now();
    // the epoch on the device (kernels read it there, also in a replayed CUDA graph); the host's
    // count runs in step for the ce engine's host-side steps (that engine is never captured)
    JSM_CUDA_TRY("dispatch mark", mark(kStart, st));
    cuda::ep_begin_kernel<<<1, 1, 0, st>>>(epoch_counter);
    JSM_CUDA_TRY("dispatch begin", cudaGetLastError());
    const uint32_t epoch = ++me->epoch;
    if (w->engine == EngineId::kCe && w->g.send_rows > 0) {
      // the outgoing headers, on XLA's stream before the fork: a kernel on the side stream could
      // find every SM taken by the fused GEMM, which waits for these very rows
      cuda::ep_headers_kernel<<<cuda::grid_for(w->g.send_rows, 256), 256, 0, st>>>(
          a, w->g.send_rows);
      JSM_CUDA_TRY("dispatch ce headers", cudaGetLastError());
    }
    JSM_CUDA_TRY("dispatch fork", cudaEventRecord(me->fork, st));
    JSM_CUDA_TRY("dispatch fork", cudaStreamWaitEvent(me->side, me->fork, 0));
    const int smem = int(cuda::SegmentTable::bytes(w->g.R, w->g.EL));
    JSM_CUDA_TRY("dispatch sm",
                 cudaFuncSetAttribute(cuda::ep_sm_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    if (w->engine == EngineId::kSm) {
      busy_sms = std::min(w->kernel_blocks, cuda::num_sms() - 1);
      cuda::ep_sm_kernel<<<busy_sms, 512, smem, me->side>>>(a, /*own_only=*/false);
      JSM_CUDA_TRY("dispatch sm", cudaGetLastError());
    } else {
      err = ce_plan_put(st, *w, *me, a, epoch);
      if (!err.empty()) return err;
      // the own rows: the GEMM's launch waits for no host step
      cuda::ep_sm_kernel<<<std::min<int64_t>(w->g.EL, cuda::num_sms()), 512, smem, st>>>(
          a, /*own_only=*/true);
      JSM_CUDA_TRY("dispatch ce own rows", cudaGetLastError());
      // the peers' rows from the staging to their offsets, beside the fused GEMM
      JSM_CUDA_TRY("dispatch ce place", cudaStreamWaitEvent(me->place, me->fork, 0));
      // Stage1Config.ce_place_blocks: SMs the fused GEMM leaves to it for its whole run (its grid
      // is fixed at launch; 4 of 132 cost it ~3%), each block moving its segments within the GPU
      const int place = std::min(w->kernel_blocks, cuda::num_sms() - 2);
      cuda::ep_place_kernel<<<place, 512, int(3 * w->g.EL + 1) * 4, me->place>>>(a);
      JSM_CUDA_TRY("dispatch ce place", cudaGetLastError());
      // the placement's SMs, and one left to the driver (a peer copy's kernel, if it uses one)
      busy_sms = place + 1;
    }
  }
  const int64_t EL = w->g.EL;
  cuda::ep_layout_kernel<<<1, 256, int(3 * EL + 1) * 4, st>>>(a, out, absent,
                                                                opt.global_overflow);
  JSM_CUDA_TRY("dispatch layout", cudaGetLastError());
  // Engine ce: the host's steps (the plan, then the peers' copies) before anything on any stream
  // that waits for the peers' rows: the fused GEMM (its launches after its first wait for that
  // one), the placement's event, the read-out. The streams of a context share a few hardware
  // queues (copy_engine.cu ce_plan_wait): a copy enqueued after such work on another stream may
  // queue behind it, and the peers' rows then wait for this rank's, which wait for theirs. So the
  // GEMM is launched once the copies are enqueued.
  if (w->engine == EngineId::kCe && !absent) {
    err = ce_plan_wait(st, *w, *me, me->epoch, started);
    if (err.empty())
      err = ce_peer_rows(me->side, *w, *me, a, me->epoch,
                         timed ? me->marks[kFirstChunk] : nullptr);
    if (!err.empty()) return err;
  }
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
  if (w->engine == EngineId::kCe && !absent)
    JSM_CUDA_TRY("dispatch ce place", cudaEventRecord(me->placed, me->place));
  // a few blocks per SM (grid-stride): each block first waits for every signal
  const int rows_grid = std::min(cuda::grid_for(w->g.m_cap, 8), 4 * cuda::num_sms());
  cuda::ep_rows_kernel<<<rows_grid, 256, int(2 * EL) * 4, st>>>(
      a, out, absent, gemm == nullptr);
  JSM_CUDA_TRY("dispatch rows", cudaGetLastError());
  if (!absent) {  // XLA may reuse the send buffer once the call is done on its stream
    JSM_CUDA_TRY("dispatch mark", mark(kSideEnd, me->side));
    JSM_CUDA_TRY("dispatch join", cudaEventRecord(me->join, me->side));
    JSM_CUDA_TRY("dispatch join", cudaStreamWaitEvent(st, me->join, 0));
    if (w->engine == EngineId::kCe)
      JSM_CUDA_TRY("dispatch join", cudaStreamWaitEvent(st, me->placed, 0));
  }
  me->marks_pending = timed;
  return "";
}

}  // namespace ep
}  // namespace jsm
