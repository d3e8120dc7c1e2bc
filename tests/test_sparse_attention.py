"""Ragged block-sparse attention: Pallas kernel (interpret mode) == jnp reference == a naive per-token oracle.

Small shapes (page 4..16, D 16..32, groups of 2..4) keep interpret mode fast. Every batch is built to catch
the classic failures: shuffled page tables whose unused entries point at NaN pages (a read through a -1 slot,
past a request's own rows or through an unused entry turns the output NaN), stale finite garbage in the slots
past ``seq_len`` of a request's last page (a missing causal mask shows up as a large error), NaN queries and
garbage selections in padding slots, contexts that are not a multiple of the page, q lengths 1..8 with
zero-length rows, -1 tails and prefill chunks. Output buffers are poisoned with NaN before the kernel runs
where the test asks for it (``poison=``, aliased into the kernel), so an unwritten row is caught.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention_walk, tuning
from pallas_kernels import sparse_attention as sa
from pallas_kernels._common import num_tiles_bound, tile_table, window_walk_bound
from pallas_kernels.platform import lower_for_gpu
from pallas_kernels.sparse_attention import (
    ragged_sparse_attention,
    ragged_sparse_attention_reference,
    union_block_counts,
)
from pallas_kernels.tuning import (
    AttentionLaunchConfig,
    paged_attention_launch_config,
    sparse_attention_launch_config,
)

# ------------------------------------------------------------------------------------------------------------
# Oracle and batch builder (shared with test_paged_attention.py).
# ------------------------------------------------------------------------------------------------------------


def naive_attention(q, kc, vc, bt, seq_lens, qsl, sel, *, scale, window=None):
    """By definition, one (token, query head) at a time in float64. ``sel=None`` means every block (dense);
    ``window``: only the keys ``pos - window < j <= pos``."""
    q = np.asarray(q, np.float64)
    kc = np.asarray(kc, np.float64)
    vc = np.asarray(vc, np.float64)
    t_cap, h_q, d = q.shape
    h_kv, _, page, _ = kc.shape
    group = h_q // h_kv
    out = np.zeros((t_cap, h_q, d))
    for r in range(len(seq_lens)):
        q_len = int(qsl[r + 1] - qsl[r])
        for i in range(q_len):
            t = int(qsl[r]) + i
            pos = int(seq_lens[r]) - q_len + i
            for qh in range(h_q):
                g = qh // group
                chosen = range(pos // page + 1) if sel is None else {int(b) for b in sel[t, g] if b >= 0}
                lo = 0 if window is None else max(0, pos - window + 1)
                keys = [j for j in range(lo, pos + 1) if j // page in chosen]
                if not keys:
                    continue
                k = np.stack([kc[g, bt[r, j // page], j % page] for j in keys])
                v = np.stack([vc[g, bt[r, j // page], j % page] for j in keys])
                s = k @ q[t, qh] * scale
                p = np.exp(s - s.max())
                out[t, qh] = p @ v / p.sum()
    return out


def make_batch(
    rng,
    *,
    q_lens,
    seq_lens,
    page,
    dim,
    kv_heads=2,
    group=2,
    topk=3,
    pad_slots=3,
    dtype=np.float32,
    correlated=True,
    neg_tail_prob=0.2,
    spare_pages=3,
):
    """A ragged batch honouring docs/ARCHITECTURE.md, with traps for out-of-contract reads (see module
    docstring)."""
    q_lens = np.asarray(q_lens, np.int32)
    seq_lens = np.asarray(seq_lens, np.int32)
    num_rows = len(q_lens)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1]) + pad_slots
    blocks_per_row = [-(-int(s) // page) for s in seq_lens]
    max_blocks = max(max(blocks_per_row) + 2, 1)
    used = sum(blocks_per_row)
    num_pages = used + spare_pages
    perm = rng.permutation(num_pages)
    nan_pages = perm[used:]  # pages no request owns: NaN, so any read of them shows up
    tables = np.empty((num_rows, max_blocks), np.int32)
    off = 0
    for r, nb in enumerate(blocks_per_row):
        tables[r, :nb] = perm[off : off + nb]
        tables[r, nb:] = rng.choice(nan_pages, max_blocks - nb)  # unused entries: NaN pages
        off += nb
    kc = rng.standard_normal((kv_heads, num_pages, page, dim))
    # V at half scale: with only a few dozen keys per query the outputs are larger than in real attention
    # (|o| ~ 0.3 at unit scale), and bf16 output rounding alone (~|o| * 2**-10 on average) would then use up
    # the 3e-4 mean tolerance before the kernel adds any error of its own.
    vc = 0.5 * rng.standard_normal((kv_heads, num_pages, page, dim))
    kc[:, nan_pages] = np.nan
    vc[:, nan_pages] = np.nan
    for r, s in enumerate(seq_lens):  # stale (finite, large) data past seq_len in the last page
        if s % page:
            kc[:, tables[r, s // page], s % page :] = 30.0
            vc[:, tables[r, s // page], s % page :] = 1e3
    q = rng.standard_normal((num_tokens, kv_heads * group, dim))
    q[qsl[-1] :] = np.nan  # padding slots: garbage queries must not leak

    sel = np.full((num_tokens, kv_heads, topk), -1, np.int32)
    sel[qsl[-1] :] = rng.integers(0, max_blocks, (pad_slots, kv_heads, topk))  # garbage in padding slots
    for r in range(num_rows):
        ql = int(q_lens[r])
        n_ctx = blocks_per_row[r]
        base = rng.standard_normal((kv_heads, max(n_ctx, 1)))
        for i in range(ql):
            t = int(qsl[r]) + i
            pos = int(seq_lens[r]) - ql + i
            nb = pos // page + 1
            for g in range(kv_heads):
                noise = 0.3 if correlated else 3.0
                score = base[g, :nb] + noise * rng.standard_normal(nb)
                score[nb - 1] = np.inf  # the local block is always selected
                order = np.argsort(-score, kind="stable")
                k = min(topk, nb)
                if rng.random() < neg_tail_prob and k > 1:
                    k -= 1  # an extra -1 tail even though more blocks are visible
                sel[t, g, :k] = order[:k]
    cast = (
        (lambda a: jnp.asarray(a, jnp.bfloat16))
        if dtype == "bf16"
        else (lambda a: jnp.asarray(a, jnp.float32))
    )
    return {
        "q": cast(q),
        "k_cache": cast(kc),
        "v_cache": cast(vc),
        "block_tables": jnp.asarray(tables),
        "seq_lens": jnp.asarray(seq_lens),
        "query_start_loc": jnp.asarray(qsl),
        "block_indices": jnp.asarray(sel),
    }


ARG_ORDER = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc", "block_indices")


def args_of(batch, dense=False):
    names = ARG_ORDER[:-1] if dense else ARG_ORDER
    return [batch[n] for n in names]


def oracle(batch, scale, dense=False, window=None):
    b = {
        k: np.asarray(v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v)
        for k, v in batch.items()
    }
    return naive_attention(
        b["q"],
        b["k_cache"],
        b["v_cache"],
        b["block_tables"],
        b["seq_lens"],
        b["query_start_loc"],
        None if dense else b["block_indices"],
        scale=scale,
        window=window,
    )


def assert_close(out, expected, dtype, num_valid, *, bf16_mean_tol=3e-4):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert not np.isnan(out).any(), "NaN in the output"
    assert np.all(out[num_valid:] == 0.0), "padding slots must be exact zeros"
    err = np.abs(out - expected)
    if dtype == "bf16":
        assert err.max() <= 2e-2, f"bf16 max abs err {err.max():.3g}"
        assert err.mean() <= bf16_mean_tol, f"bf16 mean abs err {err.mean():.3g}"
    else:
        assert err.max() <= 1e-5, f"f32 max abs err {err.max():.3g}"


# Mixed verification batch: q lengths 1..8, zero-length rows, contexts not a multiple of the page.
VERIFY = {"q_lens": [3, 0, 1, 8, 5, 0, 2], "seq_lens": [37, 0, 9, 70, 44, 0, 23]}


# ------------------------------------------------------------------------------------------------------------
# The reference against the oracle.
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("correlated", [True, False])
def test_reference_matches_naive_oracle(correlated):
    rng = np.random.default_rng(1 + correlated)
    batch = make_batch(rng, **VERIFY, page=8, dim=16, kv_heads=2, group=3, topk=3, correlated=correlated)
    scale = 16**-0.5
    ref = ragged_sparse_attention_reference(*args_of(batch), scale=scale)
    assert_close(ref, oracle(batch, scale), "f32", int(batch["query_start_loc"][-1]))


def test_reference_treats_selection_as_a_set():
    """A repeated block id counts once (the selection is a set of blocks), in the reference and the kernel."""
    rng = np.random.default_rng(3)
    batch = make_batch(rng, q_lens=[2], seq_lens=[30], page=8, dim=16, kv_heads=1, group=2, topk=4)
    sel = np.asarray(batch["block_indices"]).copy()
    sel[0, 0] = [1, 1, 0, 1]
    sel[1, 0] = [3, 3, -1, -1]
    batch["block_indices"] = jnp.asarray(sel)
    scale = 0.25
    expected = oracle(batch, scale)
    assert_close(ragged_sparse_attention_reference(*args_of(batch), scale=scale), expected, "f32", 2)
    assert_close(ragged_sparse_attention(*args_of(batch), scale=scale, block_q=2), expected, "f32", 2)


# ------------------------------------------------------------------------------------------------------------
# The kernel against the reference.
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, page, dim, kv_heads, group, topk, block_q, num_splits, block_k",
    [
        ("f32", 8, 16, 2, 2, 3, 4, 1, 8),
        ("f32", 4, 32, 1, 4, 4, 8, 3, 2),
        ("f32", 16, 16, 2, 3, 2, 1, 2, 4),
        ("bf16", 8, 32, 2, 4, 3, 8, 1, 4),
        ("bf16", 16, 16, 2, 2, 4, 2, 4, 16),
    ],
)
def test_kernel_matches_reference_verify_batch(
    dtype, page, dim, kv_heads, group, topk, block_q, num_splits, block_k
):
    rng = np.random.default_rng(hash((dtype, page, dim, block_q)) % 2**32)
    batch = make_batch(
        rng, **VERIFY, page=page, dim=dim, kv_heads=kv_heads, group=group, topk=topk, dtype=dtype
    )
    scale = dim**-0.5
    config = AttentionLaunchConfig(
        block_q=block_q, num_splits=num_splits, num_warps=4, num_stages=2, block_k=block_k
    )
    out = sa.ragged_sparse_attention_pallas(
        *args_of(batch), scale=scale, config=config, interpret=True, poison=True
    )
    assert out.dtype == batch["q"].dtype
    ref = ragged_sparse_attention_reference(*args_of(batch), scale=scale)
    num_valid = int(batch["query_start_loc"][-1])
    expected = np.asarray(ref.astype(jnp.float32), np.float64) if dtype == "f32" else oracle(batch, scale)
    assert_close(out, expected, dtype, num_valid)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_prefill_chunk_and_decode_rows(dtype):
    """A long q_len (prefill chunk of 21 tokens, tiled by block_q) next to decode rows, public entry point."""
    rng = np.random.default_rng(7)
    batch = make_batch(
        rng,
        q_lens=[21, 1, 0, 1],
        seq_lens=[50, 33, 0, 5],
        page=8,
        dim=16,
        kv_heads=2,
        group=2,
        topk=3,
        dtype=dtype,
        pad_slots=5,
    )
    scale = 0.3
    out = ragged_sparse_attention(*args_of(batch), scale=scale, block_q=4, num_splits=2)
    assert_close(out, oracle(batch, scale), dtype, 23)


def test_default_policy_and_no_padding_slots():
    """Default launch settings; T == qsl[R] (no padding tail); a token whose selection is all -1 gets
    zeros."""
    rng = np.random.default_rng(11)
    batch = make_batch(
        rng, q_lens=[2, 4], seq_lens=[20, 41], page=4, dim=16, kv_heads=2, group=2, topk=4, pad_slots=0
    )
    sel = np.asarray(batch["block_indices"]).copy()
    sel[3, 1] = -1  # token 3, KV group 1: nothing selected -> zero output for heads 2, 3
    batch["block_indices"] = jnp.asarray(sel)
    scale = 0.25
    out = ragged_sparse_attention(*args_of(batch), scale=scale)
    expected = oracle(batch, scale)
    assert np.all(expected[3, 2:] == 0)
    assert_close(out, expected, "f32", 6)
    ref = ragged_sparse_attention(*args_of(batch), scale=scale, implementation="reference")
    assert_close(ref, expected, "f32", 6)


def test_all_padding_batch_is_zero():
    rng = np.random.default_rng(5)
    batch = make_batch(
        rng, q_lens=[0, 0], seq_lens=[0, 0], page=4, dim=16, kv_heads=1, group=2, pad_slots=4, spare_pages=2
    )
    out = sa.ragged_sparse_attention_pallas(
        *args_of(batch), scale=0.2, config=AttentionLaunchConfig(2, 2, 4, 2, 2), interpret=True, poison=True
    )
    assert np.all(np.asarray(out) == 0.0)


# ------------------------------------------------------------------------------------------------------------
# Sliding window.
# ------------------------------------------------------------------------------------------------------------


def poison_before_window(batch, window):
    """NaN K and V in every page that ends before the window of its request's first new token: the windowed
    kernels must never read them (a read turns the output NaN, masked or not)."""
    page = batch["k_cache"].shape[2]
    kc, vc = np.array(batch["k_cache"], np.float32), np.array(batch["v_cache"], np.float32)
    qsl, seq, tables = (np.asarray(batch[k]) for k in ("query_start_loc", "seq_lens", "block_tables"))
    poisoned = 0
    for r in range(len(seq)):
        first = int(seq[r]) - int(qsl[r + 1] - qsl[r])  # position of the row's first new token
        for b in range(max(0, first - window + 1) // page):
            kc[:, tables[r, b]] = np.nan
            vc[:, tables[r, b]] = np.nan
            poisoned += 1
    dtype = batch["k_cache"].dtype
    return {**batch, "k_cache": jnp.asarray(kc, dtype), "v_cache": jnp.asarray(vc, dtype)}, poisoned


def windowed_bf16_tol(ref, expected):
    """bf16 mean-error tolerance of a windowed case: a few keys per query give larger outputs than the
    unwindowed batches (whose 3e-4 budget is mostly output rounding), so allow twice the error of the bf16
    reference itself (f32 math, one rounding of the output), at least the usual 3e-4."""
    floor = np.abs(np.asarray(jnp.asarray(ref, jnp.float32), np.float64) - expected).mean()
    return max(3e-4, 2 * floor)


def windowed_ref_tol(expected, num_valid):
    """bf16 mean-error tolerance of the reference on a windowed case. With a few keys per query the outputs are
    larger than on the unwindowed batches, and the reference's error (bf16 inputs, f32 math, bf16 rounding) scales
    with them: 1.1e-3 of the mean |output| (median of 40 random batches; at most 1.22e-3) against 3e-4 absolute,
    which random inputs crossed about once in a hundred runs. Allowed: 2^-9 of the mean |output|, at least the
    usual 3e-4; a wrong window or block moves the error by the order of the outputs themselves."""
    return max(3e-4, 2.0 ** -9 * float(np.abs(expected[:num_valid]).mean()))


# Windows of one key, a page, not a multiple of the page, and past every context (the whole causal range).
WINDOWED = [
    # dtype, page, window, block_q, num_splits, block_k
    ("f32", 4, 1, 4, 1, 4),
    ("f32", 8, 8, 2, 3, 4),
    ("bf16", 4, 6, 8, 2, 2),
    ("f32", 8, 13, 1, 2, 8),
    ("f32", 4, 200, 4, 1, 2),
]


@pytest.mark.parametrize("dtype, page, window, block_q, num_splits, block_k", WINDOWED)
def test_windowed_kernel_matches_oracle(dtype, page, window, block_q, num_splits, block_k):
    """A token sees its last ``window`` positions of its selected blocks: kernel (poisoned outputs, NaN pages
    before every window) == reference == the float64 oracle, on the mixed verification batch (padding slots,
    zero-length rows, contexts not a multiple of the page)."""
    rng = np.random.default_rng(hash((dtype, page, window, block_q)) % 2**32)
    batch = make_batch(rng, **VERIFY, page=page, dim=16, kv_heads=2, group=2, topk=3, dtype=dtype)
    batch, poisoned = poison_before_window(batch, window)
    assert poisoned > 0 or window >= 70
    scale = 0.25
    if poisoned:  # positive control: without the window the poisoned pages are read
        assert np.isnan(np.asarray(ragged_sparse_attention_reference(*args_of(batch), scale=scale))).any()
    expected = oracle(batch, scale, window=window)
    num_valid = int(batch["query_start_loc"][-1])
    config = AttentionLaunchConfig(block_q=block_q, num_splits=num_splits, num_warps=4, num_stages=2,
                                   block_k=block_k)
    out = sa.ragged_sparse_attention_pallas(
        *args_of(batch), scale=scale, config=config, interpret=True, poison=True, window=window
    )
    ref = ragged_sparse_attention_reference(*args_of(batch), scale=scale, window=window)
    assert_close(ref, expected, dtype, num_valid, bf16_mean_tol=windowed_ref_tol(expected, num_valid))
    assert_close(out, expected, dtype, num_valid, bf16_mean_tol=windowed_bf16_tol(ref, expected))
    if window >= 70:  # the whole causal range: the window changes nothing
        assert_close(ref, oracle(batch, scale), dtype, num_valid)


def test_windowed_union_drops_blocks_before_every_window():
    """With a window the pre-pass leaves out the selected blocks that end before the tile's first window."""
    rng = np.random.default_rng(41)
    page, window, block_q = 4, 6, 4
    batch = make_batch(rng, q_lens=[8, 1, 0, 3], seq_lens=[40, 17, 0, 26], page=page, dim=16, kv_heads=2, topk=4)
    sel = np.asarray(batch["block_indices"])
    config = AttentionLaunchConfig(block_q=block_q, num_splits=1, num_warps=4, num_stages=2)
    tiles, counts, union = (
        np.asarray(x)
        for x in sa._tile_union_prepass(
            batch["query_start_loc"], batch["seq_lens"], batch["block_tables"], batch["block_indices"],
            num_tokens=sel.shape[0], page=page, config=config, interpret=True, window=window,
        )
    )
    dropped = 0
    for i, (req, tok0, ntok, pos0) in enumerate(tiles):
        for g in range(sel.shape[1]):
            if req < 0 or ntok == 0:
                assert counts[i, g].tolist() == [0, 0]
                continue
            lo, hi = max(0, pos0 - window + 1) // page, (pos0 + ntok - 1) // page
            chosen = {int(b) for t in range(ntok) for b in sel[tok0 + t, g] if 0 <= b <= hi}
            blocks = sorted(b for b in chosen if b >= lo)
            dropped += len(chosen) - len(blocks)
            assert counts[i, g].tolist() == [sum(b < (pos0 + 1) // page for b in blocks), len(blocks)]
            np.testing.assert_array_equal(union[i, g, 1, : len(blocks)], blocks)
    assert dropped > 0


def test_window_bounds_the_walk_the_launch_policy_sees():
    """Split-K is sized for the blocks a one-token window touches, not the table's width."""
    assert window_walk_bound(256, 128, None) == 256
    assert window_walk_bound(256, 128, 4000) == 33  # cdiv(3999, 128) + 1
    assert window_walk_bound(256, 128, 1) == 1 and window_walk_bound(256, 128, 129) == 2  # 129 keys: 2 pages
    assert window_walk_bound(256, 128, 130) == 3
    assert window_walk_bound(4, 128, 10**6) == 4
    sparse = {"num_q_heads": 64, "num_kv_heads": 4, "topk": 16, "chip": "hopper", "num_tokens": 1, "num_requests": 1}
    full = sparse_attention_launch_config(max_blocks=256, **sparse)
    small = sparse_attention_launch_config(max_blocks=window_walk_bound(256, 128, 129), **sparse)
    assert small.num_splits <= 2 < full.num_splits


def test_bad_window_raises():
    b = make_batch(np.random.default_rng(8), q_lens=[2], seq_lens=[10], page=4, dim=16)
    for fn in (ragged_sparse_attention, ragged_sparse_attention_reference):
        for bad in (0, -3, True, 2.5, "8"):
            with pytest.raises(ValueError, match="window"):
                fn(*args_of(b), scale=0.1, window=bad)


# ------------------------------------------------------------------------------------------------------------
# Tiling, bytes model, policy, validation, lowering.
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_q", [1, 2, 8])
def test_tile_table_covers_every_slot_once(block_q):
    rng = np.random.default_rng(block_q)
    for _ in range(3):
        q_lens = rng.integers(0, 12, rng.integers(1, 7))
        seq_lens = q_lens + rng.integers(0, 50, len(q_lens))
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        num_tokens = int(qsl[-1]) + int(rng.integers(0, 9))
        num_tiles = num_tiles_bound(num_tokens, len(q_lens), block_q)
        tiles = np.asarray(
            tile_table(jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), num_tokens, block_q, num_tiles)
        )
        owner = np.full(num_tokens, -2)
        for req, start, length, pos0 in tiles:
            assert 0 <= length <= block_q
            for i in range(length):
                t = start + i
                assert owner[t] == -2, "a token covered twice"
                owner[t] = req
                if req >= 0:
                    assert qsl[req] <= t < qsl[req + 1]
                    assert pos0 + i == seq_lens[req] - q_lens[req] + (t - qsl[req])
                else:
                    assert t >= qsl[-1]
        assert np.all(owner != -2), "a token not covered"


@pytest.mark.parametrize("block_q, chunk_elements", [(4, 64), (8, 8192), (32, 256)])
def test_union_prepass_matches_sets(block_q, chunk_elements, monkeypatch):
    """The pre-pass writes, per (tile, KV head), the union of the tile's visible selections in ascending block
    order with each block's token bitmask and physical page, and counts the past blocks (those ending at or
    before the tile's first position). Small ``chunk_elements`` walks the block ids in several chunks;
    block_q = 32 sets bit 31 of the int32 masks."""
    monkeypatch.setattr(sa, "_PREPASS_CHUNK_ELEMENTS", chunk_elements)
    rng = np.random.default_rng(block_q)
    q_lens, seq_lens = (
        ([3, 0, 1, 8, 5, 0, 2], [37, 0, 9, 70, 44, 0, 23]) if block_q < 32 else ([35, 2], [60, 9])
    )
    batch = make_batch(rng, q_lens=q_lens, seq_lens=seq_lens, page=4, dim=16, kv_heads=2, group=2, topk=3)
    sel = np.array(batch["block_indices"])
    tables = np.asarray(batch["block_tables"])
    sel[3, 1, 1] = sel[3, 1, 0]  # a repeat inside one token's list counts once
    num_tokens = sel.shape[0]
    config = AttentionLaunchConfig(block_q=block_q, num_splits=1, num_warps=4, num_stages=2)
    tiles, counts, union = (
        np.asarray(x)
        for x in sa._tile_union_prepass(
            batch["query_start_loc"],
            batch["seq_lens"],
            batch["block_tables"],
            jnp.asarray(sel),
            num_tokens=num_tokens,
            page=4,
            config=config,
            interpret=True,
        )
    )
    expected_tiles = np.asarray(
        tile_table(batch["query_start_loc"], batch["seq_lens"], num_tokens, block_q, tiles.shape[0])
    )
    np.testing.assert_array_equal(tiles[:, [0, 2, 3]], expected_tiles[:, [0, 2, 3]])
    live = tiles[:, 2] > 0
    np.testing.assert_array_equal(tiles[live, 1], expected_tiles[live, 1])
    for i, (req, tok0, ntok, pos0) in enumerate(tiles):
        for g in range(sel.shape[1]):
            if req < 0 or ntok == 0:
                assert counts[i, g].tolist() == [0, 0]
                continue
            n_visible = (pos0 + ntok - 1) // 4 + 1
            masks = {}
            for t in range(ntok):
                for b in sel[tok0 + t, g]:
                    if 0 <= b < n_visible:
                        masks[int(b)] = masks.get(int(b), 0) | (1 << t)
            blocks = sorted(masks)
            n = len(blocks)
            assert counts[i, g].tolist() == [sum(b < (pos0 + 1) // 4 for b in blocks), n]
            np.testing.assert_array_equal(union[i, g, 1, :n], blocks)
            np.testing.assert_array_equal(union[i, g, 0, :n], tables[req, blocks])
            expected_masks = np.asarray([masks[b] for b in blocks], np.int64).astype(np.uint32).view(np.int32)
            np.testing.assert_array_equal(union[i, g, 2, :n], expected_masks)


def test_block_q_32_kernel_matches_oracle():
    """32-token tiles: the token mask uses all 32 bits of an int32 (bit 31 is the sign bit)."""
    rng = np.random.default_rng(32)
    batch = make_batch(rng, q_lens=[33, 1], seq_lens=[50, 7], page=4, dim=16, kv_heads=1, group=2, topk=3)
    out = ragged_sparse_attention(*args_of(batch), scale=0.25, block_q=32, block_k=4, num_stages=2)
    assert_close(out, oracle(batch, 0.25), "f32", 34)


def test_union_block_counts_match_sets():
    rng = np.random.default_rng(2)
    batch = make_batch(rng, **VERIFY, page=8, dim=16, kv_heads=2, group=2, topk=3)
    counts = np.asarray(
        union_block_counts(
            batch["query_start_loc"], batch["seq_lens"], batch["block_indices"], page=8, block_q=8
        )
    )
    qsl, seq, sel = (np.asarray(batch[k]) for k in ("query_start_loc", "seq_lens", "block_indices"))
    expected = []
    for r in range(len(seq)):
        for start in range(qsl[r], qsl[r + 1], 8):
            toks = range(start, min(start + 8, qsl[r + 1]))
            for g in range(sel.shape[1]):
                expected.append(len({int(b) for t in toks for b in sel[t, g] if b >= 0}))
    assert sorted(counts[counts > 0].tolist()) == sorted(x for x in expected if x > 0)
    assert counts.sum() == sum(expected)


def test_launch_policy():
    m3 = {"num_q_heads": 64, "num_kv_heads": 4}
    sparse = {**m3, "topk": 16}
    verify = sparse_attention_launch_config(
        chip="hopper", num_tokens=4096, num_requests=512, max_blocks=32, **sparse
    )
    # 4 tokens x 16 heads = 64-row tiles, one warpgroup (two programs per SM), 32-key steps.
    assert (verify.block_q, verify.num_splits, verify.num_warps, verify.block_k) == (4, 1, 4, 32)
    # The query tile plus num_stages K/V buffers fit the shared-memory budget.
    rows = verify.block_q * 16
    smem = rows * 128 * 2 + verify.num_stages * 2 * verify.block_k * 128 * 2
    assert smem <= tuning.TABLES["hopper"].sparse_attention.smem_bytes
    dense = paged_attention_launch_config(
        chip="hopper", num_tokens=4096, num_requests=512, max_blocks=32, **m3
    )
    assert (dense.block_q, dense.num_warps) == (8, 8)  # dense tiles: 128 rows, two warpgroups
    decode = sparse_attention_launch_config(chip="hopper", num_tokens=512, num_requests=512, max_blocks=32, **sparse)
    assert (decode.block_q, decode.num_splits) == (1, 1)
    single = sparse_attention_launch_config(chip="hopper", num_tokens=8, num_requests=1, max_blocks=256, **sparse)
    assert single.block_q == 4 and single.num_splits > 1
    rocm = sparse_attention_launch_config(chip="cdna3", num_tokens=8, num_requests=1, max_blocks=256, **sparse)
    assert rocm.num_warps <= 16 and rocm.num_splits > 1
    override = sparse_attention_launch_config(
        chip="hopper",
        num_tokens=8,
        num_requests=1,
        max_blocks=256,
        block_q=2,
        num_splits=3,
        num_warps=2,
        num_stages=1,
        block_k=32,
        **sparse,
    )
    assert override == AttentionLaunchConfig(2, 3, 2, 1, 32)
    with pytest.raises(ValueError, match="chip"):
        sparse_attention_launch_config(chip="rocm", num_tokens=8, num_requests=1, max_blocks=4, **sparse)


def test_bad_inputs_raise_value_errors():
    rng = np.random.default_rng(0)
    b = make_batch(rng, q_lens=[2], seq_lens=[10], page=4, dim=16, kv_heads=2, group=2)
    a = args_of(b)
    with pytest.raises(ValueError, match="block_indices"):
        ragged_sparse_attention(*a[:-1], a[-1][:, :1], scale=0.1)
    with pytest.raises(ValueError, match="query_start_loc"):
        ragged_sparse_attention(*a[:5], a[5][:-1], a[6], scale=0.1)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        ragged_sparse_attention(a[0][:, :3], *a[1:], scale=0.1)
    with pytest.raises(ValueError, match="v_cache"):
        ragged_sparse_attention(a[0], a[1], a[2][:, :, :2], *a[3:], scale=0.1)
    with pytest.raises(ValueError, match="page size"):
        ragged_sparse_attention(a[0], a[1][:, :, :3], a[2][:, :, :3], *a[3:], scale=0.1)
    with pytest.raises(ValueError, match="implementation"):
        ragged_sparse_attention(*a, scale=0.1, implementation="cuda")
    with pytest.raises(ValueError, match="block_q"):
        ragged_sparse_attention(*a, scale=0.1, block_q=3)
    with pytest.raises(ValueError, match="block_k"):
        ragged_sparse_attention(*a, scale=0.1, block_k=3)


@pytest.mark.parametrize("chip", ["hopper", "cdna3"])
def test_lowers_for_gpu(chip):
    """Deviceless Triton lowering at M3 TP1 shapes (64/4 heads of 128, topk 16, page 128, bf16), for each
    platform with its chip's launch tables."""
    S = jax.ShapeDtypeStruct
    for num_tokens, num_rows, max_blocks in ((4096, 512, 32), (8, 1, 256)):
        shapes = (
            S((num_tokens, 64, 128), jnp.bfloat16),
            S((4, 2048, 128, 128), jnp.bfloat16),
            S((4, 2048, 128, 128), jnp.bfloat16),
            S((num_rows, max_blocks), jnp.int32),
            S((num_rows,), jnp.int32),
            S((num_rows + 1,), jnp.int32),
            S((num_tokens, 4, 16), jnp.int32),
        )
        text = lower_for_gpu(
            ragged_sparse_attention,
            *shapes,
            platform=tuning.chip_platform(chip),
            scale=128**-0.5,
            interpret=False,
            chip=chip,
        )
        assert "triton" in text.lower() and "ragged_sparse_attention_bq" in text
        if num_rows == 1:  # split-K: the merge kernel is there too
            assert "ragged_sparse_attention_merge_splits" in text
    # A windowed variant (a 4,000-token window, not a multiple of the page) of the split-K decode shape.
    text = lower_for_gpu(ragged_sparse_attention, *shapes, platform=tuning.chip_platform(chip), scale=128**-0.5,
                         interpret=False, chip=chip, window=4000)
    assert "ragged_sparse_attention_tiles_bq" in text and "_window4000" in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_dots_are_full_fp32_for_fp32_inputs(dtype):
    """Triton's default for an fp32 dot is TF32; the kernels ask for IEEE fp32 (as the indexer does) so an fp32
    cache gives fp32 attention on a GPU, and leave bf16 dots on the bf16 tensor-core path."""
    a = jax.ShapeDtypeStruct((16, 32), dtype)
    with jax.default_matmul_precision("default"):  # JAX's own default, not the suite's "highest"
        (eqn,) = jax.make_jaxpr(lambda x, y: attention_walk.dot_f32(x, y, contract_b=1))(a, a).eqns
    highest = (jax.lax.Precision.HIGHEST,) * 2
    assert (eqn.params["precision"] == highest) == (dtype == jnp.float32)


# ------------------------------------------------------------------------------------------------------------
# Supported shapes, the chip's own merge table, the reference's signature.
# ------------------------------------------------------------------------------------------------------------


def pallas_calls(fn, *args) -> dict:
    """``{kernel name: pallas_call params}`` of every Pallas call ``fn(*args)`` traces (nested jits included)."""
    found = {}

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found[str(eqn.params["name"])] = eqn.params
                continue
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    visit(inner)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_supports_reports_the_limits():
    m3 = {"num_q_heads": 64, "num_kv_heads": 4, "topk": 16}
    assert sa.supports(page_size=128, head_dim=128, dtype=jnp.bfloat16, **m3)
    assert sa.supports(page_size=16, head_dim=16, dtype=jnp.float32, **m3)
    assert not sa.supports(page_size=8, head_dim=128, dtype=jnp.bfloat16, **m3)  # the dots' N: 8 keys
    assert not sa.supports(page_size=128, head_dim=8, dtype=jnp.bfloat16, **m3)  # the dots' K
    assert sa.supports(page_size=8, head_dim=8, dtype=jnp.bfloat16, interpret=True, **m3)
    assert not sa.supports(page_size=24, head_dim=128, dtype=jnp.bfloat16, interpret=True, **m3)  # not a power of 2
    assert not sa.supports(page_size=128, head_dim=128, dtype=jnp.float64, **m3)
    assert sa.supports(page_size=128, head_dim=128, dtype=jnp.float64, interpret=True, **m3)
    assert not sa.supports(page_size=128, head_dim=128, dtype=jnp.bfloat16, num_q_heads=6, num_kv_heads=4, topk=16)
    assert sa.supports(page_size=128, head_dim=128, dtype=jnp.bfloat16, num_q_heads=8, num_kv_heads=8, topk=256)
    assert not sa.supports(
        page_size=128, head_dim=128, dtype=jnp.bfloat16, num_q_heads=8, num_kv_heads=8, topk=257, interpret=True
    )  # a one-token tile would hold 512 selection entries
    with pytest.raises(ValueError, match="chip"):
        sa.supports(page_size=128, head_dim=128, dtype=jnp.bfloat16, chip="cuda", **m3)


@pytest.mark.parametrize("page, dim", [(16, 32), (8, 32), (16, 8)])
def test_supports_agrees_with_the_compiled_kernel(page, dim):
    """Where ``supports`` says yes the kernel lowers to Triton; where it says no the kernel refuses."""
    S = jax.ShapeDtypeStruct
    shapes = (S((8, 4, dim), jnp.bfloat16), S((2, 9, page, dim), jnp.bfloat16), S((2, 9, page, dim), jnp.bfloat16),
              S((2, 4), jnp.int32), S((2,), jnp.int32), S((3,), jnp.int32), S((8, 2, 3), jnp.int32))
    kw = {"platform": "cuda", "scale": 0.1, "interpret": False, "chip": "hopper"}
    expected = sa.supports(page_size=page, head_dim=dim, num_q_heads=4, num_kv_heads=2, topk=3,
                           dtype=jnp.bfloat16, chip="hopper")
    assert expected == (min(page, dim) >= 16)
    if expected:
        assert "ragged_sparse_attention_bq" in lower_for_gpu(ragged_sparse_attention, *shapes, **kw)
    else:
        with pytest.raises(ValueError, match="implementation='reference'"):
            lower_for_gpu(ragged_sparse_attention, *shapes, **kw)


def test_split_k_merge_uses_the_chips_own_table(monkeypatch):
    """Each chip's merge (and pre-pass) settings reach the kernels: a cdna3 merge table of 8 rows and 2 warps
    launches ``cdiv(T * H_q, 8)`` merge programs with 2 warps, while hopper keeps its own."""
    monkeypatch.setitem(
        tuning.TABLES,
        "cdna3",
        dataclasses.replace(
            tuning.TABLES["cdna3"], merge=tuning.MergeTable(block_rows=8, num_warps=2), prepass=tuning.PrepassTable(1)
        ),
    )
    batch = make_batch(np.random.default_rng(9), q_lens=[5], seq_lens=[40], page=4, dim=16, kv_heads=2, group=2)
    shape = {"num_tokens": 8, "num_requests": 1, "num_q_heads": 4, "num_kv_heads": 2, "topk": 3, "max_blocks": 12,
             "page": 4, "head_dim": 16, "num_splits": 3}
    for chip, rows, warps, prepass in (("cdna3", 8, 2, 1), ("hopper", 32, 4, 4)):
        config = sparse_attention_launch_config(chip=chip, **shape)
        assert (config.merge_rows, config.merge_warps, config.prepass_warps) == (rows, warps, prepass)
        calls = pallas_calls(
            functools.partial(sa.ragged_sparse_attention_pallas, scale=0.25, config=config, interpret=True),
            *args_of(batch),
        )
        (merge,) = (p for name, p in calls.items() if "merge" in name)
        assert merge["grid_mapping"].grid == (-(-8 * 4 // rows),)
        assert merge["compiler_params"].num_warps == warps
        (prepass_call,) = (p for name, p in calls.items() if "tiles" in name)
        assert prepass_call["compiler_params"].num_warps == prepass
        out = sa.ragged_sparse_attention_pallas(*args_of(batch), scale=0.25, config=config, interpret=True)
        assert_close(out, oracle(batch, 0.25), "f32", 5)


def test_reference_takes_the_kernel_signature():
    kernel = inspect.signature(ragged_sparse_attention).parameters
    reference = inspect.signature(ragged_sparse_attention_reference).parameters
    assert list(kernel) == list(reference)
    for name, p in kernel.items():
        assert (p.kind, p.annotation) == (reference[name].kind, reference[name].annotation), name
        if name != "implementation":  # the reference's default names itself
            assert p.default == reference[name].default, name


def test_misspelt_keyword_raises():
    b = make_batch(np.random.default_rng(4), q_lens=[2], seq_lens=[10], page=4, dim=16)
    for fn in (ragged_sparse_attention_reference, ragged_sparse_attention):
        with pytest.raises(TypeError, match="num_split"):
            fn(*args_of(b), scale=0.1, num_split=2)
        with pytest.raises(TypeError, match="backend"):
            fn(*args_of(b), scale=0.1, backend="rocm")  # the old name of ``chip``


def test_reference_ignores_tunables_without_recompiling():
    """Launch tunables, ``chip`` and ``interpret`` reuse the reference's compiled program; a new ``scale``
    (positive control) compiles a new one."""
    b = make_batch(np.random.default_rng(5), q_lens=[3, 1], seq_lens=[19, 6], page=4, dim=16, pad_slots=5)
    want = np.asarray(ragged_sparse_attention_reference(*args_of(b), scale=0.3))
    compiled = sa._reference._cache_size()
    for tunables in ({"block_q": 8}, {"num_splits": 3, "num_warps": 8, "num_stages": 1}, {"block_k": 2},
                     {"chip": "cdna3", "interpret": True, "implementation": "pallas"}):
        np.testing.assert_array_equal(
            np.asarray(ragged_sparse_attention_reference(*args_of(b), scale=0.3, **tunables)), want
        )
    assert sa._reference._cache_size() == compiled
    ragged_sparse_attention_reference(*args_of(b), scale=0.2)
    assert sa._reference._cache_size() == compiled + 1
