"""The speculative engine: greedy outputs equal target-only decoding, continuous batching, preemption, stats,
compilation count, the logits cap, bad input (CPU, f32, reference kernels)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minimax_jax import DSparkDrafter, init_drafter
from minimax_jax.drafter_config import DSparkConfig
from spec_decode import Engine, SamplingParams
from spec_decode.cost_table import CostTable
from spec_decode.step import FRESH_DECAY, StepConfig, StepPlan, init_state, make_step_fn
from tests.engine_models import (
    EOS,
    VOCAB,
    bigram_drafter,
    damped_target,
    greedy_reference,
    random_prompts,
    target_config,
)

# Prompts longer than topk x block = 12 tokens (MSA selection live), requests finishing at different steps, and
# more prompts than slots (max_num_seqs = 2).
PROMPT_LENS = [20, 15, 30, 13, 26]
MAX_NEW = [12, 9, 16, 5, 14]
# min_token_bucket 32, no device loop and greedy programs only (every test here is greedy): a small closed set to
# compile (test_engine_serving covers the rest)
COMMON = dict(max_num_seqs=2, max_model_len=96, max_num_batched_tokens=16, implementation="reference",
              min_token_bucket=32, device_loop=False, sampling=False)


@pytest.fixture(scope="module")
def target():
    return damped_target(damping=0.3)


@pytest.fixture(scope="module")
def drafters(target):
    return {7: bigram_drafter(target, block_size=7)}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(len(PROMPT_LENS), PROMPT_LENS, seed=3)


@pytest.fixture(scope="module")
def references(target, prompts):
    return [greedy_reference(target, p, n) for p, n in zip(prompts, MAX_NEW)]


_ENGINES = {}


def engine_for(target, drafter, mode, k, **kw):
    key = (id(target), mode, k, tuple(sorted(kw.items())))
    if key not in _ENGINES:
        _ENGINES[key] = Engine(target, drafter, num_speculative_tokens=k, verification=mode, cost_table=None,
                               **{**COMMON, **kw})
    return _ENGINES[key]


def greedy_params(n):
    return [SamplingParams(max_new_tokens=m) for m in n]


# (fixed, 3) and (none, 0) greedy against target-only decoding also run through the device loop
# (tests/test_device_loop.py); K = 1 is covered by adaptive here, which at K = 1 allocates like fixed.
@pytest.mark.parametrize("mode, k", [("adaptive", 1), ("adaptive", 3), ("fixed", 7), ("adaptive", 7), ("none", 0)])
def test_greedy_equals_target_only_decoding(target, drafters, prompts, references, mode, k):
    eng = engine_for(target, drafters[7], mode, k)
    res = eng.generate(prompts, sampling_params=greedy_params(MAX_NEW), progress=False)
    for i, (r, ref) in enumerate(zip(res, references)):
        assert r.token_ids == ref, f"prompt {i}"
        s = r.stats
        assert s["emitted_tokens"] == len(r.token_ids)
        assert s["finish_reason"] == ("stop" if ref[-1] == EOS else "length")
        if k:
            # every verify step emits accepted + 1, except a last step cut by a stop token
            extra = s["emitted_tokens"] - 1 - sum(s["accepted_per_position"])
            assert extra in (s["target_steps"], s["target_steps"] - 1)
            assert all(0 <= v <= k for v in s["verified_drafts_per_step"])
            assert s["accepted_per_position"] == sorted(s["accepted_per_position"], reverse=True)
    if k:
        assert res.stats["mean_acceptance_length"] > 1.3  # the bigram drafter is often right
        st = res.stats
        assert len(st["verified_drafts_per_step"]) == len(st["budget_per_step"]) == st["verify_steps"]
        assert all(v <= b for v, b in zip(st["verified_drafts_per_step"], st["budget_per_step"]))
        assert all(v <= k * COMMON["max_num_seqs"] for v in st["verified_drafts_per_step"])
        # predicted against observed acceptance per position (the confidences the allocator ranked by)
        pred, obs = st["predicted_per_position_acceptance"], st["per_position_acceptance"]
        assert len(pred) == len(obs) == k
        assert all(0.0 <= p <= 1.0 for p in pred if p == p) and 0.0 <= st["calibration_error"] <= 1.0


def test_windowed_target_greedy_equals_target_only_decoding(prompts):
    """A target whose dense layers slide (window 5, shorter than every prompt) generates exactly its own greedy
    decode (the plain forward with the window), which differs from the unwindowed target's on some prompt."""
    from minimax_jax.config import SLIDING_ATTENTION, SPARSE_ATTENTION

    types = (SLIDING_ATTENTION,) * 2 + (SPARSE_ATTENTION,) * 2
    target = damped_target(damping=0.3, layer_types=types, sliding_window=5)
    plain = damped_target(damping=0.3)  # the same weights, no window
    prompts, max_new = prompts[:3], MAX_NEW[:3]
    refs = [greedy_reference(target, p, n) for p, n in zip(prompts, max_new)]
    assert refs != [greedy_reference(plain, p, n) for p, n in zip(prompts, max_new)]
    eng = Engine(target, bigram_drafter(target, block_size=7), num_speculative_tokens=3, verification="adaptive",
                 cost_table=None, **COMMON)
    res = eng.generate(prompts, sampling_params=greedy_params(max_new), progress=False)
    assert [r.token_ids for r in res] == refs


def test_adaptive_budget_trims_with_a_cost_table(target, drafters, prompts, references):
    """A steep verify cost makes the planner verify fewer drafts; outputs stay exact."""
    steep = CostTable.from_measurements({8: 1.0, 16: 3.0, 32: 6.0})
    eng = Engine(target, drafters[7], num_speculative_tokens=7, verification="adaptive", cost_table=steep,
                 **{**COMMON, "min_token_bucket": 8})
    res = eng.generate(prompts, sampling_params=greedy_params(MAX_NEW), progress=False)
    assert [r.token_ids for r in res] == references
    full = engine_for(target, drafters[7], "fixed", 7).generate(prompts, sampling_params=greedy_params(MAX_NEW),
                                                                progress=False)
    assert res.stats["mean_verified_drafts_per_step"] < full.stats["mean_verified_drafts_per_step"]


def test_prefill_only_steps_draft_nothing(target, drafters, prompts, references):
    """A step without a decode row runs a length-0 program (no drafter forward over the slots, only its context
    write), in fixed verification too; steps that decode draft K; the outputs stay the target's greedy ones."""
    eng = engine_for(target, drafters[7], "fixed", 7)
    launched = []
    launch = eng._launch

    def spy(step, packed=None):
        launched.append((step.key.draft_len, step.num_decode, step.num_prefill_tokens))
        return launch(step, packed)

    eng._launch = spy
    try:
        res = eng.generate(prompts, sampling_params=greedy_params(MAX_NEW), progress=False)
    finally:
        del eng._launch
    assert [r.token_ids for r in res] == references
    prefill_only = [d for d, dec, pre in launched if dec == 0 and pre > 0]
    assert prefill_only and set(prefill_only) == {0}, launched
    assert {d for d, dec, _ in launched if dec > 0} == {7}, launched


def test_a_request_starts_at_the_running_requests_confidences(target, drafters, prompts, references):
    """A slot whose prefill just finished starts at ``fresh_confidences``: the committed decode rows'
    confidences, row-weighted, with earlier steps decayed by FRESH_DECAY (1.0 before any step has decoded), not at
    1.0, which would rank a new request's drafts above every running request's. Requests join while others decode
    (5 prompts, 2 slots); the host's mirror agrees with the device at every step."""
    eng = engine_for(target, drafters[7], "adaptive", 7)
    eng._state = eng._init_state()  # a fresh state (no step has decoded yet), so no cached prefix either
    eng.pool.clear_cache()
    seen, scheds = [], []
    launch, scheduler = eng._launch, eng._scheduler

    def spy(step, packed=None):
        st = eng._state
        before = (np.asarray(st.fresh_confidences), float(st.fresh_weight))
        out = launch(step, packed)
        st = eng._state
        seen.append((step.plan, before, jax.tree.map(np.asarray, out), np.asarray(st.fresh_confidences),
                     np.asarray(st.prev_confidences), float(st.fresh_weight)))
        return out

    eng._launch = spy
    eng._scheduler = lambda: scheds.append(scheduler()) or scheds[-1]
    try:
        res = eng.generate(prompts, sampling_params=greedy_params(MAX_NEW), progress=False)
    finally:
        del eng._launch, eng._scheduler
    assert [r.token_ids for r in res] == references
    joined_late = 0
    for plan, (fresh, weight), out, after, prev, after_weight in seen:
        rows, pre = np.asarray(plan.rows), np.asarray(plan.prefill_len)
        decoded = (rows >= 0) & (pre == 0) & (out.num_emitted > 0) & bool(plan.commit)
        n = decoded.sum()
        if n:  # an independent fold: the decayed weight of earlier steps' rows, then this step's
            kept = weight * FRESH_DECAY
            want, want_weight = (fresh * kept + out.confidences[decoded].sum(0)) / (kept + n), kept + n
        else:
            want, want_weight = fresh, weight
        np.testing.assert_allclose(after, want, rtol=1e-5)
        assert after_weight == pytest.approx(want_weight, rel=1e-6)
        for i in np.flatnonzero((rows >= 0) & (pre > 0) & np.asarray(plan.prefill_last)):
            np.testing.assert_array_equal(prev[rows[i]], after)
            joined_late += bool(n)
    assert (seen[0][1][0] == 1.0).all() and seen[0][1][1] == 0.0
    assert joined_late >= 1 and all((0.0 <= s[3]).all() and (s[3] <= 1.0).all() for s in seen)
    assert any((s[3] < 1.0).any() for s in seen)
    # the host's mirror (what the host loop plans from), folded from the read-backs, ends where the device did;
    # the next call's scheduler starts from the device's
    (host,) = scheds
    np.testing.assert_allclose(host.fresh_conf, seen[-1][3], rtol=1e-5)
    assert host.fresh_weight == pytest.approx(seen[-1][5], rel=1e-6)
    assert eng._scheduler().fresh_weight == pytest.approx(seen[-1][5], rel=1e-6)


def test_no_recompilation_after_warm_up(target, drafters, prompts):
    eng = engine_for(target, drafters[7], "adaptive", 3)
    many = random_prompts(9, [13, 40, 17, 22, 14, 31, 19, 25, 16], seed=11)
    params = [SamplingParams(max_new_tokens=m) for m in [3, 20, 7, 11, 4, 15, 9, 6, 13]]
    eng.generate(many, sampling_params=params, progress=False)
    before = eng.num_compiles
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiled.append(name) if name == "/jax/core/compile/backend_compile_duration"
        else None)
    res = eng.generate(many[::-1], sampling_params=params[::-1], progress=False)
    assert eng.num_compiles == before and res.stats["compiles"] == 0
    assert compiled == []


def test_preemption_under_a_tiny_page_pool_changes_no_output(target, drafters, prompts, references):
    # 14 pages of 4 tokens: the longest request alone needs 13, so requests cannot all stay resident
    eng = Engine(target, drafters[7], num_speculative_tokens=3, verification="adaptive", cost_table=None,
                 num_pages=14, **COMMON)
    res = eng.generate(prompts, sampling_params=greedy_params(MAX_NEW), progress=False)
    assert res.stats["preemptions"] > 0
    assert [r.token_ids for r in res] == references


def test_stream_yields_every_token_once(target, drafters, prompts, references):
    eng = engine_for(target, drafters[7], "adaptive", 3)
    got = {i: [] for i in range(len(prompts))}
    for i, new in eng.stream(prompts, sampling_params=greedy_params(MAX_NEW)):
        assert new
        got[i].extend(new)
    assert [got[i] for i in range(len(prompts))] == references


def test_stop_tokens_and_max_new_tokens(target, drafters, prompts, references):
    eng = engine_for(target, drafters[7], "fixed", 7)
    i = int(np.argmax([len(r) for r in references]))
    ref = references[i]
    stop = ref[4]
    res = eng.generate([prompts[i]], max_new_tokens=len(ref), stop_token_ids=[stop], progress=False)[0]
    assert res.token_ids == ref[: ref.index(stop) + 1] and res.finish_reason == "stop"
    res = eng.generate([prompts[i]], max_new_tokens=3, progress=False)[0]
    assert res.token_ids == ref[:3] and res.finish_reason == "length"
    res = eng.generate([prompts[i]], max_new_tokens=len(ref) + 5, ignore_eos=True, progress=False)[0]
    assert res.token_ids[: len(ref)] == ref and len(res.token_ids) == len(ref) + 5


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("prompt, match", [
    ([], "prompt 1 is empty"),
    ([1, VOCAB], f"prompt 1 holds token id {VOCAB}, outside the vocabulary"),
    ([1, -2, 3], "token id -2"),
    ([1] * 96, "prompt 1 has 96 tokens, more than"),
])
def test_bad_prompts_are_refused_before_any_work(target, drafters, prompt, match):
    eng = engine_for(target, drafters[7], "adaptive", 3)
    with pytest.raises(ValueError, match=match):
        eng.generate([[1, 5, 6], prompt], max_new_tokens=4)
    # the engine is intact: the next call works
    assert eng.generate([[1, 5, 6]], max_new_tokens=2, progress=False)[0].stats["emitted_tokens"] == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(verification="sometimes"), "verification must be one of"),
    (dict(num_speculative_tokens=8), r"num_speculative_tokens must be in \[1, 7\]"),
    (dict(num_speculative_tokens=0), r"num_speculative_tokens must be in \[1, 7\]"),
    (dict(max_model_len=100000), "max_model_len"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(cost_table="fast"), "cost_table"),
])
def test_bad_engine_arguments(target, drafters, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(target, drafters[7], **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(stop_token_ids=[VOCAB + 3]), "stop_token_ids"),
    (dict(loop="gpu"), "loop"),
])
def test_bad_sampling_settings(target, drafters, kwargs, match):
    eng = engine_for(target, drafters[7], "adaptive", 3)
    with pytest.raises(ValueError, match=match):
        eng.generate([[1, 5, 6]], **kwargs)


def test_drafter_for_another_target_is_refused(target):
    other = damped_target(seed=5)
    with pytest.raises(ValueError, match="embed_tokens is not the target's"):
        Engine(target, bigram_drafter(other), verification="adaptive")
    wide = damped_target(hidden_size=32, head_dim=8, rotary_dim=4, index_head_dim=8)
    cfg = DSparkConfig.for_target(wide.cfg, mask_token_id=VOCAB - 1, block_size=4, target_layer_ids=(1, 2))
    with pytest.raises(ValueError, match="hidden_size"):
        Engine(target, init_drafter(cfg, wide), verification="fixed")
    deep_cfg = DSparkConfig.for_target(target_config(), mask_token_id=VOCAB - 1, block_size=4,
                                       target_layer_ids=(1, 3)).replace(target_layer_ids=(1, 9), num_target_layers=12)
    # built directly (init_drafter would refuse it too): features of layer 9 of a 12-layer target
    deep = DSparkDrafter(deep_cfg, embed_tokens=target.embed_tokens[...], lm_head=target.lm_head[...],
                         dtype=target.dtype, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="target_layer_ids"):
        Engine(target, deep, verification="fixed")


def test_drafter_without_confidence_head_runs_on_the_estimator(target, prompts, references):
    drafter = bigram_drafter(target, block_size=4, confidence=False)
    with pytest.warns(UserWarning, match="online acceptance estimator"):
        eng = Engine(target, drafter, num_speculative_tokens=3, verification="adaptive", cost_table=None, **COMMON)
    res = eng.generate(prompts[:2], sampling_params=greedy_params(MAX_NEW[:2]), progress=False)
    assert [r.token_ids for r in res] == references[:2]


def test_logits_cap_holds_in_fixed_mode(target, drafters, prompts, references):
    """2 rows x (1 + 7) would need 16 verify-logits rows; with a cap of 10 fixed K verifies fewer, evenly."""
    with pytest.warns(UserWarning, match="verifies fewer than K=7"):
        eng = Engine(target, drafters[7], num_speculative_tokens=7, verification="fixed", cost_table=None,
                     max_total_logit_rows=10, **COMMON)
    res = eng.generate(prompts, sampling_params=greedy_params(MAX_NEW), progress=False)
    assert [r.token_ids for r in res] == references
    assert max(res.stats["verified_drafts_per_step"]) <= 10 - 2
    assert max(v for r in res for v in r.stats["verified_drafts_per_step"]) == 7  # alone, a request gets all 7


def test_draft_cache_shares_the_target_pool(target, drafters):
    """init_state puts the draft cache on the target's pool (same page size and count, tables as wide as the
    plans'); a step refuses, while tracing (before any device work), a draft pool of another size or plan tables
    of another width."""
    drafter = drafters[7]
    state = init_state(target, drafter, num_slots=2, num_pages=10, max_model_len=32, num_speculative_tokens=3,
                       use_estimator=False, cache_dtype=jnp.float32)
    dc = state.draft_cache
    assert (dc.num_pages, dc.page_size) == (state.cache.num_pages, state.cache.page_size) == (10, 4)
    assert dc.block_tables.shape == (2, 8) and (np.asarray(dc.block_tables) == -1).all()
    step = make_step_fn(target, drafter, StepConfig(num_speculative_tokens=3, mode="fixed",
                                                    implementation="reference"))
    r, t = 2, 8

    def plan(width):
        z = jnp.zeros((r,), jnp.int32)
        return StepPlan(rows=jnp.arange(r, dtype=jnp.int32), prefill_tokens=jnp.zeros((t,), jnp.int32),
                        prefill_len=z, prefill_start=z, prefill_last=jnp.zeros((r,), bool), resume_token=z - 1,
                        block_tables=jnp.zeros((r, width), jnp.int32), scheduled=z, budget=jnp.int32(0),
                        temperature=jnp.zeros((r,)), top_k=z, top_p=jnp.ones((r,)), seed=z, limit=z + 1,
                        prefill_emitted=z, stop_ids=jnp.full((r, 1), -1, jnp.int32), commit=jnp.bool_(False))

    params = (nnx.state(target), nnx.state(drafter))
    with pytest.raises(ValueError, match="plan.block_tables has width 5, the draft cache's tables 8"):
        jax.eval_shape(step, *params, state, plan(5))
    private = dataclasses.replace(state, draft_cache=drafter.init_cache(2, 32, dtype=jnp.float32))
    with pytest.raises(ValueError, match=r"draft cache \(16 pages of 4\) must share the target's page pool "
                                         r"\(10 pages of 4\)"):
        jax.eval_shape(step, *params, private, plan(8))
