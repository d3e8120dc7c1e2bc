"""The planner of the engine: how many positions each step drafts, how many drafts it verifies, and the cost
table it plans from.

One :class:`Planner` per engine owns

* the **rule**: ``"adaptive"`` asks :func:`spec_decode.budget.choose_plan` (expected emitted tokens per second
  of step time, from the confidences of an earlier step: lossless) for the draft length ``K_d`` (one of the
  engine's compiled ``draft_lengths``) and the budget; ``"fixed"`` drafts ``K`` and verifies every scheduled
  draft (spread evenly by the allocator when the verify-logits bound binds); ``"none"`` drafts nothing;
* the **cost table**: a step's time over the closed program set by draft length and packed tokens, given by the
  user or profiled once at warm-up (:meth:`Planner.profile`) on the engine's own compiled programs: every
  (``K_d``, packed tokens) program timed, interleaved over several rounds. The engine times the device loop's
  branches inside the loop (device time, whole steps per length); an engine without a device loop times
  host-launched steps and splits them into draft-length and verify terms
  (:func:`spec_decode.cost_table.split_step_costs`);
* the **device form** of the same table (:meth:`Planner.device_table`), so the jitted device loop plans from the
  very numbers the host loop plans from (plus the loop's own cost per iteration, where a table carries it in its
  metadata under :data:`DEVICE_LOOP_STEP_KEY`: a hand-built table, or one profiled by an earlier version).

The scheduler calls :meth:`Planner.budget` once per step; nothing else in the engine chooses a budget.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import numpy as np

from spec_decode.budget import DEFAULT_MIN_PREDICTED_GAIN, select_plan
from spec_decode.cost_table import CostTable, CostTableArrays, split_step_costs

__all__ = ["DEVICE_LOOP_STEP_KEY", "Planner"]

# the cost table's metadata key for the device loop's own seconds per iteration (beyond its step programs')
DEVICE_LOOP_STEP_KEY = "device_loop_step_s"


class Planner:
    """The engine's budget rule and cost table (see the module docstring).

    Args:
      mode: ``"adaptive"``, ``"fixed"`` or ``"none"``.
      max_total_logit_rows: the verify-logits bound of a step (rows of vocabulary logits).
      cost_table: ``"profile"`` (default: measured at warm-up), a :class:`CostTable`, or ``None`` / ``"flat"``
        (verify everything: no trade-off).
      num_speculative_tokens: K.
      draft_lengths: the ``K_d`` the engine compiled (default ``(K,)``); the adaptive rule chooses among them.
      token_buckets: ``{K_d: packed-token sizes compiled for it}`` (the closed set; None: any size).
    """

    def __init__(self, *, mode: str, max_total_logit_rows: int, cost_table="profile",
                 min_predicted_gain: float = DEFAULT_MIN_PREDICTED_GAIN, num_speculative_tokens: int = 0,
                 draft_lengths: Sequence[int] | None = None, token_buckets=None):
        self.mode = mode
        self.k = int(num_speculative_tokens)
        self.draft_lengths = tuple(sorted(set(draft_lengths))) if draft_lengths else (self.k,)
        self.token_buckets = {int(d): tuple(sorted(b)) for d, b in (token_buckets or {}).items()}
        self.host_floor_s = 0.0  # the host loop's own time per step: no step is faster than the host plans it
        self._cost_cache = None
        self.max_total_logit_rows = int(max_total_logit_rows)
        self.min_predicted_gain = min_predicted_gain
        self.table: CostTable | None = None
        self.profile_pending = False
        if mode != "adaptive" or cost_table is None or (isinstance(cost_table, str) and cost_table == "flat"):
            return
        if isinstance(cost_table, CostTable):
            self.table = cost_table
        elif isinstance(cost_table, str) and cost_table == "profile":
            self.profile_pending = True
        else:
            raise ValueError(f"cost_table must be 'profile', None or a CostTable, got {cost_table!r}")

    # ------------------------------------------------------------------ the rule
    def plan(self, stale_confidences, scheduled, *, num_sampling_rows: int,
             num_non_draft_tokens: int, draft_full: bool = False) -> tuple[int, int]:
        """``(budget, K_d)`` of the next step: drafts it verifies in total, positions each row drafts.

        ``stale_confidences f32[n, K]`` (an earlier step's, of the step's ``n`` decode rows), ``scheduled int[n]``
        (drafts each may verify), ``num_sampling_rows`` (rows that emit a token whatever the drafts),
        ``num_non_draft_tokens`` (anchors and prefill tokens); ``draft_full``: an adaptive plan drafts the longest
        length (with its best budget), to refresh the confidences a shorter one left stale
        (:func:`spec_decode.budget.count_full_drafts`)."""
        n = len(scheduled)
        full = self.draft_lengths[-1]
        # rows that sample without drafting (a prefill's last chunk) take logit rows too
        cap = self.max_total_logit_rows - (num_sampling_rows - n)
        total = int(np.sum(np.minimum(scheduled, full)))
        if self.mode == "none" or n == 0:
            return 0, self.draft_lengths[0]
        if self.mode == "fixed":
            return max(0, min(total, cap - n)), full
        table = self.table
        if table is None or table.is_flat:
            return max(0, min(total, cap - n)), full
        return self._plan_fast(np.asarray(stale_confidences), np.asarray(scheduled), num_sampling_rows,
                               num_non_draft_tokens, cap, draft_full)

    def _costs(self):
        """Per draft length: (length, the step cost paid at every packed-token count, feasible), from the table
        and the closed set's buckets; computed once per table (the planner's hot path indexes them)."""
        if self._cost_cache is not None and self._cost_cache[0] is self.table:
            return self._cost_cache[1]
        table, multi = self.table, len(self.draft_lengths) > 1
        top = max([max(b) for b in self.token_buckets.values()] + list(table.step_buckets) + [1])
        tokens = np.arange(2 * top + 1)
        out = []
        for d in self.draft_lengths:
            paid, ok = tokens, np.ones(tokens.shape, bool)
            buckets = self.token_buckets.get(d)
            if buckets:
                tb = np.asarray(buckets, np.int64)
                idx = np.searchsorted(tb, tokens, side="left")
                ok = idx < len(tb)
                paid = np.where(ok, tb[np.minimum(idx, len(tb) - 1)], tokens)
            out.append((d, table.step_costs(paid, d if multi else None), ok))
        self._cost_cache = (table, out)
        return out

    def _plan_fast(self, conf, sched, num_sampling_rows: int, num_non_draft_tokens: int, cap: int,
                   draft_full: bool = False):
        """:func:`spec_decode.budget.choose_plan` over precomputed cost arrays (the same values, bit for bit, and
        the same plan; ``tests/test_budget.py`` checks it), with the host floor (:attr:`host_floor_s`).

        Each length sorts its own drafts' survival, as the reference does: a value sort per length is several
        times faster than one stable argsort carrying the positions (at 512 rows x 7, 4 sorts take about a
        sixth of one stable argsort)."""
        n, k = conf.shape
        conf = np.nan_to_num(conf.astype(np.float64), nan=0.0)
        a = np.cumprod(np.clip(conf, 0.0, 1.0, out=conf), axis=1)
        sched = np.asarray(sched)
        cols = np.arange(k)
        draft = self.table.draft_cost(n)
        curves = []
        for d, step, ok in self._costs():
            v = -np.sort(-a[cols < np.minimum(sched, d)[:, None]])
            max_b = max(0, min(len(v), cap - n))
            gain = np.empty(max_b + 1)
            gain[0] = num_sampling_rows
            np.cumsum(v[:max_b], out=gain[1:])
            gain[1:] += num_sampling_rows
            t = np.minimum(num_non_draft_tokens + np.arange(max_b + 1), len(step) - 1)
            cost = np.maximum(draft + step[t], self.host_floor_s)
            curves.append((d, np.where(ok[t], gain / np.maximum(cost, 1e-12), -np.inf)))
        return select_plan(curves, min_predicted_gain=self.min_predicted_gain, draft_full=draft_full)

    def budget(self, stale_confidences, scheduled, *, num_sampling_rows: int, num_non_draft_tokens: int) -> int:
        """The budget of :meth:`plan` alone."""
        return self.plan(stale_confidences, scheduled, num_sampling_rows=num_sampling_rows,
                         num_non_draft_tokens=num_non_draft_tokens)[0]

    # ------------------------------------------------------------------ the table
    def profile(self, programs: Sequence[tuple[int, int]], time_program: Callable[[int, int], float], *,
                repeats: int = 7, warmup: int = 1, per_length: bool = False, source: str = "engine warm-up profile",
                progress=None, metadata=None) -> CostTable:
        """Time every ``(K_d, tokens)`` program and keep the table.

        ``time_program(d, t)`` returns the seconds of one step of that program (however it measures them: the
        engine times the device loop's branches inside the loop, or host-launched steps back to back). The
        programs are timed in ``repeats`` interleaved rounds (a drift of the device's clocks spreads over all of
        them instead of biasing one); each keeps its median. ``per_length``: keep the medians as whole steps per
        draft length (:meth:`CostTable.from_step_times`), else split them into the additive form
        (:func:`~spec_decode.cost_table.split_step_costs`). The table's metadata holds the medians, each program's
        spread (min and max of its runs), and ``noise``: the median relative spread against the median relative
        gap between neighbouring buckets of a length (what the planner acts on)."""
        programs = [tuple(map(int, p)) for p in programs]
        for p in programs:
            for _ in range(warmup):
                time_program(*p)
        runs = {p: [] for p in programs}
        for _ in range(repeats):
            for p in programs:
                runs[p].append(float(time_program(*p)))
            if progress is not None:
                progress.update(1)
        medians = {p: statistics.median(v) for p, v in runs.items()}
        spread = {f"{d}/{t}": [min(runs[d, t]), max(runs[d, t])] for d, t in programs}
        rel_spread = [(max(v) - min(v)) / max(statistics.median(v), 1e-12) for v in runs.values()]
        gaps = []
        for d in sorted({d for d, _ in programs}):
            ts = sorted(t for dd, t in programs if dd == d)
            gaps += [abs(medians[d, b] - medians[d, a]) / max(medians[d, a], 1e-12) for a, b in zip(ts, ts[1:])]
        meta = {**(metadata or {}), "source": source, "repeats": repeats, "spread_s": spread,
                "median_s": {f"{d}/{t}": s for (d, t), s in medians.items()},
                "noise": {"median_relative_spread": statistics.median(rel_spread),
                          "median_relative_gap": statistics.median(gaps) if gaps else None}}
        self.table = (CostTable.from_step_times(medians, metadata=meta) if per_length
                      else split_step_costs(medians, metadata=meta))
        self.profile_pending = False
        return self.table

    def device_table(self, *, with_loop_step: bool = True) -> CostTableArrays:
        """The table as device arrays, for the device loop.

        ``with_loop_step``: every step also pays the loop's own cost per iteration (the table's metadata
        :data:`DEVICE_LOOP_STEP_KEY`; 0 when absent, as for a table timed inside the loop, whose steps hold it
        already)."""
        table = self.table
        if self.mode != "adaptive" or table is None:
            return CostTableArrays.from_table(None)
        extra = float(table.metadata.get(DEVICE_LOOP_STEP_KEY, 0.0)) if with_loop_step else 0.0
        return CostTableArrays.from_table(table.with_step_overhead(extra))
