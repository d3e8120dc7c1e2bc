"""Jitted offline batch decoding: a batch's whole decode in one compiled program, on the engine's own state.

``Engine.generate(prompts, loop="device")`` (or :func:`spec_decode.engine.generate_offline`) runs in waves of at
most ``max_num_seqs`` requests whose pages fit the pool:

1. **prefill** through the host loop's own step programs (the closed set: chunked prefill, the prefix cache), with
   no read-back between the steps; each request's last chunk samples its first token, which stays on the device;
2. the host reserves every page each request can write until it finishes (its prompt and ``limit - 1`` more
   positions), so the device never needs a page it was not given;
3. **decode** in one compiled program: a ``lax.while_loop`` over the engine's step function, whose carry holds the
   engine's :class:`~spec_decode.step.DecodeState` (donated, returned), the output buffer and the statistics.
   Each iteration plans on the device what the host engine plans on the host:

   * rows: every slot whose request is unfinished (a finished slot's row is padding);
   * drafts per row: ``K``, clipped in the step to what the row may still emit;
   * the draft length and the budget: :func:`spec_decode.budget.choose_plan_device`, the host rule in jnp, over
     the planner's cost table and the **previous** step's confidences carried in the state (a plan from this
     step's confidences would let a draft influence its own admission; only the allocation inside the step uses
     them);
   * the program: for the chosen draft length, the smallest of a few packed-token buckets of the closed set
     holding ``rows + budget``; every (draft length, bucket) is one branch of a ``lax.switch`` over the step
     compiled at that shape;
   * how long the plan holds: up to ``LoopInputs.plan_interval`` iterations (an *epoch*), a value of the call, so
     one compiled loop serves every interval (``LoopConfig.hold_plans`` compiles the epochs in). The branch runs them in
     a loop of its own, each step's budget re-clipped to what its live rows may still verify (rows only finish
     within an epoch, so the branch's tokens still hold every step). A call's first epoch is one step (its plan
     read the confidences the call started with), and an epoch ends once a smaller size of its draft length
     would hold the step, so a wave's tail moves down the sizes as promptly as planning every step. On a GPU
     every plan and every switch is a round trip to the host (XLA reads the branch index back before it launches
     the branch) plus the planner's kernels, which an iteration of a few hundred microseconds feels; an epoch pays
     them once. The plan still reads confidences of an earlier step only, so it stays lossless. An interval of
     ``1`` plans every step, the host loop's rule, step for step; a loop compiled without ``hold_plans`` always
     does, with no epoch loop in its branches;

   the loop ends when every row has finished. One transfer in and one read-back per wave: the wave's
   :class:`LoopInputs` (33 arrays with the cost table) travel packed in one ``int32`` vector, and so do its
   :class:`LoopOutputs` (18-21 arrays) on the way back (:func:`packed_program`, :mod:`spec_decode.transfer`).
   Sent array by array, each was a transfer of its own with its host callbacks: the inputs alone took 3.5-4.6 ms
   of host threads' time a call on an H100 (``scripts/bench_loop_overhead.py --trace-calls``), and packing them
   made a 64-request wave's decode 1-1.5 ms shorter (docs/ENGINE.md, "The device loop").

**Log-probabilities** (``SamplingParams.logprobs``): a loop compiled with ``LoopConfig.logprobs = L`` (the
sampling programs only) carries, beside its output tokens, each token's log-probability ``f32[R, W]`` and its
position's ``L`` most likely tokens ``int32[R, W, L]`` / ``f32[R, W, L]``: the step's own values
(:mod:`spec_decode.logprobs`), so they equal the host loop's. ``L`` is static, chosen by the engine from the largest
``k`` of the call (one of a few widths); ``None`` (every wave without a request that asks) carries nothing and
its steps skip the computation. The first token of each request and ``prompt_logprobs`` come from the prefill,
which runs through the host loop's programs and is read back as in the host loop.

One program per engine (its shapes come from the engine's settings: slots, ``max_model_len``, K, the buckets):
the device loop compiles in ``Engine.warmup()`` with the rest of the closed set and never again. Same sampling
keys as the host loop (they depend on (seed, position) only), so greedy outputs are token-identical to the host
loop's and to target-only decoding, and stochastic outputs are identical whenever both verify the same drafts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.budget import (
    DEFAULT_MIN_PREDICTED_GAIN,
    choose_plan_device,
    full_draft_due,
    prepare_plan_device,
)
from spec_decode.cost_table import CostTableArrays
from spec_decode.logprobs import MAX_LOGPROBS, token_logprobs
from spec_decode.step import DecodeState, StepConfig, StepPlan, make_step_fn
from spec_decode.transfer import PackedLayout, pack_device, pack_host, unpack_device

__all__ = ["LOGPROBS_WIDTHS", "LoopConfig", "LoopInputs", "LoopOutputs", "add_row_stats", "logprobs_width",
           "loop_outputs_layout", "make_loop_fn", "pack_loop_inputs", "packed_program"]

LOGPROBS_WIDTHS = (0, 1, 2, 4, 8, 16, MAX_LOGPROBS)  # the loop's static top-alternative widths (each one program)


def logprobs_width(ks, vocab_size: int) -> int | None:
    """``LoopConfig.logprobs`` for requests asking for ``ks`` alternatives (``SamplingParams.logprobs``; None:
    not asked): the smallest of :data:`LOGPROBS_WIDTHS` holding the largest (at most the vocabulary), or None
    when none asks, so a call without log-probabilities runs the loop that carries none."""
    asked = [int(k) for k in ks if k is not None]
    if not asked:
        return None
    return min(next(w for w in LOGPROBS_WIDTHS if w >= max(asked)), vocab_size)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static shape and settings of the loop program (its compilation key).

    ``rows`` (R) the engine's slots; ``output_len`` (W) the output buffer width, also the bound on decode steps
    (every step emits at least one token per unfinished row); ``draft_lengths`` the ``K_d`` the plan chooses
    from (ascending), and per length ``token_buckets`` the verify sizes (ascending, from the closed set) with
    their verify-logits rows ``logit_rows``; ``logprobs`` the top alternatives carried per emitted token (``None``:
    no log-probabilities carried).
    """

    step: StepConfig
    rows: int
    output_len: int
    draft_lengths: tuple[int, ...]
    token_buckets: tuple[tuple[int, ...], ...]
    logit_rows: tuple[tuple[int, ...], ...]
    max_total_logit_rows: int
    num_stop_ids: int
    max_blocks: int
    min_predicted_gain: float = DEFAULT_MIN_PREDICTED_GAIN
    logprobs: int | None = None  # top alternatives carried per token (None: no log-probabilities; sampling only)
    # the branches hold their plan for up to LoopInputs.plan_interval iterations (an epoch loop in each branch);
    # False: plan every iteration, with no epoch loop (the host loop's rule, step for step)
    hold_plans: bool = False

    @property
    def branches(self) -> tuple[tuple[int, int], ...]:
        """``(draft length, tokens)`` of each branch of the loop's switch, in switch order."""
        return tuple((d, t) for d, buckets in zip(self.draft_lengths, self.token_buckets) for t in buckets)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopInputs:
    """Everything the host decides, once per wave. ``R`` rows (one per slot)."""

    rows: jax.Array  # int32[R]        the slot of each row, -1 when the slot holds no request of the wave
    block_tables: jax.Array  # int32[R, B]     every page the row's request may write until it finishes
    limit: jax.Array  # int32[R]        tokens the request may emit in all
    temperature: jax.Array  # f32[R]
    top_k: jax.Array  # int32[R]
    top_p: jax.Array  # f32[R]
    seed: jax.Array  # int32[R]
    stop_ids: jax.Array  # int32[R, M]
    max_steps: jax.Array  # int32[]         bound on the decode iterations
    cost_table: CostTableArrays
    min_tokens: jax.Array  # int32[R]
    min_p: jax.Array  # f32[R]
    repetition_penalty: jax.Array  # f32[R]
    presence_penalty: jax.Array  # f32[R]
    frequency_penalty: jax.Array  # f32[R]
    # bool[]: stop before the next iteration once any row of the call has finished (the host loop's multi-step
    # launches set it while requests wait for a slot, so a freed slot is refilled after this launch)
    end_on_finish: jax.Array
    # int32[]: -1 plans each iteration; b >= 0 is a timing run (the engine's warm-up profile): every iteration
    # runs branch b (the b-th (draft length, bucket) of LoopConfig, in order) with ``timing_budget`` drafts and
    # commits nothing, so each repeats the same step on the same state until ``max_steps``
    timing_branch: jax.Array
    timing_budget: jax.Array  # int32[]
    # int32[]: iterations each plan holds for (>= 1; its draft length and bucket, the budget re-clipped each
    # step), with LoopConfig.hold_plans (else every iteration plans); a call's value, not the program's
    plan_interval: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopOutputs:
    """What comes back from the device, in one transfer. ``S = W`` step slots."""

    tokens: jax.Array  # int32[R, W]     tokens emitted by the decode steps (-1 after the row's last)
    num_tokens: jax.Array  # int32[R]
    target_steps: jax.Array  # int32[R]        verify steps of the row
    accepted_per_position: jax.Array  # int32[R, K]
    verified_per_position: jax.Array  # int32[R, K]
    predicted_per_position: jax.Array  # f32[R, K]   sums of the predicted survival at verified positions
    verified_per_step: jax.Array  # int32[R, S]     the row's verified drafts at each decode step (-1: not in it)
    budget_per_step: jax.Array  # int32[S]
    draft_len_per_step: jax.Array  # int32[S]        K_d of each decode step
    live_per_step: jax.Array  # int32[S]        rows that decoded at each step
    tokens_per_step: jax.Array  # int32[S]        packed-token size of the branch each step ran
    finished: jax.Array  # bool[R]
    steps: jax.Array  # int32[]         decode iterations run
    confidences: jax.Array  # f32[R, K]       the last step's confidences per row (the host loop plans from them)
    fresh_confidences: jax.Array  # f32[K]   the state's start for a slot whose prefill is done, and its weight
    fresh_weight: jax.Array  # f32[]           (spec_decode.step.DecodeState; the host's mirror of them)
    undrafted_steps: jax.Array  # int32[]      (spec_decode.step.DecodeState; the host's mirror of them)
    full_draft_after: jax.Array  # int32[]
    # LoopConfig.logprobs = L only (else None), by the column of ``tokens``
    token_logprobs: jax.Array | None = None  # f32[R, W]     log p(token) (spec_decode.logprobs)
    top_ids: jax.Array | None = None  # int32[R, W, L]  most likely tokens at its position, best first
    top_logprobs: jax.Array | None = None  # f32[R, W, L]


def loop_outputs_layout(config: LoopConfig) -> PackedLayout:
    """Where each array of the loop's :class:`LoopOutputs` lies in the vector the program returns
    (:func:`packed_program`), from ``config`` alone: the host unpacks by it without tracing the loop. The
    program checks it against what it built when it is traced."""
    r, w, k = config.rows, config.output_len, config.step.num_speculative_tokens
    i32, f32 = np.int32, np.float32

    def a(shape, dtype=i32):
        return jax.ShapeDtypeStruct(shape, dtype)

    width = config.logprobs
    logprobs = {} if width is None else dict(token_logprobs=a((r, w), f32), top_ids=a((r, w, width)),
                                             top_logprobs=a((r, w, width), f32))
    return PackedLayout.of(LoopOutputs(
        tokens=a((r, w)), num_tokens=a((r,)), target_steps=a((r,)), accepted_per_position=a((r, k)),
        verified_per_position=a((r, k)), predicted_per_position=a((r, k), f32), verified_per_step=a((r, w)),
        budget_per_step=a((w,)), draft_len_per_step=a((w,)), live_per_step=a((w,)), tokens_per_step=a((w,)),
        finished=a((r,), np.bool_), steps=a(()), confidences=a((r, k), f32), fresh_confidences=a((max(k, 1),), f32),
        fresh_weight=a((), f32), undrafted_steps=a(()), full_draft_after=a(()), **logprobs))


def packed_program(loop_fn, config: LoopConfig, inputs_layout: PackedLayout):
    """``loop_fn`` (:func:`make_loop_fn`'s program for ``config``) with its inputs and outputs each one ``int32``
    vector: ``program(target_params, drafter_params, state, packed_inputs) -> (state, packed_outputs)``, the
    inputs :func:`pack_loop_inputs`'s vector (of ``inputs_layout``), the outputs unpacked on the host by
    :func:`loop_outputs_layout` (``spec_decode.transfer.unpack_host``)."""
    outputs_layout = loop_outputs_layout(config)

    def program(target_params, drafter_params, state, packed):
        state, out = loop_fn(target_params, drafter_params, state, unpack_device(packed, inputs_layout))
        return state, pack_device(out, outputs_layout)

    return program


def pack_loop_inputs(inputs: LoopInputs) -> np.ndarray:
    """A call's :class:`LoopInputs` (host arrays) as the one vector :func:`packed_program` takes."""
    return pack_host(inputs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Carry:
    state: DecodeState
    tokens: jax.Array
    emitted: jax.Array
    target_steps: jax.Array
    accepted: jax.Array
    verified: jax.Array
    predicted: jax.Array
    verified_per_step: jax.Array
    budget_per_step: jax.Array
    draft_len_per_step: jax.Array
    live_per_step: jax.Array
    tokens_per_step: jax.Array
    step: jax.Array
    logprobs: tuple | None  # (f32[R, W], int32[R, W, L], f32[R, W, L]) with LoopConfig.logprobs, else None


def make_loop_fn(target, drafter, config: LoopConfig):
    """The pure program ``(target_params, drafter_params, state, LoopInputs) -> (state, LoopOutputs)``.

    Jit it with the state donated. Rows whose slot is already done (or that name no slot) never run."""
    step_cfg = config.step
    k = step_cfg.num_speculative_tokens
    r, w = config.rows, config.output_len
    mode = step_cfg.mode
    lengths = tuple(config.draft_lengths)
    branches, offsets = [], []  # (step fn, tokens, K_d) per (draft length, bucket); offsets[i]: length i's first
    for d, buckets, rows in zip(lengths, config.token_buckets, config.logit_rows):
        offsets.append(len(branches))
        branches += [(make_step_fn(target, drafter, dataclasses.replace(step_cfg, num_logit_rows=nl, draft_len=d)), t,
                      d) for t, nl in zip(buckets, rows)]
    offsets_arr = np.asarray(offsets, np.int32)
    branch_length_list = [i for i, b in enumerate(config.token_buckets) for _ in b]
    branch_length = np.asarray(branch_length_list, np.int32)
    counts_arr = np.asarray([len(b) for b in config.token_buckets], np.int32)
    sizes_arr = np.asarray([t for _, t, _ in branches], np.int32)
    # per branch, the next smaller size of its draft length (0: none)
    below_arr = [int(sizes_arr[i - 1]) if i > offsets[li] else 0 for i, li in enumerate(branch_length_list)]
    lengths_arr = np.asarray(lengths, np.int32)
    kk = max(k, 1)
    # the plan's ranking pass: Pallas kernels on a GPU (pallas_kernels.plan_ranking), jnp where the engine asks for
    # reference kernels or runs on a mesh (every rank plans the same, replicated)
    plan_impl = "reference" if step_cfg.implementation == "reference" or step_cfg.mesh is not None else "auto"
    width = config.logprobs
    if width is not None and not (step_cfg.sampling and 0 <= width <= MAX_LOGPROBS):
        raise ValueError(f"LoopConfig.logprobs={width}: log-probabilities need the sampling programs "
                         f"(step.sampling=True) and a width in [0, {MAX_LOGPROBS}]")

    def program(target_params, drafter_params, state: DecodeState, inputs: LoopInputs):
        slot = jnp.maximum(inputs.rows, 0)
        zeros_r = jnp.zeros((r,), jnp.int32)
        carry = _Carry(state=state, tokens=jnp.full((r, w), -1, jnp.int32), emitted=zeros_r, target_steps=zeros_r,
                       accepted=jnp.zeros((r, kk), jnp.int32), verified=jnp.zeros((r, kk), jnp.int32),
                       predicted=jnp.zeros((r, kk), jnp.float32), verified_per_step=jnp.full((r, w), -1, jnp.int32),
                       budget_per_step=jnp.zeros((w,), jnp.int32), draft_len_per_step=jnp.zeros((w,), jnp.int32),
                       live_per_step=jnp.zeros((w,), jnp.int32), tokens_per_step=jnp.zeros((w,), jnp.int32),
                       step=jnp.zeros((), jnp.int32),
                       logprobs=None if width is None else (jnp.zeros((r, w), jnp.float32),
                                                            jnp.full((r, w, width), -1, jnp.int32),
                                                            jnp.zeros((r, w, width), jnp.float32)))
        max_steps = jnp.clip(inputs.max_steps, 0, w)

        def live_rows(st: DecodeState):
            return (inputs.rows >= 0) & ~st.done[slot]

        given = inputs.rows >= 0

        # the table's costs at the loop's sizes, once (every plan reads them)
        prepared = (prepare_plan_device(inputs.cost_table, draft_lengths=lengths,
                                        token_buckets=tuple(config.token_buckets), max_rows=r)
                    if mode == "adaptive" else None)

        def cond(c: _Carry):
            ended = inputs.end_on_finish & jnp.any(given & c.state.done[slot])
            return (c.step < max_steps) & jnp.any(live_rows(c.state)) & ~ended

        def refreshes(c: _Carry):
            """Whether this epoch's plan drafts every position again (spec_decode.budget.count_full_drafts)."""
            return full_draft_due(c.state.undrafted_steps, c.state.full_draft_after)

        def choose(c: _Carry):
            """This epoch's plan: ``(budget, branch)`` from the carried (previous step's) confidences."""
            live = live_rows(c.state)
            sched = jnp.where(live, jnp.clip(inputs.limit - c.state.num_emitted[slot] - 1, 0, k), 0)
            n_live = jnp.sum(live, dtype=jnp.int32)
            cap = config.max_total_logit_rows
            last_length = jnp.asarray(len(lengths) - 1, jnp.int32)
            if mode == "adaptive":
                with jax.named_scope("plan"):
                    budget, li = choose_plan_device(c.state.prev_confidences[slot, :k], sched, num_rows=n_live,
                                                    num_sampling_rows=n_live, num_non_draft_tokens=n_live,
                                                    cost_table=inputs.cost_table, max_total_logit_rows=cap,
                                                    draft_lengths=lengths, token_buckets=tuple(config.token_buckets),
                                                    min_predicted_gain=config.min_predicted_gain,
                                                    prepared=prepared, implementation=plan_impl,
                                                    draft_full=refreshes(c))
            elif mode == "fixed":
                budget, li = jnp.maximum(0, jnp.minimum(jnp.sum(sched), cap - n_live)), last_length
            else:
                budget, li = jnp.zeros((), jnp.int32), last_length
            timing = inputs.timing_branch >= 0  # a timing run: the branch and budget are given
            forced = jnp.clip(inputs.timing_branch, 0, len(branches) - 1)
            li = jnp.where(timing, jnp.asarray(branch_length)[forced], li)
            budget = jnp.where(timing, inputs.timing_budget, budget)
            budget = jnp.minimum(budget, jnp.sum(jnp.minimum(sched, jnp.asarray(lengths_arr)[li])))
            # the length's smallest bucket holding the step (its last always does: every row's 1 + K_d)
            first, count = jnp.asarray(offsets_arr)[li], jnp.asarray(counts_arr)[li]
            idx = jnp.arange(len(branches), dtype=jnp.int32)
            fits = (idx >= first) & (idx < first + count) & (jnp.asarray(sizes_arr) >= n_live + budget)
            bucket = jnp.where(jnp.any(fits), jnp.argmax(fits), first + count - 1).astype(jnp.int32)
            return budget, jnp.where(timing, forced, bucket)

        def held(c: _Carry, d: int, planned):
            """``(live, sched, budget, n_live)`` of a step on a branch of draft length ``d`` under the epoch's plan:
            the planned budget clipped to what the live rows may verify now (rows only finish within an epoch, so
            the branch's tokens still hold the step)."""
            live = live_rows(c.state)
            sched = jnp.where(live, jnp.clip(inputs.limit - c.state.num_emitted[slot] - 1, 0, min(k, d)), 0)
            return live, sched, jnp.minimum(planned, jnp.sum(sched)), jnp.sum(live, dtype=jnp.int32)

        def iteration(c: _Carry, fn, t: int, d: int, planned):
            """One step on branch ``(d, t)`` under the epoch's plan."""
            live, sched, budget, n_live = held(c, d, planned)
            plan = StepPlan(rows=jnp.where(live, inputs.rows, -1), prefill_tokens=jnp.zeros((t,), jnp.int32),
                            prefill_len=zeros_r, prefill_start=zeros_r, prefill_last=jnp.zeros((r,), bool),
                            resume_token=jnp.full((r,), -1, jnp.int32), block_tables=inputs.block_tables,
                            scheduled=sched, budget=budget, temperature=inputs.temperature, top_k=inputs.top_k,
                            top_p=inputs.top_p, seed=inputs.seed, limit=inputs.limit, prefill_emitted=zeros_r,
                            stop_ids=inputs.stop_ids, commit=inputs.timing_branch < 0,
                            closed=jnp.asarray(True),  # a wave admits nothing until it ends
                            min_tokens=inputs.min_tokens, min_p=inputs.min_p,
                            repetition_penalty=inputs.repetition_penalty,
                            presence_penalty=inputs.presence_penalty, frequency_penalty=inputs.frequency_penalty)
            with jax.named_scope("step"):
                st, out = fn(target_params, drafter_params, c.state, plan)
            count = jnp.where(live, out.num_emitted, 0)
            cols = jnp.arange(out.tokens.shape[1], dtype=jnp.int32)[None, :]
            dest = jnp.where(cols < count[:, None], c.emitted[:, None] + cols, w)  # w: dropped
            tokens = c.tokens.at[jnp.arange(r)[:, None], dest].set(out.tokens, mode="drop")
            logprobs = None
            if width is not None:  # beside the tokens, column by column; the prompt rows (shaped by the bucket,
                # none in a decode step) are not kept
                lp = out.logprobs
                new = (lp.token_logprobs, lp.token_top_ids[:, :, :width], lp.token_top_logprobs[:, :, :width])
                logprobs = tuple(buf.at[jnp.arange(r)[:, None], dest].set(x, mode="drop")
                                 for buf, x in zip(c.logprobs, new))
            j = jnp.arange(kk, dtype=jnp.int32)[None, :]
            acc = jnp.minimum(out.num_accepted, out.num_emitted)[:, None]
            in_verified = (j < out.num_verified[:, None]) & live[:, None]
            survival = jnp.cumprod(jnp.clip(out.confidences, 0.0, 1.0), axis=1)[:, :kk]
            s = c.step
            return _Carry(
                state=st, tokens=tokens, emitted=c.emitted + count,
                target_steps=c.target_steps + live,
                accepted=c.accepted + ((j < acc) & live[:, None]),
                verified=c.verified + in_verified,
                predicted=c.predicted + jnp.where(in_verified, survival, 0.0) if k else c.predicted,
                verified_per_step=c.verified_per_step.at[:, s].set(jnp.where(live, out.num_verified, -1)),
                budget_per_step=c.budget_per_step.at[s].set(budget),
                draft_len_per_step=c.draft_len_per_step.at[s].set(d),
                live_per_step=c.live_per_step.at[s].set(n_live),
                tokens_per_step=c.tokens_per_step.at[s].set(t),
                step=s + 1,
                logprobs=logprobs,
            )

        def branch(fn, t: int, d: int, below: int):
            def run(c: _Carry, planned):
                # the first epoch of a call is one step: its plan read the confidences the call started with
                # (those the slots got when their prefill finished, not yet their own drafts'); so is an epoch
                # that drafts every position to refresh them: the next plan reads the fresh ones
                one_step = refreshes(c) if mode == "adaptive" else False
                c = iteration(c, fn, t, d, planned)  # the epoch's first step (cond held when it was planned)
                if not config.hold_plans:
                    return c
                steps = jnp.where((c.step == 1) | one_step, 1, jnp.maximum(inputs.plan_interval, 1))

                def going(ic):  # the epoch goes on while the loop does, and while no smaller size of the length
                    # would hold the step (as rows finish, a new plan can take it; a timing run keeps its branch)
                    on = (ic[0] < steps) & cond(ic[1])
                    if below == 0:  # the length's smallest size: none to move down to
                        return on
                    _, _, budget, n_live = held(ic[1], d, planned)
                    return on & ((n_live + budget > below) | (inputs.timing_branch >= 0))

                # the rest of the epoch on the same branch: no plan, no switch (docs/ENGINE.md, "The device loop")
                _, c = jax.lax.while_loop(going, lambda ic: (ic[0] + 1, iteration(ic[1], fn, t, d, planned)), (1, c))
                return c
            return run

        def body(c: _Carry):
            planned, bucket = choose(c)
            return jax.lax.switch(bucket, [branch(fn, t, d, below) for (fn, t, d), below in zip(branches, below_arr)],
                                  c, planned)

        carry = jax.lax.while_loop(cond, body, carry)
        finished = (inputs.rows >= 0) & carry.state.done[slot]
        return carry.state, LoopOutputs(tokens=carry.tokens, num_tokens=carry.emitted,
                                        target_steps=carry.target_steps, accepted_per_position=carry.accepted[:, :k],
                                        verified_per_position=carry.verified[:, :k],
                                        predicted_per_position=carry.predicted[:, :k],
                                        verified_per_step=carry.verified_per_step,
                                        budget_per_step=carry.budget_per_step,
                                        draft_len_per_step=carry.draft_len_per_step,
                                        live_per_step=carry.live_per_step, tokens_per_step=carry.tokens_per_step,
                                        finished=finished, steps=carry.step,
                                        confidences=carry.state.prev_confidences[slot, :k],
                                        fresh_confidences=carry.state.fresh_confidences,
                                        fresh_weight=carry.state.fresh_weight,
                                        undrafted_steps=carry.state.undrafted_steps,
                                        full_draft_after=carry.state.full_draft_after,
                                        **({} if width is None else dict(zip(("token_logprobs", "top_ids",
                                                                              "top_logprobs"), carry.logprobs))))

    return program


def loop_inputs(requests, *, config: LoopConfig, block_tables: np.ndarray, cost_table: CostTableArrays,
                max_steps: int, end_on_finish: bool = False, plan_interval: int = 1) -> LoopInputs:
    """The wave's per-row settings (numpy): row ``s`` is the request in slot ``s``; other rows are -1. Not a
    timing run (the engine's profile sets ``timing_branch`` itself). ``plan_interval``: iterations each plan
    holds for (a loop compiled with ``LoopConfig.hold_plans``; else every iteration plans)."""
    if isinstance(plan_interval, bool) or int(plan_interval) != plan_interval or plan_interval < 1:
        raise ValueError(f"plan_interval must be an integer >= 1, got {plan_interval!r}")
    r = config.rows
    rows = np.full(r, -1, np.int32)
    limit = np.zeros(r, np.int32)
    temperature = np.zeros(r, np.float32)
    top_k = np.zeros(r, np.int32)
    top_p = np.ones(r, np.float32)
    seed = np.zeros(r, np.int32)
    stop_ids = np.full((r, config.num_stop_ids), -1, np.int32)
    tables = np.zeros((r, config.max_blocks), np.int32)
    min_tokens = np.zeros(r, np.int32)
    min_p, presence, frequency = np.zeros(r, np.float32), np.zeros(r, np.float32), np.zeros(r, np.float32)
    repetition = np.ones(r, np.float32)
    for req, table in zip(requests, block_tables):
        s = req.slot
        p = req.params
        rows[s], limit[s] = s, req.limit
        temperature[s], top_k[s], top_p[s], seed[s] = p.temperature, p.top_k, p.top_p, p.seed
        min_tokens[s], min_p[s] = p.min_tokens, p.min_p
        repetition[s], presence[s], frequency[s] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        stop_ids[s, : len(req.stop_ids)] = req.stop_ids
        tables[s] = table
    return LoopInputs(rows=rows, block_tables=tables, limit=limit, temperature=temperature, top_k=top_k,
                      top_p=top_p, seed=seed, stop_ids=stop_ids, max_steps=np.asarray(max_steps, np.int32),
                      cost_table=cost_table, min_tokens=min_tokens, min_p=min_p, repetition_penalty=repetition,
                      presence_penalty=presence, frequency_penalty=frequency,
                      end_on_finish=np.asarray(bool(end_on_finish)), timing_branch=np.asarray(-1, np.int32),
                      timing_budget=np.asarray(0, np.int32), plan_interval=np.asarray(plan_interval, np.int32))


def fill_requests(requests, out: LoopOutputs, k: int) -> None:
    """Fold the program's outputs (numpy) into the wave's requests (their prefill tokens, and those tokens'
    log-probabilities, are already there)."""
    for req in requests:
        s = req.slot
        n = int(out.num_tokens[s])
        req.output.extend(int(x) for x in out.tokens[s, :n])
        if req.logprobs is not None:
            if out.token_logprobs is None:
                raise RuntimeError(f"request {req.index} asks for logprobs: the loop must carry them "
                                   f"(LoopConfig.logprobs)")
            req.logprobs.extend(token_logprobs(out.tokens[s, j], out.token_logprobs[s, j], out.top_ids[s, j],
                                               out.top_logprobs[s, j], req.params.logprobs) for j in range(n))
        add_row_stats(req, out, k)


def add_row_stats(req, out: LoopOutputs, k: int) -> None:
    """Add the verification statistics of ``req``'s row (its slot) in the program's outputs (numpy) to the
    request's: verify steps, accepted / verified / predicted counts per position, verified drafts per step."""
    s = req.slot
    req.target_steps += int(out.target_steps[s])
    for j in range(k):
        req.accepted_per_position[j] += int(out.accepted_per_position[s, j])
        req.verified_per_position[j] += int(out.verified_per_position[s, j])
        req.predicted_per_position[j] += float(out.predicted_per_position[s, j])
    per_step = out.verified_per_step[s]
    req.verified_drafts_per_step.extend(int(x) for x in per_step[per_step >= 0])
