"""Write a tiny random Qwen3-style DSpark drafter in the published ``nvidia/MiniMax-M3-DSpark`` schema.

The schema (docs/DRAFTER.md, "The Qwen3-style drafter"): ``config.json`` as ModelOpt's DSpark exporter writes it
(``architectures: ["Qwen3DSparkModel"]``, Qwen3 shape keys, a ``dflash_config`` with block size, target layer ids,
mask token, Markov rank and head type, ``use_confidence_head``, and ``use_swa`` / ``swa_window_size`` /
``causal: false`` for the non-causal sliding window), and float32 safetensors named as that exporter names them:
the module's own flat head names (``markov_w1.weight``, ``markov_w2.weight``, ``confidence_proj.*``) beside
``fc``, ``hidden_norm``, ``layers.i.*`` (Qwen3 names) and ``norm``. ``names="vllm"`` writes vLLM's nested head
names instead (``markov_head.markov_w1.weight``, ``confidence_head.proj.*``). ``shards > 1`` splits the tensors
over several files with a ``model.safetensors.index.json``.

Tests call :func:`write_qwen3_dspark_fixture` into a temporary directory; from the command line::

    python scripts/make_drafter_fixture.py OUT_DIR [--layers 2] [--window 16] [--seed 0]

writes one for the tiny default test target (``MiniMaxM3Config.tiny()``).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

import numpy as np


def qwen3_dspark_config(*, hidden_size: int, vocab_size: int, num_target_layers: int, target_layer_ids: Sequence[int],
                        mask_token_id: int, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                        head_dim: int = 16, intermediate_size: int = 96, block_size: int = 8,
                        markov_rank: int = 8, window: int | None = 16, rope_theta: float = 10_000.0,
                        confidence_head: bool = True) -> dict:
    """The ``config.json`` dict, key for key as the published drafter's (ModelOpt's DSpark exporter)."""
    dflash = {
        "mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids), "block_size": block_size,
        "num_target_layers": num_target_layers, "projector_type": "dspark", "shift_label": True,
        "markov_rank": markov_rank, "markov_head_type": "vanilla", "use_confidence_head": confidence_head,
    }
    config = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "block_size": block_size,
        "hidden_size": hidden_size, "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "intermediate_size": intermediate_size,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "max_position_embeddings": 4096,
        "initializer_range": 0.02, "attention_bias": False, "attention_dropout": 0.0, "rope_theta": rope_theta,
        "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float32",
        "num_target_layers": num_target_layers, "layer_types": ["full_attention"] * num_layers,
        "dflash_config": dflash,
    }
    if window is not None:
        config["sliding_window"] = window  # dropped by transformers' Qwen3Config (no use_sliding_window) ...
        dflash.update(use_swa=True, swa_window_size=window, causal=False)  # ... the window vLLM reads
    return config


def qwen3_dspark_tensors(config: dict, *, seed: int = 0, names: str = "modelopt") -> dict[str, np.ndarray]:
    """Random float32 weights for ``config`` (torch layout, ``[out, in]``), named as ``names`` says."""
    if names not in ("modelopt", "vllm"):
        raise ValueError(f"names must be 'modelopt' or 'vllm', got {names!r}")
    rng = np.random.default_rng(seed)
    d, v = config["hidden_size"], config["vocab_size"]
    h, g, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inter, dfl = config["intermediate_size"], config["dflash_config"]
    r, m = dfl["markov_rank"], len(dfl["target_layer_ids"])

    def w(*shape, scale=None):
        scale = shape[-1] ** -0.5 if scale is None else scale
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n):  # Qwen3 RMSNorm weights multiply (initialised to 1): around 1
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"fc.weight": w(d, m * d), "hidden_norm.weight": norm(d), "norm.weight": norm(d)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        t.update({
            p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
            p + "self_attn.q_proj.weight": w(h * hd, d), p + "self_attn.k_proj.weight": w(g * hd, d),
            p + "self_attn.v_proj.weight": w(g * hd, d), p + "self_attn.o_proj.weight": w(d, h * hd),
            p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": w(inter, d), p + "mlp.up_proj.weight": w(inter, d),
            p + "mlp.down_proj.weight": w(d, inter),
        })
    head = {"markov_w1.weight": w(v, r, scale=1.0), "markov_w2.weight": w(v, r)}
    if dfl.get("use_confidence_head"):
        head["confidence_proj.weight"] = w(1, d + r)
        head["confidence_proj.bias"] = w(1, scale=0.5)
    if names == "vllm":
        head = {k.replace("markov_", "markov_head.markov_", 1) if k.startswith("markov_")
                else k.replace("confidence_proj.", "confidence_head.proj."): a for k, a in head.items()}
    t.update(head)
    return t


def write_qwen3_dspark_fixture(path: str | os.PathLike, *, hidden_size: int, vocab_size: int, num_target_layers: int,
                               target_layer_ids: Sequence[int], mask_token_id: int, seed: int = 0,
                               names: str = "modelopt", shards: int = 1, **config_kwargs) -> dict:
    """Write ``config.json`` and the safetensors (one file, or ``shards`` files and an index) to ``path``;
    returns the config dict."""
    from safetensors.numpy import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config = qwen3_dspark_config(hidden_size=hidden_size, vocab_size=vocab_size, num_target_layers=num_target_layers,
                                 target_layer_ids=target_layer_ids, mask_token_id=mask_token_id, **config_kwargs)
    tensors = qwen3_dspark_tensors(config, seed=seed, names=names)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if shards <= 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return config
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = keys[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(a.nbytes for a in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return config


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--names", choices=("modelopt", "vllm"), default="modelopt")
    args = ap.parse_args(argv)
    from minimax_jax.config import MiniMaxM3Config

    t = MiniMaxM3Config.tiny()
    write_qwen3_dspark_fixture(args.out, hidden_size=t.hidden_size, vocab_size=t.vocab_size,
                               num_target_layers=t.num_hidden_layers,
                               target_layer_ids=list(range(t.num_hidden_layers))[-min(2, t.num_hidden_layers):],
                               mask_token_id=t.vocab_size - 1, seed=args.seed, names=args.names,
                               num_layers=args.layers, window=args.window)
    print(f"wrote a Qwen3DSparkModel fixture to {args.out}")


if __name__ == "__main__":
    main()
