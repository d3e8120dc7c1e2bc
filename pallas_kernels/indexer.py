"""Ragged MSA indexer: per-token top-k key blocks over a paged index-key cache (SPEC sections 2, 4, 5).

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

* The grid runs over *query tiles*: request ``r`` contributes ``cdiv(q_len, block_q)`` tiles of up to
  ``block_q`` consecutive tokens. ``tile_starts = cumsum(tiles per request)`` is computed on the device, and
  each program finds its request by a device-side search over it (a B-ary search: one vector probe per level).
  The grid is a static bound on the tiles of any valid batch (``_num_tiles``); the tiles past the last
  request's cover the padding slots. Nothing uses ``max_query_len`` or host lengths.
* One program loads each index-key page of its request once and scores *all* its tokens x index heads against
  it with one 2-D dot (``[block_q * H, D] x [D, page]``): the tokens of a request share their key reads.
* ``fused`` path (``num_splits == 1``): the program keeps the pooled block scores
  ``[block_q * H, max_blocks]`` in registers and runs the top-k selection (iterative max selection) as its
  epilogue: one kernel.
* ``split`` path: the key range of a tile is split across ``num_splits`` programs (few requests with long
  contexts still fill the chip); they write pooled scores to an fp32 scratch ``[T * H, max_blocks]`` and a
  second kernel over the same tiles does the selection. No host round trip in either path.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.metadata import token_positions, token_to_request
from pallas_kernels.platform import on_gpu, resolve_interpret

# Score of a key hidden by the causal mask: finite, so a fully masked block pools to a number, never NaN.
MASKED_SCORE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Selection keys: a forced (local) block beats every score, an invisible or already chosen block loses to all.
_FORCED = float("inf")
_EXCLUDED = float("-inf")


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------------------------
# Launch configuration: a dataclass and a per-chip policy table.
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IndexerLaunchConfig:
    """Static launch settings of one ``ragged_index_topk`` call.

    block_q: query tokens per program (power of 2; ``block_q * pow2(H)`` is the dot's M and must be >= 16).
    pages_per_step: key pages loaded and scored per loop iteration (power of 2).
    num_splits: programs sharing one query tile's key range; 1 selects the fused single-kernel path.
    num_warps / num_stages: Triton settings of the scoring kernel.
    select_rows: rows (token x head) per selection chunk of the split path's selection kernel (power of 2).
    select_num_warps: Triton warps of that selection kernel.
    """

    block_q: int = 8
    pages_per_step: int = 1
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3
    select_rows: int = 16
    select_num_warps: int = 4

    def validate(self) -> None:
        for name in ("block_q", "pages_per_step", "select_rows"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of 2, got {v}")
        if self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        for name in ("num_warps", "select_num_warps"):
            v = getattr(self, name)
            if v < 1 or v > 16 or v & (v - 1):  # <= 16: AMD wavefronts are 64 lanes wide
                raise ValueError(f"{name} must be a power of 2 in [1, 16], got {v}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


@dataclasses.dataclass(frozen=True)
class ChipPolicy:
    """Per-chip knobs of the policy function (retune here, nowhere else)."""

    num_cores: int  # SMs (NVIDIA) or CUs (AMD)
    num_warps: int  # scoring kernel, for score tiles up to 4096 elements; doubled above
    num_stages: int  # software pipelining depth of the key loop
    programs_per_core: int  # resident programs to aim for when splitting the key range
    max_block_q: int  # largest query tile (prefill chunks)
    fused_max_elems: int  # largest pooled-score tile [block_q * H, max_blocks] kept in registers (fused)
    select_elems: int = 1024  # pooled scores per program of the split path's selection kernel
    long_context_blocks: int = 128  # from this many blocks per request on, split the key range ...
    long_context_splits: int = 4  # ... at least this many ways: ragged context lengths unbalance programs


CHIP_POLICIES: dict[str, ChipPolicy] = {
    # Hopper: 132 SMs (H100 SXM / H200), 228 KiB shared memory per SM.
    "hopper": ChipPolicy(
        num_cores=132, num_warps=4, num_stages=3, programs_per_core=4, max_block_q=32, fused_max_elems=8192
    ),
    # CDNA3 (MI300X, gfx942): 304 CUs, 64 KiB LDS per CU: shallower pipelines.
    "cdna3": ChipPolicy(
        num_cores=304, num_warps=4, num_stages=2, programs_per_core=2, max_block_q=32, fused_max_elems=8192
    ),
    # Anything else (Ampere, interpret mode on CPU, unknown parts).
    "default": ChipPolicy(
        num_cores=108, num_warps=4, num_stages=2, programs_per_core=4, max_block_q=32, fused_max_elems=8192
    ),
}


def chip_family(device_kind: str | None = None) -> str:
    """Map a device kind (``jax.devices()[0].device_kind``) to a key of ``CHIP_POLICIES``."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind if on_gpu() else ""
    kind = device_kind.lower()
    if any(n in kind for n in ("h100", "h200", "h800", "h20", "gh200")):
        return "hopper"
    if any(n in kind for n in ("gfx942", "mi300", "mi325", "gfx950", "mi350", "mi355")):
        return "cdna3"
    return "default"


def indexer_launch_config(
    *,
    num_tokens: int,
    num_requests: int,
    num_heads: int,
    max_blocks: int,
    page_size: int,
    chip: str | None = None,
) -> IndexerLaunchConfig:
    """Launch settings from static shapes only (``T``, ``R``, ``H``, ``max_blocks``, page) and the chip."""
    pol = CHIP_POLICIES[chip if chip is not None else chip_family()]
    hp = _next_pow2(num_heads)
    min_block_q = max(1, 16 // hp)  # the dot needs M >= 16
    avg_q = _cdiv(max(num_tokens, 1), max(num_requests, 1))
    block_q = min(max(_next_pow2(avg_q), min_block_q), max(pol.max_block_q, min_block_q))
    page_p2 = _next_pow2(page_size)
    m = block_q * hp
    num_warps = pol.num_warps if m * page_p2 <= 4096 else 2 * pol.num_warps
    # Tiles that will hold tokens: one per request for short queries, else T / block_q.
    live_tiles = max(1, min(num_requests, num_tokens) if avg_q <= block_q else _cdiv(num_tokens, block_q))
    target = pol.num_cores * pol.programs_per_core
    min_blocks_per_split = 4
    max_splits = max(1, _cdiv(max_blocks, min_blocks_per_split))
    num_splits = max(1, min(target // live_tiles, max_splits))
    if max_blocks >= pol.long_context_blocks:
        # One program per request waits for the longest context; 4 splits cut the ragged 512 x 1..8 x <=32K
        # batch from 667 to 601 us on the H200 (docs/bench_results/indexer_h200.json).
        num_splits = max(num_splits, min(pol.long_context_splits, max_splits))
    if num_splits == 1 and m * _next_pow2(max_blocks) > pol.fused_max_elems:
        num_splits = 2  # pooled scores too large for registers: go through the scratch + selection kernel
    # Selection is a chain of topk dependent row reductions: many small programs (about 1024 scores each, one
    # warp) finish it with the least latency.
    nb_p2 = _next_pow2(max_blocks)
    select_rows = max(1, min(m, pol.select_elems // nb_p2))
    select_num_warps = min(4, max(1, select_rows * nb_p2 // pol.select_elems))
    # The dot's N is page x pages_per_step and must be >= 16: small pages are scored several at a time.
    pages_per_step = max(1, 16 // page_p2)
    return IndexerLaunchConfig(
        block_q=block_q,
        pages_per_step=pages_per_step,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=pol.num_stages,
        select_rows=select_rows,
        select_num_warps=select_num_warps,
    )


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
    search_width: int
    search_levels: int
    compute_dtype: jnp.dtype

    @property
    def rows(self) -> int:  # M: rows (token x head) of one query tile
        return self.block_q * self.heads_p2


# ------------------------------------------------------------------------------------------------------------
# Kernel building blocks (traced inside the kernel bodies).
# ------------------------------------------------------------------------------------------------------------


def _masked_index(idx, ok, size: int):
    """Store index of masked lanes: ``size`` (out of bounds) where ``ok`` is False.

    Compiled kernels never touch masked lanes; interpret mode discharges a masked store as a scatter that
    writes the old value back on masked lanes, so they must not alias a live lane: out-of-bounds scatter
    updates are dropped.
    """
    return jnp.where(ok, idx, size)


def _lanes(iota, size: int):
    """In-bounds lane offsets ``[0, pow2(size))`` for a dimension of ``size``: clamped only when padded, so an
    unpadded ``iota`` stays a plain range and Triton keeps its contiguity (16-byte vector loads)."""
    return iota if iota.shape[-1] == size else jnp.minimum(iota, size - 1)


def _count_le(sorted_ref, value, *, n: int, width: int, levels: int):
    """Number of entries of the non-decreasing ``sorted_ref[1 : n + 1]`` that are <= ``value``.

    A B-ary search (B = ``width``): each level probes ``width`` evenly spaced entries with one vector load and
    narrows the range by a factor ``width``; ``levels`` levels cover ``width ** levels >= n`` entries.
    """
    base = jnp.int32(0)
    lane = lax.broadcasted_iota(jnp.int32, (width,), 0)
    for level in range(levels):
        stride = width ** (levels - 1 - level)
        idx = base + (lane + 1) * stride - 1  # [width] candidate positions in [0, n)
        ok = idx < n
        vals = plgpu.load(sorted_ref.at[jnp.where(ok, idx, 0) + 1], mask=ok, other=jnp.iinfo(jnp.int32).max)
        base = base + jnp.sum((ok & (vals <= value)).astype(jnp.int32)) * stride
    return base


def _locate_tile(tile_starts_ref, qsl_ref, seq_lens_ref, dims: _Dims):
    """Request and token range of this program's query tile.

    Returns ``(live, req, t0, t_end, pos0)``: the tile holds tokens ``[t0, min(t0 + block_q, t_end))`` of
    request ``req`` (``live``), token ``t0`` sits at position ``pos0``. Tiles past the last request's cover
    the padding slots ``[qsl[R], T)``: ``live`` is False there and they only write -1.
    """
    tile = pl.program_id(0)
    r_count = dims.num_requests
    req = _count_le(tile_starts_ref, tile, n=r_count, width=dims.search_width, levels=dims.search_levels)
    live = req < r_count
    rc = jnp.minimum(req, r_count - 1)
    q_begin = qsl_ref[rc]
    q_end = qsl_ref[rc + 1]
    t0_live = q_begin + (tile - tile_starts_ref[rc]) * dims.block_q
    pos0 = seq_lens_ref[rc] - (q_end - q_begin) + (t0_live - q_begin)
    t0_pad = qsl_ref[r_count] + (tile - tile_starts_ref[r_count]) * dims.block_q
    t0 = jnp.where(live, t0_live, t0_pad)
    t_end = jnp.where(live, q_end, dims.num_tokens)
    return live, rc, t0, t_end, pos0


def _tile_rows(live, t0, t_end, pos0, dims: _Dims, row_offset: int, num_rows: int):
    """Per-row metadata of rows ``row_offset + [0, num_rows)`` of a tile (row = token-in-tile * pow2(H) +
    h)."""
    m = row_offset + lax.broadcasted_iota(jnp.int32, (num_rows,), 0)
    tok = t0 + m // dims.heads_p2
    head = m % dims.heads_p2
    row_ok = (tok < t_end) & (tok < dims.num_tokens) & (head < dims.num_heads)
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
    s = jnp.where(ok, s, MASKED_SCORE)
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
    rows = _masked_index(flat, row_ok, dims.num_tokens * dims.num_heads)
    cols = _masked_index(kc, kc < dims.topk, dims.topk)
    plgpu.store(out_ref.at[rows[:, None], cols[None, :]], sel, mask=mask)


def _tile_block_range(live, t0, t_end, pos0, dims: _Dims):
    """Number of blocks visible to the last token of the tile."""
    n_tok = jnp.minimum(t_end - t0, dims.block_q)
    last_pos = pos0 + n_tok - 1
    return jnp.where(
        live & (n_tok > 0) & (last_pos >= 0),
        jnp.minimum(jnp.maximum(last_pos, 0) // dims.page + 1, dims.max_blocks),
        0,
    )


# ------------------------------------------------------------------------------------------------------------
# Kernel bodies.
# ------------------------------------------------------------------------------------------------------------


def _fused_kernel(
    tile_starts_ref,  # [R + 1] int32: first query tile of each request; [R] = number of live tiles
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
    live, req, t0, t_end, pos0 = _locate_tile(tile_starts_ref, qsl_ref, seq_lens_ref, dims)
    row_ok, flat, pos, nvis = _tile_rows(live, t0, t_end, pos0, dims, 0, dims.rows)
    q = _load_queries(q_ref, flat, row_ok, dims)  # [M, Dp]
    n_blocks = _tile_block_range(live, t0, t_end, pos0, dims)
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

    pooled = lax.fori_loop(0, steps, step, jnp.full((dims.rows, dims.blocks_p2), MASKED_SCORE, jnp.float32))

    @pl.when(t0 < dims.num_tokens)  # tiles wholly past the packed slots have nothing to write
    def _():
        sel = _select_topk(pooled, nvis, dims)
        _store_selection(out_ref, flat, row_ok, sel, dims)


def _split_scores_kernel(
    tile_starts_ref,  # [R + 1] int32: first query tile of each request
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
    live, req, t0, t_end, pos0 = _locate_tile(tile_starts_ref, qsl_ref, seq_lens_ref, dims)
    row_ok, flat, pos, _ = _tile_rows(live, t0, t_end, pos0, dims, 0, dims.rows)
    q = _load_queries(q_ref, flat, row_ok, dims)  # [M, Dp]
    n_blocks = _tile_block_range(live, t0, t_end, pos0, dims)
    b_lo = pl.program_id(1) * dims.blocks_per_split
    b_hi = jnp.minimum(n_blocks, b_lo + dims.blocks_per_split)
    steps = (jnp.maximum(b_hi - b_lo, 0) + dims.pages_per_step - 1) // dims.pages_per_step
    pp = lax.broadcasted_iota(jnp.int32, (dims.pages_per_step,), 0)

    def step(i, carry):
        b0 = b_lo + i * dims.pages_per_step
        s = _score_step(q, k_ref, bt_ref, req, b0, b_hi, pos, dims)  # [M, PPS]
        blk = b0 + pp
        mask = row_ok[:, None] & (blk < b_hi)[None, :]
        rows = _masked_index(flat, row_ok, dims.num_tokens * dims.num_heads)
        cols = _masked_index(blk, blk < b_hi, dims.max_blocks)
        plgpu.store(scores_ref.at[rows[:, None], cols[None, :]], s, mask=mask)
        return carry

    lax.fori_loop(0, steps, step, jnp.int32(0))


def _split_select_kernel(
    tile_starts_ref,  # [R + 1] int32: first query tile of each request
    qsl_ref,  # [R + 1] int32: query_start_loc
    seq_lens_ref,  # [R] int32
    scores_ref,  # [T * H, NB] fp32: pooled block scores from _split_scores_kernel
    out_ref,  # [T * H, topk] int32 out: selected logical blocks
    *,
    dims: _Dims,
    select_rows: int,
):
    """Program (tile, chunk): top-k of rows ``[chunk * select_rows, (chunk + 1) * select_rows)`` of a tile."""
    live, _, t0, t_end, pos0 = _locate_tile(tile_starts_ref, qsl_ref, seq_lens_ref, dims)
    col = lax.broadcasted_iota(jnp.int32, (dims.blocks_p2,), 0)
    row_ok, flat, _, nvis = _tile_rows(
        live, t0, t_end, pos0, dims, pl.program_id(1) * select_rows, select_rows
    )

    @pl.when(t0 < dims.num_tokens)  # tiles wholly past the packed slots have nothing to write
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


def _num_tiles(num_tokens: int, num_requests: int, block_q: int) -> int:
    """Static bound on the query tiles of any valid batch, padding-slot tiles included.

    A non-empty request wastes at most ``block_q - 1`` slots of its last tile, at most ``min(R, T)`` requests
    are non-empty, and the padding slots ``[qsl[R], T)`` take ``cdiv(T - qsl[R], block_q)`` more tiles, so
    ``sum_r cdiv(q_r, block_q) + cdiv(T - N, block_q) <= (T + (min(R, T) + 1) * (block_q - 1)) // block_q``.
    """
    return (num_tokens + (min(num_requests, num_tokens) + 1) * (block_q - 1)) // block_q


def _tile_starts(query_start_loc, block_q: int):
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    tiles = (jnp.maximum(q_lens, 0) + block_q - 1) // block_q
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles, dtype=jnp.int32)])


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
    hp = _next_pow2(h)
    if cfg.block_q * hp < 16 and not interpret:
        raise ValueError(f"block_q * pow2(H_idx) = {cfg.block_q} * {hp} must be >= 16 (Triton dot M)")
    if not interpret and (_next_pow2(page) * cfg.pages_per_step < 16 or _next_pow2(d) < 16):
        raise ValueError(
            f"page {page} x pages_per_step {cfg.pages_per_step} and D_idx {d} must be >= 16 "
            "for the Triton dot"
        )
    width = max(16, min(_next_pow2(r), 1024))  # one probe level up to R = 1024
    levels = max(1, math.ceil(math.log(max(r, 2), width)))
    while width**levels < r:
        levels += 1
    blocks_per_split = _cdiv(_cdiv(nb, cfg.num_splits), cfg.pages_per_step) * cfg.pages_per_step
    num_splits = _cdiv(nb, blocks_per_split)
    dims = _Dims(
        num_tokens=t,
        num_requests=r,
        num_heads=h,
        heads_p2=hp,
        dim=d,
        dim_p2=_next_pow2(d),
        num_pages=p,
        page=page,
        page_p2=_next_pow2(page),
        max_blocks=nb,
        blocks_p2=_next_pow2(nb),
        topk=topk,
        topk_p2=_next_pow2(topk),
        local_blocks=local_blocks,
        block_q=cfg.block_q,
        pages_per_step=cfg.pages_per_step,
        blocks_per_split=blocks_per_split,
        search_width=width,
        search_levels=levels,
        compute_dtype=jnp.promote_types(index_q.dtype, index_k_cache.dtype),
    )
    num_tiles = _num_tiles(t, r, cfg.block_q)
    qsl = query_start_loc.astype(jnp.int32)
    tile_starts = _tile_starts(qsl, cfg.block_q)
    meta = (tile_starts, qsl, seq_lens.astype(jnp.int32), block_tables.astype(jnp.int32))
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
        )(*meta, q2, k2)
    else:
        scores = pl.pallas_call(
            functools.partial(_split_scores_kernel, dims=dims),
            out_shape=jax.ShapeDtypeStruct((t * h, nb), jnp.float32),
            grid=(num_tiles, num_splits),
            compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            interpret=interpret,
            name=f"ragged_index_scores_{tag}_split{num_splits}",
        )(*meta, q2, k2)
        select_rows = min(cfg.select_rows, dims.rows)
        out = pl.pallas_call(
            functools.partial(_split_select_kernel, dims=dims, select_rows=select_rows),
            out_shape=out_shape,
            grid=(num_tiles, dims.rows // select_rows),
            compiler_params=plgpu.CompilerParams(num_warps=cfg.select_num_warps, num_stages=1),
            interpret=interpret,
            name=f"ragged_index_select_bq{cfg.block_q}_rows{select_rows}",
        )(tile_starts, qsl, seq_lens.astype(jnp.int32), scores)
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
        overrides; ``None`` takes ``indexer_launch_config``'s choice for the shapes and ``chip``.
      chip: a key of ``CHIP_POLICIES`` (default: detected from the device).

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
    **unused_tunables,
) -> jax.Array:
    """Plain-jnp ``ragged_index_topk`` (same signature and result; ``interpret`` and tunables are ignored).

    Scores one logical block of every token per step (``lax.map`` over blocks), reading each token's keys
    through its request's block table, then selects with ``lax.top_k`` (ties to the lower index).
    """
    del interpret, unused_tunables
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
        s = jnp.where((b * page + slot)[None, None, :] <= pos[:, None, None], s, MASKED_SCORE)
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
