"""Paged KV caches for MiniMax-M3 decode (docs/ARCHITECTURE.md): device buffers, their shapes and slot writes.

Device side (:class:`PagedCache`, a pytree of fixed-size buffers):

* per layer, ``k`` and ``v``: ``[num_kv_heads, num_pages, page_size, head_dim]``;
* per MSA sparse layer, ``index_k``: ``[num_pages, page_size, index_head_dim]`` (the one shared index-key head).

The page size equals the sparse block size, so one page is one MSA block and the indexer's logical block ids
resolve through the request's block table. All caches of a request share one block table (one page id covers
the same token range in every layer). Writes go to *slots* (``page * page_size + offset``); a padding slot maps
to an out-of-range slot and is dropped, so padding never corrupts another request's pages.

Which request owns which page (free list, per-request page lists, block tables, rollback by length, shared
cached prefixes) is host-side engine bookkeeping: ``spec_decode.page_pool`` (``PagePool``). This module only
takes block tables as arrays.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minimax_jax.config import MiniMaxM3Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedCache:
    k: list[jax.Array]        # per layer [H_kv, P, page, D]
    v: list[jax.Array]        # per layer [H_kv, P, page, D]
    index_k: list[jax.Array]  # per sparse layer (config order) [P, page, D_idx]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


DEFAULT_PAGE_SIZE = 16  # models without MSA layers (and without an index_block_size): the kernels' minimum


def page_size_for(cfg: MiniMaxM3Config) -> int:
    """The KV page size: the MSA block size (one page = one MSA block; docs/ARCHITECTURE.md), or
    :data:`DEFAULT_PAGE_SIZE` for a model without sparse layers and without an ``index_block_size``."""
    return cfg.index_block_size or DEFAULT_PAGE_SIZE


def check_cache(cache: PagedCache, cfg: MiniMaxM3Config) -> None:
    """Raise ValueError naming the first way ``cache`` does not fit ``cfg`` (static shapes only).

    A cache whose page size differs from the MSA block size would select tokens instead of blocks and run with
    wrong results, so it is refused here rather than discovered in the output.
    """
    page = page_size_for(cfg)
    n = cfg.num_hidden_layers
    if len(cache.k) != n or len(cache.v) != n:
        raise ValueError(f"cache has {len(cache.k)} K and {len(cache.v)} V layers; the model has {n}")
    if cache.page_size != page:
        raise ValueError(f"cache page size {cache.page_size} differs from the model's index_block_size {page}: "
                         f"one KV page must be one MSA block (build the cache with init_cache(cfg, ...))")
    want = (cfg.num_key_value_heads, cache.num_pages, page, cfg.head_dim)
    for name, layers in (("k", cache.k), ("v", cache.v)):
        for i, x in enumerate(layers):
            if tuple(x.shape) != want:
                raise ValueError(f"cache.{name}[{i}] has shape {tuple(x.shape)}, expected [H_kv, P, page, D] = "
                                 f"{list(want)}")
    n_sparse = len(cfg.sparse_layer_ids)
    if len(cache.index_k) != n_sparse:
        raise ValueError(f"cache has {len(cache.index_k)} index-K layers; the model has {n_sparse} MSA layers")
    for i, x in enumerate(cache.index_k):
        if tuple(x.shape) != (cache.num_pages, page, cfg.index_head_dim):
            raise ValueError(f"cache.index_k[{i}] has shape {tuple(x.shape)}, expected [P, page, D_idx] = "
                             f"{[cache.num_pages, page, cfg.index_head_dim]}")


def init_cache(cfg: MiniMaxM3Config, num_pages: int, *, dtype=jnp.bfloat16) -> PagedCache:
    """Zero-filled caches for ``num_pages`` physical pages of ``page_size_for(cfg)`` tokens."""
    if num_pages <= 0:
        raise ValueError(f"num_pages must be positive, got {num_pages}")
    page = page_size_for(cfg)
    kv_shape = (cfg.num_key_value_heads, num_pages, page, cfg.head_dim)
    n = cfg.num_hidden_layers
    return PagedCache(
        k=[jnp.zeros(kv_shape, dtype) for _ in range(n)],
        v=[jnp.zeros(kv_shape, dtype) for _ in range(n)],
        index_k=[jnp.zeros((num_pages, page, cfg.index_head_dim), dtype) for _ in cfg.sparse_layer_ids],
    )


def cache_bytes_per_page(cfg: MiniMaxM3Config, dtype=jnp.bfloat16) -> int:
    """Bytes one physical page takes across every layer's K, V (and index-K on MSA layers): what a page pool
    sized by a memory budget divides by."""
    page = page_size_for(cfg)
    item = jnp.dtype(dtype).itemsize
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * page * cfg.head_dim
    idx = len(cfg.sparse_layer_ids) * page * cfg.index_head_dim
    return (kv + idx) * item


# ----------------------------------------------------------------------------------------------- slots
def slot_mapping(block_tables: jax.Array, request_ids: jax.Array, positions: jax.Array, *, page_size: int,
                 num_pages: int) -> jax.Array:
    """Flat cache slot (``page * page_size + offset``, the page read from ``block_tables``) of every packed token.

    A token that names no page gets ``num_pages * page_size``, an out-of-range slot that :func:`write_tokens`
    drops (``mode="drop"``): padding (``request_ids < 0``), a row outside the table, a position outside
    ``[0, max_blocks * page_size)``, or a table entry outside ``[0, num_pages)``. So a write can only land on a
    page the token's own row names.
    """
    num_rows, max_blocks = block_tables.shape
    ok = ((request_ids >= 0) & (request_ids < num_rows) & (positions >= 0)
          & (positions < max_blocks * page_size))
    r = jnp.clip(request_ids, 0, num_rows - 1)
    p = jnp.clip(positions, 0, max_blocks * page_size - 1)
    page = block_tables[r, p // page_size]
    ok = ok & (page >= 0) & (page < num_pages)
    return jnp.where(ok, page * page_size + p % page_size, num_pages * page_size).astype(jnp.int32)


def write_tokens(cache: jax.Array, values: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter ``values`` of the packed tokens into a paged cache at ``slots``.

    ``cache [H, P, page, D]`` with ``values [T, H, D]``, or ``cache [P, page, D]`` with ``values [T, D]``.
    """
    if cache.ndim == 4:
        h, p, page, d = cache.shape
        flat = cache.reshape(h, p * page, d)
        flat = flat.at[:, slots].set(jnp.swapaxes(values, 0, 1).astype(cache.dtype), mode="drop")
        return flat.reshape(h, p, page, d)
    p, page, d = cache.shape
    flat = cache.reshape(p * page, d)
    flat = flat.at[slots].set(values.astype(cache.dtype), mode="drop")
    return flat.reshape(p, page, d)
