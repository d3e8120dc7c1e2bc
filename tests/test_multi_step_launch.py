"""The host loop's multi-step launches (``Engine(decode_steps_per_launch=M)``): while every running request decodes
and nothing waiting could be admitted, up to ``M`` decode steps run in one launch of the device loop's program.
The tokens are target-only greedy decoding's and, with sampling, the one-step-at-a-time loop's; streams deliver
every token once; every write lands on pages its request owns; admissions resume as soon as a request finishes.
CPU, f32, reference kernels."""

import numpy as np
import pytest

from spec_decode import Engine, SamplingParams
from spec_decode.programs import compile_counter
from spec_decode.scheduler import Scheduler
from tests.engine_models import EOS, bigram_drafter, damped_target, greedy_reference, random_prompts

COMMON = dict(max_num_seqs=3, max_model_len=96, max_num_batched_tokens=16, implementation="reference")
PROMPT_LENS = [20, 15, 30, 13, 26, 9, 40]
MAX_NEW = [12, 9, 16, 5, 14, 20, 7]


@pytest.fixture(scope="module")
def target():
    return damped_target(damping=0.3)


@pytest.fixture(scope="module")
def drafter(target):
    return bigram_drafter(target, block_size=7)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(len(PROMPT_LENS), PROMPT_LENS, seed=11)


@pytest.fixture(scope="module")
def references(target, prompts):
    return [greedy_reference(target, p, n) for p, n in zip(prompts, MAX_NEW)]


@pytest.mark.parametrize("mode, k", [("adaptive", 3), ("fixed", 7), ("none", 0)])
def test_multi_step_launches_give_target_only_greedy_tokens(target, drafter, prompts, references, mode, k,
                                                            monkeypatch):
    """More prompts than slots (a finished request frees its slot mid-run), EOS inside accepted drafts, every
    write checked against page ownership; then a stream of the same prompts yields the same tokens, once each;
    nothing compiles after the warm-up."""
    monkeypatch.setattr(Scheduler, "check_writes", True)
    eng = Engine(target, drafter if k else None, num_speculative_tokens=k, verification=mode, cost_table=None,
                 decode_steps_per_launch=4, sampling=False, precompile=True, **COMMON)
    params = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]
    scheds, scheduler = [], eng._scheduler
    eng._scheduler = lambda: scheds.append(scheduler()) or scheds[-1]
    with compile_counter(cache_loads=True) as compiled:
        res = eng.generate(prompts, sampling_params=params, progress=False)
        assert [r.token_ids for r in res] == references
        if k:  # the host's mirror of a new request's start, through single steps and launches, is the device's
            np.testing.assert_allclose(scheds[0].fresh_conf, np.asarray(eng._state.fresh_confidences), rtol=1e-5)
            assert scheds[0].fresh_weight == pytest.approx(float(eng._state.fresh_weight), rel=1e-5)
        for r, ref in zip(res, references):
            assert r.finish_reason == ("stop" if ref[-1] == EOS else "length")
        st = res.stats
        assert st["multi_step_launches"] > 0 and st["steps_in_multi_step_launches"] > st["multi_step_launches"]
        assert st["steps"] >= st["verify_steps"] >= st["steps_in_multi_step_launches"]
        assert len(st["verified_drafts_per_step"]) == st["verify_steps"]
        assert sum(r.stats["target_steps"] for r in res) >= st["verify_steps"]
        streamed = {i: [] for i in range(len(prompts))}
        for i, new in eng.stream(prompts, sampling_params=params):
            assert new
            streamed[i].extend(new)
        assert [streamed[i] for i in range(len(prompts))] == references
    assert compiled == []


def test_sampled_tokens_equal_one_step_at_a_time(target, drafter, prompts):
    """Fixed verification verifies the same drafts either way (each row every draft it may still use: a launch
    that may end before its first iteration promises no token, so the next step's drafts are not cut short), and
    the sampling keys depend on (seed, position) only: sampled rows with penalties, min-p and min_tokens, and stop
    ids, give the same tokens, and every request the same verified drafts per step, in multi-step launches as one
    step at a time."""
    rng = np.random.default_rng(5)
    params = []
    for i, m in enumerate(MAX_NEW):
        kw = dict(max_new_tokens=m, seed=int(rng.integers(0, 1000)), temperature=1.0)
        if i % 3 == 1:
            kw.update(top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=2)
        if i % 3 == 2:
            kw.update(stop_token_ids=(int(rng.integers(3, 31)),), presence_penalty=0.3)
        params.append(SamplingParams(**kw))
    runs = []
    eng = Engine(target, drafter, num_speculative_tokens=3, verification="fixed", cost_table=None,
                 decode_steps_per_launch=5, **COMMON)
    for m in (1, 5):  # one engine (one compile), one step per launch first
        eng.decode_steps_per_launch = m
        runs.append(eng.generate(prompts, sampling_params=params, progress=False))
    assert runs[0].stats["multi_step_launches"] == 0
    assert runs[1].stats["multi_step_launches"] > 0
    assert [r.token_ids for r in runs[1]] == [r.token_ids for r in runs[0]]
    assert [r.finish_reason for r in runs[1]] == [r.finish_reason for r in runs[0]]
    assert ([r.stats["verified_drafts_per_step"] for r in runs[1]]
            == [r.stats["verified_drafts_per_step"] for r in runs[0]])


def test_bad_steps_per_launch_is_refused(target, drafter):
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="decode_steps_per_launch"):
            Engine(target, drafter, num_speculative_tokens=3, decode_steps_per_launch=bad, **COMMON)


def test_no_launch_after_the_last_when_drafts_are_accepted(monkeypatch):
    """With most drafts accepted a launch emits several tokens a step, far above its lower bound of one: the host
    expects the launches in flight to finish every request (at its observed tokens per step) and plans no further,
    empty, launch. The negative control (the expectation switched off) makes one; the tokens are the same."""
    target = damped_target(damping=0.02)  # nearly its own bigram table: the bigram drafter's drafts survive
    drafter = bigram_drafter(target, block_size=7)
    prompts = random_prompts(3, [20, 15, 30], seed=3)
    # generate's launches are 16 M steps: M = 2 makes them 32, fewer than the 60 tokens a request's lower bound
    # (one a step) must cover, so only the expectation stops the host from launching again
    eng = Engine(target, drafter, num_speculative_tokens=7, verification="fixed", cost_table=None,
                 decode_steps_per_launch=2, sampling=False, enable_prefix_caching=False, **COMMON)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    eng.record_launches = True
    res = eng.generate(prompts, sampling_params=params, progress=False)
    assert res.stats["mean_acceptance_length"] > 4 and res.stats["multi_step_launches"] > 0
    assert res.stats["empty_launches"] == 0
    timeline = res.stats["launch_timeline"]  # one record per launch, in order, its times in order
    bursts = [t for t in timeline if t["kind"] == "multi_step"]
    assert len(bursts) == res.stats["multi_step_launches"]
    assert sum(t["steps"] for t in bursts) == res.stats["steps_in_multi_step_launches"]
    assert all(t["steps"] <= t["max_steps"] == 32 for t in bursts)
    assert len(timeline) - len(bursts) + res.stats["steps_in_multi_step_launches"] == res.stats["steps"]
    for t in timeline:
        assert 0 <= t["launch_start"] <= t["launch_end"] <= t["ready"] <= t["committed"]
    assert all(a["launch_end"] <= b["launch_start"] for a, b in zip(timeline, timeline[1:]))  # one launcher
    eng.record_launches = False
    monkeypatch.setattr(Scheduler, "expects_in_flight_to_finish", lambda self: False)
    control = eng.generate(prompts, sampling_params=params, progress=False)
    assert control.stats["empty_launches"] >= 1
    assert [r.token_ids for r in control] == [r.token_ids for r in res]
    assert [len(r.token_ids) for r in res] == [60] * 3


def test_generate_launches_the_ramps_top_and_a_stream_ramps(target, drafter, prompts, references, monkeypatch):
    """A stream's multi-step launches grow from M steps (its consumer sees early tokens); generate's are 16 M from
    the first (nobody sees a token before it returns, and every launch costs the host). Same tokens either way."""
    asked = []
    schedule_burst = Scheduler.schedule_burst

    def spy(self, max_steps, **kw):
        burst = schedule_burst(self, max_steps, **kw)
        if burst is not None:
            asked.append(max_steps)
        return burst

    monkeypatch.setattr(Scheduler, "schedule_burst", spy)
    eng = Engine(target, drafter, num_speculative_tokens=3, verification="adaptive", cost_table=None,
                 decode_steps_per_launch=2, sampling=False, **COMMON)
    params = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]
    res = eng.generate(prompts, sampling_params=params, progress=False)
    generated, asked[:] = list(asked), []
    streamed = {i: [] for i in range(len(prompts))}
    for i, new in eng.stream(prompts, sampling_params=params):
        streamed[i].extend(new)
    assert [r.token_ids for r in res] == references
    assert [streamed[i] for i in range(len(prompts))] == references
    assert generated and set(generated) == {32}
    assert asked[0] == 2 and set(asked) <= {2, 8, 32} and 8 in asked
