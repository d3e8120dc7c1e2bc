"""Online acceptance estimator for drafters without a confidence head (docs/ADAPTIVE_VERIFICATION.md).

Model: ``p_k = sigmoid(w * f + b_k)``, the probability that draft ``k`` is accepted given drafts ``< k`` were,
with one slope ``w`` shared by all positions and one intercept ``b_k`` per position. The feature is
``f = logit(max q)`` of the temperature-scaled draft distribution, clamped to ``+-40``.

Labels come from each verification and are censored: for a request with ``a`` accepted of ``v`` verified
drafts, positions ``k < a`` are 1, position ``a`` is 0 when ``a < v`` (the first rejection), and everything
after is unobserved (never verified, or verified after a rejection, which says nothing about the conditional).

Fitting is a Newton step on the logistic log-likelihood at the current parameters. Because the parameters stay
fixed between refits, the gradient ``g = sum (y - p) x`` and the Hessian ``H = sum p (1 - p) x x^T`` at those
parameters can be accumulated step by step (``x = (f, onehot_k)``, so per-position sums suffice). Every
``refit_every`` steps (100) one damped Newton step is taken and the statistics are cleared. ``H`` is an
arrowhead matrix (slope row plus a diagonal), solved exactly in ``O(K)`` through its Schur complement; a ridge of
``1e-3`` is added to its diagonal (a Levenberg term, so a position with no labels keeps its intercept).

Damping follows vLLM's online acceptance estimator (``_refit_kernel`` in
``vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py``): each parameter's step is scaled by
``n / (n + 50)`` with ``n`` the labels behind *that* parameter since the last refit. The slope learns from every
position, so it uses the total count ``N = sum_k n_k``; intercept ``b_k`` uses its own ``n_k``, so a position
the drafts rarely reach moves slowly instead of lurching, and one nobody reached (``n_k = 0``) holds still. The
intercept step is the Newton step conditioned on the slope step actually taken:
``db_k = n_k / (n_k + 50) * (g_k - c_k dw) / (h_k + ridge)``. Each component is then clipped to ``+-max_step``
(a safeguard against a confidently wrong model: saturated ``p`` makes ``H`` vanish).

Guards (also as in vLLM, one of them chosen differently):

* A refit whose statistics, Newton step or new parameters are not all finite is discarded whole: the
  parameters stay, the statistics are cleared anyway (so one poisoned window cannot poison the next), and
  ``num_discarded`` counts it. Observations whose feature is NaN are not folded into the statistics at all
  (``predict`` maps a NaN feature to 0 instead).
* The slope is kept ``>= 0`` (``SLOPE_FLOOR``). The feature is the drafter's own certainty about the token it
  drew; a negative slope would make the predicted acceptance *fall* as the drafter grows surer and rank its
  most confident drafts last. A drafter whose certainty is anti-correlated with acceptance is not a believable
  model; such a fit comes from a small or drifting window, and acting on it inverts the allocation, so the
  model is restricted to ``w >= 0``. vLLM rejects a slope step that would cross 0 and keeps the old slope;
  here the step is *projected* instead: the slope lands on ``0`` and the intercepts take their Newton step
  given that slope step. With rejection, a slope whose best value is near 0 stays at its old, larger value
  whenever a damped step overshoots below 0; the projected step is the Newton step of the constrained problem
  and converges to its optimum (slope 0, intercepts at the per-position base rates, when the data say
  ``w < 0``).

Everything is a pure, jit-able ``state -> state`` function with no conditional: the refit is computed on every
step and selected on the refit steps (a few dozen element-wise operations on ``K``-vectors), so the engine's step
program, which carries it, keeps no point where a GPU's host must wait for the device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

__all__ = [
    "FEATURE_CLAMP",
    "SLOPE_FLOOR",
    "EstimatorState",
    "censored_labels",
    "confidence_feature",
    "confidence_feature_from_logits",
    "init_estimator",
    "predict",
    "update",
]

FEATURE_CLAMP = 40.0
SLOPE_FLOOR = 0.0  # the slope never goes below this (see the module docstring)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EstimatorState:
    """Parameters, Newton sufficient statistics (at the current parameters) and the step counter.

    All fields are arrays; ``K`` is the number of draft positions.
    """

    slope: jax.Array  # f32[]      shared w
    intercepts: jax.Array  # f32[K]     b_k
    hess_bb: jax.Array  # f32[K]     sum p(1-p)          per position
    hess_wb: jax.Array  # f32[K]     sum p(1-p) f        per position
    hess_ww: jax.Array  # f32[K]     sum p(1-p) f^2      per position
    grad_b: jax.Array  # f32[K]     sum (y - p)         per position
    grad_w: jax.Array  # f32[K]     sum (y - p) f       per position
    counts: jax.Array  # f32[K]     labels observed     per position since the last refit
    step: jax.Array  # int32[]    updates so far
    num_refits: jax.Array  # int32[]    refits so far (discarded ones included)
    num_discarded: jax.Array  # int32[]    refits discarded for a non-finite result

    @property
    def num_positions(self) -> int:
        return self.intercepts.shape[0]


def init_estimator(num_positions: int, *, slope: float = 0.5, intercept: float = -0.2) -> EstimatorState:
    """A fresh estimator for ``num_positions`` (= K) draft positions, with the SPEC's initial parameters."""
    if num_positions < 1:
        raise ValueError(f"num_positions must be >= 1, got {num_positions}")
    if not slope >= SLOPE_FLOOR:
        raise ValueError(f"slope must be >= SLOPE_FLOOR = {SLOPE_FLOOR}, got {slope}")
    z = jnp.zeros((num_positions,), jnp.float32)
    return EstimatorState(
        slope=jnp.float32(slope),
        intercepts=jnp.full((num_positions,), intercept, jnp.float32),
        hess_bb=z,
        hess_wb=z,
        hess_ww=z,
        grad_b=z,
        grad_w=z,
        counts=z,
        step=jnp.int32(0),
        num_refits=jnp.int32(0),
        num_discarded=jnp.int32(0),
    )


def _clean_features(features: jax.Array) -> jax.Array:
    f = jnp.asarray(features, jnp.float32)
    return jnp.clip(jnp.where(jnp.isnan(f), 0.0, f), -FEATURE_CLAMP, FEATURE_CLAMP)


def confidence_feature(draft_probs: jax.Array) -> jax.Array:
    """``f = logit(max_v q[..., v])`` of (already temperature-scaled) draft probabilities, clamped to +-40.

    ``draft_probs``: ``f32[..., V]`` -> ``f32[...]``.
    """
    q = jnp.max(jnp.asarray(draft_probs, jnp.float32), axis=-1)
    f = jnp.log(q) - jnp.log1p(-q)
    return _clean_features(f)


def confidence_feature_from_logits(draft_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``logit(max softmax(draft_logits / T))`` computed stably as ``m - logsumexp(others)``, clamped to +-40.

    ``draft_logits``: ``f32[..., V]`` -> ``f32[...]``. ``temperature <= 0`` (greedy) uses ``T = 1``: the
    greedy draft distribution is one-hot and would carry no information.
    """
    t = float(temperature) if temperature > 0 else 1.0
    z = jnp.asarray(draft_logits, jnp.float32) / t
    m = jnp.max(z, axis=-1, keepdims=True)
    top = jnp.argmax(z, axis=-1)[..., None]
    is_top = jnp.arange(z.shape[-1]) == top  # exactly one entry, also when the max is tied
    others = jnp.where(is_top, -jnp.inf, z - m)
    f = -jax.nn.logsumexp(others, axis=-1)  # = m - log(sum of the others), in shifted units
    return _clean_features(f)


def predict(state: EstimatorState, features: jax.Array) -> jax.Array:
    """``f32[R, K]`` acceptance probabilities ``sigmoid(w * f + b_k)`` for features ``f32[R, K]``."""
    f = _clean_features(features)
    if f.ndim != 2 or f.shape[1] != state.num_positions:
        raise ValueError(f"features must be f32[R, K={state.num_positions}], got shape {f.shape}")
    return jax.nn.sigmoid(state.slope * f + state.intercepts[None, :])


def _refit(state: EstimatorState, ridge: float, damping: float, max_step: float) -> EstimatorState:
    # Newton system (H + ridge I) d = g with H = [[a, c^T], [c, diag(h)]] over (w, b_1..b_K).
    h = state.hess_bb + ridge  # [K]
    c = state.hess_wb  # [K]
    a = jnp.sum(state.hess_ww) + ridge
    gw = jnp.sum(state.grad_w)
    gb = state.grad_b  # [K]
    schur = jnp.maximum(a - jnp.sum(c * c / h), ridge * 1e-3)  # > 0 for a PSD H; guard rounding
    dw_newton = (gw - jnp.sum(c * gb / h)) / schur
    # The slope learns from every position: damped by the total count.
    n_total = jnp.sum(state.counts)
    eta_w = jnp.where(n_total > 0, n_total / (n_total + damping), 0.0)
    dw = jnp.clip(eta_w * dw_newton, -max_step, max_step)
    new_slope = jnp.maximum(state.slope + dw, SLOPE_FLOOR)  # projected onto the floor (NaN stays NaN)
    dw_taken = new_slope - state.slope
    # Each intercept: the Newton step given the slope step taken, damped by its own count.
    db_newton = (gb - c * dw_taken) / h
    eta_b = jnp.where(state.counts > 0, state.counts / (state.counts + damping), 0.0)
    db = jnp.clip(eta_b * db_newton, -max_step, max_step)
    new_intercepts = state.intercepts + db
    stats = (state.hess_bb, state.hess_wb, state.hess_ww, state.grad_b, state.grad_w, state.counts)
    finite = (
        jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in stats]))
        & jnp.isfinite(dw_newton)
        & jnp.all(jnp.isfinite(db_newton))
        & jnp.isfinite(new_slope)
        & jnp.all(jnp.isfinite(new_intercepts))
    )
    z = jnp.zeros_like(state.counts)
    return dataclasses.replace(
        state,
        slope=jnp.where(finite, new_slope, state.slope),
        intercepts=jnp.where(finite, new_intercepts, state.intercepts),
        hess_bb=z,
        hess_wb=z,
        hess_ww=z,
        grad_b=z,
        grad_w=z,
        counts=z,
        num_refits=state.num_refits + 1,
        num_discarded=state.num_discarded + (~finite).astype(jnp.int32),
    )


def censored_labels(accepted_counts: jax.Array, verified_counts: jax.Array, num_positions: int):
    """``(labels f32[R, K], observed bool[R, K])`` from accepted/verified counts (see the module docstring)."""
    v = jnp.clip(jnp.asarray(verified_counts, jnp.int32), 0, num_positions)
    a = jnp.clip(jnp.asarray(accepted_counts, jnp.int32), 0, v)
    k = jnp.arange(num_positions, dtype=jnp.int32)[None, :]
    labels = (k < a[:, None]).astype(jnp.float32)
    observed = (k < a[:, None]) | ((k == a[:, None]) & (a[:, None] < v[:, None]))
    return labels, observed


@functools.partial(jax.jit, static_argnames=("refit_every", "ridge", "damping", "max_step"))
def update(
    state: EstimatorState,
    features: jax.Array,
    accepted_counts: jax.Array,
    verified_counts: jax.Array,
    *,
    refit_every: int = 100,
    ridge: float = 1e-3,
    damping: float = 50.0,
    max_step: float = 4.0,
) -> EstimatorState:
    """Fold one verification step into the statistics; every ``refit_every`` steps take one Newton step.

    Args:
      state: the current :class:`EstimatorState` (``K`` positions).
      features: ``f32[R, K]`` features of this step's drafts (the ones whose acceptance is being reported).
      accepted_counts: ``int32[R]`` drafts accepted per request (``<= verified_counts``).
      verified_counts: ``int32[R]`` drafts verified per request (``0`` for padding rows: they add nothing).
      refit_every: take a Newton step every this many updates (static).
      ridge: added to the Hessian diagonal, ``> 0`` (static).
      damping: ``D`` in the damping factor ``n / (n + D)`` (static).
      max_step: each parameter moves at most this much per refit (static).

    Returns:
      The new state (same structure and shapes; jit-able, no host synchronisation).
    """
    kk = state.num_positions
    raw = jnp.asarray(features, jnp.float32)
    f = _clean_features(raw)
    if f.ndim != 2 or f.shape[1] != kk:
        raise ValueError(f"features must be f32[R, K={kk}], got shape {f.shape}")
    r = f.shape[0]
    if jnp.shape(accepted_counts) != (r,) or jnp.shape(verified_counts) != (r,):
        raise ValueError(
            f"accepted_counts and verified_counts must be int32[R={r}], got shapes "
            f"{jnp.shape(accepted_counts)} and {jnp.shape(verified_counts)}"
        )
    if refit_every < 1:
        raise ValueError(f"refit_every must be >= 1, got {refit_every}")
    if not (ridge > 0 and damping >= 0 and max_step > 0):
        raise ValueError(f"need ridge > 0, damping >= 0, max_step > 0; got {ridge}, {damping}, {max_step}")
    y, obs = censored_labels(accepted_counts, verified_counts, kk)
    m = (obs & ~jnp.isnan(raw)).astype(jnp.float32)  # a NaN feature is no observation
    p = jax.nn.sigmoid(state.slope * f + state.intercepts[None, :])
    hw = m * p * (1.0 - p)
    gr = m * (y - p)
    state = dataclasses.replace(
        state,
        hess_bb=state.hess_bb + jnp.sum(hw, axis=0),
        hess_wb=state.hess_wb + jnp.sum(hw * f, axis=0),
        hess_ww=state.hess_ww + jnp.sum(hw * f * f, axis=0),
        grad_b=state.grad_b + jnp.sum(gr, axis=0),
        grad_w=state.grad_w + jnp.sum(gr * f, axis=0),
        counts=state.counts + jnp.sum(m, axis=0),
        step=state.step + 1,
    )
    # a select, not a lax.cond (module docstring): the engine's step program carries this update
    due = state.step % refit_every == 0
    refitted = _refit(state, ridge, damping, max_step)
    return jax.tree.map(lambda new, old: jnp.where(due, new, old), refitted, state)
