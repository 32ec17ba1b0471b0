#!/usr/bin/env python3
"""Compiles every FlyDSL kernel of this folder for one AMDGPU arch and exports each as a C object
and header (FlyDSL's AOT path, `CompiledFunction.export_to_c`):

    python kernels/rocm/flydsl/build.py --arch gfx942|gfx950 --out DIR [--mori-cco-bc PATH]
                                        [--mori-python DIR] [--only KERNEL ...]

writes DIR/<kernel>_<arch>.o and DIR/<kernel>_<arch>.h; every exported C symbol starts with
`<kernel>_<arch>` so the objects of both archs link into one extension. Nothing runs on a device:
the kernels are compiled on placeholder arguments (null pointers, sample scalars), so neither a GPU
nor a ROCm install is needed, only the FlyDSL wheel (it imports torch; the CPU build is enough).

The sdma kernel calls mori's CCO device API (`mori.cco.device.flydsl`), whose wrappers are linked
from mori's CCO device bitcode for the same arch: --mori-cco-bc names it (mori's
src/cco/device/cco_device_wrapper.cpp built with -DBUILD_CCO_SDMA=1 -fgpu-rdc -emit-llvm);
--mori-python names the folder holding mori's Python package when `import mori` does not find it
(an unpacked amd-mori wheel). Without --mori-cco-bc (and MORI_CCO_BC unset) sdma_dispatch cannot
be built and the run fails; `--only gemm1 --only gemm2` builds the GEMMs alone.

Exit status 0 only when every kernel compiled and every code object embedded in the exports is an
AMDGPU ELF for the requested arch (checked here, see verify_objects).
"""

import argparse
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = ("gemm1", "gemm2", "sdma_dispatch")  # exported as <kernel>_<arch>
ARCHS = ("gfx942", "gfx950")
# ELF e_flags mach field of an AMDGPU code object (llvm/BinaryFormat/ELF.h EF_AMDGPU_MACH_*)
EF_AMDGPU_MACH = {"gfx942": 0x4C, "gfx950": 0x4F}
EM_AMDGPU = 224


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", required=True, choices=ARCHS)
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--mori-cco-bc", default=None, help="mori CCO device bitcode for --arch")
    p.add_argument("--mori-python", default=None, help="folder holding the `mori` package")
    p.add_argument("--only", action="append", choices=KERNELS, default=None,
                   help="build only this kernel (repeatable); default: all")
    return p.parse_args(argv)


def setup_environment(args):
    """FlyDSL reads the target from ARCH at compile time; mori's CCO bindings read the bitcode
    from MORI_CCO_BC and must not try to JIT-build it (no ROCm here)."""
    os.environ["ARCH"] = args.arch
    os.environ.setdefault("FLYDSL_RUNTIME_CACHE_DIR", os.path.join(os.path.abspath(args.out), ".flycache"))
    if args.mori_cco_bc:
        os.environ["MORI_CCO_BC"] = os.path.abspath(args.mori_cco_bc)
        os.environ["MORI_DISABLE_JIT"] = "1"
    if args.mori_python:
        sys.path.insert(0, os.path.abspath(args.mori_python))
    sys.path.insert(0, HERE)


def import_mori_cco_device():
    """mori/cco/__init__.py loads mori's host library (HIP, Cython), which cannot load without
    ROCm; the device bindings need none of it. Stand a bare package in for `mori.cco` so that
    `mori.cco.device.flydsl` imports from the same folder."""
    import mori

    if "mori.cco" not in sys.modules:
        pkg = types.ModuleType("mori.cco")
        pkg.__path__ = [os.path.join(os.path.dirname(mori.__file__), "cco")]
        sys.modules["mori.cco"] = pkg
    import mori.cco.device.flydsl as cco

    return cco


def extract_code_objects(blob):
    """AMDGPU ELF images embedded in a host object (the export keeps the code object as data)."""
    import struct

    found, at = [], 0
    while True:
        at = blob.find(b"\x7fELF", at)
        if at < 0:
            return found
        if at + 64 <= len(blob) and blob[at + 4] == 2:  # ELFCLASS64
            e_machine = struct.unpack_from("<H", blob, at + 18)[0]
            e_flags = struct.unpack_from("<I", blob, at + 48)[0]
            if e_machine == EM_AMDGPU:
                found.append((at, e_flags))
        at += 4


def verify_objects(path, arch):
    """Every exported object must embed at least one code object, each for `arch`."""
    with open(path, "rb") as f:
        objs = extract_code_objects(f.read())
    if not objs:
        raise RuntimeError(f"{path}: no AMDGPU code object embedded")
    for at, flags in objs:
        if flags & 0xFF != EF_AMDGPU_MACH[arch]:
            raise RuntimeError(f"{path}: code object at {at:#x} has mach {flags & 0xFF:#x}, "
                               f"expected {EF_AMDGPU_MACH[arch]:#x} ({arch})")
    return len(objs)


def export(compiled, out, kernel, arch):
    name = f"{kernel}_{arch}"
    compiled.export_to_c(out, name, function_prefix=name)
    obj = os.path.join(out, name + ".o")
    n = verify_objects(obj, arch)
    print(f"wrote {obj} ({n} AMDGPU code object(s), {arch}) and {os.path.join(out, name + '.h')}")


def build_gemm(arch, out, swiglu):
    """GEMM1 + SwiGLU (swiglu) or GEMM2: gemm1.py's kernel either way."""
    import flydsl.compiler as flyc

    import gemm1

    compiled = flyc.compile(gemm1.make_gemm(arch, swiglu), *gemm1.placeholder_args(swiglu))
    export(compiled, out, "gemm1" if swiglu else "gemm2", arch)


def build_sdma(arch, out):
    import flydsl.compiler as flyc

    cco = import_mori_cco_device()
    import sdma_dispatch

    compiled = flyc.compile(sdma_dispatch.make_sdma_dispatch(cco), *sdma_dispatch.placeholder_args())
    export(compiled, out, "sdma_dispatch", arch)


BUILDERS = {"gemm1": lambda arch, out: build_gemm(arch, out, True),
            "gemm2": lambda arch, out: build_gemm(arch, out, False), "sdma_dispatch": build_sdma}


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.out, exist_ok=True)
    setup_environment(args)
    out = os.path.abspath(args.out)
    failures = []
    steps = []
    for name in args.only or KERNELS:
        if name == "sdma_dispatch" and not os.environ.get("MORI_CCO_BC"):
            failures.append("sdma_dispatch: needs mori's CCO device bitcode for this arch "
                            "(--mori-cco-bc PATH or MORI_CCO_BC)")
            continue
        steps.append((name, BUILDERS[name]))
    for name, step in steps:
        try:
            step(args.arch, out)
        except Exception as exc:  # report every kernel, then fail
            import traceback

            traceback.print_exc()
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    if failures:
        for f in failures:
            print(f"FAILED {f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
