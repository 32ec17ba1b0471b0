"""Offline build of the ROCm backend for gfx942 and gfx950, without a ROCm install or an AMD GPU
(tools/rocm_check.sh runs it in the toolchain of tools/rocm_toolchain.sh; a ROCm machine builds
with CMake instead, `pip install .`).

HIP translation units go through zig's clang in three steps, as hipcc's driver would (zig carries
no clang-offload-bundler): one code object per target (device-only compile, linked by LLD),
bundled here into a HIP fat binary (the offload-bundle format), then the host compile embeds it
(-fcuda-include-gpubinary) with the kernels' registration. Host C++ (the FFI handlers, engine
sdma's mori host code, the pybind11 module) is compiled by g++ against HIP 7.1's headers. The
extension is linked against stub libraries of the same sonames (libamdhip64.so.7, and
libmori_cco.so for engine sdma's host calls, each of which is first checked to exist in the
amd-mori wheel's library), so it loads here and its FFI targets can be registered for "ROCM".

Every code object is checked to be an AMDGPU ELF (EM_AMDGPU) for its target (e_flags mach).
Usage: python tools/rocm_build.py --toolchain DIR --out DIR [--flydsl DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"gfx942": 0x04C, "gfx950": 0x04F}  # EF_AMDGPU_MACH_AMDGCN_GFX942 / _GFX950
EM_AMDGPU = 224
HIP_SOURCES = ["kernels/rocm/stages.hip", "kernels/rocm/stage2.hip", "kernels/rocm/sdma/engine.hip",
               "kernels/rocm/sdma/combine.hip"]
CC_SOURCES = ["ffi/module.cc", "ffi/cpu_handlers.cc", "kernels/cpu/dispatch.cc",
              "kernels/cpu/combine.cc", "kernels/cpu/window_table.cc",
              "ffi/rocm_handlers.cc", "kernels/rocm/sdma/windows.cc"]
# the adapter of the FlyDSL kernels' exported C functions (kernels/rocm/gemm1.h, sdma/puts.h)
FLYDSL_ADAPTER = "kernels/rocm/flydsl_calls.cc"


def run(cmd, **kw):
  print("+", " ".join(cmd) if len(" ".join(cmd)) < 300 else " ".join(cmd)[:300] + " ...",
        flush=True)
  subprocess.run(cmd, check=True, **kw)


def amdgpu_target(blob: bytes) -> str | None:
  """The gfx target of an AMDGPU ELF code object, or None if it is not one."""
  if blob[:4] != b"\x7fELF" or len(blob) < 52:
    return None
  if struct.unpack_from("<H", blob, 18)[0] != EM_AMDGPU:
    return None
  mach = struct.unpack_from("<I", blob, 48)[0] & 0xFF
  return next((t for t, m in TARGETS.items() if m == mach), f"mach 0x{mach:x}")


def embedded_code_objects(path: str) -> list:
  """The AMDGPU code objects inside a host object or library (FlyDSL's exported objects embed
  theirs as data): [(offset, target)]."""
  data = open(path, "rb").read()
  found = []
  for m in re.finditer(re.escape(b"\x7fELF"), data):
    target = amdgpu_target(data[m.start():m.start() + 64])
    if target:
      found.append((m.start(), target))
  return found


def offload_bundle(entries, out, align=4096):
  """A clang offload bundle (what clang-offload-bundler writes, uncompressed): the magic, the
  entry count, (offset, size, id) per entry, then the contents, each aligned."""
  magic = b"__CLANG_OFFLOAD_BUNDLE__"
  header = len(magic) + 8 + sum(24 + len(t) for t, _ in entries)
  offsets, off = [], header
  for _, blob in entries:
    if blob:
      off = -(-off // align) * align
    offsets.append(off)
    off += len(blob)
  data = bytearray(magic + struct.pack("<Q", len(entries)))
  for (triple, blob), o in zip(entries, offsets):
    data += struct.pack("<QQQ", o, len(blob), len(triple)) + triple.encode()
  for (_, blob), o in zip(entries, offsets):
    data += b"\0" * (o - len(data)) + blob
  with open(out, "wb") as f:
    f.write(data)


class Toolchain:
  def __init__(self, root):
    self.root = root
    self.amd = os.path.join(root, "hip/triton/backends/amd")
    self.mori = os.path.join(root, "mori/mori")
    self.mori_src = os.path.join(self.mori, "_jit-sources")
    os.environ["PATH"] = os.path.join(root, "rocm/llvm/bin") + os.pathsep + os.environ["PATH"]

  def hipcc(self):
    return [sys.executable, "-m", "ziglang", "clang", "-x", "hip", "-nogpulib",
            "-resource-dir", os.path.join(self.root, "clangres"),
            f"--rocm-path={os.path.join(self.root, 'rocm')}", "-mcode-object-version=6",
            "-D__HIP_PLATFORM_AMD__", "-std=c++17", "-O3", "-I", ROOT,
            "-I", os.path.join(self.mori_src, "include")]

  def device_libs(self):
    return ["-include", os.path.join(self.root, "rocm/oclc_shim.h"),
            "-Xclang", "-mlink-builtin-bitcode", "-Xclang", os.path.join(self.amd, "lib/ockl.bc"),
            "-Xclang", "-mlink-builtin-bitcode", "-Xclang", os.path.join(self.amd, "lib/ocml.bc")]


def build_hip(tc, src, out_dir, defines):
  """One HIP translation unit: a code object per target, their bundle, the host object."""
  name = os.path.splitext(src)[0].replace("/", "_")
  cuid = hashlib.sha1(src.encode()).hexdigest()[:16]  # one id for the device and host compiles
  entries = [("host-x86_64-unknown-linux-gnu", b"")]
  objects = []
  for target in TARGETS:
    hsaco = os.path.join(out_dir, f"{name}.{target}.hsaco")
    run(tc.hipcc() + defines + tc.device_libs() +
        [f"-cuid={cuid}", "--cuda-device-only", f"--offload-arch={target}",
         "--no-gpu-bundle-output", "-c", os.path.join(ROOT, src), "-o", hsaco])
    blob = open(hsaco, "rb").read()
    got = amdgpu_target(blob)
    if got != target:
      raise SystemExit(f"{hsaco}: not an AMDGPU code object for {target} ({got})")
    objects.append((hsaco, target))
    entries.append((f"hipv4-amdgcn-amd-amdhsa--{target}", blob))
  fatbin = os.path.join(out_dir, f"{name}.hipfb")
  offload_bundle(entries, fatbin)
  obj = os.path.join(out_dir, f"{name}.o")
  run(tc.hipcc() + defines + [f"-cuid={cuid}", "--cuda-host-only", "-fPIC"] +
      [f"--offload-arch={t}" for t in TARGETS] +
      ["-Xclang", "-fcuda-include-gpubinary", "-Xclang", fatbin,
       "-c", os.path.join(ROOT, src), "-o", obj])
  return obj, objects


def undefined(objs, pattern):
  out = subprocess.run(["nm", "-u", *objs], check=True, capture_output=True, text=True).stdout
  names = {line.split()[-1] for line in out.splitlines() if line.strip() and not line.endswith(":")}
  return sorted(n for n in names if re.match(pattern, n))


def stub_library(path, soname, symbols):
  """A shared library of `soname` that defines each symbol as a function returning 100
  (hipErrorNoDevice for the HIP runtime's calls): the extension loads where no ROCm is installed;
  nothing that calls into it can run."""
  src = path + ".c"
  with open(src, "w") as f:
    for i, sym in enumerate(symbols):
      f.write(f'int jsm_stub_{i}(void) __asm__("{sym}");\nint jsm_stub_{i}(void) {{ return 100; }}\n')
  run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", path, src])


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--toolchain", required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--flydsl", help="part of the build tree holding the FlyDSL kernels' exported "
                 "objects (<kernel>_<target>.o/.h), if they were built")
  args = p.parse_args()
  tc = Toolchain(os.path.abspath(args.toolchain))
  out = os.path.abspath(args.out)
  obj_dir = os.path.join(out, "obj")
  os.makedirs(obj_dir, exist_ok=True)
  flydsl_objs = []
  if args.flydsl and os.path.isdir(args.flydsl):
    flydsl_objs = sorted(os.path.join(args.flydsl, f) for f in os.listdir(args.flydsl)
                         if f.endswith(".o"))
  with_flydsl = bool(flydsl_objs) and os.path.exists(os.path.join(ROOT, FLYDSL_ADAPTER))
  defines = ["-DJSM_ROCM_FLYDSL"] if with_flydsl else []

  report = []  # (code object, where, target)
  host_objs = []
  for src in HIP_SOURCES:
    obj, hsacos = build_hip(tc, src, obj_dir, defines)
    host_objs.append(obj)
    report += [(os.path.relpath(h, out), src, t) for h, t in hsacos]
  for f in flydsl_objs:
    found = embedded_code_objects(f)
    if not found:
      raise SystemExit(f"{f}: holds no AMDGPU code object")
    report += [(os.path.relpath(f, out), "FlyDSL (embedded)", t) for _, t in found]

  py_inc = sysconfig.get_paths()["include"]
  import pybind11
  import jax.ffi
  cxx = ["g++", "-std=c++17", "-O2", "-fPIC", "-Wall", "-D__HIP_PLATFORM_AMD__", "-DJSM_WITH_ROCM",
         *defines, "-I", ROOT, "-I", os.path.join(tc.amd, "include"),
         "-I", os.path.join(tc.mori_src, "include"), "-isystem", jax.ffi.include_dir(),
         "-isystem", pybind11.get_include(), "-isystem", py_inc]
  if args.flydsl:
    cxx += ["-I", os.path.abspath(args.flydsl)]
  for src in CC_SOURCES + ([FLYDSL_ADAPTER] if with_flydsl else []):
    obj = os.path.join(obj_dir, src.replace("/", "_") + ".o")
    run(cxx + ["-c", os.path.join(ROOT, src), "-o", obj])
    host_objs.append(obj)
  objs = host_objs + (flydsl_objs if with_flydsl else [])

  # stubs of the sonames the extension needs; mori's symbols must exist in the wheel's library
  stub_dir = os.path.join(out, "stub")
  os.makedirs(stub_dir, exist_ok=True)
  mori_syms = undefined(objs, r"_ZN4mori3cco")
  real = subprocess.run(["nm", "-D", "--defined-only", os.path.join(tc.mori, "libmori_cco.so")],
                        check=True, capture_output=True, text=True).stdout.split()
  missing = [s for s in mori_syms if s not in real]
  if missing:
    raise SystemExit(f"libmori_cco.so of the amd-mori wheel lacks {missing}")
  hip_syms = undefined(objs, r"(__)?hip[A-Za-z0-9_]+$")
  stub_library(os.path.join(stub_dir, "libamdhip64.so.7"), "libamdhip64.so.7", hip_syms)
  stub_library(os.path.join(stub_dir, "libmori_cco.so"), "libmori_cco.so", mori_syms)
  if not os.path.exists(os.path.join(stub_dir, "libamdhip64.so")):
    os.symlink("libamdhip64.so.7", os.path.join(stub_dir, "libamdhip64.so"))

  # the package, as an install would lay it out: the Python sources and the extension
  pkg = os.path.join(out, "site")
  shutil.rmtree(pkg, ignore_errors=True)
  shutil.copytree(os.path.join(ROOT, "jax_sdma_moe"), os.path.join(pkg, "jax_sdma_moe"),
                  ignore=shutil.ignore_patterns("__pycache__", "*.so"))
  ext = os.path.join(pkg, "jax_sdma_moe", "_jsm_ffi" + sysconfig.get_config_var("EXT_SUFFIX"))
  run(["g++", "-shared", "-o", ext, *objs, "-L", stub_dir, "-lamdhip64", "-lmori_cco",
       "-pthread", "-ldl", f"-Wl,-rpath,{stub_dir}"])

  print(f"\nAMDGPU code objects ({len(report)}):")
  for path, src, target in report:
    print(f"  {target}  {path}  ({src})")
  print(f"FlyDSL kernels linked: {'yes' if with_flydsl else 'no'}"
        + ("" if with_flydsl else " (gemm1, dispatch_gemm1 and engine sdma's puts are left out)"))
  print(f"mori CCO host calls, each found in the wheel's libmori_cco.so: {len(mori_syms)}")
  print(f"extension: {ext}")


if __name__ == "__main__":
  main()
