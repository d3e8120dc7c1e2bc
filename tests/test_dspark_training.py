"""DSpark drafter training: the many-anchor forward equals block_hidden_reference, the DeepSpec loss against numpy,
targets / anchors, and the rollout harness (greedy speculative decoding reproduces the target's greedy output)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minimax_jax import init_drafter, init_model
from minimax_jax.drafter import capture_target_features
from minimax_jax.training import dspark as ds
from minimax_jax.training import loop, presets
from spec_decode import rollout as ro

TCFG = presets.target_config("smoke", vocab_size=300, bos_token_id=0, eos_token_id=1, pad_token_id=2)
DCFG = presets.drafter_config("smoke", TCFG, mask_token_id=3)
RNG = np.random.default_rng(0)
IDS = jnp.asarray(RNG.integers(4, 300, (2, 40)), jnp.int32)
ANCHORS = jnp.asarray([[1, 5, 17, 38], [3, 20, 30, 33]], jnp.int32)


@pytest.fixture(scope="module")
def target():
    return init_model(TCFG, dtype=jnp.float32, seed=0)


@pytest.fixture(scope="module")
def drafter(target):
    d = init_drafter(DCFG, target, seed=1)
    # a strong Markov term and confidence head, so a wrong previous token or feature would show
    d.markov_head.markov_w1[...] = jnp.asarray(RNG.standard_normal(d.markov_head.markov_w1.shape), jnp.float32)
    d.markov_head.markov_w2.kernel[...] = jnp.asarray(RNG.standard_normal(d.markov_head.markov_w2.kernel.shape),
                                                      jnp.float32)
    return d


def test_features_and_logits_in_one_pass(target):
    feats, logits = nnx.jit(ds.target_features_and_logits, static_argnums=2)(target, IDS, DCFG.target_layer_ids)
    want = nnx.jit(capture_target_features, static_argnums=2)(target, IDS, DCFG.target_layer_ids)
    np.testing.assert_array_equal(np.asarray(feats), np.asarray(want))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(nnx.jit(lambda m, x: m(x))(target, IDS)), atol=1e-6)


def test_many_anchor_forward_equals_block_hidden_reference(target, drafter):
    feats = capture_target_features(target, IDS, DCFG.target_layer_ids)
    got = nnx.jit(ds.block_hidden_many)(drafter, feats, IDS, ANCHORS)  # [B, A, K, d]
    b, a = ANCHORS.shape
    anchor_tokens = jnp.take_along_axis(IDS, ANCHORS, axis=1).reshape(-1)
    want = nnx.jit(lambda d, f, x, p: d.block_hidden_reference(f, x, p))(
        drafter, jnp.repeat(feats, a, axis=0), anchor_tokens, ANCHORS.reshape(-1))
    np.testing.assert_allclose(np.asarray(got).reshape(b * a, DCFG.block_size, -1), np.asarray(want), atol=2e-5)


def test_block_targets_and_anchors():
    ids = jnp.asarray([[0, 10, 11, 12, 1, 0, 13, 14]], jnp.int32)
    prev, labels, valid = ds.gather_block_targets(ids, jnp.asarray([[2]]), 7, bos_id=0, pad_id=2)
    assert prev.tolist() == [[[11, 12, 1, 0, 13, 14, 14]]]
    assert labels.tolist()[0][0][:5] == [12, 1, 0, 13, 14]
    # labels beyond the window and the document start (BOS) do not count
    assert valid.tolist() == [[[True, True, False, True, True, False, False]]]
    a = ds.sample_anchors(3, 64, 10, 7, seed=5, step=2)
    assert a.shape == (3, 10) and a.dtype == np.int32 and a.min() >= 1 and a.max() <= 62
    assert all(len(set(row)) == 10 and list(row) == sorted(row) for row in a.tolist())
    np.testing.assert_array_equal(a, ds.sample_anchors(3, 64, 10, 7, seed=5, step=2))
    with pytest.raises(ValueError, match="exceeds"):
        ds.sample_anchors(1, 8, 7, 7, seed=0, step=0)


def test_deepspec_loss_by_hand():
    # two slots (weights 1 and exp(-1/4)), the second of row 1 invalid
    terms = {"ce": jnp.asarray([[[1.0, 2.0]], [[3.0, 5.0]]]), "l1": jnp.asarray([[[0.2, 0.4]], [[0.6, 1.0]]]),
             "bce": jnp.asarray([[[0.5, 0.5]], [[0.1, 9.0]]])}
    valid = jnp.asarray([[[True, True]], [[True, False]]])
    w1 = math.exp(-0.25)

    def mean(a, b, c):
        return (a + b * w1 + c) / (2 + w1)

    want = 0.1 * mean(1.0, 2.0, 3.0) + 0.9 * mean(0.2, 0.4, 0.6) + 1.0 * mean(0.5, 0.5, 0.1)
    assert float(ds.deepspec_loss(terms, valid)) == pytest.approx(want, rel=1e-6)


def test_deepspec_terms_against_numpy(drafter):
    b, a, kk, d, v = 2, 3, DCFG.block_size, TCFG.hidden_size, TCFG.vocab_size
    h = jnp.asarray(RNG.standard_normal((b, a, kk, d)), jnp.float32)
    prev = jnp.asarray(RNG.integers(4, v, (b, a, kk)), jnp.int32)
    labels = jnp.asarray(RNG.integers(4, v, (b, a, kk)), jnp.int32)
    t_logits = jnp.asarray(2.0 * RNG.standard_normal((b, a, kk, v)), jnp.float32)
    got = {k: np.asarray(x, np.float64) for k, x in nnx.jit(ds.deepspec_terms)(drafter, h, prev, labels,
                                                                                t_logits).items()}
    # numpy from the drafter's pieces: U = h @ lm_head, B = teacher-forced Markov bias, c = w.[h; W1[prev]] + b
    hr, pr = h.reshape(b * a, kk, d), prev.reshape(b * a, kk)
    logits = np.asarray(drafter.logits(hr) + drafter.markov_head.block_bias(pr, hr), np.float64).reshape(b, a, kk, v)
    w = np.asarray(drafter.confidence_head.proj.kernel[...], np.float64)[:, 0]
    bias = float(drafter.confidence_head.proj.bias[...][0])
    feats = np.concatenate([np.asarray(h), np.asarray(drafter.markov_head.markov_w1[...])[np.asarray(prev)]], -1)
    z = feats @ w + bias

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p_d, p_t = softmax(logits), softmax(np.asarray(t_logits, np.float64))
    ce = -np.log(np.take_along_axis(p_d, np.asarray(labels)[..., None], -1)[..., 0])
    l1 = np.abs(p_d - p_t).sum(-1)
    accept = 1.0 - 0.5 * l1
    conf = 1.0 / (1.0 + np.exp(-z))
    bce = -(accept * np.log(conf) + (1.0 - accept) * np.log(1.0 - conf))
    np.testing.assert_allclose(got["ce"], ce, rtol=1e-4)
    np.testing.assert_allclose(got["l1"], l1, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["accept"], accept, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["conf"], conf, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["bce"], bce, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(got["top1"], (logits.argmax(-1) == np.asarray(labels)).astype(float))


def test_train_step_updates_params_not_shared(target):
    d = init_drafter(DCFG, target, dtype=jnp.float32, seed=2)
    dgraph, params, shared = nnx.split(d, nnx.Param, ...)
    tgraph, tstate = nnx.split(target)
    opt = loop.make_optimizer(weight_decay=0.01)
    step = ds.make_train_step(tgraph, dgraph, opt, compute_dtype=jnp.float32, bos_id=0, pad_id=2)
    state = {"params": jax.tree.map(jnp.copy, params), "opt": opt.init(params)}
    batch = jnp.asarray(RNG.integers(4, 300, (2, 40)), jnp.int32)
    anchors = jnp.asarray(ds.sample_anchors(2, 40, 5, 7, seed=0, step=0))
    losses = []
    for _ in range(3):
        state, m = step(state, tstate, shared, batch, anchors, jnp.float32(3e-3))
        losses.append(float(m["loss"]))
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert {"ce", "l1", "bce", "accept_first", "top1_first", "conf_last"} <= set(m)
    moved = [not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state["params"]))]
    assert all(moved)
    np.testing.assert_array_equal(np.asarray(shared["embed_tokens"][...]), np.asarray(target.embed_tokens[...]))


def test_greedy_rollout_is_the_targets_greedy_output(target, drafter):
    prompts = [RNG.integers(4, 300, n).tolist() for n in (5, 11, 3)]
    res = ro.batched_rollout(target, drafter, prompts, rows=2, num_verify=3, temperature=0.0, max_new_tokens=10)
    fwd = nnx.jit(lambda m, x: m(x))
    for p, got in zip(prompts, res.tokens):
        ids = list(p)
        buf = np.zeros((1, 32), np.int32)
        for _ in range(10):
            buf[0, :len(ids)] = ids
            ids.append(int(jnp.argmax(fwd(target, jnp.asarray(buf))[0, len(ids) - 1])))
        assert got == ids[len(p):]
    s = res.summary()
    # every verify step emits accepted + 1 tokens; the prefill emits one per prompt
    assert sum(len(t) for t in res.tokens) <= res.steps + 3 + int(res.num_accepted.sum())
    assert s["K"] == 3 and len(s["accepted_per_position"]) == 3
    assert np.all(res.num_verified == 3) and res.confidence_logits.shape == (res.steps, DCFG.block_size)
    assert set(res.row_ids.tolist()) == {0, 1, 2}  # no records of the second batch's padding row (id 3)
    ece = ro.ece_report(res, None)
    assert len(ece) == 3 and all(0.0 <= e <= 1.0 for e in ece)
