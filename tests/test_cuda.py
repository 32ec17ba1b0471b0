"""CUDA backend on one GPU (engine "local", R = 1) against the reference and the CPU backend.

Skips without a GPU. JSM_REQUIRE_CUDA=1 (set by the device scripts) turns a missing GPU or a
build without CUDA kernels into a failure instead of a skip.
"""
import functools
import os
import types

import _util

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import PartitionSpec as P

import jax_sdma_moe as jsm
from jax_sdma_moe import primitives, reference
from jax_sdma_moe.engines.base import Engine
from test_quantize import special_blocks


def _gpu():
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  if not gpus:
    return None, "no GPU"
  if "cuda" not in primitives.registered_platforms():
    return None, "jax_sdma_moe was built without CUDA kernels"
  return gpus[0], None


GPU, WHY = _gpu()
if GPU is None and os.environ.get("JSM_REQUIRE_CUDA") == "1":
  raise RuntimeError(f"JSM_REQUIRE_CUDA=1 but {WHY}")
CPU = jax.devices("cpu")[0]


def on(dev, tree):
  return jax.device_put(tree, dev)


def cpu_ref(fn, *args, **kw):
  with jax.default_device(CPU):
    return fn(*on(CPU, args), **kw)


@functools.cache
def _gemm1_workspace_primitive():
  """gemm1's primitive with its CUDA workspace as results, which the library's drops at
  lowering: (*h, the 16-bit rows, the words; layout.py bf16_gemm_workspace)."""
  def abstract(values, scales, offsets, counts, w_values, w_scales, *, options):
    work = jsm.layout.gemm1_workspace(values.shape[0], values.shape[1], w_values.shape[1] // 2,
                                      w_values.shape[0])
    return (*primitives._gemm1_abstract(values, scales, offsets, counts, w_values, w_scales,
                                        options=options),
            *(primitives._aval(shape, dtype) for shape, dtype in work))
  return primitives._make("gemm1", abstract, lambda p: {"gemm1": p["options"].ffi_attr()})


def _gemm1_with_workspace(landed, w1q, options):
  """gemm1 on landed rows (one rank's Landed) and its workspace (_gemm1_workspace_primitive)."""
  prim = _gemm1_workspace_primitive()
  return jax.jit(lambda *a: primitives._bind(prim, *a, options=options))(
      landed.values, landed.scales, landed.expert_offsets, landed.expert_counts, w1q.values,
      w1q.scales)


_STAGE1 = {}


def local_stage1(shape_name, out_dtype, tile=None):
  """(config, jitted stage1) of engine local on the GPU, one per shape, output dtype and GEMM tile
  (Stage1Config.gemm_tile_tokens): the cases of a shape and T compile once (one Runtime reused
  across tests, as users do)."""
  if (shape_name, out_dtype, tile) not in _STAGE1:
    mesh = jax.sharding.Mesh(np.array([GPU]), ("ep",))
    cfg = jsm.Stage1Config(engine="local", swiglu_limit=jsm.SHAPES[shape_name].swiglu_limit,
                           out_dtype=out_dtype, gemm_tile_tokens=tile)
    rt = jsm.Runtime(mesh, "ep", cfg)
    f = jax.jit(jax.shard_map(lambda x, i, w, q: jsm.stage1(x, (i, w), q, runtime=rt),
                              mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    _STAGE1[shape_name, out_dtype, tile] = (cfg, f)
  return _STAGE1[shape_name, out_dtype, tile]


@absltest.skipIf(GPU is None, WHY or "")
class CudaStagesTest(parameterized.TestCase):

  @parameterized.parameters(jnp.bfloat16, jnp.float32)
  def test_quantize_bytes(self, dtype):
    r = _util.rng()
    x = r.standard_normal((512, 512)) * np.exp(r.uniform(-30, 30, (512, 16, 1))).repeat(32, -1).reshape(512, 512)
    x = np.concatenate([x[:, :32], special_blocks(r).repeat(16, 0)[:512]], 0)
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(jnp.bfloat16).reshape(-1, 32)
    for arr in (jnp.asarray(x, dtype), jnp.asarray(bits).astype(dtype)):
      got = jax.jit(jsm.quantize)(on(GPU, arr))
      want = cpu_ref(reference.quantize, arr)
      np.testing.assert_array_equal(_util.as_bytes(got.values), _util.as_bytes(want.values))
      np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))

  # H: one partial round of 32 MX blocks in qpack (512, 96), full rounds (7168), a full round
  # then a partial one (1536)
  @parameterized.parameters(("uniform", 1, 256, 8, 4096, 512), ("masked", 4, 32, 4, 777, 1536),
                            ("invalid", 8, 384, 6, 129, 7168), ("uniform", 2, 16, 1, 1, 96))
  def test_route_qpack_pack(self, routing, R, E, K, T, H):
    r = _util.rng()
    ids = _util.make_ids(r, R, -(-T // R), K, E, routing)[:T]
    x = jnp.asarray(r.standard_normal((T, H)), jnp.bfloat16)
    w = jnp.asarray(r.random((T, K)), jnp.float32)
    got_r = jax.jit(primitives.route, static_argnums=(1, 2))(on(GPU, ids), R, E // R)
    want_r = cpu_ref(reference.route, ids, R, E // R)
    for name, a, b in zip(got_r._fields, got_r, want_r):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    used = int(np.asarray(want_r.send_counts).sum())
    want = cpu_ref(lambda x, w, p: reference.pack(reference.quantize(x), w, p), x, w, want_r.send_pos)
    for got in (jax.jit(primitives.qpack)(on(GPU, x), on(GPU, w), got_r.send_pos),
                jax.jit(primitives.pack)(jsm.quantize(on(GPU, x)), on(GPU, w), got_r.send_pos)):
      _util.assert_send_buffers_equal(got, want, np.arange(used))  # all headers, used rows

  def test_pack_any_send_pos(self):
    """qpack's unused rows' headers come from the kernel's first blocks (spans of send rows marked
    in a bitmap): with send_pos not route's (gaps between the used rows, unrouted slots, rows past
    S, which nothing writes) and more spans than those blocks (S > 64 * 16384: they loop), every
    header is the reference's and every used row its token's bytes."""
    r = _util.rng()
    T, K, H = 140_000, 8, 32
    send_pos, used = _util.scattered_send_pos(r, T, K)
    x = jnp.asarray(r.standard_normal((T, H)), jnp.bfloat16)
    w = jnp.asarray(r.random((T, K)), jnp.float32)
    got = jax.jit(primitives.qpack)(on(GPU, x), on(GPU, w), on(GPU, send_pos))
    want = cpu_ref(lambda x, w, p: reference.pack(reference.quantize(x), w, p), x, w, send_pos)
    _util.assert_send_buffers_equal(got, want, used)


SHAPE_CASES = [(f"{s}_T{T}_{routing}", s, T, routing) for s, T, routing in
               [(s, T, "uniform") for s in ("small", "dsv3", "v4pro") for T in (1, 7, 128, 4096)]
               + [("dsv3", 4096, "skewed"), ("small", 128, "skewed"), ("v4pro", 128, "skewed"),
                  ("dsv3", 1024, "wide"), ("v4pro", 256, "wide")]]


@absltest.skipIf(GPU is None, WHY or "")
class CudaGemm1Test(parameterized.TestCase):
  """gemm1 (and the local dispatch feeding it) against a per-expert float32 reference."""
  def w1q(self, name, wide=False):
    return _util.random_w1q(name, GPU, wide)

  @staticmethod
  def inputs(s, T, routing, r):
    """x [T, H] bf16, ids [T, K], weights [T, K] of one rank on the GPU."""
    E, K, H = s.num_experts, s.topk, s.hidden
    if routing == "skewed":  # one expert gets every token, most experts none
      ids = np.stack([np.concatenate([[0], 1 + r.permutation(7)[:K - 1]]) for _ in range(T)])
    elif routing == "lastwave":  # m = T K / 128 experts of 128 rows (token t: (K t + j) mod m)
      m = T * K // 128
      ids = np.stack([r.permutation((K * t + np.arange(K)) % m) for t in range(T)])
    else:
      ids = np.stack([r.permutation(E)[:K] for _ in range(T)])
    x = r.standard_normal((T, H)) * r.uniform(0.5, 2, (T, 1))
    if routing == "wide":  # rows 2^-40 .. 2^20 (MX scales far from 127; expert weights too)
      x = x * np.exp2(r.integers(-40, 21, (T, 1)))
    return (on(GPU, jnp.asarray(x, jnp.bfloat16)), on(GPU, jnp.asarray(ids, jnp.int32)),
            on(GPU, jnp.asarray(r.random((T, K)), jnp.float32)))

  def run_and_check_layout(self, s, cfg, f, x, ids, w, w1q):
    """stage1's output, and the reference landing, whose §4 layout it must equal."""
    out = f(x, ids, w, w1q)
    cap = jsm.layout.m_cap(1, x.shape[0], s.topk, s.num_experts, cfg.row_align)
    landed = jax.jit(reference.dispatch, static_argnums=(3, 4, 5))(
        jax.tree.map(lambda a: a[None], jsm.quantize(x)), ids[None], w[None], s.num_experts,
        cfg.row_align, cap)
    for name in _util.LANDED_FIELDS:
      np.testing.assert_array_equal(np.asarray(getattr(out, name)),
                                    np.asarray(getattr(landed, name))[0], err_msg=name)
    return out, landed

  @parameterized.named_parameters(*SHAPE_CASES)
  def test_stage1_local(self, shape_name, T, routing):
    s = jsm.SHAPES[shape_name]
    r = _util.rng()
    x, ids, w = self.inputs(s, T, routing, r)
    w1q = self.w1q(shape_name, wide=routing == "wide")
    # MX-fp8 output where there are rows to speak of (each output dtype is a compile)
    for out_dtype in ("bf16", "mxfp8") if T >= 128 else ("bf16",):
      cfg, f = local_stage1(shape_name, out_dtype)
      out, landed = self.run_and_check_layout(s, cfg, f, x, ids, w, w1q)
      self.check_experts(out, landed, w1q, s.swiglu_limit, out_dtype, r)

  @staticmethod
  def lastwave_tokens(s):
    """Tokens for routing "lastwave": the large tile's head launch then has some full waves of
    items on the GPU's SMs (one CTA each) and a last partial wave that the tail launch runs in
    32-token units (kernels/cuda/gemm1/scheduler.cuh head_items_left): m experts of 128 rows,
    128 m / K tokens."""
    large, small = jsm.layout.GEMM_TILE_TOKENS
    sms, col_tiles = GPU.core_count, s.intermediate // 128  # GEMM1 tiles: 128 columns
    for m in range(s.topk, s.num_experts + 1):
      items = m * col_tiles  # one row tile each
      if items > sms and 0 < items % sms and large // small * (items % sms) <= sms:
        return large * m // s.topk
    raise AssertionError(f"no expert count gives a last partial wave on {sms} SMs")

  @parameterized.parameters(("bf16", "uniform", 768), ("mxfp8", "uniform", 768),
                            ("bf16", "skewed", 800), ("mxfp8", "uniform", 4608),
                            ("bf16", "uniform", 4608), ("bf16", "lastwave", None),
                            ("mxfp8", "lastwave", None))
  def test_tile_widths_give_the_same_bytes(self, out_dtype, routing, T):
    """The bf16 GEMM's tiles (Stage1Config.gemm_tile_tokens) on the same rows: h byte for byte,
    and the small tile's against the reference. The large tile leaves an expert's tail past its
    full tiles to a launch of its own (kernels/cuda/gemm1/args.h RowPart): up to 24 rows join its
    last full tile in a 152-token tile, up to 32 run in small tiles. dsv3, uniform, 768 tokens:
    ~24 rows per expert, so some experts fill more than one small tile and most are tails only;
    skewed, 800 tokens: eight experts of 800 rows, six full large tiles and a tail of 32 (small
    tiles); uniform, 4608 tokens: ~144 rows per expert, tails on both sides of 24 and 32;
    lastwave: the large tile's head launch leaves its last partial wave to the tail launch
    (lastwave_tokens)."""
    s = jsm.SHAPES["dsv3"]
    r = _util.rng()
    T = T or self.lastwave_tokens(s)
    x, ids, w = self.inputs(s, T, routing, r)
    w1q = self.w1q("dsv3")
    outs = {}
    for tile in jsm.layout.GEMM_TILE_TOKENS:
      cfg, f = local_stage1("dsv3", out_dtype, tile)
      outs[tile], landed = self.run_and_check_layout(s, cfg, f, x, ids, w, w1q)
    small = outs[min(jsm.layout.GEMM_TILE_TOKENS)]
    self.assertGreater(int(np.max(np.asarray(small.expert_counts))),
                       min(jsm.layout.GEMM_TILE_TOKENS), "no expert spans two small tiles")
    for tile, out in outs.items():
      for a, b in zip(jax.tree.leaves(out.h), jax.tree.leaves(small.h)):
        np.testing.assert_array_equal(_util.as_bytes(a), _util.as_bytes(b), err_msg=f"tile {tile}")
    self.check_experts(small, landed, w1q, s.swiglu_limit, out_dtype, r)

  @parameterized.parameters("bf16", "mxfp8")
  def test_f16_windows_and_the_bf16_pass_agree(self, out_dtype):
    """The 16-bit GEMM computes in f16 with a window of 23 scale bytes per token row and per
    weight row (kernels/cuda/gemm1/mx_bf16.cuh window_bias), and redoes in bf16 an expert with a
    block outside its row's window (Gemm1Args::fallback): the same bytes either way. gemm1 on
    the landed rows of dsv3 at 4096 tokens (128 rows per expert, the large tile), its workspace
    read back. First call: weights times 2^-24 (every scale byte far below 112, f16's own range)
    and token rows times 2^-20 .. 2^10, every 97th zero: no expert falls back, and h is within
    the tolerance of the reference. Second call: in every expert but one, one gate row's block
    (past the 16 that place its window) raised by 2^24, above the window (f16 would overflow):
    exactly those experts fall back, and h outside that column's 32-column block is byte for byte
    the first call's."""
    s = jsm.SHAPES["dsv3"]
    r = _util.rng()
    T, E = 4096, s.num_experts
    x, ids, w = self.inputs(s, T, "uniform", r)
    x = (x * jnp.exp2(on(GPU, jnp.asarray(r.integers(-20, 11, (T, 1)), jnp.float32)))).astype(
        jnp.bfloat16).at[::97].set(0)
    w1q = self.w1q("dsv3")
    small = np.asarray(w1q.scales) - np.uint8(24)
    self.assertTrue((small < 112).all())
    col = int(r.integers(s.intermediate))  # a gate row: h's column col
    kept = int(r.integers(E))  # the expert that stays in f16
    raised = small.copy()
    lowered = np.arange(E) != kept
    raised[lowered, col, 16 + int(r.integers(s.hidden // 32 - 16))] += np.uint8(24)
    cap = jsm.layout.m_cap(1, T, s.topk, E, jsm.Stage1Config().row_align)
    landed = jax.tree.map(lambda a: a[0], jax.jit(reference.dispatch, static_argnums=(3, 4, 5))(
        jax.tree.map(lambda a: a[None], jsm.quantize(x)), ids[None], w[None], E,
        jsm.Stage1Config().row_align, cap))
    opts = primitives.Gemm1Options(s.swiglu_limit, out_dtype, jsm.layout.GEMM_TILE_TOKENS[0])
    fallback_at = jsm.layout.bf16_gemm_fallback_at(cap, E)
    qs = [jsm.QuantizedW1(w1q.values, on(GPU, jnp.asarray(scales))) for scales in (small, raised)]
    hs, fallbacks = [], []
    for q in qs:
      *h, _, words = _gemm1_with_workspace(landed, q, opts)
      hs.append(h)
      fallbacks.append(np.asarray(words)[fallback_at:][:E + 1])
    np.testing.assert_array_equal(fallbacks[0], 0, "an expert fell back with every scale in its "
                                  "row's window")
    np.testing.assert_array_equal(fallbacks[1], np.r_[lowered, True].astype(np.uint32))
    blk = col // 32  # h's MX block (mxfp8 output) of that column
    for a, b in zip(*hs, strict=True):
      a, b = _util.as_bytes(a), _util.as_bytes(b)
      width = 32 if a.shape[1] == s.intermediate else 1  # values or bf16 columns; MX scales
      keep = np.r_[0:blk * width, (blk + 1) * width:a.shape[1]]
      np.testing.assert_array_equal(a[:, keep], b[:, keep])
    for q, h in zip(qs, hs):
      out = types.SimpleNamespace(h=h[0] if out_dtype == "bf16" else jsm.MXFP8(*h),
                                  expert_offsets=landed.expert_offsets,
                                  expert_counts=landed.expert_counts)
      self.check_experts(out, jax.tree.map(lambda a: a[None], landed), q, s.swiglu_limit,
                         out_dtype, r, also=(kept,))

  def check_experts(self, out, landed, w1q, limit, out_dtype, r, also=()):
    offs, cnts = np.asarray(out.expert_offsets), np.asarray(out.expert_counts)
    nonempty = np.flatnonzero(cnts)
    pick = set(nonempty[:2]) | set(nonempty[-2:]) | {int(np.argmax(cnts))} | set(also)
    pick |= set(r.choice(nonempty, min(4, len(nonempty)), replace=False))
    h = out.h
    got = np.asarray(reference.dequantize(*h)) if out_dtype == "mxfp8" else np.asarray(h, np.float32)
    landed_rows = np.zeros(got.shape[0], bool)
    for e in range(len(offs)):
      landed_rows[offs[e]:offs[e] + cnts[e]] = True
    self.assertTrue((got[~landed_rows] == 0).all(), "padding rows must be 0")
    refs = reference.sampled_h32(landed.values, landed.scales, offs, cnts, pick, w1q, 0, limit)
    for e, ref in refs.items():
      _util.check_block(self, got[offs[e]:offs[e] + cnts[e]], ref, out_dtype, f"expert {e}")


@absltest.skipIf(GPU is None, WHY or "")
class CudaStage1Test(parameterized.TestCase):

  @parameterized.parameters("bf16", "mxfp8")
  def test_gpu_equals_cpu_backend(self, out_dtype):
    """R = 1: the same layout, values within the §3 tolerance of each other and the reference."""
    r = _util.rng()
    s = jsm.SHAPES["small"]
    T = 200
    x, ids, w, w1q = _util.make_problem(r, 1, T, s.hidden, s.intermediate, s.num_experts, s.topk,
                                        "masked")
    outs = {}
    for dev in (GPU, CPU):
      mesh = jax.sharding.Mesh(np.array([dev]), ("ep",))
      cfg = jsm.Stage1Config(engine="local", out_dtype=out_dtype, row_align=64)
      with jsm.Runtime(mesh, "ep", cfg) as rt:
        f = jax.jit(jax.shard_map(lambda x, i, w, q: jsm.stage1(x, (i, w), q, runtime=rt),
                                  mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
        outs[dev.platform] = jax.tree.map(np.asarray, f(*on(dev, (x, ids, w, w1q))))
    ref, h32 = _util.reference(x, ids, w, w1q, 1, cfg, T)
    for platform, out in outs.items():
      with self.subTest(platform=platform):
        _util.check_stage1(self, jax.tree.map(lambda a: a[None], out), ref, h32, out_dtype)

  @parameterized.parameters("bf16", "mxfp8")
  def test_local_fused_reads_token_rows(self, out_dtype):
    """Where the bf16 GEMM runs, engine local fuses the dispatch into it: qpack stores one row per
    token (token_rows) and the GEMM reads each landed row from its token's row. With M_cap too
    small for every row (the last experts' rows overflow) and masked ids: stage1 as the
    reference, and the fused call's layout and h byte for byte those of the unfused form (send
    rows, the dispatch copying them, then gemm1: Engine.dispatch_gemm1)."""
    r = _util.rng()
    H, I, E, K = _util.MID_LAYER
    T = 1000
    x, ids, w, w1q = _util.make_problem(r, 1, T, H, I, E, K, "masked")
    mesh = jax.sharding.Mesh(np.array([GPU]), ("ep",))
    cfg = jsm.Stage1Config(engine="local", out_dtype=out_dtype, max_recv_rows=3 * T)
    cap = jsm.layout.m_cap(1, T, K, E, cfg.row_align, cfg.max_recv_rows)
    args = on(GPU, (x, ids, w, w1q))
    with jsm.Runtime(mesh, "ep", cfg) as rt:
      def run(body):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
        return f.lower(*args).as_text(), jax.tree.map(np.asarray, f(*args))

      def parts(dispatch_gemm1, token_rows):
        def body(x, i, w, q):
          route = primitives.route(i, 1, E)
          send = primitives.qpack(x, w, route.send_pos, token_rows=token_rows)
          landed, h = dispatch_gemm1(send, route.send_counts, jnp.int32(0), q, cap=cap,
                                     token_rows=token_rows)
          return landed._replace(values=None, scales=None), h
        return body

      text, out = run(lambda x, i, w, q: jsm.stage1(x, (i, w), q, runtime=rt))
      self.assertNotIn("@jsm_dispatch(", text)
      self.assertIn("@jsm_dispatch_gemm1(", text)
      self.assertGreater(int(out.overflow), 0, "no row overflowed")
      ref, h32 = _util.reference(x, ids, w, w1q, 1, cfg, T)
      _util.check_stage1(self, jax.tree.map(lambda a: a[None], out), ref, h32, out_dtype)
      got = {}
      for fused, fn in ((True, rt.engine.dispatch_gemm1),
                        (False, functools.partial(Engine.dispatch_gemm1, rt.engine))):
        text, got[fused] = run(parts(fn, token_rows=fused))
        self.assertEqual("@jsm_dispatch(" in text, not fused)
    for a, b in zip(jax.tree.leaves(got[True]), jax.tree.leaves(got[False]), strict=True):
      np.testing.assert_array_equal(_util.as_bytes(a), _util.as_bytes(b))

  def test_xla_engine_matches_local(self):
    """engine xla (ragged_all_to_all on GPU) lands the same bytes as engine local (R = 1)."""
    r = _util.rng()
    s = jsm.SHAPES["small"]
    T = 96
    x, ids, w, w1q = _util.make_problem(r, 1, T, s.hidden, s.intermediate, s.num_experts, s.topk,
                                        "masked")
    mesh = jax.sharding.Mesh(np.array([GPU]), ("ep",))
    outs = []
    for engine in ("local", "xla"):
      rt = jsm.Runtime(mesh, "ep", jsm.Stage1Config(engine=engine, row_align=32))
      f = jax.jit(jax.shard_map(lambda x, i, w, q: jsm.stage1(x, (i, w), q, runtime=rt),
                                mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
      outs.append(f(*on(GPU, (x, ids, w, w1q))))
    for name, a, b in zip(outs[0]._fields, outs[0], outs[1]):
      np.testing.assert_array_equal(_util.as_bytes(a), _util.as_bytes(b), err_msg=name)

  def test_back_to_back(self):
    """100 calls with fresh inputs on one Runtime, every output checked."""
    r = _util.rng()
    s = jsm.SHAPES["small"]
    T = 64
    mesh = jax.sharding.Mesh(np.array([GPU]), ("ep",))
    cfg = jsm.Stage1Config(engine="local")
    rt = jsm.Runtime(mesh, "ep", cfg)
    f = jax.jit(jax.shard_map(lambda x, i, w, q: jsm.stage1(x, (i, w), q, runtime=rt),
                              mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    _, _, _, w1q = _util.make_problem(r, 1, 1, s.hidden, s.intermediate, s.num_experts, s.topk)
    ref_fn = jax.jit(lambda x, i, w: _util.reference(x, i, w, w1q, 1, cfg, T))
    for i in range(100):
      x = jnp.asarray(r.standard_normal((T, s.hidden)), jnp.bfloat16)
      w = jnp.asarray(r.random((T, s.topk)), jnp.float32)
      ids = _util.make_ids(r, 1, T, s.topk, s.num_experts, ("uniform", "masked")[i % 2])
      out = jax.tree.map(lambda a: np.asarray(a)[None], f(*on(GPU, (x, ids, w, w1q))))
      ref, h32 = ref_fn(x, ids, w)
      _util.check_stage1(self, out, ref, h32, "bf16")



@absltest.skipIf(GPU is None, WHY or "")
class CudaMoeTest(parameterized.TestCase):
  """jsm.moe on one GPU, engine local (Stage2 on CUDA: gemm2, the combine within the rank) against
  reference.moe: the bf16-route gemm2 (MID_LAYER) and the generic one (the small shape)."""

  @parameterized.named_parameters(
      ("mid_uniform", _util.MID_LAYER, 256, "uniform", None),
      ("mid_uniform_T1024", _util.MID_LAYER, 1024, "uniform", None),  # 256 rows per expert
      ("mid_skewed_limit", _util.MID_LAYER, 512, "skewed", 7.0),
      ("mid_masked", _util.MID_LAYER, 64, "masked", None),
      ("small_uniform", None, 128, "uniform", None),
      ("small_T1", None, 1, "uniform", None))
  def test_moe_local(self, dims, T, routing, limit):
    s = jsm.SHAPES["small"]
    H, I, E, K = dims or (s.hidden, s.intermediate, s.num_experts, s.topk)
    m = jax.sharding.Mesh(np.array([GPU]), ("ep",))
    _util.run_moe_on(self, m, "local", T, H, I, E, K, routing, limit)


@absltest.skipIf(GPU is None, WHY or "")
class CudaRanksShareOneGpuTest(parameterized.TestCase):

  @parameterized.parameters(2, 4, 8)
  def test_processes_share_the_gpu(self, R):
    """The mpirun launch mode's protocol with R processes on this one GPU, one launch each running
    both engines (ce, sm) and every part of tests/mp_gpu_worker.py on its small shapes (E = 64,
    the layer with E = 32; dsv3's sizes run in test_multigpu.py, as they do not fit beside the
    75% of the GPU this process holds): Stage1, the axis-wide overflow count, stage2 on an earlier
    Stage1Output, the whole layer. Windows opened by CUDA IPC from the other processes, copies and
    stores that cross processes, bounded waits that outlast the R contexts taking turns on the GPU.
    Bytes only: the timing of shared-GPU ranks says nothing of R GPUs."""
    _util.run_mp_gpu_workers(self, R, timeout=150 + 60 * R, gpu=0)

  def test_processes_share_the_gpu_as_groups(self):
    """EP groups (DESIGN.md §2) in the mpirun launch mode: 4 processes on this one GPU as the mesh
    (dp 2, ep 2), every part of tests/mp_gpu_worker.py for engines ce and sm per group against the
    reference of its tokens alone: each group's ranks open only their group's windows."""
    _util.run_mp_gpu_workers(self, 4, timeout=400, gpu=0, groups=2)


if __name__ == "__main__":
  absltest.main()
