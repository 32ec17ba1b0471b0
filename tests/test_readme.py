"""The README's "Use" program runs as written on 8 CPU devices (a newcomer's first run)."""
import os
import re
import subprocess
import sys
import tempfile

from absl.testing import absltest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


class ReadmeTest(absltest.TestCase):

  def test_use_program_runs_verbatim(self):
    text = open(README).read()
    section = text[text.index("\n## Use"):]
    program = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    with tempfile.TemporaryDirectory() as cwd:  # away from the source tree: the installed package
      proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                            timeout=300, env=env, cwd=cwd)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    self.assertIn("rows landed per rank: [", proc.stdout)
    self.assertNotIn("Traceback", proc.stderr)


if __name__ == "__main__":
  absltest.main()
