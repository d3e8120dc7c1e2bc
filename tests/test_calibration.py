"""Sequential temperature scaling: ECE, labels, recovery of known temperatures, positions fitted in order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.calibration import (
    RolloutRecords,
    acceptance_labels,
    apply_sts,
    expected_calibration_error,
    fit_sts,
)


def synthetic_rollouts(temperatures, n, seed, mean=1.5, std=1.5):
    """Rows with true per-position acceptance p_k = sigmoid(z_k); the recorded logits are z_k * T_k, so the
    temperatures that calibrate them are exactly T_k. Drafts are accepted left to right until the first reject."""
    rng = np.random.default_rng(seed)
    k = len(temperatures)
    z = rng.normal(mean, std, (n, k))
    accept = rng.random((n, k)) < 1.0 / (1.0 + np.exp(-z))
    num_accepted = np.argmin(np.concatenate([accept, np.zeros((n, 1), bool)], axis=1), axis=1)
    return z * np.asarray(temperatures), num_accepted


def test_ece_by_hand():
    pred = np.array([0.1, 0.12, 0.5, 0.55, 0.9, 1.0])
    target = np.array([0, 1, 1, 1, 1, 0])
    # bins of width 0.05: {0.1, 0.12} (mean 0.11 vs 0.5, two rows), {0.5}, {0.55}, {0.9}, {1.0 -> last bin}
    want = (2 * 0.39 + 0.5 + 0.45 + 0.1 + 1.0) / 6
    assert expected_calibration_error(pred, target) == pytest.approx(want, abs=1e-7)
    # two predictions sharing a bin are averaged before the comparison
    assert expected_calibration_error([0.31, 0.33], [0, 1]) == pytest.approx(abs(0.32 - 0.5), abs=1e-7)
    assert expected_calibration_error([0.31, 0.33], [0, 1], num_bins=2) == pytest.approx(0.18, abs=1e-7)
    assert np.isnan(expected_calibration_error([], []))
    with pytest.raises(ValueError, match="same size"):
        expected_calibration_error([0.1, 0.2], [1])


def test_acceptance_labels():
    labels, observed = acceptance_labels([0, 2, 3, 1, 0], [3, 2, 3, 1, 1], 3)
    np.testing.assert_array_equal(labels, [[0, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # Only verified positions are scored. Row 1 verified 2 drafts, both accepted: position 3 is unknown; row 3
    # verified 1 (accepted): 2, 3 unknown. Row 4 verified 1 and rejected it: "first 2 accepted" is known to be
    # false, but it is not scored, or trimmed rows would count only when they fail.
    np.testing.assert_array_equal(observed, [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0]])


def test_sts_recovers_known_temperatures():
    true = np.array([0.5, 2.0, 1.0, 0.7])
    logits, accepted = synthetic_rollouts(true, 30000, seed=0)
    fit = fit_sts(logits, accepted)
    got = np.array(fit.temperatures)
    assert np.all(np.abs(got / true - 1.0) < np.array([0.05, 0.08, 0.12, 0.15])), got
    assert all(a < 0.02 for a in fit.ece_after), fit.ece_after
    assert fit.ece_after[0] < 0.25 * fit.ece_before[0]  # T_1 = 0.5 was badly miscalibrated
    assert fit.num_observed == (30000,) * 4
    # the fitted temperatures calibrate the cumulative product on fresh rollouts too
    logits2, accepted2 = synthetic_rollouts(true, 30000, seed=1)
    cum = np.cumprod(np.asarray(apply_sts(jnp.asarray(logits2, jnp.float32), fit.temperatures)), axis=1)
    labels, _ = acceptance_labels(accepted2, np.full(30000, 4), 4)
    for k in range(4):
        assert expected_calibration_error(cum[:, k], labels[:, k]) < 0.02


def _trim(num_accepted_full, num_verified):
    """What a verify step that checked only ``num_verified`` drafts reports."""
    return np.minimum(num_accepted_full, num_verified)


def test_sts_recovers_known_temperatures_from_trimmed_rollouts():
    """Adaptive verification trims rows; the fit must still find the true temperatures.

    Half the rows (chosen at random) verify one draft only. Scored on verified positions the fit recovers
    T = (0.7, 1.0, 1.6). The old labelling, which also scored positions past ``num_verified`` after a rejection
    (as 0), sees the trimmed rows there only when they failed and fits T_2 around 1.7: emulated here by
    declaring every row with a rejection fully verified, which gives exactly that labelling."""
    true = np.array([0.7, 1.0, 1.6])
    n, k = 60000, 3
    logits, accepted_full = synthetic_rollouts(true, n, seed=11)
    verified = np.where(np.random.default_rng(12).random(n) < 0.5, 1, k)
    accepted = _trim(accepted_full, verified)
    fit = fit_sts(logits, accepted, verified)
    got = np.array(fit.temperatures)
    # observed over 8 seeds: ratios within [0.98, 1.06]
    assert np.all(np.abs(got / true - 1.0) < 0.08), got
    assert fit.num_observed[0] == n and abs(fit.num_observed[1] - n / 2) < 0.02 * n
    assert all(e < 0.02 for e in fit.ece_after), fit.ece_after
    # the calibrated cumulative product on fresh, untrimmed rollouts
    logits2, accepted2 = synthetic_rollouts(true, n, seed=13)
    cum = np.cumprod(1.0 / (1.0 + np.exp(-logits2 / got)), axis=1)
    labels2, _ = acceptance_labels(accepted2, np.full(n, k), k)
    assert all(expected_calibration_error(cum[:, j], labels2[:, j]) < 0.02 for j in range(k))

    old = fit_sts(logits, accepted, np.where(accepted < verified, k, verified))
    assert old.temperatures[0] == fit.temperatures[0]  # position 1 is verified in every row either way
    assert old.temperatures[1] > 1.4 * true[1], old.temperatures  # observed 1.57..1.79 over 8 seeds


def test_sts_on_rollouts_trimmed_by_survival():
    """Trimming by the allocator's rule (global top-B of survival, B = half the drafts) selects rows by their
    confidences, not their outcomes: the verified positions still calibrate to the true temperatures."""
    true = np.array([0.7, 1.0, 1.6])
    n, k = 60000, 3
    logits, accepted_full = synthetic_rollouts(true, n, seed=21)
    survival = np.cumprod(1.0 / (1.0 + np.exp(-logits / true)), axis=1)
    cutoff = np.sort(survival.ravel())[::-1][n * k // 2 - 1]
    verified = (survival >= cutoff).sum(axis=1)  # a prefix per row, since survival falls along it
    assert 0.45 < verified.sum() / (n * k) < 0.55 and verified.min() == 0
    fit = fit_sts(logits, _trim(accepted_full, verified), verified)
    # observed over 8 seeds: ratios within [0.96, 1.06]
    np.testing.assert_allclose(fit.temperatures, true, rtol=0.1)


def test_positions_are_fitted_in_order():
    """Only position 1 is miscalibrated (T_1 = 3). Fitted in order, position 2 sees the corrected c~_1 and keeps
    T_2 ~ 1; fitted on its own (c_1 uncorrected inside the product) it would need a distorted T_2."""
    true = np.array([3.0, 1.0, 1.0])
    logits, accepted = synthetic_rollouts(true, 20000, seed=2)
    fit = fit_sts(logits, accepted)
    np.testing.assert_allclose(fit.temperatures, true, rtol=0.1)
    labels, _ = acceptance_labels(accepted, np.full(20000, 3), 3)
    c1 = 1.0 / (1.0 + np.exp(-logits[:, 0]))
    grid = np.geomspace(0.2, 5.0, 41)
    ece = [expected_calibration_error(c1 / (1.0 + np.exp(-logits[:, 1] / t)), labels[:, 1]) for t in grid]
    assert abs(np.log(grid[int(np.argmin(ece))])) > np.log(1.4)  # the independent fit is far from 1
    assert min(ece) > 2 * fit.ece_after[1]


def test_unobserved_positions_and_records():
    rec = RolloutRecords(3)
    # every row verified only the first draft: positions 2, 3 are never scored (not even after the rejection
    # in row 1), and the padding row is dropped
    logits = np.array([[2.0, 1.0, 1.0], [-1.0, 0.5, 0.5], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    rec.add(logits, [1, 0, 1, 0], [1, 1, 1, 1], valid=[True, True, True, False])
    assert len(rec) == 3
    fit = rec.fit()
    assert fit.num_observed == (3, 0, 0) and fit.temperatures[1:] == (1.0, 1.0)
    rec.add(logits, [3, 0, 2, 1], [3, 2, 2, 3])
    assert len(rec) == 7
    assert rec.fit().num_observed == (7, 4, 2)  # v >= 2 in all 4 new rows, v >= 3 in 2
    with pytest.raises(ValueError, match="num_accepted <= num_verified"):
        rec.add(logits, [2, 0, 0, 0], [1, 1, 1, 1])
    with pytest.raises(ValueError, match="K = 3 columns"):
        rec.add(logits[:, :2], [0, 0, 0, 0], [1, 1, 1, 1])
    with pytest.raises(ValueError, match="num_accepted must be int\\[N\\] with N = 4"):
        fit_sts(logits, [0, 0])


def test_apply_sts_in_jit():
    logits = jnp.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])
    temps = (2.0, 0.5, 1.0)
    got = jax.jit(lambda x: apply_sts(x, temps))(logits)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.nn.sigmoid(logits / jnp.array(temps))), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(apply_sts(logits, None)), np.asarray(jax.nn.sigmoid(logits)))
    with pytest.raises(ValueError, match="temperatures must be f32\\[K\\] with K"):
        apply_sts(logits, (1.0, 2.0))
