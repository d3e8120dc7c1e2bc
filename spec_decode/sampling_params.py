"""Per-request sampling settings and the top-k / top-p filter applied to target and draft distributions.

Speculative sampling stays lossless under top-k / top-p as long as the target distribution that rejection sampling
reproduces is the *filtered* one: the verify logits are filtered before the sampler reads them. The same filter is
applied to the draft distribution the drafts are drawn from (the drafter's ``logit_filter`` hook), which keeps the
acceptance rate up; losslessness only needs the draft probabilities passed to the sampler to be the ones the drafts
were drawn from, which holds either way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.logprobs import check_logprobs_setting

__all__ = ["SamplingParams", "filter_logits"]

# Large finite negative instead of -inf: a filtered row never becomes all -inf (NaN after softmax).
_FILTERED = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    ``temperature`` 0 is greedy (argmax, ties to the lower id). ``top_k`` 0 and ``top_p`` 1.0 disable the filters;
    any ``top_k >= 0`` is valid, and one at or above the vocabulary size keeps every token (the engine clamps it to
    the vocabulary size). ``seed`` (an integer in ``[0, 2**31)``) makes sampling reproducible: every random draw
    is a function of (seed, absolute position, stream).
    Generation stops at ``max_new_tokens``, at the model's length limit, at an EOS id of the model (unless
    ``ignore_eos``) or at one of ``stop_token_ids``; the stop token itself is part of the output.

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
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)):
                object.__setattr__(self, name, float(v))
        for name in ("top_k", "seed", "max_new_tokens"):
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
        self.validate()

    def validate(self) -> None:
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) or not (
                math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be an integer in [0, 2**31), got {self.seed!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):  # spec_decode.logprobs: None or [0, MAX_LOGPROBS]
            object.__setattr__(self, name, check_logprobs_setting(name, getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """True when top-k or top-p changes the distribution."""
        return self.top_k > 0 or self.top_p < 1.0

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


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep each row's ``top_k`` largest logits and its smallest nucleus of mass ``top_p``; mask the rest.

    ``logits f32[N, V]`` (already divided by the temperature), ``top_k int32[N]`` (0: off), ``top_p f32[N]``
    (1.0: off). Ties at the top-k boundary are all kept (the filter is a value threshold), as is the token that
    crosses ``top_p``. The row's argmax always survives, so greedy rows are unaffected.
    """
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
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
