"""DeepSpec-format DSpark drafter checkpoints: :func:`load_drafter`, :func:`save_drafter` (docs/DRAFTER.md).

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
Matching is :func:`minimax_jax.safetensors_io.load_weights`, the routine the target's loader uses: all problems
(missing, unexpected, mis-shaped, wrongly typed tensors) are raised together as one :class:`CheckpointError`.
"""

from __future__ import annotations

import os
import re
import warnings

import numpy as np
from flax import nnx

from minimax_jax.checkpoint import text_model_name, weight_plan
from minimax_jax.config import ConfigError
from minimax_jax.drafter import DSparkDrafter
from minimax_jax.drafter_config import DSparkConfig, drafter_config_from_pretrained
from minimax_jax.model import MiniMaxM3ForCausalLM
from minimax_jax.safetensors_io import (
    CheckpointError,
    Rename,
    SafetensorsReader,
    Source,
    checkpoint_directory,
    compose_rename,
    identity,
    load_weights,
    to_checkpoint_tensors,
    transpose,
)

SCHEMES = ("minimax", "hf")
_SHARED_COPIES = ("embed_tokens.weight", "lm_head.weight")  # DeepSpec keeps frozen copies of the target's
_NAME_REWRITES = (
    (re.compile(r"^(language_model\.)?(model\.)?(dspark|draft_model|drafter)\."), ""),
    (re.compile(r"^model\."), ""),
    (re.compile(r"^(layers\.\d+\.)decoder_layer\."), r"\1"),
    (re.compile(r"^final_norm\."), "norm."),
    # other DFlash spellings vLLM's DFlashQwen3Model maps
    (re.compile(r"^midlayer\."), "layers.0."),
    (re.compile(r"^encoder\.fc\."), "fc."),
    (re.compile(r"^encoder\.output_norm_enc\."), "hidden_norm."),
    # ModelOpt's DSpark export keeps its module's flat head names (vLLM nests them)
    (re.compile(r"^(markov_w1|markov_w2|gate_proj|joint_proj)\."), r"markov_head.\1."),
    (re.compile(r"^confidence_proj\."), "confidence_head.proj."),
)
# not weights of the drafter: RoPE buffers, vLLM's unused mask-embedding placeholder (DSpark masks through the
# vocabulary row), the training-only target-to-draft vocabulary map
_IGNORED = re.compile(r"rotary_emb\.inv_freq$|^mask_embedding$|^t2d$")


def canonical_name(name: str) -> str:
    """Normalise a drafter checkpoint name (prefixes, ``decoder_layer.``, ``final_norm``), then as the target's
    loader does (:func:`minimax_jax.checkpoint.text_model_name`)."""
    for pat, rep in _NAME_REWRITES:
        name = pat.sub(rep, name)
    return text_model_name(name)


def drafter_weight_plan(cfg: DSparkConfig) -> dict[tuple, dict[str, Source]]:
    """For every NNX parameter path of the drafter (shared weights excluded): ``{"hf": Source, "minimax": Source}``."""
    d, v, r = cfg.hidden_size, cfg.vocab_size, cfg.markov_rank
    plan: dict[tuple, dict[str, Source]] = {}

    def both(path, name, shape, combine):
        src = Source((name,), (tuple(shape),), combine)
        plan[path] = {"hf": src, "minimax": src}

    both(("fc", "kernel"), "fc.weight", (d, cfg.feature_size), transpose)
    both(("hidden_norm", "weight"), "hidden_norm.weight", (d,), identity)
    for path, alternatives in weight_plan(cfg.layer_config).items():
        if path[0] != "layers":
            continue
        plan[path] = {scheme: Source(tuple(n.removeprefix("model.") for n in src.names), src.shapes, src.combine)
                      for scheme, src in alternatives.items()}
    both(("norm", "weight"), "norm.weight", (d,), identity)
    if r > 0:
        both(("markov_head", "markov_w1"), "markov_head.markov_w1.weight", (v, r), identity)
        both(("markov_head", "markov_w2", "kernel"), "markov_head.markov_w2.weight", (v, r), transpose)
        if cfg.markov_head_type == "gated":
            both(("markov_head", "gate_proj", "kernel"), "markov_head.gate_proj.weight", (r, d + r), transpose)
            both(("markov_head", "gate_proj", "bias"), "markov_head.gate_proj.bias", (r,), identity)
        elif cfg.markov_head_type == "rnn":
            both(("markov_head", "joint_proj", "kernel"), "markov_head.joint_proj.weight", (3 * r, 2 * r + d),
                 transpose)
            both(("markov_head", "joint_proj", "bias"), "markov_head.joint_proj.bias", (3 * r,), identity)
    if cfg.enable_confidence_head:
        both(("confidence_head", "proj", "kernel"), "confidence_head.proj.weight", (1, cfg.confidence_input_dim),
             transpose)
        both(("confidence_head", "proj", "bias"), "confidence_head.proj.bias", (1,), identity)
    return plan


def load_drafter(path: str | os.PathLike, target: MiniMaxM3ForCausalLM, *, dtype=None,
                 config: DSparkConfig | None = None, rename: Rename = None, mesh=None) -> DSparkDrafter:
    """Load a DSpark drafter for ``target`` (embeddings and LM head are the target's): DeepSpec's MiniMax-block
    format, or the Qwen3-style ``Qwen3DSparkModel`` (``nvidia/MiniMax-M3-DSpark``), picked by the config's
    ``architectures`` (:func:`minimax_jax.drafter_config.drafter_config_from_pretrained`).

    Args:
      path: directory with ``config.json`` and the safetensors file(s) (a single ``.safetensors`` file is
        accepted when ``config`` is given).
      target: the target model; its hidden size, vocabulary and layer count are checked against the drafter.
      dtype: parameter dtype (default: the target's).
      config: overrides the directory's ``config.json``.
      rename: optional extra name table (or function) applied to checkpoint names before matching.
      mesh: place the drafter on this ``jax.sharding.Mesh`` while loading, as ``load_model(..., mesh=)`` does the
        target (docs/PARALLELISM.md): each device reads only its slices; the draft layers' KV heads are replicated
        past their count. Load the target onto the same mesh: the embeddings and LM head are the target's.
    Raises:
      FileNotFoundError / NotADirectoryError for a path that does not exist or is a file (without ``config``);
      ConfigError for a malformed or incompatible config; CheckpointError listing every missing, unexpected,
      mis-shaped and wrongly typed tensor, or naming a safetensors file that cannot be read. A checkpoint whose
      config declares a confidence head but that holds none of its tensors loads without the head (a warning).
    """
    if config is None:
        path = checkpoint_directory(path, kind="drafter")
    reader = SafetensorsReader(path, rename=compose_rename(rename, canonical_name))
    tcfg = target.cfg
    if config is None:
        m = None
        if "fc.weight" in reader.names:
            fc_shape = reader.shape("fc.weight")
            if len(fc_shape) == 2 and fc_shape[0] and fc_shape[1] % fc_shape[0] == 0:
                m = fc_shape[1] // fc_shape[0]
        with_markov = None  # a Qwen3DSpark config may leave it to the confidence head's width: [1, d] or [1, d + r]
        if "confidence_head.proj.weight" in reader.names:
            width = reader.shape("confidence_head.proj.weight")[-1]
            with_markov = {tcfg.hidden_size: False}.get(width, True if width > tcfg.hidden_size else None)
        config = drafter_config_from_pretrained(path, num_target_layers=tcfg.num_hidden_layers,
                                                num_target_features=m, confidence_head_with_markov=with_markov)
    cfg = config
    cfg.check_compatible(tcfg)
    dtype = target.dtype if dtype is None else dtype
    head = ("confidence_head.proj.weight", "confidence_head.proj.bias")
    if cfg.enable_confidence_head and not any(n in reader.names for n in head):
        # DeepSpec configs may declare the head while a checkpoint was saved without it: load the drafter without
        # a confidence head (an engine then runs adaptive verification on its online acceptance estimator).
        warnings.warn(f"drafter checkpoint at {path} declares enable_confidence_head but has no confidence_head "
                      f"tensors: loaded without a confidence head", stacklevel=2)
        cfg = cfg.replace(enable_confidence_head=False, confidence_head_with_markov=False, sts_temperatures=None)

    placement, model_cfg = None, cfg
    if mesh is not None:
        from minimax_jax import sharding

        placement = sharding.loader_placement(
            mesh, cfg.layer_config, nnx.eval_shape(lambda: DSparkDrafter(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
        model_cfg = cfg.replace(layer_config=sharding.stored_config(cfg.layer_config, mesh.shape[sharding.TENSOR]))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DSparkDrafter(model_cfg, dtype=dtype, rngs=nnx.Rngs(0))))
    shared_shape = (cfg.vocab_size, cfg.hidden_size)
    state = load_weights(
        drafter_weight_plan(cfg), reader, state, kind="drafter",
        against=(f"its config ({cfg.num_draft_layers} draft layers, markov_rank {cfg.markov_rank} "
                 f"{cfg.markov_head_type or ''}, confidence head {'on' if cfg.enable_confidence_head else 'off'})"),
        prefer="minimax", ignore=_IGNORED,
        copies={name: (shared_shape, "shared with the target") for name in _SHARED_COPIES},
        preset={("embed_tokens",): target.embed_tokens[...], ("lm_head",): target.lm_head[...]},
        placement=placement)
    return nnx.merge(graphdef, state)


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
        for name, part, shape in zip(src.names, to_checkpoint_tensors(src, np.asarray(arr)), src.shapes):
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
