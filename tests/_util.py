"""Shared test helpers: 8 virtual CPU devices, random inputs, the §3 tolerance check."""
import functools
import os
import socket
import subprocess
import sys

# Must precede the first jax import: XLA sizes the host platform when the backend starts. On a
# GPU, XLA's autotuning is off: the references' float32 GEMMs take a new shape in almost every
# test, and autotuning each one is compile time (the checks against them are tolerances, §3).
os.environ.setdefault("XLA_FLAGS",
                      "--xla_force_host_platform_device_count=8 --xla_gpu_autotune_level=0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402

NUM_DEVICES = 8


def rng():
  """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
  seed = int(os.environ.get("JSM_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
  print(f"[seed {seed}]", file=sys.stderr)
  return np.random.default_rng(seed)


def mesh(num_ranks=NUM_DEVICES, axis="ep"):
  devs = np.array(jax.devices()[:num_ranks])
  return jax.sharding.Mesh(devs, (axis,), axis_types=(jax.sharding.AxisType.Explicit,))


def make_ids(r, R, T, K, E, routing="uniform"):
  """[R*T, K] int32 top-k ids. uniform: K distinct experts; skewed: every row to rank 0's experts
  (one expert gets every token); masked: ~30% of slots -1; invalid: ~20% of slots >= E."""
  EL = E // R
  if routing == "skewed":
    if K > EL:
      raise ValueError("skewed routing needs K <= E/R (distinct experts on rank 0)")
    rest = np.stack([1 + r.permutation(EL - 1)[:K - 1] for _ in range(R * T)]).reshape(R * T, K - 1)
    return jnp.asarray(np.concatenate([np.zeros((R * T, 1), int), rest], 1), jnp.int32)
  ids = np.stack([r.permutation(E)[:K] for _ in range(R * T)])
  if routing == "masked":
    ids[r.random(ids.shape) < 0.3] = -1
  elif routing == "invalid":
    bad = r.random(ids.shape) < 0.2
    ids[bad] = r.integers(E, 3 * E + 5, size=int(bad.sum()))
  elif routing != "uniform":
    raise ValueError(routing)
  return jnp.asarray(ids, jnp.int32)


def make_problem(r, R, T, H, I, E, K, routing="uniform", w_scale=0.05):
  x = jnp.asarray(r.standard_normal((R * T, H)) * r.uniform(0.5, 4.0, (R * T, 1)), jnp.bfloat16)
  ids = make_ids(r, R, T, K, E, routing)
  weights = jnp.asarray(r.random((R * T, K)), jnp.float32)
  w1 = jnp.asarray(r.standard_normal((E, 2 * I, H)) * w_scale, jnp.bfloat16)
  return x, ids, weights, jsm.quantize_w1(w1)


def shard(m, tree, axis="ep"):
  return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(m, P(axis))), tree)


def stage1_fn(m, rt, axis="ep", check=False, with_weights=True):
  """jit(shard_map(stage1)); outputs stacked [R, ...] over ranks."""
  def body(x, ids, weights, w1q):
    topk = (ids, weights) if with_weights else ids
    out = jsm.stage1(x, topk, w1q, runtime=rt, check=check)
    return jax.tree.map(lambda a: a[None], out)
  return jax.jit(jax.shard_map(body, mesh=m, in_specs=P(axis), out_specs=P(axis)))


# The references, jitted: one compile per shape instead of one per jnp operation (run eagerly, a
# reference compiles each of its operations for every new shape, for the device it runs on).
_STATIC = ("row_align", "cap", "swiglu_limit", "out_dtype")
_reference_stage1 = jax.jit(jsm.reference.stage1, static_argnames=_STATIC + ("return_f32",))
_reference_moe = jax.jit(jsm.reference.moe, static_argnames=_STATIC)


def reference(x, ids, weights, w1q, R, cfg, T, cap=None):
  K = ids.shape[-1]
  EL = w1q.values.shape[0] // R
  cap = cap or jsm.layout.m_cap(R, T, K, EL, cfg.row_align, cfg.max_recv_rows)
  xr = jax.tree.map(lambda a: a.reshape(R, T, *a.shape[1:]), x)
  return _reference_stage1(
      xr, ids.reshape(R, T, K), None if weights is None else weights.reshape(R, T, K), w1q,
      row_align=cfg.row_align, cap=cap, swiglu_limit=cfg.swiglu_limit, out_dtype=cfg.out_dtype,
      return_f32=True)


LAYOUT_FIELDS = ("expert_offsets", "expert_counts", "src_rank", "src_token", "topk_slot",
                 "topk_weight", "num_rows", "num_invalid", "overflow", "send_pos")
# the layout fields a Landed (reference.dispatch) has too: a Stage1Output's against it
LANDED_FIELDS = tuple(f for f in LAYOUT_FIELDS if f not in ("num_invalid", "send_pos"))


def scattered_send_pos(r, T, K):
  """A send_pos that is not route's: distinct positions with gaps between the used rows, a fifth
  of the slots unrouted (-1), some positions past S = T * K (no send row: qpack stores nothing for
  them). Returns it [T, K] and the send rows it uses, sorted."""
  S = T * K
  pos = r.permutation(S + 1000)[:S].astype(np.int32)
  pos[r.random(S) < 0.2] = -1
  return jnp.asarray(pos.reshape(T, K)), np.sort(pos[(pos >= 0) & (pos < S)])


def assert_send_buffers_equal(got, want, used):
  """Every header (the unused rows' -1 / 0 too) and the used rows' bytes, the others unspecified."""
  for name, a, b in zip(got._fields, got, want):
    a, b = as_bytes(a), as_bytes(b)
    if name in ("token", "slot", "weight"):
      np.testing.assert_array_equal(a, b, err_msg=name)
    else:
      np.testing.assert_array_equal(a[used], b[used], err_msg=name)


def as_bytes(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def h_float(h):
  if isinstance(h, jsm.MXFP8):
    return np.asarray(jsm.reference.dequantize(h.values, h.scales))
  return np.asarray(h, np.float32)


class Asserts:
  """The TestCase assertions the check_* helpers use, for worker processes outside a TestCase."""

  def assertFalse(self, c, m=None):
    assert not c, m

  def assertTrue(self, c, m=None):
    assert c, m

  def assertLessEqual(self, a, b, m=None):
    assert a <= b, f"{m}: {a} > {b}"

  def assertGreaterEqual(self, a, b, m=None):
    assert a >= b, f"{m}: {a} < {b}"


def check_block(tc, got, ref32, out_dtype, what):
  """DESIGN.md §3 tolerance for one expert block of h, got (as float32) against the float32
  reference. bf16: relative norm <= 4e-3, max <= 1e-2 * max |ref|. mxfp8: the output's error may
  exceed that of the ideal quantisation of the reference, Q(ref), by the same margins (a value
  byte flips where float32 accumulation order moves h across a rounding boundary)."""
  ref32 = np.asarray(ref32, np.float32)
  tc.assertFalse(np.isnan(got[~np.isnan(ref32)]).any(), f"{what}: NaN")
  fin = np.isfinite(ref32)
  # float64: the "wide" cases' h reaches ~1e24, whose float32 squares overflow the norms
  g, f = got[fin].astype(np.float64), ref32[fin].astype(np.float64)
  nref = np.linalg.norm(f)
  if nref == 0:
    return
  norm_err, max_err = np.linalg.norm(g - f) / nref, np.max(np.abs(g - f))
  norm_bound, max_bound = 4e-3, 1e-2 * np.max(np.abs(f))
  if out_dtype == "mxfp8":
    ideal = np.asarray(jsm.reference.dequantize(*jsm.reference.quantize(jnp.asarray(ref32))),
                       np.float64)[fin]
    norm_bound += np.linalg.norm(ideal - f) / nref
    max_bound += 2 * np.max(np.abs(ideal - f))
  tc.assertLessEqual(norm_err, norm_bound, f"{what}: relative norm of the error")
  tc.assertLessEqual(max_err, max_bound, f"{what}: max error")


def check_h(tc, h, expert_offsets, expert_counts, h32_ref, out_dtype):
  """check_block for every rank and expert block of h [R, M_cap, I]; padding rows exactly 0; for
  mxfp8 output also >= 99% of value bytes identical to the reference quantisation. Not 100%: a byte
  flips where the accumulation order moves h across a rounding boundary, and Hopper's fp8 wgmma
  sums each 32-product block below float32 precision before our float32 promotion (0.11% of the
  bytes flipped on the H200 at `small`, T=200). A systematic error (a wrong scale byte, a wrong
  rounding mode) changes far more than 1%."""
  h32_ref = np.asarray(h32_ref)
  got = h_float(h)
  if out_dtype == "mxfp8":
    refq = jsm.reference.quantize(jnp.asarray(h32_ref))
    same = np.mean(as_bytes(h.values) == as_bytes(refq.values))
    tc.assertGreaterEqual(same, 0.99, f"mxfp8 output: only {same:.4%} of the value bytes equal "
                          "the reference quantisation")
  offs, cnts = np.asarray(expert_offsets), np.asarray(expert_counts)
  for r in range(got.shape[0]):
    landed = np.zeros(got.shape[1], bool)
    for e in range(offs.shape[1]):
      rows = slice(offs[r, e], offs[r, e] + cnts[r, e])
      landed[rows] = True
      if cnts[r, e]:
        check_block(tc, got[r, rows], h32_ref[r, rows], out_dtype, f"rank {r} expert {e}")
    tc.assertTrue((got[r][~landed] == 0).all(), f"rank {r}: padding rows must be 0")


def check_stage1(tc, out, ref, h32_ref, out_dtype):
  for name in LAYOUT_FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)),
                                  err_msg=name)
  check_h(tc, out.h, out.expert_offsets, out.expert_counts, h32_ref, out_dtype)


@functools.lru_cache(maxsize=1)  # one shape's weights at a time: dsv3/v4pro w1 are gigabytes
def random_w1q(shape_name, device, wide=False):
  """QuantizedW1 of a fresh random w1 [E, 2I, H] (scaled by 1/sqrt(H)) of a SHAPES entry, made
  on `device`. wide: each expert further scaled by a power of two in [2^-60, 2^20], so MX scales
  span far beyond the usual (the GEMM's two-step dequantisation of large scales)."""
  s = jsm.SHAPES[shape_name]
  key = jax.random.key(np.random.SeedSequence().entropy % (2**31))
  with jax.default_device(device):
    w1 = jax.random.normal(key, (s.num_experts, 2 * s.intermediate, s.hidden), jnp.bfloat16
                           ) * jnp.bfloat16(1.0 / np.sqrt(s.hidden))
    if wide:
      k = jax.random.randint(jax.random.fold_in(key, 1), (s.num_experts, 1, 1), -60, 21)
      w1 = w1 * jnp.exp2(k.astype(jnp.float32)).astype(jnp.bfloat16)
    return jax.block_until_ready(jax.jit(jsm.quantize_w1)(w1))


def free_port():
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


# `python -c _RUN_DYING_WITH_PARENT SCRIPT ARGS...` runs SCRIPT as `python SCRIPT ARGS...` would
# (its folder first on sys.path), once it has asked Linux to kill it when the test process that
# started it dies: a suite killed by its time limit then leaves no worker behind holding a port or
# GPU memory (a worker of the one-GPU two-process test outlived its killed suite and held 16.6 GiB
# of the GPU). Set in the child, after exec: a Popen preexec_fn would fork a multithreaded JAX
# process and run Python between the fork and the exec.
_RUN_DYING_WITH_PARENT = """
import ctypes, os, runpy, sys
if sys.platform.startswith("linux"):
  ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def python_script(script, *args) -> list:
  """The command line of a worker process: `script` with `args`, dying with the test process."""
  return [sys.executable, "-c", _RUN_DYING_WITH_PARENT, script, *map(str, args)]


def run_bench_processes(n: int, flags, timeout: float):
  """bench/run.py in n processes started with --coordinator, --num-processes, --process-id (the
  mode `mpirun -n n` runs, without Open MPI), one CPU device each, with `flags` (--out among them);
  [(returncode, stdout, stderr)] per process. Kills them all when one runs past `timeout`."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  port = free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen(
      python_script(os.path.join(root, "bench", "run.py"), "--coordinator", f"localhost:{port}",
                    "--num-processes", n, "--process-id", i, *flags), cwd=root, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
  try:
    outs = [p.communicate(timeout=timeout) for p in procs]
  except subprocess.TimeoutExpired:
    for q in procs:
      q.kill()
    raise
  return [(p.returncode, *o) for p, o in zip(procs, outs)]


def run_processes(tc, script, n, seed, timeout, env_of=lambda i: {}, args_of=lambda i: ()):
  """Runs `python script PROCESS_ID n PORT SEED [args_of(PROCESS_ID)...]` n times at once
  (jax.distributed over a fresh local port); each must exit 0 and print 'OK rank <id>'."""
  port = free_port()
  procs = []
  for i in range(n):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(env_of(i))
    procs.append(subprocess.Popen(python_script(script, i, n, port, seed, *args_of(i)), env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      tc.fail(f"multi-process run timed out (seed {seed})")
  # every failed process's output: the first to fail is often not the first process (the others
  # then time out waiting for it)
  failed = [f"process {i} (exit {p.returncode}):\n{out[-3000:]}"
            for i, (p, out) in enumerate(zip(procs, outs))
            if p.returncode != 0 or f"OK rank {i}" not in out]
  tc.assertFalse(failed, f"seed {seed}:\n" + "\n".join(failed))


def run_mp_gpu_workers(tc, n, timeout, gpu=None, groups=1):
  """tests/mp_gpu_worker.py in n processes (the mpirun launch mode's checks), each on its own GPU
  (its process id) or all on GPU `gpu`; groups > 1: as the mesh (dp = groups, ep = n / groups).
  The workers allocate on demand: the test process may already hold most of the GPUs (XLA
  preallocates 75% once a GPU test has run)."""
  run_processes(tc, os.path.join(os.path.dirname(os.path.abspath(__file__)), "mp_gpu_worker.py"),
                n, int(np.random.SeedSequence().entropy % (2**31)), timeout,
                env_of=lambda i: {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
                args_of=lambda i: ((() if gpu is None else (gpu,)) +
                                   ((f"groups={groups}",) if groups > 1 else ())))


# --- the whole layer (jsm.moe): shared by test_moe.py and the GPU suites ---------------------

# DESIGN.md §3, Stage2: per rank, against the float32 reference of the same arithmetic
REL_TOL, MAX_TOL = 1e-2, 3e-2


def make_w2q(r, E, H, I, w_scale=0.05):
  return jsm.quantize_w2(jnp.asarray(r.standard_normal((E, H, I)) * w_scale, jnp.bfloat16))


def moe_fn(m, rt, with_weights=True, check=False):
  """jit(shard_map(moe)): y [R*T, H] over the ranks."""
  def body(x, ids, weights, w1q, w2q):
    topk = (ids, weights) if with_weights else ids
    return jsm.moe(x, topk, w1q, w2q, runtime=rt, check=check)
  return jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))


def reference_y(x, ids, weights, w1q, w2q, num_ranks, cfg, T):
  # on one device: the arguments may be outputs of a shard_map, sharded over the mesh
  x, ids, weights = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), (x, ids, weights))
  K = ids.shape[-1]
  EL = w1q.values.shape[0] // num_ranks
  cap = jsm.layout.m_cap(num_ranks, T, K, EL, cfg.row_align, cfg.max_recv_rows)
  xr = jax.tree.map(lambda a: a.reshape(num_ranks, T, *a.shape[1:]), x)
  return np.asarray(_reference_moe(
      xr, ids.reshape(num_ranks, T, K),
      None if weights is None else weights.reshape(num_ranks, T, K), w1q, w2q,
      row_align=cfg.row_align, cap=cap, swiglu_limit=cfg.swiglu_limit, out_dtype=cfg.out_dtype))


def check_y(tc, y, ref, ids, E):
  """Per rank within the tolerance; no NaN; tokens with no valid slot exactly +0."""
  num_ranks, T, H = ref.shape
  got = np.asarray(y, np.float32).reshape(num_ranks, T, H)
  tc.assertFalse(np.isnan(got).any(), "NaN in y")
  for r in range(num_ranks):
    nref = np.linalg.norm(ref[r])
    if nref == 0:
      tc.assertTrue((got[r] == 0).all(), f"rank {r}: y must be 0 where the reference is")
      continue
    tc.assertLessEqual(np.linalg.norm(got[r] - ref[r]) / nref, REL_TOL,
                       f"rank {r}: relative norm of the error")
    tc.assertLessEqual(np.max(np.abs(got[r] - ref[r])), MAX_TOL * np.max(np.abs(ref[r])),
                       f"rank {r}: max error")
  ids = np.asarray(ids)
  no_slot = ~((ids >= 0) & (ids < E)).any(-1)
  bits = as_bytes(jnp.asarray(y)).reshape(num_ranks * T, H)
  tc.assertTrue((bits[no_slot] == 0).all(), "tokens with no valid slot must be exact zeros")


# A layer between the "small" shape and dsv3 where both CUDA GEMMs take the bf16-route kernel
# (H % 512 == 0; I % 512 == 0 for GEMM2's depth): (H, I, E, K)
MID_LAYER = (1024, 512, 16, 4)


def run_moe_on(tc, m, engines, T, H, I, E, K, routing="uniform", swiglu_limit=None):
  """jsm.moe over the mesh m (its devices: GPUs) with each engine of `engines` (a name or a
  sequence) on the same inputs: each y against reference.moe (check_y), then the engines' y byte
  for byte."""
  engines = (engines,) if isinstance(engines, str) else tuple(engines)
  r = rng()
  R = m.devices.size
  x, ids, w, w1q = make_problem(r, R, T, H, I, E, K, routing)
  w2q = make_w2q(r, E, H, I)
  ref, first = None, None
  for engine in engines:
    cfg = jsm.Stage1Config(engine=engine, swiglu_limit=swiglu_limit)
    with jsm.Runtime(m, "ep", cfg) as rt:
      y = moe_fn(m, rt)(*shard(m, (x, ids, w)), *shard(m, (w1q, w2q)))
    if ref is None:
      ref = reference_y(x, ids, w, w1q, w2q, R, cfg, T)
    check_y(tc, y, ref, ids, E)
    if first is None:
      first = (engine, as_bytes(y))
    else:
      np.testing.assert_array_equal(as_bytes(y), first[1],
                                    f"engine {engine}'s y differs from engine {first[0]}'s")
