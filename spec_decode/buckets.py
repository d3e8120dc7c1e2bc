"""The engine's closed set of step shapes: which programs exist, derived once from the engine's settings.

Every step of the host loop runs one of a fixed, documented list of compiled programs, and ``Engine.warmup()``
compiles the whole list before the first request (``docs/ENGINE.md``, "The closed program set"):

* **rows**: always ``max_num_seqs``. The step's request metadata (slots, block tables, sampling settings) is
  sized to the engine's slots, as the JAX serving engines size theirs; idle slots are zero-length padding rows.
* **packed tokens** ``T``: powers of two from ``min_token_bucket`` up to the largest step the scheduler can build,
  ``max_num_seqs * (1 + K) + max_num_batched_tokens`` (every slot verifying ``K`` drafts while a prefill chunk
  rides along), whose own size, rounded up to a multiple of 512 (or to a power of two below that), is the last
  bucket, so every bucket is a whole number of the kernels' token tiles;
* **verify-logits rows**: a function of ``T`` (:func:`logit_rows`): never more than ``max_total_logit_rows``.

* **sampling**: a greedy program (the argmax rule alone) and a sampling program (every row: greedy rows stay
  greedy, top-k / top-p applied) for each token bucket. A step samples when any of its rows has a temperature.
* **draft length** ``K_d``: the positions each row drafts, one of the engine's ``draft_lengths`` (adaptive
  verification with a profiled cost table: ``0, 3, K`` by default; otherwise ``K`` alone). The longest length
  has every token bucket. A shorter one serves decode steps only (no prefill chunk rides along) at the
  ``length_buckets`` (2; ``Engine(draft_length_buckets=...)``) largest buckets up to the one holding every
  slot's ``1 + K_d`` tokens: a plan that drafts less is for steps where many slots decode, and the smaller
  buckets would multiply the programs to compile for steps the longest length serves as well. The planner only
  chooses a length that has a bucket for the step. (In a wave's tail, where few slots decode, that leaves the
  shorter lengths at sizes well above the step: the plan drafts ``K`` there, or keeps the shorter length at its
  smallest size, and either costs the tail a little; docs/ADAPTIVE_VERIFICATION.md, "What the table does not
  see".) Length ``0`` keeps at most :data:`ZERO_LENGTH_BUCKETS` of them whatever ``length_buckets`` is: a plan
  that drafts nothing is for full batches, where verifying costs more than it gains, never for a tail, where it
  costs almost nothing.
* **prefill-only steps draft nothing**: a speculative engine whose slots' draft positions reach half a prefill
  chunk (``2 * max_num_seqs * K >= max_num_batched_tokens``) always has length ``0`` programs, and these also take
  the bucket holding ``max_num_batched_tokens`` (a full prefill chunk). Below that, the drafter's work on a
  prefill step is small beside the chunk's and the extra programs are not worth compiling. A step
  with no decode row (the device loop's prefill waves, a burst of admissions) then runs no drafter forward over
  its ``max_num_seqs`` rows: only the drafter's context write. When ``0`` is not one of the engine's draft lengths
  (fixed verification, or an adaptive engine given other lengths), these prefill buckets are its only ones and
  the planner never chooses it for a step that decodes.
* **a closed call's prefill drafts nothing either**: an adaptive engine that plans length ``0`` also has it at the
  bucket holding ``max_num_seqs + max_num_batched_tokens``, a full chunk beside every slot decoding one token.
  While every request of a call has a slot and some are still prefilling, the scheduler gives such steps length
  ``0`` (:meth:`spec_decode.scheduler.Scheduler.schedule`, ``docs/ADAPTIVE_VERIFICATION.md``).

Per-row sampling settings, stop ids and lengths are plan arrays, so no setting or arrival order can reach a
shape that was not compiled.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ZERO_LENGTH_BUCKETS", "StepKey", "default_draft_lengths", "logit_rows", "next_pow2", "step_keys",
           "token_bucket", "token_buckets"]


# decode buckets of length 0 (no drafts) at most, whatever ``length_buckets`` gives the other shorter lengths
ZERO_LENGTH_BUCKETS = 2


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True, order=True)
class StepKey:
    """The shape of one compiled step program (its cache key): packed tokens, verify-logits rows, sampling, and
    the draft length (``-1``: the engine's K)."""

    tokens: int
    logit_rows: int
    sampling: bool = False
    draft_len: int = -1


def default_draft_lengths(num_speculative_tokens: int) -> tuple[int, ...]:
    """The draft lengths an adaptive engine compiles by default: ``0, 3`` and ``K`` (those ``<= K``).

    Length 1 was a default until session 31: the plan chose it in at most 4% of steps at any concurrency, yet it
    was 2 of the greedy device loop's 10 branches. Without it the loops compile and load faster, and at 64
    requests on an H100 the loop was no slower in any timed set (docs/ADAPTIVE_VERIFICATION.md, "The planner's
    cost in the device loop", sessions 30-31)."""
    k = int(num_speculative_tokens)
    return tuple(sorted({d for d in (0, 3) if d < k} | {k}))


def token_buckets(*, max_num_seqs: int, num_speculative_tokens: int, max_num_batched_tokens: int,
                  min_token_bucket: int) -> tuple[int, ...]:
    """Packed-token sizes of the closed set, ascending (see the module docstring)."""
    lo = next_pow2(max(min_token_bucket, 1))
    most = max_num_seqs * (1 + num_speculative_tokens) + max_num_batched_tokens
    tile = max(lo, min(512, next_pow2(most)))
    top = -(-most // tile) * tile
    out = []
    t = lo
    while t < top:
        out.append(t)
        t *= 2
    return tuple(out) + (top,)


def token_bucket(buckets: tuple[int, ...], num_tokens: int) -> int:
    """The smallest bucket holding ``num_tokens`` packed tokens."""
    for t in buckets:
        if t >= num_tokens:
            return t
    raise ValueError(f"a step of {num_tokens} packed tokens exceeds the largest compiled bucket {buckets[-1]}")


def logit_rows(tokens: int, *, rows: int, num_speculative_tokens: int, max_total_logit_rows: int) -> int:
    """Verify-logits rows of a token bucket: every row's ``1 + K`` at most, and never over the memory bound."""
    return max(1, min(tokens, max_total_logit_rows, rows * (1 + num_speculative_tokens)))


def step_keys(*, max_num_seqs: int, num_speculative_tokens: int, max_num_batched_tokens: int,
              min_token_bucket: int, max_total_logit_rows: int,
              draft_lengths: tuple[int, ...] | None = None, length_buckets: int = 2,
              sampling: bool = True) -> tuple[StepKey, ...]:
    """Every program of the host loop: greedy ones, then sampling ones (``sampling=False``: none), each by draft
    length, then tokens.

    ``draft_lengths`` None: ``K`` alone (keys carry ``draft_len = K``), and length ``0`` for prefill-only steps
    where the module docstring says."""
    k = num_speculative_tokens
    lengths = (k,) if draft_lengths is None else tuple(sorted(set(draft_lengths)))
    if any(not 0 <= d <= k for d in lengths):
        raise ValueError(f"draft lengths must lie in [0, K={k}], got {lengths}")
    kw = dict(rows=max_num_seqs, max_total_logit_rows=max_total_logit_rows)
    union = sorted({t for d in lengths for t in token_buckets(
        max_num_seqs=max_num_seqs, num_speculative_tokens=d, max_num_batched_tokens=max_num_batched_tokens,
        min_token_bucket=min_token_bucket)})
    plannable = set(lengths)
    # prefill-only steps draft nothing, where the slots' draft positions would reach half a prefill chunk
    prefill_zero = k > 0 and 2 * max_num_seqs * k >= max_num_batched_tokens
    if prefill_zero:
        lengths = tuple(sorted(plannable | {0}))
    prefill_top = next(t for t in union if t >= max_num_batched_tokens)
    prefill = [prefill_top]
    if 0 in plannable and prefill_zero:  # a full chunk beside every slot decoding one token (a closed call's prefill)
        prefill.append(next(t for t in union if t >= max_num_seqs + max_num_batched_tokens))
    keys = []
    for sample in (False, True) if sampling else (False,):
        for d in lengths:
            if d == lengths[-1]:
                top = next(t for t in union if t >= max_num_seqs * (1 + d) + max_num_batched_tokens)
                ts = [t for t in union if t <= top]
            else:
                top = next(t for t in union if t >= max_num_seqs * (1 + d))
                keep = min(length_buckets, ZERO_LENGTH_BUCKETS) if d == 0 else length_buckets
                ts = [t for t in union if t <= top][-keep:] if d in plannable else []
                if d == 0 and prefill_zero:
                    ts = sorted(set(ts) | set(prefill))
            keys += [StepKey(t, logit_rows(t, num_speculative_tokens=d, **kw), sample, d) for t in ts]
    return tuple(keys)
