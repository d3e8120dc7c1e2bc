"""Checkpoints: safetensors loading with an explicit name-mapping table, and orbax save/restore of NNX state.

``load_model`` accepts both naming schemes of MiniMax-M3 (SPEC section 9):

* the MiniMax original names (``block_sparse_moe.experts.E.w1|w3|w2``, ``self_attn.index_q_proj`` ...), also
  under the ``language_model.`` prefix of the vision-language release;
* the HF transformers names (``mlp.experts.gate_up_proj [E, 2I, d]``, ``self_attn.indexer.q_proj`` ...), also
  as ``model.language_model.*`` (the HF VL model).

Every model parameter has an entry in :func:`weight_plan`: the checkpoint tensors it is built from, in each
naming scheme, with their expected shapes and the transform into JAX layout. Tensors are read one at a time
(``safe_open``), so a checkpoint is never held in memory as a whole. All problems (missing, unexpected,
mis-shaped tensors) are collected and raised as one :class:`CheckpointError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.config import MiniMaxM3Config
from minimax_jax.model import MiniMaxM3ForCausalLM, abstract_model


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: the message lists every offending tensor."""


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


@dataclasses.dataclass(frozen=True)
class Source:
    """How one model parameter is built from checkpoint tensors in one naming scheme."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    combine: Callable[[list[np.ndarray]], np.ndarray]


def _t(xs):  # torch Linear [out, in] -> kernel [in, out]
    return xs[0].T


def _same(xs):
    return xs[0]


def _concat_t(xs):  # [gate; up] along out, then to [in, out]
    return np.concatenate(xs, axis=0).T


def _experts_t(xs):  # HF stacked [E, out, in] -> [E, in, out]
    return np.swapaxes(xs[0], 1, 2)


def _stack_gate_up(num_experts):
    def f(xs):  # [w1_0, w3_0, w1_1, w3_1, ...], each [I, d] -> [E, d, 2I]
        return np.stack([np.concatenate([xs[2 * e], xs[2 * e + 1]], axis=0).T for e in range(num_experts)])
    return f


def _stack_down(xs):  # [w2_e [d, I]] -> [E, I, d]
    return np.stack([x.T for x in xs])


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
        both(path, [name], [(out_f, in_f)], _t)

    both(("embed_tokens",), ["model.embed_tokens.weight"], [(v, d)], _same)
    linear(("lm_head",), "lm_head.weight", v, d)
    both(("norm", "weight"), ["model.norm.weight"], [(d,)], _same)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        L = ("layers", i)
        both(L + ("input_layernorm", "weight"), [p + "input_layernorm.weight"], [(d,)], _same)
        both(L + ("post_attention_layernorm", "weight"), [p + "post_attention_layernorm.weight"], [(d,)], _same)
        A = L + ("self_attn",)
        linear(A + ("q_proj", "kernel"), p + "self_attn.q_proj.weight", h * hd, d)
        linear(A + ("k_proj", "kernel"), p + "self_attn.k_proj.weight", hkv * hd, d)
        linear(A + ("v_proj", "kernel"), p + "self_attn.v_proj.weight", hkv * hd, d)
        linear(A + ("o_proj", "kernel"), p + "self_attn.o_proj.weight", d, h * hd)
        both(A + ("q_norm", "weight"), [p + "self_attn.q_norm.weight"], [(hd,)], _same)
        both(A + ("k_norm", "weight"), [p + "self_attn.k_norm.weight"], [(hd,)], _same)
        if cfg.is_sparse_layer(i):
            hi, di = cfg.index_n_heads, cfg.index_head_dim
            for part, out_f in (("q", hi * di), ("k", di)):
                plan[A + ("indexer", f"{part}_proj", "kernel")] = {
                    "hf": Source((p + f"self_attn.indexer.{part}_proj.weight",), ((out_f, d),), _t),
                    "minimax": Source((p + f"self_attn.index_{part}_proj.weight",), ((out_f, d),), _t),
                }
                plan[A + ("indexer", f"{part}_norm", "weight")] = {
                    "hf": Source((p + f"self_attn.indexer.{part}_norm.weight",), ((di,),), _same),
                    "minimax": Source((p + f"self_attn.index_{part}_norm.weight",), ((di,),), _same),
                }
        M = L + ("mlp",)
        if cfg.is_moe_layer(i):
            e, inter = cfg.num_local_experts, cfg.intermediate_size
            plan[M + ("gate", "kernel")] = {
                "hf": Source((p + "mlp.gate.weight",), ((e, d),), _t),
                "minimax": Source((p + "block_sparse_moe.gate.weight",), ((e, d),), _t),
            }
            plan[M + ("gate", "e_score_correction_bias")] = {
                "hf": Source((p + "mlp.gate.e_score_correction_bias",), ((e,),), _same),
                "minimax": Source((p + "block_sparse_moe.e_score_correction_bias",), ((e,),), _same),
            }
            plan[M + ("experts_gate_up",)] = {
                "hf": Source((p + "mlp.experts.gate_up_proj",), ((e, 2 * inter, d),), _experts_t),
                "minimax": Source(
                    tuple(f"{p}block_sparse_moe.experts.{j}.{w}.weight" for j in range(e) for w in ("w1", "w3")),
                    tuple((inter, d) for _ in range(2 * e)), _stack_gate_up(e)),
            }
            plan[M + ("experts_down",)] = {
                "hf": Source((p + "mlp.experts.down_proj",), ((e, d, inter),), _experts_t),
                "minimax": Source(tuple(f"{p}block_sparse_moe.experts.{j}.w2.weight" for j in range(e)),
                                  tuple((d, inter) for _ in range(e)), _stack_down),
            }
            if cfg.shared_intermediate_size > 0:
                si = cfg.shared_intermediate_size
                S = M + ("shared_experts",)
                plan[S + ("gate_up_proj", "kernel")] = {
                    "hf": Source((p + "mlp.shared_experts.gate_up_proj.weight",), ((2 * si, d),), _t),
                    "minimax": Source((p + "block_sparse_moe.shared_experts.gate_proj.weight",
                                       p + "block_sparse_moe.shared_experts.up_proj.weight"),
                                      ((si, d), (si, d)), _concat_t),
                }
                plan[S + ("down_proj", "kernel")] = {
                    "hf": Source((p + "mlp.shared_experts.down_proj.weight",), ((d, si),), _t),
                    "minimax": Source((p + "block_sparse_moe.shared_experts.down_proj.weight",), ((d, si),), _t),
                }
        else:
            di = cfg.dense_intermediate_size
            plan[M + ("gate_up_proj", "kernel")] = {
                "hf": Source((p + "mlp.gate_up_proj.weight",), ((2 * di, d),), _t),
                "minimax": Source((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), ((di, d), (di, d)),
                                  _concat_t),
            }
            linear(M + ("down_proj", "kernel"), p + "mlp.down_proj.weight", d, di)
    return plan


# ----------------------------------------------------------------------------------------------- reading
class SafetensorsReader:
    """Name -> file index over a single ``.safetensors`` file or a sharded ``model.safetensors.index.json``.

    Tensors are read lazily, one at a time.
    """

    def __init__(self, path: str | os.PathLike, *, rename: Mapping[str, str] | Callable[[str], str] | None = None):
        from safetensors import safe_open

        self._safe_open = safe_open
        path = os.fspath(path)
        files: dict[str, str] = {}
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.isfile(index):
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise CheckpointError(f"{index} has no 'weight_map' object")
                for name, fname in weight_map.items():
                    files[name] = os.path.join(path, fname)
                missing_files = sorted({f for f in files.values() if not os.path.isfile(f)})
                if missing_files:
                    raise CheckpointError(f"{index} names shard files that do not exist: {missing_files}")
            else:
                candidates = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
                if not candidates:
                    raise FileNotFoundError(f"no .safetensors file or model.safetensors.index.json in {path}")
                for fname in candidates:
                    full = os.path.join(path, fname)
                    with safe_open(full, framework="np") as f:
                        for name in f.keys():
                            files[name] = full
        elif os.path.isfile(path):
            with safe_open(path, framework="np") as f:
                for name in f.keys():
                    files[name] = path
        else:
            raise FileNotFoundError(f"no checkpoint at {path}")
        self.raw_files = files
        # canonical name -> raw name
        self.names: dict[str, str] = {}
        for raw in files:
            canon = raw
            if rename is not None:
                canon = rename(raw) if callable(rename) else rename.get(raw, raw)
            for pat, rep in _PREFIX_REWRITES:
                canon, n = pat.subn(rep, canon)
                if n:
                    break
            self.names[canon] = raw
        self._shapes: dict[str, tuple[int, ...]] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            raw = self.names[name]
            with self._safe_open(self.raw_files[raw], framework="np") as f:
                self._shapes[name] = tuple(f.get_slice(raw).get_shape())
        return self._shapes[name]

    def read(self, name: str) -> np.ndarray:
        raw = self.names[name]
        with self._safe_open(self.raw_files[raw], framework="np") as f:
            return f.get_tensor(raw)


def _detect_scheme(names: Sequence[str]) -> str:
    minimax = sum(".block_sparse_moe." in n or ".self_attn.index_" in n or ".mlp.gate_proj." in n for n in names)
    hf = sum(".mlp.experts.gate_up_proj" in n or ".self_attn.indexer." in n or ".mlp.gate_up_proj." in n
             for n in names)
    return "minimax" if minimax > hf else "hf"


def load_model(path: str | os.PathLike, *, dtype=jnp.bfloat16, config: MiniMaxM3Config | None = None,
               rename: Mapping[str, str] | Callable[[str], str] | None = None) -> MiniMaxM3ForCausalLM:
    """Load a MiniMax-M3 safetensors checkpoint (single file or sharded) into a :class:`MiniMaxM3ForCausalLM`.

    Args:
      path: a directory with ``config.json`` and the safetensors file(s).
      dtype: parameter dtype (the router's correction bias stays fp32).
      config: overrides the directory's ``config.json``.
      rename: optional extra name table (or function) applied to checkpoint names before matching.
    Raises:
      CheckpointError listing every missing, unexpected and mis-shaped tensor.
    """
    cfg = config if config is not None else MiniMaxM3Config.from_pretrained(path)
    reader = SafetensorsReader(path, rename=rename)
    plan = weight_plan(cfg)
    scheme = _detect_scheme(list(reader.names))

    model = abstract_model(cfg, dtype=dtype)
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))

    missing, misshaped, chosen = [], [], {}
    used: set[str] = set()
    for path_key, alternatives in plan.items():
        order = [scheme] + [s for s in alternatives if s != scheme]
        src = next((alternatives[s] for s in order if all(n in reader.names for n in alternatives[s].names)), None)
        if src is None:
            want = alternatives[scheme]
            missing.extend(n for n in want.names if n not in reader.names)
            continue
        for n, shape in zip(src.names, src.shapes):
            used.add(n)
            if reader.shape(n) != shape:
                misshaped.append(f"{reader.names[n]}: expected shape {shape}, found {reader.shape(n)}")
        chosen[path_key] = src
    unexpected = sorted(reader.names[n] for n in reader.names if n not in used and not _IGNORED.search(n))
    if missing or unexpected or misshaped:
        header = (f"checkpoint at {os.fspath(path)} does not match the {cfg.num_hidden_layers}-layer config "
                  f"({scheme} names detected):")
        parts = [header]
        if missing:
            parts.append(f"  missing ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            parts.append(f"  unexpected ({len(unexpected)}): " + ", ".join(unexpected))
        if misshaped:
            parts.append(f"  mis-shaped ({len(misshaped)}): " + "; ".join(misshaped))
        raise CheckpointError("\n".join(parts))
    if set(chosen) != set(flat):
        raise CheckpointError(f"internal: weight plan does not cover {sorted(set(flat) - set(chosen))}")

    for path_key, src in chosen.items():
        var = flat[path_key]
        arr = src.combine([reader.read(n) for n in src.names])
        target = var.get_value()
        arr = jnp.asarray(np.asarray(arr), dtype=target.dtype)
        if arr.shape != target.shape:
            raise CheckpointError(f"internal: {'.'.join(map(str, path_key))} built with shape {arr.shape}, "
                                  f"model expects {target.shape}")
        flat[path_key] = var.replace(arr)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


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
    """Restore a model written by :func:`save_checkpoint`."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
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
