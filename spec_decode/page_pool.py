"""Host-side page pool of the engine: physical KV pages, per-request block tables, automatic prefix caching.

The device caches (``minimax_jax.cache.PagedCache``) are fixed buffers of ``num_pages`` pages of ``page_size``
tokens; this module decides which request owns which page. Without prefix caching it is a free list,
per-request page lists and lengths (``ensure`` grows all-or-nothing, ``rollback`` shrinks by length, ``free``
returns everything). With prefix caching (vLLM's "automatic prefix caching") full pages of known tokens can be
shared:

**Keys.** A cached page is named by a node of a trie of page contents. The node of page ``i`` of a sequence is
looked up in one dict by ``(node id of page i - 1, tuple(tokens of page i))`` (the root's id is 0), so its key
depends on the previous key and on the *exact* tokens of the page: a lookup compares token tuples, never a
digest, and a hit is always an exact prefix match (no false hits). Node ids are never reused. A node lives
while something pins it: a page registered under it, a child node, or a request whose chain passes through it;
it is deleted (and its parent unpinned) when the last pin goes, so the trie never outgrows the pages and
requests. A node may exist without a page (its page was evicted while a child or a request still names it); a
lookup stops there, and re-registering that content reattaches the node's children.

**Registration.** ``register(rid, tokens, upto)`` walks the full pages of ``rid`` wholly below ``upto`` that
its chain does not cover yet, appending their nodes to the chain. A node without a page gets ``rid``'s page
(the page becomes *registered*: read-only, shareable). A node that already has a page (the same content
registered by another request) keeps that canonical page; ``rid``'s copy stays private and unregistered. Only
full pages are registered, and only positions the caller says are written (``upto <= length``).

**Admission.** ``match_prefix(tokens)`` is the number of tokens of the longest registered page-aligned prefix,
capped at ``((len(tokens) - 1) // page_size) * page_size`` so that at least one token is left to compute (the
step needs one token's logits). ``admit(rid, tokens)`` takes those pages for a request that owns none yet:
reference count + 1 each, and its length becomes the matched count.

**Reference counts and the LRU.** A page is owned by ``refcount(page)`` requests. When ``free`` drops a page's
count to 0 it goes to the free list if unregistered, or to the end of an LRU list of *evictable* cached pages
if registered (its content stays valid for later hits; ``free`` walks a request's pages tail first, so a
sequence's last pages are evicted before its first). ``ensure`` takes free pages first, then evicts the least
recently released evictable page (its registration goes with it). ``num_free`` and ``can_fit`` count both.

**Invariants** (``check_invariants`` asserts them; the tests run it after every operation):

* every page is exactly one of: free, evictable (refcount 0, registered), owned (refcount > 0);
* ``refcount(p)`` equals the number of page lists holding ``p``; a request never holds one page twice;
* a page held by two requests is registered (sharing only ever comes from ``admit``);
* a request writes only positions at or past its matched prefix, so never into a shared or registered page
  (``check_writable`` is the debug check); ``rollback`` refuses to forget positions of such a page.

With ``enable_prefix_caching=False`` nothing is ever registered: ``register`` and ``admit`` do nothing and
return 0, and the pool behaves exactly like the plain allocator (:class:`PageAllocator`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

__all__ = ["OutOfPagesError", "PageAllocator", "PagePool"]

_ROOT = 0  # the node id of the empty prefix (not stored)


class OutOfPagesError(RuntimeError):
    """The page pool cannot hold the requested tokens."""


@dataclasses.dataclass(slots=True)
class _Node:
    key: tuple[int, tuple[int, ...]]  # (parent node id, the page's tokens)
    page: int | None = None  # the canonical registered page holding this content, if any
    pins: int = 0  # children + requests whose chain includes this node + (1 if page is not None)


class PagePool:
    """Host-side bookkeeping of physical pages, per-request lengths and (optionally) shared cached prefixes.

    ``pages[rid]`` lists request ``rid``'s physical pages in block order, ``lengths[rid]`` its token count.
    Pages are handed out in the order of ``free_order`` (default ascending; tests pass a shuffled order).
    """

    def __init__(self, num_pages: int, page_size: int, max_blocks_per_request: int, *,
                 free_order: Iterable[int] | None = None, enable_prefix_caching: bool = True):
        if num_pages <= 0 or page_size <= 0 or max_blocks_per_request <= 0:
            raise ValueError(f"num_pages ({num_pages}), page_size ({page_size}) and max_blocks_per_request "
                             f"({max_blocks_per_request}) must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_blocks = max_blocks_per_request
        self.enable_prefix_caching = bool(enable_prefix_caching)
        order = list(range(num_pages)) if free_order is None else [int(p) for p in free_order]
        if sorted(order) != list(range(num_pages)):
            raise ValueError(f"free_order must be a permutation of range({num_pages})")
        self._free: list[int] = order[::-1]  # pop() from the end
        self.pages: dict[Hashable, list[int]] = {}
        self.lengths: dict[Hashable, int] = {}
        self._ref = [0] * num_pages
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._nodes: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> node id
        self._node: dict[int, _Node] = {}  # node id -> node
        self._page_node: dict[int, int] = {}  # registered page -> its node id
        self._chain: dict[Hashable, list[int]] = {}  # rid -> node ids of its first full pages (one pin each)
        self._next_id = _ROOT + 1
        self.reset_stats()

    # ------------------------------------------------------------------ plain allocator
    @property
    def num_free(self) -> int:
        """Pages an ``ensure`` can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        """Unreferenced registered pages (still hit by ``admit``, reclaimed by ``ensure`` in LRU order)."""
        return len(self._evictable)

    def blocks_for(self, length: int) -> int:
        return -(-length // self.page_size)

    def can_fit(self, rid: Hashable, length: int) -> bool:
        need = self.blocks_for(length) - len(self.pages.get(rid, []))
        return self.blocks_for(length) <= self.max_blocks and need <= self.num_free

    def ensure(self, rid: Hashable, length: int) -> None:
        """Make request ``rid`` own enough pages for ``length`` tokens and record the length (all-or-nothing:
        on failure nothing changes). Free pages are taken first, then the least recently used evictable
        ones."""
        if length < 0:
            raise ValueError(f"request {rid}: length must be >= 0, got {length}")
        nblocks = self.blocks_for(length)
        if nblocks > self.max_blocks:
            raise OutOfPagesError(f"request {rid}: {length} tokens need {nblocks} blocks, more than the "
                                  f"{self.max_blocks} a block table holds")
        need = nblocks - len(self.pages.get(rid, []))
        if need > self.num_free:
            raise OutOfPagesError(f"request {rid}: needs {need} more pages, {self.num_free} free "
                                  f"({len(self._free)} free + {len(self._evictable)} evictable cached)")
        pages = self.pages.setdefault(rid, [])
        for _ in range(max(need, 0)):
            page = self._free.pop() if self._free else self._evict()
            self._ref[page] = 1
            pages.append(page)
        self.lengths[rid] = length

    def rollback(self, rid: Hashable, length: int) -> None:
        """Shrink request ``rid`` to ``length`` tokens; pages wholly past it return to the free list.

        Raises RuntimeError (and changes nothing) if a forgotten position lies in a page that is shared or
        registered: only a request's private, unregistered pages may be rewritten or dropped."""
        if rid not in self.pages:
            raise KeyError(f"unknown request {rid}")
        if not 0 <= length <= self.lengths[rid]:
            raise ValueError(f"request {rid}: cannot roll back to {length} (length {self.lengths[rid]})")
        pages = self.pages[rid]
        first = length // self.page_size  # the first page holding a forgotten position
        for i in range(first, len(pages)):
            p = pages[i]
            if self._ref[p] != 1 or p in self._page_node:
                state = "registered" if p in self._page_node else "unregistered"
                raise RuntimeError(f"request {rid}: rolling back to {length} tokens would forget positions "
                                   f"of block {i} (page {p}, refcount {self._ref[p]}, {state}); only "
                                   f"private unregistered pages can be rolled back")
        self._truncate_chain(rid, first)
        keep = self.blocks_for(length)
        while len(pages) > keep:
            p = pages.pop()
            self._ref[p] = 0
            self._free.append(p)
        self.lengths[rid] = length

    def free(self, rid: Hashable) -> None:
        """Drop request ``rid``'s pages (tail first): unreferenced ones go to the free list, or to the end of
        the LRU of evictable pages if registered. Unknown requests are ignored."""
        for p in reversed(self.pages.pop(rid, [])):
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if p in self._page_node:
                    self._evictable[p] = None
                else:
                    self._free.append(p)
        self._truncate_chain(rid, 0)
        self._chain.pop(rid, None)
        self.lengths.pop(rid, None)

    def block_table(self, rids: Sequence[Hashable | None]) -> np.ndarray:
        """``int32[len(rids), max_blocks]``; ``None`` rows (padding) and unused entries are 0 (never read)."""
        table = np.zeros((len(rids), self.max_blocks), np.int32)
        for i, rid in enumerate(rids):
            if rid is None:
                continue
            pages = self.pages.get(rid, [])
            table[i, : len(pages)] = pages
        return table

    # ------------------------------------------------------------------ prefix caching
    def match_prefix(self, tokens: Sequence[int]) -> int:
        """Tokens of the longest cached page-aligned prefix of ``tokens``, at most
        ``((len(tokens) - 1) // page_size) * page_size`` (one token is always left to compute). No state
        change."""
        return len(self._match(tokens)[0]) * self.page_size

    def admit(self, rid: Hashable, tokens: Sequence[int]) -> int:
        """Give request ``rid`` (which owns no pages yet) the cached prefix pages of ``tokens``; its length
        becomes the matched token count, which is returned (0, and no state change, when nothing matches or
        caching is off). Counts ``len(tokens)`` queried and the matched tokens as hits."""
        if not self.enable_prefix_caching:
            return 0
        if self.pages.get(rid):
            raise ValueError(f"request {rid}: admit needs a request without pages, it owns "
                             f"{len(self.pages[rid])}")
        pages, nodes = self._match(tokens)
        self._queries += len(tokens)
        self._hits += len(pages) * self.page_size
        if not pages:
            return 0
        for p in pages:
            if self._ref[p] == 0:
                del self._evictable[p]
            self._ref[p] += 1
        for n in nodes:
            self._node[n].pins += 1
        self.pages[rid] = list(pages)
        self._chain[rid] = list(nodes)
        self.lengths[rid] = len(pages) * self.page_size
        return self.lengths[rid]

    def register(self, rid: Hashable, tokens: Sequence[int], upto: int) -> int:
        """Register every full page of request ``rid`` wholly below position ``upto`` that is not registered
        yet (``tokens`` is its token sequence; positions below ``upto`` must be written already). A page whose
        exact content (and prefix) is registered already keeps the existing canonical entry and stays private.
        Pages the request's chain covers already (admitted or registered before) are not re-read: ``tokens``
        must agree with the earlier calls there. Returns the number of pages newly registered (0 when caching is
        off)."""
        if not self.enable_prefix_caching:
            return 0
        if rid not in self.pages:
            raise KeyError(f"unknown request {rid}")
        length = self.lengths[rid]
        if not 0 <= upto <= min(length, len(tokens)):
            raise ValueError(f"request {rid}: cannot register up to {upto}: it holds {length} tokens and "
                             f"{len(tokens)} were given")
        ps = self.page_size
        pages = self.pages[rid]
        chain = self._chain.setdefault(rid, [])
        added = 0
        first, end = len(chain), upto // ps
        toks = _token_slice(tokens, first * ps, end * ps)
        for i in range(first, end):
            p = pages[i]
            if p in self._page_node:
                raise RuntimeError(f"request {rid}: block {i} (page {p}) is registered but not in its chain")
            parent = chain[-1] if chain else _ROOT
            key = (parent, tuple(toks[(i - first) * ps:(i - first + 1) * ps]))
            nid = self._nodes.get(key)
            if nid is None:
                nid = self._new_node(key)
            node = self._node[nid]
            node.pins += 1  # rid's chain
            chain.append(nid)
            if node.page is None:
                node.page = p
                node.pins += 1
                self._page_node[p] = nid
                added += 1
        return added

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def is_shared(self, page: int) -> bool:
        """Whether more than one request holds ``page``."""
        return self._ref[page] > 1

    def is_registered(self, page: int) -> bool:
        """Whether ``page`` holds cached content (read-only, reachable by ``admit``)."""
        return page in self._page_node

    def writable_pages(self, rid: Hashable) -> list[int]:
        """The pages of ``rid`` it may write: held by ``rid`` alone and unregistered."""
        return [p for p in self.pages.get(rid, []) if self._ref[p] == 1 and p not in self._page_node]

    def check_writable(self, rid: Hashable, start: int, end: int) -> None:
        """Debug invariant: raise RuntimeError unless positions ``[start, end)`` of ``rid`` lie in pages it
        owns alone and that are unregistered."""
        if start >= end:
            return
        pages = self.pages.get(rid, [])
        for b in range(start // self.page_size, (end - 1) // self.page_size + 1):
            if b >= len(pages):
                raise RuntimeError(f"request {rid}: positions [{start}, {end}) need block {b}, it owns "
                                   f"{len(pages)} pages")
            p = pages[b]
            if self._ref[p] != 1 or p in self._page_node:
                state = "registered" if p in self._page_node else "unregistered"
                raise RuntimeError(f"request {rid}: writing positions [{start}, {end}) touches block {b} "
                                   f"(page {p}, refcount {self._ref[p]}, {state})")

    @property
    def stats(self) -> dict[str, float | int]:
        """``queries`` (tokens looked up by ``admit``), ``hits`` (tokens matched), ``hit_rate``, ``evictions``
        (cached pages reclaimed by ``ensure``) and ``cached_pages`` (registered pages now)."""
        return dict(queries=self._queries, hits=self._hits,
                    hit_rate=self._hits / self._queries if self._queries else 0.0,
                    evictions=self._evictions, cached_pages=len(self._page_node))

    def reset_stats(self) -> None:
        self._queries = self._hits = self._evictions = 0

    def check_invariants(self) -> None:
        """Assert the module docstring's invariants (O(pages); for tests and debugging)."""
        owners = collections.Counter()
        for rid, pages in self.pages.items():
            if len(set(pages)) != len(pages):
                raise AssertionError(f"request {rid} holds a page twice: {pages}")
            owners.update(pages)
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free) or free & evictable or (free | evictable) & set(owners):
            raise AssertionError("a page is in more than one of free / evictable / owned")
        if len(free) + len(evictable) + len(owners) != self.num_pages:
            raise AssertionError(f"{len(free)} free + {len(evictable)} evictable + {len(owners)} owned != "
                                 f"{self.num_pages} pages")
        for p in range(self.num_pages):
            if self._ref[p] != owners.get(p, 0):
                raise AssertionError(f"page {p}: refcount {self._ref[p]}, held by {owners[p]} requests")
            if self._ref[p] > 1 and p not in self._page_node:
                raise AssertionError(f"page {p} is shared by {self._ref[p]} requests but not registered")
        if any(p not in self._page_node for p in evictable) or any(p in self._page_node for p in free):
            raise AssertionError("an evictable page is not registered, or a free page is")
        for p, nid in self._page_node.items():
            if self._node[nid].page != p:
                raise AssertionError(f"page {p} names node {nid}, whose page is {self._node[nid].page}")
        pins = collections.Counter()
        for nid, node in self._node.items():
            if self._nodes.get(node.key) != nid:
                raise AssertionError(f"node {nid} is not under its key")
            pins[nid] += node.page is not None
            if node.key[0] != _ROOT:
                pins[node.key[0]] += 1
        for rid, chain in self._chain.items():
            pins.update(chain)
            if len(chain) > len(self.pages.get(rid, [])):
                raise AssertionError(f"request {rid}: chain of {len(chain)} nodes over "
                                     f"{len(self.pages.get(rid, []))} pages")
        for nid, node in self._node.items():
            if node.pins != pins[nid] or node.pins <= 0:
                raise AssertionError(f"node {nid}: {node.pins} pins, expected {pins[nid]} (> 0)")

    def clear_cache(self) -> None:
        """Forget every cached page (their contents are no longer trusted: a fresh device cache, or pages
        scribbled on by timing runs). Only while no request holds pages."""
        if self.pages:
            raise RuntimeError(f"clear_cache with {len(self.pages)} requests still holding pages")
        while self._evictable:
            self._free.append(self._evict())
        self._evictions = 0

    # ------------------------------------------------------------------ internals
    def _match(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """(pages, node ids) of the longest registered prefix of ``tokens`` within the cap."""
        pages: list[int] = []
        nodes: list[int] = []
        if not self.enable_prefix_caching or len(tokens) == 0:
            return pages, nodes
        ps = self.page_size
        parent = _ROOT
        n = min((len(tokens) - 1) // ps, self.max_blocks)
        toks = _token_slice(tokens, 0, n * ps)
        for i in range(n):
            nid = self._nodes.get((parent, tuple(toks[i * ps:(i + 1) * ps])))
            if nid is None or self._node[nid].page is None:
                break
            pages.append(self._node[nid].page)
            nodes.append(nid)
            parent = nid
        return pages, nodes

    def _new_node(self, key: tuple[int, tuple[int, ...]]) -> int:
        nid = self._next_id
        self._next_id += 1
        self._nodes[key] = nid
        self._node[nid] = _Node(key)
        if key[0] != _ROOT:
            self._node[key[0]].pins += 1
        return nid

    def _unpin(self, nid: int) -> None:
        while nid != _ROOT:
            node = self._node[nid]
            node.pins -= 1
            if node.pins > 0:
                return
            del self._node[nid]
            del self._nodes[node.key]
            nid = node.key[0]

    def _truncate_chain(self, rid: Hashable, n: int) -> None:
        chain = self._chain.get(rid)
        while chain is not None and len(chain) > n:
            self._unpin(chain.pop())

    def _evict(self) -> int:
        page, _ = self._evictable.popitem(last=False)
        nid = self._page_node.pop(page)
        self._node[nid].page = None
        self._unpin(nid)
        self._evictions += 1
        return page


def _token_slice(tokens: Sequence[int], start: int, end: int) -> Sequence[int]:
    """``tokens[start:end]``, whose items page keys hold (tuples of them): an array's slice as Python ints, a list
    or tuple as it is (numpy integers in it hash and compare equal to Python ints). Converting every token with
    ``int()`` cost the host more than the rest of prefix matching."""
    part = tokens[start:end]
    return part.tolist() if hasattr(part, "tolist") else part


class PageAllocator(PagePool):
    """The plain allocator: a :class:`PagePool` without prefix caching (nothing is ever shared)."""

    def __init__(self, num_pages: int, page_size: int, max_blocks_per_request: int, *,
                 free_order: Iterable[int] | None = None):
        super().__init__(num_pages, page_size, max_blocks_per_request, free_order=free_order,
                         enable_prefix_caching=False)
