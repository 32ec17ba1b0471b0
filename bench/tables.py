"""The text tables a run prints (and --merge reprints from JSON), and the notes that explain their
columns (also stored in the JSON).

CPU mode: one line per path and (shape, tokens). --gpu: one line per engine path and (shape,
tokens), with the JAX-native baselines of the same configuration in its last columns, then the
ceilings and, for engines ce and sm, the device timeline and host statistics of the fused calls."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from bench.gemm_peers import ratios
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
                   + (f"; first peer's copies landed {t['first_chunk_ms']:.2f}"
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


GEMM1_NOTES = (
    "gemm1 against its peers (issue 13), on the same rows per expert in the same run. ms: median "
    "wall time of one gemm1 call until block_until_ready (the gemm1 ms of the Stage1 table); pipe: "
    "--iters calls enqueued back to back / iters, the device's time, from which TF/s and every "
    "ratio are taken (the peers are timed on the device with CUDA events: median of --iters calls "
    "after --warmup).",
    "vs X = X's ms / our pipe ms (> 1: ours faster). bf16 = torch._grouped_mm, bf16 x [M, H] and "
    "w [E, 2I, H] (its transpose), offsets the cumulative rows per expert; fp8 = "
    "torch._scaled_grouped_mm, e4m3 with rowwise float32 scales; MX = Triton tl.dot_scaled, e4m3 "
    "with E8M0 block-32 scales (exact MX, as ours), one dense [M, H] x [H, 2I] GEMM of the same "
    "FLOPs, best of a few tiles (each tile's ms in the JSON); dense = torch's bf16 a @ b.T of the "
    "same FLOPs (cuBLAS), a ceiling.",
    "floor = the fp8 weights and E8M0 scales of the experts with rows / the copy bandwidth of this "
    "run (read + write counted); / floor = pipe / floor (issue 13: <= 1.25 at small batches).",
    "Each peer runs on its own random data beside JAX's memory pool (torch and triton are imported "
    "only on a CUDA device) and is checked against float64 on up to 64 rows of two groups before "
    "it is timed (relative error in the JSON; over 1e-2: failed). In a Stage1 run the peers take "
    "rank 0's rows per local expert (R > 1: our gemm1 ms is the max over ranks).",
)


def format_gemm1_table(rows: Sequence[dict], ceilings: dict,
                       notes: Sequence[str] = GEMM1_NOTES) -> str:
  """gemm1 against its peers: one line per gemm1-alone row (--gemm1-rows) or engine row of a --gpu
  Stage1 run; empty if no row has peers."""
  cols = [("shape", 6, "{}"), ("T", 5, "{}"), ("path", 12, "{}"), ("rows", 6, "{}"),
          ("exp", 4, "{}"), ("rows/exp", 8, "{:.0f}"), ("ms", 7, "{:.3f}"),
          ("pipe ms", 7, "{:.3f}"), ("TF/s", 5, "{}"), ("bf16 ms", 7, "{:.3f}"),
          ("vs bf16", 7, "{:.2f}x"),
          ("fp8 ms", 7, "{:.3f}"), ("vs fp8", 6, "{:.2f}x"), ("MX ms", 7, "{:.3f}"),
          ("vs MX", 6, "{:.2f}x"), ("floor ms", 8, "{:.3f}"), ("/ floor", 7, "{:.2f}x"),
          ("dense TF/s", 10, "{}")]
  table, why = [], {}
  for r in rows:
    peers = r.get("gemm1_peers")
    if not peers or r["kind"] not in ("engine", "gemm1"):
      continue
    prob, res = peers["problem"], peers["results"]
    g = r.get("gemm1") if r["kind"] == "gemm1" else r.get("stages", {}).get("gemm1")
    ours = g["pipelined_ms"] if g and "failed" not in r else None
    ratio = ratios(ours, peers)
    where = f"{r['shape']} T={r['tokens']}" if r["tokens"] else f"{r['shape']} rows={prob['rows']}"
    for name, v in res.items():
      for state in ("skipped", "failed"):
        if state in v:  # one line per reason: the peers and rows it concerns
          peers_at = why.setdefault(f"{state}: {v[state]}", ({}, {}))
          peers_at[0][name], peers_at[1][where] = None, None

    def peer(name):
      v = res[name]
      return v["ms"] if "ms" in v and "failed" not in v else (
          "skipped" if "skipped" in v else "failed")

    dense = res["torch-dense"]
    table.append([r["shape"], r["tokens"] or "-", r["path"], prob["rows"], prob["experts"],
                  prob["rows"] / max(1, prob["experts"]),
                  g["median_ms"] if ours else "failed",
                  ours, _rate(r["gemm1_flops"] / (ours * 1e-3) / 1e12 / (r.get("ranks") or 1))
                  if ours else None,
                  peer("torch-bf16"), ratio.get("torch-bf16"), peer("torch-fp8"),
                  ratio.get("torch-fp8"), peer("triton-mx"), ratio.get("triton-mx"),
                  peers["floor"]["ms"], ratio.get("floor"),
                  _rate(dense.get("tflops")) if "failed" not in dense else None])
  if not table:
    return ""
  lines = ["gemm1 against its peers (same rows per expert, same run):"]
  lines += render_table(cols, table, left=3)
  lines += [f"  {', '.join(names)}: {w} ({', '.join(at)})" for w, (names, at) in why.items()]
  lines.append(f"ceilings (peers): copy {ceilings['copy_gbps']:.0f} GB/s, the floor's bandwidth")
  lines += [f"- {n}" for n in notes]
  extra = [t for t in (format_sustained_table(rows), format_rounds_table(rows)) if t]
  return "\n".join(lines + extra)


def format_rounds_table(rows: Sequence[dict]) -> str:
  """gemm1 and its grouped peers timed alternately (bench/run.py --rounds); empty if none was."""
  cols = [("shape", 6, "{}"), ("peer", 10, "{}"), ("rows", 6, "{}"), ("rows/exp", 8, "{:.0f}"),
          ("rounds", 6, "{}"), ("ours ms", 7, "{:.3f}"), ("peer ms", 7, "{:.3f}"),
          ("median", 7, "{:.2f}x"), ("min", 6, "{:.2f}x"), ("max", 6, "{:.2f}x"),
          ("each round (peer ms / ours ms)", 30, "{}")]
  table = []
  for r in rows:
    for name, v in (r.get("gemm1_rounds") or {}).items():
      if "skipped" in v:
        continue
      measured = "ratios" in v
      table.append([r["shape"], name, r["rows_total"], r["rows_total"] / r["experts"],
                    len(v["ratios"]) if measured else "failed"] + (
                    [float(np.median([m["ours"] for m in v["rounds"]])),
                     float(np.median([m[name] for m in v["rounds"]])), v["median_ratio"],
                     v["min_ratio"], v["max_ratio"], " ".join(f"{x:.3f}" for x in v["ratios"])]
                    if measured else [None] * 5 + [v["failed"]]))
  return _titled_table(
      "gemm1 and each grouped peer timed alternately (--rounds; > 1x: ours faster):", cols, table,
      2, "each round times ours (the pipelined burst) and the peer (the median of its calls) once "
         "each, after a rest, the order reversed every other round; ms: the rounds' medians.")


def _titled_table(title: str, cols: Sequence[tuple], table: list, left: int, note: str) -> str:
  """A title, the table (render_table) and a note; empty if the table has no rows."""
  if not table:
    return ""
  return "\n".join([title] + render_table(cols, table, left) + [f"- {note}"])


def format_sustained_table(rows: Sequence[dict]) -> str:
  """gemm1 and its peers in steady state (bench/run.py --sustain); empty if none was measured."""
  cols = [("shape", 6, "{}"), ("rows", 6, "{}"), ("rows/exp", 8, "{:.0f}"), ("s", 3, "{:.0f}"),
          ("ms", 7, "{:.3f}"), ("TF/s", 5, "{}"), ("MHz", 5, "{:.0f}"), ("W", 4, "{:.0f}"),
          ("bf16 ms", 7, "{:.3f}"), ("MHz", 5, "{:.0f}"), ("W", 4, "{:.0f}"),
          ("vs bf16", 7, "{:.2f}x"), ("fp8 ms", 7, "{:.3f}"), ("MHz", 5, "{:.0f}"),
          ("vs fp8", 6, "{:.2f}x"), ("dense TF/s", 10, "{}"), ("MHz", 5, "{:.0f}")]
  table = []
  for r in rows:
    ours = (r.get("gemm1") or {}).get("sustained") if r["kind"] == "gemm1" else None
    if not ours:
      continue
    res = r["gemm1_peers"]["results"]
    peer = {n: res[n].get("sustained") or {} for n in ("torch-bf16", "torch-fp8", "torch-dense")}
    vs = lambda n: peer[n]["ms"] / ours["ms"] if "ms" in peer[n] else None
    dense = peer["torch-dense"]
    table.append([r["shape"], r["rows_total"], r["rows_total"] / r["experts"], ours["seconds"],
                  ours["ms"], _rate(r["gemm1_flops"] / (ours["ms"] * 1e-3) / 1e12),
                  ours.get("sm_mhz"), ours.get("power_w"), peer["torch-bf16"].get("ms"),
                  peer["torch-bf16"].get("sm_mhz"), peer["torch-bf16"].get("power_w"),
                  vs("torch-bf16"), peer["torch-fp8"].get("ms"), peer["torch-fp8"].get("sm_mhz"),
                  vs("torch-fp8"),
                  _rate(r["gemm1_flops"] / (dense["ms"] * 1e-3) / 1e12) if "ms" in dense else None,
                  dense.get("sm_mhz")])
  return _titled_table(
      "gemm1 and its peers in steady state (--sustain: calls back to back for s seconds):", cols,
      table, 1, "ms per call over the second half of the period; MHz, W: the median SM clock and "
                "board power that nvidia-smi sampled meanwhile (the GPU at its power limit: short "
                "bursts of --iters calls run at higher clocks than a model's steady state).")
