"""The MX weight formats (``pallas_kernels.mx_formats``) against an independent float64 restatement of the OCP
MX rules: E8M0 scales, E2M1 nibble order, E4M3 elements, and errors that name the tensor."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mx_formats as mx


def _e2m1_by_bits(code: int) -> float:
    """E2M1 from its bits (sign, 2 exponent bits with bias 1, 1 mantissa bit; exponent 0 is subnormal)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def test_e2m1_table_follows_the_bits():
    assert [_e2m1_by_bits(c) for c in range(16)] == list(mx.E2M1_VALUES)


def test_e8m0_decodes_every_code():
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(mx.decode_e8m0(codes), np.float64)
    want = np.array([2.0 ** (int(v) - 127) for v in range(255)])
    np.testing.assert_array_equal(got[:255], want)
    assert np.isnan(got[255])


def test_fp4_nibble_order():
    # byte 0x21: element 0 is code 1 (0.5, low nibble), element 1 is code 2 (1.0, high nibble)
    got = np.asarray(mx.unpack_fp4(np.array([[0x21, 0xF9]], np.uint8)))
    np.testing.assert_array_equal(got, [[0.5, 1.0, -0.5, -6.0]])


@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_dequantize_matches_a_float64_restatement(fmt):
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((3, 5, 64)) * np.exp2(rng.integers(-8, 8, (3, 5, 1)))
    w, s = mx.quantize_reference(fmt, dense)
    got = np.asarray(mx.dequantize(fmt, w, s))
    if fmt == "mxfp4":
        codes = np.stack([w & 0xF, w >> 4], -1).reshape(3, 5, 64)
        elems = np.vectorize(_e2m1_by_bits)(codes)
    else:
        elems = w.astype(np.float64)
    want = elems * np.repeat(2.0 ** (s.astype(np.float64) - 127), 32, axis=-1)
    np.testing.assert_array_equal(got, want)
    # quantization error bounded by half a step of the coarsest element spacing in each block
    step = {"mxfp4": 2.0, "mxfp8": 32.0}[fmt]  # the largest gap between representable magnitudes
    bound = np.repeat(2.0 ** (s.astype(np.float64) - 127), 32, axis=-1) * step / 2
    assert np.all(np.abs(got - dense) <= bound + 1e-12)


def test_dequantize_in_bf16_rounds_once():
    w, s = mx.quantize_reference("mxfp8", np.linspace(-3, 3, 64).reshape(1, 64))
    np.testing.assert_array_equal(np.asarray(mx.dequantize("mxfp8", w, s, dtype=jnp.bfloat16)),
                                  np.asarray(mx.dequantize("mxfp8", w, s)).astype(jnp.bfloat16))


@pytest.mark.parametrize("case, match", [
    (dict(fmt="mxfp6"), "unknown MX format"),
    (dict(weight_shape=(4, 16)), "columns"),
    (dict(weight_dtype=np.int8), "must be uint8"),
    (dict(scale_shape=(4, 1)), r"expected \(4, 2\)"),
    (dict(scale_dtype=np.float32), "scales must be uint8"),
    (dict(in_features=48, weight_shape=(4, 24), scale_shape=(4, 1)), "multiple of 32"),
])
def test_shape_errors_name_the_tensor(case, match):
    args = dict(fmt="mxfp4", weight_shape=(4, 32), weight_dtype=np.uint8, scale_shape=(4, 2), scale_dtype=np.uint8,
                in_features=64) | case
    fmt = args.pop("fmt")
    with pytest.raises(ValueError, match=match) as e:
        mx.check_mx_shapes(fmt, **args, name="layers.3.experts.w1")
    assert "layers.3.experts.w1" in str(e.value)


def test_valid_shapes_pass():
    mx.check_mx_shapes("mxfp4", (8, 4, 32), np.uint8, (8, 4, 2), np.uint8, in_features=64)
    mx.check_mx_shapes("mxfp8", (4, 64), jnp.float8_e4m3fn, (4, 2), np.uint8, in_features=64)
