// A process-global registry of a window engine's window sets (the CUDA engines' in
// kernels/cuda/ep/windows.cu, engine sdma's in kernels/rocm/sdma/windows.cc), addressed by the id
// the `dispatch` attribute carries as window_set (ids start at 1: 0 means none). Host code.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace jsm {

template <class Set>
class Registry {
 public:
  // The set `id`, or null (unknown or removed).
  std::shared_ptr<Set> find(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sets_.find(id);
    return it == sets_.end() ? nullptr : it->second;
  }
  int64_t add(std::shared_ptr<Set> set) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t id = next_id_++;
    sets_[id] = std::move(set);
    return id;
  }
  // "" or the first error describe(rank) reports for a local rank of the set `id` (a bounded
  // wait of its kernels that ran out).
  template <class Describe>
  std::string first_error(int64_t id, Describe describe) {
    std::shared_ptr<Set> set = find(id);
    if (!set) return "";
    for (auto& l : set->local) {
      std::string m = describe(l);
      if (!m.empty()) return m;
    }
    return "";
  }
  // Removes the set `id` and hands it back (null if unknown): the caller frees it outside the lock.
  std::shared_ptr<Set> take(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sets_.find(id);
    if (it == sets_.end()) return nullptr;
    std::shared_ptr<Set> set = it->second;
    sets_.erase(it);
    return set;
  }

 private:
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<Set>> sets_;
  int64_t next_id_ = 1;
};

}  // namespace jsm
