"""Adaptive draft allocation on the device (docs/ADAPTIVE_VERIFICATION.md): caps[r] drafts of row r verified.

Survival ``a[r, j] = prod_{i <= j} c[r, i]`` is the model's probability that the first ``j + 1`` drafts of request
``r`` are all accepted, i.e. the expected gain of verifying draft ``j``. The step verifies the ``B`` entries of
largest survival over the whole batch. Survival never increases along ``j``; with ties broken by the lower
position first, the winners of every row form a prefix, so a per-row count describes them completely.

**A closed batch** (no request waits for a slot, as in an offline batch or a device-loop wave) ends with its
slowest request, so the tokens of rows that are ahead buy nothing until it does. There a ``priority`` per row
(the tokens the row may still emit, in whole steps) orders the drafts first: the budget goes to the rows with the
most left, and by survival among rows of equal priority. Ranking by survival alone would give it to the same
confident rows on every step and leave the rest decoding one token a step, which sets the batch's length
(docs/ADAPTIVE_VERIFICATION.md, "Closed batches"). Within a row the priority is the same, so the winners still
form a prefix.

Everything here is static-shape XLA: the budget ``B`` is a traced scalar, nothing syncs with the host, and the
result is a pure function of its inputs (so every tensor-parallel rank computes the same caps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["allocate_drafts", "survival"]


def survival(confidences: jax.Array, scheduled_drafts: jax.Array) -> jax.Array:
    """``f32[R, K]`` survival ``cumprod(c)`` with entries at ``j >= scheduled_drafts[r]`` set to ``-inf``.

    Confidences are clipped to ``[0, 1]`` and NaN counts as 0, so survival is non-increasing along each row
    (floating-point multiplication by a factor in ``[0, 1]`` never increases a value).
    """
    conf = jnp.asarray(confidences, jnp.float32)
    conf = jnp.where(jnp.isnan(conf), 0.0, jnp.clip(conf, 0.0, 1.0))
    k = conf.shape[1]
    if k == 0:
        return conf
    sched = jnp.clip(jnp.asarray(scheduled_drafts, jnp.int32), 0, k)
    # Sequential products (K is small): the same rounding as numpy's cumprod, and monotone by construction,
    # which a tree-shaped parallel scan would not guarantee to the last ulp.
    cols = [conf[:, 0]]
    for j in range(1, k):
        cols.append(cols[-1] * conf[:, j])
    a = jnp.stack(cols, axis=1)
    valid = jnp.arange(k, dtype=jnp.int32)[None, :] < sched[:, None]
    return jnp.where(valid, a, -jnp.inf)


@jax.jit
def _allocate(confidences: jax.Array, scheduled_drafts: jax.Array, budget: jax.Array,
              priority: jax.Array) -> jax.Array:
    r, k = confidences.shape
    a = survival(confidences, scheduled_drafts)  # [R, K]
    # Flatten position-major so that the flat index orders ties by (position asc, request asc).
    flat = a.T.reshape(-1)  # [K * R], index = j * R + r
    invalid = jnp.isneginf(flat)
    # entries that are not drafts sort last whatever their row's priority: they must take no rank
    prio_key = jnp.where(invalid, jnp.iinfo(jnp.int32).max, -jnp.tile(priority, k))
    order_key = jnp.where(invalid, jnp.inf, -flat)  # ascending key = survival descending
    flat_index = jnp.arange(k * r, dtype=jnp.int32)
    # A total order: (priority desc, survival desc, position asc, request asc). Sorting every key makes it exact.
    _, _, perm = jax.lax.sort((prio_key, order_key, flat_index), num_keys=3)  # perm[rank] = flat index
    rank = jnp.zeros((k * r,), jnp.int32).at[perm].set(flat_index)  # inverse permutation
    b = jnp.maximum(jnp.asarray(budget, jnp.int32), 0)
    win = (rank < b) & ~invalid  # [K * R]
    return jnp.sum(win.reshape(k, r), axis=0, dtype=jnp.int32)


def allocate_drafts(confidences: jax.Array, scheduled_drafts: jax.Array, budget: jax.Array,
                    priority: jax.Array | None = None) -> jax.Array:
    """How many drafts of each request to verify: the per-row count of the global top-``budget`` survivals, rows of
    higher ``priority`` first.

    Args:
      confidences: ``f32[R, K]``; ``c[r, k]`` = probability that draft ``k`` is accepted given drafts ``< k``
        were. Requests with no history should pass 1.0. Padding rows may hold anything with
        ``scheduled_drafts = 0``.
      scheduled_drafts: ``int32[R]`` in ``[0, K]``: drafts produced for each request (values are clipped).
      budget: ``int32[]`` total number of drafts to verify (may be traced; negative counts as 0).
      priority: ``int32[R]`` or None (every row equal): the drafts of a row of higher priority win before any
        draft of a row of lower priority. A closed batch passes the tokens each row may still emit, in whole steps.

    Returns:
      ``int32[R]`` caps with ``0 <= caps <= scheduled_drafts`` and ``sum(caps) == min(budget,
      sum(scheduled_drafts))``. Among rows of equal priority, ties in survival go to the lower position first, then
      the lower request.

    Runs as one sort of ``R * K`` entries in XLA (``O(RK log RK)``), jit-able, no host synchronisation.
    """
    confidences = jnp.asarray(confidences)
    scheduled_drafts = jnp.asarray(scheduled_drafts)
    budget = jnp.asarray(budget)
    if confidences.ndim != 2:
        raise ValueError(f"confidences must be f32[R, K], got shape {confidences.shape}")
    r, k = confidences.shape
    if scheduled_drafts.shape != (r,):
        raise ValueError(
            f"scheduled_drafts must be int32[R] with R={r} (from confidences {confidences.shape}), "
            f"got shape {scheduled_drafts.shape}"
        )
    if budget.ndim != 0:
        raise ValueError(f"budget must be a scalar int32[], got shape {budget.shape}")
    if priority is None:
        priority = jnp.zeros((r,), jnp.int32)
    priority = jnp.asarray(priority)
    if priority.shape != (r,) or not jnp.issubdtype(priority.dtype, jnp.integer):
        raise ValueError(f"priority must be int32[R] with R={r}, got {priority.dtype} of shape {priority.shape}")
    if not jnp.issubdtype(scheduled_drafts.dtype, jnp.integer):
        raise ValueError(f"scheduled_drafts must be an integer array, got dtype {scheduled_drafts.dtype}")
    if r == 0 or k == 0:
        return jnp.zeros((r,), jnp.int32)
    return _allocate(confidences.astype(jnp.float32), scheduled_drafts.astype(jnp.int32), budget,
                     priority.astype(jnp.int32))
