"""Device-side building blocks shared by the FlyDSL kernels of this folder.

Raw global-memory access through the MLIR `llvm` dialect (an address is an fx.Int64 byte
address), the memory-model operations the engines' protocol needs (DESIGN.md §6: acquire loads and
release stores at system scope, fences), the wall clock for bounded waits, wave-level helpers and
the EpError record of kernels/cuda/ep/window.h. Every function here is called while a kernel is
being traced.

Scopes: `syncscope=""` is LLVM's system scope (on gfx942/gfx950 it bypasses/writes back/invalidates
the caches a peer's or a copy engine's writes could hide behind); "agent" is one GPU.
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import arith as mlir_arith
from flydsl._mlir.dialects import llvm
from flydsl.expr import rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

SYSTEM = ""  # LLVM's default (system) synchronisation scope
AGENT = "agent"

# EpError (kernels/cuda/ep/window.h): {code, peer, expert, epoch}, four uint32, host-mapped.
ERR_NONE, ERR_PLAN, ERR_ROWS = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# addresses and plain loads / stores
# ---------------------------------------------------------------------------------------------
def addr_of(pointer):
    """The byte address of an `fx.Pointer` kernel argument, as an fx.Int64."""
    return fx.Int64(llvm.PtrToIntOp(T.i64, pointer.llvm_ptr).result)


def _gptr(addr):
    return llvm.IntToPtrOp(llvm.PointerType.get(address_space=1), fx.Int64(addr).ir_value()).result


def v4i32():
    return ir.VectorType.get([4], T.i32)


def load_i32(addr):
    return fx.Int32(llvm.LoadOp(T.i32, _gptr(addr), alignment=4).result)


def load_uniform_i32(addr):
    """A word every lane reads from the same address, kept in a scalar register (readfirstlane:
    the compiler cannot prove a global load uniform, and a per-lane value in a buffer base or
    bound would turn every buffer access into a waterfall loop)."""
    return first_lane_value(load_i32(addr))


def load_u8(addr):
    """One byte, zero-extended to i32."""
    byte = llvm.LoadOp(T.i8, _gptr(addr), alignment=1).result
    return fx.Int32(llvm.ZExtOp(T.i32, byte).result)


def load_f32(addr):
    return fx.Float32(llvm.LoadOp(T.f32, _gptr(addr), alignment=4).result)


def load_v4i32(addr):
    """16 bytes at a 16-byte aligned address (global_load_dwordx4)."""
    return Vec(llvm.LoadOp(v4i32(), _gptr(addr), alignment=16).result)


def store_v4i32(addr, value):
    llvm.StoreOp(Vec(value).ir_value(), _gptr(addr), alignment=16)


def store_i32(addr, value):
    llvm.StoreOp(fx.Int32(value).ir_value(), _gptr(addr), alignment=4)


def store_u8(addr, value):
    llvm.StoreOp(mlir_arith.TruncIOp(T.i8, fx.Int32(value).ir_value()).result, _gptr(addr), alignment=1)


def store_bf16(addr, value_bf16):
    """One bf16 (an fx.BFloat16 value) at a 2-byte aligned address."""
    llvm.StoreOp(value_bf16.ir_value(), _gptr(addr), alignment=2)


def zero_v4i32():
    return Vec.filled(4, 0, fx.Int32)


# ---------------------------------------------------------------------------------------------
# buffer resources: a scalar base + 32-bit per-lane offsets, reads past num_records return 0
# ---------------------------------------------------------------------------------------------
# gfx9 (CDNA) V# flags word: DATA_FORMAT 7 (float), NUM_FORMAT 4 (32-bit); no RDNA bits.
_BUFFER_FLAGS_CDNA = (7 << 12) | (4 << 15)
# A lane offset that is always past num_records: what a lane reads there is 0.
OUT_OF_RANGE = 0x7FFFFFF0


def buffer_rsrc(addr, num_bytes):
    """A buffer resource over [addr, addr + num_bytes) (num_bytes < 2^32; wave-uniform)."""
    base = llvm.IntToPtrOp(llvm.PointerType.get(), fx.Int64(addr).ir_value()).result
    flags = fx.Int32(_BUFFER_FLAGS_CDNA).ir_value()
    stride = llvm.ConstantOp(T.i16, ir.IntegerAttr.get(T.i16, 0)).result
    return rocdl.MakeBufferRsrcOp(ir.Type.parse("!llvm.ptr<8>"), base, stride,
                                  fx.Int64(num_bytes).ir_value(), flags).result


def buffer_load_v4i32(rsrc, voffset, soffset):
    """16 bytes at rsrc + voffset (per lane) + soffset (uniform); 0 past num_records."""
    return Vec(rocdl.raw_ptr_buffer_load(v4i32(), rsrc, fx.Int32(voffset).ir_value(),
                                         fx.Int32(soffset).ir_value(), 0))


def buffer_load_u8(rsrc, voffset, soffset):
    """One byte, zero-extended to i32; 0 past num_records."""
    byte = rocdl.raw_ptr_buffer_load(T.i8, rsrc, fx.Int32(voffset).ir_value(),
                                     fx.Int32(soffset).ir_value(), 0)
    return fx.Int32(llvm.ZExtOp(T.i32, byte).result)


# ---------------------------------------------------------------------------------------------
# memory model: the engines' signals (DESIGN.md §6)
# ---------------------------------------------------------------------------------------------
def load_acquire(addr, scope=SYSTEM):
    """A flag read that later reads may not pass, seeing writes of peers / copy engines."""
    return fx.Int32(llvm.LoadOp(T.i32, _gptr(addr), alignment=4,
                                ordering=llvm.AtomicOrdering.acquire, syncscope=scope).result)


def load_relaxed(addr, scope=SYSTEM):
    """A coherent read of a word another agent writes (the error word, the epoch counter)."""
    return fx.Int32(llvm.LoadOp(T.i32, _gptr(addr), alignment=4,
                                ordering=llvm.AtomicOrdering.monotonic, syncscope=scope).result)


def store_release(addr, value, scope=SYSTEM):
    """A signal: every earlier write of this thread is visible before it."""
    llvm.StoreOp(fx.Int32(value).ir_value(), _gptr(addr), alignment=4,
                 ordering=llvm.AtomicOrdering.release, syncscope=scope)


def store_relaxed(addr, value, scope=SYSTEM):
    llvm.StoreOp(fx.Int32(value).ir_value(), _gptr(addr), alignment=4,
                 ordering=llvm.AtomicOrdering.monotonic, syncscope=scope)


def fence_acquire(scope=SYSTEM):
    llvm.fence(llvm.AtomicOrdering.acquire, syncscope=scope)


def fence_release(scope=SYSTEM):
    llvm.fence(llvm.AtomicOrdering.release, syncscope=scope)


def epoch_reached(flag, epoch):
    """(int32)(flag - epoch) >= 0: epochs may wrap (DESIGN.md §6)."""
    return (fx.Int32(flag) - fx.Int32(epoch)) >= fx.Int32(0)


# ---------------------------------------------------------------------------------------------
# time, sleep, wave helpers
# ---------------------------------------------------------------------------------------------
def wall_clock():
    """s_memrealtime: the constant-rate wall clock (hipDeviceAttributeWallClockRate, 100 MHz on
    MI300X/MI355X). Timeouts are passed to the kernels in its ticks."""
    return fx.Int64(llvm.call_intrinsic(T.i64, "llvm.amdgcn.s.memrealtime", [], [], []))


def sleep_briefly():
    """s_sleep 8 (about 512 clocks, ~0.25 us): a poll loop must not flood the memory system with
    system-scope loads while the rows it waits for are still arriving."""
    llvm.call_intrinsic(None, "llvm.amdgcn.s.sleep", [fx.Int32(8).ir_value()], [], [])


def ballot(pred):
    """The wave's lanes for which pred holds, as an i64 mask (wave64)."""
    return fx.Int64(rocdl.ballot(T.i64, fx.Boolean(pred).ir_value()))


def lowest_lane(mask):
    """Index of the lowest set bit of a non-zero i64 lane mask."""
    false = fx.Boolean(False).ir_value()
    return fx.Int32(fx.Int64(llvm.call_intrinsic(T.i64, "llvm.cttz.i64",
                                                 [fx.Int64(mask).ir_value(), false], [], [])))


def first_lane_value(value):
    """The value of the wave's first active lane (readfirstlane), uniform across the wave."""
    return fx.Int32(rocdl.readfirstlane(T.i32, fx.Int32(value).ir_value()))


def wave_inclusive_scan(value, lane):
    """Inclusive prefix sum of an i32 over the 64 lanes of a wave (Hillis-Steele, ds_bpermute)."""
    v = fx.Int32(value)
    for shift in (1, 2, 4, 8, 16, 32):
        src = fx.max(lane - fx.Int32(shift), fx.Int32(0))
        got = fx.Int32(rocdl.ds_bpermute(T.i32, (src * fx.Int32(4)).ir_value(), v.ir_value()))
        v = (lane >= fx.Int32(shift)).select(v + got, v)
    return v


def wave_broadcast(value, src_lane):
    """value of lane src_lane (uniform or per lane) for every lane."""
    return fx.Int32(rocdl.ds_bpermute(T.i32, (fx.Int32(src_lane) * fx.Int32(4)).ir_value(),
                                      fx.Int32(value).ir_value()))


# ---------------------------------------------------------------------------------------------
# LDS (workgroup memory): i32 arrays
# ---------------------------------------------------------------------------------------------
def lds_arena():
    """The kernel's LDS allocator (FlyDSL allows one per kernel)."""
    return fx.SharedAllocator()


def lds_alloc_i32(arena, count):
    """An LDS array of `count` int32 from `arena`, as an !llvm.ptr<3>."""
    storage = arena.allocate(4 * count)
    return storage._ptr.llvm_ptr  # the allocation's base pointer (FlyDSL 0.5.0 has no public name)


def _lds_elem(base, index):
    return llvm.GEPOp(llvm.PointerType.get(address_space=3), base, [fx.Int32(index).ir_value()],
                      [-(2 ** 31)], T.i32, None).result


def lds_load_i32(base, index):
    return fx.Int32(llvm.LoadOp(T.i32, _lds_elem(base, index), alignment=4).result)


def lds_store_i32(base, index, value):
    llvm.StoreOp(fx.Int32(value).ir_value(), _lds_elem(base, index), alignment=4)


# ---------------------------------------------------------------------------------------------
# the error word of a bounded wait (kernels/cuda/ep/window.h EpError, record_wait_error)
# ---------------------------------------------------------------------------------------------
def error_recorded(err):
    """Whether a wait of this call already ran out (err->code != 0). One coherent read."""
    return load_relaxed(err) != fx.Int32(0)


@flyc.jit
def record_wait_error(err, code, peer, expert, epoch):
    """Records the first expired wait: the fields, a system fence, then the code (so a reader that
    sees the code sees the fields). Called by one lane."""
    if load_relaxed(err) == fx.Int32(0):
        store_relaxed(err + fx.Int64(4), peer)
        store_relaxed(err + fx.Int64(8), expert)
        store_relaxed(err + fx.Int64(12), epoch)
        fence_release()
        store_relaxed(err, code)


# ---------------------------------------------------------------------------------------------
# the bounded wait on signals (DESIGN.md §6)
# ---------------------------------------------------------------------------------------------
@flyc.jit
def wait_flags(flags, count, ranks, expert_base, epoch, timeout_ticks, err, code):
    """One wave waits until flags[i] - epoch >= 0 (int32) for every i < count: lane l reads flags
    l, l + 64, ..., so every poll is one round trip. Flag i belongs to peer i % ranks and expert
    expert_base + i / ranks (seg_flag[e][s] is e * R + s). Bounded: if a wait of this call already
    ran out (the call is failed, its rows are not trusted) it stops at once; after timeout_ticks
    of the wall clock it records {code, peer, expert, epoch} of the first missing flag in err.
    Returns 1 when every flag reached the epoch, else 0 (uniform across the wave). Every lane of
    the wave calls it; the caller's barrier releases the rest of the workgroup."""
    lane = fx.thread_idx.x & fx.Int32(63)
    deadline = wall_clock() + timeout_ticks
    polling = fx.Int32(1)
    ok = fx.Int32(0)
    first = fx.Int32(1)
    while polling != fx.Int32(0):
        first_missing = fx.Int32(-1)
        for c in range(fx.Int32(0), count, fx.Int32(64)):
            flag = fx.Int32(epoch)
            if c + lane < count:
                flag = load_acquire(flags + fx.Int64(c + lane) * fx.Int64(4))
            missing = ballot((flag - epoch) < fx.Int32(0))
            if (missing != fx.Int64(0)) & (first_missing < fx.Int32(0)):
                first_missing = c + lowest_lane(missing)
        if first_missing < fx.Int32(0):
            polling = fx.Int32(0)
            ok = fx.Int32(1)
        else:
            if first != fx.Int32(0):
                # read once, on the first miss only: err is host memory
                if error_recorded(err):
                    polling = fx.Int32(0)
            if polling != fx.Int32(0):
                if wall_clock() > deadline:
                    if lane == fx.Int32(0):
                        record_wait_error(err, code, first_missing % ranks,
                                          expert_base + first_missing // ranks, epoch)
                    polling = fx.Int32(0)
                else:
                    sleep_briefly()
        first = fx.Int32(0)
    return ok
