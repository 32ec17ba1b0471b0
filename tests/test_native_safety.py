"""Nothing lost, nothing hangs — the native parts: a closed Runtime's compiled programs fail
(FAILED_PRECONDITION, ffi/runtime_registry.h); jsm_check_layout names the first field of a
Stage1Output that breaks the §4 layout; the CPU handlers refuse what they would index out of
bounds with (InvalidArgument naming the field); any timeout_s gives a deadline in the future and
a fault delay is slept for at most timeout_s.

The cases that crashed (read or wrote out of bounds) or hung before these checks run in a
subprocess (this file run as `python test_native_safety.py worker CASE`), so that such a failure
fails its test, not the whole run."""
import json
import os
import subprocess
import sys
import time

import _util

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm
from jax_sdma_moe import primitives

R, T, H, I, E, K = 8, 4, 64, 32, 16, 2


def quantized_w2(r, E_, H_=H, I_=I):
  return jsm.quantize_w2(jnp.asarray(r.standard_normal((E_, H_, I_)) * 0.05, jnp.bfloat16))


def stage1_outputs(r, engine, ranks, config=None):
  """A fresh problem through jsm.stage1 on `ranks` devices: (Runtime, stacked numpy outputs)."""
  m = _util.mesh(ranks)
  rt = jsm.Runtime(m, "ep", config or jsm.Stage1Config(engine=engine))
  x, ids, w, w1q = _util.make_problem(r, ranks, T, H, I, E, K)
  out = _util.stage1_fn(m, rt)(*_util.shard(m, (x, ids, w, w1q)))
  return rt, jax.tree.map(np.asarray, out)


def rank_slice(out, rank):
  return jax.tree.map(lambda a: a[rank], out)


def local_options(**kw):
  kw.setdefault("timeout_s", 10.0)
  return primitives.DispatchOptions(engine="local", window_set=0, row_align=128, **kw)


def check_layout(o, num_ranks=R):
  return jax.block_until_ready(
      jax.jit(lambda *a: primitives.check_layout(*a, num_ranks=num_ranks, num_tokens=T, topk=K))(
          o.expert_offsets, o.expert_counts, o.src_rank, o.src_token, o.topk_slot))


def landed_rows(o):
  return np.nonzero(o.src_rank >= 0)[0]


# --- the subprocess cases ----------------------------------------------------------------------


def _worker_handlers():
  """gemm1, gemm2 and dispatch on CPU handed operands that index out of bounds: one line per case,
  the error or "ok"."""
  r = _util.rng()
  _, out = stage1_outputs(r, "local", 1)
  o = rank_slice(out, 0)
  M, EL = o.h.shape[0], o.expert_offsets.shape[0]
  w2q = quantized_w2(r, EL)
  w1 = jnp.asarray(r.standard_normal((EL, 2 * I, H)) * 0.05, jnp.bfloat16)
  w1q = jsm.quantize_w1(w1)
  a = jsm.quantize(jnp.asarray(r.standard_normal((M, H)), jnp.bfloat16))
  e = int(r.integers(0, EL))
  far = int(r.integers(1, 10**6))

  def offsets(v):
    bad = o.expert_offsets.copy()
    bad[e] = v
    return bad

  def counts(v):
    bad = o.expert_counts.copy()
    bad[e] = v
    return bad

  gemm2 = lambda offs, cnts: primitives.gemm2(o.h, offs, cnts, w2q)
  gemm1 = lambda offs, cnts: primitives.gemm1(a.values, a.scales, offs, cnts, w1q,
                                              options=primitives.Gemm1Options())
  cases = {
      "gemm2_offset": (lambda: gemm2(offsets(M + far), o.expert_counts), e, M + far),
      "gemm2_negative_offset": (lambda: gemm2(offsets(-far), o.expert_counts), e, -far),
      "gemm2_count": (lambda: gemm2(o.expert_offsets, counts(M + far)), e, M + far),
      "gemm1_offset": (lambda: gemm1(offsets(-far), o.expert_counts), e, -far),
      "gemm1_count": (lambda: gemm1(o.expert_offsets, counts(-far)), e, -far),
  }
  # engine local's dispatch with send counts that are negative or more than its rows
  x = jnp.asarray(r.standard_normal((T, H)), jnp.bfloat16)
  ids = jnp.asarray(r.integers(0, E, (T, K)), jnp.int32)
  route = primitives.route(ids, 1, E)
  send = primitives.qpack(x, jnp.ones((T, K), jnp.float32), route.send_pos)
  for name, value in (("dispatch_negative_count", -far), ("dispatch_count", T * K + far)):
    counts_ = np.zeros((1, E), np.int32)
    counts_[0, e] = value
    cases[name] = (lambda c=counts_: primitives.dispatch(send, jnp.asarray(c), jnp.int32(0),
                                                         cap=M, options=local_options()), e, value)
  for name, (call, index, value) in cases.items():
    try:
      jax.block_until_ready(call())
      print(json.dumps({"case": name, "index": index, "value": value, "error": None}), flush=True)
    except Exception as ex:  # the error is what the parent checks
      print(json.dumps({"case": name, "index": index, "value": value, "error": str(ex)}),
            flush=True)


def _worker_delay():
  """Engine local's dispatch whose rank is to start 10^9 ms late, with timeout_s = 1: the delay
  is slept for at most timeout_s, so the call returns."""
  x = jnp.ones((T, H), jnp.bfloat16)
  ids = jnp.zeros((T, K), jnp.int32).at[:, 1].set(1)
  route = primitives.route(ids, 1, E)
  send = primitives.qpack(x, jnp.ones((T, K), jnp.float32), route.send_pos)
  opts = local_options(timeout_s=1.0, fault_delay_rank=0, fault_delay_ms=10**9)
  start = time.monotonic()
  landed = primitives.dispatch(send, route.send_counts, jnp.int32(0), cap=T * K + E * 127,
                               options=opts)
  print(json.dumps({"case": "delay", "rows": int(landed.num_rows),
                    "seconds": time.monotonic() - start}), flush=True)


def run_worker(case: str, timeout_s: float):
  """This file as `worker CASE` in a subprocess: its JSON lines, and its exit code (None: it ran
  past timeout_s and was killed)."""
  try:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "worker", case],
                       capture_output=True, text=True, timeout=timeout_s,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
  except subprocess.TimeoutExpired as ex:
    out = ex.stdout.decode() if isinstance(ex.stdout, bytes) else (ex.stdout or "")
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")], None, ""
  lines = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
  return lines, p.returncode, p.stderr[-3000:]


# --- the tests ---------------------------------------------------------------------------------


class ClosedRuntimeTest(parameterized.TestCase):

  @parameterized.named_parameters(("cpu", "cpu", R), ("xla", "xla", R), ("local", "local", 1))
  def test_compiled_programs_fail_once_closed(self, engine, ranks):
    """stage1 and moe compiled and run, then rt.close(): the same executables fail at run time
    with FAILED_PRECONDITION "Runtime is closed" (before: the windows were gone (cpu) or the
    call simply ran (xla, local))."""
    r = _util.rng()
    m = _util.mesh(ranks)
    rt = jsm.Runtime(m, "ep", jsm.Stage1Config(engine=engine))
    x, ids, w, w1q = _util.make_problem(r, ranks, T, H, I, E, K)
    args = _util.shard(m, (x, ids, w, w1q))
    w2q = _util.shard(m, quantized_w2(r, E))
    stage1 = _util.stage1_fn(m, rt)
    moe = jax.jit(jax.shard_map(
        lambda x, ids, w, w1q, w2q: jsm.moe(x, (ids, w), w1q, w2q, runtime=rt), mesh=m,
        in_specs=P("ep"), out_specs=P("ep")))
    jax.block_until_ready((stage1(*args), moe(*args, w2q)))
    rt.close()
    for name, call in (("stage1", lambda: stage1(*args)), ("moe", lambda: moe(*args, w2q))):
      with self.subTest(name), self.assertRaisesRegex(
          Exception, r"FAILED_PRECONDITION.*jax_sdma_moe: Runtime is closed \("):
        jax.block_until_ready(call())

  def test_each_runtime_call_checks(self):
    """dispatch and combine (not only route, the first call of a program) check the registry:
    called with a closed Runtime's serial they fail naming themselves."""
    r = _util.rng()
    rt = jsm.Runtime(_util.mesh(1), "ep", jsm.Stage1Config(engine="local"))
    x = jnp.asarray(r.standard_normal((T, H)), jnp.bfloat16)
    ids = jnp.asarray(r.integers(0, E, (T, K)), jnp.int32)
    route = primitives.route(ids, 1, E)
    send = primitives.qpack(x, jnp.ones((T, K), jnp.float32), route.send_pos)
    cap = T * K + E * 127
    opts = local_options(runtime=rt.serial)
    dispatch = jax.jit(lambda send, counts: primitives.dispatch(send, counts, jnp.int32(0),
                                                                cap=cap, options=opts))
    landed = jax.block_until_ready(dispatch(send, route.send_counts))
    rows = jnp.asarray(r.standard_normal((cap, H)), jnp.bfloat16)
    combine = jax.jit(lambda rows, l: primitives.combine(
        rows, l.src_rank, l.src_token, l.topk_slot, l.topk_weight, jnp.int32(0), num_tokens=T,
        topk=K, options=opts))
    jax.block_until_ready(combine(rows, landed))
    rt.close()
    for name, call in (("dispatch on cpu", lambda: dispatch(send, route.send_counts)),
                       ("combine on cpu", lambda: combine(rows, landed)),
                       ("route on cpu", lambda: primitives.route(ids, 1, E, runtime=rt.serial))):
      with self.subTest(name), self.assertRaisesRegex(
          Exception, r"FAILED_PRECONDITION.*Runtime is closed \(" + name):
        jax.block_until_ready(call())


class CheckLayoutTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    cls.r = _util.rng()
    cls.rt, cls.out = stage1_outputs(cls.r, "cpu", R)

  @classmethod
  def tearDownClass(cls):
    cls.rt.close()

  def test_valid_layout_passes_unchanged(self):
    """Every rank's real Stage1Output passes, its offsets and counts copied through; so does one
    whose padding rows (src_rank -1) hold any token and slot."""
    for rank in range(R):
      o = rank_slice(self.out, rank)
      offs, cnts = check_layout(o)
      np.testing.assert_array_equal(offs, o.expert_offsets)
      np.testing.assert_array_equal(cnts, o.expert_counts)
    pad = np.nonzero(o.src_rank < 0)[0]
    o = o._replace(src_token=o.src_token.copy(), topk_slot=o.topk_slot.copy())
    o.src_token[pad] = self.r.integers(-10**6, 10**6, pad.size)
    o.topk_slot[pad] = self.r.integers(-10**6, 10**6, pad.size)
    check_layout(o)

  def corrupt(self, kind):
    """A random rank's output with one fault of `kind`: (output, regex of the message)."""
    r = self.r
    ranks = [q for q in range(R) if landed_rows(rank_slice(self.out, q)).size >= 2]
    o = rank_slice(self.out, int(r.choice(ranks)))
    o = jax.tree.map(lambda a: a.copy(), o)
    M, EL = o.src_rank.shape[0], o.expert_offsets.shape[0]
    e = int(r.integers(0, EL))
    i, j = sorted(r.choice(landed_rows(o), 2, replace=False).tolist())
    far = int(r.integers(1, 10**6))
    offs, cnts = o.expert_offsets, o.expert_counts
    if kind == "offset_negative":
      offs[e] = -far
      return o, rf"out1\.expert_offsets\[{e}\] = {-far} is outside \[0, M_cap = {M}\]"
    if kind == "offset_past_cap":
      offs[e] = M + far
      return o, rf"out1\.expert_offsets\[{e}\] = {M + far} is outside \[0, M_cap = {M}\]"
    if kind == "count_negative":
      cnts[e] = -far
      return o, rf"out1\.expert_counts\[{e}\] = {-far} is negative"
    if kind == "count_past_cap":
      v = M - offs[EL - 1] + far
      cnts[EL - 1] = v
      return o, rf"out1\.expert_counts\[{EL - 1}\] = {v}: .* end past M_cap = {M}"
    if kind == "offsets_decrease":
      offs[0], cnts[0] = offs[1] + 1, 0
      return o, rf"out1\.expert_offsets\[1\] = {offs[1]} is below out1\.expert_offsets\[0\]"
    if kind == "experts_overlap":
      v = offs[1] - offs[0] + int(r.integers(1, 4))
      cnts[0] = v
      return o, rf"out1\.expert_counts\[0\] = {v} overlaps expert 1's rows"
    if kind == "src_rank_range":
      v = int(r.choice([R + far, -1 - far]))
      o.src_rank[i] = v
      return o, rf"out1\.src_rank\[{i}\] = {v} is outside \[-1, num_ranks = {R}\)"
    if kind == "src_token_range":
      v = int(r.choice([T + far, -far]))
      o.src_token[i] = v
      return o, rf"out1\.src_token\[{i}\] = {v} is outside \[0, num_tokens = {T}\)"
    if kind == "topk_slot_range":
      v = int(r.choice([K + far, -far]))
      o.topk_slot[i] = v
      return o, rf"out1\.topk_slot\[{i}\] = {v} is outside \[0, topk = {K}\)"
    if kind == "row_twice":
      o.src_rank[j], o.src_token[j], o.topk_slot[j] = o.src_rank[i], o.src_token[i], o.topk_slot[i]
      return o, rf"out1\.src_token\[{j}\] = {o.src_token[i]}: row {j} returns the same .* as row {i}"
    raise ValueError(kind)

  @parameterized.parameters("offset_negative", "offset_past_cap", "count_negative",
                            "count_past_cap", "offsets_decrease", "experts_overlap",
                            "src_rank_range", "src_token_range", "topk_slot_range", "row_twice")
  def test_corruption_names_its_field(self, kind):
    o, pattern = self.corrupt(kind)
    with self.assertRaisesRegex(Exception, "INVALID_ARGUMENT: jax_sdma_moe.stage2: " + pattern):
      check_layout(o)

  def test_large_row_align_layout_is_valid(self):
    """row_align 2^16 and a small M_cap: the landed layout (kernels/common/layout.h, int64) is
    clipped, never overlapping or negative, and passes the check; the rows that did not fit are
    counted in overflow."""
    cfg = jsm.Stage1Config(engine="local", row_align=2**16, max_recv_rows=int(self.r.integers(
        T * K, 4 * T * K)))
    rt, out = stage1_outputs(self.r, "local", 1, cfg)
    rt.close()
    o = rank_slice(out, 0)
    check_layout(o, num_ranks=1)
    M = o.src_rank.shape[0]
    self.assertTrue(np.all(np.diff(o.expert_offsets) >= 0) and np.all(o.expert_offsets >= 0))
    self.assertTrue(np.all(o.expert_offsets + o.expert_counts <= M))
    self.assertEqual(int(o.expert_counts.sum()) + int(o.overflow), T * K)


class CpuHandlersTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    cls.r = _util.rng()
    cls.handlers = None

  def handler_results(self):
    if CpuHandlersTest.handlers is None:
      lines, code, err = run_worker("handlers", 300)
      CpuHandlersTest.handlers = ({l["case"]: l for l in lines}, code, err)
    return CpuHandlersTest.handlers

  @parameterized.parameters(
      ("gemm2_offset", r"gemm2 \(cpu\): expert_offsets\[{i}\] = {v} is outside \[0, M_cap"),
      ("gemm2_negative_offset",
       r"gemm2 \(cpu\): expert_offsets\[{i}\] = {v} is outside \[0, M_cap"),
      ("gemm2_count", r"gemm2 \(cpu\): expert_counts\[{i}\] = {v}: .* end past M_cap"),
      ("gemm1_offset", r"gemm1 \(cpu\): expert_offsets\[{i}\] = {v} is outside \[0, M_cap"),
      ("gemm1_count", r"gemm1 \(cpu\): expert_counts\[{i}\] = {v} is negative"),
      ("dispatch_negative_count", r"dispatch \(cpu\): send_counts\[{i}\] = {v} is negative"),
      ("dispatch_count", r"dispatch \(cpu\): send_counts add up to {v} rows, more than"),
  )
  def test_indexing_operand_is_refused(self, case, pattern):
    """(subprocess: before, these read or wrote out of bounds)"""
    results, code, err = self.handler_results()
    self.assertIn(case, results, f"the worker stopped (exit code {code}): {err}")
    got = results[case]
    self.assertIsNotNone(got["error"], f"{case} ran without an error")
    self.assertRegex(got["error"], "INVALID_ARGUMENT: jax_sdma_moe " +
                     pattern.format(i=got["index"], v=got["value"]))

  @parameterized.parameters("src_rank", "src_token", "topk_slot", "twice")
  def test_local_combine_names_the_header(self, field):
    """Engine local's combine (R = 1) of a jsm.stage1 output whose header was changed."""
    r = self.r
    rt, out = stage1_outputs(r, "local", 1)
    rt.close()
    o = jax.tree.map(lambda a: a.copy(), rank_slice(out, 0))
    M = o.src_rank.shape[0]
    i, j = sorted(r.choice(landed_rows(o), 2, replace=False).tolist())
    far = int(r.integers(1, 10**6))
    if field == "src_rank":
      o.src_rank[i] = 1 + far
      pattern = rf"src_rank\[{i}\] = {1 + far} is outside \[-1, num_ranks = 1\)"
    elif field == "src_token":
      o.src_token[i] = T + far
      pattern = rf"src_token\[{i}\] = {T + far} is outside \[0, num_tokens = {T}\)"
    elif field == "topk_slot":
      o.topk_slot[i] = -far
      pattern = rf"topk_slot\[{i}\] = {-far} is outside \[0, topk = {K}\)"
    else:
      o.src_token[j], o.topk_slot[j] = o.src_token[i], o.topk_slot[i]
      pattern = rf"src_token\[{j}\] = {o.src_token[i]}: row {j} returns the same .* as row {i}"
    rows = jnp.asarray(r.standard_normal((M, H)), jnp.bfloat16)
    with self.assertRaisesRegex(Exception, r"INVALID_ARGUMENT: jax_sdma_moe combine \(cpu\): " +
                                pattern):
      jax.block_until_ready(primitives.combine(
          rows, o.src_rank, o.src_token, o.topk_slot, o.topk_weight, jnp.int32(0), num_tokens=T,
          topk=K, options=local_options()))

  def test_cpu_engine_combine_ranks_from_window_table(self):
    """Engine cpu's combine takes R from the Runtime's window table: a src_rank of R fails every
    rank at once (no rank left waiting for it) naming the field."""
    r = self.r
    rt, out = stage1_outputs(r, "cpu", R)
    m = rt.mesh
    o = jax.tree.map(lambda a: a.copy(), out)
    row = int(r.integers(0, o.src_rank.shape[1]))
    o.src_rank[:, row] = R
    opts = rt.engine.protocol_options(rt.engine.window_set(None, None, None))
    rows = jnp.asarray(r.standard_normal((R * o.src_rank.shape[1], H)), jnp.bfloat16)

    def body(rows, src_rank, token, slot, weight):
      return primitives.combine(rows, src_rank[0], token[0], slot[0], weight[0],
                                jax.lax.axis_index("ep"), num_tokens=T, topk=K, options=opts)

    f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
    args = _util.shard(m, (rows, o.src_rank, o.src_token, o.topk_slot, o.topk_weight))
    try:
      with self.assertRaisesRegex(Exception, rf"INVALID_ARGUMENT: jax_sdma_moe combine \(cpu\): "
                                  rf"src_rank\[{row}\] = {R} is outside \[-1, num_ranks = {R}\)"):
        jax.block_until_ready(f(*args))
    finally:
      rt.close()


class BoundedWaitTest(parameterized.TestCase):

  @parameterized.parameters(1e300, float("inf"))
  def test_huge_timeout_is_a_future_deadline(self, timeout_s):
    """Engine cpu's dispatch with timeout_s = 1e300 or inf and a rank 300 ms late: the others wait
    for it (before: the deadline overflowed into the past and they timed out at once)."""
    r = _util.rng()
    m = _util.mesh(R)
    rt = jsm.Runtime(m, "ep", jsm.Stage1Config(engine="cpu"))
    x, ids, w, _ = _util.make_problem(r, R, T, H, I, E, K)
    EL = E // R
    cap = R * T * K + EL * 127
    table = rt.engine.window_set(None, None, None)
    late = int(r.integers(0, R))
    opts = primitives.DispatchOptions(engine="cpu", window_set=table, row_align=128,
                                      timeout_s=timeout_s, fault_delay_rank=late,
                                      fault_delay_ms=300)

    def body(x, ids, w):
      route = primitives.route(ids, R, EL)
      send = primitives.qpack(x, w, route.send_pos)
      landed = primitives.dispatch(send, route.send_counts, jax.lax.axis_index("ep"), cap=cap,
                                   options=opts)
      return landed.num_rows[None]

    f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
    try:
      rows = np.asarray(f(*_util.shard(m, (x, ids, w))))
    finally:
      rt.close()
    ids_ = np.asarray(ids)
    self.assertEqual(int(rows.sum()), int(((ids_ >= 0) & (ids_ < E)).sum()))

  def test_fault_delay_is_bounded_by_timeout(self):
    """A fault delay of 10^9 ms with timeout_s = 1 is slept for about 1 s (subprocess: before, it
    slept 11.6 days)."""
    lines, code, err = run_worker("delay", 120)
    self.assertIsNotNone(code, "the call slept past 120 s")
    self.assertEqual(code, 0, err)
    self.assertEqual(lines[-1]["rows"], T * K)
    self.assertLess(lines[-1]["seconds"], 30)


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "worker":
    {"handlers": _worker_handlers, "delay": _worker_delay}[sys.argv[2]]()
  else:
    absltest.main()
