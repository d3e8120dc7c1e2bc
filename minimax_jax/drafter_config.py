"""DSpark drafter configuration (docs/DRAFTER.md): :class:`DSparkConfig` (MiniMax-block draft layers, the
DeepSpec ``config.json`` format), :class:`Qwen3DSparkConfig` (Qwen3-style draft layers, the
``Qwen3DSparkModel`` format of ``nvidia/MiniMax-M3-DSpark``), :func:`drafter_config_from_pretrained` (picks
between them by the config's ``architectures``), and the target-layer ids whose features the drafter reads
(default formula and validation).
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
MLP_ACTIVATIONS = ("swigluoai", "silu")  # MiniMax-M3 blocks, Qwen3 blocks


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
    "enable_confidence_head": ("enable_confidence_head", "use_confidence_head"),
    "confidence_head_with_markov": ("confidence_head_with_markov",),
    "sts_temperatures": ("sts_temperatures",),
}
_NESTED = ("dspark_config", "dflash_config")
_NOT_SHAPE_KEYS = {a for aliases in _DRAFTER_KEYS.values() for a in aliases} | set(_NESTED) | {
    "architectures", "model_type", "num_anchors", "layer_types", "mlp_layer_types", "moe_layer_freq",
    "sparse_attention_config", "dspark_ffn_hidden_size", "auto_map", "torch_dtype", "dtype",
    "transformers_version", "text_config", "sliding_window", "use_sliding_window", "is_causal",
}


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """A DSpark drafter: the draft layers' shape plus the DeepSpec drafter keys.

    ``layer_config`` is a :class:`MiniMaxM3Config` describing the draft layers (``num_hidden_layers`` = number
    of draft layers, every layer full attention with a dense MLP of ``dense_intermediate_size``); its
    ``hidden_size`` and ``vocab_size`` must match the target's. ``hidden_act`` is the dense MLP's activation
    (``"swigluoai"``: MiniMax-M3 blocks; ``"silu"``: Qwen3 blocks, :class:`Qwen3DSparkConfig`).
    ``sliding_window`` (``None``: the whole context): slot ``k`` of a block anchored at position ``a`` sees the
    context positions ``j > a + k - sliding_window`` only (non-causal sliding-window draft layers; the block's
    own keys are always visible).
    """

    ARCHITECTURE = "MiniMaxM3DSparkModel"  # what to_dict writes
    TARGET_LAYER_IDS_KEY = "target_layer_ids"  # the config.json key, for messages

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
    sliding_window: int | None = None
    hidden_act: str = "swigluoai"

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
        if self.hidden_act not in MLP_ACTIVATIONS:
            raise ConfigError(f"hidden_act must be one of {MLP_ACTIVATIONS}, got {self.hidden_act!r}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ConfigError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
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
            problems.append(f"{self.TARGET_LAYER_IDS_KEY}: {e}")
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
            num_hidden_layers=n_layers, layer_types=(FULL_ATTENTION,) * n_layers, sliding_window=None,
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
        _refuse_causal(text)
        window = _swa_window(text)
        if window is None and text.get("sliding_window") is not None and text.get("use_sliding_window") is not False:
            window = _int(text["sliding_window"], "sliding_window")

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
            sts_temperatures=None if sts is None else tuple(float(t) for t in sts), sliding_window=window)

    def to_dict(self) -> dict[str, Any]:
        """DeepSpec-style flat dict; ``from_pretrained(to_dict())`` round-trips."""
        d = self.layer_config.to_dict()
        d["architectures"] = [self.ARCHITECTURE]
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
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
        return d

    def save(self, path: str | os.PathLike) -> None:
        write_config_json(self.to_dict(), path)


# ----------------------------------------------------------------------------------------------- Qwen3 blocks
QWEN3_DSPARK_ARCHITECTURES = ("Qwen3DSparkModel", "Qwen3DSparkForCausalLM")
DFLASH_ARCHITECTURES = ("DFlashDraftModel",)  # ModelOpt's DFlash / DSpark exporter (projector_type tells them apart)
_QWEN3_SWITCHES = {  # key -> (the value(s) implemented, what another value would need); None: absent
    "hidden_act": (("silu", None), "a Qwen3 MLP activation other than silu"),
    "attention_bias": ((False, None), "biases in the attention projections"),
    "mlp_bias": ((False, None), "biases in the MLP projections"),
    "is_neox_style": ((True, None), "interleaved (non-NeoX) RoPE"),
    "add_swa_attention_sink_bias": ((False, None), "attention sink biases"),
    "dflash_config.attention_sink_bias": ((False, None), "attention sink biases"),
    "dflash_config.projector_type": (("dspark", None), "DFlash projectors other than DSpark's"),
    "dflash_config.shift_label": ((True, None), "drafters that do not draft from the anchor slot"),
    "dflash_config.use_aux_hidden_state": ((True, None), "drafters without the target-feature projector"),
}


@dataclasses.dataclass(frozen=True)
class Qwen3DSparkConfig(DSparkConfig):
    """A DSpark drafter with Qwen3-style draft layers (``architectures: ["Qwen3DSparkModel"]``, e.g.
    ``nvidia/MiniMax-M3-DSpark``; docs/DRAFTER.md): vLLM's ``Qwen3DSparkModel`` on ``DFlashQwen3Model``.

    Each draft layer: GQA attention at the drafter's own head counts with per-head RMSNorm q/k norms (weight
    ``w``, not Gemma's ``1 + w``), full-width NeoX RoPE, no biases; a SiLU MLP (``down(silu(gate) * up)``) of
    ``intermediate_size``; RMSNorms with weight ``w``. ``layer_config`` describes that shape as a
    :class:`MiniMaxM3Config` (``use_gemma_norm=False``, ``rotary_dim = head_dim``, every layer full attention
    with a dense MLP), so caches, sharding and the engine treat both drafter kinds alike.
    """

    ARCHITECTURE = "Qwen3DSparkModel"
    TARGET_LAYER_IDS_KEY = "dflash_config.target_layer_ids"
    hidden_act: str = "silu"

    def validate(self) -> None:
        super().validate()
        c = self.layer_config
        if c.use_gemma_norm:
            raise ConfigError("Qwen3 draft layers use RMSNorm weights w (use_gemma_norm=False)")
        if c.rotary_dim != c.head_dim:
            raise ConfigError(f"Qwen3 draft layers rotate the whole head: rotary_dim must be head_dim={c.head_dim}, "
                              f"got {c.rotary_dim}")
        if self.hidden_act != "silu":
            raise ConfigError(f"Qwen3 draft layers use a silu MLP, got hidden_act={self.hidden_act!r}")
        if self.markov_rank < 1:
            raise ConfigError("dflash_config.markov_rank must be >= 1: a DSpark drafter has a Markov head")

    @classmethod
    def for_target(cls, target_cfg: MiniMaxM3Config, *, mask_token_id: int, block_size: int = 8,
                   num_draft_layers: int = 1, num_attention_heads: int | None = None,
                   num_key_value_heads: int | None = None, head_dim: int | None = None,
                   intermediate_size: int | None = None, sliding_window: int | None = None,
                   target_layer_ids: Sequence[int] | None = None, markov_rank: int = 8,
                   markov_head_type: str = "vanilla", enable_confidence_head: bool = True,
                   confidence_head_with_markov: bool = True, rope_theta: float | None = None,
                   rms_norm_eps: float = 1e-6, **ignored) -> Qwen3DSparkConfig:
        """A Qwen3-style drafter for ``target_cfg`` (hidden size and vocabulary are the target's; head counts,
        head size and MLP width default to the target's; RoPE base to the target's, as ModelOpt pins it)."""
        del ignored
        n = int(num_draft_layers)
        if n < 1:
            raise ConfigError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
        hd = int(head_dim or target_cfg.head_dim)
        layer_cfg = MiniMaxM3Config(
            vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size, num_hidden_layers=n,
            num_attention_heads=int(num_attention_heads or target_cfg.num_attention_heads),
            num_key_value_heads=int(num_key_value_heads or target_cfg.num_key_value_heads), head_dim=hd,
            layer_types=(FULL_ATTENTION,) * n, mlp_layer_types=(DENSE_MLP,) * n,
            dense_intermediate_size=int(intermediate_size or target_cfg.dense_intermediate_size), rotary_dim=hd,
            rope_theta=float(target_cfg.rope_theta if rope_theta is None else rope_theta), rms_norm_eps=rms_norm_eps,
            use_gemma_norm=False, max_position_embeddings=target_cfg.max_position_embeddings)
        nt = target_cfg.num_hidden_layers
        ids = default_target_layer_ids(nt, n) if target_layer_ids is None else tuple(target_layer_ids)
        return cls(layer_config=layer_cfg, block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=ids,
                   num_target_layers=nt, markov_rank=markov_rank, markov_head_type=markov_head_type,
                   enable_confidence_head=enable_confidence_head,
                   confidence_head_with_markov=confidence_head_with_markov, sliding_window=sliding_window)

    @classmethod
    def from_pretrained(cls, path_or_dict: str | os.PathLike | Mapping[str, Any], *,
                        num_target_layers: int | None = None, num_target_features: int | None = None,
                        confidence_head_with_markov: bool | None = None) -> Qwen3DSparkConfig:
        """Read a ``Qwen3DSparkModel`` ``config.json`` (the format ModelOpt's DSpark exporter writes).

        Shape keys at the top level (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads``, ``head_dim`` (default ``hidden_size / heads``), ``intermediate_size``,
        ``vocab_size``, ``rms_norm_eps``, ``rope_theta`` (default 1e6, vLLM's for Qwen3 drafts; or
        ``rope_parameters.rope_theta``)); DSpark keys in ``dflash_config`` (or at the top level):
        ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``num_target_layers``, ``markov_rank``,
        ``markov_head_type`` (default vanilla), ``use_confidence_head`` / ``enable_confidence_head``,
        ``confidence_head_with_markov`` (else the argument, which the loader reads off the confidence head's
        width; else true, ModelOpt's ``[h ; W1[x]]`` head). Attention is resolved as vLLM's DFlash loader does
        (``layer_types``, ``dflash_config.use_swa`` / ``swa_window_size`` / ``causal``, ``is_causal``); a top-level
        ``sliding_window`` counts only with ``use_sliding_window`` (``transformers.Qwen3Config`` drops it
        otherwise). Causal or mixed layers, biases, sink biases, non-default RoPE, a reduced draft vocabulary and
        another projector are refused, naming the key.
        """
        raw = dict(read_config_json(path_or_dict))
        dfl = _dflash(raw)
        for key, (ok, what) in _QWEN3_SWITCHES.items():
            where, name = (dfl, key.split(".", 1)[1]) if key.startswith("dflash_config.") else (raw, key)
            if name in where and where[name] not in ok:
                raise ConfigError(f"{key}={where[name]!r}: {what} is not implemented")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                    "intermediate_size"):
            if raw.get(key) is None:
                raise ConfigError(f"drafter config is missing {key!r}")
        n = _int(raw["num_hidden_layers"], "num_hidden_layers")
        heads = _int(raw["num_attention_heads"], "num_attention_heads")
        hidden = _int(raw["hidden_size"], "hidden_size")
        vocab = _int(raw["vocab_size"], "vocab_size")
        hd = _int(raw["head_dim"], "head_dim") if raw.get("head_dim") is not None else hidden // max(heads, 1)
        draft_vocab = raw.get("draft_vocab_size")
        if draft_vocab is not None and _int(draft_vocab, "draft_vocab_size") != vocab:
            raise ConfigError(f"draft_vocab_size={draft_vocab!r}: reduced-vocabulary drafters (a d2t map) are not "
                              f"implemented (vocab_size {vocab})")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise ConfigError(f"rope_parameters must be an object, got {type(rope).__name__}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"rope_scaling / rope_parameters type {rope_type!r} is not implemented for the "
                              f"drafter (only 'default' RoPE)")
        factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        if factor is not None and float(factor) != 1.0:
            raise ConfigError(f"partial_rotary_factor={factor!r}: Qwen3 draft layers rotate the whole head")
        theta_top, theta_nested = raw.get("rope_theta"), rope.get("rope_theta")
        if theta_top is not None and theta_nested is not None and float(theta_top) != float(theta_nested):
            raise ConfigError(f"rope_theta={theta_top!r} disagrees with rope_parameters.rope_theta={theta_nested!r}")
        theta = theta_top if theta_top is not None else theta_nested
        window = _qwen3_window(raw, n)

        values = {name: _lookup(raw, name, aliases) for name, aliases in _DRAFTER_KEYS.items()}
        for name in ("block_size", "mask_token_id"):
            if values[name] is None:
                raise ConfigError(f"drafter config is missing 'dflash_config.{name}'")
        n_target = values["num_target_layers"]
        n_target = _int(n_target, "dflash_config.num_target_layers") if n_target is not None else num_target_layers
        ids = values["target_layer_ids"]
        if ids is None:
            if n_target is None:
                raise ConfigError("drafter config is missing 'dflash_config.target_layer_ids' (the default formula "
                                  "needs the number of target layers)")
            ids = default_target_layer_ids(n_target, num_target_features or n)
        try:
            ids = validate_target_layer_ids(ids, n_target)
        except ConfigError as e:
            raise ConfigError(f"dflash_config.target_layer_ids: {e}") from None
        rank = values["markov_rank"]
        if rank is None:
            raise ConfigError("drafter config is missing 'dflash_config.markov_rank' (the Markov head's rank)")
        enable = _bool(values["enable_confidence_head"], "dflash_config.use_confidence_head", default=False)
        with_markov = values["confidence_head_with_markov"]
        if with_markov is None:
            with_markov = confidence_head_with_markov if confidence_head_with_markov is not None else True
        sts = values["sts_temperatures"]
        layer_cfg = MiniMaxM3Config(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n, num_attention_heads=heads,
            num_key_value_heads=_int(raw["num_key_value_heads"], "num_key_value_heads"), head_dim=hd,
            layer_types=(FULL_ATTENTION,) * n, mlp_layer_types=(DENSE_MLP,) * n,
            dense_intermediate_size=_int(raw["intermediate_size"], "intermediate_size"), rotary_dim=hd,
            rope_theta=1_000_000.0 if theta is None else float(theta),
            rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6), use_gemma_norm=False,
            max_position_embeddings=_int(raw.get("max_position_embeddings") or 32768, "max_position_embeddings"))
        return cls(
            layer_config=layer_cfg, block_size=_int(values["block_size"], "dflash_config.block_size"),
            mask_token_id=_int(values["mask_token_id"], "dflash_config.mask_token_id"), target_layer_ids=ids,
            num_target_layers=n_target, markov_rank=_int(rank, "dflash_config.markov_rank"),
            markov_head_type=str(values["markov_head_type"] or "vanilla").lower(), enable_confidence_head=enable,
            confidence_head_with_markov=_bool(with_markov, "confidence_head_with_markov", default=True) and enable,
            sts_temperatures=None if sts is None else tuple(float(t) for t in sts), sliding_window=window)

    def to_dict(self) -> dict[str, Any]:
        """The published ``Qwen3DSparkModel`` schema (ModelOpt's exporter); ``from_pretrained`` round-trips."""
        c = self.layer_config
        dfl: dict[str, Any] = {
            "block_size": self.block_size, "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids), "projector_type": "dspark", "shift_label": True,
            "markov_rank": self.markov_rank, "markov_head_type": self.markov_head_type,
            "use_confidence_head": self.enable_confidence_head}
        if self.num_target_layers is not None:
            dfl["num_target_layers"] = self.num_target_layers
        if self.enable_confidence_head and not self.confidence_head_with_markov:
            dfl["confidence_head_with_markov"] = False
        d: dict[str, Any] = {
            "architectures": [self.ARCHITECTURE], "model_type": "qwen3", "block_size": self.block_size,
            "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "intermediate_size": c.dense_intermediate_size, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings, "attention_bias": False, "rope_theta": c.rope_theta,
            "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float32",
            "layer_types": [FULL_ATTENTION] * c.num_hidden_layers, "dflash_config": dfl}
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
            dfl.update(use_swa=True, swa_window_size=self.sliding_window, causal=False)
        if self.sts_temperatures is not None:
            d["sts_temperatures"] = list(self.sts_temperatures)
        return d


def _qwen3_window(raw: Mapping[str, Any], n_layers: int) -> int | None:
    """The draft layers' sliding window as vLLM's ``_resolve_layer_attention`` reads a ``Qwen3Config``.

    ``layer_types`` (absent: generated as ``transformers.Qwen3Config`` does, sliding for layers
    ``>= max_window_layers`` when a window survives); ``dflash_config.use_swa`` makes every layer sliding when
    none is; the window is ``dflash_config.swa_window_size``, else ``sliding_window`` (kept by ``Qwen3Config``
    only with ``use_sliding_window``). A causal or a mixed stack is refused."""
    dfl = _dflash(raw)
    top = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = _int(raw.get("max_window_layers", 28), "max_window_layers")
        layer_types = ["sliding_attention" if top is not None and i >= first else FULL_ATTENTION
                       for i in range(n_layers)]
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != n_layers:
        raise ConfigError(f"layer_types must list one entry per draft layer ({n_layers}), got {layer_types!r}")
    for i, t in enumerate(layer_types):
        if t not in (FULL_ATTENTION, "sliding_attention"):
            raise ConfigError(f"layer_types[{i}]={t!r}: draft layers are full_attention or sliding_attention")
    sliding = [t == "sliding_attention" for t in layer_types]
    _refuse_causal(raw, sliding_layer_types=any(sliding))
    if _bool(dfl.get("use_swa"), "dflash_config.use_swa", default=False) and not any(sliding):
        sliding = [True] * n_layers
    if any(sliding) and not all(sliding):
        raise ConfigError(f"layer_types={list(layer_types)}: a mix of sliding-window and full-attention draft layers "
                          f"is not implemented")
    if not sliding[0]:
        return None
    window = dfl.get("swa_window_size", top)
    if window is None:
        raise ConfigError("sliding-window draft layers need a window: dflash_config.swa_window_size (or "
                          "sliding_window with use_sliding_window: true)")
    return _int(window, "dflash_config.swa_window_size")


def drafter_config_class(raw: Mapping[str, Any]) -> type[DSparkConfig]:
    """The config class a drafter ``config.json`` asks for: :class:`Qwen3DSparkConfig` for ``Qwen3DSparkModel``
    (or ModelOpt's ``DFlashDraftModel`` with ``dflash_config.projector_type: dspark``), else
    :class:`DSparkConfig` (DeepSpec's MiniMax-block drafters)."""
    arch = raw.get("architectures") or []
    if isinstance(arch, str):
        arch = [arch]
    if any(a in QWEN3_DSPARK_ARCHITECTURES for a in arch):
        return Qwen3DSparkConfig
    if any(a in DFLASH_ARCHITECTURES for a in arch):
        projector = _dflash(raw).get("projector_type")
        if projector == "dspark":
            return Qwen3DSparkConfig
        raise ConfigError(f"architectures={list(arch)} with dflash_config.projector_type={projector!r}: only DSpark "
                          f"drafters (projector_type 'dspark', with a Markov head) are implemented")
    return DSparkConfig


def drafter_config_from_pretrained(path_or_dict: str | os.PathLike | Mapping[str, Any], **kwargs) -> DSparkConfig:
    """Read a drafter ``config.json`` with the class its ``architectures`` name (:func:`drafter_config_class`).
    ``kwargs`` (``num_target_layers``, ``num_target_features``, ``confidence_head_with_markov``) go to its
    ``from_pretrained``; the MiniMax-block format ignores ``confidence_head_with_markov``."""
    raw = read_config_json(path_or_dict)
    cls = drafter_config_class(raw)
    if cls is DSparkConfig:
        kwargs.pop("confidence_head_with_markov", None)
    return cls.from_pretrained(raw, **kwargs)


def _dflash(text: Mapping[str, Any]) -> Mapping[str, Any]:
    sub = text.get("dflash_config") or {}
    if not isinstance(sub, Mapping):
        raise ConfigError(f"dflash_config must be an object, got {type(sub).__name__}")
    return sub


def _refuse_causal(text: Mapping[str, Any], sliding_layer_types: bool = False) -> None:
    """Draft layers here are non-causal (the block attends to itself both ways). vLLM's DFlash resolution:
    ``is_causal``, else ``dflash_config.causal``, else causal exactly for ``sliding_attention`` layer types."""
    is_causal, override = text.get("is_causal"), _dflash(text).get("causal")
    if is_causal is not None:
        causal, key = is_causal, "is_causal"
    elif override is not None:
        causal, key = override, "dflash_config.causal"
    else:
        causal, key = sliding_layer_types, "layer_types (sliding_attention without dflash_config.causal=false)"
    if causal:
        raise ConfigError(f"{key}: causal draft layers are not implemented (draft blocks attend bidirectionally)")


def _swa_window(text: Mapping[str, Any]) -> int | None:
    """``dflash_config.swa_window_size`` when ``dflash_config.use_swa`` is set (a window is then required)."""
    dfl = _dflash(text)
    if not _bool(dfl.get("use_swa"), "dflash_config.use_swa", default=False):
        return None
    window = dfl.get("swa_window_size")
    if window is None:
        window = text.get("sliding_window") if text.get("use_sliding_window") is not False else None
    if window is None:
        raise ConfigError("dflash_config.use_swa is true but no window is given (dflash_config.swa_window_size)")
    return _int(window, "dflash_config.swa_window_size")


def _lookup(text: Mapping[str, Any], name: str, aliases: Sequence[str]):
    found = {}
    for a in aliases:
        if a in text and text[a] is not None:
            found[a] = text[a]
    for nest in _NESTED:
        sub = text.get(nest)
        if isinstance(sub, Mapping):
            for a in dict.fromkeys((name, *aliases)):
                if sub.get(a) is not None:
                    found[f"{nest}.{a}"] = sub[a]
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
