"""Stochastic speculative decoding is lossless: the engine's samples follow target-only sampling (chi-square over
many seeds, temperature 1 and top-p), and the budget's staleness is what keeps adaptive verification lossless: a
variant that plans the budget from the *current* confidences (a negative control built only here) is biased.
Likewise with penalties and min-p at K = 1, 3, 7 and adaptive, against a control that ignores the drafts before a
position when it penalises it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_decode import Engine
from spec_decode.buckets import token_bucket
from spec_decode.cost_table import CostTable
from tests.engine_models import (
    VOCAB,
    bigram_drafter,
    damped_target,
    filtered_probs,
    penalized,
    target_logits,
    target_probs,
)

PROMPT = [1, 7, 19, 4, 25, 11, 9, 30, 6, 14, 22, 5, 17, 8]  # 14 tokens: MSA selection live (topk x block = 12)
N = 1200  # requests (seeds) per engine
HIGH = set(range(0, VOCAB, 2))  # confidence of the next draft is high after an even draft token


def staleness_pair():
    """K = 2. c_1 = 0.5 whatever the anchor (STS temperature 1000); c_2 = sigmoid(+-4): high iff draft 1 is even.

    With the cost table below, a budget planned from these *current* confidences verifies both drafts when draft 1
    is even and none when it is odd, so whether draft 1 is verified depends on draft 1 itself."""
    target = damped_target(damping=0.3, sharpness=2.0)
    drafter = bigram_drafter(target, block_size=2, confidence=True)
    w = drafter.confidence_head.proj.kernel[...]
    d = target.cfg.hidden_size
    markov_w = jnp.asarray([4.0 if t in HIGH else -4.0 for t in range(VOCAB)], jnp.float32)
    drafter.confidence_head.proj.kernel[...] = w.at[:d].set(0.0).at[d:, 0].set(markov_w)
    drafter.confidence_head.proj.bias[...] = jnp.zeros_like(drafter.confidence_head.proj.bias[...])
    drafter.set_sts_temperatures([1000.0, 1.0])
    return target, drafter


# value(0) = 1 / 1.0 beats value(2) = (1 + 0.5 + 0.5 c_2) / 1.75 unless c_2 is high (module docstring). The planner
# prices a step at the token bucket it runs in, so the engines below compile buckets of 1, 2 and 4 tokens
# (min_token_bucket=1) and the table is measured there: 1 token (the anchor alone), 2, and 3 (in the 4-token bucket)
COSTS = CostTable.from_measurements({1: 1.0, 2: 1.75, 4: 1.75})
STALENESS_ENGINE = dict(num_speculative_tokens=2, verification="adaptive", cost_table=COSTS, max_num_seqs=1,
                        max_model_len=32, implementation="reference", device_loop=False, max_num_batched_tokens=16,
                        min_token_bucket=1)


class CurrentConfidenceBudget(Engine):
    """NEGATIVE CONTROL: plans each step's budget from the confidences of the drafts it is about to verify."""

    def _launch(self, step, packed=None):  # re-plans the step, so the host's packed plan is dropped
        plan = step.plan
        dec = [i for i, r in enumerate(step.row_requests) if r is not None and plan.prefill_len[i] == 0]
        if dec:
            dry = dataclasses.replace(plan, commit=np.asarray(False))
            # same drafts: keys depend on (seed, position) only; commit=False leaves lengths and tokens as they are
            self._state, out = self._programs.run(step.key, self._target_params, self._drafter_params, self._state,
                                                  dry)
            conf = np.asarray(out.confidences)[dec]
            budget = self.planner.budget(conf, plan.scheduled[dec], num_sampling_rows=len(dec),
                                         num_non_draft_tokens=len(dec))
            t = token_bucket(self.token_buckets, step.num_prefill_tokens + len(dec) + budget)
            tokens = np.zeros(t, np.int32)
            tokens[: step.num_prefill_tokens] = plan.prefill_tokens[: step.num_prefill_tokens]
            plan = dataclasses.replace(plan, budget=np.asarray(budget, np.int32), prefill_tokens=tokens)
            key = next(key for key in self.step_keys if key.tokens == t and key.sampling == step.key.sampling
                       and key.draft_len == step.key.draft_len)
            step = dataclasses.replace(step, plan=plan, budget=budget, key=key)
        return super()._launch(step)


@pytest.fixture(scope="module")
def pair():
    return staleness_pair()


def exact_marginals(target, temperature=1.0, top_p=1.0):
    """P(token 2) and P(token 3) of target-only sampling after PROMPT (filtered by top-p)."""
    def dist(prefixes):
        p = target_probs(target, prefixes, temperature, length=32)
        if top_p < 1.0:
            srt = np.sort(p, axis=-1)[:, ::-1]
            before = np.cumsum(srt, axis=-1) - srt
            thresh = np.min(np.where(before < top_p, srt, np.inf), axis=-1, keepdims=True)
            p = np.where(p >= thresh, p, 0.0)
            p /= p.sum(-1, keepdims=True)
        return p

    p1 = dist([PROMPT])[0]
    p2_given = dist([PROMPT + [a] for a in range(VOCAB)])  # [V, V]
    p12 = p1[:, None] * p2_given
    p3_given = dist([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).reshape(VOCAB, VOCAB, VOCAB)
    return p12.sum(0), (p12[:, :, None] * p3_given).sum((0, 1))


def sample_tokens(engine, **kw):
    # 4 new tokens: the first verify step may verify both drafts (the last one never drafts past the budget)
    res = engine.generate([PROMPT] * N, max_new_tokens=4, ignore_eos=True, seed=0, progress=False, **kw)
    toks = np.asarray([r.token_ids for r in res])
    return toks, res.stats


def chi2_pvalue(samples, probs):
    counts = np.bincount(samples, minlength=VOCAB).astype(np.float64)
    expected = probs * len(samples)
    keep = expected >= 5  # pool rare cells
    obs = np.concatenate([counts[keep], [counts[~keep].sum()]])
    exp = np.concatenate([expected[keep], [expected[~keep].sum()]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
        assert counts[~keep].sum() == 0, "samples outside the support"
    stat = float(np.sum((obs - exp) ** 2 / exp))
    return float(jax.scipy.special.gammaincc((len(obs) - 1) / 2.0, stat / 2.0))


@pytest.fixture(scope="module")
def adaptive_engine(pair):
    # one engine (one compile) for both top-p cases: top_p is a per-request setting
    target, drafter = pair
    return Engine(target, drafter, **STALENESS_ENGINE)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_adaptive_sampling_matches_target_only_sampling(pair, adaptive_engine, top_p):
    target, _ = pair
    toks, st = sample_tokens(adaptive_engine, temperature=1.0, top_p=top_p)
    p2, p3 = exact_marginals(target, top_p=top_p)
    # drafts were verified (and some rejected): about 0.4 a step. A request's first plan reads the running
    # requests' mean (c_1 = 0.5, c_2 near 0.5), where verifying does not pay; its second reads its own first drafts
    assert st["mean_verified_drafts_per_step"] > 0.3
    assert st["mean_acceptance_length"] > 1.1
    assert chi2_pvalue(toks[:, 1], p2) > 1e-3
    assert chi2_pvalue(toks[:, 2], p3) > 1e-3


def test_budget_from_current_confidences_is_biased(pair):
    target, drafter = pair
    control = CurrentConfidenceBudget(target, drafter, **STALENESS_ENGINE)
    toks, _ = sample_tokens(control, temperature=1.0)
    p2, _ = exact_marginals(target)
    # the control verifies draft 1 only when it is even: even second tokens are over-represented
    even = np.isin(toks[:, 1], list(HIGH)).mean()
    assert even > p2[list(HIGH)].sum() + 0.05
    assert chi2_pvalue(toks[:, 1], p2) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# Penalties and min-p under speculation. A penalty at verify position i depends on the drafts before it; the engine
# transforms target and draft distributions at each position from that position's prefix. The exact marginals of
# the 2nd and 3rd tokens (and of "the 3rd token repeats the 2nd", the event a penalty acts on) under penalised
# target-only sampling are computed here in numpy; a NEGATIVE CONTROL that penalises each position with the
# committed tokens only (the drafts before it ignored) over-produces repeats and fails the same test.

PENALTIES = dict(temperature=1.0, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=1.0)
SLOTS = 8  # 1,200 requests in 150 waves of 8 rows
ADAPTIVE_COSTS = {8: 1.0, 16: 1.15, 24: 1.3, 32: 1.45, 48: 1.9, 64: 2.5, 128: 5.0}


def penalised_exact(target):
    """P(token 2), P(token 3), P(token 3 == token 2) of penalised target-only sampling after PROMPT."""
    kw = dict(repetition=PENALTIES["repetition_penalty"], frequency=PENALTIES["frequency_penalty"],
              presence=PENALTIES["presence_penalty"])

    def dist(outputs):
        lg = target_logits(target, [PROMPT + o for o in outputs], length=16)
        return np.stack([filtered_probs(penalized(x, PROMPT, o, **kw), PENALTIES["temperature"],
                                        min_p=PENALTIES["min_p"]) for x, o in zip(lg, outputs)])

    p1 = dist([[]])[0]
    p12 = p1[:, None] * dist([[a] for a in range(VOCAB)])
    p3 = dist([[a, b] for a in range(VOCAB) for b in range(VOCAB)]).reshape(VOCAB, VOCAB, VOCAB)
    p123 = p12[:, :, None] * p3
    repeat = float(sum(p123[:, b, b].sum() for b in range(VOCAB)))
    return p12.sum(0), p123.sum((0, 1)), repeat


@pytest.fixture(scope="module")
def penalty_pair():
    target = damped_target(damping=0.3, sharpness=3.0)
    return target, bigram_drafter(target, block_size=7, confidence=True), penalised_exact(target)


def penalty_engine(target, drafter, verification, k):
    # one packed-token bucket: a greedy and a sampling program, and the token-history writer
    # adaptive: a table on which verifying more costs more, so budgets bind and the confidences choose the drafts
    cost = CostTable.from_measurements(ADAPTIVE_COSTS) if verification == "adaptive" else None
    return Engine(target, drafter, num_speculative_tokens=k, verification=verification, cost_table=cost,
                  max_num_seqs=SLOTS, max_model_len=32, implementation="reference", device_loop=False,
                  max_num_batched_tokens=16, min_token_bucket=128)


def binom_pvalue(hits, n, p):
    stat = (hits - n * p) ** 2 / (n * p * (1 - p))
    return float(jax.scipy.special.gammaincc(0.5, stat / 2.0))


def penalised_samples(engine, k):
    # K + 2 tokens: the first verify step schedules all K drafts (the 2nd and 3rd tokens come from its rows 0, 1)
    res = engine.generate([PROMPT] * N, max_new_tokens=k + 2, ignore_eos=True, seed=0, progress=False, **PENALTIES)
    return np.asarray([r.token_ids[:3] for r in res]), res.stats


@pytest.mark.parametrize("verification,k", [("fixed", 1), ("fixed", 3), ("fixed", 7), ("adaptive", 3)])
def test_penalties_and_min_p_match_penalised_target_only_sampling(penalty_pair, verification, k):
    target, drafter, (p2, p3, repeat) = penalty_pair
    toks, st = penalised_samples(penalty_engine(target, drafter, verification, k), k)
    assert st["mean_acceptance_length"] > 1.2  # drafts were accepted (rows 1.. of a verify step sampled)
    assert st["compiles"] == 0
    assert chi2_pvalue(toks[:, 1], p2) > 1e-3
    assert chi2_pvalue(toks[:, 2], p3) > 1e-3
    assert binom_pvalue(int(np.sum(toks[:, 2] == toks[:, 1])), N, repeat) > 1e-3


def test_penalties_from_committed_tokens_only_are_biased(penalty_pair, monkeypatch):
    """NEGATIVE CONTROL: the counts at every position ignore the drafts before it."""
    import spec_decode.step as step_module

    target, drafter, (_, _, repeat) = penalty_pair
    real = step_module.penalize_at

    def committed_only(scaled, counts, mask, slots, drafts, num_before, *args):
        return real(scaled, counts, mask, slots, drafts, jnp.zeros_like(num_before), *args)

    monkeypatch.setattr(step_module, "penalize_at", committed_only)
    toks, _ = penalised_samples(penalty_engine(target, drafter, "fixed", 3), 3)
    hits = int(np.sum(toks[:, 2] == toks[:, 1]))
    assert hits > N * repeat + 12  # an accepted draft 1 is not penalised at row 1: the 3rd token repeats it
    assert binom_pvalue(hits, N, repeat) < 1e-6
