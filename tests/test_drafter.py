"""DSpark drafter: config, attention masking, cache vs from-scratch drafting, the paged cache, Markov sampling
order, jit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minimax_jax.cache import init_cache
from minimax_jax.config import ConfigError, MiniMaxM3Config
from minimax_jax.decode import forward_ragged, pack_batch, unpack_rows
from minimax_jax.draft_attention import draft_attention, draft_attention_reference
from minimax_jax.draft_cache import DraftCache
from minimax_jax.draft_step import compilation_counts, draft_step
from minimax_jax.drafter import capture_target_features, init_drafter
from minimax_jax.drafter_config import DSparkConfig, default_target_layer_ids, validate_target_layer_ids
from minimax_jax.model import init_model
from pallas_kernels.platform import loops_unrolled
from spec_decode.page_pool import PageAllocator

# A dense tiny target: the drafter only reads its embeddings, LM head and residual stream, and a dense target
# initialises twice as fast as the MoE/MSA one.
TCFG = MiniMaxM3Config.tiny(layer_types=("full_attention",) * 4, mlp_layer_types=("dense",) * 4)
RNG = np.random.default_rng(0)  # test inputs come from numpy: eager jax.random compiles per shape (slow on CPU)


def randn(*shape, scale=1.0):
    return jnp.asarray(scale * RNG.standard_normal(shape), jnp.float32)
MASK = 255
K = 4
R, CAP = 3, 32  # every test drafts R rows from caches of CAP slots: one compilation per drafter config
ROWS = jnp.arange(R)
ZERO = jnp.zeros(R, jnp.int32)


@pytest.fixture(scope="module")
def target():
    return init_model(TCFG, dtype=jnp.float32, seed=0)


def make_cfg(**kw):
    base = {"mask_token_id": MASK, "block_size": K, "num_draft_layers": 2, "target_layer_ids": (0, 2),
            "markov_rank": 8, "markov_head_type": "rnn", "enable_confidence_head": True,
            "confidence_head_with_markov": True}
    base.update(kw)
    return DSparkConfig.for_target(TCFG, **base)


@pytest.fixture(scope="module")
def drafter(target):
    return init_drafter(make_cfg(), target, seed=1)


@pytest.fixture(scope="module")
def sequences(target, drafter):
    ids = jnp.asarray(RNG.integers(0, 250, (R, 24)), jnp.int32)
    return ids, nnx.jit(capture_target_features, static_argnums=2)(target, ids, drafter.cfg.target_layer_ids)


# jitted views of the pieces the tests compare (eager op-by-op dispatch is slow on CPU)
@nnx.jit
def hidden(d, cache, anchors, pos):
    return d.block_hidden(cache, anchors, pos)


@nnx.jit
def hidden_reference(d, feats, anchors, pos):
    return d.block_hidden_reference(feats, anchors, pos)


@nnx.jit
def sample_block(d, h, anchors, temps, key):
    return d.sample_block(h, anchors, temps, key)


@nnx.jit
def teacher_forced(d, h, prev, temps):
    """Distributions and confidences recomputed from the drawn tokens (x_{k-1} = prev[:, k])."""
    logits = d.logits(h)
    if d.markov_head is not None:
        logits = logits + d.markov_head.block_bias(prev, h)
    feats = h
    if d.cfg.confidence_head_with_markov:
        feats = jnp.concatenate([h, d.markov_head.embed(prev)], -1)
    conf = d.confidence_head(feats) if d.confidence_head is not None else None
    return jax.nn.softmax(logits / temps[:, None, None]), logits.argmax(-1), conf


# ----------------------------------------------------------------------------------------------- config
def test_default_target_layer_ids():
    assert default_target_layer_ids(60, 5) == (1, 15, 29, 43, 57)
    assert default_target_layer_ids(36, 3) == (1, 17, 33)
    assert default_target_layer_ids(4, 1) == (2,)
    with pytest.raises(ConfigError, match="not strictly increasing|strictly increasing"):
        default_target_layer_ids(4, 2)  # [1, 1]
    assert validate_target_layer_ids([1, 3], 4) == (1, 3)  # the last layer N-1 is a valid feature layer
    with pytest.raises(ConfigError, match=r"exceed the target's 4 layers \(valid: -1\.\.3\)"):
        validate_target_layer_ids([1, 4], 4)
    with pytest.raises(ConfigError, match="must be >= -1"):
        validate_target_layer_ids([-2, 1], 4)
    with pytest.raises(ConfigError, match="strictly increasing"):
        validate_target_layer_ids([2, 1], 60)
    assert validate_target_layer_ids([-1, 2], 4) == (-1, 2)


def test_published_m3_feature_layers_include_the_last_layer():
    """Published MiniMax-M3 drafters read layers [3, 17, 31, 45, 59] of the 60-layer target: 59 = N-1 is valid
    (the config alone: no 60-layer model is built)."""
    t60 = TCFG.replace(num_hidden_layers=60, layer_types=("full_attention",) * 60, mlp_layer_types=("dense",) * 60)
    ids = (3, 17, 31, 45, 59)
    cfg = DSparkConfig.for_target(t60, mask_token_id=MASK, block_size=K, num_draft_layers=1, target_layer_ids=ids)
    assert cfg.target_layer_ids == ids and cfg.num_target_layers == 60
    assert cfg.feature_size == 5 * TCFG.hidden_size
    cfg.check_compatible(t60)
    assert DSparkConfig.from_pretrained(cfg.to_dict()) == cfg
    raw = cfg.to_dict()
    del raw["num_target_layers"]  # what a DeepSpec config.json holds; the loader passes the target's N
    assert DSparkConfig.from_pretrained(raw, num_target_layers=60).target_layer_ids == ids
    with pytest.raises(ConfigError, match=r"exceed the target's 60 layers \(valid: -1\.\.59\)"):
        DSparkConfig.for_target(t60, mask_token_id=MASK, block_size=K, target_layer_ids=(3, 17, 31, 45, 60))
    t59 = t60.replace(num_hidden_layers=59, layer_types=("full_attention",) * 59, mlp_layer_types=("dense",) * 59)
    with pytest.raises(ConfigError, match="exceed the target's 59 layers"):
        cfg.replace(num_target_layers=None).check_compatible(t59)


def test_config_round_trip_aliases_and_errors():
    cfg = make_cfg(sts_temperatures=(1.0, 1.5, 2.0, 0.5))
    assert DSparkConfig.from_pretrained(cfg.to_dict()) == cfg
    d = cfg.to_dict()
    for k in ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type"):
        d["dspark_" + k.replace("mask", "noise")] = d.pop(k)
    assert DSparkConfig.from_pretrained(d) == cfg
    d2 = cfg.to_dict()
    d2["dspark_block_size"] = 5
    with pytest.raises(ConfigError, match="disagrees"):
        DSparkConfig.from_pretrained(d2)

    def broken(**changes):
        d = cfg.to_dict()
        for k, v in changes.items():
            if v is None:
                d.pop(k)
            else:
                d[k] = v
        return d

    for changes, msg in [
        ({"block_size": None}, "missing 'block_size'"),
        ({"markov_head_type": None}, "missing 'markov_head_type'"),
        ({"markov_head_type": "lstm"}, "markov_head_type must be one of"),
        ({"confidence_head_with_markov": None}, "missing 'confidence_head_with_markov'"),
        ({"sts_temperatures": [1.0, 2.0]}, "sts_temperatures has 2 entries but block_size is 4"),
        ({"target_layer_ids": [1, 4]}, "exceed the target's 4 layers"),
        ({"layer_types": ["sliding_attention"] * 2}, "layer_types\\[0\\]='sliding_attention'"),
        ({"mask_token_id": 256}, "mask_token_id \\(256\\) is outside the vocabulary"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            DSparkConfig.from_pretrained(broken(**changes))
    with pytest.raises(ConfigError, match="confidence_head_with_markov is true but markov_rank is 0"):
        make_cfg(markov_rank=0)
    with pytest.raises(ConfigError) as e:
        cfg.check_compatible(TCFG.replace(hidden_size=96, vocab_size=512))
    assert "hidden_size 64 != target hidden_size 96" in str(e.value)
    assert "vocab_size 256 != target vocab_size 512" in str(e.value)


def test_last_layer_features_in_the_plain_and_paged_forward(target):
    """Feature layer N-1 is the residual stream after the last layer, before the final norm: the same array in
    the plain forward (capture_target_features) and in the paged decode path the engine captures from."""
    n, d = TCFG.num_hidden_layers, TCFG.hidden_size
    layers = (0, n - 1)
    ids = np.asarray(RNG.integers(0, 250, (2, 11)), np.int32)
    feats = np.asarray(nnx.jit(capture_target_features, static_argnums=2)(target, jnp.asarray(ids), layers))
    final, _ = nnx.jit(lambda m, x: m.hidden_states(x))(target, jnp.asarray(ids))
    np.testing.assert_array_equal(feats[..., d:], np.asarray(final))
    # the target's own head reads that feature through its final norm
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, h: m.logits(h))(target, feats[..., d:])),
                               np.asarray(nnx.jit(lambda m, x: m(x))(target, jnp.asarray(ids))), atol=1e-5)

    page = TCFG.index_block_size
    alloc = PageAllocator(16, page, max_blocks_per_request=4)
    cache = init_cache(TCFG, 16, dtype=jnp.float32)
    step = nnx.jit(lambda m, c, b: forward_ragged(m, c, b, capture_layers=layers, implementation="reference"))
    rows = [0, None, 1]  # a padding row in the middle
    for chunks in ({0: (0, ids[0, :7].tolist()), 1: (0, ids[1, :3].tolist())},   # ragged prefill
                   {0: (7, ids[0, 7:].tolist()), 1: (3, ids[1, 3:].tolist())}):  # the rest of both
        batch = pack_batch(alloc, rows, chunks, 16)
        hidden, captured, cache = step(target, cache, batch)
        for j, got in enumerate(captured):  # feature j = layer layers[j]: columns [j*d, (j+1)*d) of feats
            for rid, rows_got in unpack_rows(rows, chunks, np.asarray(got)).items():
                s = chunks[rid][0]
                want = feats[rid, s: s + len(rows_got), j * d:(j + 1) * d]
                np.testing.assert_allclose(rows_got, want, atol=1e-5, err_msg=f"layer {layers[j]}, request {rid}")
        np.testing.assert_array_equal(np.asarray(captured[-1]), np.asarray(hidden))


# ----------------------------------------------------------------------------------------------- attention
def naive_block_attention(q, k_ctx, v_ctx, visible, k_blk, v_blk, scale):
    """Loops over rows, slots and heads; keys = visible context then the whole block."""
    q, k_ctx, v_ctx, k_blk, v_blk = (np.asarray(a, np.float64) for a in (q, k_ctx, v_ctx, k_blk, v_blk))
    visible = np.broadcast_to(np.asarray(visible), (q.shape[0], q.shape[1], k_ctx.shape[1]))
    r_n, kq, h_n, _ = q.shape
    group = h_n // k_ctx.shape[2]
    out = np.zeros_like(q)
    for r in range(r_n):
        for i in range(kq):
            for h in range(h_n):
                g = h // group
                keys = [k_ctx[r, j, g] for j in range(k_ctx.shape[1]) if visible[r, i, j]] + list(k_blk[r, :, g])
                vals = [v_ctx[r, j, g] for j in range(k_ctx.shape[1]) if visible[r, i, j]] + list(v_blk[r, :, g])
                s = np.array([q[r, i, h] @ kk for kk in keys]) * scale
                p = np.exp(s - s.max())
                out[r, i, h] = (p / p.sum()) @ np.array(vals)
    return out


def test_draft_attention_against_naive_reference():
    r, kq, h, g, d, s = 3, K, 4, 2, 16, 11
    q = randn(r, kq, h, d)
    k_ctx, v_ctx = randn(r, s, g, d), randn(r, s, g, d)
    k_blk, v_blk = randn(r, kq, g, d), randn(r, kq, g, d)
    ends = jnp.array([7, 11, 0])  # row 2 is a padding row: no context at all
    visible = (jnp.arange(s)[None] < ends[:, None])[:, None, :]
    want = naive_block_attention(q, k_ctx, v_ctx, visible, k_blk, v_blk, d ** -0.5)
    attn = jax.jit(draft_attention, static_argnames="scale")
    for fn in (attn, jax.jit(draft_attention_reference, static_argnames="scale")):
        got = np.asarray(fn(q, k_ctx, v_ctx, visible, k_blk, v_blk, scale=d ** -0.5))
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    # per-slot visibility [R, K, S] also works
    vis_k = jnp.asarray(RNG.random((r, kq, s)) < 0.5)
    np.testing.assert_allclose(np.asarray(attn(q, k_ctx, v_ctx, vis_k, k_blk, v_blk, scale=0.25)),
                               naive_block_attention(q, k_ctx, v_ctx, vis_k, k_blk, v_blk, 0.25), atol=2e-5)
    # bidirectional inside the block: the LAST block key changes the FIRST slot's output
    out = attn(q, k_ctx, v_ctx, visible, k_blk, v_blk, scale=0.25)
    v_blk2 = v_blk.at[:, -1].add(1.0)
    out2 = attn(q, k_ctx, v_ctx, visible, k_blk, v_blk2, scale=0.25)
    assert np.all(np.abs(np.asarray(out2 - out)[:, 0]).max(axis=(-1, -2)) > 1e-3)


def test_context_strictly_before_anchor(drafter, sequences):
    """Entries at and after the anchor position (even if the cache holds them) are invisible."""
    ids, feats = sequences
    garbage = randn(*feats.shape, scale=5.0)
    anchor_pos = jnp.array([9, 14, 1])
    anchors = ids[ROWS, anchor_pos]
    clean = drafter.append_context(drafter.init_cache(R, CAP), feats, ZERO, anchor_pos)
    # the same context, then garbage written at the anchor position and beyond, lengths past the anchor
    dirty = drafter.append_context(clean, garbage, anchor_pos, jnp.array([6, 3, 5]))
    assert dirty.lengths.tolist() == [15, 17, 6]
    h_clean = hidden(drafter, clean, anchors, anchor_pos)
    h_dirty = hidden(drafter, dirty, anchors, anchor_pos)
    np.testing.assert_allclose(np.asarray(h_dirty), np.asarray(h_clean), atol=1e-6)
    # but the last entry before the anchor does matter
    h_shift = hidden(drafter, clean, anchors, anchor_pos - 1)
    assert np.all(np.abs(np.asarray(h_shift - h_clean)).max(axis=(1, 2)) > 1e-4)


# ----------------------------------------------------------------------------------------------- cache
def test_cached_draft_equals_from_scratch(drafter, sequences):
    """Context built by a padded prefill, a rejected-drafts append, a packed rollback/append; a padding row."""
    ids, feats = sequences
    feats = feats.at[2].set(0.0)  # row 2: padding row (no context, anchor position 0)
    cache = drafter.init_cache(R, CAP)
    cache = drafter.append_context(cache, feats[:, :8], ZERO, jnp.array([8, 5, 0]))
    junk = randn(R, 4, feats.shape[-1])
    cache = drafter.append_context(cache, junk, jnp.array([8, 5, 0]), jnp.array([4, 4, 0]))  # later rejected
    # verify-style packed write: row 0 has 7 packed tokens of which 5 are kept, row 1 has 4 (2 kept)
    packed = jnp.concatenate([feats[0, 8:15], feats[1, 5:7], junk[1, :2]])
    qsl = jnp.array([0, 7, 11, 11], jnp.int32)
    cache = drafter.append_context_packed(cache, packed, qsl, jnp.array([8, 5, 0]), jnp.array([5, 2, 0]))
    assert cache.lengths.tolist() == [13, 7, 0]

    anchor_pos = jnp.array([13, 7, 0])
    anchors = jnp.array([ids[0, 13], ids[1, 7], 17])
    h = hidden(drafter, cache, anchors, anchor_pos)
    h_ref = hidden_reference(drafter, feats, anchors, anchor_pos)
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_ref), atol=2e-5, rtol=2e-5)

    key = jax.random.key(7)
    temps = jnp.array([0.0, 0.9, 1.3])
    out = drafter.draft(cache, anchors, anchor_pos, temperature=temps, key=key)
    ref = sample_block(drafter, h_ref, anchors, temps, key)
    assert out.tokens.shape == (R, K) and out.tokens.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(out.probs), np.asarray(ref.probs), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.confidences), np.asarray(ref.confidences), atol=1e-5)
    for a in (out.probs, out.confidences, out.confidence_logits):
        assert np.all(np.isfinite(np.asarray(a)))
    np.testing.assert_allclose(np.asarray(out.probs.sum(-1)), 1.0, atol=1e-5)
    # greedy row: one-hot distributions at the argmax tokens
    np.testing.assert_array_equal(np.asarray(out.probs[0].argmax(-1)), np.asarray(out.tokens[0]))
    assert float(out.probs[0].max(-1).min()) == 1.0

    # DraftCache.rollback only shrinks
    assert cache.rollback(jnp.array([10, 20, 0])).lengths.tolist() == [10, 7, 0]


def test_append_and_draft_argument_errors(drafter, sequences):
    _, feats = sequences
    cache = drafter.init_cache(R, 16)
    with pytest.raises(ValueError, match="row 1: start \\+ num_new = 17 exceeds the cache capacity 16"):
        drafter.append_context(cache, feats, jnp.array([0, 10, 0]), jnp.array([5, 7, 0]))
    with pytest.raises(ValueError, match="features must be"):
        drafter.append_context(cache, feats[..., :64], ZERO, jnp.array([1, 1, 1]))
    with pytest.raises(ValueError, match="num_new \\(30\\) exceeds the 24 feature rows"):
        drafter.append_context(cache, feats, ZERO, jnp.array([1, 30, 0]))
    with pytest.raises(ValueError, match="anchors must be int32\\[R\\] with R = cache.num_requests = 3"):
        drafter.draft(cache, jnp.array([1, 2]), ZERO)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        drafter.draft(cache, jnp.array([1, 2, 3]), ZERO, temperature=0.5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        drafter.draft(cache, jnp.array([1, 999, 3]), ZERO)
    with pytest.raises(ValueError, match="cache must be a DraftCache"):
        drafter.draft(DraftCache.create(make_cfg(num_draft_layers=1), R, 16), jnp.array([1, 2, 3]), ZERO)


def test_draft_compiles_once_per_shape(drafter, sequences):
    ids, feats = sequences
    cache = drafter.append_context(drafter.init_cache(R, CAP), feats, ZERO, jnp.array([5, 11, 20]))
    sizes = []
    for pos in ([5, 11, 20], [3, 8, 0]):
        pos = jnp.array(pos)
        out = drafter.draft(cache.rollback(pos), ids[ROWS, pos], pos, return_probs=False,
                            temperature=jnp.array([0.0, 1.0, 0.5]), key=jax.random.key(1))
        sizes.append(compilation_counts()["draft_step"])
        assert out.probs is None and out.tokens.shape == (R, K)
    assert sizes[1] == sizes[0]  # new values, same shapes: no new compilation

    # an engine calls the functional entry point from inside its own jitted step (traced inputs, no host reads)
    graphdef, state = nnx.split(drafter)
    pos = jnp.array([5, 11, 20])
    anchors = ids[ROWS, pos]

    @jax.jit
    def engine_step(state, cache, anchors, pos):
        return draft_step(graphdef, state, cache, anchors, pos, validate=False).tokens

    np.testing.assert_array_equal(np.asarray(engine_step(state, cache, anchors, pos)),
                                  np.asarray(drafter.draft(cache, anchors, pos).tokens))


# ----------------------------------------------------------------------------------------------- paged layout
def shuffled_cache(d, num_pages, seed, fill=0.0):
    """A cache on a shared pool of ``num_pages`` pages (filled with ``fill``) whose rows own shuffled pages."""
    cache = d.init_cache(R, CAP, num_pages=num_pages)
    tables = np.random.default_rng(seed).permutation(num_pages)[: R * cache.max_blocks].reshape(R, -1)
    cache = cache.with_block_tables(jnp.asarray(tables, jnp.int32))
    return dataclasses.replace(cache, k=jnp.full_like(cache.k, fill), v=jnp.full_like(cache.v, fill)), tables


def test_shuffled_pages_equal_the_trivial_table(drafter, sequences):
    """The same context appended (padded, then packed) through shuffled block tables on a larger shared pool
    and through the trivial table of a private pool: identical hidden states and draft tokens."""
    ids, feats = sequences
    page = TCFG.index_block_size
    trivial = drafter.init_cache(R, CAP)
    assert trivial.page_size == page and trivial.capacity == CAP and trivial.num_pages == R * CAP // page
    np.testing.assert_array_equal(np.asarray(trivial.block_tables), np.arange(R * CAP // page).reshape(R, -1))
    shuffled, _ = shuffled_cache(drafter, R * CAP // page + 5, seed=3)
    caches = []
    for cache in (trivial, shuffled):
        cache = drafter.append_context(cache, feats[:, :9], ZERO, jnp.array([9, 4, 7]))
        packed = jnp.concatenate([feats[0, 9:14], feats[1, 4:6], feats[2, 7:8]])
        cache = drafter.append_context_packed(cache, packed, jnp.array([0, 5, 7, 8], jnp.int32),
                                              jnp.array([9, 4, 7]), jnp.array([5, 2, 1]))
        caches.append(cache)
    assert caches[1].lengths.tolist() == [14, 6, 8]
    pos = jnp.array([14, 6, 8])
    anchors = ids[ROWS, pos]
    h = [hidden(drafter, c, anchors, pos) for c in caches]
    np.testing.assert_array_equal(np.asarray(h[0]), np.asarray(h[1]))
    np.testing.assert_allclose(np.asarray(h[1]), np.asarray(hidden_reference(drafter, feats, anchors, pos)),
                               atol=2e-5, rtol=2e-5)
    toks = [drafter.draft(c, anchors, pos, temperature=0.8, key=jax.random.key(2)).tokens for c in caches]
    np.testing.assert_array_equal(np.asarray(toks[0]), np.asarray(toks[1]))


def test_writes_stay_on_their_rows_pages(drafter, sequences):
    """A pool poisoned with NaN: a write lands only at (own page, offset) of a live row's positions; padding
    rows (-1), a row past R, negative positions, positions past the table and rows whose table names no page
    (-1) write nothing. Reading back through the tables gives exactly the written keys."""
    _, feats = sequences
    page = TCFG.index_block_size
    num_pages = R * CAP // page + 4
    cache, tables = shuffled_cache(drafter, num_pages, seed=5, fill=np.nan)
    tables = tables.copy()
    tables[2, 1:] = -1  # row 2 owns only its first page
    cache = cache.with_block_tables(jnp.asarray(tables, jnp.int32))
    n = 8
    rows = jnp.array([0, 0, 0, -1, 3, 1, 1, 2, 2, 2, 1, 0], jnp.int32)
    positions = jnp.array([0, 5, CAP - 1, 2, 1, 3, -1, 0, 3, page, CAP, 6], jnp.int32)
    f = jnp.concatenate([feats[0, :n], feats[1, :4]])
    out = drafter.write_context(cache, f, rows, positions, jnp.array([7, 4, 4]))
    k = np.asarray(out.k)
    written = {(0, 0), (0, 5), (0, CAP - 1), (1, 3), (2, 0), (2, 3), (0, 6)}
    live = np.zeros((num_pages, page), bool)
    for r, p in written:
        live[tables[r, p // page], p % page] = True
    assert np.isfinite(k[:, :, live]).all()
    assert np.isnan(k[:, :, ~live]).all() and np.isnan(np.asarray(out.v)[:, :, ~live]).all()
    want_k, _ = nnx.jit(lambda m, x, p: m.context_kv(m.project_features(x), p))(drafter, f, jnp.maximum(positions, 0))
    for i, (r, p) in enumerate(zip(rows.tolist(), positions.tolist())):
        if (r, p) in written:
            np.testing.assert_allclose(k[:, :, tables[r, p // page], p % page], np.asarray(want_k[:, i]),
                                       atol=1e-6)


def test_paged_cache_errors(drafter):
    cache = drafter.init_cache(R, CAP)
    with pytest.raises(ValueError, match="block_tables must be int32\\[3, nb=8\\]"):
        cache.with_block_tables(jnp.zeros((R, 4), jnp.int32))
    with pytest.raises(ValueError, match="block_tables must be int32\\[2, nb=8\\]"):
        cache.with_block_tables(jnp.zeros((3, 8), jnp.int32), rows=jnp.array([0, 1]))
    with pytest.raises(ValueError, match="page size must be a power of 2, got 6"):
        drafter.init_cache(R, CAP, page_size=6)
    bad = dataclasses.replace(cache, block_tables=jnp.zeros((R + 1, 8), jnp.int32))
    with pytest.raises(ValueError, match="cache.block_tables must be int32\\[R=3, nb\\]"):
        drafter.draft(bad, jnp.array([1, 2, 3]), ZERO)


def test_paged_cache_page_ownership_errors(drafter, sequences):
    """Validated calls refuse, before any device work, writes or reads through a table entry that names no page of
    the pool, and two rows writing to one page; the cache is left as it was."""
    _, feats = sequences
    page = drafter.init_cache(R, CAP).page_size
    shared = drafter.init_cache(R, CAP, num_pages=3 * 8)  # a pool shared with a target: no tables installed yet
    with pytest.raises(ValueError, match="row 0: block 0 .* has block-table entry -1, not a page of the pool"):
        drafter.append_context(shared, feats, ZERO, jnp.array([2, 0, 0]))
    tables = np.arange(3 * 8, dtype=np.int32).reshape(3, 8)
    tables[1, 1] = tables[0, 0]  # row 1's second block on row 0's first page
    clash = shared.with_block_tables(jnp.asarray(tables))
    with pytest.raises(ValueError, match="rows 0 and 1 both write to page 0 \\(row 1's block 1\\)"):
        drafter.append_context(clash, feats, ZERO, jnp.array([1, page + 1, 0]))
    tables[1, 1] = 99  # outside the 24-page pool
    with pytest.raises(ValueError, match="row 1: block 1 .* has block-table entry 99"):
        drafter.append_context(shared.with_block_tables(jnp.asarray(tables)), feats, ZERO, jnp.array([0, 2 * page, 0]))
    tables[1, 1] = 9
    ok = drafter.append_context(shared.with_block_tables(jnp.asarray(tables)), feats, ZERO,
                                jnp.array([page, 2 * page, 0]))
    assert ok.lengths.tolist() == [page, 2 * page, 0]
    # reads: a visible block whose entry was taken away
    holes = np.asarray(ok.block_tables).copy()
    holes[1, 1] = -1
    with pytest.raises(ValueError, match="row 1: block 1 .* to read"):
        drafter.draft(ok.with_block_tables(jnp.asarray(holes)), jnp.array([1, 2, 3]), ok.lengths)


# ----------------------------------------------------------------------------------------------- Markov head
def check_teacher_forced(d, cache, anchors, pos, temps, key):
    """Each slot's returned distribution is softmax((U_k + B_k(x_{k-1})) / T) with x_{k-1} the DRAWN token, and
    the confidences use the same x_{k-1}; greedy tokens are the argmax of the same logits."""
    out = d.draft(cache, anchors, pos, temperature=temps, key=key)
    h = hidden(d, cache, anchors, pos)
    prev = jnp.concatenate([anchors[:, None], out.tokens[:, :-1]], axis=1)
    probs, _, conf = teacher_forced(d, h, prev, temps)
    np.testing.assert_allclose(np.asarray(out.probs), np.asarray(probs), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.confidence_logits), np.asarray(conf), atol=1e-5)
    g = d.draft(cache, anchors, pos)
    prev_g = jnp.concatenate([anchors[:, None], g.tokens[:, :-1]], axis=1)
    _, argmax, _ = teacher_forced(d, h, prev_g, temps)
    np.testing.assert_array_equal(np.asarray(g.tokens), np.asarray(argmax))
    return out


@pytest.mark.parametrize("kind", ["rnn", "gated"])
def test_rolled_and_unrolled_draft_positions_agree(target, drafter, sequences, kind):
    """The scans over the draft positions (drawing, and the teacher-forced block bias) are unrolled on a GPU and
    rolled elsewhere (``pallas_kernels.platform.unroll_loops``): both give the same drafts, distributions,
    confidences and bias, on greedy and sampled rows, under a logit filter that depends on the drafts drawn before
    the slot (as penalties do)."""
    d = nnx.clone(drafter) if kind == "rnn" else init_drafter(make_cfg(markov_head_type=kind, num_draft_layers=1),
                                                              target, seed=5)
    d.markov_head.markov_w1[...] = randn(*d.markov_head.markov_w1.shape, scale=3.0)
    d.markov_head.markov_w2.kernel[...] = randn(*d.markov_head.markov_w2.kernel.shape)
    ids, feats = sequences
    pos = jnp.array([11, 4, 19])
    cache = d.append_context(d.init_cache(R, CAP), feats, ZERO, pos)
    anchors = ids[ROWS, pos]
    h = hidden(d, cache, anchors, pos) + randn(R, K, d.cfg.hidden_size, scale=0.5)  # fresh inputs, not the cache's
    temps = jnp.array([0.0, 0.8, 1.4])
    prev = jnp.asarray(RNG.integers(0, 250, (R, K)), jnp.int32)

    def penalise_drawn(x, drafted):  # -3 on every token drawn at an earlier slot of the row
        hit = (jnp.arange(x.shape[-1])[None, :, None] == drafted[:, None, :]).any(-1)
        return jnp.where(hit, x - 3.0, x)

    outs, loops = {}, {}
    for unroll in (True, False):
        # a new function per setting: jit caches a trace by function, not by the switch
        run = nnx.jit(lambda d, h, a, t, k, p: (d.sample_block(h, a, t, k, logit_filter=penalise_drawn),
                                                 d.markov_head.block_bias(p, h)))
        with loops_unrolled(unroll):
            loops[unroll] = run.lower(d, h, anchors, temps, jax.random.key(13), prev).as_text().count("stablehlo.while")
            outs[unroll] = jax.tree.map(np.asarray, run(d, h, anchors, temps, jax.random.key(13), prev))
    assert loops[False] >= loops[True] + 2  # the two scans are while loops only when rolled
    (drawn, bias), (drawn_rolled, bias_rolled) = outs[True], outs[False]
    np.testing.assert_array_equal(drawn_rolled.tokens, drawn.tokens)
    for name in ("probs", "confidences", "confidence_logits"):
        np.testing.assert_allclose(getattr(drawn_rolled, name), getattr(drawn, name), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(bias_rolled, bias, rtol=1e-6, atol=1e-6)
    assert len(np.unique(drawn.tokens[1:])) > 1  # the sampled rows drew something other than one token


def test_markov_slot_depends_on_previous_draw(target, sequences):
    """W1 = identity (rank = V), W2 maps x -> f(x) = (3x + 7) mod V: drafts must follow f from the anchor on."""
    _ids, feats = sequences
    v = TCFG.vocab_size
    d = init_drafter(make_cfg(markov_rank=v, markov_head_type="vanilla", num_draft_layers=1), target, seed=3)
    f = (3 * np.arange(v) + 7) % v
    perm = np.zeros((v, v), np.float32)
    perm[np.arange(v), f] = 1.0
    d.markov_head.markov_w1[...] = jnp.eye(v, dtype=jnp.float32)
    pos = jnp.array([6, 12, 20])
    anchors = jnp.array([5, 254, 100])
    cache = d.append_context(d.init_cache(R, CAP), feats, ZERO, pos)
    # a moderate Markov term: tokens are random, and the distributions follow the drawn tokens
    d.markov_head.markov_w2.kernel[...] = jnp.asarray(3.0 * perm)
    check_teacher_forced(d, cache, anchors, pos, jnp.array([1.0, 0.8, 1.2]), jax.random.key(4))
    # a dominant one: the draws are a deterministic chain x_k = f(x_{k-1}), greedy or sampled
    d.markov_head.markov_w2.kernel[...] = jnp.asarray(200.0 * perm)
    want = np.zeros((R, K), np.int64)
    prev = np.asarray(anchors)
    for k in range(K):
        prev = f[prev]
        want[:, k] = prev
    np.testing.assert_array_equal(np.asarray(d.draft(cache, anchors, pos).tokens), want)
    sampled = d.draft(cache, anchors, pos, temperature=1.0, key=jax.random.key(11))
    np.testing.assert_array_equal(np.asarray(sampled.tokens), want)


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_draft_distribution_is_teacher_forced_markov(target, drafter, sequences, kind):
    ids, feats = sequences
    # rnn: the module's drafter (2 layers); gated: a fresh one-layer drafter
    d = nnx.clone(drafter) if kind == "rnn" else init_drafter(make_cfg(markov_head_type=kind, num_draft_layers=1),
                                                              target, seed=4)
    assert d.markov_head.kind == kind
    # make the Markov term strong enough that a wrong previous token would show
    d.markov_head.markov_w1[...] = randn(*d.markov_head.markov_w1.shape, scale=3.0)
    d.markov_head.markov_w2.kernel[...] = randn(*d.markov_head.markov_w2.kernel.shape)
    pos = jnp.array([10, 17, 3])
    cache = d.append_context(d.init_cache(R, CAP), feats, ZERO, pos)
    anchors = ids[ROWS, pos]
    check_teacher_forced(d, cache, anchors, pos, jnp.array([0.7, 1.0, 1.5]), jax.random.key(3))
    if kind == "gated":
        return
    # per-row keys work too (typed or raw), and sampling is deterministic in the key
    keys = jax.random.split(jax.random.key(9), R)
    a = d.draft(cache, anchors, pos, temperature=1.0, key=keys)
    b = d.draft(cache, anchors, pos, temperature=1.0, key=jax.random.key_data(keys))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


def test_heads_off_and_sts(target, sequences):
    ids, feats = sequences
    pos = jnp.array([10, 17, 3])
    anchors = ids[ROWS, pos]
    plain = init_drafter(make_cfg(markov_rank=0, confidence_head_with_markov=False, num_draft_layers=1), target)
    assert plain.markov_head is None
    cache = plain.append_context(plain.init_cache(R, CAP), feats, ZERO, pos)
    temps = jnp.array([0.5, 2.0, 1.0])
    out = check_teacher_forced(plain, cache, anchors, pos, temps, jax.random.key(0))
    sts = (0.5, 1.0, 2.0, 4.0)
    plain.set_sts_temperatures(sts)
    assert plain.cfg.sts_temperatures == sts
    out_sts = plain.draft(cache, anchors, pos, temperature=temps, key=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out_sts.tokens), np.asarray(out.tokens))
    np.testing.assert_allclose(np.asarray(out_sts.confidences),
                               np.asarray(jax.nn.sigmoid(out.confidence_logits / jnp.array(sts))), atol=1e-6)
    d2 = nnx.clone(plain)
    d2.cfg, d2.confidence_head = plain.cfg.replace(enable_confidence_head=False, sts_temperatures=None), None
    assert not d2.has_confidence_head
    h = hidden(plain, cache, anchors, pos)
    out2 = sample_block(d2, h, anchors, temps, jax.random.key(0))
    assert out2.confidences is None and out2.confidence_logits is None and out2.tokens.shape == (R, K)
