// Engine sdma's window sets: a process-global registry (every executable of a Runtime shares a
// set, made at the first trace of its geometry), each rank's mori CCO communicator, registered
// window and device communicator with SDMA queues, and its pinned error record, side stream and
// events. Host C++ against mori's CCO API (include/mori/cco/cco.hpp of the amd-mori wheel).
#include <hip/hip_runtime_api.h>

#include <cstring>
#include <thread>

#include "kernels/common/ep_errors.h"
#include "kernels/common/registry.h"
#include "kernels/rocm/sdma/engine.h"
#include "kernels/rocm/sdma/state.h"
#include "mori/cco/cco.hpp"

namespace jsm {
namespace sdma {
namespace {

namespace cco = mori::cco;

Registry<WindowSet> g_sets;

std::string mori_error(const char* what, int code) {
  return std::string("jax_sdma_moe sdma: mori ") + what + " failed (" + std::to_string(code) + ")";
}

#define JSM_MORI_TRY(what, expr)              \
  do {                                        \
    const int _c = (expr);                    \
    if (_c != 0) return mori_error(what, _c); \
  } while (0)

// The flat virtual address range mori reserves per rank: the window, rounded up to the 4 GiB
// stride of its LSA addressing (ccoWindowDevice::stride4G).
size_t per_rank_vmm_bytes(int64_t window_bytes) {
  const size_t stride = size_t(1) << 32;
  return (size_t(window_bytes) + (size_t(64) << 20) + stride - 1) / stride * stride;
}

// Everything of one rank, on its own thread (mori's creation calls are collective over the axis
// and block until every rank has called them).
std::string create_rank(const DispatchGeometry& g, const SdmaWindowLayout& L,
                        const cco::ccoUniqueId& id, int queues, LocalRank& l) {
  JSM_HIP_TRY("set device", hipSetDevice(l.device));
  cco::ccoComm* comm = nullptr;
  JSM_MORI_TRY("ccoCommCreate", cco::ccoCommCreate(id, int(g.R), l.rank,
                                                   per_rank_vmm_bytes(L.bytes), &comm));
  l.comm = comm;
  cco::ccoWindow_t win = nullptr;
  void* local = nullptr;
  JSM_MORI_TRY("ccoWindowRegister", cco::ccoWindowRegister(comm, size_t(L.bytes), &win, &local));
  l.window = win;
  l.own = static_cast<uint8_t*>(local);
  JSM_HIP_TRY("zero the window", hipMemset(l.own, 0, size_t(L.bytes)));
  JSM_HIP_TRY("zero the window", hipDeviceSynchronize());
  cco::ccoDevCommRequirements reqs = CCO_DEV_COMM_REQUIREMENTS_INITIALIZER;
  reqs.gdaConnectionType = cco::CCO_GDA_CONNECTION_NONE;  // one node: no RDMA
  reqs.sdmaQueueCount = queues;
  auto* dc = new cco::ccoDevComm{};
  l.dev_comm_host = dc;
  JSM_MORI_TRY("ccoDevCommCreate", cco::ccoDevCommCreate(comm, &reqs, dc));
  if (dc->lsaSize != g.R || dc->lsaRank != l.rank)
    return "jax_sdma_moe sdma: rank " + std::to_string(l.rank) + " is LSA rank " +
           std::to_string(dc->lsaRank) + " of " + std::to_string(dc->lsaSize) +
           " on its node; engine sdma needs every rank of the axis on one node, in rank order";
  if (dc->sdma.sdmaNumQueue == 0)
    return "jax_sdma_moe sdma: mori made no SDMA queues for rank " + std::to_string(l.rank) +
           " (mori enables its SDMA path only with MORI_ENABLE_SDMA=1 in the process "
           "environment, and only between GPUs whose peers it can reach by SDMA)";
  l.queues = int(dc->sdma.sdmaNumQueue);
  l.dev_comm = cco::ccoDevCommCopyToDevice(dc);
  if (!l.dev_comm) return "jax_sdma_moe sdma: ccoDevCommCopyToDevice failed";
  for (int64_t pe = 0; pe < g.R; ++pe) {
    l.peers.base[pe] = static_cast<uint8_t*>(cco::ccoGetPeerPtr(comm, local, int(pe)));
    if (!l.peers.base[pe])
      return "jax_sdma_moe sdma: rank " + std::to_string(pe) + "'s window is not mapped on rank " +
             std::to_string(l.rank) + " (engine sdma moves rows within one node)";
  }
  JSM_HIP_TRY("error record", hipHostMalloc(reinterpret_cast<void**>(&l.err_host),
                                            sizeof(EpError), hipHostMallocMapped));
  std::memset(l.err_host, 0, sizeof(EpError));
  JSM_HIP_TRY("error record", hipHostGetDevicePointer(reinterpret_cast<void**>(&l.err_dev),
                                                      l.err_host, 0));
  JSM_HIP_TRY("side stream", hipStreamCreateWithFlags(&l.side, hipStreamNonBlocking));
  JSM_HIP_TRY("events", hipEventCreateWithFlags(&l.fork, hipEventDisableTiming));
  JSM_HIP_TRY("events", hipEventCreateWithFlags(&l.join, hipEventDisableTiming));
  int khz = 0;
  JSM_HIP_TRY("wall clock", hipDeviceGetAttribute(&khz, hipDeviceAttributeWallClockRate, l.device));
  l.wall_clock_hz = uint64_t(khz) * 1000;
  JSM_MORI_TRY("ccoBarrierAll", cco::ccoBarrierAll(comm));
  return "";
}

void free_rank(LocalRank& l) {
  if (l.device >= 0) (void)hipSetDevice(l.device);
  (void)hipDeviceSynchronize();
  auto* comm = static_cast<cco::ccoComm*>(l.comm);
  auto* dc = static_cast<cco::ccoDevComm*>(l.dev_comm_host);
  if (l.dev_comm) cco::ccoDevCommFreeDeviceCopy(static_cast<cco::ccoDevComm*>(l.dev_comm));
  if (comm && dc) cco::ccoDevCommDestroy(comm, dc);
  delete dc;
  if (comm && l.window) cco::ccoWindowDeregister(comm, static_cast<cco::ccoWindow_t>(l.window));
  if (comm) cco::ccoCommDestroy(comm);
  if (l.err_host) (void)hipHostFree(l.err_host);
  if (l.side) (void)hipStreamDestroy(l.side);
  if (l.fork) (void)hipEventDestroy(l.fork);
  if (l.join) (void)hipEventDestroy(l.join);
  l = LocalRank{};
}

// Runs fn(local rank) on a thread per local rank, restoring each thread's device: mori's
// collective calls of the ranks of one process must run at once.
template <class Fn>
std::string on_rank_threads(std::vector<LocalRank>& local, Fn fn) {
  std::vector<std::string> errs(local.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < local.size(); ++i)
    threads.emplace_back([&, i] { errs[i] = fn(local[i]); });
  for (auto& t : threads) t.join();
  for (auto& e : errs)
    if (!e.empty()) return e;
  return "";
}

}  // namespace

std::shared_ptr<WindowSet> find_set(int64_t id) {
  return g_sets.find(id);
}

std::string describe(const LocalRank& me) {
  volatile EpError* v = me.err_host;  // the code is written last (after a system fence)
  return describe_wait_error(EpError{v->code, v->peer, v->expert, v->epoch}, me.rank,
                             me.timeout_s);
}

std::string unique_id(std::string* err) {
  cco::ccoUniqueId id{};
  const int c = cco::ccoGetUniqueId(&id);
  if (c != 0) {
    *err = mori_error("ccoGetUniqueId", c);
    return "";
  }
  return std::string(id.internal, sizeof(id.internal));
}

int64_t windows_create(const DispatchGeometry& g, const std::string& id,
                       const std::vector<int64_t>& ranks, const std::vector<int64_t>& devices,
                       int queues, std::string* err) {
  if (g.R < 2 || g.R > kMaxRanks) {
    *err = "jax_sdma_moe: engine sdma needs 2 to " + std::to_string(kMaxRanks) + " ranks, got " +
           std::to_string(g.R);
    return 0;
  }
  if (id.size() != sizeof(cco::ccoUniqueId) || ranks.size() != devices.size() || ranks.empty()) {
    *err = "jax_sdma_moe: sdma windows_create: a 128-byte mori id and one device per rank";
    return 0;
  }
  cco::ccoUniqueId uid{};
  std::memcpy(uid.internal, id.data(), sizeof(uid.internal));
  auto w = std::make_shared<WindowSet>();
  w->g = g;
  w->L = sdma_window_layout(g);
  for (size_t i = 0; i < ranks.size(); ++i) {
    LocalRank l;
    l.rank = int(ranks[i]);
    l.device = int(devices[i]);
    w->local.push_back(l);
  }
  *err = on_rank_threads(w->local, [&](LocalRank& l) { return create_rank(g, w->L, uid, queues, l); });
  if (!err->empty()) {
    on_rank_threads(w->local, [](LocalRank& l) { free_rank(l); return std::string(); });
    return 0;
  }
  return g_sets.add(w);
}

void windows_destroy(int64_t id) {
  std::shared_ptr<WindowSet> w = g_sets.take(id);
  if (!w) return;
  // deregistration and destruction are collective too
  on_rank_threads(w->local, [](LocalRank& l) { free_rank(l); return std::string(); });
}

std::string error_message(int64_t id) {
  return g_sets.first_error(id, [](const LocalRank& l) { return describe(l); });
}

}  // namespace sdma
}  // namespace jsm
