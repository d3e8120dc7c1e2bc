"""Requests: what a caller passed to ``Engine.generate`` / ``Engine.stream``, validated once for both loops.

:func:`build_requests` turns prompts (strings or token-id lists) and sampling settings (keywords or
:class:`~spec_decode.sampling_params.SamplingParams`) into :class:`Request` s, or raises ``ValueError`` naming the
prompt index or the argument, before any device work. It is a pure function: it reads no engine state and
changes none (the engine's limits come in as arguments).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from spec_decode.sampling_params import SamplingParams, sample_seed
from spec_decode.stop_strings import StopStrings

__all__ = ["SAMPLING_KEYWORDS", "Request", "RequestStatus", "build_requests", "encode_prompt"]

# The sampling keywords of generate/stream, in the order error messages list them.
SAMPLING_KEYWORDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos",
                     "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "min_tokens", "n")
SEED_LIMIT = 2**31


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and its host-side progress (compared by identity).

    With ``n`` samples per prompt each sample is a request of its own: ``index = prompt_index * n + sample``."""

    index: int  # position in the engine's request list (== prompt_index when n == 1)
    prompt: list[int]
    params: SamplingParams
    stop_ids: tuple[int, ...]
    arrival: int  # admission order key (smaller = older)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    output: list[int] = dataclasses.field(default_factory=list)
    limit: int = 0  # tokens it may emit in all: max_new_tokens, capped by the engine's max_model_len
    num_cached: int = 0  # tokens in the target cache, as far as the host has read back (plus prefill scheduled)
    prefill_target: list[int] = dataclasses.field(default_factory=list)  # tokens to (re)compute before decoding
    finish_reason: str | None = None
    # statistics
    target_steps: int = 0
    accepted_per_position: np.ndarray | None = None
    verified_per_position: np.ndarray | None = None
    predicted_per_position: list[float] | None = None  # sums of the predicted survival at each verified position
    verified_drafts_per_step: list[int] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    # log-probabilities (spec_decode.logprobs), when the params ask: one per output token; one per prompt position
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    prompt_index: int = -1  # position in the caller's prompt list (-1: index)
    sample: int = 0  # which of the prompt's n samples
    stop_strings: StopStrings | None = None  # the text stop sequences, when it has some

    @property
    def is_resumed(self) -> bool:
        return bool(self.output)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A text prompt as the model saw documents in training: BOS first when the tokenizer has one."""
    if getattr(tokenizer, "bos_token_id", None) is not None:
        try:
            return list(tokenizer.encode(text, add_bos=True))
        except TypeError:  # a tokenizer without the keyword
            return [tokenizer.bos_token_id] + list(tokenizer.encode(text))
    return list(tokenizer.encode(text))


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _token_ids(i: int, prompt, tokenizer) -> list[int]:
    """Prompt ``i`` as a list of Python ints (values not yet range-checked)."""
    if isinstance(prompt, str):
        if prompt == "":
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        if tokenizer is None:
            raise ValueError(f"prompt {i} is a string but the engine has no tokenizer; pass token ids or "
                             f"Engine(..., tokenizer=...)")
        prompt = encode_prompt(tokenizer, prompt)
    elif isinstance(prompt, np.ndarray):
        if prompt.ndim != 1:
            raise ValueError(f"prompt {i} must be a list of token ids (one dimension), got an array of shape "
                             f"{prompt.shape}")
        if prompt.dtype.kind in "iu":  # integers (not bool): converted in C
            return prompt.tolist()
        prompt = list(prompt)
    elif not isinstance(prompt, (list, tuple)):
        raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(prompt).__name__}")
    if set(map(type, prompt)) <= {int}:  # plain ints (bool is not int's type): checked in C
        return list(prompt)
    ids = []
    for j, t in enumerate(prompt):
        if not _is_int(t):
            raise ValueError(f"prompt {i} holds {t!r} at position {j}: token ids must be integers")
        ids.append(int(t))
    return ids


def _sampling_params(n: int, *, keywords: dict, sampling_params) -> list[SamplingParams]:
    unknown = sorted(set(keywords) - set(SAMPLING_KEYWORDS))
    if unknown:
        raise ValueError(f"unknown sampling keyword(s) {', '.join(unknown)}; known: {', '.join(SAMPLING_KEYWORDS)}")
    if sampling_params is not None:
        if keywords:
            got = ", ".join(f"{k}={keywords[k]!r}" for k in SAMPLING_KEYWORDS if k in keywords)
            raise ValueError(f"pass sampling settings as keywords or as sampling_params, not both (got {got} with "
                             f"sampling_params)")
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if isinstance(sampling_params, (str, bytes)) or not isinstance(sampling_params, Sequence):
            raise ValueError(f"sampling_params must be one SamplingParams or a list of one per prompt ({n}), got "
                             f"{type(sampling_params).__name__}")
        params = list(sampling_params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"sampling_params must be one SamplingParams or a list of one per prompt ({n}), got "
                             f"{len(params)} items")
        return params
    kw = dict(keywords)
    seed = kw.pop("seed", 0)
    if not _is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2**31), got {seed!r}")
    seed = int(seed)
    samples = kw.get("n", 1)
    if not _is_int(samples) or samples < 1:
        raise ValueError(f"n (samples per prompt) must be an integer >= 1, got {samples!r}")
    samples = int(samples)
    total = n * samples
    if seed + total - 1 >= SEED_LIMIT:
        raise ValueError(f"seed={seed} with {n} prompts x n={samples}: request i samples with seed + i, and seed + "
                         f"{total - 1} = {seed + total - 1} is not below 2**31; pass a seed <= {SEED_LIMIT - total} "
                         f"(or per-request seeds through sampling_params)")
    if "stop_token_ids" in kw and kw["stop_token_ids"] is not None:
        stop = kw["stop_token_ids"]
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (Sequence, np.ndarray)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {type(stop).__name__}")
    base = SamplingParams(seed=seed, **kw)
    return [base if i == 0 else base.replace(seed=seed + i * samples) for i in range(n)]


def build_requests(prompts, *, tokenizer, vocab_size: int, eos_token_ids, max_model_len: int, max_stop_ids: int,
                   keywords: dict, sampling_params) -> list[Request]:
    """Validated :class:`Request` s for ``prompts``, in order; ``ValueError`` naming the prompt or argument.

    ``keywords``: only the sampling keywords the caller passed (a subset of :data:`SAMPLING_KEYWORDS`); the rest
    take :class:`SamplingParams`' defaults. They may not be mixed with ``sampling_params`` (one
    ``SamplingParams`` for every prompt, or a list of one per prompt). With keywords, request ``i`` samples with
    ``seed + i``; every seed must be in ``[0, 2**31)``. A prompt with ``n > 1`` makes ``n`` requests, prompt-major
    (request ``i * n + j`` is sample ``j`` of prompt ``i``, seeded ``sample_seed(seed of prompt i, j)``; with
    keywords prompt ``i``'s seed is ``seed + i * n``, so every request still samples with ``seed + index``).
    Stop strings need ``tokenizer``. A ``top_k`` above ``vocab_size`` keeps everything (it is
    clamped to ``vocab_size``). Each request may end on at most ``max_stop_ids`` ids (EOS included).
    Prompts are strings (encoded with ``tokenizer``, BOS first when it has one) or lists / 1-D arrays of integer
    token ids in ``[0, vocab_size)``, of 1 to ``max_model_len - 1`` tokens.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
        raise ValueError(f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty")
    params = _sampling_params(len(prompts), keywords=keywords, sampling_params=sampling_params)
    requests = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        ids = _token_ids(i, prompt, tokenizer)
        if not ids:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        if len(ids) > max_model_len - 1:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than max_model_len - 1 = {max_model_len - 1} "
                             f"(the engine's max_model_len leaves room for at least one new token)")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompt {i} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
        if p.top_k > vocab_size:
            p = p.replace(top_k=vocab_size)  # keeps every token, and fits the int32 step inputs
        try:
            stop = p.stop_ids(eos_token_ids, vocab_size)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        if len(stop) > max_stop_ids:
            raise ValueError(f"prompt {i} has {len(stop)} stop token ids (EOS included), more than the engine's "
                             f"limit of {max_stop_ids}; raise it with Engine(max_stop_token_ids=...)")
        if p.stop and tokenizer is None:
            raise ValueError(f"prompt {i} has stop strings {list(p.stop)!r} but the engine has no tokenizer to "
                             f"detokenize with; pass Engine(..., tokenizer=...) or use stop_token_ids")
        for j in range(p.n):
            q = p if j == 0 else p.replace(seed=sample_seed(p.seed, j))
            index = len(requests)
            requests.append(Request(index=index, prompt=ids, params=q, stop_ids=stop, arrival=index,
                                    limit=min(p.max_new_tokens, max_model_len - len(ids)), prompt_index=i, sample=j,
                                    stop_strings=StopStrings(p.stop, tokenizer, min_tokens=p.min_tokens)
                                    if p.stop else None))
    return requests
