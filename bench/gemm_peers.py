"""gemm1's peers (issue 13), measured in the same run as gemm1 on the same rows per expert:
  torch-bf16   torch._grouped_mm, bf16 x [M, H] times w [E, 2I, H] (as its transpose), offsets the
               cumulative rows per expert (int32), bf16 out: torch's bf16 grouped GEMM.
  torch-fp8    torch._scaled_grouped_mm, the same in fp8 e4m3 with rowwise float32 scales
               (scale_a [M], scale_b [E, 2I]): torch's fp8 grouped GEMM.
  triton-mx    Triton's tl.dot_scaled e4m3 x e4m3 with uint8 E8M0 block-32 scales, the
               off-the-shelf exact-MX GEMM (on Hopper Triton upcasts both operands to bf16): one
               dense [M, H] x [H, 2I] GEMM of the same FLOPs, best of TRITON_TILES.
  torch-dense  dense bf16 [M, H] x [H, 2I] (cuBLAS), the same FLOPs: a ceiling.
and the weight-streaming floor: the fp8 weight bytes of the experts with rows (E x 2I x H values
plus their E8M0 scales) / the copy bandwidth measured in the same run (read + write counted, the
bench's ceiling).

torch and triton are imported here only when a CUDA device is measured (the CPU install has
neither); a peer that cannot run is a {"skipped": why} result, one that fails a {"failed": why},
and the rest of the run goes on. Each peer runs on its own random data of its own format (timing
does not depend on the values; the weights are made per peer and freed after it, beside JAX's
memory pool), is checked against a float64 reference on up to CHECK_ROWS rows of two groups, and
is timed with CUDA events: per call, median of `iters` calls after `warmup`."""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from bench.timing import alternate, default_rest_s, sustained

PEERS = ("torch-bf16", "torch-fp8", "triton-mx", "torch-dense")  # --skip-peers names
GROUPED = ("torch-bf16", "torch-fp8")
REL_TOL = 1e-2   # a peer's relative error against float64 beyond this: a wrong result
CHECK_ROWS = 64  # rows of each checked group
BLOCK = 32       # MX block (E8M0 scale per 32 values along K)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): triton-mx's tile configurations; a config
# that does not compile or fit is passed over
TRITON_TILES = ((128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3),
                (128, 128, 256, 8, 2), (64, 128, 128, 4, 4))
GIB = 1 << 30


class Problem(NamedTuple):
  """One GEMM1: counts[e] rows of local expert e, each [H] x [H, 2I]."""
  hidden: int
  two_i: int
  counts: tuple

  @property
  def rows(self) -> int:
    return int(sum(self.counts))

  @property
  def flops(self) -> int:
    return 2 * self.rows * self.hidden * self.two_i

  def weight_bytes(self) -> int:
    """fp8 weights and E8M0 scales of the experts that have rows (an empty one is not read)."""
    used = sum(1 for c in self.counts if c)
    return used * self.two_i * (self.hidden + self.hidden // BLOCK)


def floor(problem: Problem, copy_gbps: float) -> dict:
  """The weight-streaming floor: every weight byte read once at the copy bandwidth."""
  nbytes = problem.weight_bytes()
  return {"weight_bytes": nbytes, "copy_gbps": copy_gbps, "ms": nbytes / (copy_gbps * 1e9) * 1e3}


def ratios(ours_ms: Optional[float], peers: dict) -> dict:
  """peer ms / ours (> 1: ours faster) per measured peer, and ours / the floor (>= 1)."""
  if not ours_ms or not peers:
    return {}
  out = {name: r["ms"] / ours_ms for name, r in peers.get("results", {}).items()
         if "ms" in r and "failed" not in r}
  if peers.get("floor"):
    out["floor"] = ours_ms / peers["floor"]["ms"]
  return out


# ------------------------------------------------------------------------------------------------
# Measuring


def parse_skip(text: Optional[str]) -> tuple:
  """--skip-peers: a comma list of PEERS names, or "all"."""
  names = [s for s in (text or "").split(",") if s]
  unknown = set(names) - set(PEERS) - {"all"}
  if unknown:
    raise SystemExit(f"--skip-peers: unknown {sorted(unknown)}; known: {', '.join(PEERS)}, all")
  return PEERS if "all" in names else tuple(names)


class Timing(NamedTuple):
  """How cuda_ms times a peer: `iters` calls after `warmup`; with sustain_s > 0 also that many
  seconds of calls back to back (timing.sustained: the steady state at the power limit)."""
  iters: int
  warmup: int
  sustain_s: float = 0.0


def measure(problem: Problem, device, copy_gbps: float, timing: Timing,
            skip: Sequence[str] = (), seed: int = 0, skip_why: str = "--skip-peers") -> dict:
  """Every peer not in `skip` on `device` (a jax Device; CUDA GPUs only): {"problem", "floor",
  "results": {peer: {"ms", "min_ms", "tflops", "rel_err", "how"[, "sustained"]} | {"skipped"} |
  {"failed"}}}."""
  results = {name: {"skipped": skip_why} for name in PEERS if name in skip}
  todo = [name for name in PEERS if name not in skip]
  torch, why = _load_torch(device) if todo else (None, None)
  if torch is None:
    results.update({name: {"skipped": why} for name in todo})
  else:
    dev = torch.device("cuda", device.local_hardware_id)
    for name in todo:
      results[name] = _run_peer(torch, name, problem, dev, timing, seed)
  return {"problem": {"rows": problem.rows, "experts": len(problem.counts),
                      "experts_with_rows": sum(1 for c in problem.counts if c),
                      "hidden": problem.hidden, "two_i": problem.two_i},
          "floor": floor(problem, copy_gbps), "results": {n: results[n] for n in PEERS}}


def measure_rounds(problem: Problem, device, ours: Callable[[], float], rounds: int,
                   timing: Timing, skip: Sequence[str] = (), seed: int = 0,
                   skip_why: str = "--skip-peers") -> dict:
  """Ours and each GROUPED peer not in `skip`, one peer at a time, timed alternately for `rounds`
  rounds (bench/timing.py alternate: a rest before each measurement, the order reversed every
  other round): ours by `ours()` (ms: the pipelined burst every ratio uses), the peer by cuda_ms
  (the median of `timing.iters` calls). {peer: {"rounds": [{"ours": ms, peer: ms}, ...],
  "ratios": [peer ms / ours ms per round], "median_ratio", "min_ratio", "max_ratio"} |
  {"skipped": why} | {"failed": why}}."""
  names = [n for n in GROUPED if n not in skip]
  out = {name: {"skipped": skip_why} for name in GROUPED if name in skip}
  torch, why = _load_torch(device) if names else (None, None)
  if torch is None:
    return {**out, **{name: {"skipped": why} for name in names}}
  dev = torch.device("cuda", device.local_hardware_id)
  once = Timing(timing.iters, timing.warmup)
  for name in names:
    out[name] = _guarded(torch, dev, lambda: _rounds(torch, name, problem, dev, ours, rounds, once,
                                                     seed))
  return {name: out[name] for name in GROUPED}


def _rounds(torch, name: str, problem: Problem, dev, ours: Callable[[], float], rounds: int,
            once: Timing, seed: int) -> dict:
  call, err, _ = GROUPED_CALLS[name](torch, problem, dev,
                                     torch.Generator(device=dev).manual_seed(seed))
  if not err <= REL_TOL:  # NaN too
    return {"failed": _wrong_result(err)}
  per_round = alternate({"ours": ours, name: lambda: cuda_ms(torch, call, once)["ms"]}, rounds,
                        default_rest_s())
  r = [m[name] / m["ours"] for m in per_round]
  return {"rounds": per_round, "ratios": r, "median_ratio": float(np.median(r)),
          "min_ratio": min(r), "max_ratio": max(r)}


def _load_torch(device):
  """(torch, None), or (None, why the torch peers cannot run on `device`)."""
  if device.platform not in ("gpu", "cuda"):
    return None, f"needs a CUDA GPU, the device is {device.platform}"
  try:
    import torch
  except ImportError as e:
    return None, f"torch is not importable ({e})"
  if getattr(torch.version, "hip", None) or not torch.cuda.is_available():
    return None, f"torch {torch.__version__} has no CUDA device"
  return torch, None


def _run_peer(torch, name: str, problem: Problem, dev, timing: Timing, seed: int) -> dict:
  run = {"torch-bf16": _grouped("torch-bf16"), "torch-fp8": _grouped("torch-fp8"),
         "triton-mx": _triton_mx, "torch-dense": _torch_dense}[name]
  gen = torch.Generator(device=dev).manual_seed(seed)

  def measured() -> dict:
    result = run(torch, problem, dev, gen, timing)
    if "ms" in result:
      result["tflops"] = problem.flops / (result["ms"] * 1e-3) / 1e12
      if not result["rel_err"] <= REL_TOL:  # NaN too
        result = {"failed": _wrong_result(result["rel_err"]), **result}
    return result

  return _guarded(torch, dev, measured)


def _guarded(torch, dev, measure: Callable[[], dict]) -> dict:
  """measure() with `dev` current; its failure (out of memory, no kernel, ...) is data:
  {"failed": why}. The memory goes back after it, for the next peer and JAX's next allocations."""
  try:
    with torch.cuda.device(dev):
      return measure()
  except Exception as e:  # noqa: BLE001
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return {"failed": f"{type(e).__name__}: {lines[0][:160]}"}
  finally:
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()


def _wrong_result(rel_err: float) -> str:
  return f"wrong result: relative error {rel_err:.2e} against float64 (limit {REL_TOL})"


def cuda_ms(torch, fn: Callable, timing: Timing) -> dict:
  """fn's calls timed with CUDA events on the current stream: median and min ms of `iters` calls
  (enqueued back to back) after `warmup` untimed ones; with timing.sustain_s, "sustained"
  (bench/timing.py sustained)."""
  iters, warmup = timing.iters, timing.warmup
  for _ in range(warmup):
    fn()
  events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(max(1, iters))]
  for start, end in events:
    start.record()
    fn()
    end.record()
  torch.cuda.synchronize()
  ms = np.array([start.elapsed_time(end) for start, end in events])
  result = {"ms": float(np.median(ms)), "min_ms": float(ms.min())}
  if timing.sustain_s > 0:
    result["sustained"] = sustained(fn, lambda _: torch.cuda.synchronize(), timing.sustain_s,
                                    torch.cuda.current_device())
  return result


def _need(torch, dev, nbytes: int) -> None:
  """Refuses (MemoryError) an allocation of nbytes that the GPU's free memory cannot hold."""
  free, _ = torch.cuda.mem_get_info(dev)
  if nbytes > free - GIB // 2:
    raise MemoryError(f"needs {nbytes / GIB:.1f} GiB, {free / GIB:.1f} GiB free beside JAX's pool")


def _randn(torch, shape, dtype, dev, gen, chunk: int = 1 << 26):
  """Normal values in `dtype` (fp8: rounded from bf16), made in slices of the leading axis of
  about `chunk` elements, so the bf16 temporary stays small."""
  out = torch.empty(shape, dtype=dtype, device=dev)
  step = max(1, chunk // int(np.prod(shape[1:])))
  for i in range(0, shape[0], step):
    part = out[i:i + step]
    part.copy_(torch.randn(part.shape, dtype=torch.bfloat16, device=dev, generator=gen))
  return out


def _rel_err(torch, out, ref) -> float:
  diff = out.double() - ref
  return float(torch.linalg.norm(diff) / torch.clamp(torch.linalg.norm(ref), min=1e-300))


def _checked_groups(problem: Problem) -> list:
  """(expert, first row, rows) of the first and last expert with rows, up to CHECK_ROWS each."""
  starts = np.cumsum((0,) + tuple(problem.counts))
  used = [e for e, c in enumerate(problem.counts) if c]
  return [(e, int(starts[e]), min(CHECK_ROWS, int(problem.counts[e])))
          for e in sorted({used[0], used[-1]})] if used else []


def _grouped_check(torch, problem: Problem, out, a, w) -> float:
  """The largest relative error of out's checked groups against a(rows) @ w[e]^T in float64
  (a, w: callables giving the float64 operand values, scales applied)."""
  errs = [_rel_err(torch, out[r0:r0 + n], a(slice(r0, r0 + n)) @ w(e).T)
          for e, r0, n in _checked_groups(problem)]
  return max(errs, default=0.0)


def _offsets(torch, problem: Problem, dev):
  return torch.tensor(np.cumsum(problem.counts), dtype=torch.int32, device=dev)


def _grouped_bf16(torch, p: Problem, dev, gen) -> tuple:
  """torch-bf16's call on fresh random operands, its relative error, and how it is called."""
  E, M = len(p.counts), p.rows
  _need(torch, dev, 2 * (E * p.two_i * p.hidden + M * (p.hidden + p.two_i)))
  w = _randn(torch, (E, p.two_i, p.hidden), torch.bfloat16, dev, gen)
  x = torch.randn((M, p.hidden), dtype=torch.bfloat16, device=dev, generator=gen)
  offs = _offsets(torch, p, dev)

  def call():
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)

  err = _grouped_check(torch, p, call(), lambda r: x[r].double(), lambda e: w[e].double())
  return call, err, "torch._grouped_mm(x [M, H] bf16, w [E, 2I, H].transpose(-2, -1), offs int32)"


def _grouped_fp8(torch, p: Problem, dev, gen) -> tuple:
  """torch-fp8's call on fresh random operands, its relative error, and how it is called."""
  E, M = len(p.counts), p.rows
  f8 = torch.float8_e4m3fn
  _need(torch, dev, E * p.two_i * p.hidden + M * (p.hidden + 2 * p.two_i))
  w = _randn(torch, (E, p.two_i, p.hidden), f8, dev, gen)
  x = _randn(torch, (M, p.hidden), f8, dev, gen)
  scale_a = torch.rand(M, device=dev, generator=gen) + 0.5
  scale_b = torch.rand((E, p.two_i), device=dev, generator=gen) + 0.5
  offs = _offsets(torch, p, dev)

  def call():
    return torch._scaled_grouped_mm(x, w.transpose(-2, -1), scale_a, scale_b, offs=offs,
                                    out_dtype=torch.bfloat16)

  err = _grouped_check(torch, p, call(), lambda r: x[r].double() * scale_a[r, None].double(),
                       lambda e: w[e].double() * scale_b[e, :, None].double())
  return call, err, ("torch._scaled_grouped_mm(x [M, H] e4m3, w [E, 2I, H].transpose(-2, -1), "
                     "scale_a [M] f32, scale_b [E, 2I] f32, offs int32)")


GROUPED_CALLS = {"torch-bf16": _grouped_bf16, "torch-fp8": _grouped_fp8}


def _grouped(name: str) -> Callable:
  """A GROUPED peer, made and checked, then timed by cuda_ms."""
  def run(torch, p: Problem, dev, gen, timing: Timing) -> dict:
    call, err, how = GROUPED_CALLS[name](torch, p, dev, gen)
    return {**cuda_ms(torch, call, timing), "rel_err": err, "how": how}
  return run


def _torch_dense(torch, p: Problem, dev, gen, timing: Timing) -> dict:
  a = torch.randn((p.rows, p.hidden), dtype=torch.bfloat16, device=dev, generator=gen)
  b = torch.randn((p.two_i, p.hidden), dtype=torch.bfloat16, device=dev, generator=gen)
  out = a @ b.T
  n = min(CHECK_ROWS, p.rows)
  err = _rel_err(torch, out[:n], a[:n].double() @ b.double().T)
  return {**cuda_ms(torch, lambda: a @ b.T, timing), "rel_err": err,
          "how": "a [M, H] bf16 @ b [2I, H].T (cuBLAS)"}


# ------------------------------------------------------------------------------------------------
# triton-mx: C [M, N] = A [M, K] . B [N, K]^T, e4m3 values with E8M0 scales per 32 along K


@functools.lru_cache(maxsize=None)
def _mx_kernel():
  import triton
  import triton.language as tl

  @triton.jit
  def mx_gemm(a, sa, b, sb, c, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, GROUP_M: tl.constexpr, FMT: tl.constexpr):
    # tiles in groups of GROUP_M row tiles, so that neighbouring programs share B tiles in L2
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    in_group = pid % (GROUP_M * tiles_n)
    rm = (first_m + in_group % size_m) * BM + tl.arange(0, BM)
    rn = (in_group // size_m) * BN + tl.arange(0, BN)
    rk, rs = tl.arange(0, BK), tl.arange(0, BK // 32)
    am, bn = rm % M, rn % N  # rows past the end read a valid row; their results are not stored
    a_ptr = a + am[:, None] * K + rk[None, :]            # [BM, BK]
    b_ptr = b + bn[None, :] * K + rk[:, None]            # [BK, BN]: B is [N, K], K contiguous
    sa_ptr = sa + am[:, None] * (K // 32) + rs[None, :]  # [BM, BK/32]
    sb_ptr = sb + bn[:, None] * (K // 32) + rs[None, :]  # [BN, BK/32]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):  # K % BK == 0
      acc = tl.dot_scaled(tl.load(a_ptr), tl.load(sa_ptr), FMT, tl.load(b_ptr), tl.load(sb_ptr),
                          FMT, acc)
      a_ptr += BK
      b_ptr += BK
      sa_ptr += BK // 32
      sb_ptr += BK // 32
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=mask)

  return triton, mx_gemm


def mx_gemm(torch, a, sa, b, sb, tile: tuple, group_m: int = 8):
  """C = dequant(a, sa) @ dequant(b, sb)^T in bf16: a [M, K], b [N, K] e4m3, sa [M, K/32] and
  sb [N, K/32] uint8 E8M0, with `tile` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
  triton, kernel = _mx_kernel()
  (M, K), N = a.shape, b.shape[0]
  bm, bn, bk, warps, stages = tile
  if K % bk:
    raise ValueError(f"K = {K} is not a multiple of BLOCK_K = {bk}")
  c = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
  grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
  kernel[grid](a, sa, b, sb, c, M, N, K, BM=bm, BN=bn, BK=bk, GROUP_M=group_m, FMT="e4m3",
               num_warps=warps, num_stages=stages)
  return c


def mx_dequant(torch, v, s):
  """float64 values of e4m3 v [R, K] with uint8 E8M0 scales s [R, K/32]."""
  scale = torch.exp2(s.double() - 127).repeat_interleave(BLOCK, dim=-1)
  return v.double() * scale


def _triton_mx(torch, p: Problem, dev, gen, timing: Timing) -> dict:
  try:
    _mx_kernel()
  except ImportError as e:
    return {"skipped": f"triton is not importable ({e})"}
  M, N, K = p.rows, p.two_i, p.hidden
  a = _randn(torch, (M, K), torch.float8_e4m3fn, dev, gen)
  b = _randn(torch, (N, K), torch.float8_e4m3fn, dev, gen)
  # E8M0 scales 2^-3 .. 2^3: exact MX blocks whose scales differ block to block
  sa = torch.randint(124, 131, (M, K // BLOCK), dtype=torch.uint8, device=dev, generator=gen)
  sb = torch.randint(124, 131, (N, K // BLOCK), dtype=torch.uint8, device=dev, generator=gen)
  tried, errors = {}, {}
  for tile in TRITON_TILES:  # a quick timing of each tile, then the best one timed in full
    try:
      tried[tile] = cuda_ms(torch, lambda: mx_gemm(torch, a, sa, b, sb, tile), Timing(3, 1))["ms"]
    except Exception as e:  # noqa: BLE001  too much shared memory, K not a multiple, ...
      errors[tile] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:100]}"
  if not tried:
    raise RuntimeError(f"no tile configuration ran: {errors}")
  best = min(tried, key=tried.get)
  n = min(CHECK_ROWS, M)
  err = _rel_err(torch, mx_gemm(torch, a[:n], sa[:n], b, sb, best),
                 mx_dequant(torch, a[:n], sa[:n]) @ mx_dequant(torch, b, sb).T)
  return {**cuda_ms(torch, lambda: mx_gemm(torch, a, sa, b, sb, best), timing),
          "rel_err": err, "tile": list(best),
          "tiles_ms": {"x".join(map(str, t)): ms for t, ms in tried.items()},
          "tiles_failed": {"x".join(map(str, t)): why for t, why in errors.items()},
          "how": "triton tl.dot_scaled(a, sa, 'e4m3', b, sb, 'e4m3') dense [M, H] x [H, 2I], "
                 "best of TRITON_TILES (BLOCK_M x BLOCK_N x BLOCK_K x warps x stages)"}
