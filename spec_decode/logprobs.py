"""Log-probabilities of generated and prompt tokens, computed in the verify step (docs/ENGINE.md, "Log-probabilities").

**Which distribution.** A generated token's log-probability is taken under the *target* distribution of the
position it was emitted at (an accepted draft, the corrected token, or the bonus token: every emitted token comes
from a verify position, so the value is the same with and without speculation), after the transform the sampler
reads: the request's logits processing (penalties, when the engine has them), then the temperature, then top-k /
top-p: vLLM's ``logprobs_mode="processed_logprobs"``. A greedy request (temperature 0) is scored at temperature 1
(its top-k / top-p still apply; with the defaults the values are the plain ``log_softmax`` of the target's logits).
Tokens a filter removed have log-probability ``-inf``. Prompt log-probabilities are always the *raw* target
distribution (``log_softmax`` of the logits, no temperature, no filter, no penalty), as vLLM's are: they are what
log-likelihood scoring (:meth:`spec_decode.Engine.score`, lm-evaluation-harness) needs.

**Where.** Only the sampling programs of the closed set compute log-probabilities (a step serving a request that
asks for them runs the sampling program, which serves greedy rows too), so no program is added and greedy steps
pay nothing. They compute the top :data:`MAX_LOGPROBS` of every verify-logits row (``lax.top_k``: far cheaper than
the full-vocabulary sort the top-p filter already does there) and the host keeps the ``k`` each request asked for.

**Prompt rows.** A prefill chunk of a request with ``prompt_logprobs`` takes one verify-logits row per prompt
position it scores, placed after the rows the sampler reads (which ignores rows past its own), so the row
``lqsl[R] + i`` holds prompt row ``i``. The scheduler keeps every step within the program's verify-logits rows
(``max_total_logit_rows`` and ``max_num_seqs * (1 + K)``), chunking such prompts accordingly.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.metadata import token_to_request
from spec_decode.vocab_shards import Vocab, split_vocab, vocab_shards

__all__ = ["MAX_LOGPROBS", "LogprobsOutput", "ScoreResult", "TokenLogprobs", "check_logprobs_setting",
           "prompt_logit_rows", "step_logprobs"]

MAX_LOGPROBS = 20  # the most alternatives a request may ask for (vLLM's default max_logprobs)
_NEG = -1e30  # a log-probability below this is a filtered token: reported as -inf


def check_logprobs_setting(name: str, value):
    """``value`` of the ``SamplingParams`` field ``name`` (``logprobs`` / ``prompt_logprobs``) as an ``int`` or
    None, or a ValueError naming the field and the limit."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be None (off) or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
    if not 0 <= int(value) <= MAX_LOGPROBS:
        raise ValueError(f"{name}={int(value)} is outside [0, {MAX_LOGPROBS}] (MAX_LOGPROBS: the most alternatives "
                         f"a token reports)")
    return int(value)


# ---------------------------------------------------------------------------------------------- device side
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogprobsOutput:
    """The step's log-probabilities (``L = min(MAX_LOGPROBS, V)``; sampling programs only).

    Emitted tokens, by row and column of ``StepOutput.tokens``; prompt rows packed from 0 in row order (row ``r``
    holds ``prompt_len - prefill_last`` of them when its plan asks, see :func:`prompt_logit_rows`)."""

    token_logprobs: jax.Array  # f32[R, K+1]     log p(emitted token)
    token_top_ids: jax.Array  # int32[R, K+1, L] most likely tokens at that position, best first
    token_top_logprobs: jax.Array  # f32[R, K+1, L]
    prompt_logprobs: jax.Array  # f32[NL]          log p(next prompt token) of each prompt row
    prompt_top_ids: jax.Array  # int32[NL, L]
    prompt_top_logprobs: jax.Array  # f32[NL, L]


def prompt_logit_rows(src, lqsl, qsl, *, is_prefill, prompt_logprobs, prefill_len, prefill_last):
    """The verify-logits source rows with the prompt rows appended after the sampler's (``lqsl[R]`` on).

    ``src int32[NL]`` the packed-token row each verify-logits row reads (the sampler's layout), ``lqsl / qsl
    int32[R+1]`` the logit and token layouts; per row ``is_prefill``, ``prompt_logprobs`` (the plan asks for
    this chunk's prompt rows), ``prefill_len``, ``prefill_last``. A chunk scores every position but the prompt's
    last (whose distribution is the first generated token's). Returns ``(src, prompt_row_owner int32[NL]
    (-1: not a prompt row), prompt_row_offset int32[NL] (its position in the chunk))``."""
    nl = src.shape[0]
    n_rows = jnp.where(is_prefill & prompt_logprobs, prefill_len - prefill_last.astype(jnp.int32), 0)
    pqsl = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n_rows, dtype=jnp.int32)])
    i = jnp.arange(nl, dtype=jnp.int32) - lqsl[-1]  # index into the prompt rows
    owner_of = token_to_request(pqsl, nl)
    owner = jnp.where(i >= 0, owner_of[jnp.clip(i, 0, nl - 1)], -1)
    o = jnp.maximum(owner, 0)
    offset = i - pqsl[o]
    src = jnp.where(owner >= 0, qsl[o] + offset, src)
    return src, owner, offset


def _row_stats(scaled, target_tokens, *, num_top, vocab):
    """Per row of ``scaled f32[N, V]`` (log-probabilities up to a constant; on a mesh this device's slice of the
    vocabulary ``vocab``): log p of ``target_tokens int32[N]`` and the ``num_top`` best (ids, log p)."""
    lse = vocab.logsumexp(scaled)
    picked = vocab.take(scaled, jnp.clip(target_tokens, 0, vocab.size - 1))
    top_vals, top_ids = vocab.top_k(scaled, num_top)

    def clean(x):
        return jnp.where(x < _NEG, -jnp.inf, x)

    return clean(picked - lse), top_ids.astype(jnp.int32), clean(top_vals - lse[:, None])


def step_logprobs(raw_logits, logits, *, temperature, lr, lqsl, out_tokens, prompt_owner, prompt_offset,
                  prefill_tokens, qsl, prefill_len, next_prompt_token, mesh=None) -> LogprobsOutput:
    """The step's :class:`LogprobsOutput` from its verify logits.

    ``raw_logits f32[NL, V]`` the target's logits, ``logits`` the same after the sampling transform (what the
    sampler reads: ``temperature * transformed(logits / temperature)``), ``temperature f32[R]`` (<= 0: greedy,
    scored at 1), ``lr int32[NL]`` the request of each sampler row, ``lqsl int32[R+1]`` their layout,
    ``out_tokens int32[R, K+1]`` the sampler's tokens (column ``j`` read row ``lqsl[r] + j``); the prompt rows
    from :func:`prompt_logit_rows`, the packed ``prefill_tokens`` with their layout ``qsl``, ``prefill_len`` and
    the token after each chunk, ``next_prompt_token int32[R]``. ``mesh`` (its tensor axis splitting the
    vocabulary evenly): the log-sum-exp, the picked entries and the top tokens are computed on the vocabulary
    shards (each shard's top tokens, then a gather of ``NL x N x MAX_LOGPROBS`` candidates), not a gathered row."""
    nl, vocab = raw_logits.shape
    r, k1 = out_tokens.shape
    num_top = min(MAX_LOGPROBS, vocab)
    is_prompt = prompt_owner >= 0
    po = jnp.maximum(prompt_owner, 0)
    safe_t = jnp.where(temperature <= 0.0, 1.0, temperature)
    scaled = jnp.where(is_prompt[:, None], raw_logits.astype(jnp.float32), logits / safe_t[lr][:, None])
    # the token each row scores: the sampler's token at that column, or the prompt's next token
    li = jnp.arange(nl, dtype=jnp.int32) - lqsl[lr]
    emitted = out_tokens[lr, jnp.clip(li, 0, k1 - 1)]
    nxt_in_chunk = prompt_offset + 1 < prefill_len[po]
    t = prefill_tokens.shape[0]
    nxt = jnp.where(nxt_in_chunk, prefill_tokens[jnp.clip(qsl[po] + prompt_offset + 1, 0, t - 1)],
                    next_prompt_token[po])
    targets = jnp.where(is_prompt, nxt, emitted)
    split = split_vocab(mesh, vocab)
    if split is None:
        lp, top_ids, top_lp = _row_stats(scaled, targets, num_top=num_top, vocab=Vocab(vocab))
    else:
        stats = functools.partial(_row_stats, num_top=num_top, vocab=split)
        lp, top_ids, top_lp = vocab_shards(stats, mesh, [(None, "V"), ()], ())(scaled, targets)
    rows = jnp.clip(lqsl[:-1, None] + jnp.arange(k1, dtype=jnp.int32)[None, :], 0, nl - 1)  # [R, K+1]
    prows = jnp.clip(lqsl[-1] + jnp.arange(nl, dtype=jnp.int32), 0, nl - 1)
    return LogprobsOutput(token_logprobs=lp[rows], token_top_ids=top_ids[rows], token_top_logprobs=top_lp[rows],
                          prompt_logprobs=lp[prows], prompt_top_ids=top_ids[prows], prompt_top_logprobs=top_lp[prows])


# ---------------------------------------------------------------------------------------------- host side
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability and the ``k`` most likely tokens at its position.

    ``token_id``, ``logprob`` (its log-probability; ``-inf`` if a filter removed it), ``top``: ``k`` pairs
    ``(token id, log-probability)``, most likely first (argmax ties: lower id first), ``k`` as the request asked
    (``logprobs`` / ``prompt_logprobs``; 0: empty)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def as_dict(self) -> dict[int, float]:
        """``{token id: log-probability}``: the ``top`` alternatives and the token itself (vLLM's layout)."""
        out = dict(self.top)
        out[self.token_id] = self.logprob
        return out


def token_logprobs(token_id: int, logprob: float, top_ids, top_logprobs, k: int) -> TokenLogprobs:
    return TokenLogprobs(int(token_id), float(logprob),
                         tuple((int(i), float(v)) for i, v in zip(top_ids[:k], top_logprobs[:k])))


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """Log-likelihood of one continuation given its prompt (:meth:`spec_decode.Engine.score`).

    ``logprob``: the sum over the continuation's tokens of ``log p(token | everything before it)`` under the raw
    target distribution; ``token_ids`` the continuation's tokens, ``token_logprobs`` their log-probabilities,
    ``is_greedy[i]``: token ``i`` is the target's argmax there (lm-evaluation-harness's ``is_greedy`` is
    :attr:`greedy`: all of them)."""

    logprob: float
    token_ids: list[int]
    token_logprobs: list[float]
    is_greedy: list[bool]

    @property
    def greedy(self) -> bool:
        return all(self.is_greedy)
