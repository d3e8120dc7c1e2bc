"""Draft-block attention of the DSpark drafter (SPEC section 6): each block slot attends to the visible context
keys and to every key of its own block (bidirectional inside the block), under one softmax.

:func:`draft_attention` is the serving implementation (two score blocks, no K/V concatenation);
:func:`draft_attention_reference` is the same contract through the target's masked
:func:`~minimax_jax.attention.grouped_attention`. A Pallas kernel would sit beside them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minimax_jax.attention import MASK_VALUE, grouped_attention


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
