"""MiniMax-M3 in JAX / Flax NNX, with DSpark speculative decoding and adaptive verification."""

from minimax_jax.checkpoint import CheckpointError, load_model, restore_checkpoint, save_checkpoint
from minimax_jax.config import ConfigError, MiniMaxM3Config
from minimax_jax.model import MiniMaxM3ForCausalLM, abstract_model, init_model

__all__ = [
    "CheckpointError",
    "ConfigError",
    "MiniMaxM3Config",
    "MiniMaxM3ForCausalLM",
    "abstract_model",
    "init_model",
    "load_model",
    "restore_checkpoint",
    "save_checkpoint",
]

# DSpark drafter (issue 5)
from minimax_jax.drafter import DraftCache, DraftOutput, DSparkConfig, DSparkDrafter, init_drafter  # noqa: E402
from minimax_jax.drafter_checkpoint import load_drafter, save_drafter  # noqa: E402

__all__ += ["DSparkConfig", "DSparkDrafter", "DraftCache", "DraftOutput", "init_drafter", "load_drafter",
            "save_drafter"]
