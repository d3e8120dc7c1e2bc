"""Draft-block attention of DSpark (docs/DRAFTER.md): each block slot attends to the visible context
keys and to every key of its own block (bidirectional inside the block), under one softmax.

:func:`draft_attention` is the plain-jnp implementation (two score blocks, no K/V concatenation);
:func:`draft_attention_reference` is the same contract through the target's masked
:func:`~minimax_jax.attention.grouped_attention`. The Pallas kernel is
:func:`pallas_kernels.draft_attention.draft_attention`: the drafter's context mask is a length mask
(``j < min(length, anchor position)``), so the kernel takes the lengths and reads each row's paged context
(through its block table) only up to them, once per (row, KV head) for all ``K`` slots.
:func:`choose_implementation` picks between the two the way ``decode.choose_implementation`` does for the
target's kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minimax_jax.attention import MASK_VALUE, grouped_attention
from pallas_kernels import draft_attention as _kernel
from pallas_kernels.platform import resolve_auto

IMPLEMENTATIONS = ("auto", "pallas", "reference")


def choose_implementation(implementation: str, cfg, *, block_size: int, page_size: int, dtype,
                          interpret: bool | None = None) -> str:
    """Resolve the drafter's attention implementation: ``"pallas"`` (the kernel; Pallas interpret mode on CPU)
    or ``"reference"`` (the plain-jnp :func:`draft_attention`) pass through; ``"auto"`` (the default) is the
    compiled kernel on a GPU when it ``supports`` the draft layers' shapes (``cfg``: their
    ``MiniMaxM3Config``), ``K``, the draft cache's ``page_size`` and its ``dtype``, interpret mode with ``interpret=True``, and the jnp
    path otherwise (CPU)."""
    def supported():
        return _kernel.supports(head_dim=cfg.head_dim, num_q_heads=cfg.num_attention_heads,
                                num_kv_heads=cfg.num_key_value_heads, block_size=block_size, page_size=page_size,
                                dtype=dtype)

    return resolve_auto(implementation, interpret=interpret, supported=supported, choices=IMPLEMENTATIONS)


def draft_attention(q, k_ctx, v_ctx, ctx_visible, k_blk, v_blk, *, scale: float) -> jax.Array:
    """Block attention over [visible context ; the whole block] without concatenating keys.

    ``q [R, K, H, D]``; ``k_ctx, v_ctx [R, S, G, D]``; ``ctx_visible bool[R, 1|K, S]``;
    ``k_blk, v_blk [R, K, G, D]`` -> ``[R, K, H, D]``. The two score sets share one softmax (joint max and
    denominator), in fp32. The block keys are always visible, so no row is ever fully masked.
    """
    r, kq, h, d = q.shape
    g = k_ctx.shape[2]
    qg = q.reshape(r, kq, g, h // g, d)
    s_ctx = jnp.einsum("rqgnd,rsgd->rgnqs", qg, k_ctx, preferred_element_type=jnp.float32) * scale
    s_blk = jnp.einsum("rqgnd,rkgd->rgnqk", qg, k_blk, preferred_element_type=jnp.float32) * scale
    vis = ctx_visible[:, None, None, :, :]
    s_ctx = jnp.where(vis, s_ctx, MASK_VALUE)
    m = jnp.maximum(jnp.max(s_ctx, axis=-1), jnp.max(s_blk, axis=-1))[..., None]
    p_ctx = jnp.where(vis, jnp.exp(s_ctx - m), 0.0)
    p_blk = jnp.exp(s_blk - m)
    denom = jnp.sum(p_ctx, axis=-1) + jnp.sum(p_blk, axis=-1)
    out = (jnp.einsum("rgnqs,rsgd->rgnqd", p_ctx.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32)
           + jnp.einsum("rgnqk,rkgd->rgnqd", p_blk.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32))
    out = out / denom[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(r, kq, h, d).astype(q.dtype)


def draft_attention_reference(q, k_ctx, v_ctx, ctx_visible, k_blk, v_blk, *, scale: float) -> jax.Array:
    """Same contract as :func:`draft_attention`: concatenated keys and an explicit mask through
    :func:`minimax_jax.attention.grouped_attention`."""
    r, kq = q.shape[:2]
    g, s = k_ctx.shape[2], k_ctx.shape[1]
    k = jnp.concatenate([k_ctx, k_blk], axis=1)
    v = jnp.concatenate([v_ctx, v_blk], axis=1)
    allowed = jnp.concatenate([jnp.broadcast_to(ctx_visible, (r, kq, s)), jnp.ones((r, kq, kq), bool)], axis=-1)
    return grouped_attention(q, k, v, jnp.broadcast_to(allowed[:, None], (r, g, kq, s + kq)), scale=scale)
