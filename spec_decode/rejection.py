"""Lossless rejection sampling of verified drafts (docs/ADAPTIVE_VERIFICATION.md): greedy and stochastic.

Per request ``r`` with anchor at absolute position ``s = positions[r]`` and ``v = num_verified[r]`` verified drafts
``x_1..x_v`` (``0 <= v <= K``), verify row ``i`` (``0 <= i <= v``) is the target distribution of the token at
position ``s + i + 1``, i.e. after the anchor and the first ``i`` drafts. Rows beyond ``v`` are ignored.

* Greedy (``temperature == 0``): accept ``x_k`` while it equals the argmax of row ``k - 1``; at the first
  mismatch emit that argmax; if all ``v`` are accepted emit the argmax of row ``v`` (the bonus). Argmax ties go
  to the lower token id.
* Stochastic: ``p_t = softmax(logits / T)`` (or probabilities passed directly), ``p_d`` the Markov-corrected
  draft distribution the drafts were sampled from. Accept ``x_k`` iff ``u_k * p_d(x_k) < p_t(x_k)`` (that is
  ``u_k < min(1, p_t / p_d)`` without a division); at the first rejection sample from
  ``norm(max(0, p_t - p_d))``; if all ``v`` are accepted sample the bonus from row ``v``.

Each step emits ``num_accepted + 1`` tokens, and the emitted sequence has exactly the target's distribution for
any ``v`` as long as the choice of verifying draft ``k`` depends only on drafts before ``k`` and earlier steps.

Randomness is a deterministic function of (request seed, absolute position, stream):
``fold_in(fold_in(key(seed), position), stream)``. Tokens are drawn by Gumbel-max, ``argmax_v(log p_v + g_v)``,
with noise ``g_v`` that depends on the position's key and the token id ``v`` alone
(:func:`spec_decode.vocab_shards.gumbel_noise`), so the sampler gives the same tokens on one device and on the
vocabulary shards of a mesh (``mesh=``: the logits split over the tensor axis, as the LM head computes them;
docs/PARALLELISM.md, "The sampler on the mesh"). The acceptance test of the draft at position ``p`` uses
stream :data:`STREAM_ACCEPT`; the residual/bonus token sampled at position ``p`` uses :data:`STREAM_RESAMPLE`
(also :func:`sample_tokens`, e.g. at prefill). A drafter that samples with the same derivation must use another
stream (:data:`STREAM_DRAFT`): the acceptance uniform has to be independent of the draft it judges.

Memory: only one full vocabulary row per request is materialised (the row of the emitted token); the accept
tests gather scalars, so the packed layout is consumed in place without an ``[R, K + 1, V]`` copy. On a mesh
each device reads its own slice of the vocabulary, and only ``R x N``-sized values cross devices.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.metadata import query_lens, token_to_request
from spec_decode.vocab_shards import Vocab, gumbel_argmax, split_vocab, vocab_shards

__all__ = [
    "STREAM_ACCEPT",
    "STREAM_DRAFT",
    "STREAM_RESAMPLE",
    "RejectionOutput",
    "rejection_sample",
    "rejection_sample_packed",
    "sample_tokens",
    "sampling_key",
]

STREAM_ACCEPT = 0
STREAM_RESAMPLE = 1
STREAM_DRAFT = 2


class RejectionOutput(NamedTuple):
    num_accepted: jax.Array  # int32[R]       accepted drafts (0 for padding rows)
    output_tokens: jax.Array  # int32[R, K+1]  accepted drafts, then the corrected/bonus token, -1 padded
    num_emitted: jax.Array  # int32[R]       num_accepted + 1 (0 for padding rows)


def sampling_key(seed: jax.Array, position: jax.Array, stream: int) -> jax.Array:
    """The PRNG key of (request seed, absolute position, stream); scalars in, one typed key out."""
    base = jax.random.key(jnp.asarray(seed).astype(jnp.uint32))
    return jax.random.fold_in(jax.random.fold_in(base, jnp.asarray(position, jnp.int32)), stream)


def _keys(seeds: jax.Array, positions: jax.Array, streams: jax.Array | int) -> jax.Array:
    """Keys for ``seeds [R]``, ``positions [R, M]`` and ``streams`` (an int or ``[R, M]``) -> ``[R, M]``."""
    streams = jnp.broadcast_to(jnp.asarray(streams, jnp.int32), positions.shape)
    per_row = jax.vmap(sampling_key, in_axes=(None, 0, 0))
    return jax.vmap(per_row, in_axes=(0, 0, 0))(seeds, positions, streams)


def _greedy(top: jax.Array, drafts: jax.Array, in_verified: jax.Array):
    """Greedy rule on ``top [R, K+1]`` (argmax of each verify row): (num_accepted [R], final token [R])."""
    k = drafts.shape[1]
    ok = (drafts == top[:, :k]) & in_verified
    num_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    return num_acc, jnp.take_along_axis(top, num_acc[:, None], axis=1)[:, 0]


def _stochastic(
    flat, rows, nv, in_verified, drafts, draft_probs, seeds, positions, req_t, flat_t, inputs_are_probs, vocab
):
    """Rejection sampling proper: (num_accepted [R], final token [R]). ``req_t [R]``, ``flat_t [N]`` > 0.
    ``flat`` and ``draft_probs`` hold this device's slice of the vocabulary (``vocab``)."""
    r, k = drafts.shape
    steps = jnp.arange(k + 1, dtype=jnp.int32)
    draft_rows = rows[:, :k]  # [R, K]
    safe_x = jnp.clip(drafts, 0, vocab.size - 1)
    picked = vocab.pick(flat, draft_rows, safe_x).astype(jnp.float32)  # [R, K]
    if inputs_are_probs:
        p_t = picked
    else:
        lse = vocab.logsumexp(flat.astype(jnp.float32) / flat_t[:, None])  # [N]
        p_t = jnp.exp(picked / req_t[:, None] - lse[draft_rows])
    p_d = vocab.take(draft_probs, safe_x).astype(jnp.float32)
    # Keys of both streams at every position s+1..s+K+1, derived in one batch (fewer inlined hashes): the accept
    # test of draft k uses (s+1+k, ACCEPT); the emitted token, known only afterwards, (s+1+a, RESAMPLE).
    pos_all = positions[:, None] + 1 + steps[None, :]  # [R, K+1]
    pos_both = jnp.concatenate([pos_all, pos_all], axis=1)  # [R, 2K+2]
    stream_both = jnp.concatenate(
        [jnp.full_like(pos_all, STREAM_ACCEPT), jnp.full_like(pos_all, STREAM_RESAMPLE)], axis=1
    )
    keys = _keys(seeds, pos_both, stream_both)
    accept_keys, resample_keys = keys[:, : k + 1], keys[:, k + 1 :]  # [R, K+1] each
    u = jax.vmap(jax.vmap(lambda kk: jax.random.uniform(kk, (), jnp.float32)))(accept_keys[:, :k])
    ok = (u * p_d < p_t) & in_verified
    num_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

    # The emitted token's row: the residual after a rejection, the bonus row when everything was accepted.
    final_row = flat[jnp.take_along_axis(rows, num_acc[:, None], axis=1)[:, 0]].astype(jnp.float32)  # [R, V]
    if inputs_are_probs:
        target = final_row / jnp.maximum(vocab.sum(final_row), 1e-30)[:, None]
    else:
        target = vocab.softmax(final_row / req_t[:, None])
    if k > 0:
        d_row = jnp.take_along_axis(draft_probs, jnp.minimum(num_acc, k - 1)[:, None, None], axis=1)[:, 0]
        d_row = d_row.astype(jnp.float32)  # [R, V]
    else:
        d_row = jnp.zeros_like(target)
    rejected = num_acc < nv
    residual = jnp.maximum(target - d_row, 0.0)  # elementwise: on a mesh each device its own tokens
    usable = vocab.sum(residual) > 0.0  # p_t == p_d exactly: a rejection has probability 0
    dist = jnp.where((rejected & usable)[:, None], residual, target)
    logp = jnp.where(dist > 0.0, jnp.log(jnp.where(dist > 0.0, dist, 1.0)), -jnp.inf)
    final = gumbel_argmax(resample_keys[jnp.arange(r), num_acc], logp, vocab)  # at position s + 1 + num_accepted
    return num_acc, final


def _rule(
    flat: jax.Array,  # [N, V]      target logits (or probabilities) rows (on a mesh: this device's slice of V)
    row_start: jax.Array,  # [R]         row of request r's verify row 0 in `flat`
    num_verified: jax.Array,  # [R]         verified drafts per request
    valid: jax.Array,  # [R]         False for padding rows
    draft_tokens: jax.Array,  # [R, K]
    seeds: jax.Array,  # [R]
    positions: jax.Array,  # [R]         absolute position of the anchor
    req_t: jax.Array,  # [R]         temperature per request (<= 0: greedy)
    flat_t: jax.Array,  # [N]         temperature of each row of `flat`
    draft_probs: jax.Array | None,  # [R, K, V]   (not read when greedy)
    *,
    mode: str,  # "greedy" | "sample" | "mixed" (per-request choice)
    inputs_are_probs: bool,
    vocab: Vocab,
) -> RejectionOutput:
    n_rows = flat.shape[0]
    r, k = draft_tokens.shape
    nv = jnp.where(valid, jnp.clip(num_verified, 0, k), 0)  # [R]
    steps = jnp.arange(k + 1, dtype=jnp.int32)
    rows = jnp.clip(row_start[:, None] + jnp.minimum(steps[None, :], nv[:, None]), 0, n_rows - 1)  # [R, K+1]
    in_verified = steps[None, :k] < nv[:, None]  # [R, K]

    if mode in ("greedy", "mixed"):
        top = vocab.argmax(flat)[rows]  # [R, K+1]
        num_acc, final = _greedy(top, draft_tokens, in_verified)
    if mode in ("sample", "mixed"):
        greedy_row = req_t <= 0.0
        safe_req = jnp.where(greedy_row, 1.0, req_t)
        safe_flat = jnp.where(flat_t <= 0.0, 1.0, flat_t)
        s_acc, s_final = _stochastic(
            flat,
            rows,
            nv,
            in_verified,
            draft_tokens,
            draft_probs,
            seeds,
            positions,
            safe_req,
            safe_flat,
            inputs_are_probs,
            vocab,
        )
        if mode == "mixed":
            num_acc, final = jnp.where(greedy_row, num_acc, s_acc), jnp.where(greedy_row, final, s_final)
        else:
            num_acc, final = s_acc, s_final

    num_acc = jnp.where(valid, num_acc, 0)
    out = jnp.where(steps[None, :k] < num_acc[:, None], draft_tokens, -1)
    out = jnp.concatenate([out, jnp.full((r, 1), -1, jnp.int32)], axis=1)  # [R, K+1]
    out = jnp.where((steps[None, :] == num_acc[:, None]) & valid[:, None], final[:, None], out)
    return RejectionOutput(num_acc, out, jnp.where(valid, num_acc + 1, 0).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("mode", "inputs_are_probs", "mesh"))
def _core(flat, row_start, num_verified, valid, draft_tokens, draft_probs, seeds, positions, req_t, flat_t, *,
          mode: str, inputs_are_probs: bool, mesh=None) -> RejectionOutput:
    """:func:`_rule` on the whole row, or on the vocabulary shards of ``mesh`` (``shard_map``: ``flat`` and
    ``draft_probs`` split over the vocabulary, everything else replicated, the outputs replicated)."""
    args = (flat, row_start, num_verified, valid, draft_tokens, seeds, positions, req_t, flat_t)
    vocab = split_vocab(mesh, flat.shape[1])
    if vocab is None:
        return _rule(*args, draft_probs, mode=mode, inputs_are_probs=inputs_are_probs, vocab=Vocab(flat.shape[1]))
    specs = [(None, "V")] + [()] * (len(args) - 1)
    rule = functools.partial(_rule, mode=mode, inputs_are_probs=inputs_are_probs, vocab=vocab)
    if draft_probs is None:
        return vocab_shards(lambda *a: rule(*a, None), mesh, specs, ())(*args)
    return vocab_shards(rule, mesh, specs + [(None, None, "V")], ())(*args, draft_probs)


def _temperatures(temperature, r: int):
    """(mode, per-request temperatures f32[R]) from a Python number (static) or a traced scalar / ``[R]`` array."""
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        mode = "greedy" if temperature == 0 else "sample"
        return mode, jnp.full((r,), float(temperature), jnp.float32)
    t = jnp.asarray(temperature, jnp.float32)
    if t.ndim == 0:
        t = jnp.broadcast_to(t, (r,))
    if t.shape != (r,):
        raise ValueError(f"temperature must be a number, a scalar or f32[R={r}], got shape {t.shape}")
    return "mixed", t


def _probs_arg(draft_probs, mode):
    """Greedy never reads the draft distributions: drop them so both call forms share one compilation."""
    return None if mode == "greedy" else draft_probs


def _check_common(name, r, k, vocab, draft_tokens, draft_probs, seeds, positions, row_mask, mode):
    if draft_tokens.shape != (r, k):
        raise ValueError(
            f"draft_tokens must be int32[R={r}, K={k}] to match {name}, got {draft_tokens.shape}"
        )
    if mode != "greedy":
        if draft_probs is None:
            raise ValueError("draft_probs f32[R, K, V] is required unless temperature == 0")
        if draft_probs.shape != (r, k, vocab):
            raise ValueError(f"draft_probs must be f32[R={r}, K={k}, V={vocab}], got {draft_probs.shape}")
    for arg, val in (("seeds", seeds), ("positions", positions)):
        if jnp.shape(val) != (r,):
            raise ValueError(f"{arg} must be int32[R={r}], got shape {jnp.shape(val)}")
    if row_mask is not None and jnp.shape(row_mask) != (r,):
        raise ValueError(f"row_mask must be bool[R={r}], got shape {jnp.shape(row_mask)}")


def rejection_sample(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    num_verified: jax.Array,
    seeds: jax.Array,
    positions: jax.Array,
    *,
    temperature: float | jax.Array,
    row_mask: jax.Array | None = None,
    inputs_are_probs: bool = False,
    mesh=None,
) -> RejectionOutput:
    """Accept a prefix of each request's verified drafts and emit one corrected/bonus token.

    Args:
      target_logits: ``f32[R, K+1, V]``; row ``i`` is the target distribution after verify position ``i``
        (logits, or probabilities when ``inputs_are_probs``); rows beyond ``num_verified[r]`` are ignored.
      draft_tokens: ``int32[R, K]`` drafts; only the first ``num_verified[r]`` matter.
      draft_probs: ``f32[R, K, V]`` the (temperature-scaled, Markov-corrected) distributions the drafts were
        sampled from; not read (may be ``None``) when greedy.
      num_verified: ``int32[R]`` verified drafts per request, ``0..K`` (the allocator's caps).
      seeds: ``int32[R]`` per-request seeds. positions: ``int32[R]`` absolute position of each anchor.
      temperature: a Python number (static: ``0`` compiles the greedy rule alone), or a traced scalar or
        ``f32[R]`` (per request; ``<= 0`` is greedy for that request). Applied to logits, not probabilities.
      row_mask: ``bool[R]``, False for padding rows (they emit nothing: counts 0, tokens -1).
      inputs_are_probs: static; ``target_logits`` already holds (temperature-scaled) probabilities.
      mesh: a ``jax.sharding.Mesh`` whose tensor axis splits the vocabulary evenly: the sampler runs on the
        vocabulary shards (``shard_map``; the logits and draft distributions split over the vocabulary, as the
        LM head computes them): a local max or Gumbel-max per shard, then a gather of ``R x N`` values, never a
        whole row (docs/PARALLELISM.md, "The sampler on the mesh"). The tokens are the same as without it.

    Returns:
      :class:`RejectionOutput` ``(num_accepted int32[R], output_tokens int32[R, K+1], num_emitted int32[R])``.

    Raises:
      ValueError: shapes that do not fit ``[R, K+1, V]``, a negative static temperature, missing draft_probs.
    """
    target_logits, draft_tokens = jnp.asarray(target_logits), jnp.asarray(draft_tokens)
    draft_probs = None if draft_probs is None else jnp.asarray(draft_probs)
    if target_logits.ndim != 3 or target_logits.shape[1] < 1:
        raise ValueError(f"target_logits must be f32[R, K+1, V] with K >= 0, got shape {target_logits.shape}")
    r, k1, vocab = target_logits.shape
    k = k1 - 1
    mode, req_t = _temperatures(temperature, r)
    _check_common("target_logits", r, k, vocab, draft_tokens, draft_probs, seeds, positions, row_mask, mode)
    if jnp.shape(num_verified) != (r,):
        raise ValueError(f"num_verified must be int32[R={r}], got shape {jnp.shape(num_verified)}")
    valid = jnp.ones((r,), bool) if row_mask is None else jnp.asarray(row_mask, bool)
    return _core(
        target_logits.reshape(r * k1, vocab),
        jnp.arange(r, dtype=jnp.int32) * k1,
        jnp.asarray(num_verified, jnp.int32),
        valid,
        draft_tokens.astype(jnp.int32),
        _probs_arg(draft_probs, mode),
        jnp.asarray(seeds, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        req_t,
        jnp.repeat(req_t, k1),
        mode=mode,
        inputs_are_probs=bool(inputs_are_probs),
        mesh=mesh,
    )


def rejection_sample_packed(
    packed_logits: jax.Array,
    query_start_loc: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    seeds: jax.Array,
    positions: jax.Array,
    *,
    temperature: float | jax.Array,
    row_mask: jax.Array | None = None,
    inputs_are_probs: bool = False,
    mesh=None,
) -> RejectionOutput:
    """:func:`rejection_sample` reading the verify step's packed logits in place.

    Args:
      packed_logits: ``f32[T, V]``; request ``r`` owns rows ``[qsl[r], qsl[r+1])`` = its anchor followed by its
        verified drafts, so ``num_verified[r] = qsl[r+1] - qsl[r] - 1``. Rows at or beyond ``qsl[R]`` are padding.
      query_start_loc: ``int32[R+1]`` non-decreasing (docs/ARCHITECTURE.md); zero-length rows are padding.
      draft_tokens, draft_probs, seeds, positions, temperature, row_mask, inputs_are_probs, mesh: as in
        :func:`rejection_sample` (``positions`` = the anchor's absolute position, ``seq_lens - q_len``).

    Returns:
      :class:`RejectionOutput`; padding rows (length 0 or masked) emit nothing.
    """
    packed_logits, query_start_loc = jnp.asarray(packed_logits), jnp.asarray(query_start_loc)
    draft_tokens = jnp.asarray(draft_tokens)
    draft_probs = None if draft_probs is None else jnp.asarray(draft_probs)
    if packed_logits.ndim != 2:
        raise ValueError(f"packed_logits must be f32[T, V], got shape {packed_logits.shape}")
    num_tokens, vocab = packed_logits.shape
    if query_start_loc.ndim != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be int32[R+1], got shape {query_start_loc.shape}")
    r = query_start_loc.shape[0] - 1
    if draft_tokens.ndim != 2:
        raise ValueError(f"draft_tokens must be int32[R, K], got shape {draft_tokens.shape}")
    k = draft_tokens.shape[1]
    mode, req_t = _temperatures(temperature, r)
    _check_common("query_start_loc", r, k, vocab, draft_tokens, draft_probs, seeds, positions, row_mask, mode)
    qsl = query_start_loc.astype(jnp.int32)
    q_len = query_lens(qsl)
    valid = q_len > 0
    if row_mask is not None:
        valid = valid & jnp.asarray(row_mask, bool)
    owner = token_to_request(qsl, num_tokens)  # -1 for padding slots
    flat_t = jnp.where(owner >= 0, req_t[jnp.maximum(owner, 0)], 1.0)
    return _core(
        packed_logits,
        qsl[:-1],
        q_len - 1,
        valid,
        draft_tokens.astype(jnp.int32),
        _probs_arg(draft_probs, mode),
        jnp.asarray(seeds, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        req_t,
        flat_t,
        mode=mode,
        inputs_are_probs=bool(inputs_are_probs),
        mesh=mesh,
    )


def _sample_rule(logits, seeds, positions, temps, *, mode, vocab):
    top = vocab.argmax(logits)
    if mode == "greedy":
        return top
    keys = _keys(seeds, positions[:, None], STREAM_RESAMPLE)[:, 0]
    safe = jnp.where(temps <= 0.0, 1.0, temps)
    sampled = gumbel_argmax(keys, logits.astype(jnp.float32) / safe[:, None], vocab)
    return jnp.where(temps <= 0.0, top, sampled)


@functools.partial(jax.jit, static_argnames=("mode", "mesh"))
def _sample_rows(logits, seeds, positions, temps, *, mode, mesh=None):
    vocab = split_vocab(mesh, logits.shape[1])
    if vocab is None:
        return _sample_rule(logits, seeds, positions, temps, mode=mode, vocab=Vocab(logits.shape[1]))
    rule = functools.partial(_sample_rule, mode=mode, vocab=vocab)
    return vocab_shards(rule, mesh, [(None, "V"), (), (), ()], ())(logits, seeds, positions, temps)


def sample_tokens(
    logits: jax.Array, seeds: jax.Array, positions: jax.Array, *, temperature: float | jax.Array, mesh=None
) -> jax.Array:
    """One token per row of ``logits f32[R, V]``: argmax when greedy, else a sample of ``softmax(logits / T)``
    (Gumbel-max, as the rejection sampler draws).

    ``positions int32[R]`` is the absolute position of the token being sampled; the key is
    ``(seed, position, STREAM_RESAMPLE)``, the same one a bonus token at that position would use.
    ``temperature`` and ``mesh`` as in :func:`rejection_sample`. Returns ``int32[R]``.
    """
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be f32[R, V], got shape {logits.shape}")
    r = logits.shape[0]
    for arg, val in (("seeds", seeds), ("positions", positions)):
        if jnp.shape(val) != (r,):
            raise ValueError(f"{arg} must be int32[R={r}], got shape {jnp.shape(val)}")
    mode, temps = _temperatures(temperature, r)
    return _sample_rows(
        logits, jnp.asarray(seeds, jnp.int32), jnp.asarray(positions, jnp.int32), temps, mode=mode, mesh=mesh
    )
