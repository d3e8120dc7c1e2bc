"""The planner's ranking pass (``pallas_kernels.plan_ranking``): the two Pallas kernels (interpret mode here; compiled
in ``tests/test_kernels_gpu.py``) against the jnp pass, which ``tests/test_budget.py`` checks against the sorted
planner and the host's numpy rule."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels.plan_ranking import ranked_plan_curves, supports
from spec_decode.allocator import survival


def random_inputs(rng, rows: int, k: int, lengths: tuple, sizes: tuple, *, live: int | None = None,
                  quantised: bool = False, cap: int | None = None, non_draft: int | None = None):
    """Survival of random confidences (NaN, exact ties, zero plateaus when ``quantised``), ``live`` rows
    scheduling drafts (the rest are padding), random costs ascending in size, and the step's counts."""
    live = rows if live is None else live
    conf = (rng.integers(0, 3, (rows, k)) / 2.0 if quantised else rng.uniform(0, 1, (rows, k))).astype(np.float32)
    conf[rng.uniform(size=(rows, k)) < 0.05] = np.nan
    sched = np.where(np.arange(rows) < live, rng.integers(0, k + 1, rows), 0).astype(np.int32)
    width = max(len(s) for s in sizes)
    steps = np.cumsum(rng.uniform(0.0, 1.0, (len(lengths), width)), axis=1) + 1.0 + 0.1 * np.asarray(lengths)[:, None]
    draft = rng.uniform(0.0, 0.5, rows + 1)
    counts = np.asarray([live, live + int(rng.integers(0, 3)),
                         live + int(rng.integers(0, 20)) if non_draft is None else non_draft,
                         int(rng.integers(live, live * (k + 1) + 4)) if cap is None else cap], np.int32)
    return (np.asarray(survival(conf, sched)), counts, draft.astype(np.float32), steps.astype(np.float32))


def both(args, lengths, sizes):
    kw = dict(column_lengths=lengths, column_sizes=sizes)
    want = ranked_plan_curves(*args, implementation="reference", **kw)
    got = ranked_plan_curves(*args, implementation="pallas", interpret=True, **kw)
    return [np.asarray(x) for x in want], [np.asarray(x) for x in got]


@pytest.mark.parametrize("rows, k, lengths, sizes", [
    (1, 1, (0, 1, 1), ((8,), (8, 16), (8, 16))),  # one row, one draft
    (12, 7, (0, 1, 3, 7, 7), ((16, 24), (16, 24), (32, 48), (8, 16, 32, 64, 96), (8, 16, 32, 64, 96))),
    (40, 3, (3,), ((16, 32, 64, 128, 160),)),  # a one-length engine; rows past one pair-pass block (32)
    (70, 4, (0, 2, 4, 4), ((80,), (128, 160, 210), (128, 256, 350), (128, 256, 350))),  # past one select block
])
def test_kernels_match_the_jnp_pass(rows, k, lengths, sizes):
    """Random survival with NaN and unscheduled drafts, padding rows, exact ties and zero plateaus (quantised
    trials: their sums are exact, so the budgets must agree exactly), caps that bind and non-draft tokens that
    pass the smallest sizes: the kernels' ``(b, value(b), value(maxB), maxB)`` equal the jnp pass's (the values to
    a float32 division's rounding)."""
    rng = np.random.default_rng(rows * 100 + k)
    for trial in range(4):
        quantised = trial % 2 == 0
        args = random_inputs(rng, rows, k, lengths, sizes, live=int(rng.integers(0, rows + 1)), quantised=quantised)
        want, got = both(args, lengths, sizes)
        np.testing.assert_array_equal(got[3], want[3], err_msg=f"maxB, trial {trial}")
        if quantised:
            np.testing.assert_array_equal(got[0], want[0], err_msg=f"b, trial {trial}")
        for name, w, g in zip(("value(b)", "value(maxB)"), want[1:3], got[1:3]):
            np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=f"{name}, trial {trial}")


def test_no_size_holds_the_step():
    """Non-draft tokens past every compiled size: no budget is feasible (value -inf), and the plan is 0 drafts."""
    rng = np.random.default_rng(3)
    lengths, sizes = (1, 3), ((16, 32), (16, 32))
    args = random_inputs(rng, 8, 3, lengths, sizes, non_draft=40)
    want, got = both(args, lengths, sizes)
    assert np.all(np.isneginf(want[1])) and np.all(want[0] == 0)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


def test_bad_shapes_are_refused_before_any_work():
    rng = np.random.default_rng(0)
    lengths, sizes = (1, 3), ((16, 32), (16, 32))
    a, counts, draft, steps = random_inputs(rng, 8, 3, lengths, sizes)
    kw = dict(column_lengths=lengths, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="survival must be"):
        ranked_plan_curves(a[0], counts, draft, steps, column_sizes=sizes, **kw)
    with pytest.raises(ValueError, match="counts must be"):
        ranked_plan_curves(a, counts[:3], draft, steps, column_sizes=sizes, **kw)
    with pytest.raises(ValueError, match="column_sizes"):
        ranked_plan_curves(a, counts, draft, steps, column_sizes=((32, 16), (16, 32)), **kw)
    with pytest.raises(ValueError, match="step_costs must be"):
        ranked_plan_curves(a, counts, draft, steps[:, :1], column_sizes=sizes, **kw)
    # past what one program holds: the kernels refuse, and "auto" takes the jnp pass
    assert supports(2048, 8) and not supports(2049, 8) and not supports(4096, 1)
    big = np.full((4096, 3), -np.inf, np.float32)
    with pytest.raises(ValueError, match="too many"):
        ranked_plan_curves(big, counts, np.zeros(4097, np.float32), steps, column_sizes=sizes, **kw)
