"""The dequantizing grouped GEMM (MXFP4 / MXFP8 experts): Pallas kernel (interpret mode) == dequantize +
ragged_dot reference == dequantize + the dropless XLA fallback.

Weights are ``mx_formats.quantize_reference`` of fresh random matrices whose rows span several binades (so the
E8M0 scales differ block to block), in the checkpoint's ``[N, K]`` layout. Every routing trap of
``test_grouped_gemm`` runs on one compiled kernel per format and product (group sizes are data): empty experts,
one expert taking every row, group sizes off the row tile, padding rows past the last group, a single row, all
padding. Outputs are poisoned with NaN before the kernel runs; padding rows must come out as exact zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mx_grouped_gemm as mg
from pallas_kernels import tuning
from pallas_kernels.mx_formats import E2M1_VALUES, decode_e8m0, dequantize, quantize_reference
from pallas_kernels.tuning import GroupedMatmulLaunchConfig, mx_grouped_matmul_launch_config
from tests.test_grouped_gemm import SWIGLU, fresh_seed, routings

FORMATS = ("mxfp4", "mxfp8")


def mx_weights(rng, fmt, shape):
    """``quantize_reference`` of a random ``[..., N, K]`` matrix with rows scaled over 2**-4 .. 2**3."""
    dense = rng.standard_normal(shape) * np.exp2(rng.integers(-4, 4, (*shape[:-1], 1))) / np.sqrt(shape[-1])
    q, s = quantize_reference(fmt, dense)
    return jnp.asarray(q), jnp.asarray(s)


# ------------------------------------------------------------------------------------------------------------
# Decoders in registers == mx_formats (pure jnp, no kernel).
# ------------------------------------------------------------------------------------------------------------


def test_in_register_decoders_match_mx_formats():
    codes = jnp.arange(16, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(mg._e2m1(codes)), E2M1_VALUES)
    assert np.signbit(np.asarray(mg._e2m1(codes))[8])  # code 8 is -0.0
    v = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)
    np.testing.assert_array_equal(np.asarray(mg._e8m0(v)), np.asarray(decode_e8m0(v)))  # NaN at 255 too
    rng = np.random.default_rng(fresh_seed())
    for fmt in FORMATS:  # a whole tile: words, scales -> the dequantized [N, K] block, exactly
        q, s = mx_weights(rng, fmt, (16, 64))
        words = mg._as_words(q)
        assert words.dtype == jnp.uint16 and words.shape == (16, 64 // (4 if fmt == "mxfp4" else 2))
        got = mg._weight_tile(words, s, fmt=fmt, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(dequantize(fmt, q, s)))


# ------------------------------------------------------------------------------------------------------------
# Kernel == reference == XLA fallback.
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_routing_trap_f32(fmt):
    """fp32, tight: the fused gate/up (swigluoai) and the down kernel against dequantize + ragged_dot and the
    fallback on every routing trap; 8-row tiles, 2-tile bands, 2-step reductions of 32 (one scale each)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    num_rows, num_groups, d, inter = 45, 5, 64, 32
    gu_q, gu_s = mx_weights(rng, fmt, (num_groups, 2 * inter, d))
    dn_q, dn_s = mx_weights(rng, fmt, (num_groups, d, inter))
    config = GroupedMatmulLaunchConfig(block_m=8, block_n=16, block_k=32, group_m=2)
    for name, gs_np in routings(rng, num_rows, num_groups, 8).items():
        gs = jnp.asarray(gs_np, jnp.int32)
        xs = jnp.asarray(rng.standard_normal((num_rows, d)), jnp.float32)
        h = mg.mx_grouped_matmul_pallas(xs, gu_q, gu_s, gs, swiglu=SWIGLU, config=config, interpret=True,
                                        poison=True)
        y = mg.mx_grouped_matmul_pallas(h, dn_q, dn_s, gs, swiglu=None, config=config, interpret=True,
                                        poison=True)
        h_ref = mg.mx_grouped_matmul_reference(xs, gu_q, gu_s, gs, swiglu=SWIGLU)
        y_ref = mg.mx_moe_ffn_reference(xs, gu_q, gu_s, dn_q, dn_s, gs, swiglu=SWIGLU)
        y_xla = mg.mx_moe_ffn_xla(xs, gu_q, gu_s, dn_q, dn_s, gs, swiglu=SWIGLU)
        msg = f"seed {seed}, {fmt}, {name}, group sizes {gs_np}"
        for got, want in ((h, h_ref), (y, y_ref), (y_xla, y_ref)):  # fp32 summation order only
            atol = 1e-5 * max(1.0, float(jnp.max(jnp.abs(want))))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol, err_msg=msg)
        pad = int(gs_np.sum())
        for out in (h, y, y_xla):
            assert np.all(np.asarray(out)[pad:] == 0), msg  # padding rows: exact zeros, never NaN
    # the un-fused product of the fallback
    np.testing.assert_allclose(mg.mx_grouped_matmul_xla(xs, gu_q, gu_s, gs),
                               mg.mx_grouped_matmul_reference(xs, gu_q, gu_s, gs), rtol=1e-5, atol=1e-5)


def test_bf16_rows_through_the_dispatcher():
    """bf16 rows at the policy's own launch config (``mx_moe_ffn``, ``implementation="pallas"``): the kernel
    rounds where the reference rounds, so only fp32 accumulation order differs."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    num_groups, d, inter, num_rows = 8, 64, 32, 40
    for fmt in FORMATS:
        gu_q, gu_s = mx_weights(rng, fmt, (num_groups, 2 * inter, d))
        dn_q, dn_s = mx_weights(rng, fmt, (num_groups, d, inter))
        experts = np.sort(rng.choice(num_groups, num_rows))
        gs = jnp.asarray(np.bincount(experts, minlength=num_groups), jnp.int32)
        xs = jnp.asarray(rng.standard_normal((num_rows, d)), jnp.bfloat16)
        args = (xs, gu_q, gu_s, dn_q, dn_s, gs)
        y = mg.mx_moe_ffn(*args, swiglu=SWIGLU, implementation="pallas", interpret=True)
        y_ref = mg.mx_moe_ffn(*args, swiglu=SWIGLU, implementation="reference")
        assert y.dtype == y_ref.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(y_ref.astype(jnp.float32))))
        err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32))))
        assert err <= 2e-2 * scale, (f"seed {seed}, {fmt}", err, scale)
        # "auto" on CPU without interpret=True is the XLA fallback, with the reference's roundings
        y_auto = mg.mx_moe_ffn(*args, swiglu=SWIGLU)
        np.testing.assert_allclose(np.asarray(y_auto, np.float32), np.asarray(y_ref, np.float32), rtol=2e-2,
                                   atol=2e-2 * scale)


# ------------------------------------------------------------------------------------------------------------
# Bad input, launch policy, support.
# ------------------------------------------------------------------------------------------------------------


def test_bad_inputs_name_the_tensor():
    rng = np.random.default_rng(0)
    q, s = mx_weights(rng, "mxfp4", (2, 64, 64))
    dq, ds = mx_weights(rng, "mxfp4", (2, 64, 32))
    xs = jnp.zeros((4, 64), jnp.float32)
    gs = jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(ValueError, match=r"w_gate_up_q: scales .* do not match"):
        mg.mx_moe_ffn_reference(xs, q, s[..., :1], dq, ds, gs, swiglu=SWIGLU)
    with pytest.raises(ValueError, match=r"w_gate_up_q: MX weights must be uint8 .* got float32"):
        mg.mx_moe_ffn_reference(xs, q.astype(jnp.float32), s, dq, ds, gs, swiglu=SWIGLU)
    with pytest.raises(ValueError, match=r"w_gate_up_q: mxfp4 weight .* has 32 columns; an input dimension of 96"):
        mg.mx_moe_ffn_reference(jnp.zeros((4, 96), jnp.float32), q, s, dq, ds, gs, swiglu=SWIGLU)
    f8q, f8s = mx_weights(rng, "mxfp8", (2, 64, 32))
    with pytest.raises(ValueError, match=r"w_down_q \(mxfp8\) and w_gate_up_q \(mxfp4\) must share"):
        mg.mx_moe_ffn_reference(xs, q, s, f8q, f8s, gs, swiglu=SWIGLU)
    with pytest.raises(ValueError, match=r"group_sizes must be int32\[G=2\]"):
        mg.mx_grouped_matmul_reference(xs, q, s, gs[:1])
    with pytest.raises(ValueError, match=r"block_k=16 must be a multiple of 32"):
        mg.mx_grouped_matmul_pallas(xs, q, s, gs, swiglu=None, interpret=True,
                                    config=GroupedMatmulLaunchConfig(block_m=4, block_n=16, block_k=16))
    with pytest.raises(ValueError, match=r"w_down_q .* must be \[E=2, d=64"):
        mg.mx_moe_ffn_reference(xs, q, s, dq[:, :32], ds[:, :32], gs, swiglu=SWIGLU)


def test_launch_policy_and_support():
    for chip in tuning.CHIPS:
        for fmt in FORMATS:
            for rows, k, n, fused in ((2048, 6144, 3072, True), (16384, 3072, 6144, False), (3, 96, 32, True)):
                c = mx_grouped_matmul_launch_config(num_rows=rows, num_groups=128, k=k, n=n, fused=fused, fmt=fmt,
                                                    chip=chip)
                c.validate()
                assert c.block_k % 32 == 0 and k % c.block_k == 0 and n % c.block_n == 0, (chip, fmt, c)
    hopper = mx_grouped_matmul_launch_config(num_rows=2048, num_groups=128, k=6144, n=3072, fused=True,
                                             fmt="mxfp4", chip="hopper")
    assert (hopper.block_m, hopper.block_n, hopper.block_k) == (32, 64, 128)  # the H200 sweep's decode tile
    with pytest.raises(ValueError, match="fmt must be one of"):
        mx_grouped_matmul_launch_config(num_rows=8, num_groups=2, k=64, n=32, fmt="nvfp4")
    assert mg.supports(hidden_size=6144, intermediate_size=3072, dtype=jnp.bfloat16, chip="cdna3")
    assert not mg.supports(hidden_size=6144, intermediate_size=3080, dtype=jnp.bfloat16)  # not a 32-multiple
    assert mg.resolve_implementation("auto", hidden_size=64, intermediate_size=32, dtype=jnp.float32) == "xla"
    assert mg.resolve_implementation("auto", hidden_size=64, intermediate_size=32, dtype=jnp.float32,
                                     interpret=True) == "pallas"
    # a jitted entry: the format comes from the dtype, no host sync on group sizes
    rng = np.random.default_rng(1)
    q, s = mx_weights(rng, "mxfp8", (2, 32, 64))
    out = jax.jit(lambda x, g: mg.mx_grouped_matmul(x, q, s, g, implementation="xla"))(
        jnp.ones((3, 64), jnp.float32), jnp.asarray([1, 1], jnp.int32))
    assert out.shape == (3, 32) and np.all(np.asarray(out)[2] == 0)
