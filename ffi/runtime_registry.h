// The liveness registry of the Runtimes: the serials (jax_sdma_moe.Runtime.serial) of the Runtimes
// that are open in this process. Runtime() opens its serial (the extension's runtime_open),
// Runtime.close() and interpreter exit close it (runtime_close); every custom call that carries a
// Runtime's serial (DispatchOptions::runtime, route's attribute `runtime`; 0: none, not checked)
// checks it first, so an executable compiled for a Runtime that was closed since fails with
// FAILED_PRECONDITION instead of touching freed windows or running on state nobody owns.
// Process-wide and thread safe (the devices' threads call in at once). Header-only: the inline
// function's static is one object in the extension, whichever translation unit asks.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_set>

#include "xla/ffi/api/ffi.h"

namespace jsm {
namespace runtime_registry {

struct Registry {
  std::mutex mu;
  std::unordered_set<int64_t> open;
};

inline Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: handlers may run during exit
  return *r;
}

inline void mark_open(int64_t serial) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.open.insert(serial);
}

inline void mark_closed(int64_t serial) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.open.erase(serial);
}

inline bool is_open(int64_t serial) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.open.count(serial) != 0;
}

// The first check of a handler: FAILED_PRECONDITION unless `serial` is 0 (not checked) or open.
// call: which custom call, on which platform (for the message).
inline ::xla::ffi::Error check_open(int64_t serial, const char* call) {
  if (serial == 0 || is_open(serial)) return ::xla::ffi::Error::Success();
  return ::xla::ffi::Error(::xla::ffi::ErrorCode::kFailedPrecondition,
                           std::string("jax_sdma_moe: Runtime is closed (") + call +
                               ": this program was built for Runtime " + std::to_string(serial) +
                               ", which was closed since; make a new Runtime and trace again)");
}

}  // namespace runtime_registry
}  // namespace jsm
