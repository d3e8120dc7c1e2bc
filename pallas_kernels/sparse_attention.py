"""Ragged block-sparse (MSA) attention over a paged KV cache: one Pallas (Triton) kernel, its jnp reference.

Contract (SPEC sections 3-5). Packed queries ``q: [T, H_q, D]``; paged caches ``k_cache, v_cache: [H_kv, P,
page, D]``; ``block_tables: int32[R, max_blocks]`` map a request's logical block to a physical page;
``seq_lens: int32[R]`` include this step's tokens; ``query_start_loc: int32[R + 1]`` (request ``r`` owns
packed tokens ``[qsl[r], qsl[r + 1])``, zero-length padding rows allowed, slots at or beyond ``qsl[R]`` are
padding); ``block_indices: int32[T, H_kv, topk]`` logical block ids per (token, KV group), left-packed, ``-1``
padded.

Token ``t`` of request ``r`` (absolute position ``pos``) and query head ``qh`` of KV group ``g = qh // (H_q //
H_kv)`` attend to the keys ``{j : j // page in block_indices[t, g], j <= pos}`` with softmax scale ``scale``;
the softmax runs online in fp32 and the output has q's dtype. Padding slots and tokens without a visible
selected key get exact zeros (never NaN). Every token keeps its own selection and causal limit.

Algorithm (docs/kernels/sparse_attention.md has the bytes and FLOP model and the H200 measurements). One
program owns one *request tile* (up to ``block_q`` consecutive tokens of one request) and one KV head; its query
tile is ``block_q x group`` rows (e.g. 4 tokens x 16 heads = 64 rows) that share every K/V load. Two or three
kernels, no XLA glue:

1. Pre-pass (``_tile_union_kernel``, one program per (tile, KV head)): finds the tile's tokens by a search over
   ``query_start_loc`` (``_locate_tile``) and writes the tile table. Sparse: it writes the *union* of the
   tile's visible selections (``-1`` slots and blocks past the tile's last position dropped, repeats once) in
   ascending block order as dense int32 rows -- physical page, logical block, token bitmask (bit i: token i of
   the tile selected the block) -- plus two counts (past blocks, union size). It walks the block ids in chunks,
   comparing the tile's ``[block_q, topk]`` selections against ``chunk`` ids at a time.
2. The walk (``_ragged_attention_kernel``): per step one scalar load of the page id from those rows (the
   standard paged-attention indirect load: Triton's software pipeliner gives it its own stage before the K/V
   copy), a ``block_k``-key K/V slice, ``S = Q K^T``, online softmax, ``acc += P V``. *Past* blocks (ending at
   or before the tile's first position) need no causal mask: a row whose token did not pick the block keeps its
   state (its max is replaced by a huge value, so its probabilities are exactly 0), no per-score work. The at
   most ``cdiv(block_q - 1, page) + 1`` *causal* blocks at the end apply each row's own selection bit and
   causal limit per score. Dense mode walks blocks ``0 .. cdiv(pos_last + 1, page)`` of the request's block
   table, unmasked up to the tile's first position.
3. Split-K: ``num_splits`` programs share one tile's walk (balanced contiguous step ranges) and write fp32
   partial outputs with a base-2 log-sum-exp; a small Pallas merge kernel combines them. With
   ``num_splits == 1`` the walk writes the final output directly.

Reads: a ``-1`` slot, a block at or past ``cdiv(pos_last + 1, page)`` of the tile, a padding tile and a
zero-length row never touch ``block_tables`` or the caches; only physical pages named by a request's own table
entries for its visible blocks are read. The dense variant (``ragged_paged_attention`` in
``paged_attention.py``) reuses both kernels with ``dense=True``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import platform as _platform
from pallas_kernels.metadata import token_positions, token_to_request

__all__ = [
    "CHIP_POLICIES",
    "MASK_VALUE",
    "AttentionLaunchConfig",
    "ChipPolicy",
    "TileSettings",
    "attention_launch_config",
    "ragged_sparse_attention",
    "ragged_sparse_attention_reference",
    "union_block_counts",
]

# Large-but-finite: exp2(MASK_VALUE - m) underflows to 0 and MASK_VALUE - MASK_VALUE stays finite.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Subtracted instead of a row's max when the row skips a block: exp2(score - _SKIP_ROW) is exactly 0.
_SKIP_ROW = 0.5 * float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)
# Entries of one tile's selection list (block_q * next_pow2(topk)). The pre-pass compares them against
# _PREPASS_CHUNK_ELEMENTS / entries block ids at a time: the cap keeps those chunks at >= 32 ids.
MAX_SELECTION_ENTRIES = 256
# Triton's dot needs M, N and K of at least 16 when compiled (interpret mode has no such limit).
MIN_DOT_DIM = 16
# Tokens per sparse tile: a union block's token mask is one int32.
MAX_SPARSE_BLOCK_Q = 32
# The pre-pass compares the tile's [block_q, topk] selections against this many (selection, block id) pairs
# per step of its walk over block ids.
_PREPASS_CHUNK_ELEMENTS = 8192


# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------


def _dot(a, b, *, contract_b: int):
    """2-D ``a @ b`` (``contract_b=0``) or ``a @ b.T`` (``contract_b=1``) with an fp32 accumulator.

    fp32 operands are multiplied in full fp32 (IEEE), as in the indexer: an fp32 cache asks for accuracy, and
    Triton's default for fp32 dots is TF32. bf16 operands take the tensor cores' bf16 path.
    """
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _locate_tile(tile, seg_start, seg_len, seg_seq, *, num_rows: int, block_q: int):
    """The request tile ``tile`` of the ragged batch, from per-segment vectors (used in-kernel and in jnp).

    Segments are the ``R`` request rows plus the padding tail ``[qsl[R], T)``; each is cut into
    ``block_q``-token tiles, in order. ``seg_start, seg_len, seg_seq: int32[S_pow2]`` (start token, tokens,
    seq_len; zeros past segment ``R``). Returns scalars ``(req, tok0, ntok, pos0)``: ``req`` is -1 for
    padding-tail tiles (which only write zeros) and for tiles past the last one (``ntok == 0``, which do
    nothing).
    """
    seg_tiles = (seg_len + block_q - 1) // block_q
    ends = jnp.cumsum(seg_tiles, axis=0)
    seg = jnp.sum((ends <= tile).astype(jnp.int32))  # first segment whose tiles reach past ``tile``
    idx = jax.lax.broadcasted_iota(jnp.int32, seg_len.shape, 0)
    before = jnp.sum(jnp.where(idx < seg, seg_tiles, 0))
    here = idx == seg
    tok_start = jnp.sum(jnp.where(here, seg_start, 0))
    tokens = jnp.sum(jnp.where(here, seg_len, 0))
    seq = jnp.sum(jnp.where(here, seg_seq, 0))
    local = (tile - before) * block_q
    ntok = jnp.where(seg <= num_rows, jnp.clip(tokens - local, 0, block_q), 0)
    live = (seg < num_rows) & (ntok > 0)
    req = jnp.where(live, seg, -1)
    pos0 = jnp.where(live, seq - tokens + local, -1)
    return req, tok_start + local, ntok, pos0


def _tile_union_kernel(
    qsl_ref,  # [R + 1] int32
    seq_ref,  # [R] int32
    *refs,  # sparse: tables_ref [R, max_blocks] int32, sel_ref [T, topk] int32 (this KV head); then outputs:
    #   tile_ref [num_tiles, 4] int32: (request row or -1, first token, tokens, first position) per tile
    #   sparse: counts_ref [2] int32 (this tile, KV head): (past blocks, union blocks)
    #   sparse: union_ref [3, U] int32 (this tile, KV head): rows (physical page, logical block, token mask)
    num_tokens: int,
    num_rows: int,
    block_q: int,
    topk: int,
    topk_pow2: int,
    page: int,
    max_blocks: int,
    union_size: int,
    chunk: int,
    dense: bool,
):
    """Pre-pass, one program per (request tile, KV head): find the tile, then (sparse) write the union of its
    tokens' selections as dense arrays, so the attention walk only does scalar loads (module docstring)."""
    if dense:
        (tile_ref,) = refs
    else:
        tables_ref, sel_ref, tile_ref, counts_ref, union_ref = refs
    tile = pl.program_id(0)
    head = pl.program_id(1)

    # Which tokens the tile owns: a search over query_start_loc on the device (no host lengths).
    seg = jax.lax.broadcasted_iota(jnp.int32, (_next_pow2(num_rows + 1),), 0)
    in_seg, in_row = seg <= num_rows, seg < num_rows
    seg_start = plgpu.load(qsl_ref.at[jnp.where(in_seg, seg, 0)], mask=in_seg, other=0)
    seg_end = plgpu.load(qsl_ref.at[jnp.where(in_row, seg + 1, 0)], mask=in_row, other=num_tokens)
    seg_len = jnp.where(in_seg, jnp.clip(seg_end - seg_start, 0, num_tokens), 0)
    seg_seq = plgpu.load(seq_ref.at[jnp.where(in_row, seg, 0)], mask=in_row, other=0)
    req, tok0, ntok, pos0 = _locate_tile(
        tile, seg_start, seg_len, seg_seq, num_rows=num_rows, block_q=block_q
    )
    four = jax.lax.broadcasted_iota(jnp.int32, (4,), 0)
    info = jnp.where(four == 0, req, jnp.where(four == 1, tok0, jnp.where(four == 2, ntok, pos0)))
    first_head = head == 0
    # Only KV head 0 writes the tile's row; the other heads point one past the end (dropped).
    plgpu.store(
        tile_ref.at[jnp.zeros_like(four) + tile, jnp.where(first_head, four, 4)],
        info,
        mask=(four >= 0) & first_head,
    )
    if dense:
        return

    live = req >= 0
    req_c = jnp.maximum(req, 0)
    # Blocks visible to the tile's last token; nothing at or past this bound is ever read.
    n_visible = jnp.where(live, jnp.minimum((pos0 + ntok - 1 + page) // page, max_blocks), 0)
    # The tile's selections [block_q, topk_pow2]; -1 for padding, -1 slots and blocks past the last position.
    t = jax.lax.broadcasted_iota(jnp.int32, (block_q, topk_pow2), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (block_q, topk_pow2), 1)
    ok = (t < ntok) & (j < topk) & live
    sel = plgpu.load(sel_ref.at[jnp.where(ok, tok0 + t, 0), jnp.where(ok, j, 0)], mask=ok, other=-1)
    sel = jnp.where(ok & (sel >= 0) & (sel < n_visible), sel, -1)
    tok_bit = jnp.left_shift(1, jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0))  # [block_q, 1]
    n_past_max = jnp.minimum((pos0 + 1) // page, n_visible)  # blocks below end at or before pos0
    cb = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    # The union in ascending block order, ``chunk`` block ids at a time: a block's token mask has bit t set
    # when token t selected it (a repeat in one token's list counts once: "any" over its slots first). The
    # blocks below n_past_max ("past": no causal mask needed, only the per-row selection bit) come first by
    # construction; the at most cdiv(block_q - 1, page) + 1 causal blocks follow.
    def chunk_step(c, carry):
        offset, n_past = carry
        b = c * chunk + cb  # [chunk]
        hit = (sel[:, :, None] == b[None, None, :]).astype(jnp.int32)  # [block_q, topk_pow2, chunk]
        token_mask = jnp.sum(jnp.max(hit, axis=1) * tok_bit, axis=0)  # [chunk]
        present = token_mask != 0
        present_i = present.astype(jnp.int32)
        slot = jnp.where(present, offset + jnp.cumsum(present_i, axis=0) - present_i, union_size)
        phys = plgpu.load(
            tables_ref.at[jnp.zeros_like(b) + req_c, jnp.where(present, b, 0)], mask=present, other=0
        )
        # Slots of absent blocks point one past the end (masked on GPU, dropped by interpret mode).
        for row, value in enumerate((phys, b, token_mask)):
            plgpu.store(union_ref.at[jnp.full_like(slot, row), slot], value, mask=present)
        return offset + jnp.sum(present_i), n_past + jnp.sum(present_i * (b < n_past_max))

    n_chunks = (n_visible + chunk - 1) // chunk
    n_union, n_past = jax.lax.fori_loop(0, n_chunks, chunk_step, (jnp.int32(0), jnp.int32(0)))
    two = jax.lax.broadcasted_iota(jnp.int32, (2,), 0)
    plgpu.store(counts_ref.at[two], jnp.where(two == 0, n_past, n_union))


def _ragged_attention_kernel(
    tile_ref,  # [4] int32 (this tile): request row or -1, first token, tokens, first position
    q_ref,  # [T * H_q, D]
    k_ref,  # [P, page, D]        (this program's KV head)
    v_ref,  # [P, page, D]        (this program's KV head)
    index_ref,  # dense: block tables [R, max_blocks] int32; sparse: union [3, U] int32 (this tile, KV head)
    *refs,  # sparse: counts_ref [2] int32 (this tile, KV head); then outputs:
    #   num_splits == 1: o_ref [T * H_q, D] (q dtype)
    #   num_splits  > 1: o_ref [T * H_q, D] f32 (this split), lse_ref [T * H_q] f32 (this split, base 2)
    group: int,
    num_q_heads: int,
    block_k: int,
    rows: int,
    num_splits: int,
    max_blocks: int,
    scale: float,
    dense: bool,
):
    if dense:
        counts_ref, out_refs = None, refs
    else:
        counts_ref, *out_refs = refs
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

    if dense:
        # Blocks 0 .. n_total of the request; the first n_past end at or before the tile's first position.
        n_total = jnp.where(live, jnp.minimum((pos0 + ntok - 1 + page) // page, max_blocks), 0)
        n_past = jnp.where(live, jnp.minimum((pos0 + 1) // page, n_total), 0)
    else:
        n_past, n_total = counts_ref[0], counts_ref[1]

    # The walk: block u of the union (dense: of the request), sub-step of block_k keys; split s takes a
    # balanced contiguous share of the steps. Past blocks need no causal mask (dense: no mask at all; sparse:
    # one per-row selection bit); only the causal blocks at the end apply a mask per score.
    parts = page // block_k
    n_steps = n_total * parts
    lo = (split * n_steps) // num_splits
    hi = ((split + 1) * n_steps) // num_splits
    mid = jnp.clip(n_past * parts, lo, hi)
    key_iota = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    qk_scale = scale * _LOG2E  # scores in the log2 domain

    def load_kv(step):
        u, part = (step, 0) if parts == 1 else (step // parts, step % parts)
        page_id = index_ref[req_c, u] if dense else index_ref[0, u]
        if parts == 1:
            return u, 0, k_ref[page_id], v_ref[page_id]  # [block_k, D] each
        off = pl.multiple_of(part * block_k, block_k)
        return u, off, k_ref[page_id, pl.ds(off, block_k), :], v_ref[page_id, pl.ds(off, block_k), :]

    def picked_rows(u):
        """Rows whose token selected union block u (bit token of its mask)."""
        return jnp.bitwise_and(jnp.right_shift(index_ref[2, u], tok_local), 1) > 0

    def past_step(step, carry):
        acc, m_prev, l_prev = carry
        u, _, kb, vb = load_kv(step)
        s = _dot(q, kb, contract_b=1)  # [rows, block_k]
        m_blk = jnp.maximum(m_prev, jnp.max(s, axis=1) * qk_scale)
        if dense:
            m_next = m_exp = m_blk
        else:
            # A row that did not pick the block keeps its state: its max subtracts a huge value instead, so
            # its probabilities are exactly 0 (no per-score mask), and alpha is 1.
            picked = picked_rows(u)
            m_next = jnp.where(picked, m_blk, m_prev)
            m_exp = jnp.where(picked, m_next, _SKIP_ROW)
        p = jnp.exp2(s * qk_scale - m_exp[:, None])  # one multiply-add per score
        alpha = jnp.exp2(m_prev - m_next)
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(vb.dtype), vb, contract_b=0)
        return acc, m_next, l_next

    def causal_step(step, carry):
        acc, m_prev, l_prev = carry
        u, off, kb, vb = load_kv(step)
        if dense:
            b, limit = u, row_pos
        else:
            b, limit = index_ref[1, u], jnp.where(picked_rows(u), row_pos, -1)
        visible = (b * page + off + key_iota)[None, :] <= limit[:, None]  # [rows, block_k]
        s = jnp.where(visible, _dot(q, kb, contract_b=1) * qk_scale, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        # A row with no visible key so far has m_next == MASK_VALUE, where exp2(s - m_next) would be 1.
        p = jnp.where(visible, jnp.exp2(s - m_next[:, None]), 0.0)
        alpha = jnp.exp2(m_prev - m_next)
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(vb.dtype), vb, contract_b=0)
        return acc, m_next, l_next

    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m_i = jnp.full((rows,), MASK_VALUE, jnp.float32)
    l_i = jnp.zeros((rows,), jnp.float32)
    carry = jax.lax.fori_loop(lo, mid, past_step, (acc, m_i, l_i))
    acc, m_i, l_i = jax.lax.fori_loop(mid, hi, causal_step, carry)

    has_keys = l_i > 0.0
    out = acc / jnp.where(has_keys, l_i, 1.0)[:, None]
    # Rows outside the tile point one past the end: masked on GPU, dropped by interpret mode's scatter (a
    # clamped index would collide with a real row inside one store).
    out_rows = jnp.where(row_valid, q_rows, q_ref.shape[0])
    store_idx = out_rows[:, None], d[None, :]
    if num_splits == 1:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[store_idx], out.astype(o_ref.dtype), mask=row_valid[:, None])
    else:
        o_ref, lse_ref = out_refs
        lse = jnp.where(has_keys, m_i + jnp.log2(jnp.where(has_keys, l_i, 1.0)), MASK_VALUE)
        plgpu.store(o_ref.at[store_idx], out, mask=row_valid[:, None])
        plgpu.store(lse_ref.at[out_rows], lse, mask=row_valid)


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
        out_ref.at[jnp.where(ok, r, num)[:, None], d[None, :]], out.astype(out_ref.dtype), mask=ok[:, None]
    )


# ----------------------------------------------------------------------------------------------------------
# Launch policy
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TileSettings:
    """Launch settings of the walk for query tiles of at least ``min_rows`` rows."""

    min_rows: int
    num_warps: int
    num_stages: int
    block_k: int  # keys per step of the walk (a power-of-2 part of a page)


@dataclasses.dataclass(frozen=True)
class ChipPolicy:
    """Per-chip launch settings. Retune here, not in the kernel."""

    num_cores: int  # SMs (NVIDIA) / CUs (AMD); the device's own count is used when it reports one
    tiles: tuple[TileSettings, ...]  # largest min_rows first: the first a tile reaches applies
    smem_bytes: int  # budget for the query tile + num_stages K/V buffers; block_k is halved to fit
    max_splits_sparse: int  # split-K caps (partial outputs cost T * H_q * D * 4 bytes per split)
    max_splits_dense: int
    max_rows_sparse: int = 128  # query rows per program (block_q * group), sparse walk
    max_rows_dense: int = 128  # the same, dense walk
    merge_rows: int = 32  # rows per program of the split-K merge kernel
    prepass_warps: int = 4  # tile/union pre-pass kernel

    def tile_settings(self, rows: int) -> TileSettings:
        return next((t for t in self.tiles if rows >= t.min_rows), self.tiles[-1])


CHIP_POLICIES: dict[str, ChipPolicy] = {
    # Hopper (H100 / H200): 132 SMs, 32-wide warps, 227 KiB of shared memory per block, 64K registers per SM.
    # From the H200 sweeps (docs/kernels/sparse_attention.md): the sparse walk is fastest in 64-row tiles
    # (4 tokens x 16 heads: one warpgroup, 4 warps) with 32-key steps and 3 stages: ~166 registers and 49 KiB
    # of shared memory, so several programs share an SM and one's softmax overlaps another's tensor-core
    # work; 128-row tiles (8 warps, both warpgroups in lockstep at every barrier) are 1.13x slower there.
    # Dense tiles read every block, where the doubled L2 traffic of 64-row tiles costs more than it saves
    # (1.21x slower): 128 rows, 64-key steps, 5 stages (the page-id load, the K/V copy and the math each get
    # a pipeline stage, two K/V steps in flight). Decode tiles (16 rows) are HBM-bound; 3 stages. Split-K:
    # the merge kernel costs more per split than a short sparse walk gains (8 splits beat 11 and 32 at
    # 1x8x32K), the long dense walk wants more.
    "cuda": ChipPolicy(
        num_cores=132,
        tiles=(
            TileSettings(min_rows=128, num_warps=8, num_stages=5, block_k=64),
            TileSettings(min_rows=64, num_warps=4, num_stages=3, block_k=32),
            TileSettings(min_rows=16, num_warps=4, num_stages=3, block_k=64),
        ),
        smem_bytes=200 * 1024,
        max_splits_sparse=8,
        max_splits_dense=16,
        max_rows_sparse=64,
        max_rows_dense=128,
    ),
    # CDNA3 (MI300X, gfx942): 304 CUs, 64-wide wavefronts (4 warps = 256 lanes), 64 KiB LDS per CU.
    # Not measured yet: conservative 2-stage, 32-key tiles.
    "rocm": ChipPolicy(
        num_cores=304,
        tiles=(TileSettings(min_rows=16, num_warps=4, num_stages=2, block_k=32),),
        smem_bytes=64 * 1024,
        max_splits_sparse=16,
        max_splits_dense=16,
    ),
}


@dataclasses.dataclass(frozen=True)
class AttentionLaunchConfig:
    block_q: int  # tokens of one request per program (power of 2)
    num_splits: int  # split-K programs per (request tile, KV head)
    num_warps: int
    num_stages: int
    block_k: int = 0  # keys per step (power of 2 dividing the page); 0: the whole page
    prepass_warps: int = 4  # warps of the tile/union pre-pass kernel


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _num_tiles_bound(num_tokens: int, num_requests: int, block_q: int) -> int:
    """Static upper bound on request tiles: every non-empty segment (R rows + the padding tail) wastes at most
    ``block_q - 1`` slots of its last tile, and every tile holds at least one token."""
    segments = min(num_requests + 1, num_tokens)
    return max(1, min(num_tokens, (num_tokens + segments * (block_q - 1)) // block_q))


def _device_cores(default: int) -> int:
    if _platform.on_gpu():
        count = getattr(jax.devices()[0], "core_count", None)
        if isinstance(count, int) and count > 0:
            return count
    return default


def _detect_backend() -> str:
    """``"cuda"`` or ``"rocm"`` for the default device (the cuda table off GPU, e.g. interpret mode).

    jax reports the platform of a CUDA device as plain ``"gpu"``; the platform version / device kind tell.
    """
    name = _platform.gpu_platform_name()
    return name if name in CHIP_POLICIES else "cuda"


def attention_launch_config(
    *,
    backend: str | None,
    num_tokens: int,
    num_requests: int,
    num_q_heads: int,
    num_kv_heads: int,
    topk: int,
    max_blocks: int,
    dense: bool,
    page: int = 128,
    head_dim: int = 128,
    itemsize: int = 2,
    block_q: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_k: int | None = None,
) -> AttentionLaunchConfig:
    """Pick the launch settings; explicit arguments win over the policy.

    ``block_q``: the mean query length ``T / R`` rounded up to a power of 2, capped so that a tile has at most
    ``max_rows_sparse`` / ``max_rows_dense`` query rows (and, sparse, at most MAX_SELECTION_ENTRIES list
    entries). At M3 shapes on CUDA: decode gets 1-token tiles (16 rows), K = 7 verification 4-token sparse
    tiles (64 rows) and 8-token dense tiles (128 rows).
    ``num_warps``, ``num_stages``, ``block_k``: the policy's ``TileSettings`` for the tile's row count;
    ``block_k`` is halved until the query tile and ``num_stages`` K/V buffers fit ``smem_bytes``.
    ``num_splits``: 1 when the tiles already fill the chip, else enough splits for about one program per core.
    """
    backend = backend or _detect_backend()
    if backend not in CHIP_POLICIES:
        raise ValueError(f"backend must be one of {sorted(CHIP_POLICIES)}, got {backend!r}")
    policy = CHIP_POLICIES[backend]
    group = num_q_heads // num_kv_heads
    topk_pow2 = _next_pow2(topk)
    if block_q is None:
        mean_q = -(-num_tokens // max(num_requests, 1))
        max_rows = policy.max_rows_dense if dense else policy.max_rows_sparse
        block_q = min(_next_pow2(mean_q), max(1, max_rows // group))
        if not dense:
            block_q = min(block_q, max(1, MAX_SELECTION_ENTRIES // topk_pow2), MAX_SPARSE_BLOCK_Q)
        block_q = max(1, min(block_q, _next_pow2(num_tokens)))
    rows = max(16, _next_pow2(block_q * group))
    tile = policy.tile_settings(rows)
    if num_splits is None:
        programs = _num_tiles_bound(num_tokens, num_requests, block_q) * num_kv_heads
        cores = _device_cores(policy.num_cores)
        walk = max_blocks if dense else min(max_blocks, block_q * topk)
        max_splits = policy.max_splits_dense if dense else policy.max_splits_sparse
        num_splits = 1 if programs >= cores else min(max_splits, -(-cores // programs), max(1, walk))
    if num_warps is None:
        num_warps = tile.num_warps
    if num_stages is None:
        num_stages = tile.num_stages
    if block_k is None:
        block_k = min(page, tile.block_k)
        q_bytes = rows * head_dim * itemsize
        while (
            block_k > 16
            and q_bytes + max(num_stages, 1) * 2 * block_k * head_dim * itemsize > policy.smem_bytes
        ):
            block_k //= 2
    return AttentionLaunchConfig(
        block_q=int(block_q),
        num_splits=int(num_splits),
        num_warps=int(num_warps),
        num_stages=int(num_stages),
        block_k=int(min(block_k, page)),
        prepass_warps=policy.prepass_warps,
    )


# ----------------------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------------------


def _tile_table(query_start_loc, seq_lens, num_tokens: int, block_q: int, num_tiles: int) -> jax.Array:
    """``int32[num_tiles, 4]``: ``_locate_tile`` for every tile in jnp (the bytes model and tests use it; the
    kernel runs the same search per program): (request row or -1, first packed token, tokens, first position).
    """
    qsl = query_start_loc.astype(jnp.int32)
    num_rows = seq_lens.shape[0]
    size = _next_pow2(num_rows + 1)
    pad = size - (num_rows + 1)
    seg_start = jnp.pad(qsl, (0, pad))
    seg_end = jnp.pad(jnp.concatenate([qsl[1:], jnp.full((1,), num_tokens, jnp.int32)]), (0, pad))
    seg_len = jnp.where(jnp.arange(size) <= num_rows, jnp.clip(seg_end - seg_start, 0, num_tokens), 0)
    seg_seq = jnp.pad(seq_lens.astype(jnp.int32), (0, size - num_rows))
    locate = functools.partial(_locate_tile, num_rows=num_rows, block_q=block_q)
    cols = jax.vmap(lambda t: locate(t, seg_start, seg_len, seg_seq))(jnp.arange(num_tiles, dtype=jnp.int32))
    return jnp.stack(cols, axis=1).astype(jnp.int32)


def check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_indices):
    """Static shape/dtype validation shared by the sparse and dense entry points (ValueError naming
    shapes)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H_q, D], got shape {q.shape}")
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [H_kv, P, page, D], got shape {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} must equal k_cache shape {k_cache.shape}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page, kd = k_cache.shape
    if kd != head_dim:
        raise ValueError(f"head_dim of q {q.shape} and k_cache {k_cache.shape} differ")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"H_q={num_q_heads} (q {q.shape}) must be a multiple of H_kv={num_kv_heads}")
    for name, n in (("page size", page), ("head_dim", head_dim)):
        if n & (n - 1):
            raise ValueError(f"{name} must be a power of 2, got {n} (k_cache {k_cache.shape})")
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
    if block_indices is not None:
        if block_indices.ndim != 3 or block_indices.shape[:2] != (num_tokens, num_kv_heads):
            raise ValueError(
                f"block_indices must be [T, H_kv, topk]=[{num_tokens}, {num_kv_heads}, topk], "
                f"got shape {block_indices.shape}"
            )
        if not jnp.issubdtype(block_indices.dtype, jnp.integer):
            raise ValueError(f"block_indices must be int32, got {block_indices.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating) or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"q ({q.dtype}) must be floating and k/v caches ({k_cache.dtype}, {v_cache.dtype}) match"
        )


def _tile_union_prepass(
    query_start_loc,
    seq_lens,
    block_tables,
    block_indices,
    *,
    num_tokens: int,
    page: int,
    config: AttentionLaunchConfig,
    interpret: bool,
):
    """Runs ``_tile_union_kernel``: ``[tiles int32[num_tiles, 4]]``; sparse also ``counts int32[num_tiles,
    H_kv, 2]`` and ``union int32[num_tiles, H_kv, 3, U]``, ``U = min(max_blocks, block_q * topk)``."""
    num_rows, max_blocks = block_tables.shape
    dense = block_indices is None
    block_q = config.block_q
    num_tiles = _num_tiles_bound(num_tokens, num_rows, block_q)
    num_kv_heads, topk = (1, 1) if dense else block_indices.shape[1:]
    topk_pow2 = _next_pow2(topk)
    union_size = min(max_blocks, block_q * topk)
    pre_specs = [
        pl.BlockSpec((num_rows + 1,), lambda i, h: (0,)),
        pl.BlockSpec((num_rows,), lambda i, h: (0,)),
    ]
    pre_args = [query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32)]
    pre_shapes = [jax.ShapeDtypeStruct((num_tiles, 4), jnp.int32)]
    pre_out_specs = [pl.BlockSpec((num_tiles, 4), lambda i, h: (0, 0))]
    if not dense:
        pre_specs += [
            pl.BlockSpec((num_rows, max_blocks), lambda i, h: (0, 0)),
            pl.BlockSpec((num_tokens, None, topk), lambda i, h: (0, h, 0)),
        ]
        pre_args += [block_tables.astype(jnp.int32), block_indices.astype(jnp.int32)]
        pre_shapes += [
            jax.ShapeDtypeStruct((num_tiles, num_kv_heads, 2), jnp.int32),
            jax.ShapeDtypeStruct((num_tiles, num_kv_heads, 3, union_size), jnp.int32),
        ]
        pre_out_specs += [
            pl.BlockSpec((None, None, 2), lambda i, h: (i, h, 0)),
            pl.BlockSpec((None, None, 3, union_size), lambda i, h: (i, h, 0, 0)),
        ]
    return _call(
        functools.partial(
            _tile_union_kernel,
            num_tokens=num_tokens,
            num_rows=num_rows,
            block_q=block_q,
            topk=topk,
            topk_pow2=topk_pow2,
            page=page,
            max_blocks=max_blocks,
            union_size=union_size,
            chunk=max(1, min(_next_pow2(max_blocks), _PREPASS_CHUNK_ELEMENTS // (block_q * topk_pow2))),
            dense=dense,
        ),
        grid=(num_tiles, num_kv_heads),
        in_specs=pre_specs,
        out_specs=pre_out_specs,
        out_shape=pre_shapes,
        args=pre_args,
        poison=False,
        interpret=interpret,
        num_warps=config.prepass_warps,
        num_stages=1,
        name=f"ragged_{'paged' if dense else 'sparse'}_attention_tiles_bq{block_q}",
    )


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "poison"))
def ragged_attention_pallas(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    block_indices,
    *,
    scale: float,
    config: AttentionLaunchConfig,
    interpret: bool,
    poison: bool = False,
):
    """Builds the grids and BlockSpecs and runs the kernels: the tile/union pre-pass, the attention walk
    (sparse, or dense when ``block_indices is None``), then the split-K merge when ``config.num_splits > 1``.

    ``poison`` (tests only): start the float output buffers as NaN (aliased into the kernels) so that a row a
    kernel fails to write shows up.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page, _ = k_cache.shape
    num_rows, max_blocks = block_tables.shape
    dense = block_indices is None
    topk = 1 if dense else block_indices.shape[2]
    group = num_q_heads // num_kv_heads
    block_q, num_splits = config.block_q, config.num_splits
    block_k = config.block_k or page
    if not interpret and (block_k < MIN_DOT_DIM or head_dim < MIN_DOT_DIM):
        raise ValueError(
            f"compiled Triton dots need N and K >= {MIN_DOT_DIM}: keys per step {block_k} (page {page}) and "
            f"head_dim {head_dim}; use a page size >= {MIN_DOT_DIM} or implementation='reference'"
        )
    if block_q < 1 or block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of 2 >= 1, got {block_q}")
    if not dense and block_q > MAX_SPARSE_BLOCK_Q:
        raise ValueError(f"block_q must be <= {MAX_SPARSE_BLOCK_Q} (token bitmask of int32), got {block_q}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if block_k < 1 or block_k & (block_k - 1) or page % block_k:
        raise ValueError(f"block_k must be a power of 2 dividing the page size {page}, got {block_k}")
    topk_pow2 = _next_pow2(topk)
    if not dense and block_q * topk_pow2 > MAX_SELECTION_ENTRIES:
        raise ValueError(
            f"block_q * next_pow2(topk) = {block_q} * {topk_pow2} exceeds {MAX_SELECTION_ENTRIES} "
            f"(block_indices {block_indices.shape}); use a smaller block_q"
        )
    rows = max(16, _next_pow2(block_q * group))
    num_tiles = _num_tiles_bound(num_tokens, num_rows, block_q)
    flat_rows = num_tokens * num_q_heads
    kind = "paged" if dense else "sparse"
    tables = block_tables.astype(jnp.int32)

    # 1. Pre-pass: tile table (and the sparse unions); 2. the walk; 3. the split-K merge.
    pre = _tile_union_prepass(
        query_start_loc,
        seq_lens,
        block_tables,
        block_indices,
        num_tokens=num_tokens,
        page=page,
        config=config,
        interpret=interpret,
    )
    union_size = 1 if dense else pre[2].shape[-1]

    # 2. The attention walk.
    grid = (num_tiles, num_kv_heads, num_splits)
    in_specs = [
        pl.BlockSpec((None, 4), lambda i, h, s: (i, 0)),
        pl.BlockSpec((flat_rows, head_dim), lambda i, h, s: (0, 0)),
        pl.BlockSpec((None, num_pages, page, head_dim), lambda i, h, s: (h, 0, 0, 0)),
        pl.BlockSpec((None, num_pages, page, head_dim), lambda i, h, s: (h, 0, 0, 0)),
    ]
    args = [pre[0], q.reshape(flat_rows, head_dim), k_cache, v_cache]
    if dense:
        in_specs.append(pl.BlockSpec((num_rows, max_blocks), lambda i, h, s: (0, 0)))
        args.append(tables)
    else:
        in_specs += [
            pl.BlockSpec((None, None, 3, union_size), lambda i, h, s: (i, h, 0, 0)),
            pl.BlockSpec((None, None, 2), lambda i, h, s: (i, h, 0)),
        ]
        args += [pre[2], pre[1]]
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((flat_rows, head_dim), q.dtype)]
        out_specs = [pl.BlockSpec((flat_rows, head_dim), lambda i, h, s: (0, 0))]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, flat_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, flat_rows), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, flat_rows, head_dim), lambda i, h, s: (s, 0, 0)),
            pl.BlockSpec((None, flat_rows), lambda i, h, s: (s, 0)),
        ]
    kernel = functools.partial(
        _ragged_attention_kernel,
        group=group,
        num_q_heads=num_q_heads,
        block_k=block_k,
        rows=rows,
        num_splits=num_splits,
        max_blocks=max_blocks,
        scale=float(scale),
        dense=dense,
    )
    outs = _call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        args=args,
        poison=poison,
        interpret=interpret,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        name=f"ragged_{kind}_attention_bq{block_q}_rows{rows}_bk{block_k}_splits{num_splits}",
    )
    if num_splits == 1:
        out = outs[0]
    else:
        merge_rows = min(CHIP_POLICIES["cuda"].merge_rows, _next_pow2(flat_rows))
        (out,) = _call(
            functools.partial(_merge_splits_kernel, num_splits=num_splits, block_rows=merge_rows),
            grid=(pl.cdiv(flat_rows, merge_rows),),
            in_specs=[
                pl.BlockSpec((num_splits, flat_rows, head_dim), lambda i: (0, 0, 0)),
                pl.BlockSpec((num_splits, flat_rows), lambda i: (0, 0)),
            ],
            out_specs=[pl.BlockSpec((flat_rows, head_dim), lambda i: (0, 0))],
            out_shape=[jax.ShapeDtypeStruct((flat_rows, head_dim), q.dtype)],
            args=list(outs),
            poison=poison,
            interpret=interpret,
            num_warps=4,
            num_stages=1,
            name=f"ragged_{kind}_attention_merge_splits{num_splits}",
        )
    return out.reshape(num_tokens, num_q_heads, head_dim)


def _call(
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


def union_block_counts(
    query_start_loc: jax.Array, seq_lens: jax.Array, block_indices: jax.Array, *, page: int, block_q: int
) -> jax.Array:
    """Bytes model: ``int32[num_tiles, H_kv]``, how many distinct blocks each (request tile, KV head) program
    reads, i.e. the size of the union the kernel walks (``-1`` slots and blocks past the tile's last position
    excluded). Unique K+V bytes = ``sum * 2 * page * D * itemsize``; per-token reads would be the number of
    valid selection slots instead."""
    num_tokens, num_kv_heads, topk = block_indices.shape
    num_rows = seq_lens.shape[0]
    num_tiles = _num_tiles_bound(num_tokens, num_rows, block_q)
    tiles = _tile_table(query_start_loc, seq_lens, num_tokens, block_q, num_tiles)
    req, start, length, pos0 = (tiles[:, j] for j in range(4))
    offs = jnp.arange(block_q, dtype=jnp.int32)
    tok = jnp.clip(start[:, None] + offs[None, :], 0, num_tokens - 1)  # [tiles, bq]
    tok_ok = (offs[None, :] < length[:, None]) & (req >= 0)[:, None]
    n_visible = jnp.where((req >= 0) & (length > 0), (pos0 + length - 1 + page) // page, 0)
    sel = jnp.transpose(block_indices.astype(jnp.int32)[tok], (0, 2, 1, 3))  # [tiles, H_kv, bq, topk]
    sel = sel.reshape(num_tiles, num_kv_heads, block_q * topk)
    tok_ok = jnp.repeat(tok_ok, topk, axis=1)[:, None, :]
    ok = tok_ok & (sel >= 0) & (sel < n_visible[:, None, None])
    big = jnp.iinfo(jnp.int32).max
    srt = jnp.sort(jnp.where(ok, sel, big), axis=-1)
    prev = jnp.concatenate([jnp.full(srt.shape[:-1] + (1,), -1, jnp.int32), srt[..., :-1]], axis=-1)
    return jnp.sum((srt != big) & (srt != prev), axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------
# Public entry point and reference
# ----------------------------------------------------------------------------------------------------------


def run_attention_pallas(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    block_indices,
    *,
    scale,
    interpret,
    backend,
    block_q,
    num_splits,
    num_warps,
    num_stages,
    block_k,
):
    """Policy launch config (with the caller's overrides) + the Pallas kernels; ``block_indices=None``: dense."""
    dense = block_indices is None
    config = attention_launch_config(
        backend=backend,
        num_tokens=q.shape[0],
        num_requests=block_tables.shape[0],
        num_q_heads=q.shape[1],
        num_kv_heads=k_cache.shape[0],
        topk=1 if dense else block_indices.shape[2],
        max_blocks=block_tables.shape[1],
        dense=dense,
        block_q=block_q,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        block_k=block_k,
        page=k_cache.shape[2],
        head_dim=q.shape[2],
        itemsize=k_cache.dtype.itemsize,
    )
    return ragged_attention_pallas(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        block_indices,
        scale=scale,
        config=config,
        interpret=_platform.resolve_interpret(interpret),
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
def ragged_sparse_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    block_indices: jax.Array,
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
    """Ragged block-sparse attention over a paged KV cache (MSA), per token and per KV group.

    Args:
      q: ``[T, H_q, D]`` packed query tokens (bf16 or f32).
      k_cache, v_cache: ``[H_kv, P, page, D]`` paged caches (page = sparse block size, a power of 2).
      block_tables: ``int32[R, max_blocks]`` logical block -> physical page of each request row.
      seq_lens: ``int32[R]`` lengths including this step's tokens (0 for padding rows).
      query_start_loc: ``int32[R + 1]`` ragged query boundaries; slots ``>= qsl[R]`` are padding.
      block_indices: ``int32[T, H_kv, topk]`` selected logical blocks per (token, KV group), -1 padded.
      scale: softmax scale (``head_dim ** -0.5`` for M3).
      implementation: ``"pallas"`` (Triton kernel; interpret mode on CPU) or ``"reference"`` (plain jnp).
      interpret: ``None``: interpret mode on CPU, compiled Triton on GPU.
      block_q, num_splits, num_warps, num_stages, block_k: launch overrides; ``None`` asks the per-chip policy
        (``attention_launch_config``).
      backend: ``"cuda"`` or ``"rocm"`` policy table; ``None`` uses the default device (cuda table off GPU).
      block_k: keys per step of the walk (a power of 2 dividing the page); ``None``: policy.

    Returns:
      ``[T, H_q, D]`` in q's dtype; zeros for padding slots and for tokens without a visible selected key.
    """
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_indices)
    if implementation == "reference":
        return ragged_sparse_attention_reference(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_indices, scale=scale
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
        block_indices,
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
def ragged_sparse_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    block_indices: jax.Array,
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
    """Plain-jnp reference with ``ragged_sparse_attention``'s signature (launch arguments are ignored).

    Gathers each (token, KV group)'s selected pages (``[T, H_kv, topk, page, D]``), masks repeated, ``-1``,
    invisible and future keys, and runs an fp32 softmax. Memory is O(T * H_kv * topk * page * D).
    """
    del implementation, interpret, block_q, num_splits, num_warps, num_stages, backend, block_k
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_indices)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    topk = block_indices.shape[2]
    group = num_q_heads // num_kv_heads

    req = token_to_request(query_start_loc, num_tokens)
    pos = token_positions(query_start_loc, seq_lens, req)  # -1 for padding slots
    n_visible = jnp.where(req >= 0, (pos + page) // page, 0)
    sel = block_indices.astype(jnp.int32)
    slot = jnp.arange(topk)
    repeat = jnp.any((sel[..., :, None] == sel[..., None, :]) & (slot[:, None] > slot[None, :]), axis=-1)
    ok = (sel >= 0) & (sel < jnp.minimum(n_visible, max_blocks)[:, None, None]) & ~repeat  # [T, H_kv, topk]
    rows = jnp.maximum(req, 0)[:, None, None]
    phys = jnp.where(ok, block_tables[rows, jnp.clip(sel, 0, max_blocks - 1)], 0)
    heads = jnp.arange(num_kv_heads)[None, :, None]
    k = k_cache[heads, phys].astype(jnp.float32)  # [T, H_kv, topk, page, D]
    v = v_cache[heads, phys].astype(jnp.float32)
    kpos = sel[..., None] * page + jnp.arange(page)  # [T, H_kv, topk, page]
    visible = ok[..., None] & (kpos <= pos[:, None, None, None])
    v = jnp.where(visible[..., None], v, 0.0)  # masked slots may hold anything (stale drafts, unused pages)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("tgjd,tgkpd->tgjkp", qg, k, precision=hi) * scale
    s = jnp.where(visible[:, :, None], s, MASK_VALUE)
    s = s.reshape(num_tokens, num_kv_heads, group, topk * page)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(visible.reshape(num_tokens, num_kv_heads, 1, topk * page), jnp.exp(s - m), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum(
        "tgjn,tgnd->tgjd", p, v.reshape(num_tokens, num_kv_heads, topk * page, head_dim), precision=hi
    )
    o = o / jnp.where(den > 0, den, 1.0)
    return o.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
