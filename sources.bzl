"""The extension _jsm_ffi: its sources and the flags both builds share.

One source of truth, read by both builds: BUILD.bazel load()s it, CMakeLists.txt reads each list
below with a regular expression over its quoted strings. Keep every entry a top-level
`NAME = [...]` list of plain strings (comments after a `#` are fine).
"""

# host C++ translation units
JSM_CC_SRCS = [
    "ffi/module.cc",
    "ffi/cpu_handlers.cc",
    "kernels/cpu/dispatch.cc",
    "kernels/cpu/combine.cc",
    "kernels/cpu/window_table.cc",
]

# CUDA: every .cu file under these folders (recursively) is its own translation unit
JSM_CUDA_SRC_DIRS = [
    "kernels/cuda",
    "ffi",
]

# host compiler options, for the C++ sources and (through nvcc) the host side of the .cu sources:
# auto-vectorisation of the host GEMM; no fast-math (NaN and the DESIGN.md §3 rounding stay exact)
JSM_COPTS = [
    "-O3",
    "-fno-math-errno",
]

# the CUDA architectures (each as real code and PTX), and nvcc's own options
JSM_CUDA_ARCHS = [
    "90a",
]

JSM_NVCC_OPTS = [
    "--expt-relaxed-constexpr",
]
