"""The speculative generation engine: continuous batching over one jitted step per shape bucket.

``Engine(target, drafter).generate(prompts)`` runs DSpark speculative decoding with adaptive verification:

* the device part of a step is :func:`spec_decode.step.make_step_fn` (draft -> allocate -> pack -> verify ->
  rejection sampling -> stop -> commit -> drafter context -> estimator), compiled once per bucket
  ``(rows, packed tokens, logit rows, sampling, filtering)`` and cached; the state is donated;
* the host part is :class:`spec_decode.scheduler.Scheduler` (admission, chunked prefill, pages, buckets,
  preemption) plus the budget planner :func:`spec_decode.budget.choose_budget`, which reads the confidences of
  the *previous* step (one read-back per step: emitted tokens, counts and those confidences);
* ``verification="adaptive"`` verifies the budget's worth of drafts with the best survival, ``"fixed"`` verifies
  ``K`` per request, ``"none"`` decodes one token per step through the same paged path (no drafter).

Bad input (empty or over-long prompts, ids outside the vocabulary, unknown modes, K out of range, a drafter built
for another target, bad sampling settings) raises ``ValueError`` naming the problem before any device work.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.cache import cache_bytes_per_page, page_size_for
from minimax_jax.decode import choose_implementation
from minimax_jax.draft_cache import draft_cache_bytes_per_page
from spec_decode.budget import choose_budget
from spec_decode.cost_table import CostTable, time_callable
from spec_decode.request import build_requests
from spec_decode.scheduler import Request, ScheduledStep, Scheduler, next_pow2
from spec_decode.step import MODES, DecodeState, StepConfig, StepPlan, init_state, make_step_fn

__all__ = ["Engine", "GenerationResult", "GenerationResults"]


@dataclasses.dataclass
class GenerationResult:
    """One request's output: ``token_ids`` (the prompt excluded), ``text`` (when a tokenizer is known) and stats.

    ``stats`` keys: ``emitted_tokens`` (= ``len(token_ids)``, the token sampled at prefill included),
    ``target_steps`` (verify steps, prefill excluded), ``acceptance_length`` (tokens emitted per verify step,
    bonus included), ``accepted_per_position`` (K counts), ``verified_drafts_per_step`` (list),
    ``finish_reason`` (``"stop"`` or ``"length"``), ``prompt_tokens``, ``preemptions``.
    """

    token_ids: list[int]
    text: str | None
    stats: dict
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        return self.stats["finish_reason"]


class GenerationResults(list):
    """``list[GenerationResult]`` in prompt order, with the run-level statistics in ``.stats``."""

    stats: dict

    def __init__(self, results, stats):
        super().__init__(results)
        self.stats = stats


class Engine:
    """DSpark speculative decoding with adaptive verification over a paged MiniMax-M3 target.

    Args:
      target: a :class:`minimax_jax.MiniMaxM3ForCausalLM`.
      drafter: its :class:`minimax_jax.DSparkDrafter` (sharing the target's embeddings and LM head); may be None
        with ``verification="none"``.
      num_speculative_tokens: K, drafts per request and step (1..the drafter's block size; 0 with ``"none"``).
      verification: ``"adaptive"`` (the confidence head, or the online estimator for a drafter without one),
        ``"fixed"`` (every request verifies its K drafts) or ``"none"`` (plain decoding, one token per step).
      max_num_seqs: slots: requests decoded concurrently (more prompts than slots are admitted as slots free).
      max_model_len: longest sequence (prompt + output); default the target's ``max_position_embeddings``
        capped at 4096.
      num_pages / memory_fraction: the KV page pool (the target's K/V and the drafter's context K/V share it:
        one page id holds both): an explicit page count, or a fraction of the accelerator's free memory;
        default: enough pages for every slot at ``max_model_len`` (no preemption).
      max_num_batched_tokens: prefill tokens per step (chunked prefill).
      max_total_logit_rows: bound on the verify-logits rows per step (``rows x V`` float32); the planner and
        the fixed mode respect it at any concurrency (fixed K verifies fewer drafts, evenly, when it binds).
      cost_table: what adaptive verification trades acceptance against: ``"profile"`` (default: each row bucket's
        step is timed at every packed-token bucket it can reach, the first time it is reached), a ``{rows:
        CostTable}`` mapping, one :class:`CostTable` for every row bucket, or ``None`` (flat: verify everything).
      tokenizer: encodes string prompts and decodes outputs (``encode(str) -> list[int]``, ``decode(ids)``).
      implementation / interpret: the kernels (``decode.choose_implementation``).
      min_token_bucket: the smallest packed-token bucket (fewer compiled programs; padding slots cost little).
      device_loop_token_buckets: verify sizes compiled into the device loop (``loop="device"``): the largest
        (every row's 1 + K) and the next smaller powers of two; each is one branch of the loop's program.
    """

    def __init__(self, target, drafter=None, *, num_speculative_tokens: int = 7, verification: str = "adaptive",
                 max_num_seqs: int = 16, max_model_len: int | None = None, num_pages: int | None = None,
                 memory_fraction: float | None = None, max_num_batched_tokens: int = 512,
                 max_total_logit_rows: int | None = None, cost_table="profile", tokenizer=None,
                 implementation: str = "auto", interpret: bool | None = None, cache_dtype=None,
                 min_token_bucket: int = 8, device_loop_token_buckets: int = 4):
        cfg = target.cfg
        if verification not in MODES:
            raise ValueError(f"verification must be one of {MODES}, got {verification!r}")
        k = int(num_speculative_tokens)
        if verification == "none":
            k = 0
        else:
            if drafter is None:
                raise ValueError(f"verification={verification!r} needs a drafter (or use verification='none')")
            _check_drafter_fits(drafter, target)
            if not 1 <= k <= drafter.block_size:
                raise ValueError(f"num_speculative_tokens must be in [1, {drafter.block_size}] (the drafter's "
                                 f"block size), got {num_speculative_tokens}")
        for name, v, lo in (("max_num_seqs", max_num_seqs, 1), ("max_num_batched_tokens", max_num_batched_tokens, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        max_model_len = min(cfg.max_position_embeddings, 4096) if max_model_len is None else int(max_model_len)
        if not 2 <= max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {cfg.max_position_embeddings}] (the model's "
                             f"max_position_embeddings), got {max_model_len}")
        self.target, self.drafter = target, (drafter if k > 0 else None)
        self.tokenizer = tokenizer
        self.mode, self.k = verification, k
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size_for(cfg)
        self.max_total_logit_rows = (max(max_num_seqs * (1 + k), max_num_seqs + max_num_batched_tokens)
                                     if max_total_logit_rows is None else int(max_total_logit_rows))
        if self.max_total_logit_rows < max_num_seqs:
            raise ValueError(f"max_total_logit_rows ({self.max_total_logit_rows}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every request samples one token per step")
        if verification == "fixed" and max_num_seqs * (1 + k) > self.max_total_logit_rows:
            warnings.warn(f"fixed verification: a step with more than {self.max_total_logit_rows // (1 + k)} "
                          f"requests verifies fewer than K={k} drafts each (spread evenly) to stay within "
                          f"max_total_logit_rows={self.max_total_logit_rows}", stacklevel=2)
        self.confidence = "head"
        if k > 0 and not drafter.has_confidence_head:
            self.confidence = "estimator"
            if verification == "adaptive":
                warnings.warn("the drafter has no confidence head (or its checkpoint lacks the weights): adaptive "
                              "verification runs on the online acceptance estimator", stacklevel=2)
        self.implementation = choose_implementation(implementation, cfg, page_size=self.page_size,
                                                    dtype=target.dtype if cache_dtype is None else cache_dtype,
                                                    interpret=interpret)
        self.interpret = interpret
        self.cache_dtype = target.dtype if cache_dtype is None else cache_dtype
        self.num_pages = self._pool_size(num_pages, memory_fraction)
        self._page_limit = None if num_pages is None and memory_fraction is None else self.num_pages
        self._logit_rows_given = max_total_logit_rows is not None
        if not isinstance(device_loop_token_buckets, int) or device_loop_token_buckets < 1:
            raise ValueError(f"device_loop_token_buckets must be an integer >= 1, got {device_loop_token_buckets!r}")
        self.device_loop_token_buckets = device_loop_token_buckets
        self._given_table: CostTable | None = cost_table if isinstance(cost_table, CostTable) else None
        self._loops: dict = {}  # LoopConfig -> compiled device-loop program
        self._loop_tables: dict = {}  # LoopConfig -> profiled CostTable
        self._cost_tables: dict[int, CostTable] = {}
        self._profile_costs = False
        if verification == "adaptive":
            self._set_cost_table(cost_table)
        self.num_stop_ids = 8
        self.min_token_bucket = next_pow2(max(int(min_token_bucket), 1))
        self._target_params = nnx.state(target)
        self._drafter_params = nnx.state(self.drafter) if self.drafter is not None else None
        self._state: DecodeState | None = None
        self._compiled: dict[tuple, object] = {}
        self._step_fns: dict[tuple, object] = {}
        self.num_compiles = 0
        self._warned_no_eos = False

    # ------------------------------------------------------------------ set-up helpers
    def _pool_size(self, num_pages, memory_fraction) -> int:
        per_request = -(-self.max_model_len // self.page_size)
        if num_pages is not None and memory_fraction is not None:
            raise ValueError("give num_pages or memory_fraction, not both")
        if num_pages is not None:
            if not isinstance(num_pages, int) or num_pages < 1:
                raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
            return num_pages
        if memory_fraction is not None:
            if not 0 < memory_fraction <= 1:
                raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_limit" not in stats:
                raise ValueError("memory_fraction needs a device that reports its memory (a GPU); pass num_pages")
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            pages = int(free * memory_fraction) // self._bytes_per_page()
            if pages < per_request:
                raise ValueError(f"memory_fraction={memory_fraction} gives {pages} pages, fewer than one request "
                                 f"of max_model_len={self.max_model_len} needs ({per_request})")
            return pages
        return self.max_num_seqs * per_request

    def _bytes_per_page(self) -> int:
        """Device bytes of one page of the pool: the target's K/V (and index keys) plus, when drafting, the draft
        cache's K/V on the same page id (the draft cache shares the target's pool)."""
        per_page = cache_bytes_per_page(self.target.cfg, self.cache_dtype)
        if self.drafter is not None:
            per_page += draft_cache_bytes_per_page(self.drafter.cfg, self.page_size, self.cache_dtype)
        return per_page

    def _set_cost_table(self, cost_table) -> None:
        if cost_table is None or cost_table == "flat":
            return
        if isinstance(cost_table, str):
            if cost_table != "profile":
                raise ValueError(f"cost_table must be 'profile', None, a CostTable or {{rows: CostTable}}, got "
                                 f"{cost_table!r}")
            self._profile_costs = True
        elif isinstance(cost_table, CostTable):
            self._cost_tables = {rb: cost_table for rb in _row_buckets(self.max_num_seqs)}
        elif isinstance(cost_table, dict):
            for rb, table in cost_table.items():
                if not isinstance(table, CostTable):
                    raise ValueError(f"cost_table[{rb}] must be a CostTable, got {type(table).__name__}")
            self._cost_tables = {int(rb): t for rb, t in cost_table.items()}
        else:
            raise ValueError(f"cost_table must be 'profile', None, a CostTable or {{rows: CostTable}}, got "
                             f"{type(cost_table).__name__}")

    @property
    def cost_tables(self) -> dict[int, CostTable]:
        """The verify cost tables per row bucket (profiled or given): seconds of a whole step by packed tokens."""
        return dict(self._cost_tables)

    def _init_state(self) -> DecodeState:
        return init_state(self.target, self.drafter, num_slots=self.max_num_seqs, num_pages=self.num_pages,
                          max_model_len=self.max_model_len, num_speculative_tokens=self.k,
                          use_estimator=self.confidence == "estimator", cache_dtype=self.cache_dtype)

    def _static_config(self, key) -> StepConfig:
        _, _, nl, sampling, filtering = key
        capture = tuple(self.drafter.cfg.target_layer_ids) if self.drafter is not None else ()
        return StepConfig(num_speculative_tokens=self.k, mode=self.mode, confidence=self.confidence,
                          sampling=sampling, filtering=filtering, num_logit_rows=nl,
                          implementation=self.implementation, interpret=self.interpret, capture_layers=capture)

    def _compiled_step(self, key, plan: StepPlan):
        fn = self._compiled.get(key)
        if fn is None:
            cfg_key = key[2:]
            jitted = self._step_fns.get(cfg_key)
            if jitted is None:
                step = make_step_fn(self.target, self.drafter, self._static_config(key))
                jitted = jax.jit(step, donate_argnums=(2,))
                self._step_fns[cfg_key] = jitted
            fn = jitted.lower(self._target_params, self._drafter_params, self._state, plan).compile()
            self._compiled[key] = fn
            self.num_compiles += 1
        return fn

    def _run(self, step: ScheduledStep):
        plan = _plan(step)
        fn = self._compiled_step(step.key, plan)
        self._state, out = fn(self._target_params, self._drafter_params, self._state, plan)
        return out

    # ------------------------------------------------------------------ validation
    def _requests(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, ignore_eos,
                  sampling_params) -> list[Request]:
        """Validated requests (:func:`spec_decode.request.build_requests`) that fit the page pool."""
        passed = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                      stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        cfg = self.target.cfg
        requests = build_requests(prompts, tokenizer=self.tokenizer, vocab_size=cfg.vocab_size,
                                  eos_token_ids=cfg.eos_token_id, max_model_len=self.max_model_len,
                                  max_stop_ids=self.num_stop_ids,
                                  keywords={k: v for k, v in passed.items() if v is not None},
                                  sampling_params=sampling_params)
        for r in requests:
            p = r.params
            need = -(-min(len(r.prompt) + p.max_new_tokens + self.k, self.max_model_len) // self.page_size)
            if need > self.num_pages:
                raise ValueError(f"prompt {r.index}: {len(r.prompt)} prompt tokens + {p.max_new_tokens} new tokens "
                                 f"need {need} KV pages, more than the pool's {self.num_pages}")
        if not self._warned_no_eos and any(not r.stop_ids and not r.params.ignore_eos for r in requests):
            self._warned_no_eos = True
            warnings.warn("the target's config has no EOS token id (absent, or outside the vocabulary): "
                          "requests without stop_token_ids run to max_new_tokens", stacklevel=3)
        return requests

    # ------------------------------------------------------------------ budget
    def _budget(self, stale, scheduled, n_sampling, n_non_draft, rows) -> int:
        cap = self.max_total_logit_rows - (n_sampling - len(scheduled))
        total = int(np.sum(scheduled))
        if self.mode == "fixed":
            return max(0, min(total, cap - len(scheduled)))
        return choose_budget(stale, scheduled, num_sampling_rows=n_sampling, num_non_draft_tokens=n_non_draft,
                             cost_table=self._cost_tables.get(rows), max_total_logit_rows=cap)

    def _rebudget(self, step: ScheduledStep, budget: int) -> ScheduledStep:
        """The same step with another draft budget (the packed-token bucket follows)."""
        a = dict(step.arrays)
        n_pre = step.num_prefill_tokens
        num_tokens = n_pre + step.num_decode + budget
        t = self._scheduler.token_bucket(num_tokens)
        tokens = np.zeros(t, np.int32)
        tokens[:n_pre] = a["prefill_tokens"][:n_pre]
        a["prefill_tokens"], a["budget"] = tokens, np.asarray(budget, np.int32)
        rb, _, _, sampling, filtering = step.key
        nl = self._scheduler.logit_rows(rb, t)
        return dataclasses.replace(step, arrays=a, key=(rb, t, nl, sampling, filtering), num_tokens=num_tokens)

    def _profile(self, step: ScheduledStep, sched: Scheduler) -> ScheduledStep:
        """Time this row bucket's step at every packed-token bucket this step can reach (commit off), once."""
        rb = step.key[0]
        total = int(step.arrays["scheduled"].sum())
        base = step.num_prefill_tokens + step.num_decode
        table = self._cost_tables.get(rb)
        known = dict(zip(table.verify_buckets, table.verify_seconds)) if table else {}
        budgets = {}
        for b in range(total + 1):
            budgets.setdefault(sched.token_bucket(base + b), b)  # the smallest budget reaching each bucket
        missing = [t for t in budgets if t not in known]
        if not missing:
            return step
        for t in missing:
            trial = self._rebudget(step, budgets[t])
            trial.arrays["commit"] = np.asarray(False)
            plan = _plan(trial)
            fn = self._compiled_step(trial.key, plan)

            def run(fn=fn, plan=plan):
                self._state, out = fn(self._target_params, self._drafter_params, self._state, plan)
                return out.num_emitted

            known[t] = time_callable(run, repeats=3, warmup=1)
        self._cost_tables[rb] = CostTable.from_measurements(known, metadata={"rows": rb, "source": "engine profile"})
        a = step.arrays
        dec = [i for i, r in enumerate(step.row_requests) if r is not None and a["prefill_len"][i] == 0]
        stale = sched.stale_conf[[step.row_requests[i].slot for i in dec]][:, : self.k]
        n_sampling = len(dec) + int(np.sum((a["prefill_len"] > 0) & a["prefill_last"] & (a["resume_token"] < 0)))
        budget = self._budget(stale, a["scheduled"][dec], n_sampling, base, rb)
        return self._rebudget(step, budget)

    def _prepare(self, step: ScheduledStep, sched: Scheduler) -> ScheduledStep:
        """Last host decisions before a step runs: profile the cost table where it is incomplete."""
        if self._profile_costs and step.num_decode and self.k:
            step = self._profile(step, sched)
        return step

    # ------------------------------------------------------------------ running
    def stream(self, prompts, *, max_new_tokens: int | None = None, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               stop_token_ids: Sequence[int] | None = None, ignore_eos: bool | None = None,
               sampling_params=None) -> Iterator[tuple[int, list[int]]]:
        """Yield ``(request index, new token ids)`` as steps complete (continuous batching, host loop).

        The sampling keywords are those of :meth:`generate`."""
        requests = self._requests(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                                  ignore_eos, sampling_params)
        yield from self._loop(requests, run_stats={})

    def generate(self, prompts, *, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, ignore_eos: bool | None = None,
                 sampling_params=None, loop: str = "host", progress: bool | None = None) -> GenerationResults:
        """Generate for every prompt; returns :class:`GenerationResult` s in prompt order (``.stats``: the run).

        ``prompts``: strings (with a tokenizer) or token-id lists. Sampling settings come as keywords or as
        ``sampling_params`` (one :class:`~spec_decode.SamplingParams` or one per prompt), not both; a keyword
        left ``None`` takes its default: ``max_new_tokens`` 64, ``temperature`` 0 (greedy), ``top_k`` 0 and
        ``top_p`` 1 (no filter), ``seed`` 0, no ``stop_token_ids``, ``ignore_eos`` False. ``seed``: request ``i``
        samples with ``seed + i``; seeds are integers in ``[0, 2**31)``, so ``seed + len(prompts) - 1`` must be
        below 2**31 (per-request seeds through ``sampling_params``). Bad input raises ``ValueError`` before any
        device work (:func:`spec_decode.request.build_requests`). ``loop="host"`` is the continuous-batching
        engine; ``progress`` shows a tqdm bar (default: when there are more prompts than slots).
        ``loop="device"`` decodes the whole batch in one compiled program (``spec_decode.device_loop``): no
        Python between steps, every prompt at once (``max_num_seqs`` does not apply), same greedy tokens.
        """
        if loop not in ("host", "device"):
            raise ValueError(f"loop must be 'host' or 'device', got {loop!r}")
        requests = self._requests(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                                  ignore_eos, sampling_params)
        if loop == "device":
            return self._generate_device(requests)
        show = len(requests) > self.max_num_seqs if progress is None else bool(progress)
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), unit="req", desc="generate", file=sys.stderr)
        run_stats: dict = {}
        finished = 0
        for _ in self._loop(requests, run_stats):
            if bar is not None:
                done = sum(r.finish_reason is not None for r in requests)
                bar.update(done - finished)
                finished = done
        if bar is not None:
            bar.close()
        return GenerationResults([self._result(r) for r in requests], run_stats)

    # ------------------------------------------------------------------ the device loop
    def _loop_table(self, rows: int) -> CostTable | None:
        """A given cost table for the device loop's ``rows`` (one table, or the mapping's entry for the largest
        row bucket not above ``rows``); None when the loop should profile its own."""
        if self._given_table is not None:
            return self._given_table
        fitting = [rb for rb in self._cost_tables if rb <= rows] if not self._profile_costs else []
        return self._cost_tables[max(fitting)] if fitting else None

    def _generate_device(self, requests: list[Request]) -> GenerationResults:
        """The whole batch in one compiled program (``spec_decode.device_loop``)."""
        from spec_decode import device_loop as dl

        t0 = time.perf_counter()
        step_cfg = self._static_config((0, 0, 1, any(not r.params.greedy for r in requests),
                                        any(r.params.filters for r in requests)))
        rows = next_pow2(len(requests))
        table = self._loop_table(rows) if self.mode == "adaptive" else None
        batch = dl.plan_batch(requests, target=self.target, drafter=self.drafter, step=step_cfg,
                              page_size=self.page_size, max_model_len=self.max_model_len,
                              max_num_batched_tokens=self.max_num_batched_tokens,
                              min_token_bucket=self.min_token_bucket, num_stop_ids=self.num_stop_ids,
                              max_total_logit_rows=self.max_total_logit_rows if self._logit_rows_given else None,
                              num_token_buckets=self.device_loop_token_buckets, cache_dtype=self.cache_dtype,
                              cost_table=table)
        dl.check_fits(batch, page_limit=self._page_limit)
        planned = time.perf_counter() - t0
        compiles0 = self.num_compiles
        program = self._loops.get(batch.config)
        if program is None:
            fn = jax.jit(dl.make_loop_fn(self.target, self.drafter, batch.config))
            program = fn.lower(self._target_params, self._drafter_params, batch.inputs,
                               dl.LoopControls.run(batch.config.output_len)).compile()
            self._loops[batch.config] = program
            self.num_compiles += 1
        if self.mode == "adaptive" and self._profile_costs:
            if batch.config not in self._loop_tables:
                self._loop_tables[batch.config] = dl.profile_loop(program, self._target_params,
                                                                  self._drafter_params, batch)
            batch.inputs = dataclasses.replace(
                batch.inputs, cost_table=dl.CostTableArrays.from_table(self._loop_tables[batch.config]))
        t1 = time.perf_counter()
        out = jax.device_get(program(self._target_params, self._drafter_params, batch.inputs,
                                     dl.LoopControls.run(batch.config.output_len)))
        t2 = time.perf_counter()
        dl.fill_requests(requests, out, self.k)
        results = [self._result(r) for r in requests]
        t3 = time.perf_counter()
        stats = dl.run_stats(requests, out, batch, k=self.k, mode=self.mode, wall=t3 - t0, host=planned + (t3 - t2),
                             compiles=self.num_compiles - compiles0)
        stats["device_time_s"] = t2 - t1
        return GenerationResults(results, stats)

    @property
    def loop_cost_tables(self) -> dict:
        """The device loop's profiled cost tables, by its static config."""
        return dict(self._loop_tables)

    def _result(self, req: Request) -> GenerationResult:
        k = self.k
        emitted = len(req.output)
        stats = {
            "emitted_tokens": emitted,
            "target_steps": req.target_steps,
            "acceptance_length": (emitted - 1) / req.target_steps if req.target_steps else 0.0,
            "accepted_per_position": [int(x) for x in req.accepted_per_position[:k]] if k else [],
            "verified_per_position": [int(x) for x in req.verified_per_position[:k]] if k else [],
            "verified_drafts_per_step": list(req.verified_drafts_per_step),
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.prompt),
            "preemptions": req.preemptions,
        }
        text = self.tokenizer.decode(req.output) if self.tokenizer is not None else None
        return GenerationResult(list(req.output), text, stats, list(req.prompt))

    def _loop(self, requests: list[Request], run_stats: dict) -> Iterator[tuple[int, list[int]]]:
        if self._state is None:
            self._state = self._init_state()
        sched = Scheduler(num_slots=self.max_num_seqs, num_pages=self.num_pages, page_size=self.page_size,
                          max_model_len=self.max_model_len, num_speculative_tokens=self.k,
                          max_num_batched_tokens=self.max_num_batched_tokens,
                          max_total_logit_rows=self.max_total_logit_rows, num_stop_ids=self.num_stop_ids,
                          min_token_bucket=self.min_token_bucket)
        self._scheduler = sched
        for r in requests:
            sched.add(r)
        compiles0 = self.num_compiles
        t0 = time.perf_counter()
        steps = verify_steps = 0
        verified_per_step: list[int] = []
        budget_per_step: list[int] = []
        host_s = 0.0
        try:
            while sched.has_work:
                h0 = time.perf_counter()
                step = sched.schedule(budget_fn=self._budget)
                if step is None:
                    raise RuntimeError("the scheduler could not place any work (page pool too small?)")
                step = self._prepare(step, sched)
                h1 = time.perf_counter()
                out = jax.device_get(self._run(step))  # the one read-back of the step
                h2 = time.perf_counter()
                events = sched.commit(step, dataclasses.asdict(out))
                host_s += (h1 - h0) + (time.perf_counter() - h2)
                steps += 1
                if step.num_decode:
                    verify_steps += 1
                    verified_per_step.append(int(np.sum(out.num_verified)))
                    budget_per_step.append(int(step.arrays["budget"]))
                for req, new in events:
                    yield req.index, new
        finally:
            wall = time.perf_counter() - t0
            out_tokens = sum(len(r.output) for r in requests)
            decode_emitted = sum(max(len(r.output) - 1, 0) for r in requests if r.target_steps)
            row_steps = sum(r.target_steps for r in requests)
            acc = np.sum([r.accepted_per_position for r in requests], axis=0) if self.k else np.zeros(0)
            ver = np.sum([r.verified_per_position for r in requests], axis=0) if self.k else np.zeros(0)
            run_stats.update(
                wall_time_s=wall, output_tokens=out_tokens, output_tokens_per_s=out_tokens / wall if wall else 0.0,
                steps=steps, verify_steps=verify_steps,
                mean_acceptance_length=decode_emitted / row_steps if row_steps else 0.0,
                per_position_acceptance=[float(a / v) if v else math.nan for a, v in zip(acc[: self.k],
                                                                                           ver[: self.k])],
                verified_drafts_per_step=verified_per_step, budget_per_step=budget_per_step,
                mean_verified_drafts_per_step=float(np.mean(verified_per_step)) if verified_per_step else 0.0,
                host_time_per_step_s=host_s / steps if steps else 0.0, compiles=self.num_compiles - compiles0,
                preemptions=sched.num_preemptions, verification=self.mode, num_speculative_tokens=self.k,
            )
            if sched.has_work:  # interrupted (an exception or a closed stream): free the slots for the next run
                self._state = None


def _plan(step: ScheduledStep) -> StepPlan:
    """The step's host-built plan arrays on the device, in one transfer."""
    return StepPlan(**jax.device_put(step.arrays))


def _row_buckets(max_num_seqs: int) -> list[int]:
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [next_pow2(max_num_seqs)]


def _check_drafter_fits(drafter, target) -> None:
    """A drafter built for another target is refused before any step runs (shapes, layer ids, shared arrays)."""
    from minimax_jax.config import ConfigError

    try:
        drafter.cfg.check_compatible(target.cfg)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    for name in ("embed_tokens", "lm_head"):
        a, b = getattr(drafter, name)[...], getattr(target, name)[...]
        if a.shape != b.shape or (a is not b and not bool(jnp.array_equal(a, b))):
            raise ValueError(f"the drafter's {name} is not the target's: it was built for another target "
                             f"(load it with load_drafter(path, target) or init_drafter(cfg, target))")
