"""Dequantizing grouped GEMM: the MoE's routed experts kept in HBM as OCP MX weights (MXFP4 or MXFP8, E8M0
scales), decoded in registers by a Pallas (Triton) kernel; its dequantize-then-``ragged_dot`` reference and a
dequantize-then-dropless-XLA fallback.

Contract. As ``grouped_gemm`` (rows sorted by group, ``group_sizes: int32[G]``, padding rows at or past
``sum(gs)`` come out as exact zeros, optional fused swigluoai with gate columns ``[0, I)`` and up ``[I, 2I)``),
but each group's weight is an MX tensor in the checkpoint's ``[N, K]`` (out, in) layout:

* ``w_q``: MXFP4 ``uint8 [G, N, K / 2]`` (two E2M1 codes a byte, element ``2i`` in the low nibble) or MXFP8
  ``float8_e4m3fn [G, N, K]``; the format is read from the dtype (:func:`mx_format`);
* ``w_scale``: ``uint8 [G, N, K / 32]`` E8M0 codes, one per 32 consecutive input columns (``2 ** (v - 127)``).

The product is ``lhs @ dequantize(w)[g].T`` (``pallas_kernels.mx_formats.dequantize``) in lhs's dtype, fp32
accumulation, rounded once (the gate/up product rounded to lhs's dtype before the activation, as in
``layers.MoE``). ``mx_moe_ffn`` is the experts' whole MLP on such weights. Implementations:

* ``"reference"``: ``mx_formats.dequantize`` to lhs's dtype, then ``grouped_gemm``'s ``lax.ragged_dot`` path;
* ``"pallas"``: the kernel below (compiled Triton on a GPU, interpret mode on CPU);
* ``"xla"``: ``dequantize``, then ``grouped_gemm``'s dropless XLA fallback (it materializes the dense weights
  of every expert on each call: for chips without the kernel, not for memory);
* ``"auto"``: the compiled kernel on a GPU when :func:`supports` says so, else ``"xla"``.

Kernel. ``grouped_gemm``'s grid and program search unchanged (a 1-D grid over the ragged row tiles of the
``G + 1`` segments times the column tiles, found on the device from ``group_sizes``; bands of ``group_m`` row
tiles per column sweep). Per ``block_k`` step a program loads its ``[block_m, block_k]`` rows, then per weight
tile (two with the fused swigluoai: gate rows ``n0`` and up rows ``I + n0`` of ``w``) the packed elements as
``uint16`` words (:func:`_as_words`: Pallas' 32-bit offsets) and their ``[block_n, block_k / 32]`` scales, and
decodes in registers: E2M1 codes by bit arithmetic into float32 bits, E4M3 by a float8 conversion of each byte
(nibbles or bytes put back in element order with joins), E8M0 by placing the code in the float32 exponent
field; the decoded fp32 tile times its broadcast scales is cast to lhs's dtype (exact: at most 4 significant
bits times a power of two) and multiplied as ``rows @ tile.T`` into the fp32 accumulators. Then the activation in registers and a masked store
of the program's own rows. ``block_k`` is a multiple of 32 (one scale per 32 columns).

Bytes and FLOPs (``A`` active groups, ``R`` rows, ``b`` the rows' itemsize, ``q = 1/2`` (MXFP4) or ``1``
(MXFP8) bytes per weight element): weights ``A * K * N * (q + 1/32)`` read once per row band of a group,
rows ``R * K * b`` once per column tile (from L2), output ``R * N_out * b``; ``2 * R * K * N`` useful FLOPs
plus about 10 integer operations per decoded MXFP4 element (once per row tile). M3 gate/up (128 experts,
hidden 6144, intermediate 3072): 2.57 GB MXFP4 (0.53 ms at 4.8 TB/s), 4.98 GB MXFP8 (1.04 ms), against
9.66 GB bf16 (2.01 ms). On the H200 the decode's integer work, not the bytes, bounds the kernel today
(docs/kernels/mx_grouped_gemm.md has the tables and the measurements).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import num_tiles_bound
from pallas_kernels.attention_walk import pallas_call
from pallas_kernels.grouped_gemm import (
    grouped_matmul_reference,
    grouped_matmul_xla,
    grouped_tile_program,
    moe_ffn_reference,
    moe_ffn_xla,
)
from pallas_kernels.mx_formats import BLOCK, check_mx_shapes, dequantize
from pallas_kernels.platform import resolve_auto, resolve_interpret
from pallas_kernels.tuning import (
    COMPILED_DTYPES,
    MIN_DOT_DIM,
    GroupedMatmulLaunchConfig,
    mx_grouped_matmul_launch_config,
    pow2_divisor,
    resolve_chip,
)

__all__ = [
    "IMPLEMENTATIONS",
    "dense_weights",
    "mx_format",
    "mx_grouped_matmul",
    "mx_grouped_matmul_pallas",
    "mx_grouped_matmul_reference",
    "mx_grouped_matmul_xla",
    "mx_moe_ffn",
    "mx_moe_ffn_reference",
    "mx_moe_ffn_xla",
    "resolve_implementation",
    "supports",
]

IMPLEMENTATIONS = ("auto", "pallas", "xla", "reference")
_PACK = {"mxfp4": 2, "mxfp8": 1}  # elements per stored byte / entry


def mx_format(w_q) -> str:
    """The MX format of quantized elements from their dtype: ``uint8`` (packed E2M1) -> ``"mxfp4"``,
    ``float8_e4m3fn`` -> ``"mxfp8"``."""
    dtype = jnp.dtype(w_q.dtype)
    if dtype == jnp.uint8:
        return "mxfp4"
    if dtype == jnp.float8_e4m3fn:
        return "mxfp8"
    raise ValueError(f"MX weights must be uint8 (packed MXFP4) or float8_e4m3fn (MXFP8), got {dtype.name}")


def dense_weights(w_q, w_scale, dtype) -> jax.Array:
    """``[G, N, K]`` MX weights -> the dense ``[G, K, N]`` matrices ``grouped_gemm`` takes, in ``dtype``."""
    return jnp.swapaxes(dequantize(mx_format(w_q), w_q, w_scale, dtype=dtype), 1, 2)


# ----------------------------------------------------------------------------------------------------------
# Decoding in registers (traced in the kernel; exactly mx_formats' decoders)
# ----------------------------------------------------------------------------------------------------------


def _e8m0(s):
    """``uint8`` E8M0 codes -> float32 ``2 ** (v - 127)``: the code in the exponent field (0: 2**-127, 255:
    NaN, as ``mx_formats.decode_e8m0``)."""
    v = s.astype(jnp.int32)
    x = jax.lax.bitcast_convert_type(v << 23, jnp.float32)
    x = jnp.where(v == 0, jnp.float32(2.0**-127), x)
    return jnp.where(v == 255, jnp.float32(jnp.nan), x)


def _e2m1(codes):
    """E2M1 codes (0..15, any integer dtype) -> float32 values, as float32 bits: magnitude code ``m = 2e + b``
    is ``2 ** (e - 1) * (1 + b / 2)`` for ``m >= 2`` (exponent field ``e + 126``, mantissa bit ``b``), 0.5 for
    1, 0 for 0; bit 3 is the sign."""
    c = codes.astype(jnp.int32)
    m = c & 7
    mag = jnp.where(m >= 2, (m << 22) + (126 << 23), jnp.where(m == 1, 126 << 23, 0))
    return jax.lax.bitcast_convert_type(mag | ((c & 8) << 28), jnp.float32)


def _interleave(parts):
    """``[bn, bw]`` arrays ``parts[t]`` (element ``t`` of each word) -> ``[bn, bw * len(parts)]`` in element
    order (``t`` fastest), with joins along a new last axis (Triton's ``tt.join``); 2 or 4 parts."""
    (bn, bw), n = parts[0].shape, len(parts)
    if n == 4:  # t = 2a + b: join over a first, b last (the last join is the fastest axis)
        parts = [jnp.stack([parts[b], parts[2 + b]], axis=-1) for b in (0, 1)]
    return jnp.stack(parts, axis=-1).reshape(bn, bw * n)


def _as_words(w_q):
    """MX elements ``[G, N, K / pack]`` (uint8 or float8_e4m3fn) viewed as ``uint16 [G, N, K / pack / 2]``
    words, two bytes each (little-endian: byte ``2j`` in the low half). Pallas' Triton lowering picks 32-bit
    pointer offsets for a ref of at most 2**32 bytes, which overflow for 1-byte elements past 2**31 (M3's MXFP4
    gate/up is 2.4 GB); 2-byte words keep every offset below 2**31."""
    b = w_q if w_q.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(w_q, jnp.uint8)
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], b.shape[-1] // 2, 2), jnp.uint16)


def _weight_tile(words, s, *, fmt: str, dtype):
    """``uint16`` words ``[bn, bk / (2 pack)]`` and scales ``[bn, bk / 32]`` -> the weight tile ``[bn, bk]``
    in ``dtype`` (the checkpoint's [out, in] orientation)."""
    w = words.astype(jnp.int32)
    if fmt == "mxfp4":  # nibble t of a word is element t (byte 2j: low nibble 4j, high 4j + 1)
        elems = _e2m1(_interleave([(w >> (4 * t)) & 0xF for t in range(4)]))
    else:  # byte t of a word is element t
        f8 = [jax.lax.bitcast_convert_type(((w >> (8 * t)) & 0xFF).astype(jnp.uint8), jnp.float8_e4m3fn)
              for t in range(2)]
        elems = _interleave([x.astype(jnp.float32) for x in f8])
    bn, bk = elems.shape
    w = elems.reshape(bn, bk // BLOCK, BLOCK) * _e8m0(s)[:, :, None]
    return w.reshape(bn, bk).astype(dtype)


def _dot_nt(a, w):
    """``a [bm, bk] @ w [bn, bk].T`` with an fp32 accumulator; fp32 operands in full fp32."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------


def _mx_grouped_matmul_kernel(
    gs_ref,  # [G] int32
    lhs_ref,  # [M, K]
    q_ref,  # [G, N, K / (2 pack)] uint16: two bytes of MX elements (pack = 2 for MXFP4, 1 for MXFP8)
    s_ref,  # [G, N, K / 32] uint8 (E8M0)
    out_ref,  # [M, N_out]
    *,
    fmt: str,
    block_k: int,
    block_n: int,
    **dims,
):
    dtype = out_ref.dtype
    bq, bs = block_k // (2 * _PACK[fmt]), block_k // BLOCK

    def tile_product(a, group, col0, i):
        q0 = pl.multiple_of(i * bq, bq)
        s0 = pl.multiple_of(i * bs, bs)
        q = q_ref[group, pl.ds(col0, block_n), pl.ds(q0, bq)]  # [block_n, block_k / (2 pack)] uint16
        s = s_ref[group, pl.ds(col0, block_n), pl.ds(s0, bs)]  # [block_n, block_k / 32]
        return _dot_nt(a, _weight_tile(q, s, fmt=fmt, dtype=dtype))  # [block_m, block_n]

    grouped_tile_program(gs_ref, lhs_ref, out_ref, tile_product, block_k=block_k, block_n=block_n, **dims)


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------


def _unsupported(*, k: int, n: int, dtype, interpret: bool) -> str | None:
    """Why the kernel cannot run ``[*, k]`` rows against MX weights of ``n`` output columns (with the fused
    swigluoai, of one half) in ``dtype``; ``None`` when it can."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return f"rows must be floating, got {jnp.dtype(dtype).name}"
    if k < BLOCK or k % BLOCK or n < 1:
        return f"K={k} must be a positive multiple of the {BLOCK}-column scale block and N={n} >= 1"
    if interpret:
        return None
    if jnp.dtype(dtype).name not in COMPILED_DTYPES:
        return f"compiled kernels take {', '.join(COMPILED_DTYPES)}, got {jnp.dtype(dtype).name}"
    if pow2_divisor(n) < MIN_DOT_DIM:
        return f"compiled Triton dots need N={n} to be a multiple of {MIN_DOT_DIM}"
    return None


def supports(
    *, hidden_size: int, intermediate_size: int, dtype, chip: str | None = None, interpret: bool = False
) -> bool:
    """Whether :func:`mx_moe_ffn`'s kernels run an MoE of these sizes with rows of ``dtype``, compiled for
    ``chip`` (a chip of ``tuning.CHIPS``; ``None``: the default device's) or in interpret mode.

    Always: a floating dtype and hidden and intermediate sizes that are multiples of 32 (the scale block).
    Compiled: also a dtype of ``tuning.COMPILED_DTYPES`` and sizes that are multiples of 16 (implied). Every
    chip has the same limits (the kernel compiles for gfx942, gfx950 and sm_90: ``scripts.compile_check``).
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


def _check_weights(name: str, w_q, w_scale, k: int) -> str:
    """The format of ``name``'s ``[G, N, K / pack]`` elements and ``[G, N, K / 32]`` scales for ``k`` input
    columns; ValueError naming the tensor otherwise."""
    try:
        fmt = mx_format(w_q)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if w_q.ndim != 3:
        raise ValueError(f"{name}: MX weights must be [G, N, K / {_PACK[fmt]}], got {tuple(w_q.shape)}")
    check_mx_shapes(fmt, w_q.shape, w_q.dtype, w_scale.shape, w_scale.dtype, in_features=k, name=name)
    return fmt


def _check_inputs(lhs, w_q, w_scale, group_sizes, swiglu, name: str = "w") -> str:
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K], got {tuple(lhs.shape)}")
    if not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise ValueError(f"lhs must be floating, got {lhs.dtype}")
    fmt = _check_weights(name, w_q, w_scale, lhs.shape[1])
    if group_sizes.shape != (w_q.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        got = f"{group_sizes.dtype}{tuple(group_sizes.shape)}"
        raise ValueError(f"group_sizes must be int32[G={w_q.shape[0]}], got {got}")
    if swiglu is not None and (len(swiglu) != 3 or w_q.shape[1] % 2):
        raise ValueError(f"swiglu=(alpha, limit, beta) needs an even number of {name} rows, got "
                         f"{tuple(w_q.shape)}")
    return fmt


def _out_cols(w_q, swiglu) -> int:
    return w_q.shape[1] // 2 if swiglu is not None else w_q.shape[1]


# ----------------------------------------------------------------------------------------------------------
# Kernel wrapper and the grouped matmul entry points
# ----------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("swiglu", "config", "interpret", "poison"))
def mx_grouped_matmul_pallas(
    lhs, w_q, w_scale, group_sizes, *, swiglu, config: GroupedMatmulLaunchConfig, interpret: bool,
    poison: bool = False,
):
    """The kernel with an explicit launch ``config``. ``poison`` (tests only): the output buffer starts as NaN
    (aliased into the kernel), so a row the kernel fails to write shows up."""
    fmt = _check_inputs(lhs, w_q, w_scale, group_sizes, swiglu)
    config.validate()
    num_rows, k = lhs.shape
    num_groups = w_q.shape[0]
    n_out = _out_cols(w_q, swiglu)
    reason = _unsupported(k=k, n=n_out, dtype=lhs.dtype, interpret=interpret)
    if reason:
        raise ValueError(f"{reason}; use implementation='xla'")
    if k % config.block_k or config.block_k % BLOCK or n_out % config.block_n:
        raise ValueError(f"block_k={config.block_k} must be a multiple of {BLOCK} dividing K={k}, and "
                         f"block_n={config.block_n} must divide N={n_out}")
    if not interpret and min(config.block_m, config.block_n) < MIN_DOT_DIM:
        raise ValueError(f"compiled Triton dots need blocks >= {MIN_DOT_DIM}, got {config}")
    if num_rows == 0:
        return jnp.zeros((0, n_out), lhs.dtype)
    if 2**31 <= w_scale.size <= 2**32:  # 1-byte elements under Pallas' 32-bit offsets (_as_words)
        raise ValueError(f"w_scale {tuple(w_scale.shape)} holds {w_scale.size} bytes: the kernel indexes at most "
                         f"2**31 of them; split the experts")
    words = _as_words(w_q)
    n_tiles = n_out // config.block_n
    programs = num_tiles_bound(num_rows, num_groups, config.block_m) * n_tiles
    kernel = functools.partial(
        _mx_grouped_matmul_kernel,
        fmt=fmt,
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
            pl.BlockSpec(words.shape, lambda p: (0, 0, 0)),
            pl.BlockSpec(w_scale.shape, lambda p: (0, 0, 0)),
        ],
        out_specs=[pl.BlockSpec((num_rows, n_out), lambda p: (0, 0))],
        out_shape=[jax.ShapeDtypeStruct((num_rows, n_out), lhs.dtype)],
        args=[group_sizes.astype(jnp.int32), lhs, words, w_scale],
        poison=poison,
        interpret=interpret,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
        name=f"mx_grouped_matmul_{fmt}{'_swigluoai' if swiglu else ''}_m{c.block_m}n{c.block_n}k{c.block_k}",
    )
    return out


def _launch_config(lhs, w_q, swiglu, chip, overrides: dict) -> GroupedMatmulLaunchConfig:
    return mx_grouped_matmul_launch_config(
        num_rows=lhs.shape[0],
        num_groups=w_q.shape[0],
        k=lhs.shape[1],
        n=_out_cols(w_q, swiglu),
        fmt=mx_format(w_q),
        fused=swiglu is not None,
        itemsize=lhs.dtype.itemsize,
        chip=chip,
        **overrides,
    )


_LAUNCH = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m")


@functools.partial(jax.jit, static_argnames=("swiglu", "implementation", "interpret", "chip", *_LAUNCH))
def mx_grouped_matmul(
    lhs: jax.Array,
    w_q: jax.Array,
    w_scale: jax.Array,
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
    """Grouped matmul of rows sorted by group against MX weights, optionally with swigluoai fused (module
    docstring).

    Args:
      lhs: ``[M, K]`` rows sorted by group (bf16 or f32); rows at or past ``sum(group_sizes)`` are padding.
      w_q: ``[G, N, K / 2]`` uint8 (MXFP4, two E2M1 codes a byte, low nibble first) or ``[G, N, K]``
        float8_e4m3fn (MXFP8): one ``[out, in]`` matrix per group.
      w_scale: ``[G, N, K / 32]`` uint8 E8M0 scales.
      group_sizes: ``int32[G]`` rows per group (zeros allowed), summing to at most ``M``.
      swiglu: ``(alpha, limit, beta)``: return ``swigluoai`` of the product (gate = first half of the weight
        rows, up = second half), ``[M, N / 2]``; ``None``: the product, ``[M, N]``.
      implementation: ``"auto"``, ``"pallas"``, ``"xla"`` or ``"reference"`` (module docstring).
      interpret: ``None``: interpret mode on CPU, compiled Triton on a GPU.
      chip: a chip of ``tuning.CHIPS`` whose launch table to use (``None``: the default device's).
      block_m, block_n, block_k, num_warps, num_stages, group_m: launch overrides (``block_k`` a multiple of
        32); ``None`` asks the chip's policy (``tuning.mx_grouped_matmul_launch_config``).

    Returns:
      lhs's dtype; exact zeros on padding rows.
    """
    _check_inputs(lhs, w_q, w_scale, group_sizes, swiglu)
    impl = resolve_implementation(
        implementation, hidden_size=lhs.shape[1], intermediate_size=_out_cols(w_q, swiglu), dtype=lhs.dtype,
        interpret=interpret, chip=chip,
    )
    if impl != "pallas":
        dense = dense_weights(w_q, w_scale, lhs.dtype)
        fallback = grouped_matmul_reference if impl == "reference" else grouped_matmul_xla
        return fallback(lhs, dense, group_sizes, swiglu=swiglu)
    overrides = dict(zip(_LAUNCH, (block_m, block_n, block_k, num_warps, num_stages, group_m), strict=True))
    config = _launch_config(lhs, w_q, swiglu, chip, overrides)
    return mx_grouped_matmul_pallas(lhs, w_q, w_scale, group_sizes, swiglu=swiglu, config=config,
                                    interpret=resolve_interpret(interpret))


def mx_grouped_matmul_reference(
    lhs: jax.Array,
    w_q: jax.Array,
    w_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    swiglu: tuple[float, float, float] | None = None,
    **ignored,
) -> jax.Array:
    """:func:`mx_grouped_matmul` as ``mx_formats.dequantize`` to lhs's dtype then ``lax.ragged_dot``
    (``grouped_gemm.grouped_matmul_reference``); ``implementation``, ``interpret``, ``chip`` and the launch
    settings are accepted and ignored."""
    del ignored
    _check_inputs(lhs, w_q, w_scale, group_sizes, swiglu)
    return grouped_matmul_reference(lhs, dense_weights(w_q, w_scale, lhs.dtype), group_sizes, swiglu=swiglu)


def mx_grouped_matmul_xla(
    lhs: jax.Array,
    w_q: jax.Array,
    w_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    swiglu: tuple[float, float, float] | None = None,
    **ignored,
) -> jax.Array:
    """:func:`mx_grouped_matmul` as ``dequantize`` then ``grouped_gemm``'s dropless XLA fallback; the other
    parameters are accepted and ignored."""
    del ignored
    _check_inputs(lhs, w_q, w_scale, group_sizes, swiglu)
    return grouped_matmul_xla(lhs, dense_weights(w_q, w_scale, lhs.dtype), group_sizes, swiglu=swiglu)


# ----------------------------------------------------------------------------------------------------------
# The experts' MLP
# ----------------------------------------------------------------------------------------------------------


def _check_ffn(xs, w_gate_up_q, w_gate_up_scale, w_down_q, w_down_scale, group_sizes, swiglu) -> str:
    fmt = _check_inputs(xs, w_gate_up_q, w_gate_up_scale, group_sizes, swiglu, name="w_gate_up_q")
    num_groups, hidden = w_down_q.shape[:2] if w_down_q.ndim == 3 else (None, None)
    inter = w_gate_up_q.shape[1] // 2
    if (num_groups, hidden) != (w_gate_up_q.shape[0], xs.shape[1]):
        raise ValueError(f"w_down_q {tuple(w_down_q.shape)} must be [E={w_gate_up_q.shape[0]}, d={xs.shape[1]}, "
                         f"I / pack] for w_gate_up_q {tuple(w_gate_up_q.shape)}")
    down_fmt = _check_weights("w_down_q", w_down_q, w_down_scale, inter)
    if down_fmt != fmt:
        raise ValueError(f"w_down_q ({down_fmt}) and w_gate_up_q ({fmt}) must share one MX format")
    return fmt


@functools.partial(
    jax.jit,
    static_argnames=("swiglu", "implementation", "interpret", "chip", "gate_up_config", "down_config"),
)
def mx_moe_ffn(
    xs: jax.Array,
    w_gate_up_q: jax.Array,
    w_gate_up_scale: jax.Array,
    w_down_q: jax.Array,
    w_down_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    swiglu: tuple[float, float, float],
    implementation: str = "auto",
    interpret: bool | None = None,
    chip: str | None = None,
    gate_up_config: GroupedMatmulLaunchConfig | None = None,
    down_config: GroupedMatmulLaunchConfig | None = None,
) -> jax.Array:
    """The routed experts' MLP on MX weights over rows sorted by expert:
    ``swigluoai(xs @ W_gate_up[g].T) @ W_down[g].T`` with ``W = dequantize(w_q, w_scale)``.

    Args:
      xs: ``[M, d]`` rows sorted by expert (bf16 or f32: the compute dtype); rows at or past
        ``sum(group_sizes)`` are padding.
      w_gate_up_q: ``[E, 2I, d / 2]`` uint8 (MXFP4) or ``[E, 2I, d]`` float8_e4m3fn (MXFP8): rows ``[0, I)``
        gate (``w1``), ``[I, 2I)`` up (``w3``); w_gate_up_scale: ``[E, 2I, d / 32]`` uint8.
      w_down_q: ``[E, d, I / 2]`` uint8 or ``[E, d, I]`` float8_e4m3fn (``w2``), the same format;
        w_down_scale: ``[E, d, I / 32]`` uint8.
      group_sizes: ``int32[E]`` rows per expert, summing to at most ``M``.
      swiglu: ``(alpha, limit, beta)`` of the activation.
      implementation: ``"auto"``, ``"pallas"``, ``"xla"`` or ``"reference"`` (module docstring).
      interpret, chip: as in :func:`mx_grouped_matmul`.
      gate_up_config, down_config: launch settings of the two kernels (``None``: the chip's policy).

    Returns:
      ``[M, d]`` in xs's dtype (each product rounded to it, as in ``layers.MoE``); zeros on padding rows.
    """
    _check_ffn(xs, w_gate_up_q, w_gate_up_scale, w_down_q, w_down_scale, group_sizes, swiglu)
    impl = resolve_implementation(
        implementation, hidden_size=xs.shape[1], intermediate_size=w_gate_up_q.shape[1] // 2, dtype=xs.dtype,
        interpret=interpret, chip=chip,
    )
    if impl != "pallas":
        gu = dense_weights(w_gate_up_q, w_gate_up_scale, xs.dtype)
        dn = dense_weights(w_down_q, w_down_scale, xs.dtype)
        fallback = moe_ffn_reference if impl == "reference" else moe_ffn_xla
        return fallback(xs, gu, dn, group_sizes, swiglu=swiglu)
    interp = resolve_interpret(interpret)
    gu_cfg = gate_up_config or _launch_config(xs, w_gate_up_q, swiglu, chip, {})
    h = mx_grouped_matmul_pallas(xs, w_gate_up_q, w_gate_up_scale, group_sizes, swiglu=swiglu, config=gu_cfg,
                                 interpret=interp)
    dn_cfg = down_config or _launch_config(h, w_down_q, None, chip, {})
    return mx_grouped_matmul_pallas(h, w_down_q, w_down_scale, group_sizes, swiglu=None, config=dn_cfg,
                                    interpret=interp)


def mx_moe_ffn_reference(xs, w_gate_up_q, w_gate_up_scale, w_down_q, w_down_scale, group_sizes, *,
                         swiglu: tuple[float, float, float], **ignored) -> jax.Array:
    """:func:`mx_moe_ffn` as ``dequantize`` to xs's dtype then ``grouped_gemm.moe_ffn_reference``
    (``lax.ragged_dot``); the other parameters are accepted and ignored."""
    del ignored
    _check_ffn(xs, w_gate_up_q, w_gate_up_scale, w_down_q, w_down_scale, group_sizes, swiglu)
    return moe_ffn_reference(xs, dense_weights(w_gate_up_q, w_gate_up_scale, xs.dtype),
                             dense_weights(w_down_q, w_down_scale, xs.dtype), group_sizes, swiglu=swiglu)


def mx_moe_ffn_xla(xs, w_gate_up_q, w_gate_up_scale, w_down_q, w_down_scale, group_sizes, *,
                   swiglu: tuple[float, float, float], **ignored) -> jax.Array:
    """:func:`mx_moe_ffn` as ``dequantize`` then ``grouped_gemm.moe_ffn_xla`` (the dropless fallback); the
    other parameters are accepted and ignored."""
    del ignored
    _check_ffn(xs, w_gate_up_q, w_gate_up_scale, w_down_q, w_down_scale, group_sizes, swiglu)
    return moe_ffn_xla(xs, dense_weights(w_gate_up_q, w_gate_up_scale, xs.dtype),
                       dense_weights(w_down_q, w_down_scale, xs.dtype), group_sizes, swiglu=swiglu)
