"""The Pallas draft-attention kernel (pallas_kernels/draft_attention.py) in interpret mode against a
float64 oracle, its jnp reference and the drafter's jnp ``draft_attention``; its deviceless Triton lowering
at M3 draft shapes for CUDA and ROCm; its launch policy; and the drafter's ``implementation`` switch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import MiniMaxM3Config
from minimax_jax.draft_attention import choose_implementation
from minimax_jax.draft_attention import draft_attention as jnp_draft_attention
from minimax_jax.draft_cache import DraftCache
from minimax_jax.drafter import DSparkDrafter
from minimax_jax.drafter_config import DSparkConfig
from pallas_kernels import draft_attention as da
from pallas_kernels import tuning
from pallas_kernels.platform import lower_for_gpu
from pallas_kernels.tuning import DraftAttentionLaunchConfig, draft_attention_launch_config


def oracle(q, kc, vc, lengths, kb, vb, scale, cache_rows=None):
    """One (row, slot, head) at a time in float64: context keys j < length of the row's cache row, then the
    block's K keys, one softmax."""
    q, kc, vc, kb, vb = (np.asarray(a, np.float64) for a in (q, kc, vc, kb, vb))
    r_rows, k_slots, h, d = q.shape
    g = kb.shape[2]
    out = np.zeros_like(q)
    for r in range(r_rows):
        row = r if cache_rows is None else int(cache_rows[r])
        n = 0 if row < 0 else min(max(int(lengths[r]), 0), kc.shape[1])
        for k in range(k_slots):
            for qh in range(h):
                grp = qh // (h // g)
                keys = np.concatenate([kc[row, :n, grp] if n else np.zeros((0, d)), kb[r, :, grp]])
                vals = np.concatenate([vc[row, :n, grp] if n else np.zeros((0, d)), vb[r, :, grp]])
                s = keys @ q[r, k, qh] * scale
                p = np.exp(s - s.max())
                out[r, k, qh] = p @ vals / p.sum()
    return out


def inputs(rng, *, rows, cache_rows, k, h, g, d, capacity, layers=None, dtype=np.float32):
    lead = () if layers is None else (layers,)
    q = rng.standard_normal((rows, k, h, d)).astype(dtype)
    kc = rng.standard_normal((*lead, cache_rows, capacity, g, d)).astype(dtype)
    vc = rng.standard_normal((*lead, cache_rows, capacity, g, d)).astype(dtype)
    kb = rng.standard_normal((rows, k, g, d)).astype(dtype)
    vb = rng.standard_normal((rows, k, g, d)).astype(dtype)
    return q, kc, vc, kb, vb


def poison_past(cache, lengths_by_cache_row):
    """NaN at and past each cache row's length: the kernel must never read there."""
    cache = np.array(cache)
    for row, n in enumerate(lengths_by_cache_row):
        cache[..., row, n:, :, :] = np.nan
    return cache


def test_kernel_against_oracle_reference_and_jnp():
    """fp32, K = 7 (not a power of 2), the whole [L, R, S, H_kv, D] cache with a layer, a row map with a
    padding row (-1), lengths 0 / 1 / a step / a step + 1 / the capacity (37, not a multiple of the 16-key
    step), NaN past every length, NaN-initialised outputs."""
    rng = np.random.default_rng(0)
    k, h, g, d, cap, layers = 7, 4, 2, 16, 37, 2
    q, kc, vc, kb, vb = inputs(rng, rows=6, cache_rows=6, k=k, h=h, g=g, d=d, capacity=cap, layers=layers)
    cache_rows = np.array([2, 0, -1, 5, 4, 3], np.int32)
    lengths = np.array([0, 1, 30, 16, 37, 17], np.int32)
    q[2] = 30.0  # the padding row: large queries, no context
    by_cache_row = np.zeros(6, np.int64)
    for r, row in enumerate(cache_rows):
        if row >= 0:
            by_cache_row[row] = lengths[r]
    clean_k, clean_v = kc[1].copy(), vc[1].copy()
    kc, vc = poison_past(kc, by_cache_row), poison_past(vc, by_cache_row)
    config = DraftAttentionLaunchConfig(block_h=2, block_s=16, num_splits=1, num_warps=4, num_stages=2)
    args = (
        jnp.asarray(q),
        jnp.asarray(kc),
        jnp.asarray(vc),
        jnp.asarray(lengths),
        jnp.asarray(kb),
        jnp.asarray(vb),
        jnp.asarray(cache_rows),
    )
    out = np.asarray(
        da.draft_attention_pallas(*args, scale=0.3, layer=1, config=config, interpret=True, poison=True)
    )
    want = oracle(q, kc[1], vc[1], lengths, kb, vb, 0.3, cache_rows)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    reference = jax.jit(lambda *a: da.draft_attention_reference(*a[:6], scale=0.3, layer=1, cache_rows=a[6]))
    ref = reference(*args)
    np.testing.assert_allclose(np.asarray(ref), want, atol=2e-5, rtol=2e-5)
    # The drafter's jnp path (a length mask over the gathered rows; it reads the capacity, so no NaN there).
    rows = np.maximum(cache_rows, 0)
    ends = np.where(cache_rows >= 0, lengths, 0)
    visible = (np.arange(cap)[None, :] < ends[:, None])[:, None, :]
    jnp_out = jax.jit(jnp_draft_attention, static_argnames="scale")(
        jnp.asarray(q),
        jnp.asarray(clean_k[rows]),
        jnp.asarray(clean_v[rows]),
        jnp.asarray(visible),
        jnp.asarray(kb),
        jnp.asarray(vb),
        scale=0.3,
    )
    np.testing.assert_allclose(np.asarray(jnp_out), want, atol=2e-5, rtol=2e-5)


def test_split_k_head_chunks_bf16():
    """bf16, a [R, S, H_kv, D] cache without a row map, 3 query heads per KV head in chunks of 2 (one masked
    head), the context split 3 ways (a split with no context step, the block keys in the last split only),
    lengths 0 / 1 / the capacity."""
    rng = np.random.default_rng(1)
    k, h, g, d, cap = 7, 6, 2, 16, 40
    q, kc, vc, kb, vb = inputs(rng, rows=4, cache_rows=4, k=k, h=h, g=g, d=d, capacity=cap)
    lengths = np.array([0, 1, 40, 23], np.int32)
    kc, vc = poison_past(kc, lengths), poison_past(vc, lengths)
    q, kc, vc, kb, vb = (jnp.asarray(a, jnp.bfloat16) for a in (q, kc, vc, kb, vb))
    args = (q, kc, vc, jnp.asarray(lengths), kb, vb)
    config = DraftAttentionLaunchConfig(block_h=2, block_s=16, num_splits=3, num_warps=4, num_stages=2)
    out = da.draft_attention_pallas(*args, scale=0.25, layer=None, config=config, interpret=True, poison=True)
    assert out.dtype == jnp.bfloat16
    rounded = [np.asarray(a.astype(jnp.float32)) for a in (args[0], args[1], args[2], args[4], args[5])]
    want = oracle(rounded[0], rounded[1], rounded[2], lengths, rounded[3], rounded[4], 0.25)
    got = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)  # bf16 p and output rounding


@pytest.mark.parametrize("chip", ["hopper", "cdna3"])
def test_lowers_for_gpu(chip):
    """Deviceless Triton lowering at M3 draft shapes: K = 7, 64 query / 4 KV heads of 128, 4K context in a
    5-layer bf16 draft cache, R = 512 (one split) and R = 64 (split-K and the merge kernel)."""
    s = jax.ShapeDtypeStruct
    for rows in (512, 64):
        cache = s((5, rows, 4112, 4, 128), jnp.bfloat16)
        shapes = (
            s((rows, 7, 64, 128), jnp.bfloat16),
            cache,
            cache,
            s((rows,), jnp.int32),
            s((rows, 7, 4, 128), jnp.bfloat16),
            s((rows, 7, 4, 128), jnp.bfloat16),
        )
        text = lower_for_gpu(
            da.draft_attention,
            *shapes,
            platform=tuning.chip_platform(chip),
            scale=128**-0.5,
            layer=4,
            interpret=False,
            chip=chip,
        )
        assert "triton" in text.lower() and "draft_attention_rows128_bs" in text
        config = draft_attention_launch_config(
            num_rows=rows, block_size=7, num_q_heads=64, num_kv_heads=4, capacity=4112, chip=chip
        )
        assert ("draft_attention_merge_splits" in text) == (config.num_splits > 1)


def test_launch_policy():
    m3 = {"block_size": 7, "num_q_heads": 64, "num_kv_heads": 4, "capacity": 4112, "head_dim": 128}
    big = draft_attention_launch_config(num_rows=512, chip="hopper", **m3)
    assert (big.block_h, big.block_s, big.num_splits, big.num_warps) == (16, 64, 1, 8)
    assert tuning.draft_attention_rows(7, big.block_h) == 128
    assert draft_attention_launch_config(num_rows=64, chip="hopper", **m3).num_splits == 2
    for chip in tuning.CHIPS:
        pol = tuning.TABLES[chip].draft_attention
        for rows in (1, 64, 512):
            c = draft_attention_launch_config(num_rows=rows, chip=chip, **m3)
            assert c.block_s >= tuning.MIN_DOT_DIM and not c.block_s & (c.block_s - 1)
            assert c.num_warps <= 8 and not c.num_warps & (c.num_warps - 1)
            assert 1 <= c.num_splits <= pol.max_splits
            assert 128 * 128 * 2 + c.num_stages * 2 * c.block_s * 128 * 2 <= pol.smem_bytes
    # A large group is cut into head chunks that fit max_rows; a short capacity shrinks the step.
    wide = draft_attention_launch_config(
        num_rows=8, block_size=7, num_q_heads=64, num_kv_heads=1, capacity=20
    )
    assert tuning.draft_attention_rows(7, wide.block_h) <= 128 and wide.block_s == 16


def test_supports_and_errors():
    m3 = {"head_dim": 128, "num_q_heads": 64, "num_kv_heads": 4, "block_size": 7}
    assert da.supports(dtype=jnp.bfloat16, **m3) and da.supports(dtype=jnp.float32, chip="cdna3", **m3)
    assert not da.supports(dtype=jnp.float16, **{**m3, "head_dim": 8})
    assert da.supports(dtype=jnp.float16, interpret=True, **{**m3, "head_dim": 8})
    assert not da.supports(dtype=jnp.int8, interpret=True, **m3)
    assert not da.supports(dtype=jnp.bfloat16, **{**m3, "num_q_heads": 63})
    s = jax.ShapeDtypeStruct
    q, kb = s((2, 7, 4, 16), jnp.float32), s((2, 7, 2, 16), jnp.float32)
    cache5, lens = s((3, 2, 9, 2, 16), jnp.float32), s((2,), jnp.int32)
    with pytest.raises(ValueError, match="layer"):
        jax.eval_shape(lambda *a: da.draft_attention(*a, scale=1.0), q, cache5, cache5, lens, kb, kb)
    with pytest.raises(ValueError, match="k_blk"):
        jax.eval_shape(lambda *a: da.draft_attention(*a, scale=1.0, layer=0), q, cache5, cache5, lens, q, q)
    with pytest.raises(ValueError, match="implementation"):
        jax.eval_shape(
            lambda *a: da.draft_attention(*a, scale=1.0, layer=0, implementation="triton"),
            q,
            cache5,
            cache5,
            lens,
            kb,
            kb,
        )


def test_choose_implementation():
    cfg = MiniMaxM3Config.tiny()
    kw = {"block_size": 7, "dtype": jnp.bfloat16}
    assert choose_implementation("auto", cfg, **kw) == "reference"  # no GPU here
    assert choose_implementation("auto", cfg, interpret=True, **kw) == "pallas"
    assert choose_implementation("pallas", cfg, **kw) == "pallas"
    with pytest.raises(ValueError, match="implementation"):
        choose_implementation("triton", cfg, **kw)


def test_drafter_block_hidden_with_the_kernel():
    """block_hidden through the kernel (interpret mode) equals the jnp path, also with a row map (padding row
    -1, rows in another order) that the jnp path serves by gathering the cache."""
    from scripts.profile_step import make_random, normal_arrays

    target = MiniMaxM3Config.tiny()
    cfg = DSparkConfig.for_target(
        target, mask_token_id=3, block_size=7, num_draft_layers=1, target_layer_ids=(1, 3)
    )
    drafter = make_random(DSparkDrafter, cfg, dtype=jnp.float32, seed=0, stddev=0.2)
    c = cfg.layer_config
    rows, cap = 4, 12  # a capacity under the 16-key step: every step is a masked one
    kc, vc = normal_arrays([((1, rows, cap, c.num_key_value_heads, c.head_dim), jnp.float32)] * 2, seed=1)
    cache = DraftCache(kc, vc, jnp.asarray([5, 0, 12, 9], jnp.int32))
    anchors = jnp.asarray([5, 9, 1, 100], jnp.int32)
    positions = jnp.asarray([5, 3, 12, 7], jnp.int32)  # row 3 drafts before its cached length
    cache_rows = jnp.asarray([2, -1, 0, 3], jnp.int32)

    # The row map by hand: row 1 (-1) has no context, row 0 reads cache row 2 (length 12, capped at anchor 5).
    plain = DraftCache(kc[:, jnp.asarray([2, 0, 0, 3])], vc[:, jnp.asarray([2, 0, 0, 3])],
                       jnp.asarray([12, 0, 5, 9], jnp.int32))

    @jax.jit  # one program: both paths, with and without the row map
    def run(cache, plain, anchors, positions, cache_rows):
        out = {}
        for impl in ("pallas", "reference"):
            out[impl] = (drafter.block_hidden(cache, anchors, positions, implementation=impl),
                         drafter.block_hidden(cache, anchors, positions, cache_rows=cache_rows,
                                              implementation=impl))
        return out, drafter.block_hidden(plain, anchors, positions, implementation="reference")

    out, want = run(cache, plain, anchors, positions, cache_rows)
    for a, b in zip(out["pallas"], out["reference"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(out["pallas"][1]), np.asarray(want), atol=1e-4, rtol=1e-4)
