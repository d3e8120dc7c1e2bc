"""The kernel launch policy: one chip vocabulary, its detection, the per-chip tables and the launches they give."""

from __future__ import annotations

import dataclasses

import pytest

from pallas_kernels import tuning
from pallas_kernels.tuning import (
    CHIPS,
    TABLES,
    IndexerTable,
    MergeTable,
    PrepassTable,
    WalkTable,
    WalkTile,
    chip_for,
    indexer_launch_config,
    paged_attention_launch_config,
    sparse_attention_launch_config,
)


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@pytest.mark.parametrize(
    "platform, kind, chip",
    [
        ("cuda", "NVIDIA H200", "hopper"),
        ("cuda", "NVIDIA H100 80GB HBM3", "hopper"),
        ("cuda", "NVIDIA GH200 480GB", "hopper"),
        ("cuda", "NVIDIA A100-SXM4-80GB", "ampere"),
        ("cuda", "NVIDIA B200", "ampere"),
        ("rocm", "AMD Instinct MI300X", "cdna3"),
        ("rocm", "gfx942", "cdna3"),
        ("rocm", "AMD Instinct MI250X", "cdna3"),
        ("rocm", "AMD Instinct MI355X", "cdna4"),
        ("rocm", "gfx950", "cdna4"),
    ],
)
def test_chip_of_a_device(platform, kind, chip):
    assert chip_for(platform, kind) == chip
    assert tuning.chip_platform(chip) == platform


def test_one_vocabulary():
    assert set(CHIPS) == {"hopper", "ampere", "cdna3", "cdna4"}
    assert tuning.detect_chip() is None  # the test machine has no GPU
    assert tuning.resolve_chip(None) == tuning.DEFAULT_CHIP == "hopper"
    for old in ("cuda", "rocm", "default"):  # the names the kernels used to take
        with pytest.raises(ValueError, match="chip must be one of"):
            tuning.resolve_chip(old)
    with pytest.raises(ValueError, match="platform"):
        chip_for("tpu", "TPU v5")
    assert tuning.core_count("cdna4") == 256 and tuning.core_count("hopper") == 132  # no device: the tables'


def test_hopper_tables_keep_the_h200_measurements():
    """The values measured on the H200 (docs/BENCHMARKS.md, docs/kernels/*.md), unchanged."""
    hopper = TABLES["hopper"]
    assert hopper.platform == "cuda" and hopper.num_cores == 132
    assert hopper.indexer == IndexerTable(
        num_warps=4, num_stages=3, programs_per_core=4, max_block_q=32, fused_max_elems=8192,
        select_elems=1024, long_context_blocks=128, long_context_splits=4,
    )
    tiles = (WalkTile(128, 8, 5, 64), WalkTile(64, 4, 3, 32), WalkTile(16, 4, 3, 64))
    assert hopper.sparse_attention == WalkTable(tiles, smem_bytes=200 * 1024, max_splits=8, max_rows=64)
    assert hopper.paged_attention == WalkTable(tiles, smem_bytes=200 * 1024, max_splits=16, max_rows=128)
    assert hopper.prepass == PrepassTable(num_warps=4)
    assert hopper.merge == MergeTable(block_rows=32, num_warps=4)
    # MoE experts (scripts/bench_moe.py --sweep): 32-row tiles at 2,048 pairs over 128 experts, 128 x 128 on 8 warps
    # at 16,384 (both the fused gate/up and the down product)
    gemm = [tuning.grouped_matmul_launch_config(num_rows=pairs, num_groups=128, k=k, n=3072 if fused else 6144,
                                                fused=fused, chip="hopper")
            for pairs in (2048, 16384) for fused, k in ((True, 6144), (False, 3072))]
    assert [(c.block_m, c.block_n, c.num_warps) for c in gemm] == [(32, 128, 4)] * 2 + [(128, 128, 8)] * 2


def test_rocm_tables_keep_the_compiled_resource_settings():
    """cdna3 / cdna4 values chosen from compiled resources (docs/BENCHMARKS.md, "AMD compile gate"; the gate
    itself is tests/test_compile_kernels.py): gfx942's indexer at 1 stage (32 KiB of LDS, 2 workgroups per CU),
    a 16-warp pre-pass (no SGPR spill), a 16-row merge; gfx950 keeps the indexer's 2 stages."""
    cdna3, cdna4 = TABLES["cdna3"], TABLES["cdna4"]
    assert (cdna3.indexer.num_stages, cdna4.indexer.num_stages) == (1, 2)
    assert cdna3.prepass == cdna4.prepass == PrepassTable(num_warps=16)
    assert cdna3.merge == cdna4.merge == MergeTable(block_rows=16, num_warps=4)
    assert cdna3.sparse_attention == cdna4.sparse_attention and cdna3.paged_attention == cdna4.paged_attention
    assert (cdna3.num_cores, cdna4.num_cores) == (304, 256)


@pytest.mark.parametrize("chip", CHIPS)
def test_tables_are_portable(chip):
    """Power-of-2 shapes, at most 16 warps (AMD wavefronts are 64 lanes), every tile height covered."""
    tables = TABLES[chip]
    assert tables.platform in ("cuda", "rocm") and tables.num_cores > 0
    for walk in (tables.sparse_attention, tables.paged_attention):
        assert [t.min_rows for t in walk.tiles] == sorted((t.min_rows for t in walk.tiles), reverse=True)
        assert walk.tiles[-1].min_rows <= 16  # the smallest query tile has 16 rows
        for tile in walk.tiles:
            assert _pow2(tile.num_warps) and tile.num_warps <= 16 and tile.num_stages >= 1
            assert _pow2(tile.block_k) and tile.block_k >= tuning.MIN_DOT_DIM
        assert _pow2(walk.max_rows) and walk.max_splits >= 1 and walk.smem_bytes > 0
    assert _pow2(tables.merge.block_rows) and tables.merge.num_warps <= 16
    assert tables.prepass.num_warps <= 16
    assert tables.indexer.num_warps * 2 <= 16  # doubled for large score tiles


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("num_tokens, num_requests, max_blocks", [(4096, 512, 32), (512, 512, 32), (8, 1, 256),
                                                                  (8192, 1, 64), (3, 7, 5)])
def test_every_chip_gives_valid_launches(chip, num_tokens, num_requests, max_blocks):
    m3 = {"num_tokens": num_tokens, "num_requests": num_requests, "num_q_heads": 64, "num_kv_heads": 4,
          "max_blocks": max_blocks, "page": 128, "head_dim": 128, "itemsize": 2, "chip": chip}
    for config in (sparse_attention_launch_config(topk=16, **m3), paged_attention_launch_config(**m3)):
        assert _pow2(config.block_q) and config.num_splits >= 1
        assert _pow2(config.num_warps) and config.num_warps <= 16
        assert _pow2(config.block_k) and 128 % config.block_k == 0 and config.block_k >= tuning.MIN_DOT_DIM
        tables = TABLES[chip]
        assert (config.prepass_warps, config.merge_rows, config.merge_warps) == (
            tables.prepass.num_warps, tables.merge.block_rows, tables.merge.num_warps
        )
    sparse = sparse_attention_launch_config(topk=16, **m3)
    assert sparse.block_q <= tuning.MAX_SPARSE_BLOCK_Q
    assert sparse.block_q * 16 <= tuning.MAX_SELECTION_ENTRIES
    indexer_launch_config(
        num_tokens=num_tokens, num_requests=num_requests, num_heads=4, max_blocks=max_blocks, page_size=128,
        chip=chip,
    ).validate()


def test_walk_policy_shrinks_steps_to_the_shared_memory_budget(monkeypatch):
    """``block_k`` is halved until the query tile and ``num_stages`` K/V buffers fit ``smem_bytes``."""
    shape = {"num_tokens": 4096, "num_requests": 512, "num_q_heads": 64, "num_kv_heads": 4, "max_blocks": 32}
    # 8 tokens x 16 heads = 128 rows x 128 x 2 B = 32 KiB of queries; 2 stages x (K + V) x 32 keys x 256 B = 32 KiB.
    config = paged_attention_launch_config(chip="cdna3", **shape)
    assert (config.block_q, config.num_stages, config.block_k) == (8, 2, 32)
    small = dataclasses.replace(TABLES["cdna3"].paged_attention, smem_bytes=48 * 1024)
    monkeypatch.setitem(TABLES, "cdna3", dataclasses.replace(TABLES["cdna3"], paged_attention=small))
    assert paged_attention_launch_config(chip="cdna3", **shape).block_k == 16
