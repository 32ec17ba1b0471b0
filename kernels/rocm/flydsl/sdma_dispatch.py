"""Engine `sdma`'s device-side dispatch (DESIGN.md §6) in FlyDSL: the rows move on the SDMA copy
engines, driven from the GPU through mori's CCO device API (`DevComm(...).sdma().put(...)`,
`quiet`), between the ranks' symmetric CCO windows.

One launch per call, on its own stream next to the fused GEMM (kernels/cuda/ep/kernels.cuh
ep_sm_kernel is the model; the protocol is kernels/cuda/ep/window.h's):
  block 0   stages this rank's send counts and the call's epoch word in its window, puts the counts
            into plan[p][rank] of every peer followed by the epoch word into plan_flag[p][rank]
            there (same SDMA queue, so after the counts), and raises its own plan flag;
  all       wait (bounded) until plan_flag[p][s] has reached the epoch for every source s, then
            build the segment table of the whole plan in LDS: for every (destination d, local
            expert e) where this rank's segment lands in d (the §4 layout, rows after the
            segments of lower sources, cut at M_cap) and where it starts in the send buffer;
  block 0   lane d (one per peer) puts, in expert order, each segment's values, scales and 16-byte
            row headers at its landing offset in d's slot p, then the epoch word into
            seg_flag[p][e][rank] of d, all on queue e % num_queues (in order: the signal lands
            after the rows, the ordering mori's own trailing signal relies on); quiet at the end;
  blocks>0  copy this rank's own segments within the GPU with the CUs, each followed by a system
            release and seg_flag[p][e][rank] = epoch (block 0 does it when it is alone).
A wait that runs out records {1, peer, 0, epoch} in err (the plan) and the kernel stops.

Why flags are SDMA puts of an epoch word: mori's FlyDSL SDMA put can only raise the sender's own
completion signal (its wrapper instantiates localSignal), not a signal in the peer, so the
destination learns of a segment from a 4-byte put of the staged epoch word queued after it.

The window layout (offsets passed in; README.md lists it) follows window.h's EpWindowLayout:
per parity slot p (slot 1 at + parity_stride): values [M_cap, H], scales [M_cap, H/32],
headers [M_cap] x 16 B, plan [R src][R dst * EL] i32, plan_flag [R] u32, seg_flag [EL][R] u32;
then this rank's staging: send values [send_rows, H], send scales [send_rows, H/32], send headers
[send_rows] x 16 B (rows in send-buffer order: grouped by (destination, expert)), send counts
[R * EL] i32, epoch_word [2] u32.
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import range_constexpr
from flydsl.expr.typing import Int64

import device_ops as dev

THREADS = 256
WAVES = THREADS // 64
# R <= 64: one lane of wave 0 per peer posts its puts and reads its plan flag (the project's
# limit is kMaxRanks = 16)
MAX_SEGMENTS = 2048  # R * EL (= E) the LDS segment table holds
HEADER_BYTES = 16
COPY_UNROLL = 4  # 16-byte loads in flight per thread before their stores in the own-segment copy


@flyc.jit
def block_copy(dst, src, nbytes):
    """Workgroup-cooperative copy of nbytes (< 2^31 * 16): 16-byte accesses when both ends and the
    length allow it, else bytes (a segment of scale rows when H/32 is odd)."""
    tid = fx.thread_idx.x
    aligned = ((dst | src | fx.Int64(nbytes)) & fx.Int64(15)) == fx.Int64(0)
    if aligned:
        n16 = fx.Int32(fx.Int64(nbytes) // fx.Int64(16))
        last = fx.max(n16 - fx.Int32(1), fx.Int32(0))
        for i in range(tid, n16, fx.Int32(THREADS * COPY_UNROLL)):
            vals = []
            for k in range_constexpr(COPY_UNROLL):  # every load before the stores
                at = fx.min(i + fx.Int32(k * THREADS), last)
                vals.append(dev.load_v4i32(src + fx.Int64(at) * fx.Int64(16)))
            for k in range_constexpr(COPY_UNROLL):
                at = i + fx.Int32(k * THREADS)
                if at < n16:
                    dev.store_v4i32(dst + fx.Int64(at) * fx.Int64(16), vals[k])
    else:
        for i in range(tid, fx.Int32(nbytes), fx.Int32(THREADS)):
            dev.store_u8(dst + fx.Int64(i), dev.load_u8(src + fx.Int64(i)))


@flyc.jit
def build_segment_table(plan, send_counts, rank, R, EL, M_cap, row_align, base_lds, keep_lds,
                        from_lds):
    """Where this rank's segment of every (destination d, local expert e), index d * EL + e, lands
    and starts: kernels/common/layout.h landing_layout and segment_puts on the device, from the
    whole plan (plan[s][d * EL + e], every source's counts). The whole workgroup calls it.
      base_lds[i]: first landing row in d; keep_lds[i]: rows kept (M_cap may cut the segment);
      from_lds[i]: first row of the segment in this rank's send buffer."""
    tid = fx.thread_idx.x
    lane, wave = tid & fx.Int32(63), tid >> fx.Int32(6)
    nseg = R * EL
    # totals per (d, e) over all sources, and the rows of the sources before this rank
    for i in range(tid, nseg, fx.Int32(THREADS)):
        total = fx.Int32(0)
        before = fx.Int32(0)
        for s in range(fx.Int32(0), R, fx.Int32(1)):
            n = dev.load_i32(plan + (fx.Int64(s) * fx.Int64(nseg) + fx.Int64(i)) * fx.Int64(4))
            total = total + n
            before = before + (s < rank).select(n, fx.Int32(0))
        dev.lds_store_i32(keep_lds, i, total)
        dev.lds_store_i32(base_lds, i, before)
    fx.gpu.barrier()
    # per destination (one wave each): expert e starts at the aligned running sum of the totals,
    # clipped to M_cap; the rows kept are those before M_cap
    for d in range(wave, R, fx.Int32(WAVES)):
        running = fx.Int32(0)
        for c in range(fx.Int32(0), EL, fx.Int32(64)):
            e = c + lane
            i = d * EL + e
            total = fx.Int32(0)
            if e < EL:
                total = dev.lds_load_i32(keep_lds, i)
            aligned = (total + row_align - fx.Int32(1)) // row_align * row_align
            inclusive = dev.wave_inclusive_scan(aligned, lane)
            start = running + inclusive - aligned
            running = running + dev.wave_broadcast(inclusive, 63)
            if e < EL:
                offset = fx.min(start, M_cap)
                count = fx.min(total, M_cap - offset)
                base = offset + dev.lds_load_i32(base_lds, i)
                mine = dev.load_i32(send_counts + fx.Int64(i) * fx.Int64(4))
                keep = fx.max(fx.min(mine, offset + count - base), fx.Int32(0))
                dev.lds_store_i32(base_lds, i, base)
                dev.lds_store_i32(keep_lds, i, keep)
    # the send buffer groups rows by (destination, expert): an exclusive scan of the counts
    if wave == fx.Int32(0):
        running = fx.Int32(0)
        for c in range(fx.Int32(0), nseg, fx.Int32(64)):
            i = c + lane
            n = fx.Int32(0)
            if i < nseg:
                n = dev.load_i32(send_counts + fx.Int64(i) * fx.Int64(4))
            inclusive = dev.wave_inclusive_scan(n, lane)
            if i < nseg:
                dev.lds_store_i32(from_lds, i, running + inclusive - n)
            running = running + dev.wave_broadcast(inclusive, 63)
    fx.gpu.barrier()


def make_sdma_dispatch(cco):
    """The @flyc.jit launcher of engine sdma's dispatch; `cco` is mori.cco.device.flydsl."""
    put_args = dict(coop=cco.CoopScope.THREAD, signal=False)

    @flyc.kernel(known_block_size=[THREADS, 1, 1])
    def sdma_dispatch_kernel(dev_comm: Int64, window: Int64, send_counts: fx.Pointer,
                             epoch_counter: fx.Pointer, err: fx.Pointer, rank: fx.Int32,
                             R: fx.Int32, EL: fx.Int32, H: fx.Int32, M_cap: fx.Int32,
                             row_align: fx.Int32, num_queues: fx.Int32, timeout_ticks: Int64,
                             values_off: Int64, scales_off: Int64, headers_off: Int64,
                             plan_off: Int64, plan_flag_off: Int64, seg_flag_off: Int64,
                             parity_stride: Int64, send_values_off: Int64,
                             send_scales_off: Int64, send_headers_off: Int64,
                             send_counts_off: Int64, epoch_word_off: Int64, nb: fx.Int32):
        tid = fx.thread_idx.x
        bid = fx.block_idx.x
        sdma = cco.DevComm(dev_comm).sdma()
        local = fx.Int64(cco.Window(window).lsa_ptr(rank, 0))  # this rank's window, local VA
        counts_in = dev.addr_of(send_counts)
        err_addr = dev.addr_of(err)
        epoch = dev.first_lane_value(dev.load_relaxed(dev.addr_of(epoch_counter), dev.AGENT))
        slot = fx.Int64(epoch & fx.Int32(1)) * parity_stride
        values_p, scales_p, headers_p = values_off + slot, scales_off + slot, headers_off + slot
        plan_p, plan_flag_p, seg_flag_p = plan_off + slot, plan_flag_off + slot, seg_flag_off + slot
        epoch_word = epoch_word_off + fx.Int64(epoch & fx.Int32(1)) * fx.Int64(4)
        nseg = R * EL
        plan_bytes = fx.Int64(nseg) * fx.Int64(4)
        hs = H // fx.Int32(32)
        lds = dev.lds_arena()
        base_lds = dev.lds_alloc_i32(lds, MAX_SEGMENTS)
        keep_lds = dev.lds_alloc_i32(lds, MAX_SEGMENTS)
        from_lds = dev.lds_alloc_i32(lds, MAX_SEGMENTS)
        plan_ok = dev.lds_alloc_i32(lds, 1)

        # a plan larger than the LDS table cannot be dispatched: take no part, so that every peer's
        # bounded plan wait names this rank (the host checks R * EL <= MAX_SEGMENTS first)
        fits = nseg <= fx.Int32(MAX_SEGMENTS)
        if (bid == fx.Int32(0)) & fits:
            # 1. the counts staged where the engine reads them, this rank's own plan row, the
            #    epoch word the signal puts copy; visible to the copy engine (system release)
            for i in range(tid, nseg, fx.Int32(THREADS)):
                n = dev.load_i32(counts_in + fx.Int64(i) * fx.Int64(4))
                dev.store_i32(local + send_counts_off + fx.Int64(i) * fx.Int64(4), n)
                dev.store_i32(local + plan_p + (fx.Int64(rank) * fx.Int64(nseg) + fx.Int64(i)) * fx.Int64(4), n)
            if tid == fx.Int32(0):
                dev.store_i32(local + epoch_word, epoch)
            dev.fence_release()
            fx.gpu.barrier()
            # 2. the plan: counts, then the flag behind them on the same queue
            if tid < R:
                if tid == rank:
                    dev.store_release(local + plan_flag_p + fx.Int64(rank) * fx.Int64(4), epoch)
                else:
                    sdma.put(tid, window, plan_p + fx.Int64(rank) * plan_bytes, window,
                             send_counts_off, plan_bytes, 0, **put_args)
                    sdma.put(tid, window, plan_flag_p + fx.Int64(rank) * fx.Int64(4), window,
                             epoch_word, fx.Int64(4), 0, **put_args)

        # 3. every source's plan (bounded), shared with the whole workgroup
        if tid == fx.Int32(0):
            dev.lds_store_i32(plan_ok, 0, fx.Int32(0))
        if (tid < fx.Int32(64)) & fits:
            ok = dev.wait_flags(local + plan_flag_p, R, R, fx.Int32(0), epoch, timeout_ticks,
                                err_addr, fx.Int32(dev.ERR_PLAN))
            if tid == fx.Int32(0):
                dev.lds_store_i32(plan_ok, 0, ok)
        fx.gpu.barrier()
        if dev.lds_load_i32(plan_ok, 0) != fx.Int32(0):
            dev.fence_acquire()
            build_segment_table(local + plan_p, counts_in, rank, R, EL, M_cap, row_align,
                                base_lds, keep_lds, from_lds)
            if bid == fx.Int32(0):
                # 4. the peers' segments on the copy engines, expert by expert, each signalled
                if (tid < R) & (tid != rank):
                    d = tid
                    for e in range(fx.Int32(0), EL, fx.Int32(1)):
                        i = d * EL + e
                        base = fx.Int64(dev.lds_load_i32(base_lds, i))
                        keep = fx.Int64(dev.lds_load_i32(keep_lds, i))
                        src = fx.Int64(dev.lds_load_i32(from_lds, i))
                        queue = e % num_queues
                        if keep > fx.Int64(0):
                            sdma.put(d, window, values_p + base * fx.Int64(H), window,
                                     send_values_off + src * fx.Int64(H), keep * fx.Int64(H),
                                     queue, **put_args)
                            sdma.put(d, window, scales_p + base * fx.Int64(hs), window,
                                     send_scales_off + src * fx.Int64(hs), keep * fx.Int64(hs),
                                     queue, **put_args)
                            sdma.put(d, window, headers_p + base * fx.Int64(HEADER_BYTES), window,
                                     send_headers_off + src * fx.Int64(HEADER_BYTES),
                                     keep * fx.Int64(HEADER_BYTES), queue, **put_args)
                        sdma.put(d, window, seg_flag_p + (fx.Int64(e) * fx.Int64(R) + fx.Int64(rank)) * fx.Int64(4),
                                 window, epoch_word, fx.Int64(4), queue, **put_args)
                    sdma.quiet(d, coop=cco.CoopScope.THREAD)
            # 5. this rank's own segments with the CUs
            copiers = fx.max(nb - fx.Int32(1), fx.Int32(1))
            first_copier = (nb > fx.Int32(1)).select(fx.Int32(1), fx.Int32(0))
            if bid >= first_copier:
                for e in range(bid - first_copier, EL, copiers):
                    i = rank * EL + e
                    base = fx.Int64(dev.lds_load_i32(base_lds, i))
                    keep = fx.Int64(dev.lds_load_i32(keep_lds, i))
                    src = fx.Int64(dev.lds_load_i32(from_lds, i))
                    block_copy(local + values_p + base * fx.Int64(H),
                               local + send_values_off + src * fx.Int64(H), keep * fx.Int64(H))
                    block_copy(local + scales_p + base * fx.Int64(hs),
                               local + send_scales_off + src * fx.Int64(hs), keep * fx.Int64(hs))
                    block_copy(local + headers_p + base * fx.Int64(HEADER_BYTES),
                               local + send_headers_off + src * fx.Int64(HEADER_BYTES),
                               keep * fx.Int64(HEADER_BYTES))
                    dev.fence_release()
                    fx.gpu.barrier()
                    if tid == fx.Int32(0):
                        dev.store_release(local + seg_flag_p + (fx.Int64(e) * fx.Int64(R) + fx.Int64(rank)) * fx.Int64(4), epoch)

    @flyc.jit
    def sdma_dispatch(dev_comm: Int64, window: Int64, send_counts: fx.Pointer,
                      epoch_counter: fx.Pointer, err: fx.Pointer, rank: fx.Int32, R: fx.Int32,
                      EL: fx.Int32, H: fx.Int32, M_cap: fx.Int32, row_align: fx.Int32,
                      num_queues: fx.Int32, timeout_ticks: Int64, values_off: Int64,
                      scales_off: Int64, headers_off: Int64, plan_off: Int64, plan_flag_off: Int64,
                      seg_flag_off: Int64, parity_stride: Int64, send_values_off: Int64,
                      send_scales_off: Int64, send_headers_off: Int64, send_counts_off: Int64,
                      epoch_word_off: Int64, num_blocks: fx.Int32,
                      stream: fx.Stream = fx.Stream(None)):
        sdma_dispatch_kernel(dev_comm, window, send_counts, epoch_counter, err, rank, R, EL, H,
                             M_cap, row_align, num_queues, timeout_ticks, values_off, scales_off,
                             headers_off, plan_off, plan_flag_off, seg_flag_off, parity_stride,
                             send_values_off, send_scales_off, send_headers_off, send_counts_off,
                             epoch_word_off, num_blocks).launch(
            grid=(num_blocks, 1, 1), block=[THREADS, 1, 1], stream=stream)

    return sdma_dispatch


def placeholder_args():
    """Arguments that specialise the compile without a device (null pointers, sample scalars)."""
    ptr = lambda: flyc.from_c_void_p(fx.Uint8, None, assumed_align=16)  # noqa: E731
    return [0, 0, ptr(), ptr(), ptr(), 0, 8, 32, 7168, 1024, 128, 1, 6_000_000_000] + \
        [0] * 12 + [16]
