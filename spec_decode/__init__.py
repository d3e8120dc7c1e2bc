"""Speculative decoding with adaptive verification (docs/ADAPTIVE_VERIFICATION.md).

Pure pieces, each in its own module:

* :mod:`spec_decode.allocator`: ``allocate_drafts`` (device): caps per request from the global top-B survival.
* :mod:`spec_decode.budget`: ``choose_plan`` (host) and ``choose_plan_device`` (its jnp twin): the draft length
  and the budget maximising expected tokens per second of step time; ``choose_budget`` the one-length rule.
* :mod:`spec_decode.cost_table`: profiled, monotone step-cost tables saved as ``cost_table.json``.
* :mod:`spec_decode.estimator`: online acceptance estimator for drafters without a confidence head.
* :mod:`spec_decode.rejection`: lossless greedy/stochastic rejection sampling over a ragged verify batch.
* :mod:`spec_decode.sampling_params`: per-request sampling settings, the top-k / top-p filter.
* :mod:`spec_decode.step`: one speculative step as a pure function over an explicit state.

The engine, one concern per module (``docs/ENGINE.md`` draws the host loop):

* :mod:`spec_decode.buckets` / :mod:`spec_decode.programs`: the closed set of step programs, compiled at warm-up.
* :mod:`spec_decode.request`: requests validated once (``build_requests``); :mod:`spec_decode.results`: results.
* :mod:`spec_decode.page_pool`: pages, reference counts, automatic prefix caching.
* :mod:`spec_decode.planner`: the budget rule and its cost table; :mod:`spec_decode.scheduler`: the host side
  (admission, prefill, pages, preemption, async upper bounds).
* :mod:`spec_decode.engine`: ``Engine.warmup`` / ``generate`` / ``stream``, continuous batching, ``generate_offline``.
* :mod:`spec_decode.device_loop`: jitted offline batch decoding (``generate(loop="device")``).
* :mod:`spec_decode.compilation_cache`: the persistent compilation cache; :mod:`spec_decode.cli`: the command line.
"""

from spec_decode.allocator import allocate_drafts, survival
from spec_decode.budget import (
    budget_values,
    choose_budget,
    choose_budget_device,
    choose_plan,
    choose_plan_device,
)
from spec_decode.cost_table import (
    COST_TABLE_FILENAME,
    CostTable,
    CostTableArrays,
    load_cost_table,
    profile_cost_table,
    save_cost_table,
)
from spec_decode.engine import Engine, GenerationResult, GenerationResults, generate_offline
from spec_decode.estimator import (
    EstimatorState,
    confidence_feature,
    confidence_feature_from_logits,
    init_estimator,
)
from spec_decode.estimator import predict as predict_acceptance
from spec_decode.estimator import update as update_estimator
from spec_decode.rejection import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_RESAMPLE,
    RejectionOutput,
    rejection_sample,
    rejection_sample_packed,
    sample_tokens,
    sampling_key,
)
from spec_decode.sampling_params import SamplingParams, filter_logits

__all__ = [
    "COST_TABLE_FILENAME",
    "STREAM_ACCEPT",
    "STREAM_DRAFT",
    "STREAM_RESAMPLE",
    "CostTable",
    "CostTableArrays",
    "Engine",
    "EstimatorState",
    "GenerationResult",
    "GenerationResults",
    "RejectionOutput",
    "SamplingParams",
    "allocate_drafts",
    "budget_values",
    "choose_budget",
    "choose_budget_device",
    "choose_plan",
    "choose_plan_device",
    "confidence_feature",
    "confidence_feature_from_logits",
    "filter_logits",
    "generate_offline",
    "init_estimator",
    "load_cost_table",
    "predict_acceptance",
    "profile_cost_table",
    "rejection_sample",
    "rejection_sample_packed",
    "sample_tokens",
    "sampling_key",
    "save_cost_table",
    "survival",
    "update_estimator",
]
