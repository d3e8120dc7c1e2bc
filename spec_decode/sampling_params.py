"""Per-request sampling settings and the logit transforms applied to target and draft distributions.

The transforms follow vLLM's definitions and order (``docs/ENGINE.md``, "Sampling parameters under speculation"):
on the raw logits ``min_tokens`` (stop ids masked), then the repetition, frequency and presence penalties; the
greedy argmax reads the result; sampling divides by the temperature and applies ``min_p``, then top-k, then top-p.

Speculative sampling stays lossless under them as long as the target distribution that rejection sampling
reproduces at each verify position is the *transformed* one, computed from the prefix that position has (prompt,
output so far, and the drafts before it): the verify logits are transformed before the sampler reads them. The
same transform is applied to the draft distribution the drafts are drawn from (the drafter's ``logit_filter``
hook), which keeps the acceptance rate up; losslessness only needs the draft probabilities passed to the sampler
to be the ones the drafts were drawn from, which holds either way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.platform import unroll_loops
from spec_decode.logprobs import check_logprobs_setting
from spec_decode.vocab_shards import Vocab, midpoint, ordered_key, split_vocab, vocab_shards

__all__ = ["SamplingParams", "apply_penalties", "filter_logits", "filter_logits_by_search", "mask_min_tokens",
           "sample_seed"]

# Large finite negative instead of -inf: a filtered row never becomes all -inf (NaN after softmax).
_FILTERED = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops (vLLM's names and definitions).

    ``temperature`` 0 is greedy (argmax, ties to the lower id). ``top_k`` 0 and ``top_p`` 1.0 disable the filters;
    any ``top_k >= 0`` is valid, and one at or above the vocabulary size keeps every token (the engine clamps it to
    the vocabulary size). ``min_p`` in ``[0, 1]`` (0: off) drops the tokens whose probability is below ``min_p``
    times the most likely token's. ``seed`` (an integer in ``[0, 2**31)``) makes sampling reproducible: every
    random draw is a function of (seed, absolute position, stream).

    Penalties (on the raw logits, before the temperature; they apply to greedy requests too):
    ``repetition_penalty`` (> 0, 1.0: off) divides the positive logits and multiplies the negative ones of every
    token that occurs in the prompt or the output so far; ``frequency_penalty`` (>= 0, 0: off) subtracts itself
    times the token's count in the output so far, ``presence_penalty`` (>= 0, 0: off) itself once for a token that
    occurs there. (vLLM also allows negative frequency / presence penalties, which reward repetition; they are
    refused here.)

    Generation stops at ``max_new_tokens``, at the model's length limit, at an EOS id of the model (unless
    ``ignore_eos``) or at one of ``stop_token_ids`` (the stop token itself is part of the output), or when the
    detokenized output contains one of the ``stop`` strings (a string, or a list of non-empty strings; needs the
    engine's tokenizer): the text is cut before the match and the token ids end with the token that completed it.
    ``min_tokens`` (``<= max_new_tokens``) suppresses EOS and the stop ids (their logits are masked) and the stop
    strings until that many tokens were generated.

    ``n`` samples per prompt: sample ``j`` samples with ``sample_seed(seed, j) = seed + j`` (so ``seed + n - 1``
    must stay below 2**31); the engine returns them prompt-major (``docs/ENGINE.md``).

    numpy scalars are accepted and stored as Python ``int`` / ``float`` / ``bool``; anything invalid raises
    ``ValueError`` naming the field.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)):
                object.__setattr__(self, name, float(v))
        for name in ("top_k", "seed", "max_new_tokens", "min_tokens", "n"):
            v = getattr(self, name)
            if isinstance(v, np.integer):
                object.__setattr__(self, name, int(v))
        if isinstance(self.ignore_eos, np.bool_):
            object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        stop = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (Sequence, np.ndarray)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {type(stop).__name__}")
        for j, t in enumerate(stop):
            if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_)):
                raise ValueError(f"stop_token_ids holds {t!r} at position {j}: token ids must be integers")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        texts = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if isinstance(texts, bytes) or not isinstance(texts, (Sequence, np.ndarray)):
            raise ValueError(f"stop must be a string or a list of strings, got {type(texts).__name__}")
        for j, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(f"stop holds {t!r} at position {j}: stop sequences must be strings")
            if t == "":
                raise ValueError(f"stop holds an empty string at position {j}: a stop sequence needs at least one "
                                 f"character")
        object.__setattr__(self, "stop", tuple(dict.fromkeys(texts)))
        self.validate()

    def validate(self) -> None:
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_num(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p!r}")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0: off), got {self.min_p!r}")
        if not is_num(self.repetition_penalty) or not (math.isfinite(self.repetition_penalty)
                                                      and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1.0: off), got "
                             f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (0: off), got {v!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be an integer in [0, 2**31), got {self.seed!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], got "
                             f"{self.min_tokens!r}")
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n (samples per prompt) must be an integer >= 1, got {self.n!r}")
        if self.seed + self.n - 1 >= 2**31:
            raise ValueError(f"seed={self.seed} with n={self.n}: sample j samples with seed + j, and seed + "
                             f"{self.n - 1} is not below 2**31")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):  # spec_decode.logprobs: None or [0, MAX_LOGPROBS]
            object.__setattr__(self, name, check_logprobs_setting(name, getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """True when min-p, top-k or top-p changes the distribution."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def penalized(self) -> bool:
        """True when a penalty is on: the request needs its token counts on the device."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_sampling_program(self) -> bool:
        """True when the greedy programs (argmax of the raw logits) cannot serve this request."""
        return self.temperature > 0 or self.penalized or self.min_tokens > 0

    @property
    def wants_logprobs(self) -> bool:
        """True when the request asks for generated or prompt log-probabilities (it runs sampling programs)."""
        return self.logprobs is not None or self.prompt_logprobs is not None

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def stop_ids(self, eos_token_ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
        """The token ids that end this request (EOS unless ignored, then the extra stop ids), checked."""
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids holds {t}, outside the vocabulary [0, {vocab_size})")
        ids = () if self.ignore_eos else tuple(eos_token_ids)
        return tuple(dict.fromkeys(ids + self.stop_token_ids))


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def sample_seed(seed: int, sample: int) -> int:
    """The seed of sample ``sample`` of a request with ``n > 1`` (vLLM's rule: ``seed + sample``)."""
    return seed + sample


def mask_min_tokens(logits: jax.Array, emitted: jax.Array, min_tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """Mask the stop ids of rows that have emitted fewer than ``min_tokens`` tokens before the one they sample.

    ``logits f32[N, V]``, ``emitted int32[N]`` (tokens before the sampled one), ``min_tokens int32[N]``,
    ``stop_ids int32[N, M]`` (-1 padded: EOS unless ignored, then the request's stop ids)."""
    v = logits.shape[-1]
    active = (emitted < min_tokens)[:, None] & (stop_ids >= 0)
    hit = jnp.zeros(logits.shape, bool).at[jnp.arange(logits.shape[0])[:, None],
                                           jnp.where(active, stop_ids, v)].set(True, mode="drop")
    return jnp.where(hit, _FILTERED, logits)


def apply_penalties(logits: jax.Array, counts: jax.Array, prompt_mask: jax.Array, repetition: jax.Array,
                    frequency: jax.Array, presence: jax.Array, temperature: jax.Array | None = None) -> jax.Array:
    """vLLM's penalties on ``logits f32[N, V]``: ``counts int32[N, V]`` (each token's count in the output so far,
    at this position), ``prompt_mask bool[N, V]`` (it occurs in the prompt), per-row ``f32[N]`` penalties
    (1.0 / 0 / 0: off, an identity whatever the counts).

    The repetition penalty divides a positive logit and multiplies a negative one of every token in the prompt or
    the output; then ``frequency * count`` and ``presence * (count > 0)`` are subtracted. ``temperature f32[N]``
    (> 0): the logits are already divided by it, so the subtracted terms are too (the result is the penalised raw
    logits divided by the temperature: the repetition penalty commutes with a positive scale)."""
    seen = counts > 0
    rep = jnp.where(seen | prompt_mask, repetition[:, None], 1.0)
    out = jnp.where(logits > 0, logits / rep, logits * rep)
    sub = frequency[:, None] * counts.astype(jnp.float32) + presence[:, None] * seen.astype(jnp.float32)
    if temperature is not None:
        sub = sub / temperature[:, None]
    return out - sub


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array | None = None, *,
                  mesh=None) -> jax.Array:
    """Keep each row's ``top_k`` largest logits and its smallest nucleus of mass ``top_p``; mask the rest.

    ``logits f32[N, V]`` (already divided by the temperature), ``top_k int32[N]`` (0: off), ``top_p f32[N]``
    (1.0: off), ``min_p f32[N]`` (0: off; applied first, as vLLM does: a token less likely than ``min_p`` times
    the row's most likely one is masked, and top-k / top-p see what is left). Ties at the top-k boundary are all
    kept (the filter is a value threshold), as is the token that crosses ``top_p``. The row's argmax always
    survives, so greedy rows are unaffected.

    One device sorts the row. ``mesh`` (with a tensor axis over which the vocabulary splits evenly): the same
    thresholds found on the vocabulary shards without gathering a row (:func:`filter_logits_by_search`).
    """
    vocab = split_vocab(mesh, logits.shape[-1])
    if vocab is not None:
        if min_p is None:
            min_p = jnp.zeros(top_p.shape, jnp.float32)
        run = vocab_shards(functools.partial(filter_logits_by_search, vocab=vocab), mesh,
                           [(None, "V"), (), (), ()], (None, "V"))
        return run(logits.astype(jnp.float32), top_k, top_p, min_p)
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    if min_p is not None:  # p >= min_p * p_max  <=>  logit >= max logit + log(min_p)
        floor = jnp.max(logits, axis=-1) + jnp.log(jnp.where(min_p > 0, min_p, 1.0))
        floor = jnp.where(min_p > 0, floor, -jnp.inf)
        logits = jnp.where(logits >= floor[:, None], logits, _FILTERED)
    srt = -jnp.sort(-logits, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)  # [N, 1]
    probs = jax.nn.softmax(srt, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly larger entries
    in_nucleus = mass_before < top_p[:, None]
    # the smallest logit still inside the nucleus (the first entry is always inside)
    nucleus_min = jnp.min(jnp.where(in_nucleus, srt, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth, jnp.where(top_p[:, None] < 1.0, nucleus_min, -jnp.inf))
    return jnp.where(logits >= threshold, logits, _FILTERED)


def filter_logits_by_search(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array, *,
                            vocab: Vocab | None = None) -> jax.Array:
    """:func:`filter_logits` without a sort: the top-k and top-p thresholds found by bisection over the float
    order, on a row that may be split over devices (``vocab``: a :class:`spec_decode.vocab_shards.Vocab`, then
    ``logits`` is this device's ``[N, V / N]`` slice inside its ``shard_map``; None: the whole row).

    Over the 2^32 ``int32`` keys ordered as the float values (:func:`spec_decode.vocab_shards.ordered_key`), 32
    halvings find, per row,

    * the top-k threshold: the largest key ``t`` with ``count(key >= t) >= k``, i.e. the ``k``-th largest logit
      exactly (the counts are integers, summed over the shards);
    * the top-p threshold: the smallest key ``t`` whose mass strictly above it, ``S(t) = sum(p_v : key_v > t)``,
      is below ``top_p``; ``{v : key_v >= t}`` is exactly the nucleus of the sort (every token whose strictly
      larger entries hold less than ``top_p``, ties kept). ``S`` is a float sum (over each shard, then a
      ``psum``): it can round differently from the sort's cumulative sum, so a row whose nucleus boundary mass
      lies within that rounding of ``top_p`` may keep one tie group more or less.

    Both searches run in one loop of 32 steps, each reducing ``2 N`` numbers over the shards; min-p needs one
    ``pmax``."""
    x = logits.astype(jnp.float32)
    vocab = Vocab(x.shape[-1]) if vocab is None else vocab
    v = vocab.size
    floor = vocab.max(x) + jnp.log(jnp.where(min_p > 0, min_p, 1.0))
    floor = jnp.where(min_p > 0, floor, -jnp.inf)
    x = jnp.where(x >= floor[:, None], x, _FILTERED)
    keys = ordered_key(x)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v).astype(jnp.float32)
    probs = vocab.softmax(x)
    lowest, highest = vocab.min(keys), vocab.max(keys)
    # invariants: count(key >= k_lo) >= k > count(key >= k_hi); S(p_lo) >= top_p > S(p_hi)
    init = (lowest, highest + 1, lowest - 1, highest)

    def halve(_, carry):
        k_lo, k_hi, p_lo, p_hi = carry
        k_mid, p_mid = midpoint(k_lo, k_hi), midpoint(p_lo, p_hi)
        count = jnp.sum((keys >= k_mid[:, None]).astype(jnp.float32), axis=-1)
        mass = jnp.sum(jnp.where(keys > p_mid[:, None], probs, 0.0), axis=-1)
        count, mass = vocab.total(jnp.stack([count, mass]))  # one reduction of 2 N numbers
        k_ok, p_ok = count >= k, mass < top_p
        return (jnp.where(k_ok, k_mid, k_lo), jnp.where(k_ok, k_hi, k_mid),
                jnp.where(p_ok, p_lo, p_mid), jnp.where(p_ok, p_mid, p_hi))

    # unrolled on a GPU: a rolled loop is an XLA while loop, which a GPU drives from the host (a predicate read
    # back and a launch per iteration, docs/BENCHMARKS.md "The launch of a host step"): 32 of them in every sampling
    # step. Rolled elsewhere (pallas_kernels.platform.unroll_loops): one body to compile
    kth, _, _, nucleus = jax.lax.fori_loop(0, 32, halve, init, unroll=unroll_loops())
    threshold = jnp.maximum(kth, jnp.where(top_p < 1.0, nucleus, lowest))
    return jnp.where(keys >= threshold[:, None], x, _FILTERED)
