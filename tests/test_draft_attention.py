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


def oracle(q, kc, vc, lengths, kb, vb, scale, cache_rows=None, window=None, qpos=None):
    """One (row, slot, head) at a time in float64: context keys j < length of the row's cache row (``kc, vc
    [R_c, S, H_kv, D]``, in position order; with a ``window``, only ``j > qpos[r] + k - window`` for slot ``k``,
    ``qpos`` defaulting to the lengths), then the block's K keys, one softmax."""
    q, kc, vc, kb, vb = (np.asarray(a, np.float64) for a in (q, kc, vc, kb, vb))
    r_rows, k_slots, h, d = q.shape
    g = kb.shape[2]
    out = np.zeros_like(q)
    for r in range(r_rows):
        row = r if cache_rows is None else int(cache_rows[r])
        n = 0 if row < 0 else min(max(int(lengths[r]), 0), kc.shape[1])
        for k in range(k_slots):
            lo = 0
            if window is not None:
                lo = min(max(int(lengths[r] if qpos is None else qpos[r]) + k - window + 1, 0), n)
            for qh in range(h):
                grp = qh // (h // g)
                keys = np.concatenate([kc[row, lo:n, grp], kb[r, :, grp]])
                vals = np.concatenate([vc[row, lo:n, grp], vb[r, :, grp]])
                s = keys @ q[r, k, qh] * scale
                p = np.exp(s - s.max())
                out[r, k, qh] = p @ vals / p.sum()
    return out


def inputs(rng, *, rows, k, h, g, d, dtype=np.float32):
    """Block queries and the block's own keys and values."""
    q = rng.standard_normal((rows, k, h, d)).astype(dtype)
    kb = rng.standard_normal((rows, k, g, d)).astype(dtype)
    vb = rng.standard_normal((rows, k, g, d)).astype(dtype)
    return q, kb, vb


def paged_cache(rng, *, cache_rows, max_blocks, page, g, d, layers=None, spare=3, dtype=np.float32):
    """Random paged K/V ``[L?, H_kv, P, page, D]`` with ``P = cache_rows * max_blocks + spare`` pages and SHUFFLED
    block tables ``int32[cache_rows, max_blocks]`` (a random permutation: no row owns a contiguous run, and
    ``spare`` pages belong to nobody)."""
    num_pages = cache_rows * max_blocks + spare
    lead = () if layers is None else (layers,)
    kc = rng.standard_normal((*lead, g, num_pages, page, d)).astype(dtype)
    vc = rng.standard_normal((*lead, g, num_pages, page, d)).astype(dtype)
    tables = rng.permutation(num_pages)[: cache_rows * max_blocks].reshape(cache_rows, max_blocks)
    return kc, vc, tables.astype(np.int32)


def poison_unowned(cache, tables, lengths_by_cache_row):
    """NaN everywhere except each cache row's positions below its length: pages of other rows, spare pages and
    the tails of partly filled pages. The kernel must never read there."""
    page = cache.shape[-2]
    live = np.zeros(cache.shape[-4:-1], bool)[0]  # [P, page]
    for row, n in enumerate(lengths_by_cache_row):
        for j in range(int(n)):
            live[tables[row, j // page], j % page] = True
    return np.where(live[:, :, None], cache, np.nan).astype(cache.dtype)


def dense_view(cache, tables):
    """``[H_kv, P, page, D]`` through ``tables [R_c, nb]`` -> ``[R_c, nb * page, H_kv, D]`` (numpy)."""
    g, _, page, d = cache.shape
    pages = cache[:, tables]  # [G, R_c, nb, page, D]
    return np.moveaxis(pages, 0, 3).reshape(tables.shape[0], -1, g, d)


def by_cache_row(cache_rows, lengths, num_cache_rows):
    n = np.zeros(num_cache_rows, np.int64)
    for r, row in enumerate(cache_rows):
        if row >= 0:
            n[row] = max(n[row], lengths[r])
    return n


@pytest.mark.parametrize(
    "block_s, num_splits, seed",
    [(8, 1, 0), (4, 3, 1)],  # one step per page; two steps per page with split-K
)
def test_paged_kernel_against_oracle_and_reference(block_s, num_splits, seed):
    """fp32, K = 7 (not a power of 2), the whole [L, H_kv, P, page, D] cache read at two of its three layers,
    SHUFFLED block tables, a row map with a padding row (-1) and rows in another order, lengths 0 / 1 /
    page - 1 / page / page + 1 / full / random; every page position a row does not own up to its length is NaN;
    outputs poisoned (NaN) before the run; fresh random inputs per case."""
    rng = np.random.default_rng(seed)
    k, h, g, d, page, nb, layers, rows = 7, 4, 2, 16, 8, 5, 3, 8
    full = nb * page
    q, kb, vb = inputs(rng, rows=rows, k=k, h=h, g=g, d=d)
    kc, vc, tables = paged_cache(rng, cache_rows=rows, max_blocks=nb, page=page, g=g, d=d, layers=layers)
    cache_rows = rng.permutation(rows).astype(np.int32)
    cache_rows[3] = -1  # a padding row: no context
    lengths = np.array([0, 1, page - 1, 30, page, page + 1, full, rng.integers(1, full)], np.int32)
    q[3] = 30.0  # the padding row: large queries, no context
    n_by_row = by_cache_row(cache_rows, lengths, rows)
    clean = (kc.copy(), vc.copy())
    kc = np.stack([poison_unowned(kc[li], tables, n_by_row) for li in range(layers)])
    vc = np.stack([poison_unowned(vc[li], tables, n_by_row) for li in range(layers)])
    config = DraftAttentionLaunchConfig(block_h=2, block_s=block_s, num_splits=num_splits, num_warps=4,
                                        num_stages=2)
    args = [jnp.asarray(a) for a in (q, kc, vc, tables, lengths, kb, vb, cache_rows)]
    for layer in (0, 2):
        out = np.asarray(da.draft_attention_pallas(*args, scale=0.3, layer=layer, config=config, interpret=True,
                                                   poison=True))
        want = oracle(q, dense_view(clean[0][layer], tables), dense_view(clean[1][layer], tables), lengths, kb, vb,
                      0.3, cache_rows)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5, err_msg=f"layer {layer}")
        ref = da.draft_attention_reference(*args[:7], scale=0.3, layer=layer, cache_rows=args[7])
        np.testing.assert_allclose(np.asarray(ref), want, atol=2e-5, rtol=2e-5, err_msg=f"layer {layer}")
    # The drafter's jnp path (a length mask over the rows gathered through the tables; clean pages).
    layer = 2
    safe_rows = np.maximum(cache_rows, 0)
    ends = np.where(cache_rows >= 0, lengths, 0)
    visible = (np.arange(full)[None, :] < ends[:, None])[:, None, :]
    jnp_out = jax.jit(jnp_draft_attention, static_argnames="scale")(
        jnp.asarray(q),
        da.paged_context(jnp.asarray(clean[0][layer]), jnp.asarray(tables[safe_rows])),
        da.paged_context(jnp.asarray(clean[1][layer]), jnp.asarray(tables[safe_rows])),
        jnp.asarray(visible),
        jnp.asarray(kb),
        jnp.asarray(vb),
        scale=0.3,
    )
    np.testing.assert_allclose(np.asarray(jnp_out), want, atol=2e-5, rtol=2e-5)


def poison_outside(cache, tables, lo_by_cache_row, hi_by_cache_row):
    """NaN everywhere except each cache row's positions ``lo <= j < hi``."""
    page = cache.shape[-2]
    live = np.zeros(cache.shape[-4:-1], bool)[0]  # [P, page]
    for row, (lo, hi) in enumerate(zip(lo_by_cache_row, hi_by_cache_row)):
        for j in range(int(lo), int(hi)):
            live[tables[row, j // page], j % page] = True
    return np.where(live[:, :, None], cache, np.nan).astype(cache.dtype)


def windowed_case(rng, *, window: int, d: int, page: int, nb: int, k: int = 7, h: int = 4, g: int = 2,
                  rows: int = 8, scale: float = 0.3):
    """Inputs of a windowed draft-attention case and the float64 oracle's output: K = 7, shuffled block tables, a
    padding row, lengths 0 / 1 / 12 / around the window / a page boundary / full / random, anchors at or past the
    visible context; every cache position outside a row's ``[window start, length)`` is NaN. Returns ``(q, k_cache,
    v_cache, tables, lengths, k_blk, v_blk, cache_rows, query_positions, want, clean)`` (layer 1 of 2 holds the
    data; ``clean``: the two caches before the poisoning)."""
    full = nb * page
    q, kb, vb = inputs(rng, rows=rows, k=k, h=h, g=g, d=d)
    kc, vc, tables = paged_cache(rng, cache_rows=rows, max_blocks=nb, page=page, g=g, d=d, layers=2)
    cache_rows = np.arange(rows, dtype=np.int32)
    cache_rows[2] = -1  # a padding row
    lengths = np.array([0, 1, 12, min(window, full), page * 2, min(window + 1, full), full,
                        rng.integers(1, full)], np.int32)
    qpos = lengths.copy()
    qpos[4] += 5  # the anchor past the visible context
    qpos[7] += int(rng.integers(0, 9))
    want = oracle(q, dense_view(kc[1], tables), dense_view(vc[1], tables), lengths, kb, vb, scale, cache_rows,
                  window=window, qpos=qpos)
    lo = np.clip(qpos - window + 1, 0, lengths)
    lo_rows, hi_rows = np.where(cache_rows >= 0, lo, 0), np.where(cache_rows >= 0, lengths, 0)
    clean = (kc.copy(), vc.copy())
    kc = np.stack([poison_outside(kc[li], tables, lo_rows, hi_rows) for li in range(2)])
    vc = np.stack([poison_outside(vc[li], tables, lo_rows, hi_rows) for li in range(2)])
    return q, kc, vc, tables, lengths, kb, vb, cache_rows, qpos, want, clean


@pytest.mark.parametrize(
    "window, block_s, num_splits, seed",
    [(13, 8, 1, 3), (13, 4, 3, 4), (3, 8, 2, 5), (64, 8, 1, 6)],  # window < K and window past every context
)
def test_sliding_window_kernel_against_oracle_and_reference(window, block_s, num_splits, seed):
    """The windowed walk (the Qwen3-style drafter's non-causal sliding window): fp32, K = 7, shuffled block
    tables, a padding row, lengths 0 / 1 / window - 1 / window / window + 1 / a page boundary / full, slot-0
    positions equal to the lengths or past them (a context shorter than the anchor position); every position
    outside a row's ``[min window start, length)`` is NaN (the kernel must not read before the window either);
    outputs poisoned; fresh random inputs per case; the kernel, its jnp reference and the drafter's jnp path
    (a per-slot mask) against the float64 oracle."""
    rng = np.random.default_rng(seed)
    k, page, nb = 7, 8, 5
    full = nb * page
    q, kc, vc, tables, lengths, kb, vb, cache_rows, qpos, want, clean = windowed_case(rng, window=window, d=16,
                                                                                       page=page, nb=nb)
    config = DraftAttentionLaunchConfig(block_h=2, block_s=block_s, num_splits=num_splits, num_warps=4,
                                        num_stages=2)
    args = [jnp.asarray(a) for a in (q, kc, vc, tables, lengths, kb, vb, cache_rows, qpos)]
    out = np.asarray(da.draft_attention_pallas(*args, scale=0.3, layer=1, config=config, interpret=True,
                                               poison=True, window=window))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    ref = da.draft_attention_reference(*args[:7], scale=0.3, layer=1, cache_rows=args[7], window=window,
                                       query_positions=args[8])
    np.testing.assert_allclose(np.asarray(ref), want, atol=2e-5, rtol=2e-5)
    # without query_positions the slots follow the lengths
    out0 = da.draft_attention_pallas(*args[:8], scale=0.3, layer=1, config=config, interpret=True, poison=True,
                                     window=window)
    want0 = oracle(q, dense_view(clean[0][1], tables), dense_view(clean[1][1], tables), lengths, kb, vb, 0.3,
                   cache_rows, window=window)
    fine = qpos == lengths  # rows whose poison pattern does not depend on qpos
    np.testing.assert_allclose(np.asarray(out0)[fine], want0[fine], atol=2e-5, rtol=2e-5)
    # The drafter's jnp path: a per-slot [R, K, S] mask over the clean gathered context.
    safe_rows = np.maximum(cache_rows, 0)
    ends = np.where(cache_rows >= 0, lengths, 0)
    j = np.arange(full)[None, None, :]
    slot_pos = qpos[:, None] + np.arange(k)[None, :]
    visible = (j < ends[:, None, None]) & (j > slot_pos[:, :, None] - window)
    jnp_out = jax.jit(jnp_draft_attention, static_argnames="scale")(
        jnp.asarray(q), da.paged_context(jnp.asarray(clean[0][1]), jnp.asarray(tables[safe_rows])),
        da.paged_context(jnp.asarray(clean[1][1]), jnp.asarray(tables[safe_rows])), jnp.asarray(visible),
        jnp.asarray(kb), jnp.asarray(vb), scale=0.3)
    np.testing.assert_allclose(np.asarray(jnp_out), want, atol=2e-5, rtol=2e-5)


def test_split_k_head_chunks_bf16():
    """bf16, a one-layer [H_kv, P, page, D] cache on shuffled pages without a row map, 3 query heads per KV
    head in chunks of 2 (one masked head), the context split 3 ways (a split with no context step, the block
    keys in the last split only), lengths 0 / 1 / full / a partial page; NaN on every unowned position."""
    rng = np.random.default_rng(1)
    k, h, g, d, page, nb = 7, 6, 2, 16, 16, 3
    q, kb, vb = inputs(rng, rows=4, k=k, h=h, g=g, d=d)
    kc, vc, tables = paged_cache(rng, cache_rows=4, max_blocks=nb, page=page, g=g, d=d)
    lengths = np.array([0, 1, nb * page, 23], np.int32)
    kc, vc = poison_unowned(kc, tables, lengths), poison_unowned(vc, tables, lengths)
    q, kc, vc, kb, vb = (jnp.asarray(a, jnp.bfloat16) for a in (q, kc, vc, kb, vb))
    args = (q, kc, vc, jnp.asarray(tables), jnp.asarray(lengths), kb, vb)
    config = DraftAttentionLaunchConfig(block_h=2, block_s=16, num_splits=3, num_warps=4, num_stages=2)
    out = da.draft_attention_pallas(*args, scale=0.25, layer=None, config=config, interpret=True, poison=True)
    assert out.dtype == jnp.bfloat16
    f32 = [np.asarray(a.astype(jnp.float32)) for a in (q, kc, vc, kb, vb)]
    want = oracle(f32[0], np.nan_to_num(dense_view(f32[1], tables)), np.nan_to_num(dense_view(f32[2], tables)),
                  lengths, f32[3], f32[4], 0.25)
    got = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)  # bf16 p and output rounding


@pytest.mark.parametrize("chip", ["hopper", "cdna3"])
def test_lowers_for_gpu(chip):
    """Deviceless Triton lowering at M3 draft shapes: K = 7, 64 query / 4 KV heads of 128, 4K context on
    128-token pages of a 5-layer bf16 draft cache read through block tables, R = 512 (one split) and R = 64
    (split-K and the merge kernel)."""
    s = jax.ShapeDtypeStruct
    page, nb = 128, 33
    for rows in (512, 64):
        cache = s((5, 4, rows * nb + 1, page, 128), jnp.bfloat16)
        shapes = (
            s((rows, 7, 64, 128), jnp.bfloat16),
            cache,
            cache,
            s((rows, nb), jnp.int32),
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
            num_rows=rows, block_size=7, num_q_heads=64, num_kv_heads=4, capacity=nb * page, page_size=page,
            chip=chip
        )
        assert ("draft_attention_merge_splits" in text) == (config.num_splits > 1)


@pytest.mark.parametrize("chip", ["hopper", "cdna3"])
def test_sliding_window_lowers_for_gpu(chip):
    """The windowed walk at the Qwen3-style drafter's shapes (nvidia/MiniMax-M3-DSpark: K = 8, 32 query / 8 KV
    heads of 128, window 1024) over 4K contexts on 128-token pages, R = 64, deviceless for CUDA and ROCm."""
    s = jax.ShapeDtypeStruct
    page, nb, rows = 128, 33, 64
    cache = s((6, 8, rows * nb + 1, page, 128), jnp.bfloat16)
    shapes = (s((rows, 8, 32, 128), jnp.bfloat16), cache, cache, s((rows, nb), jnp.int32), s((rows,), jnp.int32),
              s((rows, 8, 8, 128), jnp.bfloat16), s((rows, 8, 8, 128), jnp.bfloat16), s((rows,), jnp.int32))

    def windowed(*a, **kw):  # query_positions traced (lower_for_gpu closes over keyword arguments)
        return da.draft_attention(*a[:7], query_positions=a[7], **kw)

    text = lower_for_gpu(windowed, *shapes, platform=tuning.chip_platform(chip), scale=128**-0.5, layer=5,
                         window=1024, interpret=False, chip=chip)
    assert "triton" in text.lower() and "_window" in text


def test_launch_policy():
    m3 = {"block_size": 7, "num_q_heads": 64, "num_kv_heads": 4, "capacity": 4224, "page_size": 128,
          "head_dim": 128}
    big = draft_attention_launch_config(num_rows=512, chip="hopper", **m3)
    assert (big.block_h, big.block_s, big.num_splits, big.num_warps) == (16, 128, 1, 8)  # the H200 sweep: whole pages
    assert tuning.draft_attention_rows(7, big.block_h) == 128
    assert draft_attention_launch_config(num_rows=64, chip="hopper", **m3).num_splits == 2
    for chip in tuning.CHIPS:
        pol = tuning.TABLES[chip].draft_attention
        for rows in (1, 64, 512):
            for page in (16, 128):
                c = draft_attention_launch_config(num_rows=rows, chip=chip, **{**m3, "page_size": page})
                assert c.block_s >= tuning.MIN_DOT_DIM and not c.block_s & (c.block_s - 1)
                assert page % c.block_s == 0  # a step never crosses a page
                assert c.num_warps <= 8 and not c.num_warps & (c.num_warps - 1)
                assert 1 <= c.num_splits <= pol.max_splits
                assert 128 * 128 * 2 + c.num_stages * 2 * c.block_s * 128 * 2 <= pol.smem_bytes
    # A large group is cut into head chunks that fit max_rows; a short capacity or a small page shrinks the step.
    wide = draft_attention_launch_config(
        num_rows=8, block_size=7, num_q_heads=64, num_kv_heads=1, capacity=20, page_size=128
    )
    assert tuning.draft_attention_rows(7, wide.block_h) <= 128 and wide.block_s == 16
    assert draft_attention_launch_config(num_rows=8, chip="hopper", **{**m3, "page_size": 4}).block_s == 4


def test_supports_and_errors():
    m3 = {"head_dim": 128, "num_q_heads": 64, "num_kv_heads": 4, "block_size": 7, "page_size": 128}
    assert da.supports(dtype=jnp.bfloat16, **m3) and da.supports(dtype=jnp.float32, chip="cdna3", **m3)
    assert not da.supports(dtype=jnp.float16, **{**m3, "head_dim": 8})
    assert da.supports(dtype=jnp.float16, interpret=True, **{**m3, "head_dim": 8})
    assert not da.supports(dtype=jnp.bfloat16, **{**m3, "page_size": 8})  # a compiled step is >= 16 keys
    assert da.supports(dtype=jnp.bfloat16, interpret=True, **{**m3, "page_size": 4})
    assert not da.supports(dtype=jnp.bfloat16, interpret=True, **{**m3, "page_size": 24})
    assert not da.supports(dtype=jnp.int8, interpret=True, **m3)
    assert not da.supports(dtype=jnp.bfloat16, **{**m3, "num_q_heads": 63})
    s = jax.ShapeDtypeStruct
    q, kb = s((2, 7, 4, 16), jnp.float32), s((2, 7, 2, 16), jnp.float32)
    cache5, lens, bt = s((3, 2, 9, 8, 16), jnp.float32), s((2,), jnp.int32), s((2, 4), jnp.int32)

    def call(*a, **kw):
        return jax.eval_shape(lambda *x: da.draft_attention(*x, scale=1.0, **kw), *a)

    with pytest.raises(ValueError, match="layer"):
        call(q, cache5, cache5, bt, lens, kb, kb)
    with pytest.raises(ValueError, match="k_blk"):
        call(q, cache5, cache5, bt, lens, q, q, layer=0)
    with pytest.raises(ValueError, match="implementation"):
        call(q, cache5, cache5, bt, lens, kb, kb, layer=0, implementation="triton")
    with pytest.raises(ValueError, match="block_tables must be int32"):
        call(q, cache5, cache5, s((2,), jnp.int32), lens, kb, kb, layer=0)
    with pytest.raises(ValueError, match="block tables must hold R=2 rows"):
        call(q, cache5, cache5, s((3, 4), jnp.int32), lens, kb, kb, layer=0)
    with pytest.raises(ValueError, match="k_cache must be paged"):
        call(q, s((2, 9, 2, 16), jnp.float32), s((2, 9, 2, 16), jnp.float32), bt, lens, kb, kb, layer=0)
    config = DraftAttentionLaunchConfig(block_h=2, block_s=16, num_splits=1, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="must divide the page size"):
        jax.eval_shape(lambda *x: da.draft_attention_pallas(*x, scale=1.0, layer=0, config=config, interpret=True),
                       q, cache5, cache5, bt, lens, kb, kb)


def test_choose_implementation():
    cfg = MiniMaxM3Config.tiny()
    kw = {"block_size": 7, "page_size": 16, "dtype": jnp.bfloat16}
    assert choose_implementation("auto", cfg, **kw) == "reference"  # no GPU here
    assert choose_implementation("auto", cfg, interpret=True, **kw) == "pallas"
    assert choose_implementation("pallas", cfg, **kw) == "pallas"
    with pytest.raises(ValueError, match="implementation"):
        choose_implementation("triton", cfg, **kw)


def test_drafter_block_hidden_with_the_kernel():
    """block_hidden through the kernel (interpret mode) equals the jnp path on a paged cache with shuffled
    tables, also with a row map (padding row -1, rows in another order) that the jnp path serves by gathering
    the tables; and both equal a cache whose rows were laid out by hand in that order on the trivial table."""
    from scripts.profile_step import make_random, normal_arrays

    target = MiniMaxM3Config.tiny()
    cfg = DSparkConfig.for_target(
        target, mask_token_id=3, block_size=7, num_draft_layers=2, target_layer_ids=(1, 3)
    )
    drafter = make_random(DSparkDrafter, cfg, dtype=jnp.float32, seed=0, stddev=0.2)
    c = cfg.layer_config
    rows, page, nb = 4, 4, 3  # the tiny config's 4-token pages: 12 positions per row
    num_pages = rows * nb + 2
    kc, vc = normal_arrays([((2, c.num_key_value_heads, num_pages, page, c.head_dim), jnp.float32)] * 2, seed=1)
    tables = np.random.default_rng(2).permutation(num_pages)[: rows * nb].reshape(rows, nb).astype(np.int32)
    lengths = jnp.asarray([5, 0, 12, 9], jnp.int32)
    cache = DraftCache(kc, vc, lengths, jnp.asarray(tables))
    anchors = jnp.asarray([5, 9, 1, 100], jnp.int32)
    positions = jnp.asarray([5, 3, 12, 7], jnp.int32)  # row 3 drafts before its cached length
    cache_rows = jnp.asarray([2, -1, 0, 3], jnp.int32)

    # The row map by hand: row 1 (-1) has no context, row 0 reads cache row 2 (length 12, capped at anchor 5).
    order = np.array([2, 0, 0, 3])
    plain = DraftCache(kc, vc, jnp.asarray([12, 0, 5, 9], jnp.int32), jnp.asarray(tables[order]))

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
