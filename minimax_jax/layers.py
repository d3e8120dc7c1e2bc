"""Building blocks of MiniMax-M3: Gemma RMSNorm, partial NeoX RoPE, swigluoai, dense MLP and the MoE block.

Parameters are stored in JAX layout: a linear map's ``kernel`` is ``[in, out]`` (torch stores ``[out, in]``);
the routed experts are stacked ``gate_up [E, d, 2I]`` and ``down [E, I, d]``, or, with
``cfg.expert_quantization`` ("mxfp4" / "mxfp8"), kept as the checkpoint's MX tensors in its ``[out, in]``
layout (:class:`MoE`). The linears ``cfg.quantized_linears`` names are :class:`QuantizedLinear` (MX tensors in the
checkpoint's ``[out, in]`` layout, ``w_q`` and ``w_scale``), the others :class:`Linear` (:func:`linear_for`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from minimax_jax.config import MiniMaxM3Config
from pallas_kernels.grouped_gemm import moe_ffn
from pallas_kernels.mx_formats import BLOCK as MX_BLOCK
from pallas_kernels.mx_formats import dequantize
from pallas_kernels.mx_grouped_gemm import mx_format, mx_moe_ffn


def _normal(stddev: float):
    return nnx.initializers.normal(stddev)


# RMS of the MX elements random_mx_weights draws: E2M1 codes uniform over all 16 (sqrt(mean of the squared
# values) = 2.93), E4M3 elements N(0, 64^2).
_MX_ELEMENT_RMS = {"mxfp4": 2.93, "mxfp8": 64.0}


def random_mx_weights(key: jax.Array, fmt: str, shape: tuple[int, ...], *, stddev: float = 0.02):
    """Random MX weights ``[..., N, K]`` with entries of about ``stddev`` RMS: ``(elements, scales)``, valid
    tensors of the format (``pallas_kernels.mx_formats``: MXFP4 ``uint8 [..., N, K / 2]``, MXFP8
    ``float8_e4m3fn [..., N, K]``; ``uint8 [..., N, K / 32]`` E8M0 scales, each within a factor 2 of
    ``stddev / element RMS``, so the scales vary block to block). Traceable (``jax.eval_shape``, ``jit``): the
    random init of a quantized model, and benchmark weights at M3 size."""
    *lead, n, k = shape
    if fmt not in _MX_ELEMENT_RMS:
        raise ValueError(f"fmt must be one of {tuple(_MX_ELEMENT_RMS)}, got {fmt!r}")
    if k % MX_BLOCK:
        raise ValueError(f"MX weights need the input dimension to be a multiple of {MX_BLOCK}, got shape {shape}")
    ks, ke = jax.random.split(key)
    base = 127 + round(math.log2(stddev / _MX_ELEMENT_RMS[fmt]))
    scales = (base + jax.random.randint(ks, (*lead, n, k // MX_BLOCK), -1, 2)).astype(jnp.uint8)
    if fmt == "mxfp4":
        elems = jax.random.randint(ke, (*lead, n, k // 2), 0, 256).astype(jnp.uint8)
    else:
        elems = jnp.clip(jax.random.normal(ke, shape) * 64.0, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return elems, scales


class Linear(nnx.Module):
    """``y = x @ kernel`` with a ``[in, out]`` kernel, no bias; fp32 accumulation."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, stddev: float = 0.02):
        self.in_features, self.out_features = in_features, out_features
        self.kernel = nnx.Param(_normal(stddev)(rngs.params(), (in_features, out_features), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel[...]
        y = jnp.dot(x.astype(k.dtype), k, preferred_element_type=jnp.float32)
        return y.astype(k.dtype)


class QuantizedLinear(nnx.Module):
    """A linear kept as the checkpoint's MX tensors (docs/CHECKPOINTS.md), ``y = x @ dequantize(w).T`` (:func:`mx_linear`).

    Parameters, in the checkpoint's ``[out, in]`` layout: ``w_q`` (MXFP4 ``uint8 [out, in / 2]``, two E2M1 codes a
    byte, low nibble first; MXFP8 ``float8_e4m3fn [out, in]``) and ``w_scale`` (``uint8 [out, in / 32]`` E8M0).
    The product runs in ``dtype`` (the model's), fp32 accumulation, rounded to ``dtype`` as :class:`Linear`. A
    random init draws valid MX tensors of about ``stddev`` RMS (:func:`random_mx_weights`)."""

    def __init__(self, in_features: int, out_features: int, fmt: str, *, dtype, rngs: nnx.Rngs,
                 stddev: float = 0.02):
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.dtype = jnp.dtype(dtype)
        q, s = random_mx_weights(rngs.params(), fmt, (out_features, in_features), stddev=stddev)
        self.w_q, self.w_scale = nnx.Param(q), nnx.Param(s)

    def __call__(self, x: jax.Array) -> jax.Array:
        return mx_linear(x.astype(self.dtype), self.w_q[...], self.w_scale[...]).astype(self.dtype)


def mx_linear(x: jax.Array, w_q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """``x [..., K] @ dequantize(w_q, w_scale).T`` -> fp32 ``[..., N]``: the MX weight ``[N, K]`` (format from its
    dtype, ``mx_grouped_gemm.mx_format``) decoded to x's dtype (exact: E2M1 / E4M3 values times a power of two),
    then one dot with fp32 accumulation.

    The decode is plain jnp ahead of the dot, so XLA can fuse it into the dot's operand, and the product is
    partitioned by GSPMD like a dense linear's (a ``[N, K]`` weight split along N or K, its ``[N, K / 32]``
    scales alike: docs/PARALLELISM.md). The Pallas kernel of ``mx_grouped_gemm`` (one group) is not used here:
    a Pallas call is not partitioned by GSPMD, so under tensor parallelism, which every published MiniMax-M3
    checkpoint needs, each device would gather the whole weight."""
    w = dequantize(mx_format(w_q), w_q, w_scale, dtype=x.dtype)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def linear_for(cfg: MiniMaxM3Config, path: str, in_features: int, out_features: int, *, dtype,
               rngs: nnx.Rngs) -> Linear | QuantizedLinear:
    """The linear at module path ``path`` (``layers.3.self_attn.o_proj``): a :class:`QuantizedLinear` in
    ``cfg.linear_quantization`` when ``cfg.quantized_linears`` names it, else a :class:`Linear`."""
    if path in cfg.quantized_linears:
        return QuantizedLinear(in_features, out_features, cfg.linear_quantization, dtype=dtype, rngs=rngs)
    return Linear(in_features, out_features, dtype=dtype, rngs=rngs)


class RMSNorm(nnx.Module):
    """RMSNorm in fp32: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` (Gemma style, weights initialised to 0), or
    ``... * w`` (weights initialised to 1) with ``gemma=False`` (config ``use_gemma_norm``)."""

    def __init__(self, dim: int, *, eps: float, dtype, gemma: bool = True, rngs: nnx.Rngs | None = None):
        del rngs
        self.eps = eps
        self.gemma = gemma
        self.weight = nnx.Param((jnp.zeros if gemma else jnp.ones)((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, gemma=self.gemma)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, gemma: bool = True) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    scale = weight.astype(jnp.float32)
    return (y * (1.0 + scale if gemma else scale)).astype(x.dtype)


def norm_for(cfg: MiniMaxM3Config, dim: int, *, dtype) -> RMSNorm:
    """The RMSNorm a layer of ``cfg`` uses (``eps`` and the Gemma ``1 + w`` convention from the config)."""
    return RMSNorm(dim, eps=cfg.rms_norm_eps, dtype=dtype, gemma=cfg.use_gemma_norm)


# ----------------------------------------------------------------------------------------------- RoPE
def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` of shape ``positions.shape + (rotary_dim // 2,)`` in fp32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """NeoX split-half rotation of ``x[..., :rotary_dim]``; the remaining dims pass through.

    ``x``: ``[..., S, H, D]``; ``cos``/``sin``: ``[..., S, rotary_dim // 2]`` (broadcast over heads).
    """
    half = cos.shape[-1]
    rot = 2 * half
    c, s = cos[..., None, :], sin[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:rot]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, xf[..., rot:]], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------------------------- MLPs
def swigluoai(gate_up: jax.Array, *, alpha: float, limit: float, beta: float) -> jax.Array:
    """``g = min(g, limit); u = clip(u, -limit, limit); g * sigmoid(alpha * g) * (u + beta)``.

    Gate and up are the two concatenated halves of the last axis (not interleaved).
    """
    g, u = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    g = jnp.minimum(g, limit)
    u = jnp.clip(u, -limit, limit)
    return (g * jax.nn.sigmoid(alpha * g) * (u + beta)).astype(gate_up.dtype)


class DenseMLP(nnx.Module):
    """swigluoai MLP: ``down(act(gate_up(x)))`` with a fused ``[d, 2I]`` gate/up kernel. ``prefix``: the module's
    path in the model (``layers.0.mlp``), for :func:`linear_for`."""

    def __init__(self, cfg: MiniMaxM3Config, intermediate_size: int, *, dtype, rngs: nnx.Rngs, prefix: str = ""):
        self.cfg = cfg
        self.gate_up_proj = linear_for(cfg, prefix + ".gate_up_proj", cfg.hidden_size, 2 * intermediate_size,
                                       dtype=dtype, rngs=rngs)
        self.down_proj = linear_for(cfg, prefix + ".down_proj", intermediate_size, cfg.hidden_size, dtype=dtype,
                                    rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        h = swigluoai(self.gate_up_proj(x), alpha=c.swiglu_alpha, limit=c.swiglu_limit, beta=c.swiglu_beta)
        return self.down_proj(h)


class Router(nnx.Module):
    """Sigmoid router with a selection-only correction bias."""

    def __init__(self, cfg: MiniMaxM3Config, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.kernel = nnx.Param(_normal(0.02)(rngs.params(), (cfg.hidden_size, cfg.num_local_experts), dtype))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((cfg.num_local_experts,), jnp.float32))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [N, d]`` -> ``(weights f32[N, k], experts int32[N, k])``; weights sum to routed_scaling_factor."""
        k = self.kernel[...]
        logits = jnp.dot(x.astype(k.dtype), k, preferred_element_type=jnp.float32)
        probs = jax.nn.sigmoid(logits)
        top = self.cfg.num_experts_per_tok
        if self.cfg.balanced_routing:
            return balanced_routes(x.shape[0], top, self.cfg.num_local_experts, self.cfg.routed_scaling_factor,
                                   like=probs)
        _, experts = jax.lax.top_k(probs + self.e_score_correction_bias[...].astype(jnp.float32), top)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights * self.cfg.routed_scaling_factor, experts.astype(jnp.int32)


def balanced_routes(num_tokens: int, top_k: int, num_experts: int, scale: float, *, like: jax.Array):
    """Benchmark routing (``cfg.balanced_routing``; SGLang's ``SIMULATE_UNIFORM_EXPERTS`` plays the same role):
    token ``n`` goes to experts ``(n * top_k + j) mod E``, ``j < top_k``, with equal weights summing to ``scale``.
    Every expert then gets ``N * top_k / E`` tokens (within one), the load of a well-trained router, where
    random weights would crowd a few experts. The router's product still runs (``like``: its probabilities, kept
    in the graph through a zero-weight term so its cost is measured)."""
    n = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
    experts = (n * top_k + jnp.arange(top_k, dtype=jnp.int32)[None, :]) % num_experts
    weights = jnp.full((num_tokens, top_k), scale / top_k, jnp.float32) + 0.0 * like[:, :1]
    return weights, experts


class MoE(nnx.Module):
    """Routed experts (grouped matmuls over expert-sorted tokens, ``pallas_kernels.grouped_gemm``) plus one
    always-on shared expert.

    Routed-expert parameters: ``experts_gate_up [E, d, 2I]`` (gate columns, then up) and ``experts_down
    [E, I, d]`` in the model dtype; or, with ``cfg.expert_quantization`` "mxfp4" / "mxfp8", the checkpoint's MX
    tensors in its ``[out, in]`` layout, read by the dequantizing kernel (``pallas_kernels.mx_grouped_gemm``):
    ``w_gate_up_q`` (MXFP4 ``uint8 [E, 2I, d / 2]``, two E2M1 codes a byte, low nibble first; MXFP8
    ``float8_e4m3fn [E, 2I, d]``; rows ``[0, I)`` gate ``w1``, ``[I, 2I)`` up ``w3``), ``w_gate_up_scale``
    (``uint8 [E, 2I, d / 32]`` E8M0), ``w_down_q`` (``uint8 [E, d, I / 2]`` | ``float8_e4m3fn [E, d, I]``,
    ``w2``) and ``w_down_scale`` (``uint8 [E, d, I / 32]``). A random init draws valid MX tensors
    (:func:`random_mx_weights`); the products run in the input's dtype. ``prefix``: the module's path in the model
    (``layers.1.mlp``), for the shared expert's :func:`linear_for`."""

    def __init__(self, cfg: MiniMaxM3Config, *, dtype, rngs: nnx.Rngs, prefix: str = ""):
        self.cfg = cfg
        e, d, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate = Router(cfg, dtype=dtype, rngs=rngs)
        self.quantization = cfg.expert_quantization
        if self.quantization is None:
            self.experts_gate_up = nnx.Param(_normal(0.02)(rngs.params(), (e, d, 2 * i), dtype))
            self.experts_down = nnx.Param(_normal(0.02)(rngs.params(), (e, i, d), dtype))
        else:  # the checkpoint's MX tensors, [out, in] (pallas_kernels.mx_grouped_gemm)
            q, s = random_mx_weights(rngs.params(), self.quantization, (e, 2 * i, d))
            self.w_gate_up_q, self.w_gate_up_scale = nnx.Param(q), nnx.Param(s)
            q, s = random_mx_weights(rngs.params(), self.quantization, (e, d, i))
            self.w_down_q, self.w_down_scale = nnx.Param(q), nnx.Param(s)
        self.shared_experts = (
            DenseMLP(cfg, cfg.shared_intermediate_size, dtype=dtype, rngs=rngs, prefix=prefix + ".shared_experts")
            if cfg.shared_intermediate_size > 0 else None
        )

    def __call__(self, x: jax.Array, *, implementation: str = "reference", interpret: bool | None = None,
                 token_mask: jax.Array | None = None, mesh=None) -> jax.Array:
        """``x [..., d]`` -> ``[..., d]``. ``implementation`` of the routed experts' products
        (``grouped_gemm.moe_ffn``): ``"reference"`` (the default: ``lax.ragged_dot``, differentiable),
        ``"pallas"``, ``"xla"`` (the dropless batched-matmul fallback) or ``"auto"`` (the compiled kernel on a
        GPU that supports the sizes, else ``"xla"``). ``token_mask [...]`` (optional): tokens where it is
        False (padding slots) are routed to no expert; their routed output is zero. ``mesh``: expert parallelism
        over its tensor axis (:meth:`routed`)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        mask = None if token_mask is None else token_mask.reshape(-1)
        out = self.routed(x2, implementation=implementation, interpret=interpret, token_mask=mask, mesh=mesh)
        shared = None
        if self.shared_experts is not None:
            with jax.named_scope("shared_expert"):
                shared = self.shared_experts(x2)
        with jax.named_scope("moe_combine"):
            if shared is not None:
                out = out + shared.astype(jnp.float32)
            return out.astype(x.dtype).reshape(shape)

    def routed(self, x: jax.Array, *, implementation: str = "reference", interpret: bool | None = None,
               token_mask: jax.Array | None = None, mesh=None) -> jax.Array:
        """Weighted sum of the selected experts, fp32 ``[N, d]``.

        With ``mesh`` (experts split over its ``"tensor"`` axis, docs/PARALLELISM.md): expert parallelism inside
        ``shard_map``. Every device sees every token and routing decision (replicated), runs the grouped GEMM on its
        own ``E / N`` experts only (pairs routed elsewhere are padding rows, which multiply nothing), and a
        ``psum`` adds the devices' partial sums."""
        with jax.named_scope("router"):
            weights, experts = self.gate(x)
        kw = dict(swiglu=swiglu_params(self.cfg), implementation=implementation, interpret=interpret)
        params = self.expert_params()

        def run(x, weights, experts, mask, params):
            if self.quantization is None:
                return routed_experts(x, weights, experts, *params, token_mask=mask, **kw)
            gu, gu_scale, dn, dn_scale = params
            return routed_experts(x, weights, experts, gu, dn, w_gate_up_scale=gu_scale, w_down_scale=dn_scale,
                                  token_mask=mask, **kw)

        with jax.named_scope("routed_experts"):
            return self._routed_run(run, x, weights, experts, token_mask, params, mesh)

    @staticmethod
    def _routed_run(run, x, weights, experts, token_mask, params, mesh):
        """``run`` on one device, or expert-parallel over ``mesh``'s tensor axis (:meth:`routed`)."""
        if mesh is None:
            return run(x, weights, experts, token_mask, params)
        from jax.sharding import PartitionSpec

        from minimax_jax.sharding import TENSOR

        mask = jnp.ones(x.shape[:1], bool) if token_mask is None else token_mask

        def local(x, weights, experts, mask, params):
            n_local = params[0].shape[0]
            mine = experts - jax.lax.axis_index(TENSOR) * n_local
            mine = jnp.where((mine >= 0) & (mine < n_local), mine, n_local)  # another device's: no expert here
            return jax.lax.psum(run(x, weights, mine, mask, params), TENSOR)

        rep, split = PartitionSpec(), PartitionSpec(TENSOR)
        specs = (rep, rep, rep, rep, tuple(split for _ in params))
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=rep, check_vma=False)(
            x, weights, experts, mask, params)

    def expert_params(self) -> tuple[jax.Array, ...]:
        """The routed experts' arrays, expert axis first: ``(experts_gate_up, experts_down)``, or quantized
        ``(w_gate_up_q, w_gate_up_scale, w_down_q, w_down_scale)``."""
        if self.quantization is None:
            return self.experts_gate_up[...], self.experts_down[...]
        return self.w_gate_up_q[...], self.w_gate_up_scale[...], self.w_down_q[...], self.w_down_scale[...]


def swiglu_params(cfg: MiniMaxM3Config) -> tuple[float, float, float]:
    """``(alpha, limit, beta)`` of the config's swigluoai (the kernels' ``swiglu`` argument)."""
    return float(cfg.swiglu_alpha), float(cfg.swiglu_limit), float(cfg.swiglu_beta)


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate_up: jax.Array,
                   w_down: jax.Array, *, swiglu: tuple[float, float, float],
                   implementation: str = "reference", interpret: bool | None = None,
                   token_mask: jax.Array | None = None,
                   gate_up_config=None, down_config=None,
                   w_gate_up_scale: jax.Array | None = None, w_down_scale: jax.Array | None = None) -> jax.Array:
    """The routed half of the MoE, fp32 ``[N, d]``: the ``N * k`` (token, expert) pairs sorted by expert
    (stable argsort), the tokens gathered, ``grouped_gemm.moe_ffn`` (``implementation``; launch configs of its
    two kernels, ``None``: the chip's policy), each output row scaled by its routing weight and scattered back
    onto its token. Pairs of tokens where ``token_mask`` is False sort after every expert's rows: padding rows
    of ``moe_ffn``, which multiplies nothing for them and returns zeros.

    With ``w_gate_up_scale`` and ``w_down_scale``, ``w_gate_up`` / ``w_down`` are MX elements (:class:`MoE`'s
    quantized parameters) and the products are ``mx_grouped_gemm.mx_moe_ffn``'s, in ``x``'s dtype."""
    n, k = experts.shape
    num_experts = w_gate_up.shape[0]
    flat_expert = experts.reshape(-1)
    if token_mask is not None:
        flat_expert = jnp.where(jnp.repeat(token_mask.astype(bool), k), flat_expert, num_experts)
    order = jnp.argsort(flat_expert, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)  # drops the masked pairs
    kw = dict(swiglu=swiglu, implementation=implementation, interpret=interpret, gate_up_config=gate_up_config,
              down_config=down_config)
    if (w_gate_up_scale is None) != (w_down_scale is None):
        raise ValueError("quantized experts need both w_gate_up_scale and w_down_scale")
    if w_gate_up_scale is None:
        y = moe_ffn(x[token].astype(w_gate_up.dtype), w_gate_up, w_down, group_sizes, **kw)
    else:
        y = mx_moe_ffn(x[token], w_gate_up, w_gate_up_scale, w_down, w_down_scale, group_sizes, **kw)
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(y)
