"""Host-side verification budget (docs/ADAPTIVE_VERIFICATION.md): drafts the next verify step checks in all.

The planner maximises expected emitted tokens per second of step time:

```
scores   = sort_desc(a_stale[r, j] for j < scheduled_drafts[r])        # survival of an EARLIER step
maxB     = min(sum(scheduled_drafts), max_total_logit_rows - R)         # verify-logits memory cap
value(b) = (num_sampling_rows + sum(scores[:b])) / (draft_cost[R] + verify_cost[T + b])
B        = argmax_{0 <= b <= maxB} value(b), the smallest b on ties
B        = maxB  unless  value(B) >= (1 + min_predicted_gain) * value(maxB)          # 1% by default
```

The verify cost is a staircase (compiled shape buckets), so ``value`` can fall at a bucket edge and rise again
later: the search is global over every ``b``, never a first-descent stop. The confidences come from an earlier
step, so the budget never depends on the drafts being verified (which keeps the allocation lossless, and lets
the host plan while the device drafts). A missing or flat cost table means "verify everything": ``B = maxB``.

The last line is TensorRT-LLM's guard (``compute_verify_token_budget`` in
``tensorrt_llm/_torch/speculative/dspark_planner.py``, ``minimum_predicted_gain``, one percent for profiled
tables): trimming must beat verifying everything by a margin, so that timing noise in the cost table and
calibration noise in the confidences resolve to the full budget instead of an unproven trim.

:func:`choose_budget` is plain numpy (the host engine); :func:`choose_budget_device` is its jnp twin for the
jitted offline loop, the same rule over the same inputs with the table held as arrays
(:class:`~spec_decode.cost_table.CostTableArrays`), in float32. Every tensor-parallel rank computes the same
integer from the same inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.allocator import survival
from spec_decode.cost_table import CostTable, CostTableArrays, lookup_device

__all__ = ["DEFAULT_MIN_PREDICTED_GAIN", "budget_values", "choose_budget", "choose_budget_device"]

_TIE_RTOL = 1e-9  # values this close (relative) to the best count as ties
DEFAULT_MIN_PREDICTED_GAIN = 0.01  # a trim must beat value(maxB) by 1%


def _validated(stale_confidences, scheduled_drafts) -> tuple[np.ndarray, np.ndarray]:
    conf = np.asarray(stale_confidences, np.float64)
    if conf.ndim != 2:
        raise ValueError(f"stale_confidences must be f32[R, K], got shape {conf.shape}")
    sched = np.asarray(scheduled_drafts)
    if sched.shape != (conf.shape[0],):
        raise ValueError(
            f"scheduled_drafts must be int[R] with R={conf.shape[0]} (from stale_confidences {conf.shape}), "
            f"got shape {sched.shape}"
        )
    if sched.size and not np.issubdtype(sched.dtype, np.integer):
        raise ValueError(f"scheduled_drafts must be integers, got dtype {sched.dtype}")
    sched = sched.astype(np.int64)
    if np.any(sched < 0) or np.any(sched > conf.shape[1]):
        raise ValueError(f"scheduled_drafts must lie in [0, K={conf.shape[1]}], got {sched.tolist()}")
    return conf, sched


def _sorted_scores(conf: np.ndarray, sched: np.ndarray) -> np.ndarray:
    conf = np.where(np.isnan(conf), 0.0, np.clip(conf, 0.0, 1.0))
    a = np.cumprod(conf, axis=1)
    valid = np.arange(conf.shape[1])[None, :] < sched[:, None]
    return -np.sort(-a[valid])


def budget_values(
    stale_confidences,
    scheduled_drafts,
    *,
    num_sampling_rows: int,
    num_non_draft_tokens: int,
    cost_table: CostTable,
    max_total_logit_rows: int,
) -> np.ndarray:
    """``float64[maxB + 1]``: ``value(b)`` for every candidate budget (see the module docstring)."""
    conf, sched = _validated(stale_confidences, scheduled_drafts)
    max_b = _max_budget(sched, max_total_logit_rows)
    scores = _sorted_scores(conf, sched)[:max_b]
    gain = num_sampling_rows + np.concatenate([[0.0], np.cumsum(scores)])  # [maxB + 1]
    r = conf.shape[0]
    draft = cost_table.draft_cost(r)
    cost = draft + cost_table.verify_costs(num_non_draft_tokens + np.arange(max_b + 1))
    return gain / np.maximum(cost, 1e-12)


def _max_budget(sched: np.ndarray, max_total_logit_rows: int) -> int:
    return max(0, min(int(sched.sum()), int(max_total_logit_rows) - sched.shape[0]))


def choose_budget(
    stale_confidences,
    scheduled_drafts,
    *,
    num_sampling_rows: int,
    num_non_draft_tokens: int,
    cost_table: CostTable | None,
    max_total_logit_rows: int,
    min_predicted_gain: float = DEFAULT_MIN_PREDICTED_GAIN,
) -> int:
    """The total number of drafts to verify in the next step.

    Args:
      stale_confidences: ``f32[R, K]`` per-position acceptance confidences from an earlier step (1.0 for
        requests with no history); survival is their cumulative product along ``K``.
      scheduled_drafts: ``int[R]`` in ``[0, K]``: drafts each request will produce.
      num_sampling_rows: rows that emit a token regardless of the drafts (one per running request).
      num_non_draft_tokens: ``T``, packed verify tokens that are not drafts (anchors, prefill chunks).
      cost_table: profiled :class:`CostTable`, or ``None``; a missing or flat table verifies everything.
      max_total_logit_rows: the verify-logits memory bound: at most this many rows of vocabulary logits, of
        which ``R`` are taken by the anchors.

      min_predicted_gain: the smallest relative gain in ``value`` for which a budget below ``maxB`` is chosen:
        the argmax ``b`` is returned only if ``value(b) >= (1 + min_predicted_gain) * value(maxB)``, otherwise
        ``maxB``. ``0`` gives the plain argmax.

    Returns:
      ``B`` in ``[0, maxB]``, ``maxB = min(sum(scheduled_drafts), max_total_logit_rows - R)``: the global argmax
      of the value curve, the smallest on ties (values within a relative ``1e-9`` of the best count as ties),
      or ``maxB`` when that argmax does not beat ``value(maxB)`` by ``min_predicted_gain``.
    """
    conf, sched = _validated(stale_confidences, scheduled_drafts)
    if num_sampling_rows < 0:
        raise ValueError(f"num_sampling_rows must be >= 0, got {num_sampling_rows}")
    if num_non_draft_tokens < 0:
        raise ValueError(f"num_non_draft_tokens must be >= 0, got {num_non_draft_tokens}")
    if max_total_logit_rows < 0:
        raise ValueError(f"max_total_logit_rows must be >= 0, got {max_total_logit_rows}")
    if not (np.isfinite(min_predicted_gain) and min_predicted_gain >= 0):
        raise ValueError(f"min_predicted_gain must be finite and >= 0, got {min_predicted_gain}")
    max_b = _max_budget(sched, max_total_logit_rows)
    if cost_table is None or cost_table.is_flat:
        return max_b
    values = budget_values(
        conf,
        sched,
        num_sampling_rows=num_sampling_rows,
        num_non_draft_tokens=num_non_draft_tokens,
        cost_table=cost_table,
        max_total_logit_rows=max_total_logit_rows,
    )
    # The smallest b within float rounding of the maximum: a draft of negligible survival never buys a larger B.
    best = values.max()
    b = int(np.flatnonzero(values >= best - _TIE_RTOL * abs(best))[0])
    # Trim only for a clear predicted gain over verifying everything.
    if min_predicted_gain > 0 and b < max_b and values[b] < (1.0 + min_predicted_gain) * values[max_b]:
        return max_b
    return b


# float32 ties: values within this relative distance of the best count as ties (the host's 1e-9 is below float32
# resolution; a gap this small is noise in any profiled table).
_TIE_RTOL_F32 = 1e-6


def choose_budget_device(
    stale_confidences: jax.Array,
    scheduled_drafts: jax.Array,
    *,
    num_rows: jax.Array,
    num_sampling_rows: jax.Array,
    num_non_draft_tokens: jax.Array,
    cost_table: CostTableArrays,
    max_total_logit_rows: jax.Array | int,
    min_predicted_gain: float = DEFAULT_MIN_PREDICTED_GAIN,
) -> jax.Array:
    """:func:`choose_budget` in jnp (traced, no host sync): ``int32[]`` drafts to verify in the next step.

    Same rule, same arguments, except that rows that take no part in the step (finished or padding rows of a
    fixed-shape batch) are passed with ``scheduled_drafts = 0`` and ``num_rows`` counts the rows that do (the
    host version reads it from the shape of its inputs), and the table comes as :class:`CostTableArrays`.
    ``min_predicted_gain`` is static. Values are float32; budgets equal the host's except where two candidate
    values lie within float32 noise of each other (:data:`_TIE_RTOL_F32`).
    """
    conf = jnp.asarray(stale_confidences, jnp.float32)
    sched = jnp.asarray(scheduled_drafts, jnp.int32)
    r, k = conf.shape
    max_b = jnp.maximum(0, jnp.minimum(jnp.sum(sched), jnp.asarray(max_total_logit_rows, jnp.int32) - num_rows))
    if k == 0 or r == 0:
        return jnp.zeros((), jnp.int32)
    a = survival(conf, sched).reshape(-1)  # -inf outside each row's scheduled drafts
    scores = -jnp.sort(-a)  # descending; the -inf entries last (and never reached: b <= max_b <= their count)
    scores = jnp.where(jnp.isneginf(scores), 0.0, scores)
    b = jnp.arange(r * k + 1, dtype=jnp.int32)
    gain = jnp.asarray(num_sampling_rows, jnp.float32) + jnp.concatenate(
        [jnp.zeros((1,), jnp.float32), jnp.cumsum(scores)])
    t = cost_table
    cost = (lookup_device(t.draft_buckets, t.draft_seconds, t.num_draft, num_rows)
            + lookup_device(t.verify_buckets, t.verify_seconds, t.num_verify, num_non_draft_tokens + b))
    values = jnp.where(b <= max_b, gain / jnp.maximum(cost, 1e-12), -jnp.inf)
    best = jnp.max(values)
    chosen = jnp.argmax(values >= best - _TIE_RTOL_F32 * jnp.abs(best)).astype(jnp.int32)  # first near-best
    if min_predicted_gain > 0:
        trim_pays = values[chosen] >= (1.0 + min_predicted_gain) * values[max_b]
        chosen = jnp.where((chosen < max_b) & ~trim_pays, max_b, chosen)
    return jnp.where(t.flat, max_b, chosen).astype(jnp.int32)
