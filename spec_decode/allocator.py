"""Adaptive draft allocation on the device (docs/ADAPTIVE_VERIFICATION.md): caps[r] drafts of row r verified.

Survival ``a[r, j] = prod_{i <= j} c[r, i]`` is the model's probability that the first ``j + 1`` drafts of request
``r`` are all accepted, i.e. the expected gain of verifying draft ``j``. The step verifies the ``B`` entries of
largest survival over the whole batch. Survival never increases along ``j``; with ties broken by the lower
position first, the winners of every row form a prefix, so a per-row count describes them completely.

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
def _allocate(confidences: jax.Array, scheduled_drafts: jax.Array, budget: jax.Array) -> jax.Array:
    r, k = confidences.shape
    a = survival(confidences, scheduled_drafts)  # [R, K]
    # Flatten position-major so that the flat index orders ties by (position asc, request asc).
    flat = a.T.reshape(-1)  # [K * R], index = j * R + r
    order_key = jnp.where(jnp.isneginf(flat), jnp.inf, -flat)  # ascending key = survival descending
    flat_index = jnp.arange(k * r, dtype=jnp.int32)
    # A total order: (survival desc, position asc, request asc). Sorting both keys makes it exact.
    _, perm = jax.lax.sort((order_key, flat_index), num_keys=2)  # perm[rank] = flat index
    rank = jnp.zeros((k * r,), jnp.int32).at[perm].set(flat_index)  # inverse permutation
    b = jnp.maximum(jnp.asarray(budget, jnp.int32), 0)
    win = (rank < b) & ~jnp.isneginf(flat)  # [K * R]
    return jnp.sum(win.reshape(k, r), axis=0, dtype=jnp.int32)


def allocate_drafts(confidences: jax.Array, scheduled_drafts: jax.Array, budget: jax.Array) -> jax.Array:
    """How many drafts of each request to verify: the per-row count of the global top-``budget`` survivals.

    Args:
      confidences: ``f32[R, K]``; ``c[r, k]`` = probability that draft ``k`` is accepted given drafts ``< k``
        were. Requests with no history should pass 1.0. Padding rows may hold anything with
        ``scheduled_drafts = 0``.
      scheduled_drafts: ``int32[R]`` in ``[0, K]``: drafts produced for each request (values are clipped).
      budget: ``int32[]`` total number of drafts to verify (may be traced; negative counts as 0).

    Returns:
      ``int32[R]`` caps with ``0 <= caps <= scheduled_drafts`` and ``sum(caps) == min(budget,
      sum(scheduled_drafts))``. Ties in survival go to the lower position first, then the lower request.

    Runs as one sort of ``R * K`` keys in XLA (``O(RK log RK)``), jit-able, no host synchronisation.
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
    if not jnp.issubdtype(scheduled_drafts.dtype, jnp.integer):
        raise ValueError(f"scheduled_drafts must be an integer array, got dtype {scheduled_drafts.dtype}")
    if r == 0 or k == 0:
        return jnp.zeros((r,), jnp.int32)
    return _allocate(confidences.astype(jnp.float32), scheduled_drafts.astype(jnp.int32), budget)
