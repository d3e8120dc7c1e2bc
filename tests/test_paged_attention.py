"""Ragged dense paged attention (dense layers): Pallas kernel (interpret) == jnp reference == naive oracle.

Uses the batch builder of test_sparse_attention.py: NaN pages behind unused table entries, stale finite data
past ``seq_len`` in a request's last page, NaN queries in padding slots, shuffled page tables, zero-length
rows.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels import sparse_attention as sa
from pallas_kernels import tuning
from pallas_kernels.paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.platform import lower_for_gpu
from pallas_kernels.sparse_attention import ragged_sparse_attention_reference
from pallas_kernels.tuning import AttentionLaunchConfig
from tests.test_sparse_attention import (
    VERIFY,
    WINDOWED,
    args_of,
    assert_close,
    make_batch,
    oracle,
    poison_before_window,
    windowed_bf16_tol,
    windowed_ref_tol,
)


def test_reference_matches_naive_oracle():
    rng = np.random.default_rng(21)
    batch = make_batch(rng, **VERIFY, page=8, dim=16, kv_heads=2, group=2)
    scale = 0.25
    ref = ragged_paged_attention_reference(*args_of(batch, dense=True), scale=scale)
    assert_close(ref, oracle(batch, scale, dense=True), "f32", int(batch["query_start_loc"][-1]))


def test_dense_equals_sparse_with_every_block_selected():
    rng = np.random.default_rng(22)
    batch = make_batch(
        rng, q_lens=[3, 1], seq_lens=[30, 12], page=4, dim=16, kv_heads=1, group=2, pad_slots=1
    )
    t, h_kv = batch["block_indices"].shape[:2]
    nb = batch["block_tables"].shape[1]
    everything = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (t, h_kv, nb))
    dense = ragged_paged_attention(*args_of(batch, dense=True), scale=0.3, block_q=2, num_splits=2)
    sparse = ragged_sparse_attention_reference(*args_of(batch, dense=True), everything, scale=0.3)
    assert_close(dense, np.asarray(sparse, np.float64), "f32", 4)


@pytest.mark.parametrize(
    "dtype, page, dim, group, block_q, num_splits",
    [
        ("f32", 8, 16, 2, 4, 1),
        ("f32", 4, 32, 4, 2, 3),
        ("bf16", 16, 32, 2, 8, 1),
        ("bf16", 8, 16, 3, 1, 2),
    ],
)
def test_kernel_matches_oracle_verify_batch(dtype, page, dim, group, block_q, num_splits):
    rng = np.random.default_rng(hash((dtype, page, dim, group)) % 2**32)
    batch = make_batch(rng, **VERIFY, page=page, dim=dim, kv_heads=2, group=group, dtype=dtype)
    scale = dim**-0.5
    config = AttentionLaunchConfig(
        block_q=block_q, num_splits=num_splits, num_warps=4, num_stages=2, block_k=page // 2
    )
    out = pa.ragged_paged_attention_pallas(
        *args_of(batch, dense=True), scale=scale, config=config, interpret=True, poison=True
    )
    assert out.dtype == batch["q"].dtype
    assert_close(out, oracle(batch, scale, dense=True), dtype, int(batch["query_start_loc"][-1]))


@pytest.mark.parametrize("dtype, page, window, block_q, num_splits, block_k", WINDOWED)
def test_windowed_kernel_matches_oracle(dtype, page, window, block_q, num_splits, block_k):
    """Each token attends to its last ``window`` positions: kernel (poisoned outputs; NaN pages before every
    window, which it must never read) == reference == float64 oracle, on the mixed verification batch."""
    rng = np.random.default_rng(hash(("dense", dtype, page, window, block_q)) % 2**32)
    batch = make_batch(rng, **VERIFY, page=page, dim=16, kv_heads=2, group=3, dtype=dtype)
    batch, poisoned = poison_before_window(batch, window)
    scale = 0.25
    if poisoned:  # positive control: without the window the poisoned pages are read
        assert np.isnan(np.asarray(ragged_paged_attention_reference(*args_of(batch, dense=True), scale=scale))).any()
    expected = oracle(batch, scale, dense=True, window=window)
    num_valid = int(batch["query_start_loc"][-1])
    config = AttentionLaunchConfig(block_q=block_q, num_splits=num_splits, num_warps=4, num_stages=2,
                                   block_k=block_k)
    out = pa.ragged_paged_attention_pallas(
        *args_of(batch, dense=True), scale=scale, config=config, interpret=True, poison=True, window=window
    )
    ref = ragged_paged_attention_reference(*args_of(batch, dense=True), scale=scale, window=window)
    assert_close(ref, expected, dtype, num_valid, bf16_mean_tol=windowed_ref_tol(expected, num_valid))
    assert_close(out, expected, dtype, num_valid, bf16_mean_tol=windowed_bf16_tol(ref, expected))


def test_windowed_prefill_chunk_public_entry_point():
    """A 19-token prefill chunk with a 10-token window (default launch policy), beside a decode row."""
    rng = np.random.default_rng(24)
    batch = make_batch(rng, q_lens=[19, 1, 0], seq_lens=[59, 30, 0], page=8, dim=16, pad_slots=4)
    batch, _ = poison_before_window(batch, 10)
    for implementation in ("pallas", "reference"):
        out = ragged_paged_attention(*args_of(batch, dense=True), scale=0.25, window=10,
                                     implementation=implementation)
        assert_close(out, oracle(batch, 0.25, dense=True, window=10), "f32", 20)
    for bad in (0, -1, False, 3.0):
        with pytest.raises(ValueError, match="window"):
            ragged_paged_attention(*args_of(batch, dense=True), scale=0.25, window=bad)


def test_prefill_chunk_public_entry_point():
    """A 19-token prefill chunk (continuing a 40-token context) beside decode rows, default launch policy."""
    rng = np.random.default_rng(23)
    batch = make_batch(
        rng, q_lens=[19, 1, 0], seq_lens=[59, 7, 0], page=8, dim=16, kv_heads=2, group=2, pad_slots=4
    )
    out = ragged_paged_attention(*args_of(batch, dense=True), scale=0.25)
    assert_close(out, oracle(batch, 0.25, dense=True), "f32", 20)
    ref = ragged_paged_attention(*args_of(batch, dense=True), scale=0.25, implementation="reference")
    assert_close(ref, oracle(batch, 0.25, dense=True), "f32", 20)


def test_bad_inputs_raise_value_errors():
    rng = np.random.default_rng(0)
    a = args_of(make_batch(rng, q_lens=[2], seq_lens=[10], page=4, dim=16), dense=True)
    with pytest.raises(ValueError, match="seq_lens"):
        ragged_paged_attention(*a[:4], a[4][:0], a[5], scale=0.1)
    with pytest.raises(ValueError, match="head_dim"):
        ragged_paged_attention(a[0][..., :8], *a[1:], scale=0.1)
    with pytest.raises(ValueError, match="implementation"):
        ragged_paged_attention(*a, scale=0.1, implementation="triton")


@pytest.mark.parametrize("chip", ["hopper", "cdna3"])
def test_lowers_for_gpu(chip):
    S = jax.ShapeDtypeStruct
    for num_tokens, num_rows, max_blocks in ((512, 64, 64), (8, 1, 256)):
        shapes = (
            S((num_tokens, 64, 128), jnp.bfloat16),
            S((4, 1024, 128, 128), jnp.bfloat16),
            S((4, 1024, 128, 128), jnp.bfloat16),
            S((num_rows, max_blocks), jnp.int32),
            S((num_rows,), jnp.int32),
            S((num_rows + 1,), jnp.int32),
        )
        text = lower_for_gpu(
            ragged_paged_attention,
            *shapes,
            platform=tuning.chip_platform(chip),
            scale=128**-0.5,
            interpret=False,
            chip=chip,
        )
        assert "triton" in text.lower() and "ragged_paged_attention_bq" in text
    # A windowed variant (a 4,000-token window, not a multiple of the page) of the split-K decode shape.
    text = lower_for_gpu(ragged_paged_attention, *shapes, platform=tuning.chip_platform(chip), scale=128**-0.5,
                         interpret=False, chip=chip, window=4000)
    assert "ragged_paged_attention_bq" in text and "_window4000" in text


def test_supports_reports_the_limits():
    m3 = {"num_q_heads": 64, "num_kv_heads": 4}
    assert pa.supports(page_size=128, head_dim=128, dtype=jnp.bfloat16, **m3)
    assert pa.supports(page_size=16, head_dim=16, dtype=jnp.float16, **m3)
    assert not pa.supports(page_size=8, head_dim=128, dtype=jnp.bfloat16, **m3)  # the dots' N: 8 keys
    assert not pa.supports(page_size=128, head_dim=8, dtype=jnp.bfloat16, **m3)  # the dots' K
    assert pa.supports(page_size=4, head_dim=8, dtype=jnp.float32, interpret=True, **m3)
    assert not pa.supports(page_size=128, head_dim=96, dtype=jnp.bfloat16, interpret=True, **m3)
    assert not pa.supports(page_size=128, head_dim=128, dtype=jnp.bfloat16, num_q_heads=64, num_kv_heads=3)
    for chip in tuning.CHIPS:
        assert pa.supports(page_size=16, head_dim=16, dtype=jnp.bfloat16, chip=chip, **m3)


def test_small_pages_refused_when_compiled():
    """Compiled, a page under 16 keys cannot feed the walk's dots: the kernel says so and names the way out."""
    S = jax.ShapeDtypeStruct
    shapes = (S((8, 4, 32), jnp.bfloat16), S((2, 9, 8, 32), jnp.bfloat16), S((2, 9, 8, 32), jnp.bfloat16),
              S((2, 4), jnp.int32), S((2,), jnp.int32), S((3,), jnp.int32))
    assert not pa.supports(page_size=8, head_dim=32, num_q_heads=4, num_kv_heads=2, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='reference'"):
        lower_for_gpu(ragged_paged_attention, *shapes, platform="cuda", scale=0.1, interpret=False, chip="hopper")


def test_reference_takes_the_kernel_signature_and_ignores_tunables():
    kernel = inspect.signature(ragged_paged_attention).parameters
    reference = inspect.signature(ragged_paged_attention_reference).parameters
    assert list(kernel) == list(reference)
    for name, p in kernel.items():
        assert (p.kind, p.annotation) == (reference[name].kind, reference[name].annotation), name
        if name != "implementation":  # the reference's default names itself
            assert p.default == reference[name].default, name
    b = make_batch(np.random.default_rng(6), q_lens=[3, 1], seq_lens=[19, 6], page=4, dim=16, pad_slots=5)
    with pytest.raises(TypeError, match="blockk"):
        ragged_paged_attention_reference(*args_of(b, dense=True), scale=0.3, blockk=2)
    with pytest.raises(TypeError, match="blockk"):
        ragged_paged_attention(*args_of(b, dense=True), scale=0.3, blockk=2)
    want = np.asarray(ragged_paged_attention_reference(*args_of(b, dense=True), scale=0.3))
    assert_close(want, oracle(b, 0.3, dense=True), "f32", 4)
    compiled = sa._reference._cache_size()
    for tunables in ({"block_q": 8, "num_splits": 2}, {"chip": "cdna3", "interpret": False, "block_k": 2}):
        got = ragged_paged_attention_reference(*args_of(b, dense=True), scale=0.3, **tunables)
        np.testing.assert_array_equal(np.asarray(got), want)
    assert sa._reference._cache_size() == compiled
