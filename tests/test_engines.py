"""The engines as objects: what each declares, and which one a Runtime picks (DESIGN.md §6)."""
import _util

from absl.testing import absltest

import jax_sdma_moe as jsm
from jax_sdma_moe import engines


class EnginesTest(absltest.TestCase):

  def test_registry_matches_config(self):
    self.assertEqual(set(jsm.config.ENGINE_NAMES), set(engines.ENGINES) | set(engines.NOT_BUILT))
    for name, cls in engines.ENGINES.items():
      with self.subTest(name):
        self.assertEqual(cls.name, name)
        self.assertTrue(cls.platforms and set(cls.platforms) <= {"cpu", "cuda", "rocm"})
        self.assertIsInstance(cls.fuses_gemm1, bool)
        self.assertIsInstance(cls.graph_capturable, bool)

  def test_declared_traits(self):
    # only engines whose calls have no host step may be captured in CUDA (HIP) graphs
    self.assertEqual({n for n, c in engines.ENGINES.items() if c.graph_capturable},
                     {"sm", "sdma"})
    self.assertEqual({n for n, c in engines.ENGINES.items() if c.fuses_gemm1}, {"ce", "sm", "sdma"})
    # every engine that runs as a custom call has an id the handlers know
    ids = jsm.primitives.extension().ENGINE_IDS
    for name, cls in engines.ENGINES.items():
      if issubclass(cls, engines.base.FfiDispatchEngine):
        self.assertIn(name, ids)

  def test_default_engine_on_cpu(self):
    with jsm.Runtime(_util.mesh(8), "ep") as rt:
      self.assertIsInstance(rt.engine, engines.CpuEngine)
      self.assertEqual(rt.engine.name, "cpu")
      self.assertEqual(rt.engine.host_stats(), {})
      self.assertEqual(rt.engine.timeline(), {})
    with jsm.Runtime(_util.mesh(1), "ep") as rt:
      self.assertEqual(rt.engine.name, "cpu")  # one CPU device in one process: the cpu engine
    with jsm.Runtime(_util.mesh(1), "ep", jsm.Stage1Config(engine="local")) as rt:
      self.assertIsInstance(rt.engine, engines.LocalEngine)

  def test_engine_refuses_mesh(self):
    with self.assertRaisesRegex(ValueError, "one-rank axis"):
      jsm.Runtime(_util.mesh(8), "ep", jsm.Stage1Config(engine="local"))
    self.assertIs(engines.select("sdma", platform="rocm", num_ranks=8, multi_process=False,
                                 has_cuda=False), engines.SdmaEngine)
    with self.assertRaisesRegex(ValueError, "runs on"):
      jsm.Runtime(_util.mesh(8), "ep", jsm.Stage1Config(engine="sdma"))
    # built for ROCm but lowered elsewhere: the mesh checks still apply
    with self.assertRaisesRegex(ValueError, "one rank"):
      jsm.Runtime(_util.mesh(1), "ep", jsm.Stage1Config(engine="sdma"), lowering_platform="rocm")

  def test_window_bytes(self):
    """What the window engines' windows hold beyond their landing slots, from the C++ layouts that
    allocate them (kernels/common/ep_window.h, kernels/rocm/sdma/window.h), as the Runtime's memory
    guard counts it: sm's the combine's return slots, ce's also its staging of every peer's rows,
    sdma's the return slots and its staged send rows (DESIGN §6)."""
    R, H, EL, cap, S = 8, 7168, 16, 4096, 2048  # S: send rows (T * K)
    got = {}
    for name, platform in (("sm", "cuda"), ("ce", "cuda"), ("sdma", "rocm")):
      with jsm.Runtime(_util.mesh(R), "ep", jsm.Stage1Config(engine=name),
                       lowering_platform=platform) as rt:  # lowered only: no windows are made
        got[name] = rt.engine.window_bytes(H, EL, cap, S)
    meta = (16 + H // 32 + 15) // 16 * 16  # a staged meta row: header, then the scale bytes
    returns = 2 * S * (2 * H + 8)
    staging = S * meta + 2 * (R - 1) * S * (H + meta) + (R - 1) * S * (2 * H + 8)
    # the rest: plans, flags, the send headers, counters, 256-byte alignment of each region
    self.assertBetween(got["sm"] - returns, S * 16, S * 16 + 2**16)
    self.assertBetween(got["ce"] - got["sm"] - staging, 0, 16 * 256)
    self.assertBetween(got["sdma"] - got["sm"] - S * (H + H // 32), 0, 16 * 256)
    with jsm.Runtime(_util.mesh(R), "ep") as rt:  # engine cpu: windows of landing slots only
      self.assertEqual(rt.engine.window_bytes(H, EL, cap, S), 0)

  def test_default_selection_rules(self):
    pick = lambda **kw: engines.select(None, **{**dict(platform="cuda", num_ranks=2,
                                                      multi_process=False,
                                                      has_cuda=True), **kw}).name
    self.assertEqual(pick(), "sm")
    self.assertEqual(pick(num_ranks=1), "local")
    self.assertEqual(pick(has_cuda=False), "xla")
    self.assertEqual(pick(platform="cpu"), "cpu")
    self.assertEqual(pick(platform="cpu", multi_process=True), "xla")
    # EP groups: the rules are per group (sm on CUDA, cpu on CPU where each group is in one
    # process, also across processes)
    self.assertEqual(pick(multi_process=True, groups_local=True), "sm")
    self.assertEqual(pick(multi_process=True, groups_local=False), "sm")
    self.assertEqual(pick(platform="cpu", multi_process=True, groups_local=True), "cpu")
    # ROCm: local on one GPU; xla across GPUs (engine sdma has never run on AMD hardware)
    self.assertEqual(pick(platform="rocm", has_cuda=False, num_ranks=1), "local")
    self.assertEqual(pick(platform="rocm", has_cuda=False), "xla")


if __name__ == "__main__":
  absltest.main()
