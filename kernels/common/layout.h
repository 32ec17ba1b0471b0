// The §4 landing layout (DESIGN.md): where each local expert's rows land on a rank, and where each
// source's segment of them goes. One definition for every backend: landing_layout is compiled for
// the host and (under nvcc) the device; segment_puts is host code (the cpu engine's).
#pragma once

#include <stdint.h>

#include <vector>

#include "kernels/common/mxfp8.h"  // JSM_HD

namespace jsm {

// Expert e starts at a multiple of row_align; offsets[EL] are clipped to m_cap, counts[EL] so that
// no row lies at or past m_cap. total[e] are row counts (>= 0; a negative one counts as 0); total
// may be counts itself (each is read before it is overwritten). Returns the rows that did not fit.
// In int64 throughout, for any row_align >= 1 (up to 2^16 and beyond) and m_cap up to 2^31 - 1:
// offsets never decrease, never go negative, and no two experts' rows overlap (the start stops
// growing once it has reached m_cap, so it cannot overflow either). (Index: the type of EL and
// the loop over it, int64_t on the host, int on the device as the kernels count experts.)
template <class Index>
JSM_HD int64_t landing_layout(const int32_t* total, Index EL, int64_t row_align, int64_t m_cap,
                              int32_t* offsets, int32_t* counts) {
  const int64_t align = row_align > 1 ? row_align : 1;
  const int64_t cap = m_cap > 0 ? m_cap : 0;
  int64_t off = 0, dropped = 0;
  for (Index e = 0; e < EL; ++e) {
    const int64_t want = total[e] > 0 ? int64_t(total[e]) : 0;
    const int64_t start = off < cap ? off : cap;
    const int64_t kept = want < cap - start ? want : cap - start;
    offsets[e] = int32_t(start);
    counts[e] = int32_t(kept);
    dropped += want - kept;
    if (off < cap) off += (want + align - 1) / align * align;
  }
  return dropped;
}

// The rows of a segment of n rows starting at landing row `base` that land, in an expert whose
// landed rows are [offset, offset + count) (the rest, past M_cap, overflow).
JSM_HD int64_t segment_keep(int64_t n, int64_t base, int64_t offset, int64_t count) {
  const int64_t room = offset + count - base;
  return n < room ? n : (room > 0 ? room : 0);
}

// Where source `rank` puts its segment of (destination d, local expert e), for every (d, e):
// rows [base, base + keep) of d's §4 layout (after the segments of sources < rank; keep is short of
// the segment's rows where M_cap cut it), from send-buffer rows [from, from + keep). plan holds
// every source's send counts, plan[(s * R + d) * EL + e].
struct SegmentPut {
  int64_t base, keep, from;
};
inline std::vector<SegmentPut> segment_puts(const int32_t* plan, int64_t R, int64_t EL,
                                            int64_t rank, int64_t row_align, int64_t m_cap) {
  const int32_t* mine = plan + rank * R * EL;
  std::vector<SegmentPut> puts(static_cast<size_t>(R * EL));
  std::vector<int32_t> total(static_cast<size_t>(EL)), offsets(static_cast<size_t>(EL)),
      counts(static_cast<size_t>(EL));
  int64_t from = 0;
  for (int64_t d = 0; d < R; ++d) {
    for (int64_t e = 0; e < EL; ++e) {
      total[e] = 0;
      for (int64_t s = 0; s < R; ++s) total[e] += plan[(s * R + d) * EL + e];
    }
    landing_layout(total.data(), EL, row_align, m_cap, offsets.data(), counts.data());
    for (int64_t e = 0; e < EL; ++e) {
      int64_t base = offsets[e];
      for (int64_t s = 0; s < rank; ++s) base += plan[(s * R + d) * EL + e];
      const int64_t n = mine[d * EL + e];
      puts[d * EL + e] = SegmentPut{base, segment_keep(n, base, offsets[e], counts[e]), from};
      from += n;
    }
  }
  return puts;
}

}  // namespace jsm
