"""MX-fp8 quantisation (DESIGN.md §3): the FFI kernel is byte-identical to the jnp reference, and
the reference matches an independent NumPy/ml_dtypes transcription of the rules."""
import _util  # noqa: F401  (sets up the devices before jax starts)

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

import jax_sdma_moe as jsm


def numpy_quantize(x):
  """§3 written out in NumPy with ml_dtypes' float8 rounding, block by block."""
  xf = np.asarray(x, np.float32).reshape(-1, 32)
  values = np.zeros(xf.shape, np.uint8)
  scales = np.zeros(xf.shape[0], np.uint8)
  inv448 = np.uint32(0x3B124925).view(np.float32)
  for b, blk in enumerate(xf):
    if not np.isfinite(blk).all():
      values[b], scales[b] = 0x7F, 0xFF
      continue
    amax = np.float32(max(np.float32(1e-10), np.abs(blk).max()))
    w = int(np.float32(amax * inv448).view(np.uint32))
    e = ((w >> 23) & 0xFF) + int((w & 0x7FFFFF) != 0)
    mul = np.uint32((254 - e) << 23).view(np.float32)
    values[b] = (blk * mul).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    scales[b] = e
  shape = np.shape(x)
  return values.reshape(shape), scales.reshape(*shape[:-1], shape[-1] // 32)


def special_blocks(r):
  """Rows of 32 elements: tiny (subnormal results), huge, zero, -0.0, NaN, +-Inf, one outlier,
  values on rounding ties, bf16 extremes."""
  rows = [
      np.zeros(32), -np.zeros(32), np.full(32, 1e-38), r.standard_normal(32) * 1e-30,
      r.standard_normal(32) * 1e30, r.uniform(-1, 1, 32) * 3e38,
      np.concatenate([[1e4], r.standard_normal(31) * 1e-3]),       # values under e4m3 subnormals
      np.concatenate([[np.nan], r.standard_normal(31)]),
      np.concatenate([r.standard_normal(31), [np.inf]]),
      np.concatenate([[-np.inf], np.zeros(31)]),
      np.concatenate([[448.0], np.arange(31) * 14.5]),              # exact ties of e4m3
      np.concatenate([[-448.0 * 2**-20], -np.zeros(31)]),
      np.full(32, 3.3895313892515355e38), np.full(32, -1.1754944e-38),
  ]
  return np.stack(rows)


class QuantizeTest(parameterized.TestCase):

  def check_same(self, x):
    ref = jsm.quantize(x, impl="reference")
    ffi = jsm.quantize(x, impl="ffi")
    np.testing.assert_array_equal(_util.as_bytes(ffi.values), _util.as_bytes(ref.values))
    np.testing.assert_array_equal(np.asarray(ffi.scales), np.asarray(ref.scales))
    nv, ns = numpy_quantize(np.asarray(x, np.float32))
    np.testing.assert_array_equal(_util.as_bytes(ref.values), nv)
    np.testing.assert_array_equal(np.asarray(ref.scales), ns)
    return ref

  @parameterized.parameters(jnp.bfloat16, jnp.float32)
  def test_random_magnitudes(self, dtype):
    r = _util.rng()
    x = r.standard_normal((96, 256)) * np.exp(r.uniform(-40, 40, (96, 8, 1))).repeat(32, -1).reshape(96, 256)
    self.check_same(jnp.asarray(x, dtype))

  @parameterized.parameters(jnp.bfloat16, jnp.float32)
  def test_special_blocks(self, dtype):
    x = jnp.asarray(special_blocks(_util.rng()), dtype)
    q = self.check_same(x)
    v, s = _util.as_bytes(q.values), np.asarray(q.scales)[:, 0]
    self.assertTrue((v[0] == 0).all() and s[0] == 85, "all-zero block: e = 85, zero values")
    self.assertTrue((v[1] == 0x80).all() and s[1] == 85, "-0.0 -> 0x80")
    for row in (7, 8, 9):
      self.assertEqual(s[row], 0xFF)
      self.assertTrue((v[row] == 0x7F).all(), "non-finite block: all values 0x7F")
    finite = s != 0xFF
    self.assertTrue((np.abs(np.asarray(q.values, np.float32)[finite]) <= 448).all())
    self.assertTrue(np.isnan(np.asarray(q.values, np.float32)[~finite]).all())

  def test_all_bf16_bit_patterns(self):
    # every finite bf16 value with each exponent as the block maximum
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    x = bits.view(jnp.bfloat16).reshape(-1, 32)
    self.check_same(jnp.asarray(x))

  def test_dequantize_is_exact_and_close(self):
    r = _util.rng()
    x = jnp.asarray(r.standard_normal((64, 128)), jnp.float32)
    q = jsm.quantize(x)
    y = np.asarray(jsm.reference.dequantize(*q))
    manual = np.asarray(q.values, np.float32) * np.exp2(np.asarray(q.scales, np.float32).repeat(32, -1) - 127)
    np.testing.assert_array_equal(y, manual)
    self.assertLess(np.linalg.norm(y - np.asarray(x)) / np.linalg.norm(np.asarray(x)), 0.05)

  def test_quantize_w1(self):
    r = _util.rng()
    w1 = jnp.asarray(r.standard_normal((4, 64, 96)), jnp.bfloat16)
    a, b = jsm.quantize_w1(w1), jsm.quantize_w1(w1, impl="reference")
    self.assertIsInstance(a, jsm.QuantizedW1)
    self.assertEqual(a.values.shape, (4, 64, 96))
    self.assertEqual(a.scales.shape, (4, 64, 3))
    np.testing.assert_array_equal(_util.as_bytes(a.values), _util.as_bytes(b.values))
    np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, "multiple of 32"):
      jsm.quantize(jnp.zeros((4, 48), jnp.bfloat16))
    with self.assertRaisesRegex(TypeError, "bfloat16 or float32"):
      jsm.quantize(jnp.zeros((4, 64), jnp.int32))
    with self.assertRaisesRegex(ValueError, "impl"):
      jsm.quantize(jnp.ones((4, 64), jnp.bfloat16), impl="fast")
    with self.assertRaisesRegex(ValueError, r"\[E, 2I, H\]"):
      jsm.quantize_w1(jnp.ones((3, 64), jnp.bfloat16))


if __name__ == "__main__":
  absltest.main()
