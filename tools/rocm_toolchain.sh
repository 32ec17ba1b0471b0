#!/usr/bin/env bash
# Sets up the offline ROCm compile toolchain of tools/rocm_check.sh (no AMD GPU, no ROCm install,
# only PyPI and Debian's packages), cached in $JSM_ROCM_TOOLCHAIN (default ~/.cache/jsm-rocm):
#   venv/          Python 3.11 with jax/jaxlib 0.10.2 (the lowering), flydsl 0.5.0 (part of the
#                  kernels are FlyDSL; it imports torch: the CPU wheel, never a CUDA one), ziglang
#                  (clang and LLD 22 with the AMDGPU back end), pybind11, numpy
#   hip/           HIP 7.1 headers and the ockl/ocml device bitcode, unpacked from the triton wheel
#   clangres/      a clang resource dir: zig's headers plus clang-19's HIP wrapper headers
#                  (__clang_hip_*.h, cuda_wrappers/) from Debian's libclang-common-19-dev
#   rocm/          a stand-in ROCm root: ld.lld / lld (zig's LLD), include/hip, the HIP version
#   mori/          the amd-mori wheel unpacked (CCO C++ headers and sources, libmori_cco.so, the
#                  FlyDSL device bindings); mori's native parts cannot be imported without ROCm
# Prints `toolchain ready in DIR` at the end; a second run with the same versions does nothing.
# Usage: bash tools/rocm_toolchain.sh   (CI runs it through tools/rocm_check.sh)
set -euo pipefail
T=${JSM_ROCM_TOOLCHAIN:-$HOME/.cache/jsm-rocm}
# one string for every pinned version: a change re-creates the cache
PINS="shim2 py3.11 jax==0.10.2 jaxlib==0.10.2 flydsl==0.5.0 ziglang==0.17.1 torch==2.13.0+cpu pybind11==3.0.1 triton==3.9.0 amd-mori==1.2.4 libclang-common-19-dev"
if [[ -f $T/READY && $(cat "$T/READY") == "$PINS" ]]; then
  echo "toolchain ready in $T (cached)"
  exit 0
fi
PY=${JSM_ROCM_PYTHON:-python3.11}
command -v "$PY" >/dev/null || { echo "rocm_toolchain: needs $PY (flydsl's wheels are built for it)" >&2; exit 1; }
rm -rf "$T"
mkdir -p "$T"
cd "$T"
"$PY" -m venv venv
# shellcheck disable=SC1091
. venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and by its local version: flydsl's requirement would otherwise let pip resolve a
# CUDA build of torch (gigabytes). The +cpu wheel comes from the machine's wheel folder
# (pip's find-links).
python -m pip install -q "torch==2.13.0+cpu"
python -m pip install -q jax==0.10.2 jaxlib==0.10.2 flydsl==0.5.0 ziglang==0.17.1 pybind11==3.0.1 numpy \
  "torch==2.13.0+cpu"
python - <<'PY'
import torch
assert torch.__version__.endswith("+cpu"), f"a CUDA build of torch came in: {torch.__version__}"
PY

mkdir -p dl
# HIP 7.1 headers and ockl/ocml bitcode, taken out of the triton wheel (not installed)
python -m pip download -q --no-deps -d dl triton==3.9.0
python - <<'PY'
import glob, zipfile
z = zipfile.ZipFile(glob.glob("dl/triton-3.9.0-*.whl")[0])
for n in z.namelist():
  if n.startswith(("triton/backends/amd/include/", "triton/backends/amd/lib/")) and not n.endswith(".so"):
    z.extract(n, "hip")
PY
AMD=$T/hip/triton/backends/amd
[[ -f $AMD/lib/ockl.bc && -f $AMD/lib/ocml.bc && -d $AMD/include/hip ]] || {
  echo "rocm_toolchain: the triton wheel has no HIP headers / ockl/ocml bitcode" >&2; exit 1; }

# clang's HIP wrapper headers from Debian's clang-19 resource dir (apt-get download: no install)
(cd dl && { apt-get download -q libclang-common-19-dev >/dev/null 2>&1 ||
            { apt-get update -q >/dev/null && apt-get download -q libclang-common-19-dev >/dev/null; }; } &&
 dpkg -x libclang-common-19-dev_*.deb x)
ZI=$(python -c 'import ziglang, os; print(os.path.dirname(ziglang.__file__))')/lib/include
C19=dl/x/usr/lib/llvm-19/lib/clang/19/include
mkdir -p clangres/include
cp -r "$ZI"/. clangres/include/
cp -n "$C19"/__clang_hip_* "$C19"/__clang_cuda_* clangres/include/
cp -rn "$C19"/cuda_wrappers clangres/include/

# stand-in ROCm root: ld.lld / lld -> zig's LLD; include/hip -> triton's HIP headers; version file
mkdir -p rocm/llvm/bin rocm/include rocm/share/hip
printf '#!/bin/sh\nexec %s -m ziglang ld.lld "$@"\n' "$T/venv/bin/python" > rocm/llvm/bin/ld.lld
printf '#!/bin/sh\n[ "$1" = -flavor ] && shift 2\nexec %s -m ziglang ld.lld "$@"\n' "$T/venv/bin/python" > rocm/llvm/bin/lld
chmod +x rocm/llvm/bin/*
ln -sfn "$AMD/include/hip" rocm/include/hip
ln -sfn "$AMD/include/hsa" rocm/include/hsa
printf 'HIP_VERSION_MAJOR=7\nHIP_VERSION_MINOR=1\nHIP_VERSION_PATCH=25424\n' > rocm/share/hip/version
# The oclc control bitcode of ROCm's device libraries (oclc_abi_version_600.bc,
# oclc_isa_version_9xx.bc, oclc_wavefrontsize64_on.bc) is not in the triton wheel; ockl reads
# these constants, defined here per target as those files define them
cat > rocm/oclc_shim.h <<'H'
// stand-in for ROCm's oclc control bitcode: code object v6's ABI version, the target's ISA
// version and its wave64 width, the constants ockl reads
#if defined(__HIP_DEVICE_COMPILE__)
#define JSM_OCLC extern "C" __attribute__((weak, visibility("hidden"), used)) __constant__ const
JSM_OCLC int __oclc_ABI_version = 600;
#if defined(__gfx942__)
JSM_OCLC int __oclc_ISA_version = 9402;
#elif defined(__gfx950__)
JSM_OCLC int __oclc_ISA_version = 9500;
#else
#error "oclc_shim.h: only gfx942 and gfx950 are set up"
#endif
JSM_OCLC unsigned char __oclc_wavefrontsize64 = 1;
JSM_OCLC int __oclc_wavefrontsize_log2 = 6;
#undef JSM_OCLC
#endif
H

# mori: Python sources, C++ headers and sources, host .so files (wheels exist for cp310/cp312
# only; the sources are the same, and nothing of it is imported natively here)
python -m pip download -q --no-deps -d dl --python-version 3.10 --platform manylinux_2_35_x86_64 \
  --only-binary=:all: amd-mori==1.2.4
python -c "import glob, zipfile; zipfile.ZipFile(glob.glob('dl/amd_mori-1.2.4-cp310-*.whl')[0]).extractall('mori')"
[[ -f mori/mori/_jit-sources/include/mori/cco/cco.hpp ]] || {
  echo "rocm_toolchain: the amd-mori wheel has no include/mori/cco/cco.hpp" >&2; exit 1; }
rm -rf dl
echo "$PINS" > READY
echo "toolchain ready in $T"
