"""DSpark drafter configuration (docs/DRAFTER.md): :class:`DSparkConfig`, the target-layer ids whose
features the drafter reads (default formula and validation), and the DeepSpec ``config.json`` format.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from minimax_jax.config import (
    DENSE_MLP,
    FULL_ATTENTION,
    ConfigError,
    MiniMaxM3Config,
    read_config_json,
    write_config_json,
)

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
    """Non-empty, strictly increasing, in ``[-1, N - 1]``: ``-1`` is the embedding output, ``i >= 0`` the residual
    stream after layer ``i`` (before the final norm), so ``N - 1`` is the last layer's output, which DeepSpec
    drafters may use (published MiniMax-M3 drafters read ``[3, 17, 31, 45, 59]`` of a 60-layer target).
    ``num_target_layers=None`` checks everything but the upper bound."""
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
        if ids[-1] > n - 1:
            raise ConfigError(f"target_layer_ids {ids} exceed the target's {n} layers (valid: -1..{n - 1})")
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
        write_config_json(self.to_dict(), path)


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
