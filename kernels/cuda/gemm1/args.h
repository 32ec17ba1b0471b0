// The arguments of every grouped MX-fp8 GEMM1 + SwiGLU kernel (DESIGN.md §3) and the tile geometry
// they share. Plain data, host and device: the launcher (launch.cu) fills it, each kernel's TU
// reads it.
#pragma once

#include <stdint.h>

#include "kernels/cuda/ep/window.h"  // EpError, kMaxRanks

namespace jsm {
namespace cuda {
namespace gemm1 {

// A CTA tile: BM landed rows x BN output columns, i.e. BN gate + BN up weight rows (BNW).
constexpr int BM = 128, BN = 64, BNW = 2 * BN;
constexpr int kMaxExperts = 1024;  // the tile scheduler's prefix lives in shared memory
// MX blocks per pipeline stage of both kernels: 4 x 32 = 128 bytes of K per row (one SW128 atom
// row of the wgmma kernel; measured 5-20% faster than 8 for the mma.sync kernel on an H200).
constexpr int KB = 4;

// The bf16 kernel's tiles: kBf16TileTokens tokens, or kBf16SmallTileTokens where experts hold
// few rows (Gemm1Options.tile_tokens; jax_sdma_moe/layout.py GEMM_TILE_TOKENS).
constexpr int kBf16TileTokens = 128, kBf16SmallTileTokens = 32;
// With the large tile, an expert's tail (rows past its last full large tile) runs apart from its
// full tiles (RowPart): past a full tile, a tail of at most kBf16WideTileTokens - kBf16TileTokens
// rows joins that tile in one wide tile (the tail's weights are then loaded and upcast once, with
// the tile's); another tail of at most kBf16TailMax rows runs in small tiles.
constexpr int kBf16WideTileTokens = 152, kBf16TailMax = 32;
// Which rows of each expert a launch of the bf16 kernel covers (scheduler.cuh launch_rows): all of
// them, or with the large tile its full tiles (head), its wide tile, or its short tail.
enum RowPart : int { kAllRows = 0, kHeadRows, kWideRows, kTailRows };
// The row tiles of a call can number at most this, for either tile: sum over experts of
// ceil(count / 32) with the counts summing to at most m_cap. jax_sdma_moe/layout.py's
// bf16_gemm_workspace sizes the flags by the same rule.
constexpr int64_t bf16_row_tiles_bound(int64_t m_cap, int EL) {
  return m_cap / kBf16SmallTileTokens + EL;
}
// The workspace's words: one region of row-tile flags per launch of a call (the f16 pass's head,
// tail and wide launches, then the bf16 pass's one), and after them the f16 pass's fallback words
// (Gemm1Args::fallback: one per expert and one for any), all zeroed by one memset per call; then
// the f16 pass's row factors (Gemm1Args::row_factor: one per landed row, written before read).
// jax_sdma_moe/layout.py's bf16_gemm_workspace sizes them by this rule (GEMM_FLAG_REGIONS).
constexpr int kBf16FlagRegions = 4;
constexpr int64_t bf16_flag_words(int64_t m_cap, int EL) {
  return kBf16FlagRegions * bf16_row_tiles_bound(m_cap, EL) + EL + 1;
}
constexpr int64_t bf16_workspace_words(int64_t m_cap, int EL) {
  return bf16_flag_words(m_cap, EL) + m_cap;
}

struct Gemm1Args {
  const uint8_t* a;         // [m_cap, H] e4m3
  const uint8_t* a_scales;  // [m_cap, H/32] e8m0
  const int32_t* offsets;   // [EL]
  const int32_t* counts;    // [EL]
  const uint8_t* w;         // [EL, 2I, H]
  const uint8_t* w_scales;  // [EL, 2I, H/32]
  int EL;
  int64_t H, I, m_cap;
  bool has_limit;
  float limit;
  bool scales_aligned;  // H % 128 == 0: a stage's 4 scale bytes of a row are one aligned word
  uint16_t* h_bf16;    // [m_cap, I] or null
  uint8_t* h_values;   // [m_cap, I] or null (mxfp8 output)
  uint8_t* h_scales;   // [m_cap, I/32]
  // The 16-bit kernel's workspace (null: that kernel does not run): the landed rows upcast to f16
  // or bf16 once per launch, [m_cap, H] in the kernel's K order, and the flag words
  // (xb_ready_count >= bf16_workspace_words(m_cap, EL)); a launch's xb_ready is its region's.
  uint8_t* xb;
  uint32_t* xb_ready;
  int64_t xb_ready_count;
  // The head launch's region (the tail launch's borrowed units read its row tiles, scheduler.cuh).
  const uint32_t* head_ready;
  // The bf16 kernel's row split (launch_bf16_route): the RowPart of each expert's rows that this
  // launch covers.
  int row_part = kAllRows;
  // The 16-bit kernel's two passes (launch_bf16_route): the f16 one, exact where every block's
  // scale is within its row's window (mx_bf16.cuh window_bias), sets fallback[e] and
  // fallback[EL] (words after the row-tile flags, zeroed per call) where a block of expert e's
  // weights or rows is not; the bf16 launch after it (redo) then redoes those experts' tiles,
  // and returns at once where fallback[EL] is 0. row_factor[r]: 2^(landed row r's window bias),
  // written by the f16 pass's transform, copied to shared memory by its loader for the epilogue
  // (with the tile's first stage, after the row tile's flag).
  uint32_t* fallback;
  float* row_factor;
  bool redo = false;
  // Fused with a dispatch (engines ce, sm): the call's epoch is *epoch_counter (on the device, so
  // a replayed CUDA graph reads the right one); the rows are the landing slot of its parity, and
  // expert e's rows may be read once slot_arrival[parity][e * arrival_ranks + s] has reached the
  // epoch for every source s. epoch_counter null: not fused, a and a_scales hold the rows.
  const uint32_t* epoch_counter;
  const uint8_t* slot_values[2];
  const uint8_t* slot_scales[2];
  const uint32_t* slot_arrival[2];
  int arrival_ranks;
  uint64_t timeout_ns;
  EpError* err;
  // Engine local's fused call (R = 1, the bf16 kernel only): a and a_scales hold one row per token
  // (qpack token_rows), and landed row r is their row source_rows[r] (its token: the landed
  // headers). Null: a and a_scales hold the landed rows.
  const int32_t* source_rows;
  // set by resolve_slot in the kernel
  const uint32_t* arrival;  // null: nothing to wait for
  uint32_t epoch;
};

}  // namespace gemm1
}  // namespace cuda
}  // namespace jsm
