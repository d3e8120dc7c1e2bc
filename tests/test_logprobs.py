"""Log-probabilities (spec_decode/logprobs.py): generated tokens' identical with and without speculation and equal
to a plain forward's, the device loop's equal to the host loop's, prompt log-probabilities through chunked prefill,
Engine.score, bad input (CPU, f32)."""

import jax.numpy as jnp
import numpy as np
import pytest

from spec_decode import Engine, SamplingParams
from spec_decode.device_loop import logprobs_width
from spec_decode.logprobs import MAX_LOGPROBS, ScoreResult
from spec_decode.sampling_params import filter_logits
from tests.engine_models import _padded_forward as padded_forward
from tests.engine_models import bigram_drafter, damped_target, random_prompts

# 2 slots, 16-token prefill chunks: the 30-token prompt prefills in several chunks; with K = 3 a step has
# 2 * (1 + 3) = 8 verify-logits rows, so prompt rows are cut to fit them too.
COMMON = dict(max_num_seqs=2, max_model_len=96, max_num_batched_tokens=16, implementation="reference",
              min_token_bucket=32, device_loop=False, cost_table=None)
LENGTH = 96  # the plain forward's padded length
MODES = [("none", 0), ("fixed", 3), ("adaptive", 7)]


@pytest.fixture(scope="module")
def target():
    return damped_target(damping=0.3)


@pytest.fixture(scope="module")
def engines(target):
    drafter = bigram_drafter(target, block_size=7)
    return {mode: Engine(target, drafter if k else None, num_speculative_tokens=k, verification=mode, **COMMON)
            for mode, k in MODES}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, [20, 30, 13], seed=5)


def forward_logits(target, seq):
    ids = np.zeros((1, LENGTH), np.int32)
    ids[0, :len(seq)] = seq
    return np.asarray(padded_forward(LENGTH)(target, jnp.asarray(ids))[0, :len(seq)], np.float64)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def greedy_runs(engines, prompts):
    params = SamplingParams(max_new_tokens=12, logprobs=4, prompt_logprobs=3, ignore_eos=True)
    return {mode: eng.generate(prompts, sampling_params=params, progress=False) for mode, eng in engines.items()}


def test_logprobs_identical_with_and_without_speculation(greedy_runs, target, prompts):
    base = greedy_runs["none"]
    for mode, res in greedy_runs.items():
        assert res.stats["compiles"] == 0, mode  # the sampling programs of the closed set serve them
        for i, (r, b) in enumerate(zip(res, base)):
            assert r.token_ids == b.token_ids, (mode, i)
            assert len(r.logprobs) == len(r.token_ids)
            assert [t.token_id for t in r.logprobs] == r.token_ids
            np.testing.assert_allclose([t.logprob for t in r.logprobs], [t.logprob for t in b.logprobs], atol=2e-5)
            for t, u in zip(r.logprobs, b.logprobs):
                assert len(t.top) == 4 and [x[0] for x in t.top] == [x[0] for x in u.top], (mode, i)
                np.testing.assert_allclose([x[1] for x in t.top], [x[1] for x in u.top], atol=2e-5)
    # and they are the target's: log_softmax of a plain forward over prompt + output
    for p, r in zip(prompts, base):
        lp = log_softmax(forward_logits(target, p + r.token_ids))
        rows = lp[len(p) - 1: len(p) - 1 + len(r.token_ids)]
        np.testing.assert_allclose([t.logprob for t in r.logprobs], rows[np.arange(len(rows)), r.token_ids],
                                   atol=1e-4)
        for t, row in zip(r.logprobs, rows):
            assert t.token_id == t.top[0][0]  # greedy: the argmax
            np.testing.assert_allclose([x[1] for x in t.top], np.sort(row)[::-1][:4], atol=1e-4)


def assert_same_logprobs(got, want, k, what):
    assert [t.token_id for t in got] == [t.token_id for t in want], what
    np.testing.assert_allclose([t.logprob for t in got], [t.logprob for t in want], atol=2e-5, err_msg=what)
    for t, u in zip(got, want):
        assert len(t.top) == k and [x[0] for x in t.top] == [x[0] for x in u.top[:k]], what
        np.testing.assert_allclose([x[1] for x in t.top], [x[1] for x in u.top[:k]], atol=2e-5, err_msg=what)


def test_device_loop_returns_the_host_loops_logprobs(engines, greedy_runs, prompts):
    """Greedy, none / fixed / adaptive: the same tokens, log-probabilities and alternatives as the host loop, the
    prompt's too (from the prefill); a request asking for k = 0 alternatives beside one asking for 4."""
    asks = [SamplingParams(max_new_tokens=12, logprobs=4, prompt_logprobs=3, ignore_eos=True),
            SamplingParams(max_new_tokens=12, logprobs=0, ignore_eos=True),
            SamplingParams(max_new_tokens=12, logprobs=4, prompt_logprobs=3, ignore_eos=True)]
    for mode, eng in engines.items():
        dev = eng.generate(prompts, sampling_params=asks, loop="device", progress=False)
        for i, (r, h, p) in enumerate(zip(dev, greedy_runs[mode], asks)):
            assert r.token_ids == h.token_ids, (mode, i)
            assert_same_logprobs(r.logprobs, h.logprobs, p.logprobs, (mode, i))
            if p.prompt_logprobs is None:
                assert r.prompt_logprobs is None
            else:
                assert r.prompt_logprobs[0] is None
                assert_same_logprobs(r.prompt_logprobs[1:], h.prompt_logprobs[1:], 3, (mode, i, "prompt"))
    # the loop's width: the smallest of a few that holds the call's largest k; none when no request asks
    assert [logprobs_width(ks, 32) for ks in ([None], [0, None], [3, 1], [17], [20])] == [None, 0, 4, 20, 20]
    assert logprobs_width([9], 5) == 5


def test_prompt_logprobs_match_a_plain_forward(greedy_runs, target, prompts):
    for mode, res in greedy_runs.items():
        for p, r in zip(prompts, res):
            assert len(r.prompt_logprobs) == len(p) and r.prompt_logprobs[0] is None
            lp = log_softmax(forward_logits(target, p))
            want = lp[np.arange(len(p) - 1), p[1:]]
            got = [t.logprob for t in r.prompt_logprobs[1:]]
            np.testing.assert_allclose(got, want, atol=1e-4, err_msg=mode)
            assert [t.token_id for t in r.prompt_logprobs[1:]] == p[1:]
            for t, row in zip(r.prompt_logprobs[1:], lp[:-1]):
                assert [x[0] for x in t.top] == list(np.argsort(-row, kind="stable")[:3])


def test_sampled_logprobs_are_the_filtered_target(engines, target, prompts):
    """temperature 0.7, top_k 5: the log-probability under the distribution the token was sampled from."""
    eng = engines["fixed"]
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=5, seed=11, logprobs=6, ignore_eos=True)
    res = eng.generate(prompts[:2], sampling_params=params, progress=False)
    for p, r in zip(prompts[:2], res):
        logits = forward_logits(target, p + r.token_ids)[len(p) - 1: len(p) - 1 + len(r.token_ids)]
        filt = np.asarray(filter_logits(jnp.asarray(logits / 0.7, jnp.float32), jnp.full((len(logits),), 5),
                                        jnp.ones((len(logits),))), np.float64)
        lp = log_softmax(filt)
        np.testing.assert_allclose([t.logprob for t in r.logprobs], lp[np.arange(len(lp)), r.token_ids], atol=1e-4)
        for t in r.logprobs:
            assert all(np.isfinite(v) for _, v in t.top[:5]) and t.top[5][1] == -np.inf  # 5 kept, the 6th filtered


def test_score_matches_the_model(engines, target, prompts):
    ctx = [p[:9] for p in prompts]
    cont = [p[9:] for p in prompts]
    ref = []
    for p, c in zip(ctx, cont):
        lp = log_softmax(forward_logits(target, p + c))
        rows = lp[len(p) - 1: len(p) + len(c) - 1]
        ref.append((rows[np.arange(len(c)), c], rows.argmax(-1) == np.asarray(c)))
    for mode, eng in engines.items():
        scores = eng.score(ctx, cont)
        assert all(isinstance(s, ScoreResult) for s in scores)
        for s, c, (want, greedy) in zip(scores, cont, ref):
            assert s.token_ids == c
            np.testing.assert_allclose(s.token_logprobs, want, atol=1e-4, err_msg=mode)
            np.testing.assert_allclose(s.logprob, want.sum(), atol=1e-3)
            assert s.is_greedy == list(greedy) and s.greedy == bool(greedy.all())
    # a continuation that is the greedy output is greedy
    gen = engines["none"].generate([ctx[0]], max_new_tokens=5, ignore_eos=True)[0]
    assert engines["fixed"].score([ctx[0]], [gen.token_ids])[0].greedy


def test_bad_input(engines, target, prompts):
    for bad in (MAX_LOGPROBS + 1, -1, True, 1.5, "3"):
        for field in ("logprobs", "prompt_logprobs"):
            with pytest.raises(ValueError, match=field):
                SamplingParams(**{field: bad})
    assert SamplingParams(logprobs=np.int64(3)).logprobs == 3
    eng = engines["fixed"]
    with pytest.raises(ValueError, match="same length"):
        eng.score(prompts, prompts[:1])
    with pytest.raises(ValueError, match="continuation 0 is empty"):
        eng.score(prompts[:1], [[]])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        eng.score([[]], [[3]])
    with pytest.raises(ValueError, match="string but the engine has no tokenizer"):
        eng.score(["x"], [[3]])
    greedy_only = Engine(target, None, verification="none", sampling=False, **COMMON)
    with pytest.raises(ValueError, match="sampling=False"):
        greedy_only.generate(prompts, sampling_params=SamplingParams(prompt_logprobs=0))
    assert greedy_only.warmup_report is None  # refused before any device work
