"""Reductions over a vocabulary row that may be split over the mesh's tensor axis: the sampler's building blocks
(docs/PARALLELISM.md, "The sampler on the mesh").

On a mesh the LM head is split over the vocabulary, so each device computes the logits of its own ``V / N``
tokens. The sampler (:mod:`spec_decode.rejection`, the log-probabilities of :mod:`spec_decode.logprobs`, the
filters' threshold search in :mod:`spec_decode.sampling_params`; one device's filter sorts instead) is written once
against a :class:`Vocab`, which says how a row is laid out: whole (one device, or XLA's partitioning), or split
over a ``shard_map`` axis, each device holding the contiguous slice ``[offset, offset + V / N)``. Every reduction
over a row goes through it:

* ``max`` / ``sum``: the local reduction, then a ``pmax`` / ``psum`` of ``R`` values;
* ``argmax``: the local max and its (global) index, then an all-gather of ``R x N`` pairs and the first shard
  holding the maximum, so ties go to the lower token id exactly as :func:`jax.numpy.argmax` breaks them;
* ``take`` / ``pick``: the entry of one global token id per row (its owner contributes it, the others 0);
* ``top_k``: each shard's top ``k``, then a gather of the ``N`` candidate lists and their top ``k``;
* :func:`gumbel_noise`: the sampler's noise, a function of (the position's key, the global token id) alone, so a
  shard draws exactly the values one device draws for its tokens.

No ``[R, V]`` array crosses devices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend.random import threefry_2x32

__all__ = ["Vocab", "gumbel_argmax", "gumbel_noise", "midpoint", "ordered_key", "split_vocab", "vocab_shards"]


@dataclasses.dataclass(frozen=True)
class Vocab:
    """How a vocabulary row of ``size`` tokens is laid out: whole (``axis=None``) or split evenly over the
    ``shard_map`` axis ``axis`` of ``shards`` devices (use it inside that ``shard_map`` only)."""

    size: int
    axis: str | None = None
    shards: int = 1

    @property
    def local(self) -> int:
        """Tokens on each device."""
        return self.size // self.shards

    def offset(self) -> jax.Array:
        """The global id of this device's first token."""
        if self.axis is None:
            return jnp.int32(0)
        return jax.lax.axis_index(self.axis).astype(jnp.int32) * self.local

    def ids(self) -> jax.Array:
        """``int32[V / N]``: the global ids of this device's tokens."""
        return self.offset() + jnp.arange(self.local, dtype=jnp.int32)

    def max(self, x: jax.Array) -> jax.Array:
        m = jnp.max(x, axis=-1)
        return m if self.axis is None else jax.lax.pmax(m, self.axis)

    def min(self, x: jax.Array) -> jax.Array:
        m = jnp.min(x, axis=-1)
        return m if self.axis is None else jax.lax.pmin(m, self.axis)

    def sum(self, x: jax.Array) -> jax.Array:
        return self.total(jnp.sum(x, axis=-1))

    def total(self, x: jax.Array) -> jax.Array:
        """Per-device partial results added over the shards (``x`` itself on one device)."""
        return x if self.axis is None else jax.lax.psum(x, self.axis)

    def argmax(self, x: jax.Array) -> jax.Array:
        """``int32[...]``: the global index of each row's maximum (ties and NaN as :func:`jax.numpy.argmax`)."""
        idx = jnp.argmax(x, axis=-1).astype(jnp.int32)
        if self.axis is None:
            return idx
        best = jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]
        vals = jax.lax.all_gather(best, self.axis, axis=-1)  # [..., N]: the shards' maxima, in token order
        ids = jax.lax.all_gather(idx + self.offset(), self.axis, axis=-1)
        shard = jnp.argmax(vals, axis=-1)  # the first shard holding the maximum: the lowest token id
        return jnp.take_along_axis(ids, shard[..., None], axis=-1)[..., 0]

    def take(self, x: jax.Array, token: jax.Array) -> jax.Array:
        """``x[..., token]`` for one global token id per row (``x [..., V / N]``, ``token int32[...]``, in
        ``[0, V)``)."""
        local = token - self.offset()
        mine = (local >= 0) & (local < self.local)
        val = jnp.take_along_axis(x, jnp.clip(local, 0, self.local - 1)[..., None], axis=-1)[..., 0]
        if self.axis is None:
            return val
        return jax.lax.psum(jnp.where(mine, val, jnp.zeros_like(val)), self.axis)

    def top_k(self, x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """``lax.top_k`` of each row (values, global ids; ties to the lower id) for a static ``k <= V``: each
        shard's own top ``min(k, V / N)``, then a gather of those ``N`` candidate lists and their top ``k``."""
        vals, idx = jax.lax.top_k(x, min(k, self.local))
        if self.axis is None:
            return vals, idx.astype(jnp.int32)
        vals = jax.lax.all_gather(vals, self.axis, axis=x.ndim - 1, tiled=True)  # [..., N * k]: shard order
        ids = jax.lax.all_gather(idx.astype(jnp.int32) + self.offset(), self.axis, axis=x.ndim - 1, tiled=True)
        best, where = jax.lax.top_k(vals, k)  # ties: the earlier candidate, i.e. the lower id
        return best, jnp.take_along_axis(ids, where, axis=-1)

    def pick(self, x: jax.Array, rows: jax.Array, token: jax.Array) -> jax.Array:
        """``x[rows, token]`` of ``x [N, V / N]`` for global token ids (``rows``, ``token`` int32 of one shape):
        scalar gathers, no row copied."""
        local = token - self.offset()
        val = x[rows, jnp.clip(local, 0, self.local - 1)]
        if self.axis is None:
            return val
        mine = (local >= 0) & (local < self.local)
        return jax.lax.psum(jnp.where(mine, val, jnp.zeros_like(val)), self.axis)

    def logsumexp(self, x: jax.Array) -> jax.Array:
        """``log(sum(exp(x)))`` over each row (the max subtracted first)."""
        m = self.max(x)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        return m + jnp.log(self.sum(jnp.exp(x - m[..., None])))

    def softmax(self, x: jax.Array) -> jax.Array:
        m = self.max(x)
        e = jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
        return e / self.sum(e)[..., None]


def split_vocab(mesh, vocab_size: int) -> Vocab | None:
    """The :class:`Vocab` of a row split over ``mesh``'s tensor axis, or None when there is nothing to split (no
    mesh, a tensor axis of 1, or a vocabulary it does not divide: then the whole-row code runs, XLA partitioning
    it)."""
    from minimax_jax.sharding import TENSOR

    if mesh is None or mesh.shape.get(TENSOR, 1) == 1 or vocab_size % mesh.shape[TENSOR]:
        return None
    return Vocab(vocab_size, TENSOR, mesh.shape[TENSOR])


def vocab_shards(fn, mesh, in_specs, out_spec):
    """``fn`` inside ``shard_map`` over ``mesh``: ``in_specs`` one tuple per argument naming its axes, ``"V"`` for
    the vocabulary axis (split over the tensor axis) and ``None`` for the others (``()``: replicated); ``out_spec``
    one such tuple for the whole output (e.g. ``()``: every output replicated)."""
    from jax.sharding import PartitionSpec

    from minimax_jax.sharding import TENSOR

    def spec(axes):
        return PartitionSpec(*(TENSOR if a == "V" else None for a in axes))

    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(s) for s in in_specs), out_specs=spec(out_spec),
                         check_vma=False)


# ------------------------------------------------------------------------------------------------------- noise
def gumbel_noise(keys: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Standard Gumbel noise ``f32[R, n]`` for the tokens ``token_ids int32[n]`` (global ids) of each row's key
    (``keys``: ``R`` typed PRNG keys).

    The noise of token ``v`` under key ``k`` depends on ``(k, v)`` alone: the key's Threefry-2x32 key pair
    ``(k0, k1) = jax.random.bits(k, (2,))``, then ``b = threefry_2x32((k0, k1), (0, v))[0]`` (the first word of
    the hash of the counter pair ``(0, v)``), ``u = ((b >> 9) + 1/2) / 2^23`` (strictly inside ``(0, 1)``) and
    ``g = -log(-log(u))``. So a device holding tokens ``[a, b)`` draws exactly the values one device draws for
    them."""
    pair = jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(keys)  # [R, 2]
    ids = token_ids.astype(jnp.uint32)
    counters = jnp.concatenate([jnp.zeros_like(ids), ids])  # threefry_2x32 pairs word i with word i + n

    def row(p):
        return threefry_2x32(p, counters)[: ids.shape[0]]

    bits = jax.vmap(row)(pair)  # [R, n]
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (2.0 ** -23)
    return -jnp.log(-jnp.log(u))


def gumbel_argmax(keys: jax.Array, logp: jax.Array, vocab: Vocab) -> jax.Array:
    """One sample per row of the unnormalised log-probabilities ``logp f32[R, V]`` (``-inf`` allowed; the local
    slice inside ``shard_map``) by Gumbel-max: ``argmax_v(logp_v + g_v)`` with :func:`gumbel_noise`. ``int32[R]``."""
    return vocab.argmax(logp + gumbel_noise(keys, vocab.ids()))


# --------------------------------------------------------------------------------------------- order of floats
def ordered_key(x: jax.Array) -> jax.Array:
    """``int32`` keys ordered as the float32 values ``x`` (``-0.0`` counted as ``+0.0``; not for NaN): a value
    threshold can then be bisected exactly over the 2^32 keys (the filters of :mod:`spec_decode.sampling_params`)."""
    x = jnp.where(x == 0, jnp.float32(0), x.astype(jnp.float32))
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def midpoint(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """``floor((lo + hi) / 2)`` of int32 arrays without overflow."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)
