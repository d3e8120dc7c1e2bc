"""The DSpark drafter in Flax NNX: DFlash backbone, Markov head, confidence head (docs/DRAFTER.md).

Data flow of one speculative step, for ``R`` request rows (padding rows included) and block size ``K``:

* **Context.** The target's residual stream after ``target_layer_ids`` (before its final norm), concatenated
  per position into ``features [.., m*d]``, is projected once per context position:
  ``H_ctx = hidden_norm(fc(features))``. Every draft layer turns ``H_ctx`` into context keys/values
  (``k_norm(k_proj(H_ctx))`` rotated at the context position, and ``v_proj(H_ctx)``); those live in the
  :class:`DraftCache`, paged like the target's cache: ``[L, H_kv, P, page, D]`` plus ``lengths int32[R]`` and
  ``block_tables int32[R, nb]``. Position ``j`` of row ``r`` lives on page ``block_tables[r, j // page]`` at
  offset ``j % page`` (an engine installs the target's block tables, so a position's draft K/V sits on the
  page id of its target K/V). The cache only ever holds context entries.
* **Block.** Inputs ``[anchor, MASK x (K - 1)]`` (target embeddings, ``MASK = mask_token_id``) at positions
  ``anchor_pos + 0..K-1``. Each draft layer is the target's block shape (MiniMax-M3 attention with per-head
  Gemma q/k norm and partial RoPE, dense swigluoai MLP), or a Qwen3 block (per-head RMSNorm q/k norms, full
  RoPE, SiLU MLP, own head counts: :class:`~minimax_jax.drafter_config.Qwen3DSparkConfig`). Its keys/values
  are the cached context entries at positions ``j < min(lengths[r], anchor_pos[r])`` (strictly before the
  anchor; with a sliding window ``W``, slot ``k`` also only ``j > anchor_pos[r] + k - W``) followed by the
  block's own ``K`` keys/values, and attention is bidirectional inside the block. Block keys/values are never
  written to the cache. After the final norm, ``h_k`` and ``U_k = h_k @ lm_head`` (the target's head).
* **Semi-autoregressive head.** Slot ``k`` predicts the token at ``anchor_pos + k + 1``. Left to right, with
  ``x_0 = anchor``: ``e_k = W1[x_{k-1}]``; the Markov bias ``B_k`` (vanilla / gated / rnn);
  ``p_d,k = softmax((U_k + B_k) / T)``; ``x_k`` drawn from it (argmax for ``T = 0``); the confidence
  ``c_k = sigmoid(w . [h_k ; e_k] + b)`` (``h_k`` alone without Markov features), temperature-scaled per
  position when ``sts_temperatures`` is set.
* **After verification** the accepted positions' target features are appended
  (:meth:`DSparkDrafter.write_context`); the new lengths are given explicitly, which is also how rejected
  entries are rolled back.

Where the rest lives: the configuration and ``config.json`` format in :mod:`minimax_jax.drafter_config`, the
block attention in :mod:`minimax_jax.draft_attention`, the context cache in :mod:`minimax_jax.draft_cache`, the
jitted entry points an engine calls (:func:`~minimax_jax.draft_step.draft_step`,
:func:`~minimax_jax.draft_step.append_context_step`, :func:`~minimax_jax.draft_step.append_context_packed_step`)
in :mod:`minimax_jax.draft_step`, checkpoints in :mod:`minimax_jax.drafter_checkpoint`. The methods
:meth:`DSparkDrafter.draft` / :meth:`DSparkDrafter.append_context` / :meth:`DSparkDrafter.append_context_packed`
are conveniences around those entry points.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from minimax_jax.attention import Attention
from minimax_jax.cache import slot_mapping, write_tokens
from minimax_jax.calibration import apply_sts
from minimax_jax.config import MiniMaxM3Config
from minimax_jax.draft_attention import choose_implementation, draft_attention, draft_attention_reference
from minimax_jax.draft_cache import DraftCache
from minimax_jax.draft_step import (
    DraftOutput,
    append_context_packed_step,
    append_context_step,
    draft_step,
    normalise_keys,
)
from minimax_jax.drafter_config import MARKOV_HEAD_TYPES, DSparkConfig, validate_target_layer_ids
from minimax_jax.layers import DenseMLP, Linear, apply_rope, norm_for, rope_cos_sin
from minimax_jax.model import MiniMaxM3ForCausalLM, check_input_ids
from minimax_jax.sharding import on_local_heads
from pallas_kernels import draft_attention as draft_attention_kernel
from pallas_kernels.metadata import token_to_request
from pallas_kernels.platform import unroll_loops


# ----------------------------------------------------------------------------------------------- modules
class Shared(nnx.Variable):
    """An array shared with the target (embeddings, LM head): frozen, not trained, not saved with the drafter."""


class BiasedLinear(nnx.Module):
    """``y = x @ kernel + bias`` with a ``[in, out]`` kernel; float32 output (used for gates and logits)."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, stddev: float = 0.02):
        self.kernel = nnx.Param(nnx.initializers.normal(stddev)(rngs.params(), (in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel[...]
        y = jnp.dot(x.astype(k.dtype), k, preferred_element_type=jnp.float32)
        return y + self.bias[...].astype(jnp.float32)


class SiluMLP(DenseMLP):
    """Qwen3's MLP, ``down(silu(gate) * up)``, with DenseMLP's parameters (a fused ``[d, 2I]`` gate/up kernel,
    gate first), so both load through the same checkpoint names."""

    def __call__(self, x: jax.Array) -> jax.Array:
        g, u = jnp.split(self.gate_up_proj(x).astype(jnp.float32), 2, axis=-1)
        return self.down_proj((jax.nn.silu(g) * u).astype(x.dtype))


class DraftLayer(nnx.Module):
    """One draft layer: GQA attention with per-head q/k norms and NeoX RoPE, a dense MLP (the shape and norm
    convention of ``cfg``: the target's block shape with swigluoai, or a Qwen3 block with ``act="silu"``).

    ``h = x + o_proj(attn(input_layernorm(x)))``; ``out = h + mlp(post_attention_layernorm(h))``. The context
    keys/values are projected from ``H_ctx`` directly (no input norm: ``hidden_norm`` already normalised it).
    """

    def __init__(self, cfg: MiniMaxM3Config, layer_idx: int, *, dtype, rngs: nnx.Rngs, act: str = "swigluoai"):
        self.cfg = cfg
        self.input_layernorm = norm_for(cfg, cfg.hidden_size, dtype=dtype)
        self.self_attn = Attention(cfg, layer_idx, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm_for(cfg, cfg.hidden_size, dtype=dtype)
        mlp = SiluMLP if act == "silu" else DenseMLP
        self.mlp = mlp(cfg, cfg.dense_intermediate_size, dtype=dtype, rngs=rngs)

    def context_kv(self, h_ctx: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``H_ctx [..., N, d]`` -> ``k, v [..., N, H_kv, D]`` (k normed and rotated at its position)."""
        c, a = self.cfg, self.self_attn
        lead = h_ctx.shape[:-1]
        k = a.k_norm(a.k_proj(h_ctx).reshape(*lead, c.num_key_value_heads, c.head_dim))
        v = a.v_proj(h_ctx).reshape(*lead, c.num_key_value_heads, c.head_dim)
        return apply_rope(k, cos, sin), v

    def __call__(self, x, cos, sin, k_ctx, v_ctx, ctx_visible, *, attention=None) -> jax.Array:
        """``x [R, K, d]`` block hidden states; ``k_ctx, v_ctx [R, S, H_kv, D]``; ``ctx_visible bool[R, 1|K, S]``
        (or whatever ``attention`` takes in their place: the Pallas kernel, the whole paged cache and lengths)."""
        attention = draft_attention if attention is None else attention
        r, k = x.shape[:2]
        with jax.named_scope("input_norm"):
            xn = self.input_layernorm(x)
        with jax.named_scope("qkv_proj"):
            q, kb, vb = self.self_attn.project_qkv(xn, cos, sin)
        with jax.named_scope("draft_attention"):
            o = attention(q, k_ctx, v_ctx, ctx_visible, kb, vb, scale=self.cfg.head_dim ** -0.5)
        with jax.named_scope("o_proj"):  # o_proj + residual
            h = x + self.self_attn.o_proj(o.reshape(r, k, -1))
        with jax.named_scope("post_norm"):
            hn = self.post_attention_layernorm(h)
        with jax.named_scope("mlp"):  # MLP + residual
            return h + self.mlp(hn)


class MarkovHead(nnx.Module):
    """Rank-``r`` Markov correction of the draft logits (docs/DRAFTER.md).

    ``e_k = W1[x_{k-1}]``. vanilla: ``B_k = W2 e_k``; gated: ``B_k = W2 (sigmoid(Wg [h_k; e_k] + bg) * e_k)``;
    rnn: ``z = [s_{k-1}; e_k; h_k]``, ``gate, cand, out = split3(Wj z + bj)``,
    ``s_k = sig(gate) s_{k-1} + (1 - sig(gate)) tanh(cand)``, ``B_k = W2 tanh(out)``, ``s_0 = 0``.
    ``W1`` is an embedding ``[V, r]``; ``W2`` is stored as a ``[r, V]`` kernel.
    """

    def __init__(self, kind: str, vocab_size: int, rank: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        if kind not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {kind!r}")
        self.kind, self.rank = kind, rank
        self.markov_w1 = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (vocab_size, rank), dtype))
        self.markov_w2 = Linear(rank, vocab_size, dtype=dtype, rngs=rngs)
        if kind == "gated":
            self.gate_proj = BiasedLinear(hidden_size + rank, rank, dtype=dtype, rngs=rngs)
        if kind == "rnn":
            self.joint_proj = BiasedLinear(2 * rank + hidden_size, 3 * rank, dtype=dtype, rngs=rngs)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """``W1[tokens]``: ``int32[...]`` -> ``[..., r]``."""
        return jnp.take(self.markov_w1[...], tokens, axis=0)

    def init_state(self, batch: int) -> jax.Array:
        return jnp.zeros((batch, self.rank), jnp.float32)

    def step(self, prev_tokens: jax.Array, h: jax.Array, state: jax.Array):
        """One slot: ``prev_tokens int32[R]``, ``h [R, d]``, ``state f32[R, r]`` ->
        ``(bias f32[R, V], e [R, r], new_state f32[R, r])``."""
        e = self.embed(prev_tokens)
        ef = e.astype(jnp.float32)
        if self.kind == "vanilla":
            z = ef
        elif self.kind == "gated":
            gate = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([h.astype(e.dtype), e], axis=-1)))
            z = gate * ef
        else:
            proj = self.joint_proj(jnp.concatenate([state, ef, h.astype(jnp.float32)], axis=-1))
            g, cand, out = jnp.split(proj, 3, axis=-1)
            g = jax.nn.sigmoid(g)
            state = g * state + (1.0 - g) * jnp.tanh(cand)
            z = jnp.tanh(out)
        w2 = self.markov_w2.kernel[...]
        bias = jnp.dot(z.astype(w2.dtype), w2, preferred_element_type=jnp.float32)
        return bias, e, state

    def block_bias(self, prev_tokens: jax.Array, h: jax.Array) -> jax.Array:
        """Teacher-forced bias for a whole block: ``prev_tokens int32[R, K]`` (``x_{k-1}``), ``h [R, K, d]``
        -> ``f32[R, K, V]`` (the rnn state runs left to right)."""

        def body(state, xs):
            prev, hk = xs
            bias, _, state = self.step(prev, hk, state)
            return state, bias

        _, bias = jax.lax.scan(body, self.init_state(h.shape[0]),
                               (jnp.swapaxes(prev_tokens, 0, 1), jnp.swapaxes(h, 0, 1)), unroll=unroll_loops())
        return jnp.swapaxes(bias, 0, 1)


class ConfidenceHead(nnx.Module):
    """``logit = w . features + b`` with ``features = [h_k ; e_k]`` or ``h_k``; float32 logits."""

    def __init__(self, in_dim: int, *, dtype, rngs: nnx.Rngs):
        self.proj = BiasedLinear(in_dim, 1, dtype=dtype, rngs=rngs)

    def __call__(self, features: jax.Array) -> jax.Array:
        return self.proj(features)[..., 0]


# ----------------------------------------------------------------------------------------------- the drafter
class DSparkDrafter(nnx.Module):
    """DSpark drafter: ``fc`` + ``hidden_norm`` feature projection, draft layers, final ``norm``, optional Markov
    and confidence heads. ``embed_tokens [V, d]`` and ``lm_head [d, V]`` are the target's (:class:`Shared`).

    Both drafter kinds are this module: MiniMax-block layers (:class:`DSparkConfig`) and Qwen3-style layers
    (:class:`~minimax_jax.drafter_config.Qwen3DSparkConfig`: standard RMSNorm weights, full-width RoPE, a SiLU
    MLP, own head counts, a sliding window); the config says which."""

    def __init__(self, cfg: DSparkConfig, *, embed_tokens: jax.Array | None = None,
                 lm_head: jax.Array | None = None, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        c = cfg.layer_config
        d, vocab = c.hidden_size, c.vocab_size
        init = nnx.initializers.normal(0.02)
        if embed_tokens is not None and tuple(embed_tokens.shape) != (vocab, d):
            raise ValueError(f"embed_tokens must be [V, d] = {(vocab, d)}, got {tuple(embed_tokens.shape)}")
        if lm_head is not None and tuple(lm_head.shape) != (d, vocab):
            raise ValueError(f"lm_head must be [d, V] = {(d, vocab)}, got {tuple(lm_head.shape)}")
        self.embed_tokens = Shared(init(rngs.params(), (vocab, d), dtype) if embed_tokens is None else embed_tokens)
        self.lm_head = Shared(init(rngs.params(), (d, vocab), dtype) if lm_head is None else lm_head)
        self.fc = Linear(cfg.feature_size, d, dtype=dtype, rngs=rngs)
        self.hidden_norm = norm_for(c, d, dtype=dtype)
        self.layers = nnx.List([DraftLayer(c, i, dtype=dtype, rngs=rngs, act=cfg.hidden_act)
                                for i in range(c.num_hidden_layers)])
        self.norm = norm_for(c, d, dtype=dtype)
        self.markov_head = (MarkovHead(cfg.markov_head_type, vocab, cfg.markov_rank, d, dtype=dtype, rngs=rngs)
                            if cfg.markov_rank > 0 else None)
        self.confidence_head = (ConfidenceHead(cfg.confidence_input_dim, dtype=dtype, rngs=rngs)
                                if cfg.enable_confidence_head else None)

    # ------------------------------------------------------------------ small pieces
    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def has_confidence_head(self) -> bool:
        return self.confidence_head is not None

    def set_sts_temperatures(self, temperatures: Sequence[float] | None) -> None:
        """Store per-position STS temperatures (``None`` removes them) in the config."""
        self.cfg = self.cfg.replace(sts_temperatures=None if temperatures is None else tuple(temperatures))

    def init_cache(self, num_requests: int, capacity: int, *, dtype=None, page_size: int | None = None,
                   num_pages: int | None = None) -> DraftCache:
        """An empty :class:`DraftCache` (:meth:`DraftCache.create`): a private pool with the trivial block table,
        or with ``num_pages`` a pool shared with the target whose block tables the caller installs."""
        return DraftCache.create(self.cfg, num_requests, capacity, page_size=page_size, num_pages=num_pages,
                                 dtype=self.dtype if dtype is None else dtype)

    def project_features(self, features) -> jax.Array:
        """``H_ctx = hidden_norm(fc(features))``: ``[..., m*d]`` (or a sequence of m ``[..., d]``) -> ``[..., d]``."""
        features = self._concat_features(features)
        return self.hidden_norm(self.fc(features))

    def _concat_features(self, features) -> jax.Array:
        if isinstance(features, (list, tuple)):
            if len(features) != self.cfg.num_target_features:
                raise ValueError(f"expected {self.cfg.num_target_features} feature arrays (one per target layer "
                                 f"{list(self.cfg.target_layer_ids)}), got {len(features)}")
            features = jnp.concatenate(features, axis=-1)
        if features.shape[-1] != self.cfg.feature_size:
            raise ValueError(f"features must have last dim m*d = {self.cfg.feature_size}, got shape {features.shape}")
        return features

    def _rope(self, positions):
        c = self.cfg.layer_config
        return rope_cos_sin(positions, c.rotary_dim, c.rope_theta)

    def _block_inputs(self, anchors, anchor_positions):
        k = self.cfg.block_size
        ids = jnp.concatenate([anchors[:, None].astype(jnp.int32),
                               jnp.full((anchors.shape[0], k - 1), self.cfg.mask_token_id, jnp.int32)], axis=1)
        x = jnp.take(self.embed_tokens[...], ids, axis=0).astype(self.dtype)
        positions = anchor_positions[:, None].astype(jnp.int32) + jnp.arange(k, dtype=jnp.int32)[None]
        return x, self._rope(positions)

    # ------------------------------------------------------------------ backbone
    def block_hidden(self, cache: DraftCache, anchors: jax.Array, anchor_positions: jax.Array, *,
                     cache_rows: jax.Array | None = None, implementation: str = "auto",
                     interpret: bool | None = None, mesh=None) -> jax.Array:
        """Final-normed block hidden states ``h [R, K, d]`` using the cached context.

        ``cache_rows int32[R]`` (optional): row ``r`` drafts from cache row ``cache_rows[r]`` (its block table
        and length; negative: no context) instead of row ``r``. ``implementation``: the attention, ``"pallas"``
        (the kernel: each row's pages read once per KV head, up to its length), ``"reference"`` (plain jnp: the
        context gathered through the block tables over their whole width) or ``"auto"``
        (:func:`minimax_jax.draft_attention.choose_implementation`: the kernel on a GPU).

        ``mesh`` (a ``jax.sharding.Mesh`` with a ``"tensor"`` axis; the draft layers' heads stored for it,
        ``sharding.replicate_drafter_heads``, and the cache split by KV head): the block attention runs per device
        inside ``shard_map``, on the device's ``H / N`` query heads, ``H_kv / N`` KV heads and its slice of the
        cache (block tables, lengths and rows replicated), as the target's attention does; XLA partitions the
        projections and MLPs around it (docs/PARALLELISM.md).
        """
        impl = choose_implementation(implementation, self.cfg.layer_config, block_size=self.cfg.block_size,
                                     page_size=cache.page_size, dtype=cache.k.dtype, interpret=interpret)
        with jax.named_scope("block_inputs"):
            x, (cos, sin) = self._block_inputs(anchors, anchor_positions)
            lengths = cache.lengths
            if cache_rows is not None:
                ok = (cache_rows >= 0) & (cache_rows < cache.num_requests)
                lengths = jnp.where(ok, lengths[jnp.clip(cache_rows, 0, cache.num_requests - 1)], 0)
            end = jnp.clip(jnp.minimum(lengths, anchor_positions.astype(jnp.int32)), 0, cache.capacity)
        window = self.cfg.sliding_window
        if impl == "pallas":
            # The kernel reads the [L, H_kv, P, page, D] cache in place (layer, table row and pages chosen
            # inside), up to end (and from the window's start).
            qpos = None if window is None else anchor_positions.astype(jnp.int32)
            extras = {name: val for name, val in (("cache_rows", cache_rows), ("query_positions", qpos))
                      if val is not None}  # replicated, like the block tables and the lengths
            # split on their heads: q [R, K, H, D], the caches [L, H_kv, P, page, D], kb / vb [R, K, H_kv, D]
            axes = (2, 1, 1, None, None, 2, 2) + (None,) * len(extras)
            for i, layer in enumerate(self.layers):
                def attention(q, k_cache, v_cache, ctx_end, kb, vb, *, scale, i=i):
                    def kernel(q, k_cache, v_cache, tables, ctx_end, kb, vb, *extra):
                        return draft_attention_kernel.draft_attention(
                            q, k_cache, v_cache, tables, ctx_end, kb, vb, scale=scale, layer=i, window=window,
                            implementation="pallas", interpret=interpret, **dict(zip(extras, extra)))

                    return on_local_heads(kernel, mesh, axes, 2)(q, k_cache, v_cache, cache.block_tables, ctx_end,
                                                                 kb, vb, *extras.values())

                with jax.named_scope(f"draft_layer{i}"):
                    x = layer(x, cos, sin, cache.k, cache.v, end, attention=attention)
            with jax.named_scope("final_norm"):
                return self.norm(x)
        with jax.named_scope("block_inputs"):
            tables = cache.block_tables
            if cache_rows is not None:
                tables = tables[jnp.clip(cache_rows, 0, cache.num_requests - 1)]
            visible = self._context_mask(cache.capacity, end, anchor_positions)  # [R, 1 | K, S]
            seen = jnp.any(visible, axis=1)  # [R, S]
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"draft_layer{i}"):
                with jax.named_scope("draft_attention"):  # the context gather is part of the jnp attention
                    k_ctx = draft_attention_kernel.paged_context(cache.k[i], tables)  # [R, S, H_kv, D]
                    # invisible entries are other rows' (or never written) pages: zero them so they cannot leak
                    # as NaN
                    v_ctx = jnp.where(seen[:, :, None, None],
                                      draft_attention_kernel.paged_context(cache.v[i], tables), 0)

                # q [R, K, H, D], context K/V [R, S, H_kv, D], the mask [R, 1|K, S], kb / vb [R, K, H_kv, D]
                def attention(*args, scale):
                    return on_local_heads(functools.partial(draft_attention, scale=scale), mesh,
                                          (2, 2, 2, None, 2, 2), 2)(*args)

                x = layer(x, cos, sin, k_ctx, v_ctx, visible, attention=attention)
        with jax.named_scope("final_norm"):
            return self.norm(x)

    def block_hidden_reference(self, features, anchors: jax.Array, anchor_positions: jax.Array) -> jax.Array:
        """From scratch, no cache: ``features [R, S, m*d]`` of context positions ``0..S-1`` are projected and
        turned into keys/values for every layer; keys ``j < anchor_pos`` are visible. Same output as
        :meth:`block_hidden` after appending those features."""
        h_ctx = self.project_features(features)
        r, s = h_ctx.shape[:2]
        cos_c, sin_c = self._rope(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (r, s)))
        x, (cos, sin) = self._block_inputs(anchors, anchor_positions)
        visible = self._context_mask(s, anchor_positions, anchor_positions)
        for layer in self.layers:
            k_ctx, v_ctx = layer.context_kv(h_ctx, cos_c, sin_c)
            x = layer(x, cos, sin, k_ctx, v_ctx, visible, attention=draft_attention_reference)
        return self.norm(x)

    def _context_mask(self, capacity: int, end: jax.Array, anchor_positions: jax.Array) -> jax.Array:
        """Which context positions each slot sees: ``j < end[r]`` (``bool[R, 1, S]``), and with a sliding window
        ``W`` also ``j > anchor_positions[r] + k - W`` for slot ``k`` (``bool[R, K, S]``)."""
        j = jnp.arange(capacity, dtype=jnp.int32)[None, None, :]
        visible = j < end[:, None, None]
        window = self.cfg.sliding_window
        if window is None:
            return visible
        slot_pos = anchor_positions.astype(jnp.int32)[:, None] + jnp.arange(self.cfg.block_size, dtype=jnp.int32)
        return visible & (j > slot_pos[:, :, None] - window)

    def logits(self, h: jax.Array) -> jax.Array:
        """``U = h @ lm_head`` (the target's head, without the target's final norm): float32 ``[..., V]``."""
        w = self.lm_head[...]
        return jnp.dot(h.astype(w.dtype), w, preferred_element_type=jnp.float32)

    # ------------------------------------------------------------------ semi-autoregressive head
    def sample_block(self, h: jax.Array, anchors: jax.Array, temperature=0.0, key: jax.Array | None = None, *,
                     return_probs: bool = True, logit_filter=None, feature_fn=None,
                     num_drafts: int | None = None) -> DraftOutput:
        """Draw the K drafts left to right from ``h [R, K, d]`` (see the module docstring).

        ``num_drafts`` (static, ``<= K``): draw only the first ``num_drafts`` (the LM head, the Markov head, the
        sampling and the confidence head run on those slots alone; the backbone's block was computed in full,
        as it was trained).

        ``temperature``: scalar or ``f32[R]``; rows with ``T <= 0`` are greedy. ``key``: one PRNG key, or one per
        row (``[R]`` typed keys or raw ``uint32[R, 2]``); None means greedy for every row.
        ``logit_filter``: optional ``(f32[R, V], int32[R, K]) -> f32[R, V]`` applied to the temperature-scaled
        logits of every slot before drawing, with the drafts drawn at the slots before it (-1 at this slot and
        after): penalties that depend on the prefix, min-p, top-k / top-p (the draft distribution is then the
        transformed one, as the sampler needs). ``feature_fn``: optional ``f32[R, V] -> f32[R]`` of those scaled,
        filtered logits (``T = 1`` for greedy rows), returned as ``features`` (e.g. the acceptance estimator's
        feature).
        """
        if num_drafts is not None:
            if not 0 < num_drafts <= h.shape[1]:
                raise ValueError(f"num_drafts must be in [1, {h.shape[1]}], got {num_drafts}")
            h = h[:, :num_drafts]
        r, k = h.shape[:2]
        temps = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (r,))
        greedy = temps <= 0.0
        safe_t = jnp.where(greedy, 1.0, temps)[:, None]
        keys = normalise_keys(key, r)
        h_t = jnp.swapaxes(h, 0, 1)  # [K, R, d]: the scan runs over slots, so the logits come out slot-major
        with jax.named_scope("lm_head"):
            u = self.logits(h_t)  # [K, R, V] (transposing h, not a copy of the R x K x V fp32 logits)
        markov, conf_head = self.markov_head, self.confidence_head
        state0 = markov.init_state(r) if markov is not None else jnp.zeros((r, 1), jnp.float32)

        def body(carry, xs):
            prev, state, drafted = carry
            u_k, h_k, slot = xs
            if markov is not None:
                with jax.named_scope("markov_head"):
                    bias, e, state = markov.step(prev, h_k, state)
                    logits = u_k + bias
            else:
                e, logits = None, u_k
            with jax.named_scope("sampling"):
                scaled = logits / safe_t
                if logit_filter is not None:
                    scaled = logit_filter(scaled, drafted)
                greedy_tok = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
                if keys is None:
                    tok = greedy_tok
                else:
                    slot_keys = jax.vmap(lambda kk: jax.random.fold_in(kk, slot))(keys)
                    sampled = jax.vmap(jax.random.categorical)(slot_keys, scaled).astype(jnp.int32)
                    tok = jnp.where(greedy, greedy_tok, sampled)
                ys = {"tokens": tok}
                if feature_fn is not None:
                    ys["features"] = feature_fn(scaled)
                if return_probs:
                    onehot = jax.nn.one_hot(greedy_tok, logits.shape[-1], dtype=jnp.float32)
                    ys["probs"] = jnp.where(greedy[:, None], onehot, jax.nn.softmax(scaled, axis=-1))
            if conf_head is not None:
                with jax.named_scope("confidence_head"):
                    feats = (jnp.concatenate([h_k, e.astype(h_k.dtype)], -1) if self.cfg.confidence_head_with_markov
                             else h_k)
                    ys["confidence_logits"] = conf_head(feats)
            if logit_filter is not None:
                with jax.named_scope("sampling"):
                    drafted = jax.lax.dynamic_update_slice(drafted, tok[:, None], (0, slot))
            return (tok, state, drafted), ys

        xs = (u, h_t, jnp.arange(k, dtype=jnp.int32))
        drafted0 = jnp.full((r, k) if logit_filter is not None else (r, 0), -1, jnp.int32)
        # unrolled on a GPU: K is small, and a rolled scan is an XLA while loop that a GPU drives from the host (a
        # launch and a predicate read-back per position, in the host loop's dispatch time); rolled elsewhere, where
        # one body compiles faster than K (pallas_kernels.platform.unroll_loops)
        _, ys = jax.lax.scan(body, (anchors.astype(jnp.int32), state0, drafted0), xs, unroll=unroll_loops())
        ys = {name: jnp.swapaxes(val, 0, 1) for name, val in ys.items()}
        conf_logits = ys.get("confidence_logits")
        sts = self.cfg.sts_temperatures
        with jax.named_scope("confidence_head"):
            conf = None if conf_logits is None else apply_sts(conf_logits, None if sts is None else sts[:k])
        return DraftOutput(tokens=ys["tokens"], probs=ys.get("probs"), confidences=conf,
                           confidence_logits=conf_logits, features=ys.get("features"))

    # ------------------------------------------------------------------ cache writes
    def context_kv(self, h_ctx: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``H_ctx [N, d]`` at ``positions int32[N]`` -> ``k, v [L, N, H_kv, D]`` for every draft layer."""
        cos, sin = self._rope(positions)
        kv = [layer.context_kv(h_ctx, cos, sin) for layer in self.layers]
        return jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv])

    def write_context(self, cache: DraftCache, features, rows: jax.Array, positions: jax.Array,
                      new_lengths: jax.Array) -> DraftCache:
        """Core cache write: feature row ``i`` goes to ``(rows[i], positions[i])``, i.e. to slot
        ``page * page_size + positions[i] % page_size`` of page ``block_tables[rows[i], positions[i] // page]``.

        ``features [N, m*d]``, ``rows int32[N]``, ``positions int32[N]``, ``new_lengths int32[R]``. A row
        outside ``[0, R)`` (padding: -1), a position outside ``[0, capacity)`` or a table entry outside the pool
        is dropped (``cache.slot_mapping``): a write never lands on a page its row's table does not name.
        """
        with jax.named_scope("context_write"):
            with jax.named_scope("feature_proj"):
                h_ctx = self.project_features(features)
            with jax.named_scope("context_kv"):
                k_new, v_new = self.context_kv(h_ctx, jnp.maximum(positions, 0))  # [L, N, H_kv, D]
            with jax.named_scope("scatter"):
                slots = slot_mapping(cache.block_tables, rows, positions, page_size=cache.page_size,
                                     num_pages=cache.num_pages)
                write = jax.vmap(write_tokens, in_axes=(0, 0, None))  # over the layers
                return dataclasses.replace(cache, k=write(cache.k, k_new, slots), v=write(cache.v, v_new, slots),
                                           lengths=jnp.asarray(new_lengths, jnp.int32))

    def append_context_impl(self, cache: DraftCache, features, start: jax.Array, num_new: jax.Array) -> DraftCache:
        """Traceable body of :meth:`append_context` (padded per-request layout)."""
        features = self._concat_features(features)
        r, t = features.shape[:2]
        i = jnp.arange(t, dtype=jnp.int32)[None, :]
        keep = i < num_new[:, None]
        rows = jnp.where(keep, jnp.arange(r, dtype=jnp.int32)[:, None], -1)
        pos = start[:, None] + i
        return self.write_context(cache, features.reshape(r * t, -1), rows.reshape(-1), pos.reshape(-1),
                                  start + num_new)

    def append_context_packed_impl(self, cache: DraftCache, features, query_start_loc: jax.Array,
                                   start: jax.Array, num_new: jax.Array) -> DraftCache:
        """Traceable body of :meth:`append_context_packed` (packed ragged layout)."""
        features = self._concat_features(features)
        t = features.shape[0]
        with jax.named_scope("context_write"), jax.named_scope("positions"):
            req = token_to_request(query_start_loc, t)
            rr = jnp.maximum(req, 0)
            i = jnp.arange(t, dtype=jnp.int32) - query_start_loc[rr]
            keep = (req >= 0) & (i < num_new[rr])
        return self.write_context(cache, features, jnp.where(keep, req, -1), start[rr] + i, start + num_new)

    # ------------------------------------------------------------------ conveniences (jitted)
    def draft(self, cache: DraftCache, anchors, anchor_positions, *, temperature=0.0, key=None,
              return_probs: bool = True, validate: bool = True, implementation: str = "auto") -> DraftOutput:
        """One jitted draft step; see :func:`draft_step`."""
        graphdef, state = nnx.split(self)
        return draft_step(graphdef, state, cache, anchors, anchor_positions, temperature, key,
                          return_probs=return_probs, validate=validate, implementation=implementation)

    def append_context(self, cache: DraftCache, features, start, num_new, *, validate: bool = True) -> DraftCache:
        """Jitted :func:`append_context_step`."""
        graphdef, state = nnx.split(self)
        return append_context_step(graphdef, state, cache, features, start, num_new, validate=validate)

    def append_context_packed(self, cache: DraftCache, features, query_start_loc, start, num_new, *,
                              validate: bool = True) -> DraftCache:
        """Jitted :func:`append_context_packed_step`."""
        graphdef, state = nnx.split(self)
        return append_context_packed_step(graphdef, state, cache, features, query_start_loc, start, num_new,
                                          validate=validate)


# ----------------------------------------------------------------------------------------------- construction
def capture_target_features(target: MiniMaxM3ForCausalLM, input_ids, layer_ids: Sequence[int]) -> jax.Array:
    """Target features for the plain forward: ``int32[B, S]`` -> ``[B, S, m*d]``.

    The residual stream after each layer in ``layer_ids`` (before the final norm), concatenated in that order;
    ``-1`` is the embedding output.
    """
    ids = validate_target_layer_ids(layer_ids, target.cfg.num_hidden_layers)
    input_ids = check_input_ids(input_ids, target.cfg.vocab_size)
    layers = [i for i in ids if i >= 0]
    _, captured = target.hidden_states(input_ids, capture_layers=layers)
    by_id = dict(zip(layers, captured))
    feats = [target.embed(input_ids) if i < 0 else by_id[i] for i in ids]
    return jnp.concatenate(feats, axis=-1)


def init_drafter(cfg: DSparkConfig, target: MiniMaxM3ForCausalLM, *, dtype=None, seed: int = 0) -> DSparkDrafter:
    """A randomly initialised drafter sharing ``target``'s embeddings and LM head (checked for compatibility)."""
    cfg.check_compatible(target.cfg)
    return DSparkDrafter(cfg, embed_tokens=target.embed_tokens[...], lm_head=target.lm_head[...],
                         dtype=target.dtype if dtype is None else dtype, rngs=nnx.Rngs(seed))
