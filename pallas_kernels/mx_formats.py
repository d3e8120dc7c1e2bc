"""OCP microscaling (MX) weight formats as the published MiniMax-M3 checkpoints ship them, decoded in jnp.

Both formats quantize a ``[N, K]`` linear weight (PyTorch layout: output rows, input columns) in blocks of
``BLOCK = 32`` consecutive input columns that share one power-of-two scale:

* **Scales (E8M0)**: ``uint8 [N, K / 32]``; code ``v`` means ``2 ** (v - 127)``; ``v = 255`` is NaN (the OCP MX
  specification, v1.0, section 5.4). The MXFP8 release names the tensor ``weight_scale_inv`` and the AMD Quark
  MXFP4 release ``weight_scale``; both hold the multiplier itself (the value is ``element * scale``).
* **MXFP8**: ``float8_e4m3fn [N, K]`` elements (``MiniMaxAI/MiniMax-M3-MXFP8``).
* **MXFP4**: ``uint8 [N, K / 2]``, two E2M1 codes per byte, element ``2i`` in the low nibble and ``2i + 1`` in
  the high one (``amd/MiniMax-M3-MXFP4``). Codes 0..7 are ``0, 0.5, 1, 1.5, 2, 3, 4, 6``; codes 8..15 their
  negatives (sign bit 3).

Everything here works on arrays with any leading dimensions (``[..., N, K]``: the experts of a layer stack as
``[E, N, K]``), on the host or inside a jitted program. The kernels that keep weights quantized in HBM use these
functions as their references.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = [
    "BLOCK",
    "E2M1_VALUES",
    "FORMATS",
    "check_mx_shapes",
    "decode_e8m0",
    "dequantize",
    "pack_fp4",
    "quantize_reference",
    "unpack_fp4",
]

BLOCK = 32  # input columns per scale
FORMATS = ("mxfp4", "mxfp8")
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)


def decode_e8m0(scales) -> jnp.ndarray:
    """``uint8`` E8M0 codes -> float32 ``2 ** (v - 127)`` (NaN for 255). Exact: every value is a power of two
    inside float32's range (2**-127 is a subnormal)."""
    v = jnp.asarray(scales)
    if v.dtype != jnp.uint8:
        raise TypeError(f"E8M0 scales must be uint8, got {v.dtype}")
    bits = v.astype(jnp.uint32) << 23  # the code is the float32 exponent field
    out = jnp.where(v == 0, jnp.float32(2.0 ** -127), bits.view(jnp.float32))
    return jnp.where(v == 255, jnp.float32(jnp.nan), out)


def unpack_fp4(packed) -> jnp.ndarray:
    """``uint8 [..., K / 2]`` -> E2M1 values ``float32 [..., K]`` (low nibble first)."""
    p = jnp.asarray(packed)
    if p.dtype != jnp.uint8:
        raise TypeError(f"packed MXFP4 elements must be uint8, got {p.dtype}")
    codes = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    return jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]


def pack_fp4(codes) -> np.ndarray:
    """E2M1 codes ``uint8 [..., K]`` (0..15) -> ``uint8 [..., K / 2]`` (numpy; fixtures and tests)."""
    c = np.asarray(codes, np.uint8)
    if c.shape[-1] % 2:
        raise ValueError(f"MXFP4 packs pairs of columns; got K = {c.shape[-1]}")
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def check_mx_shapes(fmt: str, weight_shape, weight_dtype, scale_shape, scale_dtype, *, in_features: int,
                    name: str = "weight") -> None:
    """Raise ``ValueError`` naming ``name`` when a quantized tensor and its scales do not fit ``in_features``."""
    if fmt not in FORMATS:
        raise ValueError(f"{name}: unknown MX format {fmt!r}; supported: {', '.join(FORMATS)}")
    k = in_features
    if k % BLOCK:
        raise ValueError(f"{name}: {fmt} needs the input dimension to be a multiple of {BLOCK}, got {k}")
    want_cols, want_dtype = (k // 2, np.dtype(np.uint8)) if fmt == "mxfp4" else (k, np.dtype(jnp.float8_e4m3fn))
    if np.dtype(weight_dtype) != want_dtype:
        raise ValueError(f"{name}: {fmt} elements must be {want_dtype}, got {np.dtype(weight_dtype)}")
    if tuple(weight_shape)[-1] != want_cols:
        raise ValueError(f"{name}: {fmt} weight {tuple(weight_shape)} has {tuple(weight_shape)[-1]} columns; "
                         f"an input dimension of {k} packs into {want_cols}")
    want_scales = (*tuple(weight_shape)[:-1], k // BLOCK)
    if np.dtype(scale_dtype) != np.dtype(np.uint8):
        raise ValueError(f"{name}: E8M0 scales must be uint8, got {np.dtype(scale_dtype)}")
    if tuple(scale_shape) != want_scales:
        raise ValueError(f"{name}: scales {tuple(scale_shape)} do not match the weight: expected {want_scales} "
                         f"(one per {BLOCK} input columns)")


def dequantize(fmt: str, weight, scales, *, dtype=jnp.float32) -> jnp.ndarray:
    """The dense ``[..., N, K]`` weight of an MX tensor (values ``element * 2 ** (scale - 127)``), in ``dtype``.
    The product is exact in float32 (E2M1 and E4M3 values times a power of two), so one rounding to ``dtype``."""
    w, s = jnp.asarray(weight), jnp.asarray(scales)
    k = w.shape[-1] * (2 if fmt == "mxfp4" else 1)
    check_mx_shapes(fmt, w.shape, w.dtype, s.shape, s.dtype, in_features=k)
    elems = unpack_fp4(w) if fmt == "mxfp4" else w.astype(jnp.float32)
    blocks = elems.reshape(*elems.shape[:-1], k // BLOCK, BLOCK) * decode_e8m0(s)[..., None]
    return blocks.reshape(elems.shape).astype(dtype)


def quantize_reference(fmt: str, dense) -> tuple[np.ndarray, np.ndarray]:
    """A dense ``[..., N, K]`` float array -> ``(weight, scales)`` in ``fmt`` (numpy, for fixtures and tests): the
    scale of each block is the power of two that puts its largest magnitude at or below the format's largest
    element (6 for E2M1, 448 for E4M3), elements rounded to the nearest representable value."""
    x = np.asarray(dense, np.float32)
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"the input dimension must be a multiple of {BLOCK}, got {k}")
    blocks = x.reshape(*x.shape[:-1], k // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    top = 6.0 if fmt == "mxfp4" else 448.0
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / top)), -127.0)
    exp = np.clip(exp, -127, 127)
    scaled = blocks / np.exp2(exp)[..., None]
    scales = (exp + 127).astype(np.uint8)
    if fmt == "mxfp8":
        elems = np.clip(scaled, -448.0, 448.0).astype(jnp.float8_e4m3fn).reshape(x.shape)
        return elems, scales
    if fmt != "mxfp4":
        raise ValueError(f"unknown MX format {fmt!r}; supported: {', '.join(FORMATS)}")
    mags = E2M1_VALUES[:8]
    idx = np.abs(np.abs(scaled)[..., None] - mags).argmin(axis=-1).astype(np.uint8)
    codes = np.where((scaled < 0) & (idx > 0), idx + 8, idx).astype(np.uint8).reshape(x.shape)
    return pack_fp4(codes), scales
