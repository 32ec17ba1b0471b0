"""What every process of a run shares: host copies of (sharded) arrays, values gathered across
processes, one outcome of a block of checks on every process, and progress lines.

Every helper is a no-op or a plain copy in a single-process run. Under jax.distributed every
process runs the same calls in the same order, so the collectives below pair up."""
from __future__ import annotations

import contextlib
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils


class CheckError(AssertionError):
  """A path's output does not match the reference: the run ends."""


class PeerFailure(RuntimeError):
  """Multi-process: another process's path failed at run time."""


# a path that fails at run time (out of memory, ...) is reported as failed and the run goes on (a
# wrong result is a CheckError and ends it)
RUN_FAILURES = (jax.errors.JaxRuntimeError, MemoryError, PeerFailure)
MESSAGE_BYTES = 2000  # of a failing process's error, sent to the others


_STARTED = time.monotonic()


def progress(msg: str) -> None:
  """A progress line on stderr, with the seconds since the run started (a run cut short by a
  time limit shows where its time went)."""
  if jax.process_index() == 0:  # multi-process: process 0 speaks for all
    print(f"[{time.monotonic() - _STARTED:6.1f} s] {msg}", file=sys.stderr, flush=True)


def to_host(tree):
  return jax.tree.map(np.asarray, tree)


def global_to_host(tree):
  """Whole arrays on the host, also when (multi-process) each process holds only its shards."""
  def one(a):
    if not isinstance(a, jax.Array) or a.is_fully_addressable:
      return np.asarray(a)
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))
  return jax.tree.map(one, tree)


def local_ranks(tree) -> tuple:
  """(the ranks this process holds, their host data) of arrays stacked [R, ...] over the ranks:
  one process holds every rank (the data is np.asarray of the whole array); under jax.distributed
  each process holds its own, [len(ranks), ...]."""
  first = jax.tree.leaves(tree)[0]
  if first.is_fully_addressable:
    return list(range(first.shape[0])), to_host(tree)

  def shards(a):
    return sorted(a.addressable_shards, key=lambda s: s.index[0].indices(a.shape[0])[0])

  ranks = [r for s in shards(first) for r in range(*s.index[0].indices(first.shape[0]))]
  return ranks, jax.tree.map(lambda a: np.concatenate([np.asarray(s.data) for s in shards(a)]),
                             tree)


def all_processes(values) -> np.ndarray:
  """A small array (the same shape on every process) from every process, stacked [P, ...]."""
  values = np.atleast_1d(np.asarray(values))
  if jax.process_count() == 1:
    return values[None]
  return np.asarray(multihost_utils.process_allgather(values))


def slowest(seconds: float) -> float:
  """The max over processes of a time each process measured."""
  return float(all_processes(seconds).max())


@contextlib.contextmanager
def same_outcome():
  """Runs a block of checks on every process; if it raises a CheckError or a run failure on any
  process, it raises on every process: its own error, or that of the first process that failed
  (a run failure there as PeerFailure). A single process just raises its error."""
  error = None
  try:
    yield
  except (CheckError, *RUN_FAILURES) as e:
    if jax.process_count() == 1:
      raise
    error = e
  if jax.process_count() == 1:
    return
  code = 0 if error is None else 1 if isinstance(error, CheckError) else 2
  text = str(error or "").encode()[:MESSAGE_BYTES].ljust(MESSAGE_BYTES, b"\0")
  outcomes = all_processes(np.concatenate([[code], np.frombuffer(text, np.uint8)]).astype(np.int32))
  if error is not None:
    raise error
  failed = np.flatnonzero(outcomes[:, 0])
  if len(failed):
    p = int(failed[0])
    message = f"process {p}: " + bytes(outcomes[p, 1:].astype(np.uint8)).rstrip(b"\0").decode(
        errors="replace")
    raise (CheckError if outcomes[p, 0] == 1 else PeerFailure)(message)
