"""One gemm1 launch at a benchmark shape (bf16 out), the target of Nsight Compute in
bench/device/profile_gemm1.sh:
  ncu -k regex:gemm1 --launch-count 1 --set full python3 bench/gemm1_profile.py dsv3 4096
  ncu ... python3 bench/gemm1_profile.py dsv3 --rows 32768 --experts 128   # the GEMM1 study's rows

With TOKENS: R = 1, the rows landed by reference.dispatch (no dispatch kernel runs), so the only
CUDA kernels launched are the quantisation's and this gemm1. With --rows: the rows of
bench/run.py --gemm1-rows (bench/inputs.gemm1_inputs: spread evenly over --experts local experts,
T x R entries as there).

With --peer NAME (torch-bf16, torch-fp8; with --rows): that peer of bench/gemm_peers.py on the
same rows per expert instead of ours (checked, then one timed call): the target of
profile_gemm1.sh --peer, to set ours against it in cycles, the clock aside.

With --time N: bench/timing.time_calls over N calls (after 2 warm-ups), its pipelined ms per call
printed (`TIMING ...`): the timing of whatever kernel the build holds, its output NOT checked. It
times diagnostic variants that compute wrong results on purpose (bench/device/ab_gemm1.sh
--unchecked); bench/run.py is the benchmark, which checks every result before it times it. With
--sustain S as well: S seconds of calls back to back after them (bench/timing.sustained: the
steady state at the board's power cap, where a call's time is its energy over the cap), printed as
`SUSTAINED ...` with the SM clock and board power."""
import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdma_moe as jsm
from jax_sdma_moe import layout, primitives, reference

sys.path.append(str(Path(__file__).resolve().parent.parent))  # bench/ as a package, after jsm
from bench import gemm_peers, inputs, timing  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("shape", nargs="?", default="dsv3", help="a jax_sdma_moe.SHAPES name")
p.add_argument("tokens", nargs="?", type=int, default=4096)
p.add_argument("--row-align", type=int, default=128)
p.add_argument("--rows", help="rows (or TxR) as bench/run.py --gemm1-rows, instead of TOKENS")
p.add_argument("--experts", type=int, help="with --rows: local experts (default E/2)")
p.add_argument("--tile-tokens", type=int, choices=layout.GEMM_TILE_TOKENS,
               help="the bf16 kernel's tile (default: the library's choice by rows per expert)")
p.add_argument("--peer", choices=gemm_peers.GROUPED,
               help="with --rows: run this peer of bench/gemm_peers.py instead of ours")
p.add_argument("--time", type=int, metavar="N",
               help="time N back-to-back calls (unchecked output) instead of one launch")
p.add_argument("--sustain", type=float, default=0.0, metavar="S",
               help="with --time: also S seconds of calls back to back (the steady state)")
a = p.parse_args()

s = jsm.SHAPES[a.shape]


def study_counts():
  """Rows per expert of bench/run.py --gemm1-rows."""
  return inputs.balanced_counts(inputs.study_rows(a.rows, s),
                                a.experts or s.num_experts // inputs.STUDY_RANKS)


def study_rows():
  """The landed rows and w1q of bench/run.py --gemm1-rows."""
  counts = study_counts()
  landed, w1q = inputs.gemm1_inputs(s, counts, a.row_align, jax.random.key(0))
  return landed, w1q, f"{int(counts.sum())} rows over {len(counts)} experts"


def dispatched_rows():
  """TOKENS tokens of R = 1 routed over all E experts, landed by reference.dispatch, and w1q."""
  E, K, H, I, T = s.num_experts, s.topk, s.hidden, s.intermediate, a.tokens
  rng = np.random.default_rng(0)
  w1q = jax.jit(jsm.quantize_w1)(
      jax.random.normal(jax.random.key(0), (E, 2 * I, H), jnp.bfloat16) * 0.02)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
  ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(T)]), jnp.int32)
  cap = layout.m_cap(1, T, K, E, a.row_align)
  landed = jax.jit(reference.dispatch, static_argnums=(3, 4, 5))(
      jax.tree.map(lambda t: t[None], jsm.quantize(x)), ids[None], jnp.ones((1, T, K)), E,
      a.row_align, cap)
  rows = (landed.values[0], landed.scales[0], landed.expert_offsets[0], landed.expert_counts[0])
  return rows, w1q, f"T={T}"


if a.peer:
  if not a.rows:
    p.error("--peer needs --rows")
  counts = study_counts()
  problem = gemm_peers.Problem(s.hidden, 2 * s.intermediate, tuple(int(c) for c in counts))
  skip = [n for n in gemm_peers.PEERS if n != a.peer]
  # copy_gbps only sizes the floor, which is not printed here
  r = gemm_peers.measure(problem, jax.devices()[0], 1.0, gemm_peers.Timing(1, 0), skip)
  print(f"peer {a.peer}: {a.shape} {problem.rows} rows over {len(counts)} experts:",
        r["results"][a.peer])
  sys.exit(0)

landed, w1q, what = study_rows() if a.rows else dispatched_rows()
rows_per_expert = float(np.asarray(landed[3]).sum()) / landed[3].shape[0]
options = primitives.Gemm1Options(
    swiglu_limit=s.swiglu_limit, out_dtype="bf16",
    tile_tokens=layout.gemm_tile_tokens(rows_per_expert, a.tile_tokens))
gemm1 = jax.jit(lambda v, sc, o, c, w: primitives.gemm1(v, sc, o, c, w, options=options))
what += f", tile {options.tile_tokens}"
h = jax.block_until_ready(gemm1(*landed, w1q))
print(f"gemm1 done: {a.shape} {what}, h {h.shape} {h.dtype}")
if a.time:
  ms = timing.time_calls(gemm1, (*landed, w1q), a.time, warmup=2)["pipelined_ms"]
  print(f"TIMING {a.shape} {what}: {ms:.3f} ms per call, pipelined (unchecked)")
  if a.sustain > 0:
    r = timing.sustained(lambda: gemm1(*landed, w1q), jax.block_until_ready, a.sustain,
                         jax.devices()[0].local_hardware_id or 0)
    print(f"SUSTAINED {a.shape} {what}: {r['ms']:.3f} ms per call over {r['seconds']:.1f} s, "
          f"{r.get('sm_mhz', float('nan')):.0f} MHz, {r.get('power_w', float('nan')):.0f} W "
          "(unchecked)")
