"""The MiniMax-M3 shapes the benchmarks, the per-op profiler and the compile gate use, declared once.

Model widths come from :meth:`minimax_jax.config.MiniMaxM3Config.m3` (nothing here restates a width); the
serving batches are :class:`Batch` values (``requests`` requests of ``tokens`` new tokens each, at ``context``
tokens). Each consumer picks its set:

* ``scripts/compile_check.py`` / ``compile_kernels.py`` (the AMD/CUDA compile gate): :data:`SERVING_BATCHES`;
* ``scripts/bench_sparse_attention.py``: :data:`ATTENTION_BATCHES` (and :data:`ATTENTION_QUICK` for CPU);
* ``scripts/bench_moe.py``: :data:`MOE_TOKENS`;
* ``scripts/bench_draft_attention.py`` and the profiler's draft step: :data:`DRAFT_ROWS` at :data:`CONTEXT`;
* ``scripts/profile_step.py``: :data:`PROFILE_VERIFY` at :data:`CONTEXT` (and the ``TINY_*`` sets for CPU).
"""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class Batch:
    """A ragged serving batch: ``requests`` requests of ``tokens`` new tokens each, at ``context`` tokens."""

    kind: str  # "verify", "decode", "prefill"
    requests: int
    tokens: int
    context: int

    @property
    def label(self) -> str:
        return f"{self.kind} {self.requests}x{self.tokens}@{self.context // 1024}K"

    @property
    def size(self) -> str:
        """``"512x8x4K"``: requests x new tokens x context."""
        return f"{self.requests}x{self.tokens}x{self.context // 1024}K"


CONTEXT = 4096  # tokens per request of the verify / draft benchmarks and the profile
DRAFT_BLOCK = 7  # K: the drafter's block size (the published M3 drafters')

# M3 serving sizes (every launch-policy branch at least once): K = 7 verification at 4K (the indexer's split path
# at 64 requests, its fused path at 512) and at 32K (the sparse pre-pass's longest union walks), decode at 16 (the
# engine's default slots), 64 and 512 requests and one 32K request alone (split-K at the chip's largest split
# count and its merge), a 512-token prefill chunk (the engine's max_num_batched_tokens: 32-token indexer tiles).
SERVING_BATCHES: tuple[Batch, ...] = (
    Batch("verify", 64, 8, CONTEXT),
    Batch("verify", 512, 8, CONTEXT),
    Batch("verify", 32, 8, 32768),
    Batch("verify", 64, 8, 32768),
    Batch("decode", 16, 1, CONTEXT),
    Batch("decode", 64, 1, CONTEXT),
    Batch("decode", 512, 1, CONTEXT),
    Batch("decode", 1, 1, 32768),
    Batch("prefill", 1, 512, CONTEXT),
)

# The attention kernels' benchmark (issue 6's targets are quoted at these).
ATTENTION_BATCHES: tuple[Batch, ...] = (
    Batch("verify", 512, 8, CONTEXT),
    Batch("decode", 512, 1, CONTEXT),
    Batch("verify", 1, 8, 32768),
)
ATTENTION_QUICK: tuple[Batch, ...] = (Batch("verify", 2, 4, 512),)  # a CPU smoke run, not a measurement

# The Qwen3-style DSpark drafter published for M3 (nvidia/MiniMax-M3-DSpark): its block and attention shape.
QWEN3_DRAFT = {"block": 8, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "window": 1024}

MOE_TOKENS = (512, 4096)  # tokens through one MoE layer: a verify step of 64 x 8, a 4K prefill
DRAFT_ROWS = (64, 512)  # draft rows R (K = DRAFT_BLOCK slots each)

# The per-op profile (issue 15): verify shapes (requests, new tokens per request) at CONTEXT.
PROFILE_VERIFY: tuple[tuple[int, int], ...] = ((64, 8), (256, 8), (512, 1), (512, 8))
TINY_VERIFY: tuple[tuple[int, int], ...] = ((4, 8), (8, 1))
TINY_CONTEXT = 128
TINY_DRAFT_ROWS = (4,)


@functools.lru_cache(maxsize=1)
def m3():
    """``MiniMaxM3Config.m3()``: the real model's widths."""
    from minimax_jax.config import MiniMaxM3Config

    return MiniMaxM3Config.m3()


def m3_attention() -> dict:
    """M3's attention at TP 1: query / KV heads, head dim, the page (the MSA block) and the indexer's top-k."""
    cfg = m3()
    return {"num_q_heads": cfg.num_attention_heads, "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "page": cfg.index_block_size, "topk": cfg.index_topk_blocks}


def m3_moe() -> dict:
    """M3's MoE layer: hidden size, experts, experts per token, the expert intermediate size, swigluoai."""
    cfg = m3()
    return {"hidden": cfg.hidden_size, "experts": cfg.num_local_experts, "top_k": cfg.num_experts_per_tok,
            "inter": cfg.intermediate_size, "swiglu": (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_beta)}
