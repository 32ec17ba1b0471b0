"""Engine sm inside XLA command buffers (CUDA graphs), started by test_multigpu.py with XLA_FLAGS
that make XLA capture custom calls: one process with 2 GPUs, 50 back-to-back Stage1 calls with
fresh inputs, every one checked against the reference (a replayed graph must read its epoch on the
device). Prints 'OK rank 0' on success (the test harness's marker)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402

seed = int(sys.argv[4])
R = int(os.environ.get("JSM_TEST_RANKS", "0")) or len(jax.devices("gpu"))  # as test_multigpu
T = 64
r = np.random.default_rng(seed)
s = jsm.SHAPES["small"]
mesh = jax.sharding.Mesh(np.array(jax.devices("gpu")[:R]), ("ep",))
_, _, _, w1q = _util.make_problem(r, R, 1, s.hidden, s.intermediate, s.num_experts, s.topk)
cfg = jsm.Stage1Config(engine="sm")


class Tc:  # _util's checks outside a TestCase
  def assertFalse(self, c, m=""): assert not c, m
  def assertTrue(self, c, m=""): assert c, m
  def assertLessEqual(self, a, b, m=""): assert a <= b, f"{m}: {a} > {b}"
  def assertGreaterEqual(self, a, b, m=""): assert a >= b, f"{m}: {a} < {b}"


with jsm.Runtime(mesh, "ep", cfg) as rt:
  f = _util.stage1_fn(mesh, rt)
  w1s = rt.shard_w1(w1q)
  ref_fn = jax.jit(lambda x, i, w: _util.reference(x, i, w, w1q, R, cfg, T))
  for it in range(50):
    x, ids, w, _ = _util.make_problem(r, R, T, s.hidden, s.intermediate, s.num_experts, s.topk,
                                      ("uniform", "masked", "skewed")[it % 3])
    out = jax.tree.map(np.asarray, f(*_util.shard(mesh, (x, ids, w)), w1s))
    ref, h32 = ref_fn(x, ids, w)
    _util.check_stage1(Tc(), out, ref, h32, "bf16")
  rt.check()
print("OK rank 0", flush=True)
