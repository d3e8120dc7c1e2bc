"""What a generation returns: per-request results and the run's statistics, written once for both loops."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from spec_decode.logprobs import TokenLogprobs
from spec_decode.request import Request

__all__ = ["GenerationResult", "GenerationResults", "request_result", "run_stats"]


@dataclasses.dataclass
class GenerationResult:
    """One request's output: ``token_ids`` (the prompt excluded), ``text`` (when a tokenizer is known) and stats.

    ``stats`` keys: ``emitted_tokens`` (= ``len(token_ids)``, the token sampled at prefill included),
    ``target_steps`` (verify steps, prefill excluded), ``acceptance_length`` (tokens emitted per verify step,
    bonus included), ``accepted_per_position`` (K counts), ``verified_per_position`` (K counts),
    ``verified_drafts_per_step`` (list), ``finish_reason`` (``"stop"`` or ``"length"``), ``prompt_tokens``,
    ``preemptions``, ``prompt_index`` and ``sample`` (which of the prompt's ``n`` samples), ``stop_string`` (the
    stop string that ended it, else None). A stop string is not part of ``text``; ``token_ids`` end with the token
    that completed it.

    ``logprobs`` (when the request's ``SamplingParams.logprobs`` is set, else None): one
    :class:`~spec_decode.logprobs.TokenLogprobs` per token of ``token_ids`` (its log-probability under the target
    distribution it was sampled from and the ``logprobs`` most likely tokens there). ``prompt_logprobs`` (with
    ``SamplingParams.prompt_logprobs``): one per prompt token, ``None`` for the first (nothing precedes it), under
    the raw target distribution. ``docs/ENGINE.md`` ("Log-probabilities") says which distribution exactly.
    """

    token_ids: list[int]
    text: str | None
    stats: dict
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finish_reason(self) -> str:
        return self.stats["finish_reason"]


class GenerationResults(list):
    """``list[GenerationResult]`` in prompt order (with ``n`` samples per prompt: prompt-major, ``[i * n + j]`` is
    sample ``j`` of prompt ``i``), with the run-level statistics in ``.stats``."""

    stats: dict

    def __init__(self, results, stats):
        super().__init__(results)
        self.stats = stats


def request_result(req: Request, *, k: int, tokenizer=None) -> GenerationResult:
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
        "prompt_index": req.prompt_index,
        "sample": req.sample,
        "stop_string": req.stop_strings.matched if req.stop_strings is not None else None,
    }
    if req.stop_strings is not None and req.stop_strings.text is not None:
        text = req.stop_strings.text  # cut before the stop string
    else:
        text = tokenizer.decode(req.output) if tokenizer is not None else None
    return GenerationResult(list(req.output), text, stats, list(req.prompt),
                            # a stop string cuts the output after the step's log-probabilities were added
                            logprobs=None if req.logprobs is None else list(req.logprobs[:len(req.output)]),
                            prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs))


@dataclasses.dataclass
class VerifySteps:
    """What each decode (verify) step of a run did, batch totals, in step order: the drafts it verified, its
    budget, the draft length ``K_d`` it drafted, the draft tokens it produced (decode rows times ``K_d``), and the
    packed-token size of the program that ran it (prefill chunks of the same host step included)."""

    verified: list[int] = dataclasses.field(default_factory=list)
    budget: list[int] = dataclasses.field(default_factory=list)
    draft_length: list[int] = dataclasses.field(default_factory=list)
    drafted: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)

    def add(self, *, verified: int, budget: int, draft_length: int, rows: int, tokens: int) -> None:
        """One host step that decoded ``rows`` requests in a program of ``tokens`` packed tokens."""
        self.verified.append(int(verified))
        self.budget.append(int(budget))
        self.draft_length.append(max(int(draft_length), 0))
        self.drafted.append(int(rows) * max(int(draft_length), 0))
        self.tokens.append(int(tokens))

    def add_loop(self, out) -> None:
        """The steps of one device-loop program run (its :class:`~spec_decode.device_loop.LoopOutputs`, numpy):
        ``out.steps`` of them, verified counts summed over the rows that ran each (``-1`` marks a row that did
        not)."""
        n = int(out.steps)
        ver = out.verified_per_step[:, :n]
        self.verified.extend(int(x) for x in np.where(ver >= 0, ver, 0).sum(0))
        self.budget.extend(int(x) for x in out.budget_per_step[:n])
        self.draft_length.extend(int(x) for x in out.draft_len_per_step[:n])
        self.drafted.extend(int(x) for x in out.draft_len_per_step[:n] * out.live_per_step[:n])
        self.tokens.extend(int(x) for x in out.tokens_per_step[:n])


def run_stats(requests: Sequence[Request], *, k: int, mode: str, loop: str, wall: float, steps: int,
              per_step: VerifySteps, host_s: float, compiles: int, preemptions: int, prefill_tokens: int,
              prefix_tokens_reused: int, **extra) -> dict:
    """The run statistics (``results.stats``), the same keys for the host and the device loop.

    ``prefill_tokens`` were computed, ``prefix_tokens_reused`` came from the prefix cache instead.
    ``per_position_acceptance[j]``: of the requests' verify steps that verified draft ``j + 1``, the fraction that
    accepted drafts ``1..j+1``; ``predicted_per_position_acceptance[j]``: the mean survival (product of the step's
    confidences up to ``j + 1``) the allocator ranked those drafts by; ``calibration_error``: the gap between the
    two, averaged over positions weighted by their verified counts. The ``*_per_step`` lists come from
    ``per_step`` (:class:`VerifySteps`), one entry per decode step."""
    verified_per_step, budget_per_step = per_step.verified, per_step.budget
    draft_length_per_step, drafted_per_step = per_step.draft_length, per_step.drafted
    out_tokens = sum(len(r.output) for r in requests)
    decode_emitted = sum(max(len(r.output) - 1, 0) for r in requests if r.target_steps)
    row_steps = sum(r.target_steps for r in requests)
    acc = np.sum([r.accepted_per_position for r in requests], axis=0) if k else np.zeros(0)
    ver = np.sum([r.verified_per_position for r in requests], axis=0) if k else np.zeros(0)
    pred = np.sum([r.predicted_per_position for r in requests], axis=0) if k else np.zeros(0)
    seen = ver > 0
    gap = np.abs(pred[seen] / ver[seen] - acc[seen] / ver[seen]) if k else np.zeros(0)
    calibration_error = float(np.sum(gap * ver[seen]) / np.sum(ver[seen])) if k and seen.any() else math.nan
    looked_up = prefill_tokens + prefix_tokens_reused
    return dict(
        wall_time_s=wall, output_tokens=out_tokens, output_tokens_per_s=out_tokens / wall if wall else 0.0,
        steps=steps, verify_steps=len(verified_per_step),
        mean_acceptance_length=decode_emitted / row_steps if row_steps else 0.0,
        per_position_acceptance=[float(a / v) if v else math.nan for a, v in zip(acc[:k], ver[:k])],
        predicted_per_position_acceptance=[float(p / v) if v else math.nan for p, v in zip(pred[:k], ver[:k])],
        calibration_error=calibration_error,
        verified_drafts_per_step=[int(x) for x in verified_per_step],
        budget_per_step=[int(x) for x in budget_per_step],
        mean_verified_drafts_per_step=float(np.mean(verified_per_step)) if len(verified_per_step) else 0.0,
        draft_length_per_step=[int(x) for x in draft_length_per_step],
        mean_draft_length=float(np.mean(draft_length_per_step)) if len(draft_length_per_step) else 0.0,
        drafted_tokens_per_step=[int(x) for x in drafted_per_step],
        mean_drafted_tokens_per_step=float(np.mean(drafted_per_step)) if len(drafted_per_step) else 0.0,
        verify_tokens_per_step=[int(x) for x in per_step.tokens],
        host_time_per_step_s=host_s / steps if steps else 0.0, compiles=compiles, preemptions=preemptions,
        verification=mode, num_speculative_tokens=k, loop=loop,
        prefill_tokens=prefill_tokens, prefix_cache_tokens=prefix_tokens_reused,
        prefix_cache_hit_rate=prefix_tokens_reused / looked_up if looked_up else 0.0,
        **extra,
    )
