"""Stage1 benchmark (DESIGN.md §8): jax_sdma_moe engines against JAX-native paths, in one run.

Every path is checked against jax_sdma_moe.reference before it is timed; a wrong result ends the
run, a path that fails at run time (out of memory, ...) is reported as failed and the run goes on.
Timed per path: Stage1 through the public API (jsm.stage1 in a jitted shard_map) and its three
stages apart (route+qpack, dispatch, gemm1: each its own jitted shard_map over the
jax_sdma_moe.primitives calls); the JAX-native baselines: a capacity-based all_to_all + einsum path
and a dropless all_to_all + ragged_dot path. One call is the wall time of the whole SPMD program
until jax.block_until_ready (the max over ranks, and over processes); statistics over --iters
calls after --warmup more. It prints a table and writes JSON (after every configuration) and a PNG
to --out.

Modes:
  CPU (default)  R ranks on virtual CPU devices (--devices, 8; or --mesh, e.g. dp=2,ep=4: then R
                 of "ep" in each EP group, T tokens on every device; --gpu and --layer take it
                 too): inputs made on the host, every path checked against the full
                 reference.stage1 (of each group), which is timed too; ceilings: host memcpy and
                 matmul.
  --gpu          R = --devices GPUs of this process (1: engine local; more: ce, sm, xla and the peer
                 copy as the wire ceiling): inputs and weights made on the devices; checks: layout
                 arrays against reference.dispatch, h of a sample of experts against a float32
                 reference; ceilings: device copy, XLA's dense bf16 matmul of gemm1's FLOPs.
                 --platform cpu runs the same code on CPU devices.
  multi-process  one rank per process over jax.distributed: under mpirun (Open MPI's environment),
                 or started with --coordinator/--num-processes/--process-id. Every process makes
                 the same inputs from the same seed, checks its own ranks (a failure on any fails
                 all) and times every call (a call's time: the max over processes); process 0
                 prints and writes. CPU: engine xla, gloo collectives; --gpu: engines ce, sm.
  --gemm1-rows   --gpu, one device: gemm1 alone at given rows over --experts local experts, checked,
                 timed, with its peers (torch's bf16 and fp8 grouped GEMMs, Triton's exact-MX
                 dot_scaled, the weight-streaming floor; bench/gemm_peers.py), instead of Stage1.
                 A Stage1 --gpu run measures the same peers on each configuration's rows.
  --layer        the whole MoE layer instead of Stage1 (bench/layer.py): jsm.moe per engine and the
                 JAX-native capacity layer (all_to_all + einsum GEMM1, GEMM2 + all_to_all back),
                 checked on sampled tokens, timed; one process (CPU devices, or --gpu --platform).
  --merge        runs nothing: one report from earlier runs' JSON files of one mode.

The code: bench/inputs.py (inputs and weights), paths.py (engine paths), natives.py (JAX-native
baselines), checks.py (references and checks), timing.py (protocol, ceilings), measure.py (one
configuration), gemm_peers.py (gemm1's peers), tables.py and report.py (output), processes.py
(across processes).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

USAGE = """Examples (from the repository root):
  python bench/run.py                # small shape, T = 128 and 1024, 8 CPU devices
  python bench/run.py --tokens 32 --iters 3 --warmup 1
  python bench/run.py --gpu          # one GPU: dsv3 and v4pro at T = 128, 1024, ..., 8192
  python bench/run.py --gpu --platform cpu --shapes small --tokens 32,128 --iters 3 --warmup 1
  python bench/run.py --gpu --skip-native ragged   # ragged_dot is slow / out of memory on GPU
  python bench/run.py --gpu --devices 2 --shapes dsv3
  python bench/run.py --gpu --gemm1-rows 128x2,32768,65536 --experts 128 --rounds 6  # issue 13
  python bench/run.py --layer --platform cpu --devices 8   # the whole layer (issue 16)
  python bench/run.py --layer --mesh dp=2,ep=4   # the layer inside a (dp, ep) mesh: 2 EP groups
  python bench/run.py --mesh dp=2,ep=4 --tokens 32   # Stage1 likewise (T tokens per device)
  mpirun --allow-run-as-root -n 2 python bench/run.py --gpu --shapes dsv3   # one GPU per process
  mpirun --allow-run-as-root -n 2 python bench/run.py --tokens 32,128   # 2 processes, 1 rank each
  python bench/run.py --coordinator localhost:12345 --num-processes 2 --process-id 0 & \\
  python bench/run.py --coordinator localhost:12345 --num-processes 2 --process-id 1   # no MPI
  python bench/run.py --merge bench/results/a.json bench/results/b.json --tag ab
Device scripts (lent GPU machines): bench/device/README.md"""

# the benchmark's token sweep (tokens per rank) on GPUs: --gpu's default, and docs/figures/
BENCH_TOKENS = (128, 1024, 2048, 4096, 8192)
NATIVE_BASELINES = ("einsum", "ragged")  # --skip-native names
# defaults that depend on the mode: (CPU, --gpu)
DEFAULT_SHAPES = ("small", "dsv3,v4pro")
DEFAULT_TOKENS = ("128,1024", ",".join(map(str, BENCH_TOKENS)))
DEFAULT_ENGINES = ("cpu,xla", "local")
DEFAULT_GPU_MULTI_ENGINES = "ce,sm,xla"  # --gpu --devices R > 1
DEFAULT_GPU_MULTI_PROCESS_ENGINES = "ce,sm"  # --gpu multi-process (Runtime refuses xla there)
MULTI_PROCESS_ENGINES = "xla"  # engine cpu moves rows between the devices of one process only
DEFAULT_DEVICES = 8
EP_AXIS = "ep"  # the mesh axis of the experts (bench/inputs.py AXIS)


def build_parser() -> argparse.ArgumentParser:
  title, _, modes, _ = __doc__.split("\n\n")
  p = argparse.ArgumentParser(description=title, epilog=f"{modes}\n\n{USAGE}",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", help="comma list of jax_sdma_moe.SHAPES names (default: "
                 f"{DEFAULT_SHAPES[0]}; --gpu: {DEFAULT_SHAPES[1]})")
  p.add_argument("--tokens", help="comma list of tokens per rank (default: "
                 f"{DEFAULT_TOKENS[0]}; --gpu: {DEFAULT_TOKENS[1]})")
  p.add_argument("--engines", help="comma list of Stage1Config engines (default: "
                 f"{DEFAULT_ENGINES[0]}; --gpu: {DEFAULT_ENGINES[1]}, with more than one GPU "
                 f"{DEFAULT_GPU_MULTI_ENGINES}; multi-process: {MULTI_PROCESS_ENGINES}, --gpu "
                 f"{DEFAULT_GPU_MULTI_PROCESS_ENGINES})")
  p.add_argument("--devices", type=int, help=f"ranks: virtual CPU devices (default: "
                 f"{DEFAULT_DEVICES}), --gpu: GPUs of this process (default: 1); multi-process: "
                 "one per process")
  p.add_argument("--mesh", metavar="AXIS=N,...", type=parse_mesh,
                 help=f"the device mesh, e.g. dp=2,ep=4: its axes in order, one of them "
                 f"'{EP_AXIS}' (the experts' axis); tokens (--tokens per device) split over every "
                 f"axis, each combination of the other axes' coordinates an independent EP group, "
                 f"the expert weights split over '{EP_AXIS}' and the same on every group; its "
                 f"size is the devices (--devices, if given, must match) (default: "
                 f"{EP_AXIS}=<every device>)")
  p.add_argument("--iters", type=int, default=20, help="timed calls per measurement (default: "
                 "%(default)s)")
  p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (default: "
                 "%(default)s)")
  p.add_argument("--row-align", type=int, default=128,
                 help="Stage1Config.row_align (default: %(default)s)")
  p.add_argument("--sm-blocks", default="24",
                 help="engine sm: comma list of Stage1Config.sm_dispatch_blocks, one path each "
                      "(the SMs the dispatch takes from the GEMM; default: %(default)s)")
  p.add_argument("--gemm-tile-tokens", type=int,
                 help="Stage1Config.gemm_tile_tokens, the CUDA bf16 GEMMs' tile width, one of "
                      "jax_sdma_moe.layout.GEMM_TILE_TOKENS (default: the library's choice by "
                      "rows per expert)")
  p.add_argument("--stage1-out", choices=("bf16", "mxfp8"), default="bf16",
                 help="--layer: Stage1Config.out_dtype of jsm.moe (mxfp8: GEMM1 writes h as "
                      "MX-fp8 and Stage2 takes those bytes, no second quantisation; DESIGN §3) "
                      "(default: %(default)s)")
  p.add_argument("--capacity-factor", type=float, default=1.25,
                 help="all_to_all+einsum baseline: capacity / mean rows per (source, expert) "
                      "(default: %(default)s)")
  p.add_argument("--skip-native", default="", help="comma list of JAX-native baselines not to "
                 f"run: {', '.join(NATIVE_BASELINES)}")
  p.add_argument("--seed", type=int, default=0, help="of every random input (default: "
                 "%(default)s)")
  p.add_argument("--out", default="bench/results",
                 help="folder for the JSON and PNG (default: %(default)s, ignored by git)")
  p.add_argument("--tag", help="output file name (default: 'cpu'; --gpu: 'gpu', 'gpu-x<R>', or "
                 "'gpu-cpu' with --platform cpu; multi-process: '<platform>-mpi<processes>' under "
                 "mpirun, '<platform>-mp<processes>' with --coordinator; --gpu: '-mpi' or '-mp' "
                 "appended; --merge: 'merged')")
  p.add_argument("--gpu", action="store_true",
                 help="GPUs (--devices of this process, or one per process): device-made inputs, "
                      "sampled checks and device ceilings")
  p.add_argument("--platform", default="gpu", choices=("gpu", "cpu"),
                 help="--gpu only: the device to run on (cpu: the same code on CPU devices, to "
                      "try the mode without a GPU; default: %(default)s)")
  p.add_argument("--skip-peers", default="", help="--gpu: comma list of gemm1's peers not to "
                 "run (bench/gemm_peers.py): torch-bf16, torch-fp8, triton-mx, torch-dense, or all")
  p.add_argument("--gemm1-rows", metavar="ROWS", help="--gpu, the first device: instead of "
                 "Stage1, gemm1 alone and its peers at each comma-listed number of rows, spread "
                 "evenly over "
                 "--experts local experts; an entry TxR is T tokens/rank on R ranks' rows, T*R*K "
                 "(e.g. 128x2,32768,65536)")
  p.add_argument("--sustain", type=float, default=0.0, metavar="S",
                 help="--gemm1-rows: also S seconds of calls back to back, ours and each peer's "
                      "(the steady state at the GPU's power limit, which --iters calls do not "
                      "reach), with the SM clock and power meanwhile (default: 0, not measured)")
  p.add_argument("--rounds", type=int, default=0, metavar="N",
                 help="--gemm1-rows: also N rounds that time ours and each grouped torch peer "
                      "alternately, a rest before each measurement and the order reversed every "
                      "other round: the ratio's spread within the run, whose median the table "
                      "reports beside the single measurement (default: 0, none)")
  p.add_argument("--experts", type=int, help="--gemm1-rows: local experts (default: E/2 of each "
                 "shape, one of 2 ranks')")
  p.add_argument("--w1-std", type=float, metavar="STD",
                 help="--gemm1-rows: our w1 is N(0, 1) * STD, then MX-fp8; below ~0.004 some of "
                      "its blocks' scale bytes fall under 112 and the 16-bit kernel runs both its "
                      "passes (DESIGN §3) (default: bench/inputs.py W1_SCALE)")
  p.add_argument("--layer", action="store_true",
                 help="the whole MoE layer instead of Stage1: jsm.moe per engine against the "
                      "JAX-native capacity layer, checked and timed in the same run "
                      "(bench/layer.py); CPU devices, or --gpu's devices of --platform")
  p.add_argument("--trace", action="store_true",
                 help="--gpu: after timing, each path's kernels per device and call from "
                      "JAX's profiler (bench/trace.py), in the log; Stage1: of the full call and "
                      "of each stage alone (also in the JSON row's 'trace'); --layer: of each "
                      "path (also in <out>/<tag>-trace.txt)")
  p.add_argument("--merge", nargs="+", metavar="JSON",
                 help="run nothing: one table, JSON and PNG (under --out, named --tag) from "
                      "earlier runs' JSON files of one mode, e.g. a run cut short by a time limit "
                      "and the run that measured the rest; a later file's row of the same shape, "
                      "tokens and path replaces an earlier one")
  mp = p.add_argument_group(
      "multi-process", "one rank per process over jax.distributed, without mpirun (under mpirun it "
      "is detected\nfrom Open MPI's environment); give all three, the same --coordinator to every "
      "process")
  mp.add_argument("--coordinator", metavar="HOST:PORT",
                  help="jax.distributed coordinator address (process 0 listens there)")
  mp.add_argument("--num-processes", type=int)
  mp.add_argument("--process-id", type=int)
  return p


def parse_mesh(text: str) -> dict:
  """--mesh "dp=2,ep=4" -> {"dp": 2, "ep": 4} (in order), with EP_AXIS among the axes."""
  axes = {}
  for item in text.split(","):
    name, sep, size = item.partition("=")
    if not sep or not name or name in axes or not size.isdigit() or int(size) < 1:
      raise argparse.ArgumentTypeError(f"{text!r}: AXIS=N pairs, comma separated, each axis once "
                                       "and N >= 1 (e.g. dp=2,ep=4)")
    axes[name] = int(size)
  if EP_AXIS not in axes:
    raise argparse.ArgumentTypeError(f"{text!r}: no axis {EP_AXIS!r} (the experts' axis)")
  return axes


def mesh_devices(args, default: int) -> int:
  """The devices a run's mesh takes: --mesh's size, else --devices, else `default`."""
  if args.mesh is None:
    return args.devices or default
  n = math.prod(args.mesh.values())
  if args.devices not in (None, n):
    raise SystemExit(f"--devices {args.devices} and --mesh {args.mesh} ({n} devices) disagree")
  return n


def make_mesh(args, devices, axis_type):
  """The run's mesh over `devices` (len: mesh_devices): --mesh's axes, else EP_AXIS alone."""
  axes = args.mesh or {EP_AXIS: len(devices)}
  return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(axis_type,) * len(axes),
                       devices=devices)


def launch_mode(args) -> str:
  """'mpirun' (Open MPI's environment with more than one process), 'explicit' (--coordinator,
  --num-processes, --process-id) or 'single' (one process: `mpirun -n 1` too)."""
  explicit = (args.coordinator, args.num_processes, args.process_id)
  if any(a is not None for a in explicit):
    if any(a is None for a in explicit):
      raise SystemExit("--coordinator, --num-processes and --process-id go together")
    return "explicit"
  if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    return "mpirun"
  return "single"


def configure_platform(args) -> None:
  """What must happen before jax starts a backend: the number of virtual CPU devices (CPU mode:
  --devices; multi-process: one per process; --gpu needs no more than every backend has), and only
  the CPU backend where the mode runs on CPU devices (on a GPU machine JAX would otherwise make a
  GPU the default device, and multi-process collectives would run on it)."""
  if not args.gpu or args.platform == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
  if launch_mode(args) != "single":
    force_host_devices(1)
  elif not args.gpu:
    force_host_devices(mesh_devices(args, DEFAULT_DEVICES))
  elif args.platform == "cpu":  # --gpu --platform cpu --devices R: R virtual CPU devices
    force_host_devices(mesh_devices(args, 1))


def force_host_devices(n: int) -> None:
  """Ask XLA:CPU for n virtual devices (replacing any device count already in XLA_FLAGS)."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


if __name__ == "__main__":
  # XLA fixes the number of host devices when jax creates its CPU backend, so the flag must be in
  # the environment before jax is imported below.
  ARGS = build_parser().parse_args()
  configure_platform(ARGS)

if not __package__:  # run as a script: import bench/'s modules as the package `bench`
  _HERE = Path(__file__).resolve().parent
  sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
  sys.path.append(str(_HERE.parent))  # last: an installed jax_sdma_moe wins over the checkout's

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402

from bench import gemm_peers, inputs, layer, tables, timing  # noqa: E402
from bench.measure import device_config, gemm1_config, host_config  # noqa: E402
from bench.processes import CheckError, progress  # noqa: E402
from bench.report import Report, merge_reports, metadata  # noqa: E402


def comma_list(text) -> list:
  return [s for s in (text or "").split(",") if s]


def skipped_natives(args) -> set:
  skip = set(comma_list(args.skip_native))
  unknown = skip - set(NATIVE_BASELINES)
  if unknown:
    raise SystemExit(f"--skip-native: unknown {sorted(unknown)}; known: {NATIVE_BASELINES}")
  return skip


def start_processes(args, launch: str) -> None:
  """Multi-process: joins the other processes (jax.distributed; Open MPI's environment is detected
  by jax itself) with gloo for the CPU collectives. Must run before jax starts a backend."""
  if launch == "single":
    return
  if args.gpu and args.devices not in (None, 1):
    raise SystemExit("--gpu --devices: a multi-process run has one device (rank) per process")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if launch == "explicit":
    # --gpu on one node: JAX uses GPU <process id> (CUDA still sees every GPU: peer access / IPC)
    local = [args.process_id] if args.gpu and args.platform == "gpu" else None
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, local_device_ids=local)
  else:
    jax.distributed.initialize()


def main(args) -> None:
  if args.merge:
    return merge_reports(args)
  launch = launch_mode(args)
  mode = int(args.gpu)  # index into the DEFAULT_* pairs
  shapes = comma_list(args.shapes or DEFAULT_SHAPES[mode])
  unknown = [s for s in shapes if s not in jsm.SHAPES]
  if unknown:
    raise SystemExit(f"unknown shape(s) {unknown}; known: {sorted(jsm.SHAPES)}")
  tokens = [int(t) for t in comma_list(args.tokens or DEFAULT_TOKENS[mode])]
  default_engines = DEFAULT_ENGINES[mode] if launch == "single" else MULTI_PROCESS_ENGINES
  if args.gpu and ((args.devices or 1) > 1 or launch != "single"):
    default_engines = ("xla" if args.platform != "gpu" else
                       DEFAULT_GPU_MULTI_ENGINES if launch == "single" else
                       DEFAULT_GPU_MULTI_PROCESS_ENGINES)  # Runtime refuses xla across processes
  engines = comma_list(args.engines or default_engines)
  skip = skipped_natives(args)  # rejects unknown names before anything runs
  gemm_peers.parse_skip(args.skip_peers)
  if args.gemm1_rows and (not args.gpu or launch != "single" or args.mesh):
    raise SystemExit("--gemm1-rows: --gpu in one process, no --mesh (it runs on the first "
                     "device)")
  if args.rounds < 0 or (args.rounds and not args.gemm1_rows):
    raise SystemExit(f"--rounds {args.rounds}: a count of rounds >= 0, with --gemm1-rows")
  start_processes(args, launch)
  try:
    if args.layer:
      rows = layer.layer_main(args, skip, shapes, tokens, engines, launch,
                              layer_mesh(args, launch))
    elif args.gemm1_rows:
      rows = gemm1_main(args, shapes)
    else:
      rows = (device_main if args.gpu else host_main)(args, skip, shapes, tokens, engines, launch)
  except CheckError as e:
    raise SystemExit(f"CHECK FAILED (aborted before timing it; results so far in --out): {e}")
  if any("failed" in r for r in rows if r["kind"] in ("engine", "gemm1")):
    raise SystemExit("an engine path or gemm1 failed at run time (see the table)")


def layer_mesh(args, launch: str):
  """--layer's mesh over devices of --platform (without --gpu: the CPU): every process's in a
  multi-process launch, else --mesh's or --devices' (default: every CPU device; one GPU)."""
  platform = args.platform if args.gpu else "cpu"
  devices = jax.devices(platform)  # every process's, in a multi-process launch
  if launch != "single":
    n = len(devices)
    if args.mesh and mesh_devices(args, n) != n:
      raise SystemExit(f"--layer --mesh: a multi-process run has one rank per device of every "
                       f"process, {n} here")
  else:
    n = mesh_devices(args, len(devices) if platform == "cpu" else 1)
  if len(devices) < n:
    raise SystemExit(f"--layer: {n} {platform} devices requested, jax sees {len(devices)}")
  return make_mesh(args, devices[:n], jax.sharding.AxisType.Explicit)


def multi_process_tag(launch: str) -> str:
  return "mpi" if launch == "mpirun" else "mp"


def multi_process_notes(notes: tuple, launch: str) -> tuple:
  if launch == "single":
    return notes
  return notes + (tables.MULTI_PROCESS_NOTE.format(processes=jax.process_count(), launch=launch),)


def host_main(args, skip, shapes, tokens, engines, launch: str) -> list:
  """R ranks: the virtual CPU devices of this process, or (multi-process) every device of every
  process."""
  if launch == "single":
    R = mesh_devices(args, DEFAULT_DEVICES)
    if len(jax.devices()) < R:
      raise SystemExit(f"{R} devices requested, jax sees {len(jax.devices())}: set "
                       f"XLA_FLAGS=--xla_force_host_platform_device_count={R} before "
                       "jax is imported (running bench/run.py as a script does)")
  else:
    R = jax.device_count()
    if mesh_devices(args, R) != R:
      raise SystemExit(f"--devices/--mesh: a multi-process run has one rank per device of "
                       f"every process, {R} here")
  devices = jax.devices()[:R]
  mesh = make_mesh(args, devices, jax.sharding.AxisType.Explicit)
  progress("measuring ceilings")
  ceilings = timing.measure_ceilings()
  notes = multi_process_notes(tables.NOTES, launch)
  tag = "cpu" if launch == "single" else (
      f"{devices[0].platform}-{multi_process_tag(launch)}{jax.process_count()}")
  report = Report(args, args.tag or tag, metadata(args, engines, devices, launch), ceilings, notes)
  rng = np.random.default_rng(args.seed)
  rows = []
  for name in shapes:
    for T in tokens:
      rows += host_config(args, skip, mesh, jsm.SHAPES[name], T, engines, ceilings, rng)
      report.write_json(rows)
  report.finish(rows, tables.format_table(rows, ceilings, notes))
  return rows


def platform_devices(args) -> list:
  try:
    return jax.devices(args.platform)
  except RuntimeError as e:
    raise SystemExit(f"--gpu: no {args.platform} device ({e}); --platform cpu runs the same code "
                     "on the CPU") from None


def measure_ceilings(device) -> dict:
  """--gpu: the device's ceilings. A 2 GiB copy and an 8192^3 matmul make an H200's; a CPU gets a
  smaller copy and matmul so that trying the mode stays quick."""
  progress(f"measuring ceilings on {device.device_kind}")
  on_gpu = device.platform != "cpu"
  return timing.measure_device_ceilings(device, (2 << 30) if on_gpu else (256 << 20),
                                        8192 if on_gpu else 1024)


def gemm1_main(args, shapes) -> list:
  """--gemm1-rows: gemm1 alone and its peers on the first device of --platform, per shape and
  rows entry, over --experts local experts."""
  device = platform_devices(args)[0]
  key, rng = jax.random.key(args.seed), np.random.default_rng(args.seed)
  rows = []
  with jax.default_device(device):
    ceilings = measure_ceilings(device)
    tag = "gemm1" + ("-cpu" if device.platform == "cpu" else "")
    report = Report(args, args.tag or tag, metadata(args, [], [device]), ceilings,
                    tables.GEMM1_NOTES)
    for s, name in enumerate(shapes):
      shape = jsm.SHAPES[name]
      experts = args.experts or shape.num_experts // inputs.STUDY_RANKS
      for i, entry in enumerate(comma_list(args.gemm1_rows)):
        rows.append(gemm1_config(args, device, shape, inputs.study_rows(entry, shape), experts,
                                 ceilings, jax.random.fold_in(key, 1000 * s + i), rng))
        report.write_json(rows)
  report.finish(rows, tables.format_gemm1_table(rows, ceilings))
  return rows


def device_main(args, skip, shapes, tokens, engines, launch: str) -> list:
  """--gpu: R = --devices (default 1; or --mesh's size) devices of --platform in this process, or
  (multi-process) one device per process; everything made and measured on the devices."""
  devices = platform_devices(args)
  R = mesh_devices(args, 1) if launch == "single" else len(devices)
  if launch != "single" and args.mesh and mesh_devices(args, R) != R:
    raise SystemExit(f"--mesh: a multi-process run has one device per process, {R}")
  if len(devices) < R:
    raise SystemExit(f"--gpu --devices {R}: only {len(devices)} {args.platform} devices")
  devices = devices[:R]
  device = jax.local_devices(backend=args.platform)[0]
  on_gpu = device.platform != "cpu"
  # Auto axes: the stacked [R, ...] arrays then also feed plain jnp code (the reference), which
  # refuses to reduce over an Explicit-sharded axis
  mesh = make_mesh(args, devices, jax.sharding.AxisType.Auto)
  key = jax.random.key(args.seed)
  rng = np.random.default_rng(args.seed)  # picks the randomly checked experts
  rows = []
  with jax.default_device(device):  # every array this makes, and every jit without inputs
    ceilings = measure_ceilings(device)
    if R > 1 and launch == "single":
      ceilings["peer_copy_gbps"] = timing.peer_copy_gbps(devices[0], devices[1],
                                                         (1 << 30) if on_gpu else (64 << 20))
    tag = ("gpu" if on_gpu else "gpu-cpu") + (f"-x{R}" if R > 1 else "")
    if launch != "single":
      tag += f"-{multi_process_tag(launch)}"
    notes = multi_process_notes(tables.SINGLE_DEVICE_NOTES, launch)
    report = Report(args, args.tag or tag, metadata(args, engines, devices, launch), ceilings,
                    notes)
    for s, name in enumerate(shapes):
      shape = jsm.SHAPES[name]
      progress(f"[{name}] making w1 on the device")
      weights = inputs.device_weights(mesh, shape, jax.random.fold_in(key, 2 * s))
      for T in tokens:
        rows += device_config(args, skip, mesh, shape, T, weights, engines, ceilings,
                              jax.random.fold_in(jax.random.fold_in(key, 2 * s + 1), T), rng)
        report.write_json(rows)
      del weights  # the next shape's weights need the memory (v4pro: 17 GB fp8 + 34 GB bf16)
  report.finish(rows, tables.format_single_device_table(rows, ceilings, skip, notes) + "\n"
                + tables.format_gemm1_table(rows, ceilings), ceilings["dense_bf16"])
  return rows


if __name__ == "__main__":
  main(ARGS)
