"""examples/moe_block.py (a model block around jsm.moe) runs and passes its dense check on 8 CPU
devices."""
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "moe_block.py")


class ExamplesTest(absltest.TestCase):

  def test_moe_block(self):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    with tempfile.TemporaryDirectory() as cwd:  # away from the source tree: the installed package
      proc = subprocess.run([sys.executable, EXAMPLE, "--tokens", "16"], capture_output=True,
                            text=True, timeout=300, env=env, cwd=cwd)
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
    self.assertIn("8 x cpu, engine cpu: routing == dense", proc.stdout)
    self.assertIn("PASS", proc.stdout)


if __name__ == "__main__":
  absltest.main()
