"""Pallas (Triton lowering) kernels for ragged MSA decode, their pure-JAX references and ragged metadata.

One module per concern: ``indexer`` (ragged MSA top-k), ``sparse_attention`` (MSA block-sparse attention),
``paged_attention`` (dense paged attention), ``attention_walk`` (the walk both attention kernels share),
``grouped_gemm`` (the MoE experts' grouped GEMM and its dropless XLA fallback), ``mx_grouped_gemm`` (the same
over experts kept as MXFP4 / MXFP8, dequantized in registers), ``mx_formats`` (the MX formats' decoders), ``draft_attention`` (the DSpark
drafter's context attention; its entry point keeps the module's name, so it is not re-exported here),
``plan_ranking`` (the adaptive planner's ranking pass on the device; imported by its module path),
``tuning`` (chips, their detection and every kernel's launch tables and policies), ``metadata`` (ragged
metadata on the device), ``platform`` (interpret/compiled dispatch, deviceless lowering), ``_common`` (shared
helpers).
"""

from pallas_kernels import platform as platform  # installs the Triton deprecation filter
from pallas_kernels.grouped_gemm import (
    grouped_matmul,
    grouped_matmul_reference,
    grouped_matmul_xla,
    moe_ffn,
    moe_ffn_reference,
    moe_ffn_xla,
)
from pallas_kernels.indexer import (
    index_block_scores_reference,
    ragged_index_topk,
    ragged_index_topk_reference,
)
from pallas_kernels.metadata import query_lens, token_positions, token_to_request
from pallas_kernels.mx_grouped_gemm import (
    mx_grouped_matmul,
    mx_grouped_matmul_reference,
    mx_grouped_matmul_xla,
    mx_moe_ffn,
    mx_moe_ffn_reference,
    mx_moe_ffn_xla,
)
from pallas_kernels.paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.sparse_attention import ragged_sparse_attention, ragged_sparse_attention_reference
from pallas_kernels.tuning import (
    CHIPS,
    AttentionLaunchConfig,
    GroupedMatmulLaunchConfig,
    IndexerLaunchConfig,
    detect_chip,
    grouped_matmul_launch_config,
    indexer_launch_config,
    mx_grouped_matmul_launch_config,
    paged_attention_launch_config,
    sparse_attention_launch_config,
)

__all__ = [
    "CHIPS",
    "AttentionLaunchConfig",
    "GroupedMatmulLaunchConfig",
    "IndexerLaunchConfig",
    "detect_chip",
    "grouped_matmul",
    "grouped_matmul_launch_config",
    "grouped_matmul_reference",
    "grouped_matmul_xla",
    "index_block_scores_reference",
    "indexer_launch_config",
    "moe_ffn",
    "moe_ffn_reference",
    "moe_ffn_xla",
    "mx_grouped_matmul",
    "mx_grouped_matmul_launch_config",
    "mx_grouped_matmul_reference",
    "mx_grouped_matmul_xla",
    "mx_moe_ffn",
    "mx_moe_ffn_reference",
    "mx_moe_ffn_xla",
    "paged_attention_launch_config",
    "query_lens",
    "ragged_index_topk",
    "ragged_index_topk_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_sparse_attention",
    "ragged_sparse_attention_reference",
    "sparse_attention_launch_config",
    "token_positions",
    "token_to_request",
]
