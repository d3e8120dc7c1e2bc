"""Cost tables: monotone step function, linear extrapolation, JSON round trip, and the profiler on real jits."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_decode.cost_table import (
    COST_TABLE_FILENAME,
    CostTable,
    CostTableArrays,
    load_cost_table,
    profile_cost_table,
    save_cost_table,
    time_callable,
)


def test_running_max_and_step_function():
    t = CostTable.from_measurements({32: 3.0, 8: 1.0, 16: 0.5, 64: 4.0}, {4: 0.2, 1: 0.1})
    assert t.verify_buckets == (8, 16, 32, 64)
    assert t.verify_seconds == (1.0, 1.0, 3.0, 4.0)  # the 16-token dip is lifted to 1.0
    # A step pays for the smallest bucket >= n.
    assert t.verify_cost(0) == 1.0
    assert t.verify_cost(1) == 1.0
    assert t.verify_cost(8) == 1.0
    assert t.verify_cost(9) == 1.0
    assert t.verify_cost(17) == 3.0
    assert t.verify_cost(32) == 3.0
    assert t.verify_cost(33) == 4.0
    assert t.draft_cost(1) == 0.1 and t.draft_cost(2) == 0.2 and t.draft_cost(4) == 0.2


def test_linear_extrapolation_above_largest_bucket():
    t = CostTable.from_measurements({8: 1.0, 16: 2.0}, {2: 1.0})
    assert t.verify_cost(24) == pytest.approx(3.0)
    assert t.verify_cost(160) == pytest.approx(20.0)
    assert t.draft_cost(6) == pytest.approx(3.0)  # one bucket: proportional
    costs = [t.verify_cost(n) for n in range(100)]
    assert all(b >= a for a, b in itertools.pairwise(costs))


def test_flatness():
    assert CostTable().is_flat
    assert CostTable.from_measurements({8: 1.0}).is_flat
    assert CostTable.from_measurements({8: 1.0, 16: 1.0, 32: 1.0}).is_flat
    # A dip lifted by the running max to a constant is flat as well.
    assert CostTable.from_measurements({8: 1.0, 16: 0.7}).is_flat
    assert not CostTable.from_measurements({8: 1.0, 16: 1.1}).is_flat
    assert CostTable().verify_cost(5) == 0.0 and CostTable().draft_cost(5) == 0.0


def test_json_round_trip_next_to_model(tmp_path):
    t = CostTable.from_measurements({8: 1.0, 16: 1.5}, {1: 0.25, 4: 0.5}, metadata={"device": "x"})
    written = save_cost_table(t, tmp_path)  # a directory: the file goes next to the model
    assert written == str(tmp_path / COST_TABLE_FILENAME)
    data = json.loads((tmp_path / COST_TABLE_FILENAME).read_text())
    assert data["verify"] == {"8": 1.0, "16": 1.5}
    loaded = load_cost_table(tmp_path)
    assert loaded == t
    assert CostTable.load(tmp_path / COST_TABLE_FILENAME) == t
    # Missing => None (the planner then verifies everything).
    assert load_cost_table(tmp_path / "nope") is None
    assert load_cost_table(None) is None


def test_bad_input_raises(tmp_path):
    with pytest.raises(ValueError, match="verify"):
        CostTable(verify_buckets=(8, 16), verify_seconds=(1.0,))
    with pytest.raises(ValueError, match="positive"):
        CostTable.from_measurements({0: 1.0})
    with pytest.raises(ValueError, match="finite"):
        CostTable.from_measurements({8: float("nan")})
    with pytest.raises(ValueError, match="duplicate"):
        CostTable(verify_buckets=(8, 8), verify_seconds=(1.0, 2.0))
    with pytest.raises(ValueError, match="format_version"):
        CostTable.from_dict({"format_version": 99, "verify": {}})
    with pytest.raises(ValueError, match="verify_fns"):
        profile_cost_table({}, {})
    with pytest.raises(ValueError, match="callable"):
        profile_cost_table({8: 3}, {})
    with pytest.raises(ValueError, match="repeats"):
        time_callable(lambda: 0, repeats=0)


def _matmul_step(n: int):
    """A real jitted step whose work grows like n^3 (a stand-in for the engine's compiled steps)."""
    x = jax.random.normal(jax.random.key(n), (n, n), jnp.float32)
    f = jax.jit(lambda a: jnp.tanh(a @ a) @ a)
    return lambda: f(x)


def test_profiler_times_real_jitted_functions(tmp_path):
    verify_sizes = {8: 16, 16: 64, 32: 256, 64: 640}  # bucket -> matrix size
    draft_sizes = {1: 16, 4: 384}
    table = profile_cost_table(
        {b: _matmul_step(n) for b, n in verify_sizes.items()},
        {b: _matmul_step(n) for b, n in draft_sizes.items()},
        repeats=5,
    )
    assert table.verify_buckets == (8, 16, 32, 64)
    assert all(s > 0 for s in table.verify_seconds)
    assert all(b >= a for a, b in itertools.pairwise(table.verify_seconds))
    # 640^3 versus 16^3 multiply-adds: the largest bucket is clearly slower than the smallest.
    assert table.verify_seconds[-1] > 5 * table.verify_seconds[0]
    assert table.draft_cost(4) > table.draft_cost(1)
    assert not table.is_flat
    raw = table.metadata["raw_verify_median_s"]
    assert set(raw) == {"8", "16", "32", "64"}
    assert table.metadata["device"].startswith("cpu")
    save_cost_table(table, tmp_path)
    assert load_cost_table(tmp_path) == table


def test_vectorised_lookup_against_hand_values():
    """Both lookups against the staircase and extrapolation written out by hand, not against each other."""
    t = CostTable.from_measurements({8: 1.0, 16: 1.3, 48: 2.5}, {4: 0.2, 16: 0.5})
    ns = np.arange(-2, 120)
    # verify: 1.0 up to 8 tokens (negative counts clamp to 0), 1.3 up to 16, 2.5 up to 48, then the last
    # segment's slope (2.5 - 1.3) / (48 - 16) = 0.0375 per token
    want_verify = np.select(
        [ns <= 8, ns <= 16, ns <= 48], [1.0, 1.3, 2.5], default=2.5 + 0.0375 * (ns - 48)
    )
    # draft: 0.2 up to 4 rows, 0.5 up to 16, then (0.5 - 0.2) / (16 - 4) = 0.025 per row
    want_draft = np.select([ns <= 4, ns <= 16], [0.2, 0.5], default=0.5 + 0.025 * (ns - 16))
    np.testing.assert_allclose(t.verify_costs(ns), want_verify, rtol=1e-12)
    np.testing.assert_allclose(t.draft_costs(ns), want_draft, rtol=1e-12)
    np.testing.assert_allclose([t.verify_cost(int(n)) for n in ns], want_verify, rtol=1e-12)
    np.testing.assert_allclose([t.draft_cost(int(n)) for n in ns], want_draft, rtol=1e-12)
    assert t.verify_cost(49) == pytest.approx(2.5375) and t.verify_cost(119) == pytest.approx(5.1625)
    # shapes are kept
    grid = np.array([[0, 9], [17, 64]])
    np.testing.assert_allclose(t.verify_costs(grid), [[1.0, 1.3], [2.5, 3.1]])


def test_split_step_costs_recovers_an_additive_model():
    """Whole-step timings of a closed set where the shorter lengths only have their 2 largest buckets (no bucket
    shared between 0 and 3): the split recovers the draft-length and verify terms of an additive model, noisy
    timings included, and a single length gives the plain per-bucket table."""
    from spec_decode.cost_table import split_step_costs

    rng = np.random.default_rng(0)
    verify = {8: 1.0, 16: 1.2, 32: 1.6, 64: 2.4, 128: 4.0}
    extra = {0: 0.0, 1: 0.3, 3: 0.5, 7: 0.9}
    have = {0: [8], 1: [8, 16], 3: [16, 32], 7: [8, 16, 32, 64, 128]}
    measured = {(d, t): verify[t] + extra[d] + rng.normal(0, 0.005) for d, ts in have.items() for t in ts}
    table = split_step_costs(measured)
    assert table.draft_lengths == (0, 1, 3, 7)
    np.testing.assert_allclose(table.draft_length_seconds, [extra[d] for d in (0, 1, 3, 7)], atol=0.02)
    np.testing.assert_allclose(table.verify_seconds, list(verify.values()), atol=0.02)
    for (d, t), s in measured.items():
        assert abs(table.draft_length_cost(d) + table.verify_cost(t) - s) < 0.03
    one = split_step_costs({(7, t): s for t, s in verify.items()})
    assert one.draft_lengths == () and one.verify_seconds == tuple(verify.values())
    with pytest.raises(ValueError, match="shares no token bucket"):
        split_step_costs({(0, 8): 1.0, (7, 16): 2.0})
    # the JSON round trip keeps the draft lengths
    assert CostTable.from_dict(json.loads(json.dumps(table.to_dict()))).draft_lengths == (0, 1, 3, 7)


def test_the_device_form_adds_the_loop_step():
    """The device loop plans with its own cost per iteration added to every verify cost; the host's form, and the
    draft terms, stay as profiled; a table without the measurement is unchanged."""
    from spec_decode.planner import DEVICE_LOOP_STEP_KEY, Planner

    table = CostTable.from_measurements({8: 1.0, 16: 2.0}, {4: 0.125}, draft_lengths={0: 0.0, 3: 0.5},
                                        metadata={DEVICE_LOOP_STEP_KEY: 0.25})
    planner = Planner(mode="adaptive", max_total_logit_rows=64, cost_table=table, num_speculative_tokens=3,
                      draft_lengths=(0, 3))
    dev, host = planner.device_table(), planner.device_table(with_loop_step=False)
    assert dev.verify_seconds[:2].tolist() == [1.25, 2.25] and host.verify_seconds[:2].tolist() == [1.0, 2.0]
    for form in (dev, host):
        assert form.draft_seconds[:1].tolist() == [0.125] and form.draft_length_seconds[:2].tolist() == [0.0, 0.5]
    planner.table = CostTable.from_measurements({8: 1.0, 16: 2.0}, draft_lengths={0: 0.0, 3: 0.5})
    assert planner.device_table().verify_seconds[:2].tolist() == [1.0, 2.0]


def test_a_per_length_table_keeps_each_lengths_steps():
    """Whole steps per draft length: each length's own staircase (running max within the length), the smallest
    tabled length >= the one asked (the longest above them all, or for None), the same lookups on the device, a
    JSON round trip, the step overhead added to every step, and a table is flat only when every step costs the
    same."""
    from spec_decode.cost_table import step_cost_device

    steps = {(0, 256): 1.0, (0, 512): 0.9, (3, 1536): 2.0, (3, 2048): 2.5, (7, 1536): 2.4, (7, 4096): 4.0}
    t = CostTable.from_step_times(steps, {8: 0.125})
    assert t.draft_lengths == (0, 3, 7) and t.draft_length_seconds == (0.0, 0.0, 0.0)
    assert t.per_length[0] == (0, (256, 512), (1.0, 1.0))  # 0.9 lifted by the running max
    assert t.step_cost(300, 0) == 1.0 and t.step_cost(1000, 3) == 2.0 and t.step_cost(2000, 3) == 2.5
    assert t.step_cost(2000, 1) == 2.5  # no length 1: length 3's steps
    assert t.step_cost(2000, 9) == t.step_cost(2000, None) == 4.0  # the longest
    assert t.step_cost(5000, 7) == pytest.approx(4.0 + 1.6 / 2560 * 904)  # extrapolated from the last two
    assert t.step_buckets == (256, 512, 1536, 2048, 4096) and not t.is_flat
    arrays = CostTableArrays.from_table(t)
    assert int(arrays.num_lengths) == 3 and int(arrays.num_draft_lengths) == 0 and int(arrays.num_verify) == 0
    tokens = np.asarray([0, 1, 256, 257, 512, 513, 1536, 1537, 2048, 3000, 4096, 5000, 9000], np.int32)
    for d in (None, 0, 1, 3, 5, 7, 8):
        got = jax.jit(lambda a, n, d=d: step_cost_device(a, d, n))(arrays, tokens)
        np.testing.assert_allclose(np.asarray(got), t.step_costs(tokens, d), rtol=1e-6)
    back = CostTable.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.per_length == t.per_length and back.draft_seconds == t.draft_seconds
    slower = t.with_step_overhead(0.5)
    assert slower.step_cost(300, 0) == 1.5 and slower.step_cost(2000, 3) == 3.0 and slower.draft_cost(8) == 0.125
    assert CostTable.from_step_times({(0, 8): 1.0, (3, 8): 1.0, (3, 16): 1.0}).is_flat
    assert CostTable.from_step_times({(0, 8): 1.0, (3, 16): 1.1}).draft_lengths == (0, 3)
    with pytest.raises(ValueError, match="not both"):
        CostTable(verify_buckets=(8,), verify_seconds=(1.0,), per_length=((0, (8,), (1.0,)),))
    with pytest.raises(ValueError, match="no buckets"):
        CostTable(per_length=((0, (), ()),))
    with pytest.raises(ValueError, match="at most 8 draft lengths"):
        CostTableArrays.from_table(CostTable.from_step_times({(d, 8): 1.0 + d for d in range(9)}))
