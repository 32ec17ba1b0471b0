// The `cpu` engine's window tables: one per Runtime, process-global (every executable of the
// Runtime shares it), created by Runtime() in Python and freed by Runtime.close(). A table holds
// the windows of every geometry the Runtime's calls use — the dispatch's (kernels/cpu/dispatch.cc)
// and the combine's (kernels/cpu/combine.cc) — one window per rank each, and what their protocols
// share: bounded waits and the timeout message.
//
// Groups: on a mesh with other axes, every combination of their coordinates is an independent EP
// group of R ranks (DESIGN.md §2). A table has G * R rank slots; a call's rank operand is its slot
// g * R + r, its peers are the slots of group g, and each group has its own windows (the group is
// part of the key), made by the first call of that group: in a process of a multi-process mesh
// only the groups it holds. Headers and messages keep the rank r within the group.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/common/options.h"

namespace jsm {

int64_t cpu_windows_create(int64_t num_ranks, int64_t num_groups = 1);
void cpu_windows_destroy(int64_t table_id);

namespace cpu_windows {

using Clock = std::chrono::steady_clock;

// The windows of one geometry, one per rank.
template <class Window>
using RankWindows = std::vector<std::unique_ptr<Window>>;

// The windows of table `table_id` under `key` (a kind tag, then the geometry's sizes), made by
// `make` at the first call with that key. nullptr, with *err set, if the table is unknown or has
// another number of ranks than `num_ranks`.
std::shared_ptr<void> find_or_make(int64_t table_id, int64_t num_ranks,
                                   const std::vector<int64_t>& key,
                                   const std::function<std::shared_ptr<void>()>& make,
                                   std::string* err);

// The number of ranks (of one group) of table `table_id`; 0 if there is no such table (unknown or
// closed).
int64_t num_ranks(int64_t table_id);

// The number of groups of table `table_id`; 0 if there is no such table.
int64_t num_groups(int64_t table_id);

// The R windows of type Window (constructible from the geometry g, which has a member R) that
// table `table_id` holds under `key`.
template <class Window, class Geometry>
std::shared_ptr<RankWindows<Window>> windows_of(int64_t table_id, const Geometry& g,
                                                const std::vector<int64_t>& key,
                                                std::string* err) {
  auto made = find_or_make(table_id, g.R, key, [&] {
    auto w = std::make_shared<RankWindows<Window>>();
    for (int64_t r = 0; r < g.R; ++r) w->push_back(std::make_unique<Window>(g));
    return std::shared_ptr<void>(w);
  }, err);
  return std::static_pointer_cast<RankWindows<Window>>(made);
}

// now + seconds, for any seconds (bounded_timeout_s: inf or 1e300 is ~31 years, not an overflow
// into the past).
inline Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(bounded_timeout_s(seconds)));
}

// One rank's part in one call of a protocol (the dispatch, the combine).
template <class Window>
struct ProtocolCall {
  std::shared_ptr<RankWindows<Window>> windows;  // every rank's of the group; null if absent or on error
  int64_t rank = 0;                              // within the group: the slot is group * R + rank
  int64_t group = 0;
  int64_t num_groups = 1;
  uint64_t epoch = 0;                            // this call's; its parity slot is epoch & 1
  Clock::time_point deadline;                    // of every wait of the call
  bool absent = false;  // fault injection: this rank takes no part (its peers time out)
  std::string error;
  int parity() const { return int(epoch & 1); }
};

// The start every protocol call shares: the slot checked and split into (group, rank), the
// options' fault injection (an absent rank of every group; a late one sleeps first), the
// deadline, the group's windows of `key`, and the rank's next epoch (Window has a member `epoch`,
// touched only by the rank's own calls, which run in program order). slot: the rank operand,
// group * R + rank. call: the custom call's name, for the error.
template <class Window, class Geometry>
ProtocolCall<Window> begin_call(const char* call, int64_t slot, const Geometry& g,
                                const std::vector<int64_t>& key, const DispatchOptions& opt) {
  ProtocolCall<Window> c;
  const std::string where = std::string("jax_sdma_moe ") + call + " (cpu engine): ";
  c.num_groups = num_groups(opt.window_set);
  if (c.num_groups == 0) {
    c.error = where + "unknown or closed Runtime (window table " +
              std::to_string(opt.window_set) + ")";
    return c;
  }
  if (g.R < 1 || slot < 0 || slot >= c.num_groups * g.R) {
    c.error = where + "rank slot " + std::to_string(slot) + " out of range (" +
              std::to_string(c.num_groups) + " groups of " + std::to_string(g.R) + " ranks)";
    return c;
  }
  c.group = slot / g.R;
  c.rank = slot % g.R;
  if (c.rank == opt.fault_absent_rank) {
    c.absent = true;
    return c;
  }
  if (c.rank == opt.fault_delay_rank)  // at most timeout_s (bounded_delay_ms)
    std::this_thread::sleep_for(std::chrono::milliseconds(bounded_delay_ms(opt)));
  c.deadline = deadline_after(opt.timeout_s);
  std::vector<int64_t> group_key = key;
  group_key.push_back(c.group);  // each group its own windows
  c.windows = windows_of<Window>(opt.window_set, g, group_key, &c.error);
  if (!c.windows) {
    c.error = where + c.error;
    return c;
  }
  c.epoch = ++(*c.windows)[size_t(c.rank)]->epoch;
  return c;
}

// Spin, then sleep briefly: the R device threads may share very few cores.
template <class Pred>
bool wait_until(Pred ready, Clock::time_point deadline) {
  for (int64_t i = 0;; ++i) {
    if (ready()) return true;
    if (Clock::now() > deadline) return ready();
    if (i < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// The error of a wait that ran out: names the call, rank, peer, what was awaited and the epoch
// (and the group, where the table has several).
std::string timeout_message(const char* call, int64_t rank, int64_t peer, const std::string& what,
                            uint64_t epoch, double timeout_s, int64_t group = 0,
                            int64_t num_groups = 1);

}  // namespace cpu_windows
}  // namespace jsm
