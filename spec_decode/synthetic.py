"""Emulated acceptance for benchmarks (docs/ADAPTIVE_VERIFICATION.md, "Emulated acceptance").

A model with random weights accepts drafts at random, so its measured speed says nothing about speculative
decoding. The serving engines offer a synthetic-acceptance mode for that case (vLLM's
``rejection_sample_method="synthetic"``, SGLang's ``SGLANG_SIMULATE_ACC_LEN``, TensorRT-LLM's
``TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS``); this one also emulates the confidences, which adaptive
verification plans and allocates by:

* ``rates r_k`` (vLLM's semantics) are the unconditional probabilities that the first ``k`` drafts are accepted,
  non-increasing in ``[0, 1]``; an acceptance length ``L`` stands for ``[1] * floor(L - 1) + [frac] + [0] * rest``.
  Their conditional rates are ``c_k = r_k / r_{k-1}``.
* **Each request has a latent profile**: conditional rates ``p[k] ~ Beta(kappa c_k, kappa (1 - c_k))`` drawn from
  the request's seed (``kappa = concentration``, default 10: a standard deviation of
  ``sqrt(c (1 - c) / (kappa + 1))``, 0.15 at ``c = 0.5``), independent across positions, so the mean over requests of
  ``prod_{i <= k} p[i]`` is ``r_k``. Rates of exactly 0 or 1 stay 0 or 1.
* The profile is **both** the acceptance probability and the confidence the planner and the allocator see (so they
  are calibrated by construction), unless ``noise > 0``: the confidences are then ``sigmoid(logit(p) + noise *
  z)``, ``z`` a standard normal per request and position, miscalibrated on purpose.
* **Draws** are per request and position, on the device inside the step, from (request seed, position): every
  device and every tensor-parallel rank draws the same, and nothing synchronises. Draft ``j`` is accepted when the
  drafts before it were and ``u < p[j]``; an accepted draft emits the real draft token, the first rejection (or the
  bonus after the last verified draft) emits the target's own token at that row (its argmax, or a sample for a
  sampled request). Both forwards run unchanged, so a step costs what a real one costs.

Emulated runs report ``acceptance="emulated"`` in their statistics: their tokens are not the target's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.rejection import RejectionOutput, sample_tokens, sampling_key

__all__ = ["STREAM_SYNTHETIC", "acceptance_rates", "conditional_rates", "emulated_accept_packed",
           "emulated_confidences", "request_profiles"]

STREAM_SYNTHETIC = 3  # the sampling-key stream of the acceptance draws (the others: rejection.STREAM_*)
_PROFILE_POSITION = -1  # the key position of a request's latent profile (no real position is negative)
_NOISE_POSITION = -2


def acceptance_rates(num_speculative_tokens: int, *, rates: Sequence[float] | None = None,
                     length: float | None = None) -> tuple[float, ...]:
    """The ``K`` unconditional rates from ``rates`` (validated) or from an acceptance ``length`` (host side).

    Raises ``ValueError`` for both or neither, a length outside ``[1, K + 1]``, rates of another length than ``K``,
    outside ``[0, 1]``, not finite or increasing."""
    k = int(num_speculative_tokens)
    if (rates is None) == (length is None):
        raise ValueError("give synthetic_acceptance_rates or synthetic_acceptance_length, not both")
    if length is not None:
        if isinstance(length, bool) or not isinstance(length, (int, float, np.integer, np.floating)) or not (
                math.isfinite(length) and 1.0 <= length <= k + 1):
            raise ValueError(f"synthetic_acceptance_length must be a number in [1, K + 1 = {k + 1}] (tokens per "
                             f"step, the bonus included), got {length!r}")
        whole = int(math.floor(length - 1))
        out = [1.0] * whole + ([length - 1 - whole] if whole < k else [])
        return tuple(out + [0.0] * (k - len(out)))
    try:
        out = tuple(float(x) for x in rates)
    except (TypeError, ValueError):
        raise ValueError(f"synthetic_acceptance_rates must be a sequence of K = {k} numbers, got {rates!r}") from None
    if len(out) != k:
        raise ValueError(f"synthetic_acceptance_rates must hold K = {k} rates (one per draft position), got {len(out)}")
    if not all(math.isfinite(x) and 0.0 <= x <= 1.0 for x in out):
        raise ValueError(f"synthetic_acceptance_rates must lie in [0, 1], got {list(out)}")
    if any(b > a for a, b in zip(out, out[1:])):
        raise ValueError(f"synthetic_acceptance_rates are P(the first k drafts are accepted): non-increasing, got "
                         f"{list(out)}")
    return out


def conditional_rates(rates: Sequence[float]) -> tuple[float, ...]:
    """``c_k = r_k / r_{k-1}`` (``r_0 = 1``; 0 after a rate of 0)."""
    out, prev = [], 1.0
    for r in rates:
        out.append(min(1.0, r / prev) if prev > 0 else 0.0)
        prev = r
    return tuple(out)


def request_profiles(seeds: jax.Array, base: Sequence[float], *, concentration: float) -> jax.Array:
    """``f32[R, K]``: each request's conditional acceptance rates, ``Beta(kappa c_k, kappa (1 - c_k))`` from its seed.

    ``base`` (static) holds the ``K`` conditional rates ``c_k``; 0 and 1 stay exact."""
    c = jnp.asarray(base, jnp.float32)
    inner = (c > 0.0) & (c < 1.0)
    safe = jnp.where(inner, c, 0.5)

    def one(seed):
        key = sampling_key(seed, jnp.asarray(_PROFILE_POSITION, jnp.int32), STREAM_SYNTHETIC)
        return jax.random.beta(key, concentration * safe, concentration * (1.0 - safe))

    p = jax.vmap(one)(jnp.asarray(seeds, jnp.int32))
    return jnp.where(inner[None, :], p, c[None, :]).astype(jnp.float32)


def emulated_confidences(profiles: jax.Array, seeds: jax.Array, *, noise: float) -> jax.Array:
    """The confidences the planner and allocator see: the profiles, or with ``noise > 0`` (static) the profiles
    miscalibrated in logit space by ``noise`` standard normals per request and position."""
    if noise <= 0:
        return profiles
    p = jnp.clip(profiles, 1e-6, 1.0 - 1e-6)
    z = jax.vmap(lambda s: jax.random.normal(
        sampling_key(s, jnp.asarray(_NOISE_POSITION, jnp.int32), STREAM_SYNTHETIC), profiles.shape[1:]))(
        jnp.asarray(seeds, jnp.int32))
    return jax.nn.sigmoid(jnp.log(p) - jnp.log1p(-p) + noise * z)


def emulated_accept_packed(packed_logits: jax.Array, query_start_loc: jax.Array, draft_tokens: jax.Array,
                           profiles: jax.Array, seeds: jax.Array, positions: jax.Array, *, temperature,
                           row_mask: jax.Array | None = None, mesh=None) -> RejectionOutput:
    """The rejection step of an emulated run (the module docstring), on the verify step's packed logits.

    Same arguments and output as :func:`spec_decode.rejection.rejection_sample_packed` except ``profiles f32[R, K]``
    (each request's acceptance probabilities) in place of the draft distributions; ``mesh``: the emitted token is
    sampled on the vocabulary shards (:func:`spec_decode.rejection.sample_tokens`)."""
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    r, k = draft_tokens.shape
    q_len = qsl[1:] - qsl[:-1]
    valid = q_len > 0
    if row_mask is not None:
        valid = valid & jnp.asarray(row_mask, bool)
    nv = jnp.where(valid, jnp.clip(q_len - 1, 0, k), 0)
    pos = jnp.asarray(positions, jnp.int32)
    j = jnp.arange(k, dtype=jnp.int32)
    u = jax.vmap(lambda s, p0: jax.vmap(lambda jj: jax.random.uniform(
        sampling_key(s, p0 + 1 + jj, STREAM_SYNTHETIC)))(j))(jnp.asarray(seeds, jnp.int32), pos)  # [R, K]
    accept = (u < profiles[:, :k]) & (j[None, :] < nv[:, None])
    num_acc = jnp.where(valid, jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1), 0).astype(jnp.int32)
    row = jnp.clip(qsl[:-1] + num_acc, 0, packed_logits.shape[0] - 1)
    final = sample_tokens(packed_logits[row], jnp.asarray(seeds, jnp.int32), pos + 1 + num_acc,
                          temperature=temperature, mesh=mesh)
    steps = jnp.arange(k + 1, dtype=jnp.int32)
    out = jnp.where(j[None, :] < num_acc[:, None], draft_tokens.astype(jnp.int32), -1)
    out = jnp.concatenate([out, jnp.full((r, 1), -1, jnp.int32)], axis=1)
    out = jnp.where((steps[None, :] == num_acc[:, None]) & valid[:, None], final[:, None], out)
    return RejectionOutput(num_acc, out, jnp.where(valid, num_acc + 1, 0).astype(jnp.int32))

