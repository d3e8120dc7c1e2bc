"""The token history that penalties read, on the device: per-slot token counts and prompt masks.

A penalty at a position depends on every token before it, so under speculation it depends on the drafts before
that position too (``docs/ENGINE.md``, "Sampling parameters under speculation"). The decode state keeps, per slot,

* ``token_counts int32[N, V]``: how often each token occurs in the request's output so far (committed tokens);
* ``prompt_mask bool[N, V]``: the tokens of its prompt (the repetition penalty reads them too).

Fixed shapes, ``5 N V`` bytes (M3, V = 200,064: 16 MB at the default 16 slots, 256 MB at 256 slots). A verify or
draft position adds the drafts before it to the committed counts (:func:`counts_at`); a step's commit adds the
tokens it emitted (:func:`commit_counts`), so the next step, planned before this one is read back (async
scheduling), reads the truth from the device. A request with a penalty is written into its slot when it is
admitted (:func:`write_history`: its prompt and, for a preempted one being recomputed, the output it had), so a
prefix-cache hit or a recompute, whose tokens never pass through a step, still counts every token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["commit_counts", "counts_at", "init_history", "write_history"]


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


def counts_at(token_counts: jax.Array, slots: jax.Array, drafts: jax.Array, num_before: jax.Array) -> jax.Array:
    """The output counts each of ``P`` positions sees: its slot's committed counts plus the first
    ``num_before[p]`` of ``drafts[p]``.

    ``slots int32[P]`` (in range), ``drafts int32[P, D]`` (the drafts of the position's row, -1 padded),
    ``num_before int32[P]``. Returns ``int32[P, V]``."""
    v = token_counts.shape[1]
    d = drafts.shape[1]
    base = token_counts[slots]
    if d == 0:
        return base
    take = (jnp.arange(d, dtype=jnp.int32)[None, :] < num_before[:, None]) & (drafts >= 0)
    rows = jnp.arange(slots.shape[0], dtype=jnp.int32)[:, None]
    return base.at[rows, jnp.where(take, drafts, v)].add(1, mode="drop")


def commit_counts(token_counts: jax.Array, slots: jax.Array, tokens: jax.Array, keep: jax.Array) -> jax.Array:
    """Add each kept row's emitted ``tokens int32[R, E]`` (-1 padded) to its slot's counts."""
    n, v = token_counts.shape
    rows = jnp.where(keep, slots, n)[:, None]
    return token_counts.at[rows, jnp.where(tokens >= 0, tokens, v)].add(1, mode="drop")
