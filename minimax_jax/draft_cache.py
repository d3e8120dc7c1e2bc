"""The DSpark drafter's context cache (docs/DRAFTER.md), paged like the target's (:mod:`minimax_jax.cache`).

Per draft layer the keys/values projected from the target features of every context position, in the target's
paged layout: ``k, v [L, H_kv, P, page, D]`` (layer ``l`` is ``[H_kv, P, page, D]``, a
:class:`~minimax_jax.cache.PagedCache` layer). Position ``j`` of request row ``r`` lives on physical page
``block_tables[r, j // page]`` at offset ``j % page``; ``lengths[r]`` positions are valid.

Two ways to own the pages:

* **standalone** (:meth:`DraftCache.create` without ``num_pages``): a private pool of ``R * nb`` pages
  (``nb = cdiv(capacity, page)``) and the trivial block table, row ``r`` owning pages ``r * nb .. r * nb + nb
  - 1``;
* **shared with the target** (``num_pages`` = the target pool's page count; what the engine does): the draft
  pool has one page per target page and no allocator of its own. Its block tables start empty (-1, "no page")
  and the engine installs the target's tables of each step's slots (:meth:`DraftCache.with_block_tables`)
  before drafting and writing, so a position's draft K/V sits on the same physical page id as its target K/V.

Either way the pool holds ``2 * L * H_kv * D * itemsize`` bytes per token of a *page* (10 KiB at MiniMax-M3
width with 5 draft layers), not per token of per-row capacity. Only context entries live here; a draft block's
own keys/values are dropped after each step. Rollback is by length: entries past ``lengths[r]`` are invisible
and get overwritten by the next append (:meth:`minimax_jax.drafter.DSparkDrafter.write_context`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minimax_jax.cache import page_size_for
from minimax_jax.drafter_config import DSparkConfig
from pallas_kernels._common import cdiv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
    """Context keys/values of every draft layer on pages, with the block tables that map rows to pages.

    ``k, v [L, H_kv, P, page, D]`` (keys already normed and rotated); ``lengths int32[R]``: positions
    ``< lengths[r]`` hold valid context (a padding row has length 0); ``block_tables int32[R, nb]``: logical
    block ``b`` of row ``r`` is physical page ``block_tables[r, b]`` (a negative entry names no page: writes
    there are dropped). The reach of a row is ``capacity = nb * page`` positions.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    block_tables: jax.Array

    @classmethod
    def create(cls, cfg: DSparkConfig, num_requests: int, capacity: int, *, page_size: int | None = None,
               num_pages: int | None = None, dtype=jnp.bfloat16) -> DraftCache:
        """An empty cache of ``num_requests`` rows reaching ``capacity`` positions each (rounded up to whole
        pages).

        ``page_size``: tokens per page, a power of 2 (default: the draft layers' MSA block size,
        ``cache.page_size_for(cfg.layer_config)``; an engine passes its target's). ``num_pages``: ``None`` for
        a private pool of ``R * nb`` pages with the trivial block table; or the size of a pool shared with the
        target, whose block tables start at -1 and are installed by :meth:`with_block_tables`.
        """
        if num_requests < 1 or capacity < 1:
            raise ValueError(f"num_requests and capacity must be >= 1, got {num_requests}, {capacity}")
        c = cfg.layer_config
        page = page_size_for(c) if page_size is None else int(page_size)
        if page < 1 or page & (page - 1):
            raise ValueError(f"the draft cache's page size must be a power of 2, got {page}")
        nb = cdiv(capacity, page)
        if num_pages is None:
            pages = num_requests * nb
            tables = jnp.arange(pages, dtype=jnp.int32).reshape(num_requests, nb)
        else:
            if num_pages < 1:
                raise ValueError(f"num_pages must be >= 1, got {num_pages}")
            pages = int(num_pages)
            tables = jnp.full((num_requests, nb), -1, jnp.int32)
        shape = (c.num_hidden_layers, c.num_key_value_heads, pages, page, c.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((num_requests,), jnp.int32), tables)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_requests(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    @property
    def capacity(self) -> int:
        """Positions a row's block table reaches: ``max_blocks * page_size``."""
        return self.max_blocks * self.page_size

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))

    def rollback(self, lengths: jax.Array) -> DraftCache:
        """Shrink each row to ``min(lengths, current)``: entries beyond become invisible (and are overwritten by
        the next append)."""
        lengths = jnp.asarray(lengths, jnp.int32)
        if lengths.shape != self.lengths.shape:
            raise ValueError(f"lengths must be int32[R] with R = {self.num_requests}, got shape {lengths.shape}")
        return dataclasses.replace(self, lengths=jnp.minimum(self.lengths, jnp.maximum(lengths, 0)))

    def with_block_tables(self, block_tables: jax.Array, rows: jax.Array | None = None) -> DraftCache:
        """Install block tables: all of them (``rows=None``, ``block_tables int32[R, nb]``), or row ``rows[i]``
        gets ``block_tables[i]`` (``rows int32[N]``, ``block_tables int32[N, nb]``; a negative row is skipped).
        This is how an engine points its draft cache at the target's pages of a step's slots."""
        tables = jnp.asarray(block_tables)
        want_rows = self.num_requests if rows is None else jnp.shape(rows)[0]
        if (tables.ndim != 2 or tables.shape != (want_rows, self.max_blocks)
                or not jnp.issubdtype(tables.dtype, jnp.integer)):
            raise ValueError(f"block_tables must be int32[{want_rows}, nb={self.max_blocks}] (the draft cache's "
                             f"table width, capacity {self.capacity} / page {self.page_size}), got "
                             f"{tables.dtype}{list(tables.shape)}")
        tables = tables.astype(jnp.int32)
        if rows is None:
            return dataclasses.replace(self, block_tables=tables)
        rows = jnp.asarray(rows, jnp.int32)
        if rows.ndim != 1:
            raise ValueError(f"rows must be int32[N], got shape {rows.shape}")
        dest = jnp.where((rows >= 0) & (rows < self.num_requests), rows, self.num_requests)
        return dataclasses.replace(self, block_tables=self.block_tables.at[dest].set(tables, mode="drop"))


def draft_cache_bytes_per_page(cfg: DSparkConfig, page_size: int, dtype=jnp.bfloat16) -> int:
    """Bytes one physical page takes in the draft cache (every draft layer's K and V): what a pool shared with
    the target adds to the target's ``cache.cache_bytes_per_page``."""
    c = cfg.layer_config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * page_size * c.head_dim * jnp.dtype(dtype).itemsize
