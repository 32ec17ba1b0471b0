// GEMM1's host entry (launch.h): the kernel choice and the TMA tensor maps of the wgmma kernel.
#include "kernels/cuda/gemm1/launch.h"

#include <cuda.h>  // CUtensorMap (the encoder comes from the driver at run time)

#include "kernels/cuda/gemm1/kernels.h"
#include "kernels/cuda/launch_util.h"
#include "kernels/common/gpu_stage2.h"
#include "kernels/common/gpu_stages.h"

namespace jsm {
namespace cuda {
namespace gemm1 {
namespace {

std::string last_error(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return "";
  return std::string("jax_sdma_moe ") + what + ": " + cudaGetErrorString(err);
}

bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// A stage's KB scale bytes of a row can be one cp.async when rows of scales keep them aligned.
bool scales_aligned(const Gemm1Args& g, int kb) {
  return (g.H / kBlock) % kb == 0 && aligned(g.a_scales, kb) && aligned(g.w_scales, kb);
}

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// A TMA box's parts: `box` of the `count` copies of the tensor `stride` bytes apart (a third
// dimension), landing one after the other in shared memory: one TMA instruction where there were
// `box` (the default: one part, a 2D map).
struct BoxParts {
  int64_t count = 1, stride = 0;
  uint32_t box = 1;
};

// A TMA map of a row-major byte matrix [rows, cols]: boxes of box_rows x box_bytes (128: 128-byte
// swizzle, the K-major layout wgmma reads; 64: 64-byte swizzle; 16: none), zeros outside.
std::string tensor_map(CUtensorMap* map, const void* base, int64_t cols, int64_t rows,
                       uint32_t box_rows, uint32_t box_bytes = 128, BoxParts parts = {}) {
  static EncodeTiledFn encode = driver_function<EncodeTiledFn>("cuTensorMapEncodeTiled");
  if (!encode) return "jax_sdma_moe gemm1: no cuTensorMapEncodeTiled";
  const cuuint32_t rank = parts.count > 1 ? 3 : 2;
  const cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(parts.count)};
  const cuuint64_t strides[2] = {cuuint64_t(cols), cuuint64_t(parts.stride)};
  const cuuint32_t box[3] = {box_bytes, box_rows, parts.box};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, rank, const_cast<void*>(base),
                            dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            box_bytes == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                            : box_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                              : CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return "jax_sdma_moe gemm1: cuTensorMapEncodeTiled failed (CUresult " +
           std::to_string(int(r)) + ")";
  return "";
}

// The 16-bit kernel's operands: TMA needs 16-byte aligned bases; the f16 pass reads a row's scale
// bytes 16 at a time (mx_bf16.cuh top_scale; a row's H / 32 bytes are a multiple of 16).
bool bf16_operands_aligned(const void* w_scales, const void* rows, const void* scales) {
  return aligned(w_scales, 16) && aligned(rows, 16) && aligned(scales, 16);
}

// The 16-bit kernel (both GEMMs; swiglu: GEMM1) with its TMA maps over the workspace's rows
// and the weights [weight_rows, H]: the f16 pass, then the bf16 one for the experts where it met a
// block outside its row's window. One memset zeroes every launch's flag region and the fallback
// words.
std::string launch_bf16_route(Gemm1Args g, int64_t weight_rows, int grid,
                              cudaStream_t stream, bool swiglu, int64_t tile_tokens) {
  if (tile_tokens != kBf16TileTokens && tile_tokens != kBf16SmallTileTokens)
    return "jax_sdma_moe GEMM: tile_tokens must be " + std::to_string(kBf16TileTokens) + " or " +
           std::to_string(kBf16SmallTileTokens) + ", got " + std::to_string(tile_tokens);
  if (g.xb_ready_count < bf16_workspace_words(g.m_cap, g.EL))
    return "jax_sdma_moe GEMM: the workspace has too few words";
  uint32_t* const flags = g.xb_ready;
  const int64_t region = bf16_row_tiles_bound(g.m_cap, g.EL);
  g.fallback = flags + kBf16FlagRegions * region;
  g.row_factor = reinterpret_cast<float*>(g.fallback + g.EL + 1);
  g.head_ready = flags;  // the first launch's region (the tail launch's borrowed units)
  Bf16RsMaps maps;
  // A tile's weight rows (and their scales) in one TMA box a stage, two parts of
  // kBf16WeightBoxRows rows part_rows apart: GEMM1's gate and up rows (I apart), GEMM2's 256 rows
  // (128 apart). The map's rows end part_rows before the tensor's, so a part-1 row stays in it; the
  // part-0 rows a tile uses end there too (GEMM1: gate rows, below their expert's up rows; GEMM2:
  // whole 256-row tiles, which launch_gemm2 routes here only).
  const int64_t sb = g.H / kBlock;
  const int64_t part_rows = swiglu ? g.I : kBf16WeightBoxRows;
  const int64_t rows = weight_rows - part_rows;
  std::string err = tensor_map(&maps.w, g.w, g.H, rows, kBf16WeightBoxRows, kBf16StageK,
                               BoxParts{2, part_rows * g.H, 2});
  if (err.empty())
    err = tensor_map(&maps.w_scales, g.w_scales, sb, rows, kBf16WeightBoxRows, 16,
                     BoxParts{2, part_rows * sb, 2});
  if (!err.empty()) return err;
  // The large tile leaves each expert's short tail to a launch of its own (args.h RowPart): as a
  // 128-token tile a tail costs what a full one does (the weights' loads and upcasts are per
  // tile, not per row); joined to the expert's last full tile in a wide one it costs the wide
  // tile's extra tokens; in a 32-token tile, little more than its weights' stream from HBM.
  // The bf16 pass (rare: a block outside its row's window) takes every row in one launch of the
  // small tile, whose bytes are the same as any tile width's.
  struct Part {
    RowPart rows;
    int tokens;
    bool f16;
  };
  // The tail launch right after the head one: it runs the head launch's last partial wave in
  // small units (scheduler.cuh head_items_left), on the SMs the head launch's CTAs leave.
  const Part split[4] = {{kHeadRows, kBf16TileTokens, true},
                         {kTailRows, kBf16SmallTileTokens, true},
                         {kWideRows, kBf16WideTileTokens, true},
                         {kAllRows, kBf16SmallTileTokens, false}};
  const Part all[2] = {{kAllRows, int(tile_tokens), true},
                       {kAllRows, kBf16SmallTileTokens, false}};
  constexpr int n_split = sizeof(split) / sizeof(split[0]), n_all = sizeof(all) / sizeof(all[0]);
  static_assert(n_split == kBf16FlagRegions && n_all <= n_split, "a flag region per launch");
  const bool large = tile_tokens == kBf16TileTokens;
  const Part* parts = large ? split : all;
  cudaMemsetAsync(flags, 0, size_t(bf16_flag_words(g.m_cap, g.EL)) * sizeof(uint32_t), stream);
  for (int i = 0; i < (large ? n_split : n_all) && err.empty(); ++i) {
    const Part& part = parts[i];
    g.row_part = part.rows;
    g.redo = !part.f16;  // the experts the f16 pass marked in g.fallback, if any
    g.xb_ready = flags + i * region, g.xb_ready_count = region;
    // the rows' map: boxes of the launch's tile width (the one before's where it is the same)
    if (i == 0 || part.tokens != parts[i - 1].tokens)
      // and a stage's two K halves (128 bytes each) in one box: parts 128 bytes apart
      err = tensor_map(&maps.xb, g.xb, 2 * g.H, g.m_cap, part.tokens, 128,
                       BoxParts{2 * g.H / 128, 128, 2});
    if (err.empty())
      launch_sm90_mx_bf16_rs(g, maps, grid, stream, swiglu, part.tokens, part.f16, i > 0);
  }
  return err;
}

}  // namespace

std::string launch_gemm1(Gemm1Args g, int grid, cudaStream_t stream, const Gemm1Options& opt) {
  g.has_limit = opt.has_limit;
  g.limit = opt.swiglu_limit;
  const int64_t row_bytes = g.h_bf16 ? g.I * 2 : g.I;
  const int64_t scale_bytes = g.h_bf16 ? 0 : g.I / kBlock;
  gpu::launch_zero_padding_rows(g.offsets, g.counts, g.EL, g.m_cap, row_bytes,
                                g.h_bf16 ? reinterpret_cast<uint8_t*>(g.h_bf16) : g.h_values,
                                g.h_scales, scale_bytes, stream);
  std::string err = last_error("gemm1 padding");
  if (!err.empty() || g.m_cap == 0) return err;
  g.scales_aligned = scales_aligned(g, KB);
  const uint8_t* rows0 = g.epoch_counter ? g.slot_values[0] : g.a;
  const uint8_t* rows1 = g.epoch_counter ? g.slot_values[1] : g.a;
  const uint8_t* scales0 = g.epoch_counter ? g.slot_scales[0] : g.a_scales;
  const uint8_t* scales1 = g.epoch_counter ? g.slot_scales[1] : g.a_scales;
  // TMA: 16-byte aligned bases and row strides (H / 32 a multiple of 16)
  if (g.H % 512 == 0 && g.I % 64 == 0 && g.xb != nullptr &&
      bf16_operands_aligned(g.w_scales, rows0, scales0) &&
      bf16_operands_aligned(g.w_scales, rows1, scales1)) {
    err = launch_bf16_route(g, int64_t(g.EL) * 2 * g.I, grid, stream, /*swiglu=*/true,
                            opt.tile_tokens);
    if (!err.empty()) return err;
  } else if (g.source_rows) {  // only the bf16 kernel reads rows through a row map
    return "jax_sdma_moe gemm1: rows by token (engine local's fused call) need the bf16 kernel "
           "(H % 512 == 0, I % 64 == 0, aligned rows and scales); use dispatch then "
           "gemm1";
  } else if (g.H % 128 == 0) {
    CUtensorMap map_a0, map_a1, map_b;
    err = tensor_map(&map_a0, rows0, g.H, g.m_cap, kTmaABoxRows);
    if (err.empty()) err = tensor_map(&map_a1, rows1, g.H, g.m_cap, kTmaABoxRows);
    if (err.empty()) err = tensor_map(&map_b, g.w, g.H, int64_t(g.EL) * 2 * g.I, BN);
    if (!err.empty()) return err;
    launch_sm90_tma_ws(g, map_a0, map_a1, map_b, grid, stream);
  } else {
    launch_sm80_mma(g, grid, stream);
  }
  return last_error("gemm1");
}

std::string load_gemm_kernels() {
  cudaError_t e = load_sm90_mx_bf16_rs();
  if (e == cudaSuccess) e = load_sm90_tma_ws();
  if (e == cudaSuccess) e = load_sm80_mma();
  if (e == cudaSuccess) e = gpu::load_zero_padding_rows();
  return e == cudaSuccess ? "" : std::string("jax_sdma_moe: loading the GEMM kernels: ") +
                                     cudaGetErrorString(e);
}

std::string launch_gemm2(Gemm1Args g, int grid, cudaStream_t stream, int64_t tile_tokens) {
  g.has_limit = false;
  gpu::launch_zero_padding_rows(g.offsets, g.counts, g.EL, g.m_cap, g.I * 2,
                                reinterpret_cast<uint8_t*>(g.h_bf16), nullptr, 0, stream);
  std::string err = last_error("gemm2 padding");
  if (!err.empty() || g.m_cap == 0) return err;
  // the 16-bit kernel's tiles of GEMM2 are whole boxes of two weight parts (launch_bf16_route)
  if (g.H % 512 == 0 && g.I % (2 * kBf16WeightBoxRows) == 0 && g.xb != nullptr &&
      bf16_operands_aligned(g.w_scales, g.a, g.a_scales)) {
    err = launch_bf16_route(g, int64_t(g.EL) * g.I, grid, stream, /*swiglu=*/false, tile_tokens);
    if (!err.empty()) return err;
  } else {  // the correctness path (kernels/common/gpu_stage2.h), shared with ROCm
    gpu::launch_generic_gemm2({g.a, g.a_scales, g.offsets, g.counts, g.w, g.w_scales, g.EL, g.I,
                               g.H, g.m_cap, g.h_bf16}, stream);
  }
  return last_error("gemm2");
}

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
