"""Sequential temperature scaling (STS) of the DSpark confidence head (docs/DRAFTER.md).

The confidence head predicts ``c_k``: the probability that draft ``k`` is accepted given that drafts ``< k`` were.
Adaptive verification ranks drafts by the survival ``prod_{i <= k} c_i``, so what has to be calibrated is the
cumulative product, not each ``c_k`` on its own. STS rescales each position's logit with its own temperature,
``c~_k = sigmoid(logit_k / T_k)``, and fits the temperatures one position at a time, in order ``k = 1..K``: with
``T_1..T_{k-1}`` fixed, ``T_k`` is the grid value minimising the expected calibration error (20 equal-width bins)
of ``prod_{i <= k} c~_i`` against the label "the first ``k`` drafts were all accepted".

Rollout records, one row per (request, speculative step):

* ``confidence_logits f32[N, K]``: the raw (uncalibrated) confidence logits the drafter produced;
* ``num_accepted int32[N]``: the accepted prefix length ``a`` (0..K);
* ``num_verified int32[N]`` (optional, default ``K``): how many drafts were verified. Label ``k`` (1-based) is
  ``k <= a`` and is scored only where ``k <= num_verified``: the positions that were verified.

Only verified positions are scored, as DeepSpec's evaluator does (``ConfidenceHeadRecorder.observe`` scores the
cumulative product against the cumulative product of the accept mask over the verified positions only). After a
rejection at ``a + 1 <= num_verified`` the label "the first ``k`` were all accepted" is also *known* to be 0 for
every ``k > num_verified``, but scoring those positions would select rows by their outcome: a row trimmed to
``v`` drafts contributes positions ``> v`` only if it failed, never if all ``v`` passed, so the labels there lean
to 0 and the fitted temperatures are biased (with half the rows trimmed to one draft, that labelling fits
``T_2 = 1.6..1.8`` for a true ``T_2 = 1``: ``tests/test_calibration.py``). Restricting to verified positions
selects rows by how many drafts were verified, which the allocator decides from confidences, not from the
outcomes, and leaves the calibration target unchanged.
Rollouts recorded with full verification (``num_verified = K``, as DeepSpec records them) are the cleanest.

Everything here is host-side numpy (calibration is an offline step) except :func:`apply_sts`, which also works on
traced jax arrays inside the jitted draft step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_NUM_BINS = 20
_EPS_PROB = 1e-8


def default_temperature_grid() -> np.ndarray:
    """321 geometrically spaced temperatures in [0.05, 20] (about 1.9% apart), 1.0 included exactly."""
    grid = np.geomspace(0.05, 20.0, 321)
    return np.unique(np.concatenate([grid, [1.0]]))


def apply_sts(confidence_logits, temperatures: Sequence[float] | None):
    """``sigmoid(logit_k / T_k)`` over the last axis ``K`` (plain sigmoid when ``temperatures`` is None).

    Works on numpy arrays and on (traced) jax arrays: ``confidence_logits [..., K]``, ``temperatures [K]``.
    """
    if temperatures is None:
        return jax.nn.sigmoid(confidence_logits)
    t = jnp.asarray(temperatures, jnp.float32)
    if t.ndim != 1 or t.shape[0] != confidence_logits.shape[-1]:
        raise ValueError(f"temperatures must be f32[K] with K = confidence_logits.shape[-1] = "
                         f"{confidence_logits.shape[-1]}, got shape {t.shape}")
    return jax.nn.sigmoid(confidence_logits / t)


def expected_calibration_error(pred, target, *, num_bins: int = DEFAULT_NUM_BINS) -> float:
    """ECE with ``num_bins`` equal-width bins on [0, 1], bins weighted by their counts.

    ``sum_b (n_b / N) |mean(pred in b) - mean(target in b)|``; ``pred`` is clipped to ``[1e-8, 1 - 1e-8]`` and a
    prediction of exactly 1 falls in the last bin. NaN for empty input.
    """
    pred = np.asarray(pred, np.float64).reshape(-1)
    target = np.asarray(target, np.float64).reshape(-1)
    if pred.shape != target.shape:
        raise ValueError(f"pred and target must have the same size, got {pred.shape} and {target.shape}")
    if pred.size == 0:
        return float("nan")
    return float(_ece_rows(pred[None], target, num_bins)[0])


def _ece_rows(pred: np.ndarray, target: np.ndarray, num_bins: int) -> np.ndarray:
    """ECE of each row of ``pred [G, N]`` against the shared ``target [N]`` -> ``[G]``."""
    g, n = pred.shape
    p = np.clip(pred, _EPS_PROB, 1.0 - _EPS_PROB)
    bins = np.minimum((p * num_bins).astype(np.int64), num_bins - 1)
    flat = (np.arange(g)[:, None] * num_bins + bins).reshape(-1)
    size = g * num_bins
    sum_pred = np.bincount(flat, weights=p.reshape(-1), minlength=size).reshape(g, num_bins)
    sum_tgt = np.bincount(flat, weights=np.broadcast_to(target, (g, n)).reshape(-1), minlength=size)
    sum_tgt = sum_tgt.reshape(g, num_bins)
    return np.abs(sum_pred - sum_tgt).sum(axis=1) / n


def acceptance_labels(num_accepted, num_verified, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(labels bool[N, K], observed bool[N, K])`` from accepted / verified counts (see the module docstring)."""
    a = np.asarray(num_accepted, np.int64).reshape(-1)
    v = np.asarray(num_verified, np.int64).reshape(-1)
    k = np.arange(1, block_size + 1)[None, :]
    labels = k <= a[:, None]
    observed = k <= v[:, None]  # [N, K]
    return labels, observed


@dataclasses.dataclass(frozen=True)
class STSFit:
    """The result of :func:`fit_sts`: temperatures and the per-position ECE of the cumulative product."""

    temperatures: tuple[float, ...]
    ece_before: tuple[float, ...]  # temperatures all 1
    ece_after: tuple[float, ...]
    num_observed: tuple[int, ...]


def _check_records(confidence_logits, num_accepted, num_verified):
    logits = np.asarray(confidence_logits, np.float64)
    if logits.ndim != 2 or logits.shape[1] < 1:
        raise ValueError(f"confidence_logits must be f32[N, K], got shape {logits.shape}")
    n, k = logits.shape
    a = np.asarray(num_accepted)
    if a.shape != (n,):
        raise ValueError(f"num_accepted must be int[N] with N = {n}, got shape {a.shape}")
    v = np.full((n,), k, np.int64) if num_verified is None else np.asarray(num_verified)
    if v.shape != (n,):
        raise ValueError(f"num_verified must be int[N] with N = {n}, got shape {v.shape}")
    if n and (a.min() < 0 or np.any(a > v) or v.min() < 0 or v.max() > k):
        raise ValueError(f"need 0 <= num_accepted <= num_verified <= K = {k}; got num_accepted in "
                         f"[{a.min()}, {a.max()}], num_verified in [{v.min()}, {v.max()}]")
    if not np.all(np.isfinite(logits)):
        raise ValueError("confidence_logits holds non-finite values")
    return logits, a.astype(np.int64), v.astype(np.int64)


def fit_sts(confidence_logits, num_accepted, num_verified=None, *, grid=None,
            num_bins: int = DEFAULT_NUM_BINS) -> STSFit:
    """Fit per-position temperatures by sequential grid search (positions in order, docs/DRAFTER.md).

    Args:
      confidence_logits: ``f32[N, K]`` raw confidence logits from rollouts.
      num_accepted: ``int[N]`` accepted prefix length of each row.
      num_verified: ``int[N]`` drafts verified per row (default: all ``K``).
      grid: candidate temperatures (default :func:`default_temperature_grid`); ties go to the candidate
        closest to 1 (in log space), so a position with no information keeps ``T = 1``.
      num_bins: ECE bins.
    Returns:
      :class:`STSFit`; positions with no observed label get ``T = 1``.
    """
    logits, a, v = _check_records(confidence_logits, num_accepted, num_verified)
    n, k_total = logits.shape
    grid = default_temperature_grid() if grid is None else np.asarray(grid, np.float64).reshape(-1)
    if grid.size == 0 or np.any(~np.isfinite(grid)) or np.any(grid <= 0):
        raise ValueError("grid must hold finite temperatures > 0")
    closeness = np.abs(np.log(grid))
    labels, observed = acceptance_labels(a, v, k_total)

    def sig(x):
        return 1.0 / (1.0 + np.exp(-x))

    temps, before, after, counts = [], [], [], []
    cum = np.ones((n,), np.float64)
    cum_plain = np.ones((n,), np.float64)
    for k in range(k_total):
        obs = observed[:, k]
        tgt = labels[obs, k].astype(np.float64)
        cum_plain = cum_plain * sig(logits[:, k])
        counts.append(int(obs.sum()))
        if not obs.any():
            temps.append(1.0)
            before.append(float("nan"))
            after.append(float("nan"))
            cum = cum * sig(logits[:, k])
            continue
        cand = cum[None, obs] * sig(logits[None, obs, k] / grid[:, None])  # [G, N_obs]
        ece = _ece_rows(cand, tgt, num_bins)
        best = np.flatnonzero(ece <= ece.min() + 1e-12)
        j = best[np.argmin(closeness[best])]
        t = float(grid[j])
        temps.append(t)
        after.append(float(ece[j]))
        before.append(float(_ece_rows(cum_plain[None, obs], tgt, num_bins)[0]))
        cum = cum * sig(logits[:, k] / t)
    return STSFit(tuple(temps), tuple(before), tuple(after), tuple(counts))


class RolloutRecords:
    """Accumulates rollout records step by step (what an engine would collect) and fits STS on them."""

    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._logits: list[np.ndarray] = []
        self._accepted: list[np.ndarray] = []
        self._verified: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(x.shape[0] for x in self._accepted)

    def add(self, confidence_logits, num_accepted, num_verified=None, valid=None) -> None:
        """Append one step: ``confidence_logits [R, K]``, ``num_accepted [R]``, ``num_verified [R]``; rows with
        ``valid[r]`` false (padding rows, requests that drafted nothing) are skipped."""
        logits, a, v = _check_records(confidence_logits, num_accepted, num_verified)
        if logits.shape[1] != self.block_size:
            raise ValueError(f"confidence_logits must have K = {self.block_size} columns, got {logits.shape}")
        keep = np.ones((logits.shape[0],), bool) if valid is None else np.asarray(valid, bool).reshape(-1)
        if keep.shape != (logits.shape[0],):
            raise ValueError(f"valid must be bool[R] with R = {logits.shape[0]}, got shape {keep.shape}")
        self._logits.append(logits[keep])
        self._accepted.append(a[keep])
        self._verified.append(v[keep])

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = self.block_size
        if not self._logits:
            return np.zeros((0, k)), np.zeros((0,), np.int64), np.zeros((0,), np.int64)
        return np.concatenate(self._logits), np.concatenate(self._accepted), np.concatenate(self._verified)

    def fit(self, **kw) -> STSFit:
        return fit_sts(*self.arrays(), **kw)
