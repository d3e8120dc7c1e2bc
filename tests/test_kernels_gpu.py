"""The compiled Triton kernels on a real GPU == their references and the naive oracles.

The other kernel tests run the same kernels in interpret mode on the CPU (CI has no GPU). This module runs them
compiled, with the same traps (NaN pages behind unused table entries, stale large values past ``seq_len``, NaN
padding queries, outputs poisoned before the run, zero-length rows, ``-1`` selection tails, contexts that are
not a multiple of the page), at shapes the compiled dots accept (pages and head dims >= 16). It is skipped
without a GPU; run it on one with::

    JAX_PLATFORMS=cuda python -m pytest -q tests/test_kernels_gpu.py
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels import sparse_attention as sa
from pallas_kernels import tuning
from pallas_kernels.indexer import (
    index_block_scores_reference,
    ragged_index_topk,
    ragged_index_topk_reference,
)
from pallas_kernels.paged_attention import ragged_paged_attention
from pallas_kernels.platform import gpu_platform_name, on_gpu
from pallas_kernels.sparse_attention import ragged_sparse_attention
from pallas_kernels.tuning import AttentionLaunchConfig
from tests import test_indexer as ti
from tests.test_sparse_attention import (
    VERIFY,
    args_of,
    assert_close,
    make_batch,
    oracle,
    poison_before_window,
    windowed_bf16_tol,
)

pytestmark = pytest.mark.skipif(not on_gpu(), reason="compiled Triton kernels need a GPU")

# Longer contexts than the interpret-mode tests: several past blocks before the causal ones, split-K ranges
# that cut through blocks.
LONG = {"q_lens": [8, 0, 1, 5, 8, 3, 0], "seq_lens": [300, 0, 17, 130, 96, 47, 0]}


def test_device_is_a_known_chip():
    """The launch tables are chosen for the detected chip; its platform is the device's runtime."""
    chip = tuning.detect_chip()
    assert chip in tuning.CHIPS
    assert tuning.resolve_chip(None) == chip
    assert tuning.chip_platform(chip) == gpu_platform_name()


@pytest.mark.parametrize(
    "dtype, page, dim, kv_heads, group, topk, block_q, num_splits, block_k, num_warps, num_stages",
    [
        ("f32", 16, 32, 2, 2, 3, 4, 1, 16, 4, 2),
        ("f32", 16, 64, 2, 8, 4, 8, 3, 16, 4, 3),
        ("f32", 32, 32, 1, 4, 3, 2, 2, 32, 4, 2),
        ("bf16", 16, 32, 2, 4, 3, 4, 1, 16, 4, 3),
        ("bf16", 32, 64, 2, 16, 4, 4, 1, 32, 4, 3),
        ("bf16", 32, 128, 2, 16, 4, 8, 1, 32, 8, 3),
        ("bf16", 32, 128, 1, 16, 4, 1, 4, 32, 4, 3),
        ("bf16", 64, 128, 2, 8, 3, 2, 3, 32, 4, 4),
    ],
)
@pytest.mark.parametrize("shape", ["verify", "long"])
def test_sparse_attention_compiled(
    dtype, page, dim, kv_heads, group, topk, block_q, num_splits, block_k, num_warps, num_stages, shape
):
    rng = np.random.default_rng(hash((dtype, page, dim, group, block_q, shape)) % 2**32)
    lens = VERIFY if shape == "verify" else LONG
    batch = make_batch(rng, **lens, page=page, dim=dim, kv_heads=kv_heads, group=group, topk=topk, dtype=dtype)
    scale = dim**-0.5
    config = AttentionLaunchConfig(block_q, num_splits, num_warps, num_stages, block_k)
    out = sa.ragged_sparse_attention_pallas(
        *args_of(batch), scale=scale, config=config, interpret=False, poison=True
    )
    assert out.dtype == batch["q"].dtype
    assert_close(out, oracle(batch, scale), dtype, int(batch["query_start_loc"][-1]))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_sparse_attention_compiled_default_policy(dtype):
    """The public entry point with the chip's launch policy (M3-like group of 16, head_dim 128)."""
    rng = np.random.default_rng(11)
    batch = make_batch(rng, **LONG, page=32, dim=128, kv_heads=2, group=16, topk=4, dtype=dtype)
    scale = 128**-0.5
    out = ragged_sparse_attention(*args_of(batch), scale=scale, interpret=False)
    assert_close(out, oracle(batch, scale), dtype, int(batch["query_start_loc"][-1]))


@pytest.mark.parametrize(
    "dtype, page, dim, group, block_q, num_splits, block_k",
    [
        ("f32", 16, 32, 2, 4, 1, 16),
        ("f32", 32, 64, 4, 8, 3, 16),
        ("bf16", 32, 128, 16, 8, 1, 32),
        ("bf16", 16, 64, 8, 1, 4, 16),
    ],
)
def test_paged_attention_compiled(dtype, page, dim, group, block_q, num_splits, block_k):
    rng = np.random.default_rng(hash((dtype, page, dim, group, block_q)) % 2**32)
    batch = make_batch(rng, **LONG, page=page, dim=dim, kv_heads=2, group=group, dtype=dtype)
    scale = dim**-0.5
    config = AttentionLaunchConfig(block_q, num_splits, 4, 3, block_k)
    out = pa.ragged_paged_attention_pallas(
        *args_of(batch, dense=True), scale=scale, config=config, interpret=False, poison=True
    )
    assert_close(out, oracle(batch, scale, dense=True), dtype, int(batch["query_start_loc"][-1]))
    public = ragged_paged_attention(*args_of(batch, dense=True), scale=scale, interpret=False)
    assert_close(public, oracle(batch, scale, dense=True), dtype, int(batch["query_start_loc"][-1]))


@pytest.mark.parametrize(
    "kernel, dtype, page, dim, group, window, block_q, num_splits, block_k",
    [
        ("dense", "f32", 16, 32, 2, 1, 4, 1, 16),
        ("dense", "bf16", 32, 128, 16, 32, 8, 1, 32),
        ("dense", "bf16", 16, 64, 8, 45, 1, 4, 16),
        ("dense", "f32", 32, 64, 4, 1000, 8, 3, 16),
        ("sparse", "f32", 16, 32, 2, 16, 4, 2, 16),
        ("sparse", "bf16", 32, 128, 16, 77, 4, 1, 32),
        ("sparse", "bf16", 16, 64, 8, 3, 1, 3, 16),
    ],
)
def test_windowed_attention_compiled(kernel, dtype, page, dim, group, window, block_q, num_splits, block_k):
    """Sliding windows (one key, a page, not a multiple of the page, past every context) compiled: NaN pages
    before every window are never read, poisoned outputs, the public entry point with the chip's policy too."""
    rng = np.random.default_rng(hash((kernel, dtype, page, window)) % 2**32)
    batch = make_batch(rng, **LONG, page=page, dim=dim, kv_heads=2, group=group, topk=4, dtype=dtype)
    batch, _ = poison_before_window(batch, window)
    dense = kernel == "dense"
    scale = dim**-0.5
    expected = oracle(batch, scale, dense=dense, window=window)
    num_valid = int(batch["query_start_loc"][-1])
    ref_fn = pa.ragged_paged_attention_reference if dense else sa.ragged_sparse_attention_reference
    tol = windowed_bf16_tol(ref_fn(*args_of(batch, dense=dense), scale=scale, window=window), expected)
    pallas = pa.ragged_paged_attention_pallas if dense else sa.ragged_sparse_attention_pallas
    config = AttentionLaunchConfig(block_q, num_splits, 4, 3, block_k)
    out = pallas(*args_of(batch, dense=dense), scale=scale, config=config, interpret=False, poison=True,
                 window=window)
    assert_close(out, expected, dtype, num_valid, bf16_mean_tol=tol)
    public = (ragged_paged_attention if dense else ragged_sparse_attention)(
        *args_of(batch, dense=dense), scale=scale, window=window, interpret=False
    )
    assert_close(public, expected, dtype, num_valid, bf16_mean_tol=tol)


def test_all_padding_batch_is_zero_compiled():
    rng = np.random.default_rng(5)
    batch = make_batch(rng, q_lens=[0, 0], seq_lens=[0, 0], page=16, dim=32, kv_heads=1, group=2, pad_slots=4)
    out = sa.ragged_sparse_attention_pallas(
        *args_of(batch), scale=0.2, config=AttentionLaunchConfig(2, 2, 4, 2, 16), interpret=False, poison=True
    )
    assert np.all(np.asarray(out) == 0.0)


@pytest.mark.parametrize(
    "page, dim, heads, block_q, num_splits, pages_per_step",
    [(16, 32, 4, 4, 1, 1), (16, 64, 4, 8, 2, 2), (32, 32, 8, 2, 1, 1), (32, 128, 4, 4, 3, 1), (16, 32, 4, 4, 1, 4)],
)
@pytest.mark.parametrize("values", ["int", "normal"])
def test_indexer_compiled(page, dim, heads, block_q, num_splits, pages_per_step, values):
    """Exact selections: integer inputs (exact dot products in any order) and continuous ones (no ties)."""
    rng = np.random.default_rng(hash((page, dim, heads, block_q, values)) % 2**32)
    q_lens = [8, 0, 1, 5, 8, 3, 0, 1]
    seq_lens = [8 + 290, 0, 17, 130, page * 6, 3 + page, 0, 1]
    for dtype in (np.float32, jnp.bfloat16):
        b = ti.make_batch(rng, q_lens=q_lens, seq_lens=seq_lens, page=page, dim=dim, heads=heads, values=values,
                          dtype=dtype, extra_blocks=2, pad_slots=5)
        for local in (0, 1, 2):
            want = np.asarray(ragged_index_topk_reference(*ti.args_of(b), topk=4, local_blocks=local))
            got = np.asarray(
                ragged_index_topk(*ti.args_of(b), topk=4, local_blocks=local, interpret=False, block_q=block_q,
                                  num_splits=num_splits, pages_per_step=pages_per_step)
            )
            pooled = index_block_scores_reference(*ti.args_of(b))
            ti.assert_score_equivalent(got, want, pooled, local_blocks=local)
            np.testing.assert_array_equal(got, want)  # integer inputs too: kernel and reference break ties alike
            assert (got[b["qsl"][-1]:] == -1).all()


# ------------------------------------------------------------------------------------------------------------
# The MoE's grouped GEMM (pallas_kernels.grouped_gemm), compiled: every routing trap, poisoned outputs.
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, block_m, block_n, block_k, num_warps, num_stages, group_m",
    [
        ("f32", 16, 16, 16, 4, 2, 2),
        ("f32", 32, 32, 32, 4, 3, 8),
        ("bf16", 16, 64, 64, 4, 3, 8),
        ("bf16", 64, 32, 32, 4, 4, 1),
        ("bf16", 128, 64, 32, 8, 3, 4),
    ],
)
def test_grouped_gemm_compiled(dtype, block_m, block_n, block_k, num_warps, num_stages, group_m):
    from pallas_kernels import grouped_gemm as gg
    from tests.test_grouped_gemm import SWIGLU, make_weights, routings

    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    tol = 1e-4 if dtype == "f32" else 2e-2
    rng = np.random.default_rng(0)
    num_rows, num_groups, d, inter = 300, 9, 128, 64
    wgu, wd = make_weights(rng, num_groups, d, inter, dt)
    config = tuning.GroupedMatmulLaunchConfig(block_m=block_m, block_n=block_n, block_k=block_k,
                                              num_warps=num_warps, num_stages=num_stages, group_m=group_m)
    for name, gs_np in routings(rng, num_rows, num_groups, block_m).items():
        gs = jnp.asarray(gs_np, jnp.int32)
        xs = jnp.asarray(rng.standard_normal((num_rows, d)), dt)
        h = gg.grouped_matmul_pallas(xs, wgu, gs, swiglu=SWIGLU, config=config, interpret=False, poison=True)
        y = gg.grouped_matmul_pallas(h, wd, gs, swiglu=None, config=config, interpret=False, poison=True)
        for out, ref in ((h, gg.grouped_matmul_reference(xs, wgu, gs, swiglu=SWIGLU)),
                         (y, gg.moe_ffn_reference(xs, wgu, wd, gs, swiglu=SWIGLU))):
            out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
            scale = max(float(np.abs(ref).max()), 1e-6)
            assert not np.isnan(out).any(), name
            assert np.abs(out - ref).max() <= tol * scale, (name, np.abs(out - ref).max(), scale)
            assert (out[int(gs_np.sum()):] == 0).all(), name  # padding rows: exact zeros


@pytest.mark.parametrize("num_tokens", [1, 64, 512])
def test_moe_ffn_compiled_default_policy(num_tokens):
    """The chip's own launch policy at a narrow M3-like shape (bf16, 32 experts, top-4) == ragged_dot, and the
    XLA fallback too."""
    from pallas_kernels import grouped_gemm as gg
    from tests.test_grouped_gemm import SWIGLU, make_weights

    rng = np.random.default_rng(num_tokens)
    num_groups, d, inter, top_k = 32, 512, 256, 4
    wgu, wd = make_weights(rng, num_groups, d, inter, jnp.bfloat16)
    picks = [rng.choice(num_groups, top_k, replace=False) for _ in range(num_tokens)]
    experts = np.sort(np.concatenate(picks))
    gs = jnp.asarray(np.bincount(experts, minlength=num_groups), jnp.int32)
    xs = jnp.asarray(rng.standard_normal((num_tokens * top_k, d)), jnp.bfloat16)
    ref = np.asarray(gg.moe_ffn_reference(xs, wgu, wd, gs, swiglu=SWIGLU), np.float32)
    scale = float(np.abs(ref).max())
    for impl in ("pallas", "auto", "xla"):
        out = np.asarray(gg.moe_ffn(xs, wgu, wd, gs, swiglu=SWIGLU, implementation=impl), np.float32)
        assert np.abs(out - ref).max() <= 2e-2 * scale, (impl, np.abs(out - ref).max(), scale)
@pytest.mark.parametrize(
    "dtype, heads, kv_heads, dim, block_h, block_s, num_splits, num_warps, num_stages",
    [
        ("f32", 4, 2, 32, 2, 16, 1, 4, 2),
        ("f32", 8, 2, 64, 4, 32, 3, 4, 3),
        ("bf16", 32, 2, 128, 16, 64, 1, 8, 3),  # the M3 tile: 7 -> 8 slots x 16 heads = 128 rows
        ("bf16", 32, 2, 128, 16, 64, 2, 8, 3),
        ("bf16", 12, 4, 128, 2, 32, 4, 4, 2),  # 3 heads per KV head in chunks of 2
    ],
)
def test_draft_attention_compiled(dtype, heads, kv_heads, dim, block_h, block_s, num_splits, num_warps,
                                  num_stages):
    """The compiled draft-attention kernel against the float64 oracle: K = 7, the whole [L, H_kv, P, page, D]
    cache with a layer, 64-token pages behind shuffled block tables, a row map with a padding row, lengths 0 /
    1 / a step / a step - 1 / a page + 1 / the capacity (320), NaN on every position a row does not own below its
    length, NaN-poisoned outputs."""
    from pallas_kernels import draft_attention as da
    from tests.test_draft_attention import (
        by_cache_row,
        dense_view,
        inputs,
        oracle,
        paged_cache,
        poison_unowned,
    )

    rng = np.random.default_rng(7)
    page, nb = 64, 5
    q, kb, vb = inputs(rng, rows=6, k=7, h=heads, g=kv_heads, d=dim)
    kc, vc, tables = paged_cache(rng, cache_rows=6, max_blocks=nb, page=page, g=kv_heads, d=dim, layers=2)
    cache_rows = np.array([2, 0, -1, 5, 4, 3], np.int32)
    lengths = np.array([0, 1, page + 1, block_s, nb * page, block_s - 1], np.int32)
    by_row = by_cache_row(cache_rows, lengths, 6)
    clean = (kc[1].copy(), vc[1].copy())
    kc = np.stack([poison_unowned(kc[i], tables, by_row) for i in range(2)])
    vc = np.stack([poison_unowned(vc[i], tables, by_row) for i in range(2)])
    jdt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    args = [jnp.asarray(a, jdt) for a in (q, kc, vc)] + [jnp.asarray(tables), jnp.asarray(lengths)]
    args += [jnp.asarray(a, jdt) for a in (kb, vb)] + [jnp.asarray(cache_rows)]
    config = tuning.DraftAttentionLaunchConfig(block_h=block_h, block_s=block_s, num_splits=num_splits,
                                               num_warps=num_warps, num_stages=num_stages)
    out = da.draft_attention_pallas(*args, scale=dim**-0.5, layer=1, config=config, interpret=False, poison=True)
    f32 = [np.asarray(jnp.asarray(a, jdt).astype(jnp.float32)) for a in (q, clean[0], clean[1], kb, vb)]
    want = oracle(f32[0], dense_view(f32[1], tables), dense_view(f32[2], tables), lengths, f32[3], f32[4],
                  dim**-0.5, cache_rows)
    got = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(got).all()
    tol = 1e-4 if dtype == "f32" else 3e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    # The policy's own launch (no overrides) gives the same result.
    auto = da.draft_attention(*args[:7], scale=dim**-0.5, layer=1, cache_rows=args[7])
    np.testing.assert_allclose(np.asarray(auto.astype(jnp.float32)), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window, block_s, num_splits", [(13, 16, 1), (40, 16, 3), (1024, 16, 2)])
def test_draft_attention_window_compiled(window, block_s, num_splits):
    """The compiled windowed walk (the Qwen3-style drafter's non-causal sliding window) against the float64
    oracle: fp32, K = 7, 16-token pages behind shuffled block tables, a padding row, lengths 0 / 1 / around the
    window / a page boundary / full, anchors past the visible context; every position outside a row's window is
    NaN, outputs poisoned."""
    from pallas_kernels import draft_attention as da
    from tests.test_draft_attention import windowed_case

    rng = np.random.default_rng(window)
    q, kc, vc, tables, lengths, kb, vb, cache_rows, qpos, want, _ = windowed_case(rng, window=window, d=32, page=16,
                                                                                  nb=5)
    config = tuning.DraftAttentionLaunchConfig(block_h=2, block_s=block_s, num_splits=num_splits, num_warps=4,
                                               num_stages=2)
    args = [jnp.asarray(a) for a in (q, kc, vc, tables, lengths, kb, vb, cache_rows, qpos)]
    out = np.asarray(da.draft_attention_pallas(*args, scale=0.3, layer=1, config=config, interpret=False,
                                               poison=True, window=window))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_mx_grouped_gemm_compiled(fmt, dtype):
    """The compiled dequantizing grouped GEMM (MXFP4 / MXFP8 experts in the checkpoint's [N, K] layout) against
    dequantize + ragged_dot on every routing trap (empty experts, one expert taking every row, padding rows past
    the last group, all padding): the fused gate/up and the down product, outputs poisoned, padding rows exact
    zeros; the policy's own launch (``mx_moe_ffn``) too."""
    from pallas_kernels import mx_grouped_gemm as mg
    from tests.test_grouped_gemm import SWIGLU, routings
    from tests.test_mx_grouped_gemm import mx_weights

    rng = np.random.default_rng(11)
    jdt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    num_rows, num_groups, d, inter = 80, 6, 256, 128
    gu_q, gu_s = mx_weights(rng, fmt, (num_groups, 2 * inter, d))
    dn_q, dn_s = mx_weights(rng, fmt, (num_groups, d, inter))
    config = tuning.GroupedMatmulLaunchConfig(block_m=16, block_n=32, block_k=64, group_m=2)
    tol = 1e-4 if dtype == "f32" else 3e-2
    for name, gs_np in routings(rng, num_rows, num_groups, 16).items():
        gs = jnp.asarray(gs_np, jnp.int32)
        xs = jnp.asarray(rng.standard_normal((num_rows, d)), jdt)
        h = mg.mx_grouped_matmul_pallas(xs, gu_q, gu_s, gs, swiglu=SWIGLU, config=config, interpret=False,
                                        poison=True)
        y = mg.mx_grouped_matmul_pallas(h, dn_q, dn_s, gs, swiglu=None, config=config, interpret=False,
                                        poison=True)
        h_ref = mg.mx_grouped_matmul_reference(xs, gu_q, gu_s, gs, swiglu=SWIGLU)
        y_ref = mg.mx_moe_ffn_reference(xs, gu_q, gu_s, dn_q, dn_s, gs, swiglu=SWIGLU)
        y_auto = mg.mx_moe_ffn(xs, gu_q, gu_s, dn_q, dn_s, gs, swiglu=SWIGLU, implementation="pallas")
        used = int(np.sum(gs_np))
        for got, want in ((h, h_ref), (y, y_ref), (y_auto, y_ref)):
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            assert np.isfinite(got).all(), name
            assert (got[used:] == 0).all(), name
            scale = max(float(np.abs(want).max()), 1e-6)
            assert np.abs(got - want).max() <= tol * scale, (name, np.abs(got - want).max(), scale)


@pytest.mark.parametrize("rows, k", [(1, 1), (12, 7), (70, 4), (512, 7)])
def test_plan_ranking_compiled(rows, k):
    """The planner's ranking kernels, compiled, == the jnp pass (exactly on quantised confidences, whose survival
    sums are exact; values to float32 rounding otherwise), at the device loop's 512 slots and small odd sizes."""
    from pallas_kernels.plan_ranking import ranked_plan_curves
    from tests.test_plan_ranking import random_inputs

    lengths = tuple(sorted({0, 1, min(3, k), k})) + (k,)
    sizes = tuple(tuple(sorted({max(8, rows * (1 + d) - i * rows) for i in range(4)})) for d in lengths)
    rng = np.random.default_rng(rows)
    for trial in range(6):
        quantised = trial % 2 == 0
        args = random_inputs(rng, rows, k, lengths, sizes, live=int(rng.integers(0, rows + 1)), quantised=quantised)
        kw = dict(column_lengths=lengths, column_sizes=sizes)
        want = [np.asarray(x) for x in ranked_plan_curves(*args, implementation="reference", **kw)]
        got = [np.asarray(x) for x in ranked_plan_curves(*args, implementation="pallas", **kw)]
        np.testing.assert_array_equal(got[3], want[3])
        np.testing.assert_allclose(got[1:3], want[1:3], rtol=1e-5)
        if quantised:
            np.testing.assert_array_equal(got[0], want[0])
