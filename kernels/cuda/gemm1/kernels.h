// Host launchers of the GEMM1 kernel variants, each compiled in its own translation unit; the one
// entry that picks between them is launch.h. Each only enqueues on `stream` (g complete, including
// g.scales_aligned); the caller checks cudaGetLastError().
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include "kernels/cuda/gemm1/args.h"

namespace jsm {
namespace cuda {
namespace gemm1 {

// sm90_tma_ws.cu: warp-specialised, TMA loads and wgmma (H % 128 == 0). A is loaded in boxes of
// kTmaABoxRows rows: only the tile's valid rows (rounded up) cost memory traffic, as cp.async's
// zero-fill did. map_a0, map_a1: the landed rows [m_cap, H] (fused with a dispatch: one map per
// landing-slot parity; else map_a1 is unused), boxes kTmaABoxRows x 128 B; map_b: w1 [EL * 2I, H],
// boxes BN x 128 B. Tiles of <= 64 rows split their K stages between the two consumer warpgroups.
constexpr int kTmaABoxRows = 16;
void launch_sm90_tma_ws(const Gemm1Args& g, const CUtensorMap& map_a0, const CUtensorMap& map_a1,
                        const CUtensorMap& map_b, int grid, cudaStream_t stream);

// sm90_mx_bf16_rs.cu: exact MX through bf16 wgmma, weights upcast in registers, tokens upcast once
// per call into the workspace g.xb (H % 512 == 0, I % 64 == 0). Tiles of tile_tokens tokens
// (kBf16TileTokens, with its tails in kBf16WideTileTokens and kBf16SmallTileTokens; or
// kBf16SmallTileTokens where experts hold few rows) x kBf16TileCols output columns. Its TMA maps
// (row-major byte matrices):
struct Bf16RsMaps {
  CUtensorMap xb;        // the workspace's bf16 rows [m_cap, 2H bytes]: boxes of tile_tokens rows x
                         // two 128 B parts (a stage's K halves), 128-byte swizzle
  CUtensorMap w;         // w1 [EL * 2I, H]: boxes of two parts of kBf16WeightBoxRows rows x
                         // kBf16StageK B (GEMM1: gate and up rows; GEMM2: a tile's 256 rows),
                         // 128-byte swizzle
  CUtensorMap w_scales;  // [EL * 2I, H / 32]: the same boxes' rows x 16 B
};
// kBf16StageK: K per stage of the ring, one 128-byte fp8 row of a weight box.
constexpr int kBf16TileCols = 128, kBf16StageK = 128, kBf16WeightBoxRows = 128;
// swiglu: GEMM1 (gate and up rows, SwiGLU); else GEMM2 (plain, g.I output columns; see
// SchedulerFor in the .cu). tile_tokens: kBf16TileTokens, kBf16WideTileTokens or
// kBf16SmallTileTokens (args.h). f16: the f16 pass (exact where every block's scale is within its
// row's window, mx_bf16.cuh; else it marks the expert in g.fallback and the bf16 pass after it
// redoes that expert's tiles: Gemm1Args::redo). programmatic: this launch follows another of
// this kernel's on the stream (a call's launches after its first) and may take that one's SMs as
// they come free (see the kernel in the .cu).
void launch_sm90_mx_bf16_rs(const Gemm1Args& g, const Bf16RsMaps& maps, int grid,
                            cudaStream_t stream, bool swiglu, int tile_tokens, bool f16,
                            bool programmatic);

// sm80_mma.cu: mma.sync with cp.async stages (any H % 32 == 0).
void launch_sm80_mma(const Gemm1Args& g, int grid, cudaStream_t stream);

// Each variant's kernels loaded into the current device's context (load_kernels_once,
// launch_util.h: a fused GEMM launches while a dispatch kernel spins).
cudaError_t load_sm90_tma_ws();
cudaError_t load_sm90_mx_bf16_rs();
cudaError_t load_sm80_mma();

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
