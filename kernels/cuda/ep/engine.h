// Host side of the multi-GPU dispatch engines `ce` and `sm`: the symmetric windows of a Runtime
// (one set per dispatch geometry; windows.cu) and the dispatch itself (engine.cu, with the ce
// engine's host steps in copy_engine.cu). No CUDA types here, so the pybind11 module (a plain C++
// translation unit) can call it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/common/dispatch_io.h"
#include "kernels/cuda/ep/window.h"

namespace jsm {
namespace ep {

// The window sets of every Runtime with engine ce or sm, in a process-global registry (every
// executable of a Runtime shares them, and they must exist before tracing: IPC handles are
// exchanged then). Allocates (and zeroes) the windows of `ranks`, each on its CUDA device, for
// `engine` (ce or sm; kernel_blocks: the blocks of the engine's own kernel, sm's stores or ce's
// placement). Returns the set's id > 0, or 0 with *err set.
// EP groups (DESIGN.md §2): the set holds this process's ranks of every group it serves, each
// (groups[i] < num_groups, ranks[i]) on devices[i], one rank per device (a call finds its rank by the current
// device); g.R is a group's size, and a rank's peers are the ranks of its own group.
int64_t windows_create(EngineId engine, int kernel_blocks, const DispatchGeometry& g,
                       int64_t num_groups, const std::vector<int64_t>& groups,
                       const std::vector<int64_t>& ranks, const std::vector<int64_t>& devices,
                       std::string* err);
// Every group's ranks in this process: enables peer access between the devices, fills the tables.
std::string windows_connect_local(int64_t id);
// A group across processes: the CUDA IPC handle of a local rank's window, and the peers' windows
// of the rank's group (those in this process directly, the others by their IPC handles).
std::string window_ipc_handle(int64_t id, int64_t group, int64_t rank, std::string* handle);
std::string windows_open(int64_t id, int64_t group, int64_t rank,
                         const std::vector<std::string>& handles);
void windows_destroy(int64_t id);
// "" or the error a bounded wait of a kernel recorded (first local rank that has one).
std::string error_message(int64_t id);

// Host time spent inside the ce engine's calls, per local rank: the plan's host synchronisation
// (from the call's start until every source's plan is on the host: it includes waiting for this
// rank's route and qpack and for the slowest peer; plan_stream_us: until the first poll came
// back, i.e. the wait for the stream's earlier work) and the enqueueing of the row copies to the
// peers; the copies enqueued, and those enqueued one at a time (the batch API refused them:
// batch_error).
struct HostStats {
  int64_t rank;
  uint64_t calls;
  double plan_us, plan_stream_us, enqueue_us;  // totals over the calls
  uint64_t copies, single_copies;
  std::string batch_error;  // the name of the last refused batch's cudaError_t, "" if none
  // Both engines, fused calls (dispatch + GEMM) outside CUDA graphs: the device-side timeline of
  // the calls counted (timed_calls; first_chunk_calls: those with engine ce's first-chunk mark),
  // totals of µs after the dispatch's start on XLA's stream until that stream reached the GEMM
  // and left it, the side stream was done, and (ce) the first peer's copies had landed.
  uint64_t timed_calls, first_chunk_calls;
  double gemm_start_us, gemm_end_us, side_end_us, first_chunk_us;
};
std::vector<HostStats> host_stats(int64_t id);

// The landing slots as the fused GEMM reads them: the call's epoch is *epoch_counter (device
// memory, written by the call's first kernel); rows of expert e in the slot of parity
// p = epoch & 1 may be read once arrival[p][e * R + s] has reached the epoch for every source s.
// (arrival null: nothing to wait for, e.g. an absent rank with no rows.)
struct SlotView {
  const uint8_t* values[2];  // [m_cap, H] per parity
  const uint8_t* scales[2];  // [m_cap, H/32]
  const uint32_t* arrival[2];
  const uint32_t* epoch_counter;
  int R;
  uint64_t timeout_ns;
  cuda::EpError* err;
  int sms;  // SMs the GEMM may occupy (the sm engine keeps some)
};
// Launches the GEMM on `stream` (a cudaStream_t); returns "" or an error.
using GemmLaunch = std::string (*)(const SlotView& slot, void* stream, void* ctx);

// Runs one epoch of the protocol for the rank whose device is current, through the window set
// opt.window_set (its engine must be opt.engine), on `stream` (XLA's) and the rank's side stream
// (the row copies, or the sm kernel), joined back before returning.
// Without gemm: the landed rows are copied to out (out.values, out.scales). With gemm: it runs
// between the layout and the headers, reading the rows from the slot as they land (out.values
// and out.scales are unused). Returns "" or an error message.
std::string dispatch(void* stream, const DispatchGeometry& g, const SendView& send,
                     const LandedView& out, const DispatchOptions& opt, GemmLaunch gemm = nullptr,
                     void* gemm_ctx = nullptr);

// Stage2's way back (engines sm and ce; protocol: kernels/common/ep_window.h): GEMM2's rows with
// the landed rows' headers to y [T, H] bf16 of this rank's tokens, on `stream` through the window
// set opt.window_set (of send_rows = T * K). row_of: [T * K] int32 device scratch (engine ce's
// index of the returned rows). Returns "" or an error message.
std::string combine(void* stream, const CombineView& in, int32_t* row_of,
                    const DispatchOptions& opt);

}  // namespace ep
}  // namespace jsm
