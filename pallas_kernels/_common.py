"""Helpers every kernel module shares: power-of-2 sizes, the mask value, out-of-bounds store lanes and the
ragged *query tiles* (how a kernel program finds its tokens).

Query tiles (the indexer and both attention walks cut a ragged batch the same way). The batch has ``R + 1``
*segments*: the ``R`` request rows (``[qsl[r], qsl[r + 1])``, zero-length rows included) and the padding tail
``[qsl[R], T)``. Each segment is cut into tiles of up to ``block_q`` consecutive tokens, segment by segment, in
order; a zero-length segment owns no tile. A program locates its tile on the device from ``query_start_loc``
and ``seq_lens`` alone (never from host lengths or ``max_query_len``): ``load_segments`` reads the segment
vectors, ``locate_tile`` finds the tile in them. ``num_tiles_bound`` is the static grid size, ``tile_table`` the
same search in plain jnp for tests and bytes models.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plgpu

# Large-but-finite mask value: exp(MASK_VALUE - m) underflows to 0, MASK_VALUE - MASK_VALUE stays finite, and a
# fully masked row pools or normalises to a number, never NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def next_pow2(n: int) -> int:
    """Smallest power of 2 >= ``n`` (1 for ``n <= 1``): in-kernel shapes are powers of 2."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def out_of_bounds_where(ok, idx, size: int):
    """Store index of masked lanes: ``size`` (one past the end) where ``ok`` is False.

    Compiled kernels never touch masked lanes; interpret mode discharges a masked store as a scatter that writes
    the old value back on masked lanes, so they must not alias a live lane (a clamped index would collide with a
    real one inside one store): out-of-bounds scatter updates are dropped.
    """
    return jnp.where(ok, idx, size)


def num_tiles_bound(num_tokens: int, num_requests: int, block_q: int) -> int:
    """Static upper bound on the query tiles of any valid batch, padding-tail tiles included.

    Every non-empty segment (at most ``min(R + 1, T)`` of them: each holds a token) wastes at most
    ``block_q - 1`` slots of its last tile, and every tile holds at least one token.
    """
    segments = min(num_requests + 1, num_tokens)
    return max(1, min(num_tokens, (num_tokens + segments * (block_q - 1)) // block_q))


def locate_tile(tile, seg_start, seg_len, seg_seq, *, num_rows: int, block_q: int):
    """Query tile ``tile`` of the ragged batch, from the segment vectors (traced in kernels and in jnp).

    ``seg_start, seg_len, seg_seq: int32[S_pow2]`` hold each segment's first token, tokens and seq_len (zeros
    past segment ``R``). Returns scalars ``(req, tok0, ntok, pos0)``: the tile holds tokens
    ``[tok0, tok0 + ntok)`` of request row ``req``, token ``tok0`` sits at position ``pos0``. ``req`` (and
    ``pos0``) is -1 for padding-tail tiles, which only write their "nothing" output, and for tiles past the
    last one (``ntok == 0``), which do nothing.
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


def visible_blocks(live, pos0, ntok, *, page: int, max_blocks: int):
    """Blocks visible to the last token of a tile (tokens at positions ``[pos0, pos0 + ntok)``):
    ``cdiv(pos_last + 1, page)``, at most ``max_blocks``; 0 for a tile that is not ``live`` or holds no token.
    Nothing at or past this bound is ever read."""
    last = pos0 + ntok - 1
    n = jnp.minimum(jnp.maximum(last, 0) // page + 1, max_blocks)
    return jnp.where(live & (ntok > 0) & (last >= 0), n, 0)


def check_window(window) -> None:
    """A sliding window is a positive int (each query sees its last ``window`` positions, itself included) or
    ``None`` (no window); a ValueError names anything else."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive integer (the sliding window in tokens) or None, got {window!r}")


def window_start(live, pos0, ntok, *, page: int, window: int):
    """The first block a sliding ``window`` lets a tile (tokens at positions ``[pos0, pos0 + ntok)``) see: the
    blocks before it end before every token's window (never read). 0 for a tile that is not ``live``."""
    start = jnp.maximum(pos0 - window + 1, 0) // page
    return jnp.where(live & (ntok > 0) & (pos0 >= 0), start, 0)


def window_walk_bound(max_blocks: int, page: int, window: int | None) -> int:
    """Launch policy input: the most blocks a one-token tile walks, ``max_blocks``, or with a sliding
    ``window`` at most the ``cdiv(window - 1, page) + 1`` pages a window of one token touches."""
    if window is None:
        return max_blocks
    return max(1, min(max_blocks, cdiv(window - 1, page) + 1))


def load_segments(qsl_ref, seq_ref, *, num_rows: int, num_tokens: int):
    """In-kernel: the segment vectors of :func:`locate_tile` from ``qsl_ref [R + 1]`` and ``seq_ref [R]``."""
    seg = jax.lax.broadcasted_iota(jnp.int32, (next_pow2(num_rows + 1),), 0)
    in_seg, in_row = seg <= num_rows, seg < num_rows
    seg_start = plgpu.load(qsl_ref.at[jnp.where(in_seg, seg, 0)], mask=in_seg, other=0)
    seg_end = plgpu.load(qsl_ref.at[jnp.where(in_row, seg + 1, 0)], mask=in_row, other=num_tokens)
    seg_len = jnp.where(in_seg, jnp.clip(seg_end - seg_start, 0, num_tokens), 0)
    seg_seq = plgpu.load(seq_ref.at[jnp.where(in_row, seg, 0)], mask=in_row, other=0)
    return seg_start, seg_len, seg_seq


def tile_table(query_start_loc, seq_lens, num_tokens: int, block_q: int, num_tiles: int) -> jax.Array:
    """``int32[num_tiles, 4]``: :func:`locate_tile` for every tile in plain jnp, rows ``(request row or -1,
    first packed token, tokens, first position)`` (the kernels run the same search per program)."""
    qsl = query_start_loc.astype(jnp.int32)
    num_rows = seq_lens.shape[0]
    size = next_pow2(num_rows + 1)
    pad = size - (num_rows + 1)
    seg_start = jnp.pad(qsl, (0, pad))
    seg_end = jnp.pad(jnp.concatenate([qsl[1:], jnp.full((1,), num_tokens, jnp.int32)]), (0, pad))
    seg_len = jnp.where(jnp.arange(size) <= num_rows, jnp.clip(seg_end - seg_start, 0, num_tokens), 0)
    seg_seq = jnp.pad(seq_lens.astype(jnp.int32), (0, size - num_rows))
    locate = functools.partial(locate_tile, num_rows=num_rows, block_q=block_q)
    cols = jax.vmap(lambda t: locate(t, seg_start, seg_len, seg_seq))(jnp.arange(num_tiles, dtype=jnp.int32))
    return jnp.stack(cols, axis=1).astype(jnp.int32)
