"""What a run leaves under --out (default bench/results/, ignored by git): <tag>.json, rewritten
after every configuration so an interrupted run keeps what it measured, and at the end <tag>.png
(when matplotlib is importable). --merge makes one report (table, JSON, PNG and <tag>.txt) from
several runs' JSON files of one mode.

JSON: {"meta": how and where it ran (versions, machine, devices, launch, args), "ceilings": what the
machine does at best, measured in the same run, "notes": the table's notes, "results": one row per
(shape, tokens, path)}."""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Optional, Sequence

import jax
import numpy as np

import jax_sdma_moe as jsm

from bench.tables import format_gemm1_table, format_single_device_table, format_table

DENSE_LABEL = "XLA dense bf16 matmul, same FLOPs"


def write_plot(rows: Sequence[dict], path: Path, dense: Optional[Sequence[dict]] = None
               ) -> Optional[str]:
  """Stage1 ms against tokens per shape, one line per path; with `dense` (--gpu) a second row of
  panels: gemm1 useful TFLOP/s of every path against XLA's dense bf16 matmul of the same FLOPs."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
  except ImportError:
    return "matplotlib is not importable: no plot written (pip install matplotlib)"
  ok = [r for r in rows if "failed" not in r and "stage1" in r]  # gemm1-alone rows: no plot
  if not ok:
    return "no measured rows: no plot written"
  shapes = sorted({r["shape"] for r in ok})
  panels = 2 if dense is not None else 1
  fig, axes = plt.subplots(panels, len(shapes), figsize=(6 * len(shapes), 4.5 * panels),
                           squeeze=False)

  def draw(ax, series: dict, ylabel: str, title: str):
    for name, pts in series.items():
      if pts:  # engines solid, JAX-native dashed, the dense matmul ceiling dotted
        ax.plot(*zip(*sorted(pts)), marker="o", label=name,
                linestyle="-" if name.startswith("engine") else ":" if name == DENSE_LABEL
                else "--")
    ax.set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel=ylabel, title=title)
    ax.set_xticks(sorted({T for pts in series.values() for T, _ in pts}))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

  for col, shape in enumerate(shapes):
    mine = [r for r in ok if r["shape"] == shape]
    names = dict.fromkeys(r["path"] for r in mine)
    draw(axes[0][col], {n: [(r["tokens"], r["stage1"]["median_ms"]) for r in mine
                            if r["path"] == n] for n in names},
         "Stage1 ms (median)", f"{shape}, {ok[0]['ranks']} ranks")
    if dense is not None:
      series = {n: [(r["tokens"], r["stages"]["gemm1"]["gflops"] / 1e3) for r in mine
                    if r["path"] == n and r["stages"]] for n in names}
      series[DENSE_LABEL] = [(d["tokens"], d["gflops"] / 1e3) for d in dense
                             if d["shape"] == shape]
      draw(axes[1][col], series, "gemm1 useful TFLOP/s", f"{shape}: gemm1")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return None


def metadata(args, engines, devices, launch: str = "single") -> dict:
  cpu_model = platform.processor()
  if not cpu_model and os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      cpu_model = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), "")
  return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
          "numpy": np.__version__, "jax_sdma_moe": jsm.__version__,
          "python": platform.python_version(),
          "machine": cpu_model or platform.machine(), "nproc": os.cpu_count(),
          "platform": devices[0].platform, "devices": len(devices),
          "device_kind": devices[0].device_kind, "engines": list(engines),
          "launch": launch, "processes": jax.process_count(),
          "args": vars(args), "argv": sys.argv}


class Report:
  """The JSON (rewritten after every configuration, so an interrupted run keeps what it has) and,
  at the end, the PNG, under --out. Multi-process: process 0 writes them, the others nothing."""

  def __init__(self, args, stem: str, meta: dict, ceilings: dict, notes: Sequence[str]):
    self.dir = Path(args.out)
    self.writes = jax.process_index() == 0
    if self.writes:
      self.dir.mkdir(parents=True, exist_ok=True)
    self.json, self.png = self.dir / f"{stem}.json", self.dir / f"{stem}.png"
    self.head = {"meta": meta, "ceilings": ceilings, "notes": list(notes)}

  def write_json(self, rows: Sequence[dict]) -> None:
    if self.writes:
      self.json.write_text(json.dumps({**self.head, "results": list(rows)}, indent=1) + "\n")

  def finish(self, rows: Sequence[dict], table: str, dense=None) -> None:
    """Prints the table, writes the JSON and the PNG (with dense: the --gpu panels of gemm1
    against XLA's dense matmul)."""
    if not self.writes:
      return
    print(table)
    self.write_json(rows)
    print(f"wrote {self.json}")
    note = write_plot(rows, self.png, dense)
    print(note or f"wrote {self.png}")


def merge_reports(args) -> None:
  """--merge: the rows of several runs' JSON files as one report, each row as it was measured."""
  runs = [(f, json.loads(Path(f).read_text())) for f in args.merge]
  modes = {(d["meta"]["args"].get("gpu"), bool(d["meta"]["args"].get("gemm1_rows")),
            d["meta"]["launch"], d["meta"]["devices"], d["meta"]["device_kind"]) for _, d in runs}
  if len(modes) > 1:
    raise SystemExit(f"--merge: the files come from different modes {sorted(map(str, modes))}")
  rows, dense = {}, {}
  for f, d in runs:
    rows.update({(r["shape"], r["tokens"], r.get("rows_total") if r["kind"] == "gemm1" else None,
                  r.get("experts"), r["path"]): {**r, "source": Path(f).name}
                 for r in d["results"]})
    dense.update({(r["shape"], r["tokens"]): r for r in d["ceilings"].get("dense_bf16", [])})
  rows = sorted(rows.values(), key=lambda r: (r["shape"], r["tokens"] or 0, r.get("rows_total")
                                             if r["kind"] == "gemm1" else 0))  # stable
  first = runs[0][1]
  ceilings = {**first["ceilings"], "dense_bf16": list(dense.values())}
  sources = [f"{Path(f).name} ({d['meta']['date']}, {len(d['results'])} rows, ceilings "
             f"copy {d['ceilings']['copy_gbps']:.0f} GB/s)" for f, d in runs]
  notes = list(first["notes"]) + ["merged from " + "; ".join(sources) + "; the ceilings line is "
                                  "the first file's"]
  gpu_mode, stem = first["meta"]["args"].get("gpu"), args.tag or "merged"
  if first["meta"]["args"].get("gemm1_rows"):
    gpu_mode, text = False, format_gemm1_table(rows, ceilings, notes)  # no plot
  elif gpu_mode:
    skipped = set.intersection(*({s for s in (d["meta"]["args"].get("skip_native") or "").split(",")
                                  if s} for _, d in runs))  # skipped in every run
    text = (format_single_device_table(rows, ceilings, skipped, notes) + "\n"
            + format_gemm1_table(rows, ceilings))
  else:
    text = format_table(rows, ceilings, notes)
  report = Report(args, stem, {**first["meta"], "merged_from": sources}, ceilings, notes)
  (report.dir / f"{stem}.txt").write_text(text + "\n")
  report.finish(rows, text, ceilings["dense_bf16"] if gpu_mode else None)
