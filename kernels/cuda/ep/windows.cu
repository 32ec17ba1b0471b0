// The window sets of engines ce and sm: a process-global registry (every executable of a Runtime
// shares a set, made before tracing so IPC handles can be exchanged), each set's device windows,
// pinned host buffers, side stream and events per local rank, and their statistics.
#include <cuda_runtime.h>

#include <cstring>

#include "kernels/common/registry.h"
#include "kernels/cuda/ep/engine.h"
#include "kernels/cuda/ep/state.h"

namespace jsm {
namespace ep {
namespace {

using cuda::EpError;

constexpr int64_t kMaxSegments = 4096;  // R * EL: the sm kernel keeps its segment table in smem

Registry<WindowSet> g_sets;

struct DeviceGuard {
  int prev = 0;
  explicit DeviceGuard(int dev) {
    cudaGetDevice(&prev);
    cudaSetDevice(dev);
  }
  ~DeviceGuard() { cudaSetDevice(prev); }
};

LocalRank* local_rank(WindowSet& w, int64_t group, int64_t rank) {
  for (auto& l : w.local)
    if (l.group == group && l.rank == rank) return &l;
  return nullptr;
}

std::string who(int64_t group, int64_t rank) {
  return "rank " + std::to_string(rank) + " of EP group " + std::to_string(group);
}

// Peer access from the current device (`from`) to `to`'s memory, within this process.
std::string enable_peer_access(int from, int to) {
  if (from == to) return "";
  int can = 0;
  JSM_CUDA_TRY("peer access", cudaDeviceCanAccessPeer(&can, from, to));
  if (!can)
    return "jax_sdma_moe: device " + std::to_string(from) + " cannot access device " +
           std::to_string(to) + " (no peer access): use engine 'xla'";
  cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled)
    cudaGetLastError();
  else if (e != cudaSuccess)
    return cuda_error("peer access", e);
  return "";
}

void free_rank(LocalRank& l) {
  DeviceGuard guard(l.device);
  cudaDeviceSynchronize();
  for (void* p : l.opened) cudaIpcCloseMemHandle(p);
  if (l.own) cudaFree(l.own);
  if (l.err_host) cudaFreeHost(l.err_host);
  if (l.h_plan) cudaFreeHost(l.h_plan);
  if (l.h_ready) cudaFreeHost(l.h_ready);
  if (l.check_dev) cudaFree(l.check_dev);
  if (l.check_host) cudaFreeHost(l.check_host);
  if (l.side) cudaStreamDestroy(l.side);
  if (l.place) cudaStreamDestroy(l.place);
  if (l.placed) cudaEventDestroy(l.placed);
  if (l.fork) cudaEventDestroy(l.fork);
  for (cudaEvent_t ev : l.marks)
    if (ev) cudaEventDestroy(ev);
  if (l.join) cudaEventDestroy(l.join);
  l = LocalRank{};
}

}  // namespace

std::shared_ptr<WindowSet> find_set(int64_t id) {
  return g_sets.find(id);
}

int64_t windows_create(EngineId engine, int kernel_blocks, const DispatchGeometry& g,
                       int64_t num_groups, const std::vector<int64_t>& groups,
                       const std::vector<int64_t>& ranks, const std::vector<int64_t>& devices,
                       std::string* err) {
  const int64_t R = g.R;
  if (engine != EngineId::kCe && engine != EngineId::kSm) {
    *err = std::string("jax_sdma_moe: window sets are for engines ce and sm, not ") +
           engine_name(engine);
    return 0;
  }
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
  if (ranks.size() != devices.size() || groups.size() != ranks.size()) {
    *err = "jax_sdma_moe: groups, ranks and devices differ in length";
    return 0;
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (groups[i] < 0 || groups[i] >= num_groups || ranks[i] < 0 || ranks[i] >= R) {
      *err = "jax_sdma_moe: " + who(groups[i], ranks[i]) + " outside the mesh's " +
             std::to_string(num_groups) + " groups of " + std::to_string(R) + " ranks";
      return 0;
    }
    for (size_t j = 0; j < i; ++j)
      // a call finds its rank by the current device: one rank per device
      if (devices[j] == devices[i] || (groups[j] == groups[i] && ranks[j] == ranks[i])) {
        *err = "jax_sdma_moe: " + who(groups[i], ranks[i]) + " on device " +
               std::to_string(devices[i]) + " repeats a device or a rank of the window set";
        return 0;
      }
  }
  auto w = std::make_shared<WindowSet>();
  w->engine = engine, w->kernel_blocks = kernel_blocks, w->g = g;
  w->L = jsm::ep_window_layout_of(engine, g);
  for (size_t i = 0; i < ranks.size(); ++i) {
    LocalRank l;
    l.group = int(groups[i]), l.rank = int(ranks[i]), l.device = int(devices[i]);
    l.num_groups = int(num_groups);
    DeviceGuard guard(l.device);
    cudaError_t e = cudaMalloc(&l.own, size_t(w->L.bytes));
    if (e == cudaSuccess) e = cudaMemset(l.own, 0, size_t(w->L.bytes));
    if (e == cudaSuccess)
      e = cudaHostAlloc(&l.err_host, sizeof(EpError), cudaHostAllocMapped | cudaHostAllocPortable);
    if (e == cudaSuccess) std::memset(l.err_host, 0, sizeof(EpError));
    if (e == cudaSuccess) e = cudaHostGetDevicePointer(&l.err_dev, l.err_host, 0);
    if (e == cudaSuccess)
      e = cudaHostAlloc(&l.h_plan, size_t(R * R * g.EL) * 4,
                        cudaHostAllocMapped | cudaHostAllocPortable);
    if (e == cudaSuccess) e = cudaHostGetDevicePointer(&l.d_plan, l.h_plan, 0);
    if (e == cudaSuccess)
      e = cudaHostAlloc(&l.h_ready, sizeof(uint32_t),
                        cudaHostAllocMapped | cudaHostAllocPortable);
    if (e == cudaSuccess) *l.h_ready = 0;
    if (e == cudaSuccess) e = cudaHostGetDevicePointer(&l.d_ready, l.h_ready, 0);
    if (e == cudaSuccess) e = cudaMalloc(&l.check_dev, kCheckWords * sizeof(int32_t));
    if (e == cudaSuccess) e = cudaMallocHost(&l.check_host, kCheckWords * sizeof(int32_t));
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&l.side, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&l.place, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&l.placed, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&l.fork, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&l.join, cudaEventDisableTiming);
    for (cudaEvent_t& ev : l.marks)
      if (e == cudaSuccess) e = cudaEventCreate(&ev);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    l.peers.base[l.rank] = l.own;
    w->local.push_back(l);
    if (e != cudaSuccess) {
      *err = cuda_error("window of " + who(l.group, l.rank) + " (" +
                            std::to_string(w->L.bytes) + " bytes on device " +
                            std::to_string(l.device) + ")",
                        e);
      for (auto& made : w->local) free_rank(made);
      return 0;
    }
  }
  return g_sets.add(w);
}

std::string windows_connect_local(int64_t id) {
  auto w = find_set(id);
  if (!w) return "jax_sdma_moe: unknown window set";
  for (auto& a : w->local) {
    DeviceGuard guard(a.device);
    for (int64_t s = 0; s < w->g.R; ++s) {
      LocalRank* b = local_rank(*w, a.group, s);
      if (!b) return "jax_sdma_moe: " + who(a.group, s) + " is not in this process";
      a.peers.base[s] = b->own;
      const std::string e = enable_peer_access(a.device, b->device);
      if (!e.empty()) return e;
    }
    a.connected = true;
  }
  w->connected = true;
  return "";
}

std::string window_ipc_handle(int64_t id, int64_t group, int64_t rank, std::string* handle) {
  auto w = find_set(id);
  LocalRank* me = w ? local_rank(*w, group, rank) : nullptr;
  if (!me) return "jax_sdma_moe: " + who(group, rank) + " has no window here";
  DeviceGuard guard(me->device);
  cudaIpcMemHandle_t h;
  JSM_CUDA_TRY("IPC handle", cudaIpcGetMemHandle(&h, me->own));
  handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  return "";
}

std::string windows_open(int64_t id, int64_t group, int64_t rank,
                         const std::vector<std::string>& handles) {
  auto w = find_set(id);
  LocalRank* me = w ? local_rank(*w, group, rank) : nullptr;
  if (!me) return "jax_sdma_moe: " + who(group, rank) + " has no window here";
  if (int64_t(handles.size()) != w->g.R)
    return "jax_sdma_moe: one IPC handle per rank of the group expected";
  DeviceGuard guard(me->device);
  for (int64_t s = 0; s < w->g.R; ++s) {
    if (s == rank) continue;
    if (LocalRank* peer = local_rank(*w, group, s)) {
      // a peer in this process: its pointer (CUDA IPC opens no memory of the process itself)
      const std::string e = enable_peer_access(me->device, peer->device);
      if (!e.empty()) return e;
      me->peers.base[s] = peer->own;
      continue;
    }
    if (handles[size_t(s)].size() != sizeof(cudaIpcMemHandle_t))
      return "jax_sdma_moe: malformed IPC handle from " + who(group, s);
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[size_t(s)].data(), sizeof(h));
    void* p = nullptr;
    JSM_CUDA_TRY("opening the window of " + who(group, s),
                 cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    me->opened.push_back(p);
    me->peers.base[s] = static_cast<uint8_t*>(p);
  }
  me->connected = true;
  bool all = true;
  for (const auto& l : w->local) all = all && l.connected;
  w->connected = all;
  return "";
}

void windows_destroy(int64_t id) {
  std::shared_ptr<WindowSet> w = g_sets.take(id);
  if (!w) return;
  for (auto& l : w->local) free_rank(l);
}

std::string error_message(int64_t id) {
  return g_sets.first_error(id, [](const LocalRank& l) { return describe(l); });
}

std::vector<HostStats> host_stats(int64_t id) {
  std::vector<HostStats> out;
  auto w = find_set(id);
  if (!w) return out;
  for (auto& l : w->local)
    out.push_back(HostStats{l.rank, l.stats->calls.load(), l.stats->plan_ns.load() * 1e-3,
                            l.stats->plan_stream_ns.load() * 1e-3,
                            l.stats->enqueue_ns.load() * 1e-3, l.stats->copies.load(),
                            l.stats->single_copies.load(),
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

}  // namespace ep
}  // namespace jsm
