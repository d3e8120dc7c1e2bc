"""Rejection sampling: lossless by a chi-square test with the power to see a 1% bias; exact greedy.

A toy autoregressive target over a small vocabulary: ``p_t(next | prev, pos) = softmax(L[pos % P, prev] / T)``.
The draft model is a Markov chain close to it (some tokens impossible for the drafter), sampled left to right
with the key ``(seed, position, STREAM_DRAFT)``. Every sample row runs whole speculative steps (draft,
truncation policy, target rows for the drafted prefix, ``rejection_sample``) until it has ``L`` tokens; the
empirical joint law of the first ``L`` emitted tokens is compared with the target's exact joint law.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_decode.allocator import allocate_drafts
from spec_decode.rejection import (
    STREAM_DRAFT,
    rejection_sample,
    rejection_sample_packed,
    sample_tokens,
    sampling_key,
)

NUM_SAMPLES = 1 << 19  # enough that a 1% mixture bias is rejected (see test_chi_square_rejects_a_1pct_bias)
ALPHA = 1e-3
SUBSET_ALPHA = 1e-5  # per-policy quarters: 12 more tests, so a stricter level keeps false alarms rare
L_TOKENS = 2
PERIOD = 3  # target tables repeat every PERIOD positions
ANCHOR, START = 1, 10  # every sample row starts from anchor token 1 at position 10


def make_models(vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    target = rng.normal(0.0, 1.2, (PERIOD, vocab, vocab)).astype(np.float32)
    draft = target + rng.normal(0.0, 0.8, target.shape).astype(np.float32)
    # The drafter can never propose some tokens (the residual must supply them), never all of them.
    impossible = rng.random(target.shape) < 0.2
    impossible[..., 0] = False
    draft = np.where(impossible, -np.inf, draft).astype(np.float32)
    conf = rng.uniform(0.3, 1.0, (PERIOD, vocab)).astype(np.float32)  # c_k from (prev token, position)
    return jnp.asarray(target), jnp.asarray(draft), jnp.asarray(conf)


def target_joint(target, temperature, length):
    """Exact law of the first `length` target tokens after ANCHOR at START: ``f64[V] * length``."""
    t = np.asarray(target, np.float64) / temperature
    p = np.exp(t - t.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    joint = p[(START + 1) % PERIOD, ANCHOR]  # [V]
    for i in range(1, length):
        joint = joint[..., None] * p[(START + 1 + i) % PERIOD]  # [..., prev, 1] * [prev, next]
    return joint


POLICIES = ("full", "random", "threshold", "adaptive", "same_position")


def _policy_caps(policy_ids, k, drafts, conf_k, key):
    """num_verified per row, by each row's policy; all but 'same_position' look only at drafts before k."""
    num_rows = drafts.shape[0]
    k_rand, k_sched = jax.random.split(key)
    surv = jnp.cumprod(conf_k, axis=1)  # conf_k[:, j] depends on the token before draft j only
    sched = jax.random.randint(k_sched, (num_rows,), 1, k + 1)
    caps = jnp.stack(
        [
            jnp.full((num_rows,), k, jnp.int32),  # full
            jax.random.randint(k_rand, (num_rows,), 0, k + 1),  # random, independent of the drafts
            jnp.sum(surv >= 0.35, axis=1).astype(jnp.int32),  # threshold on survival
            # adaptive: the engine's global top-B over every sample row
            allocate_drafts(conf_k, sched, jnp.int32(num_rows * k // 2)),
            # WRONG on purpose: trims draft j by looking at draft j itself (docs/ADAPTIVE_VERIFICATION.md)
            jnp.sum(jnp.cumprod((drafts != 0).astype(jnp.int32), axis=1), axis=1).astype(jnp.int32),
        ],
        axis=1,
    )
    return jnp.take_along_axis(caps, policy_ids[:, None], axis=1)[:, 0]


def _draft(draft_table, seeds, anchor, pos, k, temperature):
    """Left-to-right Markov drafts: tokens [N, K] and the distributions they were drawn from [N, K, V]."""

    def one(prev, j):
        p = pos + 1 + j
        logits = draft_table[p % PERIOD, prev] / temperature  # [N, V]
        keys = jax.vmap(lambda s, q: sampling_key(s, q, STREAM_DRAFT))(seeds, p)
        x = jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
        return x, (x, jax.nn.softmax(logits, axis=-1))

    _, (toks, probs) = jax.lax.scan(one, anchor, jnp.arange(k))
    return toks.T, jnp.swapaxes(probs, 0, 1)


@functools.partial(jax.jit, static_argnames=("k", "temperature", "length", "draft_temperature"))
def _rollout(
    target, draft_table, conf, policy_ids, bias, seed_offset, *, k, temperature, length, draft_temperature
):
    num_rows = policy_ids.shape[0]
    seeds = jnp.arange(num_rows, dtype=jnp.int32) * 7919 + 13 + seed_offset
    policy_key = jax.random.key(99)
    draft_t = temperature if draft_temperature is None else draft_temperature

    def step(i, carry):  # every step emits at least one token, so `length` steps are enough
        buf, count, anchor, pos = carry
        drafts, dprobs = _draft(draft_table, seeds, anchor, pos, k, draft_t)
        prevs = jnp.concatenate([anchor[:, None], drafts], axis=1)  # token before verify row i
        row_pos = pos[:, None] + 1 + jnp.arange(k + 1)[None, :]
        logits = target[row_pos % PERIOD, prevs]  # [N, K+1, V]
        conf_k = conf[row_pos[:, :k] % PERIOD, prevs[:, :k]]  # [N, K]
        caps = _policy_caps(policy_ids, k, drafts, conf_k, jax.random.fold_in(policy_key, i))
        out = rejection_sample(logits, drafts, dprobs, caps, seeds, pos, temperature=temperature)
        # The deliberately biased variant: the very first emitted token, mixed with the target's mode.
        mode = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        u = jax.vmap(lambda s, p: jax.random.uniform(sampling_key(s, p, 77)))(seeds, pos)
        first = jnp.where((i == 0) & (u < bias), mode, out.output_tokens[:, 0])
        out = out._replace(output_tokens=out.output_tokens.at[:, 0].set(first))
        # Append this step's tokens after the `count` already emitted.
        cols = count[:, None] + jnp.arange(k + 1)[None, :]
        take = jnp.arange(k + 1)[None, :] < out.num_emitted[:, None]
        cols = jnp.where(take, cols, buf.shape[1])  # out-of-range index: dropped
        buf = buf.at[jnp.arange(num_rows)[:, None], cols].set(out.output_tokens, mode="drop")
        last = jnp.take_along_axis(out.output_tokens, (out.num_emitted - 1)[:, None], axis=1)[:, 0]
        return buf, count + out.num_emitted, last, pos + out.num_emitted

    init = (
        jnp.full((num_rows, length + k + 1), -1, jnp.int32),
        jnp.zeros((num_rows,), jnp.int32),
        jnp.full((num_rows,), ANCHOR, jnp.int32),
        jnp.full((num_rows,), START, jnp.int32),
    )
    buf = jax.lax.fori_loop(0, length, step, init)[0]
    return buf[:, :length]


def speculative_rollout(
    target,
    draft_table,
    conf,
    policy_ids,
    bias=0.0,
    seed_offset=0,
    *,
    k,
    temperature,
    length,
    draft_temperature=None,
):
    """Each row: speculative steps from (ANCHOR, START) until `length` tokens are out. Returns [N, length].

    ``policy_ids int32[N]`` picks each row's truncation policy (an index into POLICIES). ``bias`` > 0 makes a
    deliberately wrong sampler: the first emitted token is replaced, with probability ``bias``, by the mode of
    the target's first distribution. One compilation per (shapes, k, temperature, length).
    """
    return _rollout(
        target,
        draft_table,
        conf,
        jnp.asarray(policy_ids, jnp.int32),
        jnp.float32(bias),
        jnp.int32(seed_offset),
        k=k,
        temperature=temperature,
        length=length,
        draft_temperature=draft_temperature,
    )


def _mixed_policies(num_rows):
    """Rows cycle through the lossless policies (each row's choice depends only on its index)."""
    return jnp.arange(num_rows, dtype=jnp.int32) % 4


def chi_square(samples: np.ndarray, joint: np.ndarray) -> tuple[float, float]:
    """(statistic, p-value) of the sampled tuples against the exact joint law; impossible cells must be empty."""
    v = joint.shape[0]
    flat = np.ravel_multi_index(tuple(samples.T), joint.shape)
    observed = np.bincount(flat, minlength=v**joint.ndim).astype(np.float64)
    expected = joint.reshape(-1) * len(samples)
    assert observed[expected == 0].sum() == 0, "emitted a tuple the target gives probability 0"
    live = expected > 0
    stat = float(np.sum((observed[live] - expected[live]) ** 2 / expected[live]))
    df = int(live.sum()) - 1
    p_value = float(jax.scipy.special.gammaincc(df / 2.0, stat / 2.0))
    return stat, p_value


CONFIGS = [  # (vocab, K, temperature, table seed); every config mixes all four lossless policies
    (5, 3, 1.0, 0),
    (6, 4, 0.7, 1),
    (8, 2, 1.3, 2),
]


@pytest.mark.parametrize("vocab,k,temperature,seed", CONFIGS)
def test_emitted_tokens_follow_the_target(vocab, k, temperature, seed):
    target, draft, conf = make_models(vocab, seed)
    toks = speculative_rollout(
        target, draft, conf, _mixed_policies(NUM_SAMPLES), k=k, temperature=temperature, length=L_TOKENS
    )
    toks = np.asarray(toks)
    assert np.all(toks >= 0) and np.all(toks < vocab)
    joint = target_joint(target, temperature, L_TOKENS)
    stat, p_value = chi_square(toks, joint)
    assert p_value > ALPHA, (stat, p_value)
    # Each policy on its own too (a quarter of the samples each).
    policies = np.asarray(_mixed_policies(NUM_SAMPLES))
    for pid in range(4):
        stat, p_value = chi_square(toks[policies == pid], joint)
        assert p_value > SUBSET_ALPHA, (POLICIES[pid], stat, p_value)


@pytest.mark.parametrize("vocab,k,temperature,seed", CONFIGS)
def test_chi_square_rejects_a_1pct_bias(vocab, k, temperature, seed):
    # The same statistic and sample size as above catch a sampler whose first token is a 1% mixture with the
    # target's mode (a total-variation distance of 1% * (1 - p_mode)). Expected noncentrality here is
    # N * 1e-4 * (1 - p_mode) / p_mode = 40..90, far above the 1e-3 critical values (df 24..63).
    target, draft, conf = make_models(vocab, seed)
    policies = _mixed_policies(NUM_SAMPLES)
    toks = speculative_rollout(
        target, draft, conf, policies, 0.01, k=k, temperature=temperature, length=L_TOKENS
    )
    stat, p_value = chi_square(np.asarray(toks), target_joint(target, temperature, L_TOKENS))
    assert p_value < ALPHA, (stat, p_value)


def test_same_position_trimming_is_detected_as_lossy():
    # deciding to verify draft k from draft k itself breaks losslessness (docs/ADAPTIVE_VERIFICATION.md)
    vocab, k, temperature, seed = CONFIGS[0]
    target, draft, conf = make_models(vocab, seed)
    policies = jnp.full((NUM_SAMPLES,), POLICIES.index("same_position"), jnp.int32)
    toks = speculative_rollout(target, draft, conf, policies, k=k, temperature=temperature, length=L_TOKENS)
    _, p_value = chi_square(np.asarray(toks), target_joint(target, temperature, L_TOKENS))
    assert p_value < ALPHA


def test_greedy_emits_exactly_the_target_argmax_sequence():
    vocab, k, length, rows = 8, 4, 9, 512
    target, draft, conf = make_models(vocab, 5)
    # A drafter that mostly agrees with the target, so steps accept several drafts as well as reject.
    draft = jnp.where(jnp.isinf(draft), draft, target + 0.3 * draft)
    policies = jnp.arange(rows, dtype=jnp.int32) % 5  # the greedy rule does not care how drafts were chosen
    toks = np.asarray(
        speculative_rollout(
            target, draft, conf, policies, k=k, temperature=0.0, length=length, draft_temperature=1.0
        )
    )
    t = np.asarray(target)
    expected, prev = [], ANCHOR
    for i in range(length):
        prev = int(np.argmax(t[(START + 1 + i) % PERIOD, prev]))
        expected.append(prev)
    np.testing.assert_array_equal(toks, np.tile(expected, (rows, 1)))


def _case(r=8, k=3, vocab=6, seed=0):
    """Random inputs; the unit tests below share one shape so the sampler compiles only a few times."""
    key = jax.random.split(jax.random.key(seed), 4)
    logits = jax.random.normal(key[0], (r, k + 1, vocab)) * 2
    dprobs = jax.nn.softmax(jax.random.normal(key[1], (r, k, vocab)) * 2, axis=-1)
    drafts = jax.random.randint(key[2], (r, k), 0, vocab)
    return logits, drafts, dprobs


def test_greedy_single_step_rules():
    logits = jnp.full((3, 3, 4), -1.0)
    logits = logits.at[:, 0, 2].set(1.0).at[:, 1, 3].set(1.0).at[:, 2, 0].set(1.0)  # argmax rows: 2, 3, 0
    drafts = jnp.array([[2, 3], [2, 1], [0, 3]], jnp.int32)
    out = rejection_sample(
        logits,
        drafts,
        None,
        jnp.array([2, 2, 2]),
        jnp.zeros(3, jnp.int32),
        jnp.zeros(3, jnp.int32),
        temperature=0.0,
    )
    np.testing.assert_array_equal(out.num_accepted, [2, 1, 0])
    np.testing.assert_array_equal(out.output_tokens, [[2, 3, 0], [2, 3, -1], [2, -1, -1]])
    np.testing.assert_array_equal(out.num_emitted, [3, 2, 1])
    # Fewer verified drafts: the bonus comes from the last verified row.
    out = rejection_sample(
        logits,
        drafts,
        None,
        jnp.array([1, 0, 1]),
        jnp.zeros(3, jnp.int32),
        jnp.zeros(3, jnp.int32),
        temperature=0.0,
    )
    np.testing.assert_array_equal(out.output_tokens, [[2, 3, -1], [2, -1, -1], [2, -1, -1]])


def test_padding_rows_emit_nothing_and_rows_are_independent():
    logits, drafts, dprobs = _case()
    seeds, pos = jnp.arange(8, dtype=jnp.int32), jnp.array([3, 9, 0, 5, 1, 2, 3, 4], jnp.int32)
    nv = jnp.array([3, 2, 0, 1, 3, 3, 2, 1], jnp.int32)
    mask = jnp.array([True, False, True, True, True, True, True, True])
    for temperature in (0.0, 0.8):
        full = rejection_sample(logits, drafts, dprobs, nv, seeds, pos, temperature=temperature)
        masked = rejection_sample(
            logits, drafts, dprobs, nv, seeds, pos, temperature=temperature, row_mask=mask
        )
        assert int(masked.num_emitted[1]) == 0 and int(masked.num_accepted[1]) == 0
        np.testing.assert_array_equal(masked.output_tokens[1], [-1] * 4)
        for r in (0, 2, 3, 4, 5, 6, 7):  # other rows do not depend on the padding row
            np.testing.assert_array_equal(masked.output_tokens[r], full.output_tokens[r])
        # Garbage (NaN) in a padding row's logits does not leak into the others.
        bad = logits.at[1].set(jnp.nan)
        dirty = rejection_sample(bad, drafts, dprobs, nv, seeds, pos, temperature=temperature, row_mask=mask)
        np.testing.assert_array_equal(dirty.output_tokens, masked.output_tokens)
        # Output layout: accepted drafts, then one token, then -1.
        o = np.asarray(full.output_tokens)
        for r in range(8):
            a = int(full.num_accepted[r])
            assert a <= int(nv[r]) and int(full.num_emitted[r]) == a + 1
            np.testing.assert_array_equal(o[r, :a], np.asarray(drafts)[r, :a])
            assert 0 <= o[r, a] < 6 and np.all(o[r, a + 1 :] == -1)


def test_packed_layout_matches_padded_layout():
    r, vocab = 8, 6
    logits, drafts, dprobs = _case(seed=3)
    nv = np.array([3, 0, 2, 1, 0, 3, 1, 0])
    is_pad = np.array([False, False, False, False, True, False, False, True])  # zero-length padding rows
    q_len = np.where(is_pad, 0, nv + 1)
    qsl = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)
    packed = np.zeros((32, vocab), np.float32) + 1e9  # padding slots hold garbage
    for i in range(r):
        packed[qsl[i] : qsl[i + 1]] = np.asarray(logits)[i, : q_len[i]]
    seeds, pos = jnp.arange(r, dtype=jnp.int32) + 100, jnp.arange(r, dtype=jnp.int32) * 4
    for temperature in (0.0, 0.8):
        a = rejection_sample(
            logits,
            drafts,
            dprobs,
            jnp.asarray(nv),
            seeds,
            pos,
            temperature=temperature,
            row_mask=jnp.asarray(~is_pad),
        )
        b = rejection_sample_packed(
            jnp.asarray(packed), jnp.asarray(qsl), drafts, dprobs, seeds, pos, temperature=temperature
        )
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        assert int(b.num_emitted[4]) == 0 and int(b.num_emitted[7]) == 0


def test_deterministic_in_seed_and_position():
    logits, drafts, dprobs = _case(seed=1)
    nv = jnp.full((8,), 3, jnp.int32)
    seeds, pos = jnp.arange(8, dtype=jnp.int32) * 3, jnp.full((8,), 11, jnp.int32)
    run = functools.partial(rejection_sample, temperature=0.8)
    a = run(logits, drafts, dprobs, nv, seeds, pos)
    b = run(logits, drafts, dprobs, nv, seeds, pos)
    np.testing.assert_array_equal(a.output_tokens, b.output_tokens)
    # A row's result depends on its own (seed, position) and inputs only, not on its place in the batch.
    perm = jnp.array([7, 6, 5, 4, 3, 2, 1, 0])
    c = run(logits[perm], drafts[perm], dprobs[perm], nv[perm], seeds[perm], pos[perm])
    np.testing.assert_array_equal(np.asarray(c.output_tokens), np.asarray(a.output_tokens)[::-1])
    # Another position gives other randomness.
    d = run(logits, drafts, dprobs, nv, seeds, pos + 1)
    assert not np.array_equal(np.asarray(a.output_tokens), np.asarray(d.output_tokens))


def test_probability_inputs_match_logits():
    logits, drafts, dprobs = _case(seed=2)
    nv = jnp.array([3, 2, 1, 0] * 2, jnp.int32)
    seeds, pos = jnp.arange(8, dtype=jnp.int32), jnp.arange(8, dtype=jnp.int32)
    a = rejection_sample(logits, drafts, dprobs, nv, seeds, pos, temperature=0.8)
    b = rejection_sample(
        jax.nn.softmax(logits / 0.8, axis=-1),
        drafts,
        dprobs,
        nv,
        seeds,
        pos,
        temperature=0.8,
        inputs_are_probs=True,
    )
    np.testing.assert_array_equal(a.num_accepted, b.num_accepted)
    np.testing.assert_array_equal(a.output_tokens, b.output_tokens)


def test_identical_draft_and_target_accept_everything():
    logits, drafts, _ = _case(seed=4)
    probs = jax.nn.softmax(logits / 0.8, axis=-1)
    out = rejection_sample(
        logits,
        drafts,
        probs[:, :3],
        jnp.full((8,), 3, jnp.int32),
        jnp.arange(8, dtype=jnp.int32),
        jnp.zeros(8, jnp.int32),
        temperature=0.8,
    )
    np.testing.assert_array_equal(out.num_accepted, np.full(8, 3))  # p_t(x) = p_d(x) => u * p < p always


def test_sample_tokens():
    logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]] * 4096))
    greedy = sample_tokens(logits, jnp.zeros(4096, jnp.int32), jnp.zeros(4096, jnp.int32), temperature=0.0)
    assert np.all(np.asarray(greedy) == 1)
    toks = sample_tokens(
        logits, jnp.arange(4096, dtype=jnp.int32), jnp.full((4096,), 7, jnp.int32), temperature=1.0
    )
    freq = np.bincount(np.asarray(toks), minlength=3) / 4096
    np.testing.assert_allclose(freq, [0.1, 0.6, 0.3], atol=0.03)


def test_bad_shapes_raise():
    logits, drafts, dprobs = _case()
    z = jnp.zeros(8, jnp.int32)
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(logits[0], drafts, dprobs, z, z, z, temperature=1.0)
    with pytest.raises(ValueError, match="draft_tokens"):
        rejection_sample(logits, drafts[:, :2], dprobs, z, z, z, temperature=1.0)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(logits, drafts, None, z, z, z, temperature=1.0)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(logits, drafts, dprobs[:, :, :3], z, z, z, temperature=1.0)
    with pytest.raises(ValueError, match="num_verified"):
        rejection_sample(logits, drafts, dprobs, z[:3], z, z, temperature=1.0)
    with pytest.raises(ValueError, match="seeds"):
        rejection_sample(logits, drafts, dprobs, z, z[:2], z, temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        rejection_sample(logits, drafts, dprobs, z, z, z, temperature=-1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        rejection_sample_packed(
            logits[0], jnp.zeros((2, 2), jnp.int32), drafts, dprobs, z, z, temperature=1.0
        )


def test_per_request_temperatures_match_the_static_paths():
    logits, drafts, dprobs = _case(seed=6)
    nv = jnp.array([3, 2, 1, 0, 3, 3, 2, 1], jnp.int32)
    seeds, pos = jnp.arange(8, dtype=jnp.int32) + 40, jnp.arange(8, dtype=jnp.int32) * 2
    temps = jnp.array([0.0, 0.8, 0.0, 0.8, 0.8, 0.0, 0.8, -1.0])  # <= 0: greedy for that request
    greedy = rejection_sample(logits, drafts, None, nv, seeds, pos, temperature=0.0)
    sampled = rejection_sample(logits, drafts, dprobs, nv, seeds, pos, temperature=0.8)
    mixed = rejection_sample(logits, drafts, dprobs, nv, seeds, pos, temperature=temps)
    pick = np.asarray(temps) <= 0
    for g, s_, m in zip(greedy, sampled, mixed):
        expect = np.where(pick.reshape((-1,) + (1,) * (np.ndim(g) - 1)), np.asarray(g), np.asarray(s_))
        np.testing.assert_array_equal(m, expect)
    # A traced scalar temperature equals the static one.
    traced = jax.jit(lambda t: rejection_sample(logits, drafts, dprobs, nv, seeds, pos, temperature=t))(0.8)
    np.testing.assert_array_equal(traced.output_tokens, sampled.output_tokens)
    # The packed layout takes per-request temperatures too.
    qsl = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(nv + 1)]).astype(jnp.int32)
    packed = jnp.concatenate([logits[i, : int(nv[i]) + 1] for i in range(8)])
    packed = jnp.concatenate([packed, jnp.zeros((32 - packed.shape[0], 6))])
    via_packed = rejection_sample_packed(packed, qsl, drafts, dprobs, seeds, pos, temperature=temps)
    np.testing.assert_array_equal(via_packed.output_tokens, mixed.output_tokens)
    toks = sample_tokens(logits[:, 0], seeds, pos, temperature=temps)
    np.testing.assert_array_equal(
        np.asarray(toks)[pick], np.asarray(sample_tokens(logits[:, 0], seeds, pos, temperature=0.0))[pick]
    )
    np.testing.assert_array_equal(
        np.asarray(toks)[~pick], np.asarray(sample_tokens(logits[:, 0], seeds, pos, temperature=0.8))[~pick]
    )
    with pytest.raises(ValueError, match="temperature"):
        rejection_sample(logits, drafts, dprobs, nv, seeds, pos, temperature=jnp.ones(3))
