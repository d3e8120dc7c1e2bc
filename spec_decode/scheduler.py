"""The host side of the engine: admission, prefix caching, chunked prefill, pages, preemption, bookkeeping.

The scheduler never touches device arrays: it turns the engine's requests into one host
:class:`~spec_decode.step.StepPlan` (numpy arrays) per step, with its :class:`~spec_decode.buckets.StepKey`, and
folds each step's small read-back :class:`~spec_decode.step.StepOutput` into per-request state.

**Upper bounds, so that a step can be planned before the previous one is read back** (async scheduling,
``docs/ENGINE.md``). The device holds the truth (anchors, lengths, emitted counts, finished flags); the host keeps
for every request what it has read back plus, for each of its steps still in flight, what that step may add at
most (``1 + scheduled`` cached tokens: every draft accepted) and at least (one emitted token). Pages are reserved
for the upper bound; a request whose lower bound has reached its limit is not scheduled again; a request that
finished in a step still in flight may be carried through one more step, where the device treats it as padding
and its tokens are discarded.

Policy, step by step:

1. **Decode rows** (requests whose prompt is in the cache) each get pages for their upper-bound length plus the
   anchor and the drafts they may verify. When the page pool runs out, the *newest* running request (latest
   admission) is **preempted**: its pages and slot are freed and it goes back to the front of the waiting queue;
   once its steps in flight are read back it is recomputed (prompt plus the tokens it already produced, prefilled
   again, largely from the prefix cache) and continues where it stopped. Sampling keys depend only on (seed,
   position), so greedy outputs are unchanged by preemption, and so are stochastic outputs under fixed
   verification (adaptive allocation depends on the batch by design).
2. **Prefill chunks**: requests being prefilled continue first, then waiting requests are admitted in order while a
   slot is free, pages are available and the step's prefill token budget (``max_num_batched_tokens``) lasts. An
   admitted request first takes the cached pages of its longest cached prompt prefix (:mod:`spec_decode.page_pool`)
   and prefills only the rest. Admitted work that does not fit waits; nothing crashes.
3. **Plan**: the :class:`~spec_decode.planner.Planner` chooses how many positions the step drafts (``K_d``) and
   how many drafts it verifies, from the confidences of an earlier step (lossless). A step that carries a
   prefill chunk while every request has a slot drafts nothing instead, unless a decode row is the one behind
   (``docs/ADAPTIVE_VERIFICATION.md``, "Closed batches").
4. **Shape**: rows are always the engine's slots; the packed tokens go to the smallest bucket of the closed set
   (:mod:`spec_decode.buckets`).
5. **Prefix caching**: every full page of a prefill chunk is registered in the pool once the step is built, so
   requests admitted in later steps can share it. The samples of a prompt with ``n > 1`` are admitted one step
   after the first of them (not in the same step), so they start from its cached pages instead of computing the
   prompt again.
6. **Token histories**: a request with a penalty is written into its slot's history when it is admitted (its
   prompt, and a recomputed request's output), before the step's program runs (``ScheduledStep.histories``,
   :mod:`spec_decode.penalties`).
7. **Stop strings** are matched as tokens are read back (:mod:`spec_decode.stop_strings`): a match finishes the
   request on the host (its later steps in flight are discarded).
8. **Multi-step launches** (:meth:`Scheduler.schedule_burst`): when every running request decodes and no waiting
   request could be admitted now, the engine may launch several decode steps at once, through the device loop's
   program (:mod:`spec_decode.device_loop`). The scheduler reserves pages for what those steps may write (``M``
   steps of ``1 + K`` tokens per row, capped by the request's limit) and folds their read-back into the requests
   as it does a step's (:meth:`Scheduler.commit_burst`).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from spec_decode.buckets import StepKey, logit_rows, token_bucket
from spec_decode.budget import FULL_DRAFT_AFTER, PYTHON_SCALARS, count_full_drafts, full_draft_due
from spec_decode.device_loop import add_row_stats
from spec_decode.logprobs import token_logprobs
from spec_decode.page_pool import OutOfPagesError, PagePool
from spec_decode.request import Request, RequestStatus
from spec_decode.step import StepOutput, StepPlan, fold_fresh_confidences

__all__ = ["Request", "RequestStatus", "ScheduledBurst", "ScheduledStep", "Scheduler"]

# the share of a request's observed tokens per decode step that the host expects its next steps to emit when it
# decides whether the launches in flight finish every request (Scheduler.expects_in_flight_to_finish)
EXPECTED_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """What one scheduled step may change for its request, until it is read back."""

    cached_max: int  # cache tokens it may add at most (decode rows: 1 + scheduled; prefill rows: 0, counted)
    emit_min: int  # tokens it emits at least (decode rows and a fresh prefill's last chunk: 1)
    decode_steps: int = 0  # decode steps it may run for the request (0: a prefill chunk)
    emit_max: int = 0  # tokens it emits at most (a step: 1 + its drafts; a multi-step launch: what the request lacks)


@dataclasses.dataclass
class ScheduledBurst:
    """Up to ``max_steps`` decode steps of ``requests`` (each in its slot), launched as one device-loop call."""

    requests: list[Request]
    max_steps: int
    end_on_finish: bool  # requests wait for a slot: end the launch once one of these requests finishes


@dataclasses.dataclass
class ScheduledStep:
    """One planned step: the host plan, its program key, and which request each row serves."""

    plan: StepPlan  # numpy arrays, sent to the device in one transfer
    key: StepKey
    row_requests: list[Request | None]
    num_tokens: int  # real packed tokens (prefill + anchors + verified drafts)
    num_decode: int
    num_prefill_tokens: int
    budget: int
    # (slot, prompt + output so far, prompt length) of each admitted request with a penalty: its slot's token
    # history, written before the step runs
    histories: list[tuple[int, list[int], int]] = dataclasses.field(default_factory=list)


class Scheduler:
    """Slots, the page pool and the waiting queue of one engine run (see the module docstring).

    ``pool`` is the engine's :class:`~spec_decode.page_pool.PagePool` (it outlives runs: its cached prefix pages
    stay valid in the engine's device cache); ``planner`` chooses each step's draft budget.
    """

    check_writes = False  # tests: assert every write of a step lands on pages its request owns alone

    def __init__(self, *, num_slots: int, pool: PagePool, planner, max_model_len: int, num_speculative_tokens: int,
                 max_num_batched_tokens: int, token_buckets: dict[int, tuple[int, ...]],
                 max_total_logit_rows: int, num_stop_ids: int, fresh_confidences=None, fresh_weight: float = 0.0,
                 undrafted_steps: int = 0, full_draft_after: int = FULL_DRAFT_AFTER):
        self.num_slots = num_slots
        self.pool = pool
        self.planner = planner
        self.page_size = pool.page_size
        self.max_model_len = max_model_len
        self.k = num_speculative_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.token_buckets = token_buckets  # {K_d: packed-token sizes of its programs}
        self.max_total_logit_rows = max_total_logit_rows
        self.max_blocks = pool.max_blocks
        self.num_stop_ids = num_stop_ids
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}  # slot -> request (prefill or decode)
        self.num_preemptions = 0
        self.prefill_tokens_computed = 0
        self.prefix_tokens_reused = 0
        self.stale_conf = np.ones((num_slots, max(self.k, 1)), np.float32)
        # what a slot starts at once its prefill is done: the decayed mean of recent decode rows' confidences, the
        # host's mirror of the device's DecodeState.fresh_confidences / fresh_weight (a call starts from those)
        self.fresh_conf = np.ones(max(self.k, 1), np.float32)
        if fresh_confidences is not None:
            self.fresh_conf[:] = np.asarray(fresh_confidences, np.float32)
        self.fresh_weight = np.float32(fresh_weight)
        # steps with decode rows since one drafted all K positions, and how many the plans allow: the host's
        # mirror of the device's DecodeState.undrafted_steps / full_draft_after, counted from the plans
        # (spec_decode.budget.count_full_drafts)
        self.undrafted_steps, self.full_draft_after = int(undrafted_steps), int(full_draft_after)
        self._inflight: dict[int, collections.deque[_InFlight]] = {}  # request index -> its steps in flight
        self._bounds: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        k = max(self.k, 1)
        request.accepted_per_position = [0] * k
        request.verified_per_position = [0] * k
        request.predicted_per_position = [0.0] * k
        self._inflight[request.index] = collections.deque()
        self._bounds[request.index] = [0, 0]  # sums over its steps in flight: cached_max, emit_min
        if request.params.logprobs is not None:
            request.logprobs = []
        if request.params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(request.prompt)  # the first token has none
        self.waiting.append(request)

    @staticmethod
    def _scores_prompt(req: Request) -> bool:
        """The request's prefill computes prompt log-probabilities (a resumed one has them already)."""
        return req.params.prompt_logprobs is not None and not req.is_resumed

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release_all(self) -> None:
        """Free every page and slot this run holds (an interrupted run)."""
        for req in list(self.running.values()):
            self._release(req)
        self.waiting.clear()

    def _release(self, req: Request) -> None:
        self.pool.free(req.index)
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
                self.pool.ensure(req.index, length)
                return True
            except OutOfPagesError:
                victim = self._newest_running()
                if victim is None:
                    raise
                self._preempt(victim)
                if victim is req:
                    return False

    # ------------------------------------------------------------------ bounds
    def _cached_upper(self, req: Request) -> int:
        return req.num_cached + self._bounds[req.index][0]

    def _emitted_lower(self, req: Request) -> int:
        return len(req.output) + self._bounds[req.index][1]

    def _push(self, req: Request, flight: _InFlight) -> None:
        self._inflight[req.index].append(flight)
        b = self._bounds[req.index]
        b[0] += flight.cached_max
        b[1] += flight.emit_min

    def _pop(self, req: Request) -> None:
        flight = self._inflight[req.index].popleft()
        b = self._bounds[req.index]
        b[0] -= flight.cached_max
        b[1] -= flight.emit_min

    @staticmethod
    def _expected_per_step(req: Request, default: float = 1.0) -> float:
        """Tokens a decode step of ``req`` is expected to emit: :data:`EXPECTED_SHARE` of what its decode steps
        emitted so far on average (``default`` before its first one)."""
        steps = req.target_steps
        return EXPECTED_SHARE * (len(req.output) - 1) / steps if steps and req.output else default

    def expects_in_flight_to_finish(self) -> bool:
        """Whether the steps in flight are expected to finish every running request, with nothing waiting that
        could be admitted now. The host then waits for their read-back instead of planning the next launch on
        the lower bounds (one token a decode step): with speculation a step emits more, and that launch would
        most likely run on finished requests only. A wrong guess costs one launch's latency, never a token."""
        if not self.running or (self.waiting and self.free_slots):
            return False
        # a request with no decode step read back yet (its prefill just ended) is expected to do as the others
        # have done on average: they draft from the same drafter (1 a step when none has decoded yet)
        seen = [self._expected_per_step(r) for r in self.running.values() if r.target_steps and r.output]
        default = max(1.0, sum(seen) / len(seen)) if seen else 1.0
        for r in self.running.values():
            flights = self._inflight[r.index]
            if not flights:
                return False
            rate = self._expected_per_step(r, default)  # the current estimate, not the one when they were planned
            expected = sum(max(f.emit_min, min(f.emit_max, f.decode_steps * rate)) for f in flights)
            if len(r.output) + expected < r.limit:
                return False
        return True

    # ------------------------------------------------------------------ planning
    def schedule(self, *, prefill_only: bool = False) -> ScheduledStep | None:
        """Plan the next step (None when nothing can run now: everything left waits on steps in flight, or on
        pages). ``prefill_only``: admit and prefill, schedule no decode rows (the device loop decodes)."""
        k = self.k
        # 1. decode rows, oldest first; pages for the upper-bound length + anchor + scheduled drafts
        decode: list[tuple[Request, int]] = []
        for req in sorted(self.running.values(), key=lambda r: r.arrival):
            if prefill_only or req.status is not RequestStatus.RUNNING or req.slot is None:
                continue
            remaining = req.limit - self._emitted_lower(req)  # an upper bound of what it may still emit
            if remaining <= 0:
                continue  # finished, or finishes in a step in flight
            sched = max(0, min(k, remaining - 1))
            if not self._ensure(req, self._cached_upper(req) + 1 + sched):
                continue
            decode.append((req, sched))
        decode = [(r, s) for r, s in decode if r.slot is not None and r.status is RequestStatus.RUNNING]

        # 2. prefill chunks: continuing prefills first, then admissions (prefix cache first)
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
        histories = []
        prefilling = {r.prompt_index for r in self.running.values() if r.status is RequestStatus.PREFILL}
        while self.waiting and room > 0 and self.free_slots:
            req = self.waiting[0]
            if self._inflight[req.index]:
                break  # preempted while a step of it was in flight: its output is not known yet
            if req.params.n > 1 and req.prompt_index in prefilling and not req.is_resumed:
                break  # a sibling sample prefills its prompt now: start from its pages next step
            target = req.prompt + req.output[:-1]  # a resumed request recomputes its output but the anchor
            # prompt log-probabilities need every prompt position computed: no prefix reuse
            cached = 0 if self._scores_prompt(req) else self.pool.admit(req.index, target)
            n = min(room, len(target) - cached)
            if not self._try_ensure(req, cached + n):
                self.pool.free(req.index)
                break  # admitted work waits for pages
            self.waiting.popleft()
            req.prefill_target = target
            req.slot = self.free_slots.pop()
            req.status = RequestStatus.PREFILL
            req.num_cached = cached
            self.prefix_tokens_reused += cached
            self.running[req.slot] = req
            prefilling.add(req.prompt_index)
            if req.params.penalized:
                histories.append((req.slot, req.prompt + req.output, len(req.prompt)))
            prefill.append((req, n))
            room -= n
        if not decode and not prefill:
            return None
        # prompt log-probabilities take one verify-logits row per scored position: such chunks are cut to fit
        logit_cap = min(self.max_total_logit_rows, self.num_slots * (1 + k))  # the longest draft length's rows
        scores = [self._scores_prompt(req) for req, _ in prefill]
        if any(scores):
            prefill = self._fit_prompt_rows(prefill, scores, len(decode), logit_cap)

        # 3. the draft length and the budget, from the confidences of an earlier step
        n_pre = sum(n for _, n in prefill)
        ends = [req.num_cached + n == len(req.prefill_target) for req, n in prefill]
        fresh_first = [end and not req.is_resumed for (req, _), end in zip(prefill, ends)]
        # logit rows of the prefill rows: the first token's, or every scored position's (the last one included)
        prefill_rows = sum(n if sc else int(ff) for (_, n), sc, ff in zip(prefill, scores, fresh_first))
        scheduled = np.asarray([s for _, s in decode], np.int64)
        # no decode rows: no drafts to verify, so the length whose program does the least for the chunks, counting
        # the drafter's K_d positions of every slot beside the packed tokens (length 0 drafts nothing; the longest
        # has every bucket)
        budget = 0
        draft_len = min((token_bucket(b, n_pre) + self.num_slots * d, d) for d, b in self.token_buckets.items()
                        if b[-1] >= n_pre)[1]
        if k and decode and prefill and self._prefill_sets_the_end(decode, n_pre):
            # every request has a slot and the last ones are still prefilling: their decode, after this chunk,
            # sets when the call ends, and the rows decoding now are ahead of them, so the step drafts nothing
            # and costs what plain decoding's does (docs/ADAPTIVE_VERIFICATION.md, "Closed batches")
            budget, draft_len = 0, 0
            decode = [(r, 0) for r, _ in decode]
        elif k and decode:
            stale = self.stale_conf[[r.slot for r, _ in decode]][:, :k]
            budget, draft_len = self.planner.plan(stale, scheduled, num_sampling_rows=len(decode) + prefill_rows,
                                                  num_non_draft_tokens=n_pre + len(decode),
                                                  draft_full=full_draft_due(self.undrafted_steps,
                                                                            self.full_draft_after))
            decode = [(r, min(s, draft_len)) for r, s in decode]
            budget = max(0, min(int(budget), sum(s for _, s in decode)))
        if any(scores):  # the longest draft length's programs have the rows (logit_cap) and every token bucket
            draft_len = max(self.token_buckets)
            budget = max(0, min(budget, logit_cap - len(decode) - prefill_rows))
        if k and decode:  # as the step counts it on the device
            self.undrafted_steps, self.full_draft_after = count_full_drafts(
                self.undrafted_steps, self.full_draft_after, decoded=True, full=draft_len == k, xp=PYTHON_SCALARS)
        num_tokens = n_pre + len(decode) + budget
        t = token_bucket(self.token_buckets[draft_len], num_tokens)
        # log-probabilities are computed by the sampling programs (they serve greedy rows too)
        sampling = any(req.params.needs_sampling_program or req.params.wants_logprobs for req, _ in prefill + decode)
        key = StepKey(t, logit_rows(t, rows=self.num_slots, num_speculative_tokens=draft_len,
                                    max_total_logit_rows=self.max_total_logit_rows), sampling, draft_len)

        # 4. the plan arrays: prefill rows first, then decode rows, then padding rows
        row_reqs: list[Request | None] = [r for r, _ in prefill] + [r for r, _ in decode]
        row_reqs += [None] * (self.num_slots - len(row_reqs))
        plan = self._plan_arrays(row_reqs, prefill, ends, decode, budget, t, scores)
        step = ScheduledStep(plan, key, row_reqs, num_tokens, len(decode), n_pre, budget, histories)
        if self.check_writes:
            self._check_writes(prefill, decode)

        # 5. bookkeeping: prefill progress is exact; decode rows add upper / lower bounds until read back
        for (req, n), end, first in zip(prefill, ends, fresh_first):
            req.num_cached += n
            self.prefill_tokens_computed += n
            self.pool.register(req.index, req.prefill_target, req.num_cached)
            if end:
                req.status = RequestStatus.RUNNING
                # the device starts the slot at fresh_confidences; a decode step planned before this one is read
                # back plans from the host's latest mirror of them, not from the slot's previous request's
                self.stale_conf[req.slot] = self.fresh_conf
            self._push(req, _InFlight(0, 1 if first else 0))
        for req, s in decode:
            self._push(req, _InFlight(1 + s, 1, decode_steps=1, emit_max=1 + s))
        return step

    def _prefill_sets_the_end(self, decode: list[tuple[Request, int]], num_prefill_tokens: int) -> bool:
        """Whether a step that carries prefill chunks beside ``decode`` should draft nothing: an adaptive plan
        with a length-0 program for it, no request waiting for a slot to free (those left waiting fit the free
        slots), and no decode row with more tokens left to emit (at most) than a request still prefilling or
        waiting has. The call then ends when those finish, whatever the rows ahead emit now."""
        lengths = self.token_buckets.get(0)
        if (self.planner.mode != "adaptive" or 0 not in self.planner.draft_lengths or not lengths
                or lengths[-1] < num_prefill_tokens + len(decode) or len(self.waiting) > len(self.free_slots)):
            return False
        behind = [r.limit - len(r.output) for r in self.running.values() if r.status is RequestStatus.PREFILL]
        behind += [r.limit - len(r.output) for r in self.waiting]
        return bool(behind) and all(r.limit - self._emitted_lower(r) <= max(behind) for r, _ in decode)

    def schedule_burst(self, max_steps: int, *, min_rows: int = 1) -> ScheduledBurst | None:
        """Plan ``max_steps`` decode steps of every running request as one launch, or None when one step at a
        time is what fits: a request is being prefilled, a waiting request could be admitted now (a slot and its
        pages are free), a request wants log-probabilities (the device loop returns none), fewer than
        ``min_rows`` requests would decode, or the pool lacks the pages the steps may write (nothing is preempted
        for a multi-step launch; the single steps preempt as they must)."""
        running = list(self.running.values())
        if any(r.status is not RequestStatus.RUNNING for r in running):
            return None
        if self.waiting and self.free_slots:
            req = self.waiting[0]
            if not self._inflight[req.index] and self.pool.can_fit(req.index, 1):
                return None  # it could be admitted: a single step admits it
        decode = [r for r in sorted(running, key=lambda r: r.arrival) if r.limit - self._emitted_lower(r) > 0]
        if len(decode) < max(min_rows, 1) or any(r.params.wants_logprobs for r in decode):
            return None
        lengths = [self._burst_length(r, max_steps) for r in decode]
        pool = self.pool
        need = sum(max(0, pool.blocks_for(n) - len(pool.pages.get(r.index, []))) for r, n in zip(decode, lengths))
        if need > pool.num_free or any(pool.blocks_for(n) > pool.max_blocks for n in lengths):
            return None
        end_on_finish = bool(self.waiting)
        for r, n in zip(decode, lengths):
            self.pool.ensure(r.index, n)
            if self.check_writes:
                self.pool.check_writable(r.index, r.num_cached, n)
            # every iteration emits a token for each row not finished, and the launch runs all its iterations
            # unless every row finishes, so a request that does not finish emits at least one token a step (the
            # host then plans no launch after this one for a request this one takes to its limit); with
            # end_on_finish it may run no iteration at all (a row finished before it started): at least nothing
            # (a launch that may end on any row's finish is expected to emit nothing: 0 decode steps)
            remaining = r.limit - self._emitted_lower(r)
            self._push(r, _InFlight(n - self._cached_upper(r), 0 if end_on_finish else min(max_steps, remaining),
                                    decode_steps=0 if end_on_finish else max_steps, emit_max=remaining))
        return ScheduledBurst(decode, max_steps, end_on_finish=end_on_finish)

    def _burst_length(self, req: Request, max_steps: int) -> int:
        """The cache length ``max_steps`` decode steps of ``req`` may reach: ``1 + K`` positions a step, at most
        its last position (prompt + limit - 2: the last token emitted is never written)."""
        cap = min(len(req.prompt) + req.limit - 1, self.max_blocks * self.page_size)
        return max(self._cached_upper(req), min(self._cached_upper(req) + max_steps * (1 + self.k), cap))

    def _fit_prompt_rows(self, prefill, scores, num_decode: int, logit_cap: int):
        """Cut the chunks that score their prompt so that the step's verify-logits rows fit ``logit_cap``: the
        decode rows' anchors and the other prefill rows' first tokens come first; each scoring chunk keeps at
        least one token (the rows never exceed the slots, and ``logit_cap >= max_num_seqs``)."""
        fixed = num_decode + sum(1 for (req, n), sc in zip(prefill, scores)
                                 if not sc and req.num_cached + n == len(req.prefill_target) and not req.is_resumed)
        avail = logit_cap - fixed
        left = sum(scores)
        out = []
        for (req, n), sc in zip(prefill, scores):
            if sc:
                left -= 1
                n = max(1, min(n, avail - left))
                avail -= n
            out.append((req, n))
        return out

    def _plan_arrays(self, row_reqs, prefill, ends, decode, budget: int, t: int, scores) -> StepPlan:
        r, m = self.num_slots, self.num_stop_ids
        live = [req for req in row_reqs if req is not None]
        pad = r - len(live)

        def per_row(values, fill, dtype):
            return np.asarray(list(values) + [fill] * pad, dtype)

        params = [req.params for req in live]
        n_pre = len(prefill)
        prefill_tokens = np.zeros(t, np.int32)
        off = 0
        for req, n in prefill:
            prefill_tokens[off: off + n] = req.prefill_target[req.num_cached: req.num_cached + n]
            off += n
        pre = [(n, req.num_cached, end, len(req.output) if req.is_resumed else 0,
                req.output[-1] if end and req.is_resumed else -1) for (req, n), end in zip(prefill, ends)]
        pre += [(0, 0, False, 0, -1)] * (r - n_pre)
        n_len, n_start, n_last, n_emitted, n_resume = zip(*pre)
        # prompt rows: the chunks that score their prompt, and the prompt token after each (its last row's target)
        score_rows = np.zeros(r, np.int32)
        next_token = np.zeros(r, np.int32)
        for i, ((req, n), sc) in enumerate(zip(prefill, scores)):
            if sc:
                score_rows[i] = 1
                after = req.num_cached + n
                next_token[i] = req.prefill_target[after] if after < len(req.prefill_target) else 0
        stop_ids = np.full((r, m), -1, np.int32)
        for i, req in enumerate(live):
            if req.stop_ids:
                stop_ids[i, : len(req.stop_ids)] = req.stop_ids
        block_tables = np.zeros((r, self.max_blocks), np.int32)
        block_tables[: len(live)] = self.pool.block_table([req.index for req in live])
        return StepPlan(rows=per_row((req.slot for req in live), -1, np.int32), prefill_tokens=prefill_tokens,
                        prefill_len=np.asarray(n_len, np.int32), prefill_start=np.asarray(n_start, np.int32),
                        prefill_last=np.asarray(n_last, bool), resume_token=np.asarray(n_resume, np.int32),
                        block_tables=block_tables,
                        scheduled=np.asarray([0] * n_pre + [s for _, s in decode] + [0] * pad, np.int32),
                        budget=np.asarray(budget, np.int32),
                        temperature=per_row((p.temperature for p in params), 0.0, np.float32),
                        top_k=per_row((p.top_k for p in params), 0, np.int32),
                        top_p=per_row((p.top_p for p in params), 1.0, np.float32),
                        seed=per_row((p.seed for p in params), 0, np.int32),
                        limit=per_row((req.limit for req in live), 0, np.int32),
                        prefill_emitted=np.asarray(n_emitted, np.int32), stop_ids=stop_ids,
                        commit=np.asarray(True), closed=np.asarray(not self.waiting),
                        prompt_logprobs=score_rows, next_prompt_token=next_token,
                        min_tokens=per_row((p.min_tokens for p in params), 0, np.int32),
                        min_p=per_row((p.min_p for p in params), 0.0, np.float32),
                        repetition_penalty=per_row((p.repetition_penalty for p in params), 1.0, np.float32),
                        presence_penalty=per_row((p.presence_penalty for p in params), 0.0, np.float32),
                        frequency_penalty=per_row((p.frequency_penalty for p in params), 0.0, np.float32))

    def _check_writes(self, prefill, decode) -> None:
        for req, n in prefill:
            self.pool.check_writable(req.index, req.num_cached, req.num_cached + n)
        for req, s in decode:
            self.pool.check_writable(req.index, req.num_cached, self._cached_upper(req) + 1 + s)

    def _try_ensure(self, req: Request, length: int) -> bool:
        """Pages for ``length`` tokens of ``req`` if the pool has them (nothing is preempted); else False."""
        if not self.pool.can_fit(req.index, length):
            return False
        self.pool.ensure(req.index, length)
        return True

    def reserve_decode_pages(self, req: Request) -> None:
        """Pages for every position decoding ``req`` to its limit can write (the device loop reserves up front):
        the prompt, then anchors and drafts up to ``prompt + limit - 2``."""
        self.pool.ensure(req.index, min(len(req.prompt) + req.limit - 1, self.max_blocks * self.page_size))

    def finish_wave(self, requests) -> None:
        """The device loop decoded ``requests`` to the end: free their slots and pages."""
        for req in requests:
            self._release(req)
            req.status = RequestStatus.FINISHED
            self._inflight[req.index].clear()
            self._bounds[req.index] = [0, 0]

    # ------------------------------------------------------------------ results
    @staticmethod
    def _commit_logprobs(step: ScheduledStep, out: StepOutput) -> None:
        """Fold the step's log-probabilities into the requests that asked: the emitted tokens' (in the order
        :meth:`commit` appends them) and the scored prompt positions' (by position: a recomputed chunk rewrites
        the same values)."""
        lp, plan = out.logprobs, step.plan
        scored = np.asarray(plan.prompt_logprobs if plan.prompt_logprobs is not None else np.zeros(len(plan.rows)))
        n_prompt = np.where(scored != 0, plan.prefill_len - plan.prefill_last.astype(np.int64), 0)
        starts = np.concatenate([[0], np.cumsum(n_prompt)])
        for i, req in enumerate(step.row_requests):
            if req is None or req.status is RequestStatus.FINISHED:
                continue
            k = req.params.logprobs
            if k is not None:
                for j in range(int(out.num_emitted[i])):
                    req.logprobs.append(token_logprobs(out.tokens[i, j], lp.token_logprobs[i, j],
                                                       lp.token_top_ids[i, j], lp.token_top_logprobs[i, j], k))
            if n_prompt[i] and req.prompt_logprobs is not None:
                k = req.params.prompt_logprobs
                start = int(plan.prefill_start[i])
                for o in range(int(n_prompt[i])):
                    row, pos = starts[i] + o, start + o + 1  # the row at position p scores token p + 1
                    req.prompt_logprobs[pos] = token_logprobs(req.prompt[pos], lp.prompt_logprobs[row],
                                                              lp.prompt_top_ids[row], lp.prompt_top_logprobs[row], k)

    def commit(self, step: ScheduledStep, out: StepOutput) -> list[tuple[Request, list[int]]]:
        """Fold one step's read-back output into the requests; returns ``(request, new tokens)`` per row that
        emitted, and finishes / frees requests that are done."""
        events = []
        k = self.k
        plan = step.plan
        rows, pre_len, pre_last = plan.rows.tolist(), plan.prefill_len.tolist(), plan.prefill_last.tolist()
        emitted, accepted = out.num_emitted.tolist(), out.num_accepted.tolist()
        verified, finished = out.num_verified.tolist(), out.finished.tolist()
        tokens = out.tokens.tolist()
        if out.logprobs is not None:
            self._commit_logprobs(step, out)
        conf_rows, conf_slots, prefilled_slots = [], [], []
        predicted: list[tuple[Request, int, int]] = []  # (request, row, verified drafts)
        for i, req in enumerate(step.row_requests):
            if req is None:
                continue
            self._pop(req)
            if req.status is RequestStatus.FINISHED:
                continue  # it finished in an earlier step: the device ran this row as padding
            holds_slot = req.slot == rows[i] and req.status is not RequestStatus.WAITING
            n_emit = emitted[i]
            new = tokens[i][:n_emit]
            if pre_len[i]:
                if pre_last[i] and holds_slot:
                    prefilled_slots.append(req.slot)
            elif n_emit:
                acc, ver = accepted[i], verified[i]
                req.target_steps += 1
                req.verified_drafts_per_step.append(ver)
                if k:
                    a, v = req.accepted_per_position, req.verified_per_position
                    for j in range(min(acc, n_emit)):
                        a[j] += 1
                    for j in range(ver):
                        v[j] += 1
                    if ver:
                        predicted.append((req, i, ver))
                if holds_slot:
                    req.num_cached += 1 + acc
                    if k:
                        conf_rows.append(i)
                        conf_slots.append(req.slot)
            self._emit(req, new, bool(finished[i]), events)
        if conf_rows:
            conf = out.confidences[conf_rows, :k]
            self.stale_conf[conf_slots] = conf
            fresh, weight = fold_fresh_confidences(self.fresh_conf, self.fresh_weight, conf.sum(0, dtype=np.float32),
                                                   np.float32(len(conf_rows)), xp=np)
            self.fresh_conf, self.fresh_weight = fresh.astype(np.float32), np.float32(weight)
        if prefilled_slots:
            self.stale_conf[prefilled_slots] = self.fresh_conf
        if predicted:  # the survival the allocator ranked by: its prediction that the first j+1 are accepted
            survival = np.cumprod(np.clip(out.confidences[[i for _, i, _ in predicted], :k], 0.0, 1.0),
                                  axis=1).tolist()
            for (req, _, ver), surv in zip(predicted, survival):
                p = req.predicted_per_position
                for j in range(ver):
                    p[j] += surv[j]
        return events

    def commit_burst(self, burst: ScheduledBurst, out) -> list[tuple[Request, list[int]]]:
        """Fold a multi-step launch's read-back (a :class:`~spec_decode.device_loop.LoopOutputs`, numpy) into its
        requests, as :meth:`commit` does a step's: ``(request, new tokens)`` per request that emitted; finished
        requests are freed."""
        events = []
        k = self.k
        for req in burst.requests:
            self._pop(req)
            if req.status is RequestStatus.FINISHED:
                continue  # finished (a stop string) in an earlier launch: the device decoded it on, discarded
            s = req.slot
            n = int(out.num_tokens[s])
            new = [int(x) for x in out.tokens[s, :n]]
            add_row_stats(req, out, k)
            req.num_cached += n  # every decode step caches its anchor and accepted drafts: what it emits
            if k:
                self.stale_conf[s] = out.confidences[s, :k]
            self._emit(req, new, bool(out.finished[s]), events)
        if k:  # the launch folded each of its steps on the device: the mirror takes the result
            self.fresh_conf = np.asarray(out.fresh_confidences, np.float32)
            self.fresh_weight = np.float32(out.fresh_weight)
            self.undrafted_steps, self.full_draft_after = int(out.undrafted_steps), int(out.full_draft_after)
        return events

    def _emit(self, req: Request, new: list[int], finished: bool, events: list) -> None:
        """Append a row's emitted tokens to its request (cut after a completed stop string), add the
        ``(request, tokens)`` event, and finish the request when the device said so or a stop string ended it:
        its reason set, its slot and pages released (a request still waiting leaves the queue instead)."""
        stopped = False
        if new:
            req.output.extend(new)
            if req.stop_strings is not None:
                keep = req.stop_strings.feed(req.output)
                if keep is not None:  # a stop string completed: the tokens after it are dropped
                    del new[len(new) - (len(req.output) - keep):]
                    del req.output[keep:]
                    stopped = True
            if new:
                events.append((req, new))
        if finished or stopped:
            last = req.output[-1] if req.output else None
            req.finish_reason = "stop" if stopped or last in req.stop_ids else "length"
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
            else:
                self._release(req)
            req.status = RequestStatus.FINISHED
