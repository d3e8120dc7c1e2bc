"""Checkpoints of the target: the MiniMax-M3 safetensors name-mapping table, and orbax save/restore of NNX state.

``load_model`` accepts both naming schemes of MiniMax-M3 (docs/ARCHITECTURE.md):

* the MiniMax original names (``block_sparse_moe.experts.E.w1|w3|w2``, ``self_attn.index_q_proj`` ...), also
  under the ``language_model.`` prefix of the vision-language release;
* the HF transformers names (``mlp.experts.gate_up_proj [E, 2I, d]``, ``self_attn.indexer.q_proj`` ...), also
  as ``model.language_model.*`` (the HF VL model).

Every model parameter has an entry in :func:`weight_plan`: the checkpoint tensors it is built from, in each
naming scheme, with their expected shapes and the transform into JAX layout.
:func:`minimax_jax.safetensors_io.load_weights` (shared with the drafter's loader) reads the tensors one at a time
and raises one :class:`CheckpointError` listing every missing, unexpected, mis-shaped and wrongly typed tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.config import ConfigError, MiniMaxM3Config, read_config_json
from minimax_jax.model import MiniMaxM3ForCausalLM, abstract_model
from minimax_jax.safetensors_io import (
    CheckpointError,
    Rename,
    SafetensorsReader,
    Source,
    checkpoint_directory,
    compose_rename,
    concat_transpose,
    experts_transpose,
    identity,
    load_weights,
    rows_of_parts,
    transpose,
)

# Prefix rewrites applied to every checkpoint name before matching (VL releases nest the text model).
_PREFIX_REWRITES = (
    (re.compile(r"^language_model\.model\."), "model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^model\.language_model\."), "model."),
    (re.compile(r"^language_model\."), ""),
)
# Tensors of a VL or MTP release that the text model does not use.
_IGNORED = re.compile(
    r"^(vision_tower|multi_modal_projector|patch_merge_mlp|model\.vision_tower|model\.multi_modal_projector|"
    r"mtp|model\.mtp)\.|(^|\.)mtp\.|rotary_emb\.inv_freq$")


def text_model_name(name: str) -> str:
    """A checkpoint name as the text model's table spells it: the VL release prefixes rewritten (first match)."""
    for pat, rep in _PREFIX_REWRITES:
        name, n = pat.subn(rep, name)
        if n:
            break
    return name


def _stack_gate_up(num_experts):
    def f(xs):  # [w1_0, w3_0, w1_1, w3_1, ...], each [I, d] -> [E, d, 2I]
        return np.stack([np.concatenate([xs[2 * e], xs[2 * e + 1]], axis=0).T for e in range(num_experts)])

    def block(src, read_slice, spans):  # experts [e0, e1) only, each its rows of w1 / w3
        (e0, e1), (d0, d1), (c0, c1) = spans
        inter = src.shapes[0][0]
        out = []
        for e in range(e0, e1):
            parts = [read_slice(src.names[2 * e + i], (slice(a, b), slice(d0, d1)))
                     for i, a, b in rows_of_parts([inter, inter], c0, c1)]
            out.append(np.concatenate(parts, axis=0).T)
        return np.stack(out)

    f.block = block
    return f


def _stack_down(xs):  # [w2_e [d, I]] -> [E, I, d]
    return np.stack([x.T for x in xs])


def _stack_down_block(src, read_slice, spans):
    (e0, e1), (i0, i1), (d0, d1) = spans
    return np.stack([read_slice(src.names[e], (slice(d0, d1), slice(i0, i1))).T for e in range(e0, e1)])


_stack_down.block = _stack_down_block


def _stack_experts(num_experts: int, parts: int):
    """``[a_0, b_0, a_1, b_1, ...]`` (``parts`` tensors per expert, each ``[rows_i, cols]``, shipped ``[N, K]``) ->
    ``[E, sum rows_i, cols]``: each expert's tensors concatenated along the rows, no transpose (the quantized
    experts keep the checkpoint's layout, packed columns and scale columns alike)."""
    def f(xs):
        return np.stack([np.concatenate(xs[parts * e:parts * (e + 1)], axis=0) for e in range(num_experts)])

    def block(src, read_slice, spans):
        (e0, e1), (r0, r1), (c0, c1) = spans
        sizes = [s[0] for s in src.shapes[:parts]]
        return np.stack([np.concatenate([read_slice(src.names[parts * e + i], (slice(a, b), slice(c0, c1)))
                                         for i, a, b in rows_of_parts(sizes, r0, r1)], axis=0)
                         for e in range(e0, e1)])

    f.block = block
    return f


def _quantized_experts(cfg: MiniMaxM3Config, p: str, fmt: str, scale_name: str) -> dict[str, dict[str, Source]]:
    """The keep-mode MoE parameters of the layer at prefix ``p`` (MiniMax names; docs/CHECKPOINTS.md):
    ``w_gate_up_q [E, 2I, d/2 | d]`` (rows ``[0, I)`` the gate w1, ``[I, 2I)`` the up w3), ``w_gate_up_scale
    [E, 2I, d/32]``, ``w_down_q [E, d, I/2 | I]``, ``w_down_scale [E, d, I/32]``, as shipped."""
    e, d, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    pack = 2 if fmt == "mxfp4" else 1
    blk = 32

    def src(tensor, which, rows, cols):
        names = tuple(f"{p}block_sparse_moe.experts.{j}.{w}.{tensor}" for j in range(e) for w in which)
        return {"minimax": Source(names, tuple((rows, cols) for _ in names), _stack_experts(e, len(which)))}

    return {
        "w_gate_up_q": src("weight", ("w1", "w3"), inter, d // pack),
        "w_gate_up_scale": src(scale_name, ("w1", "w3"), inter, d // blk),
        "w_down_q": src("weight", ("w2",), d, inter // pack),
        "w_down_scale": src(scale_name, ("w2",), d, inter // blk),
    }


def _dense_experts(plan, M, p, e, inter, d):
    """The routed experts in JAX layout (``experts_gate_up [E, d, 2I]``, ``experts_down [E, I, d]``)."""
    plan[M + ("experts_gate_up",)] = {
        "hf": Source((p + "mlp.experts.gate_up_proj",), ((e, 2 * inter, d),), experts_transpose),
        "minimax": Source(
            tuple(f"{p}block_sparse_moe.experts.{j}.{w}.weight" for j in range(e) for w in ("w1", "w3")),
            tuple((inter, d) for _ in range(2 * e)), _stack_gate_up(e)),
    }
    plan[M + ("experts_down",)] = {
        "hf": Source((p + "mlp.experts.down_proj",), ((e, d, inter),), experts_transpose),
        "minimax": Source(tuple(f"{p}block_sparse_moe.experts.{j}.w2.weight" for j in range(e)),
                          tuple((d, inter) for _ in range(e)), _stack_down),
    }


def weight_plan(cfg: MiniMaxM3Config, *, scale_name: str | None = None) -> dict[tuple, dict[str, Source]]:
    """For every parameter path of the NNX model: ``{"hf": Source, "minimax": Source}``.

    The two schemes share a name wherever the checkpoints do. When ``cfg.expert_quantization`` is ``"mxfp4"`` or
    ``"mxfp8"`` (the routed experts kept quantized), the MoE layers' routed experts are the four shipped tensors
    of :func:`_quantized_experts` (MiniMax names). Every linear ``cfg.quantized_linears`` names reads its shipped
    tensors as ``w_q`` and ``w_scale`` (:func:`_quantized_linear`). ``scale_name``: the scale tensor's name, by
    default the one of the format's release, :data:`minimax_jax.quantization.SCALE_SUFFIX`.
    """
    from minimax_jax.quantization import SCALE_SUFFIX

    expert_fmt = cfg.expert_quantization
    if expert_fmt is not None and scale_name is None:
        scale_name = SCALE_SUFFIX[expert_fmt]
    d, v = cfg.hidden_size, cfg.vocab_size
    h, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    plan: dict[tuple, dict[str, Source]] = {}

    def both(path, names, shapes, combine):
        src = Source(tuple(names), tuple(tuple(s) for s in shapes), combine)
        plan[path] = {"hf": src, "minimax": src}

    def linear(path, name, out_f, in_f):
        both(path, [name], [(out_f, in_f)], transpose)

    both(("embed_tokens",), ["model.embed_tokens.weight"], [(v, d)], identity)
    linear(("lm_head",), "lm_head.weight", v, d)
    both(("norm", "weight"), ["model.norm.weight"], [(d,)], identity)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        L = ("layers", i)
        both(L + ("input_layernorm", "weight"), [p + "input_layernorm.weight"], [(d,)], identity)
        both(L + ("post_attention_layernorm", "weight"), [p + "post_attention_layernorm.weight"], [(d,)], identity)
        A = L + ("self_attn",)
        linear(A + ("q_proj", "kernel"), p + "self_attn.q_proj.weight", h * hd, d)
        linear(A + ("k_proj", "kernel"), p + "self_attn.k_proj.weight", hkv * hd, d)
        linear(A + ("v_proj", "kernel"), p + "self_attn.v_proj.weight", hkv * hd, d)
        linear(A + ("o_proj", "kernel"), p + "self_attn.o_proj.weight", d, h * hd)
        both(A + ("q_norm", "weight"), [p + "self_attn.q_norm.weight"], [(hd,)], identity)
        both(A + ("k_norm", "weight"), [p + "self_attn.k_norm.weight"], [(hd,)], identity)
        if cfg.is_sparse_layer(i):
            hi, di = cfg.index_n_heads, cfg.index_head_dim
            for part, out_f in (("q", hi * di), ("k", di)):
                plan[A + ("indexer", f"{part}_proj", "kernel")] = {
                    "hf": Source((p + f"self_attn.indexer.{part}_proj.weight",), ((out_f, d),), transpose),
                    "minimax": Source((p + f"self_attn.index_{part}_proj.weight",), ((out_f, d),), transpose),
                }
                plan[A + ("indexer", f"{part}_norm", "weight")] = {
                    "hf": Source((p + f"self_attn.indexer.{part}_norm.weight",), ((di,),), identity),
                    "minimax": Source((p + f"self_attn.index_{part}_norm.weight",), ((di,),), identity),
                }
        M = L + ("mlp",)
        if cfg.is_moe_layer(i):
            e, inter = cfg.num_local_experts, cfg.intermediate_size
            plan[M + ("gate", "kernel")] = {
                "hf": Source((p + "mlp.gate.weight",), ((e, d),), transpose),
                "minimax": Source((p + "block_sparse_moe.gate.weight",), ((e, d),), transpose),
            }
            plan[M + ("gate", "e_score_correction_bias")] = {
                "hf": Source((p + "mlp.gate.e_score_correction_bias",), ((e,),), identity),
                "minimax": Source((p + "block_sparse_moe.e_score_correction_bias",), ((e,),), identity),
            }
            if expert_fmt is not None:
                for name, alts in _quantized_experts(cfg, p, expert_fmt, scale_name).items():
                    plan[M + (name,)] = alts
            else:
                _dense_experts(plan, M, p, e, inter, d)
            if cfg.shared_intermediate_size > 0:
                si = cfg.shared_intermediate_size
                S = M + ("shared_experts",)
                plan[S + ("gate_up_proj", "kernel")] = {
                    "hf": Source((p + "mlp.shared_experts.gate_up_proj.weight",), ((2 * si, d),), transpose),
                    "minimax": Source((p + "block_sparse_moe.shared_experts.gate_proj.weight",
                                       p + "block_sparse_moe.shared_experts.up_proj.weight"),
                                      ((si, d), (si, d)), concat_transpose),
                }
                plan[S + ("down_proj", "kernel")] = {
                    "hf": Source((p + "mlp.shared_experts.down_proj.weight",), ((d, si),), transpose),
                    "minimax": Source((p + "block_sparse_moe.shared_experts.down_proj.weight",), ((d, si),), transpose),
                }
        else:
            di = cfg.dense_intermediate_size
            plan[M + ("gate_up_proj", "kernel")] = {
                "hf": Source((p + "mlp.gate_up_proj.weight",), ((2 * di, d),), transpose),
                "minimax": Source((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), ((di, d), (di, d)),
                                  concat_transpose),
            }
            linear(M + ("down_proj", "kernel"), p + "mlp.down_proj.weight", d, di)
    if cfg.quantized_linears:
        fmt = cfg.linear_quantization
        for module in cfg.quantized_linears:
            path = tuple(int(x) if x.isdigit() else x for x in module.split(".")) + ("kernel",)
            if path not in plan:
                raise CheckpointError(f"internal: quantized_linears names {module}, which the weight plan lacks")
            q, sc = _quantized_linear(plan.pop(path), fmt, scale_name or SCALE_SUFFIX[fmt])
            plan[path[:-1] + ("w_q",)], plan[path[:-1] + ("w_scale",)] = q, sc
    return plan


def _quantized_linear(alternatives: dict[str, Source], fmt: str, scale_name: str):
    """The ``w_q`` and ``w_scale`` sources of a linear kept quantized, from its dense ``kernel`` sources: the same
    tensors (``[gate; up]`` parts concatenated along the rows), as shipped in the ``[out, in]`` layout, and the
    scales beside them (``<module>.<scale_name>``)."""
    from minimax_jax.safetensors_io import concat_rows

    pack = 2 if fmt == "mxfp4" else 1
    q, sc = {}, {}
    for scheme, src in alternatives.items():
        if src.combine not in (transpose, concat_transpose):
            raise CheckpointError(f"internal: {src.names} is not a linear's kernel")
        combine = identity if len(src.names) == 1 else concat_rows
        scales = tuple(n[: -len("weight")] + scale_name for n in src.names)
        q[scheme] = Source(src.names, tuple((n, k // pack) for n, k in src.shapes), combine)
        sc[scheme] = Source(scales, tuple((n, k // 32) for n, k in src.shapes), combine)
    return q, sc


# ----------------------------------------------------------------------------------------------- loading
QUANTIZATION_MODES = ("keep", "dequantize")


def load_model(path: str | os.PathLike, *, dtype=jnp.bfloat16, config: MiniMaxM3Config | None = None,
               rename: Rename = None, mesh=None, quantization: str = "keep") -> MiniMaxM3ForCausalLM:
    """Load a MiniMax-M3 safetensors checkpoint (single file or sharded) into a :class:`MiniMaxM3ForCausalLM`.

    Args:
      path: a directory with ``config.json`` and the safetensors file(s) (a single ``.safetensors`` file is
        accepted when ``config`` is given). The VL releases load as they ship: the text model's config under
        ``text_config``, tensors under ``language_model.``; vision, projector and ``mtp.*`` tensors are skipped
        (one line on stderr says how many).
      dtype: parameter dtype (the router's correction bias stays fp32).
      config: overrides the directory's ``config.json`` (its ``quantization_config`` is still read from the
        directory when there is one).
      rename: optional extra name table (or function) applied to checkpoint names before matching.
      mesh: a ``jax.sharding.Mesh`` with a ``"tensor"`` axis: the parameters are placed by
        :func:`minimax_jax.sharding.param_layout` while loading (KV and index heads replicated past their count,
        the model's config says so), each device reading only the checkpoint slices of its own blocks
        (docs/PARALLELISM.md); quantized weights are decoded per slice.
      quantization: for a quantized checkpoint (``quantization_config``: ``mxfp8``, or ``quark`` with MXFP4
        weights; docs/CHECKPOINTS.md). ``"dequantize"``: every quantized weight is decoded to ``dtype`` on load.
        ``"keep"``: the routed experts stay as shipped (packed elements and E8M0 scales, the MoE's
        ``w_gate_up_q`` / ``w_gate_up_scale`` / ``w_down_q`` / ``w_down_scale``), and so does every other
        quantized linear (attention and index projections, dense MLPs, shared expert: a
        :class:`~minimax_jax.layers.QuantizedLinear`'s ``w_q`` / ``w_scale``; ``model.cfg.quantized_linears``
        lists them). Either reads an unquantized checkpoint as it is. With ``mesh=``, a row-parallel quantized
        linear whose per-device inputs would cut a 32-input scale block is refused (ValueError naming it).
    Raises:
      FileNotFoundError / NotADirectoryError for a path that does not exist or is a file (without ``config``);
      ConfigError for a ``quantization_config`` that is not supported (naming the key);
      CheckpointError listing every missing, unexpected, mis-shaped and wrongly typed tensor, every quantized
      tensor that does not fit its scales or the config, or naming a safetensors file that cannot be read or a
      shard that disagrees with the index.
    """
    from minimax_jax.quantization import DequantizingReader, read_quantization_config

    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {quantization!r}")
    if config is None:
        path = checkpoint_directory(path, kind="model")
    raw_config = _config_json_beside(path, required=config is None)
    cfg = config if config is not None else MiniMaxM3Config.from_pretrained(raw_config or path)
    scheme = read_quantization_config(raw_config) if raw_config is not None else None
    reader = SafetensorsReader(path, rename=compose_rename(rename, text_model_name))
    dense_plan = weight_plan(cfg)  # what the quantized tensors decode to: dense shapes, the linears
    plan = dense_plan
    if scheme is not None:
        checked = dict(linear_names=_linear_names(dense_plan), expected_shapes=_expected_shapes(dense_plan))
        if quantization == "keep":
            quantized = set(DequantizingReader(reader, scheme, **checked).dequantized)  # headers only
            cfg = _keep_config(cfg, scheme, dense_plan, quantized)
            plan = weight_plan(cfg, scale_name=scheme.scale_suffix)
        kept = {n for k, alts in plan.items() if k[-1] in _KEPT for src in alts.values() for n in src.names}
        reader = DequantizingReader(reader, scheme, **checked, keep=kept.__contains__, dtype=dtype)
    _say_skipped(reader)
    placement, model_cfg = None, cfg
    if mesh is not None:  # the checkpoint is cfg's; the model stores its heads for the mesh
        from minimax_jax import sharding

        placement = sharding.loader_placement(mesh, cfg, abstract_model(cfg, dtype=dtype))
        model_cfg = sharding.stored_config(cfg, mesh.shape[sharding.TENSOR])

    graphdef, state = nnx.split(abstract_model(model_cfg, dtype=dtype))
    state = load_weights(plan, reader, state, kind="model", against=f"the {cfg.num_hidden_layers}-layer config",
                         prefer="hf", ignore=_IGNORED, placement=placement)
    return nnx.merge(graphdef, state)


# Parameters read as shipped in keep mode: the routed experts' (layers.MoE) and the quantized linears'.
_KEPT = ("w_gate_up_q", "w_gate_up_scale", "w_down_q", "w_down_scale", "w_q", "w_scale")


def _keep_config(cfg: MiniMaxM3Config, scheme, dense_plan, quantized: set[str]) -> MiniMaxM3Config:
    """``cfg`` for a keep-mode load: the routed experts in the checkpoint's format (when there are MoE layers),
    and every linear whose shipped tensors are all quantized (``quantized``: their names) in ``quantized_linears``.
    The router, the embedding and ``lm_head`` are not :class:`~minimax_jax.layers.Linear` modules: they are
    decoded when a checkpoint quantizes them."""
    linears = []
    for path, alts in dense_plan.items():
        module = ".".join(map(str, path[:-1]))
        if path[-1] == "kernel" and cfg.linear_in_features(module) is not None and any(
                all(n in quantized for n in src.names) for src in alts.values()):
            linears.append(module)
    fmt = scheme.weight_format
    return dataclasses.replace(cfg, expert_quantization=fmt if cfg.moe_layer_ids else None,
                               linear_quantization=fmt if linears else None, quantized_linears=tuple(linears))


def _config_json_beside(path, *, required: bool) -> dict | None:
    """The parsed ``config.json`` of a checkpoint directory (or of a single file's directory), None if absent (or,
    when the caller gave its own config, unreadable: then only its quantization_config would have been read)."""
    path = os.fspath(path)
    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    file = os.path.join(directory, "config.json")
    if not os.path.isfile(file):
        return None
    try:
        return read_config_json(file)
    except ConfigError:
        if required:
            raise
        return None


def _linear_names(plan) -> set[str]:
    """Checkpoint names a linear parameter is built from (the weight plan's non-identity sources): the tensors a
    ``quantization_config`` may quantize. Norms, embeddings and the router's bias are not linears."""
    return {n for alts in plan.values() for src in alts.values() if src.combine is not identity
            for n in src.names}


def _expected_shapes(plan) -> dict[str, tuple[int, ...]]:
    return {n: shape for alts in plan.values() for src in alts.values() for n, shape in zip(src.names, src.shapes)}


def _say_skipped(reader) -> None:
    """One line on stderr for the tensors of a VL or MTP release the text model does not use (not an error)."""
    skipped = [n for n in reader.names if _IGNORED.search(n)]
    if not skipped:
        return
    kinds: dict[str, int] = {}
    for n in skipped:
        kind = next((k for k, pat in _SKIPPED_KINDS if pat.search(n)), "other")
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"minimax-jax: load_model: skipped {len(skipped)} tensors the text model does not use ("
          + ", ".join(f"{k} {c}" for k, c in kinds.items()) + ")", file=sys.stderr)


_SKIPPED_KINDS = (("vision tower", re.compile(r"vision_tower\.")), ("projector", re.compile(r"multi_modal_projector\.")),
                  ("patch merge", re.compile(r"patch_merge_mlp\.")), ("mtp", re.compile(r"(^|\.)mtp\.")),
                  ("rotary inv_freq", re.compile(r"rotary_emb\.inv_freq$")))


# ----------------------------------------------------------------------------------------------- orbax
def save_checkpoint(model: nnx.Module, path: str | os.PathLike) -> None:
    """Save the model's NNX state with orbax (and its config as ``config.json`` beside it)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    state = nnx.state(model)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "state"), state, force=True)
    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, MiniMaxM3Config):
        cfg.save(path)
        with open(os.path.join(path, "dtype.json"), "w") as f:
            json.dump({"dtype": jnp.dtype(model.dtype).name}, f)


def restore_checkpoint(path: str | os.PathLike, *, dtype=None) -> MiniMaxM3ForCausalLM:
    """Restore a model written by :func:`save_checkpoint`.

    Raises:
      FileNotFoundError for a path that does not exist; CheckpointError for anything that is not such a
      checkpoint (a safetensors checkpoint directory is read by :func:`load_model`).
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"no orbax checkpoint at {path}: the path does not exist")
    if not os.path.isdir(os.path.join(path, "state")):
        what = ("a directory without the 'state' folder save_checkpoint writes" if os.path.isdir(path)
                else "a file")
        hint = ""
        if os.path.isdir(path) and any(f.endswith(".safetensors") or f == "model.safetensors.index.json"
                                       for f in os.listdir(path)):
            hint = "; it holds safetensors: read it with load_model"
        raise CheckpointError(f"{path} is not an orbax checkpoint written by save_checkpoint ({what}){hint}")
    cfg = MiniMaxM3Config.from_pretrained(path)
    if dtype is None:
        dtype_file = os.path.join(path, "dtype.json")
        dtype = jnp.bfloat16
        if os.path.isfile(dtype_file):
            with open(dtype_file) as f:
                dtype = jnp.dtype(json.load(f)["dtype"])
    abstract = abstract_model(cfg, dtype=dtype)
    graphdef, abstract_state = nnx.split(abstract)
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(os.path.join(path, "state"), abstract_state)
    return nnx.merge(graphdef, state)


__all__ = ["QUANTIZATION_MODES", "CheckpointError", "load_model", "restore_checkpoint", "save_checkpoint",
           "text_model_name", "weight_plan"]
