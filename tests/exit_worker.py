"""Run by test_stage1.test_overflow_everywhere_and_clean_exit in a child process (so a hang or an
abort fails that test instead of the test run): stage1(check=True) with rows beyond M_cap on
every rank, for the engines given, then exit with Runtimes left open."""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402

R, T, H, I, E, K = 8, 16, 64, 32, 16, 4
r = np.random.default_rng(int(sys.argv[1]))
m = _util.mesh(R)
x, ids, w, w1q = _util.make_problem(r, R, T, H, I, E, K, "uniform")
runtimes = []
for engine in sys.argv[2:]:
  # uniform routing sends ~T*K = 64 rows to every rank: 16 fit
  rt = jsm.Runtime(m, "ep", jsm.Stage1Config(engine=engine, row_align=8, max_recv_rows=16))
  runtimes.append(rt)  # left open on purpose: the interpreter's exit must free them quietly
  try:
    jax.block_until_ready(_util.stage1_fn(m, rt, check=True)(
        *_util.shard(m, (x, ids, w)), _util.shard(m, w1q)))
    print(f"{engine}: no error")
  except Exception as e:  # the project's error, from inside the computation
    print(f"{engine}: raised: {str(e).splitlines()[0][:300]}")
sys.stdout.flush()
