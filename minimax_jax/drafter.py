"""The DSpark drafter in Flax NNX: DFlash backbone, Markov head, confidence head (SPEC section 6).

Data flow of one speculative step, for ``R`` request rows (padding rows included) and block size ``K``:

* **Context.** The target's residual stream after ``target_layer_ids`` (before its final norm), concatenated
  per position into ``features [.., m*d]``, is projected once per context position:
  ``H_ctx = hidden_norm(fc(features))``. Every draft layer turns ``H_ctx`` into context keys/values
  (``k_norm(k_proj(H_ctx))`` rotated at the context position, and ``v_proj(H_ctx)``); those live in the
  :class:`DraftCache`, a fixed-size per-request buffer ``[L, R, S, H_kv, D]`` plus ``lengths int32[R]``.
  Slot ``j`` of a row holds absolute position ``j``. The cache only ever holds context entries.
* **Block.** Inputs ``[anchor, MASK x (K - 1)]`` (target embeddings, ``MASK = mask_token_id``) at positions
  ``anchor_pos + 0..K-1``. Each draft layer is the target's block shape (MiniMax-M3 attention with per-head
  Gemma q/k norm and partial RoPE, dense swigluoai MLP). Its keys/values are the cached context entries at
  positions ``j < min(lengths[r], anchor_pos[r])`` (strictly before the anchor) followed by the block's own
  ``K`` keys/values, and attention is bidirectional inside the block. Block keys/values are never written to
  the cache. After the final norm, ``h_k`` and ``U_k = h_k @ lm_head`` (the target's head).
* **Semi-autoregressive head.** Slot ``k`` predicts the token at ``anchor_pos + k + 1``. Left to right, with
  ``x_0 = anchor``: ``e_k = W1[x_{k-1}]``; the Markov bias ``B_k`` (vanilla / gated / rnn);
  ``p_d,k = softmax((U_k + B_k) / T)``; ``x_k`` drawn from it (argmax for ``T = 0``); the confidence
  ``c_k = sigmoid(w . [h_k ; e_k] + b)`` (``h_k`` alone without Markov features), temperature-scaled per
  position when ``sts_temperatures`` is set.
* **After verification** the accepted positions' target features are appended (:meth:`append_context`); the
  new lengths are given explicitly, which is also how rejected entries are rolled back.

Entry points an engine calls with padded static shapes: :func:`draft_step` and :func:`append_context_step`
(``graphdef`` static, the state passed as an argument; see ``docs/DRAFTER.md``). The module methods
:meth:`DSparkDrafter.draft` / :meth:`DSparkDrafter.append_context` are conveniences around them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.attention import MASK_VALUE, Attention, grouped_attention
from minimax_jax.calibration import apply_sts
from minimax_jax.config import DENSE_MLP, FULL_ATTENTION, ConfigError, MiniMaxM3Config, read_config_json
from minimax_jax.layers import DenseMLP, Linear, RMSNorm, apply_rope, rope_cos_sin
from minimax_jax.model import MiniMaxM3ForCausalLM, check_input_ids
from pallas_kernels.metadata import token_to_request

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


# ----------------------------------------------------------------------------------------------- target layers
def default_target_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """``round(1 + i * (N - 4) / (m - 1))`` for ``i < m`` (``m = 1``: ``[N // 2]``), validated."""
    n, m = int(num_target_layers), int(num_features)
    if m < 1:
        raise ConfigError(f"the number of target features must be >= 1, got {m}")
    if m == 1:
        ids = [n // 2]
    else:
        ids = [round(1 + i * (n - 4) / (m - 1)) for i in range(m)]
    try:
        return validate_target_layer_ids(ids, n)
    except ConfigError as e:
        raise ConfigError(f"the default target_layer_ids for {m} features of a {n}-layer target are {ids}, "
                          f"which is invalid ({e}); pass target_layer_ids explicitly") from None


def validate_target_layer_ids(layer_ids: Sequence[int], num_target_layers: int | None) -> tuple[int, ...]:
    """Non-empty, strictly increasing, in ``[-1, N - 2]`` (-1: the embedding output; the last layer N-1 is not
    allowed: its output is what the target's own head reads, not a feature the drafter is trained on)."""
    if isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, Sequence):
        raise ConfigError(f"target_layer_ids must be a list of integers, got {layer_ids!r}")
    ids = []
    for v in layer_ids:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ConfigError(f"target_layer_ids must hold integers, got {v!r}")
        ids.append(int(v))
    if not ids:
        raise ConfigError("target_layer_ids must not be empty")
    if any(b <= a for a, b in itertools.pairwise(ids)):
        raise ConfigError(f"target_layer_ids must be strictly increasing, got {ids}")
    if ids[0] < -1:
        raise ConfigError(f"target_layer_ids must be >= -1 (-1 is the embedding output), got {ids}")
    if num_target_layers is not None:
        n = int(num_target_layers)
        if ids[-1] == n - 1:
            raise ConfigError(f"target_layer_ids {ids} contains the target's last layer {n - 1}: not allowed")
        if ids[-1] > n - 1:
            raise ConfigError(f"target_layer_ids {ids} exceed the target's {n} layers (valid: -1..{n - 2})")
    return tuple(ids)


# ----------------------------------------------------------------------------------------------- config
# Drafter keys of a DeepSpec-style config.json and the aliases we accept for them.
_DRAFTER_KEYS: dict[str, tuple[str, ...]] = {
    "block_size": ("block_size", "dspark_block_size"),
    "mask_token_id": ("mask_token_id", "dspark_mask_token_id", "dspark_noise_token_id", "noise_token_id"),
    "target_layer_ids": ("target_layer_ids", "dspark_target_layer_ids"),
    "num_target_layers": ("num_target_layers",),
    "markov_rank": ("markov_rank", "dspark_markov_rank"),
    "markov_head_type": ("markov_head_type", "dspark_markov_head_type"),
    "enable_confidence_head": ("enable_confidence_head",),
    "confidence_head_with_markov": ("confidence_head_with_markov",),
    "sts_temperatures": ("sts_temperatures",),
}
_NESTED = ("dspark_config", "dflash_config")
_NOT_SHAPE_KEYS = {a for aliases in _DRAFTER_KEYS.values() for a in aliases} | set(_NESTED) | {
    "architectures", "model_type", "num_anchors", "layer_types", "mlp_layer_types", "moe_layer_freq",
    "sparse_attention_config", "dspark_ffn_hidden_size", "auto_map", "torch_dtype", "dtype",
    "transformers_version", "text_config",
}


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """A DSpark drafter: the draft layers' shape plus the DeepSpec drafter keys.

    ``layer_config`` is a :class:`MiniMaxM3Config` describing the draft layers (``num_hidden_layers`` = number
    of draft layers, every layer full attention with a dense MLP of ``dense_intermediate_size``); its
    ``hidden_size`` and ``vocab_size`` must match the target's.
    """

    layer_config: MiniMaxM3Config
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    markov_rank: int = 0
    markov_head_type: str | None = None
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    sts_temperatures: tuple[float, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        if self.sts_temperatures is not None:
            object.__setattr__(self, "sts_temperatures", tuple(float(t) for t in self.sts_temperatures))
        if isinstance(self.markov_rank, int) and self.markov_rank == 0:
            object.__setattr__(self, "markov_head_type", None)
        if not self.enable_confidence_head:
            object.__setattr__(self, "confidence_head_with_markov", False)
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def hidden_size(self) -> int:
        return self.layer_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer_config.vocab_size

    @property
    def num_draft_layers(self) -> int:
        return self.layer_config.num_hidden_layers

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features, ``m * d`` (the input of ``fc``)."""
        return self.num_target_features * self.hidden_size

    @property
    def confidence_input_dim(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        c = self.layer_config
        if not isinstance(c, MiniMaxM3Config):
            raise ConfigError(f"layer_config must be a MiniMaxM3Config, got {type(c).__name__}")
        for i, t in enumerate(c.layer_types):
            if t != FULL_ATTENTION:
                raise ConfigError(f"draft layers use full attention over the context; layer_types[{i}]={t!r} "
                                  f"is not supported")
        for i, t in enumerate(c.mlp_layer_types):
            if t != DENSE_MLP:
                raise ConfigError(f"draft layers use a dense MLP; mlp_layer_types[{i}]={t!r} is not supported")
        for name in ("block_size", "mask_token_id", "markov_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name} must be an integer, got {v!r}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.mask_token_id < c.vocab_size:
            raise ConfigError(f"mask_token_id ({self.mask_token_id}) is outside the vocabulary [0, {c.vocab_size})")
        if self.num_target_layers is not None and (isinstance(self.num_target_layers, bool)
                                                   or not isinstance(self.num_target_layers, int)
                                                   or self.num_target_layers < 2):
            raise ConfigError(f"num_target_layers must be an integer >= 2, got {self.num_target_layers!r}")
        validate_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        if self.markov_rank < 0:
            raise ConfigError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_rank > 0 and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES} when markov_rank > 0, "
                              f"got {self.markov_head_type!r}")
        for name in ("enable_confidence_head", "confidence_head_with_markov"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.confidence_head_with_markov and self.markov_rank == 0:
            raise ConfigError("confidence_head_with_markov is true but markov_rank is 0 (no Markov features)")
        if self.sts_temperatures is not None:
            if not self.enable_confidence_head:
                raise ConfigError("sts_temperatures given but enable_confidence_head is false")
            if len(self.sts_temperatures) != self.block_size:
                raise ConfigError(f"sts_temperatures has {len(self.sts_temperatures)} entries but block_size is "
                                  f"{self.block_size}")
            if not all(math.isfinite(t) and t > 0 for t in self.sts_temperatures):
                raise ConfigError(f"sts_temperatures must be finite and > 0, got {list(self.sts_temperatures)}")

    def check_compatible(self, target_cfg: MiniMaxM3Config) -> None:
        """Raise one :class:`ConfigError` listing every way this drafter does not fit ``target_cfg``."""
        problems = []
        if self.hidden_size != target_cfg.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target hidden_size {target_cfg.hidden_size}")
        if self.vocab_size != target_cfg.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target vocab_size {target_cfg.vocab_size}")
        n = target_cfg.num_hidden_layers
        if self.num_target_layers is not None and self.num_target_layers != n:
            problems.append(f"num_target_layers {self.num_target_layers} != the target's {n} layers")
        try:
            validate_target_layer_ids(self.target_layer_ids, n)
        except ConfigError as e:
            problems.append(str(e))
        if problems:
            raise ConfigError("drafter does not fit the target: " + "; ".join(problems))

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_target(cls, target_cfg: MiniMaxM3Config, *, mask_token_id: int, block_size: int = 7,
                   num_draft_layers: int = 1, target_layer_ids: Sequence[int] | None = None,
                   num_target_features: int | None = None, intermediate_size: int | None = None,
                   markov_rank: int = 0, markov_head_type: str | None = None,
                   enable_confidence_head: bool = False, confidence_head_with_markov: bool = False,
                   sts_temperatures: Sequence[float] | None = None) -> DSparkConfig:
        """A drafter for ``target_cfg``: draft layers copy the target's attention shape, with a dense MLP.

        ``target_layer_ids`` defaults to :func:`default_target_layer_ids` with ``num_target_features``
        features (default: one per draft layer, as DFlash does).
        """
        n_layers = int(num_draft_layers)
        if n_layers < 1:
            raise ConfigError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
        layer_cfg = target_cfg.replace(
            num_hidden_layers=n_layers, layer_types=(FULL_ATTENTION,) * n_layers,
            mlp_layer_types=(DENSE_MLP,) * n_layers,
            dense_intermediate_size=int(intermediate_size or target_cfg.dense_intermediate_size))
        n = target_cfg.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(n, num_target_features or n_layers)
        return cls(layer_config=layer_cfg, block_size=block_size, mask_token_id=mask_token_id,
                   target_layer_ids=tuple(target_layer_ids), num_target_layers=n, markov_rank=markov_rank,
                   markov_head_type=markov_head_type, enable_confidence_head=enable_confidence_head,
                   confidence_head_with_markov=confidence_head_with_markov,
                   sts_temperatures=None if sts_temperatures is None else tuple(sts_temperatures))

    def replace(self, **changes) -> DSparkConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_pretrained(cls, path_or_dict: str | os.PathLike | Mapping[str, Any], *,
                        num_target_layers: int | None = None,
                        num_target_features: int | None = None) -> DSparkConfig:
        """Read a drafter ``config.json`` (DeepSpec keys plus the draft layers' MiniMax-M3 shape keys).

        Drafter keys (aliases ``dspark_*`` and a nested ``dspark_config`` / ``dflash_config`` object are also
        read): ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``markov_rank``, ``markov_head_type``
        (required when ``markov_rank > 0``), ``enable_confidence_head``, ``confidence_head_with_markov``
        (required when the confidence head is enabled), optional ``sts_temperatures`` and
        ``num_target_layers``. ``num_hidden_layers`` is the number of draft layers; the draft MLP width is
        ``dense_intermediate_size`` (else ``intermediate_size``). Without ``target_layer_ids`` the default
        formula is used, which needs ``num_target_layers`` and ``num_target_features``.
        """
        raw = read_config_json(path_or_dict)
        text = raw.get("text_config")
        if text is not None:
            if not isinstance(text, Mapping):
                raise ConfigError(f"text_config must be an object, got {type(text).__name__}")
            text = {**{k: v for k, v in raw.items() if k != "text_config"}, **text}
        else:
            text = dict(raw)
        values = {name: _lookup(text, name, aliases) for name, aliases in _DRAFTER_KEYS.items()}
        for name in ("block_size", "mask_token_id"):
            if values[name] is None:
                raise ConfigError(f"drafter config is missing {name!r}")
        if "num_hidden_layers" not in text:
            raise ConfigError("drafter config is missing 'num_hidden_layers' (the number of draft layers)")
        n_layers = _int(text["num_hidden_layers"], "num_hidden_layers")

        # the draft layers' shape, through the target's config parser
        for key, types in (("layer_types", text.get("layer_types")), ("mlp_layer_types", text.get("mlp_layer_types"))):
            if types is not None:
                if not isinstance(types, (list, tuple)) or len(types) != n_layers:
                    raise ConfigError(f"{key} must list one entry per draft layer ({n_layers}), got {types!r}")
                want = FULL_ATTENTION if key == "layer_types" else DENSE_MLP
                for i, t in enumerate(types):
                    if t != want:
                        raise ConfigError(f"{key}[{i}]={t!r}: draft layers use {want!r} only")
        moe = text.get("moe_layer_freq")
        if moe is not None and (not isinstance(moe, (list, tuple)) or any(moe)):
            raise ConfigError(f"moe_layer_freq={moe!r}: draft layers use a dense MLP only")
        sparse = text.get("sparse_attention_config") or {}
        if isinstance(sparse, Mapping) and any(sparse.get("sparse_attention_freq") or []):
            raise ConfigError("sparse_attention_config.sparse_attention_freq: draft layers use full attention only")
        shape = {k: v for k, v in text.items() if k not in _NOT_SHAPE_KEYS}
        width = text.get("dspark_ffn_hidden_size", text.get("dense_intermediate_size",
                                                            text.get("intermediate_size")))
        if width is not None:
            shape["dense_intermediate_size"] = width
        shape["layer_types"] = [FULL_ATTENTION] * n_layers
        shape["mlp_layer_types"] = [DENSE_MLP] * n_layers
        layer_cfg = MiniMaxM3Config.from_pretrained(shape)

        n_target = values["num_target_layers"]
        n_target = _int(n_target, "num_target_layers") if n_target is not None else num_target_layers
        ids = values["target_layer_ids"]
        if ids is None:
            if n_target is None or num_target_features is None:
                raise ConfigError("drafter config is missing 'target_layer_ids' (the default formula needs the "
                                  "number of target layers and of target features)")
            ids = default_target_layer_ids(n_target, num_target_features)
        rank = _int(values["markov_rank"], "markov_rank") if values["markov_rank"] is not None else 0
        head_type = values["markov_head_type"]
        if rank > 0 and head_type is None:
            raise ConfigError("drafter config is missing 'markov_head_type' (required when markov_rank > 0)")
        enable = _bool(values["enable_confidence_head"], "enable_confidence_head", default=False)
        with_markov = values["confidence_head_with_markov"]
        if enable and with_markov is None:
            raise ConfigError("drafter config is missing 'confidence_head_with_markov' (required when "
                              "enable_confidence_head is true)")
        sts = values["sts_temperatures"]
        if sts is not None:
            if not isinstance(sts, (list, tuple)):
                raise ConfigError(f"sts_temperatures must be a list of numbers, got {sts!r}")
            if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in sts):
                raise ConfigError(f"sts_temperatures must be a list of numbers, got {sts!r}")
        return cls(
            layer_config=layer_cfg, block_size=_int(values["block_size"], "block_size"),
            mask_token_id=_int(values["mask_token_id"], "mask_token_id"),
            target_layer_ids=validate_target_layer_ids(ids, n_target), num_target_layers=n_target,
            markov_rank=rank, markov_head_type=None if head_type is None else str(head_type).lower(),
            enable_confidence_head=enable,
            confidence_head_with_markov=_bool(with_markov, "confidence_head_with_markov", default=False),
            sts_temperatures=None if sts is None else tuple(float(t) for t in sts))

    def to_dict(self) -> dict[str, Any]:
        """DeepSpec-style flat dict; ``from_pretrained(to_dict())`` round-trips."""
        d = self.layer_config.to_dict()
        d["architectures"] = ["MiniMaxM3DSparkModel"]
        d["model_type"] = "minimax_m3_dspark"
        d.update(block_size=self.block_size, mask_token_id=self.mask_token_id,
                 target_layer_ids=list(self.target_layer_ids), markov_rank=self.markov_rank,
                 enable_confidence_head=self.enable_confidence_head,
                 confidence_head_with_markov=self.confidence_head_with_markov)
        if self.markov_head_type is not None:
            d["markov_head_type"] = self.markov_head_type
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.sts_temperatures is not None:
            d["sts_temperatures"] = list(self.sts_temperatures)
        return d

    def save(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)


def _lookup(text: Mapping[str, Any], name: str, aliases: Sequence[str]):
    found = {}
    for a in aliases:
        if a in text and text[a] is not None:
            found[a] = text[a]
    for nest in _NESTED:
        sub = text.get(nest)
        if isinstance(sub, Mapping) and sub.get(name) is not None:
            found[f"{nest}.{name}"] = sub[name]
    if not found:
        return None
    first_key, first = next(iter(found.items()))
    for k, v in found.items():
        if v != first:
            raise ConfigError(f"{k}={v!r} disagrees with {first_key}={first!r}")
    return first


def _int(v, key) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ConfigError(f"{key} must be an integer, got {v!r}")
    return int(v)


def _bool(v, key, *, default: bool) -> bool:
    if v is None:
        return default
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise ConfigError(f"{key} must be true or false, got {v!r}")


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


class DraftLayer(nnx.Module):
    """One draft layer: the target's block shape (MiniMax-M3 attention, dense swigluoai MLP).

    ``h = x + o_proj(attn(input_layernorm(x)))``; ``out = h + mlp(post_attention_layernorm(h))``. The context
    keys/values are projected from ``H_ctx`` directly (no input norm: ``hidden_norm`` already normalised it).
    """

    def __init__(self, cfg: MiniMaxM3Config, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, layer_idx, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = DenseMLP(cfg, cfg.dense_intermediate_size, dtype=dtype, rngs=rngs)

    def context_kv(self, h_ctx: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``H_ctx [..., N, d]`` -> ``k, v [..., N, H_kv, D]`` (k normed and rotated at its position)."""
        c, a = self.cfg, self.self_attn
        lead = h_ctx.shape[:-1]
        k = a.k_norm(a.k_proj(h_ctx).reshape(*lead, c.num_key_value_heads, c.head_dim))
        v = a.v_proj(h_ctx).reshape(*lead, c.num_key_value_heads, c.head_dim)
        return apply_rope(k, cos, sin), v

    def __call__(self, x, cos, sin, k_ctx, v_ctx, ctx_visible, *, attention=None) -> jax.Array:
        """``x [R, K, d]`` block hidden states; ``k_ctx, v_ctx [R, S, H_kv, D]``; ``ctx_visible bool[R, 1|K, S]``."""
        attention = draft_attention if attention is None else attention
        r, k = x.shape[:2]
        q, kb, vb = self.self_attn.project_qkv(self.input_layernorm(x), cos, sin)
        o = attention(q, k_ctx, v_ctx, ctx_visible, kb, vb, scale=self.cfg.head_dim ** -0.5)
        h = x + self.self_attn.o_proj(o.reshape(r, k, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nnx.Module):
    """Rank-``r`` Markov correction of the draft logits (SPEC section 6).

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
                               (jnp.swapaxes(prev_tokens, 0, 1), jnp.swapaxes(h, 0, 1)))
        return jnp.swapaxes(bias, 0, 1)


class ConfidenceHead(nnx.Module):
    """``logit = w . features + b`` with ``features = [h_k ; e_k]`` or ``h_k``; float32 logits."""

    def __init__(self, in_dim: int, *, dtype, rngs: nnx.Rngs):
        self.proj = BiasedLinear(in_dim, 1, dtype=dtype, rngs=rngs)

    def __call__(self, features: jax.Array) -> jax.Array:
        return self.proj(features)[..., 0]


# ----------------------------------------------------------------------------------------------- cache / outputs
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
    """Context keys/values of every draft layer, one fixed-size buffer per request row.

    ``k, v [L, R, S, H_kv, D]`` (slot ``j`` = absolute position ``j``; keys already normed and rotated) and
    ``lengths int32[R]``: slots ``< lengths[r]`` hold valid context. A padding row has length 0.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def create(cls, cfg: DSparkConfig, num_requests: int, capacity: int, *, dtype=jnp.bfloat16) -> DraftCache:
        if num_requests < 1 or capacity < 1:
            raise ValueError(f"num_requests and capacity must be >= 1, got {num_requests}, {capacity}")
        c = cfg.layer_config
        shape = (c.num_hidden_layers, num_requests, capacity, c.num_key_value_heads, c.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((num_requests,), jnp.int32))

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_requests(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def rollback(self, lengths: jax.Array) -> DraftCache:
        """Shrink each row to ``min(lengths, current)``: entries beyond become invisible (and are overwritten by
        the next append)."""
        lengths = jnp.asarray(lengths, jnp.int32)
        if lengths.shape != self.lengths.shape:
            raise ValueError(f"lengths must be int32[R] with R = {self.num_requests}, got shape {lengths.shape}")
        return dataclasses.replace(self, lengths=jnp.minimum(self.lengths, jnp.maximum(lengths, 0)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftOutput:
    """What one draft step returns.

    ``tokens int32[R, K]``; ``probs f32[R, K, V]``: the Markov-corrected, temperature-scaled draft distribution
    each token was drawn from (one-hot of the argmax for rows with temperature 0; None when not requested);
    ``confidences f32[R, K]``: ``c_k`` after STS (None without a confidence head); ``confidence_logits
    f32[R, K]``: the raw logits (what :func:`minimax_jax.calibration.fit_sts` consumes).
    """

    tokens: jax.Array
    probs: jax.Array | None
    confidences: jax.Array | None
    confidence_logits: jax.Array | None


# ----------------------------------------------------------------------------------------------- attention
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


# ----------------------------------------------------------------------------------------------- the drafter
class DSparkDrafter(nnx.Module):
    """DSpark drafter: ``fc`` + ``hidden_norm`` feature projection, draft layers, final ``norm``, optional Markov
    and confidence heads. ``embed_tokens [V, d]`` and ``lm_head [d, V]`` are the target's (:class:`Shared`)."""

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
        self.hidden_norm = RMSNorm(d, eps=c.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DraftLayer(c, i, dtype=dtype, rngs=rngs) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(d, eps=c.rms_norm_eps, dtype=dtype)
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

    def init_cache(self, num_requests: int, capacity: int, *, dtype=None) -> DraftCache:
        return DraftCache.create(self.cfg, num_requests, capacity, dtype=self.dtype if dtype is None else dtype)

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
    def block_hidden(self, cache: DraftCache, anchors: jax.Array, anchor_positions: jax.Array) -> jax.Array:
        """Final-normed block hidden states ``h [R, K, d]`` using the cached context."""
        x, (cos, sin) = self._block_inputs(anchors, anchor_positions)
        end = jnp.minimum(cache.lengths, anchor_positions.astype(jnp.int32))
        visible = (jnp.arange(cache.capacity, dtype=jnp.int32)[None, :] < end[:, None])[:, None, :]  # [R, 1, S]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], visible)
        return self.norm(x)

    def block_hidden_reference(self, features, anchors: jax.Array, anchor_positions: jax.Array) -> jax.Array:
        """From scratch, no cache: ``features [R, S, m*d]`` of context positions ``0..S-1`` are projected and
        turned into keys/values for every layer; keys ``j < anchor_pos`` are visible. Same output as
        :meth:`block_hidden` after appending those features."""
        h_ctx = self.project_features(features)
        r, s = h_ctx.shape[:2]
        cos_c, sin_c = self._rope(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (r, s)))
        x, (cos, sin) = self._block_inputs(anchors, anchor_positions)
        visible = (jnp.arange(s)[None, :] < anchor_positions[:, None])[:, None, :]
        for layer in self.layers:
            k_ctx, v_ctx = layer.context_kv(h_ctx, cos_c, sin_c)
            x = layer(x, cos, sin, k_ctx, v_ctx, visible, attention=draft_attention_reference)
        return self.norm(x)

    def logits(self, h: jax.Array) -> jax.Array:
        """``U = h @ lm_head`` (the target's head, without the target's final norm): float32 ``[..., V]``."""
        w = self.lm_head[...]
        return jnp.dot(h.astype(w.dtype), w, preferred_element_type=jnp.float32)

    # ------------------------------------------------------------------ semi-autoregressive head
    def sample_block(self, h: jax.Array, anchors: jax.Array, temperature=0.0, key: jax.Array | None = None, *,
                     return_probs: bool = True) -> DraftOutput:
        """Draw the K drafts left to right from ``h [R, K, d]`` (see the module docstring).

        ``temperature``: scalar or ``f32[R]``; rows with ``T <= 0`` are greedy. ``key``: one PRNG key, or one per
        row (``[R]`` typed keys or raw ``uint32[R, 2]``); None means greedy for every row.
        """
        r, k = h.shape[:2]
        temps = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (r,))
        greedy = temps <= 0.0
        safe_t = jnp.where(greedy, 1.0, temps)[:, None]
        keys = _normalise_key(key, r)
        u = self.logits(h)  # [R, K, V]
        markov, conf_head = self.markov_head, self.confidence_head
        state0 = markov.init_state(r) if markov is not None else jnp.zeros((r, 1), jnp.float32)

        def body(carry, xs):
            prev, state = carry
            u_k, h_k, slot = xs
            if markov is not None:
                bias, e, state = markov.step(prev, h_k, state)
                logits = u_k + bias
            else:
                e, logits = None, u_k
            greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            scaled = logits / safe_t
            if keys is None:
                tok = greedy_tok
            else:
                slot_keys = jax.vmap(lambda kk: jax.random.fold_in(kk, slot))(keys)
                sampled = jax.vmap(jax.random.categorical)(slot_keys, scaled).astype(jnp.int32)
                tok = jnp.where(greedy, greedy_tok, sampled)
            ys = {"tokens": tok}
            if return_probs:
                onehot = jax.nn.one_hot(greedy_tok, logits.shape[-1], dtype=jnp.float32)
                ys["probs"] = jnp.where(greedy[:, None], onehot, jax.nn.softmax(scaled, axis=-1))
            if conf_head is not None:
                feats = jnp.concatenate([h_k, e.astype(h_k.dtype)], -1) if self.cfg.confidence_head_with_markov \
                    else h_k
                ys["confidence_logits"] = conf_head(feats)
            return (tok, state), ys

        xs = (jnp.swapaxes(u, 0, 1), jnp.swapaxes(h, 0, 1), jnp.arange(k, dtype=jnp.int32))
        _, ys = jax.lax.scan(body, (anchors.astype(jnp.int32), state0), xs)
        ys = {name: jnp.swapaxes(val, 0, 1) for name, val in ys.items()}
        conf_logits = ys.get("confidence_logits")
        conf = None if conf_logits is None else apply_sts(conf_logits, self.cfg.sts_temperatures)
        return DraftOutput(tokens=ys["tokens"], probs=ys.get("probs"), confidences=conf,
                           confidence_logits=conf_logits)

    # ------------------------------------------------------------------ cache writes
    def context_kv(self, h_ctx: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``H_ctx [N, d]`` at ``positions int32[N]`` -> ``k, v [L, N, H_kv, D]`` for every draft layer."""
        cos, sin = self._rope(positions)
        kv = [layer.context_kv(h_ctx, cos, sin) for layer in self.layers]
        return jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv])

    def write_context(self, cache: DraftCache, features, rows: jax.Array, positions: jax.Array,
                      new_lengths: jax.Array) -> DraftCache:
        """Core cache write: feature row ``i`` goes to ``(rows[i], positions[i])``; rows ``< 0`` are skipped.

        ``features [N, m*d]``, ``rows int32[N]``, ``positions int32[N]``, ``new_lengths int32[R]``.
        Positions outside ``[0, capacity)`` are dropped.
        """
        h_ctx = self.project_features(features)
        k_new, v_new = self.context_kv(h_ctx, jnp.maximum(positions, 0))
        keep = (rows >= 0) & (positions >= 0) & (positions < cache.capacity)
        rows_w = jnp.where(keep, rows, cache.num_requests)  # out of bounds -> dropped
        pos_w = jnp.where(keep, positions, cache.capacity)
        k = cache.k.at[:, rows_w, pos_w].set(k_new.astype(cache.k.dtype), mode="drop")
        v = cache.v.at[:, rows_w, pos_w].set(v_new.astype(cache.v.dtype), mode="drop")
        return DraftCache(k, v, jnp.asarray(new_lengths, jnp.int32))

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
        req = token_to_request(query_start_loc, t)
        rr = jnp.maximum(req, 0)
        i = jnp.arange(t, dtype=jnp.int32) - query_start_loc[rr]
        keep = (req >= 0) & (i < num_new[rr])
        return self.write_context(cache, features, jnp.where(keep, req, -1), start[rr] + i, start + num_new)

    # ------------------------------------------------------------------ conveniences (jitted)
    def draft(self, cache: DraftCache, anchors, anchor_positions, *, temperature=0.0, key=None,
              return_probs: bool = True, validate: bool = True) -> DraftOutput:
        """One jitted draft step; see :func:`draft_step`."""
        graphdef, state = nnx.split(self)
        return draft_step(graphdef, state, cache, anchors, anchor_positions, temperature, key,
                          return_probs=return_probs, validate=validate)

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


def _normalise_key(key, r: int):
    """None, one key, or ``r`` keys (typed or raw) -> typed keys ``[r]`` (or None)."""
    if key is None:
        return None
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.shape[-1:] != (2,) or key.ndim not in (1, 2):
            raise ValueError(f"key must be a PRNG key, [R] keys, or raw uint32[2] / uint32[R, 2], got "
                             f"{key.dtype}{list(key.shape)}")
        key = jax.random.wrap_key_data(key)
    if key.shape == ():
        return jax.random.split(key, r)
    if key.shape == (r,):
        return key
    raise ValueError(f"key must be one key or R = {r} keys, got key shape {key.shape}")


# ----------------------------------------------------------------------------------------------- entry points
def _check_cache(dims, cache: DraftCache):
    want = (dims["num_layers"], cache.num_requests, cache.capacity, dims["kv_heads"], dims["head_dim"])
    if not isinstance(cache, DraftCache) or cache.k.shape != want or cache.v.shape != want:
        raise ValueError(f"cache must be a DraftCache with k, v of shape [L, R, S, H_kv, D] = {list(want)}, got "
                         f"{getattr(getattr(cache, 'k', None), 'shape', None)}")
    if cache.lengths.shape != (cache.num_requests,):
        raise ValueError(f"cache.lengths must be int32[R] with R = {cache.num_requests}, got {cache.lengths.shape}")


def _check_draft_args(dims, cache: DraftCache, anchors, anchor_positions, temperature, key, validate: bool):
    anchors = jnp.asarray(anchors)
    anchor_positions = jnp.asarray(anchor_positions)
    r = cache.num_requests
    if anchors.shape != (r,) or not jnp.issubdtype(anchors.dtype, jnp.integer):
        raise ValueError(f"anchors must be int32[R] with R = cache.num_requests = {r}, got "
                         f"{anchors.dtype}{list(anchors.shape)}")
    if anchor_positions.shape != (r,) or not jnp.issubdtype(anchor_positions.dtype, jnp.integer):
        raise ValueError(f"anchor_positions must be int32[R] with R = {r}, got "
                         f"{anchor_positions.dtype}{list(anchor_positions.shape)}")
    t = jnp.asarray(temperature)
    if t.shape not in ((), (r,)):
        raise ValueError(f"temperature must be a scalar or f32[R] with R = {r}, got shape {t.shape}")
    _check_cache(dims, cache)
    if not validate:
        return anchors.astype(jnp.int32), anchor_positions.astype(jnp.int32)
    if (not isinstance(anchors, jax.core.Tracer) and anchors.size
            and (int(anchors.min()) < 0 or int(anchors.max()) >= dims["vocab"])):
        raise ValueError(f"anchors hold token ids outside the vocabulary [0, {dims['vocab']})")
    if (not isinstance(anchor_positions, jax.core.Tracer) and anchor_positions.size
            and int(anchor_positions.min()) < 0):
        raise ValueError("anchor_positions must be >= 0")
    if key is None and not isinstance(t, jax.core.Tracer) and bool(jnp.any(t > 0)):
        raise ValueError("temperature > 0 needs a PRNG key")
    return anchors.astype(jnp.int32), anchor_positions.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "return_probs"))
def _draft_jit(graphdef, state, cache, anchors, anchor_positions, temperature, key, *, return_probs):
    drafter = nnx.merge(graphdef, state)
    h = drafter.block_hidden(cache, anchors, anchor_positions)
    return drafter.sample_block(h, anchors, temperature, key, return_probs=return_probs)


def draft_step(graphdef, state, cache: DraftCache, anchors, anchor_positions, temperature=0.0, key=None, *,
               return_probs: bool = True, validate: bool = True) -> DraftOutput:
    """One drafting step for ``R`` request rows (jitted; ``graphdef`` and ``return_probs`` static).

    Args:
      graphdef, state: ``nnx.split(drafter)`` (split once, reuse: the state is passed as an argument).
      cache: :class:`DraftCache` with ``R`` rows; row ``r`` sees its context slots
        ``j < min(cache.lengths[r], anchor_positions[r])``.
      anchors: ``int32[R]`` the last emitted token of each row (any valid id for padding rows).
      anchor_positions: ``int32[R]`` the anchor's absolute position (normally ``== cache.lengths``).
      temperature: scalar or ``f32[R]``; ``<= 0`` means greedy for that row.
      key: PRNG key (one, or ``[R]``); required when any temperature is > 0.
      return_probs: also return the ``f32[R, K, V]`` draft distributions (what rejection sampling needs).
      validate: also check VALUES (token ids in the vocabulary, positions >= 0, a key when sampling); this
        reads the arrays back to the host, so an engine's hot loop passes False (shapes are always checked).
    Returns:
      :class:`DraftOutput` (``tokens int32[R, K]``, ``probs``, ``confidences``, ``confidence_logits``).
    """
    anchors, anchor_positions = _check_draft_args(_state_dims(state), cache, anchors, anchor_positions, temperature,
                                                  key, validate)
    # one compiled program whatever the caller passes: temperatures f32[R], always a key (greedy without one)
    r = cache.num_requests
    temps = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (r,))
    if key is None:
        temps, key = jnp.zeros((r,), jnp.float32), _greedy_keys(r)
    else:
        key = _normalise_key(key, r)  # [R] typed keys
    return _draft_jit(graphdef, state, cache, anchors, anchor_positions, temps, key, return_probs=return_probs)


@functools.lru_cache(maxsize=8)
def _greedy_keys(r: int):
    with jax.ensure_compile_time_eval():  # concrete even when called under an outer jit: safe to cache
        return jax.random.split(jax.random.key(0), r)


def _append_impl(graphdef, state, cache, features, start, num_new):
    return nnx.merge(graphdef, state).append_context_impl(cache, features, start, num_new)


def _append_packed_impl(graphdef, state, cache, features, query_start_loc, start, num_new):
    return nnx.merge(graphdef, state).append_context_packed_impl(cache, features, query_start_loc, start, num_new)


_append_jit = jax.jit(_append_impl, static_argnums=0)
_append_jit_donating = jax.jit(_append_impl, static_argnums=0, donate_argnums=2)
_append_packed_jit = jax.jit(_append_packed_impl, static_argnums=0)
_append_packed_jit_donating = jax.jit(_append_packed_impl, static_argnums=0, donate_argnums=2)


def _donate() -> bool:
    return jax.default_backend() != "cpu"  # XLA:CPU ignores donation (with a warning)


def _check_append_args(dims, cache, features, start, num_new, max_new: int, what: str, validate: bool):
    _check_cache(dims, cache)
    r = cache.num_requests
    start, num_new = jnp.asarray(start), jnp.asarray(num_new)
    for name, a in (("start", start), ("num_new", num_new)):
        if a.shape != (r,) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be int32[R] with R = {r}, got {a.dtype}{list(a.shape)}")
    if validate and not isinstance(start, jax.core.Tracer) and not isinstance(num_new, jax.core.Tracer) and r:
        s, n = np.asarray(start), np.asarray(num_new)
        if s.min() < 0 or n.min() < 0:
            raise ValueError("start and num_new must be >= 0")
        if n.max() > max_new:
            raise ValueError(f"num_new ({int(n.max())}) exceeds the {max_new} feature rows {what}")
        if (s + n).max() > cache.capacity:
            bad = int(np.argmax(s + n))
            raise ValueError(f"row {bad}: start + num_new = {int(s[bad] + n[bad])} exceeds the cache capacity "
                             f"{cache.capacity}")
    return start.astype(jnp.int32), num_new.astype(jnp.int32)


def append_context_step(graphdef, state, cache: DraftCache, features, start, num_new, *,
                        validate: bool = True) -> DraftCache:
    """Write target features into the draft cache, per-request padded layout (jitted, cache donated on GPU).

    Args:
      features: ``[R, T, m*d]`` concatenated target features (or a sequence of m ``[R, T, d]``); row ``r``'s
        feature ``i`` belongs to absolute position ``start[r] + i``.
      start: ``int32[R]`` position of each row's first feature row.
      num_new: ``int32[R]`` how many feature rows of each row to write (``0..T``); the rest is ignored.
      validate: check values (reads ``start`` / ``num_new`` back to the host; pass False in a hot loop).
    Returns:
      the cache with those K/V written and ``lengths = start + num_new`` for EVERY row: a row not taking part
      passes ``start = its length, num_new = 0``; ``start < length`` rolls the row back to ``start`` first.
    """
    dims = _state_dims(state)
    if isinstance(features, (list, tuple)):
        features = jnp.concatenate(features, axis=-1)
    if features.ndim != 3 or features.shape[0] != cache.num_requests or features.shape[2] != dims["feature_size"]:
        raise ValueError(f"features must be [R={cache.num_requests}, T, m*d={dims['feature_size']}], got shape "
                         f"{features.shape}")
    start, num_new = _check_append_args(dims, cache, features, start, num_new, features.shape[1], "per row",
                                        validate)
    fn = _append_jit_donating if _donate() else _append_jit
    return fn(graphdef, state, cache, features, start, num_new)


def append_context_packed_step(graphdef, state, cache: DraftCache, features, query_start_loc, start,
                               num_new, *, validate: bool = True) -> DraftCache:
    """Like :func:`append_context_step` for the packed verify layout (SPEC section 5).

    ``features [T, m*d]`` packed over requests by ``query_start_loc int32[R + 1]``; packed token ``t`` of row
    ``r`` (``i = t - qsl[r]``) is written at position ``start[r] + i`` when ``i < num_new[r]``. For a verify
    step: ``start`` = the anchor positions, ``num_new`` = 1 + accepted drafts.
    """
    dims = _state_dims(state)
    if isinstance(features, (list, tuple)):
        features = jnp.concatenate(features, axis=-1)
    if features.ndim != 2 or features.shape[1] != dims["feature_size"]:
        raise ValueError(f"features must be [T, m*d={dims['feature_size']}], got shape {features.shape}")
    qsl = jnp.asarray(query_start_loc)
    if qsl.shape != (cache.num_requests + 1,):
        raise ValueError(f"query_start_loc must be int32[R + 1] with R = {cache.num_requests}, got shape {qsl.shape}")
    start, num_new = _check_append_args(dims, cache, features, start, num_new, features.shape[0], "in the batch",
                                        validate)
    if validate and not isinstance(qsl, jax.core.Tracer) and not isinstance(num_new, jax.core.Tracer):
        q_len = np.diff(np.asarray(qsl))
        if np.any(np.asarray(num_new) > q_len):
            raise ValueError(f"num_new {np.asarray(num_new).tolist()} exceeds the query lengths {q_len.tolist()}")
    fn = _append_packed_jit_donating if _donate() else _append_packed_jit
    return fn(graphdef, state, cache, features, qsl.astype(jnp.int32), start, num_new)


def _state_dims(state) -> dict[str, int]:
    """Sizes the argument checks need, read from a drafter's split state (no merge on the hot path)."""
    try:
        vocab = state["embed_tokens"].shape[0]
        feature_size = state["fc"]["kernel"].shape[0]
        layers = state["layers"]
        attn = layers[0]["self_attn"]
        head_dim = attn["k_norm"]["weight"].shape[0]
        kv_heads = attn["k_proj"]["kernel"].shape[1] // head_dim
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"state does not look like a split DSparkDrafter ({e!r})") from None
    return {"vocab": vocab, "feature_size": feature_size, "num_layers": len(layers), "kv_heads": kv_heads,
                "head_dim": head_dim}


# ----------------------------------------------------------------------------------------------- helpers
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
