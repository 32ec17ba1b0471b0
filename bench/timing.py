"""The measurement protocol and the ceilings the rates are held against.

Protocol: one call is the wall time of the whole SPMD program until `jax.block_until_ready`, i.e.
the max over ranks in a single-process run (multi-process: each process times the call, and the
call's time is the max over processes); statistics are over --iters calls after --warmup more.

Ceilings are measured in the same run, on the same machine: CPU mode, host memcpy bandwidth and
matmul rates; --gpu, the device's copy bandwidth, XLA's dense bf16 matmul (one 8192^3, and per
configuration one of gemm1's FLOPs) and, with R > 1 GPUs in one process, the peer copy."""
from __future__ import annotations

import shutil
import subprocess
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdma_moe as jsm

from bench.paths import STAGES
from bench.processes import all_processes, slowest

# ------------------------------------------------------------------------------------------------
# Timing


# Idle seconds between time_calls' two measurements on a GPU (a burst of ~10-100 ms at the power
# cap leaves its clock low for a while after it). A CPU run does not rest.
REST_S = 1.0


def time_calls(fn: Callable, args: tuple, iters: int, warmup: int,
               rest_s: Optional[float] = None) -> dict:
  """Per call (the protocol): wall time of one call until block_until_ready, median over iters.
  Also pipelined_ms: iters calls enqueued back to back, one wait at the end, / iters — what a
  model's step sees, without the ~0.1-0.2 ms of host dispatch and synchronisation per call that
  dominate the small stages. A GPU's clock falls as a run of calls goes on (the power cap), so
  a ratio holds only between calls timed at the same point of their runs: each measurement starts
  right after a warm-up from a rested GPU, as gemm_peers.cuda_ms times the peers (their inputs
  made and checked in between). rest_s: the rest (default REST_S on a GPU, 0 on a CPU)."""
  if rest_s is None:
    rest_s = default_rest_s()
  pipelined = burst_seconds(fn, args, iters, warmup)
  if rest_s > 0:
    time.sleep(rest_s)
  warm_up(fn, args, warmup)
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  ms = all_processes(times).max(0) * 1e3  # per call, the slowest process
  return {"median_ms": float(np.median(ms)), "min_ms": float(ms.min()),
          "p90_ms": float(np.percentile(ms, 90)), "pipelined_ms": slowest(pipelined) * 1e3}


def default_rest_s() -> float:
  """REST_S on a GPU; a CPU run does not rest."""
  return 0.0 if jax.devices()[0].platform == "cpu" else REST_S


def warm_up(fn: Callable, args: tuple, calls: int) -> None:
  """`calls` calls that each wait for their result."""
  for _ in range(calls):
    jax.block_until_ready(fn(*args))


def burst_seconds(fn: Callable, args: tuple, iters: int, warmup: int) -> float:
  """`warmup` calls that each wait, then `iters` calls enqueued back to back and one wait: seconds
  per call of the burst (this process's; time_calls takes the slowest process's)."""
  warm_up(fn, args, warmup)
  t0 = time.perf_counter()
  outs = [fn(*args) for _ in range(iters)]
  jax.block_until_ready(outs)
  return (time.perf_counter() - t0) / iters


def alternate(timers: dict, rounds: int, rest_s: float) -> list:
  """Rounds of every timer in turn, each after a rest of rest_s: {name: ms} per round. Torch's
  own time moves up to 14% between runs of one device call (docs/PERF.md §3), so a single pair of
  measurements compares two moments of a drifting GPU; alternating them, the order reversed every
  other round (so neither always runs right after the other), gives each ratio's spread. timers:
  {name: a callable that measures once and returns ms}."""
  names = list(timers)
  out = []
  for r in range(rounds):
    ms = {}
    for name in names if r % 2 == 0 else names[::-1]:
      if rest_s > 0:
        time.sleep(rest_s)
      ms[name] = float(timers[name]())
    out.append({n: ms[n] for n in names})
  return out


def sustained(call: Callable[[], object], sync: Callable[[object], None], seconds: float,
              gpu_index: int = 0) -> dict:
  """Calls back to back for `seconds` (a model's steady state: the GPU at its power limit, which
  short bursts of --iters calls do not reach), synchronised every 8 calls so that only a few
  outputs live at once: ms per call over the second half (at least the last 8 calls: a call
  slower than `seconds` / 8 runs 16), and the SM clock and board power that nvidia-smi samples
  every 100 ms meanwhile (medians of the second half; absent without it)."""
  smi = None
  if shutil.which("nvidia-smi"):
    smi = subprocess.Popen(["nvidia-smi", "-i", str(gpu_index), "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  marks, n, t0 = [], 0, time.perf_counter()
  while True:
    out = call()
    n += 1
    if n % 8 == 0:
      sync(out)
      marks.append((time.perf_counter() - t0, n))
      if marks[-1][0] >= seconds and len(marks) >= 2:
        break
  # the second half from the first mark past its start, never the last mark itself
  half = next((m for m in marks[:-1] if m[0] >= marks[-1][0] / 2), marks[-2])
  result = {"seconds": marks[-1][0], "calls": n,
            "ms": (marks[-1][0] - half[0]) / (marks[-1][1] - half[1]) * 1e3}
  if smi is not None:
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].splitlines():
      try:
        samples.append([float(v) for v in line.split(",")])
      except ValueError:
        pass
    if samples:
      late = np.array(samples[len(samples) // 2:])
      result["sm_mhz"], result["power_w"] = (float(v) for v in np.median(late, axis=0))
  return result


def first_call(fn: Callable, *args):
  """The first call (compiles); returns its result and wall seconds."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


def add_rates(row: dict, useful_rows: int, tokens_total: int, row_bytes: Optional[int],
              compute_dtype: str, shape: jsm.MoEShape, ceilings: dict) -> None:
  """Useful GB/s and GFLOP/s of a measured row, and the fraction of the ceilings it reaches.
  route+qpack bytes: the bf16 tokens read (tokens_total = R*T of them) and the rows written.
  With ceilings["rate_devices"] = R (GPUs, which run in parallel and whose ceilings are one
  GPU's) every rate is per GPU: all ranks' bytes and FLOPs / R (the JSON's totals stay whole)."""
  per = ceilings.get("rate_devices", 1)
  flops = 2 * useful_rows * shape.hidden * 2 * shape.intermediate
  wire = useful_rows * row_bytes if row_bytes else 0
  row["compute_dtype"] = compute_dtype
  row["useful_rows"], row["wire_bytes"], row["gemm1_flops"] = useful_rows, wire, flops
  row["rates_per_device"] = per > 1
  flops, wire, tokens_total = flops / per, wire / per, tokens_total / per
  copy_gbps = ceilings["copy_gbps"]
  copy_bound_s = 2 * wire / (copy_gbps * 1e9)
  mm_bound_s = flops / (ceilings["matmul_gflops"][compute_dtype] * 1e9)
  frac = {"stage1": max(copy_bound_s, mm_bound_s) / (row["stage1"]["median_ms"] * 1e-3)}
  if row["stages"]:
    q, d, g = (row["stages"][s] for s in STAGES)
    q["bytes"] = tokens_total * shape.hidden * 2 + wire
    q["gbps"] = q["bytes"] / (q["median_ms"] * 1e-3) / 1e9
    d["gbps"] = wire / (d["median_ms"] * 1e-3) / 1e9
    g["gflops"] = flops / (g["median_ms"] * 1e-3) / 1e9
    frac["route+qpack"] = q["gbps"] / copy_gbps  # both count bytes read + written
    if q.get("pipelined_ms"):  # calls back to back: the kernels without the per-call host wait
      q["pipelined_gbps"] = q["bytes"] / (q["pipelined_ms"] * 1e-3) / 1e9
      frac["route+qpack pipelined"] = q["pipelined_gbps"] / copy_gbps
    frac["dispatch"] = copy_bound_s / (d["median_ms"] * 1e-3)
    frac["gemm1"] = mm_bound_s / (g["median_ms"] * 1e-3)
  row["ceiling_fraction"] = frac


# ------------------------------------------------------------------------------------------------
# Ceilings


# XLA's dense matmul with float32 accumulation (cuBLAS on GPU), the matmul ceilings' kernel
_dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))


def _best_seconds(fn: Callable, reps: int) -> float:
  """Fastest of reps calls after one untimed call: a ceiling is the best the machine does (a shared
  machine only ever makes a call slower)."""
  fn()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times)


def measure_ceilings(reps: int = 10, n: int = 1024) -> dict:
  """Host memcpy bandwidth (read + write bytes) and matmul rates per compute dtype: float32 (the CPU
  GEMM1 kernel and the reference accumulate dequantised values in float32) and bfloat16 inputs with
  float32 accumulation (what the JAX-native paths run)."""
  src = np.ones((256 << 20) // 8, np.float64)  # 256 MiB, pages touched before timing
  dst = np.empty_like(src)
  copy_s = _best_seconds(lambda: np.copyto(dst, src), reps)
  a = np.random.default_rng(0).standard_normal((n, n), np.float32)
  a32, a16 = jnp.asarray(a), jnp.asarray(a, jnp.bfloat16)
  flops = 2 * n ** 3
  f32_s = min(_best_seconds(lambda: a @ a, reps),
              _best_seconds(lambda: _dot(a32, a32).block_until_ready(), reps))
  bf16_s = _best_seconds(lambda: _dot(a16, a16).block_until_ready(), reps)
  return {"copy_gbps": 2 * src.nbytes / copy_s / 1e9,
          "matmul_gflops": {"f32": flops / f32_s / 1e9, "bf16": flops / bf16_s / 1e9},
          "how": f"best of {reps}: numpy copyto of {src.nbytes >> 20} MiB counting read + write; "
                 f"{n}^3 matmul, f32: faster of numpy and jnp.dot, bf16: jnp.dot with f32 "
                 "accumulation"}


def measure_device_ceilings(device, copy_bytes: int, n: int, reps: int = 10) -> dict:
  """On `device` (the default device while this runs): copy bandwidth (read + write bytes of a
  jitted elementwise pass over copy_bytes) and XLA's dense bf16 matmul rate at n³ (f32
  accumulation), best of reps."""
  copy_gbps = device_copy_gbps(copy_bytes, reps)
  mm = dense_bf16_matmul(n, n, n, reps, 1, jax.random.key(0), stat="min_ms")
  return {"copy_gbps": copy_gbps,
          "matmul_gflops": {"bf16": mm["gflops"]},
          "how": f"best of {reps} on {device.device_kind}: jitted a + 1 over "
                 f"{copy_bytes >> 20} MiB (uint32) counting read + write; {n}^3 jnp.dot in bf16 "
                 "with f32 accumulation",
          "dense_bf16": []}  # one per (shape, tokens), by measure.device_config


def peer_copy_gbps(src, dst, nbytes: int, reps: int = 5) -> float:
  """Bytes per second of one device-to-device copy src -> dst (jax.device_put between the devices
  of one process: PjRt's peer copy), best of reps: the wire ceiling of one direction."""
  a = jax.device_put(jnp.zeros(nbytes // 4, jnp.uint32), src)
  return nbytes / _best_seconds(lambda: jax.device_put(a, dst).block_until_ready(), reps) / 1e9


def device_copy_gbps(nbytes: int, reps: int) -> float:
  """Read + write bytes per second of a jitted elementwise pass over nbytes on the default device
  (`a + 1`, not `a + 0` or a copy XLA could elide: every byte is read and written)."""
  src = jnp.zeros(nbytes // 4, jnp.uint32)
  bump = jax.jit(lambda a: a + 1)
  return 2 * nbytes / _best_seconds(lambda: bump(src).block_until_ready(), reps) / 1e9


def dense_bf16_matmul(m: int, k: int, n: int, iters: int, warmup: int, key,
                      stat: str = "median_ms") -> dict:
  """XLA's (cuBLAS on GPU) dense bf16 [m, k] x [k, n] with f32 accumulation on the default device,
  timed like the paths; gflops from the `stat` time."""
  ka, kb = jax.random.split(key)
  a = jax.random.normal(ka, (m, k), jnp.bfloat16)
  b = jax.random.normal(kb, (k, n), jnp.bfloat16)
  t = time_calls(_dot, (a, b), iters, warmup)
  return {"m": m, "k": k, "n": n, **t, "gflops": 2 * m * k * n / (t[stat] * 1e-3) / 1e9}
