"""Incremental paged decode == the plain causal forward, on the HF goldens (kernels in interpret mode)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels.platform
from minimax_jax import load_model
from minimax_jax.cache import init_cache, slot_mapping, write_tokens
from minimax_jax.config import MiniMaxM3Config
from minimax_jax.decode import (
    RaggedBatch,
    choose_implementation,
    forward_ragged,
    make_step_fn,
    pack_batch,
    unpack_rows,
)
from spec_decode.page_pool import PageAllocator

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
GOLDEN = np.load(os.path.join(FIXTURES, "golden.npz"))
T_BUCKET = 32


@pytest.fixture(scope="module")
def model():
    return load_model(os.path.join(FIXTURES, "hf_tiny"), dtype=jnp.float32)


@pytest.mark.parametrize("implementation", ["pallas", "reference"])
def test_incremental_decode_matches_plain_forward(model, implementation):
    seqs = {0: GOLDEN["ids_64"][0], 1: GOLDEN["ids_64"][1], 2: GOLDEN["ids_53"][0]}
    ref = {0: GOLDEN["logits_64"][0], 1: GOLDEN["logits_64"][1], 2: GOLDEN["logits_53"][0]}
    cfg = model.cfg
    page = cfg.index_block_size
    rng = np.random.default_rng(0)
    num_pages = 64
    alloc = PageAllocator(num_pages, page, max_blocks_per_request=18, free_order=rng.permutation(num_pages))
    cache = init_cache(cfg, num_pages, dtype=jnp.float32)
    # poison the cache: reads of unwritten slots would show up
    cache = jax.tree.map(lambda x: jnp.full_like(x, 1e4), cache)
    step = make_step_fn(model, implementation=implementation)
    params = nnx.state(model)
    rows = [0, None, 1, 2]  # a zero-length padding row in the middle
    # (lengths per request per step): a ragged prefill, then verify-like steps of 1..8 tokens
    schedule = [
        {0: 13, 1: 5, 2: 1},
        {0: 3, 1: 8, 2: 7},
        {0: 1, 2: 8},           # request 1 idle this step (length-0 row that is not padding)
        {0: 8, 1: 1, 2: 6},
        {0: 7, 1: 8, 2: 5},
        {0: 8, 1: 8, 2: 8},
        {0: 8, 1: 8, 2: 8},
        {0: 16, 1: 15, 2: 1},
    ]
    schedule += [{0: 8, 1: 8, 2: 8}] * 4  # then verify-sized steps until every sequence is consumed
    done = {r: 0 for r in seqs}
    errors = []
    for si, lens in enumerate(schedule):
        if all(done[r] == len(seqs[r]) for r in seqs):
            break
        chunks = {}
        for rid, n in lens.items():
            n = min(n, len(seqs[rid]) - done[rid])
            if n > 0:
                chunks[rid] = (done[rid], [int(t) for t in seqs[rid][done[rid]: done[rid] + n]])
        if si == 4:
            # a step whose last 3 tokens of request 1 are rejected drafts (junk), then rolled back
            s1, toks1 = chunks[1]
            junk = dict(chunks)
            junk[1] = (s1, toks1[:-3] + [7, 7, 7])
            batch = pack_batch(alloc, rows, junk, T_BUCKET)
            _, _, cache = step(params, cache, batch, jnp.arange(T_BUCKET))
            for rid, (s, toks) in chunks.items():
                alloc.rollback(rid, s)  # forget the whole step, then redo it properly
        batch = pack_batch(alloc, rows, chunks, T_BUCKET)
        logits, _, cache = step(params, cache, batch, jnp.arange(T_BUCKET))
        for rid, got in unpack_rows(rows, chunks, np.asarray(logits)).items():
            s = chunks[rid][0]
            want = ref[rid][s: s + len(got)]
            errors.append(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            done[rid] = s + len(got)
    assert done == {r: len(s) for r, s in seqs.items()}
    assert max(errors) < 1e-4, max(errors)


def test_padding_never_writes_and_slots(model):
    cfg = model.cfg
    cache = init_cache(cfg, 8, dtype=jnp.float32)
    bt = jnp.asarray([[3, 5], [0, 0]], jnp.int32)
    req = jnp.asarray([0, 0, -1, -1], jnp.int32)
    pos = jnp.asarray([3, 4, -1, -1], jnp.int32)
    slots = slot_mapping(bt, req, pos, page_size=4, num_pages=8)
    np.testing.assert_array_equal(np.asarray(slots), [3 * 4 + 3, 5 * 4 + 0, 32, 32])
    vals = jnp.arange(4 * cfg.num_key_value_heads * cfg.head_dim, dtype=jnp.float32).reshape(4, cfg.num_key_value_heads,
                                                                                           cfg.head_dim) + 1
    out = write_tokens(cache.k[0], vals, slots)
    assert float(jnp.abs(out).sum()) == float(jnp.abs(vals[:2]).sum())
    np.testing.assert_array_equal(np.asarray(out[:, 3, 3]), np.asarray(vals[0]))


def test_bad_batches_are_rejected(model):
    cfg = model.cfg
    cache = init_cache(cfg, 8, dtype=jnp.float32)
    ok = dict(input_ids=jnp.zeros(8, jnp.int32), query_start_loc=jnp.asarray([0, 3], jnp.int32),
              seq_lens=jnp.asarray([3], jnp.int32), block_tables=jnp.zeros((1, 4), jnp.int32))
    forward_ragged(model, cache, RaggedBatch(**ok), implementation="reference")
    for change, msg in [
        (dict(query_start_loc=jnp.asarray([0, 3, 4], jnp.int32)), "query_start_loc"),
        (dict(seq_lens=jnp.asarray([2], jnp.int32)), "seq_lens"),
        (dict(query_start_loc=jnp.asarray([0, 9], jnp.int32), seq_lens=jnp.asarray([9], jnp.int32)),
         "query_start_loc"),
        (dict(seq_lens=jnp.asarray([40], jnp.int32)), "blocks"),
        (dict(input_ids=jnp.zeros((2, 4), jnp.int32)), "input_ids"),
        (dict(block_tables=jnp.zeros((2, 4), jnp.int32)), "block_tables"),
    ]:
        with pytest.raises(ValueError, match=msg):
            forward_ragged(model, cache, RaggedBatch(**{**ok, **change}), implementation="reference")


def test_auto_is_compiled_kernels_on_a_gpu_else_references(monkeypatch):
    """"auto" never picks Pallas interpret mode on its own (too slow to serve from); on a GPU it picks the
    compiled kernels only where every kernel the model runs supports the shapes."""
    tiny = MiniMaxM3Config.tiny()  # pages of 4 tokens
    kw = {"page_size": tiny.index_block_size, "dtype": jnp.float32}
    assert choose_implementation("auto", tiny, **kw) == "reference"  # CPU
    assert choose_implementation("auto", tiny, interpret=False, **kw) == "reference"
    assert choose_implementation("auto", tiny, interpret=True, **kw) == "pallas"  # asked for: interpret mode
    assert choose_implementation("pallas", tiny, **kw) == "pallas"
    assert choose_implementation("reference", tiny, interpret=True, **kw) == "reference"
    with pytest.raises(ValueError, match="implementation"):
        choose_implementation("triton", tiny, **kw)

    monkeypatch.setattr(pallas_kernels.platform, "on_gpu", lambda: True)  # resolve_auto's view of the device
    gpu = tiny.replace(index_block_size=16, head_dim=32, rotary_dim=16, index_head_dim=32)
    assert choose_implementation("auto", gpu, page_size=16, dtype=jnp.bfloat16) == "pallas"
    assert choose_implementation("auto", tiny, **kw) == "reference"  # 4-token pages: the attention dots' N
    # 8-dim index keys: the indexer's dot K is too small although both attention kernels would compile.
    small_index = gpu.replace(index_head_dim=8, rotary_dim=8)
    assert choose_implementation("auto", small_index, page_size=16, dtype=jnp.bfloat16) == "reference"
    # A dense-only model never runs the indexer.
    dense_only = small_index.replace(layer_types=["full_attention"] * small_index.num_hidden_layers)
    assert not dense_only.sparse_layer_ids
    assert choose_implementation("auto", dense_only, page_size=16, dtype=jnp.bfloat16) == "pallas"
    assert choose_implementation("auto", gpu, page_size=16, dtype=jnp.float64) == "reference"  # not compiled
