"""bench/timing.py: time_calls' order of calls (the back-to-back burst at the point of a run where
the peers are timed), alternate()'s rounds (bench/run.py --rounds), and sustained(), the
steady-state timing behind bench/run.py --sustain and bench/gemm1_profile.py --sustain, on a host
call of known duration."""
import os
import sys
import time
from unittest import mock

from absl.testing import absltest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import tables, timing  # noqa: E402


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


class AlternateTest(absltest.TestCase):

  def test_order_reversed_every_other_round_after_rests(self):
    """Each measurement after a rest; ours first in even rounds and last in odd ones, so neither
    side always runs right after the other; each round's ms under its own name."""
    events, ms = [], {"ours": iter([1.0, 2.0, 3.0]), "peer": iter([10.0, 20.0, 30.0])}

    def timer(name):
      def measure():
        events.append(name)
        return next(ms[name])
      return measure

    with mock.patch.object(timing.time, "sleep", lambda s: events.append(f"rest {s}")):
      rounds = timing.alternate({"ours": timer("ours"), "peer": timer("peer")}, 3, 0.5)
    self.assertEqual(events, ["rest 0.5", "ours", "rest 0.5", "peer", "rest 0.5", "peer",
                              "rest 0.5", "ours", "rest 0.5", "ours", "rest 0.5", "peer"])
    self.assertEqual(rounds, [{"ours": 1.0, "peer": 10.0}, {"ours": 2.0, "peer": 20.0},
                              {"ours": 3.0, "peer": 30.0}])

  def test_no_rest_on_cpu(self):
    with mock.patch.object(timing.time, "sleep", lambda s: self.fail("rested")):
      self.assertEqual(timing.alternate({"a": lambda: 1, "b": lambda: 2}, 2, 0.0),
                       [{"a": 1.0, "b": 2.0}] * 2)


class RoundsTableTest(absltest.TestCase):

  def test_median_spread_and_each_round(self):
    rounds = [{"ours": 2.0, "torch-bf16": 2.2}, {"ours": 2.5, "torch-bf16": 2.0},
              {"ours": 2.0, "torch-bf16": 2.1}]
    ratios = [m["torch-bf16"] / m["ours"] for m in rounds]
    row = {"shape": "dsv3", "rows_total": 32768, "experts": 128, "gemm1_rounds": {
        "torch-bf16": {"rounds": rounds, "ratios": ratios, "median_ratio": 1.05,
                       "min_ratio": 0.8, "max_ratio": 1.1},
        "torch-fp8": {"failed": "OutOfMemoryError: no room"}}}
    lines = tables.format_rounds_table([row]).splitlines()
    bf16 = next(line for line in lines if "torch-bf16" in line).split()
    self.assertEqual(bf16[:5], ["dsv3", "torch-bf16", "32768", "256", "3"])
    self.assertEqual(bf16[5:10], ["2.000", "2.100", "1.05x", "0.80x", "1.10x"])
    self.assertEqual(bf16[10:], ["1.100", "0.800", "1.050"])
    self.assertIn("OutOfMemoryError: no room", next(line for line in lines if "torch-fp8" in line))
    row["gemm1_rounds"] = {"torch-bf16": {"skipped": "--skip-peers"}}
    self.assertEqual(tables.format_rounds_table([row]), "", "nothing measured: no table")


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
