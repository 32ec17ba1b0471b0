#include "kernels/cpu/window_table.h"

#include <map>
#include <mutex>

namespace jsm {

namespace {

// One Runtime's windows: per (kind, geometry, group) key, one window per rank of the group.
struct WindowTable {
  int64_t R;
  int64_t G;  // groups (window_table.h)
  std::mutex mu;
  std::map<std::vector<int64_t>, std::shared_ptr<void>> windows;
};

std::mutex g_tables_mu;
std::map<int64_t, std::shared_ptr<WindowTable>> g_tables;  // id -> the table of one Runtime
int64_t g_next_id = 1;

}  // namespace

int64_t cpu_windows_create(int64_t num_ranks, int64_t num_groups) {
  auto table = std::make_shared<WindowTable>();
  table->R = num_ranks;
  table->G = num_groups;
  std::lock_guard<std::mutex> lock(g_tables_mu);
  int64_t id = g_next_id++;
  g_tables[id] = table;
  return id;
}

void cpu_windows_destroy(int64_t table_id) {
  std::lock_guard<std::mutex> lock(g_tables_mu);
  g_tables.erase(table_id);
}

namespace cpu_windows {

std::shared_ptr<void> find_or_make(int64_t table_id, int64_t num_ranks,
                                   const std::vector<int64_t>& key,
                                   const std::function<std::shared_ptr<void>()>& make,
                                   std::string* err) {
  std::shared_ptr<WindowTable> table;
  {
    std::lock_guard<std::mutex> lock(g_tables_mu);
    auto it = g_tables.find(table_id);
    if (it != g_tables.end()) table = it->second;
  }
  if (!table) {
    *err = "unknown or closed Runtime (window table " + std::to_string(table_id) + ")";
    return nullptr;
  }
  if (table->R != num_ranks) {
    *err = "Runtime has " + std::to_string(table->R) + " ranks but the call has " +
           std::to_string(num_ranks);
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(table->mu);
  auto& w = table->windows[key];
  if (!w) w = make();
  return w;
}

int64_t num_ranks(int64_t table_id) {
  std::lock_guard<std::mutex> lock(g_tables_mu);
  auto it = g_tables.find(table_id);
  return it == g_tables.end() ? 0 : it->second->R;
}

int64_t num_groups(int64_t table_id) {
  std::lock_guard<std::mutex> lock(g_tables_mu);
  auto it = g_tables.find(table_id);
  return it == g_tables.end() ? 0 : it->second->G;
}

std::string timeout_message(const char* call, int64_t rank, int64_t peer, const std::string& what,
                            uint64_t epoch, double timeout_s, int64_t group, int64_t num_groups) {
  const std::string of_group = num_groups > 1 ? " of group " + std::to_string(group) : "";
  return std::string("jax_sdma_moe ") + call + " (cpu engine): rank " + std::to_string(rank) +
         of_group + " timed out after " + std::to_string(timeout_s) + " s waiting for " + what +
         " from peer rank " + std::to_string(peer) + " (epoch " + std::to_string(epoch) +
         "); the peer did not arrive. The Runtime's windows are now out of step: create a new "
         "Runtime.";
}

}  // namespace cpu_windows
}  // namespace jsm
