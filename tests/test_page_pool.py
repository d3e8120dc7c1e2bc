"""spec_decode.page_pool: the plain allocator, prefix caching (exact matches, the cap, LRU eviction,
refcounts) and a seeded random walk against an independent model of the pool."""

from __future__ import annotations

import numpy as np
import pytest

from spec_decode.page_pool import OutOfPagesError, PageAllocator, PagePool


def test_page_allocator():
    alloc = PageAllocator(6, 4, max_blocks_per_request=3, free_order=[5, 4, 3, 2, 1, 0])
    alloc.ensure("a", 5)
    assert alloc.pages["a"] == [5, 4] and alloc.num_free == 4
    alloc.ensure("b", 12)
    assert alloc.pages["b"] == [3, 2, 1]
    with pytest.raises(OutOfPagesError):
        alloc.ensure("c", 8)  # needs 2, 1 free: nothing changes
    assert "c" not in alloc.pages and alloc.num_free == 1
    with pytest.raises(OutOfPagesError, match="blocks"):
        alloc.ensure("a", 13)
    alloc.rollback("b", 5)
    assert alloc.pages["b"] == [3, 2] and alloc.num_free == 2 and alloc.lengths["b"] == 5
    with pytest.raises(ValueError):
        alloc.rollback("b", 6)
    np.testing.assert_array_equal(alloc.block_table(["a", None, "b"]), [[5, 4, 0], [0, 0, 0], [3, 2, 0]])
    alloc.free("a")
    assert alloc.num_free == 4 and "a" not in alloc.lengths


def _run(pool: PagePool, rid, tokens, upto=None) -> int:
    """Admit ``rid`` with ``tokens``, give it pages for all of them and register its full pages."""
    hit = pool.admit(rid, tokens)
    pool.ensure(rid, len(tokens))
    pool.register(rid, tokens, len(tokens) if upto is None else upto)
    pool.check_invariants()
    return hit


def test_shared_first_page_only():
    pool = PagePool(8, 4, 4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = [1, 2, 3, 4, 5, 6, 7, 0, 9]  # same first page, second page differs in one token
    assert _run(pool, "a", a) == 0
    assert pool.stats["cached_pages"] == 2  # the partial third page is never registered
    assert pool.match_prefix(b) == 4
    assert _run(pool, "b", b, upto=4) == 4  # b has written only its first page so far
    assert pool.pages["a"][0] == pool.pages["b"][0] and pool.refcount(pool.pages["a"][0]) == 2
    assert pool.is_shared(pool.pages["a"][0])
    assert not set(pool.pages["a"][1:]) & set(pool.pages["b"][1:])
    assert pool.writable_pages("b") == pool.pages["b"][1:] and pool.writable_pages("a") == pool.pages["a"][2:]
    pool.check_writable("b", 4, 9)
    with pytest.raises(RuntimeError, match="request b"):
        pool.check_writable("b", 3, 5)
    with pytest.raises(RuntimeError, match="registered"):
        pool.check_writable("a", 4, 8)  # a's own second page is registered: read-only now
    with pytest.raises(RuntimeError, match="block 3"):
        pool.check_writable("a", 8, 13)  # past its pages


@pytest.mark.parametrize("kind", ["numpy ints in a list", "array", "tuple"])
def test_token_containers_share_pages_with_plain_lists(kind):
    """Page keys are tuples of the token ids as given: numpy integers hash and compare as Python ints, so a
    prompt given as an array, a tuple or a list of numpy ints hits the pages a list of ints registered."""
    rng = np.random.default_rng(len(kind))
    ids = [int(t) for t in rng.integers(0, 1000, 13)]
    pool = PagePool(8, 4, max_blocks_per_request=4)
    assert _run(pool, "a", ids) == 0
    other = {"numpy ints in a list": [np.int64(t) for t in ids], "array": np.asarray(ids, np.int32),
             "tuple": tuple(ids)}[kind]
    assert _run(pool, "b", other) == 12  # three full pages (one token always left to compute)
    assert pool.pages["b"][:3] == pool.pages["a"][:3]
    assert pool.match_prefix(ids[:5] + [ids[5] + 1] + ids[6:]) == 4  # a changed token in page 2: page 1 only


def test_hash_collisions_never_hit():
    # equal Python hashes, different tokens: hash(-1) == hash(-2), and ints congruent mod 2**61 - 1 collide
    m = 2**61 - 1
    assert hash((0, (1, 2, 3, -1))) == hash((0, (1, 2, 3, -2)))
    assert hash((0, (1, 2, 3, 5))) == hash((0, (1, 2, 3, 5 + m)))
    pool = PagePool(8, 4, 4)
    _run(pool, "a", [1, 2, 3, -1, 7])
    _run(pool, "b", [1, 2, 3, 5, 7])
    for tokens in ([1, 2, 3, -2, 7], [1, 2, 3, 5 + m, 7]):
        assert pool.match_prefix(tokens) == 0
        assert pool.admit("c", tokens) == 0 and "c" not in pool.pages
    assert pool.match_prefix([1, 2, 3, -1, 0]) == 4 and pool.match_prefix([1, 2, 3, 5, 0]) == 4


def test_the_same_page_in_another_prefix_does_not_hit():
    pool = PagePool(8, 2, 4)
    _run(pool, "a", [1, 2, 3, 4, 0])
    assert pool.match_prefix([3, 4, 1, 2, 0]) == 0  # page [3, 4] is cached, but after [1, 2]
    assert pool.match_prefix([1, 2, 3, 4, 0]) == 4


def test_cap_leaves_one_token_to_compute():
    pool = PagePool(8, 4, 4)
    tokens = list(range(8))
    _run(pool, "a", tokens)
    assert pool.stats["cached_pages"] == 2
    assert pool.match_prefix(tokens) == 4  # wholly cached: the last page is recomputed
    assert pool.match_prefix(tokens + [8]) == 8
    assert pool.match_prefix(tokens[:5]) == 4 and pool.match_prefix(tokens[:4]) == 0
    assert pool.match_prefix([]) == 0
    assert pool.admit("b", tokens) == 4 and pool.lengths["b"] == 4 and pool.pages["b"] == pool.pages["a"][:1]


def test_lru_eviction_order_and_registration_removal():
    pool = PagePool(3, 2, 2)
    prompts = {r: [10 * i + 1, 10 * i + 2, 0] for i, r in enumerate("abc")}  # one cacheable page each
    for r, t in prompts.items():
        _run(pool, r, t[:2])
    assert pool.num_free == 0
    for r in "abc":
        pool.free(r)
    assert pool.num_free == 3 and pool.num_evictable == 3 and pool.stats["cached_pages"] == 3
    assert pool.admit("b2", prompts["b"]) == 2  # a hit makes b's page the most recently used when freed
    pool.free("b2")
    pool.ensure("x", 2)  # evicts the least recently used: a's page
    assert pool.match_prefix(prompts["a"]) == 0
    assert pool.match_prefix(prompts["b"]) == 2 and pool.match_prefix(prompts["c"]) == 2
    pool.ensure("y", 2)  # then c's (b's was released after c's)
    assert pool.match_prefix(prompts["c"]) == 0 and pool.match_prefix(prompts["b"]) == 2
    assert pool.stats["evictions"] == 2 and pool.stats["cached_pages"] == 1
    pool.check_invariants()


def test_free_releases_a_sequence_tail_first():
    pool = PagePool(3, 2, 3)
    tokens = [1, 2, 3, 4, 5]
    _run(pool, "a", tokens)
    first, second, third = pool.pages["a"]
    pool.free("a")
    assert pool.num_free == 3 and pool.num_evictable == 2
    pool.ensure("b", 2)
    assert pool.pages["b"] == [third]  # truly free pages first
    pool.ensure("b", 4)
    assert pool.pages["b"] == [third, second]  # then the tail of the cached sequence
    assert pool.match_prefix(tokens) == 2 and pool.match_prefix([1, 2, 3, 4, 9]) == 2
    pool.check_invariants()


def test_ensure_is_all_or_nothing_with_cached_pages():
    pool = PagePool(4, 2, 6)
    _run(pool, "a", [1, 2, 3, 4, 5])  # 3 pages, 2 registered
    pool.free("a")
    before = (pool.num_free, pool.num_evictable, pool.stats, dict(pool.pages))
    with pytest.raises(OutOfPagesError, match="request b: needs 5 more pages, 4 free"):
        pool.ensure("b", 10)
    with pytest.raises(OutOfPagesError, match="blocks"):
        pool.ensure("b", 13)
    assert (pool.num_free, pool.num_evictable, pool.stats, dict(pool.pages)) == before
    assert pool.match_prefix([1, 2, 3, 4, 5]) == 4 and pool.can_fit("b", 8) and not pool.can_fit("b", 9)
    pool.check_invariants()


def test_duplicate_registration_keeps_one_canonical_page_and_reattaches():
    pool = PagePool(5, 2, 3)
    _run(pool, "a", [1, 2, 0])  # registers [1, 2]
    _run(pool, "b", [9, 9, 0], upto=0)  # nothing registered: b computed its own prompt
    pool.free("b")
    pool.ensure("c", 5)  # c computes [1, 2] itself (no admit)
    pool.free("b")  # unknown requests are ignored
    # registering: registering keeps a's page canonical, c's copy stays private
    assert pool.register("c", [1, 2, 3, 4, 0], 4) == 1
    a0, (c0, c1, _) = pool.pages["a"][0], pool.pages["c"]
    assert pool.is_registered(a0) and not pool.is_registered(c0) and pool.is_registered(c1)
    assert pool.writable_pages("c") == [c0, pool.pages["c"][2]]
    assert pool.match_prefix([1, 2, 3, 4, 5]) == 4
    pool.free("a")
    pool.ensure("x", 4)  # the free page, then a's evictable page: [1, 2] is no longer cached
    assert pool.match_prefix([1, 2, 3, 4, 5]) == 0 and pool.stats["cached_pages"] == 1
    pool.check_invariants()
    pool.free("x")
    _run(pool, "d", [1, 2, 7], upto=2)  # [1, 2] cached again: c's [3, 4] after it is reachable again
    assert pool.match_prefix([1, 2, 3, 4, 5]) == 4
    pool.free("c")
    pool.free("d")
    assert pool.admit("e", [1, 2, 3, 4, 5]) == 4 and pool.pages["e"] == [pool.pages["e"][0], c1]
    pool.check_invariants()


def test_rollback_refuses_shared_and_registered_pages():
    pool = PagePool(8, 2, 4)
    _run(pool, "a", [1, 2, 3, 4, 5])
    _run(pool, "b", [1, 2, 3, 6, 7])
    assert pool.lengths["b"] == 5 and pool.refcount(pool.pages["b"][0]) == 2
    pool.rollback("b", 4)  # drops b's private tail page
    with pytest.raises(RuntimeError, match=r"request b: .* block 1 .*registered"):
        pool.rollback("b", 3)  # b registered [3, 6]
    with pytest.raises(RuntimeError, match=r"request b: .* block 0 .*refcount 2"):
        pool.rollback("b", 0)
    assert pool.lengths["b"] == 4 and len(pool.pages["b"]) == 2
    pool.check_invariants()
    pool.ensure("b", 8)
    pool.rollback("b", 4)
    assert len(pool.pages["b"]) == 2
    pool.check_invariants()


def test_admit_and_register_errors():
    pool = PagePool(8, 2, 4)
    pool.ensure("a", 3)
    with pytest.raises(ValueError, match="request a: admit needs a request without pages, it owns 2"):
        pool.admit("a", [1, 2, 3])
    with pytest.raises(ValueError, match="request a: cannot register up to 4: it holds 3 tokens"):
        pool.register("a", [1, 2, 3, 4], 4)
    with pytest.raises(KeyError):
        pool.register("z", [1, 2], 2)


def test_caching_off_never_shares():
    for pool in (PagePool(6, 2, 3, enable_prefix_caching=False), PageAllocator(6, 2, 3)):
        pool.ensure("a", 5)
        assert pool.register("a", [1, 2, 3, 4, 5], 5) == 0
        assert pool.match_prefix([1, 2, 3, 4, 5]) == 0 and pool.admit("b", [1, 2, 3, 4, 5]) == 0
        assert "b" not in pool.pages
        pool.ensure("b", 5)
        assert not set(pool.pages["a"]) & set(pool.pages["b"])
        pool.free("a")
        assert pool.num_free == 3 and pool.num_evictable == 0
        assert pool.stats == dict(queries=0, hits=0, hit_rate=0.0, evictions=0, cached_pages=0)
        pool.check_invariants()


def test_stats():
    pool = PagePool(6, 2, 6)
    assert pool.stats == dict(queries=0, hits=0, hit_rate=0.0, evictions=0, cached_pages=0)
    _run(pool, "a", [1, 2, 3, 4, 5])  # 5 queried, 0 hit
    _run(pool, "b", [1, 2, 3, 9, 9])  # 5 queried, 2 hit
    assert pool.stats == dict(queries=10, hits=2, hit_rate=0.2, evictions=0, cached_pages=3)
    pool.free("a")
    pool.free("b")
    pool.ensure("c", 12)  # 3 free pages + 3 evicted
    assert pool.stats["evictions"] == 3 and pool.stats["cached_pages"] == 0
    pool.reset_stats()
    assert pool.stats == dict(queries=0, hits=0, hit_rate=0.0, evictions=0, cached_pages=0)


# ----------------------------------------------------------------------------------------------- random walk
class _Model:
    """An independent, slow model of the pool: registrations keyed by the whole token prefix a page ends."""

    def __init__(self, num_pages, page_size, max_blocks, order):
        self.ps, self.max_blocks, self.num_pages = page_size, max_blocks, num_pages
        self.free = list(order)[::-1]
        self.lru: list[int] = []
        self.owners: dict = {}
        self.lengths: dict = {}
        self.covered: dict = {}  # rid -> leading full pages already considered for registration
        self.reg: dict[int, tuple] = {}  # page -> the full prefix it ends
        self.by_prefix: dict[tuple, int] = {}
        self.evictions = 0

    def ref(self, p):
        return sum(pages.count(p) for pages in self.owners.values())

    def match(self, tokens):
        pages = []
        cap = min(max(len(tokens) - 1, 0) // self.ps, self.max_blocks)
        while len(pages) < cap and tuple(tokens[: (len(pages) + 1) * self.ps]) in self.by_prefix:
            pages.append(self.by_prefix[tuple(tokens[: (len(pages) + 1) * self.ps])])
        return pages

    def admit(self, rid, tokens):
        pages = self.match(tokens)
        if pages:
            for p in pages:
                if self.ref(p) == 0:
                    self.lru.remove(p)
            self.owners[rid] = list(pages)
            self.lengths[rid] = len(pages) * self.ps
            self.covered[rid] = len(pages)
        return len(pages) * self.ps

    def ensure(self, rid, length):
        nb = -(-length // self.ps)
        need = nb - len(self.owners.get(rid, []))
        if nb > self.max_blocks or need > len(self.free) + len(self.lru):
            return False
        pages = self.owners.setdefault(rid, [])
        for _ in range(max(need, 0)):
            if self.free:
                p = self.free.pop()
            else:
                p = self.lru.pop(0)
                del self.by_prefix[self.reg.pop(p)]
                self.evictions += 1
            pages.append(p)
        self.lengths[rid] = length
        return True

    def register(self, rid, tokens, upto):
        for i in range(self.covered.get(rid, 0), upto // self.ps):
            prefix = tuple(tokens[: (i + 1) * self.ps])
            if prefix not in self.by_prefix:
                self.by_prefix[prefix] = self.owners[rid][i]
                self.reg[self.owners[rid][i]] = prefix
        self.covered[rid] = max(self.covered.get(rid, 0), upto // self.ps)

    def rollback(self, rid, length):
        pages = self.owners[rid]
        first = length // self.ps
        if any(self.ref(p) > 1 or p in self.reg for p in pages[first:]):
            return False
        self.covered[rid] = min(self.covered.get(rid, 0), first)
        while len(pages) > -(-length // self.ps):
            self.free.append(pages.pop())
        self.lengths[rid] = length
        return True

    def release(self, rid):
        pages = self.owners.pop(rid, [])
        for i in range(len(pages) - 1, -1, -1):
            p = pages[i]
            if self.ref(p) == 0 and p not in pages[:i]:
                (self.lru if p in self.reg else self.free).append(p)
        self.lengths.pop(rid, None)
        self.covered.pop(rid, None)


def _compare(pool: PagePool, model: _Model, probes) -> None:
    pool.check_invariants()
    assert pool.pages == model.owners and pool.lengths == model.lengths
    assert pool.num_free == len(model.free) + len(model.lru) and pool.num_evictable == len(model.lru)
    referenced = {p for pages in model.owners.values() for p in pages}
    assert pool.num_free == pool.num_pages - len(referenced)
    for p in range(pool.num_pages):
        assert pool.refcount(p) == model.ref(p) and pool.is_registered(p) == (p in model.reg)
        assert pool.is_shared(p) == (model.ref(p) > 1)
    for rid, pages in model.owners.items():
        assert pool.writable_pages(rid) == [p for p in pages if model.ref(p) == 1 and p not in model.reg]
        table = pool.block_table([rid])
        np.testing.assert_array_equal(table[0, : len(pages)], pages)
    assert pool.stats["cached_pages"] == len(model.reg) and pool.stats["evictions"] == model.evictions
    for tokens in probes:
        assert pool.match_prefix(tokens) == len(model.match(tokens)) * model.ps


@pytest.mark.parametrize("seed", range(24))
def test_random_walk_matches_model(seed):
    rng = np.random.default_rng(seed)
    ps, max_blocks, num_pages = int(rng.integers(1, 4)), 6, int(rng.integers(4, 14))
    order = rng.permutation(num_pages)
    pool = PagePool(num_pages, ps, max_blocks, free_order=order)
    model = _Model(num_pages, ps, max_blocks, order)
    n = ps * max_blocks
    # a few shared stems, so that prompts often agree on a page prefix (a tiny vocabulary makes partial
    # agreement within a page common too)
    stems = [rng.integers(0, 3, n).tolist() for _ in range(3)]
    seqs: dict[int, list[int]] = {}

    def fresh():
        cut = int(rng.integers(0, n + 1))
        return (stems[int(rng.integers(0, 3))][:cut] + rng.integers(0, 3, n).tolist())[:n]

    for _ in range(250):
        op = rng.choice(["admit", "ensure", "register", "rollback", "free", "writable"],
                        p=[.2, .3, .2, .1, .12, .08])
        idle = [r for r in range(6) if r not in pool.pages]
        live = list(pool.pages)
        if op == "admit" and idle:
            rid = idle[0]
            seqs[rid] = fresh()
            prompt = seqs[rid][: int(rng.integers(0, n + 1))]
            assert pool.admit(rid, prompt) == model.admit(rid, prompt)
        elif op == "ensure" and (live or idle):
            rid = int(rng.choice(live)) if live and (rng.random() < 0.7 or not idle) else idle[0]
            seqs.setdefault(rid, fresh())
            length = int(rng.integers(pool.lengths.get(rid, 0), n + ps + 1))
            if model.ensure(rid, length):
                pool.ensure(rid, length)
            else:
                with pytest.raises(OutOfPagesError, match=f"request {rid}"):
                    pool.ensure(rid, length)
        elif op == "register" and live:
            rid = int(rng.choice(live))
            upto = int(rng.integers(0, pool.lengths[rid] + 1))
            pool.register(rid, seqs[rid], upto)
            model.register(rid, seqs[rid], upto)
        elif op == "rollback" and live:
            rid = int(rng.choice(live))
            length = int(rng.integers(0, pool.lengths[rid] + 1))
            if model.rollback(rid, length):
                pool.rollback(rid, length)
                seqs[rid][length:] = rng.integers(0, 3, n - length).tolist()  # rejected drafts: new tokens
            else:
                with pytest.raises(RuntimeError, match=f"request {rid}: rolling back"):
                    pool.rollback(rid, length)
        elif op == "free" and live:
            rid = int(rng.choice(live))
            pool.free(rid)
            model.release(rid)
        elif op == "writable" and live:
            rid = int(rng.choice(live))
            start = int(rng.integers(0, n))
            end = int(rng.integers(start, n + 1))
            pages = model.owners[rid]
            ok = start >= end or all(b < len(pages) and model.ref(pages[b]) == 1 and pages[b] not in model.reg
                     for b in range(start // ps, -(-end // ps)))
            if ok:
                pool.check_writable(rid, start, end)
            else:
                with pytest.raises(RuntimeError, match=f"request {rid}"):
                    pool.check_writable(rid, start, end)
        probes = [s[: int(rng.integers(0, n + 1))] for s in seqs.values()] + [fresh()]
        _compare(pool, model, probes)
