"""cuda_objects: .cu sources compiled by nvcc, each its own translation unit, as a cc_library.

Bazel 4 has no CUDA rules and nothing may be downloaded: one genrule per .cu runs the local nvcc
(@local_cuda) and yields a position-independent object; the cc_library links them (alwayslink)
with the static CUDA runtime, so the extension needs only the driver, and only at the first CUDA
call: it imports on machines without a GPU. The flags are those CMake gives nvcc, less -Xptxas=-v
(register usage printed for each kernel) and libcudadevrt (used only by relocatable device code).
"""

load("@local_cuda//:defs.bzl", "CUDA_LIB", "HAVE_CUDA", "NVCC")

def cuda_objects(name, srcs, hdrs, archs, copts, nvcc_opts, defines, tags = [], **kwargs):
    """srcs: .cu files; hdrs: every header they include; archs: e.g. ["90a"] (real code and PTX
    of each); copts: host compiler options (nvcc forwards those it does not know); nvcc_opts:
    nvcc's own; defines: NAME=VALUE."""
    repo = native.repository_name()
    root = "." if repo == "@" else "external/" + repo[1:]
    gencode = ["'--generate-code=arch=compute_{0},code=[compute_{0},sm_{0}]'".format(a)
               for a in archs]
    flags = (["-std=c++17", "-forward-unknown-to-host-compiler", "-Xcompiler=-fPIC",
              "-Xcompiler=-fvisibility=hidden"] + gencode + copts + nvcc_opts +
             ["-D" + d for d in defines] +
             ["-I" + root, "-isystem external/local_py/xla_ffi_include"])
    objs = []
    for src in srcs:
        obj = "_objs/%s/%s.pic.o" % (name, src[:-len(".cu")])
        if HAVE_CUDA:
            # nvcc names its temporary files after its PID (tmpxft_<pid>_...), and sandboxed
            # actions run in PID namespaces over one /tmp: two concurrent nvcc of PID 2 took each
            # other's files. Each action gets its own TMPDIR.
            cmd = " ".join([
                "t=$$(mktemp -d) && TMPDIR=$$t",
                NVCC,
                # CMake's Release: -DNDEBUG (-c opt, the .bazelrc's default)
                "$$([ $(COMPILATION_MODE) = opt ] && echo -DNDEBUG)",
            ] + flags + ["-c $(location %s) -o $@;" % src,
                         "rc=$$?; rm -rf $$t; exit $$rc"])
        else:
            cmd = ("echo 'cuda_objects: no CUDA toolkit (nvcc) found: set CUDA_PATH or put nvcc " +
                   "on the PATH, or build without --define=cuda=true' >&2; exit 1")
        native.genrule(
            name = "%s_%s" % (name, src.replace("/", "_").replace(".", "_")),
            srcs = [src] + hdrs + ["@local_py//:xla_ffi_hdrs"],
            outs = [obj],
            cmd = cmd,
            message = "nvcc " + src,
            tags = tags,
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        alwayslink = 1,  # every object linked, as CMake does (not only those an archive yields)
        linkopts = [CUDA_LIB + "/libcudart_static.a", "-ldl", "-lrt", "-lpthread"],
        tags = tags,
        **kwargs
    )
