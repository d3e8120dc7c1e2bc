"""MiniMax-M3 text-model configuration: parsing of real ``config.json`` files, validation, presets.

A MiniMax-M3 ``config.json`` comes in several dialects. :meth:`MiniMaxM3Config.from_pretrained` accepts all of
the ones we know of:

* the text settings at the top level, or under ``text_config`` (the vision-language release);
* the sparse-attention settings as flat HF keys (``index_n_heads`` ...) or as the legacy
  ``sparse_attention_config`` dict (``sparse_num_index_heads``, ``sparse_attention_freq`` ...);
* the per-layer MLP choice as ``mlp_layer_types`` or the legacy ``moe_layer_freq``;
* ``rope_theta`` at the top level or inside ``rope_parameters``; the rotated width as ``rotary_dim`` or as
  ``partial_rotary_factor`` (top level or inside ``rope_parameters``);
* ``swiglu_beta`` missing (checkpoints omit it): 1.0.

Every problem raises :class:`ConfigError` (a ``ValueError``) naming the offending key.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

FULL_ATTENTION = "full_attention"
SPARSE_ATTENTION = "minimax_m3_sparse"
DENSE_MLP = "dense"
MOE_MLP = "sparse"


class ConfigError(ValueError):
    """A malformed or inconsistent MiniMax-M3 configuration."""


@dataclasses.dataclass(frozen=True)
class MiniMaxM3Config:
    vocab_size: int = 200064
    hidden_size: int = 6144
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    rotary_dim: int = 64
    rope_theta: float = 5_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 524288
    # MLPs
    intermediate_size: int = 3072  # one routed expert
    dense_intermediate_size: int = 12288
    shared_intermediate_size: int = 3072  # 0: no shared expert
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    swiglu_beta: float = 1.0
    # per-layer dispatch
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    # MSA sparse attention
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    # tokens
    bos_token_id: int | None = 200034
    eos_token_id: tuple[int, ...] = (200020,)
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self):
        n = self.num_hidden_layers
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple([FULL_ATTENTION] * n))
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", tuple([MOE_MLP] * n))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        eos = self.eos_token_id
        if eos is None:
            eos = ()
        elif isinstance(eos, int):
            eos = (eos,)
        object.__setattr__(self, "eos_token_id", tuple(int(e) for e in eos))
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def sparse_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SPARSE_ATTENTION)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == MOE_MLP)

    def is_sparse_layer(self, i: int) -> bool:
        return self.layer_types[i] == SPARSE_ATTENTION

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == MOE_MLP

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def positive(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "dense_intermediate_size",
                     "max_position_embeddings"):
            positive(name)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if not (0 < self.rotary_dim <= self.head_dim) or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {n}")
        if len(self.mlp_layer_types) != n:
            raise ConfigError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries but num_hidden_layers is {n}")
        for i, t in enumerate(self.layer_types):
            if t not in (FULL_ATTENTION, SPARSE_ATTENTION):
                raise ConfigError(f"layer_types[{i}] must be {FULL_ATTENTION!r} or {SPARSE_ATTENTION!r}, got {t!r}")
        for i, t in enumerate(self.mlp_layer_types):
            if t not in (DENSE_MLP, MOE_MLP):
                raise ConfigError(f"mlp_layer_types[{i}] must be {DENSE_MLP!r} or {MOE_MLP!r}, got {t!r}")
        if self.moe_layer_ids:
            positive("num_local_experts")
            positive("num_experts_per_tok")
            if self.num_experts_per_tok > self.num_local_experts:
                raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                                  f"num_local_experts ({self.num_local_experts})")
            if self.shared_intermediate_size < 0:
                raise ConfigError(f"shared_intermediate_size must be >= 0, got {self.shared_intermediate_size}")
        if self.sparse_layer_ids:
            for name in ("index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks"):
                positive(name)
            if self.index_n_heads != self.num_key_value_heads:
                raise ConfigError(
                    f"index_n_heads ({self.index_n_heads}) must equal num_key_value_heads "
                    f"({self.num_key_value_heads}): MSA selects blocks once per KV group")
            if self.index_head_dim < self.rotary_dim:
                raise ConfigError(f"index_head_dim ({self.index_head_dim}) must be >= rotary_dim ({self.rotary_dim})")
            if not 0 <= self.index_local_blocks <= self.index_topk_blocks:
                raise ConfigError(f"index_local_blocks must be in [0, index_topk_blocks={self.index_topk_blocks}], "
                                  f"got {self.index_local_blocks}")
        if self.swiglu_limit <= 0:
            raise ConfigError(f"swiglu_limit must be > 0, got {self.swiglu_limit}")
        for name in ("bos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                raise ConfigError(f"{name} ({v}) is outside the vocabulary [0, {self.vocab_size})")
        for e in self.eos_token_id:
            if not 0 <= e < self.vocab_size:
                raise ConfigError(f"eos_token_id ({e}) is outside the vocabulary [0, {self.vocab_size})")

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_pretrained(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> MiniMaxM3Config:
        """Read a MiniMax-M3 ``config.json`` (a directory, the file, or an already-parsed dict)."""
        raw = read_config_json(path_or_dict)
        return cls(**_normalise(raw))

    def to_dict(self) -> dict[str, Any]:
        """HF-style flat dict; ``from_pretrained(to_dict())`` round-trips."""
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["eos_token_id"] = list(self.eos_token_id)
        d["model_type"] = "minimax_m3_vl_text"
        return d

    def save(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def replace(self, **changes) -> MiniMaxM3Config:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @classmethod
    def m3(cls) -> MiniMaxM3Config:
        """The real MiniMax-M3 text shape (about 428B parameters): 3 dense layers, then MoE + MSA."""
        n = 60
        return cls(
            num_hidden_layers=n,
            layer_types=tuple([FULL_ATTENTION] * 3 + [SPARSE_ATTENTION] * (n - 3)),
            mlp_layer_types=tuple([DENSE_MLP] * 3 + [MOE_MLP] * (n - 3)),
        )

    @classmethod
    def tiny(cls, **overrides) -> MiniMaxM3Config:
        """A small MiniMax-M3-shaped config for tests and the embedded default's architecture."""
        base = dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rotary_dim=8, rope_theta=10_000.0, intermediate_size=32, dense_intermediate_size=64,
            shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            layer_types=(FULL_ATTENTION, FULL_ATTENTION, SPARSE_ATTENTION, SPARSE_ATTENTION),
            mlp_layer_types=(DENSE_MLP, MOE_MLP, DENSE_MLP, MOE_MLP),
            index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=3, index_local_blocks=1,
            bos_token_id=1, eos_token_id=(2,), max_position_embeddings=4096,
        )
        base.update(overrides)
        return cls(**base)


# ---------------------------------------------------------------------- parsing
def read_config_json(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json`` as a dict: from a directory, the file itself, or an already-parsed mapping."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


_FIELDS = {f.name for f in dataclasses.fields(MiniMaxM3Config)}

_LEGACY_SPARSE_KEYS = {
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
}

_INT_KEYS = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rotary_dim", "max_position_embeddings", "intermediate_size", "dense_intermediate_size",
    "shared_intermediate_size", "num_local_experts", "num_experts_per_tok", "index_n_heads", "index_head_dim",
    "index_block_size", "index_topk_blocks", "index_local_blocks",
}
_FLOAT_KEYS = {"rope_theta", "rms_norm_eps", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit", "swiglu_beta"}


def _normalise(raw: dict[str, Any]) -> dict[str, Any]:
    top = raw
    text = raw.get("text_config")
    if text is not None:
        if not isinstance(text, Mapping):
            raise ConfigError(f"text_config must be an object, got {type(text).__name__}")
        text = dict(text)
        # A few token ids and the tying flag may sit only at the top level of a VL config.
        for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            if k not in text and k in top:
                text[k] = top[k]
    else:
        text = dict(raw)

    out: dict[str, Any] = {}
    if "num_experts" in text and "num_local_experts" not in text:
        text["num_local_experts"] = text["num_experts"]

    # sparse attention: legacy dict first, flat keys win if both are present and agree
    sparse_cfg = text.get("sparse_attention_config") or {}
    if not isinstance(sparse_cfg, Mapping):
        raise ConfigError(f"sparse_attention_config must be an object, got {type(sparse_cfg).__name__}")
    for legacy, flat in _LEGACY_SPARSE_KEYS.items():
        if legacy in sparse_cfg:
            if flat in text and text[flat] != sparse_cfg[legacy]:
                raise ConfigError(f"{flat}={text[flat]!r} disagrees with "
                                  f"sparse_attention_config.{legacy}={sparse_cfg[legacy]!r}")
            out[flat] = sparse_cfg[legacy]

    n_layers = text.get("num_hidden_layers")
    layer_types = text.get("layer_types")
    if layer_types is None and "sparse_attention_freq" in sparse_cfg:
        freq = sparse_cfg["sparse_attention_freq"]
        layer_types = [SPARSE_ATTENTION if f else FULL_ATTENTION for f in _as_list(freq, "sparse_attention_config."
                                                                                   "sparse_attention_freq", n_layers)]
    if layer_types is not None:
        out["layer_types"] = tuple(_as_list(layer_types, "layer_types", None))

    mlp_types = text.get("mlp_layer_types")
    if mlp_types is None and text.get("moe_layer_freq") is not None:
        mlp_types = [MOE_MLP if f else DENSE_MLP for f in _as_list(text["moe_layer_freq"], "moe_layer_freq", n_layers)]
    if mlp_types is not None:
        out["mlp_layer_types"] = tuple(_as_list(mlp_types, "mlp_layer_types", None))

    # RoPE
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"rope_parameters must be an object, got {type(rope).__name__}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported (only 'default' RoPE)")
    theta_top, theta_nested = text.get("rope_theta"), rope.get("rope_theta")
    if theta_top is not None and theta_nested is not None and float(theta_top) != float(theta_nested):
        raise ConfigError(f"rope_theta={theta_top!r} disagrees with rope_parameters.rope_theta={theta_nested!r}")
    theta = theta_top if theta_top is not None else theta_nested
    if theta is not None:
        out["rope_theta"] = theta

    head_dim = text.get("head_dim")
    if head_dim is None and "hidden_size" in text and "num_attention_heads" in text:
        head_dim = int(text["hidden_size"]) // int(text["num_attention_heads"])
        out["head_dim"] = head_dim
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor"))
    rotary_dim = text.get("rotary_dim")
    if factor is not None:
        if head_dim is None:
            raise ConfigError("partial_rotary_factor needs head_dim")
        from_factor = int(int(head_dim) * float(factor))
        if rotary_dim is not None and int(rotary_dim) != from_factor:
            raise ConfigError(f"rotary_dim={rotary_dim!r} disagrees with partial_rotary_factor={factor!r} "
                              f"(head_dim {head_dim} -> {from_factor})")
        out["rotary_dim"] = from_factor
    elif rotary_dim is None and head_dim is not None:
        out["rotary_dim"] = int(head_dim) // 2  # MiniMax-M3 rotates half of each head

    # everything else that matches a field name
    for k, v in text.items():
        if k in _FIELDS and k not in out and k not in ("layer_types", "mlp_layer_types"):
            out[k] = v
    if "swiglu_beta" not in out:
        out["swiglu_beta"] = 1.0
    if "hidden_act" in text and text["hidden_act"] not in ("swigluoai", "silu", "swiglu"):
        raise ConfigError(f"hidden_act={text['hidden_act']!r}: MiniMax-M3 uses 'swigluoai'")

    for k in list(out):
        v = out[k]
        if k in _INT_KEYS:
            out[k] = _as_int(v, k)
        elif k in _FLOAT_KEYS:
            out[k] = _as_float(v, k)
    if "eos_token_id" in out and out["eos_token_id"] is not None:
        eos = out["eos_token_id"]
        eos = [eos] if not isinstance(eos, (list, tuple)) else eos
        out["eos_token_id"] = tuple(_as_int(e, "eos_token_id") for e in eos)
    for k in ("bos_token_id", "pad_token_id"):
        if out.get(k) is not None:
            out[k] = _as_int(out[k], k)
    return out


def _as_list(v, key, n):
    if not isinstance(v, (list, tuple)):
        raise ConfigError(f"{key} must be a list, got {type(v).__name__}")
    if n is not None and len(v) != n:
        raise ConfigError(f"{key} has {len(v)} entries but num_hidden_layers is {n}")
    return list(v)


def _as_int(v, key) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ConfigError(f"{key} must be an integer, got {v!r}")
    return int(v)


def _as_float(v, key) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{key} must be a number, got {v!r}")
    return float(v)
