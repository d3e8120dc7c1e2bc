"""Pallas (Triton lowering) kernels for ragged MSA decode, their pure-JAX references and ragged metadata."""

from pallas_kernels import platform as platform  # noqa: F401  (installs the Triton deprecation filter)
from pallas_kernels.metadata import query_lens, token_positions, token_to_request

__all__ = ["query_lens", "token_positions", "token_to_request"]

from pallas_kernels.indexer import (  # noqa: E402
    IndexerLaunchConfig,
    index_block_scores_reference,
    indexer_launch_config,
    ragged_index_topk,
    ragged_index_topk_reference,
)

__all__ += ["IndexerLaunchConfig", "index_block_scores_reference", "indexer_launch_config", "ragged_index_topk",
            "ragged_index_topk_reference"]

from pallas_kernels.paged_attention import (  # noqa: E402
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.sparse_attention import (  # noqa: E402
    AttentionLaunchConfig,
    attention_launch_config,
    ragged_sparse_attention,
    ragged_sparse_attention_reference,
)

__all__ += ["AttentionLaunchConfig", "attention_launch_config", "ragged_paged_attention",
            "ragged_paged_attention_reference", "ragged_sparse_attention", "ragged_sparse_attention_reference"]
