"""The AMD compile gate: every Pallas kernel compiled for gfx942, gfx950 and sm_90 on the CPU (the dequantizing
MXFP4 / MXFP8 grouped GEMM included).

``scripts.compile_check`` lowers each kernel deviceless at M3 shapes with each chip's launch tables and
compiles the Triton IR with the pip triton wheel (``GATE_CASES``: every kernel and every AMD launch shape). The
gate fails on a compile error, a register spill, scratch use, or an AMD kernel under 2 waves per SIMD. It needs
the pinned jax + triton pair (``pip install '.[amd]'``; ``scripts/_env.sh`` installs it) and skips, saying why,
without it. The occupancy arithmetic is tested everywhere.
"""

from __future__ import annotations

import re

import pytest

from scripts import compile_check as cc

UNAVAILABLE = cc.toolchain_unavailable()
needs_toolchain = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"AMD compile gate: {UNAVAILABLE}")
TARGETS = {t.name: t for t in cc.TARGETS}


@pytest.fixture(scope="module")
def reports() -> list[cc.KernelReport]:
    # Serial: the suite's other xdist worker keeps the second core busy, and compile processes would each import
    # jax and triton again (2 processes: ~30 % more CPU for ~15 % less wall time here).
    return cc.compile_all(cc.TARGETS, cc.GATE_CASES, jobs=1)


def _family(name: str) -> str:
    """A kernel's family: its name without the launch parameters (``ragged_sparse_attention_bq8_rows128...`` ->
    ``ragged_sparse_attention``, ``..._merge_splits16`` -> ``..._merge``)."""
    return re.sub(r"_(bq|merge_splits|rows|pps|split|m)\d.*$", lambda m: "_merge" if "merge" in m.group(0) else "",
                  name)


def _where(r: cc.KernelReport) -> str:
    return f"{r.target} {r.name} ({', '.join(r.cases)})"


# One test holds every check of the gate: pytest-xdist's `load` distribution would run a module fixture once per
# worker that picks up one of its tests (and its `loadgroup` grouping does not work with pytest 9.2), i.e.
# compile everything twice. Each check's failures are collected and reported together.
@needs_toolchain
def test_compile_gate(reports):
    failures = []
    # 1. Every kernel compiles for every target.
    failures += [f"compile error: {_where(r)}: {r.error}" for r in reports if r.error]
    ok = [r for r in reports if not r.error]
    # 2. No register spills, no scratch.
    failures += [f"spill: {_where(r)}: spills {r.spills}, scratch {r.scratch_bytes} B"
                 for r in ok if r.spilled or r.scratch_bytes]
    # 3. The cdna3 / cdna4 tables' rule (pallas_kernels/tuning.py): >= 2 waves per SIMD, whatever limits them.
    failures += [f"occupancy: {_where(r)}: {r.occupancy} wave(s) per SIMD ({r.limited_by}-limited), "
                 f"{r.registers}, {r.shared_bytes} B LDS"
                 for r in ok if r.target.startswith("gfx") and r.occupancy < 2]
    # 4. Coverage: each target compiled each kernel family of every entry point (the indexer's fused, split-scores
    #    and selection kernels; each attention's pre-pass, walk and split-K merge), the 16- and 128-row walks on
    #    AMD, the sliding-window variants of both attentions' walks (and the MSA union pre-pass), and the gfx942
    #    indexer's key page fits two workgroups per CU (32 KiB: one stage; two took 33,280 B).
    want = {
        "ragged_index_topk_fused", "ragged_index_scores", "ragged_index_select",
        "ragged_sparse_attention_tiles", "ragged_sparse_attention", "ragged_sparse_attention_merge",
        "ragged_paged_attention_tiles", "ragged_paged_attention", "ragged_paged_attention_merge",
        "draft_attention", "draft_attention_merge", "grouped_matmul_swigluoai", "grouped_matmul",
        "mx_grouped_matmul_mxfp4_swigluoai", "mx_grouped_matmul_mxfp4", "mx_grouped_matmul_mxfp8_swigluoai",
        "mx_grouped_matmul_mxfp8", "plan_ranking_pairs", "plan_ranking_select",
    }
    for target in TARGETS:
        mine = [r for r in reports if r.target == target]
        missing = want - {_family(r.name) for r in mine}
        failures += [f"coverage: {target} compiled no {name} kernel" for name in sorted(missing)]
        failures += [f"coverage: {target} lowered nothing for {name}" for name, _ in cc.KERNELS
                     if not any(c.startswith(name + " ") for r in mine for c in r.cases)]
        windowed = {_family(r.name) for r in mine if "_window" in r.name}
        failures += [f"coverage: {target} compiled no windowed {name} kernel" for name in
                     ("ragged_sparse_attention_tiles", "ragged_sparse_attention", "ragged_paged_attention")
                     if name not in windowed]
        if target.startswith("gfx"):
            rows = {m.group(1) for r in mine for m in [re.search(r"attention_bq\d+_rows(\d+)_", r.name)] if m}
            failures += [f"coverage: {target} compiled no {n}-row walk" for n in ("16", "128") if n not in rows]
    failures += [f"LDS: {_where(r)}: {r.shared_bytes} B > 32 KiB (one workgroup per CU)" for r in ok
                 if r.target == "gfx942" and re.match(r"ragged_index_(scores|topk_fused)", r.name)
                 and r.shared_bytes > 32 * 1024]
    assert not failures, f"{len(failures)} problem(s):\n" + "\n".join(failures)
    assert cc.problems(reports) == []


# ------------------------------------------------------------------------------------------------------------
# The occupancy arithmetic (no toolchain needed).
# ------------------------------------------------------------------------------------------------------------


def test_amd_occupancy_from_lds_and_registers():
    gfx942, gfx950 = TARGETS["gfx942"], TARGETS["gfx950"]
    # The indexer at 2 stages: 33,280 B of LDS leaves one 4-wave workgroup per CU, one wave per SIMD.
    assert cc.amd_occupancy(register_waves=3, shared=33_280, num_warps=4, target=gfx942) == (1, "LDS")
    assert cc.amd_occupancy(register_waves=3, shared=32_768, num_warps=4, target=gfx942) == (2, "LDS")
    assert cc.amd_occupancy(register_waves=3, shared=33_280, num_warps=4, target=gfx950) == (3, "registers")
    # 8 waves of one workgroup put 2 on each SIMD.
    assert cc.amd_occupancy(register_waves=5, shared=34_816, num_warps=8, target=gfx942) == (2, "LDS")
    # No LDS: registers, then the 8-wave cap.
    assert cc.amd_occupancy(register_waves=2, shared=0, num_warps=4, target=gfx942) == (2, "registers")
    assert cc.amd_occupancy(register_waves=10, shared=0, num_warps=1, target=gfx942) == (8, "waves")
    assert cc.amd_occupancy(register_waves=8, shared=70_000, num_warps=4, target=gfx942) == (0, "LDS")


def test_cuda_occupancy_from_registers_and_shared_memory():
    sm90 = TARGETS["sm_90"]
    # 128 registers x 32 lanes = 4096 per warp: 16 warps, 4 blocks of 4 warps; 49 KiB blocks: 4 by shared memory.
    assert cc.cuda_occupancy(registers=128, shared=49_188, num_warps=4, target=sm90) == (16, 4, "registers")
    assert cc.cuda_occupancy(registers=80, shared=38_948, num_warps=4, target=sm90) == (20, 5, "shared")
    assert cc.cuda_occupancy(registers=16, shared=0, num_warps=4, target=sm90) == (64, 16, "warps")
    assert cc.cuda_occupancy(registers=32, shared=240 * 1024, num_warps=4, target=sm90) == (0, 0, "shared")


def test_problems_name_errors_spills_and_low_occupancy():
    ok = cc.KernelReport("gfx942", "k", 4, 1, (1, 1, 1), cases=["c"], spills={"vgpr": 0, "sgpr": 0}, occupancy=2)
    spill = cc.KernelReport("gfx950", "s", 4, 1, (1, 1, 1), spills={"vgpr": 0, "sgpr": 9}, occupancy=6)
    low = cc.KernelReport("gfx942", "l", 4, 2, (1, 1, 1), spills={"vgpr": 0, "sgpr": 0}, occupancy=1,
                          limited_by="LDS")
    cuda = cc.KernelReport("sm_90", "n", 4, 3, (1, 1, 1), spills={"stores": 0, "loads": 0}, occupancy=1)
    broken = cc.KernelReport("sm_90", "b", 4, 3, (1, 1, 1), error="PTXASError: boom")
    got = cc.problems([ok, spill, low, cuda, broken])
    assert len(got) == 3
    assert "sgpr" in got[0] and "LDS-limited" in got[1] and "boom" in got[2]


def test_gate_skips_without_the_pinned_pair(monkeypatch):
    """The gate runs only with the pinned jax + triton pair and names what is missing otherwise."""
    import sys

    monkeypatch.setattr(cc.jax, "__version__", "0.11.2")
    assert "jax 0.11.2 is not the pinned" in cc.toolchain_unavailable()
    monkeypatch.setattr(cc.jax, "__version__", cc.PINNED_JAX)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    assert "triton is not installed" in cc.toolchain_unavailable()
