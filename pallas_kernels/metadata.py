"""Ragged verify-batch metadata, computed on the device.

The contract (docs/ARCHITECTURE.md):

* ``query_start_loc: int32[R + 1]`` is non-decreasing; request row ``r`` owns packed tokens
  ``[query_start_loc[r], query_start_loc[r + 1])``. ``R`` counts zero-length padding rows too.
  Packed slots at or beyond ``query_start_loc[R]`` are padding.
* ``seq_lens: int32[R]`` include this step's tokens; token ``i`` of a request with ``q_len`` tokens sits at
  absolute position ``seq_lens[r] - q_len + i``.
* The request of a packed token is found by a binary search over ``query_start_loc`` on the device. Host-side
  lengths and ``max_query_len`` are only upper bounds once drafts are reallocated on the device, so they are
  never used to derive request ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_to_request(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """Request row of each of ``num_tokens`` packed slots; ``-1`` for slots at or beyond ``qsl[R]``.

    The row of token ``t`` is the first ``r`` with ``query_start_loc[r + 1] > t``; zero-length rows never own a
    token. Implemented as a count of the row ends at or before each slot (``jnp.searchsorted`` with
    ``method="compare_all"``: ``T x R`` comparisons in one fused kernel, static shapes, no host sync; the default
    binary search lowers to an XLA while loop, which a GPU runs from the host, one launch per iteration).
    """
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    if qsl.ndim != 1 or qsl.shape[0] < 1:
        raise ValueError(f"query_start_loc must be int32[R + 1], got shape {qsl.shape}")
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # side="right" over qsl[1:]: the first r with qsl[r + 1] > t.
    row = jnp.searchsorted(qsl[1:], t, side="right", method="compare_all").astype(jnp.int32)
    valid = t < qsl[-1]
    return jnp.where(valid, row, -1)


def token_positions(
    query_start_loc: jax.Array, seq_lens: jax.Array, request_ids: jax.Array
) -> jax.Array:
    """Absolute position of every packed token (``-1`` for padding slots).

    ``request_ids`` is the output of :func:`token_to_request`.
    """
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    seq_lens = jnp.asarray(seq_lens, jnp.int32)
    r = jnp.maximum(request_ids, 0)
    t = jnp.arange(request_ids.shape[0], dtype=jnp.int32)
    q_len = qsl[r + 1] - qsl[r]
    pos = seq_lens[r] - q_len + (t - qsl[r])
    return jnp.where(request_ids >= 0, pos, -1)


def query_lens(query_start_loc: jax.Array) -> jax.Array:
    """``int32[R]``: the number of packed tokens of each request row."""
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    return qsl[1:] - qsl[:-1]
