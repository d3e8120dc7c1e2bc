"""DeepSpec-format DSpark drafter checkpoints: :func:`load_drafter` and :func:`save_drafter` (SPEC section 9).

A drafter directory holds ``config.json`` (see :meth:`DSparkConfig.from_pretrained`) and safetensors (one file or
a sharded ``model.safetensors.index.json``) with these names (torch layout, Linear weights ``[out, in]``):

==========================================  ===================  ==========================================
checkpoint tensor                           shape                NNX parameter
==========================================  ===================  ==========================================
``fc.weight``                               ``[d, m*d]``         ``fc.kernel`` (transposed)
``hidden_norm.weight``, ``norm.weight``     ``[d]``              Gemma RMSNorm weights
``layers.i.*``                              target block names   ``layers[i]`` (HF or original MLP names)
``markov_head.markov_w1.weight``            ``[V, r]``           ``markov_head.markov_w1`` (an embedding)
``markov_head.markov_w2.weight``            ``[V, r]``           ``markov_head.markov_w2.kernel [r, V]``
``markov_head.gate_proj.{weight,bias}``     ``[r, d+r]``, [r]    gated head only
``markov_head.joint_proj.{weight,bias}``    ``[3r, 2r+d]``, [3r] rnn head only
``confidence_head.proj.{weight,bias}``      ``[1, d(+r)]``, [1]  ``confidence_head.proj``
==========================================  ===================  ==========================================

The layer names come from the target's own table (:func:`minimax_jax.checkpoint.weight_plan` of the draft layers'
config, without the ``model.`` prefix), so both the HF (``mlp.gate_up_proj``) and the MiniMax original
(``mlp.gate_proj`` + ``mlp.up_proj``) spellings load. Names are normalised first: a ``model.`` /
``dspark.`` / ``language_model.model.dspark.`` prefix is dropped, ``layers.i.decoder_layer.`` becomes
``layers.i.`` and ``final_norm`` becomes ``norm``. ``embed_tokens.weight`` / ``lm_head.weight`` copies (DeepSpec
keeps frozen copies of the target's) are shape-checked and ignored: the drafter uses the target's.
All problems (missing, unexpected, mis-shaped tensors) are raised together as one :class:`CheckpointError`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.checkpoint import (
    CheckpointError,
    SafetensorsReader,
    Source,
    _concat_t,
    _same,
    _t,
    weight_plan,
)
from minimax_jax.config import ConfigError
from minimax_jax.drafter import DSparkDrafter
from minimax_jax.drafter_config import DSparkConfig
from minimax_jax.model import MiniMaxM3ForCausalLM

SCHEMES = ("minimax", "hf")
_SHARED = {("embed_tokens",): "embed_tokens.weight", ("lm_head",): "lm_head.weight"}
_NAME_REWRITES = (
    (re.compile(r"^(language_model\.)?(model\.)?(dspark|draft_model|drafter)\."), ""),
    (re.compile(r"^model\."), ""),
    (re.compile(r"^(layers\.\d+\.)decoder_layer\."), r"\1"),
    (re.compile(r"^final_norm\."), "norm."),
)
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_QUANTISED = re.compile(r"\.(weight_scale_inv|weight_scale|scales?)$")


def canonical_name(name: str) -> str:
    """Normalise a drafter checkpoint name (prefixes, ``decoder_layer.``, ``final_norm``)."""
    for pat, rep in _NAME_REWRITES:
        name = pat.sub(rep, name)
    return name


def drafter_weight_plan(cfg: DSparkConfig) -> dict[tuple, dict[str, Source]]:
    """For every NNX parameter path of the drafter (shared weights excluded): ``{"hf": Source, "minimax": Source}``."""
    d, v, r = cfg.hidden_size, cfg.vocab_size, cfg.markov_rank
    plan: dict[tuple, dict[str, Source]] = {}

    def both(path, name, shape, combine):
        src = Source((name,), (tuple(shape),), combine)
        plan[path] = {"hf": src, "minimax": src}

    both(("fc", "kernel"), "fc.weight", (d, cfg.feature_size), _t)
    both(("hidden_norm", "weight"), "hidden_norm.weight", (d,), _same)
    for path, alternatives in weight_plan(cfg.layer_config).items():
        if path[0] != "layers":
            continue
        plan[path] = {scheme: Source(tuple(n.removeprefix("model.") for n in src.names), src.shapes, src.combine)
                      for scheme, src in alternatives.items()}
    both(("norm", "weight"), "norm.weight", (d,), _same)
    if r > 0:
        both(("markov_head", "markov_w1"), "markov_head.markov_w1.weight", (v, r), _same)
        both(("markov_head", "markov_w2", "kernel"), "markov_head.markov_w2.weight", (v, r), _t)
        if cfg.markov_head_type == "gated":
            both(("markov_head", "gate_proj", "kernel"), "markov_head.gate_proj.weight", (r, d + r), _t)
            both(("markov_head", "gate_proj", "bias"), "markov_head.gate_proj.bias", (r,), _same)
        elif cfg.markov_head_type == "rnn":
            both(("markov_head", "joint_proj", "kernel"), "markov_head.joint_proj.weight", (3 * r, 2 * r + d), _t)
            both(("markov_head", "joint_proj", "bias"), "markov_head.joint_proj.bias", (3 * r,), _same)
    if cfg.enable_confidence_head:
        both(("confidence_head", "proj", "kernel"), "confidence_head.proj.weight", (1, cfg.confidence_input_dim), _t)
        both(("confidence_head", "proj", "bias"), "confidence_head.proj.bias", (1,), _same)
    return plan


def _rename(user: Mapping[str, str] | Callable[[str], str] | None):
    def f(raw: str) -> str:
        name = raw
        if user is not None:
            name = user(name) if callable(user) else user.get(name, name)
        return canonical_name(name)
    return f


def load_drafter(path: str | os.PathLike, target: MiniMaxM3ForCausalLM, *, dtype=None,
                 config: DSparkConfig | None = None,
                 rename: Mapping[str, str] | Callable[[str], str] | None = None) -> DSparkDrafter:
    """Load a DeepSpec-format DSpark drafter for ``target`` (embeddings and LM head are the target's).

    Args:
      path: directory with ``config.json`` and the safetensors file(s).
      target: the target model; its hidden size, vocabulary and layer count are checked against the drafter.
      dtype: parameter dtype (default: the target's).
      config: overrides the directory's ``config.json``.
      rename: optional extra name table (or function) applied to checkpoint names before matching.
    Raises:
      ConfigError for a malformed or incompatible config; CheckpointError listing every missing, unexpected and
      mis-shaped tensor.
    """
    path = os.fspath(path)
    reader = SafetensorsReader(path, rename=_rename(rename))
    tcfg = target.cfg
    if config is None:
        m = None
        if "fc.weight" in reader.names:
            fc_shape = reader.shape("fc.weight")
            if len(fc_shape) == 2 and fc_shape[0] and fc_shape[1] % fc_shape[0] == 0:
                m = fc_shape[1] // fc_shape[0]
        config = DSparkConfig.from_pretrained(path, num_target_layers=tcfg.num_hidden_layers, num_target_features=m)
    cfg = config
    cfg.check_compatible(tcfg)
    dtype = target.dtype if dtype is None else dtype

    plan = drafter_weight_plan(cfg)
    names = list(reader.names)
    minimax = sum(".mlp.gate_proj." in n for n in names)
    hf = sum(".mlp.gate_up_proj." in n for n in names)
    scheme = "hf" if hf > minimax else "minimax"

    missing, misshaped, chosen = [], [], {}
    used: set[str] = set()
    for path_key, alternatives in plan.items():
        order = [scheme] + [s for s in alternatives if s != scheme]
        src = next((alternatives[s] for s in order if all(n in reader.names for n in alternatives[s].names)), None)
        if src is None:
            missing.extend(n for n in alternatives[scheme].names if n not in reader.names)
            continue
        for n, shape in zip(src.names, src.shapes):
            used.add(n)
            if reader.shape(n) != shape:
                misshaped.append(f"{reader.names[n]}: expected shape {shape}, found {reader.shape(n)}")
        chosen[path_key] = src
    shared_shape = (cfg.vocab_size, cfg.hidden_size)
    for n in _SHARED.values():
        if n in reader.names:
            used.add(n)
            if reader.shape(n) != shared_shape:
                misshaped.append(f"{reader.names[n]}: expected shape {shared_shape} (shared with the target), "
                                 f"found {reader.shape(n)}")
    unexpected = sorted(reader.names[n] for n in reader.names if n not in used and not _IGNORED.search(n))
    if missing or unexpected or misshaped:
        parts = [(f"drafter checkpoint at {path} does not match its config ({cfg.num_draft_layers} draft layers, "
                 f"markov_rank {cfg.markov_rank} {cfg.markov_head_type or ''}, confidence head "
                 f"{'on' if cfg.enable_confidence_head else 'off'}):")]
        if missing:
            parts.append(f"  missing ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            parts.append(f"  unexpected ({len(unexpected)}): " + ", ".join(unexpected))
            if any(_QUANTISED.search(n) for n in unexpected):
                parts.append("  (quantised drafter weights are not supported: dequantise to bf16/fp32 first)")
        if misshaped:
            parts.append(f"  mis-shaped ({len(misshaped)}): " + "; ".join(misshaped))
        raise CheckpointError("\n".join(parts))

    abstract = nnx.eval_shape(lambda: DSparkDrafter(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    if set(chosen) | set(_SHARED) != set(flat):
        raise CheckpointError(f"internal: drafter weight plan does not cover {sorted(set(flat) - set(chosen))}")
    flat[("embed_tokens",)] = flat[("embed_tokens",)].replace(target.embed_tokens[...])
    flat[("lm_head",)] = flat[("lm_head",)].replace(target.lm_head[...])
    for path_key, src in chosen.items():
        var = flat[path_key]
        want = var.get_value()
        arr = np.asarray(src.combine([reader.read(n) for n in src.names]))
        if arr.shape != want.shape:
            raise CheckpointError(f"internal: {'.'.join(map(str, path_key))} built with shape {arr.shape}, the "
                                  f"drafter expects {want.shape}")
        flat[path_key] = var.replace(jnp.asarray(arr, dtype=want.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _to_checkpoint(src: Source, arr: np.ndarray) -> list[np.ndarray]:
    """Inverse of ``src.combine``: one JAX-layout array -> the checkpoint tensors of ``src.names``."""
    if src.combine is _same:
        parts = [arr]
    elif src.combine is _t:
        parts = [arr.T]
    elif src.combine is _concat_t:
        cuts = np.cumsum([s[0] for s in src.shapes])[:-1]
        parts = np.split(arr.T, cuts, axis=0)
    else:
        raise CheckpointError(f"internal: no inverse for the transform of {src.names}")
    return [np.ascontiguousarray(p) for p in parts]


def drafter_tensors(drafter: DSparkDrafter, *, scheme: str = "minimax", dtype=None) -> dict[str, np.ndarray]:
    """The drafter's own weights as DeepSpec-named numpy arrays (shared embeddings / LM head excluded)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    flat = dict(nnx.to_flat_state(nnx.state(drafter, nnx.Param)))
    plan = drafter_weight_plan(drafter.cfg)
    if set(plan) != set(flat):
        raise CheckpointError(f"internal: weight plan and drafter differ: {sorted(set(plan) ^ set(flat))}")
    out = {}
    for path_key, alternatives in plan.items():
        src = alternatives[scheme]
        arr = flat[path_key].get_value()
        if dtype is not None:
            arr = arr.astype(dtype)
        for name, part, shape in zip(src.names, _to_checkpoint(src, np.asarray(arr)), src.shapes):
            if part.shape != shape:
                raise CheckpointError(f"internal: {name} has shape {part.shape}, expected {shape}")
            out[name] = part
    return out


def save_drafter(drafter: DSparkDrafter, path: str | os.PathLike, *, scheme: str = "minimax", dtype=None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (DeepSpec names; ``scheme`` picks the MLP spelling:
    "minimax" = ``mlp.gate_proj`` / ``mlp.up_proj``, "hf" = ``mlp.gate_up_proj``). :func:`load_drafter`
    reads it back exactly (``dtype`` casts on the way out, e.g. ``jnp.bfloat16``)."""
    from safetensors.numpy import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = drafter_tensors(drafter, scheme=scheme, dtype=dtype)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    drafter.cfg.save(os.path.join(path, "config.json"))


__all__ = ["CheckpointError", "ConfigError", "canonical_name", "drafter_tensors", "drafter_weight_plan",
           "load_drafter", "save_drafter"]
