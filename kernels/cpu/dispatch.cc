#include "kernels/cpu/dispatch.h"

#include <atomic>
#include <thread>

#include "kernels/cpu/window_table.h"

namespace jsm {

namespace {

using cpu_windows::wait_until;

struct Slot {
  std::vector<uint8_t> values, scales;
  std::vector<int32_t> src_rank, token, slot;
  std::vector<float> weight;
  std::vector<int32_t> plan;                          // [R src][R dst][EL]
  std::unique_ptr<std::atomic<uint64_t>[]> plan_flag;  // [R src]
  std::unique_ptr<std::atomic<uint64_t>[]> seg_flag;   // [R src][EL]

  explicit Slot(const DispatchGeometry& g)
      : values(static_cast<size_t>(g.m_cap * g.H)),
        scales(static_cast<size_t>(g.m_cap * g.H / kBlock)),
        src_rank(static_cast<size_t>(g.m_cap)),
        token(static_cast<size_t>(g.m_cap)),
        slot(static_cast<size_t>(g.m_cap)),
        weight(static_cast<size_t>(g.m_cap)),
        plan(static_cast<size_t>(g.R * g.R * g.EL)),
        plan_flag(new std::atomic<uint64_t>[size_t(g.R)]),
        seg_flag(new std::atomic<uint64_t>[size_t(g.R * g.EL)]) {
    for (int64_t i = 0; i < g.R; ++i) plan_flag[i].store(0);
    for (int64_t i = 0; i < g.R * g.EL; ++i) seg_flag[i].store(0);
  }
};

struct RankWindow {
  Slot slots[2];
  uint64_t epoch = 0;  // touched only by this rank's own calls, which run in program order
  explicit RankWindow(const DispatchGeometry& g) : slots{Slot(g), Slot(g)} {}
};

// the window table's key of a dispatch geometry (kind tag 0; the combine's is 1)
std::vector<int64_t> dispatch_key(const DispatchGeometry& g) {
  return {0, g.R, g.EL, g.H, g.m_cap, g.send_rows};
}

template <class Call>
std::string timeout_message(const Call& c, int64_t peer, const std::string& what,
                            double timeout_s) {
  return cpu_windows::timeout_message("dispatch", c.rank, peer, what, c.epoch, timeout_s, c.group,
                                      c.num_groups);
}

void copy_rows(const Slot& from, int64_t src, const LandedView& to, int64_t dst, int64_t n,
               const DispatchGeometry& g) {
  const int64_t HS = g.H / kBlock;
  std::memcpy(to.values + dst * g.H, from.values.data() + src * g.H, size_t(n * g.H));
  std::memcpy(to.scales + dst * HS, from.scales.data() + src * HS, size_t(n * HS));
  std::copy_n(from.src_rank.data() + src, n, to.src_rank + dst);
  std::copy_n(from.token.data() + src, n, to.token + dst);
  std::copy_n(from.slot.data() + src, n, to.slot + dst);
  std::copy_n(from.weight.data() + src, n, to.weight + dst);
}

void zero_outputs(const DispatchGeometry& g, const LandedView& out) {
  std::memset(out.values, 0, size_t(g.m_cap * g.H));
  std::memset(out.scales, 0, size_t(g.m_cap * g.H / kBlock));
  std::fill_n(out.src_rank, g.m_cap, -1);
  std::fill_n(out.token, g.m_cap, -1);
  std::fill_n(out.slot, g.m_cap, -1);
  std::fill_n(out.weight, g.m_cap, 0.0f);
  std::fill_n(out.expert_offsets, g.EL, 0);
  std::fill_n(out.expert_counts, g.EL, 0);
  *out.num_rows = 0;
  *out.overflow = 0;
}

// The padding rows (every row outside the experts' landed ones) and the row counts.
void finish_landed(const DispatchGeometry& g, int64_t rows, int64_t dropped,
                   const LandedView& out) {
  const int64_t HS = g.H / kBlock;
  for_each_padding_row(out.expert_offsets, out.expert_counts, g.EL, g.m_cap, [&](int64_t r) {
    std::memset(out.values + r * g.H, 0, size_t(g.H));
    std::memset(out.scales + r * HS, 0, size_t(HS));
    out.src_rank[r] = out.token[r] = out.slot[r] = -1;
    out.weight[r] = 0.0f;
  });
  *out.num_rows = int32_t(rows);
  *out.overflow = int32_t(dropped);
}

}  // namespace

std::string dispatch_cpu(int64_t slot, const DispatchGeometry& g, const DispatchOptions& opt,
                         const SendView& send, const LandedView& out) {
  const int64_t R = g.R, EL = g.EL, HS = g.H / kBlock;
  const auto call = cpu_windows::begin_call<RankWindow>("dispatch", slot, g, dispatch_key(g), opt);
  if (call.absent) {
    zero_outputs(g, out);
    return "";
  }
  if (!call.windows) return call.error;
  const int64_t rank = call.rank;  // within the group; W holds the group's windows
  auto& W = *call.windows;
  const uint64_t epoch = call.epoch;
  const int parity = call.parity();

  // 1. plan to every destination
  for (int64_t d = 0; d < R; ++d) {
    Slot& sd = W[d]->slots[parity];
    std::memcpy(sd.plan.data() + rank * R * EL, send.counts, size_t(R * EL) * sizeof(int32_t));
    sd.plan_flag[rank].store(epoch, std::memory_order_release);
  }
  // 2. every source's plan
  Slot& me = W[rank]->slots[parity];
  for (int64_t s = 0; s < R; ++s)
    if (!wait_until([&] { return me.plan_flag[s].load(std::memory_order_acquire) >= epoch; },
                    call.deadline))
      return timeout_message(call, s, "its plan (send counts)", opt.timeout_s);
  const int32_t* plan = me.plan.data();  // plan[(s * R + d) * EL + e]

  // 3. put each segment at its §4 offset, destinations starting after this rank
  const std::vector<SegmentPut> puts = segment_puts(plan, R, EL, rank, opt.row_align, g.m_cap);
  for (int64_t j = 0; j < R; ++j) {
    const int64_t d = (rank + j) % R;
    Slot& sd = W[d]->slots[parity];
    for (int64_t e = 0; e < EL; ++e) {
      const SegmentPut& q = puts[size_t(d * EL + e)];
      std::memcpy(sd.values.data() + q.base * g.H, send.values + q.from * g.H,
                  size_t(q.keep * g.H));
      std::memcpy(sd.scales.data() + q.base * HS, send.scales + q.from * HS, size_t(q.keep * HS));
      std::fill_n(sd.src_rank.data() + q.base, q.keep, int32_t(rank));
      std::copy_n(send.token + q.from, q.keep, sd.token.data() + q.base);
      std::copy_n(send.slot + q.from, q.keep, sd.slot.data() + q.base);
      std::copy_n(send.weight + q.from, q.keep, sd.weight.data() + q.base);
      sd.seg_flag[rank * EL + e].store(epoch, std::memory_order_release);
    }
  }
  // 4. every segment of every source, then read out
  for (int64_t s = 0; s < R; ++s)
    for (int64_t e = 0; e < EL; ++e)
      if (!wait_until(
              [&] { return me.seg_flag[s * EL + e].load(std::memory_order_acquire) >= epoch; },
              call.deadline))
        return timeout_message(call, s, "its rows of local expert " + std::to_string(e),
                               opt.timeout_s);
  std::vector<int32_t> total(static_cast<size_t>(EL));
  for (int64_t e = 0; e < EL; ++e) {
    total[e] = 0;
    for (int64_t s = 0; s < R; ++s) total[e] += plan[(s * R + rank) * EL + e];
  }
  const int64_t dropped =
      landing_layout(total.data(), EL, opt.row_align, g.m_cap, out.expert_offsets,
                     out.expert_counts);
  int64_t rows = 0;
  for (int64_t e = 0; e < EL; ++e) {
    copy_rows(me, out.expert_offsets[e], out, out.expert_offsets[e], out.expert_counts[e], g);
    rows += out.expert_counts[e];
  }
  finish_landed(g, rows, dropped, out);
  return "";
}

std::string dispatch_local_cpu(const DispatchGeometry& g, const DispatchOptions& opt,
                               const SendView& send, const LandedView& out) {
  if (g.R != 1) return "engine 'local' moves rows within one rank only (R = 1)";
  const int64_t EL = g.EL, H = g.H, HS = H / kBlock;
  if (opt.fault_absent_rank == 0) {
    zero_outputs(g, out);
    return "";
  }
  if (opt.fault_delay_rank == 0)  // at most timeout_s (bounded_delay_ms)
    std::this_thread::sleep_for(std::chrono::milliseconds(bounded_delay_ms(opt)));
  const int64_t dropped = landing_layout(send.counts, EL, opt.row_align, g.m_cap,
                                         out.expert_offsets, out.expert_counts);
  int64_t rows = 0, from = 0;
  for (int64_t e = 0; e < EL; ++e) {
    const int64_t at = out.expert_offsets[e], n = out.expert_counts[e];
    std::memcpy(out.values + at * H, send.values + from * H, size_t(n * H));
    std::memcpy(out.scales + at * HS, send.scales + from * HS, size_t(n * HS));
    std::fill_n(out.src_rank + at, n, 0);
    std::copy_n(send.token + from, n, out.token + at);
    std::copy_n(send.slot + from, n, out.slot + at);
    std::copy_n(send.weight + from, n, out.weight + at);
    rows += n;
    from += send.counts[e];
  }
  finish_landed(g, rows, dropped, out);
  return "";
}

}  // namespace jsm
