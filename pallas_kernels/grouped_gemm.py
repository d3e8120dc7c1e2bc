"""Grouped GEMM for the MoE's routed experts: a Pallas (Triton) kernel, its ragged_dot reference and a
dropless XLA fallback.

Contract. ``lhs: [M, K]`` rows sorted by group (expert); ``rhs: [G, K, N]`` one weight matrix per group;
``group_sizes: int32[G]``: group ``g`` owns rows ``[sum(gs[:g]), sum(gs[:g + 1]))``; rows at or past
``sum(gs)`` are *padding* and come out as exact zeros (``jax.lax.ragged_dot``'s rule; the sum must not exceed
``M``). ``grouped_matmul`` returns ``lhs @ rhs[g]`` per row in lhs's dtype (fp32 accumulation, rounded once);
with ``swiglu=(alpha, limit, beta)`` it returns ``layers.swigluoai`` of that product instead: ``N = 2I``
weight columns whose halves are gate ``[0, I)`` and up ``[I, 2I)`` (split, not interleaved), output
``[M, I]``. ``moe_ffn`` is the experts' whole MLP: ``swigluoai(xs @ w_gate_up[g]) @ w_down[g]``, each product
rounded to the weights' dtype as in ``minimax_jax.layers.MoE``. Implementations (every entry point takes them
all):

* ``"reference"``: ``jax.lax.ragged_dot``, the model's original path. XLA lowers it on GPUs like a dense
  product over every group (H200, M3 gate/up at 2048 rows: 25 ms against a 2.3 ms weight-read floor).
* ``"pallas"``: the kernel below (compiled Triton on a GPU, interpret mode on CPU).
* ``"xla"``: a dropless batched-matmul fallback for where the kernel cannot run (below).
* ``"auto"``: the compiled kernel on a GPU when :func:`supports` says so, else ``"xla"``; interpret mode only
  when asked for (``interpret=True``).

Kernel. A 1-D grid; one program per (row tile of one group, column tile). The ``G + 1`` *segments* (the groups
and the padding tail) are cut into row tiles of ``block_m``; every program loads ``group_sizes`` and finds its
(segment, row tile, column tile) on the device (a cumsum over the segments' program counts, as
``_common.locate_tile`` does for ragged query tiles; no host sync, no sort). Inside a segment the programs run
row tiles fastest in bands of ``group_m`` (the weight column tile just read is reused from L2 by the band's
row tiles, and the band's rows stay in L2 across the column tiles). The static grid is
``num_tiles_bound(M, G, block_m) * N / block_n`` programs (about ``cdiv(M, block_m) + G`` row tiles);
programs past the last tile and empty groups do nothing, padding-tail programs only write zeros. A program loops over ``K`` in ``block_k``
steps: a masked ``[block_m, block_k]`` row load, one ``[block_k, block_n]`` weight tile (two with the fused
swigluoai: gate and up columns ``n0`` and ``I + n0``), fp32 dots; then the activation in registers and a
masked store of its own rows only.

Bytes and FLOPs per call (``A`` active groups, ``R = M`` rows, itemsize ``b``): weights ``A * K * N * b`` read
once per row band of a group (at decode, a few rows per expert: exactly once), rows ``R * K * b`` read once
per column tile (mostly from L2), output ``R * N_out * b`` written once; ``2 * R * K * N`` useful FLOPs,
executed ``2 * sum_g(cdiv(gs_g, block_m) * block_m) * K * N``. M3 (hidden 6144, 128 experts, intermediate
3072, bf16): gate/up weights 9.66 GB (2.25 ms at 4.3 TB/s), down 4.83 GB; 2048 pairs of gate/up are 155 GFLOP
(0.16 ms at 989 TFLOP/s): weight-read bound up to about 29K rows at the tensor cores' peak.

XLA fallback (``"xla"``): no product by every expert, no dropped row, static shapes. Each group's rows are cut
into chunks of ``C = next_pow2(cdiv(2M, G))`` rows (the *capacity*, a power-of-2 bucket of twice the mean
group). Chunk 0 of group ``g`` goes to slot ``g``: one batched matmul ``[G, C, K] x [G, K, N]`` reads every
weight once (``G * C`` rows: 2..4 x ``M``). Later chunks (groups larger than ``C``) go to ``V = (M - 1) // C``
overflow slots (enough for any routing: a group of ``n`` rows needs ``(n - 1) // C`` of them, and these sum to
at most ``(M - 1) // C``), multiplied against their groups' gathered weights under a ``lax.cond`` that skips
them when no group exceeds ``C`` (the usual case for balanced routing). Static work is at most ``G * C + M``
rows; one expert taking every row costs ``V`` weight gathers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import cdiv, next_pow2, num_tiles_bound, out_of_bounds_where
from pallas_kernels.attention_walk import pallas_call
from pallas_kernels.platform import resolve_auto, resolve_interpret
from pallas_kernels.tuning import (
    COMPILED_DTYPES,
    MIN_DOT_DIM,
    GroupedMatmulLaunchConfig,
    grouped_matmul_launch_config,
    pow2_divisor,
    resolve_chip,
)

__all__ = [
    "IMPLEMENTATIONS",
    "capacity",
    "grouped_matmul",
    "grouped_matmul_pallas",
    "grouped_matmul_reference",
    "grouped_matmul_xla",
    "grouped_tile_program",
    "locate_program",
    "moe_ffn",
    "moe_ffn_reference",
    "moe_ffn_xla",
    "program_table",
    "resolve_implementation",
    "segments",
    "supports",
    "swigluoai_halves",
]

IMPLEMENTATIONS = ("auto", "pallas", "xla", "reference")


# ----------------------------------------------------------------------------------------------------------
# Program search (traced in the kernel and in jnp)
# ----------------------------------------------------------------------------------------------------------


def segments(group_sizes, *, num_groups: int, num_rows: int):
    """``(seg_start, seg_len) int32[S]`` of the ``G`` groups and the padding tail (segment ``G``) from
    ``group_sizes`` padded with zeros to ``S > G`` lanes. Lengths are clipped so no segment passes ``M``."""
    idx = jax.lax.broadcasted_iota(jnp.int32, group_sizes.shape, 0)
    in_group = idx < num_groups
    gs = jnp.where(in_group, jnp.maximum(group_sizes, 0), 0)
    ends = jnp.cumsum(gs, axis=0)
    start = jnp.minimum(ends - gs, num_rows)
    length = jnp.minimum(ends, num_rows) - start
    total = jnp.sum(length)
    seg_start = jnp.where(in_group, start, jnp.where(idx == num_groups, total, 0))
    seg_len = jnp.where(in_group, length, jnp.where(idx == num_groups, num_rows - total, 0))
    return seg_start, seg_len


def locate_program(p, seg_start, seg_len, *, num_groups: int, block_m: int, n_tiles: int, group_m: int):
    """Program ``p`` of the grid: scalars ``(segment, row0, nrows, n_tile)``. The program owns rows ``[row0,
    row0 + nrows)`` of ``segment`` (a group, or ``G`` for the padding tail) and output columns ``[n_tile *
    block_n, ...)``; ``nrows == 0`` past the last tile. Segment-major; inside a segment, bands of ``group_m``
    row tiles, row tiles fastest."""
    tiles = (seg_len + block_m - 1) // block_m
    progs = tiles * n_tiles
    ends = jnp.cumsum(progs, axis=0)
    seg = jnp.sum((ends <= p).astype(jnp.int32))
    idx = jax.lax.broadcasted_iota(jnp.int32, seg_len.shape, 0)
    here = idx == seg
    before = jnp.sum(jnp.where(idx < seg, progs, 0))
    m_tiles = jnp.sum(jnp.where(here, tiles, 0))
    start = jnp.sum(jnp.where(here, seg_start, 0))
    length = jnp.sum(jnp.where(here, seg_len, 0))
    local = p - before
    width = group_m * n_tiles
    first = (local // width) * group_m
    band = jnp.clip(m_tiles - first, 1, group_m)
    within = local % width
    # within // band with a dynamic band in [1, group_m], as a select over static divisors: a division by the
    # dynamic value makes the ROCm pipeline of the pinned Triton abort (TritonAMDFoldTrueCmpI; compile_check)
    n_tile = jnp.zeros_like(within)
    for divisor in range(1, group_m + 1):
        n_tile = jnp.where(band == divisor, within // divisor, n_tile)
    m = first + within - n_tile * band
    nrows = jnp.where(seg <= num_groups, jnp.clip(length - m * block_m, 0, block_m), 0)
    return seg, start + m * block_m, nrows, n_tile


@functools.partial(jax.jit, static_argnames=("num_rows", "n_cols", "config"))
def program_table(group_sizes, *, num_rows: int, n_cols: int, config: GroupedMatmulLaunchConfig) -> jax.Array:
    """``int32[programs, 4]``: :func:`locate_program` for every program of the grid in plain jnp (tests, bytes
    models): rows ``(segment, row0, nrows, n_tile)``."""
    num_groups = group_sizes.shape[0]
    size = next_pow2(num_groups + 1)
    gs = jnp.pad(group_sizes.astype(jnp.int32), (0, size - num_groups))
    seg_start, seg_len = segments(gs, num_groups=num_groups, num_rows=num_rows)
    n_tiles = n_cols // config.block_n
    programs = num_tiles_bound(num_rows, num_groups, config.block_m) * n_tiles
    locate = functools.partial(
        locate_program, num_groups=num_groups, block_m=config.block_m, n_tiles=n_tiles, group_m=config.group_m
    )
    cols = jax.vmap(lambda p: locate(p, seg_start, seg_len))(jnp.arange(programs, dtype=jnp.int32))
    return jnp.stack(cols, axis=1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------


def _dot(a, b):
    """2-D ``a @ b`` with an fp32 accumulator; fp32 operands in full fp32 (Triton's fp32 default is TF32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def swigluoai_halves(g, u, swiglu):
    """``layers.swigluoai`` on its split fp32 halves (gate ``g``, up ``u``); ``swiglu = (alpha, limit, beta)``."""
    alpha, limit, beta = swiglu
    g = jnp.minimum(g, limit)
    u = jnp.clip(u, -limit, limit)
    return g * jax.nn.sigmoid(alpha * g) * (u + beta)


def grouped_tile_program(
    gs_ref,  # [G] int32
    lhs_ref,  # [M, K]
    out_ref,  # [M, N_out]
    tile_product,
    *,
    num_groups: int,
    num_rows: int,
    k_steps: int,
    n_tiles: int,
    half: int,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int,
    swiglu,
):
    """The body of one program of a grouped GEMM (this module's kernel and the MX one,
    ``pallas_kernels.mx_grouped_gemm``): find this program's (segment, row tile, column tile), loop over ``K``
    in ``block_k`` steps, apply the fused swigluoai if asked, store the program's own rows.
    ``tile_product(a, group, col0, i)`` -> f32 ``[block_m, block_n]``: the rows' ``K`` slice ``i`` (``a [block_m,
    block_k]``) times the weight tile of ``group`` at output columns ``[col0, col0 + block_n)``; it is what the
    two kernels do differently (a plain weight tile; MX elements decoded in registers)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, (next_pow2(num_groups + 1),), 0)
    in_group = lane < num_groups
    gs = plgpu.load(gs_ref.at[jnp.where(in_group, lane, 0)], mask=in_group, other=0)
    seg_start, seg_len = segments(gs, num_groups=num_groups, num_rows=num_rows)
    seg, row0, nrows, n_tile = locate_program(
        pl.program_id(0), seg_start, seg_len, num_groups=num_groups, block_m=block_m, n_tiles=n_tiles,
        group_m=group_m,
    )
    group = jnp.minimum(seg, num_groups - 1)
    # Only a group's tiles multiply; the padding tail's accumulators stay zero (and swigluoai(0) == 0).
    # int32 bounds on both ends: a weakly typed bound lowers to another integer width than the other on
    # jax 0.11's Triton lowering, and Triton then refuses the loop ('scf.for' bounds of different types)
    steps = jnp.where((seg < num_groups) & (nrows > 0), jnp.int32(k_steps), jnp.int32(0))
    r = jax.lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    row_ok = r < nrows
    rows = jnp.where(row_ok, row0 + r, 0)
    kk = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    n0 = pl.multiple_of(n_tile * block_n, block_n)

    def step(i, accs):
        k0 = pl.multiple_of(i * block_k, block_k)
        a = plgpu.load(lhs_ref.at[rows[:, None], (k0 + kk)[None, :]], mask=row_ok[:, None], other=0)
        out = [accs[0] + tile_product(a, group, n0, i)]
        if swiglu is not None:
            out.append(accs[1] + tile_product(a, group, half + n0, i))
        return tuple(out)

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    accs = jax.lax.fori_loop(jnp.int32(0), steps, step, (zeros,) * (1 if swiglu is None else 2))
    dtype = out_ref.dtype
    if swiglu is None:
        y = accs[0]
    else:  # the reference rounds the product to the output's dtype before the activation: so does the kernel
        g, u = (acc.astype(dtype).astype(jnp.float32) for acc in accs)
        y = swigluoai_halves(g, u, swiglu)
    cols = n0 + jax.lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    out_rows = out_of_bounds_where(row_ok, row0 + r, num_rows)
    plgpu.store(out_ref.at[out_rows[:, None], cols[None, :]], y.astype(dtype), mask=row_ok[:, None])


def _grouped_matmul_kernel(
    gs_ref,  # [G] int32
    lhs_ref,  # [M, K]
    rhs_ref,  # [G, K, N]
    out_ref,  # [M, N_out]
    *,
    block_k: int,
    block_n: int,
    **dims,
):
    def tile_product(a, group, col0, i):
        k0 = pl.multiple_of(i * block_k, block_k)
        return _dot(a, rhs_ref[group, pl.ds(k0, block_k), pl.ds(col0, block_n)])  # [block_m, block_n]

    grouped_tile_program(gs_ref, lhs_ref, out_ref, tile_product, block_k=block_k, block_n=block_n, **dims)


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------


def _unsupported(*, k: int, n: int, dtype, interpret: bool) -> str | None:
    """Why the kernel cannot run a ``[*, k] x [G, k, n]`` product (``n``: output columns; with the fused
    swigluoai, of one half) in ``dtype``; ``None`` when it can."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return f"inputs must be floating, got {jnp.dtype(dtype).name}"
    if k < 1 or n < 1:
        return f"K={k} and N={n} must be >= 1"
    if interpret:
        return None
    if jnp.dtype(dtype).name not in COMPILED_DTYPES:
        return f"compiled kernels take {', '.join(COMPILED_DTYPES)}, got {jnp.dtype(dtype).name}"
    if min(pow2_divisor(k), pow2_divisor(n)) < MIN_DOT_DIM:
        return f"compiled Triton dots need K={k} and N={n} to be multiples of {MIN_DOT_DIM}"
    return None


def supports(
    *, hidden_size: int, intermediate_size: int, dtype, chip: str | None = None, interpret: bool = False
) -> bool:
    """Whether :func:`moe_ffn`'s kernels run an MoE of these sizes, compiled for ``chip`` (a chip of
    ``tuning.CHIPS``; ``None``: the default device's) or in interpret mode.

    Always: a floating dtype. Compiled: also a dtype of ``tuning.COMPILED_DTYPES`` and hidden and intermediate
    sizes that are multiples of 16 (``tuning.MIN_DOT_DIM``: the power-of-2 tiles must divide K and N exactly).
    Every chip has the same limits today (the kernel compiles for gfx942, gfx950 and sm_90:
    ``scripts.compile_check``).
    """
    resolve_chip(chip)
    return all(
        _unsupported(k=k, n=n, dtype=dtype, interpret=interpret) is None
        for k, n in ((hidden_size, intermediate_size), (intermediate_size, hidden_size))
    )


def resolve_implementation(
    implementation: str, *, hidden_size: int, intermediate_size: int, dtype, interpret: bool | None = None,
    chip: str | None = None,
) -> str:
    """``"auto"``: Pallas interpret mode with ``interpret=True``; the compiled kernel on a GPU where
    :func:`supports` the sizes; else the ``"xla"`` fallback. Other names pass through (checked)."""
    def supported() -> bool:
        return supports(hidden_size=hidden_size, intermediate_size=intermediate_size, dtype=dtype, chip=chip)

    return resolve_auto(implementation, interpret=interpret, supported=supported, choices=IMPLEMENTATIONS,
                        fallback="xla")


def _check_inputs(lhs, rhs, group_sizes, swiglu):
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"lhs must be [M, K] and rhs [G, K, N], got {lhs.shape} and {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        got = f"{group_sizes.dtype}{group_sizes.shape}"
        raise ValueError(f"group_sizes must be int32[G={rhs.shape[0]}], got {got}")
    if lhs.dtype != rhs.dtype or not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise ValueError(f"lhs ({lhs.dtype}) and rhs ({rhs.dtype}) must share one floating dtype")
    if swiglu is not None and (len(swiglu) != 3 or rhs.shape[2] % 2):
        raise ValueError(f"swiglu=(alpha, limit, beta) needs an even number of rhs columns, got {rhs.shape}")


def _out_cols(rhs, swiglu) -> int:
    return rhs.shape[2] // 2 if swiglu is not None else rhs.shape[2]


# ----------------------------------------------------------------------------------------------------------
# Kernel wrappers
# ----------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("swiglu", "config", "interpret", "poison"))
def grouped_matmul_pallas(
    lhs, rhs, group_sizes, *, swiglu, config: GroupedMatmulLaunchConfig, interpret: bool, poison: bool = False
):
    """The kernel with an explicit launch ``config``. ``poison`` (tests only): the output buffer starts as NaN
    (aliased into the kernel), so a row the kernel fails to write shows up."""
    _check_inputs(lhs, rhs, group_sizes, swiglu)
    config.validate()
    num_rows, k = lhs.shape
    num_groups = rhs.shape[0]
    n_out = _out_cols(rhs, swiglu)
    reason = _unsupported(k=k, n=n_out, dtype=lhs.dtype, interpret=interpret)
    if reason:
        raise ValueError(f"{reason}; use implementation='xla'")
    if k % config.block_k or n_out % config.block_n:
        raise ValueError(f"block_k={config.block_k} and block_n={config.block_n} must divide K={k}, "
                         f"N={n_out}")
    if not interpret and min(config.block_m, config.block_n, config.block_k) < MIN_DOT_DIM:
        raise ValueError(f"compiled Triton dots need blocks >= {MIN_DOT_DIM}, got {config}")
    if num_rows == 0:
        return jnp.zeros((0, n_out), lhs.dtype)
    n_tiles = n_out // config.block_n
    programs = num_tiles_bound(num_rows, num_groups, config.block_m) * n_tiles
    kernel = functools.partial(
        _grouped_matmul_kernel,
        num_groups=num_groups,
        num_rows=num_rows,
        k_steps=k // config.block_k,
        n_tiles=n_tiles,
        half=n_out,
        block_m=config.block_m,
        block_n=config.block_n,
        block_k=config.block_k,
        group_m=config.group_m,
        swiglu=swiglu,
    )
    c = config
    (out,) = pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[
            pl.BlockSpec((num_groups,), lambda p: (0,)),
            pl.BlockSpec(lhs.shape, lambda p: (0, 0)),
            pl.BlockSpec(rhs.shape, lambda p: (0, 0, 0)),
        ],
        out_specs=[pl.BlockSpec((num_rows, n_out), lambda p: (0, 0))],
        out_shape=[jax.ShapeDtypeStruct((num_rows, n_out), lhs.dtype)],
        args=[group_sizes.astype(jnp.int32), lhs, rhs],
        poison=poison,
        interpret=interpret,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
        name=f"grouped_matmul{'_swigluoai' if swiglu else ''}_m{c.block_m}n{c.block_n}k{c.block_k}",
    )
    return out


def _launch_config(lhs, rhs, swiglu, chip, overrides: dict) -> GroupedMatmulLaunchConfig:
    return grouped_matmul_launch_config(
        num_rows=lhs.shape[0],
        num_groups=rhs.shape[0],
        k=lhs.shape[1],
        n=_out_cols(rhs, swiglu),
        fused=swiglu is not None,
        itemsize=rhs.dtype.itemsize,
        chip=chip,
        **overrides,
    )


_LAUNCH = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m")


@functools.partial(jax.jit, static_argnames=("swiglu", "implementation", "interpret", "chip", *_LAUNCH))
def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    swiglu: tuple[float, float, float] | None = None,
    implementation: str = "auto",
    interpret: bool | None = None,
    chip: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int | None = None,
) -> jax.Array:
    """Grouped matmul over rows sorted by group, optionally with swigluoai fused (module docstring).

    Args:
      lhs: ``[M, K]`` rows sorted by group (bf16 or f32); rows at or past ``sum(group_sizes)`` are padding.
      rhs: ``[G, K, N]`` one matrix per group, lhs's dtype.
      group_sizes: ``int32[G]`` rows per group (zeros allowed), summing to at most ``M``.
      swiglu: ``(alpha, limit, beta)``: return ``swigluoai`` of the product (gate = first half of the columns,
        up = second half), ``[M, N / 2]``; ``None``: the product, ``[M, N]``.
      implementation: ``"auto"``, ``"pallas"``, ``"xla"`` or ``"reference"`` (module docstring).
      interpret: ``None``: interpret mode on CPU, compiled Triton on a GPU.
      chip: a chip of ``tuning.CHIPS`` whose launch table to use (``None``: the default device's).
      block_m, block_n, block_k, num_warps, num_stages, group_m: launch overrides; ``None`` asks the chip's
        policy (``tuning.grouped_matmul_launch_config``).

    Returns:
      lhs's dtype; exact zeros on padding rows.
    """
    _check_inputs(lhs, rhs, group_sizes, swiglu)
    impl = resolve_implementation(
        implementation, hidden_size=lhs.shape[1], intermediate_size=_out_cols(rhs, swiglu), dtype=lhs.dtype,
        interpret=interpret, chip=chip,
    )
    if impl == "reference":
        return grouped_matmul_reference(lhs, rhs, group_sizes, swiglu=swiglu)
    if impl == "xla":
        return grouped_matmul_xla(lhs, rhs, group_sizes, swiglu=swiglu)
    overrides = dict(zip(_LAUNCH, (block_m, block_n, block_k, num_warps, num_stages, group_m), strict=True))
    config = _launch_config(lhs, rhs, swiglu, chip, overrides)
    return grouped_matmul_pallas(lhs, rhs, group_sizes, swiglu=swiglu, config=config,
                                 interpret=resolve_interpret(interpret))


def grouped_matmul_reference(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    swiglu: tuple[float, float, float] | None = None,
    implementation: str = "reference",
    interpret: bool | None = None,
    chip: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int | None = None,
) -> jax.Array:
    """``jax.lax.ragged_dot`` (the model's original path) with :func:`grouped_matmul`'s parameters and result;
    ``implementation``, ``interpret``, ``chip`` and the launch settings are named and ignored."""
    del implementation, interpret, chip, block_m, block_n, block_k, num_warps, num_stages, group_m
    _check_inputs(lhs, rhs, group_sizes, swiglu)
    return _ragged(lhs, group_sizes, [rhs], (swiglu,))


@functools.partial(jax.jit, static_argnames=("swiglus",))
def _ragged(lhs, group_sizes, weights, swiglus):
    """``lax.ragged_dot`` through ``weights``, each product rounded to lhs's dtype, then the optional
    swigluoai (``layers.MoE``'s original ops)."""
    x = lhs
    for w, swiglu in zip(weights, swiglus, strict=True):
        x = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
        x = x.astype(lhs.dtype)
        if swiglu is not None:
            g, u = jnp.split(x.astype(jnp.float32), 2, axis=-1)
            x = swigluoai_halves(g, u, swiglu).astype(lhs.dtype)
    return x


# ----------------------------------------------------------------------------------------------------------
# XLA fallback: capacity slots plus overflow slots (module docstring)
# ----------------------------------------------------------------------------------------------------------


def capacity(num_rows: int, num_groups: int) -> int:
    """Rows per slot of the XLA fallback: ``next_pow2(cdiv(2M, G))`` (twice the mean group, bucketed)."""
    return next_pow2(cdiv(2 * max(num_rows, 1), max(num_groups, 1)))


@dataclasses.dataclass(frozen=True)
class _Slots:
    """Where the rows go: ``G`` primary slots (chunk 0 of each group) then ``V`` overflow slots, ``C`` rows
    each."""

    slot_rows: jax.Array  # int32[G + V, C]: the row in each slot position, -1 when empty
    row_slot: jax.Array  # int32[M]: each row's slot (G + V for padding rows)
    row_pos: jax.Array  # int32[M]: each row's position in its slot
    overflow_group: jax.Array  # int32[V]: the group of each overflow slot (0 when unused)
    any_overflow: jax.Array  # bool: some group has more than C rows


def _slot_layout(group_sizes, *, num_rows: int, cap: int) -> _Slots:
    num_groups = group_sizes.shape[0]
    num_over = (num_rows - 1) // cap
    num_slots = num_groups + num_over
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends_raw = jnp.cumsum(gs)
    start = jnp.minimum(ends_raw - gs, num_rows)
    ends = jnp.minimum(ends_raw, num_rows)
    length = ends - start
    r = jnp.arange(num_rows, dtype=jnp.int32)
    # First group ending past r (G: padding). "compare_all": one [M, G] comparison, no loop on the device.
    group = jnp.searchsorted(ends, r, side="right", method="compare_all").astype(jnp.int32)
    live = group < num_groups
    g = jnp.minimum(group, num_groups - 1)
    j = r - start[g]
    chunk, pos = j // cap, j % cap
    n_over = jnp.where(length > 0, (length - 1) // cap, 0)  # overflow chunks per group
    over_end = jnp.cumsum(n_over)
    slot = jnp.where(chunk == 0, g, num_groups + over_end[g] - n_over[g] + chunk - 1)
    slot = jnp.where(live, slot, num_slots)
    slot_rows = jnp.full((num_slots, cap), -1, jnp.int32).at[slot, pos].set(r, mode="drop")
    v = jnp.arange(num_over, dtype=jnp.int32)
    overflow_group = jnp.searchsorted(over_end, v, side="right", method="compare_all")
    overflow_group = jnp.minimum(overflow_group, num_groups - 1).astype(jnp.int32)
    return _Slots(slot_rows, slot, pos, overflow_group, over_end[-1] > 0)


def _chain(x, weights, swiglus, dtype):
    """``x [B, C, K]`` through batched products with ``weights [B, K, N]`` (each rounded to ``dtype``, then
    the optional swigluoai): the reference's roundings."""
    for w, swiglu in zip(weights, swiglus, strict=True):
        x = jnp.einsum("bck,bkn->bcn", x, w, preferred_element_type=jnp.float32).astype(dtype)
        if swiglu is not None:
            g, u = jnp.split(x.astype(jnp.float32), 2, axis=-1)
            x = swigluoai_halves(g, u, swiglu).astype(dtype)
    return x


@functools.partial(jax.jit, static_argnames=("swiglus",))
def _slotted(lhs, group_sizes, weights, swiglus):
    """The fallback: rows into slots, :func:`_chain` per slot (overflow slots under a ``lax.cond``), rows
    back out; zeros for padding rows."""
    num_rows = lhs.shape[0]
    num_groups = weights[0].shape[0]
    n_out = weights[-1].shape[2] // (2 if swiglus[-1] is not None else 1)
    if num_rows == 0:
        return jnp.zeros((0, n_out), lhs.dtype)
    slots = _slot_layout(group_sizes, num_rows=num_rows, cap=capacity(num_rows, num_groups))
    x = jnp.where((slots.slot_rows >= 0)[..., None], lhs[jnp.maximum(slots.slot_rows, 0)], 0)  # [S, C, K]
    y = _chain(x[:num_groups], weights, swiglus, lhs.dtype)
    num_over = x.shape[0] - num_groups
    if num_over:
        def overflow(x_over, og):
            return _chain(x_over, [w[og] for w in weights], swiglus, lhs.dtype)

        def skip(x_over, og):
            del og
            return jnp.zeros((num_over, *y.shape[1:]), y.dtype)

        y_over = jax.lax.cond(slots.any_overflow, overflow, skip, x[num_groups:], slots.overflow_group)
        y = jnp.concatenate([y, y_over], axis=0)
    live = slots.row_slot < y.shape[0]
    out = y[jnp.minimum(slots.row_slot, y.shape[0] - 1), slots.row_pos]
    return jnp.where(live[:, None], out, 0).astype(lhs.dtype)


def grouped_matmul_xla(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    swiglu: tuple[float, float, float] | None = None,
    implementation: str = "xla",
    interpret: bool | None = None,
    chip: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int | None = None,
) -> jax.Array:
    """The dropless XLA fallback (module docstring) with :func:`grouped_matmul`'s parameters and result;
    ``implementation``, ``interpret``, ``chip`` and the launch settings are named and ignored."""
    del implementation, interpret, chip, block_m, block_n, block_k, num_warps, num_stages, group_m
    _check_inputs(lhs, rhs, group_sizes, swiglu)
    return _slotted(lhs, group_sizes, [rhs], (swiglu,))


# ----------------------------------------------------------------------------------------------------------
# The experts' MLP
# ----------------------------------------------------------------------------------------------------------


def _check_ffn(xs, w_gate_up, w_down, group_sizes, swiglu):
    _check_inputs(xs, w_gate_up, group_sizes, swiglu)
    num_groups, inter, hidden = w_down.shape
    if (num_groups, 2 * inter) != (w_gate_up.shape[0], w_gate_up.shape[2]) or hidden != xs.shape[1]:
        raise ValueError(f"w_gate_up {w_gate_up.shape} and w_down {w_down.shape} must be [G, d, 2I] and "
                         f"[G, I, d] for xs {xs.shape}")
    if w_down.dtype != w_gate_up.dtype:
        raise ValueError(f"w_down ({w_down.dtype}) and w_gate_up ({w_gate_up.dtype}) must share a dtype")


@functools.partial(
    jax.jit,
    static_argnames=("swiglu", "implementation", "interpret", "chip", "gate_up_config", "down_config"),
)
def moe_ffn(
    xs: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    group_sizes: jax.Array,
    *,
    swiglu: tuple[float, float, float],
    implementation: str = "auto",
    interpret: bool | None = None,
    chip: str | None = None,
    gate_up_config: GroupedMatmulLaunchConfig | None = None,
    down_config: GroupedMatmulLaunchConfig | None = None,
) -> jax.Array:
    """The routed experts' MLP over rows sorted by expert: ``swigluoai(xs @ w_gate_up[g]) @ w_down[g]``.

    Args:
      xs: ``[M, d]`` rows sorted by expert, the weights' dtype; rows at or past ``sum(group_sizes)`` are
        padding.
      w_gate_up: ``[E, d, 2I]`` (gate columns, then up columns); w_down: ``[E, I, d]``.
      group_sizes: ``int32[E]`` rows per expert, summing to at most ``M``.
      swiglu: ``(alpha, limit, beta)`` of the activation.
      implementation: ``"auto"``, ``"pallas"``, ``"xla"`` or ``"reference"`` (module docstring).
      interpret, chip: as in :func:`grouped_matmul`.
      gate_up_config, down_config: launch settings of the two kernels (``None``: the chip's policy).

    Returns:
      ``[M, d]`` in the weights' dtype (each product rounded to it, as in ``layers.MoE``); zeros on padding
      rows.
    """
    _check_ffn(xs, w_gate_up, w_down, group_sizes, swiglu)
    impl = resolve_implementation(
        implementation, hidden_size=xs.shape[1], intermediate_size=w_down.shape[1], dtype=xs.dtype,
        interpret=interpret, chip=chip,
    )
    if impl == "reference":
        return moe_ffn_reference(xs, w_gate_up, w_down, group_sizes, swiglu=swiglu)
    if impl == "xla":
        return moe_ffn_xla(xs, w_gate_up, w_down, group_sizes, swiglu=swiglu)
    interp = resolve_interpret(interpret)
    gu = gate_up_config or _launch_config(xs, w_gate_up, swiglu, chip, {})
    h = grouped_matmul_pallas(xs, w_gate_up, group_sizes, swiglu=swiglu, config=gu, interpret=interp)
    dn = down_config or _launch_config(h, w_down, None, chip, {})
    return grouped_matmul_pallas(h, w_down, group_sizes, swiglu=None, config=dn, interpret=interp)


def moe_ffn_reference(
    xs: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    group_sizes: jax.Array,
    *,
    swiglu: tuple[float, float, float],
    implementation: str = "reference",
    interpret: bool | None = None,
    chip: str | None = None,
    gate_up_config: GroupedMatmulLaunchConfig | None = None,
    down_config: GroupedMatmulLaunchConfig | None = None,
) -> jax.Array:
    """:func:`moe_ffn` through ``jax.lax.ragged_dot`` (the model's original path); ``implementation``,
    ``interpret``, ``chip`` and the launch configs are named and ignored."""
    del implementation, interpret, chip, gate_up_config, down_config
    _check_ffn(xs, w_gate_up, w_down, group_sizes, swiglu)
    return _ragged(xs, group_sizes, [w_gate_up, w_down], (swiglu, None))


def moe_ffn_xla(
    xs: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    group_sizes: jax.Array,
    *,
    swiglu: tuple[float, float, float],
    implementation: str = "xla",
    interpret: bool | None = None,
    chip: str | None = None,
    gate_up_config: GroupedMatmulLaunchConfig | None = None,
    down_config: GroupedMatmulLaunchConfig | None = None,
) -> jax.Array:
    """:func:`moe_ffn` through the dropless XLA fallback (one slot layout for both products);
    ``implementation``, ``interpret``, ``chip`` and the launch configs are named and ignored."""
    del implementation, interpret, chip, gate_up_config, down_config
    _check_ffn(xs, w_gate_up, w_down, group_sizes, swiglu)
    return _slotted(xs, group_sizes, [w_gate_up, w_down], (swiglu, None))
