"""bench/timing.py: time_calls' order of calls (the back-to-back burst at the point of a run where
the peers are timed) and sustained(), the steady-state timing behind bench/run.py --sustain and
bench/gemm1_profile.py --sustain, on a host call of known duration."""
import os
import sys
import time
from unittest import mock

from absl.testing import absltest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import timing  # noqa: E402


class TimeCallsTest(absltest.TestCase):

  def test_burst_right_after_the_warmup(self):
    """gemm_peers.cuda_ms times a peer's calls right after its warm-up; ours must be timed at the
    same point (after 10 calls that each wait, a GPU runs at a lower clock: ours was 2-15% slower
    there in one device call), the waited calls too (after a rest and another warm-up)."""
    events = []

    def fn(x):
      events.append("call")
      return x

    def wait(out):
      events.append("wait")
      return out

    with mock.patch.object(timing.jax, "block_until_ready", wait), \
         mock.patch.object(timing.time, "sleep", lambda s: events.append(f"rest {s}")):
      r = timing.time_calls(fn, (1,), iters=3, warmup=2, rest_s=timing.REST_S)
    warmup = ["call", "wait"] * 2
    self.assertEqual(events, warmup + ["call"] * 3 + ["wait"] + [f"rest {timing.REST_S}"] +
                     warmup + ["call", "wait"] * 3)
    self.assertGreaterEqual(r["pipelined_ms"], 0.0)
    self.assertLessEqual(r["min_ms"], r["median_ms"])


class SustainedTest(absltest.TestCase):

  def _sustained(self, call_s, seconds):
    calls = []

    def call():
      calls.append(None)
      time.sleep(call_s)
      return len(calls)

    synced = []
    r = timing.sustained(call, synced.append, seconds)
    self.assertEqual(r["calls"], len(calls))
    self.assertEqual(synced, list(range(8, len(calls) + 1, 8)), "a sync every 8 calls")
    return r

  def test_period_of_many_calls(self):
    r = self._sustained(0.002, 0.2)
    self.assertGreaterEqual(r["seconds"], 0.2)
    self.assertGreater(r["ms"], 2.0 * 0.9)
    self.assertLess(r["ms"], 2.0 * 3)

  def test_calls_slower_than_the_period(self):
    """8 calls outlast `seconds`: still a rate, over the last 8 of 16 calls (it divided by zero)."""
    r = self._sustained(0.01, 0.001)
    self.assertEqual(r["calls"], 16)
    self.assertGreater(r["ms"], 10.0 * 0.9)
    self.assertLess(r["ms"], 10.0 * 3)


if __name__ == "__main__":
  absltest.main()
