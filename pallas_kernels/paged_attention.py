"""Ragged dense paged attention (the dense layers of M3): every token attends to all its keys ``j <= pos``.

Same ragged contract as ``ragged_sparse_attention`` (ARCHITECTURE.md) without ``block_indices``: token ``t``
of request ``r`` at absolute position ``pos`` and query head ``qh`` of KV group ``g = qh // (H_q // H_kv)``
attend to keys ``0 .. pos`` of request ``r`` (read through ``block_tables[r]``) with softmax scale ``scale``.
Padding slots and zero-length rows produce zeros and read nothing.

The Pallas path is the walk of ``attention_walk.py`` over the request's own blocks (:class:`DenseWalk`): the
pre-pass (``attention_walk.tile_prepass``) writes only the tile table; a walk program owns one request tile
(``block_q`` tokens x the group's heads) and one KV head and walks the blocks ``0 .. cdiv(pos_last + 1, page)``
of the tile once, page ids loaded from the block table in the walk, unmasked up to the tile's first position and
with the causal mask after it (no selection list, no union); split-K over those blocks fills the chip when there
are few tiles. Prefill chunks are tiled by ``block_q``. Launch settings: ``tuning.paged_attention_launch_config``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import check_window, visible_blocks, window_start, window_walk_bound
from pallas_kernels.attention_walk import (
    attention_unsupported,
    check_attention_inputs,
    check_walk_config,
    run_walk,
    tile_prepass,
)
from pallas_kernels.platform import resolve_interpret
from pallas_kernels.sparse_attention import ragged_sparse_attention_reference
from pallas_kernels.tuning import AttentionLaunchConfig, paged_attention_launch_config, resolve_chip

__all__ = [
    "DenseWalk",
    "ragged_paged_attention",
    "ragged_paged_attention_pallas",
    "ragged_paged_attention_reference",
    "supports",
]


@dataclasses.dataclass(frozen=True)
class DenseWalk:
    """The walk over a tile's request blocks ``0 .. cdiv(pos_last + 1, page)`` (``attention_walk.Walk``):
    index ref ``block_tables [R, max_blocks]``; every row takes every block."""

    max_blocks: int
    kind = "paged"
    num_index_refs = 1

    def block_range(self, index_refs, *, live, req, pos0, ntok, page, window):
        del index_refs, req
        # Blocks 0 .. n_total of the request; the first n_past end at or before the tile's first position.
        n_total = visible_blocks(live, pos0, ntok, page=page, max_blocks=self.max_blocks)
        n_past = jnp.where(live, jnp.minimum((pos0 + 1) // page, n_total), 0)
        if window is None:
            return 0, n_past, n_total
        # A window skips the blocks that end before its first token's window.
        return jnp.minimum(window_start(live, pos0, ntok, page=page, window=window), n_past), n_past, n_total

    def page_id(self, index_refs, req, u):
        return index_refs[0][req, u]

    def block_id(self, index_refs, u):
        del index_refs
        return u

    def picked_rows(self, index_refs, u, tok_local):
        """``None``: every row takes every block."""
        del index_refs, u, tok_local


def supports(
    *,
    page_size: int,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    dtype,
    chip: str | None = None,
    interpret: bool = False,
) -> bool:
    """Whether ``ragged_paged_attention`` runs these shapes, compiled for ``chip`` (a chip of ``tuning.CHIPS``;
    ``None``: the default device's) or in interpret mode.

    Always: page size and head_dim powers of 2, ``H_q`` a multiple of ``H_kv``. Compiled: also a dtype of
    ``tuning.COMPILED_DTYPES`` and page size and head_dim >= 16 (``tuning.MIN_DOT_DIM``: the dots' N and K).
    Every chip has the same limits today.
    """
    resolve_chip(chip)
    return (
        attention_unsupported(
            page_size=page_size,
            head_dim=head_dim,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            dtype=dtype,
            interpret=interpret,
        )
        is None
    )


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "poison", "window"))
def ragged_paged_attention_pallas(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    *,
    scale: float,
    config: AttentionLaunchConfig,
    interpret: bool,
    poison: bool = False,
    window: int | None = None,
):
    """The Pallas kernels with an explicit launch ``config``: the tile pre-pass, the walk, the split-K merge.

    ``poison`` (tests only): start the float output buffers as NaN (aliased into the kernels) so that a row a
    kernel fails to write shows up. ``window``: as in :func:`ragged_paged_attention`.
    """
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    check_window(window)
    check_walk_config(config, q, k_cache, interpret=interpret)
    num_rows, max_blocks = block_tables.shape
    tiles = tile_prepass(
        query_start_loc, seq_lens, num_tokens=q.shape[0], config=config, kind="paged", interpret=interpret
    )
    return run_walk(
        q,
        k_cache,
        v_cache,
        tiles,
        [block_tables.astype(jnp.int32)],
        [pl.BlockSpec((num_rows, max_blocks), lambda i, h, s: (0, 0))],
        walk=DenseWalk(max_blocks),
        scale=scale,
        config=config,
        interpret=interpret,
        poison=poison,
        window=window,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "window",
        "implementation",
        "interpret",
        "block_q",
        "num_splits",
        "num_warps",
        "num_stages",
        "chip",
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
    window: int | None = None,
    implementation: str = "pallas",
    interpret: bool | None = None,
    block_q: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    chip: str | None = None,
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
      window: static sliding window ``W`` (``None``: no window): token at position ``pos`` attends to keys
        ``pos - W < j <= pos`` only (its last ``W`` positions, itself included; HF's ``sliding_window``). Blocks
        before a tile's first window are never read; the walk masks the others per score.
      implementation: ``"pallas"`` (Triton kernels; interpret mode on CPU) or ``"reference"`` (plain jnp).
      interpret: ``None``: interpret mode on CPU, compiled Triton on GPU.
      block_q, num_splits, num_warps, num_stages, block_k: launch overrides; ``None`` asks the chip's policy
        (``tuning.paged_attention_launch_config``).
      chip: a chip of ``tuning.CHIPS`` whose launch tables to use (``None``: the default device's).

    Returns:
      ``[T, H_q, D]`` in q's dtype, zeros for padding slots.
    """
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    check_window(window)
    if implementation == "reference":
        return ragged_paged_attention_reference(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale, window=window
        )
    if implementation != "pallas":
        raise ValueError(f"implementation must be 'pallas' or 'reference', got {implementation!r}")
    config = paged_attention_launch_config(
        num_tokens=q.shape[0],
        num_requests=block_tables.shape[0],
        num_q_heads=q.shape[1],
        num_kv_heads=k_cache.shape[0],
        max_blocks=window_walk_bound(block_tables.shape[1], k_cache.shape[2], window),
        page=k_cache.shape[2],
        head_dim=q.shape[2],
        itemsize=k_cache.dtype.itemsize,
        chip=chip,
        block_q=block_q,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        block_k=block_k,
    )
    return ragged_paged_attention_pallas(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale=scale,
        config=config,
        interpret=resolve_interpret(interpret),
        window=window,
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
    window: int | None = None,
    implementation: str = "reference",
    interpret: bool | None = None,
    block_q: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    chip: str | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Plain-jnp ``ragged_paged_attention``: the kernel's parameters and result; ``implementation``,
    ``interpret``, the launch tunables and ``chip`` are named and ignored (changing them reuses the compiled
    program).

    Dense attention is sparse attention with every block selected: the sparse reference runs with
    ``block_indices[t, g] = 0 .. max_blocks - 1`` (blocks past a token's position, and keys outside its
    ``window``, are masked there).
    """
    del implementation, interpret, block_q, num_splits, num_warps, num_stages, chip, block_k
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    check_window(window)
    num_tokens = q.shape[0]
    num_kv_heads = k_cache.shape[0]
    max_blocks = block_tables.shape[1]
    all_blocks = jnp.broadcast_to(
        jnp.arange(max_blocks, dtype=jnp.int32), (num_tokens, num_kv_heads, max_blocks)
    )
    return ragged_sparse_attention_reference(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, all_blocks, scale=scale, window=window
    )
