"""The drafter's engine entry points (docs/DRAFTER.md): :func:`draft_step`, :func:`append_context_step`
and :func:`append_context_packed_step`, jitted with ``graphdef`` static and the drafter's state passed as an
argument (split once, Flax Gemma-sampler style), and their argument checks.

Static (shape) checks always run; value checks (token ids, positions, capacity, a key when sampling) read the
arrays back to the host and run only with ``validate=True``, so an engine's hot loop passes ``validate=False``.
Every entry point compiles once per shape and can be called from inside an outer ``jax.jit``. The cache write is
donated on GPU. See ``docs/DRAFTER.md`` for the engine-side contract.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.draft_cache import DraftCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftOutput:
    """What one draft step returns.

    ``tokens int32[R, K]``; ``probs f32[R, K, V]``: the Markov-corrected, temperature-scaled draft distribution
    each token was drawn from (one-hot of the argmax for rows with temperature 0; None when not requested);
    ``confidences f32[R, K]``: ``c_k`` after STS (None without a confidence head); ``confidence_logits
    f32[R, K]``: the raw logits (what :func:`minimax_jax.calibration.fit_sts` consumes); ``features f32[R, K]``:
    ``feature_fn`` of each slot's scaled draft logits when one was given (None otherwise).
    """

    tokens: jax.Array
    probs: jax.Array | None
    confidences: jax.Array | None
    confidence_logits: jax.Array | None
    features: jax.Array | None = None


def normalise_keys(key, r: int):
    """None, one key, or ``r`` keys (typed or raw ``uint32[2]`` / ``uint32[r, 2]``) -> typed keys ``[r]`` (or
    None). One key is split into ``r`` per-row keys."""
    if key is None:
        return None
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.shape[-1:] != (2,) or key.ndim not in (1, 2):
            raise ValueError(f"key must be a PRNG key, [R] keys, or raw uint32[2] / uint32[R, 2], got "
                             f"{key.dtype}{list(key.shape)}")
        key = jax.random.wrap_key_data(key)
    if key.shape == ():
        return jax.random.split(key, r)
    if key.shape == (r,):
        return key
    raise ValueError(f"key must be one key or R = {r} keys, got key shape {key.shape}")


# ----------------------------------------------------------------------------------------------- argument checks
def _state_dims(state) -> dict[str, int]:
    """Sizes the argument checks need, read from a drafter's split state (no merge on the hot path)."""
    try:
        vocab = state["embed_tokens"].shape[0]
        feature_size = state["fc"]["kernel"].shape[0]
        layers = state["layers"]
        attn = layers[0]["self_attn"]
        head_dim = attn["k_norm"]["weight"].shape[0]
        kv_heads = attn["k_proj"]["kernel"].shape[1] // head_dim
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"state does not look like a split DSparkDrafter ({e!r})") from None
    return {"vocab": vocab, "feature_size": feature_size, "num_layers": len(layers), "kv_heads": kv_heads,
            "head_dim": head_dim}


def _check_cache(dims, cache: DraftCache):
    if not isinstance(cache, DraftCache):
        raise TypeError(f"cache must be a DraftCache, got {type(cache).__name__}")
    want = (dims["num_layers"], dims["kv_heads"], cache.num_pages, cache.page_size, dims["head_dim"])
    if cache.k.shape != want or cache.v.shape != want:
        raise ValueError(f"cache must be a DraftCache with k, v of shape [L, H_kv, P, page, D] = {list(want)}, got "
                         f"{getattr(getattr(cache, 'k', None), 'shape', None)}")
    page = cache.page_size
    if page < 1 or page & (page - 1):
        raise ValueError(f"the draft cache's page size must be a power of 2, got {page}")
    r = cache.num_requests
    if cache.lengths.ndim != 1:
        raise ValueError(f"cache.lengths must be int32[R], got shape {cache.lengths.shape}")
    tables = cache.block_tables
    if tables.ndim != 2 or tables.shape[0] != r or not jnp.issubdtype(tables.dtype, jnp.integer):
        raise ValueError(f"cache.block_tables must be int32[R={r}, nb], got {tables.dtype}{list(tables.shape)}")


def _check_pages(cache: DraftCache, first, end, action: str) -> None:
    """Host-side check (validated calls) that row ``r``'s positions ``[first[r], end[r])`` lie on pages of the
    pool, through its block table, and (``action == "write"``) that no two rows write to one page: a ``-1`` or
    out-of-pool entry would drop the write or read another page, and a page shared between rows would let one
    request overwrite another's context."""
    if isinstance(cache.block_tables, jax.core.Tracer):
        return
    tables = np.asarray(cache.block_tables)
    page, pool = cache.page_size, cache.num_pages
    owner: dict[int, int] = {}
    for r, (lo, hi) in enumerate(zip(np.asarray(first).tolist(), np.asarray(end).tolist())):
        if hi <= lo:
            continue
        blocks = range(lo // page, (hi - 1) // page + 1)
        ids = tables[r, blocks.start:blocks.stop]
        bad = np.flatnonzero((ids < 0) | (ids >= pool))
        if bad.size:
            b = blocks.start + int(bad[0])
            raise ValueError(f"row {r}: block {b} (positions {b * page}..{(b + 1) * page - 1}, to {action}) has "
                             f"block-table entry {int(tables[r, b])}, not a page of the pool [0, {pool}): install "
                             f"the row's pages first (DraftCache.with_block_tables)")
        if action == "write":
            for b, pid in zip(blocks, ids.tolist()):
                other = owner.setdefault(pid, r)
                if other != r:
                    raise ValueError(f"rows {other} and {r} both write to page {pid} (row {r}'s block {b}): a "
                                     f"page belongs to one request")


def _check_draft_args(dims, cache: DraftCache, anchors, anchor_positions, temperature, key, validate: bool):
    anchors = jnp.asarray(anchors)
    anchor_positions = jnp.asarray(anchor_positions)
    r = cache.num_requests
    if anchors.shape != (r,) or not jnp.issubdtype(anchors.dtype, jnp.integer):
        raise ValueError(f"anchors must be int32[R] with R = cache.num_requests = {r}, got "
                         f"{anchors.dtype}{list(anchors.shape)}")
    if anchor_positions.shape != (r,) or not jnp.issubdtype(anchor_positions.dtype, jnp.integer):
        raise ValueError(f"anchor_positions must be int32[R] with R = {r}, got "
                         f"{anchor_positions.dtype}{list(anchor_positions.shape)}")
    t = jnp.asarray(temperature)
    if t.shape not in ((), (r,)):
        raise ValueError(f"temperature must be a scalar or f32[R] with R = {r}, got shape {t.shape}")
    _check_cache(dims, cache)
    if not validate:
        return anchors.astype(jnp.int32), anchor_positions.astype(jnp.int32)
    if (not isinstance(anchors, jax.core.Tracer) and anchors.size
            and (int(anchors.min()) < 0 or int(anchors.max()) >= dims["vocab"])):
        raise ValueError(f"anchors hold token ids outside the vocabulary [0, {dims['vocab']})")
    if (not isinstance(anchor_positions, jax.core.Tracer) and anchor_positions.size
            and int(anchor_positions.min()) < 0):
        raise ValueError("anchor_positions must be >= 0")
    if key is None and not isinstance(t, jax.core.Tracer) and bool(jnp.any(t > 0)):
        raise ValueError("temperature > 0 needs a PRNG key")
    if not isinstance(anchor_positions, jax.core.Tracer) and not isinstance(cache.lengths, jax.core.Tracer):
        visible = np.minimum(np.asarray(cache.lengths), np.asarray(anchor_positions))
        _check_pages(cache, np.zeros_like(visible), visible, "read")
    return anchors.astype(jnp.int32), anchor_positions.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------- draft
@functools.partial(jax.jit, static_argnames=("graphdef", "return_probs", "implementation", "interpret"))
def _draft_jit(graphdef, state, cache, anchors, anchor_positions, temperature, key, *, return_probs,
               implementation="auto", interpret=None):
    drafter = nnx.merge(graphdef, state)
    h = drafter.block_hidden(cache, anchors, anchor_positions, implementation=implementation, interpret=interpret)
    return drafter.sample_block(h, anchors, temperature, key, return_probs=return_probs)


def draft_step(graphdef, state, cache: DraftCache, anchors, anchor_positions, temperature=0.0, key=None, *,
               return_probs: bool = True, validate: bool = True, implementation: str = "auto",
               interpret: bool | None = None) -> DraftOutput:
    """One drafting step for ``R`` request rows (jitted; ``graphdef`` and ``return_probs`` static).

    Args:
      graphdef, state: ``nnx.split(drafter)`` (split once, reuse: the state is passed as an argument).
      cache: :class:`DraftCache` with ``R`` rows; row ``r`` sees its context positions
        ``j < min(cache.lengths[r], anchor_positions[r])``.
      anchors: ``int32[R]`` the last emitted token of each row (any valid id for padding rows).
      anchor_positions: ``int32[R]`` the anchor's absolute position (normally ``== cache.lengths``).
      temperature: scalar or ``f32[R]``; ``<= 0`` means greedy for that row.
      key: PRNG key (one, or ``[R]``); required when any temperature is > 0.
      return_probs: also return the ``f32[R, K, V]`` draft distributions (what rejection sampling needs).
      validate: also check VALUES (token ids in the vocabulary, positions >= 0, a key when sampling); this
        reads the arrays back to the host, so an engine's hot loop passes False (shapes are always checked).
      implementation: the draft attention (``"auto"``: the Pallas kernel on a GPU, plain jnp elsewhere;
        ``"pallas"``, ``"reference"``; :func:`minimax_jax.draft_attention.choose_implementation`). interpret:
        Pallas interpret mode for the kernel (``None``: on CPU).
    Returns:
      :class:`DraftOutput` (``tokens int32[R, K]``, ``probs``, ``confidences``, ``confidence_logits``).
    """
    anchors, anchor_positions = _check_draft_args(_state_dims(state), cache, anchors, anchor_positions, temperature,
                                                  key, validate)
    # one compiled program whatever the caller passes: temperatures f32[R], always a key (greedy without one)
    r = cache.num_requests
    temps = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (r,))
    if key is None:
        temps, key = jnp.zeros((r,), jnp.float32), _greedy_keys(r)
    else:
        key = normalise_keys(key, r)  # [R] typed keys
    return _draft_jit(graphdef, state, cache, anchors, anchor_positions, temps, key, return_probs=return_probs,
                      implementation=implementation, interpret=interpret)


@functools.lru_cache(maxsize=8)
def _greedy_keys(r: int):
    with jax.ensure_compile_time_eval():  # concrete even when called under an outer jit: safe to cache
        return jax.random.split(jax.random.key(0), r)


# ----------------------------------------------------------------------------------------------- append context
def _append_impl(graphdef, state, cache, features, start, num_new):
    return nnx.merge(graphdef, state).append_context_impl(cache, features, start, num_new)


def _append_packed_impl(graphdef, state, cache, features, query_start_loc, start, num_new):
    return nnx.merge(graphdef, state).append_context_packed_impl(cache, features, query_start_loc, start, num_new)


_append_jit = jax.jit(_append_impl, static_argnums=0)
_append_jit_donating = jax.jit(_append_impl, static_argnums=0, donate_argnums=2)
_append_packed_jit = jax.jit(_append_packed_impl, static_argnums=0)
_append_packed_jit_donating = jax.jit(_append_packed_impl, static_argnums=0, donate_argnums=2)


def _donate() -> bool:
    return jax.default_backend() != "cpu"  # XLA:CPU ignores donation (with a warning)


def _concat_features(features) -> jax.Array:
    """A sequence of m ``[..., d]`` feature arrays -> ``[..., m*d]`` (an array passes through)."""
    return jnp.concatenate(features, axis=-1) if isinstance(features, (list, tuple)) else jnp.asarray(features)


def _check_append_args(dims, cache, start, num_new, max_new: int, what: str, validate: bool):
    _check_cache(dims, cache)
    r = cache.num_requests
    start, num_new = jnp.asarray(start), jnp.asarray(num_new)
    for name, a in (("start", start), ("num_new", num_new)):
        if a.shape != (r,) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be int32[R] with R = {r}, got {a.dtype}{list(a.shape)}")
    if validate and not isinstance(start, jax.core.Tracer) and not isinstance(num_new, jax.core.Tracer) and r:
        s, n = np.asarray(start), np.asarray(num_new)
        if s.min() < 0 or n.min() < 0:
            raise ValueError("start and num_new must be >= 0")
        if n.max() > max_new:
            raise ValueError(f"num_new ({int(n.max())}) exceeds the {max_new} feature rows {what}")
        if (s + n).max() > cache.capacity:
            bad = int(np.argmax(s + n))
            raise ValueError(f"row {bad}: start + num_new = {int(s[bad] + n[bad])} exceeds the cache capacity "
                             f"{cache.capacity}")
        _check_pages(cache, s, s + n, "write")
    return start.astype(jnp.int32), num_new.astype(jnp.int32)


def append_context_step(graphdef, state, cache: DraftCache, features, start, num_new, *,
                        validate: bool = True) -> DraftCache:
    """Write target features into the draft cache, per-request padded layout (jitted, cache donated on GPU).

    Args:
      features: ``[R, T, m*d]`` concatenated target features (or a sequence of m ``[R, T, d]``); row ``r``'s
        feature ``i`` belongs to absolute position ``start[r] + i``.
      start: ``int32[R]`` position of each row's first feature row.
      num_new: ``int32[R]`` how many feature rows of each row to write (``0..T``); the rest is ignored.
      validate: check values (reads ``start`` / ``num_new`` back to the host; pass False in a hot loop).
    Returns:
      the cache with those K/V written and ``lengths = start + num_new`` for EVERY row: a row not taking part
      passes ``start = its length, num_new = 0``; ``start < length`` rolls the row back to ``start`` first.
    """
    dims = _state_dims(state)
    features = _concat_features(features)
    if features.ndim != 3 or features.shape[0] != cache.num_requests or features.shape[2] != dims["feature_size"]:
        raise ValueError(f"features must be [R={cache.num_requests}, T, m*d={dims['feature_size']}], got shape "
                         f"{features.shape}")
    start, num_new = _check_append_args(dims, cache, start, num_new, features.shape[1], "per row", validate)
    fn = _append_jit_donating if _donate() else _append_jit
    return fn(graphdef, state, cache, features, start, num_new)


def append_context_packed_step(graphdef, state, cache: DraftCache, features, query_start_loc, start,
                               num_new, *, validate: bool = True) -> DraftCache:
    """Like :func:`append_context_step` for the packed verify layout (docs/ARCHITECTURE.md).

    ``features [T, m*d]`` packed over requests by ``query_start_loc int32[R + 1]``; packed token ``t`` of row
    ``r`` (``i = t - qsl[r]``) is written at position ``start[r] + i`` when ``i < num_new[r]``. For a verify
    step: ``start`` = the anchor positions, ``num_new`` = 1 + accepted drafts.
    """
    dims = _state_dims(state)
    features = _concat_features(features)
    if features.ndim != 2 or features.shape[1] != dims["feature_size"]:
        raise ValueError(f"features must be [T, m*d={dims['feature_size']}], got shape {features.shape}")
    qsl = jnp.asarray(query_start_loc)
    if qsl.shape != (cache.num_requests + 1,):
        raise ValueError(f"query_start_loc must be int32[R + 1] with R = {cache.num_requests}, got shape {qsl.shape}")
    start, num_new = _check_append_args(dims, cache, start, num_new, features.shape[0], "in the batch", validate)
    if validate and not isinstance(qsl, jax.core.Tracer) and not isinstance(num_new, jax.core.Tracer):
        q_len = np.diff(np.asarray(qsl))
        if np.any(np.asarray(num_new) > q_len):
            raise ValueError(f"num_new {np.asarray(num_new).tolist()} exceeds the query lengths {q_len.tolist()}")
    fn = _append_packed_jit_donating if _donate() else _append_packed_jit
    return fn(graphdef, state, cache, features, qsl.astype(jnp.int32), start, num_new)


def compilation_counts() -> dict[str, int]:
    """How many programs each entry point has compiled in this process (what a compile-count test checks: new
    values of the same shapes must not add one)."""
    return {"draft_step": _draft_jit._cache_size(),
            "append_context_step": _append_jit._cache_size() + _append_jit_donating._cache_size(),
            "append_context_packed_step": (_append_packed_jit._cache_size()
                                           + _append_packed_jit_donating._cache_size())}
