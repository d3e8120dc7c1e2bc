"""Ahead-of-time compile check: every Pallas kernel compiled for AMD (gfx942, gfx950) and NVIDIA (sm_90) on a
CPU, with its registers, LDS / shared memory, spills and occupancy.

The CPU suite runs the kernels in Pallas interpret mode, which says nothing about how they compile: a kernel can
spill registers, need more LDS than a CU has or run one wave per SIMD, and only a GPU run would show it. This
module compiles the real Triton kernels without a GPU:

1. Each kernel entry point is lowered deviceless (``platform.lowered_for_gpu``) with one chip's launch tables
   (``tuning``). Every Pallas kernel becomes a ``__gpu$xla.gpu.triton`` custom call whose backend config holds
   the kernel's Triton IR as MLIR bytecode (``ir``) beside ``name``, ``num_warps``, ``num_stages`` and the grid.
2. The pip ``triton`` wheel pinned with jax (``pip install '.[amd]'``: same LLVM / MLIR generation as
   jaxlib's Triton dialect, so it reads that bytecode) runs its backend's stages on the IR: for
   ``GPUTarget("hip", "gfx942" | "gfx950", 64)`` ``make_ttir``, ``make_ttgir``, ``make_llir``, ``make_amdgcn``
   and ``make_hsaco`` (a linked code object; lld lives inside libtriton), for ``GPUTarget("cuda", 90, 32)``
   ``make_ttir`` .. ``make_ptx`` and the wheel's own ``ptxas -v``.
3. Resources: AMD registers and spills from the AMDGCN's kernel-info comments and code-object metadata, LDS
   from Triton's shared-memory size (``metadata["shared"]``: Triton allocates LDS dynamically, so LLVM's own
   occupancy figure ignores it); NVIDIA registers and spills from ``ptxas -v``, shared memory from Triton.
   Occupancy combines both limits (:func:`amd_occupancy`, :func:`cuda_occupancy`).

The figures are close to, not exactly, what runs: at run time XLA compiles the same IR with its own pinned
Triton and pass pipeline. On ROCm that pipeline mirrors Triton's ``make_ttgir`` with asynchronous copies off
(``xla/backends/gpu/codegen/triton/compilation_pipeline_rocm.cc``), which :func:`compile_kernel` mirrors.

Adding a kernel to the check is one entry in :data:`KERNELS`: a name and a function from a serving
:class:`Batch` to the call to lower. ``scripts/compile_kernels.py`` prints the table and writes JSON;
``tests/test_compile_kernels.py`` fails on a compile error, a spill, or fewer than 2 waves per SIMD on AMD.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.platform import lowered_for_gpu
from pallas_kernels.tuning import chip_platform
from scripts.bench_shapes import DRAFT_BLOCK, QWEN3_DRAFT, SERVING_BATCHES, Batch

__all__ = [
    "BATCHES",
    "GATE_CASES",
    "KERNELS",
    "PINNED_JAX",
    "PINNED_TRITON",
    "TARGETS",
    "Batch",
    "Case",
    "KernelCall",
    "KernelReport",
    "Target",
    "TritonKernel",
    "all_cases",
    "amd_occupancy",
    "compile_all",
    "compile_kernel",
    "cuda_occupancy",
    "problems",
    "toolchain_unavailable",
    "triton_kernels",
]

# The versions whose Triton IR bytecode and LLVM generation match (pyproject's ``amd`` extra).
PINNED_JAX = "0.12.0.1"
PINNED_TRITON = "3.9.0"

_TRITON_CALL = "__gpu$xla.gpu.triton"


def toolchain_unavailable() -> str | None:
    """Why the compile check cannot run here (``None`` when it can): triton missing or not the pinned pair."""
    if jax.__version__ != PINNED_JAX:
        return f"jax {jax.__version__} is not the pinned {PINNED_JAX} (pip install '.[amd]')"
    try:
        import triton
    except ImportError:
        return f"triton is not installed (pip install '.[amd]' for triton=={PINNED_TRITON})"
    if triton.__version__ != PINNED_TRITON:
        return f"triton {triton.__version__} is not the pinned {PINNED_TRITON} (pip install '.[amd]')"
    return None


# ------------------------------------------------------------------------------------------------------------
# Targets: a GPU architecture, the chip whose launch tables drive it, and its occupancy limits.
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # "gfx942", "gfx950", "sm_90"
    chip: str  # the tuning chip whose tables the kernels are lowered with
    backend: str  # "hip" or "cuda"
    arch: str | int  # Triton's GPUTarget arch
    warp_size: int
    shared_per_core: int  # LDS per CU / shared memory per SM, bytes
    max_shared_per_block: int  # largest LDS / shared-memory allocation of one workgroup / block
    max_waves: int  # AMD: waves per SIMD; NVIDIA: warps per SM
    max_blocks: int  # AMD: workgroups of more than one wave per CU (barriers); NVIDIA: blocks per SM


TARGETS: tuple[Target, ...] = (
    # CDNA3 / CDNA4: 4 SIMDs per CU, 512 unified VGPRs (arch + AGPR) per lane and SIMD, 8 waves per SIMD, 16
    # barriers (workgroups of 2+ waves) per CU; 64 KiB LDS per CU on gfx942, 160 KiB on gfx950.
    Target("gfx942", "cdna3", "hip", "gfx942", 64, 64 * 1024, 64 * 1024, 8, 16),
    Target("gfx950", "cdna4", "hip", "gfx950", 64, 160 * 1024, 160 * 1024, 8, 16),
    # Hopper: 64K 32-bit registers, 64 warps, 32 blocks and 228 KiB shared memory per SM (227 KiB per block,
    # 1 KiB per block reserved by the runtime).
    Target("sm_90", "hopper", "cuda", 90, 32, 228 * 1024, 227 * 1024, 64, 32),
)

_AMD_SIMDS_PER_CU = 4
_AMD_LDS_GRANULE = 512  # gfx9 allocates LDS in 128-dword blocks (assumed for gfx950 as well)
_CUDA_REGS_PER_SM = 64 * 1024
_CUDA_REG_GRANULE = 256  # registers are allocated per warp in 256-register units
_CUDA_RESERVED_SHARED = 1024


def amd_occupancy(*, register_waves: int, shared: int, num_warps: int, target: Target) -> tuple[int, str]:
    """Waves per SIMD and what limits them: LLVM's register occupancy (VGPRs incl. AGPRs, SGPRs; LLVM sees no
    LDS because Triton allocates it dynamically), the LDS (``floor(LDS per CU / shared)`` workgroups, their
    ``num_warps`` waves spread over the CU's 4 SIMDs), the workgroups per CU (16 barriers for workgroups of more
    than one wave) and the 8-wave cap. Ties name the first of that order."""
    if shared > target.max_shared_per_block:
        return 0, "LDS"

    def per_simd(groups: int) -> int:
        return max(1, groups * num_warps // _AMD_SIMDS_PER_CU)

    limits = {"registers": register_waves}
    if shared:
        granules = -(-shared // _AMD_LDS_GRANULE)
        limits["LDS"] = per_simd(target.shared_per_core // (granules * _AMD_LDS_GRANULE))
    if num_warps > 1:
        limits["workgroups"] = per_simd(target.max_blocks)
    limits["waves"] = target.max_waves
    waves = min(limits.values())
    return waves, next(k for k, v in limits.items() if v == waves)


def cuda_occupancy(*, registers: int, shared: int, num_warps: int, target: Target) -> tuple[int, int, str]:
    """``(warps per SM, blocks per SM, limiter)`` from registers per thread and shared memory per block."""
    if shared > target.max_shared_per_block:
        return 0, 0, "shared"
    per_warp = -(-max(registers, 1) * 32 // _CUDA_REG_GRANULE) * _CUDA_REG_GRANULE
    limits = {
        "registers": (_CUDA_REGS_PER_SM // per_warp) // num_warps,
        "shared": target.shared_per_core // (shared + _CUDA_RESERVED_SHARED),
        "warps": target.max_waves // num_warps,
        "blocks": target.max_blocks,
    }
    blocks = min(limits.values())
    return blocks * num_warps, blocks, next(k for k, v in limits.items() if v == blocks)


# ------------------------------------------------------------------------------------------------------------
# What to compile: serving batches x kernel entry points, at M3 shapes.
# ------------------------------------------------------------------------------------------------------------


# The serving batches are declared once, for the benchmarks, the profiler and this gate (scripts/bench_shapes.py).
BATCHES: tuple[Batch, ...] = SERVING_BATCHES


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One call to lower: ``fn(*args, chip=chip, interpret=False, **kwargs)`` (``args``: ShapeDtypeStructs)."""

    fn: Callable
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict, hash=False)


def _m3():
    from scripts.bench_shapes import m3

    return m3()


def _page(cfg) -> int:
    from minimax_jax.cache import page_size_for

    return page_size_for(cfg)  # the paged K/V and index-key caches' page: the MSA block (128 for M3)


def _ragged(batch: Batch, page: int):
    """Block tables, seq_lens and query_start_loc of ``batch`` (one private page per block, page 0 spare)."""
    s = jax.ShapeDtypeStruct
    r, blocks = batch.requests, -(-batch.context // page)
    return (
        r * blocks + 1,
        (s((r, blocks), jnp.int32), s((r,), jnp.int32), s((r + 1,), jnp.int32)),
    )


def _indexer_call(batch: Batch) -> KernelCall:
    from pallas_kernels.indexer import ragged_index_topk

    cfg = _m3()
    s, page = jax.ShapeDtypeStruct, _page(cfg)
    pages, meta = _ragged(batch, page)
    t = batch.requests * batch.tokens
    args = (
        s((t, cfg.index_n_heads, cfg.index_head_dim), jnp.bfloat16),
        s((pages, page, cfg.index_head_dim), jnp.bfloat16),
        *meta,
    )
    kwargs = {"topk": cfg.index_topk_blocks, "local_blocks": cfg.index_local_blocks}
    return KernelCall(ragged_index_topk, args, kwargs)


def _attention_args(batch: Batch):
    cfg = _m3()
    s, page = jax.ShapeDtypeStruct, _page(cfg)
    pages, meta = _ragged(batch, page)
    t = batch.requests * batch.tokens
    cache = s((cfg.num_key_value_heads, pages, page, cfg.head_dim), jnp.bfloat16)
    q = s((t, cfg.num_attention_heads, cfg.head_dim), jnp.bfloat16)
    return cfg, (q, cache, cache, *meta), {"scale": cfg.head_dim**-0.5}


def _sparse_attention_call(batch: Batch) -> KernelCall:
    from pallas_kernels.sparse_attention import ragged_sparse_attention

    cfg, args, kwargs = _attention_args(batch)
    t = batch.requests * batch.tokens
    selection = jax.ShapeDtypeStruct((t, cfg.num_key_value_heads, cfg.index_topk_blocks), jnp.int32)
    return KernelCall(ragged_sparse_attention, (*args, selection), kwargs)


def _paged_attention_call(batch: Batch) -> KernelCall:
    from pallas_kernels.paged_attention import ragged_paged_attention

    _, args, kwargs = _attention_args(batch)
    return KernelCall(ragged_paged_attention, args, kwargs)


# The sliding window of the windowed attention variants (a windowed target's layers): static, so its value only
# sets constants; not a multiple of the 128-key page, as a window usually is not.
ATTENTION_WINDOW = 4000


def _windowed(make: Callable[[Batch], KernelCall]) -> Callable[[Batch], KernelCall]:
    """``make``'s call with the sliding window ``ATTENTION_WINDOW`` (dense / MSA attention of a windowed target)."""

    def windowed(batch: Batch) -> KernelCall:
        call = make(batch)
        return dataclasses.replace(call, kwargs={**call.kwargs, "window": ATTENTION_WINDOW})

    return windowed


def _moe_ffn_call(batch: Batch, *, experts: int | None = None) -> KernelCall:
    """The routed experts of one M3 MoE layer over the batch's tokens (gate/up with swigluoai, then down)."""
    from minimax_jax.layers import swiglu_params
    from pallas_kernels.grouped_gemm import moe_ffn

    cfg = _m3()
    s = jax.ShapeDtypeStruct
    e = cfg.num_local_experts if experts is None else experts
    pairs = batch.requests * batch.tokens * cfg.num_experts_per_tok
    d, i = cfg.hidden_size, cfg.intermediate_size
    args = (s((pairs, d), jnp.bfloat16), s((e, d, 2 * i), jnp.bfloat16), s((e, i, d), jnp.bfloat16),
            s((e,), jnp.int32))
    return KernelCall(moe_ffn, args, {"swiglu": swiglu_params(cfg), "implementation": "pallas"})


def _mx_moe_ffn_call(batch: Batch, *, fmt: str) -> KernelCall:
    """The routed experts of one M3 MoE layer kept quantized (``fmt``: ``"mxfp4"`` / ``"mxfp8"``, E8M0 scales
    per 32 input columns), bf16 rows: the dequantizing gate/up with swigluoai, then down."""
    from minimax_jax.layers import swiglu_params
    from pallas_kernels.mx_grouped_gemm import mx_moe_ffn

    cfg = _m3()
    s = jax.ShapeDtypeStruct
    e = cfg.num_local_experts
    pairs = batch.requests * batch.tokens * cfg.num_experts_per_tok
    d, i = cfg.hidden_size, cfg.intermediate_size
    pack, elem = (2, jnp.uint8) if fmt == "mxfp4" else (1, jnp.float8_e4m3fn)
    args = (s((pairs, d), jnp.bfloat16), s((e, 2 * i, d // pack), elem), s((e, 2 * i, d // 32), jnp.uint8),
            s((e, d, i // pack), elem), s((e, d, i // 32), jnp.uint8), s((e,), jnp.int32))
    return KernelCall(mx_moe_ffn, args, {"swiglu": swiglu_params(cfg), "implementation": "pallas"})


def _draft_attention_call(batch: Batch) -> KernelCall | None:
    """The DSpark drafter's context attention (K = 7, M3-width draft layer, the batch's context on pages of the
    target's page size, read through block tables) at decode and verify sizes (one draft step per request)."""
    from pallas_kernels.draft_attention import draft_attention

    if batch.kind == "prefill":
        return None
    cfg = _m3()
    s, page = jax.ShapeDtypeStruct, _page(cfg)
    pages, (tables, _, _) = _ragged(batch, page)
    r, k, layers = batch.requests, DRAFT_BLOCK, 1
    h, g, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cache = s((layers, g, pages, page, hd), jnp.bfloat16)
    args = (s((r, k, h, hd), jnp.bfloat16), cache, cache, tables, s((r,), jnp.int32),
            s((r, k, g, hd), jnp.bfloat16), s((r, k, g, hd), jnp.bfloat16))
    return KernelCall(draft_attention, args, {"scale": hd**-0.5, "layer": 0, "implementation": "pallas"})


def _draft_attention_window_call(batch: Batch) -> KernelCall | None:
    """The Qwen3-style DSpark drafter's attention (``nvidia/MiniMax-M3-DSpark``: K = 8, 32 query / 8 KV heads of
    128, non-causal sliding window 1024) on the batch's context, at decode and verify sizes."""
    from pallas_kernels.draft_attention import draft_attention

    if batch.kind == "prefill":
        return None
    s, page = jax.ShapeDtypeStruct, _page(_m3())
    pages, (tables, _, _) = _ragged(batch, page)
    q3 = QWEN3_DRAFT
    r, k, h, g, hd = batch.requests, q3["block"], q3["num_q_heads"], q3["num_kv_heads"], q3["head_dim"]
    cache = s((1, g, pages, page, hd), jnp.bfloat16)
    args = (s((r, k, h, hd), jnp.bfloat16), cache, cache, tables, s((r,), jnp.int32),
            s((r, k, g, hd), jnp.bfloat16), s((r, k, g, hd), jnp.bfloat16), s((r,), jnp.int32))

    def windowed(*a, **kw):  # the slots' positions traced, not closed over
        return draft_attention(*a[:7], query_positions=a[7], **kw)

    return KernelCall(windowed, args, {"scale": hd**-0.5, "layer": 0, "window": q3["window"],
                                       "implementation": "pallas"})


def _plan_ranking_call(batch: Batch) -> KernelCall | None:
    """The adaptive planner's ranking pass (the device loop plans every iteration): one row per request, K = 7,
    the default draft lengths (0, 3, 7 since session 31), four verify sizes per length."""
    from pallas_kernels.plan_ranking import ranked_plan_curves
    from spec_decode.buckets import default_draft_lengths

    if batch.kind != "decode":  # one row per request whatever its tokens: the decode batches give every size
        return None
    s, r, k = jax.ShapeDtypeStruct, batch.requests, DRAFT_BLOCK
    lengths = default_draft_lengths(k)
    sizes = tuple(tuple(max(8, r * (1 + d) - i * r) for i in range(3, -1, -1)) for d in lengths)
    sizes = tuple(tuple(sorted(set(b))) for b in sizes)
    width = max(len(b) for b in sizes)
    args = (s((r, k), jnp.float32), s((4,), jnp.int32), s((r + 1,), jnp.float32), s((len(lengths), width), jnp.float32))
    return KernelCall(ranked_plan_curves, args, {"column_lengths": lengths, "column_sizes": sizes,
                                                 "implementation": "pallas"})


# Every kernel entry point: (name, batch -> the call to lower, or None to skip that batch). Add new kernels here;
# they join both the full report (BATCHES) and the CI gate (GATE_CASES).
KERNELS: tuple[tuple[str, Callable[[Batch], KernelCall | None]], ...] = (
    ("ragged_index_topk", _indexer_call),
    ("ragged_sparse_attention", _sparse_attention_call),
    ("ragged_paged_attention", _paged_attention_call),
    ("ragged_sparse_attention_window", _windowed(_sparse_attention_call)),
    ("ragged_paged_attention_window", _windowed(_paged_attention_call)),
    ("moe_ffn", _moe_ffn_call),
    ("mx_moe_ffn_mxfp4", functools.partial(_mx_moe_ffn_call, fmt="mxfp4")),
    ("mx_moe_ffn_mxfp8", functools.partial(_mx_moe_ffn_call, fmt="mxfp8")),
    ("draft_attention", _draft_attention_call),
    ("draft_attention_window", _draft_attention_window_call),
    ("plan_ranking", _plan_ranking_call),
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel entry point at one serving size."""

    kernel: str
    make: Callable[[Batch], KernelCall | None]
    batch: Batch

    @property
    def label(self) -> str:
        return f"{self.kernel} {self.batch.label}"


def all_cases(kernels=KERNELS, batches: Iterable[Batch] = BATCHES, *, only: Iterable[str] | None = None) -> list[Case]:
    """Every kernel of ``kernels`` (or the ``only`` names) at every batch."""
    names = None if only is None else set(only)
    return [Case(name, make, b) for b in batches for name, make in kernels if names is None or name in names]


# The CI gate (tests/test_compile_kernels.py): every kernel and every launch shape of the AMD tables in about a
# third of the full report's compile time (49 of 173 kernels). K = 7 verification of 32 requests at 32K (128-row walks at 238-240
# VGPRs on gfx942, the split indexer, the union pre-pass at its worst: 95 SGPRs spilled with the old 4-warp
# pre-pass), 16 requests decoding (the engine's default slots: 16-row walks, split-K and its merge on every
# chip), and the indexer's fused path (512 decoding requests) and 8-warp, 32-token prefill tile.
# The MoE's grouped GEMMs (bf16, and the dequantizing MXFP4 / MXFP8 kernel) join at verify sizes (their decode
# tiles) and at 512 x 8 (their 64-row tiles); the planner's ranking kernels at 512 decoding requests (the select
# kernel's largest single program).
GATE_CASES: tuple[Case, ...] = (
    *all_cases(batches=(Batch("verify", 32, 8, 32768),)),
    *all_cases(batches=(Batch("verify", 512, 8, 4096),), only=("moe_ffn", "mx_moe_ffn_mxfp4", "mx_moe_ffn_mxfp8")),
    *all_cases(batches=(Batch("decode", 16, 1, 4096),), only=("ragged_sparse_attention", "ragged_paged_attention",
                                                               "ragged_sparse_attention_window",
                                                               "ragged_paged_attention_window")),
    *all_cases(batches=(Batch("decode", 512, 1, 4096), Batch("prefill", 1, 512, 4096)),
               only=("ragged_index_topk", "plan_ranking")),
)


# ------------------------------------------------------------------------------------------------------------
# Lowering: the Triton kernels of a call.
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One ``__gpu$xla.gpu.triton`` custom call: the kernel's Triton IR (MLIR bytecode) and launch."""

    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    ir: bytes = dataclasses.field(repr=False)

    @property
    def key(self) -> str:
        """Identity of the compiled kernel (the same IR and launch compile once)."""
        h = hashlib.sha256(self.ir)
        h.update(f"{self.num_warps}/{self.num_stages}".encode())
        return h.hexdigest()[:16]


def triton_kernels(call: KernelCall, chip: str) -> list[TritonKernel]:
    """The Triton kernels of ``call`` lowered with ``chip``'s launch tables, in program order."""
    from jax._src.lib.mlir import ir

    lowered = lowered_for_gpu(
        call.fn, *call.args, platform=chip_platform(chip), chip=chip, interpret=False, **call.kwargs
    )
    found: list[TritonKernel] = []

    def visit(op) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    inner = inner.operation
                    if inner.name == "stablehlo.custom_call" and (
                        ir.StringAttr(inner.attributes["call_target_name"]).value == _TRITON_CALL
                    ):
                        cfg = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                        ints = {k: ir.IntegerAttr(cfg[k]).value for k in ("num_warps", "num_stages", "grid_x",
                                                                          "grid_y", "grid_z")}
                        found.append(
                            TritonKernel(
                                name=ir.StringAttr(cfg["name"]).value,
                                num_warps=ints["num_warps"],
                                num_stages=ints["num_stages"],
                                grid=(ints["grid_x"], ints["grid_y"], ints["grid_z"]),
                                ir=ir.StringAttr(cfg["ir"]).value_bytes,
                            )
                        )
                    visit(inner)

    visit(lowered.compiler_ir("stablehlo").operation)
    return found


# ------------------------------------------------------------------------------------------------------------
# Compiling one kernel with pip triton's backends.
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class KernelReport:
    """What one kernel compiled to on one target (``error`` set instead when it did not compile)."""

    target: str
    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    cases: list[str] = dataclasses.field(default_factory=list)  # "kernel / batch" labels that launch it
    registers: dict[str, int] = dataclasses.field(default_factory=dict)  # vgpr/agpr/sgpr or regs
    shared_bytes: int = 0  # LDS / shared memory per workgroup / block
    spills: dict[str, int] = dataclasses.field(default_factory=dict)
    scratch_bytes: int = 0  # private segment / stack frame
    occupancy: int = 0  # AMD: waves per SIMD; NVIDIA: warps per SM
    blocks_per_core: int = 0  # AMD: workgroups per CU; NVIDIA: blocks per SM
    limited_by: str = ""
    matrix_ops: list[str] = dataclasses.field(default_factory=list)  # MFMA / MMA / WGMMA instruction shapes
    binary_bytes: int = 0  # hsaco / cubin size
    compile_s: float = 0.0
    error: str | None = None

    @property
    def spilled(self) -> bool:
        return any(v > 0 for v in self.spills.values())

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _amd_info(asm: str) -> dict[str, int]:
    """Kernel-info comments and code-object metadata of an AMDGCN listing."""
    fields = {
        "vgpr": r"; NumVgprs: (\d+)",
        "agpr": r"; NumAgprs: (\d+)",
        "total_vgpr": r"; TotalNumVgprs: (\d+)",
        "sgpr": r"; TotalNumSgprs: (\d+)",
        "scratch": r"; ScratchSize: (\d+)",
        "occupancy": r"; Occupancy: (\d+)",
        "vgpr_spill": r"\.vgpr_spill_count:\s+(\d+)",
        "sgpr_spill": r"\.sgpr_spill_count:\s+(\d+)",
    }
    info = {}
    for key, pattern in fields.items():
        m = re.search(pattern, asm)
        if m is None:
            raise RuntimeError(f"no {pattern!r} in the AMDGCN listing")
        info[key] = int(m.group(1))
    return info


def _backend(target: Target):
    from triton.backends.compiler import GPUTarget

    if target.backend == "hip":
        from triton.backends.amd.compiler import HIPBackend

        return HIPBackend(GPUTarget("hip", target.arch, target.warp_size))
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend(GPUTarget("cuda", target.arch, target.warp_size))


def _compile_hip(kernel: TritonKernel, target: Target, report: KernelReport, backend, module) -> None:
    import triton

    options = backend.parse_options(
        {"num_warps": kernel.num_warps, "num_stages": kernel.num_stages, "enable_fp_fusion": True}
    )
    metadata: dict[str, Any] = {"num_ctas": 1}
    with triton.knobs.amd.scope():
        triton.knobs.amd.use_async_copy = False  # as XLA's ROCm pipeline (Triton defaults to on for gfx950)
        mod = backend.make_ttir(module, metadata, options)
        mod = backend.make_ttgir(mod, metadata, options)
        llir = backend.make_llir(mod, metadata, options)
        asm = backend.make_amdgcn(llir, metadata, options)
        hsaco = backend.make_hsaco(asm, metadata, options)
    info = _amd_info(asm)
    report.registers = {"vgpr": info["vgpr"], "agpr": info["agpr"], "sgpr": info["sgpr"]}
    report.shared_bytes = int(metadata["shared"] or 0)
    report.spills = {"vgpr": info["vgpr_spill"], "sgpr": info["sgpr_spill"]}
    report.scratch_bytes = info["scratch"]
    report.occupancy, report.limited_by = amd_occupancy(
        register_waves=info["occupancy"], shared=report.shared_bytes, num_warps=kernel.num_warps, target=target
    )
    report.blocks_per_core = report.occupancy * _AMD_SIMDS_PER_CU // kernel.num_warps
    report.matrix_ops = sorted(set(re.findall(r"\bv_mfma_\w+", asm)))
    report.binary_bytes = len(hsaco)


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _compile_cuda(kernel: TritonKernel, target: Target, report: KernelReport, backend, module) -> None:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    options = backend.parse_options(
        {"num_warps": kernel.num_warps, "num_stages": kernel.num_stages, "enable_fp_fusion": True}
    )
    capability = int(target.arch)
    metadata: dict[str, Any] = {"num_ctas": 1}
    mod = backend.make_ttir(module, metadata, options, capability)
    mod = backend.make_ttgir(mod, metadata, options, capability)
    llir = backend.make_llir(mod, metadata, options, capability)
    ptx = backend.make_ptx(llir, metadata, options, capability)
    # Triton's make_cubin drops ptxas's report; run the wheel's ptxas with Triton's flags and -v here.
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(capability).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(capability)}", src, "-o", out]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"ptxas failed ({done.returncode}): {done.stderr[-2000:]}")
        with open(out, "rb") as f:
            cubin = f.read()
    log = done.stderr + done.stdout
    regs, spills = _PTXAS_REGS.search(log), _PTXAS_SPILLS.search(log)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output: {log[-2000:]}")
    report.registers = {"regs": int(regs.group(1))}
    report.shared_bytes = int(metadata["shared"] or 0)
    report.spills = {"stores": int(spills.group(2)), "loads": int(spills.group(3))}
    report.scratch_bytes = int(spills.group(1))
    report.occupancy, report.blocks_per_core, report.limited_by = cuda_occupancy(
        registers=report.registers["regs"], shared=report.shared_bytes, num_warps=kernel.num_warps, target=target
    )
    report.binary_bytes = len(cubin)
    report.matrix_ops = sorted(set(re.findall(r"\b(wgmma\.mma_async\.\S+?|mma\.sync\.\S+?)[ \t]", ptx)))


def compile_kernel(kernel: TritonKernel, target: Target) -> KernelReport:
    """Compile ``kernel`` for ``target`` with pip triton; a compile error is reported, not raised."""
    from triton._C.libtriton import ir

    report = KernelReport(target.name, kernel.name, kernel.num_warps, kernel.num_stages, kernel.grid)
    start = time.perf_counter()
    try:
        backend = _backend(target)
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        with tempfile.NamedTemporaryFile(suffix=".ttir") as f:  # triton parses IR (text or bytecode) from a file
            f.write(kernel.ir)
            f.flush()
            module = ir.parse_mlir_module(f.name, context)
        module.context = context
        compile_for = _compile_hip if target.backend == "hip" else _compile_cuda
        compile_for(kernel, target, report, backend, module)
    except Exception as e:  # noqa: BLE001 (a compile failure is a result)
        report.error = f"{type(e).__name__}: {e}"[:4000]
    report.compile_s = round(time.perf_counter() - start, 3)
    return report


# ------------------------------------------------------------------------------------------------------------
# Everything: each target's chip tables, every kernel x batch, each distinct kernel compiled once.
# ------------------------------------------------------------------------------------------------------------


def compile_all(
    targets: Iterable[Target] = TARGETS,
    cases: Iterable[Case] | None = None,
    *,
    jobs: int = 1,
    log: Callable[[str], None] | None = None,
) -> list[KernelReport]:
    """Reports of every distinct kernel of ``cases`` (default: every kernel at every batch) for every target.

    Each target's chip tables lower every case (in this process); the same IR and launch compile once, in
    ``jobs`` worker processes when ``jobs > 1``. Reports come in target, case and program order.
    """
    cases = all_cases() if cases is None else list(cases)
    reports: list[KernelReport] = []
    pending: list[tuple[int, TritonKernel, Target]] = []  # (index in reports, kernel, target) to compile
    for target in targets:
        by_key: dict[str, KernelReport] = {}
        for case in cases:
            call = case.make(case.batch)
            if call is None:
                continue
            try:
                found = triton_kernels(call, target.chip)
            except Exception as e:  # noqa: BLE001 (a lowering failure is a result)
                failed = KernelReport(target.name, case.kernel, 0, 0, (0, 0, 0), cases=[case.label])
                failed.error = f"lowering failed: {type(e).__name__}: {e}"[:4000]
                reports.append(failed)
                continue
            for kernel in found:
                if kernel.key not in by_key:
                    by_key[kernel.key] = KernelReport(
                        target.name, kernel.name, kernel.num_warps, kernel.num_stages, kernel.grid
                    )
                    pending.append((len(reports), kernel, target))
                    reports.append(by_key[kernel.key])
                by_key[kernel.key].cases.append(case.label)

    def done(index: int, compiled: KernelReport) -> None:
        compiled.cases = reports[index].cases
        reports[index] = compiled
        if log:
            where = f"{compiled.target} {compiled.name}"
            log(f"{where}: ERROR {compiled.error}" if compiled.error else f"{where}: {_summary(compiled)}")

    if jobs > 1 and len(pending) > 1:
        import concurrent.futures
        import multiprocessing

        # spawn: the parent's JAX runtime threads make fork unsafe; workers only import triton and this module.
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            futures = {pool.submit(compile_kernel, k, t): i for i, k, t in pending}
            for future in concurrent.futures.as_completed(futures):
                done(futures[future], future.result())
    else:
        for index, kernel, target in pending:
            done(index, compile_kernel(kernel, target))
    return reports


def _summary(r: KernelReport) -> str:
    regs = "/".join(f"{k} {v}" for k, v in r.registers.items())
    return (f"{regs}, shared {r.shared_bytes} B, spills {r.spills}, occupancy {r.occupancy} "
            f"({r.limited_by}), {r.compile_s:.2f} s")


def problems(reports: Iterable[KernelReport], *, min_amd_waves: int = 2) -> list[str]:
    """Compile errors, spills, scratch use, and AMD kernels under ``min_amd_waves`` waves per SIMD."""
    out = []
    for r in reports:
        where = f"{r.target} {r.name} ({', '.join(r.cases)})"
        if r.error:
            out.append(f"{where}: {r.error}")
            continue
        if r.spilled:
            out.append(f"{where}: spills {r.spills}")
        if r.scratch_bytes:
            out.append(f"{where}: {r.scratch_bytes} B of scratch / stack")
        if r.target.startswith("gfx") and r.occupancy < min_amd_waves:
            out.append(f"{where}: {r.occupancy} wave(s) per SIMD ({r.limited_by}-limited), want >= {min_amd_waves}")
    return out


def markdown_table(reports: Sequence[KernelReport], target: str) -> str:
    """One target's reports as a markdown table."""
    amd = target.startswith("gfx")
    head = ("| kernel | warps / stages | VGPR / AGPR / SGPR | LDS | spills | waves / SIMD | launched by |"
            if amd else
            "| kernel | warps / stages | registers | shared | spills | warps / SM (blocks) | launched by |")
    lines = [head, "|" + "---|" * 7]
    for r in reports:
        if r.target != target:
            continue
        cases = ", ".join(r.cases)
        if r.error:
            lines.append(f"| {r.name} | {r.num_warps} / {r.num_stages} | ERROR: {r.error[:80]} | | | | {cases} |")
            continue
        spills = "none" if not r.spilled else ", ".join(f"{v} {k}" for k, v in r.spills.items() if v)
        if amd:
            regs = f"{r.registers['vgpr']} / {r.registers['agpr']} / {r.registers['sgpr']}"
            occ = f"{r.occupancy} ({r.limited_by})" if r.limited_by != "waves" else f"{r.occupancy}"
        else:
            regs = str(r.registers["regs"])
            occ = f"{r.occupancy} ({r.blocks_per_core}, {r.limited_by})"
        lines.append(f"| {r.name} | {r.num_warps} / {r.num_stages} | {regs} | {_kib(r.shared_bytes)} | {spills} "
                     f"| {occ} | {cases} |")
    return "\n".join(lines)


def _kib(n: int) -> str:
    return "0" if not n else f"{n:,} B" if n < 1024 or n % 1024 else f"{n // 1024} KiB"
