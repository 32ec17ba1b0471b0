"""The text tables a run prints (and --merge reprints from JSON), and the notes that explain their
columns (also stored in the JSON).

CPU mode: one line per path and (shape, tokens). --gpu: one line per engine path and (shape,
tokens), with the JAX-native baselines of the same configuration in its last columns, then the
ceilings and, for engines ce and sm, the device timeline and host statistics of the fused calls."""
from __future__ import annotations

from typing import Optional, Sequence

from bench.paths import STAGES

VS_NATIVE_NOTE = ("vs nat = fastest JAX-native stage1 ms / this path's stage1 ms (>1: faster than "
                  "JAX-native).")
NOTES = (
    "ms: median wall time of one call of the whole SPMD program (= max over ranks); JSON has "
    "min and p90.",
    "stage columns, each stage its own jitted shard_map: rt+qpack = route + qpack (JAX-native: "
    "route + bf16 pack), disp = dispatch (JAX-native: all_to_all), gemm1 = GEMM1 + SwiGLU.",
    "GB/s: useful landed-row bytes / dispatch time (engines: H + H/32 + 12 bytes a row; "
    "JAX-native: 2H bf16 + 12 header bytes); padding rows are not counted, so paths that move "
    "fixed-size chunks (engine:xla on CPU, both a2a paths) move more bytes than credited.",
    "GFLOP/s: 2 * useful rows * H * 2I / gemm1 time, summed over ranks.",
    "%bw = (2 x row bytes / memcpy bw) / dispatch time (a copy reads and writes each byte); "
    "%mm = gemm1 GFLOP/s / matmul GFLOP/s of the path's arithmetic (engines: the CPU kernel's f32 "
    "on dequantised fp8; JAX-native: bf16 in, f32 accumulation); %ceil = the larger of both "
    "bounds / stage1 time.",
    VS_NATIVE_NOTE,
    "ragged_all_to_all + ragged_dot: n/a on CPU (XLA:CPU does not implement ragged_all_to_all); "
    "native:a2a+ragged_dot sends fixed T*min(K,EL)-row chunks per destination instead (dropless).",
    "native:a2a+einsum: capacity C = ceil(cf * T*K/E) rows per (source, expert) - cf times the "
    "mean - sent in bf16 with all_to_all, einsum per expert; rows past C are dropped ('drop').",
    "native:jnp-reference: jax_sdma_moe.reference.stage1 jitted on one device (all ranks, no "
    "collective; a correctness reference, not a tuned path).",
    "JAX-native paths run on bf16 copies of the dequantised MX-fp8 inputs (exact in bf16), so they "
    "are checked against the same reference at the DESIGN §3 tolerance.",
)
MULTI_PROCESS_NOTE = (
    "{processes} processes ({launch}), one rank each: every process times every call, and a "
    "call's time is the max over processes (= over ranks) before the median over calls; every "
    "process checks its own ranks against the full reference (made from the same seed on every "
    "process), and a failure on any fails all. native:jnp-reference runs on every process's own "
    "device (the max over processes). Ceilings: process 0's, measured while every process "
    "measured its own.")
SINGLE_DEVICE_NOTES = (
    "R devices of one process (R = 1: engine local). ms: median wall time of one jitted call "
    "until block_until_ready (the max over ranks); JSON has min and p90.",
    "Every GB/s and TFLOP/s is per GPU (all ranks' bytes or FLOPs / R), against one GPU's "
    "ceilings. R > 1: disp GB/s = rows landed on a GPU * (H + H/32 + 12) bytes / dispatch time "
    "(including the 1/R that stay on their own GPU), against peer_copy_gbps (one direction). The "
    "dispatch stage alone copies the rows out of the window (engines ce, sm); stage1 runs the GEMM "
    "fused with the dispatch (each expert starts when its rows have landed), so stage1 / gemm1 "
    "measures the overlap.",
    "stage1 = jsm.stage1 (route + qpack + dispatch + gemm1); rt+qp = route + qpack in one jitted "
    "call, disp = dispatch (engine local: a copy into the landing layout), gemm1 = MX-fp8 GEMM1 + "
    "SwiGLU; each stage its own jitted call.",
    "qpack GB/s = (T*H*2 bytes read + rows*(H + H/32 + 12) written) / rt+qp time; %copy = that / "
    "the measured copy bandwidth (read + write); pipe %copy: the same with the calls enqueued "
    "back to back (the kernels' rate, without the per-call host wait).",
    "TFLOP/s = 2 * rows * H * 2I / gemm1 time (rows = T*K, all useful); mm TF/s = XLA's dense bf16 "
    "matmul [T*K, H] x [H, 2I] (f32 accumulation) measured the same way in this run; %mm = "
    "gemm1 / mm. fused TF/s = the same FLOPs / (stage1 - rt+qp): gemm1 with the dispatch it runs "
    "concurrently with (the stage1 GEMM is fused with the dispatch).",
    "einsum = JAX-native capacity path: rows sorted per expert into [E, C, H] bf16 buffers, C = "
    "ceil(cf * T*K/E), einsum, SwiGLU; rows past C dropped ('drop'). ragged = JAX-native dropless "
    "path: rows sorted by expert, lax.ragged_dot with the group sizes. Both run on bf16 copies of "
    "the dequantised MX-fp8 inputs (exact) and are checked like the engine.",
    VS_NATIVE_NOTE,
    "pipe = stage1 with --iters calls enqueued back to back and one wait / iters (no per-call host "
    "synchronisation); every other ms column is per call.",
    "checks before timing: layout arrays equal to reference.dispatch; h of the sampled experts "
    "within DESIGN §3 of a float32 reference; padding rows 0.",
)


def render_table(cols: Sequence[tuple], rows: Sequence[Sequence], left: int) -> list:
  """Lines of a text table: cols are (name, width, format), the first `left` left-aligned and
  printed as they are, the others right-aligned and formatted ('-' for None). A str value in a
  formatted column (e.g. 'failed: ...') is printed as it is."""
  def cell(i, value):
    name, width, fmt = cols[i]
    if i < left:
      return f"{value:<{width}}"
    text = "-" if value is None else value if isinstance(value, str) else fmt.format(value)
    return text.rjust(width)

  lines = ["  ".join(f"{name:>{w}}" if i >= left else f"{name:<{w}}"
                     for i, (name, w, _) in enumerate(cols))]
  lines += ["  ".join(cell(i, v) for i, v in enumerate(vals)) for vals in rows]
  return lines


def format_table(rows: Sequence[dict], ceilings: dict, notes: Sequence[str] = NOTES) -> str:
  cols = [("shape", 6, "{}"), ("T", 5, "{}"), ("path", 28, "{}"), ("stage1 ms", 9, "{:.2f}"),
          ("rt+qpack", 8, "{:.2f}"), ("disp ms", 8, "{:.2f}"), ("GB/s", 6, "{:.2f}"),
          ("%bw", 5, "{:.0%}"), ("gemm1 ms", 8, "{:.2f}"), ("GFLOP/s", 7, "{:.1f}"),
          ("%mm", 5, "{:.0%}"), ("%ceil", 5, "{:.0%}"), ("vs nat", 6, "{:.2f}x"), ("drop", 5, "{}")]
  table, failed = [], []
  for r in rows:
    if "failed" in r:
      failed.append(f"{r['shape']:<6}  {r['tokens']:<5}  {r['path']:<28}  failed: {r['failed']}")
      continue
    st, frac = r["stages"], r["ceiling_fraction"]

    def get(stage, field):  # the reference row has no stages
      return st[stage][field] if st else None

    table.append([r["shape"], r["tokens"], r["path"], r["stage1"]["median_ms"],
                  get("route+qpack", "median_ms"), get("dispatch", "median_ms"),
                  get("dispatch", "gbps"), frac.get("dispatch"), get("gemm1", "median_ms"),
                  get("gemm1", "gflops"), frac.get("gemm1"), frac["stage1"], r["vs_best_native"],
                  r["dropped"]])
  lines = render_table(cols, table, left=3) + failed
  for shape, T in sorted({(r["shape"], r["tokens"]) for r in rows}):
    lines.append(f"{shape:<6}  {T:<5}  {'native:ragged_a2a+ragged_dot':<28}  n/a on CPU "
                 "(XLA:CPU has no ragged_all_to_all)")
  mm = ceilings["matmul_gflops"]
  lines.append(f"ceilings: memcpy {ceilings['copy_gbps']:.1f} GB/s, matmul f32 {mm['f32']:.0f} / "
               f"bf16 {mm['bf16']:.0f} GFLOP/s ({ceilings['how']})")
  lines += [f"- {n}" for n in notes]
  return "\n".join(lines)


def _rate(v: Optional[float]) -> Optional[str]:
  """A rate with 3 significant digits, without exponents (H200 TFLOP/s run to 4 digits)."""
  return None if v is None else f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def format_single_device_table(rows: Sequence[dict], ceilings: dict, skipped: set,
                               notes: Sequence[str] = SINGLE_DEVICE_NOTES) -> str:
  """--gpu: one line per engine path and (shape, tokens), with the JAX-native baselines of the same
  configuration in its last columns."""
  cols = [("shape", 6, "{}"), ("T", 5, "{}"), ("path", 12, "{}"), ("stage1 ms", 9, "{:.3f}"),
          ("pipe ms", 7, "{:.3f}"), ("rt+qp ms", 8, "{:.3f}"), ("GB/s", 6, "{}"), ("%copy", 5, "{:.0%}"),
          ("pipe %copy", 10, "{:.0%}"),
          ("disp ms", 7, "{:.3f}"), ("GB/s", 6, "{}"), ("gemm1 ms", 8, "{:.3f}"),
          ("TFLOP/s", 7, "{}"), ("fused TF/s", 10, "{}"), ("st1/gemm", 8, "{:.2f}"),
          ("mm TF/s", 7, "{}"), ("%mm", 5, "{:.0%}"), ("einsum ms", 9, "{:.3f}"),
          ("drop", 5, "{}"), ("vs nat", 6, "{:.2f}x"), ("ragged ms", 9, "{:.3f}")]

  def native(shape, T, baseline):
    """(stage1 ms or why there is none, rows dropped) of a baseline in this configuration."""
    if baseline in skipped:
      return "skipped", None
    r = next((r for r in rows if r["shape"] == shape and r["tokens"] == T
              and r.get("baseline") == baseline), None)
    if r is None:
      return None, None
    if "failed" in r:
      return f"failed: {r['failed']}", None
    return r["stage1"]["median_ms"], r["dropped"]

  table = []
  for r in rows:
    if r["kind"] != "engine":
      continue
    shape, T = r["shape"], r["tokens"]
    einsum_ms, drop = native(shape, T, "einsum")
    ragged_ms, _ = native(shape, T, "ragged")
    if "failed" in r:
      natives = [einsum_ms, drop, None, ragged_ms]  # the last four columns
      table.append([shape, T, r["path"], f"failed: {r['failed']}"]
                   + [None] * (len(cols) - 4 - len(natives)) + natives)
      continue
    q, d, g = (r["stages"][s] for s in STAGES)
    frac = r["ceiling_fraction"]
    fused_ms = r["stage1"]["median_ms"] - q["median_ms"]  # gemm1 with the dispatch it overlaps
    fused = g["gflops"] * g["median_ms"] / fused_ms / 1e3 if fused_ms > 0 else None
    table.append([shape, T, r["path"], r["stage1"]["median_ms"], r["stage1"]["pipelined_ms"],
                  q["median_ms"], _rate(q["gbps"]),
                  frac["route+qpack"], frac.get("route+qpack pipelined"), d["median_ms"],
                  _rate(d["gbps"]), g["median_ms"],
                  _rate(g["gflops"] / 1e3), _rate(fused), r["stage1"]["median_ms"] / g["median_ms"],
                  _rate(r["dense_bf16_gflops"] / 1e3), frac["gemm1"], einsum_ms, drop,
                  r["vs_best_native"], ragged_ms])
  lines = render_table(cols, table, left=3)
  peer = (f", peer copy {ceilings['peer_copy_gbps']:.0f} GB/s (jax.device_put GPU0 -> GPU1)"
          if "peer_copy_gbps" in ceilings else "")
  lines.append(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s{peer}, dense bf16 "
               f"{ceilings['matmul_gflops']['bf16'] / 1e3:.3g} TFLOP/s ({ceilings['how']})")
  for r in rows:
    if "timeline_ms" in r:
      t = r["timeline_ms"]
      lines.append(f"{r['shape']} T={r['tokens']} {r['path']}: device timeline of the fused calls "
                   f"(ms after the dispatch's start, mean over calls, max over ranks): GEMM "
                   f"starts {t['gemm_start_ms']:.2f}, ends {t['gemm_end_ms']:.2f}; side stream "
                   f"done {t['side_end_ms']:.2f}"
                   + (f"; first chunk of peer copies landed {t['first_chunk_ms']:.2f}"
                      if t.get("first_chunk_ms") is not None else ""))
    if "ce_host_us" in r:
      h = r["ce_host_us"]
      lines.append(f"{r['shape']} T={r['tokens']} {r['path']}: host per call (mean over the "
                   f"path's calls, max over ranks): plan synchronisation {h['plan_us']:.0f} µs "
                   + (f"({h['plan_stream_us']:.0f} of them waiting for this rank's stream: "
                      "route+qpack; the rest for the slowest peer)"
                      if "plan_stream_us" in h else
                      "(includes waiting for route+qpack and the slowest peer)")
                   + ", copy enqueue "
                   f"{h['enqueue_us']:.0f} µs for {h.get('copies', 0):.0f} copies"
                   + (f" (of them within the GPU: {h['own_enqueue_us']:.0f} µs for "
                      f"{h['own_copies']:.0f})" if "own_copies" in h else "")
                   + (f", {h['single_copies']:.0f} of them one at a time (cudaMemcpyBatchAsync: "
                      f"{h['batch_error']})" if h.get("single_copies") else ""))
  lines += [f"- {n}" for n in notes]
  return "\n".join(lines)
