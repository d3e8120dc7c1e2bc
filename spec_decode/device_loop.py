"""Jitted offline batch decoding: the whole speculative loop of a fixed batch in one compiled program.

``Engine.generate(prompts, loop="device")`` (or :func:`generate_offline`) decodes a fixed batch of prompts to the
end with no Python between steps. One program per static shape does it all:

1. **prefill**: the prompts, cut into chunks of at most ``max_num_batched_tokens`` tokens packed by the host
   (up front: the batch is known), run through the engine's own step function (:func:`spec_decode.step.
   make_step_fn`) in a ``fori_loop``; each row's last chunk samples its first token, exactly as in the engine;
2. **decode**: a ``lax.while_loop`` whose carry holds the paged target cache, the drafter's context cache,
   per-row lengths, the previous step's confidences, the estimator, the output buffer, finished flags and the
   statistics. Each iteration plans on the device what the host engine plans on the host:

   * rows: every unfinished request (a finished row becomes a zero-length padding row);
   * drafts per row: ``min(K, tokens the row may still emit - 1)``;
   * the budget: :func:`spec_decode.budget.choose_budget_device`, the host planner's rule in jnp, over the cost
     table held as arrays and the **previous** step's confidences carried in the state (a budget from this
     step's confidences would let a draft influence its own admission and break losslessness, DSpark paper
     Appendix A; only the allocation of the budget uses this step's confidences, inside the step);
   * the packed-token bucket: the smallest of a few static token buckets that holds ``rows + budget`` tokens.
     Each bucket is one branch of a ``lax.switch`` over the same step compiled at that size, so a trimmed budget
     buys a smaller verify, as it does in the host engine;

   then runs the step (draft -> allocate -> verify -> rejection sampling -> stop -> commit -> drafter context ->
   estimator) and appends the emitted tokens. The loop ends when every row has finished (a stop token or its
   ``max_new_tokens``).

Same sampling keys as the engine (they depend on (seed, position) only), so greedy outputs are token-identical
to the engine's and to target-only decoding, and stochastic outputs are identical to the engine's whenever the
two verify the same drafts: always under ``"fixed"`` and ``"none"``, and under ``"adaptive"`` when both plan
from the same cost table (one :class:`~spec_decode.cost_table.CostTable` given to the engine). With profiled
tables each loop measures its own programs, so adaptive budgets (and with them stochastic samples) differ while
staying equal in distribution (both are lossless).

Memory is fixed up front: every request gets the pages for its prompt and ``max_new_tokens`` before compiling
(one contiguous run of pages per row), the output buffer is ``[rows, max_new_tokens]``; a batch that does not
fit is refused with the number of pages it would need. One compile per (batch bucket, K, lengths bucket,
sampling settings); the cost table is an argument, so a new table never recompiles.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.cache import cache_bytes_per_page, page_size_for
from minimax_jax.draft_cache import draft_cache_bytes_per_page
from spec_decode.budget import DEFAULT_MIN_PREDICTED_GAIN, choose_budget_device
from spec_decode.cost_table import CostTable, CostTableArrays, time_callable
from spec_decode.scheduler import Request, RequestStatus, next_pow2
from spec_decode.step import StepConfig, StepPlan, init_state, make_step_fn

__all__ = ["LoopConfig", "LoopControls", "LoopInputs", "LoopOutputs", "OfflineBatch", "generate_offline",
           "make_loop_fn", "plan_batch"]


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static shape and settings of one compiled loop program (its compilation key).

    ``rows`` (R, a power of two) request rows; ``num_pages`` the page pool (the target's and the drafter
    context's: the draft cache lives on the same pages); ``capacity`` a row's reach (``max_blocks x page``);
    ``prefill_tokens`` the packed tokens of one prefill step and ``max_prefill_steps`` the (padded) number of them; ``output_len`` (W) the output buffer width, also the bound
    on decode steps (every step emits at least one token per unfinished row); ``token_buckets`` the verify
    sizes, ascending; ``max_total_logit_rows`` the verify-logits bound.
    """

    step: StepConfig
    rows: int
    num_pages: int
    capacity: int
    prefill_tokens: int
    max_prefill_steps: int
    output_len: int
    token_buckets: tuple[int, ...]
    max_total_logit_rows: int
    cache_dtype: str
    min_predicted_gain: float = DEFAULT_MIN_PREDICTED_GAIN

    def logit_rows(self, tokens: int) -> int:
        """Verify-logits rows of a bucket (as the engine's scheduler: every row's 1 + K at most, the bound)."""
        k = self.step.num_speculative_tokens
        return max(1, min(tokens, self.max_total_logit_rows, self.rows * (1 + k)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopInputs:
    """Everything the host decides, once, for the whole batch. ``P`` prefill steps, ``R`` rows."""

    prefill_rows: jax.Array  # int32[P, R]     row (= slot) of each prefill row, -1 when the row has no chunk
    prefill_ids: jax.Array  # int32[P, Tp]    the step's chunks, packed in row order
    prefill_len: jax.Array  # int32[P, R]
    prefill_start: jax.Array  # int32[P, R]
    prefill_last: jax.Array  # bool[P, R]
    num_prefill_steps: jax.Array  # int32[]
    block_tables: jax.Array  # int32[R, B]     the row's pages (a contiguous run)
    limit: jax.Array  # int32[R]        tokens the row may emit (max_new_tokens, the length limit); 0 padding
    temperature: jax.Array  # f32[R]
    top_k: jax.Array  # int32[R]
    top_p: jax.Array  # f32[R]
    seed: jax.Array  # int32[R]
    stop_ids: jax.Array  # int32[R, M]
    cost_table: CostTableArrays


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopControls:
    """Run-time switches of a compiled program (arguments: changing them never recompiles).

    ``max_steps`` bounds the decode iterations; ``force_bucket >= 0`` runs every iteration in that token bucket
    (with as many drafts as it holds) and ``commit = False`` leaves the decode state unchanged: the cost-table
    profiler times the program's own iterations this way.
    """

    max_steps: jax.Array  # int32[]
    force_bucket: jax.Array  # int32[]
    commit: jax.Array  # bool[]

    @classmethod
    def run(cls, max_steps: int) -> LoopControls:
        return cls(np.asarray(max_steps, np.int32), np.asarray(-1, np.int32), np.asarray(True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopOutputs:
    """What comes back from the device, in one transfer. ``S = W`` step slots."""

    tokens: jax.Array  # int32[R, W]     emitted tokens (-1 after the row's last)
    num_tokens: jax.Array  # int32[R]
    finished: jax.Array  # bool[R]
    target_steps: jax.Array  # int32[R]        verify steps of the row
    accepted_per_position: jax.Array  # int32[R, K]
    verified_per_position: jax.Array  # int32[R, K]
    verified_per_step: jax.Array  # int32[R, S]     the row's verified drafts at each decode step (-1: not in it)
    budget_per_step: jax.Array  # int32[S]
    steps: jax.Array  # int32[]         decode iterations run


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Carry:
    state: object
    tokens: jax.Array
    emitted: jax.Array
    finished: jax.Array
    target_steps: jax.Array
    accepted: jax.Array
    verified: jax.Array
    verified_per_step: jax.Array
    budget_per_step: jax.Array
    step: jax.Array


def make_loop_fn(target, drafter, config: LoopConfig):
    """The pure program ``(target_params, drafter_params, LoopInputs, LoopControls) -> LoopOutputs``.

    Jit it (nothing is donated: the caches are created inside the program and never leave it).
    """
    step_cfg = config.step
    k = step_cfg.num_speculative_tokens
    r = config.rows
    w = config.output_len
    mode = step_cfg.mode
    buckets = tuple(config.token_buckets)
    prefill_step = make_step_fn(target, drafter, dataclasses.replace(step_cfg, num_logit_rows=r))
    branch_steps = [make_step_fn(target, drafter, dataclasses.replace(step_cfg,
                                                                      num_logit_rows=config.logit_rows(t)))
                    for t in buckets]
    kk = max(k, 1)
    row_ids = jnp.arange(r, dtype=jnp.int32)

    def program(target_params, drafter_params, inputs: LoopInputs, controls: LoopControls) -> LoopOutputs:
        state = init_state(target, drafter, num_slots=r, num_pages=config.num_pages, max_model_len=config.capacity,
                           num_speculative_tokens=k, use_estimator=step_cfg.confidence == "estimator",
                           cache_dtype=jnp.dtype(config.cache_dtype))

        def plan(rows, prefill_ids, prefill_len, prefill_start, prefill_last, scheduled, budget, max_emit, commit):
            return StepPlan(rows=rows, prefill_tokens=prefill_ids, prefill_len=prefill_len,
                            prefill_start=prefill_start, prefill_last=prefill_last,
                            resume_token=jnp.full((r,), -1, jnp.int32), block_tables=inputs.block_tables,
                            scheduled=scheduled, budget=budget, temperature=inputs.temperature,
                            top_k=inputs.top_k, top_p=inputs.top_p, seed=inputs.seed, max_emit=max_emit,
                            stop_ids=inputs.stop_ids, commit=commit)

        def append(c: _Carry, out, commit):
            """The step's emitted tokens after each row's earlier ones; finished flags."""
            count = jnp.where(commit, out.num_emitted, 0)
            cols = jnp.arange(out.tokens.shape[1], dtype=jnp.int32)[None, :]
            dest = jnp.where(cols < count[:, None], c.emitted[:, None] + cols, w)  # w: dropped
            tokens = c.tokens.at[row_ids[:, None], dest].set(out.tokens, mode="drop")
            return dataclasses.replace(c, tokens=tokens, emitted=c.emitted + count,
                                       finished=c.finished | (out.finished & commit))

        zeros_r = jnp.zeros((r,), jnp.int32)
        carry = _Carry(state=state, tokens=jnp.full((r, w), -1, jnp.int32), emitted=zeros_r,
                       finished=inputs.limit <= 0, target_steps=zeros_r,
                       accepted=jnp.zeros((r, kk), jnp.int32), verified=jnp.zeros((r, kk), jnp.int32),
                       verified_per_step=jnp.full((r, w), -1, jnp.int32), budget_per_step=jnp.zeros((w,), jnp.int32),
                       step=jnp.zeros((), jnp.int32))

        # ---- 1. prefill: the host-packed chunks, each row's last chunk samples its first token
        def prefill_body(i, c: _Carry):
            p = plan(inputs.prefill_rows[i], inputs.prefill_ids[i], inputs.prefill_len[i], inputs.prefill_start[i],
                     inputs.prefill_last[i], zeros_r, jnp.zeros((), jnp.int32), inputs.limit - c.emitted,
                     jnp.asarray(True))
            st, out = prefill_step(target_params, drafter_params, c.state, p)
            return append(dataclasses.replace(c, state=st), out, jnp.asarray(True))

        carry = jax.lax.fori_loop(0, inputs.num_prefill_steps, prefill_body, carry)

        # ---- 2. decode until every row is done
        max_steps = jnp.clip(controls.max_steps, 0, w)
        bucket_sizes = jnp.asarray(buckets, jnp.int32)

        def cond(c: _Carry):
            return (c.step < max_steps) & jnp.any(~c.finished)

        def body(c: _Carry):
            live = ~c.finished
            rows = jnp.where(live, row_ids, -1)
            max_emit = inputs.limit - c.emitted
            sched = jnp.where(live, jnp.clip(max_emit - 1, 0, k), 0)
            n_live = jnp.sum(live, dtype=jnp.int32)
            cap = config.max_total_logit_rows
            max_b = jnp.maximum(0, jnp.minimum(jnp.sum(sched), cap - n_live))
            if mode == "adaptive":
                budget = choose_budget_device(c.state.prev_confidences[:, :k], sched, num_rows=n_live,
                                              num_sampling_rows=n_live, num_non_draft_tokens=n_live,
                                              cost_table=inputs.cost_table, max_total_logit_rows=cap,
                                              min_predicted_gain=config.min_predicted_gain)
            elif mode == "fixed":
                budget = max_b
            else:
                budget = jnp.zeros((), jnp.int32)
            fits = bucket_sizes >= n_live + budget  # the last bucket always does (plan_batch sizes it so)
            bucket = jnp.where(jnp.any(fits), jnp.argmax(fits), len(buckets) - 1).astype(jnp.int32)
            forced = controls.force_bucket >= 0
            bucket = jnp.where(forced, jnp.clip(controls.force_bucket, 0, len(buckets) - 1), bucket)
            budget = jnp.where(forced, jnp.clip(bucket_sizes[bucket] - n_live, 0, max_b), budget)
            commit = controls.commit
            p = plan(rows, None, zeros_r, zeros_r, jnp.zeros((r,), bool), sched, budget, max_emit, commit)

            def branch(fn, t):
                def run(state, p):
                    return fn(target_params, drafter_params, state,
                              dataclasses.replace(p, prefill_tokens=jnp.zeros((t,), jnp.int32)))
                return run

            st, out = jax.lax.switch(bucket, [branch(fn, t) for fn, t in zip(branch_steps, buckets)], c.state, p)
            c = append(dataclasses.replace(c, state=st), out, commit)
            counted = live & commit
            j = jnp.arange(kk, dtype=jnp.int32)[None, :]
            acc = jnp.minimum(out.num_accepted, out.num_emitted)[:, None]
            s = c.step
            return dataclasses.replace(
                c,
                target_steps=c.target_steps + counted,
                accepted=c.accepted + ((j < acc) & counted[:, None]),
                verified=c.verified + ((j < out.num_verified[:, None]) & counted[:, None]),
                verified_per_step=c.verified_per_step.at[:, s].set(jnp.where(counted, out.num_verified, -1)),
                budget_per_step=c.budget_per_step.at[s].set(budget),
                step=s + 1,
            )

        carry = jax.lax.while_loop(cond, body, carry)
        return LoopOutputs(tokens=carry.tokens, num_tokens=carry.emitted, finished=carry.finished,
                           target_steps=carry.target_steps, accepted_per_position=carry.accepted[:, :k],
                           verified_per_position=carry.verified[:, :k], verified_per_step=carry.verified_per_step,
                           budget_per_step=carry.budget_per_step, steps=carry.step)

    return program


# ---------------------------------------------------------------------------------------------- host side
@dataclasses.dataclass
class OfflineBatch:
    """A batch planned for the device loop: its static config, its inputs (numpy) and what it needs."""

    config: LoopConfig
    inputs: LoopInputs
    pages_needed: int
    bytes_needed: int
    num_prefill_steps: int


def plan_batch(requests: Sequence[Request], *, target, drafter, step: StepConfig, page_size: int,
               max_model_len: int, max_num_batched_tokens: int, min_token_bucket: int, num_stop_ids: int,
               max_total_logit_rows: int | None, num_token_buckets: int, cache_dtype,
               cost_table: CostTable | None) -> OfflineBatch:
    """Static shapes, pages, prefill chunks and per-row settings of the device loop for ``requests``.

    Shapes are bucketed (rows, prefill steps, lengths, output width to powers of two) so that batches of similar
    size share one compiled program.
    """
    n = len(requests)
    k = step.num_speculative_tokens
    rows = next_pow2(n)
    limits = [min(q.params.max_new_tokens, max_model_len - len(q.prompt)) for q in requests]
    # positions written: the prompt, then anchors and drafts up to prompt + limit - 2 (module docstring)
    need = [-(-(len(q.prompt) + lim - 1) // page_size) for q, lim in zip(requests, limits)]
    max_blocks = next_pow2(max(need))
    pages = sum(need)
    num_pages = min(next_pow2(pages), rows * max_blocks)
    cap = rows * (1 + k) if max_total_logit_rows is None else int(max_total_logit_rows)
    if cap < rows:
        raise ValueError(f"max_total_logit_rows ({cap}) must be >= the batch's {rows} rows: every request samples "
                         f"one token per step")
    t_max = max(next_pow2(min(rows * (1 + k), cap)), min_token_bucket)
    buckets = sorted({max(t_max >> i, min_token_bucket) for i in range(max(1, num_token_buckets))})

    # prefill chunks, requests in order, at most max_num_batched_tokens tokens per step
    steps: list[list[tuple[int, int, int]]] = [[]]
    room = max_num_batched_tokens
    for i, q in enumerate(requests):
        done = 0
        while done < len(q.prompt):
            if room == 0:
                steps.append([])
                room = max_num_batched_tokens
            m = min(room, len(q.prompt) - done)
            steps[-1].append((i, done, m))
            done += m
            room -= m
    p_real = len(steps)
    p = next_pow2(p_real)
    tp = max(next_pow2(max(sum(m for _, _, m in s) for s in steps)), min_token_bucket)
    pre_rows = np.full((p, rows), -1, np.int32)
    pre_ids = np.zeros((p, tp), np.int32)
    pre_len = np.zeros((p, rows), np.int32)
    pre_start = np.zeros((p, rows), np.int32)
    pre_last = np.zeros((p, rows), bool)
    for s, chunks in enumerate(steps):
        off = 0
        for i, start, m in chunks:  # ascending rows: the step packs chunks in row order
            pre_rows[s, i], pre_len[s, i], pre_start[s, i] = i, m, start
            pre_last[s, i] = start + m == len(requests[i].prompt)
            pre_ids[s, off: off + m] = requests[i].prompt[start: start + m]
            off += m

    block_tables = np.zeros((rows, max_blocks), np.int32)
    first = 0
    for i, m in enumerate(need):
        block_tables[i, :m] = first + np.arange(m)
        first += m
    limit = np.zeros(rows, np.int32)
    limit[:n] = limits
    temperature = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    seed = np.zeros(rows, np.int32)
    stop_ids = np.full((rows, num_stop_ids), -1, np.int32)
    for i, q in enumerate(requests):
        temperature[i], top_k[i], top_p[i], seed[i] = (q.params.temperature, q.params.top_k, q.params.top_p,
                                                       q.params.seed)
        stop_ids[i, : len(q.stop_ids)] = q.stop_ids
    width = next_pow2(max(limits))
    cache_dtype = jnp.dtype(cache_dtype)
    config = LoopConfig(step=step, rows=rows, num_pages=num_pages, capacity=max_blocks * page_size,
                        prefill_tokens=tp, max_prefill_steps=p, output_len=width, token_buckets=tuple(buckets),
                        max_total_logit_rows=cap, cache_dtype=cache_dtype.name)
    inputs = LoopInputs(prefill_rows=pre_rows, prefill_ids=pre_ids, prefill_len=pre_len, prefill_start=pre_start,
                        prefill_last=pre_last, num_prefill_steps=np.asarray(p_real, np.int32),
                        block_tables=block_tables, limit=limit, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, stop_ids=stop_ids, cost_table=CostTableArrays.from_table(cost_table))
    return OfflineBatch(config, inputs, pages, _bytes_needed(config, target, drafter, cache_dtype), p_real)


def _bytes_needed(config: LoopConfig, target, drafter, cache_dtype) -> int:
    """Device memory the program allocates beyond the weights: caches, drafter context, verify logits, outputs."""
    cfg = target.cfg
    total = config.num_pages * cache_bytes_per_page(cfg, cache_dtype)
    if drafter is not None and config.step.num_speculative_tokens:  # the draft cache shares the target's pages
        total += config.num_pages * draft_cache_bytes_per_page(drafter.cfg, page_size_for(cfg), cache_dtype)
    total += config.logit_rows(config.token_buckets[-1]) * cfg.vocab_size * 4 * 2  # logits + filtered copy
    total += config.rows * config.output_len * 4 * 2
    return int(total)


def check_fits(batch: OfflineBatch, *, page_limit: int | None, device=None) -> None:
    """Refuse a batch that cannot fit, naming the pages it would need (before compiling anything)."""
    if page_limit is not None and batch.pages_needed > page_limit:
        raise ValueError(f"the batch needs {batch.pages_needed} KV pages for its prompts and max_new_tokens, more "
                         f"than the engine's pool of {page_limit} (num_pages / memory_fraction); pass a larger "
                         f"pool, fewer prompts or a smaller max_new_tokens")
    device = device or jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if batch.bytes_needed > free:
            raise ValueError(f"the batch needs {batch.pages_needed} KV pages ({batch.bytes_needed / 2**30:.2f} GiB "
                             f"with the drafter's context cache and the verify logits), more than the "
                             f"{free / 2**30:.2f} GiB free on {device.device_kind}; decode it in smaller batches "
                             f"or with a smaller max_new_tokens")


def profile_loop(program, target_params, drafter_params, batch: OfflineBatch, *, steps: int = 4,
                 repeats: int = 3) -> CostTable:
    """Seconds per decode iteration in each token bucket, measured on the loop program itself.

    For each bucket the program runs with that bucket forced and the decode state frozen (``commit=False``),
    once with 1 iteration and once with ``1 + steps``; the difference over ``steps`` is one iteration
    (prefill and the transfers cancel out).
    """
    inputs = jax.device_put(batch.inputs)
    verify = {}
    for b, t in enumerate(batch.config.token_buckets):
        def run(n, b=b):
            ctl = LoopControls(np.asarray(n, np.int32), np.asarray(b, np.int32), np.asarray(False))
            return program(target_params, drafter_params, inputs, ctl).steps

        one = time_callable(lambda: run(1), repeats=repeats, warmup=1)
        more = time_callable(lambda: run(1 + steps), repeats=repeats, warmup=0)
        verify[t] = max((more - one) / steps, 1e-9)
    return CostTable.from_measurements(verify, metadata={"rows": batch.config.rows, "source": "device loop profile"})


def fill_requests(requests: Sequence[Request], out: LoopOutputs, k: int) -> None:
    """Fold the program's outputs into the requests (the engine then builds its results from them)."""
    for i, q in enumerate(requests):
        n = int(out.num_tokens[i])
        q.output = [int(x) for x in out.tokens[i, :n]]
        q.target_steps = int(out.target_steps[i])
        kk = max(k, 1)
        q.accepted_per_position = np.zeros(kk, np.int64)
        q.verified_per_position = np.zeros(kk, np.int64)
        if k:
            q.accepted_per_position[:k] = out.accepted_per_position[i]
            q.verified_per_position[:k] = out.verified_per_position[i]
        per_step = out.verified_per_step[i]
        q.verified_drafts_per_step = [int(x) for x in per_step[per_step >= 0]]
        last = q.output[-1] if q.output else None
        q.finish_reason = "stop" if last in q.stop_ids else "length"
        q.status = RequestStatus.FINISHED


def run_stats(requests: Sequence[Request], out: LoopOutputs, batch: OfflineBatch, *, k: int, mode: str,
              wall: float, host: float, compiles: int) -> dict:
    """The run statistics, with the same keys as the host engine's (and a few of the device loop's own)."""
    steps = int(out.steps)
    per_step = np.where(out.verified_per_step[:, :steps] >= 0, out.verified_per_step[:, :steps], 0).sum(0)
    out_tokens = sum(len(q.output) for q in requests)
    decode_emitted = sum(max(len(q.output) - 1, 0) for q in requests if q.target_steps)
    row_steps = sum(q.target_steps for q in requests)
    acc = np.sum([q.accepted_per_position for q in requests], axis=0)
    ver = np.sum([q.verified_per_position for q in requests], axis=0)
    return dict(
        wall_time_s=wall, output_tokens=out_tokens, output_tokens_per_s=out_tokens / wall if wall else 0.0,
        steps=batch.num_prefill_steps + steps, verify_steps=steps,
        mean_acceptance_length=decode_emitted / row_steps if row_steps else 0.0,
        per_position_acceptance=[float(a / v) if v else math.nan for a, v in zip(acc[:k], ver[:k])],
        verified_drafts_per_step=[int(x) for x in per_step],
        budget_per_step=[int(x) for x in out.budget_per_step[:steps]],
        mean_verified_drafts_per_step=float(np.mean(per_step)) if steps else 0.0,
        host_time_per_step_s=host / max(batch.num_prefill_steps + steps, 1), compiles=compiles, preemptions=0,
        verification=mode, num_speculative_tokens=k, loop="device", prefill_steps=batch.num_prefill_steps,
        token_buckets=list(batch.config.token_buckets), kv_pages=batch.pages_needed,
    )


def generate_offline(target, drafter, prompts, *, max_new_tokens: int | None = None,
                     temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                     seed: int | None = None, stop_token_ids: Sequence[int] | None = None,
                     ignore_eos: bool | None = None, sampling_params=None, **engine_kwargs):
    """Jitted offline batch decoding in one call: ``Engine(target, drafter, **engine_kwargs).generate(prompts,
    loop="device", ...)``. Keep an :class:`~spec_decode.engine.Engine` instead to reuse its compiled programs."""
    from spec_decode.engine import Engine

    engine = Engine(target, drafter, **engine_kwargs)
    return engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=seed, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                           sampling_params=sampling_params, loop="device")

