"""bench/run.py --layer (the whole MoE layer: jsm.moe per engine and the JAX-native capacity
layer, checked and timed in one run) at a tiny size: 8 CPU devices of one process, and two
processes of one CPU device each (the mode `mpirun -n 2` runs, started with --coordinator); and
--mesh dp=2,ep=4 (two EP groups of 4 ranks) for the layer and for the Stage1 benchmark."""
import json
import os
import subprocess
import sys
import tempfile

import _util

from absl.testing import absltest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BenchLayerTest(absltest.TestCase):

  def _bench(self, *flags):
    """bench/run.py on 8 CPU devices with `flags`: its stdout and output folder's files by name."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    with tempfile.TemporaryDirectory() as out:
      p = subprocess.run(
          [sys.executable, os.path.join(ROOT, "bench", "run.py"), "--tokens", "16", "--iters",
           "2", "--warmup", "1", "--out", out, *flags], cwd=ROOT, env=env, capture_output=True,
          text=True, timeout=300)
      self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-3000:])
      return p.stdout, {n: open(os.path.join(out, n)).read() for n in os.listdir(out)}

  def _run_on_cpu_devices(self, *flags, engines=("cpu", "xla")):
    """bench/run.py --layer on 8 CPU devices with `flags`: its JSON, stdout and output folder's
    files by name."""
    stdout, files = self._bench("--layer", "--platform", "cpu", "--devices", "8", *flags)
    result = json.loads(files["layer-cpu.json"])
    self.assertEqual(result["meta"]["devices"], 8)
    rows = {r["path"]: r for r in result["results"]}
    self.assertEqual(set(rows), {*(f"engine:{e}" for e in engines), "native:layer(cf=1.25)"})
    for name, row in rows.items():
      self.assertNotIn("failed", row, name)
      self.assertLessEqual(row["max_rel_err"], 1e-2, name)
      self.assertGreater(row["median_ms"], 0, name)
    self.assertEqual(rows[f"engine:{engines[0]}"]["dropped"], 0)
    self.assertIn("native:layer(cf=1.25)", stdout)  # the table
    return files

  def test_layer_on_cpu_devices(self):
    self._run_on_cpu_devices()

  def test_layer_with_mxfp8_stage1_and_trace(self):
    # each path checked against the reference of its own Stage1 output; --trace's tables written
    # (CPU devices have no device streams: each path says so)
    files = self._run_on_cpu_devices("--stage1-out", "mxfp8", "--trace")
    trace = files["layer-cpu-trace.txt"]
    for path in ("engine:cpu", "engine:xla", "native:layer(cf=1.25)"):
      self.assertIn(f"[small T=16] {path}", trace)

  def test_layer_on_a_dp_ep_mesh(self):
    # two EP groups of 4 ranks (tokens on all 8 devices, the experts over "ep"): each device's y
    # checked against the float32 reference of its tokens (engine xla: engine-independent here)
    files = self._run_on_cpu_devices("--mesh", "dp=2,ep=4", "--engines", "xla",
                                     engines=("xla",))
    result = json.loads(files["layer-cpu.json"])
    self.assertEqual(result["meta"]["args"]["mesh"], {"dp": 2, "ep": 4})
    self.assertEqual({r["ranks"] for r in result["results"]}, {4})

  def test_stage1_on_a_dp_ep_mesh(self):
    # the Stage1 benchmark's CPU mode: every path checked against reference.stage1 of each group
    stdout, files = self._bench("--mesh", "dp=2,ep=4", "--engines", "xla", "--skip-native",
                                "ragged")
    self.assertIn("engine:xla", stdout)  # the table
    result = json.loads(files["cpu.json"])
    self.assertEqual((result["meta"]["devices"], result["meta"]["args"]["mesh"]),
                     (8, {"dp": 2, "ep": 4}))
    rows = {r["path"]: r for r in result["results"]}
    self.assertEqual(set(rows), {"engine:xla", "native:a2a+einsum(cf=1.25)",
                                 "native:jnp-reference(1 dev)"})
    for name, row in rows.items():
      self.assertNotIn("failed", row, name)
      self.assertEqual(row["ranks"], 4, name)
    # 8 devices' 16 tokens, K = 4 rows each, all routed (dropless engine)
    self.assertEqual(rows["engine:xla"]["rows_total"], 8 * 16 * 4)
    self.assertEqual(rows["engine:xla"]["dropped"], 0)

  def test_layer_in_two_processes(self):
    with tempfile.TemporaryDirectory() as out:
      outs = _util.run_bench_processes(
          2, ["--layer", "--tokens", "16", "--iters", "2", "--warmup", "1", "--out", out], 300)
      for i, (rc, stdout, stderr) in enumerate(outs):
        self.assertEqual(rc, 0, f"process {i} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
      with open(os.path.join(out, "layer-cpu.json")) as f:
        result = json.load(f)
    self.assertEqual((result["meta"]["processes"], result["meta"]["devices"]), (2, 2))
    rows = {r["path"]: r for r in result["results"]}
    self.assertEqual(set(rows), {"engine:xla", "native:layer(cf=1.25)"})
    for name, row in rows.items():
      self.assertNotIn("failed", row, name)
      self.assertLessEqual(row["max_rel_err"], 1e-2, name)
    self.assertIn("engine:xla", outs[0][1])     # process 0 prints the table
    self.assertNotIn("engine:xla", outs[1][1])  # the others do not


if __name__ == "__main__":
  absltest.main()
