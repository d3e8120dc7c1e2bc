"""MiniMax-M3 attention: GQA with per-head Gemma QK-norm and partial RoPE; MSA sparse layers add an indexer.

This module holds the parameters and the plain whole-sequence computation (pure jnp, exact). The paged,
ragged decode path reuses :meth:`Attention.project_qkv` and :meth:`MSAIndexer.project` and swaps the
attention core for the Pallas kernels (see ``minimax_jax/decode.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from minimax_jax import msa
from minimax_jax.config import MiniMaxM3Config
from minimax_jax.layers import apply_rope, linear_for, norm_for

# Large finite negative instead of -inf so a fully masked row can never produce NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class MSAIndexer(nnx.Module):
    """The lightning indexer of a sparse layer: ``index_n_heads`` query heads and ONE shared key head. ``prefix``:
    the module's path in the model (``layers.2.self_attn.indexer``), for :func:`~minimax_jax.layers.linear_for`."""

    def __init__(self, cfg: MiniMaxM3Config, *, dtype, rngs: nnx.Rngs, prefix: str = ""):
        self.cfg = cfg
        d, hi, di = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
        self.q_proj = linear_for(cfg, prefix + ".q_proj", d, hi * di, dtype=dtype, rngs=rngs)
        self.k_proj = linear_for(cfg, prefix + ".k_proj", d, di, dtype=dtype, rngs=rngs)
        self.q_norm = norm_for(cfg, di, dtype=dtype)
        self.k_norm = norm_for(cfg, di, dtype=dtype)

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [..., S, d]`` -> ``index_q [..., S, H_idx, D_idx]``, ``index_k [..., S, D_idx]`` (normed, RoPE)."""
        c = self.cfg
        q = self.q_norm(self.q_proj(x).reshape(*x.shape[:-1], c.index_n_heads, c.index_head_dim))
        k = self.k_norm(self.k_proj(x).reshape(*x.shape[:-1], 1, c.index_head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)[..., 0, :]

    def select(self, x: jax.Array, positions: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Whole-sequence selection: ``x [B, S, d]`` -> ``int32[B, H_idx, S, topk]`` (keys = the same tokens)."""
        c = self.cfg
        q, k = self.project(x, cos, sin)
        scores = msa.block_scores(q, k, positions, block_size=c.index_block_size)
        return msa.select_blocks(scores, positions, block_size=c.index_block_size, topk=c.index_topk_blocks,
                                 local_blocks=c.index_local_blocks)


class Attention(nnx.Module):
    def __init__(self, cfg: MiniMaxM3Config, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.layer_idx = layer_idx
        d, h, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        p = f"layers.{layer_idx}.self_attn"
        self.q_proj = linear_for(cfg, p + ".q_proj", d, h * hd, dtype=dtype, rngs=rngs)
        self.k_proj = linear_for(cfg, p + ".k_proj", d, hkv * hd, dtype=dtype, rngs=rngs)
        self.v_proj = linear_for(cfg, p + ".v_proj", d, hkv * hd, dtype=dtype, rngs=rngs)
        self.o_proj = linear_for(cfg, p + ".o_proj", h * hd, d, dtype=dtype, rngs=rngs)
        self.q_norm = norm_for(cfg, hd, dtype=dtype)
        self.k_norm = norm_for(cfg, hd, dtype=dtype)
        self.indexer = (MSAIndexer(cfg, dtype=dtype, rngs=rngs, prefix=p + ".indexer")
                        if cfg.is_sparse_layer(layer_idx) else None)
        self.window = cfg.layer_window(layer_idx)  # sliding window (None: every earlier position)

    @property
    def is_sparse(self) -> bool:
        return self.indexer is not None

    def project_qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """``x [..., S, d]`` -> ``q [..., S, H, D]``, ``k, v [..., S, H_kv, D]`` (q/k normed and rotated)."""
        c = self.cfg
        lead = x.shape[:-1]
        q = self.q_norm(self.q_proj(x).reshape(*lead, c.num_attention_heads, c.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(*lead, c.num_key_value_heads, c.head_dim))
        v = self.v_proj(x).reshape(*lead, c.num_key_value_heads, c.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def __call__(self, x: jax.Array, positions: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Plain causal attention over the whole sequence ``x [B, S, d]`` (MSA selection on sparse layers; with
        a sliding ``window``, only the keys ``pos - window < j <= pos``)."""
        c = self.cfg
        b, s, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin)
        keys = jnp.arange(s)[None, None, None, :]
        causal = keys <= positions[:, None, :, None]  # [B, 1, S, S]
        if self.is_sparse:
            sel = self.indexer.select(x, positions, cos, sin)  # [B, G, S, topk]
            allowed = msa.selection_key_mask(sel, positions, s, block_size=c.index_block_size)  # [B, G, S, S]
        else:
            allowed = jnp.broadcast_to(causal, (b, c.num_key_value_heads, s, s))
        if self.window is not None:
            allowed = allowed & (keys > positions[:, None, :, None] - self.window)
        out = grouped_attention(q, k, v, allowed, scale=c.head_dim ** -0.5)
        return self.o_proj(out.reshape(b, s, -1))


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, *, scale: float) -> jax.Array:
    """GQA softmax attention with an explicit per-group mask.

    ``q [B, Sq, H, D]``, ``k, v [B, Sk, G, D]``, ``allowed bool[B, G, Sq, Sk]`` -> ``[B, Sq, H, D]``.
    Scores and softmax in fp32; rows with no allowed key give zeros.
    """
    b, sq, h, d = q.shape
    g = k.shape[2]
    qg = q.reshape(b, sq, g, h // g, d)
    scores = jnp.einsum("bqgnd,bkgd->bgnqk", qg, k, preferred_element_type=jnp.float32) * scale
    mask = allowed[:, :, None, :, :]
    scores = jnp.where(mask, scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask, probs, 0.0).astype(v.dtype)
    out = jnp.einsum("bgnqk,bkgd->bqgnd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, sq, h, d).astype(q.dtype)
