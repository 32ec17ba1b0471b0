"""Grouped MX-fp8 GEMM1 + SwiGLU over the landed rows (DESIGN.md §3, §4) in FlyDSL, for gfx950
(MI355X) and gfx942 (MI300X): the ROCm twin of kernels/cuda/gemm1/ (args.h, scheduler.cuh).

    h[r, :] = SwiGLU(A[r, :] @ W[e, 0:I, :]^T, A[r, :] @ W[e, I:2I, :]^T)   for r in expert e's rows

The same kernel without SwiGLU is GEMM2 (make_gemm(arch, swiglu=False), as on CUDA): W [EL, I, H]
with I the output columns (the model's hidden size) and H the depth (the expert's intermediate
size), y[r, :] = A[r, :] @ W[e]^T in bf16, tiles of 2 * BN plain columns.

A: a_values [M_cap, H] OCP e4m3fn bytes + a_scales [M_cap, H/32] E8M0; rows of local expert e are
[expert_offsets[e], + expert_counts[e]). W: w_values [EL, 2I, H] (rows [0, I) gate, [I, 2I) up)
+ w_scales [EL, 2I, H/32]. h: [M_cap, I] bf16 (RNE), or MX-fp8 along I (values [M_cap, I] +
scales [M_cap, I/32], §3 on the float32 result); rows outside every expert are written 0 when
zero_padding is set (else the caller zeroes them).

Arithmetic (the §3 contract: exact products of dequantised values, float32 accumulation):
  gfx950  v_mfma_scale_f32_16x16x128_f8f6f4 with E8M0 block-32 scales: the MX arithmetic is the
          instruction's own (OCP e4m3fn operands, one scale byte per lane and 32 values).
  gfx942  bf16 route. Its fp8 MFMA reads e4m3fnuz, and a fnuz MFMA would need a float32 promotion
          of every 16x16x32 block with a row and a column scale per output (4 FMAs + scale gathers
          per block): about as much VALU work as this upcast, for an MFMA only twice as fast.
          Instead each e4m3fn byte x scale is dequantised *exactly* to bf16 (4 significant bits;
          exact for scales 14 <= e <= 240, the §3 quantiser makes e >= 85), then
          v_mfma_f32_16x16x16_bf16 multiplies exactly and accumulates in float32. The bytes are
          read through the hardware's fnuz converter, which gives exactly half of the e4m3fn value
          for every byte but 0x80 (-0 in e4m3fn, NaN in fnuz: cleared first); the factor 2 goes
          into the scale. NaN blocks (scale 0xFF) get a NaN scale.

Tiling: a tile is BM landed rows x BN output columns (BN gate + BN up weight rows) of one expert;
256 threads = 4 waves as 2 x 2, a wave owns 64 rows x 32 columns (4 x 2 MFMA 16x16 blocks for gate
and the same for up, so gate and up of one output sit in the same lane for the epilogue). No LDS:
each lane loads its MFMA operands straight from memory through buffer resources (reads past a
tile's valid rows or past the weights return 0), the next K step's loads in flight while the
MFMAs of this one run. Persistent: `num_blocks` workgroups walk the work items (expert, row tile,
column tile) in expert order, block b taking items b, b + num_blocks, ...

Fused with engine sdma (epoch_counter != null): the call's epoch is *epoch_counter, the rows are
the landing slot of its parity, and before a block's first tile of expert e wave 0 waits (bounded
by timeout_ticks of the wall clock) until arrival[p][e * R + s] - epoch >= 0 (int32) for every
source s, recording {2, peer, expert, epoch} into err and giving up on expiry, as
kernels/cuda/gemm1/scheduler.cuh's wait_arrival does.
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import arith as mlir_arith
from flydsl._mlir.dialects import llvm
from flydsl.expr import arith, const_expr, range_constexpr, rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

import device_ops as dev

BM = 128  # landed rows per tile (the CUDA kernels' BM)
BN = 64  # output columns per tile: BN gate + BN up weight rows
THREADS = 256
WAVE_M, WAVE_N = 64, 32  # a wave's share of the tile (2 x 2 waves)
MSUB, NSUB = WAVE_M // 16, WAVE_N // 16  # 16 x 16 MFMA blocks per wave (rows; gate or up cols)
NOPS = MSUB + 2 * NSUB  # operands a lane loads per K step: 4 row blocks, 2 gate + 2 up col blocks
NACC = MSUB * 2 * NSUB  # accumulators: acc[i * 4 + jj], jj 0..1 gate, 2..3 up
MX_BLOCK = 32


class ArchPlan:
    """What differs between the two archs: how far a K step goes and how it is multiplied."""

    def __init__(self, arch):
        self.arch = arch
        # gfx950: a lane holds 32 contiguous K bytes (one MX block) of a 128-K step;
        # gfx942: a lane holds 16 contiguous K bytes (half an MX block) of a 64-K step.
        self.kstep = 128 if arch == "gfx950" else 64
        self.lane_k_bytes = 32 if arch == "gfx950" else 16
        self.blocks_per_step = self.kstep // MX_BLOCK


def _f32_from_bits(bits):
    return fx.Float32(llvm.BitcastOp(T.f32, fx.Int32(bits).ir_value()).result)


def _bits_of_f32(value):
    return fx.Int32(llvm.BitcastOp(T.i32, fx.Float32(value).ir_value()).result)


# ----------------------------------------------------------------------------------------------
# one K step: loads and MFMAs
# ----------------------------------------------------------------------------------------------
def _lane_valid_k(plan, step, hb, lane_group):
    """Whether this lane's K bytes of `step` lie inside H (only a tail step can fail this)."""
    if plan.arch == "gfx950":
        block = step * fx.Int32(plan.blocks_per_step) + lane_group
    else:
        block = step * fx.Int32(plan.blocks_per_step) + (lane_group >> fx.Int32(1))
    return block < hb


def _load_step(plan, rsrcs, voffs, srsrcs, svoffs, step, valid=None):
    """This lane's operand bytes and scale bytes of every operand for K step `step`.

    Returns NOPS data vectors (8 x i32 on gfx950, 4 x i32 on gfx942) then NOPS scale bytes. A lane
    whose K bytes lie past H (valid false) reads 0 (offset out of range)."""
    soff = step * fx.Int32(plan.kstep)
    ssoff = step * fx.Int32(plan.blocks_per_step)
    data, scales = [], []
    for o in range_constexpr(NOPS):
        voff, svoff = voffs[o], svoffs[o]
        if const_expr(valid is not None):
            voff = valid.select(voff, fx.Int32(dev.OUT_OF_RANGE))
            svoff = valid.select(svoff, fx.Int32(dev.OUT_OF_RANGE))
        lo = dev.buffer_load_v4i32(rsrcs[o], voff, soff)
        if const_expr(plan.arch == "gfx950"):
            hi = dev.buffer_load_v4i32(rsrcs[o], voff + fx.Int32(16), soff)
            data.append(Vec.from_elements([lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]],
                                          fx.Int32))
        else:
            data.append(lo)
        scales.append(dev.buffer_load_u8(srsrcs[o], svoff, ssoff))
    return data + scales


def _mma_step_gfx950(acc, ops):
    """16 scaled MFMAs: acc[i][jj] += A_i (16 x 128) . B_jj^T with their E8M0 block scales."""
    data, scales = ops[:NOPS], ops[NOPS:]
    out = []
    for i in range_constexpr(MSUB):
        for jj in range_constexpr(2 * NSUB):
            b = MSUB + jj
            out.append(Vec(rocdl.mfma_scale_f32_16x16x128_f8f6f4(
                ir.VectorType.get([4], T.f32),
                [data[i], data[b], acc[i * 2 * NSUB + jj], 0, 0, 0, scales[i], 0, scales[b]])))
    return out


def _fnuz_scale(e8m0):
    """The float32 2^(e - 126) that turns an fnuz-read e4m3fn byte into its dequantised value
    (2^(e-127) times the factor 2 between the formats); NaN for the MX NaN scale 0xFF."""
    bits = (e8m0 + fx.Int32(1)) << fx.Int32(23)
    return _f32_from_bits((e8m0 == fx.Int32(255)).select(fx.Int32(0x7FC00000), bits))


def _fnuz_pair(word, high_half):
    """The gfx942 converter (v_cvt_pk_f32_fp8, e4m3fnuz): bytes 0, 1 (or 2, 3) of word as floats."""
    return Vec(rocdl.cvt_pk_f32_fp8(ir.VectorType.get([2], T.f32), word, high_half))


def _fp8x4_to_bf16x4(word, scale, decode_pair=_fnuz_pair):
    """Four e4m3fn bytes (little-endian K order) times scale, exactly, as two words of bf16 pairs.

    0x80 (-0) is NaN to the fnuz converter: bytes whose magnitude bits are all 0 lose their sign
    bit first (SWAR: keep = 0xFF where the byte's low 7 bits are non-zero, else 0x7F).
    decode_pair: the fnuz decoder (check_arith.py runs this on the host with a software one)."""
    low7 = word & fx.Int32(0x7F7F7F7F)
    word = word & ((low7 + fx.Int32(0x7F7F7F7F)) | low7 | fx.Int32(0x7F7F7F7F))
    out = []
    for high_half in (False, True):
        pair = decode_pair(word, high_half)
        x0 = _bits_of_f32(fx.Float32(pair[0]) * scale)
        x1 = _bits_of_f32(fx.Float32(pair[1]) * scale)
        # the products are exact in bf16: its bits are the float's high half
        out.append(((x0 >> fx.Int32(16)) & fx.Int32(0xFFFF)) | (x1 & fx.Int32(-65536)))
    return out


def _mma_step_gfx942(acc, ops):
    """Dequantise this lane's 16 bytes of each operand to bf16, then 4 x 16 bf16 MFMAs (K = 16
    each). MFMA q takes bytes [4q, 4q + 4) of every lane's 16: A and B use the same permutation of
    K inside the step, so the dot products are unchanged (and one lane's 16 bytes share a scale)."""
    data, scales = ops[:NOPS], ops[NOPS:]
    conv = []
    for o in range_constexpr(NOPS):
        scale = _fnuz_scale(scales[o])
        words = []
        for q in range_constexpr(4):
            words.append(Vec.from_elements(_fp8x4_to_bf16x4(data[o][q], scale), fx.Int32)
                         .bitcast(fx.Int16))
        conv.append(words)
    out = list(acc)
    for q in range_constexpr(4):
        for i in range_constexpr(MSUB):
            for jj in range_constexpr(2 * NSUB):
                k = i * 2 * NSUB + jj
                out[k] = Vec(rocdl.mfma_f32_16x16x16bf16_1k(
                    ir.VectorType.get([4], T.f32), [conv[i][q], conv[MSUB + jj][q], out[k]]))
    return out


# ----------------------------------------------------------------------------------------------
# the epilogue: SwiGLU, then bf16 RNE or the §3 MX-fp8 quantisation along I; valid rows/cols only
# ----------------------------------------------------------------------------------------------
def _swiglu(g, u, has_limit, limit):
    """silu(g) * u, or silu(min(g, L)) * clamp(u, -L, L); NaN propagates (minimumf/maximumf)."""
    g_lim = arith.minimumf(g, limit)
    u_lim = arith.maximumf(arith.minimumf(u, limit), -limit)
    g = has_limit.select(fx.Float32(g_lim), g)
    u = has_limit.select(fx.Float32(u_lim), u)
    return g / (fx.Float32(1.0) + fx.math.exp(-g)) * u


def _f32_to_e4m3fn(x):
    """float32 -> e4m3fn byte, round to nearest even, subnormals; >= 464 and NaN give NaN with
    the sign: kernels/common/mxfp8.h f32_to_e4m3fn, bit for bit."""
    b = _bits_of_f32(x)
    sign = (b >> fx.Int32(24)) & fx.Int32(0x80)
    a = b & fx.Int32(0x7FFFFFFF)
    # below 2^-6: the subnormal quantum 2^-9 (x * 512 is exact; roundeven is RNE)
    q = fx.Float32(llvm.call_intrinsic(T.f32, "llvm.roundeven.f32",
                                       [(_f32_from_bits(a) * fx.Float32(512.0)).ir_value()], [], []))
    sub = sign | fx.Int32(mlir_arith.FPToSIOp(T.i32, q.ir_value()).result)
    r = a + fx.Int32(0x7FFFF) + ((a >> fx.Int32(20)) & fx.Int32(1))  # RNE to 3 mantissa bits
    norm = sign | (((r >> fx.Int32(23)) - fx.Int32(120)) << fx.Int32(3)) | ((r >> fx.Int32(20)) & fx.Int32(7))
    out = (a < fx.Int32(0x3C800000)).select(sub, norm)
    return (a >= fx.Int32(0x43E80000)).select(sign | fx.Int32(0x7F), out)  # also NaN (a > inf)


def _e8m0_for_amax(amax):
    """§3 steps 1-3: bits(max(amax, 1e-10) * f32(1/448)); exponent, +1 if the mantissa is not 0."""
    w = _bits_of_f32(fx.max(amax, fx.Float32(1e-10)) * _f32_from_bits(fx.Int32(0x3B124925)))
    return ((w >> fx.Int32(23)) & fx.Int32(0xFF)) + ((w & fx.Int32(0x7FFFFF)) != fx.Int32(0)).select(
        fx.Int32(1), fx.Int32(0))


def _group16_max(value, lane):
    """Max of a non-negative float over the 16 lanes of this lane's row group (xor butterfly)."""
    v = value
    for k in (1, 2, 4, 8):
        other = dev.wave_broadcast(_bits_of_f32(v), lane ^ fx.Int32(k))
        v = fx.max(v, _f32_from_bits(other))
    return v


def _group16_any(flag, lane):
    """1 if `flag` (0/1) is set in any lane of this lane's row group of 16."""
    v = flag
    for k in (1, 2, 4, 8):
        v = v | dev.wave_broadcast(v, lane ^ fx.Int32(k))
    return v


def _abs_f32(x):
    return _f32_from_bits(_bits_of_f32(x) & fx.Int32(0x7FFFFFFF))


def _is_finite(x):
    return (_bits_of_f32(x) & fx.Int32(0x7F800000)) != fx.Int32(0x7F800000)


@flyc.jit
def _store_tile(acc, h, h_scales, mx_out, row0, rows, n0, I, has_limit, limit, wm, wn, lane,
                lane16, lane_group):
    """Lane (lane_group, lane16) holds rows lane_group * 4 + v of each 16-row block i and column
    lane16 of each 16-column block j, gate and up alike. MX-fp8: a row's 32 columns of this wave
    (one §3 block: the wave's columns start at a multiple of 32) are its 16 lanes x 2 blocks j."""
    col0 = n0 + wn * fx.Int32(WAVE_N)
    for i in range_constexpr(MSUB):
        for v in range_constexpr(4):
            r = wm * fx.Int32(WAVE_M) + fx.Int32(i * 16) + lane_group * fx.Int32(4) + fx.Int32(v)
            row = fx.Int64(row0 + r)
            out = [_swiglu(fx.Float32(acc[i * 2 * NSUB + j][v]),
                           fx.Float32(acc[i * 2 * NSUB + NSUB + j][v]), has_limit, limit)
                   for j in range(NSUB)]
            if mx_out:
                amax = _group16_max(fx.max(_abs_f32(out[0]), _abs_f32(out[1])), lane)
                bad = (_is_finite(out[0]) & _is_finite(out[1])).select(fx.Int32(0), fx.Int32(1))
                nonfinite = _group16_any(bad, lane) != fx.Int32(0)
                e = _e8m0_for_amax(fx.Float32(amax))
                mul = _f32_from_bits((fx.Int32(254) - e) << fx.Int32(23))
                if (r < rows) & (col0 < I):
                    for j in range_constexpr(NSUB):
                        y = nonfinite.select(fx.Int32(0x7F), _f32_to_e4m3fn(out[j] * mul))
                        col = col0 + fx.Int32(j * 16) + lane16
                        dev.store_u8(h + row * fx.Int64(I) + fx.Int64(col), y)
                    if lane16 == fx.Int32(0):
                        dev.store_u8(h_scales + row * fx.Int64(I // fx.Int32(32)) + fx.Int64(col0 // fx.Int32(32)),
                                     nonfinite.select(fx.Int32(0xFF), e))
            else:
                for j in range_constexpr(NSUB):
                    col = col0 + fx.Int32(j * 16) + lane16
                    if (r < rows) & (col < I):
                        dev.store_bf16(h + (row * fx.Int64(I) + fx.Int64(col)) * fx.Int64(2),
                                       out[j].to(fx.BFloat16))


# ----------------------------------------------------------------------------------------------
# one tile
# ----------------------------------------------------------------------------------------------
@flyc.jit
def _store_plain_tile(acc, h, row0, rows, n0, I, wm, wn, lane16, lane_group):
    """GEMM2's epilogue: the wave's 4 column blocks are 64 consecutive output columns, bf16
    (RNE)."""
    col0 = n0 + wn * fx.Int32(2 * WAVE_N)
    for i in range_constexpr(MSUB):
        for v in range_constexpr(4):
            r = wm * fx.Int32(WAVE_M) + fx.Int32(i * 16) + lane_group * fx.Int32(4) + fx.Int32(v)
            row = fx.Int64(row0 + r)
            for jj in range_constexpr(2 * NSUB):
                col = col0 + fx.Int32(jj * 16) + lane16
                if (r < rows) & (col < I):
                    dev.store_bf16(h + (row * fx.Int64(I) + fx.Int64(col)) * fx.Int64(2),
                                   fx.Float32(acc[i * 2 * NSUB + jj][v]).to(fx.BFloat16))


def _make_do_tile(plan, swiglu):
    """One tile of GEMM1 (swiglu: BN gate + BN up weight rows, SwiGLU) or GEMM2 (2 BN plain
    weight rows and output columns)."""
    mma_step = _mma_step_gfx950 if plan.arch == "gfx950" else _mma_step_gfx942

    @flyc.jit
    def do_tile(a, a_scales, w, w_scales, h, h_scales, mx_out, e, row0, rows, n0, H, I, has_limit,
                limit):
        tid = fx.thread_idx.x
        lane = tid & fx.Int32(63)
        wave = tid >> fx.Int32(6)
        wm, wn = wave >> fx.Int32(1), wave & fx.Int32(1)
        lane16, lane_group = lane & fx.Int32(15), lane >> fx.Int32(4)
        hb = H // fx.Int32(MX_BLOCK)
        # buffer resources: the tile's landed rows (reads of rows >= rows give 0) and the expert's
        # weights (GEMM1: gate rows past I read up rows, up rows past 2I give 0; GEMM2: rows past
        # I give 0; none of them is stored)
        a_rsrc = dev.buffer_rsrc(a + fx.Int64(row0) * fx.Int64(H), fx.Int64(rows) * fx.Int64(H))
        as_rsrc = dev.buffer_rsrc(a_scales + fx.Int64(row0) * fx.Int64(hb), fx.Int64(rows) * fx.Int64(hb))
        w_rows = fx.Int64(2 if swiglu else 1) * fx.Int64(I)
        w_rsrc = dev.buffer_rsrc(w + fx.Int64(e) * w_rows * fx.Int64(H), w_rows * fx.Int64(H))
        ws_rsrc = dev.buffer_rsrc(w_scales + fx.Int64(e) * w_rows * fx.Int64(hb), w_rows * fx.Int64(hb))
        if const_expr(plan.arch == "gfx950"):
            lane_k, lane_kb = lane_group * fx.Int32(plan.lane_k_bytes), lane_group
        else:
            lane_k, lane_kb = lane_group * fx.Int32(plan.lane_k_bytes), lane_group >> fx.Int32(1)
        rsrcs, srsrcs, voffs, svoffs = [], [], [], []
        for i in range_constexpr(MSUB):
            row = wm * fx.Int32(WAVE_M) + fx.Int32(i * 16) + lane16
            rsrcs.append(a_rsrc)
            srsrcs.append(as_rsrc)
            voffs.append(row * H + lane_k)
            svoffs.append(row * hb + lane_kb)
        for jj in range_constexpr(2 * NSUB):
            if const_expr(swiglu):
                wrow = n0 + wn * fx.Int32(WAVE_N) + fx.Int32((jj % NSUB) * 16) + lane16
                if const_expr(jj >= NSUB):
                    wrow = wrow + I
            else:
                wrow = n0 + wn * fx.Int32(2 * WAVE_N) + fx.Int32(jj * 16) + lane16
            rsrcs.append(w_rsrc)
            srsrcs.append(ws_rsrc)
            voffs.append(wrow * H + lane_k)
            svoffs.append(wrow * hb + lane_kb)

        full_steps = H // fx.Int32(plan.kstep)
        last = fx.max(full_steps - fx.Int32(1), fx.Int32(0))
        acc = [Vec.filled(4, 0.0, fx.Float32) for _ in range(NACC)]
        first = _load_step(plan, rsrcs, voffs, srsrcs, svoffs, fx.Int32(0))
        # software pipeline: step s's MFMAs run while step s + 1's loads are in flight
        for s, state in range(fx.Int32(0), full_steps, fx.Int32(1), init=acc + first):
            cur = list(state[NACC:])
            nxt = _load_step(plan, rsrcs, voffs, srsrcs, svoffs, fx.min(fx.Int32(s) + fx.Int32(1), last))
            new_acc = mma_step(list(state[:NACC]), cur)
            state = yield new_acc + nxt
        acc = [Vec(v) for v in state[:NACC]]
        # the tail: H % kstep != 0 leaves up to kstep - 32 bytes; a lane past H reads zeros
        if (hb % fx.Int32(plan.blocks_per_step)) != fx.Int32(0):
            valid = _lane_valid_k(plan, full_steps, hb, lane_group)
            tail = _load_step(plan, rsrcs, voffs, srsrcs, svoffs, full_steps, valid)
            acc = mma_step(acc, tail)
        if const_expr(swiglu):
            _store_tile(acc, h, h_scales, mx_out, row0, rows, n0, I, has_limit, limit, wm, wn,
                        lane, lane16, lane_group)
        else:
            _store_plain_tile(acc, h, row0, rows, n0, I, wm, wn, lane16, lane_group)

    return do_tile


@flyc.jit
def zero_padding_rows(offsets, counts, h, h_scales, mx_out, EL, I, M_cap, nb):
    """h rows in no expert's [offset, offset + count) (padding and rows cut by M_cap) become 0:
    the gaps before each expert and after the last, rows spread over the nb workgroups. MX-fp8:
    their value bytes and scale bytes."""
    tid = fx.thread_idx.x
    bid = fx.block_idx.x
    row_bytes = mx_out.select(I, I * fx.Int32(2))
    scale_bytes = I // fx.Int32(32)
    prev_end = fx.Int32(0)
    for e in range(fx.Int32(0), EL + fx.Int32(1), fx.Int32(1)):
        start = M_cap
        end = M_cap
        if e < EL:
            start = dev.load_uniform_i32(offsets + fx.Int64(e) * fx.Int64(4))
            end = start + dev.load_uniform_i32(counts + fx.Int64(e) * fx.Int64(4))
        for r in range(prev_end + bid, start, nb):
            row = h + fx.Int64(r) * fx.Int64(row_bytes)
            for c in range(tid * fx.Int32(16), row_bytes, fx.Int32(THREADS * 16)):
                dev.store_v4i32(row + fx.Int64(c), dev.zero_v4i32())  # I % 32 == 0: whole 16 B
            if mx_out:
                for c in range(tid, scale_bytes, fx.Int32(THREADS)):
                    dev.store_u8(h_scales + fx.Int64(r) * fx.Int64(scale_bytes) + fx.Int64(c), fx.Int32(0))
        prev_end = end


def make_gemm(arch, swiglu=True):
    """The @flyc.jit launcher of the grouped GEMM1 + SwiGLU (swiglu) or GEMM2 for `arch` (gfx942
    or gfx950). GEMM2 takes the same arguments: I its output columns, H its depth, bf16 h (h_scales
    null), no limit; fused with an arrival (epoch_counter) like GEMM1, though no engine asks."""
    plan = ArchPlan(arch)
    do_tile = _make_do_tile(plan, swiglu)
    tile_cols = BN if swiglu else 2 * BN  # output columns per tile

    @flyc.kernel(known_block_size=[THREADS, 1, 1])
    def gemm1_kernel(a_values0: fx.Pointer, a_values1: fx.Pointer, a_scales0: fx.Pointer,
                     a_scales1: fx.Pointer, expert_offsets: fx.Pointer, expert_counts: fx.Pointer,
                     w_values: fx.Pointer, w_scales: fx.Pointer, h: fx.Pointer, h_scales: fx.Pointer,
                     EL: fx.Int32, H: fx.Int32, I: fx.Int32, M_cap: fx.Int32, has_limit: fx.Int32,
                     swiglu_limit: fx.Float32, zero_padding: fx.Int32, epoch_counter: fx.Pointer,
                     arrival0: fx.Pointer, arrival1: fx.Pointer, arrival_ranks: fx.Int32,
                     timeout_ticks: fx.Int64, err: fx.Pointer, nb: fx.Int32):
        # nb: the grid size (gridDim would need ockl's device library at link time)
        tid = fx.thread_idx.x
        bid = fx.block_idx.x
        offsets, counts = dev.addr_of(expert_offsets), dev.addr_of(expert_counts)
        h_addr, hs_addr = dev.addr_of(h), dev.addr_of(h_scales)
        mx_out = hs_addr != fx.Int64(0)  # MX-fp8 output: h holds e4m3fn bytes, h_scales E8M0
        err_addr = dev.addr_of(err)
        w_addr, ws_addr = dev.addr_of(w_values), dev.addr_of(w_scales)
        # the call's slot: a fused call reads the landing slot of its epoch's parity
        counter = dev.addr_of(epoch_counter)
        fused = counter != fx.Int64(0)
        epoch = fx.Int32(0)
        if fused:
            # uniform by construction; readfirstlane tells the compiler so (scalar buffer bases)
            epoch = dev.first_lane_value(dev.load_relaxed(counter, dev.AGENT))
        odd = (epoch & fx.Int32(1)) != fx.Int32(0)
        a = odd.select(dev.addr_of(a_values1), dev.addr_of(a_values0))
        a_sc = odd.select(dev.addr_of(a_scales1), dev.addr_of(a_scales0))
        arrival = odd.select(dev.addr_of(arrival1), dev.addr_of(arrival0))
        limited = has_limit != fx.Int32(0)

        if zero_padding != fx.Int32(0):
            zero_padding_rows(offsets, counts, h_addr, hs_addr, mx_out, EL, I, M_cap, nb)

        n_tiles = (I + fx.Int32(tile_cols - 1)) // fx.Int32(tile_cols)
        base = fx.Int32(0)  # work items of the experts before e
        for e in range(fx.Int32(0), EL, fx.Int32(1)):
            off = dev.load_uniform_i32(offsets + fx.Int64(e) * fx.Int64(4))
            cnt = dev.load_uniform_i32(counts + fx.Int64(e) * fx.Int64(4))
            items = (cnt + fx.Int32(BM - 1)) // fx.Int32(BM) * n_tiles
            skew = (bid - base) % nb
            skew = (skew < fx.Int32(0)).select(skew + nb, skew)
            mine = base + skew  # this block's first item of expert e
            if mine < base + items:
                if fused & (arrival != fx.Int64(0)):
                    # kernels/cuda/gemm1/scheduler.cuh wait_arrival: wave 0 waits for every
                    # source's rows of expert e; on expiry the rows are not trusted (the error
                    # surfaces at the host) and the tiles run anyway, as on CUDA
                    if tid < fx.Int32(64):
                        dev.wait_flags(arrival + fx.Int64(e) * fx.Int64(arrival_ranks) * fx.Int64(4),
                                       arrival_ranks, arrival_ranks, e, epoch, timeout_ticks,
                                       err_addr, fx.Int32(dev.ERR_ROWS))
                    fx.gpu.barrier()
                    dev.fence_acquire()  # every wave: the landed rows, not stale cache lines
                for item in range(mine, base + items, nb):
                    local = item - base
                    m_tile, n_tile = local // n_tiles, local % n_tiles
                    row0 = off + m_tile * fx.Int32(BM)
                    rows = fx.min(cnt - m_tile * fx.Int32(BM), fx.Int32(BM))
                    do_tile(a, a_sc, w_addr, ws_addr, h_addr, hs_addr, mx_out, e, row0, rows,
                            n_tile * fx.Int32(tile_cols), H, I, limited, swiglu_limit)
            base = base + items

    @flyc.jit
    def gemm1(a_values0: fx.Pointer, a_values1: fx.Pointer, a_scales0: fx.Pointer,
              a_scales1: fx.Pointer, expert_offsets: fx.Pointer, expert_counts: fx.Pointer,
              w_values: fx.Pointer, w_scales: fx.Pointer, h: fx.Pointer, h_scales: fx.Pointer,
              EL: fx.Int32, H: fx.Int32, I: fx.Int32, M_cap: fx.Int32, has_limit: fx.Int32,
              swiglu_limit: fx.Float32, zero_padding: fx.Int32, epoch_counter: fx.Pointer,
              arrival0: fx.Pointer, arrival1: fx.Pointer, arrival_ranks: fx.Int32,
              timeout_ticks: fx.Int64, err: fx.Pointer, num_blocks: fx.Int32,
              stream: fx.Stream = fx.Stream(None)):
        gemm1_kernel(a_values0, a_values1, a_scales0, a_scales1, expert_offsets, expert_counts,
                     w_values, w_scales, h, h_scales, EL, H, I, M_cap, has_limit, swiglu_limit,
                     zero_padding, epoch_counter, arrival0, arrival1, arrival_ranks, timeout_ticks,
                     err, num_blocks).launch(grid=(num_blocks, 1, 1), block=[THREADS, 1, 1],
                                             stream=stream)

    return gemm1


def placeholder_args(swiglu=True):
    """Arguments that specialise the compile without a device (null pointers, sample scalars:
    dsv3's GEMM1, H 7168 -> I 2048, or its GEMM2, 2048 -> 7168)."""
    ptr = lambda: flyc.from_c_void_p(fx.Uint8, None, assumed_align=16)  # noqa: E731
    depth, cols = (7168, 2048) if swiglu else (2048, 7168)
    return [ptr() for _ in range(10)] + [8, depth, cols, 1024, 0, 0.0, 1] + \
        [ptr(), ptr(), ptr(), 8, 6_000_000_000, ptr(), 304]
