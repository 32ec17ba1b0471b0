// pybind11 module: hands each FFI handler to Python as a capsule (registered with
// jax.ffi.register_ffi_target, one target name per stage) and owns the cpu engine's Runtime table.
#include <pybind11/pybind11.h>

#include "cpu_handlers.h"
#ifdef JSM_WITH_CUDA
#include "cuda_handlers.h"
#endif
#include "kernels/cpu/dispatch.h"

namespace py = pybind11;

namespace {

template <typename T>
py::capsule encapsulate(T* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

PYBIND11_MODULE(_jsm_ffi, m) {
  m.doc() = "jax_sdma_moe FFI handlers";
  m.def("cpu_targets", [] {
    py::dict d;
    d["quantize"] = encapsulate(JsmQuantizeCpu);
    d["route"] = encapsulate(JsmRouteCpu);
    d["qpack"] = encapsulate(JsmQpackCpu);
    d["pack"] = encapsulate(JsmPackCpu);
    d["dispatch"] = encapsulate(JsmDispatchCpu);
    d["gemm1"] = encapsulate(JsmGemm1Cpu);
    d["check_overflow"] = encapsulate(JsmCheckOverflowCpu);
    return d;
  });
#ifdef JSM_WITH_CUDA
  m.def("cuda_targets", [] {
    py::dict d;
    d["quantize"] = encapsulate(JsmQuantizeCuda);
    d["route"] = encapsulate(JsmRouteCuda);
    d["qpack"] = encapsulate(JsmQpackCuda);
    d["pack"] = encapsulate(JsmPackCuda);
    d["dispatch"] = encapsulate(JsmDispatchCuda);
    d["gemm1"] = encapsulate(JsmGemm1Cuda);
    d["check_overflow"] = encapsulate(JsmCheckOverflowCuda);
    return d;
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
