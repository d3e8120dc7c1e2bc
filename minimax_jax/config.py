"""MiniMax-M3 text-model configuration: parsing of real ``config.json`` files, validation, presets.

A MiniMax-M3 ``config.json`` comes in several dialects. :meth:`MiniMaxM3Config.from_pretrained` accepts all of
the ones we know of:

* the text settings at the top level, or under ``text_config`` (the vision-language release);
* the sparse-attention settings as flat HF keys (``index_n_heads`` ...) or as the legacy
  ``sparse_attention_config`` dict (``sparse_num_index_heads``, ``sparse_attention_freq`` ...);
* the per-layer MLP choice as ``mlp_layer_types`` or the legacy ``moe_layer_freq``;
* ``rope_theta`` at the top level or inside ``rope_parameters``; the rotated width as ``rotary_dim`` or as
  ``partial_rotary_factor`` (top level or inside ``rope_parameters``).

Strictness:

* **Shape-defining keys are required** (vocabulary, widths, layer and head counts, the per-layer attention and
  MLP kinds, the MoE sizes when there are MoE layers, the MSA sizes when there are sparse layers); a missing one
  raises :class:`ConfigError` naming every missing key. ``head_dim`` may be derived from ``hidden_size /
  num_attention_heads`` and ``rotary_dim`` defaults to half of ``head_dim``, as the reference does.
* Keys with a true default (the reference implementation's value when the key is absent) may be omitted:
  ``rope_theta`` 5e6, ``rms_norm_eps`` 1e-6, ``routed_scaling_factor`` 2.0, ``swiglu_alpha`` 1.702,
  ``swiglu_limit`` 7.0, ``swiglu_beta`` 1.0 (released checkpoints omit it), ``index_local_blocks`` 1,
  ``use_gemma_norm`` true, ``max_position_embeddings`` 524288.
* Keys we do not know are ignored with ONE warning that lists them (a misspelt ``num_hiden_layers`` shows up).
* ``hidden_act`` must be ``swigluoai``; ``silu`` is accepted only in a config written by transformers (its
  MiniMax-M3 class writes that default but always runs swigluoai).
* Feature switches we do not implement (an attention output gate, top-k reuse across layers, non-sigmoid
  routing, ...) are refused with a message naming the key, never silently run as something else.
* Sliding windows (docs/CHECKPOINTS.md, "Sliding windows"): ``sliding_window`` (a positive integer, or null)
  counts unless ``use_sliding_window`` is false. Per layer, HF style: the layers ``layer_types`` names
  ``sliding_attention`` are dense layers over their last ``sliding_window`` positions. Model-wide (no such
  entry): every ``full_attention`` layer becomes ``sliding_attention``, as vLLM's model-level window reaches
  MiniMax-M3's dense layers only; MSA layers take no window. A window that would reach no layer, a list-valued
  ``sliding_window``, ``use_sliding_window: true`` without a window and ``max_window_layers`` beside a window
  are refused.
* ``quantization_config`` is read by :mod:`minimax_jax.quantization`: the MXFP8 and Quark MXFP4 releases load,
  any other scheme is refused naming what is unsupported (docs/CHECKPOINTS.md).
* Special token ids (BOS, EOS, PAD) outside the vocabulary are loaded as *absent*, with a warning: small test
  models saved by the reference carry MiniMax-M3's ids. Whoever needs such a token later says clearly that it
  is missing.

Every problem raises :class:`ConfigError` (a ``ValueError``) naming the offending key. The dataclass itself
takes keyword arguments only and requires the shape-defining fields; :meth:`MiniMaxM3Config.m3` and
:meth:`MiniMaxM3Config.tiny` are the presets.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"  # dense attention over the last `sliding_window` positions
SPARSE_ATTENTION = "minimax_m3_sparse"
DENSE_MLP = "dense"
MOE_MLP = "sparse"


# Module paths of the linears a config may hold quantized (MiniMaxM3Config.quantized_linears).
_LINEAR_PATH = re.compile(r"layers\.(?P<layer>\d+)\.(?P<where>self_attn\.(?:[qkvo]_proj|indexer\.[qk]_proj)|"
                          r"mlp\.(?:shared_experts\.)?(?:gate_up|down)_proj)")


class ConfigError(ValueError):
    """A malformed or inconsistent MiniMax-M3 configuration."""


class ConfigWarning(UserWarning):
    """A config.json that loads, but with something the user should know (unknown keys, absent special ids)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MiniMaxM3Config:
    # ---- shape (required)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    # ---- shape, required where the layer kind exists (None otherwise)
    dense_intermediate_size: int | None = None  # dense MLP layers
    intermediate_size: int | None = None  # one routed expert (MoE layers)
    shared_intermediate_size: int | None = None  # the shared expert (MoE layers); 0: none
    num_local_experts: int | None = None
    num_experts_per_tok: int | None = None
    index_n_heads: int | None = None  # MSA sparse layers
    index_head_dim: int | None = None
    index_block_size: int | None = None
    index_topk_blocks: int | None = None
    # ---- keys with a true default (the reference's value when the key is absent)
    index_local_blocks: int = 1
    sliding_window: int | None = None  # the window of the `sliding_attention` layers (None: there are none)
    rotary_dim: int | None = None  # None: head_dim // 2 (MiniMax-M3 rotates half of each head)
    rope_theta: float = 5_000_000.0
    rms_norm_eps: float = 1e-6
    use_gemma_norm: bool = True  # RMSNorm scales by (1 + w) (Gemma) rather than by w
    max_position_embeddings: int = 524288
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    swiglu_beta: float = 1.0
    # ---- tokens (None / empty: absent)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    # ---- storage: routed experts kept quantized in HBM ("mxfp4" / "mxfp8", E8M0 scales; layers.MoE); None: dense
    expert_quantization: str | None = None
    # ---- storage: the linears (attention and index projections, dense MLPs, shared expert) held as MX tensors,
    # by module path ("layers.0.self_attn.q_proj"; layers.QuantizedLinear), in the format linear_quantization
    linear_quantization: str | None = None
    quantized_linears: tuple[str, ...] = ()
    # ---- benchmarks only: every routed token goes to experts chosen round-robin, equal weights (layers.Router;
    # random router weights otherwise give a load no trained model has). Never set by a checkpoint.
    balanced_routing: bool = False

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        eos = self.eos_token_id
        if eos is None:
            eos = ()
        elif isinstance(eos, int):
            eos = (eos,)
        object.__setattr__(self, "eos_token_id", tuple(int(e) for e in eos))
        if isinstance(self.quantized_linears, (list, tuple)):
            object.__setattr__(self, "quantized_linears", tuple(self.quantized_linears))
        if self.rotary_dim is None and isinstance(self.head_dim, int):
            object.__setattr__(self, "rotary_dim", self.head_dim // 2)
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

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i``'s attention: ``sliding_window`` on a ``sliding_attention`` layer,
        None (every earlier position) on the others."""
        return self.sliding_window if self.layer_types[i] == SLIDING_ATTENTION else None

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def positive(name):
            v = getattr(self, name)
            if v is None:
                raise ConfigError(f"{name} is required for this model (it defines tensor shapes)")
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            positive(name)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if not isinstance(self.rotary_dim, int) or not (0 < self.rotary_dim <= self.head_dim) or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not isinstance(self.use_gemma_norm, bool):
            raise ConfigError(f"use_gemma_norm must be true or false, got {self.use_gemma_norm!r}")
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings=true is not supported: MiniMax-M3 has an untied lm_head")
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {n}")
        if len(self.mlp_layer_types) != n:
            raise ConfigError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries but num_hidden_layers is {n}")
        for i, t in enumerate(self.layer_types):
            if t not in (FULL_ATTENTION, SLIDING_ATTENTION, SPARSE_ATTENTION):
                raise ConfigError(f"layer_types[{i}] must be {FULL_ATTENTION!r}, {SLIDING_ATTENTION!r} or "
                                  f"{SPARSE_ATTENTION!r}, got {t!r}")
        sliding = [i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION]
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ConfigError(f"sliding_window must be a positive integer or None, got {w!r}")
        if sliding and w is None:
            raise ConfigError(f"layer_types[{sliding[0]}] is {SLIDING_ATTENTION!r} but sliding_window is not set")
        if w is not None and not sliding:
            raise ConfigError(f"sliding_window={w} but no layer is {SLIDING_ATTENTION!r} (the window applies to "
                              f"those layers only)")
        for i, t in enumerate(self.mlp_layer_types):
            if t not in (DENSE_MLP, MOE_MLP):
                raise ConfigError(f"mlp_layer_types[{i}] must be {DENSE_MLP!r} or {MOE_MLP!r}, got {t!r}")
        if len(self.moe_layer_ids) < n:
            positive("dense_intermediate_size")
        if self.moe_layer_ids:
            for name in ("intermediate_size", "num_local_experts", "num_experts_per_tok"):
                positive(name)
            if self.num_experts_per_tok > self.num_local_experts:
                raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                                  f"num_local_experts ({self.num_local_experts})")
            s = self.shared_intermediate_size
            if s is None:
                raise ConfigError("shared_intermediate_size is required for MoE layers (0 for no shared expert)")
            if not isinstance(s, int) or isinstance(s, bool) or s < 0:
                raise ConfigError(f"shared_intermediate_size must be an integer >= 0, got {s!r}")
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
        if self.index_block_size is not None:
            positive("index_block_size")
        if self.expert_quantization not in (None, "mxfp4", "mxfp8"):
            raise ConfigError(f"expert_quantization must be None, 'mxfp4' or 'mxfp8', got {self.expert_quantization!r}")
        if self.expert_quantization is not None and self.moe_layer_ids:
            for name in ("hidden_size", "intermediate_size"):
                if getattr(self, name) % 32:
                    raise ConfigError(f"expert_quantization={self.expert_quantization!r} needs {name} to be a "
                                      f"multiple of 32 (one E8M0 scale per 32 inputs), got {getattr(self, name)}")
        self._validate_quantized_linears()
        if self.swiglu_limit <= 0:
            raise ConfigError(f"swiglu_limit must be > 0, got {self.swiglu_limit}")
        for name in ("bos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                raise ConfigError(f"{name} ({v}) is outside the vocabulary [0, {self.vocab_size})")
        for e in self.eos_token_id:
            if not 0 <= e < self.vocab_size:
                raise ConfigError(f"eos_token_id ({e}) is outside the vocabulary [0, {self.vocab_size})")

    def linear_in_features(self, path: str) -> int | None:
        """The input width of the linear at module path ``path`` (``layers.3.self_attn.o_proj``), None when the
        model has no linear there."""
        m = _LINEAR_PATH.fullmatch(path)
        if m is None:
            return None
        i, where = int(m["layer"]), m["where"]
        if not i < self.num_hidden_layers:
            return None
        if where == "self_attn.o_proj":
            return self.num_attention_heads * self.head_dim
        if where.startswith("self_attn.indexer.") and not self.is_sparse_layer(i):
            return None
        if where.startswith("mlp.shared_experts."):
            if not (self.is_moe_layer(i) and self.shared_intermediate_size):
                return None
            return self.shared_intermediate_size if where.endswith("down_proj") else self.hidden_size
        if where.startswith("mlp."):
            if self.is_moe_layer(i):
                return None
            return self.dense_intermediate_size if where.endswith("down_proj") else self.hidden_size
        return self.hidden_size

    def _validate_quantized_linears(self) -> None:
        fmt, paths = self.linear_quantization, self.quantized_linears
        if fmt not in (None, "mxfp4", "mxfp8"):
            raise ConfigError(f"linear_quantization must be None, 'mxfp4' or 'mxfp8', got {fmt!r}")
        if not isinstance(paths, tuple) or not all(isinstance(p, str) for p in paths):
            raise ConfigError(f"quantized_linears must be a list of module paths, got {paths!r}")
        if bool(paths) != (fmt is not None):
            raise ConfigError(f"quantized_linears ({len(paths)} paths) and linear_quantization={fmt!r} go together: "
                              f"both set or neither")
        for p in paths:
            k = self.linear_in_features(p)
            if k is None:
                raise ConfigError(f"quantized_linears names {p!r}, which is not a linear of this model (expected "
                                  f"layers.N.self_attn.q_proj | k_proj | v_proj | o_proj, layers.N.self_attn.indexer."
                                  f"q_proj | k_proj, layers.N.mlp.gate_up_proj | down_proj, layers.N.mlp."
                                  f"shared_experts.gate_up_proj | down_proj, for layers of that kind)")
            if k % 32:
                raise ConfigError(f"quantized_linears: {p} has {k} inputs, not a multiple of 32 (one E8M0 scale per "
                                  f"32 inputs)")

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_pretrained(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> MiniMaxM3Config:
        """Read a MiniMax-M3 ``config.json`` (a directory, the file, or an already-parsed dict).

        Raises :class:`ConfigError` naming every missing required key, or the first bad value; warns once
        (:class:`ConfigWarning`) about unknown keys and about special token ids outside the vocabulary.
        """
        from minimax_jax.quantization import read_quantization_config

        raw = read_config_json(path_or_dict)
        read_quantization_config(raw)  # refuses a scheme the loader cannot read, naming the key
        return cls(**_normalise(raw))

    def to_dict(self) -> dict[str, Any]:
        """HF-style flat dict; ``from_pretrained(to_dict())`` round-trips. Absent optional sizes are left out."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if self.quantized_linears:
            d["quantized_linears"] = list(self.quantized_linears)
        else:
            d.pop("quantized_linears")
        d["layer_types"] = list(self.layer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["eos_token_id"] = list(self.eos_token_id)
        d["hidden_act"] = "swigluoai"
        d["model_type"] = "minimax_m3_vl_text"
        return d

    def save(self, path: str | os.PathLike) -> None:
        write_config_json(self.to_dict(), path)

    def replace(self, **changes) -> MiniMaxM3Config:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @classmethod
    def m3(cls) -> MiniMaxM3Config:
        """The real MiniMax-M3 text shape (about 428B parameters): 3 dense layers, then MoE + MSA."""
        n = 60
        return cls(
            vocab_size=200064, hidden_size=6144, num_hidden_layers=n, num_attention_heads=64, num_key_value_heads=4,
            head_dim=128, rotary_dim=64, rope_theta=5_000_000.0, rms_norm_eps=1e-6,
            layer_types=tuple([FULL_ATTENTION] * 3 + [SPARSE_ATTENTION] * (n - 3)),
            mlp_layer_types=tuple([DENSE_MLP] * 3 + [MOE_MLP] * (n - 3)),
            dense_intermediate_size=12288, intermediate_size=3072, shared_intermediate_size=3072,
            num_local_experts=128, num_experts_per_tok=4, routed_scaling_factor=2.0,
            index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
            bos_token_id=200034, eos_token_id=(200020,),
        )

    @classmethod
    def tiny(cls, **overrides) -> MiniMaxM3Config:
        """A small MiniMax-M3-shaped config for tests: 2 full + 2 MSA layers, dense and MoE MLPs alternating."""
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
    with open(path, "rb") as f:
        data = f.read()
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file (expected a config.json)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def write_config_json(data: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write ``data`` as ``config.json``: into the directory ``path``, or to the file ``path``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, "w") as f:
        json.dump(dict(data), f, indent=2)


_FIELDS = {f.name for f in dataclasses.fields(MiniMaxM3Config)}

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")

_LEGACY_SPARSE_KEYS = {
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
}
# Other keys of the legacy sparse dict: known; the value each must have for what we implement (None: any).
_LEGACY_SPARSE_SWITCHES = {
    "sparse_attention_freq": None, "use_sparse_attention": None, "sparse_disable_index_value": None,
    "sparse_score_type": "max", "sparse_init_block": 0,
}

# Keys that carry no information for inference (framework bookkeeping and training-only settings).
_BOOKKEEPING = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache", "auto_map",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "attention_dropout", "initializer_range",
    "return_dict", "output_hidden_states", "output_attentions", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "tokenizer_class", "chunk_size_feed_forward", "_name_or_path", "name_or_path",
    "base_config_key", "num_mtp_modules", "keys_to_ignore_at_inference",
}
# Keys the parser reads besides the field names.
_READ = {
    "text_config", "vision_config", "sparse_attention_config", "moe_layer_freq", "num_experts", "rope_parameters",
    "rope_scaling", "partial_rotary_factor", "hidden_act", "quantization_config", "use_sliding_window",
    "max_window_layers",
}
# Feature switches: key -> (the value(s) we implement, what the other values would need).
_SWITCHES = {
    "attention_output_gate": ((False, None), "an attention output gate"),
    "use_qk_norm": ((True, None), "attention without q/k norms"),
    "qk_norm_type": (("per_head", None), "q/k norms other than per head"),
    "scoring_func": (("sigmoid", None), "routers other than sigmoid scoring"),
    "use_routing_bias": ((True, None), "routers without the selection bias"),
    "use_index_cache": ((False, None), "MSA top-k reuse across layers (use_index_cache)"),
    "index_topk_freq": ((1, None), "MSA top-k reuse across layers (index_topk_freq > 1)"),
    "index_topk_pattern": ((None,), "MSA top-k reuse across layers (index_topk_pattern)"),
    "index_skip_topk_offset": ((0, None), "MSA top-k reuse across layers (index_skip_topk_offset)"),
    "attention_bias": ((False, None), "biases in the attention projections"),
    "mlp_bias": ((False, None), "biases in the MLP projections"),
}
_KNOWN = _FIELDS | set(_LEGACY_SPARSE_KEYS) | _BOOKKEEPING | _READ | set(_SWITCHES) | {"n_shared_experts"}

_INT_KEYS = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rotary_dim", "max_position_embeddings", "intermediate_size", "dense_intermediate_size",
    "shared_intermediate_size", "num_local_experts", "num_experts_per_tok", "index_n_heads", "index_head_dim",
    "index_block_size", "index_topk_blocks", "index_local_blocks",
}
_FLOAT_KEYS = {"rope_theta", "rms_norm_eps", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit", "swiglu_beta"}
_BOOL_KEYS = {"use_gemma_norm", "tie_word_embeddings"}


def _warn(message: str) -> None:
    # Point at the caller's line, outside this package.
    warnings.warn(message, ConfigWarning, skip_file_prefixes=(os.path.dirname(os.path.abspath(__file__)),))


def _text_section(raw: dict[str, Any]) -> dict[str, Any]:
    text = raw.get("text_config")
    if text is None:
        return dict(raw)
    if not isinstance(text, Mapping):
        raise ConfigError(f"text_config must be an object, got {type(text).__name__}")
    text = dict(text)
    # A few token ids and the tying flag may sit only at the top level of a VL config.
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "transformers_version"):
        if k not in text and k in raw:
            text[k] = raw[k]
    return text


def _check_switches(text: Mapping[str, Any]) -> None:
    for key, (supported, what) in _SWITCHES.items():
        if key in text and text[key] not in supported:
            raise ConfigError(f"{key}={text[key]!r}: {what} is not implemented")
    shared = text.get("n_shared_experts")
    if shared is not None and _as_int(shared, "n_shared_experts") not in (0, 1):
        raise ConfigError(f"n_shared_experts={shared!r}: one shared expert (or none) is implemented")


def _check_hidden_act(text: Mapping[str, Any]) -> None:
    act = text.get("hidden_act")
    if act is None or act == "swigluoai":
        return
    if act == "silu" and "transformers_version" in text:
        # transformers' MiniMax-M3 config class writes its default 'silu', but its MLPs always run swigluoai (the
        # HF golden logits in tests/fixtures prove it): a config it saved describes a swigluoai model.
        return
    raise ConfigError(f"hidden_act={act!r} is not implemented: MiniMax-M3 uses 'swigluoai'")


def _normalise(raw: dict[str, Any]) -> dict[str, Any]:
    text = _text_section(raw)
    unknown = sorted(k for k in text if k not in _KNOWN)
    _check_switches(text)
    _check_hidden_act(text)

    out: dict[str, Any] = {}
    if "num_experts" in text and "num_local_experts" not in text:
        text["num_local_experts"] = text["num_experts"]

    # sparse attention: legacy dict first, flat keys win if both are present and agree
    sparse_cfg = text.get("sparse_attention_config") or {}
    if not isinstance(sparse_cfg, Mapping):
        raise ConfigError(f"sparse_attention_config must be an object, got {type(sparse_cfg).__name__}")
    for key, value in sparse_cfg.items():
        if key in _LEGACY_SPARSE_KEYS:
            continue
        if key not in _LEGACY_SPARSE_SWITCHES:
            unknown.append(f"sparse_attention_config.{key}")
        elif _LEGACY_SPARSE_SWITCHES[key] is not None and value != _LEGACY_SPARSE_SWITCHES[key]:
            raise ConfigError(f"sparse_attention_config.{key}={value!r} is not implemented "
                              f"(only {_LEGACY_SPARSE_SWITCHES[key]!r})")
    for legacy, flat in _LEGACY_SPARSE_KEYS.items():
        if legacy in sparse_cfg:
            if flat in text and text[flat] != sparse_cfg[legacy]:
                raise ConfigError(f"{flat}={text[flat]!r} disagrees with "
                                  f"sparse_attention_config.{legacy}={sparse_cfg[legacy]!r}")
            out[flat] = sparse_cfg[legacy]

    missing = [k for k in _REQUIRED if text.get(k) is None]
    n_layers = text.get("num_hidden_layers")
    layer_types = text.get("layer_types")
    if layer_types is None and "sparse_attention_freq" in sparse_cfg:
        freq = _as_list(sparse_cfg["sparse_attention_freq"], "sparse_attention_config.sparse_attention_freq",
                        n_layers)
        layer_types = [SPARSE_ATTENTION if f else FULL_ATTENTION for f in freq]
    if layer_types is None:
        missing.append("layer_types (or sparse_attention_config.sparse_attention_freq)")
    else:
        out["layer_types"] = tuple(_as_list(layer_types, "layer_types", None))
        _sliding_window(text, out)

    mlp_types = text.get("mlp_layer_types")
    if mlp_types is None and text.get("moe_layer_freq") is not None:
        mlp_types = [MOE_MLP if f else DENSE_MLP for f in _as_list(text["moe_layer_freq"], "moe_layer_freq", n_layers)]
    if mlp_types is None:
        missing.append("mlp_layer_types (or moe_layer_freq)")
    else:
        out["mlp_layer_types"] = tuple(_as_list(mlp_types, "mlp_layer_types", None))
    if text.get("n_shared_experts") == 0:
        out["shared_intermediate_size"] = 0

    # sizes required by the layer kinds present
    kinds = set(out.get("mlp_layer_types", ())) | set(out.get("layer_types", ()))
    need = []
    if DENSE_MLP in kinds:
        need.append("dense_intermediate_size")
    if MOE_MLP in kinds:
        need += ["intermediate_size", "num_local_experts", "num_experts_per_tok"]
        if "shared_intermediate_size" not in out:
            need.append("shared_intermediate_size")
    if SPARSE_ATTENTION in kinds:
        need += ["index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks"]
    missing += [k for k in need if text.get(k) is None and k not in out]
    if text.get("head_dim") is None and (text.get("hidden_size") is None or text.get("num_attention_heads") is None):
        missing.append("head_dim")
    if missing:
        raise ConfigError("config.json is missing required keys: " + ", ".join(missing))

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
    if head_dim is None:
        head_dim = _as_int(text["hidden_size"], "hidden_size") // _as_int(text["num_attention_heads"],
                                                                          "num_attention_heads")
        out["head_dim"] = head_dim
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor"))
    rotary_dim = text.get("rotary_dim")
    if factor is not None:
        from_factor = int(_as_int(head_dim, "head_dim") * _as_float(factor, "partial_rotary_factor"))
        if rotary_dim is not None and _as_int(rotary_dim, "rotary_dim") != from_factor:
            raise ConfigError(f"rotary_dim={rotary_dim!r} disagrees with partial_rotary_factor={factor!r} "
                              f"(head_dim {head_dim} -> {from_factor})")
        out["rotary_dim"] = from_factor

    # everything else that matches a field name (JSON null = absent)
    for k, v in text.items():
        if (k in _FIELDS and k not in out and k not in ("layer_types", "mlp_layer_types", "sliding_window")
                and v is not None):
            out[k] = v

    for k in list(out):
        v = out[k]
        if k in _INT_KEYS:
            out[k] = _as_int(v, k)
        elif k in _FLOAT_KEYS:
            out[k] = _as_float(v, k)
        elif k in _BOOL_KEYS and not isinstance(v, bool):
            raise ConfigError(f"{k} must be true or false, got {v!r}")
    _special_tokens(out)
    if unknown:
        _warn("config.json keys not used by MiniMax-M3 (ignored; misspelt?): " + ", ".join(unknown))
    return out


def _sliding_window(text: Mapping[str, Any], out: dict[str, Any]) -> None:
    """Read ``sliding_window`` / ``use_sliding_window`` into ``out`` (``sliding_window`` and the layers'
    ``sliding_attention`` types; see the module docstring and docs/CHECKPOINTS.md)."""
    window, use = text.get("sliding_window"), text.get("use_sliding_window")
    if use is not None and not isinstance(use, bool):
        raise ConfigError(f"use_sliding_window must be true or false, got {use!r}")
    if isinstance(window, (list, tuple)):
        raise ConfigError(f"sliding_window={window!r}: a per-layer list is not read; give one window and mark "
                          f"its layers {SLIDING_ATTENTION!r} in layer_types")
    if window is not None and (isinstance(window, bool) or _as_int(window, "sliding_window") < 1):
        raise ConfigError(f"sliding_window must be a positive integer or null, got {window!r}")
    if use is True and window is None:
        raise ConfigError("use_sliding_window is true but sliding_window is not set")
    types = list(out["layer_types"])
    if window is None or use is False:  # no window (transformers drops sliding_window without the switch)
        if SLIDING_ATTENTION in types:
            raise ConfigError(f"layer_types[{types.index(SLIDING_ATTENTION)}] is {SLIDING_ATTENTION!r} but "
                              f"there is no sliding window (sliding_window={window!r}, use_sliding_window={use!r})")
        return
    if text.get("max_window_layers") is not None:
        raise ConfigError(f"max_window_layers={text['max_window_layers']!r} beside sliding_window: which layers it "
                          f"windows is model-specific; mark them {SLIDING_ATTENTION!r} in layer_types instead")
    if SLIDING_ATTENTION not in types:
        # One model-wide window: vLLM's model-level window reaches MiniMax-M3's dense attention layers (its MSA
        # layers take none), so every full_attention layer slides.
        if FULL_ATTENTION not in types:
            raise ConfigError(f"sliding_window={window!r} applies to full_attention layers and this config has "
                              f"none (MSA layers, {SPARSE_ATTENTION!r}, take no window)")
        out["layer_types"] = tuple(SLIDING_ATTENTION if t == FULL_ATTENTION else t for t in types)
    out["sliding_window"] = _as_int(window, "sliding_window")


def _special_tokens(out: dict[str, Any]) -> None:
    """Parse BOS/EOS/PAD; ids outside the vocabulary become absent, with one warning."""
    vocab = out["vocab_size"]
    dropped = []
    if "eos_token_id" in out:
        eos = out["eos_token_id"]
        eos = [eos] if not isinstance(eos, (list, tuple)) else eos
        ids = [_as_int(e, "eos_token_id") for e in eos]
        dropped += [f"eos_token_id {e}" for e in ids if not 0 <= e < vocab]
        out["eos_token_id"] = tuple(e for e in ids if 0 <= e < vocab)
    for k in ("bos_token_id", "pad_token_id"):
        if out.get(k) is not None:
            v = _as_int(out[k], k)
            if 0 <= v < vocab:
                out[k] = v
            else:
                dropped.append(f"{k} {v}")
                out[k] = None
    if dropped:
        _warn(f"special token ids outside the vocabulary [0, {vocab}) are treated as absent: " + ", ".join(dropped))


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
