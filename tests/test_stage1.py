"""stage1() under shard_map on 8 CPU devices against the jnp reference (DESIGN.md §2-§6)."""
import os
import subprocess
import sys

import _util

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm
from jax_sdma_moe._testing import inject_faults

SMALL = jsm.SHAPES["small"]
R = _util.NUM_DEVICES


def run_case(tc, *, engine="cpu", T=16, H=SMALL.hidden, I=SMALL.intermediate,
             E=SMALL.num_experts, K=SMALL.topk, routing="uniform", prequantized=False,
             with_weights=True, faults=None, **cfg_kw):
  r = _util.rng()
  m = _util.mesh(R)
  cfg = jsm.Stage1Config(engine=engine, timeout_s=30.0, **{"row_align": 16, **cfg_kw})
  x, ids, w, w1q = _util.make_problem(r, R, T, H, I, E, K, routing)
  if prequantized:
    x = jsm.quantize(x)
  with jsm.Runtime(m, "ep", cfg) as rt:
    if faults:
      inject_faults(rt, **faults)
    out = _util.stage1_fn(m, rt, with_weights=with_weights)(
        *_util.shard(m, (x, ids, w)), _util.shard(m, w1q))
  ref, h32 = _util.reference(x, ids, w if with_weights else None, w1q, R, cfg, T)
  _util.check_stage1(tc, out, ref, h32, cfg.out_dtype)
  return out, (x, ids, w, w1q)


class Stage1Test(parameterized.TestCase):

  @parameterized.product(engine=("cpu", "xla"), routing=("uniform", "masked", "invalid"))
  def test_routing(self, engine, routing):
    out, (_, ids, _, _) = run_case(self, engine=engine, routing=routing)
    ids = np.asarray(ids)
    valid = (ids >= 0) & (ids < SMALL.num_experts)
    self.assertEqual(int(np.asarray(out.num_rows).sum()), int(valid.sum()), "no row dropped")
    self.assertEqual(int(np.asarray(out.num_invalid).sum()), int((ids >= SMALL.num_experts).sum()))
    self.assertTrue((np.asarray(out.overflow) == 0).all())

  @parameterized.parameters("cpu", "xla")
  def test_skewed_all_rows_to_one_rank(self, engine):
    out, _ = run_case(self, engine=engine, H=128, I=64, E=64, K=4, routing="skewed")
    counts = np.asarray(out.expert_counts)
    self.assertEqual(counts[1:].sum(), 0, "ranks 1.. receive nothing")
    self.assertEqual(counts[0, 0], R * 16, "expert 0 gets every token")

  @parameterized.named_parameters(
      ("T1", dict(T=1)), ("K1", dict(K=1)), ("EL1", dict(E=8, K=3)),
      ("swiglu_limit", dict(swiglu_limit=0.75)), ("mxfp8_out", dict(out_dtype="mxfp8")),
      ("mxfp8_out_limit", dict(out_dtype="mxfp8", swiglu_limit=2.0)),
      ("prequantized_x", dict(prequantized=True)), ("ids_only", dict(with_weights=False)),
      ("row_align_1", dict(row_align=1)), ("row_align_128", dict(row_align=128, T=40)))
  def test_variants(self, kw):
    for engine in ("cpu", "xla"):
      run_case(self, engine=engine, **kw)

  @parameterized.parameters("cpu", "xla")
  def test_empty_batch(self, engine):
    """T = 0 tokens per rank: every output is padding, nothing fails."""
    r = _util.rng()
    m = _util.mesh(R)
    x, ids, w, w1q = _util.make_problem(r, R, 1, 64, 32, 16, 2)
    x, ids, w = x[:0], ids[:0], w[:0]
    cfg = jsm.Stage1Config(engine=engine, row_align=8)
    with jsm.Runtime(m, "ep", cfg) as rt:
      out = _util.stage1_fn(m, rt)(*_util.shard(m, (x, ids, w)), _util.shard(m, w1q))
    ref, h32 = _util.reference(x, ids, w, w1q, R, cfg, 0)
    _util.check_stage1(self, out, ref, h32, "bf16")
    self.assertEqual(int(np.asarray(out.num_rows).sum()), 0)

  def test_local_engine_one_rank(self):
    r = _util.rng()
    m = _util.mesh(1)
    T, s = 50, SMALL
    x, ids, w, w1q = _util.make_problem(r, 1, T, s.hidden, s.intermediate, s.num_experts, s.topk,
                                        "masked")
    cfg = jsm.Stage1Config(engine="local", row_align=32)
    with jsm.Runtime(m, "ep", cfg) as rt:
      out = _util.stage1_fn(m, rt)(*_util.shard(m, (x, ids, w)), _util.shard(m, w1q))
    ref, h32 = _util.reference(x, ids, w, w1q, 1, cfg, T)
    _util.check_stage1(self, out, ref, h32, "bf16")
    with self.assertRaisesRegex(ValueError, "one-rank axis"):
      jsm.Runtime(_util.mesh(2), "ep", cfg)

  @parameterized.parameters(("bf16", 512, 64), ("mxfp8", 512, 64), ("bf16", 256, 128))
  def test_cuda_lowering_has_the_gemm1_workspace(self, out_dtype, H, I):
    """Lowered for CUDA (no GPU needed), gemm1 has two scratch results after h (DESIGN §5): the
    bf16 rows [M_cap, 2H] and the row-tile flags where the bf16 kernel applies (H % 512 == 0,
    I % 64 == 0), else two empty ones. Where it applies, engine local fuses the dispatch into it
    (dispatch_gemm1 after the landed layout's 8 results; no dispatch call copies the rows) and
    qpack stores one row per token (token_rows)."""
    r = _util.rng()
    m = _util.mesh(1)
    T, E, K = 8, 4, 2
    x, ids, w, w1q = _util.make_problem(r, 1, T, H, I, E, K)
    cfg = jsm.Stage1Config(engine="local", out_dtype=out_dtype)
    with jsm.Runtime(m, "ep", cfg, lowering_platform="cuda") as rt:
      f = _util.stage1_fn(m, rt)
      text = f.trace(*_util.shard(m, (x, ids, w)), _util.shard(m, w1q)).lower(
          lowering_platforms=("cuda",)).as_text()
    cap = jsm.layout.m_cap(1, T, K, E, cfg.row_align)
    h_results = 1 if out_dtype == "bf16" else 2
    fused = jsm.layout.gemm1_bf16_applies(H, I)
    target, layout_results = ("jsm_dispatch_gemm1", 8) if fused else ("jsm_gemm1", 0)
    self.assertEqual("@jsm_dispatch(" in text, not fused)
    qpack = next(line.strip() for line in text.splitlines() if "@jsm_qpack(" in line)
    self.assertIn(f"token_rows = {str(fused).lower()}", qpack)
    self.assertIn(f"tensor<{T if fused else T * K}x{H}xf8E4M3FN>", qpack.split("->")[-1])
    call = next(line.strip() for line in text.splitlines() if f"@{target}(" in line)
    self.assertRegex(call, rf"^%\w+:{layout_results + h_results + 2} = "
                     rf"stablehlo.custom_call @{target}\(")
    results = call.split("->")[-1]
    if H % 512 == 0:
      self.assertIn(f"tensor<{cap}x{2 * H}xui8>", results)
      # a region per launch of one flag per row tile of the smaller tile, the fallback words,
      # a row factor per landed row
      row_tiles = cap // min(jsm.layout.GEMM_TILE_TOKENS) + E
      flags = jsm.layout.GEMM_FLAG_REGIONS * row_tiles + E + 1 + cap
      self.assertIn(f"tensor<{flags}xui32>", results)
    else:
      self.assertIn("tensor<0xui8>", results)
    # T*K/E = 4 rows per expert: the small tile (weight-bound), unless the config says otherwise
    self.assertRegex(call, r"tile_tokens = 32 : i64")

  def test_engines_byte_identical(self):
    r = _util.rng()
    m = _util.mesh(R)
    x, ids, w, w1q = _util.make_problem(r, R, 32, SMALL.hidden, SMALL.intermediate,
                                        SMALL.num_experts, SMALL.topk, "masked")
    args = (*_util.shard(m, (x, ids, w)), _util.shard(m, w1q))
    outs = []
    for engine in ("cpu", "xla"):
      for out_dtype in ("bf16", "mxfp8"):
        with jsm.Runtime(m, "ep", jsm.Stage1Config(engine=engine, out_dtype=out_dtype)) as rt:
          outs.append((engine, out_dtype, _util.stage1_fn(m, rt)(*args)))
    for (e1, d1, a), (e2, d2, b) in zip(outs[:2], outs[2:]):
      self.assertEqual(d1, d2)
      for name, x1, x2 in zip(a._fields, jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(_util.as_bytes(x1), _util.as_bytes(x2),
                                      err_msg=f"{e1} vs {e2}, {d1}")

  def test_back_to_back_calls_reuse_windows(self):
    """50 calls on one Runtime, fresh inputs each time, every output checked."""
    r = _util.rng()
    m = _util.mesh(R)
    T = 8
    cfg = jsm.Stage1Config(engine="cpu", row_align=8)
    w1q = jsm.quantize_w1(jnp.asarray(r.standard_normal((SMALL.num_experts, 2 * 64, 64)) * 0.1,
                                      jnp.bfloat16))
    with jsm.Runtime(m, "ep", cfg) as rt:
      f = _util.stage1_fn(m, rt)
      ref_fn = jax.jit(lambda x, ids, w: _util.reference(x, ids, w, w1q, R, cfg, T))
      for i in range(50):
        x = jnp.asarray(r.standard_normal((R * T, 64)), jnp.bfloat16)
        ids = _util.make_ids(r, R, T, SMALL.topk, SMALL.num_experts, ("uniform", "masked")[i % 2])
        w = jnp.asarray(r.random((R * T, SMALL.topk)), jnp.float32)
        out = f(*_util.shard(m, (x, ids, w)), _util.shard(m, w1q))
        ref, h32 = ref_fn(x, ids, w)
        _util.check_stage1(self, out, ref, h32, "bf16")

  def test_two_calls_in_one_jit(self):
    r = _util.rng()
    m = _util.mesh(R)
    T, H, I, E, K = 8, 64, 32, 16, 2
    x, ids, w, w1q = _util.make_problem(r, R, T, H, I, E, K)
    x2, ids2, w2, _ = _util.make_problem(r, R, T, H, I, E, K, "masked")
    cfg = jsm.Stage1Config(engine="cpu", row_align=8)
    with jsm.Runtime(m, "ep", cfg) as rt:
      def body(x, ids, w, x2, ids2, w2, w1q):
        a = jsm.stage1(x, (ids, w), w1q, runtime=rt)
        # the second call depends on the first, as a second MoE layer would
        b = jsm.stage1(x2 + a.h[:1].astype(jnp.bfloat16).sum() * 0, (ids2, w2), w1q, runtime=rt)
        return jax.tree.map(lambda v: v[None], (a, b))
      f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("ep"), out_specs=P("ep")))
      a, b = f(*_util.shard(m, (x, ids, w, x2, ids2, w2)), _util.shard(m, w1q))
    for out, args in ((a, (x, ids, w)), (b, (x2, ids2, w2))):
      ref, h32 = _util.reference(*args, w1q, R, cfg, T)
      _util.check_stage1(self, out, ref, h32, "bf16")

  @parameterized.parameters("cpu", "xla")
  def test_overflow_reported_and_checked(self, engine):
    r = _util.rng()
    m = _util.mesh(R)
    T, H, I, E, K = 16, 64, 32, 64, 4
    x, ids, w, w1q = _util.make_problem(r, R, T, H, I, E, K, "skewed")
    cfg = jsm.Stage1Config(engine=engine, row_align=8, max_recv_rows=100)
    with jsm.Runtime(m, "ep", cfg) as rt:
      out = _util.stage1_fn(m, rt)(*_util.shard(m, (x, ids, w)), _util.shard(m, w1q))
      ref, h32 = _util.reference(x, ids, w, w1q, R, cfg, T)
      _util.check_stage1(self, out, ref, h32, "bf16")
      overflow, rows = int(np.asarray(out.overflow)[0]), int(np.asarray(out.num_rows)[0])
      self.assertGreater(overflow, 0)
      self.assertLessEqual(rows, 100)
      self.assertEqual(overflow + rows, R * T * K, "every routed row is landed or counted")
      with self.assertRaisesRegex(Exception, "did not fit their rank.s M_cap"):
        jax.block_until_ready(_util.stage1_fn(m, rt, check=True)(
            *_util.shard(m, (x, ids, w)), _util.shard(m, w1q)))

  def test_overflow_everywhere_and_clean_exit(self):
    """Every rank overflows with check=True: each engine raises the project's error within
    seconds (no hang in a collective, no abort), and a process that leaves its Runtimes open
    exits without tracebacks."""
    engines = ("cpu", "xla")
    proc = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "exit_worker.py"),
         str(_util.rng().integers(2**31)), *engines],
        capture_output=True, text=True, timeout=120)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    for engine in engines:
      self.assertRegex(proc.stdout, rf"{engine}: raised: .*rows routed over the axis did not fit "
                       r"their rank's M_cap = 16 \(rank \d+ dropped some\): "
                       r"Stage1Config.max_recv_rows")
    self.assertNotIn("Exception ignored", proc.stderr)
    self.assertNotIn("Traceback", proc.stderr)

  def test_delayed_rank(self):
    """One rank starts 300 ms late: the others wait for it, then all finish correctly."""
    run_case(self, engine="cpu", faults=dict(delay_rank=5, delay_ms=300))

  def test_absent_peer_times_out_naming_it(self):
    r = _util.rng()
    m = _util.mesh(R)
    x, ids, w, w1q = _util.make_problem(r, R, 4, 64, 32, 16, 2)
    cfg = jsm.Stage1Config(engine="cpu", timeout_s=0.5)
    with jsm.Runtime(m, "ep", cfg) as rt:
      inject_faults(rt, absent_rank=3)
      f = _util.stage1_fn(m, rt)
      with self.assertRaisesRegex(Exception, r"timed out after 0\.5.* from peer rank 3"):
        jax.block_until_ready(f(*_util.shard(m, (x, ids, w)), _util.shard(m, w1q)))


if __name__ == "__main__":
  absltest.main()
