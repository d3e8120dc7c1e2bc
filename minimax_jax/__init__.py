"""MiniMax-M3 in JAX / Flax NNX, with DSpark speculative decoding and adaptive verification."""

from minimax_jax.checkpoint import CheckpointError, load_model, restore_checkpoint, save_checkpoint
from minimax_jax.config import ConfigError, MiniMaxM3Config
from minimax_jax.draft_cache import DraftCache
from minimax_jax.draft_step import DraftOutput, append_context_packed_step, append_context_step, draft_step
from minimax_jax.drafter import DSparkDrafter, capture_target_features, init_drafter
from minimax_jax.drafter_checkpoint import load_drafter, save_drafter
from minimax_jax.drafter_config import DSparkConfig
from minimax_jax.model import MiniMaxM3ForCausalLM, abstract_model, init_model

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DSparkConfig",
    "DSparkDrafter",
    "DraftCache",
    "DraftOutput",
    "MiniMaxM3Config",
    "MiniMaxM3ForCausalLM",
    "abstract_model",
    "append_context_packed_step",
    "append_context_step",
    "capture_target_features",
    "draft_step",
    "init_drafter",
    "init_model",
    "load_drafter",
    "load_model",
    "restore_checkpoint",
    "save_checkpoint",
    "save_drafter",
]
