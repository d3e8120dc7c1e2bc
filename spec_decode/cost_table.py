"""Profiled step costs for the budget planner (docs/ADAPTIVE_VERIFICATION.md).

A :class:`CostTable` holds seconds per call of the engine's compiled steps at the shape buckets it compiles:

* the verify step, keyed by the total number of verify tokens (anchors plus verified drafts) it was compiled for;
* the draft step, keyed by the number of request rows;
* the draft length: the extra seconds a step pays for drafting ``K_d`` positions per row, keyed by ``K_d``
  (0 for ``K_d = 0``, or for a table without draft lengths: then the verify costs include the drafting);
* or, in place of the last two, **whole steps per draft length** (:attr:`CostTable.per_length`): for each
  ``K_d``, the seconds of a step by packed tokens, as timed, with no model in between.

A step that drafts ``K_d`` positions and verifies ``T`` packed tokens at ``R`` rows costs
``draft_cost(R) + step_cost(T, K_d)``: ``draft_length_cost(K_d) + verify_cost(T)`` in the additive form, or the
length's own entry at ``T`` in the per-length form. The engine times the device loop's branches in the loop
itself and keeps them per length (:meth:`CostTable.from_step_times`): each length is compiled at its own few
buckets, so no bucket need be shared between lengths. :func:`split_step_costs` fits the additive form to timings
of a closed set whose longest length has every bucket (the host-launched profile of an engine without a device
loop): the drafter's work does not depend on ``T`` and the target's does not depend on ``K_d``.

:class:`CostTableArrays` is the same table as fixed-size device arrays and :func:`lookup_device` its lookup in
jnp, for the planner that runs inside the jitted offline loop (``spec_decode.device_loop``).

Lookups behave like the engine: a step with ``n`` tokens runs the smallest compiled bucket ``>= n`` and pays its
time (a step function inside the buckets). Times are made non-decreasing with a running max, because a larger
bucket can never be cheaper to run than padding up to it; beyond the largest bucket the cost is extrapolated
linearly. A missing table, or one whose step costs are all equal, is *flat*: it carries no trade-off, and the
planner then verifies everything.

The table is saved as ``cost_table.json`` next to the model (:func:`save_cost_table`, :func:`load_cost_table`).
"""

from __future__ import annotations

import itertools
import json
import math
import numbers
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "COST_TABLE_FILENAME",
    "CostTable",
    "CostTableArrays",
    "draft_length_cost_device",
    "load_cost_table",
    "profile_cost_table",
    "save_cost_table",
    "split_step_costs",
    "step_cost_device",
    "step_costs_device",
    "time_callable",
]

COST_TABLE_FILENAME = "cost_table.json"
_FORMAT_VERSION = 3  # 2 added the draft lengths, 3 the per-length steps; version 1 and 2 files still load


def _normalise(name: str, keys: Sequence[int], seconds: Sequence[float], *, minimum: int = 1,
               what: str = "buckets") -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Sort by key (bucket, or draft length), validate (integers ``>= minimum``, distinct; timings finite and
    ``>= 0``), and apply the running max."""
    if len(keys) != len(seconds):
        raise ValueError(f"{name}: {len(keys)} {what} but {len(seconds)} timings")
    pairs = []
    for b, s in zip(keys, seconds):
        if isinstance(b, bool) or int(b) != b or int(b) < minimum:
            kind = "positive integers" if minimum == 1 else f"integers >= {minimum}"
            raise ValueError(f"{name}: {what} must be {kind}, got {b!r}")
        s = float(s)
        if not math.isfinite(s) or s < 0:
            raise ValueError(f"{name}: timings must be finite and >= 0, got {s!r} for {what[:-1]} {b}")
        pairs.append((int(b), s))
    pairs.sort()
    for (b0, _), (b1, _) in itertools.pairwise(pairs):
        if b0 == b1:
            raise ValueError(f"{name}: duplicate {what[:-1]} {b0}")
    out_b, out_s, running = [], [], 0.0
    for b, s in pairs:
        running = max(running, s)
        out_b.append(b)
        out_s.append(running)
    return tuple(out_b), tuple(out_s)


def _lookup(buckets: tuple[int, ...], seconds: tuple[float, ...], n) -> np.ndarray:
    """Step function inside the buckets, linear extrapolation above the largest one (vectorised over n)."""
    n = np.maximum(np.asarray(n, np.int64), 0)
    if not buckets:
        return np.zeros(n.shape, np.float64)
    b = np.asarray(buckets, np.int64)
    s = np.asarray(seconds, np.float64)
    idx = np.searchsorted(b, n, side="left")  # the smallest bucket >= n
    inside = s[np.minimum(idx, len(b) - 1)]
    if len(b) == 1:
        slope = s[-1] / b[-1]  # proportional: the only slope one point gives
    else:
        slope = (s[-1] - s[-2]) / (b[-1] - b[-2])  # >= 0 after the running max
    above = s[-1] + slope * (n - b[-1])
    return np.where(idx < len(b), inside, above)


@dataclass(frozen=True)
class CostTable:
    """Seconds per verify step (by total verify tokens), per draft step (by request rows) and per draft length.

    Construction sorts the buckets and forces the timings non-decreasing (running max); the raw measurements
    are kept in ``metadata`` by the profiler if wanted. ``draft_lengths`` are the ``K_d`` a planner may choose
    from (empty: only the engine's K, whose drafting the verify costs include). ``per_length`` holds whole step
    costs per draft length instead (:meth:`from_step_times`); its lengths are then :attr:`draft_lengths`, at cost
    0 (their steps hold their drafting).
    """

    verify_buckets: tuple[int, ...] = ()
    verify_seconds: tuple[float, ...] = ()
    draft_buckets: tuple[int, ...] = ()
    draft_seconds: tuple[float, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)
    draft_lengths: tuple[int, ...] = ()
    draft_length_seconds: tuple[float, ...] = ()
    # ((K_d, buckets, seconds), ...) ascending in K_d: whole steps per draft length (then the verify and
    # draft-length terms are unused)
    per_length: tuple[tuple[int, tuple[int, ...], tuple[float, ...]], ...] = ()

    def __post_init__(self):
        vb, vs = _normalise("verify", self.verify_buckets, self.verify_seconds)
        db, ds = _normalise("draft", self.draft_buckets, self.draft_seconds)
        dl, dls = _normalise("draft", self.draft_lengths, self.draft_length_seconds, minimum=0, what="lengths")
        object.__setattr__(self, "verify_buckets", vb)
        object.__setattr__(self, "verify_seconds", vs)
        object.__setattr__(self, "draft_buckets", db)
        object.__setattr__(self, "draft_seconds", ds)
        object.__setattr__(self, "draft_lengths", dl)
        object.__setattr__(self, "draft_length_seconds", dls)
        object.__setattr__(self, "metadata", dict(self.metadata))
        per = []
        for d, buckets, seconds in self.per_length:
            if isinstance(d, bool) or int(d) != d or int(d) < 0:
                raise ValueError(f"per_length: draft lengths must be integers >= 0, got {d!r}")
            if not len(buckets):
                raise ValueError(f"per_length: draft length {d} has no buckets")
            per.append((int(d),) + _normalise(f"per_length[{int(d)}]", buckets, seconds))
        per.sort()
        for (d0, *_), (d1, *_) in itertools.pairwise(per):
            if d0 == d1:
                raise ValueError(f"per_length: duplicate draft length {d0}")
        object.__setattr__(self, "per_length", tuple(per))
        if per:
            if self.verify_buckets or self.draft_length_seconds and any(self.draft_length_seconds):
                raise ValueError("a cost table holds per-length steps or verify and draft-length terms, not both")
            object.__setattr__(self, "draft_lengths", tuple(d for d, _, _ in per))
            object.__setattr__(self, "draft_length_seconds", (0.0,) * len(per))

    @classmethod
    def from_measurements(
        cls,
        verify: Mapping[int, float],
        draft: Mapping[int, float] | None = None,
        *,
        draft_lengths: Mapping[int, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> CostTable:
        """Build from ``{bucket: seconds}`` mappings (``draft_lengths``: ``{K_d: seconds}``)."""
        draft = draft or {}
        lengths = draft_lengths or {}
        return cls(tuple(verify), tuple(verify.values()), tuple(draft), tuple(draft.values()), metadata or {},
                   tuple(lengths), tuple(lengths.values()))

    @classmethod
    def from_step_times(cls, steps: Mapping[tuple[int, int], float], draft: Mapping[int, float] | None = None, *,
                        metadata: Mapping[str, Any] | None = None) -> CostTable:
        """A per-length table from whole-step timings ``{(K_d, tokens): seconds}``."""
        lengths = sorted({int(d) for d, _ in steps})
        per = tuple((d, tuple(t for (dd, t) in steps if dd == d), tuple(s for (dd, _), s in steps.items() if dd == d))
                    for d in lengths)
        draft = draft or {}
        return cls(draft_buckets=tuple(draft), draft_seconds=tuple(draft.values()), metadata=metadata or {},
                   per_length=per)

    def _length_entry(self, draft_len: int | None):
        """The per-length entry a step of ``draft_len`` pays: the smallest tabled length ``>= draft_len`` (the
        largest above them all, or for None)."""
        if draft_len is None:
            return self.per_length[-1]
        return next((e for e in self.per_length if e[0] >= int(draft_len)), self.per_length[-1])

    def step_costs(self, num_tokens, draft_len: int | None = None) -> np.ndarray:
        """Seconds of a step over ``num_tokens`` packed tokens (any shape, ``float64``) that drafts ``draft_len``
        positions per row, less the draft side's :meth:`draft_cost`: the length's own steps (per-length table),
        else ``draft_length_cost(draft_len) + verify_cost(num_tokens)`` (None: the verify cost alone, or the
        longest length's steps)."""
        if self.per_length:
            _, buckets, seconds = self._length_entry(draft_len)
            return _lookup(buckets, seconds, num_tokens)
        extra = 0.0 if draft_len is None else self.draft_length_cost(draft_len)
        return extra + _lookup(self.verify_buckets, self.verify_seconds, num_tokens)

    def step_cost(self, num_tokens: int, draft_len: int | None = None) -> float:
        """Scalar :meth:`step_costs`."""
        return float(self.step_costs(num_tokens, draft_len))

    @property
    def step_buckets(self) -> tuple[int, ...]:
        """Every packed-token bucket the table holds (verify buckets, or every length's)."""
        return tuple(sorted(set(self.verify_buckets).union(*(b for _, b, _ in self.per_length))))

    def with_step_overhead(self, seconds: float) -> CostTable:
        """The same table with ``seconds`` added to every step (each verify cost, or each per-length step)."""
        if seconds == 0:
            return self
        return CostTable(self.verify_buckets, tuple(s + seconds for s in self.verify_seconds), self.draft_buckets,
                         self.draft_seconds, self.metadata, () if self.per_length else self.draft_lengths,
                         () if self.per_length else self.draft_length_seconds,
                         tuple((d, b, tuple(x + seconds for x in ss)) for d, b, ss in self.per_length))

    def verify_cost(self, num_tokens: int) -> float:
        """Seconds of a verify step over ``num_tokens`` packed tokens."""
        return float(_lookup(self.verify_buckets, self.verify_seconds, num_tokens))

    def draft_cost(self, num_requests: int) -> float:
        """Seconds of a draft step over ``num_requests`` request rows (0 when no draft timings exist)."""
        return float(_lookup(self.draft_buckets, self.draft_seconds, num_requests))

    def draft_length_cost(self, draft_len: int) -> float:
        """Extra seconds of a step that drafts ``draft_len`` positions per row: the smallest tabled length
        ``>= draft_len`` (the largest one's above it); 0 for a table without draft lengths."""
        if not self.draft_lengths:
            return 0.0
        i = int(np.searchsorted(np.asarray(self.draft_lengths), int(draft_len), side="left"))
        return float(self.draft_length_seconds[min(i, len(self.draft_lengths) - 1)])

    def verify_costs(self, num_tokens) -> np.ndarray:
        """Vectorised :meth:`verify_cost`: ``float64`` array shaped like ``num_tokens``."""
        return _lookup(self.verify_buckets, self.verify_seconds, num_tokens)

    def draft_costs(self, num_requests) -> np.ndarray:
        """Vectorised :meth:`draft_cost`."""
        return _lookup(self.draft_buckets, self.draft_seconds, num_requests)

    @property
    def is_flat(self) -> bool:
        """True when the step costs carry no trade-off (no timings, or all equal): verify everything."""
        return len(set(self.verify_seconds).union(*(s for _, _, s in self.per_length))) < 2

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": _FORMAT_VERSION,
            "verify": {str(b): s for b, s in zip(self.verify_buckets, self.verify_seconds)},
            "draft": {str(b): s for b, s in zip(self.draft_buckets, self.draft_seconds)},
            "draft_lengths": {str(d): s for d, s in zip(self.draft_lengths, self.draft_length_seconds)},
            "per_length": {str(d): {str(b): x for b, x in zip(bs, ss)} for d, bs, ss in self.per_length},
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostTable:
        if not isinstance(data, Mapping) or "verify" not in data:
            raise ValueError("cost table data must be a mapping with a 'verify' entry")
        version = data.get("format_version", _FORMAT_VERSION)
        if version not in (1, 2, _FORMAT_VERSION):
            raise ValueError(
                f"unsupported cost table format_version {version!r} (expected {_FORMAT_VERSION})"
            )
        verify = {int(k): float(v) for k, v in data["verify"].items()}
        draft = {int(k): float(v) for k, v in data.get("draft", {}).items()}
        lengths = {int(k): float(v) for k, v in data.get("draft_lengths", {}).items()}
        per = {(int(d), int(b)): float(x) for d, row in data.get("per_length", {}).items() for b, x in row.items()}
        if per:
            return cls.from_step_times(per, draft, metadata=data.get("metadata", {}))
        return cls.from_measurements(verify, draft, draft_lengths=lengths, metadata=data.get("metadata", {}))

    def save(self, path: str | os.PathLike) -> str:
        """See :func:`save_cost_table`."""
        return save_cost_table(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostTable | None:
        """See :func:`load_cost_table`."""
        return load_cost_table(path)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class CostTableArrays:
    """A :class:`CostTable` as fixed-size device arrays, for the budget planner inside a jitted loop.

    ``verify_buckets / verify_seconds [CAPACITY]`` hold the table's entries first (``num_verify`` of them), then
    padding; the draft side likewise; a per-length table fills ``length_ids [LENGTHS]`` and, per length, its
    row of ``length_buckets / length_seconds [LENGTHS, CAPACITY]`` (``num_length_buckets`` entries each; the
    additive form's arrays are then empty). Passing a table this way (an argument, not a constant) lets one
    compiled program run with any table of up to :attr:`CAPACITY` entries. ``flat`` is :attr:`CostTable.is_flat`
    (or no table at all): the planner then verifies everything.
    """

    verify_buckets: jax.Array  # int32[C]
    verify_seconds: jax.Array  # f32[C]
    num_verify: jax.Array  # int32[]
    draft_buckets: jax.Array  # int32[C]
    draft_seconds: jax.Array  # f32[C]
    num_draft: jax.Array  # int32[]
    flat: jax.Array  # bool[]
    draft_lengths: jax.Array  # int32[C]
    draft_length_seconds: jax.Array  # f32[C]
    num_draft_lengths: jax.Array  # int32[]
    length_ids: jax.Array  # int32[L]        the per-length table's K_d, ascending
    length_buckets: jax.Array  # int32[L, C]
    length_seconds: jax.Array  # f32[L, C]
    num_length_buckets: jax.Array  # int32[L]
    num_lengths: jax.Array  # int32[]         0: the additive form

    CAPACITY = 32
    LENGTHS = 8

    @classmethod
    def from_table(cls, table: CostTable | None) -> CostTableArrays:
        """Host-side conversion (numpy leaves; ``jax.device_put`` them or pass them to a jitted function)."""
        c, nl = cls.CAPACITY, cls.LENGTHS
        vb, vs = (table.verify_buckets, table.verify_seconds) if table is not None else ((), ())
        db, ds = (table.draft_buckets, table.draft_seconds) if table is not None else ((), ())
        per = table.per_length if table is not None else ()
        dl, dls = ((table.draft_lengths, table.draft_length_seconds) if table is not None and not per else ((), ()))
        if len(vb) > c or len(db) > c or len(dl) > c or any(len(b) > c for _, b, _ in per):
            raise ValueError(f"a cost table for the device loop holds at most {c} buckets per side, got "
                             f"{len(vb)} verify and {len(db)} draft buckets")
        if len(per) > nl:
            raise ValueError(f"a cost table for the device loop holds at most {nl} draft lengths, got {len(per)}")

        def pad(values, dtype):
            out = np.zeros(c, dtype)
            out[: len(values)] = values
            return out

        ids = np.zeros(nl, np.int32)
        ids[: len(per)] = [d for d, _, _ in per]
        rows_b = np.zeros((nl, c), np.int32)
        rows_s = np.zeros((nl, c), np.float32)
        counts = np.zeros(nl, np.int32)
        for i, (_, b, sec) in enumerate(per):
            rows_b[i], rows_s[i], counts[i] = pad(b, np.int32), pad(sec, np.float32), len(b)
        return cls(pad(vb, np.int32), pad(vs, np.float32), np.asarray(len(vb), np.int32),
                   pad(db, np.int32), pad(ds, np.float32), np.asarray(len(db), np.int32),
                   np.asarray(table is None or table.is_flat),
                   pad(dl, np.int32), pad(dls, np.float32), np.asarray(len(dl), np.int32),
                   ids, rows_b, rows_s, counts, np.asarray(len(per), np.int32))


def lookup_device(buckets: jax.Array, seconds: jax.Array, count: jax.Array, n: jax.Array) -> jax.Array:
    """jnp twin of the table lookup (float32): the smallest bucket ``>= n`` among the first ``count`` entries,
    linear extrapolation above the largest, 0 for an empty table. ``n`` may have any shape."""
    n = jnp.maximum(jnp.asarray(n, jnp.int32), 0)
    valid = jnp.arange(buckets.shape[0], dtype=jnp.int32) < count
    idx = jnp.sum((valid & (buckets < n[..., None])).astype(jnp.int32), axis=-1)  # searchsorted 'left'
    last = jnp.maximum(count - 1, 0)
    inside = seconds[jnp.minimum(idx, last)]
    b_last, s_last = buckets[last].astype(jnp.float32), seconds[last]
    prev = jnp.maximum(count - 2, 0)
    two = (s_last - seconds[prev]) / jnp.maximum(b_last - buckets[prev].astype(jnp.float32), 1.0)
    slope = jnp.where(count >= 2, two, s_last / jnp.maximum(b_last, 1.0))
    above = s_last + slope * (n.astype(jnp.float32) - b_last)
    return jnp.where(count == 0, 0.0, jnp.where(idx < count, inside, above))


def lookup_rows_device(buckets: jax.Array, seconds: jax.Array, count: jax.Array, n: jax.Array) -> jax.Array:
    """:func:`lookup_device` per row: column ``l`` of ``n [..., L]`` looks up row ``l`` of ``buckets / seconds
    [L, C]`` (its first ``count[l]`` entries); the same float32 operations, so the same values."""
    n = jnp.maximum(jnp.asarray(n, jnp.int32), 0)
    rows = jnp.arange(buckets.shape[0])
    valid = jnp.arange(buckets.shape[1], dtype=jnp.int32)[None, :] < count[:, None]
    idx = jnp.sum((valid & (buckets < n[..., None])).astype(jnp.int32), axis=-1)  # searchsorted 'left'
    last = jnp.maximum(count - 1, 0)
    inside = seconds[rows, jnp.minimum(idx, last)]
    b_last, s_last = buckets[rows, last].astype(jnp.float32), seconds[rows, last]
    prev = jnp.maximum(count - 2, 0)
    two = (s_last - seconds[rows, prev]) / jnp.maximum(b_last - buckets[rows, prev].astype(jnp.float32), 1.0)
    slope = jnp.where(count >= 2, two, s_last / jnp.maximum(b_last, 1.0))
    above = s_last + slope * (n.astype(jnp.float32) - b_last)
    return jnp.where(count == 0, 0.0, jnp.where(idx < count, inside, above))


def step_costs_device(table: CostTableArrays, draft_lens: tuple, tokens) -> jax.Array:
    """jnp twin of :meth:`CostTable.step_costs` for several draft lengths at once (float32): column ``l`` of
    ``tokens [..., L]`` is priced at the static ``draft_lens[l]`` (None: the table's longest length, or the verify
    costs alone). One pass for every length: fewer kernels in the device loop's body than a lookup per length."""
    count = table.num_lengths
    valid = jnp.arange(table.length_ids.shape[0], dtype=jnp.int32) < count
    last = jnp.maximum(count - 1, 0)
    i = jnp.stack([last if d is None else
                   jnp.minimum(jnp.sum((valid & (table.length_ids < int(d))).astype(jnp.int32)), last)
                   for d in draft_lens])
    per = lookup_rows_device(table.length_buckets[i], table.length_seconds[i], table.num_length_buckets[i], tokens)
    extra = jnp.stack([jnp.zeros((), jnp.float32) if d is None else draft_length_cost_device(table, d)
                       for d in draft_lens])
    additive = extra + lookup_device(table.verify_buckets, table.verify_seconds, table.num_verify, tokens)
    return jnp.where(count > 0, per, additive)


def step_cost_device(table: CostTableArrays, draft_len: int | None, tokens) -> jax.Array:
    """jnp twin of :meth:`CostTable.step_costs` (float32; ``draft_len`` static, ``tokens`` any shape)."""
    return step_costs_device(table, (draft_len,), jnp.asarray(tokens)[..., None])[..., 0]


def draft_length_cost_device(table: CostTableArrays, draft_len) -> jax.Array:
    """jnp twin of :meth:`CostTable.draft_length_cost` (float32; ``draft_len`` may have any shape)."""
    d = jnp.asarray(draft_len, jnp.int32)
    count = table.num_draft_lengths
    valid = jnp.arange(table.draft_lengths.shape[0], dtype=jnp.int32) < count
    idx = jnp.sum((valid & (table.draft_lengths < d[..., None])).astype(jnp.int32), axis=-1)
    return jnp.where(count == 0, 0.0, table.draft_length_seconds[jnp.minimum(idx, jnp.maximum(count - 1, 0))])


def split_step_costs(measured: Mapping[tuple[int, int], float], *, metadata: Mapping[str, Any] | None = None
                     ) -> CostTable:
    """A :class:`CostTable` from whole-step timings ``{(draft_len, tokens): seconds}`` of a closed program set.

    The model is additive, ``step(K_d, T) = draft_length_cost(K_d) + verify_cost(T)``, relative to the smallest
    draft length ``d0`` (``draft_length_cost(d0) = 0``, so the verify costs hold what every step pays: the
    target's forward and the drafter's context write). The longest length ``K`` is the pivot (the closed set
    compiles it at every bucket): each length's offset to it is the median, over the buckets the length was
    compiled at, of ``step(K_d, T) - step(K, T)``; the costs are those offsets less ``d0``'s (clipped at 0, then
    non-decreasing in ``K_d``). A bucket's verify cost is the median, over the lengths compiled at it, of the step
    time less that length's cost. The medians pool every program's timing, which is what makes the split steadier
    than any one program's time.
    """
    if not measured:
        raise ValueError("split_step_costs needs at least one (draft_len, tokens) timing")
    lengths = sorted({d for d, _ in measured})
    pivot = lengths[-1]
    at_pivot = {t: s for (d, t), s in measured.items() if d == pivot}
    offset = {}
    for d in lengths:
        diffs = [s - at_pivot[t] for (dd, t), s in measured.items() if dd == d and t in at_pivot]
        if not diffs:
            raise ValueError(f"draft length {d} shares no token bucket with the longest, {pivot}: cannot split")
        offset[d] = statistics.median(diffs)
    extra, running = {}, 0.0
    for d in lengths:
        running = max(running, offset[d] - offset[lengths[0]], 0.0)
        extra[d] = running
    verify = {}
    for t in sorted({t for _, t in measured}):
        verify[t] = max(0.0, statistics.median(s - extra[d] for (d, tt), s in measured.items() if tt == t))
    return CostTable.from_measurements(verify, draft_lengths=extra if len(lengths) > 1 else None, metadata=metadata)


def _table_path(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    return os.path.join(path, COST_TABLE_FILENAME) if os.path.isdir(path) else path


def save_cost_table(table: CostTable, path: str | os.PathLike) -> str:
    """Write ``table`` as JSON; ``path`` is a model directory (gets ``cost_table.json``) or a file path."""
    target = _table_path(path)
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(table.to_dict(), f, indent=2, sort_keys=True)
    os.replace(tmp, target)  # atomic: a concurrent reader never sees half a file
    return target


def load_cost_table(path: str | os.PathLike | None) -> CostTable | None:
    """Read a table from a model directory or a JSON file; ``None`` when there is none (verify everything)."""
    if path is None:
        return None
    target = _table_path(path)
    if not os.path.exists(target):
        return None
    with open(target) as f:
        return CostTable.from_dict(json.load(f))


def time_callable(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` timed calls after ``warmup`` calls (all synchronised)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def profile_cost_table(
    verify_fns: Mapping[int, Callable[[], Any]],
    draft_fns: Mapping[int, Callable[[], Any]],
    *,
    repeats: int = 5,
    warmup: int = 1,
    metadata: Mapping[str, Any] | None = None,
) -> CostTable:
    """Time the engine's compiled steps per shape bucket and build a monotone :class:`CostTable`.

    Args:
      verify_fns: ``{total_verify_tokens_bucket: fn}``; each ``fn()`` runs one verify step at that bucket
        (closing over its inputs) and returns its outputs (they are synchronised with
        ``jax.block_until_ready``).
      draft_fns: ``{num_request_rows_bucket: fn}``, the same for the draft step (may be empty).
      repeats: timed replays per bucket; the median is kept.
      warmup: untimed calls per bucket first (compilation, autotuning, allocator warm-up).
      metadata: extra fields stored with the table; the device, the jax version and the raw medians are added.

    Raises:
      ValueError: no verify buckets, a bucket that is not a positive integer, or a value that is not callable.
    """
    if not verify_fns:
        raise ValueError("verify_fns must hold at least one bucket")
    for name, fns in (("verify_fns", verify_fns), ("draft_fns", draft_fns)):
        for b, fn in fns.items():
            if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
                raise ValueError(f"{name}: buckets must be positive integers, got {b!r}")
            if not callable(fn):
                raise ValueError(f"{name}[{b}] is not callable")  # noqa: TRY004 (bad input: ValueError)
    verify = {
        int(b): time_callable(fn, repeats=repeats, warmup=warmup) for b, fn in sorted(verify_fns.items())
    }
    draft = {int(b): time_callable(fn, repeats=repeats, warmup=warmup) for b, fn in sorted(draft_fns.items())}
    dev = jax.devices()[0]
    meta = {
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '?')}",
        "jax": jax.__version__,
        "repeats": repeats,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "raw_verify_median_s": {str(b): s for b, s in verify.items()},
        "raw_draft_median_s": {str(b): s for b, s in draft.items()},
    }
    meta.update(metadata or {})
    return CostTable.from_measurements(verify, draft, metadata=meta)
