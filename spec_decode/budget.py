"""Host-side verification plan (docs/ADAPTIVE_VERIFICATION.md): how many positions the next step drafts, and how
many drafts it verifies in all.

The planner maximises expected emitted tokens per second of step time. For one draft length (the engine's K):

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

**Draft length.** With a cost table that has draft lengths (:attr:`CostTable.draft_lengths`), the plan also
chooses ``K_d`` among them: row ``r`` may then verify ``min(scheduled_drafts[r], K_d)`` drafts, and the step pays
that length's step cost (``CostTable.step_costs``: ``draft_length_cost(K_d) + verify_cost(T)`` in the additive
form, the length's own timed steps in the per-length one):

```
value(d, b) = (num_sampling_rows + sum(scores_d[:b])) / (draft_cost[R] + step_cost[d, T + b])
(K_d, B)    = argmax over d and b <= maxB_d, the smallest d, then the smallest b, on ties
              unless it beats value(K, maxB_K) by min_predicted_gain: then (K, maxB_K)
```

``K_d = 0`` is a plan too: draft nothing, decode one token per row (the drafter's context still follows the
emitted tokens, a cost the verify side of the table carries). :func:`choose_plan` returns both;
:func:`choose_budget` is the one-length rule.

**Refreshing what a shorter length leaves stale.** A position the step does not draft keeps the confidence it
had, so a plan that drafts less than ``K`` reads the same numbers on the next step, and would choose the same
again for ever: ``K_d = 0`` is absorbing, even once the text has become easy. Once ``full_draft_after`` decode
steps in a row have drafted fewer than ``K`` positions, the next plan takes the longest length (with that
length's best budget; ``draft_full``), so every position's confidence is fresh again. ``full_draft_after``
starts at :data:`FULL_DRAFT_AFTER`, doubles after each forced refresh (up to :data:`FULL_DRAFT_AFTER_MAX`: where
a shorter plan stays right, refreshing costs less and less) and returns to the start whenever a plan drafts ``K``
by itself. The engines keep both counts in their state (``DecodeState.undrafted_steps`` and
``full_draft_after``, :func:`count_full_drafts`); the rule reads only those counts and the stale confidences, so
it stays lossless.

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

# float32 ties: values within 1e-6 (relative) of the best count as ties (the host's 1e-9 is below float32
# resolution; a gap this small is noise in any profiled table)
from pallas_kernels.plan_ranking import TIE_RTOL as _TIE_RTOL_F32
from pallas_kernels.plan_ranking import ranked_plan_curves
from spec_decode.allocator import survival
from spec_decode.cost_table import CostTable, CostTableArrays, lookup_device, step_costs_device

__all__ = ["DEFAULT_MIN_PREDICTED_GAIN", "FULL_DRAFT_AFTER", "FULL_DRAFT_AFTER_MAX", "PYTHON_SCALARS", "TIE_RTOL",
           "budget_values", "choose_budget", "choose_budget_device", "choose_plan", "choose_plan_device",
           "count_full_drafts", "full_draft_due", "prepare_plan_device", "select_plan"]

TIE_RTOL = 1e-9  # values this close (relative) to the best count as ties
DEFAULT_MIN_PREDICTED_GAIN = 0.01  # a trim must beat value(maxB) by 1%
# decode steps in a row that may draft fewer than K positions before a plan drafts K again (module docstring),
# doubled after each forced refresh up to the maximum: a stale plan ends within 8 steps, and where a shorter plan
# stays right the refreshes cost 1 step in 9, 17, 33, ... and then in 257
FULL_DRAFT_AFTER = 8
FULL_DRAFT_AFTER_MAX = 256


def full_draft_due(undrafted_steps, full_draft_after):
    """Whether the next plan drafts every position (``draft_full``): enough steps in a row drafted fewer."""
    return undrafted_steps >= full_draft_after


class PYTHON_SCALARS:  # noqa: N801  (an ``xp`` namespace, like ``jnp``)
    """``xp`` for :func:`count_full_drafts` on Python ints and bools: the host's mirror runs it on every step it
    plans, where numpy's ``where`` on scalars would cost it microseconds."""

    where = staticmethod(lambda cond, a, b: a if cond else b)
    minimum = staticmethod(min)


def count_full_drafts(undrafted_steps, full_draft_after, *, decoded, full: bool, xp=jnp):
    """``(undrafted_steps, full_draft_after)`` after a step (module docstring): ``decoded``, whether its plan had
    decode rows (a step without any changes nothing); ``full``, whether it drafted all ``K`` positions. A step
    that drafted ``K`` while :func:`full_draft_due` was a forced refresh and doubles ``full_draft_after``; one that
    drafted ``K`` otherwise returns it to :data:`FULL_DRAFT_AFTER`. ``xp``: ``jnp`` (the step program, int32
    scalars) or :class:`PYTHON_SCALARS` (the host's mirror, :class:`spec_decode.scheduler.Scheduler`)."""
    if not full:
        return undrafted_steps + xp.where(decoded, 1, 0), full_draft_after
    after = xp.where(full_draft_due(undrafted_steps, full_draft_after),
                     xp.minimum(2 * full_draft_after, FULL_DRAFT_AFTER_MAX), FULL_DRAFT_AFTER)
    return xp.where(decoded, 0, undrafted_steps), xp.where(decoded, after, full_draft_after)


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
    draft_len: int | None = None,
    token_buckets=None,
) -> np.ndarray:
    """``float64[maxB + 1]``: ``value(b)`` for every candidate budget (see the module docstring); with
    ``draft_len``, ``value(draft_len, b)``: rows verify at most ``draft_len`` drafts and the step pays its cost.
    ``token_buckets``: the packed-token sizes compiled for this length: a step pays the smallest one holding it,
    and one larger than all of them is infeasible (value ``-inf``)."""
    conf, sched = _validated(stale_confidences, scheduled_drafts)
    if draft_len is not None:
        sched = np.minimum(sched, int(draft_len))
    max_b = _max_budget(sched, max_total_logit_rows)
    scores = _sorted_scores(conf, sched)[:max_b]
    gain = num_sampling_rows + np.concatenate([[0.0], np.cumsum(scores)])  # [maxB + 1]
    r = conf.shape[0]
    draft = cost_table.draft_cost(r)
    tokens = num_non_draft_tokens + np.arange(max_b + 1)
    feasible = np.ones(tokens.shape, bool)
    if token_buckets is not None and len(token_buckets):
        tb = np.asarray(sorted(token_buckets), np.int64)
        idx = np.searchsorted(tb, tokens, side="left")
        feasible = idx < len(tb)
        tokens = np.where(feasible, tb[np.minimum(idx, len(tb) - 1)], tokens)
    cost = draft + cost_table.step_costs(tokens, None if draft_len is None else int(draft_len))
    return np.where(feasible, gain / np.maximum(cost, 1e-12), -np.inf)


def _check_scalars(num_sampling_rows, num_non_draft_tokens, max_total_logit_rows, min_predicted_gain) -> None:
    if num_sampling_rows < 0:
        raise ValueError(f"num_sampling_rows must be >= 0, got {num_sampling_rows}")
    if num_non_draft_tokens < 0:
        raise ValueError(f"num_non_draft_tokens must be >= 0, got {num_non_draft_tokens}")
    if max_total_logit_rows < 0:
        raise ValueError(f"max_total_logit_rows must be >= 0, got {max_total_logit_rows}")
    if not (np.isfinite(min_predicted_gain) and min_predicted_gain >= 0):
        raise ValueError(f"min_predicted_gain must be finite and >= 0, got {min_predicted_gain}")


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
    token_buckets=None,
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
      token_buckets: the packed-token sizes the step can run at (None: any size): a step pays the smallest one
        holding it, and a budget no size holds is not a candidate.

    Returns:
      ``B`` in ``[0, maxB]``, ``maxB = min(sum(scheduled_drafts), max_total_logit_rows - R)``: the global argmax
      of the value curve, the smallest on ties (values within a relative ``1e-9`` of the best count as ties),
      or ``maxB`` when that argmax does not beat ``value(maxB)`` by ``min_predicted_gain``.
    """
    conf, sched = _validated(stale_confidences, scheduled_drafts)
    _check_scalars(num_sampling_rows, num_non_draft_tokens, max_total_logit_rows, min_predicted_gain)
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
        token_buckets=token_buckets,
    )
    # The smallest b within float rounding of the maximum: a draft of negligible survival never buys a larger B.
    best = values.max()
    b = int(np.flatnonzero(values >= best - TIE_RTOL * abs(best))[0])
    # Trim only for a clear predicted gain over verifying everything.
    if min_predicted_gain > 0 and b < max_b and values[b] < (1.0 + min_predicted_gain) * values[max_b]:
        return max_b
    return b


def choose_plan(
    stale_confidences,
    scheduled_drafts,
    *,
    num_sampling_rows: int,
    num_non_draft_tokens: int,
    cost_table: CostTable | None,
    max_total_logit_rows: int,
    draft_lengths: tuple[int, ...] | None = None,
    token_buckets=None,
    min_predicted_gain: float = DEFAULT_MIN_PREDICTED_GAIN,
    draft_full: bool = False,
) -> tuple[int, int]:
    """``(B, K_d)``: the drafts the next step verifies in total, and the positions it drafts per row.

    Same arguments as :func:`choose_budget`, plus ``draft_lengths``: the ``K_d`` the engine compiled (the
    table's :attr:`~CostTable.draft_lengths` by default), searched together with ``B`` (module docstring), and
    ``token_buckets``: ``{K_d: packed-token sizes compiled for it}`` (None: any size); a length whose sizes
    cannot hold the step is not a candidate. The full plan, ``K = max(draft_lengths)`` with ``maxB``, is kept
    unless another beats it by ``min_predicted_gain``. ``draft_full``: the longest length only, with its best
    budget (a refresh of the stale positions, module docstring). Without draft lengths (or a flat table) this is
    ``(choose_budget(...), K)``, ``K`` the confidences' width.
    """
    conf, sched = _validated(stale_confidences, scheduled_drafts)
    k = conf.shape[1]
    if draft_lengths is None:
        draft_lengths = cost_table.draft_lengths if cost_table is not None else ()
    lengths = sorted({int(d) for d in draft_lengths if 0 <= int(d) <= k})
    kw = dict(num_sampling_rows=num_sampling_rows, num_non_draft_tokens=num_non_draft_tokens,
              cost_table=cost_table, max_total_logit_rows=max_total_logit_rows)
    full_len = lengths[-1] if lengths else k
    if len(lengths) < 2 or cost_table is None or cost_table.is_flat or not cost_table.draft_lengths:  # (a
        # per-length table lists its lengths as draft_lengths)
        sched_full = np.minimum(sched, full_len)
        return choose_budget(conf, sched_full, min_predicted_gain=min_predicted_gain,
                             token_buckets=(token_buckets or {}).get(full_len), **kw), full_len
    _check_scalars(num_sampling_rows, num_non_draft_tokens, max_total_logit_rows, min_predicted_gain)
    curves = [(d, budget_values(conf, sched, draft_len=d, token_buckets=(token_buckets or {}).get(d), **kw))
              for d in lengths]
    return select_plan(curves, min_predicted_gain=min_predicted_gain, draft_full=draft_full)


def select_plan(curves, *, min_predicted_gain: float, draft_full: bool = False) -> tuple[int, int]:
    """``(B, K_d)`` from the value curves ``[(K_d, value(K_d, b) for b = 0..maxB)]`` of every candidate length,
    ascending, the last the full plan: the global best (the shorter length, then the smaller ``b``, on ties
    within a relative ``1e-9``), unless it does not beat the full plan by ``min_predicted_gain``.
    ``draft_full``: the last length's curve alone."""
    if draft_full:
        curves = curves[-1:]
    best = None  # (value, d, b)
    for d, values in curves:
        top = values.max()
        b = int(np.flatnonzero(values >= top - TIE_RTOL * abs(top))[0])
        if best is None or top > best[0] * (1 + TIE_RTOL) or not np.isfinite(best[0]):
            best = (top, d, b)
    full_d, full_values = curves[-1]
    full = (full_values[-1], full_d, len(full_values) - 1)
    value, d, b = best
    if min_predicted_gain > 0 and (d, b) != full[1:] and value < (1.0 + min_predicted_gain) * full[0]:
        return full[2], full[1]
    return b, d


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
    sched = jnp.asarray(scheduled_drafts, jnp.int32)
    curves = _curves_device(_sorted_survival_device(stale_confidences, sched), sched, (None,), num_rows=num_rows,
                            num_sampling_rows=num_sampling_rows, num_non_draft_tokens=num_non_draft_tokens,
                            cost_table=cost_table, max_total_logit_rows=max_total_logit_rows)
    return _guarded(curves, cost_table, min_predicted_gain)[0]


def _sorted_survival_device(stale_confidences, scheduled_drafts):
    """Every scheduled draft's survival, best first, with its position: ``(scores f32[N], pos int32[N], finite
    bool[N])``, ``N = R * K``, unscheduled entries last (score 0, ``finite`` False). One sort serves every draft
    length: a length ``d`` keeps the entries at ``pos < d`` in the same order (survival falls along a row)."""
    a = survival(stale_confidences, scheduled_drafts)
    r, k = a.shape
    pos = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (r, k)).reshape(-1)
    neg, pos = jax.lax.sort((-a.reshape(-1), pos), num_keys=1)
    finite = ~jnp.isposinf(neg)
    return jnp.where(finite, -neg, 0.0), pos, finite


def _size_index(sizes: jax.Array, tokens: jax.Array) -> jax.Array:
    """Per column ``l`` of ``tokens [..., L]``: how many of row ``l``'s ``sizes [L, W]`` (ascending, padded with
    int32 max) lie below it, i.e. the index of the smallest size holding it (``W`` or the row's count: none)."""
    return jnp.sum((sizes < tokens[..., None]).astype(jnp.int32), axis=-1)


def _curves_device(ranked, sched, draft_lens: tuple, *, num_rows, num_sampling_rows, num_non_draft_tokens,
                   cost_table: CostTableArrays, max_total_logit_rows, token_buckets=None):
    """The one-length rule's value curves at the static ``draft_lens`` (an entry None: every ranked draft, priced
    at the table's longest length or its verify costs alone), all in one ``[N, L]`` pass over the ranked
    survival of :func:`_sorted_survival_device`: ``(b, value(b), value(maxB), maxB)``, each ``[L]``, with ``b`` the
    smallest near-best budget of each length (no minimum gain applied). ``token_buckets``: per length, the static
    sizes compiled for it (None or empty: any size), as in :func:`budget_values`.

    A candidate ``b`` of length ``d`` is the count of its entries among the first ``j + 1`` ranked ones, at each
    ``j`` holding one of them (and ``b = 0``): the same prefix sums as sorting the length's entries alone. One pass
    for every length keeps the device loop's body to a few kernels, where a pass per length took several each."""
    scores, pos, finite = ranked
    t = cost_table
    n_len = len(draft_lens)
    cols = jnp.arange(n_len)
    limit = jnp.asarray([np.iinfo(np.int32).max if d is None else int(d) for d in draft_lens], jnp.int32)
    mine = finite[:, None] & (pos[:, None] < limit[None, :])  # [N, L]
    clipped = jnp.minimum(jnp.asarray(sched, jnp.int32)[:, None], limit[None, :])
    max_b = jnp.maximum(0, jnp.minimum(jnp.sum(clipped, axis=0),
                                       jnp.asarray(max_total_logit_rows, jnp.int32) - num_rows))
    draft = lookup_device(t.draft_buckets, t.draft_seconds, t.num_draft, num_rows)
    per_length = tuple(token_buckets) if token_buckets is not None else (None,) * n_len
    sizes = [sorted(b) if b else [] for b in per_length]
    width = max([len(b) for b in sizes] + [1])
    tb = jnp.asarray([b + [np.iinfo(np.int32).max] * (width - len(b)) for b in sizes], jnp.int32)  # [L, W]
    nb = jnp.asarray([len(b) for b in sizes], jnp.int32)

    def value(b, g):  # [..., L]
        tokens, ok = num_non_draft_tokens + b, jnp.ones(jnp.shape(b), bool)
        if any(sizes):  # the length's smallest size holding the step; none holds it: infeasible
            idx = _size_index(tb, tokens)
            fits = idx < nb
            paid = jnp.where(fits, tb[cols, jnp.minimum(idx, jnp.maximum(nb - 1, 0))], tokens)
            ok = jnp.where(nb > 0, fits, True)
            tokens = jnp.where(nb > 0, paid, tokens)
        cost = draft + step_costs_device(t, draft_lens, tokens)
        return jnp.where(ok & (b <= max_b), g / jnp.maximum(cost, 1e-12), -jnp.inf)

    s = jnp.asarray(num_sampling_rows, jnp.float32)
    v0 = value(jnp.zeros((n_len,), jnp.int32), jnp.full((n_len,), s))
    if scores.shape[0] == 0:  # no drafts at all (K = 0 or no rows)
        return jnp.zeros((n_len,), jnp.int32), v0, v0, max_b
    count = jnp.cumsum(mine.astype(jnp.int32), axis=0)
    gain = s + jnp.cumsum(jnp.where(mine, scores[:, None], 0.0), axis=0)
    vals = jnp.where(mine, value(count, gain), -jnp.inf)
    best = jnp.maximum(v0, jnp.max(vals, axis=0))
    near = best - _TIE_RTOL_F32 * jnp.abs(best)
    j = jnp.argmax(vals >= near[None, :], axis=0)
    at_zero = v0 >= near
    b = jnp.where(at_zero, 0, count[j, cols]).astype(jnp.int32)
    v_b = jnp.where(at_zero, v0, vals[j, cols])
    full = jnp.argmax(mine & (count == max_b[None, :]), axis=0)
    v_full = jnp.where(max_b == 0, v0, vals[full, cols])
    return b, v_b, v_full, max_b


def _curves_ranked(stale_confidences, sched, draft_lens: tuple, token_buckets: tuple, *, num_rows,
                   num_sampling_rows, num_non_draft_tokens, cost_table: CostTableArrays, max_total_logit_rows,
                   priced_as: tuple | None = None, prepared=None, implementation: str = "auto"):
    """:func:`_curves_device` for lengths whose packed-token sizes are all compiled (``token_buckets``, one
    non-empty tuple per length), without a sort or a scan: the same ``(b, value(b), value(maxB), maxB)``.

    A step pays its bucket's cost, so within a bucket the value only grows with ``b`` (survival is never
    negative): each bucket's best budget is its upper edge (the largest ``b`` it holds, at most ``maxB``), and the
    best of the curve is the best of ``0``, the edges and ``maxB``. Those need the summed survival of the top
    ``b`` drafts at a dozen ``b``, which one pass over the pairs of drafts gives: each draft's rank among its
    length's drafts and the summed survival of those ranked at or before it
    (:mod:`pallas_kernels.plan_ranking`: two Pallas kernels on a GPU, the same pass in jnp elsewhere). The smallest
    near-best ``b`` is then the smallest rank whose summed survival reaches the best value, within its bucket.

    The device loop plans every iteration, and on a GPU each fusion of the plan is about one kernel launch: the
    jnp pass measured 20 kernels and 62 us per iteration at 512 rows (docs/ADAPTIVE_VERIFICATION.md, "The
    planner's cost in the device loop"), hence the kernels. ``priced_as``: the lengths the table prices each
    column at (None entries: the table's longest length, or its verify costs alone), ``draft_lens`` by default.
    ``prepared``: :func:`prepare_plan_device` of the same table and sizes (the device loop computes it once,
    outside its loop), else the table is looked up here. ``implementation``: as
    :func:`pallas_kernels.plan_ranking.ranked_plan_curves`."""
    priced = draft_lens if priced_as is None else priced_as
    sizes = tuple(tuple(sorted(int(t) for t in b)) for b in token_buckets)
    if prepared is None:
        rows = jnp.arange(stale_confidences.shape[0] + 1, dtype=jnp.int32)
        prepared = (_step_costs_at_sizes(cost_table, priced, sizes),
                    lookup_device(cost_table.draft_buckets, cost_table.draft_seconds, cost_table.num_draft, rows))
    step_at, draft_by_rows = prepared  # [L, W] seconds at each compiled size; [R + 1] draft seconds per rows
    counts = jnp.stack([jnp.asarray(x, jnp.int32) for x in (num_rows, num_sampling_rows, num_non_draft_tokens,
                                                             max_total_logit_rows)])
    return ranked_plan_curves(survival(stale_confidences, sched), counts, draft_by_rows, step_at,
                              column_lengths=tuple(int(d) for d in draft_lens), column_sizes=sizes,
                              implementation=implementation)


def _step_costs_at_sizes(cost_table: CostTableArrays, priced: tuple, sizes) -> jax.Array:
    """``f32[L, W]``: each column's step cost at each of its compiled sizes (padding: the last size's)."""
    width = max(len(b) for b in sizes)
    tokens = jnp.asarray([list(b) + [b[-1]] * (width - len(b)) for b in sizes], jnp.int32).T  # [W, L]
    return step_costs_device(cost_table, tuple(priced), tokens).T


def _plan_columns(lengths: tuple[int, ...], per_length: tuple) -> tuple[tuple, tuple, tuple]:
    """The columns :func:`choose_plan_device` plans over: ``(draft lengths, sizes, priced as)``. One length: that
    length, priced as the one-length rule prices it (the table's longest length, or its verify costs alone).
    Several: every length, each priced at itself. The table-less fallback (the one-length rule at the longest
    length, for a table without draft lengths, or a flat one) is the longest length's column: the same drafts,
    sizes and prices."""
    if len(lengths) == 1:
        return lengths, per_length, (None,)
    return lengths, per_length, lengths


def prepare_plan_device(cost_table: CostTableArrays, *, draft_lengths: tuple[int, ...],
                        token_buckets: tuple[tuple[int, ...], ...], max_rows: int):
    """What :func:`choose_plan_device` reads from the table, as two small arrays: the step cost of every
    (draft length, compiled size) and the draft cost of every row count up to ``max_rows``. They depend on the
    table alone, so the device loop computes them once before its first iteration instead of looking them up
    in every one (each lookup is a few kernels of its own). Pass the result as ``prepared=`` with the same
    ``draft_lengths`` and ``token_buckets`` (each length's sizes non-empty)."""
    lengths = tuple(int(d) for d in draft_lengths)
    per_length = tuple(tuple(sorted(int(t) for t in b)) for b in token_buckets)
    if len(per_length) != len(lengths) or not all(per_length):
        raise ValueError(f"token_buckets must give non-empty sizes for each of {lengths}, got {token_buckets}")
    _, sizes, priced = _plan_columns(lengths, per_length)
    rows = jnp.arange(int(max_rows) + 1, dtype=jnp.int32)
    draft = lookup_device(cost_table.draft_buckets, cost_table.draft_seconds, cost_table.num_draft, rows)
    return _step_costs_at_sizes(cost_table, priced, sizes), draft


def _ranked_fits(num_drafts: int) -> bool:
    """Whether the sort-free pass suits this many drafts here: always on an accelerator (where kernel count is
    what costs), on a CPU only for small batches (there its ``O(N^2)`` pass took 1.5 ms at 448 drafts against
    0.25 ms for the sort, and 0.3 s at 3,584)."""
    return jax.default_backend() != "cpu" or num_drafts <= 128


def _guarded(curves, cost_table: CostTableArrays, min_predicted_gain: float) -> jax.Array:
    """The one-length budgets of ``curves`` (:func:`_curves_device`): ``maxB`` unless the best trim beats it by
    ``min_predicted_gain`` (static), and ``maxB`` for a flat table."""
    b, v_b, v_full, max_b = curves
    if min_predicted_gain > 0:
        trim_pays = v_b >= (1.0 + min_predicted_gain) * v_full
        b = jnp.where((b < max_b) & ~trim_pays, max_b, b)
    return jnp.where(cost_table.flat, max_b, b).astype(jnp.int32)


def choose_plan_device(
    stale_confidences: jax.Array,
    scheduled_drafts: jax.Array,
    *,
    num_rows: jax.Array,
    num_sampling_rows: jax.Array,
    num_non_draft_tokens: jax.Array,
    cost_table: CostTableArrays,
    max_total_logit_rows: jax.Array | int,
    draft_lengths: tuple[int, ...],
    token_buckets: tuple[tuple[int, ...], ...] | None = None,
    min_predicted_gain: float = DEFAULT_MIN_PREDICTED_GAIN,
    prepared=None,
    implementation: str = "auto",
    draft_full: jax.Array | bool = False,
) -> tuple[jax.Array, jax.Array]:
    """:func:`choose_plan` in jnp: ``(B int32[], i int32[])`` with ``draft_lengths[i]`` the chosen ``K_d``.

    ``draft_lengths`` (ascending) and ``token_buckets`` (per length, the packed-token sizes the loop compiled
    for it) are static; arguments as :func:`choose_budget_device`. A table without draft lengths, or a flat one,
    gives the last length and the one-length budget. With every length's sizes given, the plan takes the sort-free
    pass over bucket edges (:func:`_curves_ranked`; the same plan up to float32 near-ties), reading the table
    through ``prepared`` (:func:`prepare_plan_device`) when given, in Pallas kernels on a GPU
    (``implementation``: ``"auto"``, ``"pallas"`` or ``"reference"``, as
    :func:`pallas_kernels.plan_ranking.ranked_plan_curves`)."""
    lengths = tuple(int(d) for d in draft_lengths)
    if list(lengths) != sorted(set(lengths)):
        raise ValueError(f"draft_lengths must be distinct and ascending, got {draft_lengths}")
    per_length = tuple(token_buckets) if token_buckets is not None else (None,) * len(lengths)
    if len(per_length) != len(lengths):
        raise ValueError(f"token_buckets must give one tuple of sizes per draft length, got {token_buckets}")
    sched = jnp.asarray(scheduled_drafts, jnp.int32)
    kw = dict(num_rows=num_rows, num_sampling_rows=num_sampling_rows, num_non_draft_tokens=num_non_draft_tokens,
              cost_table=cost_table, max_total_logit_rows=max_total_logit_rows)
    # every length's sizes known: the sort-free pass (_curves_ranked)
    compiled = all(per_length) and _ranked_fits(int(np.prod(jnp.shape(stale_confidences))))
    last = len(lengths) - 1
    columns, sizes, priced = _plan_columns(lengths, per_length)
    if len(lengths) == 1:
        clipped = jnp.minimum(sched, lengths[0])
        if compiled:
            curves = _curves_ranked(stale_confidences, clipped, columns, sizes, priced_as=priced, prepared=prepared,
                                    implementation=implementation, **kw)
        else:
            curves = _curves_device(_sorted_survival_device(stale_confidences, clipped), clipped, priced, **kw)
        return _guarded(curves, cost_table, min_predicted_gain)[0], jnp.asarray(last, jnp.int32)
    # every length in one pass (the longest length's column is also the table-less fallback: _plan_columns)
    if compiled:
        b, value, value_full, max_b = _curves_ranked(stale_confidences, sched, columns, sizes, priced_as=priced,
                                                     prepared=prepared, implementation=implementation, **kw)
    else:
        b, value, value_full, max_b = _curves_device(_sorted_survival_device(stale_confidences, sched), sched,
                                                     columns, token_buckets=sizes, **kw)
    best_value, best_b, best_i = value[0], b[0], jnp.asarray(0, jnp.int32)
    for i in range(1, len(lengths)):
        better = value[i] > best_value * (1 + _TIE_RTOL_F32)  # ties keep the shorter length
        best_value = jnp.where(better, value[i], best_value)
        best_b = jnp.where(better, b[i], best_b)
        best_i = jnp.where(better, i, best_i)
    full_only = jnp.asarray(draft_full, bool)  # the longest length's curve alone (select_plan)
    best_value = jnp.where(full_only, value[last], best_value)
    best_b = jnp.where(full_only, b[last], best_b)
    best_i = jnp.where(full_only, last, best_i)
    full_value, full_b = value_full[last], max_b[last]
    if min_predicted_gain > 0:
        keep_full = ((best_i != last) | (best_b != full_b)) & (best_value < (1.0 + min_predicted_gain) * full_value)
        best_b = jnp.where(keep_full, full_b, best_b)
        best_i = jnp.where(keep_full, last, best_i)
    one = _guarded((b[-1:], value[-1:], value_full[-1:], max_b[-1:]), cost_table, min_predicted_gain)[0]
    no_lengths = cost_table.flat | ((cost_table.num_draft_lengths == 0) & (cost_table.num_lengths == 0))
    return (jnp.where(no_lengths, one, best_b).astype(jnp.int32),
            jnp.where(no_lengths, last, best_i).astype(jnp.int32))
