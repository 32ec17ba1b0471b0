"""examples/moe_block.py (a model block around jsm.moe) and examples/flax_decoder_block.py (a Flax
NNX decoder block on a (dp, ep) mesh; skipped without flax) run and pass their dense checks on 8 CPU
devices."""
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


class ExamplesTest(absltest.TestCase):

  def _run(self, example, *flags):
    """examples/<example> with `flags` on 8 CPU devices: its stdout (it must exit 0)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    with tempfile.TemporaryDirectory() as cwd:  # away from the source tree: the installed package
      proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, example), *flags],
                            capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
    self.assertIn("PASS", proc.stdout)
    return proc.stdout

  def test_moe_block(self):
    self.assertIn("8 x cpu, engine cpu: routing == dense", self._run("moe_block.py", "--tokens",
                                                                     "16"))

  def test_flax_decoder_block(self):
    try:
      import flax.nnx  # noqa: F401
    except ImportError as e:
      self.skipTest(f'flax is not importable ({e}): pip install ".[flax]"')
    # whichever engine the (dp, ep) mesh gets
    self.assertRegex(self._run("flax_decoder_block.py", "--platform", "cpu"),
                     r"dp x ep = 2 x 4 cpu, engine \w+: routing == dense")


if __name__ == "__main__":
  absltest.main()
