"""The MiniMax-M3 causal language model in Flax NNX.

``MiniMaxM3ForCausalLM(cfg, rngs=...)(input_ids)`` is the plain causal forward: positions ``0..S-1``, no cache,
float32 logits. It is deliberately simple and exact; it is the oracle for the paged decode path and the Pallas
kernels. A layer is ``h = x + o_proj(attn(norm1(x)))``; ``out = h + mlp(norm2(h))``; then the final norm and an
untied ``lm_head``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.attention import Attention
from minimax_jax.config import MiniMaxM3Config
from minimax_jax.layers import DenseMLP, MoE, norm_for, rope_cos_sin


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: MiniMaxM3Config, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        self.layer_idx = layer_idx
        self.input_layernorm = norm_for(cfg, cfg.hidden_size, dtype=dtype)
        self.self_attn = Attention(cfg, layer_idx, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm_for(cfg, cfg.hidden_size, dtype=dtype)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg, dtype=dtype, rngs=rngs, prefix=f"layers.{layer_idx}.mlp")
        else:
            self.mlp = DenseMLP(cfg, cfg.dense_intermediate_size, dtype=dtype, rngs=rngs,
                                prefix=f"layers.{layer_idx}.mlp")

    def __call__(self, x, positions, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), positions, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class MiniMaxM3ForCausalLM(nnx.Module):
    """MiniMax-M3 text model with its LM head."""

    def __init__(self, cfg: MiniMaxM3Config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size),
                                                                    dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = norm_for(cfg, cfg.hidden_size, dtype=dtype)
        self.lm_head = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.hidden_size, cfg.vocab_size),
                                                               dtype))

    # ------------------------------------------------------------------ pieces shared with the decode path
    def embed(self, input_ids: jax.Array) -> jax.Array:
        return jnp.take(self.embed_tokens[...], input_ids, axis=0)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm and LM head: ``[..., d]`` residual stream -> float32 logits ``[..., V]``."""
        with jax.named_scope("final_norm"):
            h = self.norm(hidden)
        with jax.named_scope("lm_head"):
            w = self.lm_head[...]
            return jnp.dot(h.astype(w.dtype), w, preferred_element_type=jnp.float32)

    def rope(self, positions: jax.Array):
        return rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta)

    # ------------------------------------------------------------------ plain forward
    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """``int32[B, S]`` -> float32 logits ``[B, S, V]`` (positions 0..S-1, no cache)."""
        return self.logits(self.hidden_states(input_ids)[0])

    def hidden_states(self, input_ids: jax.Array, capture_layers: Sequence[int] = ()) -> tuple[jax.Array, list]:
        """Residual stream after the last layer (before the final norm), and the outputs of ``capture_layers``."""
        input_ids = check_input_ids(input_ids, self.cfg.vocab_size,
                                    max_length=self.cfg.max_position_embeddings)
        b, s = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        cos, sin = self.rope(positions)
        x = self.embed(input_ids)
        captured = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, cos, sin)
            if i in capture_layers:
                captured[i] = x
        return x, [captured[i] for i in capture_layers]


def check_input_ids(input_ids, vocab_size: int, *, ndim: int = 2, name: str = "input_ids",
                    max_length: int | None = None, to_device: bool = True) -> jax.Array | np.ndarray:
    """Validate token ids on the host: integer dtype, rank ``ndim``, a non-empty last axis of at most
    ``max_length`` tokens, and (when the array is concrete) values in ``[0, vocab_size)``.

    Returns the ids as int32: a device array, or with ``to_device=False`` a numpy array for host-side callers
    (the engine), which then stage nothing per prompt length.

    Call it before any jitted program: inside ``jit`` the values are tracers and only shapes can be checked.
    """
    if isinstance(input_ids, jax.Array):
        arr = input_ids
    else:
        try:
            arr = np.asarray(input_ids)
        except (OverflowError, TypeError, ValueError):  # a Python int beyond int64, ragged nesting
            raise ValueError(f"{name} must be a rectangular array of integer token ids in [0, {vocab_size})") from None
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {arr.shape}")
    if arr.shape[-1] == 0:
        raise ValueError(f"{name} is empty: a prompt needs at least one token")
    if arr.dtype == object:  # Python ints beyond int64 (numpy keeps them as objects)
        flat = arr.ravel().tolist()
        if all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            bad = next((v for v in flat if not 0 <= v < vocab_size), flat[0])
            raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    if arr.dtype == object or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if max_length is not None and arr.shape[-1] > max_length:
        raise ValueError(f"{name} has {arr.shape[-1]} tokens, more than the model's maximum of {max_length} "
                         f"positions (max_position_embeddings)")
    if not isinstance(arr, jax.core.Tracer) and arr.size:
        values = np.asarray(arr)
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    if not to_device and not isinstance(arr, jax.Array):
        return arr.astype(np.int32, copy=False)
    return jnp.asarray(arr, jnp.int32)


def init_model(cfg: MiniMaxM3Config, *, dtype=jnp.bfloat16, seed: int = 0) -> MiniMaxM3ForCausalLM:
    return MiniMaxM3ForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed))


def abstract_model(cfg: MiniMaxM3Config, *, dtype=jnp.bfloat16) -> MiniMaxM3ForCausalLM:
    """The model with ``jax.ShapeDtypeStruct`` leaves: nothing is allocated (works for the 428B preset)."""
    return nnx.eval_shape(lambda: MiniMaxM3ForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
