"""Ragged block-sparse (MSA) attention over a paged KV cache: the Pallas (Triton) kernels and their jnp reference.

Contract (docs/kernels/). Packed queries ``q: [T, H_q, D]``; paged caches ``k_cache, v_cache: [H_kv, P,
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
program owns one request tile (up to ``block_q`` consecutive tokens of one request) and one KV head, and walks
the *union* of its tokens' selections once: the walk, split-K and merge of ``attention_walk.py``, with

1. the union pre-pass (``_tile_union_kernel``, one program per (tile, KV head)): it writes the tile table
   (``attention_walk.write_tile_row``) and the union of the tile's visible selections (``-1`` slots and blocks
   past the tile's last position dropped, repeats once) in ascending block order as dense int32 rows --
   physical page, logical block, token bitmask (bit i: token i of the tile selected the block) -- plus two
   counts (past blocks, union size). It walks the block ids in chunks, comparing the tile's ``[block_q, topk]``
   selections against ``chunk`` ids at a time;
2. the walk over those rows (:class:`SparseWalk`): per step one scalar load of the page id (the standard
   paged-attention indirect load: Triton's software pipeliner gives it its own stage before the K/V copy). On
   *past* blocks a row whose token did not pick the block keeps its state (its max is replaced by a huge value,
   so its probabilities are exactly 0), no per-score work; the causal blocks at the end apply each row's own
   selection bit and causal limit per score.

Reads: a ``-1`` slot, a block at or past ``cdiv(pos_last + 1, page)`` of the tile, a padding tile and a
zero-length row never touch ``block_tables`` or the caches; only physical pages named by a request's own table
entries for its visible blocks are read. Launch settings: ``tuning.sparse_attention_launch_config``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    MASK_VALUE,
    check_window,
    next_pow2,
    num_tiles_bound,
    out_of_bounds_where,
    tile_table,
    visible_blocks,
    window_start,
    window_walk_bound,
)
from pallas_kernels.attention_walk import (
    attention_unsupported,
    check_attention_inputs,
    check_walk_config,
    pallas_call,
    run_walk,
    write_tile_row,
)
from pallas_kernels.metadata import token_positions, token_to_request
from pallas_kernels.platform import resolve_interpret
from pallas_kernels.tuning import (
    MAX_SELECTION_ENTRIES,
    MAX_SPARSE_BLOCK_Q,
    AttentionLaunchConfig,
    resolve_chip,
    sparse_attention_launch_config,
)

__all__ = [
    "SparseWalk",
    "ragged_sparse_attention",
    "ragged_sparse_attention_pallas",
    "ragged_sparse_attention_reference",
    "supports",
    "union_block_counts",
]

# The pre-pass compares the tile's [block_q, topk] selections against this many (selection, block id) pairs
# per step of its walk over block ids (tuning.MAX_SELECTION_ENTRIES keeps that at >= 32 ids per step).
_PREPASS_CHUNK_ELEMENTS = 8192


# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------


def _tile_union_kernel(
    qsl_ref,  # [R + 1] int32
    seq_ref,  # [R] int32
    tables_ref,  # [R, max_blocks] int32
    sel_ref,  # [T, topk] int32 (this KV head)
    tile_ref,  # [num_tiles, 4] int32 out: (request row or -1, first token, tokens, first position) per tile
    counts_ref,  # [2] int32 out (this tile, KV head): (past blocks, union blocks)
    union_ref,  # [3, U] int32 out (this tile, KV head): rows (physical page, logical block, token mask)
    *,
    num_tokens: int,
    num_rows: int,
    block_q: int,
    topk: int,
    topk_pow2: int,
    page: int,
    max_blocks: int,
    union_size: int,
    chunk: int,
    window: int | None,
):
    """Pre-pass, one program per (request tile, KV head): find the tile, then write the union of its tokens'
    selections as dense arrays, so the attention walk only does scalar loads (module docstring)."""
    req, tok0, ntok, pos0 = write_tile_row(
        qsl_ref, seq_ref, tile_ref, num_tokens=num_tokens, num_rows=num_rows, block_q=block_q
    )
    live = req >= 0
    req_c = jnp.maximum(req, 0)
    n_visible = visible_blocks(live, pos0, ntok, page=page, max_blocks=max_blocks)
    # The tile's selections [block_q, topk_pow2]; -1 for padding, -1 slots and blocks past the last position.
    t = jax.lax.broadcasted_iota(jnp.int32, (block_q, topk_pow2), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (block_q, topk_pow2), 1)
    ok = (t < ntok) & (j < topk) & live
    sel = plgpu.load(sel_ref.at[jnp.where(ok, tok0 + t, 0), jnp.where(ok, j, 0)], mask=ok, other=-1)
    sel = jnp.where(ok & (sel >= 0) & (sel < n_visible), sel, -1)
    if window is not None:  # blocks that end before the tile's first window are dropped (never read)
        sel = jnp.where(sel >= window_start(live, pos0, ntok, page=page, window=window), sel, -1)
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
        # Slots of absent blocks point one past the end (masked on GPU, dropped by interpret mode).
        slot = out_of_bounds_where(present, offset + jnp.cumsum(present_i, axis=0) - present_i, union_size)
        phys = plgpu.load(
            tables_ref.at[jnp.zeros_like(b) + req_c, jnp.where(present, b, 0)], mask=present, other=0
        )
        for row, value in enumerate((phys, b, token_mask)):
            plgpu.store(union_ref.at[jnp.full_like(slot, row), slot], value, mask=present)
        return offset + jnp.sum(present_i), n_past + jnp.sum(present_i * (b < n_past_max))

    n_chunks = (n_visible + chunk - 1) // chunk
    n_union, n_past = jax.lax.fori_loop(0, n_chunks, chunk_step, (jnp.int32(0), jnp.int32(0)))
    two = jax.lax.broadcasted_iota(jnp.int32, (2,), 0)
    plgpu.store(counts_ref.at[two], jnp.where(two == 0, n_past, n_union))


@dataclasses.dataclass(frozen=True)
class SparseWalk:
    """The walk over a tile's union (``attention_walk.Walk``): index refs ``union [3, U]`` (physical page,
    logical block, token mask per union block) and ``counts [2]`` (past blocks, union size); with a window the
    pre-pass left out the blocks before the tile's first window."""

    kind = "sparse"
    num_index_refs = 2

    def block_range(self, index_refs, *, live, req, pos0, ntok, page, window):
        del live, req, pos0, ntok, page, window  # the pre-pass counted them
        _, counts_ref = index_refs
        return 0, counts_ref[0], counts_ref[1]

    def page_id(self, index_refs, req, u):
        del req
        return index_refs[0][0, u]

    def block_id(self, index_refs, u):
        return index_refs[0][1, u]

    def picked_rows(self, index_refs, u, tok_local):
        """Rows whose token selected union block u (bit token of its mask)."""
        return jnp.bitwise_and(jnp.right_shift(index_refs[0][2, u], tok_local), 1) > 0


# ----------------------------------------------------------------------------------------------------------
# Validation and wrappers
# ----------------------------------------------------------------------------------------------------------


def _selection_unsupported(topk: int) -> str | None:
    if topk < 1:
        return f"topk must be >= 1, got {topk}"
    if next_pow2(topk) > MAX_SELECTION_ENTRIES:
        return f"next_pow2(topk) = {next_pow2(topk)} exceeds {MAX_SELECTION_ENTRIES} selection entries per tile"
    return None


def supports(
    *,
    page_size: int,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    topk: int,
    dtype,
    chip: str | None = None,
    interpret: bool = False,
) -> bool:
    """Whether ``ragged_sparse_attention`` runs these shapes, compiled for ``chip`` (a chip of
    ``tuning.CHIPS``; ``None``: the default device's) or in interpret mode.

    Always: page size and head_dim powers of 2, ``H_q`` a multiple of ``H_kv``, ``next_pow2(topk) <=
    tuning.MAX_SELECTION_ENTRIES`` (a one-token tile's selection list). Compiled: also a dtype of
    ``tuning.COMPILED_DTYPES`` and page size and head_dim >= 16 (``tuning.MIN_DOT_DIM``: the dots' N and K).
    Every chip has the same limits today.
    """
    resolve_chip(chip)
    return (
        _selection_unsupported(topk) is None
        and attention_unsupported(
            page_size=page_size,
            head_dim=head_dim,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            dtype=dtype,
            interpret=interpret,
        )
        is None
    )


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_indices):
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_kv_heads = q.shape[0], k_cache.shape[0]
    if block_indices.ndim != 3 or block_indices.shape[:2] != (num_tokens, num_kv_heads):
        raise ValueError(
            f"block_indices must be [T, H_kv, topk]=[{num_tokens}, {num_kv_heads}, topk], "
            f"got shape {block_indices.shape}"
        )
    if not jnp.issubdtype(block_indices.dtype, jnp.integer):
        raise ValueError(f"block_indices must be int32, got {block_indices.dtype}")


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
    window: int | None = None,
):
    """Runs ``_tile_union_kernel``: ``tiles int32[num_tiles, 4]``, ``counts int32[num_tiles, H_kv, 2]`` and
    ``union int32[num_tiles, H_kv, 3, U]``, ``U = min(max_blocks, block_q * topk)``."""
    num_rows, max_blocks = block_tables.shape
    block_q = config.block_q
    num_tiles = num_tiles_bound(num_tokens, num_rows, block_q)
    num_kv_heads, topk = block_indices.shape[1:]
    topk_pow2 = next_pow2(topk)
    union_size = min(max_blocks, block_q * topk)
    return pallas_call(
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
            chunk=max(1, min(next_pow2(max_blocks), _PREPASS_CHUNK_ELEMENTS // (block_q * topk_pow2))),
            window=window,
        ),
        grid=(num_tiles, num_kv_heads),
        in_specs=[
            pl.BlockSpec((num_rows + 1,), lambda i, h: (0,)),
            pl.BlockSpec((num_rows,), lambda i, h: (0,)),
            pl.BlockSpec((num_rows, max_blocks), lambda i, h: (0, 0)),
            pl.BlockSpec((num_tokens, None, topk), lambda i, h: (0, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((num_tiles, 4), lambda i, h: (0, 0)),
            pl.BlockSpec((None, None, 2), lambda i, h: (i, h, 0)),
            pl.BlockSpec((None, None, 3, union_size), lambda i, h: (i, h, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_tiles, 4), jnp.int32),
            jax.ShapeDtypeStruct((num_tiles, num_kv_heads, 2), jnp.int32),
            jax.ShapeDtypeStruct((num_tiles, num_kv_heads, 3, union_size), jnp.int32),
        ],
        args=[
            query_start_loc.astype(jnp.int32),
            seq_lens.astype(jnp.int32),
            block_tables.astype(jnp.int32),
            block_indices.astype(jnp.int32),
        ],
        poison=False,
        interpret=interpret,
        num_warps=config.prepass_warps,
        num_stages=1,
        name=f"ragged_sparse_attention_tiles_bq{block_q}" + ("" if window is None else f"_window{window}"),
    )


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "poison", "window"))
def ragged_sparse_attention_pallas(
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
    window: int | None = None,
):
    """The Pallas kernels with an explicit launch ``config``: the union pre-pass, the walk, the split-K merge.

    ``poison`` (tests only): start the float output buffers as NaN (aliased into the kernels) so that a row a
    kernel fails to write shows up. ``window``: as in :func:`ragged_sparse_attention`.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_indices)
    check_window(window)
    check_walk_config(config, q, k_cache, interpret=interpret)
    block_q = config.block_q
    if block_q > MAX_SPARSE_BLOCK_Q:
        raise ValueError(f"block_q must be <= {MAX_SPARSE_BLOCK_Q} (token bitmask of int32), got {block_q}")
    topk_pow2 = next_pow2(block_indices.shape[2])
    if block_q * topk_pow2 > MAX_SELECTION_ENTRIES:
        raise ValueError(
            f"block_q * next_pow2(topk) = {block_q} * {topk_pow2} exceeds {MAX_SELECTION_ENTRIES} "
            f"(block_indices {block_indices.shape}); use a smaller block_q"
        )
    tiles, counts, union = _tile_union_prepass(
        query_start_loc,
        seq_lens,
        block_tables,
        block_indices,
        num_tokens=q.shape[0],
        page=k_cache.shape[2],
        config=config,
        interpret=interpret,
        window=window,
    )
    union_size = union.shape[-1]
    return run_walk(
        q,
        k_cache,
        v_cache,
        tiles,
        [union, counts],
        [
            pl.BlockSpec((None, None, 3, union_size), lambda i, h, s: (i, h, 0, 0)),
            pl.BlockSpec((None, None, 2), lambda i, h, s: (i, h, 0)),
        ],
        walk=SparseWalk(),
        scale=scale,
        config=config,
        interpret=interpret,
        poison=poison,
        window=window,
    )


def union_block_counts(
    query_start_loc: jax.Array, seq_lens: jax.Array, block_indices: jax.Array, *, page: int, block_q: int
) -> jax.Array:
    """Bytes model: ``int32[num_tiles, H_kv]``, how many distinct blocks each (request tile, KV head) program
    reads, i.e. the size of the union the kernel walks (``-1`` slots and blocks past the tile's last position
    excluded). Unique K+V bytes = ``sum * 2 * page * D * itemsize``; per-token reads would be the number of
    valid selection slots instead."""
    num_tokens, num_kv_heads, topk = block_indices.shape
    num_rows = seq_lens.shape[0]
    num_tiles = num_tiles_bound(num_tokens, num_rows, block_q)
    tiles = tile_table(query_start_loc, seq_lens, num_tokens, block_q, num_tiles)
    req, start, length, pos0 = (tiles[:, j] for j in range(4))
    offs = jnp.arange(block_q, dtype=jnp.int32)
    tok = jnp.clip(start[:, None] + offs[None, :], 0, num_tokens - 1)  # [tiles, bq]
    tok_ok = (offs[None, :] < length[:, None]) & (req >= 0)[:, None]
    big = jnp.iinfo(jnp.int32).max
    n_visible = visible_blocks(req >= 0, pos0, length, page=page, max_blocks=big)
    sel = jnp.transpose(block_indices.astype(jnp.int32)[tok], (0, 2, 1, 3))  # [tiles, H_kv, bq, topk]
    sel = sel.reshape(num_tiles, num_kv_heads, block_q * topk)
    tok_ok = jnp.repeat(tok_ok, topk, axis=1)[:, None, :]
    ok = tok_ok & (sel >= 0) & (sel < n_visible[:, None, None])
    srt = jnp.sort(jnp.where(ok, sel, big), axis=-1)
    prev = jnp.concatenate([jnp.full(srt.shape[:-1] + (1,), -1, jnp.int32), srt[..., :-1]], axis=-1)
    return jnp.sum((srt != big) & (srt != prev), axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------
# Public entry point and reference
# ----------------------------------------------------------------------------------------------------------


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
    """Ragged block-sparse attention over a paged KV cache (MSA), per token and per KV group.

    Args:
      q: ``[T, H_q, D]`` packed query tokens (bf16 or f32).
      k_cache, v_cache: ``[H_kv, P, page, D]`` paged caches (page = sparse block size, a power of 2).
      block_tables: ``int32[R, max_blocks]`` logical block -> physical page of each request row.
      seq_lens: ``int32[R]`` lengths including this step's tokens (0 for padding rows).
      query_start_loc: ``int32[R + 1]`` ragged query boundaries; slots ``>= qsl[R]`` are padding.
      block_indices: ``int32[T, H_kv, topk]`` selected logical blocks per (token, KV group), -1 padded.
      scale: softmax scale (``head_dim ** -0.5`` for M3).
      window: static sliding window ``W`` (``None``: no window): a token at position ``pos`` attends only to
        the keys ``pos - W < j <= pos`` of its selected blocks (the window masks the attention; the selection
        is the caller's). The pre-pass drops selected blocks that end before the first window of a tile (never
        read); the walk masks the rest per score.
      implementation: ``"pallas"`` (Triton kernels; interpret mode on CPU) or ``"reference"`` (plain jnp).
      interpret: ``None``: interpret mode on CPU, compiled Triton on GPU.
      block_q, num_splits, num_warps, num_stages, block_k: launch overrides; ``None`` asks the chip's policy
        (``tuning.sparse_attention_launch_config``). ``block_k``: keys per step of the walk (a power of 2
        dividing the page).
      chip: a chip of ``tuning.CHIPS`` whose launch tables to use (``None``: the default device's).

    Returns:
      ``[T, H_q, D]`` in q's dtype; zeros for padding slots and for tokens without a visible selected key.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_indices)
    check_window(window)
    if implementation == "reference":
        return ragged_sparse_attention_reference(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_indices, scale=scale, window=window
        )
    if implementation != "pallas":
        raise ValueError(f"implementation must be 'pallas' or 'reference', got {implementation!r}")
    config = sparse_attention_launch_config(
        num_tokens=q.shape[0],
        num_requests=block_tables.shape[0],
        num_q_heads=q.shape[1],
        num_kv_heads=k_cache.shape[0],
        topk=block_indices.shape[2],
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
    return ragged_sparse_attention_pallas(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        block_indices,
        scale=scale,
        config=config,
        interpret=resolve_interpret(interpret),
        window=window,
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
    """Plain-jnp ``ragged_sparse_attention``: the kernel's parameters and result; ``implementation``,
    ``interpret``, the launch tunables and ``chip`` are named and ignored (changing them reuses the compiled
    program).

    Gathers each (token, KV group)'s selected pages (``[T, H_kv, topk, page, D]``), masks repeated, ``-1``,
    invisible and future keys (and keys outside the ``window``), and runs an fp32 softmax. Memory is O(T * H_kv
    * topk * page * D).
    """
    del implementation, interpret, block_q, num_splits, num_warps, num_stages, chip, block_k
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_indices)
    check_window(window)
    return _reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_indices, scale=scale,
                      window=window)


@functools.partial(jax.jit, static_argnames=("scale", "window"))
def _reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_indices, *, scale, window):
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
    if window is not None:
        visible = visible & (kpos > (pos - window)[:, None, None, None])
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
