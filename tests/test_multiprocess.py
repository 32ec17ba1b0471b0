"""Multi-process Stage1 on CPU: 2 processes with jax.distributed (gloo), one rank each, engine xla
(the launch mode `mpirun -n R` uses, without needing MPI here); and a (dp, ep) mesh whose EP
groups each lie in one process (engine cpu)."""
import os

import _util

import numpy as np
from absl.testing import absltest

HERE = os.path.dirname(os.path.abspath(__file__))


class MultiProcessTest(absltest.TestCase):

  def test_two_processes_engine_xla(self):
    _util.run_processes(self, os.path.join(HERE, "mp_worker.py"), 2,
                        int(np.random.SeedSequence().entropy % (2**31)), timeout=180)

  def test_two_processes_dp_ep_mesh_default_engine(self):
    """A (dp 2, ep 4) mesh, dp across 2 processes of 4 CPU devices: each EP group within one
    process, so the default engine is cpu; stage1 and moe of each group against the references
    of its tokens (tests/mp_mesh_worker.py)."""
    _util.run_processes(self, os.path.join(HERE, "mp_mesh_worker.py"), 2,
                        int(np.random.SeedSequence().entropy % (2**31)), timeout=180)


if __name__ == "__main__":
  absltest.main()
