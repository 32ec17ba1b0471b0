#include "kernels/cpu/combine.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/cpu/window_table.h"

namespace jsm {

namespace {

using cpu_windows::wait_until;

struct ReturnSlot {
  std::vector<uint16_t> rows;                          // [T*K][H] bf16
  std::vector<float> weight;                           // [T*K]
  std::vector<uint64_t> stamp;                         // [T*K] the epoch that wrote the row
  std::unique_ptr<std::atomic<uint64_t>[]> done_flag;  // [R expert rank]

  explicit ReturnSlot(const CombineGeometry& g)
      : rows(static_cast<size_t>(g.T * g.K * g.H)),
        weight(static_cast<size_t>(g.T * g.K)),
        stamp(static_cast<size_t>(g.T * g.K), 0),
        done_flag(new std::atomic<uint64_t>[size_t(g.R)]) {
    for (int64_t i = 0; i < g.R; ++i) done_flag[i].store(0);
  }
};

struct ReturnWindow {
  ReturnSlot slots[2];
  uint64_t epoch = 0;  // touched only by this rank's own calls, which run in program order
  explicit ReturnWindow(const CombineGeometry& g) : slots{ReturnSlot(g), ReturnSlot(g)} {}
};

// the window table's key of a combine geometry (kind tag 1; the dispatch's is 0)
std::vector<int64_t> combine_key(const CombineGeometry& g) { return {1, g.R, g.T, g.K, g.H}; }

}  // namespace

std::string combine_cpu(int64_t slot, const CombineGeometry& g, const DispatchOptions& opt,
                        const ReturnRows& in, uint16_t* y) {
  const int64_t R = g.R, H = g.H;
  const auto call = cpu_windows::begin_call<ReturnWindow>("combine", slot, g, combine_key(g), opt);
  if (call.absent) {
    std::fill_n(y, g.T * H, uint16_t(0));
    return "";
  }
  if (!call.windows) return call.error;
  const int64_t rank = call.rank;  // within the group; W holds the group's windows
  auto& W = *call.windows;
  const uint64_t epoch = call.epoch;
  const int parity = call.parity();

  // 1. each source's rows to its return slot, then its done flag
  std::vector<std::vector<int64_t>> rows_of(static_cast<size_t>(R));
  for (int64_t i = 0; i < g.m_cap; ++i)
    if (in.src_rank[i] >= 0) rows_of[size_t(in.src_rank[i])].push_back(i);
  for (int64_t j = 0; j < R; ++j) {
    const int64_t s = (rank + 1 + j) % R;
    ReturnSlot& to = W[s]->slots[parity];
    for (const int64_t i : rows_of[size_t(s)]) {
      const int64_t at = int64_t(in.token[i]) * g.K + in.slot[i];
      std::memcpy(to.rows.data() + at * H, in.rows + i * H, size_t(H) * sizeof(uint16_t));
      to.weight[size_t(at)] = in.weight[i];
      to.stamp[size_t(at)] = epoch;
    }
    to.done_flag[rank].store(epoch, std::memory_order_release);
  }
  // 2. every rank's rows
  ReturnSlot& me = W[rank]->slots[parity];
  for (int64_t d = 0; d < R; ++d)
    if (!wait_until([&] { return me.done_flag[d].load(std::memory_order_acquire) >= epoch; },
                    call.deadline))
      return cpu_windows::timeout_message("combine", rank, d, "its returned rows", epoch,
                                          opt.timeout_s, call.group, call.num_groups);
  // 3. the weighted sum of this epoch's rows
  combine_tokens(g.T, g.K, H, [&](int64_t t, int64_t k, const uint16_t** row, float* w) {
    const size_t at = size_t(t * g.K + k);
    if (me.stamp[at] != epoch) return false;
    *row = me.rows.data() + at * H;
    *w = me.weight[at];
    return true;
  }, y);
  return "";
}

}  // namespace jsm
