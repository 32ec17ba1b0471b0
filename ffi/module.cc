// pybind11 module: hands each FFI handler to Python as a capsule (registered with
// jax.ffi.register_ffi_target, one target name per stage), exports the engine ids the handlers'
// `dispatch` attribute carries, and creates and frees the Runtimes' windows (the cpu engine's
// window tables, the ce/sm engines' window sets, the sdma engine's window sets).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>
#include <utility>

#include "ffi/cpu_handlers.h"
#include "ffi/runtime_registry.h"
#include "kernels/common/ep_window.h"
#include "kernels/rocm/sdma/window.h"
#include "kernels/common/options.h"
#include "kernels/cpu/window_table.h"
#ifdef JSM_WITH_CUDA
#include "ffi/cuda_handlers.h"
#include "kernels/cuda/ep/engine.h"
#endif
#ifdef JSM_WITH_ROCM
#include "ffi/rocm_handlers.h"
#include "kernels/rocm/sdma/engine.h"
#endif

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
                    {"check_overflow", JsmCheckOverflowCpu}, {"gemm2", JsmGemm2Cpu},
                    {"combine", JsmCombineCpu}, {"check_layout", JsmCheckLayoutCpu}});
  });
#ifdef JSM_WITH_CUDA
  m.def("cuda_targets", [] {
    return targets({{"quantize", JsmQuantizeCuda}, {"route", JsmRouteCuda},
                    {"qpack", JsmQpackCuda}, {"pack", JsmPackCuda}, {"dispatch", JsmDispatchCuda},
                    {"gemm1", JsmGemm1Cuda}, {"check_overflow", JsmCheckOverflowCuda},
                    {"dispatch_gemm1", JsmDispatchGemm1Cuda},
                    {"dispatch_graph", JsmDispatchGraphCuda},
                    {"dispatch_gemm1_graph", JsmDispatchGemm1GraphCuda},
                    {"gemm2", JsmGemm2Cuda}, {"combine", JsmCombineCuda},
                    {"check_layout", JsmCheckLayoutCuda}});
  });
#endif
#ifdef JSM_WITH_ROCM
  // GEMM1 and the fused dispatch + GEMM1 exist where the FlyDSL kernels were built
  m.def("rocm_targets", [] {
    return targets({{"quantize", JsmQuantizeRocm}, {"route", JsmRouteRocm},
                    {"qpack", JsmQpackRocm}, {"pack", JsmPackRocm}, {"dispatch", JsmDispatchRocm},
                    {"check_overflow", JsmCheckOverflowRocm},
                    {"dispatch_graph", JsmDispatchGraphRocm},
                    {"gemm2", JsmGemm2Rocm}, {"combine", JsmCombineRocm},
                    {"check_layout", JsmCheckLayoutRocm},
#ifdef JSM_ROCM_FLYDSL
                    {"gemm1", JsmGemm1Rocm}, {"dispatch_gemm1", JsmDispatchGemm1Rocm},
                    {"dispatch_gemm1_graph", JsmDispatchGemm1GraphRocm},
#endif
    });
  });
  // Engine sdma's window sets (mori CCO communicators and windows): the 128-byte communicator id
  // of the process holding rank 0, then the set of this process's ranks (collective over the
  // axis); an id is the `dispatch` attribute's window_set.
  m.def("sdma_unique_id", [] {
    std::string err;
    std::string id = jsm::sdma::unique_id(&err);
    if (!err.empty()) throw std::runtime_error(err);
    return py::bytes(id);
  });
  m.def("sdma_windows_create",
        [](int64_t R, int64_t H, int64_t EL, int64_t m_cap, int64_t send_rows, py::bytes id,
           std::vector<int64_t> ranks, std::vector<int64_t> devices, int queues) {
          std::string err;
          const std::string uid = id;
          int64_t set = 0;
          {
            py::gil_scoped_release release;  // the ranks' threads block in mori's collectives
            set = jsm::sdma::windows_create(jsm::DispatchGeometry{R, EL, H, m_cap, send_rows}, uid,
                                            ranks, devices, queues, &err);
          }
          if (set == 0) throw std::runtime_error(err);
          return set;
        },
        py::arg("num_ranks"), py::arg("hidden"), py::arg("local_experts"), py::arg("m_cap"),
        py::arg("send_rows"), py::arg("unique_id"), py::arg("ranks"), py::arg("devices"),
        py::arg("queues"));
  m.def("sdma_windows_destroy", [](int64_t id) {
    py::gil_scoped_release release;
    jsm::sdma::windows_destroy(id);
  });
  m.def("sdma_error", &jsm::sdma::error_message);
#endif
  m.def("has_rocm", [] {
#ifdef JSM_WITH_ROCM
    return true;
#else
    return false;
#endif
  });
  // which ROCm custom calls this build has: the GEMM (and with it the fused call and engine
  // sdma's put kernel) needs the FlyDSL kernels
  m.def("has_rocm_flydsl", [] {
#ifdef JSM_ROCM_FLYDSL
    return true;
#else
    return false;
#endif
  });
  // The liveness registry (ffi/runtime_registry.h): Runtime() opens its serial, close() and exit
  // close it; a custom call of a closed Runtime's program fails with FAILED_PRECONDITION.
  m.def("runtime_open", &jsm::runtime_registry::mark_open, py::arg("serial"));
  m.def("runtime_close", &jsm::runtime_registry::mark_closed, py::arg("serial"));
  m.def("runtime_is_open", &jsm::runtime_registry::is_open, py::arg("serial"));
  m.attr("ENGINE_IDS") = py::dict(
      py::arg("local") = int64_t(jsm::EngineId::kLocal), py::arg("cpu") = int64_t(jsm::EngineId::kCpu),
      py::arg("ce") = int64_t(jsm::EngineId::kCe), py::arg("sm") = int64_t(jsm::EngineId::kSm),
      py::arg("sdma") = int64_t(jsm::EngineId::kSdma));
  // The cpu engine's window table of a Runtime: its id is the `dispatch` attribute's window_set.
  // num_groups: the EP groups of a mesh with other axes; a call's rank operand is its slot
  // group * num_ranks + rank (kernels/cpu/window_table.h)
  m.def("cpu_windows_create", &jsm::cpu_windows_create, py::arg("num_ranks"),
        py::arg("num_groups") = 1);
  m.def("cpu_windows_destroy", &jsm::cpu_windows_destroy, py::arg("table_id"));
  // The bytes of one rank's window of a window engine (ce, sm: kernels/common/ep_window.h; sdma:
  // kernels/rocm/sdma/window.h) for a dispatch geometry, as its window set allocates it; every
  // build has it: the Runtime's memory guard counts it.
  m.def(
      "window_bytes",
      [](int64_t engine_id, int64_t R, int64_t EL, int64_t H, int64_t m_cap, int64_t send_rows) {
        const jsm::DispatchGeometry g{R, EL, H, m_cap, send_rows};
        const jsm::EngineId engine = jsm::EngineId(engine_id);
        if (engine == jsm::EngineId::kSdma) return jsm::sdma::sdma_window_layout(g).bytes;
        if (engine == jsm::EngineId::kCe || engine == jsm::EngineId::kSm)
          return jsm::ep_window_layout_of(engine, g).bytes;
        throw std::invalid_argument("window_bytes: engine " + std::to_string(engine_id) +
                                    " has no window");
      },
      py::arg("engine_id"), py::arg("num_ranks"), py::arg("local_experts"), py::arg("hidden"),
      py::arg("m_cap"), py::arg("send_rows"));
#ifdef JSM_WITH_CUDA
  // The ce/sm engines' window sets: created per dispatch geometry by jax_sdma_moe.runtime; an id
  // is the `dispatch` attribute's window_set.
  auto check = [](const std::string& err) {
    if (!err.empty()) throw std::runtime_error(err);
  };
  m.def("ep_windows_create",
        [](int64_t R, int64_t engine_id, int kernel_blocks, int64_t H, int64_t EL, int64_t m_cap,
           int64_t send_rows, int64_t num_groups, std::vector<int64_t> groups,
           std::vector<int64_t> ranks, std::vector<int64_t> devices) {
          std::string err;
          const int64_t id = jsm::ep::windows_create(
              jsm::EngineId(engine_id), kernel_blocks,
              jsm::DispatchGeometry{R, EL, H, m_cap, send_rows}, num_groups, groups, ranks,
              devices, &err);
          if (id == 0) throw std::runtime_error(err);
          return id;
        },
        py::arg("num_ranks"), py::arg("engine_id"), py::arg("kernel_blocks"), py::arg("hidden"),
        py::arg("local_experts"), py::arg("m_cap"), py::arg("send_rows"), py::arg("num_groups"),
        py::arg("groups"),
        py::arg("ranks"), py::arg("devices"));
  m.def("ep_windows_connect_local", [check](int64_t id) { check(jsm::ep::windows_connect_local(id)); });
  m.def("ep_window_ipc_handle", [check](int64_t id, int64_t group, int64_t rank) {
    std::string h;
    check(jsm::ep::window_ipc_handle(id, group, rank, &h));
    return py::bytes(h);
  });
  m.def("ep_windows_open",
        [check](int64_t id, int64_t group, int64_t rank, std::vector<std::string> handles) {
          check(jsm::ep::windows_open(id, group, rank, handles));
        });
  m.def("ep_windows_destroy", &jsm::ep::windows_destroy);
  m.def("ep_error", &jsm::ep::error_message);
  m.def("ep_host_stats", [](int64_t id) {
    py::list out;
    for (const auto& h : jsm::ep::host_stats(id))
      out.append(py::dict(py::arg("rank") = h.rank, py::arg("calls") = h.calls,
                          py::arg("plan_us") = h.plan_us,
                          py::arg("plan_stream_us") = h.plan_stream_us,
                          py::arg("enqueue_us") = h.enqueue_us,
                          py::arg("copies") = h.copies, py::arg("single_copies") = h.single_copies,
                          py::arg("batch_error") = h.batch_error,
                          py::arg("timed_calls") = h.timed_calls,
                          py::arg("first_chunk_calls") = h.first_chunk_calls,
                          py::arg("gemm_start_us") = h.gemm_start_us,
                          py::arg("gemm_end_us") = h.gemm_end_us,
                          py::arg("side_end_us") = h.side_end_us,
                          py::arg("first_chunk_us") = h.first_chunk_us));
    return out;
  });
#endif
  m.def("has_cuda", [] {
#ifdef JSM_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
}
