"""Ragged dense paged attention (the dense layers of M3): every token attends to all its keys ``j <= pos``.

Same ragged contract as ``ragged_sparse_attention`` (SPEC sections 4-5) without ``block_indices``: token ``t``
of request ``r`` at absolute position ``pos`` and query head ``qh`` of KV group ``g = qh // (H_q // H_kv)``
attend to keys ``0 .. pos`` of request ``r`` (read through ``block_tables[r]``) with softmax scale ``scale``.
Padding slots and zero-length rows produce zeros and read nothing.

The Pallas path is the kernels of ``sparse_attention.py`` in their ``dense`` mode: the pre-pass writes only the
tile table; a walk program owns one request tile (``block_q`` tokens x the group's heads) and one KV head and
walks the blocks ``0 .. cdiv(pos_last + 1, page)`` of the tile once, page ids loaded from the block table in the
walk, unmasked up to the tile's first position and with the causal mask after it (no selection list, no union);
split-K over those blocks fills the chip when there are few tiles. Prefill chunks are tiled by ``block_q``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.sparse_attention import (
    check_attention_inputs,
    ragged_sparse_attention_reference,
    run_attention_pallas,
)

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference"]


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "implementation",
        "interpret",
        "block_q",
        "num_splits",
        "num_warps",
        "num_stages",
        "backend",
        "block_k",
    ),
)
def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    scale: float,
    implementation: str = "pallas",
    interpret: bool | None = None,
    block_q: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    backend: str | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Ragged causal attention over a paged KV cache (dense layers).

    Args:
      q: ``[T, H_q, D]`` packed query tokens.
      k_cache, v_cache: ``[H_kv, P, page, D]`` paged caches (page a power of 2).
      block_tables: ``int32[R, max_blocks]`` logical block -> physical page per request row.
      seq_lens: ``int32[R]`` lengths including this step's tokens.
      query_start_loc: ``int32[R + 1]``; slots ``>= qsl[R]`` are padding.
      scale: softmax scale.
      implementation: ``"pallas"`` or ``"reference"``.
      interpret, block_q, num_splits, num_warps, num_stages, backend, block_k: as in
        ``ragged_sparse_attention``.

    Returns:
      ``[T, H_q, D]`` in q's dtype, zeros for padding slots.
    """
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, None)
    if implementation == "reference":
        return ragged_paged_attention_reference(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale
        )
    if implementation != "pallas":
        raise ValueError(f"implementation must be 'pallas' or 'reference', got {implementation!r}")
    return run_attention_pallas(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        None,
        scale=scale,
        interpret=interpret,
        backend=backend,
        block_q=block_q,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        block_k=block_k,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "implementation",
        "interpret",
        "block_q",
        "num_splits",
        "num_warps",
        "num_stages",
        "backend",
        "block_k",
    ),
)
def ragged_paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    scale: float,
    implementation: str = "reference",
    interpret: bool | None = None,
    block_q: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    backend: str | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Plain-jnp reference with ``ragged_paged_attention``'s signature (launch arguments are ignored).

    Dense attention is sparse attention with every block selected: the sparse reference runs with
    ``block_indices[t, g] = 0 .. max_blocks - 1`` (blocks past a token's position are masked there).
    """
    del implementation, interpret, block_q, num_splits, num_warps, num_stages, backend, block_k
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, None)
    num_tokens = q.shape[0]
    num_kv_heads = k_cache.shape[0]
    max_blocks = block_tables.shape[1]
    all_blocks = jnp.broadcast_to(
        jnp.arange(max_blocks, dtype=jnp.int32), (num_tokens, num_kv_heads, max_blocks)
    )
    return ragged_sparse_attention_reference(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, all_blocks, scale=scale
    )
