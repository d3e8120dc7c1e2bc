"""One speculative decoding step as a pure function over an explicit state (docs/ENGINE.md).

``step(target_params, drafter_params, state, plan) -> (state, output)`` runs, in one jitted program per shape
bucket:

1. **draft** (decode rows): the DSpark drafter drafts ``K_d <= K`` tokens after each row's anchor (the last emitted
   token), with Markov-corrected draft distributions and per-position confidences (the confidence head after STS,
   the same recalibrated online, or the online estimator's predictions from the draft distributions). ``K_d`` is
   the program's draft length, chosen by the planner: the backbone runs the whole block as trained, the heads
   only the first ``K_d`` slots; ``K_d = 0`` drafts nothing (the drafter's context still follows, step 7);
2. **allocate**: ``caps = allocate_drafts(confidences, scheduled, budget)``: the global top-``budget`` survivals of
   *this* step's confidences. The budget itself was chosen from an *earlier* step's confidences (by the host
   planner, or by the device loop's planner), which is what keeps adaptive verification lossless: a confidence
   depends on the draft before it, so a budget from the current confidences would let a draft influence its own
   admission. In a closed batch (``plan.closed``: no request waits for a slot) the rows with the most tokens left
   (counted in steps of ``1 + K_d`` tokens) win first (``priority``), since the batch ends with its slowest row;
3. **pack** the ragged verify batch on the device: prefill rows first (their prompt chunks come packed from the
   host), then per decode row ``[anchor, d_1 .. d_caps[r]]``; zero-length padding rows last;
4. **verify**: the target's paged forward over the packed tokens (``decode.forward_ragged``), capturing the
   drafter's target layers; logits only for the rows that sample (bounded verify logits);
5. **rejection sampling** (lossless; greedy or stochastic; min_tokens, the penalties, min-p, top-k and top-p
   applied to both distributions at each position, from that position's prefix: the drafts before it included,
   :mod:`spec_decode.penalties`): accepted
   drafts plus one corrected or bonus token per decode row, the first token of a row whose prefill finished
   (emulated acceptance, :mod:`spec_decode.synthetic`: drafts accepted by each request's latent profile instead,
   the target's own token after them);
6. **stop**: emitted tokens are cut after a stop token and at the row's remaining token budget;
7. **commit**: the target cache length grows by the anchor plus the accepted drafts (rejected drafts are rolled
   back by length: their slots are overwritten later); the drafter's context gets the accepted positions' target
   features; the estimator sees the verification outcome.

The state lives per *slot* (``N = max_num_seqs`` slots); the plan maps the step's ``R`` rows (a power-of-two
bucket) to slots. Everything the host decides is in the plan (rows, block tables, prompt chunks, the budget, the
per-row sampling settings); everything the step decides on the device stays there except the small
:class:`StepOutput`, which the host reads back in one transfer. The jitted offline loop runs this same function
inside ``lax.while_loop``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from minimax_jax.cache import PagedCache, init_cache, page_size_for
from minimax_jax.decode import RaggedBatch, forward_ragged
from pallas_kernels.metadata import token_to_request
from spec_decode.allocator import allocate_drafts
from spec_decode.budget import FULL_DRAFT_AFTER, count_full_drafts
from spec_decode.estimator import (
    EstimatorState,
    confidence_feature_from_logits,
    init_estimator,
    predict,
    update,
)
from spec_decode.logprobs import LogprobsOutput, prompt_logit_rows, step_logprobs
from spec_decode.penalties import commit_counts, init_history, penalize_at
from spec_decode.rejection import STREAM_DRAFT, rejection_sample_packed, sampling_key
from spec_decode.sampling_params import filter_logits, mask_min_tokens
from spec_decode.synthetic import emulated_accept_packed, emulated_confidences, request_profiles

__all__ = ["DecodeState", "StepConfig", "StepOutput", "StepPlan", "init_state", "make_step_fn"]

MODES = ("adaptive", "fixed", "none")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of one compiled step (hashable; part of the compilation key).

    ``num_speculative_tokens`` (K) the engine's drafts per decode row and ``draft_len`` (``K_d <= K``, ``None``: K)
    the positions this program drafts; ``mode`` the verification mode; ``confidence`` where adaptive confidences
    come from (``"head"``; ``"calibrated"``: the head's, recalibrated online from the verified positions;
    ``"estimator"``: the online estimator on the draft distributions); ``num_logit_rows`` the verify-logits rows
    materialised (the memory bound), ``implementation`` the kernels. ``sampling``: False compiles the greedy rule
    alone (no draft distributions, no transform of the logits: the greedy rows it serves have no penalty and no
    ``min_tokens``, and min-p / top-k / top-p never change an argmax); True serves every row, greedy rows included
    (temperature <= 0 is greedy per row), with min_tokens, the penalties (per-row settings: off is an identity),
    min-p, top-k and top-p applied to target and draft distributions at each position. A static switch, not a
    ``lax.cond``: on a GPU a conditional makes the host wait for its predicate, which would stall the dispatch of
    the step and with it the async scheduling.
    """

    num_speculative_tokens: int
    mode: str
    confidence: str = "head"
    sampling: bool = False
    num_logit_rows: int = 1
    implementation: str = "auto"
    interpret: bool | None = None
    capture_layers: tuple[int, ...] = ()
    draft_len: int | None = None
    synthetic: tuple[float, ...] | None = None  # emulated acceptance: the K conditional base rates
    synthetic_concentration: float = 10.0
    synthetic_noise: float = 0.0
    mesh: object = None  # tensor parallelism: the target's attention kernels run per device (docs/PARALLELISM.md)


CONFIDENCES = ("head", "calibrated", "estimator")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything that persists between steps, per slot (``N`` slots). Fixed shapes; donated to each step.

    ``num_cached[s]`` tokens of slot ``s`` are in the target cache (and in the drafter's context); the slot's last
    emitted token ``last_token[s]`` is the next anchor, at position ``num_cached[s]``. ``prev_confidences`` are the
    confidences of the slot's latest drafts: what the next budget is planned from. A slot whose prefill just
    finished has drafted nothing yet; it starts at ``fresh_confidences``, the mean confidences of the decode rows
    of recent steps, each step weighted by its rows and by ``FRESH_DECAY`` per decoding step since (1.0 before any
    step has decoded; ``fresh_weight`` is the decayed row count), so a new request competes for the budget at the
    rate the running requests survive instead of outranking them all (docs/ADAPTIVE_VERIFICATION.md, "The first
    plan of a request").
    ``undrafted_steps`` counts the committed steps with decode rows since one last drafted all ``K`` positions:
    the positions a shorter draft length skips keep their confidences, and once the count reaches
    ``full_draft_after`` the plans draft ``K`` again (:func:`spec_decode.budget.count_full_drafts`; a step with any
    decode row in its plan counts, a finished slot's padding row included, so the host counts it from its plans
    alone).
    ``num_emitted[s]`` counts the tokens the slot's request has emitted (those before a preemption included) and
    ``done[s]`` says it has finished: the device holds the truth, so the host can plan a step before it has read
    the previous one back (async scheduling); a decode row whose slot is done is a padding row.
    ``token_counts`` / ``prompt_mask`` (engines with sampling programs) are the slots' token histories the
    penalties read (:mod:`spec_decode.penalties`); the sampling programs update them on commit.
    """

    cache: PagedCache
    draft_cache: object  # minimax_jax DraftCache on the target's pages (k, v [L, H_kv, P, page, D], lengths [N],
    #                      block_tables [N, B]: the target's tables of each slot's latest step) or None ("none")
    num_cached: jax.Array  # int32[N]
    last_token: jax.Array  # int32[N]
    prev_confidences: jax.Array  # f32[N, K]
    fresh_confidences: jax.Array  # f32[K]  what a slot starts at after its prefill (see above)
    fresh_weight: jax.Array  # f32[]      the decayed count of decode rows behind it
    undrafted_steps: jax.Array  # int32[]  decode steps in a row that drafted fewer than K positions (see above)
    full_draft_after: jax.Array  # int32[] how many of them the plans allow before drafting K again
    estimator: EstimatorState | None
    num_emitted: jax.Array  # int32[N]
    done: jax.Array  # bool[N]
    token_counts: jax.Array | None = None  # int32[N, V] output token counts (penalties; None: not kept)
    prompt_mask: jax.Array | None = None  # bool[N, V]  prompt tokens (the repetition penalty)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What the host (or the device loop) decides for one step. ``R`` rows, ``T`` packed token slots.

    Row kinds: a *prefill* row has ``prefill_len > 0`` (a chunk of its prompt, packed at the front of
    ``prefill_tokens`` in row order; prefill rows come first); a *decode* row has a slot and ``prefill_len == 0``
    (it runs only while its slot is not ``done``); a padding row has ``rows == -1``.

    Nothing in a plan depends on the step before it: the anchors, lengths and emitted counts of decode rows are
    read from the device state, and ``scheduled`` is an upper bound the step clips to what the row may still
    emit. So the host can build step ``n + 1`` while step ``n`` runs (``docs/ENGINE.md``, async scheduling).
    """

    rows: jax.Array  # int32[R]        slot of each row, -1 for padding
    prefill_tokens: jax.Array  # int32[T]        prompt chunks of the prefill rows, packed from slot 0
    prefill_len: jax.Array  # int32[R]        chunk length (0: not a prefill row)
    prefill_start: jax.Array  # int32[R]        position of the chunk's first token (a reused slot starts at 0)
    prefill_last: jax.Array  # bool[R]         the chunk ends the prefill: sample the first token, or resume
    resume_token: jax.Array  # int32[R]        >= 0: a recomputed (preempted) row's anchor; the step samples nothing
    block_tables: jax.Array  # int32[R, B]     pages covering every position this step writes
    scheduled: jax.Array  # int32[R]        drafts this decode row may verify (0..K; clipped on the device)
    budget: jax.Array  # int32[]         total drafts verified this step
    temperature: jax.Array  # f32[R]          <= 0: greedy
    top_k: jax.Array  # int32[R]        0: off
    top_p: jax.Array  # f32[R]          1.0: off
    seed: jax.Array  # int32[R]
    limit: jax.Array  # int32[R]        tokens the row's request may emit in all (max_new_tokens, length limit)
    prefill_emitted: jax.Array  # int32[R]  prefill rows: tokens the request emitted before (a preempted one's)
    stop_ids: jax.Array  # int32[R, M]     tokens that end the row (-1 padded)
    commit: jax.Array  # bool[]          False: a timing run that leaves lengths and tokens unchanged
    # a closed batch: no request waits for a slot, so the budget goes to the rows with most tokens left first
    # (spec_decode.allocator); None or False: by survival alone
    closed: jax.Array | None = None  # bool[]
    # log-probabilities (spec_decode.logprobs; None: no prompt rows, as in the device loop)
    prompt_logprobs: jax.Array | None = None  # bool[R]  this prefill chunk scores its prompt positions
    next_prompt_token: jax.Array | None = None  # int32[R] the prompt token after the chunk (its last row's target)
    # the sampling programs' per-row transforms (None: off for every row)
    min_tokens: jax.Array | None = None  # int32[R]  stop ids masked until this many tokens were emitted
    min_p: jax.Array | None = None  # f32[R]    0: off
    repetition_penalty: jax.Array | None = None  # f32[R]    1.0: off
    presence_penalty: jax.Array | None = None  # f32[R]    0: off
    frequency_penalty: jax.Array | None = None  # f32[R]    0: off


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What the host reads back after a step (one transfer)."""

    tokens: jax.Array  # int32[R, K+1]   emitted tokens (-1 padded), cut after a stop token / the budget
    num_emitted: jax.Array  # int32[R]
    num_accepted: jax.Array  # int32[R]        accepted drafts (before the cut)
    num_verified: jax.Array  # int32[R]        drafts verified (the allocator's caps)
    confidences: jax.Array  # f32[R, K]       this step's confidences (the next budget's input)
    finished: jax.Array  # bool[R]         a stop token was emitted or the budget is used up
    logprobs: LogprobsOutput | None = None  # sampling programs only (spec_decode.logprobs)


def init_state(target, drafter, *, num_slots: int, num_pages: int, max_model_len: int, num_speculative_tokens: int,
               use_estimator: bool, cache_dtype=None, confidence: str = "head", penalties: bool = False
               ) -> DecodeState:
    """A fresh :class:`DecodeState`: empty caches, every slot empty (confidences 1.0, and 1.0 for a slot's start
    until a step has decoded).

    ``use_estimator`` (or ``confidence="calibrated"``) keeps an online estimator in the state; for
    ``"calibrated"`` it starts as the identity on the head's confidences (slope 1, intercepts 0). ``penalties``
    keeps the per-slot token histories the penalties read (``5 N V`` bytes, :mod:`spec_decode.penalties`).

    The drafter's context cache shares the target's page pool: ``num_pages`` pages of the target's page size,
    block tables ``[num_slots, cdiv(max_model_len, page)]`` (the plans' width) that each step fills with the
    target's tables of its slots, so no second allocator exists."""
    cfg = target.cfg
    dtype = target.dtype if cache_dtype is None else cache_dtype
    k = num_speculative_tokens
    draft_cache = None
    if drafter is not None and k > 0:
        draft_cache = drafter.init_cache(num_slots, max_model_len, dtype=dtype, page_size=page_size_for(cfg),
                                         num_pages=num_pages)
    return DecodeState(
        cache=init_cache(cfg, num_pages, dtype=dtype),
        draft_cache=draft_cache,
        num_cached=jnp.zeros((num_slots,), jnp.int32),
        last_token=jnp.zeros((num_slots,), jnp.int32),
        prev_confidences=jnp.ones((num_slots, max(k, 1)), jnp.float32),
        fresh_confidences=jnp.ones((max(k, 1),), jnp.float32),
        fresh_weight=jnp.zeros((), jnp.float32),
        undrafted_steps=jnp.zeros((), jnp.int32),
        full_draft_after=jnp.asarray(FULL_DRAFT_AFTER, jnp.int32),
        # distinct buffers for every leaf: the state is donated, and one buffer may not be donated twice
        estimator=(jax.tree.map(jnp.copy, init_estimator(k, **_ESTIMATOR_INIT[confidence]))
                   if (use_estimator or confidence == "calibrated") and k > 0 else None),
        num_emitted=jnp.zeros((num_slots,), jnp.int32),
        done=jnp.zeros((num_slots,), bool),
        **(dict(zip(("token_counts", "prompt_mask"), init_history(num_slots, cfg.vocab_size))) if penalties else {}),
    )


FRESH_DECAY = 0.9  # per decoding step: the weight of an earlier step's rows in ``fresh_confidences``


def fold_fresh_confidences(fresh, weight, conf_sum, rows, xp=jnp):
    """``(fresh_confidences, fresh_weight)`` after a step whose ``rows`` decode rows' confidences sum to
    ``conf_sum`` (per position): the row-weighted mean with every earlier step's weight decayed by
    ``FRESH_DECAY``. A step without decode rows changes nothing. ``xp``: ``jnp`` (the step) or ``numpy`` (the
    host's mirror, :class:`spec_decode.scheduler.Scheduler`)."""
    kept = weight * FRESH_DECAY
    new_weight = kept + rows
    mean = (fresh * kept + conf_sum) / xp.maximum(new_weight, 1e-30)
    return xp.where(rows > 0, mean, fresh), xp.where(rows > 0, new_weight, weight)


# the estimator's start: its own defaults on draft features; the identity when recalibrating the head's confidences
_ESTIMATOR_INIT = {"head": {}, "estimator": {}, "calibrated": {"slope": 1.0, "intercept": 0.0}}


def _head_feature(confidences: jax.Array) -> jax.Array:
    """The recalibration's feature: the logit of the head's confidence (clamped away from 0 and 1)."""
    c = jnp.clip(confidences, 1e-6, 1.0 - 1e-6)
    return jnp.log(c) - jnp.log1p(-c)


def _scatter(values: jax.Array, slots: jax.Array, new: jax.Array, keep: jax.Array) -> jax.Array:
    """``values[slots[r]] = new[r]`` where ``keep[r]``; other rows (padding, not committed) are dropped."""
    n = values.shape[0]
    return values.at[jnp.where(keep, slots, n)].set(new.astype(values.dtype), mode="drop")


def _stop(tokens, num_emitted, stop_ids, max_emit):
    """Cut each row's emitted tokens after the first stop token and at ``max_emit``: (count, finished).

    ``tokens int32[R, K+1]`` (-1 padded), ``stop_ids int32[R, M]`` (-1 padded, never matches a token)."""
    k1 = tokens.shape[1]
    idx = jnp.arange(k1, dtype=jnp.int32)[None, :]
    live = (idx < num_emitted[:, None]) & (tokens >= 0)
    is_stop = jnp.any(tokens[:, :, None] == stop_ids[:, None, :], axis=-1) & live
    first_stop = jnp.min(jnp.where(is_stop, idx, k1), axis=1)  # k1: no stop token
    count = jnp.clip(jnp.minimum(num_emitted, first_stop + 1), 0, jnp.maximum(max_emit, 0))
    finished = (num_emitted > 0) & ((first_stop < count) | (count >= max_emit))
    return count, finished


def _transform(plan: StepPlan, state: DecodeState, slot: jax.Array, emitted: jax.Array, r: int, *, mesh=None):
    """The sampling programs' logit transform at a set of positions (draft slots or verify rows), in vLLM's order:
    the penalties, ``min_tokens`` (stop ids masked), then min-p, top-k, top-p.

    ``transform(scaled f32[P, V], rows int32[P], num_before int32[P], drafts int32[P, D], temps f32[P])``: the
    logits of ``P`` positions already divided by their row's temperature (1 for greedy rows), the plan row of
    each, how many of its row's ``drafts`` come before it; the row's emitted count plus ``num_before`` is the
    number of output tokens before the position. A plan without the transform fields has them off. ``mesh``:
    min-p, top-k and top-p run on the vocabulary shards (``filter_logits``)."""
    def field(x, fill, dtype):
        return jnp.full((r,), fill, dtype) if x is None else x

    min_tokens = field(plan.min_tokens, 0, jnp.int32)
    min_p = field(plan.min_p, 0.0, jnp.float32)
    repetition = field(plan.repetition_penalty, 1.0, jnp.float32)
    frequency = field(plan.frequency_penalty, 0.0, jnp.float32)
    presence = field(plan.presence_penalty, 0.0, jnp.float32)

    def transform(scaled, rows, num_before, drafts, temps):
        if state.token_counts is not None:  # the penalties (an identity for rows with them off)
            scaled = penalize_at(scaled, state.token_counts, state.prompt_mask, slot[rows], drafts, num_before,
                                 repetition[rows], frequency[rows], presence[rows], temps)
        scaled = mask_min_tokens(scaled, emitted[rows] + num_before, min_tokens[rows], plan.stop_ids[rows])
        return filter_logits(scaled, plan.top_k[rows], plan.top_p[rows], min_p[rows], mesh=mesh)

    return transform


def _draft_cache_for(state: DecodeState, plan: StepPlan, slots: jax.Array):
    """The draft cache with the plan's block tables installed for the step's ``slots`` (-1: padding rows).

    Static checks name the mismatch: the draft pool must be the target's (same page size and page count) and
    the plan's tables as wide as the draft cache's."""
    dc, cache = state.draft_cache, state.cache
    if (dc.page_size, dc.num_pages) != (cache.page_size, cache.num_pages):
        raise ValueError(f"the draft cache ({dc.num_pages} pages of {dc.page_size}) must share the target's page "
                         f"pool ({cache.num_pages} pages of {cache.page_size}): build it with init_state")
    if plan.block_tables.shape[1] != dc.max_blocks:
        raise ValueError(f"plan.block_tables has width {plan.block_tables.shape[1]}, the draft cache's tables "
                         f"{dc.max_blocks} (cdiv(max_model_len, page)): both come from the same max_model_len")
    return dc.with_block_tables(plan.block_tables, slots)


def _pad_positions(features: jax.Array, k: int) -> jax.Array:
    """``f32[R, K_d]`` features to the estimator's ``K`` positions (the undrafted ones are never verified, so never
    observed: their value does not matter)."""
    return jnp.pad(features, ((0, 0), (0, k - features.shape[1])))


def _estimator_feature(scaled_logits: jax.Array) -> jax.Array:
    """The estimator's feature of a draft distribution: ``logit(max q)`` of the (already scaled) logits."""
    return confidence_feature_from_logits(scaled_logits, 1.0)


def make_step_fn(target, drafter, config: StepConfig):
    """The pure step ``(target_params, drafter_params, state, plan) -> (state, StepOutput)`` for ``config``.

    ``target`` / ``drafter`` are only used for their graph definitions (split once); their parameters are
    arguments of the returned function, so compiled programs do not embed the weights. The caller jits it
    (the engine donates ``state``; the device loop calls it inside ``lax.while_loop``).
    """
    if config.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {config.mode!r}")
    if config.confidence not in CONFIDENCES:
        raise ValueError(f"confidence must be one of {CONFIDENCES}, got {config.confidence!r}")
    k = config.num_speculative_tokens
    kd = k if config.draft_len is None or config.draft_len < 0 else int(config.draft_len)
    if not 0 <= kd <= k:
        raise ValueError(f"draft_len must be in [0, K={k}], got {config.draft_len}")
    synthetic = config.synthetic is not None and k > 0
    if synthetic and len(config.synthetic) != k:
        raise ValueError(f"synthetic needs K = {k} conditional rates, got {len(config.synthetic)}")
    online = config.confidence in ("estimator", "calibrated") and not synthetic  # emulated: nothing to learn
    tgraph, _ = nnx.split(target)
    dgraph = nnx.split(drafter)[0] if (drafter is not None and k > 0) else None
    capture = tuple(i for i in config.capture_layers if i >= 0)
    embed_feature = -1 in config.capture_layers

    def step(target_params, drafter_params, state: DecodeState, plan: StepPlan):
        tgt = nnx.merge(tgraph, target_params)
        r = plan.rows.shape[0]
        t = plan.prefill_tokens.shape[0]
        vocab = tgt.cfg.vocab_size
        slot = jnp.maximum(plan.rows, 0)
        is_prefill = (plan.rows >= 0) & (plan.prefill_len > 0)
        is_decode = (plan.rows >= 0) & ~is_prefill & ~state.done[slot]  # a finished slot's row is padding
        active = is_prefill | is_decode
        num_cached = jnp.where(is_prefill, plan.prefill_start, jnp.where(active, state.num_cached[slot], 0))
        emitted = jnp.where(is_prefill, plan.prefill_emitted, state.num_emitted[slot])
        max_emit = jnp.where(active, plan.limit - emitted, 0)  # tokens the row may still emit
        anchor = jnp.where(is_decode, state.last_token[slot], 0)
        sampled = config.sampling
        safe_temp = jnp.where(plan.temperature <= 0.0, 1.0, plan.temperature)
        if sampled:
            transform = _transform(plan, state, slot, emitted, r, mesh=config.mesh)

        # ---- 1. draft (K_d of the K positions; K_d = 0: none)
        with jax.named_scope("install_tables"):
            if k > 0:
                drafter = nnx.merge(dgraph, drafter_params)
                # the draft cache lives on the target's pages: this step's slots take the plan's block tables
                dc = _draft_cache_for(state, plan, jnp.where(active, slot, -1))
        with jax.named_scope("draft"):
            if kd > 0:
                # each decode row drafts from its slot's context, read in place (no per-step copy of the cache);
                # other rows see no context
                h = drafter.block_hidden(dc, anchor, num_cached,
                                         cache_rows=jnp.where(is_decode, slot, -1),
                                         implementation="reference" if config.implementation == "reference" else "auto",
                                         interpret=config.interpret, mesh=config.mesh)
                estimator = config.confidence == "estimator"

                keys = jax.vmap(lambda s, p: sampling_key(s, p, STREAM_DRAFT))(plan.seed, num_cached)
                d = drafter.sample_block(
                    h, anchor, plan.temperature, keys if sampled else None, return_probs=sampled,
                    logit_filter=(lambda x, drafted: transform(x, jnp.arange(r), jnp.sum(drafted >= 0, axis=1), drafted,
                                                               safe_temp)) if sampled else None,
                    feature_fn=_estimator_feature if estimator else None, num_drafts=kd)
                drafts = d.tokens
                draft_probs = d.probs if sampled else None
                features = None
                if estimator:
                    features = d.features
                elif config.confidence == "calibrated":
                    features = _head_feature(d.confidences)
                conf = predict(state.estimator, _pad_positions(features, k))[:, :kd] if online else d.confidences
                if synthetic:  # each request's latent profile: the acceptance probabilities and the confidences
                    profiles = request_profiles(plan.seed, config.synthetic, concentration=config.synthetic_concentration)
                    conf = emulated_confidences(profiles, plan.seed, noise=config.synthetic_noise)[:, :kd]
                conf = jnp.where(is_decode[:, None], conf, 0.0)
                sched = jnp.where(is_decode, jnp.clip(jnp.minimum(plan.scheduled, max_emit - 1), 0, kd), 0)
                alloc_conf = conf if config.mode == "adaptive" else jnp.ones_like(conf)
                priority = None
                if config.mode == "adaptive" and plan.closed is not None:
                    # tokens left, in whole steps of 1 + K_d: rows within a step of each other compete by survival
                    priority = jnp.where(plan.closed & is_decode, max_emit // (1 + kd), 0)
                with jax.named_scope("allocate"):
                    caps = allocate_drafts(alloc_conf, sched, plan.budget, priority)
            else:
                drafts = jnp.zeros((r, 0), jnp.int32)
                draft_probs = jnp.zeros((r, 0, vocab), jnp.float32) if sampled else None  # no drafts: plain sampling
                features = None
                conf = jnp.zeros((r, 0 if k else 1), jnp.float32)
                caps = jnp.zeros((r,), jnp.int32)

        # ---- 2. pack: prefill chunks (host-packed, rows first) then [anchor, drafts] per decode row
        with jax.named_scope("pack"):
            q_len = jnp.where(is_prefill, plan.prefill_len, jnp.where(is_decode, 1 + caps, 0))
            qsl = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_len, dtype=jnp.int32)])
            dec_tokens = jnp.concatenate([anchor[:, None], drafts], axis=1)
            offs = jnp.arange(kd + 1, dtype=jnp.int32)[None, :]
            place = is_decode[:, None] & (offs <= caps[:, None])
            dest = jnp.where(place, qsl[:-1, None] + offs, t)
            input_ids = plan.prefill_tokens.at[dest.reshape(-1)].set(dec_tokens.reshape(-1), mode="drop")
            seq_lens = jnp.where(active, num_cached + q_len, 0)
            batch = RaggedBatch(input_ids, qsl, seq_lens, plan.block_tables)

        # ---- 3. verify
        with jax.named_scope("verify"):
            hidden, captured, cache = forward_ragged(tgt, state.cache, batch, capture_layers=capture,
                                                     implementation=config.implementation, interpret=config.interpret,
                                                     mesh=config.mesh)
            samples_first = is_prefill & plan.prefill_last & (plan.resume_token < 0)
            n_logit = jnp.where(is_decode, 1 + caps, jnp.where(samples_first, 1, 0))
            lqsl = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n_logit, dtype=jnp.int32)])
            nl = config.num_logit_rows
            lrow = token_to_request(lqsl, nl)
            lr = jnp.maximum(lrow, 0)
            li = jnp.arange(nl, dtype=jnp.int32) - lqsl[lr]
            src = jnp.where(is_decode[lr], qsl[lr] + li, qsl[lr + 1] - 1)
            src = jnp.clip(jnp.where(lrow >= 0, src, 0), 0, t - 1)
            scores_prompt = sampled and plan.prompt_logprobs is not None
            if scores_prompt:  # prompt-logprob rows after the sampler's (spec_decode.logprobs)
                src, p_owner, p_offset = prompt_logit_rows(src, lqsl, qsl, is_prefill=is_prefill,
                                                           prompt_logprobs=plan.prompt_logprobs,
                                                           prefill_len=plan.prefill_len, prefill_last=plan.prefill_last)
            logits = tgt.logits(hidden[src])  # [NL, V] float32
            raw_logits = logits  # before the transforms: prompt log-probabilities read these (spec_decode.logprobs)
            if sampled:  # greedy programs skip the transforms: their rows have none that changes an argmax
                # verify row li of a decode row follows the anchor and drafts 1..li: its prefix, penalties included
                row_t = safe_temp[lr]
                before = jnp.where(is_decode[lr], jnp.maximum(li, 0), 0)
                logits = transform(logits / row_t[:, None], lr, before, drafts[lr], row_t) * row_t[:, None]

        # ---- 4. rejection sampling (prefill-final rows: zero drafts, the bonus is the first token)
        with jax.named_scope("rejection"):
            anchor_pos = jnp.where(is_decode, num_cached, num_cached + plan.prefill_len - 1)

            if synthetic and kd > 0:
                rej = emulated_accept_packed(logits, lqsl, drafts, profiles[:, :kd], plan.seed, anchor_pos,
                                             temperature=plan.temperature if sampled else 0.0, row_mask=n_logit > 0,
                                             mesh=config.mesh)
            else:  # on a mesh: on the vocabulary shards the LM head left the logits on (docs/PARALLELISM.md)
                rej = rejection_sample_packed(logits, lqsl, drafts, draft_probs, plan.seed, anchor_pos,
                                              temperature=plan.temperature if sampled else 0.0, row_mask=n_logit > 0,
                                              mesh=config.mesh)
            num_acc = jnp.where(is_decode, rej.num_accepted, 0)

        # ---- 5. stop (outputs padded to the engine's K + 1 columns whatever K_d)
        with jax.named_scope("bookkeeping"):
            out_tokens = jnp.pad(rej.output_tokens, ((0, 0), (0, k - kd)), constant_values=-1)
            count, finished = _stop(out_tokens, rej.num_emitted, plan.stop_ids, max_emit)
            finished = finished & active
            col = jnp.arange(out_tokens.shape[1], dtype=jnp.int32)[None, :]
            tokens = jnp.where(col < count[:, None], out_tokens, -1)

            # ---- 6. commit
            commit = plan.commit & active
            new_cached = jnp.where(is_decode, num_cached + 1 + num_acc, num_cached + plan.prefill_len)
            resumes = is_prefill & plan.prefill_last & (plan.resume_token >= 0)
            last = jnp.take_along_axis(rej.output_tokens, jnp.maximum(rej.num_emitted - 1, 0)[:, None], axis=1)[:, 0]
            last = jnp.where(resumes, plan.resume_token, last)
            new_state = dict(
                cache=cache,
                num_cached=_scatter(state.num_cached, slot, new_cached, commit),
                last_token=_scatter(state.last_token, slot, last, commit & ((rej.num_emitted > 0) | resumes)),
                num_emitted=_scatter(state.num_emitted, slot, emitted + count, commit),
                done=_scatter(state.done, slot, finished, commit),
            )
            if sampled and state.token_counts is not None:  # the emitted tokens join the history penalties read
                new_state["token_counts"] = commit_counts(state.token_counts, slot, tokens,
                                                          commit & (is_decode | samples_first))
            if k > 0:
                # positions past K_d were not drafted: they keep their last confidences (the next plan's input)
                conf = jnp.concatenate([conf, state.prev_confidences[slot, kd:k]], axis=1)
                # a row that just prefilled starts at the running requests' mean (this step's committed decode
                # rows folded into the decayed mean of earlier steps'), never at anything of its own drafts
                decoded = commit & is_decode
                fresh, weight = fold_fresh_confidences(state.fresh_confidences, state.fresh_weight,
                                                       jnp.sum(jnp.where(decoded[:, None], conf, 0.0), axis=0),
                                                       jnp.sum(decoded).astype(jnp.float32))
                new_state.update(fresh_confidences=fresh, fresh_weight=weight)
                # a step that drafted every position refreshed them all; a shorter one left some stale
                planned = plan.commit & jnp.any((plan.rows >= 0) & ~is_prefill)
                new_state["undrafted_steps"], new_state["full_draft_after"] = count_full_drafts(
                    state.undrafted_steps, state.full_draft_after, decoded=planned, full=kd == k)
                prev_conf = jnp.where(is_decode[:, None], conf, fresh[None, :])
                new_state["prev_confidences"] = _scatter(state.prev_confidences, slot, prev_conf,
                                                         commit & (is_decode | (is_prefill & plan.prefill_last)))
                # drafter context: the anchor and accepted drafts of decode rows, the whole chunk of prefill rows
                feats = list(captured)
                if embed_feature:
                    emb = jnp.where((token_to_request(qsl, t) >= 0)[:, None], tgt.embed(input_ids), 0)
                    feats = [emb if i < 0 else feats.pop(0) for i in config.capture_layers]
                features_cat = jnp.concatenate(feats, axis=-1).astype(drafter.dtype)
                num_new = jnp.where(is_decode, 1 + num_acc, jnp.where(is_prefill, plan.prefill_len, 0))
                num_new = jnp.where(commit, num_new, 0)
                treq = token_to_request(qsl, t)
                tr = jnp.maximum(treq, 0)
                ti = jnp.arange(t, dtype=jnp.int32) - qsl[tr]
                write = (treq >= 0) & (ti < num_new[tr])
                lengths = _scatter(dc.lengths, slot, num_cached + num_new, commit)
                new_state["draft_cache"] = drafter.write_context(dc, features_cat, jnp.where(write, slot[tr], -1),
                                                                 num_cached[tr] + ti, lengths)
                if online:
                    if features is None:  # K_d = 0: nothing verified, nothing to learn
                        features = jnp.zeros((r, 0), jnp.float32)
                    est = update(state.estimator, _pad_positions(features, k), num_acc,
                                 jnp.where(commit & is_decode, caps, 0))
                    # a timing run (commit False) leaves the estimator untouched (not even its step counter)
                    new_state["estimator"] = jax.tree.map(lambda a, b: jnp.where(plan.commit, a, b), est,
                                                          state.estimator)
            state = dataclasses.replace(state, **new_state)
        with jax.named_scope("logprobs"):
            logprobs = None
            if sampled:  # the target's log-probabilities at the verify positions (and prompt rows)
                if not scores_prompt:
                    p_owner = p_offset = jnp.full((nl,), -1, jnp.int32)
                logprobs = step_logprobs(raw_logits, logits, temperature=plan.temperature, lr=lr, lqsl=lqsl,
                                         out_tokens=out_tokens, prompt_owner=p_owner, prompt_offset=p_offset,
                                         prefill_tokens=input_ids, qsl=qsl, prefill_len=plan.prefill_len,
                                         next_prompt_token=(plan.next_prompt_token if scores_prompt
                                                            else jnp.zeros((r,), jnp.int32)), mesh=config.mesh)
        out = StepOutput(tokens=tokens, num_emitted=count, num_accepted=num_acc, num_verified=caps,
                         confidences=conf, finished=finished, logprobs=logprobs)
        return state, out

    return step
