#!/usr/bin/env bash
# The ROCm backend's offline check (no AMD GPU, no ROCm install): sets up the toolchain
# (tools/rocm_toolchain.sh, cached), builds every ROCm code object for gfx942 and gfx950 (the HIP
# stages and engine sdma's kernels, mori's CCO device bitcode, the FlyDSL kernels of
# kernels/rocm/flydsl/ when that folder has its build.py), links the extension against stub HIP
# and mori libraries (tools/rocm_build.py), registers its FFI targets for "ROCM" and lowers stage1
# for platform "rocm" under shard_map with engines local, xla and sdma, printing the custom-call
# targets (tools/rocm_lower.py). Exits non-zero on any failure. Nothing here runs on a GPU.
# Usage: bash tools/rocm_check.sh   (build tree: $JSM_ROCM_BUILD, default build/rocm)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
t0=$SECONDS
bash tools/rocm_toolchain.sh
T=${JSM_ROCM_TOOLCHAIN:-$HOME/.cache/jsm-rocm}
# shellcheck disable=SC1091
. "$T/venv/bin/activate"
B=$(mkdir -p "${JSM_ROCM_BUILD:-build/rocm}" && cd "${JSM_ROCM_BUILD:-build/rocm}" && pwd)
rm -rf "$B"/*
export PATH=$T/rocm/llvm/bin:$PATH
M=$T/mori/mori/_jit-sources
AMD=$T/hip/triton/backends/amd

echo "== mori CCO device bitcode (for the FlyDSL SDMA put kernel)"
mkdir -p "$B/mori"
for a in gfx942 gfx950; do
  python -m ziglang clang -x hip -nogpulib -resource-dir "$T/clangres" --rocm-path="$T/rocm" \
    -mcode-object-version=6 -D__HIP_PLATFORM_AMD__ -c --cuda-device-only -emit-llvm -fgpu-rdc \
    --offload-arch=$a -std=c++17 -O2 -DHIP_ENABLE_WARP_SYNC_BUILTINS -DBUILD_CCO_SDMA=1 \
    -I"$M" -I"$M/include" -I"$M/src" -I"$M/3rdparty/spdlog/include" \
    -I"$M/3rdparty/msgpack-c/include" "$M/src/cco/device/cco_device_wrapper.cpp" \
    -o "$B/mori/libmori_cco_device.$a.bc"
  # the bitcode's target: compiled on to an object, it must be an AMDGPU ELF for $a
  python -m ziglang clang -target amdgcn-amd-amdhsa -nogpulib -mcpu=$a -c "$B/mori/libmori_cco_device.$a.bc" \
    -o "$B/mori/libmori_cco_device.$a.o"
  python - "$B/mori/libmori_cco_device.$a.o" $a <<'PY'
import sys
sys.path.insert(0, "tools")
from rocm_build import amdgpu_target
got = amdgpu_target(open(sys.argv[1], "rb").read())
assert got == sys.argv[2], f"{sys.argv[1]}: {got}, not {sys.argv[2]}"
print(f"  {got}  mori/libmori_cco_device.{got}.bc  (LLVM bitcode; compiled on: EM_AMDGPU {got})")
PY
done

FLY=""
if [[ -f kernels/rocm/flydsl/build.py ]]; then
  echo "== FlyDSL kernels (kernels/rocm/flydsl/build.py)"
  FLY=$B/flydsl
  for a in gfx942 gfx950; do
    # FlyDSL links with the stand-in ROCm root's ld.lld (zig's LLD); mori's FlyDSL bindings link
    # the CCO bitcode built above (the unpacked wheel holds their Python sources)
    ROCM_PATH=$T/rocm FLYDSL_RUNTIME_CACHE_DIR=$B/flydsl-cache \
      python kernels/rocm/flydsl/build.py --arch $a --out "$FLY" \
      --mori-cco-bc "$B/mori/libmori_cco_device.$a.bc" --mori-python "$T/mori"
  done
else
  echo "== FlyDSL kernels: kernels/rocm/flydsl/build.py is not in this tree; not built"
fi

echo "== HIP code objects, host objects, the extension against stub libraries"
python tools/rocm_build.py --toolchain "$T" --out "$B" ${FLY:+--flydsl "$FLY"} > "$B/build.log" 2>&1 ||
  { tail -40 "$B/build.log"; echo "rocm_check: the build failed (log: $B/build.log)"; exit 1; }
sed -n '/^AMDGPU code objects/,$p' "$B/build.log"

echo "== registration for ROCM and lowering of stage1 for rocm"
(cd /tmp && PYTHONPATH="$B/site" JAX_PLATFORMS=cpu python "$REPO/tools/rocm_lower.py" --register)
echo "rocm_check: passed in $((SECONDS - t0)) s (compiled and lowered; nothing ran on an AMD GPU)"
