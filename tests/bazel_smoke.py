"""Smoke test of the Bazel build (BUILD.bazel's bazel_smoke_test, run by `bazel test //...`): the
package's sources and the Bazel-built extension, both from Bazel's runfiles (asserted: not an
installed jax_sdma_moe), and two custom calls against the jnp reference on fresh random inputs:
quantize byte for byte, and stage1 (engine cpu) on 8 virtual CPU devices, its landing layout exact
and h within DESIGN.md §3's tolerance. Not collected by pytest (no test_ prefix)."""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_sdma_moe as jsm  # noqa: E402
from jax_sdma_moe import primitives  # noqa: E402

R = 8


def check_bazel_built(with_cuda):
  ext = primitives.extension()
  runfiles = os.path.abspath(os.environ.get("TEST_SRCDIR") or os.environ["RUNFILES_DIR"])
  for f in (jsm.__file__, ext.__file__):
    assert os.path.abspath(f).startswith(runfiles + os.sep), f"{f}: not from runfiles {runfiles}"
  assert os.path.basename(ext.__file__) == "_jsm_ffi.so", ext.__file__
  real = os.path.realpath(ext.__file__)
  assert f"{os.sep}bazel-out{os.sep}" in real, f"{real}: not a Bazel output"
  assert ext.has_cuda() == with_cuda, f"has_cuda() = {ext.has_cuda()}, built with_cuda={with_cuda}"
  print(f"_jsm_ffi: {ext.__file__} -> {real} (CUDA handlers: {ext.has_cuda()})")


def check_quantize(rng):
  # magnitudes from 1e-13 to 1e13 across the 32-element blocks, one NaN and one Inf block
  scale = np.exp(rng.uniform(-30, 30, (64, 8, 1))).repeat(32, -1).reshape(64, 256)
  x = rng.standard_normal((64, 256)) * scale
  x[3, 5], x[7, 40] = np.nan, np.inf
  for dtype in (jnp.bfloat16, jnp.float32):
    xa = jnp.asarray(x, dtype)
    got, ref = jsm.quantize(xa, impl="ffi"), jsm.quantize(xa, impl="reference")
    np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8),
                                  np.asarray(ref.values).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(ref.scales))
  print("quantize: FFI == reference, byte for byte (bf16, f32)")


def check_stage1(rng):
  s = jsm.SHAPES["small"]
  T, H, I, E, K = 16, s.hidden, s.intermediate, s.num_experts, s.topk
  mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
  x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
  ids = np.stack([rng.permutation(E)[:K] for _ in range(R * T)])
  ids[rng.random(ids.shape) < 0.2] = -1
  ids = jnp.asarray(ids, jnp.int32)
  weights = jnp.asarray(rng.random((R * T, K)), jnp.float32)
  w1q = jsm.quantize_w1(jnp.asarray(rng.standard_normal((E, 2 * I, H)) / np.sqrt(H), jnp.bfloat16))
  cfg = jsm.Stage1Config(engine="cpu", row_align=16, timeout_s=60.0)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
  with jsm.Runtime(mesh, "ep", cfg) as rt:
    f = jax.jit(jax.shard_map(
        lambda x, i, w, wq: jax.tree.map(lambda a: a[None], jsm.stage1(x, (i, w), wq, runtime=rt)),
        mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    out = jax.block_until_ready(f(put(x), put(ids), put(weights), rt.shard_w1(w1q)))
  cap = jsm.layout.m_cap(R, T, K, E // R, cfg.row_align)
  ref, h32 = jsm.reference.stage1(x.reshape(R, T, H), ids.reshape(R, T, K),
                                  weights.reshape(R, T, K), w1q, row_align=cfg.row_align, cap=cap,
                                  return_f32=True)
  for name in ("expert_offsets", "expert_counts", "src_rank", "src_token", "topk_slot",
               "topk_weight", "num_rows", "num_invalid", "overflow"):
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)),
                                  err_msg=name)
  h, h32 = np.asarray(out.h, np.float32), np.asarray(h32)
  rel = np.linalg.norm(h - h32) / np.linalg.norm(h32)
  assert rel <= 4e-3, f"stage1 h: ||h - ref|| / ||ref|| = {rel:.2e} > 4e-3"
  rows = int(np.asarray(out.num_rows).sum())
  assert rows == int((np.asarray(ids) >= 0).sum()), "a row was dropped"
  print(f"stage1 (engine cpu, {R} CPU devices): layout == reference, {rows} rows, "
        f"||h-ref||/||ref|| = {rel:.2e}")


def main():
  with_cuda = "--with-cuda" in sys.argv[1:]
  seed = int(os.environ.get("JSM_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
  print(f"[seed {seed}] jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].platform}")
  rng = np.random.default_rng(seed)
  check_bazel_built(with_cuda)
  check_quantize(rng)
  check_stage1(rng)
  print("OK")


if __name__ == "__main__":
  main()
