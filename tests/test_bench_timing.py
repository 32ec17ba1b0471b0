"""bench/timing.py's sustained(): the steady-state timing behind bench/run.py --sustain and
bench/gemm1_profile.py --sustain, on a host call of known duration."""
import os
import sys
import time

from absl.testing import absltest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import timing  # noqa: E402


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
