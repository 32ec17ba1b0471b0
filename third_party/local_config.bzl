"""Repository rules that find what the build needs on this machine; nothing is downloaded.

local_python_configure (@local_py): asks the interpreter named by $PYTHON_BIN_PATH (else python3 on
  the PATH), the one with the README's install, where Python's, pybind11's and jaxlib's XLA FFI
  headers are, links them in as header-only cc_library targets, and registers that interpreter as
  the Python toolchain (py_test runs on it, with its jax).
local_cuda_configure (@local_cuda): finds the CUDA toolkit ($CUDA_PATH, /usr/local/cuda, or nvcc on
  the PATH) and writes defs.bzl with HAVE_CUDA and its paths; only --define=cuda=true uses them.
host_cc_configure (@host_cc): whether the C++ compiler takes -march=native (CMake's
  check_cxx_compiler_flag); defs.bzl has MARCH_NATIVE.
"""

_PY_QUERY = """
import sysconfig, pybind11, jax.ffi
print(sysconfig.get_paths()["include"])
print(pybind11.get_include())
print(jax.ffi.include_dir())
"""

_PY_BUILD = """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)

cc_library(
    name = "pybind11",
    hdrs = glob(["pybind11_include/pybind11/**/*.h"]),
    includes = ["pybind11_include"],
    deps = [":python_headers"],
)

cc_library(
    name = "xla_ffi",
    hdrs = glob(["xla_ffi_include/xla/**/*.h"]),
    includes = ["xla_ffi_include"],
)

# the XLA FFI headers for nvcc (a genrule): -isystem external/local_py/xla_ffi_include
filegroup(
    name = "xla_ffi_hdrs",
    srcs = glob(["xla_ffi_include/xla/**/*.h"]),
)

py_runtime(
    name = "python3",
    interpreter_path = "{python}",
    python_version = "PY3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":python3",
)

toolchain(
    name = "py_toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

def _workspace(rctx):
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)

def _python_impl(rctx):
    python = rctx.os.environ.get("PYTHON_BIN_PATH", "") or "python3"
    if not python.startswith("/"):
        python = rctx.which(python)
    if not python:
        fail("local_python_configure: set PYTHON_BIN_PATH to the Python that has the README's " +
             "install (jax, pybind11), or put python3 on the PATH")
    res = rctx.execute([python, "-c", _PY_QUERY])
    if res.return_code != 0:
        fail(("local_python_configure: %s cannot name the headers: it needs the README's " +
              "install and pybind11 (pip install \"pybind11>=2.12\", the build requirement " +
              "pip's isolated build does not leave behind):\n%s") % (python, res.stderr))
    py_inc, pb_inc, ffi_inc = res.stdout.strip().splitlines()[-3:]
    rctx.symlink(py_inc, "python_include")
    rctx.symlink(pb_inc, "pybind11_include")
    rctx.symlink(ffi_inc, "xla_ffi_include")
    _workspace(rctx)

    # the path as given, not resolved: a venv's python finds its site-packages by its own path
    rctx.file("BUILD.bazel", _PY_BUILD.replace("{python}", str(python)))

local_python_configure = repository_rule(
    implementation = _python_impl,
    environ = ["PYTHON_BIN_PATH", "PATH"],
    local = True,
)

def _cuda_impl(rctx):
    root = rctx.os.environ.get("CUDA_PATH", "")
    if not root and rctx.path("/usr/local/cuda/bin/nvcc").exists:
        root = "/usr/local/cuda"
    if not root:
        nvcc = rctx.which("nvcc")
        if nvcc:
            # nvcc may be a wrapper script (/usr/local/bin/nvcc): ask the toolkit where it lives
            res = rctx.execute([nvcc, "--dryrun", "-c", "-x", "cu", "/dev/null"])
            for line in res.stderr.splitlines():
                if line.startswith("#$ TOP="):
                    root = line[len("#$ TOP="):].strip()
            if not root:
                root = str(nvcc.realpath.dirname.dirname)
    have = bool(root) and rctx.path(root + "/bin/nvcc").exists
    root = str(rctx.path(root).realpath) if have else ""
    rctx.file("defs.bzl", "\n".join([
        "# written by //third_party:local_config.bzl (local_cuda_configure)",
        "HAVE_CUDA = %s" % have,
        "CUDA_ROOT = \"%s\"" % root,
        "NVCC = \"%s/bin/nvcc\"" % root,
        "CUDA_LIB = \"%s/lib64\"" % root,
        "",
    ]))
    _workspace(rctx)
    rctx.file("BUILD.bazel", "exports_files([\"defs.bzl\"])\n")

local_cuda_configure = repository_rule(
    implementation = _cuda_impl,
    environ = ["CUDA_PATH", "PATH"],
    local = True,
)

def _host_cc_impl(rctx):
    cc = rctx.os.environ.get("CC", "") or rctx.which("gcc") or rctx.which("cc")
    native = False
    if cc:
        res = rctx.execute([cc, "-march=native", "-x", "c++", "-fsyntax-only", "/dev/null"])
        native = res.return_code == 0
    rctx.file("defs.bzl", "\n".join([
        "# written by //third_party:local_config.bzl (host_cc_configure)",
        "MARCH_NATIVE = %s" % native,
        "",
    ]))
    _workspace(rctx)
    rctx.file("BUILD.bazel", "exports_files([\"defs.bzl\"])\n")

host_cc_configure = repository_rule(
    implementation = _host_cc_impl,
    environ = ["CC", "PATH"],
    local = True,
)
