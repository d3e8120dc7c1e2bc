"""The token history that penalties read, on the device: per-slot token counts and prompt masks.

A penalty at a position depends on every token before it, so under speculation it depends on the drafts before
that position too (``docs/ENGINE.md``, "Sampling parameters under speculation"). The decode state keeps, per slot,

* ``token_counts int32[N, V]``: how often each token occurs in the request's output so far (committed tokens);
* ``prompt_mask bool[N, V]``: the tokens of its prompt (the repetition penalty reads them too).

Fixed shapes, ``5 N V`` bytes (M3, V = 200,064: 16 MB at the default 16 slots, 256 MB at 256 slots). A verify or
draft position is penalised with its slot's committed counts plus the drafts before it (:func:`penalize_at`, which
applies them to the logits without writing out a ``[positions, V]`` counts array); a step's commit adds the
tokens it emitted (:func:`commit_counts`), so the next step, planned before this one is read back (async
scheduling), reads the truth from the device. A request with a penalty is written into its slot when it is
admitted (:func:`write_history`: its prompt and, for a preempted one being recomputed, the output it had), so a
prefix-cache hit or a recompute, whose tokens never pass through a step, still counts every token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_decode.sampling_params import apply_penalties

__all__ = ["commit_counts", "init_history", "penalize_at", "penalize_at_reference", "write_history"]


def init_history(num_slots: int, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Empty ``(token_counts int32[N, V], prompt_mask bool[N, V])``."""
    return jnp.zeros((num_slots, vocab_size), jnp.int32), jnp.zeros((num_slots, vocab_size), bool)


def write_history(token_counts: jax.Array, prompt_mask: jax.Array, slot: jax.Array, tokens: jax.Array,
                  num_prompt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Slot ``slot``'s history from scratch: ``tokens int32[L]`` (-1 padded) are its prompt (the first
    ``num_prompt``) followed by the output it has so far (a recomputed request's). Jit it with the two arrays
    donated: one program for the engine (``L = max_model_len``)."""
    v = token_counts.shape[1]
    pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    valid = tokens >= 0
    in_prompt = valid & (pos < num_prompt)
    in_output = valid & (pos >= num_prompt)
    mask = jnp.zeros((v,), bool).at[jnp.where(in_prompt, tokens, v)].set(True, mode="drop")
    counts = jnp.zeros((v,), jnp.int32).at[jnp.where(in_output, tokens, v)].add(1, mode="drop")
    return token_counts.at[slot].set(counts), prompt_mask.at[slot].set(mask)


def penalize_at(scaled: jax.Array, token_counts: jax.Array, prompt_mask: jax.Array, slots: jax.Array,
                drafts: jax.Array, num_before: jax.Array, repetition: jax.Array, frequency: jax.Array,
                presence: jax.Array, temperature: jax.Array) -> jax.Array:
    """The penalties at ``P`` positions, each seeing its slot's committed counts plus the first ``num_before[p]``
    of ``drafts[p]`` (the drafts before it), applied to ``scaled f32[P, V]`` (the logits divided by
    ``temperature f32[P]``; :func:`spec_decode.sampling_params.apply_penalties` is the formula).

    ``slots int32[P]`` (in range), ``drafts int32[P, D]`` (the drafts of the position's row, -1 padded),
    ``num_before int32[P]``, per-position ``repetition / frequency / presence f32[P]`` (1 / 0 / 0: off).

    No ``[P, V]`` counts array is built: the slot's committed counts and prompt mask are gathered inside the
    elementwise transform of the logits (XLA fuses the gather into it), and the ``<= D`` tokens drawn before the
    position, whose counts the drafts raise, are recomputed from ``[P, D]`` gathers and scattered over the result.
    A position with every penalty off is an identity whatever the counts, so it reads slot 0's history instead of
    its own: such positions all read the same row (one row of ``5 V`` bytes, from cache on a GPU), and a batch
    without a penalised row reads almost nothing beyond its logits. (No ``lax.cond``: on a GPU the host would wait
    for the predicate and stall the asynchronous dispatch, ``docs/ENGINE.md``.)"""
    p, v = scaled.shape
    on = (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)
    src = jnp.where(on, slots, 0)
    out = apply_penalties(scaled, token_counts[src], prompt_mask[src], repetition, frequency, presence,
                          temperature=temperature)
    d = drafts.shape[1]
    if d == 0:
        return out
    take = (jnp.arange(d, dtype=jnp.int32)[None, :] < num_before[:, None]) & (drafts >= 0) & on[:, None]  # [P, D]
    tok = jnp.where(take, drafts, 0)
    # each such token's count at the position: committed + its occurrences among the drafts before the position
    extra = jnp.sum((tok[:, :, None] == tok[:, None, :]) & take[:, None, :], axis=-1, dtype=jnp.int32)
    counts = token_counts[src[:, None], tok] + extra
    raw = jnp.take_along_axis(scaled, tok, axis=1)
    fixed = apply_penalties(raw, counts, prompt_mask[src[:, None], tok], repetition, frequency, presence,
                            temperature=temperature)
    rows = jnp.arange(p, dtype=jnp.int32)[:, None]
    return out.at[rows, jnp.where(take, tok, v)].set(fixed, mode="drop")


def penalize_at_reference(scaled: jax.Array, token_counts: jax.Array, prompt_mask: jax.Array, slots: jax.Array,
                          drafts: jax.Array, num_before: jax.Array, repetition: jax.Array, frequency: jax.Array,
                          presence: jax.Array, temperature: jax.Array) -> jax.Array:
    """:func:`penalize_at` the direct way (tests): the dense ``int32[P, V]`` counts of every position, then the
    formula."""
    v = token_counts.shape[1]
    counts = token_counts[slots]
    if drafts.shape[1]:
        take = (jnp.arange(drafts.shape[1], dtype=jnp.int32)[None, :] < num_before[:, None]) & (drafts >= 0)
        rows = jnp.arange(slots.shape[0], dtype=jnp.int32)[:, None]
        counts = counts.at[rows, jnp.where(take, drafts, v)].add(1, mode="drop")
    return apply_penalties(scaled, counts, prompt_mask[slots], repetition, frequency, presence,
                           temperature=temperature)


def commit_counts(token_counts: jax.Array, slots: jax.Array, tokens: jax.Array, keep: jax.Array) -> jax.Array:
    """Add each kept row's emitted ``tokens int32[R, E]`` (-1 padded) to its slot's counts."""
    n, v = token_counts.shape
    rows = jnp.where(keep, slots, n)[:, None]
    return token_counts.at[rows, jnp.where(tokens >= 0, tokens, v)].add(1, mode="drop")
