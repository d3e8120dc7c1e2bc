"""The speculative generation engine: continuous batching over a closed set of compiled steps.

``Engine(target, drafter).generate(prompts)`` runs DSpark speculative decoding with adaptive verification. The
host loop reads top to bottom (``docs/ENGINE.md`` draws it):

1. :meth:`Engine.warmup` (the first call does it) compiles every program the engine can run, a closed set derived
   from its settings (:mod:`spec_decode.buckets`, :mod:`spec_decode.programs`), and profiles the cost table the
   :class:`~spec_decode.planner.Planner` plans from. Nothing compiles after it, whatever the prompts.
2. Each step: the :class:`~spec_decode.scheduler.Scheduler` plans it (admission, prefix cache, chunked prefill,
   pages, preemption, the planner's budget) into a host :class:`~spec_decode.step.StepPlan`; the program of its
   :class:`~spec_decode.buckets.StepKey` runs it on the device (draft -> allocate -> pack -> verify -> rejection
   sampling -> stop -> commit -> drafter context -> estimator), the state donated; its small
   :class:`~spec_decode.step.StepOutput` is copied back asynchronously.
3. With ``async_scheduling`` (default) the host plans and launches step ``n + 1`` before it reads step ``n``
   back, from upper bounds (the device holds the truth); then it folds step ``n`` into the requests
   (``Scheduler.commit``) and hands its tokens to ``stream`` consumers.

``verification="adaptive"`` verifies the budget's worth of drafts with the best survival, ``"fixed"`` verifies
``K`` per request, ``"none"`` decodes one token per step through the same paged path (no drafter).

One engine is one device state: callers are serialised. A second ``generate``/``stream`` from another thread
waits for the running one; one from the thread whose ``stream`` is still open is refused with a RuntimeError
(it would reuse that stream's slots). Bad input raises ``ValueError`` naming the problem before any device work,
and a refused call leaves the engine as it was.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax import sharding
from minimax_jax.cache import cache_bytes_per_page, page_size_for
from minimax_jax.decode import choose_implementation
from minimax_jax.draft_cache import draft_cache_bytes_per_page
from spec_decode import compilation_cache as persistent_cache
from spec_decode.buckets import StepKey, default_draft_lengths, logit_rows, step_keys, token_bucket
from spec_decode.budget import FULL_DRAFT_AFTER
from spec_decode.cost_table import CostTable, CostTableArrays, load_cost_table, save_cost_table
from spec_decode.device_loop import (
    LoopConfig,
    fill_requests,
    logprobs_width,
    loop_inputs,
    loop_outputs_layout,
    make_loop_fn,
    pack_loop_inputs,
    packed_program,
)
from spec_decode.executable_store import (
    ExecutableStore,
    abstract,
    live_code,
    program_digest,
    recall,
    remember,
)
from spec_decode.logprobs import ScoreResult
from spec_decode.page_pool import PagePool
from spec_decode.penalties import write_history
from spec_decode.planner import Planner
from spec_decode.programs import (
    CompileReport,
    StepPrograms,
    compile_counter,
    compile_in_pool,
    on_mesh,
    pack_plan,
)
from spec_decode.request import SAMPLING_KEYWORDS, Request, build_requests, encode_prompt
from spec_decode.results import GenerationResult, GenerationResults, VerifySteps, request_result, run_stats
from spec_decode.sampling_params import SamplingParams
from spec_decode.scheduler import ScheduledBurst, ScheduledStep, Scheduler
from spec_decode.step import CONFIDENCES, MODES, DecodeState, StepConfig, StepPlan, init_state
from spec_decode.synthetic import acceptance_rates, conditional_rates
from spec_decode.transfer import PackedLayout, unpack_host

__all__ = ["Engine", "GenerationResult", "GenerationResults", "generate_offline"]

# the cost table's profile: rounds over every program
PROFILE_REPEATS = 5
# the device loop's iterations per plan (Engine(device_loop_plan_interval=...); docs/ENGINE.md, "The device loop"):
# 8 since session 39: a shorter iteration than 4's at 1, 8, 64, 256 and 512 requests on an H100 (docs/BENCHMARKS.md)
DEVICE_LOOP_PLAN_INTERVAL = 8
# inside the device loop: a timed branch runs 1 and 1 + n iterations, n the smallest that fills this many
# seconds (from a first estimate of the largest branch), within PROFILE_LOOP_STEPS
PROFILE_LOOP_SECONDS = 0.02
PROFILE_LOOP_STEPS = (4, 32)
# an engine without a device loop: host-launched steps back to back per timed call
PROFILE_STEPS_PER_CALL = 3
# how the cost table is profiled (part of its cache key: a table profiled another way is profiled again)
COST_PROFILE_VERSION = "profile 3: the device loop's branches timed inside the loop"
# (cost-table key, live code) -> the table an engine of this process profiled or loaded: a second engine with the
# same settings (a notebook cell re-run, another verification run beside it) plans from it instead of profiling
# again, with or without the cache on disk (one process only: a multi-process profile runs on every process)
_profiled_tables: dict[tuple[str, str], CostTable] = {}


def _compile_order(name) -> tuple:
    """Warm-up compiles the longest programs first (they start first and do not trail the rest): the device loops
    (a step per token bucket in one program), then the sampling step programs, then the greedy ones, larger token
    buckets first, then the history writer."""
    if isinstance(name, StepKey):
        return 1, not name.sampling, -name.tokens
    return (0, False, 0) if isinstance(name, tuple) else (2, False, 0)


class Engine:
    """DSpark speculative decoding with adaptive verification over a paged MiniMax-M3 target.

    Args:
      target: a :class:`minimax_jax.MiniMaxM3ForCausalLM`.
      drafter: its :class:`minimax_jax.DSparkDrafter` (sharing the target's embeddings and LM head); may be None
        with ``verification="none"``.
      num_speculative_tokens: K, drafts per request and step (1..the drafter's block size; 0 with ``"none"``).
      verification: ``"adaptive"`` (the confidence head, or the online estimator for a drafter without one),
        ``"fixed"`` (every request verifies its K drafts) or ``"none"`` (plain decoding, one token per step).
      max_num_seqs: slots: requests decoded concurrently (more prompts than slots are admitted as slots free;
        the device loop decodes in waves of at most this many).
      max_model_len: longest sequence (prompt + output); default the target's ``max_position_embeddings``
        capped at 4096.
      num_pages / memory_fraction: the KV page pool (the target's K/V and the drafter's context K/V share it:
        one page id holds both): an explicit page count, or a fraction of the accelerator's free memory;
        default: enough pages for every slot at ``max_model_len`` (no preemption).
      max_num_batched_tokens: prefill tokens per step (chunked prefill).
      max_total_logit_rows: bound on the verify-logits rows per step (``rows x V`` float32); the planner and
        the fixed mode respect it at any concurrency (fixed K verifies fewer drafts, evenly, when it binds).
      cost_table: what adaptive verification trades acceptance against: ``"profile"`` (default: every program
        of the closed set is timed at warm-up, unless an engine of this process or the cache on disk has a table
        for the same settings), a :class:`CostTable`, or ``None`` (flat: verify everything).
      draft_lengths: the draft lengths ``K_d`` adaptive verification chooses from each step (each one a set of
        programs of the closed set): default ``(0, 3, K)`` with a profiled table, the table's own lengths
        with a given one, else ``(K,)``; ``(K,)`` holds the draft length at K (only the verified count adapts).
        Fixed and none verification draft K (none: 0) always.
      confidence: where adaptive confidences come from: ``"head"`` (the drafter's confidence head after STS),
        ``"calibrated"`` (the head's, recalibrated online from the verified positions: a per-position Platt fit
        refit every 100 steps), ``"estimator"`` (the online estimator on the draft distributions; the only
        choice for a drafter without a head). Default: ``"head"`` when the drafter has one.
      sampling: compile the sampling programs (default); ``False`` compiles the greedy ones alone (half the
        programs: greedy offline batch decoding) and refuses a request with a temperature above 0.
      synthetic_acceptance_rates / synthetic_acceptance_length: **emulated acceptance** for benchmarks on models
        whose acceptance means nothing (random weights): ``K`` unconditional rates ``P(the first k drafts are
        accepted)``, or an acceptance length ``L`` (:mod:`spec_decode.synthetic`). Each request draws a latent
        profile around them (``synthetic_concentration``, default 10), which serves as its acceptance probabilities
        and its confidences (``synthetic_confidence_noise`` > 0 miscalibrates the confidences on purpose). The
        outputs are not the target's; the statistics say ``acceptance="emulated"``.
      tensor_parallel_size / mesh: tensor parallelism (docs/PARALLELISM.md) over the first N devices, or over the
        ``"tensor"`` axis of a given ``jax.sharding.Mesh``: the target's heads, MLP columns, experts and vocabulary
        split over it (KV and index heads replicated first where N exceeds them: a new module), the drafter's
        draft layers likewise, the KV pages split by head; the target's attention kernels and experts run per
        device (``shard_map``), XLA partitions the rest. The given modules' parameters are placed on the mesh
        (moved, not changed).
      tokenizer: encodes string prompts and decodes outputs (``encode(str) -> list[int]``, ``decode(ids)``).
      implementation / interpret: the kernels (``decode.choose_implementation``).
      min_token_bucket: the smallest packed-token bucket of the closed set.
      draft_length_buckets: the packed-token sizes each draft length below ``K`` compiles: the largest ones up to
        the size holding every slot's ``1 + K_d`` tokens (``K`` has every size; ``spec_decode/buckets.py``). More
        let a shorter length serve the tail of a wave, where few rows decode, at a small size; each adds a step
        program per shorter length and sampling mode, and a branch to the greedy device loop. Length 0 keeps at
        most two (``spec_decode.buckets.ZERO_LENGTH_BUCKETS``: drafting nothing is for full batches).
      device_loop_token_buckets: verify sizes compiled into the greedy device loop (``loop="device"``), per
        draft length: the largest decode buckets of the closed set; each is one branch of the loop's program.
      device_loop_sampling_token_buckets: the same for the sampling device loop (waves with a sampled row), at
        most ``device_loop_token_buckets``. Default 1: per draft length the size holding every slot's drafts, so
        the sampling loop, the largest program of the warm-up, compiles and loads fastest (a sampled wave whose
        plan trims verification still pays that size; docs/ENGINE.md, "The device loop: jitted offline batch
        decoding").
      max_stop_token_ids: stop ids a request may have (EOS included); part of every program's shape.
      enable_prefix_caching: requests that share a prompt prefix share its full pages (``docs/ENGINE.md``).
      async_scheduling: plan and launch each step before the previous one is read back (default); ``False``
        reads every step back before planning the next.
      decode_steps_per_launch: the host loop's **multi-step launches** (``M``): while every running request
        decodes and no waiting request could be admitted, launch several decode steps at once through the device
        loop's program (one launch and one read-back for all of them; ``docs/ENGINE.md``). A stream's first
        such launch after a single step runs ``M`` steps, each next one four times as many, up to ``16 M``, and
        the stream receives a request's tokens a launch at a time; ``generate`` launches ``16 M`` at once (its
        caller sees no token before it returns). ``1`` launches every step on its own; so does an engine
        built with ``device_loop=False`` (the launches use the device loop's programs).
      device_loop_plan_interval: the device loop's iterations per plan (``N``): it chooses the draft length,
        budget and bucket, then runs up to ``N`` steps on that branch before it plans again, each step's budget
        clipped to what its rows may still verify (a call's first plan holds one step; an epoch ends early once a
        smaller bucket holds the step: docs/ENGINE.md, "The device loop"). On a GPU each plan costs the
        planner's kernels and a read-back of the branch index; holding it for 4 made the adaptive decode loop 4%
        faster at 64 requests on an H100 (docs/BENCHMARKS.md, session 27). ``1`` plans every step, as the host
        loop does, in a loop compiled without epochs. The interval is a value of each call, not of the compiled
        loop: an engine built with ``N >= 2`` takes another ``N >= 1`` between calls
        (``engine.device_loop_plan_interval = 8``) without compiling anything.
      precompile: compile the whole closed set now (else the first ``generate`` / ``stream`` does).
      device_loop: compile the device loop's programs at warm-up too (default); ``False`` leaves them out of the
        warm-up (fewer programs when only the host loop is used: the first ``loop="device"`` call compiles those
        its waves need). A device loop that carries log-probabilities compiles on the first call that asks.
      compilation_cache: keep compiled programs and profiled cost tables on disk
        (:mod:`spec_decode.compilation_cache`).
    """

    def __init__(self, target, drafter=None, *, num_speculative_tokens: int = 7, verification: str = "adaptive",
                 max_num_seqs: int = 16, max_model_len: int | None = None, num_pages: int | None = None,
                 memory_fraction: float | None = None, max_num_batched_tokens: int = 512,
                 max_total_logit_rows: int | None = None, cost_table="profile", tokenizer=None,
                 implementation: str = "auto", interpret: bool | None = None, cache_dtype=None,
                 min_token_bucket: int = 8, draft_length_buckets: int = 2, device_loop_token_buckets: int = 4,
                 device_loop_sampling_token_buckets: int = 1, max_stop_token_ids: int = 16,
                 enable_prefix_caching: bool = True, async_scheduling: bool = True, precompile: bool = False,
                 compilation_cache: bool = True, device_loop: bool = True, draft_lengths=None,
                 confidence: str | None = None, sampling: bool = True, synthetic_acceptance_rates=None,
                 synthetic_acceptance_length=None, synthetic_confidence_noise: float = 0.0,
                 synthetic_concentration: float = 10.0, tensor_parallel_size: int = 1, mesh=None,
                 decode_steps_per_launch: int = 16, device_loop_plan_interval: int = DEVICE_LOOP_PLAN_INTERVAL):
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
        for name, v, lo in (("max_num_seqs", max_num_seqs, 1), ("max_num_batched_tokens", max_num_batched_tokens, 1),
                            ("max_stop_token_ids", max_stop_token_ids, 1), ("min_token_bucket", min_token_bucket, 1),
                            ("draft_length_buckets", draft_length_buckets, 1),
                            ("device_loop_token_buckets", device_loop_token_buckets, 1),
                            ("device_loop_sampling_token_buckets", device_loop_sampling_token_buckets, 1),
                            ("decode_steps_per_launch", decode_steps_per_launch, 1),
                            ("device_loop_plan_interval", device_loop_plan_interval, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        max_model_len = min(cfg.max_position_embeddings, 4096) if max_model_len is None else int(max_model_len)
        if not 2 <= max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {cfg.max_position_embeddings}] (the model's "
                             f"max_position_embeddings), got {max_model_len}")
        self.mesh = self._mesh(tensor_parallel_size, mesh)
        if self.mesh is not None:
            target = sharding.replicate_heads(target, self.mesh.shape[sharding.TENSOR])
            sharding.shard_module(target, self.mesh, target.cfg)
            if drafter is not None and k > 0:
                drafter = sharding.replicate_drafter_heads(drafter, self.mesh.shape[sharding.TENSOR])
                sharding.shard_module(drafter, self.mesh, drafter.cfg.layer_config)
        self.target, self.drafter = target, (drafter if k > 0 else None)
        self.tokenizer = tokenizer
        self.mode, self.k = verification, k
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size_for(cfg)
        self.max_blocks = -(-max_model_len // self.page_size)
        self.max_total_logit_rows = (max(max_num_seqs * (1 + k), max_num_seqs + max_num_batched_tokens)
                                     if max_total_logit_rows is None else int(max_total_logit_rows))
        if self.max_total_logit_rows < max_num_seqs:
            raise ValueError(f"max_total_logit_rows ({self.max_total_logit_rows}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every request samples one token per step")
        if verification == "fixed" and max_num_seqs * (1 + k) > self.max_total_logit_rows:
            warnings.warn(f"fixed verification: a step with more than {self.max_total_logit_rows // (1 + k)} "
                          f"requests verifies fewer than K={k} drafts each (spread evenly) to stay within "
                          f"max_total_logit_rows={self.max_total_logit_rows}", stacklevel=2)
        self.confidence = self._confidence(confidence, k, verification)
        self.draft_lengths = self._draft_lengths(draft_lengths, cost_table)
        self.synthetic_rates = None
        if synthetic_acceptance_rates is not None or synthetic_acceptance_length is not None:
            if k == 0:
                raise ValueError("emulated acceptance needs drafts: verification='none' drafts nothing")
            self.synthetic_rates = acceptance_rates(k, rates=synthetic_acceptance_rates,
                                                    length=synthetic_acceptance_length)
            for name, v, lo in (("synthetic_confidence_noise", synthetic_confidence_noise, 0.0),
                                ("synthetic_concentration", synthetic_concentration, 1e-3)):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
                    raise ValueError(f"{name} must be a finite number >= {lo}, got {v!r}")
        self.cache_dtype = target.dtype if cache_dtype is None else cache_dtype
        self.implementation = choose_implementation(implementation, cfg, page_size=self.page_size,
                                                    dtype=self.cache_dtype, interpret=interpret)
        self.interpret = interpret
        self.num_pages = self._pool_size(num_pages, memory_fraction)
        self.num_stop_ids = max_stop_token_ids
        self._plan_interval = device_loop_plan_interval  # each call's; the loops compile epochs if it is >= 2
        self.async_scheduling = bool(async_scheduling)
        self.pool = PagePool(self.num_pages, self.page_size, self.max_blocks,
                             enable_prefix_caching=bool(enable_prefix_caching))
        # the closed program set
        self.step_keys = step_keys(max_num_seqs=max_num_seqs, num_speculative_tokens=k,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   min_token_bucket=min_token_bucket, max_total_logit_rows=self.max_total_logit_rows,
                                   draft_lengths=self.draft_lengths, length_buckets=draft_length_buckets,
                                   sampling=bool(sampling))
        self.sampling = bool(sampling)
        # per draft length of the programs: the planner's lengths, and 0 for prefill-only steps (spec_decode.buckets)
        self.buckets_by_length = {d: tuple(sorted(key.tokens for key in self.step_keys
                                                  if key.draft_len == d and not key.sampling))
                                  for d in sorted({key.draft_len for key in self.step_keys})}
        self.planner = Planner(mode=verification, max_total_logit_rows=self.max_total_logit_rows,
                               cost_table=cost_table, num_speculative_tokens=k, draft_lengths=self.draft_lengths,
                               token_buckets=self.buckets_by_length)
        self.token_buckets = tuple(sorted({key.tokens for key in self.step_keys}))
        capture = tuple(self.drafter.cfg.target_layer_ids) if self.drafter is not None else ()
        self._step_config = StepConfig(
            num_speculative_tokens=k, mode=verification, confidence=self.confidence,
            implementation=self.implementation, interpret=interpret, capture_layers=capture,
            synthetic=None if self.synthetic_rates is None else conditional_rates(self.synthetic_rates),
            synthetic_concentration=float(synthetic_concentration), synthetic_noise=float(synthetic_confidence_noise),
            mesh=self.mesh)
        self.loop_config = self._loop_config(device_loop_token_buckets)  # the greedy loop's
        self.sampling_loop_config = self._loop_config(min(device_loop_sampling_token_buckets, device_loop_token_buckets))
        self._state_shardings = None  # the decode state's placement on the mesh (set with the first state)
        self._programs = StepPrograms(target, self.drafter, self._step_config, self.step_keys,
                                     num_rows=self.max_num_seqs, num_stop_ids=self.num_stop_ids, mesh=self.mesh)
        # (sampling, log-probability width or None) -> the compiled device loop (spec_decode.device_loop)
        self._loop_programs: dict[tuple[bool, int | None], object] = {}
        self._loop_output_layouts: dict[tuple[bool, int | None], PackedLayout] = {}  # by the same keys
        self._history_program = None  # writes one slot's token history (penalties), compiled at warm-up
        self._warm_device_loop = bool(device_loop)
        self.decode_steps_per_launch = decode_steps_per_launch if device_loop else 1
        # a multi-step launch runs the device loop's smallest bucket at least: not for rows whose own step
        # program is under half its size (one step at a time is cheaper then)
        smallest, d = self.loop_config.token_buckets[-1][0], self.draft_lengths[-1]
        self._burst_min_rows = next((n for n in range(1, max_num_seqs + 1)
                                     if 2 * token_bucket(self.buckets_by_length[d], n * (1 + d)) >= smallest),
                                    max_num_seqs)
        self._burst_costs = None  # (the planner's table, as the device loop reads it)
        self._burst_run = 0  # multi-step launches since the last single step
        # diagnostics: with record_launches, a host-loop run's results.stats["launch_timeline"] lists each launch's
        # times (planned and submitted, launch start and end on the launcher thread, read back, committed)
        self.record_launches = False
        self._target_params = nnx.state(target)
        self._drafter_params = nnx.state(self.drafter) if self.drafter is not None else None
        self._state: DecodeState | None = None
        self._lock = threading.Lock()
        self._launch_pool: concurrent.futures.ThreadPoolExecutor | None = None  # the host loop's launcher
        self._owner: int | None = None
        self._warned_no_eos = False
        self.warmup_report: CompileReport | None = None
        self.num_compiles = 0  # programs this engine compiled (XLA compilations, counted by JAX's monitoring)
        self.compilation_cache_dir = persistent_cache.enable() if compilation_cache else None
        # compiled programs on disk as executables (one process, one device: a mesh's programs compile)
        self._executables = (ExecutableStore.default() if compilation_cache and self.mesh is None
                             and jax.process_count() == 1 else None)
        # one process: processes may hold different cache files, and a profile runs on all of them together
        self._cache_costs = bool(compilation_cache) and persistent_cache.enabled() and jax.process_count() == 1
        if precompile:
            self.warmup()

    # ------------------------------------------------------------------ set-up helpers
    @staticmethod
    def _mesh(tensor_parallel_size, mesh):
        """The engine's mesh: ``mesh`` (with a ``"tensor"`` axis), or one over the first N devices, or None."""
        if mesh is not None:
            if sharding.TENSOR not in mesh.shape:
                raise ValueError(f"mesh must have a {sharding.TENSOR!r} axis, got axes {tuple(mesh.shape)}")
            if tensor_parallel_size not in (1, mesh.shape[sharding.TENSOR]):
                raise ValueError(f"tensor_parallel_size={tensor_parallel_size} disagrees with the mesh's "
                                 f"{sharding.TENSOR!r} axis of {mesh.shape[sharding.TENSOR]}")
            return mesh
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or \
                tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
        if tensor_parallel_size == 1:
            return None
        if tensor_parallel_size > len(jax.devices()):
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs that many devices, "
                             f"{len(jax.devices())} available")
        return sharding.make_mesh(tensor_parallel_size)

    def _confidence(self, confidence, k: int, verification: str) -> str:
        has_head = k > 0 and self.drafter.has_confidence_head
        if confidence is None:
            if k > 0 and not has_head and verification == "adaptive":
                warnings.warn("the drafter has no confidence head (or its checkpoint lacks the weights): adaptive "
                              "verification runs on the online acceptance estimator", stacklevel=3)
            return "head" if has_head or k == 0 else "estimator"
        if confidence not in CONFIDENCES:
            raise ValueError(f"confidence must be one of {CONFIDENCES}, got {confidence!r}")
        if confidence in ("head", "calibrated") and k > 0 and not has_head:
            raise ValueError(f"confidence={confidence!r} needs a drafter with a confidence head; this one has none "
                             f"(use 'estimator')")
        return confidence

    def _draft_lengths(self, draft_lengths, cost_table) -> tuple[int, ...]:
        k = self.k
        if draft_lengths is not None:
            try:
                lengths = tuple(sorted({int(d) for d in draft_lengths}))
            except (TypeError, ValueError):
                raise ValueError(f"draft_lengths must be a sequence of integers, got {draft_lengths!r}") from None
            if not lengths or any(d < 0 or d > k or isinstance(d, bool) for d in lengths):
                raise ValueError(f"draft_lengths must be a non-empty set of integers in [0, K={k}], got "
                                 f"{draft_lengths!r}")
            if self.mode != "adaptive" and lengths != (k,):
                raise ValueError(f"draft_lengths other than ({k},) need verification='adaptive' (fixed and none "
                                 f"draft K, none K = 0), got {draft_lengths!r}")
            if len(lengths) > 1 and (cost_table is None or cost_table == "flat"):
                raise ValueError("draft_lengths with more than one length need a cost table (cost_table='profile' "
                                 "or a CostTable): with a flat table there is nothing to choose by")
            return lengths
        if self.mode != "adaptive":
            return (k,)
        if isinstance(cost_table, CostTable):
            return tuple(sorted({d for d in cost_table.draft_lengths if d <= k} | {k}))
        if isinstance(cost_table, str) and cost_table == "profile":
            return default_draft_lengths(k)
        return (k,)

    def _pool_size(self, num_pages, memory_fraction) -> int:
        if num_pages is not None and memory_fraction is not None:
            raise ValueError("give num_pages or memory_fraction, not both")
        if num_pages is not None:
            if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
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
            if pages < self.max_blocks:
                raise ValueError(f"memory_fraction={memory_fraction} gives {pages} pages, fewer than one request "
                                 f"of max_model_len={self.max_model_len} needs ({self.max_blocks})")
            return pages
        return self.max_num_seqs * self.max_blocks

    def _bytes_per_page(self) -> int:
        """Device bytes of one page of the pool: the target's K/V (and index keys) plus, when drafting, the draft
        cache's K/V on the same page id (the draft cache shares the target's pool)."""
        cfg = self.target.cfg
        if self.mesh is not None:  # one device's share: its KV heads (the index keys replicated)
            local = cfg.num_key_value_heads // self.mesh.shape[sharding.TENSOR]
            cfg = cfg.replace(num_key_value_heads=local, index_n_heads=None if cfg.index_n_heads is None else local)
        per_page = cache_bytes_per_page(cfg, self.cache_dtype)
        if self.drafter is not None:  # on a mesh, its context K/V is split by (stored) head too
            tp = 1 if self.mesh is None else self.mesh.shape[sharding.TENSOR]
            per_page += draft_cache_bytes_per_page(self.drafter.cfg, self.page_size, self.cache_dtype) // tp
        return per_page

    def _loop_config(self, num_buckets: int) -> LoopConfig:
        """The device loop's static shape: the engine's slots, ``max_model_len`` wide outputs, per draft length
        the largest decode buckets of the closed set."""
        per_length, rows = [], []
        for d in self.draft_lengths:
            decode_max = self.max_num_seqs * (1 + d)
            have = sorted(key.tokens for key in self.step_keys if key.draft_len == d and not key.sampling)
            fitting = [t for t in have if t < decode_max] + [next(t for t in have if t >= decode_max)]
            buckets = tuple(fitting[-num_buckets:])
            per_length.append(buckets)
            rows.append(tuple(logit_rows(t, rows=self.max_num_seqs, num_speculative_tokens=d,
                                         max_total_logit_rows=self.max_total_logit_rows) for t in buckets))
        return LoopConfig(step=self._step_config, rows=self.max_num_seqs, output_len=self.max_model_len,
                          draft_lengths=self.draft_lengths, token_buckets=tuple(per_length), logit_rows=tuple(rows),
                          max_total_logit_rows=self.max_total_logit_rows, num_stop_ids=self.num_stop_ids,
                          max_blocks=self.max_blocks, hold_plans=self._plan_interval > 1)

    @property
    def device_loop_plan_interval(self) -> int:
        """The device loop's iterations per plan (``Engine(device_loop_plan_interval=N)``). An engine built with
        ``N >= 2`` takes any ``N >= 1`` between calls, on the same compiled programs: the interval is a value of
        each call, not of the program. One built with ``1`` compiled its loop without epochs and keeps ``1``. The
        cost table stays the one profiled at warm-up."""
        return self._plan_interval

    @device_loop_plan_interval.setter
    def device_loop_plan_interval(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"device_loop_plan_interval must be an integer >= 1, got {value!r}")
        if value > 1 and not self.loop_config.hold_plans:
            raise ValueError(f"device_loop_plan_interval={value}: this engine was built with 1, so its device loop "
                             f"plans every iteration and has no epochs to hold a plan in; build it with an "
                             f"interval >= 2 to choose one between calls")
        self._plan_interval = value

    @property
    def acceptance(self) -> str:
        """``"emulated"`` (synthetic acceptance) or ``"real"``."""
        return "real" if self.synthetic_rates is None else "emulated"

    @property
    def cost_table(self) -> CostTable | None:
        """The verify cost table the planner uses (seconds of a whole step by packed tokens), once known."""
        return self.planner.table

    def _init_state(self) -> DecodeState:
        state = init_state(self.target, self.drafter, num_slots=self.max_num_seqs, num_pages=self.num_pages,
                           max_model_len=self.max_model_len, num_speculative_tokens=self.k,
                           use_estimator=self.confidence == "estimator", cache_dtype=self.cache_dtype,
                           confidence=self.confidence, penalties=self.sampling)
        return self._placed(state)

    def _placed(self, state: DecodeState) -> DecodeState:
        """The state on the engine's mesh (K/V pages split by head, the rest replicated); as is without one."""
        if self.mesh is None:
            return state
        return jax.device_put(state, sharding.state_shardings(state, self.mesh))

    def _example_plan(self, key: StepKey) -> StepPlan:
        """A plan of ``key``'s shape with every slot a padding row (warm-up and profiling fill it in)."""
        r = self.max_num_seqs

        def z():  # a fresh array per field: profiling writes into them
            return np.zeros(r, np.int32)

        return StepPlan(rows=np.full(r, -1, np.int32), prefill_tokens=np.zeros(key.tokens, np.int32),
                        prefill_len=z(), prefill_start=z(), prefill_last=np.zeros(r, bool),
                        resume_token=np.full(r, -1, np.int32), block_tables=np.zeros((r, self.max_blocks), np.int32),
                        scheduled=z(), budget=np.asarray(0, np.int32), temperature=np.zeros(r, np.float32),
                        top_k=z(), top_p=np.ones(r, np.float32), seed=z(), limit=z(), prefill_emitted=z(),
                        stop_ids=np.full((r, self.num_stop_ids), -1, np.int32), commit=np.asarray(True),
                        min_tokens=z(), min_p=np.zeros(r, np.float32), repetition_penalty=np.ones(r, np.float32),
                        presence_penalty=np.zeros(r, np.float32), frequency_penalty=np.zeros(r, np.float32))

    # ------------------------------------------------------------------ warm-up
    def warmup(self, *, progress: bool | None = None) -> CompileReport:
        """Compile every program of the closed set (host steps and the device loop) and profile the cost table.

        Idempotent: a second call does nothing. Prints the count and time to stderr; ``progress`` shows tqdm bars
        (default: when stderr is a terminal)."""
        with self._exclusive():
            return self._warmup(progress)

    def _warmup(self, progress: bool | None, *, loops=()) -> CompileReport:
        """The closed set (with ``Engine(device_loop=True)`` the greedy and sampling device loops too), and the
        device loops ``loops`` (``(sampling, log-probability width)`` keys, :meth:`_loop_key`) a call needs:
        those not compiled yet compile now (a loop that carries log-probabilities, or any loop of an engine built
        with ``device_loop=False``, on the first call that needs it)."""
        loops = list(dict.fromkeys(([(s, None) for s in (False, True)[:1 + self.sampling]]
                                    if self._warm_device_loop else []) + list(loops)))
        if self.warmup_report is not None and all(key in self._loop_programs for key in loops):
            return self.warmup_report
        show = sys.stderr.isatty() if progress is None else bool(progress)
        t0 = time.perf_counter()
        with compile_counter() as compiled:
            if self._state is None:
                self._state = self._init_state()
            # what is missing: step programs, the history writer, device loops ("loop", sampling, width)
            names = list(self._programs.missing)
            if self._state.token_counts is not None and self._history_program is None:
                names.append("history")
            names += [("loop",) + key for key in loops if key not in self._loop_programs]
            # first from this process's programs or the executable store (no tracing), then lowered and compiled
            digests, live = self._program_digests(names), live_code()
            seconds: dict = {}  # each program's compile, or its load from the executable store
            loaded = self._load_executables(digests, live, seconds)
            t_loaded = time.perf_counter()
            todo = [name for name in names if name not in loaded]
            todo.sort(key=_compile_order)
            from_cache: set = set()  # served by JAX's persistent cache, not compiled here
            done, lower_s = compile_in_pool(((name, self._lowering(name)) for name in todo), total=len(todo),
                                            progress=show, desc="compiling", seconds=seconds, from_cache=from_cache)
            t_compiled = time.perf_counter()
            for name, exe in done.items():
                remember(digests[name], live, exe)
                if self._executables is not None:
                    self._executables.save(digests[name], exe, from_cache=name in from_cache)
            done.update(loaded)
            for key in loops:
                if ("loop",) + key in done:
                    self._loop_programs[key] = done.pop(("loop",) + key)
            self._history_program = done.pop("history", self._history_program)
            self._programs.install(done)
            if self.planner.profile_pending and self.k and self._programs.ready:
                self._load_or_profile_costs(show)
        self.num_compiles += len(compiled)
        report = CompileReport(programs=len(names), compiled=len(compiled), seconds=time.perf_counter() - t0,
                               lower_seconds=lower_s, compile_seconds=t_compiled - t_loaded - lower_s,
                               loaded=len(loaded), load_seconds=t_loaded - t0,
                               slowest=tuple(sorted(((str(k), round(v, 2)) for k, v in seconds.items()),
                                                    key=lambda kv: -kv[1])[:6]))
        if self.warmup_report is not None:  # the device loop, compiled on its first use
            report = self.warmup_report + report
        self.warmup_report = report
        print(f"minimax-jax: warm-up: {report}", file=sys.stderr)
        return report

    def _lowering(self, name):
        """A function that lowers the program ``name`` of :meth:`_warmup` (a step key, ``"history"`` or
        ``("loop", sampling, width)``)."""
        params = (self._target_params, self._drafter_params)
        if isinstance(name, StepKey):
            return self._programs.lowering(name, *params, self._state, self._example_plan)
        if name == "history":
            s = self._state
            return lambda: self._history_jit().lower(s.token_counts, s.prompt_mask, np.int32(0),
                                                     np.full(self.max_model_len, -1, np.int32), np.int32(0))
        return lambda: self._loop_jit(*name[1:]).lower(*params, self._state,
                                                       pack_loop_inputs(self._example_loop_inputs()))

    def _loop_config_of(self, sampling: bool) -> LoopConfig:
        """The static shape of the greedy or the sampling device loop (they differ in their token buckets)."""
        return self.sampling_loop_config if sampling else self.loop_config

    def _loop_program_config(self, sampling: bool, width: int | None) -> LoopConfig:
        """The configuration the device loop of ``(sampling, width)`` (a key of ``_loop_programs``) is built for."""
        return dataclasses.replace(self._loop_config_of(sampling), logprobs=width,
                                   step=dataclasses.replace(self._step_config, sampling=sampling))

    def _loop_jit(self, sampling: bool, width: int | None):
        """The device loop (greedy or sampling programs, carrying ``width`` log-probabilities or none), jitted: its
        inputs and outputs each one vector (``spec_decode.device_loop.packed_program``)."""
        cfg = self._loop_program_config(sampling, width)
        program = packed_program(make_loop_fn(self.target, self.drafter, cfg), cfg,
                                 PackedLayout.of(self._example_loop_inputs()))
        return jax.jit(on_mesh(program, self.mesh), donate_argnums=(2,))

    def _read_loop(self, out, key: tuple[bool, int | None]):
        """The :class:`~spec_decode.device_loop.LoopOutputs` (numpy) of a call of the device loop ``key``: its one
        vector read back (waiting for it) and unpacked. Each key's layout is derived once (about 0.1 ms a time:
        every wave and multi-step launch reads one)."""
        layout = self._loop_output_layouts.get(key)
        if layout is None:
            layout = self._loop_output_layouts[key] = loop_outputs_layout(self._loop_program_config(*key))
        return unpack_host(np.asarray(out), layout)

    def _program_digests(self, names: list) -> dict:
        """``{name: key}``: each program's key in the executable store (:mod:`spec_decode.executable_store`): what
        determines it before tracing."""
        if not names:
            return {}
        flat = self._programs.flat_params(self._target_params, self._drafter_params)
        common = (repr(nnx.graphdef(self.target)),
                  repr(nnx.graphdef(self.drafter)) if self.drafter is not None else None,
                  abstract(flat), abstract(self._state), repr(self._step_config), repr(self.loop_config),
                  self.max_num_seqs, self.num_stop_ids, self.max_model_len)
        digests = {}
        for name in names:
            if isinstance(name, StepKey):
                parts = ("step", repr(name), pack_plan(self._example_plan(name)).shape)
            elif name == "history":
                parts = ("history",)
            else:
                parts = (repr(name), repr(self._loop_config_of(name[1])), abstract(self._example_loop_inputs()))
            digests[name] = program_digest(common, parts)
        return digests

    def _load_executables(self, digests: dict, live: str, seconds: dict | None = None) -> dict:
        """``{name: program}`` of the programs already compiled in this process under the same key and code
        (``live``), or held by the executable store on disk (loaded in a thread pool, longest first: mostly the
        runtime's work, reading and placing the kernels). ``seconds``, when given, gets each store load's time."""
        loaded = {name: exe for name, d in digests.items() if (exe := recall(d, live)) is not None}
        # the longest loads first, as the compiles (a device loop takes 6-9 s on the H200, a step program under 1 s):
        # queued last, they would start only as the pool's first round of step programs ended
        rest = sorted((name for name in digests if name not in loaded), key=_compile_order)

        def load(name):
            t = time.perf_counter()
            exe = self._executables.load(digests[name])
            if seconds is not None and exe is not None:
                seconds[name] = time.perf_counter() - t
            return exe

        if self._executables is not None and rest:
            with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(rest), os.cpu_count() or 1, 16))) \
                    as pool:
                found = dict(zip(rest, pool.map(load, rest)))
            for name, exe in found.items():
                if exe is not None:
                    loaded[name] = exe
                    remember(digests[name], live, exe)
        return loaded

    def _history_jit(self):
        """:func:`spec_decode.penalties.write_history` jitted for the engine's state (its two arrays donated)."""
        out = None
        if self.mesh is not None:
            rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            out = (rep, rep)
        return jax.jit(write_history, donate_argnums=(0, 1), out_shardings=out)

    def _write_histories(self, histories) -> None:
        """The token histories of a step's admitted requests with a penalty, into their slots (before the step)."""
        for slot, tokens, num_prompt in histories:
            padded = np.full(self.max_model_len, -1, np.int32)
            padded[:len(tokens)] = tokens
            counts, mask = self._history_program(self._state.token_counts, self._state.prompt_mask, np.int32(slot),
                                                 padded, np.int32(num_prompt))
            self._state = dataclasses.replace(self._state, token_counts=counts, prompt_mask=mask)

    def _put_loop_inputs(self, inputs):
        """A device loop's :class:`~spec_decode.device_loop.LoopInputs` (host arrays) on the device(s), packed in
        one transfer: what the loop programs take."""
        return self._programs.put(pack_loop_inputs(inputs))

    def _example_loop_inputs(self):
        return loop_inputs([], config=self.loop_config, block_tables=np.zeros((0, self.max_blocks), np.int32),
                           cost_table=CostTableArrays.from_table(None), max_steps=0,
                           plan_interval=self.device_loop_plan_interval)

    def _cost_table_key(self) -> str:
        """What the profiled timings depend on: device, model and drafter shapes, dtypes, the engine's programs
        (the device loop's too: the profile times its branches, epochs of the plan interval included)."""
        dev = jax.devices()[0]
        parts = [COST_PROFILE_VERSION, dev.platform, getattr(dev, "device_kind", ""), jax.__version__, repr(self.target.cfg),
                 repr(self.drafter.cfg) if self.drafter is not None else "", str(self.target.dtype),
                 str(jnp.dtype(self.cache_dtype)), repr(self._step_config), repr(self.step_keys), self.max_model_len,
                 self.num_pages, repr(self.loop_config), self.device_loop_plan_interval]
        return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()[:32]

    def _load_or_profile_costs(self, show: bool) -> None:
        """The cost table an engine of this process profiled under the same key and code, else the one in the
        engine's cache on disk under the same key, else profiled now (:meth:`_profile_costs`); kept for the
        process's next engines, and written to the disk cache unless it came from there."""
        key = self._cost_table_key()
        path = persistent_cache.cost_table_path(key) if self._cache_costs else None
        # an engine of this process profiled under the same key and code: its table, as its programs are shared
        memo = (key, live_code()) if jax.process_count() == 1 else None
        table = _profiled_tables.get(memo) if memo is not None else None
        from_disk = False
        if table is None and path is not None and os.path.exists(path):
            try:
                table, from_disk = load_cost_table(path), True
            except (ValueError, KeyError, OSError) as e:  # a stale or damaged file: profile again
                warnings.warn(f"ignoring the cached cost table {path}: {e}", stacklevel=3)
        if table is None:
            table = self._profile_costs(show)
        self.planner.table, self.planner.profile_pending = table, False
        if table is not None:
            if path is not None and not from_disk:
                save_cost_table(table, path)
            if memo is not None:
                _profiled_tables[memo] = table

    def _profile_costs(self, show: bool) -> CostTable | None:
        """Profile the cost table now, with a progress bar and the time on stderr; every process returns rank 0's."""
        t0 = time.perf_counter()
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=PROFILE_REPEATS, unit="round", desc="profiling", file=sys.stderr, leave=False)
        program = self._loop_programs.get((False, None))
        r = self.max_num_seqs
        try:
            if program is not None:
                timed, where = self._profile_loop_branches(program, bar), "device-loop branches"
            else:
                timed, where = self._profile_host_steps(bar), "host-launched step programs"
        finally:
            if bar is not None:
                bar.close()
            self._state = self._placed(_with_lengths(self._state, np.zeros(r, np.int32)))
            self.pool.clear_cache()  # the timing runs wrote pages: nothing cached survives them
        # every process plans from rank 0's timings (the loop's timing runs take the table as an input already)
        table = _same_on_every_process(self.planner.table)
        print(f"minimax-jax: profiled the cost table of {timed} {where} in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
        return table

    def _profile_loop_branches(self, program, bar) -> int:
        """Time every branch of the greedy device loop inside the loop (device time: no host launch enters it)
        and keep them per draft length (docs/ADAPTIVE_VERIFICATION.md, "Cost tables"); returns how many.

        A timing run (``LoopInputs.timing_branch``) runs one branch every iteration on the same state, committing
        nothing: ``min(R, T)`` slots decode at a context of a quarter of ``max_model_len`` and verify
        ``T - min(R, T)`` drafts (at most ``K_d`` each). A branch's step is the difference between a run of ``1 + n`` iterations
        and one of 1, over ``n``: the launch and the read-back cancel, the loop's own planning and branch choice
        stay in, as in a decode wave."""
        cfg = self.loop_config
        branches, run, context = self._loop_branch_timer(program)
        lo, hi = PROFILE_LOOP_STEPS
        hi = max(1, min(hi, cfg.output_len - 1))
        run(*branches[-1], 1)  # one-off costs
        estimate = run(*branches[-1], 1 + lo) / (1 + lo)  # an upper bound on the largest branch's step
        n = int(min(hi, max(min(lo, hi), math.ceil(PROFILE_LOOP_SECONDS / max(estimate, 1e-9)))))

        def time_branch(d: int, t: int) -> float:
            return (run(d, t, 1 + n) - run(d, t, 1)) / n

        self.planner.profile(branches, time_branch, repeats=PROFILE_REPEATS, per_length=True, progress=bar,
                             source="engine warm-up profile: the device loop's branches, timed inside the loop",
                             metadata={"loop_iterations": [1, 1 + n], "context": context})
        return len(branches)

    def _loop_branch_timer(self, program, *, sampling: bool = False, context: int | None = None):
        """``(branches, run, context)`` for timing runs of the device loop ``program`` (the greedy one, or with
        ``sampling`` the sampling one): ``branches`` its ``(draft length, tokens)`` in switch order,
        ``run(d, t, steps, live=None)`` the seconds of one call that runs branch ``(d, t)`` in each of ``steps``
        iterations (from the call to the read-back of its outputs), on every slot's state set to ``context``
        tokens (default a quarter of ``max_model_len``), ``live`` slots decoding (default ``min(R, t)``) with
        ``t - live`` drafts among them (at most ``d`` each). Used by the cost-table profile and by
        ``scripts/bench_loop_overhead.py``."""
        cfg, r = self._loop_config_of(sampling), self.max_num_seqs
        branches = list(cfg.branches)
        index = {p: i for i, p in enumerate(branches)}
        context = max(1, self.max_model_len // 4) if context is None else int(context)
        if not 0 < context <= self.max_model_len - 1 - self.k:
            raise ValueError(f"a timing run's context must leave room for a step of 1 + K tokens within "
                             f"max_model_len {self.max_model_len}: got {context}")
        self._state = self._placed(_with_lengths(self._state, np.full(r, context, np.int32)))
        base = dataclasses.replace(self._example_loop_inputs(), block_tables=self._profile_tables(context + 1 + self.k),
                                   limit=np.full(r, self.max_model_len, np.int32),
                                   cost_table=self.planner.device_table())

        def run(d: int, t: int, steps: int, live: int | None = None) -> float:
            n = min(r, t) if live is None else int(live)
            rows = np.where(np.arange(r) < n, np.arange(r), -1).astype(np.int32)
            inputs = self._put_loop_inputs(dataclasses.replace(
                base, rows=rows, max_steps=np.asarray(steps, np.int32),
                timing_branch=np.asarray(index[d, t], np.int32), timing_budget=np.asarray(min(t - n, n * d), np.int32)))
            t0 = time.perf_counter()
            self._state, out = program(self._target_params, self._drafter_params, self._state, inputs)
            ran = int(self._read_loop(out, (sampling, None)).steps)
            if ran != steps:
                raise RuntimeError(f"the timing run of branch {d}/{t} ran {ran} of {steps} iterations")
            return time.perf_counter() - t0

        return branches, run, context

    def _profile_host_steps(self, bar) -> int:
        """Time every step program of the planner's draft lengths, host-launched back to back, on every slot
        decoding (``commit=False``: lengths and tokens stay) at a context of a quarter of ``max_model_len``; the
        planner splits them into draft-length and verify terms. For an engine without a device loop (a launch
        outlasts a small model's step, so this measures the host where the loop measures the device). Returns how
        many programs were timed."""
        r, k = self.max_num_seqs, self.k
        context = max(1, self.max_model_len // 4)
        tables = self._profile_tables(context + 1 + k)
        self._state = self._placed(_with_lengths(self._state, np.full(r, context, np.int32)))
        by_shape = {(key.draft_len, key.tokens): key for key in self.step_keys
                    if not key.sampling and key.draft_len in self.draft_lengths}

        def time_program(d: int, t: int) -> float:
            key = by_shape[d, t]
            n = min(r, t)
            plan = self._example_plan(key)
            plan.rows[:n] = np.arange(n)
            plan.scheduled[:n] = d
            plan.limit[:n] = self.max_model_len
            plan.block_tables[:] = tables
            plan = dataclasses.replace(plan, budget=np.asarray(min(t - n, n * d), np.int32),
                                       commit=np.asarray(False))
            t0 = time.perf_counter()
            for _ in range(PROFILE_STEPS_PER_CALL):  # back to back, as a run launches them
                self._state, out = self._programs.run(key, self._target_params, self._drafter_params,
                                                      self._state, plan)
            jax.block_until_ready(out)
            return (time.perf_counter() - t0) / PROFILE_STEPS_PER_CALL

        self.planner.profile(sorted(by_shape), time_program, repeats=PROFILE_REPEATS, progress=bar,
                             metadata={"steps_per_call": PROFILE_STEPS_PER_CALL, "context": context})
        return len(by_shape)

    def _profile_tables(self, tokens: int) -> np.ndarray:
        """Block tables for the profiling runs: every slot's own ``tokens`` worth of pages (wrapping round the pool:
        timing runs may share pages, and the pool's cache is cleared after them)."""
        nb = -(-tokens // self.page_size)
        r = self.max_num_seqs
        return ((np.arange(r)[:, None] * nb + np.arange(self.max_blocks)[None, :]) % self.num_pages).astype(np.int32)

    # ------------------------------------------------------------------ one caller at a time
    @contextlib.contextmanager
    def _exclusive(self):
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError("this engine is already running a generate() or stream() in this thread (a stream "
                               "that is still open?): finish or close() that stream first, or use another Engine")
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None

    # ------------------------------------------------------------------ validation
    def _requests(self, prompts, passed: dict, sampling_params) -> list[Request]:
        """Validated requests (:func:`spec_decode.request.build_requests`) that fit the page pool; ``passed``: the
        sampling keywords of the call (None: not given)."""
        cfg = self.target.cfg
        requests = build_requests(prompts, tokenizer=self.tokenizer, vocab_size=cfg.vocab_size,
                                  eos_token_ids=cfg.eos_token_id, max_model_len=self.max_model_len,
                                  max_stop_ids=self.num_stop_ids,
                                  keywords={k: v for k, v in passed.items() if v is not None},
                                  sampling_params=sampling_params)
        if not self.sampling:
            hot = [r for r in requests if r.params.needs_sampling_program]
            if hot:
                p = hot[0].params
                what = (f"temperature {p.temperature}" if p.temperature > 0 else
                        "a penalty (repetition, presence or frequency)" if p.penalized else
                        f"min_tokens={p.min_tokens}")
                raise ValueError(f"prompt {hot[0].prompt_index} has {what}: this engine was built with "
                                 f"sampling=False (greedy programs only, which apply no penalty or min_tokens)")
            asks = [r for r in requests if r.params.wants_logprobs]
            if asks:
                raise ValueError(f"prompt {asks[0].prompt_index} asks for logprobs / prompt_logprobs: the sampling "
                                 f"programs compute them, and this engine was built with sampling=False")
        for r in requests:
            self._check_fits(r)
        if not self._warned_no_eos and any(not r.stop_ids and not r.params.ignore_eos for r in requests):
            self._warned_no_eos = True
            warnings.warn("the target's config has no EOS token id (absent, or outside the vocabulary): "
                          "requests without stop_token_ids run to max_new_tokens", stacklevel=3)
        return requests

    def _check_fits(self, req: Request) -> None:
        need = -(-min(len(req.prompt) + req.limit + self.k, self.max_model_len) // self.page_size)
        if need > self.num_pages:
            raise ValueError(f"prompt {req.prompt_index}: {len(req.prompt)} prompt tokens + "
                             f"{req.params.max_new_tokens} new "
                             f"tokens need {need} KV pages, more than the pool's {self.num_pages}")

    # ------------------------------------------------------------------ running
    def stream(self, prompts, *, max_new_tokens: int | None = None, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               stop_token_ids: Sequence[int] | None = None, ignore_eos: bool | None = None,
               min_p: float | None = None, repetition_penalty: float | None = None,
               presence_penalty: float | None = None, frequency_penalty: float | None = None,
               stop: str | Sequence[str] | None = None, min_tokens: int | None = None, n: int | None = None,
               sampling_params=None) -> Iterator[tuple[int, list[int]]]:
        """Yield ``(request index, new token ids)`` as steps complete (continuous batching, host loop).

        The sampling keywords are those of :meth:`generate`; with ``n > 1`` the index is the request's,
        ``prompt index * n + sample``. The engine is held from the first ``next()`` until the stream is exhausted or
        closed."""
        requests = self._requests(prompts, _keywords(locals()), sampling_params)
        return self._stream(requests)

    def _stream(self, requests: list[Request]) -> Iterator[tuple[int, list[int]]]:
        with self._exclusive():
            self._warmup(None)
            yield from self._host_loop(requests, {}, ramp=True)

    def generate(self, prompts, *, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, ignore_eos: bool | None = None,
                 min_p: float | None = None, repetition_penalty: float | None = None,
                 presence_penalty: float | None = None, frequency_penalty: float | None = None,
                 stop: str | Sequence[str] | None = None, min_tokens: int | None = None, n: int | None = None,
                 sampling_params=None, loop: str = "host", progress: bool | None = None) -> GenerationResults:
        """Generate for every prompt; returns :class:`GenerationResult` s in prompt order (``.stats``: the run).

        ``prompts``: strings (with a tokenizer) or token-id lists. Sampling settings come as keywords or as
        ``sampling_params`` (one :class:`~spec_decode.SamplingParams` or one per prompt), not both; a keyword
        left ``None`` takes its default: ``max_new_tokens`` 64, ``temperature`` 0 (greedy), ``top_k`` 0,
        ``top_p`` 1 and ``min_p`` 0 (no filter), ``seed`` 0, no ``stop_token_ids``, ``ignore_eos`` False, no
        penalty (``repetition_penalty`` 1, ``presence_penalty`` and ``frequency_penalty`` 0), no ``stop`` strings
        (they need the engine's tokenizer), ``min_tokens`` 0, ``n`` 1 (:class:`~spec_decode.SamplingParams`
        defines each, as vLLM does; every one is lossless under speculation, ``docs/ENGINE.md``). With ``n > 1``
        the results hold ``n`` per prompt, prompt-major: ``results[i * n + j]`` is sample ``j`` of prompt ``i``.
        ``seed``: request ``i`` samples with ``seed + i``; seeds are integers in ``[0, 2**31)``, so
        ``seed + len(prompts) * n - 1`` must be below 2**31 (per-request seeds through ``sampling_params``). Bad
        input raises ``ValueError`` before any device work (:func:`spec_decode.request.build_requests`).
        ``loop="host"`` is the continuous-batching engine; ``progress`` shows a tqdm bar (default: when there are
        more prompts than slots).
        ``loop="device"`` decodes each wave of up to ``max_num_seqs`` requests in one compiled program
        (:mod:`spec_decode.device_loop`): no Python between decode steps, same greedy tokens and the same
        log-probabilities (``SamplingParams.logprobs`` / ``prompt_logprobs``).
        """
        if loop not in ("host", "device"):
            raise ValueError(f"loop must be 'host' or 'device', got {loop!r}")
        requests = self._requests(prompts, _keywords(locals()), sampling_params)
        width, loops = None, ()
        if loop == "device":  # the loop's static log-probability width (None: no request asks)
            width = logprobs_width([r.params.logprobs for r in requests], self.target.cfg.vocab_size)
            loops = [self._loop_key(wave, width) for wave in self._waves(requests)]
        with self._exclusive():
            self._warmup(None, loops=loops)
            if loop == "device":
                return self._device_loop(requests, width)
            show = len(requests) > self.max_num_seqs if progress is None else bool(progress)
            bar = None
            if show:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(requests), unit="req", desc="generate", file=sys.stderr)
            stats: dict = {}
            finished = 0
            for _ in self._host_loop(requests, stats, ramp=False):
                if bar is not None:
                    done = sum(r.finish_reason is not None for r in requests)
                    bar.update(done - finished)
                    finished = done
            if bar is not None:
                bar.close()
            return GenerationResults([self._result(r) for r in requests], stats)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt page (vLLM's ``LLM.reset_prefix_cache``): later requests prefill their whole
        prompts again. Returns the number of pages that were cached. For benchmarks that time the same prompts
        twice (a second run would read the first one's pages), and after changing weights in place. Waits for a
        running ``generate``; raises ``RuntimeError`` from the thread that holds an open stream."""
        with self._exclusive():
            cached = self.pool.num_evictable
            self.pool.clear_cache()
            return cached

    def score(self, prompts, continuations, *, progress: bool | None = None) -> list[ScoreResult]:
        """Log-likelihood of each continuation given its prompt, without generating (``docs/EVALUATION.md``).

        ``prompts`` and ``continuations``: lists of the same length, each item text (with a tokenizer: the
        prompt encoded with BOS first, the continuation on its own, without BOS, and appended) or token ids.
        Every continuation needs a token, every prompt too (the first continuation token is scored given it).
        Runs each ``prompt + continuation`` through the prefill with ``prompt_logprobs`` (the raw target
        distribution; the one token the prefill samples is dropped), so the values do not depend on the
        verification mode. Returns one :class:`~spec_decode.logprobs.ScoreResult` per pair, in order."""
        for name, v in (("prompts", prompts), ("continuations", continuations)):
            if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
                raise ValueError(f"{name} must be a list of strings or of token-id lists, got {type(v).__name__}")
        if len(prompts) != len(continuations):
            raise ValueError(f"prompts and continuations must have the same length, got {len(prompts)} and "
                             f"{len(continuations)}")
        if not prompts:
            raise ValueError("prompts is empty")
        full, splits = [], []
        for i, (p, c) in enumerate(zip(prompts, continuations)):
            ctx = self._score_ids(i, "prompt", p, bos=True)
            cont = self._score_ids(i, "continuation", c, bos=False)
            full.append(ctx + cont)
            splits.append(len(ctx))
        params = SamplingParams(max_new_tokens=1, ignore_eos=True, prompt_logprobs=1)
        results = self.generate(full, sampling_params=params, progress=progress)
        out = []
        for r, n in zip(results, splits):
            scored = r.prompt_logprobs[n:]
            lps = [t.logprob for t in scored]
            out.append(ScoreResult(logprob=float(sum(lps)), token_ids=[t.token_id for t in scored],
                                   token_logprobs=lps, is_greedy=[t.top[0][0] == t.token_id for t in scored]))
        return out

    def _score_ids(self, i: int, what: str, item, *, bos: bool) -> list[int]:
        """Token ids of one prompt / continuation of :meth:`score` (range checks come with the requests)."""
        if isinstance(item, str):
            if self.tokenizer is None:
                raise ValueError(f"{what} {i} is a string but the engine has no tokenizer; pass token ids or "
                                 f"Engine(..., tokenizer=...)")
            ids = encode_prompt(self.tokenizer, item) if bos else list(self.tokenizer.encode(item))
        elif isinstance(item, (list, tuple, np.ndarray)) and np.ndim(item) == 1:
            ids = list(item)
            bad = [t for t in ids if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_))]
            if bad:
                raise ValueError(f"{what} {i} holds {bad[0]!r}: token ids must be integers")
            ids = [int(t) for t in ids]
        else:
            raise ValueError(f"{what} {i} must be a string or a list of token ids, got {type(item).__name__}")
        if not ids:
            raise ValueError(f"{what} {i} is empty: " + ("its first continuation token is scored given at least one "
                                                        "prompt token" if bos else "there is nothing to score"))
        return ids

    def chat(self, messages, **kwargs) -> GenerationResult:
        """One conversation (``[{"role": ..., "content": ...}, ...]``) rendered by the tokenizer's chat template
        (``Tokenizer.apply_chat_template``, the assistant turn opened), then :meth:`generate` with ``kwargs``."""
        render = getattr(self.tokenizer, "apply_chat_template", None)
        if render is None:
            raise ValueError("chat needs a tokenizer with a chat template: Engine(..., tokenizer=load_tokenizer(dir))")
        return self.generate([render(messages, add_generation_prompt=True, tokenize=True)], **kwargs)[0]

    def _result(self, req: Request) -> GenerationResult:
        return request_result(req, k=self.k, tokenizer=self.tokenizer)

    def _scheduler(self) -> Scheduler:
        return Scheduler(num_slots=self.max_num_seqs, pool=self.pool, planner=self.planner,
                         max_model_len=self.max_model_len, num_speculative_tokens=self.k,
                         max_num_batched_tokens=self.max_num_batched_tokens, token_buckets=self.buckets_by_length,
                         max_total_logit_rows=self.max_total_logit_rows, num_stop_ids=self.num_stop_ids,
                         **self._planning_state())

    def _planning_state(self) -> dict:
        """What the host's plans start a call from, read from the device state (replicated: any shard holds it
        whole): a slot's start once prefilled and its weight, and the counts of the stale-confidence refresh;
        nothing without a live state."""
        st = self._state
        if st is None or st.fresh_confidences.is_deleted():
            return {}
        return {"fresh_confidences": np.asarray(st.fresh_confidences.addressable_data(0)),
                "fresh_weight": float(np.asarray(st.fresh_weight.addressable_data(0))),
                "undrafted_steps": int(np.asarray(st.undrafted_steps.addressable_data(0))),
                "full_draft_after": int(np.asarray(st.full_draft_after.addressable_data(0)))}

    def _launch(self, step: ScheduledStep | ScheduledBurst, packed=None):
        """Dispatch one step (its plan in one transfer), or a multi-step launch (``packed``: its
        :class:`~spec_decode.device_loop.LoopInputs`, returned as a :class:`_LoopCall`); the output is copied back
        asynchronously. The token histories of the requests a step admits are written first (in dispatch order:
        the device runs them before it)."""
        if isinstance(step, ScheduledBurst):
            key = (any(r.params.needs_sampling_program for r in step.requests), None)
            self._state, out = self._loop_programs[key](self._target_params, self._drafter_params, self._state,
                                                        self._put_loop_inputs(packed))
            out.copy_to_host_async()
            return _LoopCall(out, key)
        if step.histories:
            self._write_histories(step.histories)
        self._state, out = self._programs.run(step.key, self._target_params, self._drafter_params, self._state,
                                              step.plan if packed is None else packed)
        for leaf in jax.tree.leaves(out):
            leaf.copy_to_host_async()
        return out

    def _launch_timed(self, step: ScheduledStep | ScheduledBurst, packed, after=None):
        """Launch ``step`` (and time it) unless the launch before it, ``after`` (a future), failed: a step is
        planned on the one before it, so nothing runs after a failed launch."""
        if after is not None and after.exception() is not None:
            raise RuntimeError("not launched: an earlier step of this run failed to launch") from after.exception()
        t = time.perf_counter()
        out = self._launch(step, packed)
        return out, t, time.perf_counter()

    def _launcher(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread that launches the host loop's steps (created on first use). Launching a step program is
        mostly the XLA runtime's own work, outside the GIL (1-2 ms per step on an H200: ``docs/ENGINE.md``), so
        with it on its own thread the host plans and commits while the previous step is being launched."""
        if self._launch_pool is None:
            self._launch_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                      thread_name_prefix="minimax-jax-launch")
        return self._launch_pool

    # ------------------------------------------------------------------ the host loop
    def _schedule(self, sched: Scheduler, *, ramp: bool) -> tuple[ScheduledStep | ScheduledBurst | None, object]:
        """The next launch and what it sends: a multi-step launch and its loop inputs when one fits (see
        :meth:`Scheduler.schedule_burst`), else one step and its packed plan (None: nothing can run now, or
        the launches in flight are expected to finish every request: wait for them). ``ramp``: a stream's
        multi-step launches grow from ``M`` steps (its consumer sees early tokens); without it (``generate``,
        whose caller sees nothing before the call returns) each is the ramp's top, ``16 M``."""
        if sched.expects_in_flight_to_finish():
            return None, None
        m0 = self.decode_steps_per_launch
        if m0 > 1 and (False, None) in self._loop_programs:
            # a stream's first multi-step launch after a single step runs M0 steps, each next one 4x the one
            # before, up to 16 M0 (few launches for a long decode, early tokens for the stream); generate's
            # launches start at 16 M0; fewer steps when the pool is short
            m = min(m0 * 4 ** self._burst_run, 16 * m0) if ramp else 16 * m0
            burst = None
            while burst is None and m >= m0:
                burst = sched.schedule_burst(m, min_rows=self._burst_min_rows)
                m //= 4
            if burst is not None:
                self._burst_run += 1
                if self._burst_costs is None or self._burst_costs[0] is not self.planner.table:
                    self._burst_costs = (self.planner.table, self.planner.device_table())
                tables = self.pool.block_table([r.index for r in burst.requests])
                return burst, loop_inputs(burst.requests, config=self.loop_config, block_tables=tables,
                                          cost_table=self._burst_costs[1], max_steps=burst.max_steps,
                                          end_on_finish=burst.end_on_finish,
                                          plan_interval=self.device_loop_plan_interval)
        step = sched.schedule()
        self._burst_run = 0
        return step, (None if step is None else pack_plan(step.plan))

    def _host_loop(self, requests: list[Request], stats: dict, *, ramp: bool) -> Iterator[tuple[int, list[int]]]:
        sched = self._scheduler()
        for r in requests:
            sched.add(r)
        depth = 1 if self.async_scheduling else 0  # steps left in flight while the host plans the next
        in_flight: collections.deque = collections.deque()
        steps = 0
        verify_log = VerifySteps()
        # seconds the host spent, by part; "dispatch": launching the step programs (on the launcher thread when
        # async, where it overlaps the main thread's schedule and commit)
        host = {"schedule": 0.0, "dispatch": 0.0, "commit": 0.0}
        launches = {"multi_step": 0, "steps_in_multi_step": 0, "empty": 0}
        timeline = [] if self.record_launches else None
        t0 = time.perf_counter()
        with compile_counter(cache_loads=True) as compiled:  # a program made ready mid-call, compiled or loaded
            try:
                while sched.has_work or in_flight:
                    h0 = time.perf_counter()
                    commit_s = 0.0
                    # the plan is packed here: the launcher never reads the scheduler's arrays
                    step, packed = self._schedule(sched, ramp=ramp) if sched.has_work else (None, None)
                    if step is not None:
                        if depth:
                            prev = in_flight[-1][1] if in_flight else None
                            launch = self._launcher().submit(self._launch_timed, step, packed, prev)
                        else:
                            launch = concurrent.futures.Future()
                            launch.set_result(self._launch_timed(step, packed))
                        in_flight.append((step, launch, time.perf_counter()))
                        steps += isinstance(step, ScheduledStep)  # a multi-step launch counts its steps when read
                    elif not in_flight:
                        raise RuntimeError("the scheduler could not place any work (page pool too small?)")
                    h2 = time.perf_counter()
                    host["schedule"] += h2 - h0
                    launch_s = 0.0
                    while in_flight and (len(in_flight) > depth or step is None):
                        done, launch, submitted = in_flight.popleft()
                        out, started, ended = launch.result()
                        launch_s = ended - started
                        host["dispatch"] += launch_s
                        # waits for that step only
                        out = self._read_loop(out.packed, out.key) if isinstance(out, _LoopCall) else jax.device_get(out)
                        h3 = time.perf_counter()
                        if isinstance(done, ScheduledBurst):
                            events = sched.commit_burst(done, out)
                            n = int(out.steps)
                            steps += n
                            launches["multi_step"] += 1
                            launches["steps_in_multi_step"] += n
                            verify_log.add_loop(out)
                        else:
                            events = sched.commit(done, out)
                            if done.num_decode:
                                verify_log.add(verified=np.sum(out.num_verified), budget=done.budget,
                                             draft_length=done.key.draft_len, rows=done.num_decode,
                                             tokens=done.key.tokens)
                        if not events and (isinstance(done, ScheduledBurst) or done.num_decode):
                            launches["empty"] += 1  # a decode launch whose requests had all finished
                        commit_s += time.perf_counter() - h3
                        if timeline is not None:  # seconds from the run's start
                            timeline.append({
                                "kind": "multi_step" if isinstance(done, ScheduledBurst) else "step",
                                "steps": int(out.steps) if isinstance(done, ScheduledBurst) else 1,
                                "max_steps": done.max_steps if isinstance(done, ScheduledBurst) else 1,
                                "submitted": submitted - t0, "launch_start": started - t0, "launch_end": ended - t0,
                                "ready": h3 - t0, "committed": time.perf_counter() - t0})
                        for req, new in events:
                            yield req.index, new
                    host["commit"] += commit_s
                    if depth and isinstance(step, ScheduledStep):
                        # with a step in flight while the host plans, a step takes at least the host's time (the
                        # main thread's, or the launcher's if longer): the planner's costs have that floor (an
                        # average over the recent steps)
                        it = max((h2 - h0) + commit_s, launch_s)
                        p = self.planner
                        p.host_floor_s = it if p.host_floor_s == 0.0 else 0.9 * p.host_floor_s + 0.1 * it
            except BaseException as e:
                for _, launch, _ in in_flight:  # let launched steps finish before the state is inspected
                    concurrent.futures.wait([launch])
                # a closed stream leaves every planned step launched; anything else may have registered prefix
                # pages whose writes never ran
                self._recover(sched, forget_prefixes=not isinstance(e, GeneratorExit))
                raise
            finally:
                wall = time.perf_counter() - t0
                self.num_compiles += len(compiled)
                host_ms = {f"host_{part}_ms_per_step": 1e3 * v / max(steps, 1) for part, v in host.items()}
                stats.update(run_stats(requests, k=self.k, mode=self.mode, loop="host", wall=wall, steps=steps,
                                       per_step=verify_log, host_s=sum(host.values()),
                                       compiles=len(compiled), preemptions=sched.num_preemptions,
                                       prefill_tokens=sched.prefill_tokens_computed,
                                       prefix_tokens_reused=sched.prefix_tokens_reused,
                                       async_scheduling=self.async_scheduling, acceptance=self.acceptance,
                                       multi_step_launches=launches["multi_step"],
                                       steps_in_multi_step_launches=launches["steps_in_multi_step"],
                                       empty_launches=launches["empty"],
                                       **({} if timeline is None else {"launch_timeline": timeline}),
                                       **host_ms))

    def _recover(self, sched: Scheduler, *, forget_prefixes: bool = True) -> None:
        """An interrupted run (an exception, or a closed stream): free its pages and slots. If the device state
        was lost with it (a failed step), start from a fresh state. The prefix cache is forgotten then, and
        whenever ``forget_prefixes``: a step the scheduler planned (registering its prompt pages as cached) may
        never have run, and a later request must not read those pages."""
        sched.release_all()
        lost = self._state is None or any(x.is_deleted() for x in jax.tree.leaves(self._state))
        if lost:
            self._state = self._init_state()
        if lost or forget_prefixes:
            self.pool.clear_cache()

    # ------------------------------------------------------------------ the device loop
    def _device_loop(self, requests: list[Request], width: int | None = None) -> GenerationResults:
        """Waves of at most ``max_num_seqs`` requests whose pages fit: prefill with the host steps, then one
        compiled program decodes the wave to the end (:mod:`spec_decode.device_loop`); a wave with a request that
        asks for log-probabilities runs the sampling loop that carries ``width`` of them."""
        sched = self._scheduler()
        t0 = time.perf_counter()
        steps = 0
        verify_log = VerifySteps()
        device_s = 0.0
        buckets = self.loop_config.token_buckets  # the verify sizes of the loop the last wave ran
        with compile_counter(cache_loads=True) as compiled:  # a program made ready mid-call, compiled or loaded
            try:
                for wave in self._waves(requests):
                    for r in wave:
                        sched.add(r)
                    pending = []
                    while any(r.status.value in ("waiting", "prefill") for r in wave):
                        step = sched.schedule(prefill_only=True)
                        if step is None:
                            raise RuntimeError("the device loop could not prefill its wave (page pool too small?)")
                        pending.append((step, self._launch(step)))
                        steps += 1
                    for step, out in pending:  # the first tokens (and requests that finish at once)
                        sched.commit(step, jax.device_get(out))
                    live = [r for r in wave if r.finish_reason is None]
                    for r in live:
                        sched.reserve_decode_pages(r)
                    tables = self.pool.block_table([r.index for r in live])
                    cost = self.planner.device_table()
                    inputs = loop_inputs(live, config=self.loop_config, block_tables=tables, cost_table=cost,
                                         max_steps=self.loop_config.output_len,
                                         plan_interval=self.device_loop_plan_interval)
                    d0 = time.perf_counter()
                    key = self._loop_key(wave, width)
                    program, buckets = self._loop_programs[key], self._loop_config_of(key[0]).token_buckets
                    self._state, out = program(self._target_params, self._drafter_params, self._state,
                                               self._put_loop_inputs(inputs))
                    out = self._read_loop(out, key)
                    device_s += time.perf_counter() - d0
                    fill_requests(live, out, self.k)
                    stopped = set()
                    for r in live:  # stop strings: the device loop decoded past them; cut the output now
                        if r.stop_strings is not None:
                            keep = r.stop_strings.feed(r.output)
                            if keep is not None:
                                del r.output[keep:]
                                stopped.add(r.index)
                    n = int(out.steps)
                    steps += n
                    verify_log.add_loop(out)
                    for r in live:
                        last = r.output[-1] if r.output else None
                        r.finish_reason = "stop" if r.index in stopped or last in r.stop_ids else "length"
                    sched.finish_wave(live)
            except BaseException:
                self._recover(sched)
                raise
        self.num_compiles += len(compiled)
        wall = time.perf_counter() - t0
        stats = run_stats(requests, k=self.k, mode=self.mode, loop="device", wall=wall, steps=steps,
                          per_step=verify_log,
                          host_s=wall - device_s, compiles=len(compiled), preemptions=0,
                          prefill_tokens=sched.prefill_tokens_computed, prefix_tokens_reused=sched.prefix_tokens_reused,
                          token_buckets=[list(b) for b in buckets], device_time_s=device_s,
                          acceptance=self.acceptance)
        return GenerationResults([self._result(r) for r in requests], stats)

    @staticmethod
    def _loop_key(wave: list[Request], width: int | None) -> tuple[bool, int | None]:
        """The device loop a wave runs: ``(sampling, log-probability width)``; the width (the call's) only when
        a request of the wave asks for log-probabilities, which the sampling loop computes."""
        w = width if any(r.params.logprobs is not None for r in wave) else None
        return w is not None or any(r.params.needs_sampling_program for r in wave), w

    def _waves(self, requests: list[Request]):
        """Consecutive groups of at most ``max_num_seqs`` requests whose every page fits the pool at once."""
        wave, pages = [], 0
        for r in requests:
            need = -(-(len(r.prompt) + r.limit + self.k) // self.page_size)
            if wave and (len(wave) == self.max_num_seqs or pages + need > self.num_pages):
                yield wave
                wave, pages = [], 0
            wave.append(r)
            pages += need
        if wave:
            yield wave


def generate_offline(target, drafter, prompts, *, sampling_params=None, **kwargs) -> GenerationResults:
    """Jitted offline batch decoding in one call: ``Engine(target, drafter, **engine_kwargs).generate(prompts,
    loop="device", ...)``; ``kwargs`` are the sampling keywords of :meth:`Engine.generate` and the engine's
    settings. Keep an :class:`Engine` instead to reuse its compiled programs."""
    sampling = {k: kwargs.pop(k) for k in SAMPLING_KEYWORDS if k in kwargs}
    engine = Engine(target, drafter, **kwargs)
    return engine.generate(prompts, sampling_params=sampling_params, loop="device", **sampling)


def _keywords(args: dict) -> dict:
    """The sampling keywords of a ``generate`` / ``stream`` call (from its ``locals()``)."""
    return {k: args[k] for k in SAMPLING_KEYWORDS}


def _same_on_every_process(table: CostTable | None) -> CostTable | None:
    """Process 0's cost table on every process of a multi-process run: each process timed its own runs, and the
    plans (so the programs every process launches together) must not differ between them."""
    if jax.process_count() == 1 or table is None:
        return table
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(table.to_dict(), sort_keys=True).encode(), np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.asarray(len(data), np.int32)))
    buf = np.zeros(n, np.uint8)
    buf[: min(n, len(data))] = data[:n]
    return CostTable.from_dict(json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes().decode()))


@dataclasses.dataclass(frozen=True)
class _LoopCall:
    """A multi-step launch in flight: the device loop's output vector (being copied back) and the key of the
    program that wrote it (``Engine._read_loop`` unpacks it by that program's layout)."""

    packed: jax.Array
    key: tuple[bool, int | None]


@jax.jit
def _with_lengths(state: DecodeState, lengths) -> DecodeState:
    """The state with every slot's cached length (and the draft context's) set to ``lengths``, nothing emitted,
    nothing finished, and the fresh slot's confidences (profiling)."""
    dc = state.draft_cache
    if dc is not None:
        dc = dataclasses.replace(dc, lengths=lengths)
    return dataclasses.replace(state, num_cached=lengths, draft_cache=dc, done=jnp.zeros_like(state.done),
                               num_emitted=jnp.zeros_like(state.num_emitted),
                               prev_confidences=jnp.ones_like(state.prev_confidences),
                               undrafted_steps=jnp.zeros_like(state.undrafted_steps),
                               full_draft_after=jnp.full_like(state.full_draft_after, FULL_DRAFT_AFTER))


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
