"""The benchmark's command line (bench/run.py and the bench/ modules it runs) at a tiny size:
multi-process, 2 processes started with --coordinator, --num-processes, --process-id (the mode
`mpirun -n 2` runs, without Open MPI) and, where Open MPI's mpirun is on PATH, under mpirun; one
CPU rank each; --merge, which makes one report of runs cut short by a time limit; --help."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import _util

from absl.testing import absltest, parameterized

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BenchMultiProcessTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("host_devices", (), "cpu-mp2"),
      # the --gpu mode (device-made inputs, sampled checks on every rank), here on CPU devices
      ("gpu_mode_on_cpu", ("--gpu", "--platform", "cpu", "--shapes", "small"), "gpu-cpu-x2-mp"))
  def test_two_processes(self, flags, stem):
    n = 2
    with tempfile.TemporaryDirectory() as out:
      try:
        outs = _util.run_bench_processes(
            n, ["--tokens", "16", "--iters", "2", "--warmup", "1", "--out", out, *flags], 180)
      except subprocess.TimeoutExpired:
        self.fail("multi-process bench timed out")
      for i, (rc, stdout, stderr) in enumerate(outs):
        self.assertEqual(rc, 0, f"process {i} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
      outs = [o[1:] for o in outs]
      self.assertIn("engine:xla", outs[0][0])        # process 0 prints the table
      self.assertNotIn("engine:xla", outs[1][0])     # the others do not
      with open(os.path.join(out, f"{stem}.json")) as f:
        result = json.load(f)
      self.assertEqual((result["meta"]["launch"], result["meta"]["processes"]), ("explicit", n))
      self.assertEqual(result["meta"]["devices"], n)
      paths = {r["path"] for r in result["results"] if "failed" not in r}
      self.assertIn("engine:xla", paths)
      self.assertIn("native:a2a+einsum(cf=1.25)", paths)


  @absltest.skipUnless(shutil.which("mpirun"), "needs Open MPI's mpirun")
  def test_mpirun(self):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    with tempfile.TemporaryDirectory() as out:
      p = subprocess.run(
          ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable,
           os.path.join(ROOT, "bench", "run.py"), "--tokens", "16", "--iters", "2", "--warmup",
           "1", "--out", out], cwd=ROOT, env=env, stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, text=True, timeout=300)
      self.assertEqual(p.returncode, 0, f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
      self.assertEqual(p.stdout.count("engine:xla  "), 1)  # process 0's table only
      with open(os.path.join(out, "cpu-mpi2.json")) as f:
        result = json.load(f)
      self.assertEqual((result["meta"]["launch"], result["meta"]["processes"]), ("mpirun", 2))


class BenchCommandLineTest(absltest.TestCase):

  def test_help_prints_each_default_once(self):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run.py"), "--help"],
                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=60)
    self.assertEqual(p.returncode, 0, p.stderr)
    text = " ".join(p.stdout.split())  # argparse wraps lines
    self.assertNotIn("(default: None)", text)
    self.assertEqual(text.count("(default: 20)"), 1)  # --iters
    self.assertIn("--coordinator", text)


class BenchMergeTest(absltest.TestCase):

  def run_bench(self, *flags):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run.py"), *flags], cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr

  def test_merge_keeps_every_row_later_file_wins(self):
    with tempfile.TemporaryDirectory() as out:
      rc, log = self.run_bench("--gpu", "--platform", "cpu", "--shapes", "small", "--tokens",
                               "16,32", "--iters", "2", "--warmup", "1", "--out", out)
      self.assertEqual(rc, 0, log[-3000:])
      with open(os.path.join(out, "gpu-cpu.json")) as f:
        run = json.load(f)
      # the first run stopped after T = 16; a second run measured T = 32 (its marker time)
      cut = {**run, "results": [r for r in run["results"] if r["tokens"] == 16]}
      rest = {**run, "results": [r for r in run["results"] if r["tokens"] == 32]}
      self.assertTrue(cut["results"] and rest["results"])
      rest["results"][0]["stage1"]["median_ms"] = 123.456
      files = [os.path.join(out, n) for n in ("cut.json", "rest.json")]
      for name, d in zip(files, (cut, rest)):
        with open(name, "w") as f:
          json.dump(d, f)
      rc, log = self.run_bench("--merge", *files, "--out", out, "--tag", "merged")
      self.assertEqual(rc, 0, log[-3000:])
      with open(os.path.join(out, "merged.json")) as f:
        merged = json.load(f)
      self.assertEqual(len(merged["results"]), len(run["results"]))
      self.assertEqual({r["tokens"] for r in merged["results"]}, {16, 32})
      self.assertEqual({(r["tokens"], r["source"]) for r in merged["results"]},
                       {(16, "cut.json"), (32, "rest.json")})
      self.assertIn("123.456", log)
      self.assertIn("merged from cut.json", open(os.path.join(out, "merged.txt")).read())
      # files of different modes are refused
      rest["meta"]["devices"] = 2
      with open(files[1], "w") as f:
        json.dump(rest, f)
      rc, log = self.run_bench("--merge", *files, "--out", out)
      self.assertNotEqual(rc, 0)
      self.assertIn("different modes", log)


if __name__ == "__main__":
  absltest.main()
