"""The README's "Use" programs run as written on 8 CPU devices (a newcomer's first run; then the
layer inside a (dp, ep) mesh)."""
import os
import re
import subprocess
import sys
import tempfile

from absl.testing import absltest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


class ReadmeTest(absltest.TestCase):

  def _programs(self) -> list:
    """The complete programs of the "Use" section, in order."""
    text = open(README).read()
    start = text.index("\n## Use")
    section = text[start:text.index("\n## ", start + 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)

  def _run(self, program: str) -> str:
    """Runs `program` on 8 CPU devices, away from the source tree (the installed package); its
    stdout."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    with tempfile.TemporaryDirectory() as cwd:
      proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                            timeout=300, env=env, cwd=cwd)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    self.assertNotIn("Traceback", proc.stderr)
    return proc.stdout

  def test_use_program_runs_verbatim(self):
    self.assertIn("rows landed per rank: [", self._run(self._programs()[0]))

  def test_dp_ep_program_runs_verbatim(self):
    # the second program: the layer inside a (dp, ep) mesh, whichever engine it gets
    self.assertIn("dp x ep = 2 x 4, engine ", self._run(self._programs()[1]))


if __name__ == "__main__":
  absltest.main()
