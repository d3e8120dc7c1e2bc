"""Building blocks of MiniMax-M3: Gemma RMSNorm, partial NeoX RoPE, swigluoai, dense MLP and the MoE block.

Parameters are stored in JAX layout: a linear map's ``kernel`` is ``[in, out]`` (torch stores ``[out, in]``);
the routed experts are stacked ``gate_up [E, d, 2I]`` and ``down [E, I, d]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from minimax_jax.config import MiniMaxM3Config
from pallas_kernels.grouped_gemm import moe_ffn


def _normal(stddev: float):
    return nnx.initializers.normal(stddev)


class Linear(nnx.Module):
    """``y = x @ kernel`` with a ``[in, out]`` kernel, no bias; fp32 accumulation."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, stddev: float = 0.02):
        self.in_features, self.out_features = in_features, out_features
        self.kernel = nnx.Param(_normal(stddev)(rngs.params(), (in_features, out_features), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel[...]
        y = jnp.dot(x.astype(k.dtype), k, preferred_element_type=jnp.float32)
        return y.astype(k.dtype)


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
    """swigluoai MLP: ``down(act(gate_up(x)))`` with a fused ``[d, 2I]`` gate/up kernel."""

    def __init__(self, cfg: MiniMaxM3Config, intermediate_size: int, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * intermediate_size, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate_size, cfg.hidden_size, dtype=dtype, rngs=rngs)

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
        _, experts = jax.lax.top_k(probs + self.e_score_correction_bias[...].astype(jnp.float32),
                                   self.cfg.num_experts_per_tok)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights * self.cfg.routed_scaling_factor, experts.astype(jnp.int32)


class MoE(nnx.Module):
    """Routed experts (grouped matmuls over expert-sorted tokens, ``pallas_kernels.grouped_gemm``) plus one
    always-on shared expert."""

    def __init__(self, cfg: MiniMaxM3Config, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        e, d, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate = Router(cfg, dtype=dtype, rngs=rngs)
        self.experts_gate_up = nnx.Param(_normal(0.02)(rngs.params(), (e, d, 2 * i), dtype))
        self.experts_down = nnx.Param(_normal(0.02)(rngs.params(), (e, i, d), dtype))
        self.shared_experts = (
            DenseMLP(cfg, cfg.shared_intermediate_size, dtype=dtype, rngs=rngs)
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
        if self.shared_experts is not None:
            out = out + self.shared_experts(x2).astype(jnp.float32)
        return out.astype(x.dtype).reshape(shape)

    def routed(self, x: jax.Array, *, implementation: str = "reference", interpret: bool | None = None,
               token_mask: jax.Array | None = None, mesh=None) -> jax.Array:
        """Weighted sum of the selected experts, fp32 ``[N, d]``.

        With ``mesh`` (experts split over its ``"tensor"`` axis, docs/PARALLELISM.md): expert parallelism inside
        ``shard_map``. Every device sees every token and routing decision (replicated), runs the grouped GEMM on its
        own ``E / N`` experts only (pairs routed elsewhere are padding rows, which multiply nothing), and a
        ``psum`` adds the devices' partial sums."""
        weights, experts = self.gate(x)
        kw = dict(swiglu=swiglu_params(self.cfg), implementation=implementation, interpret=interpret)
        if mesh is None:
            return routed_experts(x, weights, experts, self.experts_gate_up[...], self.experts_down[...],
                                  token_mask=token_mask, **kw)
        from jax.sharding import PartitionSpec

        from minimax_jax.sharding import TENSOR

        mask = jnp.ones(x.shape[:1], bool) if token_mask is None else token_mask

        def local(x, weights, experts, mask, w_gate_up, w_down):
            n_local = w_gate_up.shape[0]
            mine = experts - jax.lax.axis_index(TENSOR) * n_local
            mine = jnp.where((mine >= 0) & (mine < n_local), mine, n_local)  # another device's: no expert here
            y = routed_experts(x, weights, mine, w_gate_up, w_down, token_mask=mask, **kw)
            return jax.lax.psum(y, TENSOR)

        rep, split = PartitionSpec(), PartitionSpec(TENSOR)
        return jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, rep, rep, split, split), out_specs=rep,
                             check_vma=False)(x, weights, experts, mask, self.experts_gate_up[...],
                                              self.experts_down[...])


def swiglu_params(cfg: MiniMaxM3Config) -> tuple[float, float, float]:
    """``(alpha, limit, beta)`` of the config's swigluoai (the kernels' ``swiglu`` argument)."""
    return float(cfg.swiglu_alpha), float(cfg.swiglu_limit), float(cfg.swiglu_beta)


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate_up: jax.Array,
                   w_down: jax.Array, *, swiglu: tuple[float, float, float],
                   implementation: str = "reference", interpret: bool | None = None,
                   token_mask: jax.Array | None = None,
                   gate_up_config=None, down_config=None) -> jax.Array:
    """The routed half of the MoE, fp32 ``[N, d]``: the ``N * k`` (token, expert) pairs sorted by expert
    (stable argsort), the tokens gathered, ``grouped_gemm.moe_ffn`` (``implementation``; launch configs of its
    two kernels, ``None``: the chip's policy), each output row scaled by its routing weight and scattered back
    onto its token. Pairs of tokens where ``token_mask`` is False sort after every expert's rows: padding rows
    of ``moe_ffn``, which multiplies nothing for them and returns zeros."""
    n, k = experts.shape
    num_experts = w_gate_up.shape[0]
    flat_expert = experts.reshape(-1)
    if token_mask is not None:
        flat_expert = jnp.where(jnp.repeat(token_mask.astype(bool), k), flat_expert, num_experts)
    order = jnp.argsort(flat_expert, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)  # drops the masked pairs
    xs = x[token].astype(w_gate_up.dtype)
    y = moe_ffn(xs, w_gate_up, w_down, group_sizes, swiglu=swiglu, implementation=implementation,
                interpret=interpret, gate_up_config=gate_up_config, down_config=down_config)
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(y)
