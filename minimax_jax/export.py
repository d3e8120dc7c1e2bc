"""Writing a MiniMax-M3 model as an HF-style checkpoint: ``config.json`` + ``model.safetensors``.

:func:`save_model` is the inverse of :func:`minimax_jax.checkpoint.load_model`: it walks the same
:func:`~minimax_jax.checkpoint.weight_plan` table and undoes each transform (kernels back to torch ``[out, in]``,
stacked experts back to ``[E, out, in]``), so ``load_model(save_model(m))`` gives ``m`` back exactly (up to the
``dtype`` cast). Tensors are written with HF transformers names (``mlp.experts.gate_up_proj``,
``self_attn.indexer.*``).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.checkpoint import CheckpointError, weight_plan
from minimax_jax.model import MiniMaxM3ForCausalLM
from minimax_jax.safetensors_io import to_checkpoint_tensors

# Tensors kept in float32 whatever ``dtype`` asks: the router's selection-only bias shifts a top-k between
# sigmoid scores, so rounding it to bf16 would change which experts run.
KEEP_FP32 = ("e_score_correction_bias",)


def model_tensors(model: MiniMaxM3ForCausalLM, *, dtype=None) -> dict[str, np.ndarray]:
    """The model's parameters as HF-named numpy arrays (``dtype`` casts all but :data:`KEEP_FP32`)."""
    cfg = model.cfg
    if cfg.expert_quantization is not None or cfg.quantized_linears:
        what = ([f"routed experts ({cfg.expert_quantization})"] if cfg.expert_quantization is not None else []) + (
            [f"{len(cfg.quantized_linears)} linears ({cfg.linear_quantization})"] if cfg.quantized_linears else [])
        raise CheckpointError(f"the model holds MX tensors ({', '.join(what)}): save_model writes dense checkpoints; "
                              f"load the checkpoint with quantization='dequantize' to export it")
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    plan = weight_plan(cfg)
    if set(plan) != set(flat):
        raise CheckpointError(f"internal: weight plan and model differ: {sorted(set(plan) ^ set(flat))}")
    out: dict[str, np.ndarray] = {}
    for path, alternatives in plan.items():
        arr = flat[path].get_value()
        if dtype is not None and path[-1] not in KEEP_FP32:
            arr = arr.astype(dtype)
        elif path[-1] in KEEP_FP32:
            arr = arr.astype(jnp.float32)
        src = alternatives["hf"]
        for name, part in zip(src.names, to_checkpoint_tensors(src, np.asarray(arr))):
            out[name] = part
    return out


def save_model(model: MiniMaxM3ForCausalLM, path: str | os.PathLike, *, dtype=None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (HF names) into the directory ``path``.

    ``dtype`` (e.g. ``jnp.bfloat16``) casts the weights on the way out; the router's
    ``e_score_correction_bias`` stays float32. :func:`~minimax_jax.checkpoint.load_model` reads it back.
    """
    from safetensors.numpy import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = model_tensors(model, dtype=dtype)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    model.cfg.save(os.path.join(path, "config.json"))


__all__ = ["KEEP_FP32", "model_tensors", "save_model"]
