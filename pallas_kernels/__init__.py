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
