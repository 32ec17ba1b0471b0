// pybind11 module: hands each FFI handler to Python as a capsule (registered with
// jax.ffi.register_ffi_target, one target name per stage) and owns the cpu engine's Runtime table.
#include <pybind11/pybind11.h>

#include <initializer_list>
#include <utility>

#include "cpu_handlers.h"
#ifdef JSM_WITH_CUDA
#include "cuda_handlers.h"
#endif
#include "kernels/cpu/dispatch.h"

namespace py = pybind11;

namespace {

// stage name -> capsule of its handler, in the order of jax_sdma_moe.primitives.STAGES
py::dict targets(std::initializer_list<std::pair<const char*, XLA_FFI_Handler*>> handlers) {
  py::dict d;
  for (const auto& [stage, fn] : handlers) d[stage] = py::capsule(reinterpret_cast<void*>(fn));
  return d;
}

}  // namespace

PYBIND11_MODULE(_jsm_ffi, m) {
  m.doc() = "jax_sdma_moe FFI handlers";
  m.def("cpu_targets", [] {
    return targets({{"quantize", JsmQuantizeCpu}, {"route", JsmRouteCpu}, {"qpack", JsmQpackCpu},
                    {"pack", JsmPackCpu}, {"dispatch", JsmDispatchCpu}, {"gemm1", JsmGemm1Cpu},
                    {"check_overflow", JsmCheckOverflowCpu}});
  });
#ifdef JSM_WITH_CUDA
  m.def("cuda_targets", [] {
    return targets({{"quantize", JsmQuantizeCuda}, {"route", JsmRouteCuda},
                    {"qpack", JsmQpackCuda}, {"pack", JsmPackCuda}, {"dispatch", JsmDispatchCuda},
                    {"gemm1", JsmGemm1Cuda}, {"check_overflow", JsmCheckOverflowCuda}});
  });
#endif
  m.def("runtime_create", &jsm::runtime_create, py::arg("num_ranks"));
  m.def("runtime_destroy", &jsm::runtime_destroy, py::arg("runtime_id"));
  m.def("has_cuda", [] {
#ifdef JSM_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
}
