"""The embedded default: a small MiniMax-M3-shaped target and its DSpark drafter, trained on the Python standard
library, shipped in the package (``minimax_jax/assets/default/``). See ``docs/MODEL_CARD.md``.

Layout of a default directory::

    target/     config.json, model.safetensors    (HF names, bf16; read by load_model)
    drafter/    config.json, model.safetensors    (DeepSpec names, bf16, STS temperatures; read by load_drafter)
    tokenizer/  tokenizer.json, tokenizer_config.json
    prompts.json                                  (held-out prompts; not needed to load)
"""

from __future__ import annotations

import os

import jax.numpy as jnp

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "default")
PARTS = ("target", "drafter", "tokenizer")
HOW_TO_BUILD = ("the weights are produced by scripts/train_default.sh (corpus, target and drafter training, then "
                "scripts/export_default.py); see docs/MODEL_CARD.md")


class DefaultModelMissing(FileNotFoundError):
    """The embedded default's weights are not present in the package (they have not been trained yet)."""


def default_paths(path: str | os.PathLike | None = None) -> dict[str, str]:
    """``{"target": ..., "drafter": ..., "tokenizer": ...}`` directories under ``path`` (default: the package's)."""
    root = os.fspath(path) if path is not None else DEFAULT_DIR
    return {part: os.path.join(root, part) for part in PARTS}


def check_default_present(path: str | os.PathLike | None = None) -> dict[str, str]:
    """The part directories, after checking each holds what it needs; :class:`DefaultModelMissing` otherwise."""
    paths = default_paths(path)
    need = {"target": ("config.json", "model.safetensors"), "drafter": ("config.json", "model.safetensors"),
            "tokenizer": ("tokenizer.json",)}
    missing = [os.path.join(paths[p], f) for p in PARTS for f in need[p] if not os.path.isfile(os.path.join(paths[p], f))]
    if missing:
        where = "this package" if path is None else os.fspath(path)
        raise DefaultModelMissing(f"the embedded default is not available in {where}: missing "
                                  f"{', '.join(missing)}. {HOW_TO_BUILD}")
    return paths


def load_default(*, dtype=jnp.bfloat16, path: str | os.PathLike | None = None):
    """``(target, drafter, tokenizer)``: the embedded trained pair and its tokenizer.

    Args:
      dtype: parameter dtype of both models (the weights are stored in bf16).
      path: a directory with the default's layout (default: the one shipped in the package).
    Raises:
      DefaultModelMissing: the weights are not there (with how to produce them).
      ValueError: the three parts do not fit together (vocabulary, special ids).
    """
    from minimax_jax.checkpoint import load_model
    from minimax_jax.drafter_checkpoint import load_drafter
    from minimax_jax.tokenizer import load_tokenizer

    paths = check_default_present(path)
    tokenizer = load_tokenizer(paths["tokenizer"])
    target = load_model(paths["target"], dtype=dtype)
    drafter = load_drafter(paths["drafter"], target, dtype=dtype)
    problems = []
    if target.cfg.vocab_size != tokenizer.vocab_size:
        problems.append(f"target vocab_size {target.cfg.vocab_size} != tokenizer vocab_size {tokenizer.vocab_size}")
    if tokenizer.mask_token_id is not None and drafter.cfg.mask_token_id != tokenizer.mask_token_id:
        problems.append(f"drafter mask_token_id {drafter.cfg.mask_token_id} != tokenizer mask token "
                        f"{tokenizer.mask_token_id}")
    if target.cfg.bos_token_id != tokenizer.bos_token_id:
        problems.append(f"target bos_token_id {target.cfg.bos_token_id} != tokenizer {tokenizer.bos_token_id}")
    if problems:
        raise ValueError(f"the default in {path or DEFAULT_DIR} is inconsistent: " + "; ".join(problems))
    return target, drafter, tokenizer


__all__ = ["DEFAULT_DIR", "DefaultModelMissing", "check_default_present", "default_paths", "load_default"]


def load_prompts(path: str | os.PathLike | None = None) -> list[str]:
    """The committed held-out prompts of the embedded default (Python code openings and headers), as text."""
    import json

    file = os.path.join(os.fspath(path) if path is not None else DEFAULT_DIR, "prompts.json")
    with open(file) as f:
        data = json.load(f)
    return [p["text"] for p in data["prompts"]]
