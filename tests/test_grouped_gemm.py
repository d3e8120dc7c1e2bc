"""The MoE's grouped GEMM: Pallas kernel (interpret mode) == ragged_dot reference == dropless XLA fallback.

Every routing trap on one compiled kernel (group sizes are data, so one compile serves them all): empty
experts, one expert taking every row, group sizes that are not multiples of the row tile, padding rows past
the last group, a single token. Outputs are poisoned with NaN before the kernel runs (``poison=True``), so an
unwritten row shows up; padding rows must come out as exact zeros. Inputs are fresh random draws every run
(the seed is in the failure message). Shapes stay tiny: interpret mode compiles each kernel in about 2 s.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels.platform
from minimax_jax.config import MiniMaxM3Config
from minimax_jax.layers import MoE, swiglu_params
from pallas_kernels import grouped_gemm as gg
from pallas_kernels import tuning
from pallas_kernels._common import num_tiles_bound
from pallas_kernels.platform import lower_for_gpu
from pallas_kernels.tuning import GroupedMatmulLaunchConfig, grouped_matmul_launch_config

SWIGLU = (1.702, 7.0, 1.0)


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % (1 << 31))


def routings(rng, num_rows: int, num_groups: int, block_m: int) -> dict[str, np.ndarray]:
    """Group sizes for every trap (each sums to at most ``num_rows``)."""
    def split(total, groups):
        cuts = np.sort(rng.integers(0, total + 1, groups - 1))
        return np.diff(np.concatenate([[0], cuts, [total]]))

    empty = split(num_rows, num_groups)
    empty[rng.choice(num_groups, num_groups // 2, replace=False)] = 0
    empty[rng.integers(num_groups)] += num_rows - empty.sum()
    one = np.zeros(num_groups, np.int64)
    one[rng.integers(num_groups)] = num_rows
    size = max(1, num_rows // num_groups)
    odd = np.full(num_groups, size - 1 if size % block_m == 0 and size > 1 else size)  # not tile multiples
    odd[-1] = 0  # ... and the rest is padding
    return {
        "random": split(num_rows, num_groups),
        "half_empty": empty,
        "one_takes_all": one,
        "padding_rows": split(num_rows - 7, num_groups),
        "odd_sizes": odd,
        "single_row": np.eye(num_groups, dtype=np.int64)[rng.integers(num_groups)],
        "all_padding": np.zeros(num_groups, np.int64),
    }


def make_weights(rng, num_groups, d, inter, dtype):
    wgu = rng.standard_normal((num_groups, d, 2 * inter)) / np.sqrt(d)
    wd = rng.standard_normal((num_groups, inter, d)) / np.sqrt(inter)
    return jnp.asarray(wgu, dtype), jnp.asarray(wd, dtype)


def kernel_ffn(xs, wgu, wd, gs, gu_config, dn_config):
    """``moe_ffn``'s two kernels with poisoned outputs."""
    h = gg.grouped_matmul_pallas(xs, wgu, gs, swiglu=SWIGLU, config=gu_config, interpret=True, poison=True)
    return h, gg.grouped_matmul_pallas(h, wd, gs, swiglu=None, config=dn_config, interpret=True, poison=True)


# ------------------------------------------------------------------------------------------------------------
# Program search: every (row, column tile) exactly once, in plain jnp (no kernel).
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_m, group_m", [(16, 8), (4, 2), (8, 1)])
def test_programs_cover_every_row_once(block_m, group_m):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    num_rows, num_groups, n_cols, block_n = 53, 6, 64, 16
    config = GroupedMatmulLaunchConfig(block_m=block_m, block_n=block_n, block_k=16, group_m=group_m)
    for name, gs in routings(rng, num_rows, num_groups, block_m).items():
        table = np.asarray(gg.program_table(jnp.asarray(gs, jnp.int32), num_rows=num_rows, n_cols=n_cols,
                                            config=config))
        assert len(table) == num_tiles_bound(num_rows, num_groups, block_m) * (n_cols // block_n)
        owner = np.full((num_rows, n_cols // block_n), -1)
        starts = np.concatenate([[0], np.cumsum(gs)])
        for p, (seg, row0, nrows, n_tile) in enumerate(table):
            if nrows == 0:
                continue
            assert 0 <= seg <= num_groups and 0 < nrows <= block_m, (seed, name, p)
            lo, hi = (starts[seg], starts[seg + 1]) if seg < num_groups else (starts[-1], num_rows)
            assert lo <= row0 and row0 + nrows <= hi, (seed, name, p)  # a tile never leaves its group
            assert (owner[row0: row0 + nrows, n_tile] == -1).all(), (seed, name, p)
            owner[row0: row0 + nrows, n_tile] = p
        assert (owner >= 0).all(), (seed, name, "uncovered rows")
        # Programs are segment-major, so a group's weights are swept by consecutive programs.
        live = table[table[:, 2] > 0]
        assert (np.diff(live[:, 0]) >= 0).all()


# ------------------------------------------------------------------------------------------------------------
# Kernel == reference == XLA fallback.
# ------------------------------------------------------------------------------------------------------------


def test_every_routing_trap_f32():
    """fp32, tight: the fused gate/up (swigluoai) and the down kernel against ragged_dot and the fallback on
    every routing trap, one compile for all of them (8-row tiles, 2-tile bands, 3-step reductions)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    num_rows, num_groups, d, inter = 45, 5, 48, 32
    wgu, wd = make_weights(rng, num_groups, d, inter, jnp.float32)
    gu_config = GroupedMatmulLaunchConfig(block_m=8, block_n=16, block_k=16, group_m=2)
    dn_config = GroupedMatmulLaunchConfig(block_m=8, block_n=16, block_k=8, group_m=2)
    for name, gs_np in routings(rng, num_rows, num_groups, 8).items():
        gs = jnp.asarray(gs_np, jnp.int32)
        xs = jnp.asarray(rng.standard_normal((num_rows, d)), jnp.float32)
        h, y = kernel_ffn(xs, wgu, wd, gs, gu_config, dn_config)
        h_ref = gg.grouped_matmul_reference(xs, wgu, gs, swiglu=SWIGLU)
        y_ref = gg.moe_ffn_reference(xs, wgu, wd, gs, swiglu=SWIGLU)
        y_xla = gg.moe_ffn_xla(xs, wgu, wd, gs, swiglu=SWIGLU)
        msg = f"seed {seed}, {name}, group sizes {gs_np}"
        np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5, err_msg=msg)
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5, err_msg=msg)
        np.testing.assert_allclose(y_xla, y_ref, rtol=1e-5, atol=1e-5, err_msg=msg)
        pad = int(gs_np.sum())
        for out in (h, y, y_xla):
            assert np.all(np.asarray(out)[pad:] == 0), msg  # padding rows: exact zeros, never NaN
        # The un-fused product too (the XLA fallback's own single-product path).
        want = gg.grouped_matmul_reference(xs, wgu, gs)
        got = gg.grouped_matmul_xla(xs, wgu, gs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=msg)


def test_single_token_and_bf16():
    """One token routed to its top-2 (two rows), and bf16 at M3-like proportions with loose tolerances (the
    kernel rounds where the reference rounds, so only fp32 accumulation order differs)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    num_groups, d, inter = 8, 64, 32
    for dtype, num_rows, tol in ((jnp.float32, 2, 1e-5), (jnp.bfloat16, 40, 2e-2)):
        wgu, wd = make_weights(rng, num_groups, d, inter, dtype)
        gu_config = grouped_matmul_launch_config(num_rows=num_rows, num_groups=num_groups, k=d, n=inter,
                                                 fused=True, itemsize=2)
        dn_config = grouped_matmul_launch_config(num_rows=num_rows, num_groups=num_groups, k=inter, n=d)
        experts = np.sort(rng.choice(num_groups, num_rows, replace=num_rows > num_groups))
        gs = jnp.asarray(np.bincount(experts, minlength=num_groups), jnp.int32)
        xs = jnp.asarray(rng.standard_normal((num_rows, d)), dtype)
        _, y = kernel_ffn(xs, wgu, wd, gs, gu_config, dn_config)
        y_ref = gg.moe_ffn_reference(xs, wgu, wd, gs, swiglu=SWIGLU)
        y_xla = gg.moe_ffn_xla(xs, wgu, wd, gs, swiglu=SWIGLU)
        assert y.dtype == y_ref.dtype == y_xla.dtype == dtype
        msg = f"seed {seed}, {jnp.dtype(dtype).name}, group sizes {np.asarray(gs)}"
        scale = float(jnp.max(jnp.abs(y_ref.astype(jnp.float32))))
        for out in (y, y_xla):
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - y_ref.astype(jnp.float32))))
            assert err <= tol * scale, (msg, err, scale)


def test_xla_fallback_is_dropless_and_bounded():
    """The fallback never drops a row: one expert taking every row of a large batch needs every overflow slot;
    its static work is at most ``G * C + M`` rows."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    num_rows, num_groups, d = 300, 16, 16
    rhs = jnp.asarray(rng.standard_normal((num_groups, d, d)), jnp.float32)
    cap = gg.capacity(num_rows, num_groups)
    assert cap == 64 and num_groups * cap + (num_rows - 1) // cap * cap <= 5 * num_rows
    for name, gs in routings(rng, num_rows, num_groups, cap).items():
        lhs = jnp.asarray(rng.standard_normal((num_rows, d)), jnp.float32)
        gs = jnp.asarray(gs, jnp.int32)
        want = gg.grouped_matmul_reference(lhs, rhs, gs)
        np.testing.assert_allclose(gg.grouped_matmul_xla(lhs, rhs, gs), want, rtol=1e-5, atol=1e-5,
                                   err_msg=f"seed {seed}, {name}")


# ------------------------------------------------------------------------------------------------------------
# The MoE module: the new dispatch == the old ragged_dot path.
# ------------------------------------------------------------------------------------------------------------


def test_moe_module_parity():
    seed = fresh_seed()
    cfg = MiniMaxM3Config.tiny()
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, 9, cfg.hidden_size)), jnp.float32)
    old = moe(x)  # no argument: today's ragged_dot path
    np.testing.assert_array_equal(old, moe(x, implementation="reference"))
    for impl, kw in (("xla", {}), ("pallas", {"interpret": True})):
        np.testing.assert_allclose(moe(x, implementation=impl, **kw), old, rtol=1e-5, atol=1e-6,
                                   err_msg=f"seed {seed}, {impl}")
    # Masked tokens (padding slots) get only the shared expert; the others are unchanged.
    mask = jnp.asarray(rng.random((2, 9)) < 0.7)
    masked = moe(x, implementation="xla", token_mask=mask)
    np.testing.assert_allclose(jnp.where(mask[..., None], masked, 0), jnp.where(mask[..., None], old, 0),
                               rtol=1e-5, atol=1e-6)
    shared = moe.shared_experts(x.reshape(-1, cfg.hidden_size)).reshape(x.shape)
    np.testing.assert_allclose(jnp.where(mask[..., None], 0, masked), jnp.where(mask[..., None], 0, shared),
                               rtol=1e-6, atol=1e-7)
    assert swiglu_params(cfg) == (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_beta)


# ------------------------------------------------------------------------------------------------------------
# Dispatch, support, signatures, launch policy.
# ------------------------------------------------------------------------------------------------------------


def test_auto_is_the_kernel_on_a_gpu_else_the_xla_fallback(monkeypatch):
    m3 = {"hidden_size": 6144, "intermediate_size": 3072, "dtype": jnp.bfloat16}
    monkeypatch.setattr(pallas_kernels.platform, "on_gpu", lambda: False)
    assert gg.resolve_implementation("auto", **m3) == "xla"  # CPU
    assert gg.resolve_implementation("auto", interpret=True, **m3) == "pallas"
    for name in ("pallas", "xla", "reference"):
        assert gg.resolve_implementation(name, **m3) == name
    with pytest.raises(ValueError, match="implementation"):
        gg.resolve_implementation("triton", **m3)
    monkeypatch.setattr(pallas_kernels.platform, "on_gpu", lambda: True)
    assert gg.resolve_implementation("auto", **m3) == "pallas"
    assert gg.resolve_implementation("auto", **{**m3, "intermediate_size": 3080}) == "xla"  # 3080 = 8 x 385
    assert gg.resolve_implementation("auto", **{**m3, "dtype": jnp.float64}) == "xla"
    assert gg.supports(hidden_size=64, intermediate_size=32, dtype=jnp.float32)
    assert not gg.supports(hidden_size=24, intermediate_size=32, dtype=jnp.float32)
    assert gg.supports(hidden_size=24, intermediate_size=32, dtype=jnp.float32, interpret=True)
    assert gg.supports(hidden_size=64, intermediate_size=32, dtype=jnp.bfloat16, chip="cdna3")
    assert gg.resolve_implementation("auto", chip="cdna4", **m3) == "pallas"


def test_references_share_the_kernels_signature():
    pairs = ((gg.grouped_matmul, gg.grouped_matmul_reference), (gg.grouped_matmul, gg.grouped_matmul_xla),
             (gg.moe_ffn, gg.moe_ffn_reference), (gg.moe_ffn, gg.moe_ffn_xla))
    for fn, ref in pairs:
        want = [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]
        assert [(p.name, p.kind) for p in inspect.signature(ref).parameters.values()] == want


def test_bad_inputs_are_rejected():
    lhs, rhs, gs = jnp.zeros((8, 16)), jnp.zeros((2, 16, 32)), jnp.array([3, 5], jnp.int32)
    with pytest.raises(ValueError, match="rhs"):
        gg.grouped_matmul(lhs, rhs[:, :8], gs)
    with pytest.raises(ValueError, match="group_sizes"):
        gg.grouped_matmul(lhs, rhs, gs[:1])
    with pytest.raises(ValueError, match="dtype"):
        gg.grouped_matmul(lhs.astype(jnp.bfloat16), rhs, gs)
    with pytest.raises(ValueError, match="swiglu"):
        gg.grouped_matmul(lhs, rhs[:, :, :31], gs, swiglu=SWIGLU)
    with pytest.raises(ValueError, match="implementation"):
        gg.grouped_matmul(lhs, rhs, gs, implementation="cuda")
    with pytest.raises(ValueError, match="block_n"):
        gg.grouped_matmul(lhs, rhs, gs, implementation="pallas", block_n=64)
    with pytest.raises(ValueError, match="power of 2"):
        gg.grouped_matmul(lhs, rhs, gs, implementation="pallas", block_m=12)
    with pytest.raises(ValueError, match="implementation='xla'"):  # compiled: K must be a multiple of 16
        gg.grouped_matmul_pallas(jnp.zeros((8, 24)), jnp.zeros((2, 24, 32)), gs, swiglu=None,
                                 config=GroupedMatmulLaunchConfig(block_k=8, block_n=32), interpret=False)
    with pytest.raises(ValueError, match="w_down"):
        gg.moe_ffn(lhs, rhs, jnp.zeros((2, 8, 16)), gs, swiglu=SWIGLU)


@pytest.mark.parametrize("chip", tuning.CHIPS)
@pytest.mark.parametrize("num_rows", [1, 4, 2048, 16384, 1 << 17])
def test_launch_policy_is_portable(chip, num_rows):
    """Powers of 2 that tile M3's K and N exactly, >= 16 for Triton's dot, at most 16 warps, the chip's shared
    memory budget (AMD: 64 KiB of LDS per CU)."""
    table = tuning.TABLES[chip].grouped_gemm
    for k, n, fused in ((6144, 3072, True), (3072, 6144, False)):
        c = grouped_matmul_launch_config(num_rows=num_rows, num_groups=128, k=k, n=n, fused=fused, chip=chip)
        c.validate()
        assert min(c.block_m, c.block_n, c.block_k) >= tuning.MIN_DOT_DIM
        assert k % c.block_k == 0 and n % c.block_n == 0 and c.num_warps <= 16
        mats = 2 if fused else 1
        assert c.num_stages * (c.block_m + mats * c.block_n) * c.block_k * 2 <= table.smem_bytes
        assert c.block_m * c.block_n * mats <= table.max_acc_elems
        if tuning.chip_platform(chip) == "rocm":
            assert table.smem_bytes <= 32 * 1024 and c.num_warps <= 8


@pytest.mark.parametrize("chip", ["hopper", "cdna3"])
def test_lowers_for_gpu(chip):
    """Deviceless Triton lowering of both kernels at M3 shapes (hidden 6144, 128 experts, intermediate 3072,
    bf16) for decode- and prefill-sized batches, with the chip's launch table."""
    S = jax.ShapeDtypeStruct
    for num_rows in (2048, 16384):
        text = lower_for_gpu(
            gg.moe_ffn,
            S((num_rows, 6144), jnp.bfloat16),
            S((128, 6144, 6144), jnp.bfloat16),
            S((128, 3072, 6144), jnp.bfloat16),
            S((128,), jnp.int32),
            platform=tuning.chip_platform(chip),
            swiglu=SWIGLU,
            implementation="pallas",
            interpret=False,
            chip=chip,
        )
        assert "triton" in text.lower()
        assert "grouped_matmul_swigluoai_m" in text and "grouped_matmul_m" in text
