// The options every backend's dispatch and GEMM1 read, as plain structs: the FFI handlers decode
// them from the custom calls' dictionary attributes `dispatch` and `gemm1` (ffi/options.h lists
// the member names, which must match these members one for one and in this order).
#pragma once

#include <stdint.h>

namespace jsm {

// The dispatch engines that run as custom calls (Stage1Config.engine; "xla" runs no custom call).
// The pybind module exports these values as ENGINE_IDS.
enum class EngineId : int64_t {
  kLocal = 0,  // one rank: rows placed by a local copy (CPU or CUDA)
  kCpu = 1,    // the CPU virtual devices of one process, through a process-global window table
  kCe = 2,     // CUDA copy engines
  kSm = 3,     // CUDA SM stores over NVLink
  kSdma = 4,   // ROCm SDMA engines driven from a kernel through mori CCO
};

inline const char* engine_name(EngineId e) {
  switch (e) {
    case EngineId::kLocal: return "local";
    case EngineId::kCpu: return "cpu";
    case EngineId::kCe: return "ce";
    case EngineId::kSm: return "sm";
    case EngineId::kSdma: return "sdma";
  }
  return "unknown";
}

// Attribute `dispatch` of jsm_dispatch(_graph) and jsm_dispatch_gemm1(_graph).
struct DispatchOptions {
  EngineId engine;
  // The Runtime's window set: the cpu window table (engine cpu), the CUDA window set (ce, sm), the
  // ROCm window set (sdma); 0 for engine local, which has none.
  int64_t window_set;
  int64_t row_align;  // every expert's first landed row is a multiple of this (DESIGN.md §4)
  double timeout_s;   // every wait of the protocol is bounded by this
  int64_t fault_absent_rank;  // this rank never takes part (tests the timeout path)
  int64_t fault_delay_rank;   // this rank starts late by fault_delay_ms
  int64_t fault_delay_ms;     // bounded by timeout_s where it is slept
  // The Runtime's entry in the liveness registry (ffi/runtime_registry.h): a call whose Runtime
  // was closed fails with FAILED_PRECONDITION "Runtime is closed"; 0: not checked.
  int64_t runtime;
  // stage1(check=True) on engines ce and sm: the dispatch's `overflow` result is the rows dropped
  // over every rank of the axis (from the full plan every rank holds), so that every rank's
  // check fails at the same point and none waits for a rank that left.
  bool global_overflow;
};

// The longest wait any timeout_s stands for (~31 years): a larger value, inf or NaN waits this
// long, so that a deadline computed from it (now + timeout in ns or device ticks) never overflows
// into the past; a value <= 0 waits not at all.
constexpr double kMaxTimeoutS = 1e9;
inline double bounded_timeout_s(double timeout_s) {
  if (!(timeout_s <= kMaxTimeoutS)) return kMaxTimeoutS;  // also NaN
  return timeout_s > 0 ? timeout_s : 0.0;
}

// The fault injection's delay that a rank sleeps (fault_delay_ms), at most the call's timeout:
// a delay beyond it could only make the peers time out, and must not hang the caller.
inline int64_t bounded_delay_ms(const DispatchOptions& opt) {
  const double limit_ms = bounded_timeout_s(opt.timeout_s) * 1000.0;
  if (opt.fault_delay_ms <= 0) return 0;
  return double(opt.fault_delay_ms) < limit_ms ? opt.fault_delay_ms : int64_t(limit_ms);
}

// Attribute `gemm1` of jsm_gemm1 and jsm_dispatch_gemm1(_graph).
struct Gemm1Options {
  bool has_limit;
  float swiglu_limit;   // used when has_limit
  int64_t tile_tokens;  // the CUDA bf16 kernel's tile: 128 or 32 tokens (others ignore it)
};

}  // namespace jsm
