"""Ragged MSA indexer: Pallas kernel (interpret mode) == jnp reference == a naive per-token numpy oracle.

Shapes are small (page 4..16, D 16..32, topk 3..4) so interpret mode stays fast; contexts are longer than
topk * page so selection really drops blocks. Interpret mode fills outputs with int32 min before the kernel
runs, so comparing full output arrays (with -1 where expected) also proves that every element is written.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import indexer, tuning
from pallas_kernels._common import num_tiles_bound
from pallas_kernels.indexer import (
    index_block_scores_reference,
    ragged_index_topk,
    ragged_index_topk_reference,
)
from pallas_kernels.platform import lower_for_gpu
from pallas_kernels.tuning import IndexerLaunchConfig, indexer_launch_config

# ------------------------------------------------------------------------------------------------------------
# Oracle and batch builder.
# ------------------------------------------------------------------------------------------------------------


def naive_index_topk(q, kc, bt, seq_lens, qsl, *, topk, local_blocks):
    """By definition, one token at a time, float64. Returns (selection [T, H, topk], pooled [T, H, NB])."""
    q = np.asarray(q, np.float64)
    kc = np.asarray(kc, np.float64)
    t_cap, h_idx, _ = q.shape
    page = kc.shape[1]
    nb = bt.shape[1]
    out = np.full((t_cap, h_idx, topk), -1, np.int64)
    pooled = np.full((t_cap, h_idx, nb), -np.inf)
    for r in range(len(seq_lens)):
        q_len = qsl[r + 1] - qsl[r]
        for i in range(q_len):
            t = qsl[r] + i
            pos = seq_lens[r] - q_len + i
            n_vis = pos // page + 1
            keys = np.concatenate([kc[bt[r, b]] for b in range(n_vis)])[: pos + 1]  # logical order, j <= pos
            s = q[t] @ keys.T  # [H, pos + 1]
            forced = set(range(max(0, n_vis - local_blocks), n_vis))
            for h in range(h_idx):
                blocks = [s[h, b * page : (b + 1) * page].max() for b in range(n_vis)]
                pooled[t, h, :n_vis] = blocks
                keyed = [np.inf if b in forced else blocks[b] for b in range(n_vis)]  # forced: score +inf
                order = sorted(range(n_vis), key=lambda b: (-keyed[b], b))  # descending, ties to lower id
                k = min(topk, n_vis)
                out[t, h, :k] = order[:k]
    return out, pooled


def make_batch(
    rng,
    *,
    q_lens,
    seq_lens,
    page,
    dim,
    heads=4,
    pad_slots=3,
    extra_blocks=1,
    dtype=np.float32,
    values="int",
    unused=-1,
):
    """A ragged batch with a shuffled (non-identity) page map; unused table entries hold ``unused``."""
    q_lens = np.asarray(q_lens, np.int64)
    seq_lens = np.asarray(seq_lens, np.int64)
    assert (seq_lens >= q_lens).all()
    r = len(q_lens)
    n_blocks = -(-seq_lens // page)
    nb = int(max(n_blocks.max(), 1) + extra_blocks)
    num_pages = int(n_blocks.sum() + 5)
    perm = rng.permutation(num_pages)
    bt = np.full((r, nb), unused, np.int64)
    used = 0
    for i in range(r):
        bt[i, : n_blocks[i]] = perm[used : used + n_blocks[i]]
        used += n_blocks[i]
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    t_cap = int(qsl[-1] + pad_slots)
    if values == "int":  # exactly representable, exact fp32 dot products whatever the summation order
        lim = 16 if dtype == jnp.bfloat16 else 64
        q = rng.integers(-lim, lim + 1, (t_cap, heads, dim))
        kc = rng.integers(-lim, lim + 1, (num_pages, page, dim))
    elif values == "small":  # many exact ties
        q = rng.integers(-2, 3, (t_cap, heads, dim))
        kc = rng.integers(-1, 2, (num_pages, page, dim))
    else:  # continuous: ties have probability zero
        q = rng.standard_normal((t_cap, heads, dim))
        kc = rng.standard_normal((num_pages, page, dim))
    return {
        "q": np.asarray(jnp.asarray(q, dtype)),
        "kc": np.asarray(jnp.asarray(kc, dtype)),
        "bt": bt.astype(np.int32),
        "seq_lens": seq_lens.astype(np.int32),
        "qsl": qsl.astype(np.int32),
    }


def args_of(b):
    return tuple(jnp.asarray(b[k]) for k in ("q", "kc", "bt", "seq_lens", "qsl"))


def oracle_bt(b):
    return np.where(b["bt"] < 0, 0, b["bt"])


def run_naive(b, *, topk, local_blocks=1):
    q = np.asarray(jnp.asarray(b["q"], jnp.float32))
    kc = np.asarray(jnp.asarray(b["kc"], jnp.float32))
    return naive_index_topk(
        q, kc, oracle_bt(b), b["seq_lens"], b["qsl"], topk=topk, local_blocks=local_blocks
    )


def assert_score_equivalent(out, ref, pooled, *, local_blocks):
    """Kernel selection == reference selection up to exact ties: same valid prefix, local blocks first, no
    duplicates, and the same multiset of pooled scores in the same order."""
    out = np.asarray(out)
    ref = np.asarray(ref)
    pooled = np.asarray(pooled, np.float64)
    np.testing.assert_array_equal(out >= 0, ref >= 0)
    t_cap, h_idx, _ = out.shape
    for t in range(t_cap):
        for h in range(h_idx):
            o = out[t, h][out[t, h] >= 0]
            e = ref[t, h][ref[t, h] >= 0]
            assert len(set(o.tolist())) == len(o), (t, h, o)
            n_local = min(local_blocks, len(e))
            np.testing.assert_array_equal(o[:n_local], e[:n_local])
            np.testing.assert_allclose(
                pooled[t, h, o[n_local:]], pooled[t, h, e[n_local:]], rtol=1e-5, atol=1e-5
            )


# ------------------------------------------------------------------------------------------------------------
# The reference against the oracle.
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("values", ["int", "small"])
def test_reference_matches_naive_oracle(seed, values):
    rng = np.random.default_rng(seed)
    page = 4
    q_lens = [3, 0, 1, 8, 2, 5]
    seq_lens = [3 + 40, 0, 1, 8 + 23, 2 + 4, 5 + 11]
    b = make_batch(rng, q_lens=q_lens, seq_lens=seq_lens, page=page, dim=16, values=values)
    for topk, local in ((3, 1), (4, 2), (4, 0)):
        want, pooled = run_naive(b, topk=topk, local_blocks=local)
        got = ragged_index_topk_reference(*args_of(b), topk=topk, local_blocks=local)
        np.testing.assert_array_equal(np.asarray(got), want)
    scores = index_block_scores_reference(*args_of(b))
    np.testing.assert_array_equal(np.asarray(scores), pooled.astype(np.float32))


def test_reference_tie_rule():
    """All keys equal: every visible block ties, so the local block comes first, then ascending block ids."""
    page, topk = 4, 3
    b = make_batch(np.random.default_rng(3), q_lens=[2, 1], seq_lens=[2 + 21, 6], page=page, dim=16)
    b["kc"] = np.ones_like(b["kc"])
    got = np.asarray(ragged_index_topk_reference(*args_of(b), topk=topk))
    # request 0: positions 21, 22 -> local block 5; request 1: position 5 -> local block 1
    np.testing.assert_array_equal(got[0], [[5, 0, 1]] * 4)
    np.testing.assert_array_equal(got[1], [[5, 0, 1]] * 4)
    np.testing.assert_array_equal(got[2], [[1, 0, -1]] * 4)
    np.testing.assert_array_equal(got[3:], -1)  # padding slots
    kernel = np.asarray(ragged_index_topk(*args_of(b), topk=topk, num_splits=1, interpret=True))
    np.testing.assert_array_equal(kernel, got)


# ------------------------------------------------------------------------------------------------------------
# The kernel against the reference.
# ------------------------------------------------------------------------------------------------------------

# (num_splits, block_q, pages_per_step): fused single kernel, split + selection kernel, multi-page steps.
CONFIGS = [(1, 4, 1), (3, 2, 1), (2, 8, 2), (1, 2, 2)]


@pytest.mark.parametrize("num_splits,block_q,pages_per_step", CONFIGS)
def test_kernel_exact_on_random_ragged_batches(num_splits, block_q, pages_per_step):
    """Fresh random ragged batch: 1..8 tokens per request, zero-length rows, padding slots, shuffled pages."""
    rng = np.random.default_rng(100 + num_splits * 10 + block_q + pages_per_step)
    page, topk = 8, 3
    r = 7
    q_lens = rng.integers(1, 9, r)
    q_lens[[1, 4]] = 0  # zero-length padding rows (seq_len 0)
    ctx = rng.integers(0, 60, r)
    seq_lens = np.where(q_lens > 0, q_lens + ctx, 0)
    b = make_batch(rng, q_lens=q_lens, seq_lens=seq_lens, page=page, dim=16, extra_blocks=2)
    for local in (1, 0):
        want = np.asarray(ragged_index_topk_reference(*args_of(b), topk=topk, local_blocks=local))
        got = ragged_index_topk(
            *args_of(b),
            topk=topk,
            local_blocks=local,
            interpret=True,
            num_splits=num_splits,
            block_q=block_q,
            pages_per_step=pages_per_step,
        )
        np.testing.assert_array_equal(np.asarray(got), want)
    assert (want[: b["qsl"][-1]] >= 0).any() and (want[b["qsl"][-1] :] == -1).all()


@pytest.mark.parametrize("num_splits", [1, 2])
def test_kernel_boundary_lengths(num_splits):
    """Contexts 0, 1, page-1, page, page+1, 2*page, long; query chunks crossing block and tile edges."""
    rng = np.random.default_rng(7 + num_splits)
    page, topk, block_q = 8, 3, 4
    rows = [  # (q_len, seq_len)
        (0, 0),
        (1, 1),
        (1, page - 1),
        (1, page),
        (1, page + 1),
        (2, page),
        (2, page + 1),
        (3, page + 1),
        (block_q, 3 * page),
        (block_q + 1, 3 * page + 1),
        (8, 2 * page + 3),
        (1, 9 * page),
        (8, 9 * page + 4),
        (0, 0),
    ]
    q_lens, seq_lens = zip(*rows)
    b = make_batch(rng, q_lens=q_lens, seq_lens=seq_lens, page=page, dim=16, pad_slots=5)
    for local in (0, 1, 2):  # local 0: the causal mask inside the last block decides its score
        want, _ = run_naive(b, topk=topk, local_blocks=local)
        got = ragged_index_topk(
            *args_of(b), topk=topk, local_blocks=local, interpret=True, block_q=block_q, num_splits=num_splits
        )
        np.testing.assert_array_equal(np.asarray(got), want)


def test_kernel_prefill_chunk_many_tiles():
    """A long prefill chunk (many query tiles in one request) next to decode rows; block_q 4 -> 10+ tiles."""
    rng = np.random.default_rng(11)
    page, topk = 4, 4
    q_lens = [37, 1, 0, 6]
    seq_lens = [37 + 5, 30, 0, 6 + 17]
    b = make_batch(rng, q_lens=q_lens, seq_lens=seq_lens, page=page, dim=16, pad_slots=2)
    want, _ = run_naive(b, topk=topk, local_blocks=1)
    for num_splits, select_rows in ((1, None), (4, 4)):  # split: 4 selection programs per tile
        got = ragged_index_topk(
            *args_of(b), topk=topk, interpret=True, block_q=4, num_splits=num_splits, select_rows=select_rows
        )
        np.testing.assert_array_equal(np.asarray(got), want)


def test_kernel_bf16_exact_and_odd_sizes():
    """bf16 inputs; non power-of-2 heads, head dim, page and topk exercise every padding mask."""
    rng = np.random.default_rng(5)
    page, topk = 6, 3
    q_lens = [2, 5, 0, 1]
    seq_lens = [2 + 30, 5 + 13, 0, 25]
    b = make_batch(rng, q_lens=q_lens, seq_lens=seq_lens, page=page, dim=24, heads=3, dtype=jnp.bfloat16)
    want, _ = run_naive(b, topk=topk, local_blocks=1)
    for num_splits, pps in ((1, 1), (2, 2)):
        got = ragged_index_topk(
            *args_of(b), topk=topk, interpret=True, block_q=4, num_splits=num_splits, pages_per_step=pps
        )
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_kernel_ties_set_equality(num_splits):
    """Small-integer keys: many exact ties. Exact products make the kernel match bit for bit; also check the
    weaker contract (score equivalence) that the GPU parity check relies on."""
    rng = np.random.default_rng(20 + num_splits)
    page, topk = 4, 4
    q_lens = [1, 8, 3, 0, 2]
    seq_lens = [33, 8 + 30, 3 + 9, 0, 2 + 40]
    b = make_batch(rng, q_lens=q_lens, seq_lens=seq_lens, page=page, dim=16, values="small")
    want = np.asarray(ragged_index_topk_reference(*args_of(b), topk=topk))
    got = np.asarray(
        ragged_index_topk(*args_of(b), topk=topk, interpret=True, block_q=4, num_splits=num_splits)
    )
    pooled = index_block_scores_reference(*args_of(b))
    assert_score_equivalent(got, want, pooled, local_blocks=1)
    np.testing.assert_array_equal(got, want)


def test_kernel_continuous_random_inputs():
    """Tie-free (continuous) fp32 and bf16 inputs: the selections agree, checked exactly and by score."""
    for dtype in (np.float32, jnp.bfloat16):
        rng = np.random.default_rng(31)
        q_lens = [4, 1, 8, 0]
        seq_lens = [4 + 50, 64, 8 + 21, 0]
        b = make_batch(rng, q_lens=q_lens, seq_lens=seq_lens, page=8, dim=32, values="normal", dtype=dtype)
        want = np.asarray(ragged_index_topk_reference(*args_of(b), topk=4))
        got = np.asarray(ragged_index_topk(*args_of(b), topk=4, interpret=True, num_splits=1, block_q=4))
        pooled = index_block_scores_reference(*args_of(b))
        assert_score_equivalent(got, want, pooled, local_blocks=1)
        np.testing.assert_array_equal(got, want)


def test_unused_table_entries_do_not_matter():
    """Entries past a row's own blocks (and all entries of padding rows) are never dereferenced: filling them
    with -1, 0 or out-of-range page ids gives the same result."""
    rng = np.random.default_rng(41)
    q_lens, seq_lens = [2, 0, 3], [2 + 17, 0, 3 + 5]
    base = make_batch(rng, q_lens=q_lens, seq_lens=seq_lens, page=4, dim=16, extra_blocks=3)
    want = np.asarray(ragged_index_topk_reference(*args_of(base), topk=3))
    used = np.zeros_like(base["bt"], bool)
    for r, s in enumerate(seq_lens):
        used[r, : -(-s // 4)] = True
    for fill in (0, -1, 10**6, -(10**6)):
        b = dict(base, bt=np.where(used, base["bt"], fill).astype(np.int32))
        for ns in (1, 2):
            got = ragged_index_topk(*args_of(b), topk=3, interpret=True, block_q=4, num_splits=ns)
            np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(np.asarray(ragged_index_topk_reference(*args_of(b), topk=3)), want)


def test_many_requests():
    """R = 1100 rows (more rows than packed slots, most of them zero-length): the tile search scans 2048
    segments and the grid bound counts at most one non-empty segment per slot."""
    rng = np.random.default_rng(51)
    r = 1100
    q_lens = np.zeros(r, np.int64)
    live = rng.choice(r, 12, replace=False)
    live[0] = r - 1  # the last row owns tokens too
    q_lens[live] = rng.integers(1, 5, len(live))
    seq_lens = np.where(q_lens > 0, q_lens + rng.integers(0, 30, r), 0)
    b = make_batch(rng, q_lens=q_lens, seq_lens=seq_lens, page=4, dim=16, pad_slots=4)
    want = np.asarray(ragged_index_topk_reference(*args_of(b), topk=3))
    got = ragged_index_topk(*args_of(b), topk=3, interpret=True, block_q=4, num_splits=1)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_default_policy_and_reference_switch():
    rng = np.random.default_rng(61)
    b = make_batch(rng, q_lens=[1, 3, 0], seq_lens=[40, 3 + 20, 0], page=8, dim=16)
    want = np.asarray(ragged_index_topk_reference(*args_of(b), topk=3))
    np.testing.assert_array_equal(np.asarray(ragged_index_topk(*args_of(b), topk=3)), want)  # interpret=None
    np.testing.assert_array_equal(
        np.asarray(ragged_index_topk(*args_of(b), topk=3, implementation="reference")), want
    )


# ------------------------------------------------------------------------------------------------------------
# Validation, policy, lowering.
# ------------------------------------------------------------------------------------------------------------


def test_bad_inputs_raise_value_errors():
    b = make_batch(np.random.default_rng(0), q_lens=[1], seq_lens=[5], page=4, dim=16)
    q, kc, bt, sl, qsl = args_of(b)
    with pytest.raises(ValueError, match="index_q"):
        ragged_index_topk(q[0], kc, bt, sl, qsl, topk=3)
    with pytest.raises(ValueError, match="D_idx"):
        ragged_index_topk(q, kc[..., :8], bt, sl, qsl, topk=3)
    with pytest.raises(ValueError, match="seq_lens"):
        ragged_index_topk(q, kc, bt, jnp.concatenate([sl, sl]), qsl, topk=3)
    with pytest.raises(ValueError, match="query_start_loc"):
        ragged_index_topk(q, kc, bt, sl, qsl[:1], topk=3)
    with pytest.raises(ValueError, match="block_tables"):
        ragged_index_topk(q, kc, bt.astype(jnp.float32), sl, qsl, topk=3)
    with pytest.raises(ValueError, match="topk"):
        ragged_index_topk(q, kc, bt, sl, qsl, topk=0)
    with pytest.raises(ValueError, match="implementation"):
        ragged_index_topk(q, kc, bt, sl, qsl, topk=3, implementation="cuda")
    with pytest.raises(ValueError, match="block_q"):
        ragged_index_topk(q, kc, bt, sl, qsl, topk=3, block_q=3)


@pytest.mark.parametrize("chip", tuning.CHIPS)
def test_policy_configs_are_valid(chip):
    for t, r in ((512, 512), (4096, 512), (8, 1), (8192, 1), (2048, 2), (64, 64)):
        for nb in (1, 32, 256, 1024):
            cfg = indexer_launch_config(
                num_tokens=t, num_requests=r, num_heads=4, max_blocks=nb, page_size=128, chip=chip
            )
            cfg.validate()
            assert cfg.block_q * 4 >= 16
            if cfg.num_splits == 1:  # fused: the pooled-score tile must fit the register budget
                assert cfg.block_q * 4 * max(nb, 1) <= tuning.TABLES[chip].indexer.fused_max_elems
    # many requests -> one program per request (fused); one long request -> its key range is split
    assert (
        indexer_launch_config(
            num_tokens=4096, num_requests=512, num_heads=4, max_blocks=32, page_size=128, chip="hopper"
        ).num_splits
        == 1
    )
    assert (
        indexer_launch_config(
            num_tokens=8, num_requests=1, num_heads=4, max_blocks=256, page_size=128, chip="hopper"
        ).num_splits
        > 32
    )
    with pytest.raises(ValueError, match="num_warps"):
        IndexerLaunchConfig(num_warps=32).validate()


def _serving_shapes(r, q_len, ctx, *, page=128, dim=128, heads=4):
    t = r * q_len
    nb = ctx // page
    s = jax.ShapeDtypeStruct
    return (
        s((t, heads, dim), jnp.bfloat16),
        s((r * nb + 1, page, dim), jnp.bfloat16),
        s((r, nb), jnp.int32),
        s((r,), jnp.int32),
        s((r + 1,), jnp.int32),
    )


@pytest.mark.parametrize("chip", ["hopper", "cdna3"])
@pytest.mark.parametrize(
    "case",
    [
        (512, 8, 4096, {}, 1),  # fused path: one Triton kernel
        (512, 1, 4096, {}, 1),
        (1, 8, 32768, {}, 2),  # split path: scores kernel + selection kernel
        (64, 8, 4096, {"pages_per_step": 2, "num_splits": 2}, 2),
        (64, 8, 4096, {"pages_per_step": 2, "num_splits": 1}, 1),
    ],
)
def test_lowers_for_gpu(chip, case):
    """Deviceless Triton lowering for each platform with its chip's launch table."""
    r, q_len, ctx, kw, num_kernels = case
    text = lower_for_gpu(
        ragged_index_topk,
        *_serving_shapes(r, q_len, ctx),
        platform=tuning.chip_platform(chip),
        topk=16,
        interpret=False,
        chip=chip,
        **kw,
    )
    assert text.count(f"custom_call @{plgpu.CUSTOM_CALL_TARGET_NAME}(") == num_kernels
    assert "ragged_index_" in text


def test_tile_bound_worst_case():
    """Every request wastes block_q - 1 slots of its last tile and the padding slots need their own tiles: the
    static grid bound must still cover every token (a missed tile would leave int32-min poison behind)."""
    rng = np.random.default_rng(71)
    block_q, r = 4, 6
    q_lens = [block_q + 1] * r  # each request: 2 tiles, the second holding 1 token
    seq_lens = [q + 9 for q in q_lens]
    b = make_batch(rng, q_lens=q_lens, seq_lens=seq_lens, page=4, dim=16, pad_slots=block_q + 1)
    t_cap = b["q"].shape[0]
    needed = sum(-(-q // block_q) for q in q_lens) + -(-(t_cap - sum(q_lens)) // block_q)
    assert needed == num_tiles_bound(t_cap, r, block_q)  # the bound is tight here
    want, _ = run_naive(b, topk=3, local_blocks=1)
    for ns in (1, 2):
        got = ragged_index_topk(*args_of(b), topk=3, interpret=True, block_q=block_q, num_splits=ns)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_fewer_blocks_than_topk():
    """max_blocks < topk: every visible block is selected, the remaining slots are -1."""
    rng = np.random.default_rng(81)
    b = make_batch(rng, q_lens=[2, 1, 3], seq_lens=[2 + 5, 4, 3 + 6], page=4, dim=16, extra_blocks=0)
    assert b["bt"].shape[1] < 4
    want, _ = run_naive(b, topk=4, local_blocks=1)
    for ns in (1, 2):
        got = ragged_index_topk(*args_of(b), topk=4, interpret=True, block_q=4, num_splits=ns)
        np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(ragged_index_topk_reference(*args_of(b), topk=4)), want)


# ------------------------------------------------------------------------------------------------------------
# Supported shapes and the reference's signature.
# ------------------------------------------------------------------------------------------------------------


def test_supports_reports_the_compiled_limits():
    bf16 = {"num_index_heads": 4, "dtype": jnp.bfloat16}
    assert indexer.supports(page_size=128, index_head_dim=128, **bf16)
    assert indexer.supports(page_size=4, index_head_dim=16, **bf16)  # small pages: several pages per step
    assert indexer.supports(page_size=6, index_head_dim=9, num_index_heads=3, dtype=jnp.float32)  # D pads to 16
    assert not indexer.supports(page_size=128, index_head_dim=8, **bf16)  # the dot's K would be 8
    assert indexer.supports(page_size=128, index_head_dim=8, interpret=True, **bf16)
    assert not indexer.supports(page_size=128, index_head_dim=128, num_index_heads=4, dtype=jnp.float64)
    assert indexer.supports(page_size=128, index_head_dim=128, num_index_heads=4, dtype=jnp.float64, interpret=True)
    assert not indexer.supports(page_size=16, index_head_dim=16, num_index_heads=4, dtype=jnp.int32, interpret=True)
    for chip in tuning.CHIPS:
        assert indexer.supports(page_size=4, index_head_dim=16, chip=chip, **bf16)
    with pytest.raises(ValueError, match="chip"):
        indexer.supports(page_size=128, index_head_dim=128, chip="rocm", **bf16)


@pytest.mark.parametrize("page, dim, dtype", [(4, 16, "bfloat16"), (6, 9, "float32"), (16, 8, "bfloat16"),
                                              (16, 16, "float8_e4m3fn")])
def test_supports_agrees_with_the_compiled_kernel(page, dim, dtype):
    """Where ``supports`` says yes the kernel lowers to Triton; where it says no the kernel refuses."""
    s = jax.ShapeDtypeStruct
    shapes = (s((8, 4, dim), dtype), s((9, page, dim), dtype), s((2, 4), jnp.int32), s((2,), jnp.int32),
              s((3,), jnp.int32))
    expected = indexer.supports(page_size=page, index_head_dim=dim, num_index_heads=4, dtype=dtype, chip="hopper")
    assert expected == (dim >= 9 and dtype != "float8_e4m3fn")
    if expected:
        text = lower_for_gpu(ragged_index_topk, *shapes, platform="cuda", topk=2, interpret=False, chip="hopper")
        assert text.count(f"custom_call @{plgpu.CUSTOM_CALL_TARGET_NAME}(") >= 1
    else:
        with pytest.raises(ValueError, match="implementation='reference'"):
            lower_for_gpu(ragged_index_topk, *shapes, platform="cuda", topk=2, interpret=False, chip="hopper")


def test_reference_takes_the_kernel_signature():
    kernel = inspect.signature(ragged_index_topk).parameters
    reference = inspect.signature(ragged_index_topk_reference).parameters
    assert list(kernel) == list(reference)
    for name, p in kernel.items():
        assert (p.kind, p.annotation) == (reference[name].kind, reference[name].annotation), name
        if name != "implementation":  # the reference's default names itself
            assert p.default == reference[name].default, name


def test_misspelt_keyword_raises():
    b = make_batch(np.random.default_rng(2), q_lens=[1], seq_lens=[5], page=4, dim=16)
    for fn in (ragged_index_topk_reference, ragged_index_topk):
        with pytest.raises(TypeError, match="local_block"):
            fn(*args_of(b), topk=3, local_block=2)  # local_blocks misspelt
        with pytest.raises(TypeError, match="blockq"):
            fn(*args_of(b), topk=3, blockq=4)


def test_reference_ignores_tunables_without_recompiling():
    """The reference's jitted core sees only what changes its result: a new launch tunable, chip or interpret
    flag reuses the compiled program; a new ``topk`` (positive control) compiles a new one."""
    b = make_batch(np.random.default_rng(3), q_lens=[3, 2], seq_lens=[17, 9], page=4, dim=16, pad_slots=6)
    want = np.asarray(ragged_index_topk_reference(*args_of(b), topk=3))
    compiled = indexer._reference_jit._cache_size()
    for tunables in ({"block_q": 8}, {"num_splits": 3, "num_warps": 8}, {"chip": "cdna3", "interpret": True},
                     {"pages_per_step": 2, "select_rows": 4, "select_num_warps": 2, "num_stages": 1}):
        got = ragged_index_topk_reference(*args_of(b), topk=3, **tunables)
        np.testing.assert_array_equal(np.asarray(got), want)
    assert indexer._reference_jit._cache_size() == compiled
    ragged_index_topk_reference(*args_of(b), topk=2)
    assert indexer._reference_jit._cache_size() == compiled + 1
