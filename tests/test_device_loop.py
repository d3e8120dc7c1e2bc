"""Jitted offline batch decoding (``loop="device"``): the same tokens as the host engine and as target-only
decoding, the device budget planner in situ, stochastic outputs identical to the engine's, nothing compiled after
warm-up, waves that fit the page pool, the logits cap, the profiled cost table (CPU, f32, reference kernels)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_decode import Engine, SamplingParams, generate_offline
from spec_decode.buckets import ZERO_LENGTH_BUCKETS
from spec_decode.cost_table import CostTable
from spec_decode.device_loop import loop_inputs
from spec_decode.engine import _with_lengths
from spec_decode.planner import DEVICE_LOOP_STEP_KEY
from spec_decode.programs import compile_counter
from tests.engine_models import EOS, bigram_drafter, damped_target, greedy_reference, random_prompts

PROMPT_LENS = [20, 15, 30, 13, 26]  # > topk x block = 12: MSA selection is live
MAX_NEW = [12, 9, 16, 5, 14]  # requests finish at different steps
# Every prompt in one prefill step (128 >= 104 tokens) and one slot each: the host engine then plans the same
# steps as the device loop, which is what lets the adaptive comparisons below be exact.
COMMON = dict(max_num_seqs=8, max_model_len=96, max_num_batched_tokens=128, implementation="reference",
              device_loop_token_buckets=2)
# A verify cost steep enough that the planner trims (0.25 s a step at 8 tokens up to 4 s at 64).
STEEP = CostTable.from_measurements({8: 0.25, 16: 1.0, 32: 2.0, 64: 4.0})


@pytest.fixture(scope="module")
def target():
    return damped_target(damping=0.3)


@pytest.fixture(scope="module")
def drafter(target):
    return bigram_drafter(target, block_size=7)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(len(PROMPT_LENS), PROMPT_LENS, seed=3)


@pytest.fixture(scope="module")
def references(target, prompts):
    return [greedy_reference(target, p, n) for p, n in zip(prompts, MAX_NEW)]


def _timing_run(eng, *, branch: int, budget: int, steps: int, context: int):
    """A timing run of the greedy loop's ``branch`` (its index in switch order) with ``budget`` drafts, every slot
    decoding at ``context`` tokens, for ``steps`` iterations: the loop's outputs (numpy)."""
    program, r = eng._loop_programs[(False, None)], eng.max_num_seqs
    eng._state = eng._placed(_with_lengths(eng._state, np.full(r, context, np.int32)))
    inputs = dataclasses.replace(eng._example_loop_inputs(), rows=np.arange(r, dtype=np.int32),
                                 block_tables=eng._profile_tables(context + 4), limit=np.full(r, 50, np.int32),
                                 max_steps=np.asarray(steps, np.int32), timing_branch=np.asarray(branch, np.int32),
                                 timing_budget=np.asarray(budget, np.int32), cost_table=eng.planner.device_table())
    eng._state, out = program(eng._target_params, eng._drafter_params, eng._state, eng._put_loop_inputs(inputs))
    return eng._read_loop(out, (False, None))


def test_adaptive_device_loop_is_the_engine_step_for_step(target, drafter, prompts, references):
    """Mixed greedy and T = 1 / top-p rows, adaptive K = 7 under a trimming cost table: the device loop gives the
    host engine's tokens and per-request statistics exactly (same budgets every step: the jnp planner over the
    carried confidences is the host planner; the host loop reads every step back, so both plan from the previous
    step's confidences), greedy rows equal target-only decoding."""
    params = [SamplingParams(max_new_tokens=m, seed=11 + i, ignore_eos=True,
                             **({} if i % 2 == 0 else dict(temperature=1.0, top_p=0.9)))
              for i, m in enumerate(MAX_NEW)]
    # one token bucket (64) for both loops: fewer programs to compile; the budgets are still trimmed by STEEP
    # one step per launch: the host loop plans every step on the host (the comparison is host planner vs device)
    eng = Engine(target, drafter, num_speculative_tokens=7, verification="adaptive", cost_table=STEEP,
                 async_scheduling=False, decode_steps_per_launch=1,
                 device_loop_plan_interval=1,  # the host loop's rule: a plan every step
                 **{**COMMON, "min_token_bucket": 64, "device_loop_token_buckets": 1})
    dev = eng.generate(prompts, sampling_params=params, loop="device")
    host = eng.generate(prompts, sampling_params=params, loop="host")
    for i, (d, h) in enumerate(zip(dev, host)):
        assert d.token_ids == h.token_ids, f"request {i}"
        assert d.stats == h.stats, f"request {i}"
        assert len(d.token_ids) == MAX_NEW[i]  # ignore_eos: every row runs to its max_new_tokens
    for i in range(0, len(prompts), 2):  # the greedy rows
        ref = greedy_reference(target, prompts[i], MAX_NEW[i], stop=())
        assert dev[i].token_ids == ref
    st, hst = dev.stats, host.stats
    assert st["loop"] == "device" and st["compiles"] == 0 and eng.warmup_report.programs >= 2
    assert st["budget_per_step"] == hst["budget_per_step"]
    assert st["predicted_per_position_acceptance"] == pytest.approx(hst["predicted_per_position_acceptance"],
                                                                     rel=1e-4, nan_ok=True)
    assert st["calibration_error"] == pytest.approx(hst["calibration_error"], rel=1e-4)
    assert st["verified_drafts_per_step"] == hst["verified_drafts_per_step"]
    assert st["budget_per_step"][0] < sum(min(7, m - 1) for m in MAX_NEW) == 32  # the planner trimmed
    assert all(v <= b for v, b in zip(st["verified_drafts_per_step"], st["budget_per_step"]))
    assert st["mean_acceptance_length"] > 1.3


@pytest.mark.parametrize("mode, k", [("fixed", 3), ("none", 0)])
def test_greedy_equals_target_only_decoding(target, drafter, prompts, references, mode, k):
    params = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]
    if mode == "none":  # the one-call form
        res = generate_offline(target, None, prompts, sampling_params=params, num_speculative_tokens=k,
                               verification=mode, sampling=False, **COMMON)
    else:
        eng = Engine(target, drafter, num_speculative_tokens=k, verification=mode, sampling=False, **COMMON)
        res = eng.generate(prompts, sampling_params=params, loop="device")
    assert [r.token_ids for r in res] == references
    for r, ref in zip(res, references):
        s = r.stats
        assert s["finish_reason"] == ("stop" if ref[-1] == EOS else "length")
        assert s["emitted_tokens"] == len(ref)
        assert s["target_steps"] == len(s["verified_drafts_per_step"])
        if k:
            extra = s["emitted_tokens"] - 1 - sum(s["accepted_per_position"])
            assert extra in (s["target_steps"], s["target_steps"] - 1)
            assert all(0 <= v <= k for v in s["verified_drafts_per_step"])
        else:
            assert s["target_steps"] == len(ref) - 1
    st = res.stats
    assert st["verify_steps"] == len(st["budget_per_step"]) == len(st["verified_drafts_per_step"])
    if mode == "fixed":
        # fixed: every unfinished row verifies min(K, what it may still emit - 1)
        assert st["budget_per_step"][0] == sum(min(k, m - 1) for m in MAX_NEW)
        # another batch (other lengths) runs the program compiled at warm-up
        other = random_prompts(3, [17, 40, 9], seed=5)
        with compile_counter(cache_loads=True) as compiled:
            again = eng.generate(other, max_new_tokens=10, loop="device")
        assert again.stats["compiles"] == 0 and compiled == []
        assert [r.token_ids for r in again] == [greedy_reference(target, p, 10) for p in other]


def test_profiled_cost_table_times_the_loop_branches_inside_the_loop(target, prompts, references):
    """A drafter without a confidence head (the online estimator) and the default profiled table: warm-up times
    every branch of the greedy device loop inside the loop and keeps whole steps per draft length (the loop's own
    lengths and buckets, nothing added for the loop's own step: its timings hold it). A timing run repeats its
    branch for exactly ``max_steps`` iterations at the given budget and commits nothing. The profile leaves no
    trace: the estimator has learnt nothing, and both loops give the target's tokens from the table."""
    drafter = bigram_drafter(target, block_size=4, confidence=False)
    with pytest.warns(UserWarning, match="online acceptance estimator"):
        eng = Engine(target, drafter, num_speculative_tokens=3, verification="adaptive", draft_lengths=(0, 3),
                     sampling=False, **COMMON)
    eng.warmup()
    table, cfg = eng.cost_table, eng.loop_config
    # per draft length, the largest 2 decode buckets of the closed set (0 drafts: the 8 rows fit the smallest)
    assert cfg.token_buckets == ((8,), (16, 32))
    assert [(d, b) for d, b, _ in table.per_length] == list(zip(cfg.draft_lengths, cfg.token_buckets))
    assert all(s > 0 for _, _, seconds in table.per_length for s in seconds)
    meta = table.metadata
    assert "inside the loop" in meta["source"] and DEVICE_LOOP_STEP_KEY not in meta
    assert set(meta["median_s"]) == {"0/8", "3/16", "3/32"} and meta["loop_iterations"][0] == 1
    fresh = eng._init_state().estimator
    for got, want in zip(jax.tree.leaves(eng._state.estimator), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(eng.planner.device_table().length_seconds,
                                  eng.planner.device_table(with_loop_step=False).length_seconds)

    # a timing run of branch 3/16 (index 1) on 8 decoding slots at context 20: 5 iterations, none committed
    program, r = eng._loop_programs[(False, None)], eng.max_num_seqs
    out = _timing_run(eng, branch=1, budget=8, steps=5, context=20)
    assert int(out.steps) == 5 and out.draft_len_per_step[:5].tolist() == [3] * 5
    assert out.budget_per_step[:5].tolist() == [8] * 5 and out.live_per_step[:5].tolist() == [8] * 5
    assert np.asarray(eng._state.num_cached).tolist() == [20] * r
    assert not np.asarray(eng._state.num_emitted).any() and not np.asarray(eng._state.done).any()
    # the timer at another context, with fewer slots decoding (as scripts/bench_loop_overhead.py --contexts runs
    # it): every slot's state at that context, the given slots live
    _, timer, context = eng._loop_branch_timer(program, context=30)
    assert context == 30 and timer(3, 16, 2, 4) > 0
    assert np.asarray(eng._state.num_cached).tolist() == [30] * r
    with pytest.raises(ValueError, match="context"):
        eng._loop_branch_timer(program, context=eng.max_model_len)
    # the script's sweep over two contexts with live counts: every branch at each context, each shape once
    from scripts.bench_loop_overhead import context_sweep, shapes

    sweep = context_sweep(eng, [20, 30], rounds=1, live=(2,))
    branches = eng._loop_branch_timer(program)[0]
    want = [(c, f"{d}/{t}", name, n) for c in (20, 30) for d, t in branches for name, n in shapes(d, t, r, (2,))]
    assert [(w["context"], w["branch"], w["shape"], w["live"]) for w in sweep["rows"]] == want
    assert any(w[2] == "live 2" for w in want) and all(np.isfinite(w["ms_per_iteration"]) for w in sweep["rows"])
    eng._state = eng._placed(_with_lengths(eng._state, np.zeros(r, np.int32)))
    eng.pool.clear_cache()

    params = [SamplingParams(max_new_tokens=m) for m in MAX_NEW[:3]]
    res = eng.generate(prompts[:3], sampling_params=params, loop="device")
    assert [r.token_ids for r in res] == references[:3]
    assert res.stats["token_buckets"] == [[8], [16, 32]]
    assert all(0 <= v <= b for v, b in zip(res.stats["verified_drafts_per_step"], res.stats["budget_per_step"]))
    assert set(res.stats["draft_length_per_step"]) <= {0, 3}
    assert [r.token_ids for r in eng.generate(prompts[:3], sampling_params=params, loop="host")] == references[:3]


def test_draft_lengths_device_loop_is_the_engine_step_for_step(target, drafter, prompts, references):
    """A table with draft lengths 0 and 3 on which neither always wins: the device loop chooses the host's draft
    length and budget at every step (same tokens, same per-request statistics, same per-step plans), both use
    both lengths, and greedy tokens are the target's."""
    table = CostTable.from_measurements({128: 1.0, 256: 2.0}, draft_lengths={0: 0.0, 3: 0.35})
    eng = Engine(target, drafter, num_speculative_tokens=3, verification="adaptive", cost_table=table,
                 async_scheduling=False, decode_steps_per_launch=1, sampling=False,
                 device_loop_plan_interval=1,
                 **{**COMMON, "min_token_bucket": 128, "device_loop_token_buckets": 1})
    assert eng.draft_lengths == (0, 3)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in MAX_NEW]
    dev = eng.generate(prompts, sampling_params=params, loop="device")
    host = eng.generate(prompts, sampling_params=params, loop="host")
    assert [r.token_ids for r in dev] == [r.token_ids for r in host] == [
        greedy_reference(target, p, n, stop=()) for p, n in zip(prompts, MAX_NEW)]
    for d, h in zip(dev, host):
        assert d.stats == h.stats
    for key in ("draft_length_per_step", "budget_per_step", "verified_drafts_per_step", "drafted_tokens_per_step"):
        assert dev.stats[key] == host.stats[key], key
    assert set(host.stats["draft_length_per_step"]) == {0, 3}, host.stats["draft_length_per_step"]


def test_a_plan_held_for_several_iterations(target, drafter, prompts, references):
    """``device_loop_plan_interval=N``: a plan holds for up to ``N`` steps on its branch, each step's budget
    re-clipped to the rows still decoding. The call's first plan (from the confidences it started with) holds for
    one step, and an epoch ends early once a smaller size of its draft length would hold the step. Greedy tokens
    stay the target's; a timing run still repeats its branch for exactly ``max_steps`` iterations."""
    table = CostTable.from_measurements({128: 1.0, 256: 2.0}, draft_lengths={0: 0.0, 3: 0.35})
    kw = dict(num_speculative_tokens=3, verification="adaptive", cost_table=table, sampling=False,
              **{**COMMON, "min_token_bucket": 128, "device_loop_token_buckets": 1})
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in MAX_NEW]
    want = [greedy_reference(target, p, n, stop=()) for p, n in zip(prompts, MAX_NEW)]
    every = Engine(target, drafter, device_loop_plan_interval=1, **kw).generate(prompts, sampling_params=params,
                                                                              loop="device")
    # one size per length: epochs are steps [0], [1..7], [8] (15 new tokens at most: 9 steps here)
    eng = Engine(target, drafter, device_loop_plan_interval=7, **kw)
    assert eng.loop_config.hold_plans and eng.device_loop_plan_interval == 7
    held = eng.generate(prompts, sampling_params=params, loop="device")
    assert [r.token_ids for r in held] == [r.token_ids for r in every] == want
    lengths, budgets = held.stats["draft_length_per_step"], held.stats["budget_per_step"]
    ref_lengths, ref_budgets = every.stats["draft_length_per_step"], every.stats["budget_per_step"]
    assert len(lengths) == len(ref_lengths) == 9 and ref_lengths[-1] == 0 != ref_lengths[-2]
    # the first and the last epoch start where the every-step loop plans: the same plans
    for s in (0, 1, 8):
        assert (lengths[s], budgets[s]) == (ref_lengths[s], ref_budgets[s]), s
    assert len(set(lengths[1:8])) == 1 and budgets[1:8] == sorted(budgets[1:8], reverse=True), (lengths, budgets)
    assert all(0 <= v <= b for v, b in zip(held.stats["verified_drafts_per_step"], budgets))
    assert held.stats["compiles"] == 0

    # a timing run of branch 1 (length 3 at 128 tokens): 5 iterations (epochs of 1 and 4), nothing committed
    r = eng.max_num_seqs
    out = _timing_run(eng, branch=1, budget=8, steps=5, context=20)
    assert int(out.steps) == 5 and out.draft_len_per_step[:6].tolist() == [3] * 5 + [0]
    assert out.budget_per_step[:5].tolist() == [8] * 5 and out.tokens_per_step[:5].tolist() == [128] * 5
    assert np.asarray(eng._state.num_cached).tolist() == [20] * r and not np.asarray(eng._state.done).any()
    with pytest.raises(ValueError, match="device_loop_plan_interval"):
        Engine(target, drafter, device_loop_plan_interval=0, **kw)


def _longest_short_run(lengths, k):
    """The most decode steps in a row that drafted fewer than ``k`` positions."""
    run = most = 0
    for d in lengths:
        run = run + 1 if d < k else 0
        most = max(most, run)
    return most


def test_a_plan_that_drafts_less_is_refreshed(target, drafter, monkeypatch):
    """Positions a step does not draft keep their confidences, so a plan of K_d = 0 read the same numbers on every
    later step and drafted nothing for ever, for every later request too (a slot starts at the running rows'
    confidences): on an H100 an adaptive engine at 1 request stopped speculating after its first call. Every
    path starts from confidences of 0.02 (as after a hard passage): the host loop planning each step, its
    multi-step launches and the device loop. Under a table where drafting doubles a step (only drafts that
    survive pay for it) a plan drafts K after FULL_DRAFT_AFTER steps of K_d = 0 (the loops: at the next epoch's
    plan), and the drafter's real confidences decide from there. Under one where drafting never pays, the forced
    refreshes come after 8, 16, 32, ... steps. The tokens stay the target's greedy ones, and the host's counts
    are the device's. Without the refresh the host loop never drafts."""
    import spec_decode.scheduler as scheduler_module
    from spec_decode.budget import FULL_DRAFT_AFTER, FULL_DRAFT_AFTER_MAX

    k, new = 7, 70
    sizes = (8, 16, 32, 64, 128, 256)
    pays = CostTable.from_step_times({**{(0, t): 1.0 for t in sizes}, **{(k, t): 2.0 for t in sizes}})
    never = CostTable.from_step_times({**{(0, t): 1.0 for t in sizes}, **{(k, t): 100.0 for t in sizes}})
    eng = Engine(target, drafter, num_speculative_tokens=k, verification="adaptive", cost_table=pays,
                 draft_lengths=(0, k), sampling=False, max_num_seqs=2, max_model_len=96, max_num_batched_tokens=32,
                 implementation="reference", device_loop_token_buckets=1)
    eng.warmup()  # the state the calls below start from
    prompt = random_prompts(1, [20], seed=5)
    want = greedy_reference(target, prompt[0], new, stop=())
    params = [SamplingParams(max_new_tokens=new, ignore_eos=True)]
    schedulers = []
    make = eng._scheduler
    monkeypatch.setattr(eng, "_scheduler", lambda: schedulers.append(make()) or schedulers[-1])

    def run(loop, steps_per_launch, table=pays):
        """A call from low confidences: its decode steps' draft lengths; the host's counts are the device's."""
        eng._state = eng._placed(dataclasses.replace(
            eng._state, fresh_confidences=jnp.full_like(eng._state.fresh_confidences, 0.02),
            fresh_weight=jnp.asarray(1e3, jnp.float32), undrafted_steps=jnp.zeros((), jnp.int32),
            full_draft_after=jnp.asarray(FULL_DRAFT_AFTER, jnp.int32)))
        eng.decode_steps_per_launch = steps_per_launch
        eng.planner.table = table
        res = eng.generate(prompt, sampling_params=params, loop=loop)
        assert res[0].token_ids == want, (loop, steps_per_launch)
        counts = (int(np.asarray(eng._state.undrafted_steps)), int(np.asarray(eng._state.full_draft_after)))
        if loop == "host":  # the mirror the host planned from, folded from its steps (and launches' read-backs)
            assert (schedulers[-1].undrafted_steps, schedulers[-1].full_draft_after) == counts, loop
        assert (make().undrafted_steps, make().full_draft_after) == counts  # where the next call's plans start
        lengths = res.stats["draft_length_per_step"]
        assert k in lengths, (loop, steps_per_launch, lengths)
        return lengths

    one_step = run("host", 1)  # the scheduler plans every step
    assert one_step[:FULL_DRAFT_AFTER + 1] == [0] * FULL_DRAFT_AFTER + [k], one_step
    assert _longest_short_run(one_step, k) <= FULL_DRAFT_AFTER_MAX, one_step
    for lengths in (run("host", 16), run("device", 16)):  # the loop's plans, one per epoch
        assert lengths[:FULL_DRAFT_AFTER] == [0] * FULL_DRAFT_AFTER, lengths
        assert _longest_short_run(lengths, k) <= FULL_DRAFT_AFTER_MAX + eng.device_loop_plan_interval - 1, lengths
    # drafting never pays: only the forced refreshes draft, each after twice as many steps as the one before
    backoff = [0] * 8 + [k] + [0] * 16 + [k] + [0] * 32 + [k]
    assert run("host", 1, never)[:len(backoff)] == backoff
    # the negative control: without the refresh the host loop drafts nothing at all
    monkeypatch.setattr(scheduler_module, "count_full_drafts", lambda u, a, **kw: (0, 10 ** 9))
    eng._state = eng._placed(dataclasses.replace(
        eng._state, fresh_confidences=jnp.full_like(eng._state.fresh_confidences, 0.02),
        full_draft_after=jnp.asarray(10 ** 9, jnp.int32)))
    eng.decode_steps_per_launch, eng.planner.table = 1, pays
    stuck = eng.generate(prompt, sampling_params=params, loop="host")
    assert stuck[0].token_ids == want and set(stuck.stats["draft_length_per_step"]) == {0}


def test_the_plan_interval_is_a_value_of_each_call(target, drafter, prompts):
    """An engine built with an interval >= 2 takes another between calls on the same compiled loop (the interval
    travels with the call's inputs): at 1 its plans are those of an engine built with 1, step for step; at 7 those
    of an engine built with 7; nothing compiles, and engines that differ only in the interval share executables.
    An engine built with 1 has no epochs and refuses a longer interval; a refused value leaves the engine's as it
    was."""
    # STEEP trims, and a plan held over an epoch only re-clips its budget where a fresh one may grow it back
    kw = dict(num_speculative_tokens=3, verification="adaptive", cost_table=STEEP, sampling=False, **COMMON)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in MAX_NEW]
    keys = ("draft_length_per_step", "budget_per_step", "verified_drafts_per_step", "verify_tokens_per_step")
    one = Engine(target, drafter, device_loop_plan_interval=1, **kw)
    assert not one.loop_config.hold_plans
    every = one.generate(prompts, sampling_params=params, loop="device")
    seven_eng = Engine(target, drafter, device_loop_plan_interval=7, **kw)
    seven = seven_eng.generate(prompts, sampling_params=params, loop="device")
    # built with another interval of 2 or more: the same programs, taken from the live engine's executables
    eng = Engine(target, drafter, device_loop_plan_interval=2, **kw)
    report = eng.warmup()
    assert report.loaded == report.programs and report.compiled == 0, report
    for interval, want in ((1, every), (7, seven)):
        eng.device_loop_plan_interval = interval
        with compile_counter(cache_loads=True) as compiled:
            got = eng.generate(prompts, sampling_params=params, loop="device")
        assert compiled == [] and got.stats["compiles"] == 0, interval
        assert [r.token_ids for r in got] == [r.token_ids for r in want], interval
        for key in keys:
            assert got.stats[key] == want.stats[key], (interval, key)
    assert any(every.stats[key] != seven.stats[key] for key in keys)  # the interval changed the plans
    for bad in (0, -1, True, 2.0, "4", None):
        with pytest.raises(ValueError, match="device_loop_plan_interval must be an integer >= 1"):
            eng.device_loop_plan_interval = bad
        assert eng.device_loop_plan_interval == 7
    with pytest.raises(ValueError, match="built with 1"):
        one.device_loop_plan_interval = 4
    assert one.device_loop_plan_interval == 1
    with pytest.raises(ValueError, match="plan_interval must be an integer >= 1"):
        loop_inputs([], config=eng.loop_config, block_tables=np.zeros((0, eng.max_blocks), np.int32),
                    cost_table=eng.planner.device_table(), max_steps=4, plan_interval=0)


def test_a_held_plan_moves_to_a_smaller_size_as_rows_finish(target, drafter, prompts, references):
    """Fixed K with two sizes per length: as rows finish, an epoch ends once the smaller size holds the step, so
    every step runs at the size the every-step loop picks (same budgets, same sizes), with the target's tokens."""
    kw = dict(num_speculative_tokens=3, verification="fixed", sampling=False, **COMMON)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in MAX_NEW]
    every = Engine(target, drafter, device_loop_plan_interval=1, **kw).generate(prompts, sampling_params=params,
                                                                              loop="device")
    held = Engine(target, drafter, device_loop_plan_interval=8, **kw).generate(prompts, sampling_params=params,
                                                                             loop="device")
    assert [r.token_ids for r in held] == [r.token_ids for r in every] == [
        greedy_reference(target, p, n, stop=()) for p, n in zip(prompts, MAX_NEW)]
    for key in ("budget_per_step", "verify_tokens_per_step", "draft_length_per_step"):
        assert held.stats[key] == every.stats[key], key
    sizes = held.stats["verify_tokens_per_step"]
    assert len(set(sizes)) == 2 and sizes == sorted(sizes, reverse=True), sizes  # it moved to the smaller size


def test_waves_that_fit_the_pool_and_the_logits_cap(target, drafter, prompts, references):
    """20 pages hold 2-3 of the requests at once: the device loop decodes in waves and gives the reference tokens;
    with a verify-logits cap of 6 rows, no step verifies more than 6 - (live rows) drafts."""
    # greedy: the greedy programs alone (sampling=False), half of the closed set to compile
    eng = Engine(target, drafter, num_speculative_tokens=3, verification="fixed", num_pages=20, sampling=False,
                 **COMMON)
    res = eng.generate(prompts, sampling_params=[SamplingParams(max_new_tokens=m) for m in MAX_NEW], loop="device")
    assert [r.token_ids for r in res] == references
    with pytest.warns(UserWarning, match="verifies fewer than K=3"):
        small_cap = Engine(target, drafter, num_speculative_tokens=3, verification="fixed", max_total_logit_rows=6,
                           sampling=False, **{**COMMON, "max_num_seqs": 4})
    res = small_cap.generate(prompts, sampling_params=[SamplingParams(max_new_tokens=m) for m in MAX_NEW],
                             loop="device")
    assert [r.token_ids for r in res] == references
    assert max(res.stats["verified_drafts_per_step"]) <= 6 - 1
    with pytest.raises(ValueError, match="loop must be 'host' or 'device'"):
        eng.generate(prompts, max_new_tokens=4, loop="gpu")


def test_the_sampling_loop_compiles_the_largest_bucket_of_each_draft_length(target, drafter):
    """The sampling device loop (the warm-up's largest program) has one branch per draft length by default: the
    bucket holding every slot's ``1 + K_d`` tokens, as the greedy loop's largest; more on request, never more than
    the greedy loop's; a count below 1 is refused before anything is built."""
    table = CostTable.from_measurements({8: 1.0, 16: 1.5, 32: 2.0}, draft_lengths={0: 0.0, 3: 0.35})
    eng = Engine(target, drafter, num_speculative_tokens=3, verification="adaptive", cost_table=table, **COMMON)
    greedy, sampled = eng.loop_config, eng.sampling_loop_config
    assert greedy.draft_lengths == sampled.draft_lengths == (0, 3)
    assert greedy.token_buckets == ((8,), (16, 32)) and sampled.token_buckets == ((8,), (32,))
    assert sampled.logit_rows == tuple(rows[-1:] for rows in greedy.logit_rows)
    assert eng._loop_config_of(True) is sampled and eng._loop_config_of(False) is greedy
    wide = Engine(target, drafter, num_speculative_tokens=3, verification="adaptive", cost_table=table,
                  device_loop_sampling_token_buckets=8, **COMMON)
    assert wide.sampling_loop_config.token_buckets == greedy.token_buckets
    with pytest.raises(ValueError, match="device_loop_sampling_token_buckets must be an integer >= 1"):
        Engine(target, drafter, num_speculative_tokens=3, cost_table=table, device_loop_sampling_token_buckets=0,
               **COMMON)


def test_draft_length_buckets_sets_the_sizes_of_the_shorter_lengths(target, drafter):
    """A draft length below K compiles the largest ``draft_length_buckets`` sizes up to every slot's ``1 + K_d``
    (2 by default): one keeps only that size, more reach down to the smallest; K keeps every size, length 0 at most
    two, and the device loop's branches follow. A count below 1 is refused before anything is built."""
    table = CostTable.from_measurements({8: 1.0, 16: 1.5, 32: 2.0}, draft_lengths={1: 0.1, 3: 0.35})
    kw = dict(num_speculative_tokens=3, verification="adaptive", cost_table=table, draft_lengths=(1, 3), **COMMON)
    sizes = {}
    for n in (1, 2, 3):
        eng = Engine(target, drafter, draft_length_buckets=n, **kw)
        sizes[n] = eng.buckets_by_length[1]
        assert eng.buckets_by_length[3][:3] == (8, 16, 32)  # K: every size (prefill chunks' above)
        assert dict(zip(eng.loop_config.draft_lengths, eng.loop_config.token_buckets))[1] == sizes[n]
    assert sizes == {1: (16,), 2: (8, 16), 3: (8, 16)}  # 8 slots: 1 + 1 tokens each fit 16
    assert sizes[2] == Engine(target, drafter, **kw).buckets_by_length[1]  # the default
    # length 0 keeps at most ZERO_LENGTH_BUCKETS sizes, whatever the others get: drafting nothing is for full batches
    table0 = CostTable.from_measurements({2: 0.5, 4: 0.75, 8: 1.0, 16: 1.5, 32: 2.0},
                                         draft_lengths={0: 0.0, 1: 0.1, 3: 0.35})
    eng = Engine(target, drafter, draft_length_buckets=3, **{**kw, "cost_table": table0, "draft_lengths": (0, 1, 3),
                                                              "min_token_bucket": 2})
    assert ZERO_LENGTH_BUCKETS == 2
    assert eng.buckets_by_length[0] == (4, 8) and eng.buckets_by_length[1] == (4, 8, 16)
    assert dict(zip(eng.loop_config.draft_lengths, eng.loop_config.token_buckets))[0] == (4, 8)
    with pytest.raises(ValueError, match="draft_length_buckets must be an integer >= 1"):
        Engine(target, drafter, draft_length_buckets=0, **kw)
