"""MSA (MiniMax sparse attention) selection in plain jnp, for whole sequences (docs/kernels/indexer.md).

These functions are the exact, simple definition used by the plain causal forward; the paged Pallas kernels in
``pallas_kernels`` are checked against them (through the model's incremental decode path).

Per query token at position ``pos`` and index head ``h``:

* ``s[j] = qI[h] . kI[j]`` in fp32 for keys ``j <= pos`` (no scale, no ReLU);
* ``S[b] = max_{j in block b, j <= pos} s[j]`` for visible blocks ``b <= pos // block``;
* the ``local_blocks`` blocks ending at ``pos // block`` are forced (+inf);
* the ``min(topk, pos // block + 1)`` best blocks by descending score, ties to the lower block id,
  left-packed, ``-1`` padded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def block_scores(index_q: jax.Array, index_k: jax.Array, q_positions: jax.Array, *, block_size: int) -> jax.Array:
    """Block max-pooled index scores.

    Args:
      index_q: ``[B, Sq, H, D]`` index queries (normed, RoPE applied).
      index_k: ``[B, Sk, D]`` index keys of key positions ``0..Sk-1``.
      q_positions: ``int32[B, Sq]`` absolute positions of the queries.
    Returns:
      ``f32[B, H, Sq, NB]`` with ``NB = ceil(Sk / block_size)``; ``-inf`` for blocks with no visible key.
    """
    sk = index_k.shape[1]
    nb = -(-sk // block_size)
    s = jnp.einsum("bqhd,bkd->bhqk", index_q.astype(jnp.float32), index_k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    visible = jnp.arange(sk)[None, None, None, :] <= q_positions[:, None, :, None]
    s = jnp.where(visible, s, -jnp.inf)
    s = jnp.pad(s, ((0, 0), (0, 0), (0, 0), (0, nb * block_size - sk)), constant_values=-jnp.inf)
    return s.reshape(*s.shape[:3], nb, block_size).max(axis=-1)


def select_blocks(scores: jax.Array, q_positions: jax.Array, *, block_size: int, topk: int,
                  local_blocks: int) -> jax.Array:
    """Top-k block ids from ``scores f32[B, H, Sq, NB]``: ``int32[B, H, Sq, topk]``, ``-1`` padded."""
    nb = scores.shape[-1]
    q_block = (q_positions // block_size)[:, None, :, None]  # [B, 1, Sq, 1]
    blocks = jnp.arange(nb)[None, None, None, :]
    if local_blocks > 0:
        forced = (blocks <= q_block) & (blocks > q_block - local_blocks)
        scores = jnp.where(forced, jnp.inf, scores)
    scores = jnp.where(blocks <= q_block, scores, -jnp.inf)
    k = min(topk, nb)
    top_scores, top_ids = jax.lax.top_k(scores, k)  # ties: lower index first
    sel = jnp.where(top_scores == -jnp.inf, -1, top_ids).astype(jnp.int32)
    if k < topk:
        sel = jnp.pad(sel, ((0, 0),) * 3 + ((0, topk - k),), constant_values=-1)
    return sel


def selection_key_mask(selected: jax.Array, q_positions: jax.Array, num_keys: int, *, block_size: int) -> jax.Array:
    """``bool[B, G, Sq, Sk]``: key ``j`` is attended iff ``j // block`` is selected and ``j <= pos``."""
    nb = -(-num_keys // block_size)
    onehot = (selected[..., None] == jnp.arange(nb)).any(axis=-2)  # [B, G, Sq, NB]; -1 matches nothing
    per_key = jnp.repeat(onehot, block_size, axis=-1)[..., :num_keys]
    causal = jnp.arange(num_keys)[None, None, None, :] <= q_positions[:, None, :, None]
    return per_key & causal
