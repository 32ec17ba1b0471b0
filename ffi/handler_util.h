// Helpers every platform's handlers share: error propagation and checks of what XLA hands them.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/common/options.h"
#include "xla/ffi/api/ffi.h"

#define JSM_RETURN_IF_ERROR(expr)   \
  do {                              \
    ::xla::ffi::Error _e = (expr);  \
    if (!_e.success()) return _e;   \
  } while (0)

namespace jsm {
namespace handler {

namespace ffi = xla::ffi;

inline ffi::Error check_dtype(const ffi::AnyBuffer& b, ffi::DataType want, const char* what) {
  if (b.element_type() != want)
    return ffi::Error::InvalidArgument(std::string("jax_sdma_moe: ") + what +
                                       " has the wrong element type");
  return ffi::Error::Success();
}

// Rows of a buffer (its leading dimension; 1 for a scalar) and its last dimension.
inline int64_t rows_of(const ffi::AnyBuffer& b) {
  return b.dimensions().size() == 0 ? 1 : b.dimensions()[0];
}
inline int64_t last_dim(const ffi::AnyBuffer& b) { return b.dimensions().back(); }

// The send buffer's rows (values, scales) against its send rows (the headers' count `send_rows`):
// one each, or with token_rows (qpack's attribute) one per token of x (`tokens`).
inline ffi::Error check_send_rows(const ffi::AnyBuffer& values, const ffi::AnyBuffer& scales,
                                  int64_t send_rows, int64_t tokens, bool token_rows,
                                  const char* what) {
  const int64_t want = token_rows ? tokens : send_rows;
  if (rows_of(values) != want || rows_of(scales) != want)
    return ffi::Error::InvalidArgument(
        std::string("jax_sdma_moe ") + what + ": the send buffer holds " +
        std::to_string(rows_of(values)) + " rows, not " + std::to_string(want) + " (one per " +
        (token_rows ? "token: token_rows" : "send row") + ")");
  return ffi::Error::Success();
}

// A fused dispatch + gemm1 whose engine takes a send buffer of token rows (engine local) or of
// send rows (the others), given the call's token_rows attribute.
inline ffi::Error check_token_rows(bool token_rows, bool engine_takes_them, EngineId engine,
                                   const char* what) {
  if (token_rows == engine_takes_them) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string("jax_sdma_moe ") + what + ": engine '" + engine_name(engine) +
      "' takes a send buffer of " +
      (engine_takes_them ? "token rows (qpack token_rows=True)" : "send rows (token_rows=False)"));
}

// A buffer's data as T.
template <class T>
T* ptr(ffi::Result<ffi::AnyBuffer>& r) {
  return static_cast<T*>(r->untyped_data());
}
template <class T>
const T* ptr(const ffi::AnyBuffer& b) {
  return static_cast<const T*>(b.untyped_data());
}

// The error of a handler given an engine it does not serve.
inline ffi::Error wrong_engine(const char* target, EngineId engine, const char* serves) {
  return ffi::Error::InvalidArgument(std::string("jax_sdma_moe ") + target + ": engine '" +
                                     engine_name(engine) + "' (id " +
                                     std::to_string(int64_t(engine)) +
                                     ") is not served here; this handler serves " + serves);
}

// The arrays an axis-wide check guards pass through aliased (ffi_lowering operand_output_aliases);
// copy(dst, src, bytes) runs only where XLA did not alias one.
template <class Copy>
ffi::Error pass_through(ffi::RemainingArgs& in, ffi::RemainingRets& out, Copy copy) {
  for (size_t i = 0; i < in.size(); ++i) {
    auto a = in.get<ffi::AnyBuffer>(i);
    auto r = out.get<ffi::AnyBuffer>(i);
    if (!a.has_value()) return a.error();
    if (!r.has_value()) return r.error();
    if ((*r)->untyped_data() != a->untyped_data())
      copy((*r)->untyped_data(), a->untyped_data(), a->size_bytes());
  }
  return ffi::Error::Success();
}

// What an axis-wide check (jsm_check_overflow) counts; every rank checks the same count, so every
// rank fails at the same point and none waits in a later exchange for one that left.
enum class AxisCheck : int64_t {
  kOverflow = 0,     // stage1(check=True): rows routed over the axis that did not fit M_cap
  kPeerLayout = 1,   // stage2 (engine xla): ranks whose Stage1Output fails its layout check
};

// The failure of an axis-wide check: `count` > 0 as `what` says; `rank` one rank concerned (-1:
// unknown); `cap` the landing capacity M_cap.
inline ffi::Error axis_check_error(AxisCheck what, int64_t count, int64_t rank, int64_t cap) {
  if (what == AxisCheck::kPeerLayout)
    return ffi::Error::InvalidArgument(
        "jax_sdma_moe.stage2: the Stage1Output given on " + std::to_string(count) +
        " rank(s) of the axis (rank " + std::to_string(rank) +
        " first) fails its layout check (expert offsets and counts monotone within M_cap = " +
        std::to_string(cap) + ", row headers in range, one row per (rank, token, slot)): a "
        "modified Stage1Output; every rank stops here, before the exchange");
  return ffi::Error(
      ffi::ErrorCode::kResourceExhausted,
      "jax_sdma_moe.stage1(check=True): " + std::to_string(count) +
          " rows routed over the axis did not fit their rank's M_cap = " + std::to_string(cap) +
          (rank >= 0 ? " (rank " + std::to_string(rank) + " dropped some)" : std::string()) +
          ": Stage1Config.max_recv_rows is below what this routing needs; raise it, or leave "
          "it None (M_cap then holds every row of any ids)");
}

}  // namespace handler
}  // namespace jsm
