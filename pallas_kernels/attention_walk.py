"""The attention walk shared by ragged sparse (MSA) attention and ragged dense paged attention.

Both kernels cut the ragged batch into *request tiles* (up to ``block_q`` consecutive tokens of one request,
``pallas_kernels._common``) and run the same three Pallas (Triton) kernels, no XLA glue:

1. A pre-pass, one program per (tile, KV head), finds each tile's tokens on the device and writes the tile table
   ``int32[num_tiles, 4]``: (request row or -1, first token, tokens, first position) (``write_tile_row``). The
   dense pre-pass is :func:`tile_prepass`; the sparse one (``sparse_attention.py``) also writes the union of the
   tile's selections.
2. The walk (:func:`run_walk`), one program per (tile, KV head, split): its query tile is ``block_q x group``
   rows (row = token * group + head, padded to a power of 2 >= 16) that share every K/V load. Per step: one
   scalar load of a page id, a ``block_k``-key K/V slice, ``S = Q K^T``, online softmax in fp32 (log2 domain),
   ``acc += P V``. *Past* blocks (ending at or before the tile's first position) need no causal mask; only the
   at most ``cdiv(block_q - 1, page) + 1`` *causal* blocks at the end mask per score. Which blocks a tile walks,
   where their page ids come from and which rows take each block is the kernel's :class:`Walk`. With a sliding
   ``window`` (static) the walk starts at the tile's first window and masks every step (causal and window
   bounds per row) in one loop; the blocks before it are never read.
3. Split-K: ``num_splits`` programs share one tile's walk (balanced contiguous step ranges) and write fp32
   partial outputs with a base-2 log-sum-exp; ``_merge_splits_kernel`` combines them. With one split the walk
   writes the final output.

Launch settings: ``tuning.AttentionLaunchConfig`` (the walk, the pre-pass and the merge), chosen per chip by
``tuning.sparse_attention_launch_config`` / ``tuning.paged_attention_launch_config``.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    MASK_VALUE,
    cdiv,
    load_segments,
    locate_tile,
    next_pow2,
    num_tiles_bound,
    out_of_bounds_where,
)
from pallas_kernels.tuning import COMPILED_DTYPES, MIN_DOT_DIM, AttentionLaunchConfig

__all__ = [
    "LOG2E",
    "Walk",
    "attention_unsupported",
    "check_attention_inputs",
    "check_walk_config",
    "dot_f32",
    "merge_splits",
    "online_softmax_step",
    "pallas_call",
    "run_walk",
    "split_outputs",
    "store_walk_output",
    "tile_prepass",
    "write_tile_row",
]

# Subtracted instead of a row's max when the row skips a block: exp2(score - _SKIP_ROW) is exactly 0.
_SKIP_ROW = 0.5 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)


class Walk(Protocol):
    """What one attention kernel walks; traced inside ``_walk_kernel`` (all methods take the kernel's index
    refs, the ``num_index_refs`` refs after ``v_ref``)."""

    kind: str  # kernel names: ``ragged_{kind}_attention_...``
    num_index_refs: int

    def block_range(self, index_refs, *, live, req, pos0, ntok, page: int, window: int | None):
        """``(n_start, n_past, n_total)``: the tile walks blocks ``[n_start, n_total)`` of its list; blocks
        below ``n_past`` end at or before the tile's first position. ``n_start`` is 0 without a sliding
        ``window``; with one, the blocks before it end before every token's window (never read)."""

    def page_id(self, index_refs, req, u):
        """Physical page of block ``u`` of the list (a scalar load)."""

    def block_id(self, index_refs, u):
        """Logical block of block ``u`` of the list (for the causal mask)."""

    def picked_rows(self, index_refs, u, tok_local):
        """``bool[rows]``: rows whose token takes block ``u``; ``None`` when every row takes every block."""


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


def dot_f32(a, b, *, contract_b: int):
    """2-D ``a @ b`` (``contract_b=0``) or ``a @ b.T`` (``contract_b=1``) with an fp32 accumulator.

    fp32 operands are multiplied in full fp32 (IEEE), as in the indexer: an fp32 cache asks for accuracy, and
    Triton's default for fp32 dots is TF32. bf16 operands take the tensor cores' bf16 path.
    """
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def online_softmax_step(carry, s, v, visible=None):
    """One online-softmax step (in-kernel, base 2): fold the scores ``s [rows, keys]`` (already in the log2
    domain, ``MASK_VALUE`` where not ``visible``) and their values ``v [keys, D]`` into ``carry = (acc [rows, D],
    m [rows], l [rows])``. ``visible`` (broadcastable to ``s``) zeroes masked probabilities: a row with no visible
    key yet has ``m == MASK_VALUE``, where ``exp2(s - m)`` would be 1."""
    acc, m_prev, l_prev = carry
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    p = jnp.exp2(s - m_next[:, None])
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    alpha = jnp.exp2(m_prev - m_next)
    l_next = l_prev * alpha + jnp.sum(p, axis=1)
    return acc * alpha[:, None] + dot_f32(p.astype(v.dtype), v, contract_b=0), m_next, l_next


def split_outputs(rows: int, head_dim: int, dtype, num_splits: int):
    """``(out_shape, out_specs)`` of a walk over a grid whose last axis is the split: the ``[rows, D]`` output in
    ``dtype``, or with split-K the fp32 partials ``[S, rows, D]`` and their log-sum-exps ``[S, rows]`` that
    :func:`merge_splits` combines."""
    if num_splits == 1:
        return ([jax.ShapeDtypeStruct((rows, head_dim), dtype)],
                [pl.BlockSpec((rows, head_dim), lambda *_: (0, 0))])
    return (
        [jax.ShapeDtypeStruct((num_splits, rows, head_dim), jnp.float32),
         jax.ShapeDtypeStruct((num_splits, rows), jnp.float32)],
        [pl.BlockSpec((None, rows, head_dim), lambda *idx: (idx[-1], 0, 0)),
         pl.BlockSpec((None, rows), lambda *idx: (idx[-1], 0))],
    )


def write_tile_row(qsl_ref, seq_ref, tile_ref, *, num_tokens: int, num_rows: int, block_q: int):
    """In a pre-pass program (tile, KV head): locate tile ``program_id(0)`` (a search over
    ``query_start_loc`` on the device, no host lengths) and, from KV head 0, write its row of ``tile_ref
    [num_tiles, 4]``. Returns ``(req, tok0, ntok, pos0)`` (``_common.locate_tile``)."""
    tile = pl.program_id(0)
    segments = load_segments(qsl_ref, seq_ref, num_rows=num_rows, num_tokens=num_tokens)
    req, tok0, ntok, pos0 = locate_tile(tile, *segments, num_rows=num_rows, block_q=block_q)
    four = jax.lax.broadcasted_iota(jnp.int32, (4,), 0)
    info = jnp.where(four == 0, req, jnp.where(four == 1, tok0, jnp.where(four == 2, ntok, pos0)))
    first_head = pl.program_id(1) == 0
    # Only KV head 0 writes the tile's row; the other heads point one past the end (dropped).
    plgpu.store(
        tile_ref.at[jnp.zeros_like(four) + tile, out_of_bounds_where(first_head, four, 4)],
        info,
        mask=(four >= 0) & first_head,
    )
    return req, tok0, ntok, pos0


def _tile_kernel(
    qsl_ref,  # [R + 1] int32
    seq_ref,  # [R] int32
    tile_ref,  # [num_tiles, 4] int32 out: (request row or -1, first token, tokens, first position) per tile
    *,
    num_tokens: int,
    num_rows: int,
    block_q: int,
):
    write_tile_row(qsl_ref, seq_ref, tile_ref, num_tokens=num_tokens, num_rows=num_rows, block_q=block_q)


def _walk_kernel(
    tile_ref,  # [4] int32 (this tile): request row or -1, first token, tokens, first position
    q_ref,  # [T * H_q, D]
    k_ref,  # [P, page, D]        (this program's KV head)
    v_ref,  # [P, page, D]        (this program's KV head)
    *refs,  # walk.num_index_refs index refs (Walk), then the outputs:
    #   num_splits == 1: o_ref [T * H_q, D] (q dtype)
    #   num_splits  > 1: o_ref [T * H_q, D] f32 (this split), lse_ref [T * H_q] f32 (this split, base 2)
    walk: Walk,
    group: int,
    num_q_heads: int,
    block_k: int,
    rows: int,
    num_splits: int,
    scale: float,
    window: int | None,
):
    index_refs, out_refs = refs[: walk.num_index_refs], refs[walk.num_index_refs :]
    head = pl.program_id(1)
    split = pl.program_id(2)
    _, page, head_dim = k_ref.shape

    req, tok0, ntok, pos0 = tile_ref[0], tile_ref[1], tile_ref[2], tile_ref[3]
    live = req >= 0
    req_c = jnp.maximum(req, 0)

    # Query rows of the tile: token-major, the group's heads inside (row = token * group + head).
    r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    tok_local = r // group
    row_valid = tok_local < ntok
    row_tok = jnp.where(row_valid, tok0 + tok_local, 0)
    row_pos = jnp.where(row_valid & live, pos0 + tok_local, -1)
    q_rows = jnp.where(row_valid, row_tok * num_q_heads + head * group + r % group, 0)
    d = jax.lax.broadcasted_iota(jnp.int32, (head_dim,), 0)
    q = plgpu.load(q_ref.at[q_rows[:, None], d[None, :]], mask=row_valid[:, None], other=0)  # [rows, D]

    n_start, n_past, n_total = walk.block_range(
        index_refs, live=live, req=req_c, pos0=pos0, ntok=ntok, page=page, window=window
    )

    # The walk: block u of the list, sub-step of block_k keys; split s takes a balanced contiguous share of the
    # steps. Past blocks need no causal mask (at most a per-row "took the block" select); only the causal blocks
    # at the end apply a mask per score. With a sliding window the walk starts at the tile's first window and
    # masks every step.
    parts = page // block_k
    n_steps = (n_total - n_start) * parts
    lo = (split * n_steps) // num_splits
    hi = ((split + 1) * n_steps) // num_splits
    key_iota = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    qk_scale = scale * LOG2E  # scores in the log2 domain

    def load_kv(step):
        u, part = (step, 0) if parts == 1 else (step // parts, step % parts)
        page_id = walk.page_id(index_refs, req_c, u)
        if parts == 1:
            return u, 0, k_ref[page_id], v_ref[page_id]  # [block_k, D] each
        off = pl.multiple_of(part * block_k, block_k)
        return u, off, k_ref[page_id, pl.ds(off, block_k), :], v_ref[page_id, pl.ds(off, block_k), :]

    def past_step(step, carry):
        acc, m_prev, l_prev = carry
        u, _, kb, vb = load_kv(step)
        s = dot_f32(q, kb, contract_b=1)  # [rows, block_k]
        m_blk = jnp.maximum(m_prev, jnp.max(s, axis=1) * qk_scale)
        picked = walk.picked_rows(index_refs, u, tok_local)
        if picked is None:
            m_next = m_exp = m_blk
        else:
            # A row that did not pick the block keeps its state: its max subtracts a huge value instead, so
            # its probabilities are exactly 0 (no per-score mask), and alpha is 1.
            m_next = jnp.where(picked, m_blk, m_prev)
            m_exp = jnp.where(picked, m_next, _SKIP_ROW)
        p = jnp.exp2(s * qk_scale - m_exp[:, None])  # one multiply-add per score
        alpha = jnp.exp2(m_prev - m_next)
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot_f32(p.astype(vb.dtype), vb, contract_b=0)
        return acc, m_next, l_next

    def masked_step(step, carry):
        u, off, kb, vb = load_kv(step)
        b = walk.block_id(index_refs, u)
        picked = walk.picked_rows(index_refs, u, tok_local)
        limit = row_pos if picked is None else jnp.where(picked, row_pos, -1)
        key_pos = (b * page + off + key_iota)[None, :]
        visible = key_pos <= limit[:, None]  # [rows, block_k]
        if window is not None:
            visible = visible & (key_pos > (row_pos - window)[:, None])  # each row's last `window` positions
        s = jnp.where(visible, dot_f32(q, kb, contract_b=1) * qk_scale, MASK_VALUE)
        return online_softmax_step(carry, s, vb, visible)

    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m_i = jnp.full((rows,), MASK_VALUE, jnp.float32)
    l_i = jnp.zeros((rows,), jnp.float32)
    carry = (acc, m_i, l_i)
    if window is None:  # the past steps need no mask, the causal ones at the end do
        mid = jnp.clip(n_past * parts, lo, hi)
        carry = jax.lax.fori_loop(lo, mid, past_step, carry)
        acc, m_i, l_i = jax.lax.fori_loop(mid, hi, masked_step, carry)
    else:
        # Windowed: every step from the first window's block on is masked per score, in one loop (at most
        # cdiv(window + block_q - 1, page) + 1 blocks). An unmasked loop for the blocks inside every token's
        # window beside the masked ones spilled scalar registers of the 128-row walk on gfx942.
        first = n_start * parts
        acc, m_i, l_i = jax.lax.fori_loop(first + lo, first + hi, masked_step, carry)

    store_walk_output(out_refs, acc, m_i, l_i, q_rows=q_rows, row_ok=row_valid, num_rows=q_ref.shape[0],
                      num_splits=num_splits)


def store_walk_output(out_refs, acc, m_i, l_i, *, q_rows, row_ok, num_rows: int, num_splits: int) -> None:
    """The online-softmax epilogue every attention walk shares (in-kernel): normalise ``acc [rows, D]`` by
    ``l_i`` and store it at ``q_rows``, or with split-K the fp32 partial and its base-2 log-sum-exp (the merge
    kernel's inputs). A row that saw no key stores zeros and ``MASK_VALUE``."""
    has_keys = l_i > 0.0
    out = acc / jnp.where(has_keys, l_i, 1.0)[:, None]
    out_rows = out_of_bounds_where(row_ok, q_rows, num_rows)
    d = jax.lax.broadcasted_iota(jnp.int32, (acc.shape[1],), 0)
    store_idx = out_rows[:, None], d[None, :]
    if num_splits == 1:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[store_idx], out.astype(o_ref.dtype), mask=row_ok[:, None])
    else:
        o_ref, lse_ref = out_refs
        lse = jnp.where(has_keys, m_i + jnp.log2(jnp.where(has_keys, l_i, 1.0)), MASK_VALUE)
        plgpu.store(o_ref.at[store_idx], out, mask=row_ok[:, None])
        plgpu.store(lse_ref.at[out_rows], lse, mask=row_ok)


def _merge_splits_kernel(
    o_ref,  # [S, N, D] f32: normalised partial outputs
    lse_ref,  # [S, N] f32: base-2 log-sum-exp, MASK_VALUE where a split saw no key
    out_ref,  # [N, D]
    *,
    num_splits: int,
    block_rows: int,
):
    num, head_dim = out_ref.shape
    r = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    ok = r < num
    rr = jnp.where(ok, r, 0)
    d = jax.lax.broadcasted_iota(jnp.int32, (head_dim,), 0)
    lses = [
        plgpu.load(lse_ref.at[jnp.full_like(rr, s), rr], mask=ok, other=MASK_VALUE) for s in range(num_splits)
    ]
    m = functools.reduce(jnp.maximum, lses)
    acc = jnp.zeros((block_rows, head_dim), jnp.float32)
    den = jnp.zeros((block_rows,), jnp.float32)
    for s in range(num_splits):
        w = jnp.where(lses[s] > 0.5 * MASK_VALUE, jnp.exp2(lses[s] - m), 0.0)
        o = plgpu.load(
            o_ref.at[jnp.full_like(rr, s)[:, None], rr[:, None], d[None, :]], mask=ok[:, None], other=0.0
        )
        acc = acc + w[:, None] * o
        den = den + w
    out = acc / jnp.where(den > 0, den, 1.0)[:, None]  # rows no split saw stay exact zeros
    plgpu.store(
        out_ref.at[out_of_bounds_where(ok, r, num)[:, None], d[None, :]],
        out.astype(out_ref.dtype),
        mask=ok[:, None],
    )


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------


def attention_unsupported(
    *, page_size: int, head_dim: int, num_q_heads: int, num_kv_heads: int, dtype, interpret: bool
) -> str | None:
    """Why the walk cannot run these shapes (``None`` when it can): the limits both attention kernels'
    ``supports`` report. Pages and head dims are powers of 2 and ``H_q`` a multiple of ``H_kv``; compiled, the
    dtype is one of ``tuning.COMPILED_DTYPES`` and pages and head dims are >= 16 (the dots' N and K: a walk step
    is a power-of-2 part of a page of at least 16 keys)."""
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        return f"H_q={num_q_heads} must be a positive multiple of H_kv={num_kv_heads}"
    for name, n in (("page size", page_size), ("head_dim", head_dim)):
        if n < 1 or n & (n - 1):
            return f"{name} must be a power of 2, got {n}"
    if not jnp.issubdtype(dtype, jnp.floating):
        return f"q and the caches must be floating, got {jnp.dtype(dtype).name}"
    if interpret:
        return None
    if jnp.dtype(dtype).name not in COMPILED_DTYPES:
        return f"compiled kernels take {', '.join(COMPILED_DTYPES)}, got {jnp.dtype(dtype).name}"
    if min(page_size, head_dim) < MIN_DOT_DIM:
        return (
            f"compiled Triton dots need N and K >= {MIN_DOT_DIM}: page {page_size} and head_dim {head_dim}"
        )
    return None


def check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc):
    """Static shape/dtype validation of both attention entry points (ValueErrors naming the shapes)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H_q, D], got shape {q.shape}")
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [H_kv, P, page, D], got shape {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} must equal k_cache shape {k_cache.shape}")
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page, kd = k_cache.shape
    if kd != head_dim:
        raise ValueError(f"head_dim of q {q.shape} and k_cache {k_cache.shape} differ")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [R, max_blocks], got shape {block_tables.shape}")
    num_rows = block_tables.shape[0]
    if seq_lens.shape != (num_rows,):
        raise ValueError(f"seq_lens must be [R]={num_rows}, got shape {seq_lens.shape}")
    if query_start_loc.shape != (num_rows + 1,):
        raise ValueError(f"query_start_loc must be [R + 1]={num_rows + 1}, got shape {query_start_loc.shape}")
    for name, a in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating) or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"q ({q.dtype}) must be floating and k/v caches ({k_cache.dtype}, {v_cache.dtype}) match"
        )
    reason = attention_unsupported(
        page_size=page,
        head_dim=head_dim,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        dtype=k_cache.dtype,
        interpret=True,
    )
    if reason:
        raise ValueError(f"{reason} (q {q.shape}, k_cache {k_cache.shape})")


def check_walk_config(config: AttentionLaunchConfig, q, k_cache, *, interpret: bool) -> None:
    """Launch checks of the walk (both kernels): the compiled shapes and dtypes, a power-of-2 ``block_q``,
    ``num_splits >= 1`` and ``block_k`` a power of 2 dividing the page (at least 16 when compiled)."""
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page, _ = k_cache.shape
    for dtype in (q.dtype, k_cache.dtype):
        reason = attention_unsupported(
            page_size=page,
            head_dim=head_dim,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            dtype=dtype,
            interpret=interpret,
        )
        if reason:
            raise ValueError(f"{reason}; use implementation='reference'")
    block_k = config.block_k or page
    if not interpret and block_k < MIN_DOT_DIM:
        raise ValueError(f"compiled Triton dots need N >= {MIN_DOT_DIM}: keys per step {block_k} (page {page})")
    if config.block_q < 1 or config.block_q & (config.block_q - 1):
        raise ValueError(f"block_q must be a power of 2 >= 1, got {config.block_q}")
    if config.num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {config.num_splits}")
    if block_k < 1 or block_k & (block_k - 1) or page % block_k:
        raise ValueError(f"block_k must be a power of 2 dividing the page size {page}, got {block_k}")


# ----------------------------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------------------------


def pallas_call(
    kernel, *, grid, in_specs, out_specs, out_shape, args, poison, interpret, num_warps, num_stages, name
):
    """``pl.pallas_call`` with the Triton compiler params; with ``poison`` the float outputs start as NaN."""
    in_specs, args = list(in_specs), list(args)
    aliases = {}
    if poison:
        for j, o in enumerate(out_shape):
            if jnp.issubdtype(o.dtype, jnp.floating):
                aliases[len(args)] = j
                args.append(jnp.full(o.shape, jnp.nan, o.dtype))
                in_specs.append(out_specs[j])
    if aliases:
        n_in, n_alias = len(args) - len(aliases), len(aliases)
        inner = kernel

        def kernel(*refs):  # drop the aliased input refs: the kernel writes the outputs
            return inner(*refs[:n_in], *refs[n_in + n_alias :])

    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*args)


def tile_prepass(
    query_start_loc, seq_lens, *, num_tokens: int, config: AttentionLaunchConfig, kind: str, interpret: bool
):
    """The dense walk's pre-pass: ``int32[num_tiles, 4]``, the tile table (``write_tile_row``)."""
    num_rows = seq_lens.shape[0]
    block_q = config.block_q
    num_tiles = num_tiles_bound(num_tokens, num_rows, block_q)
    (tiles,) = pallas_call(
        functools.partial(_tile_kernel, num_tokens=num_tokens, num_rows=num_rows, block_q=block_q),
        grid=(num_tiles, 1),
        in_specs=[
            pl.BlockSpec((num_rows + 1,), lambda i, h: (0,)),
            pl.BlockSpec((num_rows,), lambda i, h: (0,)),
        ],
        out_specs=[pl.BlockSpec((num_tiles, 4), lambda i, h: (0, 0))],
        out_shape=[jax.ShapeDtypeStruct((num_tiles, 4), jnp.int32)],
        args=[query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32)],
        poison=False,
        interpret=interpret,
        num_warps=config.prepass_warps,
        num_stages=1,
        name=f"ragged_{kind}_attention_tiles_bq{block_q}",
    )
    return tiles


def run_walk(
    q,
    k_cache,
    v_cache,
    tiles,
    index_args,
    index_specs,
    *,
    walk: Walk,
    scale: float,
    config: AttentionLaunchConfig,
    interpret: bool,
    poison: bool,
    window: int | None = None,
):
    """The walk over ``tiles`` (a pre-pass's tile table), then the split-K merge when ``config.num_splits > 1``.

    ``index_args`` / ``index_specs``: the walk's index arrays and their BlockSpecs over the grid
    ``(tile, KV head, split)``, passed to the kernel as ``walk``'s index refs. ``poison`` (tests only): the float
    output buffers start as NaN (aliased into the kernels), so a row a kernel fails to write shows up.
    ``window`` (static): each token sees only its last ``window`` positions (``None``: every key up to itself).
    Returns ``[T, H_q, D]`` in q's dtype.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    block_q, num_splits = config.block_q, config.num_splits
    block_k = config.block_k or page
    rows = max(16, next_pow2(block_q * group))
    num_tiles = tiles.shape[0]
    flat_rows = num_tokens * num_q_heads
    kind = walk.kind

    in_specs = [
        pl.BlockSpec((None, 4), lambda i, h, s: (i, 0)),
        pl.BlockSpec((flat_rows, head_dim), lambda i, h, s: (0, 0)),
        pl.BlockSpec((None, num_pages, page, head_dim), lambda i, h, s: (h, 0, 0, 0)),
        pl.BlockSpec((None, num_pages, page, head_dim), lambda i, h, s: (h, 0, 0, 0)),
        *index_specs,
    ]
    args = [tiles, q.reshape(flat_rows, head_dim), k_cache, v_cache, *index_args]
    out_shape, out_specs = split_outputs(flat_rows, head_dim, q.dtype, num_splits)
    kernel = functools.partial(
        _walk_kernel,
        walk=walk,
        group=group,
        num_q_heads=num_q_heads,
        block_k=block_k,
        rows=rows,
        num_splits=num_splits,
        scale=float(scale),
        window=window,
    )
    outs = pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        args=args,
        poison=poison,
        interpret=interpret,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        name=f"ragged_{kind}_attention_bq{block_q}_rows{rows}_bk{block_k}_splits{num_splits}"
        + ("" if window is None else f"_window{window}"),
    )
    out = outs[0] if num_splits == 1 else merge_splits(
        outs, num_splits=num_splits, dtype=q.dtype, merge_rows=config.merge_rows, merge_warps=config.merge_warps,
        poison=poison, interpret=interpret, name=f"ragged_{kind}_attention_merge_splits{num_splits}")
    return out.reshape(num_tokens, num_q_heads, head_dim)


def merge_splits(outs, *, num_splits: int, dtype, merge_rows: int, merge_warps: int, poison: bool,
                 interpret: bool, name: str) -> jax.Array:
    """Combine split-K partials: ``outs = (o [S, rows, D] fp32, lse [S, rows])`` -> ``[rows, D]`` in ``dtype``
    (the merge kernel; shared by every split-K attention kernel)."""
    _, flat_rows, head_dim = outs[0].shape
    block_rows = min(merge_rows, next_pow2(flat_rows))
    (out,) = pallas_call(
        functools.partial(_merge_splits_kernel, num_splits=num_splits, block_rows=block_rows),
        grid=(cdiv(flat_rows, block_rows),),
        in_specs=[
            pl.BlockSpec((num_splits, flat_rows, head_dim), lambda i: (0, 0, 0)),
            pl.BlockSpec((num_splits, flat_rows), lambda i: (0, 0)),
        ],
        out_specs=[pl.BlockSpec((flat_rows, head_dim), lambda i: (0, 0))],
        out_shape=[jax.ShapeDtypeStruct((flat_rows, head_dim), dtype)],
        args=list(outs),
        poison=poison,
        interpret=interpret,
        num_warps=merge_warps,
        num_stages=1,
        name=name,
    )
    return out
