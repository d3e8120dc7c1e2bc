"""Ragged MSA indexer: per-token top-k key blocks over a paged index-key cache (docs/kernels/indexer.md).

For packed token ``t`` of request ``r`` at absolute position ``pos`` and index head ``h``::

    s[h, j]  = index_q[t, h] . kI[j]                 fp32, keys j <= pos, kI read through block_tables[r]
    S[h, b]  = max_{j in block b, j <= pos} s[h, j]  visible blocks b <= pos // page
    S[h, b]  = +inf for the `local_blocks` blocks ending at pos // page
    out[t, h] = the k = min(topk, pos // page + 1) best logical blocks, descending score, ties to the
                lower id, left-packed, -1 padded; all -1 for padding slots t >= query_start_loc[R]

Ragged batch contract (the one of ``pallas_kernels.metadata``): ``query_start_loc: int32[R + 1]``
non-decreasing, request ``r`` owns packed tokens ``[qsl[r], qsl[r + 1])``, ``seq_lens[r]`` counts this step's
tokens, token ``i`` of a request with ``q_len`` tokens sits at ``seq_lens[r] - q_len + i``; zero-length rows
are padding rows, slots at or beyond ``qsl[R]`` are padding slots. ``seq_lens[r] <= max_blocks * page`` (the
kernel clamps to stay in bounds). Only block-table entries of blocks a row can see are read.

Algorithm (Pallas, Triton lowering; ``docs/kernels/indexer.md`` has the bytes/FLOPs model):

* The grid runs over *query tiles* (``pallas_kernels._common``): request ``r`` contributes
  ``cdiv(q_len, block_q)`` tiles of up to ``block_q`` consecutive tokens, the padding slots ``[qsl[R], T)``
  their own tiles (which only write -1). Each program finds its tile on the device from ``query_start_loc``
  (cumulative tile counts of the segments, one vector scan per program), in one kernel with no XLA glue; the grid
  is a static bound on the tiles of any valid batch. Nothing uses ``max_query_len`` or host lengths.
* One program loads each index-key page of its request once and scores *all* its tokens x index heads against
  it with one 2-D dot (``[block_q * H, D] x [D, page]``): the tokens of a request share their key reads.
* ``fused`` path (``num_splits == 1``): the program keeps the pooled block scores
  ``[block_q * H, max_blocks]`` in registers and runs the top-k selection (iterative max selection) as its
  epilogue: one kernel.
* ``split`` path: the key range of a tile is split across ``num_splits`` programs (few requests with long
  contexts still fill the chip); they write pooled scores to an fp32 scratch ``[T * H, max_blocks]`` and a
  second kernel over the same tiles does the selection. No host round trip in either path.

Launch settings come from ``tuning.indexer_launch_config`` (the chip's ``IndexerTable``); ``supports`` says which
shapes the compiled kernel takes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
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
    visible_blocks,
)
from pallas_kernels.metadata import token_positions, token_to_request
from pallas_kernels.platform import resolve_interpret
from pallas_kernels.tuning import (
    COMPILED_DTYPES,
    MIN_DOT_DIM,
    IndexerLaunchConfig,
    indexer_launch_config,
    resolve_chip,
)

__all__ = [
    "index_block_scores_reference",
    "ragged_index_topk",
    "ragged_index_topk_reference",
    "supports",
]

# Selection keys: a forced (local) block beats every score, an invisible or already chosen block loses to all.
_FORCED = float("inf")
_EXCLUDED = float("-inf")


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Static sizes shared by the kernel bodies."""

    num_tokens: int  # T
    num_requests: int  # R
    num_heads: int  # H
    heads_p2: int  # pow2(H)
    dim: int  # D
    dim_p2: int  # pow2(D)
    num_pages: int  # P
    page: int
    page_p2: int
    max_blocks: int  # NB
    blocks_p2: int  # pow2(NB)
    topk: int
    topk_p2: int
    local_blocks: int
    block_q: int
    pages_per_step: int
    blocks_per_split: int
    compute_dtype: jnp.dtype

    @property
    def rows(self) -> int:  # M: rows (token x head) of one query tile
        return self.block_q * self.heads_p2


# ------------------------------------------------------------------------------------------------------------
# Kernel building blocks (traced inside the kernel bodies).
# ------------------------------------------------------------------------------------------------------------


def _lanes(iota, size: int):
    """In-bounds lane offsets ``[0, pow2(size))`` for a dimension of ``size``: clamped only when padded, so an
    unpadded ``iota`` stays a plain range and Triton keeps its contiguity (16-byte vector loads)."""
    return iota if iota.shape[-1] == size else jnp.minimum(iota, size - 1)


def _locate(qsl_ref, seq_lens_ref, dims: _Dims):
    """This program's query tile (``_common.locate_tile``): ``(live, req, t0, ntok, pos0)``, tokens
    ``[t0, t0 + ntok)`` of request ``req`` (clamped to a valid row), token ``t0`` at position ``pos0``; padding-tail
    tiles are not ``live`` and only write -1, tiles past the last one have ``ntok == 0``."""
    segments = load_segments(qsl_ref, seq_lens_ref, num_rows=dims.num_requests, num_tokens=dims.num_tokens)
    req, t0, ntok, pos0 = locate_tile(
        pl.program_id(0), *segments, num_rows=dims.num_requests, block_q=dims.block_q
    )
    return req >= 0, jnp.maximum(req, 0), t0, ntok, pos0


def _tile_rows(live, t0, ntok, pos0, dims: _Dims, row_offset: int, num_rows: int):
    """Per-row metadata of rows ``row_offset + [0, num_rows)`` of a tile (row = token-in-tile * pow2(H) +
    h)."""
    m = row_offset + lax.broadcasted_iota(jnp.int32, (num_rows,), 0)
    tok = t0 + m // dims.heads_p2
    head = m % dims.heads_p2
    row_ok = (tok < t0 + ntok) & (tok < dims.num_tokens) & (head < dims.num_heads)
    flat = jnp.where(row_ok, tok * dims.num_heads + head, 0)  # row of the [T * H, ...] views
    pos = pos0 + m // dims.heads_p2
    seen = live & row_ok & (pos >= 0)
    nvis = jnp.where(seen, jnp.minimum(jnp.maximum(pos, 0) // dims.page + 1, dims.max_blocks), 0)
    return row_ok, flat, pos, nvis


def _load_queries(q_ref, flat, row_ok, dims: _Dims):
    d = lax.broadcasted_iota(jnp.int32, (dims.dim_p2,), 0)
    mask = row_ok[:, None]
    if dims.dim_p2 != dims.dim:
        mask = mask & (d < dims.dim)[None, :]
    q = plgpu.load(q_ref.at[flat[:, None], _lanes(d, dims.dim)[None, :]], mask=mask, other=0)
    return q.astype(dims.compute_dtype)  # [M, Dp]


def _score_step(q, k_ref, bt_ref, req, b0, b_hi, pos, dims: _Dims):
    """Pooled scores ``[M, pages_per_step]`` of logical blocks ``b0 + [0, pages_per_step)`` (blocks >= b_hi
    are neither read nor valid)."""
    bk = dims.pages_per_step * dims.page_p2
    kk = lax.broadcasted_iota(jnp.int32, (bk,), 0)
    blk = b0 + kk // dims.page_p2  # [BK] logical block of each key slot
    slot = kk % dims.page_p2
    kmask = blk < b_hi
    if dims.page_p2 != dims.page:
        kmask = kmask & (slot < dims.page)
    if dims.pages_per_step == 1:
        # One page: a scalar block-table read and one contiguous [page, D] tile.
        phys = jnp.clip(bt_ref[req, jnp.minimum(b0, dims.max_blocks - 1)], 0, dims.num_pages - 1)
        krow = phys * dims.page + _lanes(slot, dims.page)
    else:
        phys = plgpu.load(bt_ref.at[req, jnp.minimum(blk, dims.max_blocks - 1)], mask=kmask, other=0)
        krow = jnp.clip(phys, 0, dims.num_pages - 1) * dims.page + _lanes(slot, dims.page)
    d = lax.broadcasted_iota(jnp.int32, (dims.dim_p2,), 0)
    lmask = kmask[:, None]
    if dims.dim_p2 != dims.dim:
        lmask = lmask & (d < dims.dim)[None, :]
    k = plgpu.load(k_ref.at[krow[:, None], _lanes(d, dims.dim)[None, :]], mask=lmask, other=0)
    s = plgpu.dot(q, k.astype(dims.compute_dtype), trans_b=True, allow_tf32=False)  # [M, BK] fp32
    key_pos = blk * dims.page + slot
    ok = kmask[None, :] & (key_pos[None, :] <= pos[:, None])
    s = jnp.where(ok, s, MASK_VALUE)
    if dims.pages_per_step == 1:
        return jnp.max(s, axis=1, keepdims=True)  # [M, 1]
    return jnp.max(s.reshape(s.shape[0], dims.pages_per_step, dims.page_p2), axis=2)  # [M, PPS]


def _select_topk(scores, nvis, dims: _Dims):
    """Iterative max selection: ``[rows, NBp]`` pooled scores -> ``[rows, topk_p2]`` logical block ids.

    ``scores`` may hold anything at columns >= ``nvis`` (they are excluded); the ``local_blocks`` blocks
    ending at ``nvis - 1`` are forced; each pick takes the highest key, the lowest column on ties.
    """
    rows = scores.shape[0]
    col = lax.broadcasted_iota(jnp.int32, (rows, dims.blocks_p2), 1)
    visible = col < nvis[:, None]
    forced = visible & (col >= nvis[:, None] - dims.local_blocks)
    keys = jnp.where(forced, _FORCED, jnp.where(visible, scores, _EXCLUDED))
    k_row = jnp.minimum(nvis, dims.topk)
    kcol = lax.broadcasted_iota(jnp.int32, (rows, dims.topk_p2), 1)

    def pick(i, carry):
        keys, out = carry
        best = jnp.argmax(keys, axis=1).astype(jnp.int32)  # [rows]; ties -> lowest column
        out = jnp.where((kcol == i) & (i < k_row)[:, None], best[:, None], out)
        keys = jnp.where(col == best[:, None], _EXCLUDED, keys)
        return keys, out

    out = jnp.full((rows, dims.topk_p2), -1, jnp.int32)
    _, out = lax.fori_loop(0, dims.topk, pick, (keys, out))
    return out


def _store_selection(out_ref, flat, row_ok, sel, dims: _Dims):
    kc = lax.broadcasted_iota(jnp.int32, (dims.topk_p2,), 0)
    mask = row_ok[:, None]
    if dims.topk_p2 != dims.topk:
        mask = mask & (kc < dims.topk)[None, :]
    rows = out_of_bounds_where(row_ok, flat, dims.num_tokens * dims.num_heads)
    cols = out_of_bounds_where(kc < dims.topk, kc, dims.topk)
    plgpu.store(out_ref.at[rows[:, None], cols[None, :]], sel, mask=mask)


# ------------------------------------------------------------------------------------------------------------
# Kernel bodies.
# ------------------------------------------------------------------------------------------------------------


def _fused_kernel(
    qsl_ref,  # [R + 1] int32: query_start_loc
    seq_lens_ref,  # [R] int32
    bt_ref,  # [R, NB] int32: logical block -> physical page
    q_ref,  # [T * H, D] index queries, row t * H + h
    k_ref,  # [P * page, D] index keys, row page_id * page + slot
    out_ref,  # [T * H, topk] int32 out: selected logical blocks
    *,
    dims: _Dims,
):
    """One program = one query tile: score every visible page once, pool, then select in registers."""
    live, req, t0, ntok, pos0 = _locate(qsl_ref, seq_lens_ref, dims)
    row_ok, flat, pos, nvis = _tile_rows(live, t0, ntok, pos0, dims, 0, dims.rows)
    q = _load_queries(q_ref, flat, row_ok, dims)  # [M, Dp]
    n_blocks = visible_blocks(live, pos0, ntok, page=dims.page, max_blocks=dims.max_blocks)
    steps = (n_blocks + dims.pages_per_step - 1) // dims.pages_per_step
    col = lax.broadcasted_iota(jnp.int32, (dims.rows, dims.blocks_p2), 1)
    pcol = lax.broadcasted_iota(jnp.int32, (dims.rows, dims.pages_per_step), 1)

    def step(i, pooled):  # pooled: [M, NBp] fp32
        b0 = i * dims.pages_per_step
        s = _score_step(q, k_ref, bt_ref, req, b0, n_blocks, pos, dims)  # [M, PPS]
        if dims.pages_per_step == 1:
            return jnp.where(col == b0, s, pooled)
        for p in range(dims.pages_per_step):
            s_p = jnp.sum(jnp.where(pcol == p, s, 0.0), axis=1, keepdims=True)
            pooled = jnp.where(col == b0 + p, s_p, pooled)
        return pooled

    pooled = lax.fori_loop(0, steps, step, jnp.full((dims.rows, dims.blocks_p2), MASK_VALUE, jnp.float32))

    @pl.when(ntok > 0)  # tiles past the last one have nothing to write
    def _():
        sel = _select_topk(pooled, nvis, dims)
        _store_selection(out_ref, flat, row_ok, sel, dims)


def _split_scores_kernel(
    qsl_ref,  # [R + 1] int32: query_start_loc
    seq_lens_ref,  # [R] int32
    bt_ref,  # [R, NB] int32: logical block -> physical page
    q_ref,  # [T * H, D] index queries, row t * H + h
    k_ref,  # [P * page, D] index keys, row page_id * page + slot
    scores_ref,  # [T * H, NB] fp32 out: pooled block scores (only visible blocks are written)
    *,
    dims: _Dims,
):
    """Program (tile, split): score pages ``[split * bps, (split + 1) * bps)`` of the tile's visible range."""
    live, req, t0, ntok, pos0 = _locate(qsl_ref, seq_lens_ref, dims)
    row_ok, flat, pos, _ = _tile_rows(live, t0, ntok, pos0, dims, 0, dims.rows)
    q = _load_queries(q_ref, flat, row_ok, dims)  # [M, Dp]
    n_blocks = visible_blocks(live, pos0, ntok, page=dims.page, max_blocks=dims.max_blocks)
    b_lo = pl.program_id(1) * dims.blocks_per_split
    b_hi = jnp.minimum(n_blocks, b_lo + dims.blocks_per_split)
    steps = (jnp.maximum(b_hi - b_lo, 0) + dims.pages_per_step - 1) // dims.pages_per_step
    pp = lax.broadcasted_iota(jnp.int32, (dims.pages_per_step,), 0)

    def step(i, carry):
        b0 = b_lo + i * dims.pages_per_step
        s = _score_step(q, k_ref, bt_ref, req, b0, b_hi, pos, dims)  # [M, PPS]
        blk = b0 + pp
        mask = row_ok[:, None] & (blk < b_hi)[None, :]
        rows = out_of_bounds_where(row_ok, flat, dims.num_tokens * dims.num_heads)
        cols = out_of_bounds_where(blk < b_hi, blk, dims.max_blocks)
        plgpu.store(scores_ref.at[rows[:, None], cols[None, :]], s, mask=mask)
        return carry

    lax.fori_loop(0, steps, step, jnp.int32(0))


def _split_select_kernel(
    qsl_ref,  # [R + 1] int32: query_start_loc
    seq_lens_ref,  # [R] int32
    scores_ref,  # [T * H, NB] fp32: pooled block scores from _split_scores_kernel
    out_ref,  # [T * H, topk] int32 out: selected logical blocks
    *,
    dims: _Dims,
    select_rows: int,
):
    """Program (tile, chunk): top-k of rows ``[chunk * select_rows, (chunk + 1) * select_rows)`` of a tile."""
    live, _, t0, ntok, pos0 = _locate(qsl_ref, seq_lens_ref, dims)
    col = lax.broadcasted_iota(jnp.int32, (dims.blocks_p2,), 0)
    row_ok, flat, _, nvis = _tile_rows(
        live, t0, ntok, pos0, dims, pl.program_id(1) * select_rows, select_rows
    )

    @pl.when(ntok > 0)  # tiles past the last one have nothing to write
    def _():
        mask = (col[None, :] < nvis[:, None]) & row_ok[:, None]
        scores = plgpu.load(
            scores_ref.at[flat[:, None], _lanes(col, dims.max_blocks)[None, :]], mask=mask, other=_EXCLUDED
        )  # [rows, NBp]
        sel = _select_topk(scores, nvis, dims)
        _store_selection(out_ref, flat, row_ok, sel, dims)


# ------------------------------------------------------------------------------------------------------------
# Wrapper and public entry point.
# ------------------------------------------------------------------------------------------------------------


def _validate(index_q, index_k_cache, block_tables, seq_lens, query_start_loc, topk, local_blocks):
    if index_q.ndim != 3:
        raise ValueError(f"index_q must be [T, H_idx, D_idx], got shape {index_q.shape}")
    if index_k_cache.ndim != 3:
        raise ValueError(f"index_k_cache must be [P, page, D_idx], got shape {index_k_cache.shape}")
    if index_k_cache.shape[2] != index_q.shape[2]:
        raise ValueError(f"index_q {index_q.shape} and index_k_cache {index_k_cache.shape} disagree on D_idx")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [R, max_blocks], got shape {block_tables.shape}")
    if seq_lens.ndim != 1 or seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"seq_lens must be [R] = [{block_tables.shape[0]}], got shape {seq_lens.shape}")
    if query_start_loc.ndim != 1 or query_start_loc.shape[0] != block_tables.shape[0] + 1:
        raise ValueError(
            f"query_start_loc must be [R + 1] = [{block_tables.shape[0] + 1}], "
            f"got shape {query_start_loc.shape}"
        )
    for name, a in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {a.dtype}")
    for name, a in (("index_q", index_q), ("index_k_cache", index_k_cache)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating array, got {a.dtype}")
    if block_tables.shape[0] < 1 or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must have R >= 1 and max_blocks >= 1, got shape {block_tables.shape}")
    if min(index_q.shape) < 1 or min(index_k_cache.shape) < 1:
        raise ValueError(f"empty index_q {index_q.shape} or index_k_cache {index_k_cache.shape}")
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if not isinstance(local_blocks, int) or local_blocks < 0:
        raise ValueError(f"local_blocks must be a non-negative int, got {local_blocks!r}")


def _unsupported(*, page_size: int, index_head_dim: int, num_index_heads: int, dtype, interpret: bool):
    """Why the kernel cannot run these shapes (``None`` when it can); see :func:`supports`."""
    if min(page_size, index_head_dim, num_index_heads) < 1:
        return f"page {page_size}, D_idx {index_head_dim} and H_idx {num_index_heads} must be >= 1"
    if not jnp.issubdtype(dtype, jnp.floating):
        return f"index queries and keys must be floating, got {jnp.dtype(dtype).name}"
    if interpret:
        return None
    if jnp.dtype(dtype).name not in COMPILED_DTYPES:
        return f"compiled kernels take {', '.join(COMPILED_DTYPES)}, got {jnp.dtype(dtype).name}"
    if next_pow2(index_head_dim) < MIN_DOT_DIM:
        return (
            f"compiled Triton dots need K >= {MIN_DOT_DIM}: D_idx {index_head_dim} pads to "
            f"{next_pow2(index_head_dim)}"
        )
    return None


def supports(
    *,
    page_size: int,
    index_head_dim: int,
    num_index_heads: int,
    dtype,
    chip: str | None = None,
    interpret: bool = False,
) -> bool:
    """Whether ``ragged_index_topk`` runs these shapes, compiled for ``chip`` (a chip of ``tuning.CHIPS``;
    ``None``: the default device's) or in interpret mode.

    Compiled: bf16, f16 or f32 index queries and keys, and ``D_idx`` padded to a power of 2 at least 16 (the dot's
    K). Every page size works (pages under 16 keys are scored several per step, so the dot's N stays >= 16), and
    every number of index heads (the policy's ``block_q`` keeps the dot's M >= 16); ``topk`` and
    ``local_blocks`` are free. Every chip has the same limits today. Interpret mode: any floating dtype.
    """
    resolve_chip(chip)
    return (
        _unsupported(
            page_size=page_size,
            index_head_dim=index_head_dim,
            num_index_heads=num_index_heads,
            dtype=dtype,
            interpret=interpret,
        )
        is None
    )


def _ragged_index_topk_pallas(
    index_q,
    index_k_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    *,
    topk,
    local_blocks,
    cfg: IndexerLaunchConfig,
    interpret: bool,
):
    t, h, d = index_q.shape
    p, page, _ = index_k_cache.shape
    r, nb = block_tables.shape
    cfg.validate()
    for dtype in (index_q.dtype, index_k_cache.dtype):
        reason = _unsupported(
            page_size=page, index_head_dim=d, num_index_heads=h, dtype=dtype, interpret=interpret
        )
        if reason:
            raise ValueError(f"ragged_index_topk: {reason}; use implementation='reference'")
    hp = next_pow2(h)
    if cfg.block_q * hp < MIN_DOT_DIM and not interpret:
        raise ValueError(f"block_q * pow2(H_idx) = {cfg.block_q} * {hp} must be >= {MIN_DOT_DIM} (Triton dot M)")
    if not interpret and next_pow2(page) * cfg.pages_per_step < MIN_DOT_DIM:
        raise ValueError(
            f"page {page} x pages_per_step {cfg.pages_per_step} must be >= {MIN_DOT_DIM} (Triton dot N)"
        )
    blocks_per_split = cdiv(cdiv(nb, cfg.num_splits), cfg.pages_per_step) * cfg.pages_per_step
    num_splits = cdiv(nb, blocks_per_split)
    dims = _Dims(
        num_tokens=t,
        num_requests=r,
        num_heads=h,
        heads_p2=hp,
        dim=d,
        dim_p2=next_pow2(d),
        num_pages=p,
        page=page,
        page_p2=next_pow2(page),
        max_blocks=nb,
        blocks_p2=next_pow2(nb),
        topk=topk,
        topk_p2=next_pow2(topk),
        local_blocks=local_blocks,
        block_q=cfg.block_q,
        pages_per_step=cfg.pages_per_step,
        blocks_per_split=blocks_per_split,
        compute_dtype=jnp.promote_types(index_q.dtype, index_k_cache.dtype),
    )
    num_tiles = num_tiles_bound(t, r, cfg.block_q)
    qsl = query_start_loc.astype(jnp.int32)
    seq = seq_lens.astype(jnp.int32)
    q2 = index_q.reshape(t * h, d)
    k2 = index_k_cache.reshape(p * page, d)
    out_shape = jax.ShapeDtypeStruct((t * h, topk), jnp.int32)
    tag = f"bq{cfg.block_q}_pps{cfg.pages_per_step}"
    if num_splits == 1:
        out = pl.pallas_call(
            functools.partial(_fused_kernel, dims=dims),
            out_shape=out_shape,
            grid=(num_tiles,),
            compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            interpret=interpret,
            name=f"ragged_index_topk_fused_{tag}",
        )(qsl, seq, block_tables.astype(jnp.int32), q2, k2)
    else:
        scores = pl.pallas_call(
            functools.partial(_split_scores_kernel, dims=dims),
            out_shape=jax.ShapeDtypeStruct((t * h, nb), jnp.float32),
            grid=(num_tiles, num_splits),
            compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            interpret=interpret,
            name=f"ragged_index_scores_{tag}_split{num_splits}",
        )(qsl, seq, block_tables.astype(jnp.int32), q2, k2)
        select_rows = min(cfg.select_rows, dims.rows)
        out = pl.pallas_call(
            functools.partial(_split_select_kernel, dims=dims, select_rows=select_rows),
            out_shape=out_shape,
            grid=(num_tiles, dims.rows // select_rows),
            compiler_params=plgpu.CompilerParams(num_warps=cfg.select_num_warps, num_stages=1),
            interpret=interpret,
            name=f"ragged_index_select_bq{cfg.block_q}_rows{select_rows}",
        )(qsl, seq, scores)
    return out.reshape(t, h, topk)


@functools.partial(
    jax.jit,
    static_argnames=(
        "topk",
        "local_blocks",
        "interpret",
        "implementation",
        "block_q",
        "pages_per_step",
        "num_splits",
        "num_warps",
        "num_stages",
        "select_rows",
        "select_num_warps",
        "chip",
    ),
)
def ragged_index_topk(
    index_q: jax.Array,
    index_k_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    topk: int,
    local_blocks: int = 1,
    interpret: bool | None = None,
    implementation: str = "pallas",
    block_q: int | None = None,
    pages_per_step: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    select_rows: int | None = None,
    select_num_warps: int | None = None,
    chip: str | None = None,
) -> jax.Array:
    """Top-k index blocks per (packed token, index head) of a ragged batch over a paged index-key cache.

    Args:
      index_q: ``[T, H_idx, D_idx]`` index queries (RoPE applied), packed tokens of all requests.
      index_k_cache: ``[P, page, D_idx]`` paged index keys; ``page`` is the index block size.
      block_tables: ``int32[R, max_blocks]`` logical block -> physical page of each request row.
      seq_lens: ``int32[R]`` context lengths including this step's tokens (0 for padding rows).
      query_start_loc: ``int32[R + 1]`` token offsets of the request rows (non-decreasing).
      topk: blocks per (token, head). local_blocks: blocks ending at the token's own block that always win.
      interpret: Pallas interpret mode; ``None`` = interpret on CPU, compiled Triton on GPU (CUDA or ROCm).
      implementation: ``"pallas"`` or ``"reference"`` (the plain-jnp ``ragged_index_topk_reference``).
      block_q, pages_per_step, num_splits, num_warps, num_stages, select_rows, select_num_warps: launch
        overrides; ``None`` takes ``tuning.indexer_launch_config``'s choice for the shapes and ``chip``.
      chip: a chip of ``tuning.CHIPS`` whose launch table to use (``None``: the default device's).

    Returns:
      ``int32[T, H_idx, topk]`` logical block ids: left-packed, descending score (local blocks first), ties to
      the lower block id, -1 padded; all -1 for padding slots.
    """
    _validate(index_q, index_k_cache, block_tables, seq_lens, query_start_loc, topk, local_blocks)
    if implementation == "reference":
        return ragged_index_topk_reference(
            index_q,
            index_k_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            topk=topk,
            local_blocks=local_blocks,
        )
    if implementation != "pallas":
        raise ValueError(f"implementation must be 'pallas' or 'reference', got {implementation!r}")
    t, h, _ = index_q.shape
    r, nb = block_tables.shape
    cfg = indexer_launch_config(
        num_tokens=t, num_requests=r, num_heads=h, max_blocks=nb, page_size=index_k_cache.shape[1], chip=chip
    )
    overrides = {
        "block_q": block_q,
        "pages_per_step": pages_per_step,
        "num_splits": num_splits,
        "num_warps": num_warps,
        "num_stages": num_stages,
        "select_rows": select_rows,
        "select_num_warps": select_num_warps,
    }
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    return _ragged_index_topk_pallas(
        index_q,
        index_k_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        topk=topk,
        local_blocks=local_blocks,
        cfg=cfg,
        interpret=resolve_interpret(interpret),
    )


def ragged_index_topk_reference(
    index_q: jax.Array,
    index_k_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    topk: int,
    local_blocks: int = 1,
    interpret: bool | None = None,
    implementation: str = "reference",
    block_q: int | None = None,
    pages_per_step: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    select_rows: int | None = None,
    select_num_warps: int | None = None,
    chip: str | None = None,
) -> jax.Array:
    """Plain-jnp ``ragged_index_topk``: the kernel's parameters and result; ``implementation``, ``interpret``,
    the launch tunables and ``chip`` are named and ignored (changing them reuses the compiled program).

    Scores one logical block of every token per step (``lax.map`` over blocks), reading each token's keys
    through its request's block table, then selects with ``lax.top_k`` (ties to the lower index).
    """
    del interpret, implementation, block_q, pages_per_step, num_splits, num_warps, num_stages
    del select_rows, select_num_warps, chip
    _validate(index_q, index_k_cache, block_tables, seq_lens, query_start_loc, topk, local_blocks)
    return _reference_jit(
        index_q, index_k_cache, block_tables, seq_lens, query_start_loc, topk=topk, local_blocks=local_blocks
    )


def index_block_scores_reference(index_q, index_k_cache, block_tables, seq_lens, query_start_loc):
    """``float32[T, H_idx, max_blocks]`` causal block max-pooled index scores (before local forcing).

    Entry ``[t, h, b]`` is ``max_{j in block b, j <= pos(t)} index_q[t, h] . kI[j]`` for visible blocks
    ``b <= pos // page``; ``-inf`` for invisible blocks and padding slots. Used by the reference and by parity
    checks that compare selections by score (kernels may legitimately differ on exact fp32 ties).
    """
    _validate(index_q, index_k_cache, block_tables, seq_lens, query_start_loc, 1, 0)
    pooled, nvis = _reference_scores(index_q, index_k_cache, block_tables, seq_lens, query_start_loc)
    visible = jnp.arange(block_tables.shape[1])[None, None, :] < nvis[:, None, None]
    return jnp.where(visible, pooled, _EXCLUDED)


@jax.jit
def _reference_scores(index_q, index_k_cache, block_tables, seq_lens, query_start_loc):
    t, _h, _d = index_q.shape
    p, page, _ = index_k_cache.shape
    _r, nb = block_tables.shape
    qsl = query_start_loc.astype(jnp.int32)
    req = token_to_request(qsl, t)
    pos = token_positions(qsl, seq_lens.astype(jnp.int32), req)
    nvis = jnp.where((req >= 0) & (pos >= 0), jnp.minimum(jnp.maximum(pos, 0) // page + 1, nb), 0)  # [T]
    q32 = index_q.astype(jnp.float32)
    table_rows = block_tables.astype(jnp.int32)[jnp.maximum(req, 0)]  # [T, NB]
    slot = jnp.arange(page, dtype=jnp.int32)

    def block_scores(b):  # -> [T, H] pooled scores of logical block b
        phys = jnp.where(
            b < nvis, jnp.clip(table_rows[:, b], 0, p - 1), 0
        )  # unused entries never dereferenced
        keys = index_k_cache[phys].astype(jnp.float32)  # [T, page, D]
        s = jnp.einsum("thd,tjd->thj", q32, keys, precision=lax.Precision.HIGHEST)
        s = jnp.where((b * page + slot)[None, None, :] <= pos[:, None, None], s, MASK_VALUE)
        return jnp.max(s, axis=-1)

    pooled = jnp.moveaxis(lax.map(block_scores, jnp.arange(nb, dtype=jnp.int32)), 0, -1)  # [T, H, NB]
    return pooled, nvis


@functools.partial(jax.jit, static_argnames=("topk", "local_blocks"))
def _reference_jit(index_q, index_k_cache, block_tables, seq_lens, query_start_loc, *, topk, local_blocks):
    nb = block_tables.shape[1]
    pooled, nvis = _reference_scores(index_q, index_k_cache, block_tables, seq_lens, query_start_loc)
    col = jnp.arange(nb, dtype=jnp.int32)
    visible = col[None, None, :] < nvis[:, None, None]
    forced = visible & (col[None, None, :] >= nvis[:, None, None] - local_blocks)
    keys = jnp.where(forced, _FORCED, jnp.where(visible, pooled, _EXCLUDED))
    if nb < topk:
        keys = jnp.pad(keys, ((0, 0), (0, 0), (0, topk - nb)), constant_values=_EXCLUDED)
    _, idx = lax.top_k(keys, topk)  # ties: lower index first
    k = jnp.minimum(nvis, topk)
    return jnp.where(jnp.arange(topk)[None, None, :] < k[:, None, None], idx.astype(jnp.int32), -1)
