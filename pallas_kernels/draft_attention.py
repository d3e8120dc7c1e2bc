"""DSpark draft-block attention as a Pallas (Triton) kernel: each request row's paged context read once per KV head.

Contract (the drafter's attention, docs/DRAFTER.md; ``minimax_jax.draft_attention.draft_attention`` with a
length mask). ``q: [R, K, H_q, D]`` the block's queries (``K`` draft slots); the context caches ``k_cache,
v_cache: [H_kv, P, page, D]`` (the target's paged layout), or the whole draft cache ``[L, H_kv, P, page, D]``
with a ``layer``; ``block_tables: int32[R_c, nb]`` (logical block ``b`` of cache row ``c`` is physical page
``block_tables[c, b]``: position ``j`` lives on page ``block_tables[c, j // page]`` at offset ``j % page``);
``ctx_lengths: int32[R]``; ``k_blk, v_blk: [R, K, H_kv, D]`` the block's own keys and values. Slot ``k`` of
row ``r`` and query head ``qh`` of KV group ``g = qh // (H_q / H_kv)`` attend, under ONE softmax (scale
``scale``, fp32), to the context keys ``j < ctx_lengths[r]`` of cache row ``r`` (or ``cache_rows[r]``; a
negative entry reads nothing) and to all ``K`` block keys (bidirectional inside the block). The output has q's
dtype. Lengths are clamped to ``[0, nb * page]``; block-table entries and pages at or past a row's length are
never read (they may hold anything, NaN included), so the bytes read follow the lengths, not the capacity.

Sliding window (``window = W``, static; the Qwen3-style DSpark drafter's non-causal sliding-window layers,
docs/DRAFTER.md): slot ``k`` of row ``r`` sits at position ``query_positions[r] + k`` (default: the row's
context length) and sees only the context keys ``j > query_positions[r] + k - W`` (and ``j < ctx_lengths[r]``),
the trained mask of ModelOpt's DFlash/DSpark drafters (``kv > q_pos - window`` on the context, the block never
windowed). The walk then starts at the window's first page: pages before it are never read either.

Algorithm. One program per (request row, KV head, head chunk, split): its query tile is the ``K`` slots x
``block_h`` heads of the group (row = slot * block_h + head, padded to a power of 2 >= 16; at M3, K = 7 -> 8
slots x 16 heads = 128 rows), so every context key and value is loaded once per (row, KV head) for all of
them. The context is walked in ``block_s``-key steps, ``page / block_s`` steps per page (``block_s`` divides
the page); each step loads its page id from the row's block-table entry (one scalar load, as the target's
paged walk in ``attention_walk`` does) and a ``block_s``-key slice of that page (unmasked full steps, one
masked tail step), with an online softmax in the log2 domain; the last split then adds the block's ``K`` keys
(padded to 16 and masked). With ``num_splits > 1`` the splits write fp32 partial outputs and a base-2
log-sum-exp and the split-K merge kernel of ``attention_walk`` combines them. The layer is a kernel input (a
value, not a block index), so one compiled kernel serves every layer of the cache. Every in-kernel shape is a
power of 2 and every dot 2-D. Launch settings: ``tuning.draft_attention_launch_config`` (per chip).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import MASK_VALUE, cdiv, check_window, next_pow2
from pallas_kernels.attention_walk import (
    LOG2E,
    dot_f32,
    merge_splits,
    online_softmax_step,
    pallas_call,
    split_outputs,
    store_walk_output,
)
from pallas_kernels.platform import resolve_interpret
from pallas_kernels.tuning import (
    COMPILED_DTYPES,
    MIN_DOT_DIM,
    DraftAttentionLaunchConfig,
    draft_attention_launch_config,
    draft_attention_rows,
    resolve_chip,
)

WINDOW_MAX_BLOCK_S = 64  # context keys per step of the windowed walk (its per-row masks)

__all__ = ["draft_attention", "draft_attention_pallas", "draft_attention_reference", "paged_context", "supports"]



# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------


def _draft_attention_kernel(
    layer_ref,  # [1] int32: the layer of the cache to read
    len_ref,  # [R] int32 context lengths
    *refs,  # [qpos_ref [R] int32 when windowed], [rows_ref [R] when has_rows], bt_ref [R_c, nb] int32,
    #         q_ref [R*K*H_q, D],
    #         k_ref / v_ref [L, P, page, D] (this KV head), kb_ref / vb_ref [R*K*H_kv, D],
    #         then the outputs (o_ref, or o_ref f32 + lse_ref f32 for split-K)
    has_rows: bool,
    window: int | None,
    block_size: int,
    group: int,
    block_h: int,
    num_q_heads: int,
    num_kv_heads: int,
    block_s: int,
    rows: int,
    blk_rows: int,
    num_splits: int,
    scale: float,
):
    refs = list(refs)
    qpos_ref = refs.pop(0) if window is not None else None
    rows_ref = refs.pop(0) if has_rows else None
    bt_ref, q_ref, k_ref, v_ref, kb_ref, vb_ref, *out_refs = refs
    r = pl.program_id(0)
    chunks = cdiv(group, block_h)
    g = pl.program_id(1) // chunks
    chunk = pl.program_id(1) % chunks
    split = pl.program_id(2)
    _, num_pages, page, head_dim = k_ref.shape
    num_cache_rows, max_blocks = bt_ref.shape
    layer = layer_ref[0]  # a value, not a block index: one compiled kernel serves every layer

    length = jnp.clip(len_ref[r], 0, max_blocks * page)
    if has_rows:
        crow = rows_ref[r]
        length = jnp.where((crow >= 0) & (crow < num_cache_rows), length, 0)
        crow = jnp.clip(crow, 0, num_cache_rows - 1)
    else:
        crow = r

    # Query rows: slot-major, the chunk's heads inside (row = slot * block_h + head).
    i = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    slot = i // block_h
    head = chunk * block_h + i % block_h
    row_ok = (slot < block_size) & (head < group)
    q_rows = jnp.where(row_ok, (r * block_size + slot) * num_q_heads + g * group + head, 0)
    d = jax.lax.broadcasted_iota(jnp.int32, (head_dim,), 0)
    q = plgpu.load(q_ref.at[q_rows[:, None], d[None, :]], mask=row_ok[:, None], other=0)  # [rows, D]
    qk_scale = scale * LOG2E

    # The context walk: steps [first, n_steps) of cdiv(length, block_s), page / block_s steps per page, shared
    # out among the splits; without a window the first n_full need no mask, with one every step is masked per
    # query row (each slot's window start). Step ``step`` reads block-table entry step // parts.
    parts = page // block_s
    n_steps = (length + block_s - 1) // block_s
    n_full = length // block_s
    if window is None:
        first = jnp.int32(0)
        lo0 = row_lo = None
    else:
        lo0 = qpos_ref[r] - (window - 1)  # slot 0's first visible context position (slot k: lo0 + k)
        first = jnp.clip(lo0, 0, length) // block_s
        row_lo = lo0 + slot  # [rows]
    total = n_steps - first
    lo = first + (split * total) // num_splits
    hi = first + ((split + 1) * total) // num_splits
    key_iota = jax.lax.broadcasted_iota(jnp.int32, (block_s,), 0)

    def kv_slice(ref, step):
        """This step's ``[block_s, D]`` slice of its page (the page id: one scalar load of the table)."""
        if parts == 1:  # (no multiple_of on a constant offset: jax 0.11's Triton lowering rejects it)
            return ref.at[layer, jnp.clip(bt_ref[crow, step], 0, num_pages - 1)]
        page_id = jnp.clip(bt_ref[crow, step // parts], 0, num_pages - 1)
        off = pl.multiple_of((step % parts) * block_s, block_s)
        return ref.at[layer, page_id, pl.ds(off, block_s), :]

    def full_step(step, carry):
        kb = kv_slice(k_ref, step)[...]  # [block_s, D]
        vb = kv_slice(v_ref, step)[...]
        return online_softmax_step(carry, dot_f32(q, kb, contract_b=1) * qk_scale, vb)  # scores [rows, block_s]

    def masked_step(step, carry):
        pos = step * block_s + key_iota  # [block_s]
        in_len = pos < length  # never read at or past the length
        if row_lo is not None:
            in_len = in_len & (pos >= lo0)  # nor before slot 0's window
        kb = plgpu.load(kv_slice(k_ref, step), mask=in_len[:, None], other=0)
        vb = plgpu.load(kv_slice(v_ref, step), mask=in_len[:, None], other=0)
        visible = in_len[None, :]
        if row_lo is not None:
            visible = visible & (pos[None, :] >= row_lo[:, None])  # [rows, block_s]: each slot's window
        s = jnp.where(visible, dot_f32(q, kb, contract_b=1) * qk_scale, MASK_VALUE)
        return online_softmax_step(carry, s, vb, visible)

    carry = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    if window is None:
        carry = jax.lax.fori_loop(lo, jnp.minimum(hi, n_full), full_step, carry)
        carry = jax.lax.fori_loop(jnp.maximum(lo, n_full), hi, masked_step, carry)
    else:  # at most window / block_s + 2 steps: every one masked (one loop body keeps the registers low)
        carry = jax.lax.fori_loop(lo, hi, masked_step, carry)

    # The block's own keys (every slot sees all K of them), in the last split only.
    j = jax.lax.broadcasted_iota(jnp.int32, (blk_rows,), 0)
    j_ok = j < block_size
    blk_idx = jnp.where(j_ok, (r * block_size + j) * num_kv_heads + g, 0)
    kb = plgpu.load(kb_ref.at[blk_idx[:, None], d[None, :]], mask=j_ok[:, None], other=0)  # [blk_rows, D]
    vb = plgpu.load(vb_ref.at[blk_idx[:, None], d[None, :]], mask=j_ok[:, None], other=0)
    take = j_ok & (split == num_splits - 1)
    s = jnp.where(take[None, :], dot_f32(q, kb, contract_b=1) * qk_scale, MASK_VALUE)
    acc, m_i, l_i = online_softmax_step(carry, s, vb, take[None, :])

    store_walk_output(out_refs, acc, m_i, l_i, q_rows=q_rows, row_ok=row_ok, num_rows=q_ref.shape[0],
                      num_splits=num_splits)


# ----------------------------------------------------------------------------------------------------------
# Validation, supports
# ----------------------------------------------------------------------------------------------------------


def _unsupported(
    *, head_dim: int, num_q_heads: int, num_kv_heads: int, block_size: int, page_size: int, dtype,
    interpret: bool
) -> str | None:
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        return f"H_q={num_q_heads} must be a positive multiple of H_kv={num_kv_heads}"
    for name, n in (("head_dim", head_dim), ("page size", page_size)):
        if n < 1 or n & (n - 1):
            return f"{name} must be a power of 2, got {n}"
    if block_size < 1 or next_pow2(block_size) > 128:
        return f"the block size K={block_size} must be in [1, 128]"
    if not jnp.issubdtype(dtype, jnp.floating):
        return f"q and the caches must be floating, got {jnp.dtype(dtype).name}"
    if interpret:
        return None
    if jnp.dtype(dtype).name not in COMPILED_DTYPES:
        return f"compiled kernels take {', '.join(COMPILED_DTYPES)}, got {jnp.dtype(dtype).name}"
    if min(head_dim, page_size) < MIN_DOT_DIM:
        return (f"compiled Triton dots need N and K >= {MIN_DOT_DIM}: head_dim {head_dim}, page {page_size} "
                f"(a context step is part of a page)")
    return None


def supports(
    *,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    page_size: int,
    dtype,
    chip: str | None = None,
    interpret: bool = False,
) -> bool:
    """Whether :func:`draft_attention` runs these shapes, compiled for ``chip`` (``None``: the default
    device's) or in interpret mode: head_dim and the page size powers of 2, ``H_q`` a multiple of ``H_kv``,
    ``K <= 128``; compiled, also a dtype of ``tuning.COMPILED_DTYPES`` and head_dim and page >= 16. Every chip
    has the same limits today."""
    resolve_chip(chip)
    return (
        _unsupported(
            head_dim=head_dim,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            page_size=page_size,
            dtype=dtype,
            interpret=interpret,
        )
        is None
    )


def _check_inputs(q, k_cache, v_cache, block_tables, ctx_lengths, k_blk, v_blk, layer, cache_rows, window=None,
                  query_positions=None):
    """Static shape/dtype checks (ValueErrors naming the shapes)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [R, K, H_q, D], got shape {q.shape}")
    r, kq, h, d = q.shape
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {k_cache.shape} {k_cache.dtype} and v_cache {v_cache.shape} {v_cache.dtype} must match"
        )
    if k_cache.ndim == 5:
        if layer is None or not 0 <= layer < k_cache.shape[0]:
            raise ValueError(
                f"a [L, H_kv, P, page, D] cache {k_cache.shape} needs a static layer in [0, "
                f"{k_cache.shape[0]}), got {layer!r}"
            )
    elif k_cache.ndim != 4 or layer is not None:
        raise ValueError(
            f"k_cache must be paged, [H_kv, P, page, D] (layer=None) or [L, H_kv, P, page, D] with a layer, got "
            f"shape {k_cache.shape} and layer={layer!r}"
        )
    g, _, _, dk = k_cache.shape[-4:]
    if dk != d or g < 1 or h % g:
        raise ValueError(f"q {q.shape} and the cache {k_cache.shape} do not fit (head_dim, H_q % H_kv)")
    if k_blk.shape != (r, kq, g, d) or v_blk.shape != k_blk.shape:
        raise ValueError(
            f"k_blk, v_blk must be [R, K, H_kv, D] = {[r, kq, g, d]}, got {k_blk.shape}, {v_blk.shape}"
        )
    if ctx_lengths.shape != (r,) or not jnp.issubdtype(ctx_lengths.dtype, jnp.integer):
        raise ValueError(
            f"ctx_lengths must be int32[R={r}], got {ctx_lengths.dtype}{list(ctx_lengths.shape)}"
        )
    if (block_tables.ndim != 2 or block_tables.shape[0] < 1 or block_tables.shape[1] < 1
            or not jnp.issubdtype(block_tables.dtype, jnp.integer)):
        raise ValueError(
            f"block_tables must be int32[R_c, nb] with R_c, nb >= 1, got "
            f"{block_tables.dtype}{list(block_tables.shape)}"
        )
    if cache_rows is None:
        if block_tables.shape[0] != r:
            raise ValueError(
                f"without cache_rows the block tables must hold R={r} rows, got {block_tables.shape[0]}"
            )
    elif cache_rows.shape != (r,) or not jnp.issubdtype(cache_rows.dtype, jnp.integer):
        raise ValueError(f"cache_rows must be int32[R={r}], got {cache_rows.dtype}{list(cache_rows.shape)}")
    check_window(window)
    if query_positions is not None:
        if window is None:
            raise ValueError("query_positions only matter with a window: pass window= too")
        if query_positions.shape != (r,) or not jnp.issubdtype(query_positions.dtype, jnp.integer):
            raise ValueError(f"query_positions must be int32[R={r}], got "
                             f"{query_positions.dtype}{list(query_positions.shape)}")


# ----------------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("scale", "layer", "config", "interpret", "poison", "window"))
def draft_attention_pallas(
    q,
    k_cache,
    v_cache,
    block_tables,
    ctx_lengths,
    k_blk,
    v_blk,
    cache_rows=None,
    query_positions=None,
    *,
    scale: float,
    layer: int | None,
    config: DraftAttentionLaunchConfig,
    interpret: bool,
    poison: bool = False,
    window: int | None = None,
):
    """The kernel (and the split-K merge) with an explicit launch ``config``. ``poison`` (tests only): the
    float output buffers start as NaN, so a row the kernels fail to write shows up."""
    _check_inputs(q, k_cache, v_cache, block_tables, ctx_lengths, k_blk, v_blk, layer, cache_rows, window,
                  query_positions)
    page = k_cache.shape[-2]
    reason = _unsupported(
        head_dim=q.shape[3],
        num_q_heads=q.shape[2],
        num_kv_heads=k_blk.shape[2],
        block_size=q.shape[1],
        page_size=page,
        dtype=k_cache.dtype,
        interpret=interpret,
    )
    if reason:
        raise ValueError(f"{reason}; use implementation='reference'")
    r, kq, h, d = q.shape
    g = k_blk.shape[2]
    group = h // g
    block_h, block_s, num_splits = config.block_h, config.block_s, config.num_splits
    if block_h < 1 or block_s < 1 or block_s & (block_s - 1) or num_splits < 1:
        raise ValueError(f"bad launch config {config}")
    if page % block_s:
        raise ValueError(f"block_s ({block_s}) must divide the page size ({page}): a context step is part of a page")
    if not interpret and block_s < MIN_DOT_DIM:
        raise ValueError(f"compiled Triton dots need N >= {MIN_DOT_DIM}: context keys per step {block_s}")
    rows = draft_attention_rows(kq, block_h)
    blk_rows = max(MIN_DOT_DIM, next_pow2(kq))
    chunks = cdiv(group, block_h)
    num_cache_rows, max_blocks = block_tables.shape
    flat_rows = r * kq * h
    grid = (r, g * chunks, num_splits)

    if k_cache.ndim == 4:  # one layer: a free reshape to the [L, H_kv, P, page, D] form
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    num_layers, _, num_pages, _, _ = k_cache.shape
    cache_spec = pl.BlockSpec((num_layers, None, num_pages, page, d), lambda i, c, s: (0, c // chunks, 0, 0, 0))
    full_1d = pl.BlockSpec((r,), lambda i, c, s: (0,))
    has_rows = cache_rows is not None
    if window is not None and query_positions is None:
        query_positions = ctx_lengths  # the block follows the visible context
    in_specs = (
        [pl.BlockSpec((1,), lambda i, c, s: (0,)), full_1d]
        + ([full_1d] if window is not None else [])
        + ([full_1d] if has_rows else [])
        + [
            pl.BlockSpec((num_cache_rows, max_blocks), lambda i, c, s: (0, 0)),
            pl.BlockSpec((flat_rows, d), lambda i, c, s: (0, 0)),
            cache_spec,
            cache_spec,
            pl.BlockSpec((r * kq * g, d), lambda i, c, s: (0, 0)),
            pl.BlockSpec((r * kq * g, d), lambda i, c, s: (0, 0)),
        ]
    )
    args = (
        [jnp.full((1,), layer, jnp.int32), ctx_lengths.astype(jnp.int32)]
        + ([query_positions.astype(jnp.int32)] if window is not None else [])
        + ([cache_rows.astype(jnp.int32)] if has_rows else [])
        + [
            block_tables.astype(jnp.int32),
            q.reshape(flat_rows, d),
            k_cache,
            v_cache,
            k_blk.reshape(r * kq * g, d),
            v_blk.reshape(r * kq * g, d),
        ]
    )
    out_shape, out_specs = split_outputs(flat_rows, d, q.dtype, num_splits)
    kernel = functools.partial(
        _draft_attention_kernel,
        has_rows=has_rows,
        window=window,
        block_size=kq,
        group=group,
        block_h=block_h,
        num_q_heads=h,
        num_kv_heads=g,
        block_s=block_s,
        rows=rows,
        blk_rows=blk_rows,
        num_splits=num_splits,
        scale=float(scale),
    )
    outs = pallas_call(
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
        name=f"draft_attention_rows{rows}_bs{block_s}_splits{num_splits}" + ("" if window is None else "_window"),
    )
    out = outs[0] if num_splits == 1 else merge_splits(
        outs, num_splits=num_splits, dtype=q.dtype, merge_rows=config.merge_rows, merge_warps=config.merge_warps,
        poison=poison, interpret=interpret, name=f"draft_attention_merge_splits{num_splits}")
    return out.reshape(r, kq, h, d)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "layer",
        "window",
        "implementation",
        "interpret",
        "block_h",
        "block_s",
        "num_splits",
        "num_warps",
        "num_stages",
        "chip",
    ),
)
def draft_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    ctx_lengths: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    *,
    scale: float,
    layer: int | None = None,
    cache_rows: jax.Array | None = None,
    window: int | None = None,
    query_positions: jax.Array | None = None,
    implementation: str = "pallas",
    interpret: bool | None = None,
    block_h: int | None = None,
    block_s: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    chip: str | None = None,
) -> jax.Array:
    """Draft-block attention over each row's paged context (``j < ctx_lengths[r]``) and the block's own keys.

    Args:
      q: ``[R, K, H_q, D]`` block queries.
      k_cache, v_cache: ``[H_kv, P, page, D]``, or ``[L, H_kv, P, page, D]`` with ``layer`` (static; the draft
        cache is read in place, no per-layer slice copy).
      block_tables: ``int32[R_c, nb]`` logical block -> physical page of each cache row (entries at or past a
        row's length are never read).
      ctx_lengths: ``int32[R]`` visible context of each row (clamped to ``[0, nb * page]``).
      k_blk, v_blk: ``[R, K, H_kv, D]`` the block's keys (normed, rotated) and values.
      scale: softmax scale.
      cache_rows: optional ``int32[R]``: row ``r`` reads through block-table row ``cache_rows[r]`` (negative:
        no context) instead of row ``r`` (what an engine's slot map needs without gathering the tables).
      window: static sliding window ``W`` (``None``: the whole context): slot ``k`` sees only the context keys
        ``j > query_positions[r] + k - W``; the block's own keys are always visible.
      query_positions: ``int32[R]`` position of slot 0 of each row (with ``window``; default ``ctx_lengths``).
      implementation: ``"pallas"`` (Triton; interpret mode on CPU) or ``"reference"`` (plain jnp).
      interpret: ``None``: interpret mode on CPU, compiled Triton on a GPU.
      block_h, block_s, num_splits, num_warps, num_stages: launch overrides; ``None`` asks the chip's policy
        (``tuning.draft_attention_launch_config``). chip: a chip of ``tuning.CHIPS`` (``None``: the device's).

    Returns:
      ``[R, K, H_q, D]`` in q's dtype.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, ctx_lengths, k_blk, v_blk, layer, cache_rows, window,
                  query_positions)
    if implementation == "reference":
        return draft_attention_reference(
            q, k_cache, v_cache, block_tables, ctx_lengths, k_blk, v_blk, scale=scale, layer=layer,
            cache_rows=cache_rows, window=window, query_positions=query_positions
        )
    if implementation != "pallas":
        raise ValueError(f"implementation must be 'pallas' or 'reference', got {implementation!r}")
    config = draft_attention_launch_config(
        num_rows=q.shape[0],
        block_size=q.shape[1],
        num_q_heads=q.shape[2],
        num_kv_heads=k_blk.shape[2],
        capacity=block_tables.shape[1] * k_cache.shape[-2] if window is None
        else min(block_tables.shape[1] * k_cache.shape[-2], window + q.shape[1]),  # the keys a row can read
        page_size=k_cache.shape[-2],
        head_dim=q.shape[3],
        itemsize=k_cache.dtype.itemsize,
        chip=chip,
        block_h=block_h,
        block_s=block_s,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if window is not None and block_s is None and config.block_s > WINDOW_MAX_BLOCK_S:
        # the windowed walk masks every step per query row: 128-key steps spill on sm_90 (compile gate)
        config = dataclasses.replace(config, block_s=WINDOW_MAX_BLOCK_S)
    return draft_attention_pallas(
        q,
        k_cache,
        v_cache,
        block_tables,
        ctx_lengths,
        k_blk,
        v_blk,
        cache_rows,
        query_positions,
        scale=scale,
        layer=layer,
        config=config,
        interpret=resolve_interpret(interpret),
        window=window,
    )


def paged_context(cache: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Each row's context in position order through its block table, in plain jnp: ``cache [H_kv, P, page,
    D]``, ``block_tables int32[R, nb]`` -> ``[R, nb * page, H_kv, D]`` (a gather of every table entry; the
    caller masks by length, and entries outside ``[0, P)`` read a clamped page)."""
    h, num_pages, page, d = cache.shape
    r, nb = block_tables.shape
    pages = cache[:, jnp.clip(block_tables, 0, num_pages - 1)]  # [H_kv, R, nb, page, D]
    return jnp.moveaxis(pages, 0, 3).reshape(r, nb * page, h, d)


def draft_attention_reference(
    q,
    k_cache,
    v_cache,
    block_tables,
    ctx_lengths,
    k_blk,
    v_blk,
    *,
    scale: float,
    layer: int | None = None,
    cache_rows=None,
    window: int | None = None,
    query_positions=None,
    **ignored,
) -> jax.Array:
    """Plain jnp, same contract as :func:`draft_attention` (launch arguments are accepted and ignored): the
    row's context gathered through its block table (:func:`paged_context`) and the block's keys concatenated,
    one masked fp32 softmax per (slot, head)."""
    del ignored
    _check_inputs(q, k_cache, v_cache, block_tables, ctx_lengths, k_blk, v_blk, layer, cache_rows, window,
                  query_positions)
    kc = k_cache if layer is None else k_cache[layer]
    vc = v_cache if layer is None else v_cache[layer]
    r, kq, h, d = q.shape
    g = kc.shape[0]
    capacity = block_tables.shape[1] * kc.shape[2]
    lengths = jnp.clip(ctx_lengths.astype(jnp.int32), 0, capacity)
    tables = block_tables.astype(jnp.int32)
    if cache_rows is not None:
        ok = (cache_rows >= 0) & (cache_rows < tables.shape[0])
        tables = tables[jnp.clip(cache_rows, 0, tables.shape[0] - 1)]
        lengths = jnp.where(ok, lengths, 0)
    kc, vc = paged_context(kc, tables), paged_context(vc, tables)  # [R, S, G, D]
    keys = jnp.concatenate([kc, k_blk.astype(kc.dtype)], axis=1).astype(jnp.float32)  # [R, S + K, G, D]
    values = jnp.concatenate([vc, v_blk.astype(vc.dtype)], axis=1).astype(jnp.float32)
    pos = jnp.arange(capacity)[None, None, :]  # [1, 1, S]
    ctx = jnp.broadcast_to(pos < lengths[:, None, None], (r, kq, capacity))  # [R, K, S]
    if window is not None:
        qpos = (ctx_lengths if query_positions is None else query_positions).astype(jnp.int32)
        slot_pos = qpos[:, None] + jnp.arange(kq, dtype=jnp.int32)[None, :]  # [R, K]
        ctx = ctx & (pos > slot_pos[:, :, None] - window)
    visible = jnp.concatenate([ctx, jnp.ones((r, kq, kq), bool)], axis=2)  # [R, K, S + K]
    qg = q.astype(jnp.float32).reshape(r, kq, g, h // g, d)
    s = jnp.einsum("rqgnd,rsgd->rgnqs", qg, keys, precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(visible[:, None, None], p, 0.0)  # masked (possibly NaN) values never contribute
    values = jnp.where(jnp.any(visible, axis=1)[:, :, None, None], values, 0.0)  # keys no slot sees
    out = jnp.einsum(
        "rgnqs,rsgd->rqgnd",
        p,
        values,
        precision=jax.lax.Precision.HIGHEST,
    )
    return out.reshape(r, kq, h, d).astype(q.dtype)
