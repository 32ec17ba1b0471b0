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

}  // namespace handler
}  // namespace jsm
