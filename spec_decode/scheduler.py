"""The host side of the engine: admission, chunked prefill, page allocation, bucketing, preemption, bookkeeping.

The scheduler never touches device arrays: it turns the engine's requests into one :class:`~spec_decode.step.
StepPlan` (numpy arrays) per step and folds the step's small read-back output into per-request state.

Policy, step by step:

1. **Decode rows** (requests whose prompt is in the cache) each get pages for the anchor plus the drafts they may
   verify (``num_cached + 1 + scheduled``). When the page pool runs out, the *newest* running request (latest
   admission) is **preempted**: its pages and slot are freed and it goes back to the front of the waiting queue;
   later it is recomputed (prompt plus the tokens it already produced, prefilled again) and continues where it
   stopped. Sampling keys depend only on (seed, position), so greedy outputs are unchanged by preemption, and so
   are stochastic outputs under fixed verification (adaptive allocation depends on the batch by design).
2. **Prefill chunks**: requests being prefilled continue first, then waiting requests are admitted in order while a
   slot is free, pages are available and the step's prefill token budget (``max_num_batched_tokens``) lasts.
   Admitted work that does not fit waits; nothing crashes.
3. **Buckets**: rows are padded to a power of two (at most ``max_num_seqs``), packed tokens to a power of two; the
   verify-logits rows are bounded by ``max_total_logit_rows``.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from minimax_jax.cache import OutOfPagesError, PageAllocator
from spec_decode.request import Request, RequestStatus

__all__ = ["Request", "RequestStatus", "ScheduledStep", "Scheduler", "next_pow2"]


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclasses.dataclass
class ScheduledStep:
    """One planned step: the plan arrays, its bucket key, and which request each row serves."""

    arrays: dict[str, np.ndarray]
    key: tuple  # (rows, tokens, logit rows, sampling, filtering)
    row_requests: list[Request | None]
    num_tokens: int  # real packed tokens (prefill + anchors + verified drafts)
    num_decode: int
    num_prefill_tokens: int


class Scheduler:
    """Slots, the page pool and the waiting queue of one engine run (see the module docstring)."""

    def __init__(self, *, num_slots: int, num_pages: int, page_size: int, max_model_len: int,
                 num_speculative_tokens: int, max_num_batched_tokens: int, max_total_logit_rows: int,
                 num_stop_ids: int, min_token_bucket: int = 8):
        self.num_slots = num_slots
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.k = num_speculative_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_total_logit_rows = max_total_logit_rows
        self.max_blocks = -(-max_model_len // page_size)
        self.num_stop_ids = num_stop_ids
        self.min_token_bucket = min_token_bucket
        self.allocator = PageAllocator(num_pages, page_size, self.max_blocks)
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}  # slot -> request (prefill or decode)
        self.num_preemptions = 0
        self.stale_conf = np.ones((num_slots, max(self.k, 1)), np.float32)

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        request.prefill_target = list(request.prompt)
        k = max(self.k, 1)
        request.accepted_per_position = np.zeros(k, np.int64)
        request.verified_per_position = np.zeros(k, np.int64)
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, req: Request) -> None:
        self.allocator.free(req.index)
        if req.slot is not None:
            self.running.pop(req.slot, None)
            self.free_slots.append(req.slot)
            self.free_slots.sort(reverse=True)
        req.slot = None

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s pages and slot; it is recomputed later (prompt + its output so far)."""
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_cached = 0
        req.prefill_target = req.prompt + req.output[:-1]  # the last output token is the anchor, not cached
        req.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _newest_running(self) -> Request | None:
        live = [r for r in self.running.values() if r.status in (RequestStatus.RUNNING, RequestStatus.PREFILL)]
        return max(live, key=lambda r: r.arrival) if live else None

    def _ensure(self, req: Request, length: int) -> bool:
        """Pages for ``length`` tokens of ``req``, preempting newer requests as needed; False if ``req`` itself
        was preempted (it is the newest and still does not fit)."""
        while True:
            try:
                self.allocator.ensure(req.index, length)
                return True
            except OutOfPagesError:
                victim = self._newest_running()
                if victim is None:
                    raise
                self._preempt(victim)
                if victim is req:
                    return False

    # ------------------------------------------------------------------ planning
    def max_emit(self, req: Request) -> int:
        return min(req.params.max_new_tokens - len(req.output), self.max_model_len - req.total_len)

    def schedule(self, *, budget_fn) -> ScheduledStep | None:
        """Plan the next step; ``budget_fn(stale_conf [n, K], scheduled [n], n_sampling, n_non_draft, rows)``
        returns the draft budget. None when nothing can run."""
        k = self.k
        # 1. decode rows, oldest first; pages for anchor + scheduled drafts
        decode: list[tuple[Request, int]] = []
        for req in sorted(self.running.values(), key=lambda r: r.arrival):
            if req.status is not RequestStatus.RUNNING or req.slot is None:
                continue
            sched = max(0, min(k, self.max_emit(req) - 1))
            if not self._ensure(req, req.num_cached + 1 + sched):
                continue
            decode.append((req, sched))
        decode = [(r, s) for r, s in decode if r.slot is not None and r.status is RequestStatus.RUNNING]

        # 2. prefill chunks: continuing prefills first, then admissions
        prefill: list[tuple[Request, int]] = []
        room = self.max_num_batched_tokens
        cont = sorted((r for r in self.running.values() if r.status is RequestStatus.PREFILL),
                      key=lambda r: r.arrival)
        for req in cont:
            if room <= 0:
                break
            n = min(room, len(req.prefill_target) - req.num_cached)
            if not self._try_ensure(req, req.num_cached + n):
                continue
            prefill.append((req, n))
            room -= n
        while self.waiting and room > 0 and self.free_slots:
            req = self.waiting[0]
            n = min(room, len(req.prefill_target))
            if not self._try_ensure(req, n):
                break  # admitted work waits for pages
            self.waiting.popleft()
            req.slot = self.free_slots.pop()
            req.status = RequestStatus.PREFILL
            req.num_cached = 0
            self.running[req.slot] = req
            prefill.append((req, n))
            room -= n
        if not decode and not prefill:
            return None

        rows = len(prefill) + len(decode)
        rb = min(next_pow2(rows), next_pow2(self.num_slots))
        row_reqs: list[Request | None] = [r for r, _ in prefill] + [r for r, _ in decode]
        row_reqs += [None] * (rb - rows)

        prefill_tokens = [t for req, n in prefill for t in req.prefill_target[req.num_cached: req.num_cached + n]]
        n_pre = len(prefill_tokens)
        resume = [req.is_resumed and req.num_cached + n == len(req.prefill_target) for req, n in prefill]
        sampling_prefill = sum(1 for (req, n), res in zip(prefill, resume)
                               if req.num_cached + n == len(req.prefill_target) and not res)
        scheduled = np.asarray([s for _, s in decode], np.int64)
        stale = self.stale_conf[[r.slot for r, _ in decode]] if decode else np.ones((0, max(k, 1)), np.float32)
        n_sampling = len(decode) + sampling_prefill
        budget = int(budget_fn(stale[:, :k] if k else stale[:, :0], scheduled, n_sampling, n_pre + len(decode),
                               rb)) if k and decode else 0
        budget = max(0, min(budget, int(scheduled.sum()) if decode else 0))
        num_tokens = n_pre + len(decode) + budget
        t = self.token_bucket(num_tokens)
        nl = self.logit_rows(rb, t)

        a = {
            "rows": np.full(rb, -1, np.int32),
            "prefill_tokens": np.zeros(t, np.int32),
            "prefill_len": np.zeros(rb, np.int32),
            "prefill_start": np.zeros(rb, np.int32),
            "prefill_last": np.zeros(rb, bool),
            "resume_token": np.full(rb, -1, np.int32),
            "block_tables": np.zeros((rb, self.max_blocks), np.int32),
            "scheduled": np.zeros(rb, np.int32),
            "budget": np.asarray(budget, np.int32),
            "temperature": np.zeros(rb, np.float32),
            "top_k": np.zeros(rb, np.int32),
            "top_p": np.ones(rb, np.float32),
            "seed": np.zeros(rb, np.int32),
            "max_emit": np.zeros(rb, np.int32),
            "stop_ids": np.full((rb, self.num_stop_ids), -1, np.int32),
            "commit": np.asarray(True),
        }
        a["prefill_tokens"][:n_pre] = prefill_tokens
        for i, req in enumerate(row_reqs):
            if req is None:
                continue
            a["rows"][i] = req.slot
            p = req.params
            a["temperature"][i], a["top_k"][i], a["top_p"][i], a["seed"][i] = (p.temperature, p.top_k, p.top_p,
                                                                               p.seed)
            a["max_emit"][i] = self.max_emit(req)
            a["stop_ids"][i, : len(req.stop_ids)] = req.stop_ids
        a["block_tables"][: rows] = self.allocator.block_table([r.index for r in row_reqs[:rows]])
        for i, ((req, n), res) in enumerate(zip(prefill, resume)):
            a["prefill_len"][i] = n
            a["prefill_start"][i] = req.num_cached
            a["prefill_last"][i] = req.num_cached + n == len(req.prefill_target)
            if res:
                a["resume_token"][i] = req.output[-1]
        for j, (_, s) in enumerate(decode):
            a["scheduled"][len(prefill) + j] = s
        sampling = any(r is not None and not r.params.greedy for r in row_reqs)
        filtering = any(r is not None and r.params.filters for r in row_reqs)
        key = (rb, t, nl, sampling, filtering)
        return ScheduledStep(a, key, row_reqs, num_tokens, len(decode), n_pre)

    def token_bucket(self, num_tokens: int) -> int:
        """Packed-token bucket: a power of two, at least :attr:`min_token_bucket` (fewer compiled programs)."""
        return max(next_pow2(max(num_tokens, 1)), self.min_token_bucket)

    def logit_rows(self, rows: int, tokens: int) -> int:
        """Verify-logits rows of a bucket: every row's 1 + K at most, and never over the memory bound."""
        return max(1, min(tokens, self.max_total_logit_rows, rows * (1 + self.k)))

    def _try_ensure(self, req: Request, length: int) -> bool:
        """Pages for ``length`` tokens of ``req`` if the pool has them (nothing is preempted); else False."""
        if not self.allocator.can_fit(req.index, length):
            return False
        self.allocator.ensure(req.index, length)
        return True

    # ------------------------------------------------------------------ results
    def commit(self, step: ScheduledStep, out: dict[str, np.ndarray]) -> list[tuple[Request, list[int]]]:
        """Fold one step's read-back output into the requests; returns ``(request, new tokens)`` per row that
        emitted, and finishes / frees requests that are done."""
        events = []
        k = self.k
        for i, req in enumerate(step.row_requests):
            if req is None:
                continue
            n_emit = int(out["num_emitted"][i])
            new = [int(x) for x in out["tokens"][i, :n_emit]]
            n_pre = int(step.arrays["prefill_len"][i])
            if n_pre:
                req.num_cached += n_pre
                if req.num_cached == len(req.prefill_target):
                    req.status = RequestStatus.RUNNING
                    self.stale_conf[req.slot] = 1.0
            else:
                acc = int(out["num_accepted"][i])
                ver = int(out["num_verified"][i])
                req.num_cached += 1 + acc
                req.target_steps += 1
                req.verified_drafts_per_step.append(ver)
                if k:
                    req.accepted_per_position[: min(acc, n_emit)] += 1
                    req.verified_per_position[:ver] += 1
                    self.stale_conf[req.slot] = out["confidences"][i, :k]
            req.output.extend(new)
            if new:
                events.append((req, new))
            if bool(out["finished"][i]):
                last = req.output[-1] if req.output else None
                req.finish_reason = "stop" if last in req.stop_ids else "length"
                req.status = RequestStatus.FINISHED
                self._release(req)
        return events
