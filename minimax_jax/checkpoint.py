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

import json
import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.config import MiniMaxM3Config
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


def weight_plan(cfg: MiniMaxM3Config) -> dict[tuple, dict[str, Source]]:
    """For every parameter path of the NNX model: ``{"hf": Source, "minimax": Source}``.

    The two schemes share a name wherever the checkpoints do.
    """
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
    return plan


# ----------------------------------------------------------------------------------------------- loading
def load_model(path: str | os.PathLike, *, dtype=jnp.bfloat16, config: MiniMaxM3Config | None = None,
               rename: Rename = None, mesh=None) -> MiniMaxM3ForCausalLM:
    """Load a MiniMax-M3 safetensors checkpoint (single file or sharded) into a :class:`MiniMaxM3ForCausalLM`.

    Args:
      path: a directory with ``config.json`` and the safetensors file(s) (a single ``.safetensors`` file is
        accepted when ``config`` is given).
      dtype: parameter dtype (the router's correction bias stays fp32).
      config: overrides the directory's ``config.json``.
      rename: optional extra name table (or function) applied to checkpoint names before matching.
      mesh: a ``jax.sharding.Mesh`` with a ``"tensor"`` axis: the parameters are placed by
        :func:`minimax_jax.sharding.param_layout` while loading (KV and index heads replicated past their count,
        the model's config says so), each device reading only the checkpoint slices of its own blocks
        (docs/PARALLELISM.md).
    Raises:
      FileNotFoundError / NotADirectoryError for a path that does not exist or is a file (without ``config``);
      CheckpointError listing every missing, unexpected, mis-shaped and wrongly typed tensor, or naming a
      safetensors file that cannot be read.
    """
    if config is None:
        path = checkpoint_directory(path, kind="model")
    cfg = config if config is not None else MiniMaxM3Config.from_pretrained(path)
    reader = SafetensorsReader(path, rename=compose_rename(rename, text_model_name))
    placement, model_cfg = None, cfg
    if mesh is not None:  # the checkpoint is cfg's; the model stores its heads for the mesh
        from minimax_jax import sharding

        placement = sharding.loader_placement(mesh, cfg, abstract_model(cfg, dtype=dtype))
        model_cfg = sharding.stored_config(cfg, mesh.shape[sharding.TENSOR])

    graphdef, state = nnx.split(abstract_model(model_cfg, dtype=dtype))
    state = load_weights(weight_plan(cfg), reader, state, kind="model",
                         against=f"the {cfg.num_hidden_layers}-layer config", prefer="hf", ignore=_IGNORED,
                         placement=placement)
    return nnx.merge(graphdef, state)


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


__all__ = ["CheckpointError", "load_model", "restore_checkpoint", "save_checkpoint", "text_model_name",
           "weight_plan"]
