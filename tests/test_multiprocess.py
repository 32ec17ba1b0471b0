"""Multi-process Stage1 on CPU: 2 processes with jax.distributed (gloo), one rank each, engine xla
(the launch mode `mpirun -n R` uses, without needing MPI here)."""
import os
import socket
import subprocess
import sys

import _util  # noqa: F401

import numpy as np
from absl.testing import absltest

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


class MultiProcessTest(absltest.TestCase):

  def test_two_processes_engine_xla(self):
    n, port, seed = 2, free_port(), int(np.random.SeedSequence().entropy % (2**31))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "mp_worker.py"), str(i), str(n),
                               str(port), str(seed)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(n)]
    outs = []
    for p in procs:
      try:
        outs.append(p.communicate(timeout=180)[0])
      except subprocess.TimeoutExpired:
        for q in procs:
          q.kill()
        self.fail(f"multi-process run timed out (seed {seed})")
    for i, (p, out) in enumerate(zip(procs, outs)):
      self.assertEqual(p.returncode, 0, f"process {i} failed (seed {seed}):\n{out[-3000:]}")
      self.assertIn(f"OK rank {i}", out)


if __name__ == "__main__":
  absltest.main()
