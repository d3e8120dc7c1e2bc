"""Online acceptance estimator: censored labels, Newton refits, damping, guards, recovery of known parameters."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_decode.estimator import (
    SLOPE_FLOOR,
    censored_labels,
    confidence_feature,
    confidence_feature_from_logits,
    init_estimator,
    predict,
    update,
)


def test_init_and_predict():
    s = init_estimator(4)
    assert float(s.slope) == 0.5
    np.testing.assert_allclose(s.intercepts, [-0.2] * 4)
    f = jnp.array([[0.0, 1.0, -2.0, 40.0], [3.0, 0.5, 0.0, -100.0]])
    expected = 1 / (1 + np.exp(-(0.5 * np.clip(np.asarray(f), -40, 40) - 0.2)))
    np.testing.assert_allclose(predict(s, f), expected, rtol=1e-6)
    assert len(jax.tree_util.tree_leaves(s)) == 11  # a pytree of arrays


def test_censored_labels():
    y, obs = censored_labels(jnp.array([0, 2, 3, 1, 0]), jnp.array([3, 3, 3, 1, 0]), 4)
    np.testing.assert_array_equal(
        obs,
        [
            [1, 0, 0, 0],  # first draft rejected: one 0 label
            [1, 1, 1, 0],  # two accepted, third rejected
            [1, 1, 1, 0],  # all three verified drafts accepted; the 4th was never verified
            [1, 0, 0, 0],  # one verified and accepted
            [0, 0, 0, 0],  # nothing verified (a padding row)
        ],
    )
    np.testing.assert_array_equal(y * obs, [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [0] * 4])


def test_statistics_and_refit_schedule():
    s = init_estimator(3)
    f = jnp.array([[1.0, -1.0, 2.0], [0.5, 0.0, 0.0]])
    acc, ver = jnp.array([1, 0]), jnp.array([3, 0])  # row 1 is padding
    s1 = update(s, f, acc, ver, refit_every=3)
    p = 1 / (1 + np.exp(-(0.5 * np.array([1.0, -1.0]) - 0.2)))
    np.testing.assert_allclose(s1.counts, [1, 1, 0])
    np.testing.assert_allclose(s1.grad_b, [1 - p[0], 0 - p[1], 0], rtol=1e-6)
    np.testing.assert_allclose(s1.grad_w, [(1 - p[0]) * 1.0, (0 - p[1]) * -1.0, 0], rtol=1e-6)
    np.testing.assert_allclose(s1.hess_bb, [p[0] * (1 - p[0]), p[1] * (1 - p[1]), 0], rtol=1e-6)
    np.testing.assert_allclose(s1.hess_ww, [p[0] * (1 - p[0]), p[1] * (1 - p[1]), 0], rtol=1e-6)
    assert int(s1.step) == 1 and int(s1.num_refits) == 0
    s2 = update(s1, f, acc, ver, refit_every=3)
    assert float(s2.slope) == 0.5 and int(s2.num_refits) == 0  # no refit before step 3
    s3 = update(s2, f, acc, ver, refit_every=3)
    assert int(s3.num_refits) == 1 and int(s3.step) == 3
    np.testing.assert_array_equal(s3.counts, [0, 0, 0])  # statistics cleared
    assert float(s3.slope) != 0.5
    assert float(s3.intercepts[2]) == pytest.approx(-0.2)  # no labels at position 2: unchanged


def test_the_refit_is_a_select_not_a_conditional():
    """The engine's step program carries ``update`` (confidence "estimator" and "calibrated"); on a GPU a
    conditional makes the host wait for its predicate in the middle of the program, so the compiled update has
    none, and a step that is not a refit step returns the statistics it accumulated and the old parameters."""
    s = init_estimator(3)
    args = (s, jnp.array([[1.0, -1.0, 2.0]]), jnp.array([1]), jnp.array([3]))
    assert " conditional(" not in update.lower(*args, refit_every=3).compile().as_text()  # the HLO op
    poisoned = dataclasses.replace(s, hess_bb=jnp.array([jnp.nan, 0.0, 0.0]))  # a refit would discard it
    s1 = update(poisoned, *args[1:], refit_every=3)
    assert float(s1.slope) == 0.5 and int(s1.num_refits) == 0 and int(s1.num_discarded) == 0
    np.testing.assert_array_equal(s1.intercepts, s.intercepts)


def _hand_state(**stats):
    """K = 2, slope 0.5, intercepts -0.2, with the given Newton statistics (statistics not given are zero)."""
    s = init_estimator(2)
    return dataclasses.replace(s, **{k: jnp.asarray(v, jnp.float32) for k, v in stats.items()})


_PAD = (jnp.zeros((1, 2)), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32))  # a padding row: adds nothing
_HAND = {
    "hess_bb": [10.0, 2.0],
    "hess_wb": [2.0, 1.0],
    "hess_ww": [20.0, 5.9],
    "grad_b": [5.0, 1.0],
    "counts": [40.0, 10.0],
}


def test_per_position_damping_by_hand():
    """One refit from hand-set statistics (ridge ~ 0), against values worked out on paper.

    a = 25.9, sum c^2/h = 4/10 + 1/2 = 0.9, Schur complement 25; g_w = 6.5, sum c g_b / h = 1.5, so the full
    slope step is 5 / 25 = 0.2. The slope is damped by its own count, all 50 labels: 50 / 100 -> +0.1.
    Intercepts given that step: (5 - 2 * 0.1) / 10 = 0.48 and (1 - 1 * 0.1) / 2 = 0.45, damped per position by
    40 / 90 and 10 / 60 -> +0.213333 and +0.075. (Damping both by the total count, with the intercepts taken
    from the full slope step, would give +0.23 and +0.2.)"""
    s = _hand_state(grad_w=[5.0, 1.5], **_HAND)
    s = update(s, *_PAD, refit_every=1, ridge=1e-9)
    assert int(s.num_refits) == 1 and int(s.num_discarded) == 0
    np.testing.assert_allclose(float(s.slope), 0.6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s.intercepts), [-0.2 + 0.48 * 4 / 9, -0.2 + 0.45 / 6], rtol=1e-5)
    np.testing.assert_array_equal(s.counts, [0, 0])  # statistics cleared


def test_slope_is_projected_onto_the_floor_by_hand():
    """Same statistics with g_w = -48.5: the full slope step is (-48.5 - 1.5) / 25 = -2, damped -1, which would
    take the slope from 0.5 to -0.5. It lands on the floor (0), and the intercepts step given the slope step
    actually taken (-0.5): (5 + 2 * 0.5) / 10 * 4/9 and (1 + 1 * 0.5) / 2 * 1/6."""
    assert SLOPE_FLOOR == 0.0
    s = _hand_state(grad_w=[-40.0, -8.5], **_HAND)
    s = update(s, *_PAD, refit_every=1, ridge=1e-9)
    assert float(s.slope) == 0.0
    np.testing.assert_allclose(np.asarray(s.intercepts), [-0.2 + 0.6 * 4 / 9, -0.2 + 0.75 / 6], rtol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("field", ["grad_w", "grad_b", "hess_ww", "hess_bb", "counts"])
def test_nonfinite_refit_is_discarded(field, bad):
    stats = {**_HAND, "grad_w": [5.0, 1.5]}
    stats[field] = [stats[field][0], bad]
    s = update(_hand_state(**stats), *_PAD, refit_every=1)
    assert float(s.slope) == 0.5
    np.testing.assert_array_equal(np.asarray(s.intercepts), np.float32([-0.2, -0.2]))
    assert int(s.num_refits) == 1 and int(s.num_discarded) == 1
    for name in ("hess_bb", "hess_wb", "hess_ww", "grad_b", "grad_w", "counts"):
        np.testing.assert_array_equal(getattr(s, name), [0, 0])  # the poisoned window is gone
    # the next window refits normally from clean statistics
    f = jnp.array([[1.0, -1.0], [0.5, 2.0]])
    s2 = update(s, f, jnp.array([2, 0]), jnp.array([2, 2]), refit_every=1)
    assert int(s2.num_discarded) == 1 and int(s2.num_refits) == 2
    assert np.isfinite(float(s2.slope)) and float(s2.slope) != 0.5


def test_nan_features_are_not_observations():
    """A NaN feature adds no label (it used to count as an observation at f = 0); the state stays finite."""
    s = init_estimator(3)
    f = jnp.array([[jnp.nan, 1.0, 2.0], [0.5, jnp.nan, 1.0], [jnp.nan] * 3])
    acc, ver = jnp.array([2, 2, 1]), jnp.array([3, 3, 3])  # labels (1, 1, 0), (1, 1, 0), (1, 0, -)
    s1 = update(s, f, acc, ver, refit_every=2)
    np.testing.assert_array_equal(s1.counts, [1, 1, 2])
    p = 1 / (1 + np.exp(-(0.5 * np.array([0.5, 1.0, 2.0, 1.0]) - 0.2)))  # the four finite observations
    np.testing.assert_allclose(s1.grad_b, [1 - p[0], 1 - p[1], -p[2] - p[3]], rtol=1e-6)
    s2 = update(s1, f, acc, ver, refit_every=2)  # refit
    assert int(s2.num_refits) == 1 and int(s2.num_discarded) == 0
    assert np.isfinite(float(s2.slope)) and np.all(np.isfinite(np.asarray(s2.intercepts)))
    assert np.all(np.isfinite(np.asarray(predict(s2, f))))


def _numpy_newton_mle(f, y, pos, k, iters=50):
    theta = np.zeros(k + 1)
    x = np.zeros((len(f), k + 1))
    x[:, 0] = f
    x[np.arange(len(f)), 1 + pos] = 1.0
    for _ in range(iters):
        p = 1 / (1 + np.exp(-x @ theta))
        g = x.T @ (y - p)
        h = (x * (p * (1 - p))[:, None]).T @ x
        theta = theta + np.linalg.solve(h, g)
    return theta


def test_repeated_refits_on_fixed_data_reach_the_mle():
    rng = np.random.default_rng(0)
    r, k = 64, 3
    f = rng.normal(0.0, 1.5, (r, k)).astype(np.float32)
    ver = rng.integers(0, k + 1, r)
    acc = np.array([rng.integers(0, v + 1) for v in ver])
    y, obs = map(np.asarray, censored_labels(acc, ver, k))
    rows, cols = np.nonzero(obs)
    mle = _numpy_newton_mle(f[rows, cols].astype(np.float64), y[rows, cols], cols, k)
    n_obs = obs.sum(axis=0)
    assert n_obs[2] < 20  # the last position is thin: its step is damped by n_2 / (n_2 + 50) < 0.3 each refit
    step = jax.jit(functools.partial(update, refit_every=1))
    s = init_estimator(k)
    for _ in range(60):  # damping slows convergence on thin positions but leaves the fixed point (the MLE)
        s = step(s, f, acc, ver)
    np.testing.assert_allclose(float(s.slope), mle[0], atol=2e-3)
    np.testing.assert_allclose(np.asarray(s.intercepts), mle[1:], atol=2e-3)


def _simulate(true_w, true_b, *, num_steps, num_rows, seed):
    """Simulated verifications: acceptance of draft k ~ Bernoulli(sigmoid(w f + b_k)) until the first miss."""
    k = true_b.shape[0]

    def one_step(state, key):
        kf, ka, kv = jax.random.split(key, 3)
        f = jax.random.normal(kf, (num_rows, k)) * 1.5 + 0.5
        p = jax.nn.sigmoid(true_w * f + true_b[None, :])
        ok = jax.random.uniform(ka, (num_rows, k)) < p
        ver = jax.random.randint(kv, (num_rows,), 1, k + 1)
        lead = jnp.cumprod(ok.astype(jnp.int32), axis=1)  # 1 while all so far accepted
        acc = jnp.minimum(jnp.sum(lead, axis=1), ver)
        return update(state, f, acc, ver), None

    keys = jax.random.split(jax.random.key(seed), num_steps)
    state, _ = jax.lax.scan(one_step, init_estimator(k), keys)
    return state


def test_negative_slope_data_leaves_the_slope_at_the_floor():
    """Acceptance that falls as the drafter grows surer (true w = -1): the slope stops at 0 and the intercepts go
    to the constrained optimum, each position's base rate logit(E[sigmoid(-f + b_k)]) over f ~ N(0.5, 1.5)
    (which drafts reach position k depends only on earlier positions' features, so f_k keeps its law)."""
    true_b = jnp.array([1.0, 0.5, 0.0], jnp.float32)
    state = jax.jit(functools.partial(_simulate, num_steps=600, num_rows=256, seed=3))(jnp.float32(-1.0), true_b)
    assert int(state.num_refits) == 6 and int(state.num_discarded) == 0
    assert float(state.slope) == 0.0
    f = np.random.default_rng(0).normal(0.5, 1.5, 1_000_000)
    rate = np.array([np.mean(1 / (1 + np.exp(f - b))) for b in np.asarray(true_b)])
    # observed over 8 seeds: slope exactly 0, intercepts within 0.06
    np.testing.assert_allclose(np.asarray(state.intercepts), np.log(rate / (1 - rate)), atol=0.1)


@pytest.mark.parametrize("seed", [1, 2])
def test_recovers_known_parameters(seed):
    true_w = jnp.float32(1.3)
    true_b = jnp.array([2.0, 1.2, 0.6, 0.0, -0.5], jnp.float32)
    state = jax.jit(functools.partial(_simulate, num_steps=1200, num_rows=256, seed=seed))(true_w, true_b)
    assert int(state.num_refits) == 12
    assert abs(float(state.slope) - 1.3) < 0.08
    np.testing.assert_allclose(np.asarray(state.intercepts), np.asarray(true_b), atol=0.25)
    # Starting from (0.5, -0.2) the fit has clearly moved to the truth, not stayed near the initialisation.
    assert abs(float(state.slope) - 0.5) > 0.6


def test_confidence_features():
    probs = jnp.array([[0.7, 0.2, 0.1], [1.0, 0.0, 0.0], [0.25, 0.25, 0.5]])
    np.testing.assert_allclose(confidence_feature(probs), [np.log(0.7 / 0.3), 40.0, 0.0], atol=1e-5)
    logits = jnp.log(jnp.array([[0.7, 0.2, 0.1], [0.4, 0.4, 0.2]]))
    np.testing.assert_allclose(
        confidence_feature_from_logits(logits, 1.0), [np.log(0.7 / 0.3), np.log(0.4 / 0.6)], atol=1e-5
    )
    # Temperature scaling: T = 0.5 squares the probabilities before renormalising.
    q = np.array([0.7, 0.2, 0.1]) ** 2
    np.testing.assert_allclose(
        confidence_feature_from_logits(logits[:1], 0.5), [np.log(q[0] / (q[1] + q[2]))], atol=1e-5
    )
    huge = jnp.array([[1000.0, 0.0, 0.0]])
    np.testing.assert_allclose(confidence_feature_from_logits(huge, 1.0), [40.0])


def test_bad_shapes_raise():
    s = init_estimator(3)
    with pytest.raises(ValueError, match="features"):
        predict(s, jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="features"):
        update(s, jnp.ones((2, 4)), jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match="accepted_counts"):
        update(s, jnp.ones((2, 3)), jnp.ones(3, jnp.int32), jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match="num_positions"):
        init_estimator(0)
    with pytest.raises(ValueError, match="slope must be >= SLOPE_FLOOR"):
        init_estimator(3, slope=-0.5)
    with pytest.raises(ValueError, match="ridge > 0"):
        update(s, jnp.ones((2, 3)), jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int32), ridge=0.0)
    with pytest.raises(ValueError, match="refit_every"):
        update(s, jnp.ones((2, 3)), jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int32), refit_every=0)
