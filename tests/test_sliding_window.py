"""A target with sliding-window layers: the plain forward's attention == a float64 masked-softmax oracle, and the
paged ragged forward (prefill chunks, verify and decode steps; Pallas interpret mode and the references) == the
plain forward (docs/CHECKPOINTS.md, "Sliding windows")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minimax_jax.cache import init_cache
from minimax_jax.config import FULL_ATTENTION, SLIDING_ATTENTION, SPARSE_ATTENTION, MiniMaxM3Config
from minimax_jax.decode import make_step_fn, pack_batch, unpack_rows
from minimax_jax.model import init_model
from spec_decode.page_pool import PageAllocator

W, F, S = SLIDING_ATTENTION, FULL_ATTENTION, SPARSE_ATTENTION


def windowed_config(window: int, layer_types=(W, F, S, S)) -> MiniMaxM3Config:
    return MiniMaxM3Config.tiny(layer_types=layer_types, sliding_window=window)


def masked_softmax_oracle(q, k, v, window):
    """float64 GQA attention of one sequence: query ``i`` sees keys ``i - window < j <= i`` (``None``: ``j <=
    i``). ``q [S, H, D]``, ``k, v [S, G, D]`` -> ``[S, H, D]``."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s, h, d = q.shape
    group = h // k.shape[1]
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    allowed = (j <= i) & ((j > i - window) if window is not None else True)
    out = np.zeros_like(q)
    for head in range(h):
        scores = q[:, head] @ k[:, head // group].T / np.sqrt(d)
        scores = np.where(allowed, scores, -np.inf)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, head] = (p / p.sum(axis=1, keepdims=True)) @ v[:, head // group]
    return out


@pytest.mark.parametrize("window", [1, 4, 6, 40])  # one key, a page, not a multiple of it, the whole sequence
def test_dense_layers_match_a_masked_softmax_oracle(window):
    """Layer 0 (sliding) sees its last ``window`` positions, layer 1 (full) every earlier one."""
    model = init_model(windowed_config(window), dtype=jnp.float32, seed=window)
    n = 19
    x = jax.random.normal(jax.random.key(window), (1, n, model.cfg.hidden_size), jnp.float32)
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    cos, sin = model.rope(positions)
    for layer, expect in ((0, window), (1, None)):
        attn = model.layers[layer].self_attn
        assert attn.window == expect
        q, k, v = attn.project_qkv(x, cos, sin)
        want = masked_softmax_oracle(q[0], k[0], v[0], expect).reshape(n, -1)
        got = attn(x, positions, cos, sin)[0]
        np.testing.assert_allclose(np.asarray(got), np.asarray(attn.o_proj(jnp.asarray(want, jnp.float32))),
                                   atol=2e-6, rtol=1e-5)


def test_window_changes_the_model_only_past_the_window():
    """Positive control: the windowed model (same weights) equals the unwindowed one on the first ``window``
    positions and differs after them; a window past the sequence changes nothing."""
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 200, (1, 24)), jnp.int32)
    full = init_model(MiniMaxM3Config.tiny(), dtype=jnp.float32, seed=3)(ids)
    windowed = init_model(windowed_config(5, (W, W, S, S)), dtype=jnp.float32, seed=3)(ids)
    long = init_model(windowed_config(24, (W, W, S, S)), dtype=jnp.float32, seed=3)(ids)
    np.testing.assert_allclose(np.asarray(windowed[0, :5]), np.asarray(full[0, :5]), atol=1e-5)
    assert np.abs(np.asarray(windowed[0, 6:] - full[0, 6:])).max() > 1e-3
    np.testing.assert_allclose(np.asarray(long), np.asarray(full), atol=1e-5)


# The Pallas kernels in interpret mode; the references run this path in tests/test_engine.py (the windowed engine).
@pytest.mark.parametrize("implementation", ["pallas"])
def test_ragged_forward_matches_plain_forward(implementation):
    """Both dense layers slide (window 6 over 4-token pages); prefill chunks, verify-sized steps with a zero-
    length row, and single-token decode steps through the paged cache (poisoned), against the plain forward
    (which a ragged forward ignoring the window misses by about 100 % of the logits' scale)."""
    cfg = windowed_config(6, (W, W, S, S))
    model = init_model(cfg, dtype=jnp.float32, seed=11)
    rng = np.random.default_rng(11)
    seqs = {0: rng.integers(3, 200, 29), 1: rng.integers(3, 200, 21)}
    want = {r: np.asarray(model(jnp.asarray(s[None], jnp.int32))[0]) for r, s in seqs.items()}
    page, num_pages = cfg.index_block_size, 24
    alloc = PageAllocator(num_pages, page, max_blocks_per_request=10, free_order=rng.permutation(num_pages))
    cache = jax.tree.map(lambda a: jnp.full_like(a, 1e4), init_cache(cfg, num_pages, dtype=jnp.float32))
    step = make_step_fn(model, implementation=implementation, interpret=True if implementation == "pallas" else None)
    params = nnx.state(model)
    rows, bucket = [0, None, 1], 16
    schedule = [{0: 11, 1: 4}, {0: 8, 1: 7}, {1: 8}, {0: 1, 1: 1}, {0: 7, 1: 1}, {0: 1}, {0: 1}]
    done, errors = {0: 0, 1: 0}, []
    for lens in schedule:
        chunks = {r: (done[r], [int(t) for t in seqs[r][done[r]: done[r] + n]]) for r, n in lens.items()}
        batch = pack_batch(alloc, rows, chunks, bucket)
        logits, _, cache = step(params, cache, batch, jnp.arange(bucket))
        for r, got in unpack_rows(rows, chunks, np.asarray(logits)).items():
            ref = want[r][done[r]: done[r] + len(got)]
            errors.append(np.abs(got - ref).max() / np.abs(ref).max())
            done[r] += len(got)
    assert done == {r: len(s) for r, s in seqs.items()}
    assert max(errors) < 1e-4, max(errors)
