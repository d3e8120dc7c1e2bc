"""The budget planner of the engine: how many drafts each step verifies, and the cost table it plans from.

One :class:`Planner` per engine owns

* the **rule**: ``"adaptive"`` asks :func:`spec_decode.budget.choose_budget` (expected emitted tokens per second
  of step time, from the confidences of an earlier step: lossless); ``"fixed"`` verifies every scheduled draft
  (spread evenly by the allocator when the verify-logits bound binds); ``"none"`` verifies nothing;
* the **cost table**: seconds of a whole step per packed-token bucket of the closed program set, given by the user
  or profiled once at warm-up (:meth:`Planner.profile`) on the engine's own compiled programs;
* the **device form** of the same table (:meth:`Planner.device_table`), so the jitted device loop plans from the
  very numbers the host loop plans from.

The scheduler calls :meth:`Planner.budget` once per step; nothing else in the engine chooses a budget.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from spec_decode.budget import DEFAULT_MIN_PREDICTED_GAIN, choose_budget
from spec_decode.cost_table import CostTable, CostTableArrays

__all__ = ["Planner"]


class Planner:
    """The engine's budget rule and cost table (see the module docstring).

    Args:
      mode: ``"adaptive"``, ``"fixed"`` or ``"none"``.
      max_total_logit_rows: the verify-logits bound of a step (rows of vocabulary logits).
      cost_table: ``"profile"`` (default: measured at warm-up), a :class:`CostTable`, or ``None`` / ``"flat"``
        (verify everything: no trade-off).
    """

    def __init__(self, *, mode: str, max_total_logit_rows: int, cost_table="profile",
                 min_predicted_gain: float = DEFAULT_MIN_PREDICTED_GAIN):
        self.mode = mode
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
    def budget(self, stale_confidences, scheduled, *, num_sampling_rows: int, num_non_draft_tokens: int) -> int:
        """Drafts the next step verifies in total: ``stale_confidences f32[n, K]`` (an earlier step's, of the
        step's ``n`` decode rows), ``scheduled int[n]`` (drafts each may verify), ``num_sampling_rows`` (rows
        that emit a token whatever the drafts), ``num_non_draft_tokens`` (anchors and prefill tokens)."""
        n = len(scheduled)
        # rows that sample without drafting (a prefill's last chunk) take logit rows too
        cap = self.max_total_logit_rows - (num_sampling_rows - n)
        total = int(np.sum(scheduled))
        if self.mode == "none" or n == 0:
            return 0
        if self.mode == "fixed":
            return max(0, min(total, cap - n))
        return choose_budget(stale_confidences, scheduled, num_sampling_rows=num_sampling_rows,
                             num_non_draft_tokens=num_non_draft_tokens, cost_table=self.table,
                             max_total_logit_rows=cap, min_predicted_gain=self.min_predicted_gain)

    # ------------------------------------------------------------------ the table
    def profile(self, buckets: Sequence[int], time_bucket: Callable[[int], None], *, repeats: int = 5,
                warmup: int = 1, progress=None) -> CostTable:
        """Time one step at every packed-token bucket and keep the table (median of ``repeats`` runs each).

        ``time_bucket(t)`` runs one step of bucket ``t`` and blocks until it is done. The spread (min and max
        of the runs) is kept in the table's metadata."""
        measured, spread = {}, {}
        for t in buckets:
            for _ in range(warmup):
                time_bucket(t)
            runs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                time_bucket(t)
                runs.append(time.perf_counter() - t0)
            measured[t] = statistics.median(runs)
            spread[str(t)] = [min(runs), max(runs)]
            if progress is not None:
                progress.update(1)
        self.table = CostTable.from_measurements(measured, metadata={"source": "engine warm-up profile",
                                                                     "repeats": repeats, "spread_s": spread})
        self.profile_pending = False
        return self.table

    def device_table(self, buckets: Sequence[int] | None = None) -> CostTableArrays:
        """The table as device arrays; with ``buckets``, restated at those buckets only (the device loop's)."""
        table = self.table
        if self.mode != "adaptive" or table is None:
            return CostTableArrays.from_table(None)
        if buckets is not None:
            table = CostTable.from_measurements({int(b): table.verify_cost(int(b)) for b in buckets},
                                                metadata=table.metadata)
        return CostTableArrays.from_table(table)
