"""Configurations of the embedded default and of the CPU smoke runs, parameter counts and size budgets.

The default target (5 layers, d = 256, 4096-token vocabulary)::

    layer 0      full attention (GQA 8 query / 2 KV heads, head_dim 32, partial RoPE on 16 dims) + dense MLP 512
    layers 1-4   MSA sparse attention (index block 32 = KV page, top-8 blocks, 1 local block, 2 index heads of 32)
                 + MoE: 8 experts of 64, top-2, sigmoid router with correction bias, one shared expert of 128

The GQA ratio is 4:1, not M3's 16:1: at d = 256, 16 query heads per KV group would mean head_dim 8 (below the
compiled kernels' 16) or 32 heads of 16, doubling the ``[B, H, S, S]`` attention traffic that dominates training at
this size; and two KV groups keep the per-group MSA selection (one selection per KV group) meaningful.

The default drafter: 2 draft layers (the target's attention shape, dense MLP 384), features of target layers 1, 2
and 3, an rnn Markov head of rank 32, a confidence head on ``[h ; e]``, block size 7.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from minimax_jax.config import DENSE_MLP, FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION, MiniMaxM3Config

# Size budget of what ships in the package (bf16 weights): issue 12.
TARGET_MAX_PARAMS = 5_500_000
DRAFTER_MAX_PARAMS = 1_500_000
SHIPPED_MAX_BYTES = 16_000_000
PRESETS = ("default", "smoke")


def target_config(preset: str, *, vocab_size: int, bos_token_id: int, eos_token_id: int,
                  pad_token_id: int | None) -> MiniMaxM3Config:
    """The target's MiniMax-M3 config for ``preset`` ("default" or "smoke"), with the tokenizer's ids."""
    tokens = {"vocab_size": vocab_size, "bos_token_id": bos_token_id, "eos_token_id": (eos_token_id,),
              "pad_token_id": pad_token_id, "tie_word_embeddings": False}
    if preset == "default":
        n = 5
        return MiniMaxM3Config(
            hidden_size=256, num_hidden_layers=n, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
            rotary_dim=16, rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
            intermediate_size=64, dense_intermediate_size=512, shared_intermediate_size=128,
            num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0,
            swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_beta=1.0,
            layer_types=(FULL_ATTENTION,) + (SPARSE_ATTENTION,) * (n - 1),
            mlp_layer_types=(DENSE_MLP,) + (MOE_MLP,) * (n - 1),
            index_n_heads=2, index_head_dim=32, index_block_size=32, index_topk_blocks=8, index_local_blocks=1,
            **tokens)
    if preset == "smoke":
        n = 3
        return MiniMaxM3Config(
            hidden_size=32, num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rotary_dim=8, rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
            intermediate_size=16, dense_intermediate_size=64, shared_intermediate_size=16,
            num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=2.0,
            swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_beta=1.0,
            layer_types=(FULL_ATTENTION,) + (SPARSE_ATTENTION,) * (n - 1),
            mlp_layer_types=(DENSE_MLP,) + (MOE_MLP,) * (n - 1),
            index_n_heads=2, index_head_dim=16, index_block_size=8, index_topk_blocks=2, index_local_blocks=1,
            **tokens)
    raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")


@dataclasses.dataclass(frozen=True)
class DrafterShape:
    num_draft_layers: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    markov_head_type: str
    block_size: int = 7


def drafter_shape(preset: str) -> DrafterShape:
    if preset == "default":
        return DrafterShape(num_draft_layers=2, intermediate_size=384, target_layer_ids=(1, 2, 3), markov_rank=32,
                            markov_head_type="rnn")
    if preset == "smoke":
        return DrafterShape(num_draft_layers=1, intermediate_size=32, target_layer_ids=(0, 1), markov_rank=8,
                            markov_head_type="rnn")
    raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")


def drafter_config(preset: str, target_cfg: MiniMaxM3Config, *, mask_token_id: int):
    """The DSpark drafter config for ``preset`` on ``target_cfg`` (confidence head on ``[h ; e]``)."""
    from minimax_jax import DSparkConfig

    s = drafter_shape(preset)
    return DSparkConfig.for_target(target_cfg, mask_token_id=mask_token_id, block_size=s.block_size,
                                   num_draft_layers=s.num_draft_layers, target_layer_ids=s.target_layer_ids,
                                   intermediate_size=s.intermediate_size, markov_rank=s.markov_rank,
                                   markov_head_type=s.markov_head_type, enable_confidence_head=True,
                                   confidence_head_with_markov=True)


# ----------------------------------------------------------------------------------------------- counting
def count_params(module: nnx.Module) -> int:
    """Number of trainable values (``nnx.Param``; a drafter's shared embeddings / LM head are not counted)."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(module, nnx.Param))))


def target_param_count(cfg: MiniMaxM3Config) -> int:
    from minimax_jax.model import abstract_model

    return count_params(abstract_model(cfg))


def drafter_param_count(cfg) -> int:
    from minimax_jax import DSparkDrafter

    return count_params(nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0))))


def check_budget(name: str, count: int, limit: int) -> None:
    """Refuse a configuration over its parameter budget."""
    if count > limit:
        raise ValueError(f"the {name} config has {count:,} parameters, over the shipping budget of {limit:,} "
                         f"(everything shipped must stay under {SHIPPED_MAX_BYTES / 1e6:.0f} MB in bf16)")
