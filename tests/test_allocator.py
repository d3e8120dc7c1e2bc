"""Property tests for the device-side draft allocator (docs/ADAPTIVE_VERIFICATION.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_decode.allocator import allocate_drafts, survival

# Bucketed shapes keep the number of compilations small across hypothesis examples.
_SHAPES = [(1, 1), (1, 4), (3, 2), (4, 4), (5, 7), (8, 3)]
# Dyadic confidences: their products are exact in float32, so the brute force below sees the same survival
# values as the device, and ties are frequent.
_DYADIC = [0.0, 0.25, 0.5, 0.75, 1.0]

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def brute_force_caps(conf: np.ndarray, scheduled: np.ndarray, budget: int, priority=None) -> np.ndarray:
    """Python reference: enumerate every (request, position), sort by the total order (priority descending,
    survival descending, position, request), count winners."""
    r, k = conf.shape
    priority = np.zeros(r, np.int64) if priority is None else np.asarray(priority)
    entries = []
    for i in range(r):
        a = 1.0
        for j in range(k):
            a = np.float32(a * np.float32(conf[i, j]))
            if j < scheduled[i]:
                entries.append((-int(priority[i]), -float(a), j, i))
    entries.sort()
    caps = np.zeros(r, np.int64)
    for *_, i in entries[: max(budget, 0)]:
        caps[i] += 1
    return caps


@st.composite
def allocation_problem(draw, values=None):
    r, k = draw(st.sampled_from(_SHAPES))
    if values is None:
        conf = draw(st.lists(st.sampled_from(_DYADIC), min_size=r * k, max_size=r * k))
    else:
        conf = draw(st.lists(values, min_size=r * k, max_size=r * k))
    sched = draw(st.lists(st.integers(0, k), min_size=r, max_size=r))
    budget = draw(st.integers(-2, r * k + 3))
    return np.asarray(conf, np.float32).reshape(r, k), np.asarray(sched, np.int32), budget


@_SETTINGS
@given(allocation_problem())
def test_invariants_and_brute_force(problem):
    conf, sched, budget = problem
    caps = np.asarray(allocate_drafts(jnp.asarray(conf), jnp.asarray(sched), jnp.int32(budget)))
    assert caps.dtype == np.int32
    assert caps.sum() == min(max(budget, 0), int(sched.sum()))
    assert np.all(caps >= 0) and np.all(caps <= sched)
    np.testing.assert_array_equal(caps, brute_force_caps(conf, sched, budget))


@_SETTINGS
@given(allocation_problem(), st.data())
def test_priority_orders_rows_first_and_matches_brute_force(problem, data):
    """A closed batch's priority (tokens left per row): its rows' drafts win first, survival decides within equal
    priority, and a row's winners are still a prefix; entries past a row's scheduled drafts take no budget, whatever
    the row's priority."""
    conf, sched, budget = problem
    r, k = conf.shape
    prio = np.asarray(data.draw(st.lists(st.integers(0, 3), min_size=r, max_size=r)), np.int32)
    caps = np.asarray(allocate_drafts(jnp.asarray(conf), jnp.asarray(sched), jnp.int32(budget), jnp.asarray(prio)))
    assert caps.sum() == min(max(budget, 0), int(sched.sum()))
    assert np.all(caps >= 0) and np.all(caps <= sched)
    np.testing.assert_array_equal(caps, brute_force_caps(conf, sched, budget, prio))
    # no draft of a lower-priority row wins while a higher-priority row keeps an unverified scheduled draft
    for i in range(r):
        for j in range(r):
            if prio[i] > prio[j] and caps[j] > 0:
                assert caps[i] == sched[i]
    # equal priorities everywhere: the plain survival order
    same = np.asarray(allocate_drafts(jnp.asarray(conf), jnp.asarray(sched), jnp.int32(budget),
                                      jnp.full((r,), 2, jnp.int32)))
    np.testing.assert_array_equal(same, brute_force_caps(conf, sched, budget))


def test_priority_goes_to_the_rows_behind():
    # Survivals: row 0 .9 .81 .729, row 1 .5 .25 .125. By survival alone row 0 takes 3 of a budget of 3; with row
    # 1 further behind (more tokens left) it takes all of its drafts first.
    conf = np.array([[0.9, 0.9, 0.9], [0.5, 0.5, 0.5]], np.float32)
    sched = np.array([3, 3], np.int32)
    np.testing.assert_array_equal(allocate_drafts(conf, sched, jnp.int32(3)), [3, 0])
    np.testing.assert_array_equal(allocate_drafts(conf, sched, jnp.int32(3), jnp.array([10, 12], jnp.int32)), [0, 3])
    np.testing.assert_array_equal(allocate_drafts(conf, sched, jnp.int32(4), jnp.array([10, 12], jnp.int32)), [1, 3])
    # a row of high priority with no scheduled drafts takes nothing
    np.testing.assert_array_equal(
        allocate_drafts(conf, np.array([3, 0], np.int32), jnp.int32(2), jnp.array([1, 99], jnp.int32)), [2, 0])
    with pytest.raises(ValueError, match="priority"):
        allocate_drafts(conf, sched, jnp.int32(1), jnp.ones((3,), jnp.int32))


@_SETTINGS
@given(allocation_problem(values=st.floats(0.0, 1.0, width=32)))
def test_arbitrary_floats_match_reference_and_rows_are_prefixes(problem):
    conf, sched, budget = problem
    caps = np.asarray(allocate_drafts(jnp.asarray(conf), jnp.asarray(sched), jnp.int32(budget)))
    assert caps.sum() == min(max(budget, 0), int(sched.sum()))
    # The winners as a set, from the survival the device computed: every row's winners are a prefix.
    a = np.asarray(survival(conf, sched))
    r, k = conf.shape
    order = sorted((-float(a[i, j]), j, i) for i in range(r) for j in range(k) if j < sched[i])[
        : max(budget, 0)
    ]
    won = np.zeros((r, k), bool)
    for _, j, i in order:
        won[i, j] = True
    for i in range(r):
        np.testing.assert_array_equal(won[i], np.arange(k) < caps[i])
    # Survival is non-increasing along each row within the scheduled drafts.
    for i in range(r):
        s = a[i, : sched[i]]
        assert np.all(s[1:] <= s[:-1])


@_SETTINGS
@given(allocation_problem())
def test_invariant_under_jit_and_traced_budget(problem):
    conf, sched, budget = problem
    eager = allocate_drafts(conf, sched, np.int32(budget))
    jitted = jax.jit(allocate_drafts)(jnp.asarray(conf), jnp.asarray(sched), jnp.int32(budget))
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


def test_tie_break_lower_position_then_lower_request():
    # All survivals equal 1: position 0 of every request goes first, then position 1, request order inside.
    conf = np.ones((3, 4), np.float32)
    sched = np.array([4, 4, 4], np.int32)
    np.testing.assert_array_equal(allocate_drafts(conf, sched, jnp.int32(2)), [1, 1, 0])
    np.testing.assert_array_equal(allocate_drafts(conf, sched, jnp.int32(3)), [1, 1, 1])
    np.testing.assert_array_equal(allocate_drafts(conf, sched, jnp.int32(4)), [2, 1, 1])
    # Equal survival at different positions: a[0,1] = 0.5 = a[1,0]; the lower position (request 1) wins.
    conf = np.array([[1.0, 0.5], [0.5, 1.0]], np.float32)
    np.testing.assert_array_equal(allocate_drafts(conf, np.array([2, 2], np.int32), jnp.int32(2)), [1, 1])


def test_scheduled_mask_and_global_choice():
    conf = np.array([[0.9, 0.9, 0.9], [0.5, 0.5, 0.5], [1.0, 1.0, 1.0]], np.float32)
    sched = np.array([3, 3, 1], np.int32)  # request 2 has only one draft despite confidence 1
    # Survivals: r0 .9 .81 .729, r1 .5 .25 .125, r2 1 (then masked).
    np.testing.assert_array_equal(allocate_drafts(conf, sched, jnp.int32(4)), [3, 0, 1])
    np.testing.assert_array_equal(allocate_drafts(conf, sched, jnp.int32(5)), [3, 1, 1])
    np.testing.assert_array_equal(allocate_drafts(conf, sched, jnp.int32(100)), [3, 3, 1])
    np.testing.assert_array_equal(allocate_drafts(conf, sched, jnp.int32(0)), [0, 0, 0])


def test_nan_and_out_of_range_confidences_are_safe():
    conf = np.array([[np.nan, 1.0], [1.5, -0.2]], np.float32)
    caps = np.asarray(allocate_drafts(conf, np.array([2, 2], np.int32), jnp.int32(3)))
    assert caps.sum() == 3 and np.all(caps <= 2)
    # Survivals: row 0 = [0, 0] (NaN counts as 0), row 1 = [1, 0] (clipped). Order: (1,0), (0,0), (0,1).
    np.testing.assert_array_equal(caps, [2, 1])


def test_single_compilation_for_different_budgets():
    conf = jnp.full((4, 4), 0.5, jnp.float32)
    sched = jnp.array([4, 2, 0, 3], jnp.int32)
    f = jax.jit(lambda c, s, b: allocate_drafts(c, s, b))  # a fresh function: its own compilation cache
    f(conf, sched, jnp.int32(1))
    for b in range(2, 9):
        caps = f(conf, sched, jnp.int32(b))
        assert int(caps.sum()) == min(b, 9)
    assert f._cache_size() == 1


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="confidences"):
        allocate_drafts(jnp.ones((4,)), jnp.ones((4,), jnp.int32), jnp.int32(1))
    with pytest.raises(ValueError, match="scheduled_drafts"):
        allocate_drafts(jnp.ones((4, 2)), jnp.ones((3,), jnp.int32), jnp.int32(1))
    with pytest.raises(ValueError, match="budget"):
        allocate_drafts(jnp.ones((4, 2)), jnp.ones((4,), jnp.int32), jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="scheduled_drafts"):
        allocate_drafts(jnp.ones((4, 2)), jnp.ones((4,), jnp.float32), jnp.int32(1))
