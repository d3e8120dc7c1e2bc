"""Host-side budget planner: the global argmax over a staircase cost curve (docs/ADAPTIVE_VERIFICATION.md)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_decode.budget import DEFAULT_MIN_PREDICTED_GAIN, budget_values, choose_budget
from spec_decode.cost_table import CostTable

# Verify costs jump at the 8 -> 16 token edge a little and at 16 -> 32 a lot; the draft step costs 0.2.
STAIRCASE = CostTable.from_measurements({8: 1.0, 16: 1.3, 32: 2.5}, {4: 0.2})


def _kw(**over):
    kw = {
        "num_sampling_rows": 4,
        "num_non_draft_tokens": 4,
        "cost_table": STAIRCASE,
        "max_total_logit_rows": 1000,
    }
    kw.update(over)
    return kw


def test_staircase_global_argmax_beats_first_descent():
    conf = np.full((4, 7), 0.8)  # survivals 0.8, 0.64, 0.512, ... in each of 4 rows
    sched = np.full(4, 7)
    # Hand values: b = 4 fills the 8-token bucket: (4 + 4 * 0.8) / (0.2 + 1.0) = 6.0. b = 5 pays the 16-token
    # bucket and drops to (4 + 3.2 + 0.64) / 1.5 = 5.227: a first-descent search would stop at 4.
    # b = 12 fills that bucket: (4 + 3.2 + 2.56 + 2.048) / 1.5 = 7.872, the global best.
    values = budget_values(conf, sched, **_kw())
    assert values[4] == pytest.approx(6.0)
    assert values[5] == pytest.approx((4 + 3.2 + 0.64) / 1.5)
    assert values[12] == pytest.approx(7.872)
    first_descent = next(b for b in range(len(values) - 1) if values[b + 1] < values[b])
    assert first_descent == 4
    b = choose_budget(conf, sched, **_kw())
    assert b == 12
    assert values[b] > values[first_descent]


def test_smallest_budget_on_ties():
    # Drafts beyond position 1 have survival 0: they add nothing, and inside one bucket they cost nothing,
    # so every b from 8 up to the bucket edge ties; the smallest wins.
    conf = np.array([[1.0, 1.0, 0.0, 0.0]] * 4)
    sched = np.full(4, 4)
    values = budget_values(conf, sched, **_kw(cost_table=CostTable.from_measurements({16: 1.0, 32: 9.0})))
    assert values[8] == values[9] == values[12]
    assert choose_budget(conf, sched, **_kw(cost_table=CostTable.from_measurements({16: 1.0, 32: 9.0}))) == 8


def _two_step_table(riser: float) -> CostTable:
    """Verify costs 1.0 up to 2 tokens, ``riser`` up to 4; no draft cost."""
    return CostTable.from_measurements({2: 1.0, 4: riser})


def test_minimum_predicted_gain_both_sides():
    """One request, survivals 0.9, 0.45, 0.09, one anchor token. By hand, with the verify cost X at 3-4 tokens:
    value(0) = 1, value(1) = 1.9 / 1.0, value(2) = 2.35 / X, value(3) = 2.44 / X, so for X > 1.2842 the argmax
    is b = 1 and it beats verifying everything by value(1) / value(3) - 1 = 1.9 X / 2.44 - 1."""
    assert DEFAULT_MIN_PREDICTED_GAIN == 0.01
    conf = np.array([[0.9, 0.5, 0.2]])
    sched = np.array([3])
    kw = {"num_sampling_rows": 1, "num_non_draft_tokens": 1, "max_total_logit_rows": 100}

    above = _two_step_table(1.3)  # gain 2.47 / 2.44 - 1 = 1.23%
    np.testing.assert_allclose(
        budget_values(conf, sched, cost_table=above, **kw), [1.0, 1.9, 2.35 / 1.3, 2.44 / 1.3]
    )
    assert choose_budget(conf, sched, cost_table=above, **kw) == 1  # default 1%: trims
    assert choose_budget(conf, sched, cost_table=above, min_predicted_gain=0.012, **kw) == 1
    assert choose_budget(conf, sched, cost_table=above, min_predicted_gain=0.013, **kw) == 3

    below = _two_step_table(1.29)  # gain 2.451 / 2.44 - 1 = 0.45%: the argmax is still b = 1
    values = budget_values(conf, sched, cost_table=below, **kw)
    assert int(np.argmax(values)) == 1
    assert values[1] / values[3] - 1 == pytest.approx(2.451 / 2.44 - 1)
    assert choose_budget(conf, sched, cost_table=below, **kw) == 3  # default 1%: noise, verify everything
    assert choose_budget(conf, sched, cost_table=below, min_predicted_gain=0.004, **kw) == 1
    assert choose_budget(conf, sched, cost_table=below, min_predicted_gain=0.0, **kw) == 1  # plain argmax

    # the full budget is the memory cap when that binds: here maxB = 3 - 1 = 2, value(2) = 2.35 / 1.29,
    # and value(1) / value(2) - 1 = 1.9 * 1.29 / 2.35 - 1 = 4.3%: trims
    assert choose_budget(conf, sched, cost_table=below, **{**kw, "max_total_logit_rows": 3}) == 1
    with pytest.raises(ValueError, match="min_predicted_gain"):
        choose_budget(conf, sched, cost_table=below, min_predicted_gain=-0.01, **kw)


def test_flat_or_missing_table_verifies_everything():
    conf = np.full((3, 5), 0.1)
    sched = np.array([5, 2, 0])
    assert choose_budget(conf, sched, **_kw(cost_table=None)) == 7
    assert choose_budget(conf, sched, **_kw(cost_table=CostTable())) == 7
    assert choose_budget(conf, sched, **_kw(cost_table=CostTable.from_measurements({8: 1.0, 64: 1.0}))) == 7


def test_logits_memory_cap():
    conf = np.ones((4, 7))
    sched = np.full(4, 7)
    # At most 10 logit rows: 4 go to the anchors, so at most 6 drafts, whatever the table says.
    assert choose_budget(conf, sched, **_kw(cost_table=None, max_total_logit_rows=10)) == 6
    assert choose_budget(conf, sched, **_kw(max_total_logit_rows=10)) <= 6
    assert len(budget_values(conf, sched, **_kw(max_total_logit_rows=10))) == 7
    assert choose_budget(conf, sched, **_kw(cost_table=None, max_total_logit_rows=3)) == 0


def test_only_scheduled_drafts_count():
    # Request 1 schedules no drafts: its (high) confidences must not enter the scores.
    conf = np.array([[0.5, 0.5], [1.0, 1.0]])
    values = budget_values(conf, np.array([2, 0]), **_kw(num_sampling_rows=2, num_non_draft_tokens=2))
    assert len(values) == 3
    d, v = STAIRCASE.draft_cost(2), STAIRCASE.verify_cost(4)
    np.testing.assert_allclose(values, [(2 + 0) / (d + v), (2 + 0.5) / (d + v), (2 + 0.75) / (d + v)])


def _brute_force(conf, sched, table, n_rows, t, max_rows, min_gain):
    a = np.cumprod(conf, axis=1)
    scores = sorted((a[r, j] for r in range(len(sched)) for j in range(sched[r])), reverse=True)
    max_b = max(0, min(int(sum(sched)), max_rows - len(sched)))
    values = [
        (n_rows + sum(scores[:b])) / (table.draft_cost(len(sched)) + table.verify_cost(t + b))
        for b in range(max_b + 1)
    ]
    best = max(values)
    b = next(b for b, v in enumerate(values) if v >= best - 1e-9 * best)
    if min_gain > 0 and values[b] < (1 + min_gain) * values[max_b]:
        return max_b
    return b


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    r=st.integers(1, 6),
    k=st.integers(1, 6),
    costs=st.lists(st.floats(0.05, 5.0), min_size=2, max_size=5),
)
def test_matches_brute_force(data, r, k, costs):
    conf = np.array(data.draw(st.lists(st.floats(0.0, 1.0), min_size=r * k, max_size=r * k))).reshape(r, k)
    sched = np.array(data.draw(st.lists(st.integers(0, k), min_size=r, max_size=r)))
    buckets = [4 * 2**i for i in range(len(costs))]
    table = CostTable.from_measurements(dict(zip(buckets, costs)), {8: 0.1})
    max_rows = data.draw(st.integers(0, r * (k + 1) + 2))
    min_gain = data.draw(st.sampled_from([0.0, 0.01, 0.1]))
    if table.is_flat:
        return
    b = choose_budget(
        conf,
        sched,
        num_sampling_rows=r,
        num_non_draft_tokens=r,
        cost_table=table,
        max_total_logit_rows=max_rows,
        min_predicted_gain=min_gain,
    )
    assert b == _brute_force(conf, sched, table, r, r, max_rows, min_gain)
    assert 0 <= b <= min(int(sched.sum()), max(0, max_rows - r))


def test_bad_input_raises():
    with pytest.raises(ValueError, match="stale_confidences"):
        choose_budget(np.ones(4), np.ones(4, int), **_kw())
    with pytest.raises(ValueError, match="scheduled_drafts"):
        choose_budget(np.ones((4, 2)), np.ones(3, int), **_kw())
    with pytest.raises(ValueError, match="scheduled_drafts"):
        choose_budget(np.ones((4, 2)), np.full(4, 3), **_kw())
    with pytest.raises(ValueError, match="scheduled_drafts"):
        choose_budget(np.ones((4, 2)), np.ones(4, np.float32), **_kw())
    with pytest.raises(ValueError, match="num_non_draft_tokens"):
        choose_budget(np.ones((4, 2)), np.ones(4, int), **_kw(num_non_draft_tokens=-1))


# ---------------------------------------------------------------- the device planner (jnp twin)
def _random_case(rng):
    r, k = int(rng.integers(1, 13)), int(rng.integers(1, 8))
    conf = rng.uniform(0.0, 1.0, (r, k)).astype(np.float32)
    conf[rng.uniform(size=(r, k)) < 0.15] = 1.0
    conf[rng.uniform(size=(r, k)) < 0.05] = 0.0
    sched = rng.integers(0, k + 1, r)
    n_buckets = int(rng.integers(0, 6))
    buckets = sorted(rng.choice([1, 2, 4, 8, 16, 32, 64, 128], size=n_buckets, replace=False).tolist())
    seconds = np.cumsum(rng.uniform(0.0, 1.0, n_buckets)) + 0.1
    draft = {int(rng.integers(1, 16)): float(rng.uniform(0, 0.5))} if rng.uniform() < 0.5 else {}
    table = None if n_buckets == 0 and rng.uniform() < 0.5 else CostTable.from_measurements(
        dict(zip(buckets, seconds.tolist())), draft)
    kw = dict(num_sampling_rows=r + int(rng.integers(0, 3)), num_non_draft_tokens=r + int(rng.integers(0, 20)),
              cost_table=table, max_total_logit_rows=int(rng.integers(r, r * (k + 1) + 4)))
    return conf, sched, kw


def test_device_planner_gives_the_host_budgets():
    """``choose_budget_device`` (traced, float32, padding rows with no drafts) == ``choose_budget`` on 400 random
    cases: random confidences with exact 0s and 1s, random scheduled counts, staircases with 0..5 buckets, draft
    costs, logits caps, and both settings of the minimum gain."""
    from spec_decode.budget import choose_budget_device
    from spec_decode.cost_table import CostTableArrays

    @jax.jit
    def device(conf, sched, n_rows, n_samp, n_non, table, cap, gain_on):
        kw = dict(num_rows=n_rows, num_sampling_rows=n_samp, num_non_draft_tokens=n_non, cost_table=table,
                  max_total_logit_rows=cap)
        return (choose_budget_device(conf, sched, **kw, min_predicted_gain=DEFAULT_MIN_PREDICTED_GAIN),
                choose_budget_device(conf, sched, **kw, min_predicted_gain=0.0))

    rng = np.random.default_rng(7)
    trimmed = 0
    for case in range(400):
        conf, sched, kw = _random_case(rng)
        r, k = conf.shape
        # pad to a fixed 16 x 7 batch: extra rows and positions carry garbage but schedule no drafts
        pc = rng.uniform(size=(16, 7)).astype(np.float32)
        pc[:r, :k] = conf
        ps = np.zeros(16, np.int32)
        ps[:r] = sched
        pc = np.where(np.arange(7)[None, :] < k, pc, 1.0)  # positions past K: the device batch has K = 7 ...
        ps = np.minimum(ps, k)  # ... but never schedules them
        got = device(jnp.asarray(pc), jnp.asarray(ps), r, kw["num_sampling_rows"], kw["num_non_draft_tokens"],
                     CostTableArrays.from_table(kw["cost_table"]), kw["max_total_logit_rows"], True)
        want = (choose_budget(conf, sched, **kw), choose_budget(conf, sched, **kw, min_predicted_gain=0.0))
        assert (int(got[0]), int(got[1])) == want, f"case {case}: {kw}, sched {sched.tolist()}"
        trimmed += want[0] < min(int(sched.sum()), kw["max_total_logit_rows"] - r)
    assert trimmed > 40  # the cases exercise real trims, not only "verify everything"


def test_planner_fast_path_is_choose_plan():
    """The engine's planner (precomputed cost arrays) gives choose_plan's plan on random confidences, schedules,
    tables with draft lengths (additive, or whole steps per length), per-length buckets and logit caps; and choose_plan_device agrees with the host up
    to float32 near-ties, with and without ``draft_full`` (the longest length at its best budget). A host floor
    above every step cost leaves only the gain: the longest length, all drafts."""
    from spec_decode.budget import choose_plan, choose_plan_device
    from spec_decode.cost_table import CostTableArrays
    from spec_decode.planner import Planner

    rng = np.random.default_rng(7)
    k = 7
    lengths = (0, 1, 3, 7)
    rows = 24  # the device planner sees every slot, as in the device loop: rows past r schedule nothing

    @functools.partial(jax.jit, static_argnames=("token_buckets",))
    def device_plan(conf, sched, r, n_samp, cap, table, full, *, token_buckets):
        return choose_plan_device(conf, sched, num_rows=r, num_sampling_rows=n_samp, num_non_draft_tokens=r,
                                  cost_table=table, max_total_logit_rows=cap, draft_lengths=lengths,
                                  token_buckets=token_buckets, draft_full=full)

    mismatches = 0
    for trial in range(150):
        r = int(rng.integers(1, rows))
        union = [8, 16, 32, 64, 128, 256]
        buckets = {0: (8 if r <= 8 else 16 if r <= 16 else 24,), 1: (16, 32), 3: (32, 64), 7: tuple(union)}
        verify = {t: float(s) for t, s in zip(union, np.cumsum(rng.uniform(0.0, 1.0, len(union))) + 1.0)}
        extra = {0: 0.0, 1: float(rng.uniform(0, 0.3)), 3: float(rng.uniform(0.3, 0.6)), 7: float(rng.uniform(0.6, 1))}
        table = CostTable.from_measurements(verify, draft_lengths=extra)
        if trial % 2:  # whole steps per length, as the engine's in-loop profile keeps them
            table = CostTable.from_step_times({(d, t): float(s) for d in lengths for t, s in zip(
                buckets[d], np.cumsum(rng.uniform(0.0, 1.0, len(buckets[d]))) + 1.0 + extra[d])})
        conf = rng.uniform(0, 1, (r, k)).astype(np.float32)
        conf[rng.uniform(size=(r, k)) < 0.05] = np.nan
        sched = rng.integers(0, k + 1, r)
        cap = int(rng.integers(r, r * (k + 1) + 4))
        n_samp = r + int(rng.integers(0, 3))
        planner = Planner(mode="adaptive", max_total_logit_rows=cap + (n_samp - r), cost_table=table,
                          num_speculative_tokens=k, draft_lengths=lengths, token_buckets=buckets)
        full = trial % 3 == 0  # a refresh: the longest length's curve alone
        got = planner.plan(conf, sched, num_sampling_rows=n_samp, num_non_draft_tokens=r, draft_full=full)
        want = choose_plan(conf, sched, num_sampling_rows=n_samp, num_non_draft_tokens=r, cost_table=table,
                           max_total_logit_rows=cap, draft_lengths=lengths, token_buckets=buckets, draft_full=full)
        assert got == want, (trial, got, want)
        assert want[1] == 7 or not full, (trial, want)
        padded_conf = np.zeros((rows, k), np.float32)
        padded_conf[:r] = np.nan_to_num(conf, nan=0.0)
        padded_sched = np.zeros(rows, np.int32)
        padded_sched[:r] = sched
        b, i = device_plan(padded_conf, padded_sched, np.int32(r), np.int32(n_samp), np.int32(cap),
                           CostTableArrays.from_table(table), np.bool_(full),
                           token_buckets=tuple(buckets[d] for d in lengths))
        mismatches += (int(b), lengths[int(i)]) != want
        planner.host_floor_s = 1e3
        assert planner.plan(conf, sched, num_sampling_rows=n_samp, num_non_draft_tokens=r) == (
            min(int(np.minimum(sched, 7).sum()), cap - r), 7)
    assert mismatches <= 3  # float32 near-ties only


def test_sort_free_device_curves_match_the_sorted_ones():
    """The device loop's sort-free planner pass (ranks from one pass over pairs of drafts, values at the bucket
    edges) gives the sorted pass's curves: the same budgets and values, on random tables, confidences with exact
    ties and zero-survival plateaus (quantised), NaN, unscheduled and padding rows, logit caps that bind, and
    anchors that overflow the smallest buckets. Both run at float32; survival sums of the quantised
    confidences are exact, so their budgets must agree exactly. The pass's Pallas kernels (interpret mode) give
    the jnp pass's curves on every trial."""
    from spec_decode.budget import _curves_device, _curves_ranked, _sorted_survival_device
    from spec_decode.cost_table import CostTableArrays

    rng = np.random.default_rng(11)
    k, rows = 7, 20
    lengths = (0, 2, 7)
    buckets = ((8, 16, 24), (16, 32, 64), (8, 16, 32, 64, 128, 160))

    @jax.jit
    def both(conf, sched, r, n_nd, n_samp, cap, table):
        kw = dict(num_rows=r, num_sampling_rows=n_samp, num_non_draft_tokens=n_nd, cost_table=table,
                  max_total_logit_rows=cap)
        sorted_ = _curves_device(_sorted_survival_device(conf, sched), sched, lengths, token_buckets=buckets, **kw)
        return (sorted_, _curves_ranked(conf, sched, lengths, buckets, **kw),
                _curves_ranked(conf, sched, lengths, buckets, implementation="pallas", **kw))

    checked = exact = 0
    for trial in range(60):
        r = int(rng.integers(0, rows + 1))
        union = sorted({t for b in buckets for t in b})
        table = CostTable.from_step_times({(d, t): float(s) for d, b in zip(lengths, buckets) for t, s in zip(
            b, np.cumsum(rng.uniform(0.0, 1.0, len(b))) + 1.0 + 0.1 * d)})
        if trial % 3 == 0:
            table = CostTable.from_measurements({t: float(s) for t, s in zip(union, np.cumsum(
                rng.uniform(0, 1, len(union))) + 1.0)}, draft_lengths={0: 0.0, 2: 0.2, 7: 0.5})
        quantised = trial % 2 == 0
        conf = (rng.integers(0, 3, (rows, k)) / 2.0 if quantised else rng.uniform(0, 1, (rows, k))).astype(np.float32)
        conf[rng.uniform(size=(rows, k)) < 0.05] = np.nan
        sched = np.where(np.arange(rows) < r, rng.integers(0, k + 1, rows), 0).astype(np.int32)  # padding rows
        n_nd = r + int(rng.integers(0, 20))  # anchors and prefill tokens: may pass the smallest sizes
        cap = int(rng.integers(r, r * (k + 1) + 4))
        got = both(conf, sched, np.int32(r), np.int32(n_nd), np.int32(r + int(rng.integers(0, 3))), np.int32(cap),
                   CostTableArrays.from_table(table))
        (b0, v0, f0, m0), (b1, v1, f1, m1), kernels = jax.device_get(got)
        for want, have in zip((b1, v1, f1, m1), kernels):  # the Pallas kernels (interpret mode) == the jnp pass
            np.testing.assert_allclose(have, want, rtol=1e-6, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(m0, m1)
        np.testing.assert_allclose(f1, f0, rtol=1e-5)
        np.testing.assert_allclose(v1, v0, rtol=1e-5)
        if quantised:
            np.testing.assert_array_equal(b1, b0, err_msg=f"trial {trial}")
            exact += 1
        checked += int(np.sum(b0 == b1))
    assert exact == 30 and checked >= 60 * len(lengths) - 6  # float32 near-ties only, on the uniform ones
