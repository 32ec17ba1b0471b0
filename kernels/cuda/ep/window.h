// The CUDA engines' (`ce`, `sm`) view of the symmetric landing window: its layout and protocol
// (kernels/common/ep_window.h, shared with ROCm's engine sdma) named in jsm::cuda, and their device
// helpers (kernels/common/gpu_sys.cuh: system-scope acquire/release, the global timer).
#pragma once

#include <stdint.h>

#include "kernels/common/ep_window.h"
#ifdef __CUDACC__
#include "kernels/common/gpu_sys.cuh"
#endif

namespace jsm {
namespace cuda {

using jsm::align_up;
using jsm::at;
using jsm::ep_meta_stride;
using jsm::ep_send_run;
using jsm::ep_stage_index;
using jsm::ep_window_layout;
using jsm::epoch_reached;
using jsm::EpError;
using jsm::EpWindowLayout;
using jsm::kMaxRanks;
using jsm::PeerTable;
using jsm::RowHeader;

#ifdef __CUDACC__
using gpu::ld_acquire_sys;
using gpu::poll_pause;
using gpu::record_wait_error;
using gpu::st_release_sys;
using gpu::timer_now;
using gpu::wait_flags_block;
using gpu::WaitWho;
#endif

}  // namespace cuda
}  // namespace jsm
