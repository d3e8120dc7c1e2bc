"""Kernel launch policy: one chip vocabulary, one chip detection, and every kernel's per-chip launch table.

Chips (each runs on one platform, ``"cuda"`` or ``"rocm"``):

* ``"hopper"``: NVIDIA H100 / H200 (sm_90). Every CUDA value below was measured on an H200
  (``docs/BENCHMARKS.md``, ``docs/kernels/*.md``).
* ``"ampere"``: any other NVIDIA GPU (Ampere, Ada, Blackwell): the indexer's conservative table, the Hopper
  attention tables; none of it measured on such a part.
* ``"cdna3"``: AMD MI300X / MI325X (gfx942); also AMD parts not named below. Set from compiled resources
  (``scripts/compile_kernels.py``: registers, LDS, spills, occupancy), not from timings on the hardware.
* ``"cdna4"``: AMD MI350X / MI355X (gfx950): cdna3's tables but the indexer's 2 stages (160 KiB of LDS); the same
  compiled-resource basis.

:func:`detect_chip` names the default device's chip (``None`` off GPU); :func:`resolve_chip` turns a kernel's
``chip=`` argument into a chip, ``DEFAULT_CHIP`` when there is no GPU (interpret mode then makes the launch
choices of the measured chip). The tables sit side by side in ``TABLES`` (one :class:`ChipTables` per chip:
the indexer, the sparse and the dense attention walks, the walks' tile pre-pass and split-K merge, the
MoE's grouped GEMM), ``PEAKS`` the roofline constants of the GPU models the benchmarks and the per-op profiler
quote against (:func:`detect_peak` names the default device's), and the policy functions (:func:`indexer_launch_config`,
:func:`sparse_attention_launch_config`, :func:`paged_attention_launch_config`,
:func:`grouped_matmul_launch_config`) turn static shapes and a chip into a launch config. Retune here, nowhere
else. Every in-kernel shape is a power of 2 and ``num_warps <= 16`` (AMD wavefronts are 64 lanes wide), so the
kernels stay portable.
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels._common import cdiv, next_pow2, num_tiles_bound
from pallas_kernels.mx_formats import BLOCK as MX_BLOCK  # elements per E8M0 scale
from pallas_kernels.platform import gpu_platform_name

# ------------------------------------------------------------------------------------------------------------
# Kernel limits the policies respect (and each kernel module's ``supports`` reports).
# ------------------------------------------------------------------------------------------------------------

# Triton's dot needs M, N and K of at least 16 when compiled (interpret mode has no such limit).
MIN_DOT_DIM = 16
# Input dtypes of the compiled kernels (interpret mode takes any floating dtype).
COMPILED_DTYPES = ("bfloat16", "float16", "float32")
# Tokens per sparse-attention tile: a union block's token mask is one int32.
MAX_SPARSE_BLOCK_Q = 32
# Entries of one sparse tile's selection list (block_q * next_pow2(topk)); the pre-pass compares them against a
# fixed number of (selection, block id) pairs per step, so the cap keeps its block-id chunks at >= 32 ids.
MAX_SELECTION_ENTRIES = 256

# ------------------------------------------------------------------------------------------------------------
# Chips and their detection.
# ------------------------------------------------------------------------------------------------------------

DEFAULT_CHIP = "hopper"

_HOPPER_KINDS = ("h100", "h200", "h800", "h20", "gh200")
_CDNA4_KINDS = ("gfx950", "mi350", "mi355")


def chip_for(platform: str, device_kind: str) -> str:
    """The chip of a GPU from its platform (``"cuda"`` / ``"rocm"``) and ``device_kind``."""
    kind = device_kind.lower()
    if platform == "cuda":
        return "hopper" if any(n in kind for n in _HOPPER_KINDS) else "ampere"
    if platform == "rocm":
        return "cdna4" if any(n in kind for n in _CDNA4_KINDS) else "cdna3"
    raise ValueError(f"platform must be 'cuda' or 'rocm', got {platform!r}")


def detect_chip() -> str | None:
    """The chip of JAX's default device; ``None`` without a GPU."""
    platform = gpu_platform_name()
    return None if platform is None else chip_for(platform, jax.devices()[0].device_kind)


def resolve_chip(chip: str | None) -> str:
    """A kernel's ``chip=`` argument: a chip of ``TABLES``; ``None`` = the default device's, or
    ``DEFAULT_CHIP`` without a GPU."""
    if chip is None:
        chip = detect_chip() or DEFAULT_CHIP
    if chip not in TABLES:
        raise ValueError(f"chip must be one of {sorted(TABLES)}, got {chip!r}")
    return chip


def chip_platform(chip: str) -> str:
    """``"cuda"`` or ``"rocm"``: the platform ``chip`` runs on (what ``platform.lower_for_gpu`` takes)."""
    return TABLES[resolve_chip(chip)].platform


def core_count(chip: str) -> int:
    """SMs (NVIDIA) / CUs (AMD) to fill: the device's own count when it is a ``chip`` that reports one, else
    the table's."""
    if detect_chip() == chip:
        count = getattr(jax.devices()[0], "core_count", None)
        if isinstance(count, int) and count > 0:
            return count
    return TABLES[chip].num_cores


# ------------------------------------------------------------------------------------------------------------
# Roofline constants of the GPU models the benchmarks and the profiler quote against.
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChipPeak:
    """Roofline constants of one GPU model: the HBM rate a roofline uses (achievable), the nominal (data sheet)
    one, and the dense bf16 tensor-core peak. ``chip``: its family in :data:`TABLES`."""

    name: str
    chip: str
    hbm_bytes_per_s: float
    hbm_nominal_bytes_per_s: float
    bf16_flops_per_s: float
    note: str = ""


PEAKS: dict[str, ChipPeak] = {
    "h200": ChipPeak("NVIDIA H200 SXM", "hopper", 4.3e12, 4.8e12, 989e12,
                     "achievable HBM: the 4.0-4.2 TB/s copy rates measured in docs/BENCHMARKS.md"),
    "h100": ChipPeak("NVIDIA H100 SXM", "hopper", 3.0e12, 3.35e12, 989e12, "achievable HBM assumed 0.9 x nominal"),
    "mi300x": ChipPeak("AMD MI300X", "cdna3", 4.3e12, 5.3e12, 1307e12, "achievable HBM assumed ~0.8 x nominal"),
}
DEFAULT_PEAK = "h200"


def detect_peak() -> str | None:
    """The :data:`PEAKS` key of the default device (by its ``device_kind``); ``None`` off GPU or for a model
    not listed."""
    if gpu_platform_name() is None:
        return None
    kind = jax.devices()[0].device_kind.lower().replace(" ", "")
    return next((key for key in PEAKS if key in kind), None)


# ------------------------------------------------------------------------------------------------------------
# Per-chip launch tables.
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IndexerTable:
    """``ragged_index_topk``'s knobs."""

    num_warps: int  # scoring kernel, for score tiles up to 4096 elements; doubled above
    num_stages: int  # software pipelining depth of the key loop
    programs_per_core: int  # resident programs to aim for when splitting the key range
    max_block_q: int  # largest query tile (prefill chunks)
    fused_max_elems: int  # largest pooled-score tile [block_q * H, max_blocks] kept in registers (fused)
    select_elems: int = 1024  # pooled scores per program of the split path's selection kernel
    long_context_blocks: int = 128  # from this many blocks per request on, split the key range ...
    long_context_splits: int = 4  # ... at least this many ways: ragged context lengths unbalance programs


@dataclasses.dataclass(frozen=True)
class WalkTile:
    """Launch settings of an attention walk for query tiles of at least ``min_rows`` rows."""

    min_rows: int
    num_warps: int
    num_stages: int
    block_k: int  # keys per step of the walk (a power-of-2 part of a page)


@dataclasses.dataclass(frozen=True)
class WalkTable:
    """One attention walk's knobs (sparse or dense paged attention)."""

    tiles: tuple[WalkTile, ...]  # largest min_rows first: the first a tile reaches applies
    smem_bytes: int  # budget for the query tile + num_stages K/V buffers; block_k is halved to fit
    max_splits: int  # split-K cap (partial outputs cost T * H_q * D * 4 bytes per split)
    max_rows: int = 128  # query rows per program (block_q * group)

    def tile(self, rows: int) -> WalkTile:
        return next((t for t in self.tiles if rows >= t.min_rows), self.tiles[-1])


@dataclasses.dataclass(frozen=True)
class PrepassTable:
    """The walks' tile (sparse: tile and union) pre-pass kernel."""

    num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class MergeTable:
    """The walks' split-K merge kernel."""

    block_rows: int = 32  # output rows per program
    num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class GemmTile:
    """Grouped-GEMM launch settings for groups of at least ``min_rows`` rows on average (rows per active
    group: ``num_rows / min(num_groups, num_rows)``)."""

    min_rows: int
    block_m: int  # rows per program (capped at next_pow2 of the mean group, at least 16)
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class GroupedGemmTable:
    """``grouped_gemm.grouped_matmul``'s knobs (the MoE's expert products)."""

    tiles: tuple[GemmTile, ...]  # largest min_rows first: the first a mean group reaches applies
    smem_bytes: int  # budget for num_stages x (row tile + weight tiles); block_k is halved to fit
    max_acc_elems: int = 16384  # fp32 accumulator elements per program (block_m x block_n x accumulators)
    programs_per_core: int = 2  # block_n is halved (down to 32) until live programs fill the chip this often
    group_m: int = 8  # row tiles of one group that sweep the weight columns together (L2 reuse of both)

    def tile(self, rows: int) -> GemmTile:
        return next((t for t in self.tiles if rows >= t.min_rows), self.tiles[-1])


# Grouped GEMM, from the H200 sweeps (scripts/bench_moe.py --sweep, M3 width, docs/BENCHMARKS.md). Decode-sized
# groups (tens of rows per expert: 2,048 pairs over 128 experts) are weight-read bound: a 32-row tile streams
# each expert's weights once, 4 stages deep (gate/up at 1.04x the weight-read floor). From 64 rows per expert
# (16,384 pairs) the tensor cores matter: 128 x 128 tiles on 8 warps (two fp32 accumulators of 128 x 128 with
# the fused gate/up: 128 registers a thread) took gate/up from 5.25 ms (64 x 128, 4 warps) to 3.54 ms, and
# 128 x 64 tiles 3.96 ms; hence the 32K-element accumulator budget.
_HOPPER_GEMM = GroupedGemmTable(
    tiles=(
        GemmTile(min_rows=64, block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
        GemmTile(min_rows=1, block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=4),
    ),
    smem_bytes=160 * 1024,
    max_acc_elems=32768,
)


# Dequantizing grouped GEMM (``pallas_kernels.mx_grouped_gemm``: MXFP4 / MXFP8 experts decoded in registers),
# from the H200 sweep (scripts/bench_moe.py --quantization, M3 width, uniform routing, 2026-12-01;
# docs/bench_results/moe_mxfp{4,8}_h200.json, docs/kernels/mx_grouped_gemm.md). The decode is ALU work per
# weight element and per row tile, so a weight tile must be decoded as few times as possible: at 2,048 pairs
# (16 rows per expert) 32-row tiles (one per expert) beat 16-row ones (MXFP4 gate/up 3.66 against 4.50 ms,
# MXFP8 2.26 against 2.68 ms); at 16,384 pairs 128 x 64 tiles on 8 warps were the fastest (MXFP4 7.36 ms, MXFP8
# 6.03 ms; 64 x 64 on 4 warps: 8.31 / 6.23 ms). ``block_k`` is a multiple of the 32-element scale block.
_HOPPER_MX_GEMM = GroupedGemmTable(
    tiles=(
        GemmTile(min_rows=64, block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3),
        GemmTile(min_rows=1, block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4),
    ),
    smem_bytes=160 * 1024,
    max_acc_elems=16384,
)


@dataclasses.dataclass(frozen=True)
class DraftAttentionTable:
    """The DSpark draft-attention kernel's knobs (``pallas_kernels.draft_attention``): one program per
    (request row, KV head, split) streams the row's context in ``block_s``-key steps for a query tile of
    ``K`` draft slots x the group's heads."""

    num_warps: int  # query tiles of max_rows rows; half of it (at least 4) for smaller tiles
    num_stages: int  # software pipelining depth of the context walk
    block_s: int  # context keys per step (power of 2, >= MIN_DOT_DIM); halved to fit smem_bytes
    max_rows: int  # query rows per program (slots x heads, padded to a power of 2): heads are split above it
    programs_per_core: int  # split the context when fewer programs than this many per core
    max_splits: int  # split-K cap
    smem_bytes: int  # budget for the query tile + num_stages K/V buffers


# Hopper, from the H200 sweep (scripts/bench_draft_attention.py, M3 draft shapes on the paged cache, K = 7, 4K
# context; docs/BENCHMARKS.md): a 128-row tile (8 slots x 16 heads at M3) reads each row's context once per KV
# head. Whole-page steps (128 keys) cut 512 rows from 2.08 to 1.76 ms (64-key steps) and 64 rows from 0.32 to
# 0.27 ms: one page-id load per page. 8 warps, 3 stages (219 registers, 161 KiB of shared memory, no spills in the
# sm_90 compile). 4 warps with 64-key steps ran faster still (1.48 ms) but spill (255 registers), which the compile
# gate forbids; 4 warps with 32-key steps do not spill and took 1.93 ms.
# The budget is the block's 227 KiB: the model (queries + 3 stages of K and V, 224 KiB) is above what Triton
# allocates (161 KiB).
_HOPPER_DRAFT = DraftAttentionTable(num_warps=8, num_stages=3, block_s=128, max_rows=128, programs_per_core=2,
                                    max_splits=8, smem_bytes=227 * 1024)
# CDNA3 / CDNA4: untuned guesses in the spirit of the walk tables (2 stages, 32-key steps, 64 KiB LDS).
_CDNA3_DRAFT = DraftAttentionTable(num_warps=8, num_stages=2, block_s=32, max_rows=128, programs_per_core=2,
                                   max_splits=8, smem_bytes=64 * 1024)


@dataclasses.dataclass(frozen=True)
class ChipTables:
    platform: str  # "cuda" or "rocm"
    num_cores: int  # SMs / CUs; the device's own count is used when it reports one (core_count)
    indexer: IndexerTable
    sparse_attention: WalkTable
    paged_attention: WalkTable
    prepass: PrepassTable = PrepassTable()
    merge: MergeTable = MergeTable()
    grouped_gemm: GroupedGemmTable = _HOPPER_GEMM
    mx_grouped_gemm: GroupedGemmTable = _HOPPER_MX_GEMM
    draft_attention: DraftAttentionTable = _HOPPER_DRAFT


# Hopper walk tiles, from the H200 sweeps (docs/kernels/sparse_attention.md): the sparse walk is fastest in 64-row
# tiles (4 tokens x 16 heads: one warpgroup, 4 warps) with 32-key steps and 3 stages: ~166 registers and 49 KiB
# of shared memory, so several programs share an SM and one's softmax overlaps another's tensor-core work;
# 128-row tiles (8 warps, both warpgroups in lockstep at every barrier) are 1.13x slower there. Dense tiles read
# every block, where the doubled L2 traffic of 64-row tiles costs more than it saves (1.21x slower): 128 rows,
# 64-key steps, 5 stages (the page-id load, the K/V copy and the math each get a pipeline stage, two K/V steps
# in flight). Decode tiles (16 rows) are HBM-bound; 3 stages. 227 KiB of shared memory per block.
_HOPPER_TILES = (
    WalkTile(min_rows=128, num_warps=8, num_stages=5, block_k=64),
    WalkTile(min_rows=64, num_warps=4, num_stages=3, block_k=32),
    WalkTile(min_rows=16, num_warps=4, num_stages=3, block_k=64),
)
# Split-K: the merge kernel costs more per split than a short sparse walk gains (8 splits beat 11 and 32 at
# 1x8x32K); the long dense walk wants more.
_HOPPER_SPARSE = WalkTable(tiles=_HOPPER_TILES, smem_bytes=200 * 1024, max_splits=8, max_rows=64)
_HOPPER_DENSE = WalkTable(tiles=_HOPPER_TILES, smem_bytes=200 * 1024, max_splits=16, max_rows=128)

# CDNA3 (MI300X / MI325X, gfx942): 304 CUs of 4 SIMDs; 64-wide wavefronts, so 4 warps put one wave on each
# SIMD. Each SIMD has 512 VGPRs per lane, shared by a wave's arch VGPRs and AGPRs (MFMA accumulators):
# floor(512 / VGPRs) waves per SIMD, i.e. <= 256 VGPRs for 2 waves, <= 168 for 3, <= 128 for 4 (at most 8).
# 64 KiB of LDS per CU; Triton allocates a workgroup's LDS dynamically, so LLVM's occupancy ignores it and
# workgroups per CU = floor(64 KiB / LDS). No timing on the hardware yet: every value below is set from what
# the kernels compile to (pip triton 3.9 on a CPU, scripts/compile_kernels.py; the tables before / after are
# in docs/BENCHMARKS.md), with the rule that every kernel keeps >= 2 waves per SIMD without spills.
#
# * Indexer: the dot's B operand, one index-key page (128 keys x 128 dims bf16 = 32 KiB), is staged through
#   LDS for the v_mfma_f32_32x32x8_bf16 layout. Two stages add 512 B (33,280 B): one workgroup per CU, one wave
#   per SIMD. One stage keeps exactly 32 KiB: two workgroups per CU, 2 waves per SIMD (3 for the 8-warp
#   prefill tiles), and the second workgroup's page loads overlap the first's math, as the pipeline would.
#   8 warps for the 8-token verify tile (M = 32 rows) was worse: 198 VGPRs and 15 SGPRs spilled.
# * Walks: one tile row, 4 warps, 2 stages, 32-key steps. K + V of 32 keys x 2 stages are 32 KiB of LDS (two
#   workgroups per CU). The 128-row tile (8 tokens x 16 heads: verification, prefill) takes 238-240 VGPRs, 2
#   waves per SIMD: each wave owns 32 query rows (v_mfma_f32_32x32x8_bf16) and their 32 x 128 fp32 accumulator.
#   8 warps would fit 3 waves (161-166 VGPRs) but Triton then lays Q K^T out over [8, 1] waves, two waves per
#   32-row block: 96 v_mfma per wave where an even split gives 64 (4 warps: 128), 1.5x the matrix issue per
#   tile; 64-key steps spill. Kept at 4 warps until measured on an MI300X. 16-row decode tiles: 108-118 VGPRs, 16 KiB, 4
#   waves (v_mfma_f32_16x16x16_bf16).
# * Pre-pass: the sparse union walk compares the tile's [block_q, topk] selections with 64 block ids at a time
#   (8192 lanes); every compare result is a 64-bit lane mask in an SGPR pair, and at 4 warps (32 per lane)
#   the 8-token tiles of a 32K context spill 9-12 SGPRs (at the 102-SGPR limit). 16 warps: 72 SGPRs, no spill.
# * Merge: 16 rows per program. Each program loads all num_splits partial rows up front; at 32 rows x 16 splits
#   that is 221 VGPRs (2 waves), at 16 rows 113 (4 waves).
_CDNA3_WALK_TILES = (WalkTile(min_rows=16, num_warps=4, num_stages=2, block_k=32),)
_CDNA3 = ChipTables(
    platform="rocm",
    num_cores=304,
    indexer=IndexerTable(
        num_warps=4, num_stages=1, programs_per_core=2, max_block_q=32, fused_max_elems=8192
    ),
    sparse_attention=WalkTable(tiles=_CDNA3_WALK_TILES, smem_bytes=64 * 1024, max_splits=16),
    paged_attention=WalkTable(tiles=_CDNA3_WALK_TILES, smem_bytes=64 * 1024, max_splits=16),
    # Grouped GEMM: 2-stage pipelines kept well under the 64 KiB LDS of a CU (24 KiB per program).
    grouped_gemm=GroupedGemmTable(
        tiles=(
            GemmTile(min_rows=64, block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2),
            GemmTile(min_rows=1, block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=2),
        ),
        smem_bytes=24 * 1024,
        max_acc_elems=8192,
    ),
    # Dequantizing grouped GEMM: the bf16 table's tiles; block_k at least the 32-element scale block.
    mx_grouped_gemm=GroupedGemmTable(
        tiles=(
            GemmTile(min_rows=64, block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2),
            GemmTile(min_rows=1, block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=2),
        ),
        smem_bytes=24 * 1024,
        max_acc_elems=8192,
    ),
    draft_attention=_CDNA3_DRAFT,
    prepass=PrepassTable(num_warps=16),
    merge=MergeTable(block_rows=16, num_warps=4),
)
# CDNA4 (MI350X / MI355X, gfx950): 256 CUs, the same 512 VGPRs per SIMD lane, 160 KiB of LDS per CU and bf16
# MFMAs of twice the depth (v_mfma_f32_32x32x16_bf16 / 16x16x32_bf16). cdna3's tables, except the indexer keeps
# 2 stages: its pipelined page goes through 4-8 KiB of LDS on gfx950 (34 KiB for the 8-warp prefill tile, still
# 4 workgroups per CU) and registers allow 2-5 waves. The 128-row walk takes 220-222 VGPRs (2 waves) and the same
# 32 KiB of LDS; the pre-pass spills as on gfx942 at 4 warps.
_CDNA4 = dataclasses.replace(
    _CDNA3, num_cores=256, indexer=dataclasses.replace(_CDNA3.indexer, num_stages=2)
)

TABLES: dict[str, ChipTables] = {
    # Hopper: 132 SMs (H100 SXM / H200), 228 KiB shared memory per SM.
    "hopper": ChipTables(
        platform="cuda",
        num_cores=132,
        indexer=IndexerTable(
            num_warps=4, num_stages=3, programs_per_core=4, max_block_q=32, fused_max_elems=8192
        ),
        sparse_attention=_HOPPER_SPARSE,
        paged_attention=_HOPPER_DENSE,
    ),
    # Other NVIDIA parts (A100: 108 SMs): shallower indexer pipelines; the attention walks keep Hopper's tables
    # (their 200 KiB shared-memory budget is more than an A100 block gets: retune before serving there).
    "ampere": ChipTables(
        platform="cuda",
        num_cores=108,
        indexer=IndexerTable(
            num_warps=4, num_stages=2, programs_per_core=4, max_block_q=32, fused_max_elems=8192
        ),
        sparse_attention=_HOPPER_SPARSE,
        paged_attention=_HOPPER_DENSE,
    ),
    "cdna3": _CDNA3,
    "cdna4": _CDNA4,
}

CHIPS = tuple(TABLES)

# ------------------------------------------------------------------------------------------------------------
# Launch configs and the policy functions.
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IndexerLaunchConfig:
    """Static launch settings of one ``ragged_index_topk`` call.

    block_q: query tokens per program (power of 2; ``block_q * pow2(H)`` is the dot's M and must be >= 16).
    pages_per_step: key pages loaded and scored per loop iteration (power of 2).
    num_splits: programs sharing one query tile's key range; 1 selects the fused single-kernel path.
    num_warps / num_stages: Triton settings of the scoring kernel.
    select_rows: rows (token x head) per selection chunk of the split path's selection kernel (power of 2).
    select_num_warps: Triton warps of that selection kernel.
    """

    block_q: int = 8
    pages_per_step: int = 1
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3
    select_rows: int = 16
    select_num_warps: int = 4

    def validate(self) -> None:
        for name in ("block_q", "pages_per_step", "select_rows"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of 2, got {v}")
        if self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        for name in ("num_warps", "select_num_warps"):
            v = getattr(self, name)
            if v < 1 or v > 16 or v & (v - 1):  # <= 16: AMD wavefronts are 64 lanes wide
                raise ValueError(f"{name} must be a power of 2 in [1, 16], got {v}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


def indexer_launch_config(
    *,
    num_tokens: int,
    num_requests: int,
    num_heads: int,
    max_blocks: int,
    page_size: int,
    chip: str | None = None,
) -> IndexerLaunchConfig:
    """Launch settings from static shapes only (``T``, ``R``, ``H``, ``max_blocks``, page) and the chip."""
    chip = resolve_chip(chip)
    pol = TABLES[chip].indexer
    hp = next_pow2(num_heads)
    min_block_q = max(1, MIN_DOT_DIM // hp)  # the dot needs M >= 16
    avg_q = cdiv(max(num_tokens, 1), max(num_requests, 1))
    block_q = min(max(next_pow2(avg_q), min_block_q), max(pol.max_block_q, min_block_q))
    page_p2 = next_pow2(page_size)
    m = block_q * hp
    num_warps = pol.num_warps if m * page_p2 <= 4096 else 2 * pol.num_warps
    # Tiles that will hold tokens: one per request for short queries, else T / block_q.
    live_tiles = max(1, min(num_requests, num_tokens) if avg_q <= block_q else cdiv(num_tokens, block_q))
    target = core_count(chip) * pol.programs_per_core
    min_blocks_per_split = 4
    max_splits = max(1, cdiv(max_blocks, min_blocks_per_split))
    num_splits = max(1, min(target // live_tiles, max_splits))
    if max_blocks >= pol.long_context_blocks:
        # One program per request waits for the longest context; 4 splits cut the ragged 512 x 1..8 x <=32K
        # batch from 667 to 601 us on the H200 (docs/bench_results/indexer_h200.json).
        num_splits = max(num_splits, min(pol.long_context_splits, max_splits))
    if num_splits == 1 and m * next_pow2(max_blocks) > pol.fused_max_elems:
        num_splits = 2  # pooled scores too large for registers: go through the scratch + selection kernel
    # Selection is a chain of topk dependent row reductions: many small programs (about 1024 scores each, one
    # warp) finish it with the least latency.
    nb_p2 = next_pow2(max_blocks)
    select_rows = max(1, min(m, pol.select_elems // nb_p2))
    select_num_warps = min(4, max(1, select_rows * nb_p2 // pol.select_elems))
    # The dot's N is page x pages_per_step and must be >= 16: small pages are scored several at a time.
    pages_per_step = max(1, MIN_DOT_DIM // page_p2)
    return IndexerLaunchConfig(
        block_q=block_q,
        pages_per_step=pages_per_step,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=pol.num_stages,
        select_rows=select_rows,
        select_num_warps=select_num_warps,
    )


@dataclasses.dataclass(frozen=True)
class AttentionLaunchConfig:
    """Static launch settings of one sparse or dense attention call: the walk, its pre-pass and its merge."""

    block_q: int  # tokens of one request per program (power of 2)
    num_splits: int  # split-K programs per (request tile, KV head)
    num_warps: int
    num_stages: int
    block_k: int = 0  # keys per step (power of 2 dividing the page); 0: the whole page
    prepass_warps: int = 4  # warps of the tile (and union) pre-pass kernel
    merge_rows: int = 32  # output rows per program of the split-K merge kernel
    merge_warps: int = 4  # warps of the split-K merge kernel


def sparse_attention_launch_config(
    *,
    num_tokens: int,
    num_requests: int,
    num_q_heads: int,
    num_kv_heads: int,
    topk: int,
    max_blocks: int,
    page: int = 128,
    head_dim: int = 128,
    itemsize: int = 2,
    chip: str | None = None,
    block_q: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_k: int | None = None,
) -> AttentionLaunchConfig:
    """Launch settings of ``ragged_sparse_attention``; explicit arguments win over the policy.

    ``block_q``: the mean query length ``T / R`` rounded up to a power of 2, capped so that a tile has at most
    the table's ``max_rows`` query rows, at most ``MAX_SELECTION_ENTRIES`` selection entries and at most
    ``MAX_SPARSE_BLOCK_Q`` tokens. At M3 shapes on Hopper: decode gets 1-token tiles (16 rows), K = 7
    verification 4-token tiles (64 rows). The rest as in :func:`paged_attention_launch_config`, with a walk of
    at most ``min(max_blocks, block_q * topk)`` blocks.
    """
    return _attention_launch_config(
        "sparse_attention",
        topk=topk,
        chip=chip,
        num_tokens=num_tokens,
        num_requests=num_requests,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        max_blocks=max_blocks,
        page=page,
        head_dim=head_dim,
        itemsize=itemsize,
        block_q=block_q,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        block_k=block_k,
    )


def paged_attention_launch_config(
    *,
    num_tokens: int,
    num_requests: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_blocks: int,
    page: int = 128,
    head_dim: int = 128,
    itemsize: int = 2,
    chip: str | None = None,
    block_q: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_k: int | None = None,
) -> AttentionLaunchConfig:
    """Launch settings of ``ragged_paged_attention``; explicit arguments win over the policy.

    ``block_q``: the mean query length rounded up to a power of 2, capped at the table's ``max_rows`` query
    rows (M3 on Hopper: 8-token, 128-row verification tiles). ``num_warps``, ``num_stages``, ``block_k``: the
    table's ``WalkTile`` for the tile's row count; ``block_k`` is halved until the query tile and
    ``num_stages`` K/V buffers fit ``smem_bytes``. ``num_splits``: 1 when the tiles already fill the chip, else
    enough splits for about one program per core, at most ``max_splits``. Pre-pass and merge: the chip's tables.
    """
    return _attention_launch_config(
        "paged_attention",
        topk=None,
        chip=chip,
        num_tokens=num_tokens,
        num_requests=num_requests,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        max_blocks=max_blocks,
        page=page,
        head_dim=head_dim,
        itemsize=itemsize,
        block_q=block_q,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        block_k=block_k,
    )


def _attention_launch_config(
    kernel: str,
    *,
    topk: int | None,
    chip: str | None,
    num_tokens: int,
    num_requests: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_blocks: int,
    page: int,
    head_dim: int,
    itemsize: int,
    block_q: int | None,
    num_splits: int | None,
    num_warps: int | None,
    num_stages: int | None,
    block_k: int | None,
) -> AttentionLaunchConfig:
    """The walk policy of ``kernel`` (a ``WalkTable`` field of ``ChipTables``); ``topk`` is None for dense."""
    chip = resolve_chip(chip)
    tables = TABLES[chip]
    table: WalkTable = getattr(tables, kernel)
    group = num_q_heads // num_kv_heads
    if block_q is None:
        mean_q = cdiv(num_tokens, max(num_requests, 1))
        block_q = min(next_pow2(mean_q), max(1, table.max_rows // group))
        if topk is not None:
            block_q = min(block_q, max(1, MAX_SELECTION_ENTRIES // next_pow2(topk)), MAX_SPARSE_BLOCK_Q)
        block_q = max(1, min(block_q, next_pow2(num_tokens)))
    rows = max(16, next_pow2(block_q * group))
    tile = table.tile(rows)
    if num_splits is None:
        programs = num_tiles_bound(num_tokens, num_requests, block_q) * num_kv_heads
        cores = core_count(chip)
        walk = max_blocks if topk is None else min(max_blocks, block_q * topk)
        num_splits = 1 if programs >= cores else min(table.max_splits, cdiv(cores, programs), max(1, walk))
    if num_warps is None:
        num_warps = tile.num_warps
    if num_stages is None:
        num_stages = tile.num_stages
    if block_k is None:
        block_k = min(page, tile.block_k)
        q_bytes = rows * head_dim * itemsize
        while (
            block_k > 16 and q_bytes + max(num_stages, 1) * 2 * block_k * head_dim * itemsize > table.smem_bytes
        ):
            block_k //= 2
    return AttentionLaunchConfig(
        block_q=int(block_q),
        num_splits=int(num_splits),
        num_warps=int(num_warps),
        num_stages=int(num_stages),
        block_k=int(min(block_k, page)),
        prepass_warps=tables.prepass.num_warps,
        merge_rows=tables.merge.block_rows,
        merge_warps=tables.merge.num_warps,
    )


@dataclasses.dataclass(frozen=True)
class GroupedMatmulLaunchConfig:
    """Static launch settings of one ``grouped_gemm.grouped_matmul`` call (all sizes powers of 2).

    block_m: rows of one group per program; block_n: output columns per program (with the fused swigluoai:
    columns of the activation, i.e. of each half of the weights); block_k: reduction step; group_m: row tiles
    of one group that sweep the column tiles together (program order inside a group, for L2 reuse).
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8

    def validate(self) -> None:
        for name in ("block_m", "block_n", "block_k", "group_m"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of 2, got {v}")
        if self.num_warps < 1 or self.num_warps > 16 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of 2 in [1, 16], got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


def pow2_divisor(n: int) -> int:
    """The largest power of 2 dividing ``n`` (``n >= 1``): a block that tiles ``n`` exactly."""
    return int(n) & -int(n)


def grouped_matmul_launch_config(
    *,
    num_rows: int,
    num_groups: int,
    k: int,
    n: int,
    fused: bool = False,
    itemsize: int = 2,
    chip: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int | None = None,
) -> GroupedMatmulLaunchConfig:
    """Launch settings of a grouped matmul ``[num_rows, k] x [num_groups, k, n']``; explicit arguments win.

    ``n``: output columns (``fused``: the activation's, half the weight columns; two weight tiles and two
    accumulators per program). The table's ``GemmTile`` for the mean rows per active group
    (``num_rows / min(num_groups, num_rows)``); ``block_m`` at most ``next_pow2`` of 1.5 x that mean (most
    groups of a balanced routing then fit one row tile) and at least 16 (Triton's dot); ``block_k`` /
    ``block_n`` at most the largest powers of 2 dividing ``k`` / ``n`` (so no reduction or column mask is
    needed); ``block_n`` halved while the accumulators exceed ``max_acc_elems`` and while fewer than
    ``programs_per_core`` programs per core would hold rows; ``block_k`` halved until ``num_stages`` row and
    weight tiles fit ``smem_bytes``.
    """
    chip = resolve_chip(chip)
    return _gemm_launch_config(
        TABLES[chip].grouped_gemm, chip, num_rows=num_rows, num_groups=num_groups, k=k, n=n, fused=fused,
        row_bytes=itemsize, weight_bytes=itemsize, min_block_k=MIN_DOT_DIM, block_m=block_m, block_n=block_n,
        block_k=block_k, num_warps=num_warps, num_stages=num_stages, group_m=group_m,
    )


# Bytes per weight element of the MX formats in HBM (elements plus one E8M0 byte per 32 of them).
MX_WEIGHT_BYTES = {"mxfp4": 0.5 + 1 / 32, "mxfp8": 1 + 1 / 32}


def mx_grouped_matmul_launch_config(
    *,
    num_rows: int,
    num_groups: int,
    k: int,
    n: int,
    fmt: str,
    fused: bool = False,
    itemsize: int = 2,
    chip: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int | None = None,
) -> GroupedMatmulLaunchConfig:
    """Launch settings of the dequantizing grouped matmul (``mx_grouped_gemm``): rows ``[num_rows, k]`` of
    ``itemsize`` bytes against ``fmt`` (``"mxfp4"`` / ``"mxfp8"``) weights ``[num_groups, n', k]``; explicit
    arguments win. The policy of :func:`grouped_matmul_launch_config` on the chip's ``mx_grouped_gemm`` table,
    with the weight tiles' bytes of the format and ``block_k`` a multiple of the 32-element scale block."""
    if fmt not in MX_WEIGHT_BYTES:
        raise ValueError(f"fmt must be one of {tuple(MX_WEIGHT_BYTES)}, got {fmt!r}")
    chip = resolve_chip(chip)
    return _gemm_launch_config(
        TABLES[chip].mx_grouped_gemm, chip, num_rows=num_rows, num_groups=num_groups, k=k, n=n, fused=fused,
        row_bytes=itemsize, weight_bytes=MX_WEIGHT_BYTES[fmt], min_block_k=MX_BLOCK, block_m=block_m,
        block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages, group_m=group_m,
    )


def _gemm_launch_config(
    table: GroupedGemmTable, chip: str, *, num_rows, num_groups, k, n, fused, row_bytes, weight_bytes,
    min_block_k, block_m, block_n, block_k, num_warps, num_stages, group_m,
) -> GroupedMatmulLaunchConfig:
    """The grouped GEMM policy (:func:`grouped_matmul_launch_config`) on one table: ``row_bytes`` /
    ``weight_bytes`` per element of a row tile / weight tile; the shared-memory fit never halves ``block_k``
    below ``min_block_k``."""
    mats = 2 if fused else 1
    active = max(1, min(num_groups, num_rows))
    mean = cdiv(max(num_rows, 1), active)
    tile = table.tile(mean)
    if block_m is None:  # 1.5x the mean: most groups of a balanced routing fit one row tile
        block_m = max(MIN_DOT_DIM, min(tile.block_m, next_pow2(cdiv(3 * mean, 2))))
    if num_warps is None:
        num_warps = tile.num_warps
    if num_stages is None:
        num_stages = tile.num_stages
    if block_n is None:
        block_n = min(tile.block_n, pow2_divisor(n))
        while block_n > MIN_DOT_DIM and block_m * block_n * mats > table.max_acc_elems:
            block_n //= 2
        programs = active * cdiv(mean, block_m) * cdiv(n, block_n)
        while block_n > 32 and programs < table.programs_per_core * core_count(chip):
            block_n //= 2
            programs *= 2
    if block_k is None:
        block_k = min(tile.block_k, pow2_divisor(k))
        tile_bytes = block_m * row_bytes + mats * block_n * weight_bytes  # per unit of block_k
        while block_k > min_block_k and num_stages * tile_bytes * block_k > table.smem_bytes:
            block_k //= 2
    return GroupedMatmulLaunchConfig(
        block_m=int(block_m),
        block_n=int(block_n),
        block_k=int(block_k),
        num_warps=int(num_warps),
        num_stages=int(num_stages),
        group_m=int(table.group_m if group_m is None else group_m),
    )


@dataclasses.dataclass(frozen=True)
class DraftAttentionLaunchConfig:
    """Static launch settings of one ``pallas_kernels.draft_attention`` call.

    block_h: query heads of the KV group per program (the tile is ``K`` slots x ``block_h`` heads);
    block_s: context keys per step; num_splits: programs sharing one (row, KV head, head chunk)'s context
    (split-K, then the walks' merge kernel); num_warps / num_stages: Triton settings of the walk.
    """

    block_h: int
    block_s: int
    num_splits: int
    num_warps: int
    num_stages: int
    merge_rows: int = 32
    merge_warps: int = 4


def draft_attention_rows(block_size: int, block_h: int) -> int:
    """Query rows of one draft-attention program: ``K`` slots x ``block_h`` heads, a power of 2 >= 16."""
    return max(MIN_DOT_DIM, next_pow2(block_size * block_h))


def draft_attention_launch_config(
    *,
    num_rows: int,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    capacity: int,
    page_size: int,
    head_dim: int = 128,
    itemsize: int = 2,
    chip: str | None = None,
    block_h: int | None = None,
    block_s: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> DraftAttentionLaunchConfig:
    """Launch settings of the draft-attention kernel from static shapes; explicit arguments win.

    ``block_h``: the group's heads, halved while the ``K x block_h`` tile exceeds the table's ``max_rows``
    (M3, K = 7: all 16 heads, 128 rows). ``num_warps``: the table's for a full tile, half of it (at least 4)
    below. ``block_s``: the table's, halved (down to 16) until the query tile and ``num_stages`` K/V steps fit
    ``smem_bytes``, at most the capacity (or 16) and at most the page (a step is part of one page:
    ``page_size``, a power of 2, the draft cache's page). ``num_splits``: 1 when ``R x H_kv x head chunks``
    programs reach ``programs_per_core`` per core, else enough to get there, at most ``max_splits`` and the
    context's steps (the lengths are not static: the capacity bounds them).
    """
    chip = resolve_chip(chip)
    tables = TABLES[chip]
    pol = tables.draft_attention
    group = num_q_heads // num_kv_heads
    if block_h is None:
        block_h = group
        while block_h > 1 and draft_attention_rows(block_size, block_h) > pol.max_rows:
            block_h = (block_h + 1) // 2
    rows = draft_attention_rows(block_size, block_h)
    if num_warps is None:
        num_warps = pol.num_warps if rows >= pol.max_rows else max(4, pol.num_warps // 2)
    if num_stages is None:
        num_stages = pol.num_stages
    if block_s is None:
        block_s = min(pol.block_s, max(MIN_DOT_DIM, next_pow2(capacity + 1) // 2))  # a power of 2 <= capacity
        q_bytes = rows * head_dim * itemsize
        kv_step = 2 * head_dim * itemsize  # one key and one value
        while block_s > MIN_DOT_DIM and q_bytes + max(num_stages, 1) * block_s * kv_step > pol.smem_bytes:
            block_s //= 2
        block_s = min(block_s, page_size)
    if num_splits is None:
        programs = num_rows * num_kv_heads * cdiv(group, block_h)
        target = core_count(chip) * pol.programs_per_core
        steps = max(1, cdiv(capacity, block_s))
        num_splits = 1 if programs >= target else min(pol.max_splits, cdiv(target, programs), steps)
    return DraftAttentionLaunchConfig(
        block_h=int(block_h),
        block_s=int(block_s),
        num_splits=int(num_splits),
        num_warps=int(num_warps),
        num_stages=int(num_stages),
        merge_rows=tables.merge.block_rows,
        merge_warps=tables.merge.num_warps,
    )
