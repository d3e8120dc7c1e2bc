"""How long a closed batch runs when the budget binds: survival ranking against the rows behind first (numpy).

    python3 scripts/simulate_closed_batch.py [--rows 500] [--tokens 149] [--seeds 3]

A model of the allocation alone, not of the engine: ``rows`` requests that each need ``tokens`` tokens, with
emulated acceptance as ``spec_decode.synthetic`` draws it (each request's conditional rates from
``Beta(kappa c_k, kappa (1 - c_k))`` around the embedded default's measured profile, ``kappa = 10``). Each step
drafts ``K_d`` positions for every live row and verifies a fixed fraction of them, chosen either by survival
alone (``allocate_drafts`` without a priority) or by tokens left first, counted in steps of ``1 + K_d``, then
survival (a closed batch's priority); a row emits its accepted drafts plus one token. Printed: the steps until the last row finishes, the
mean over ``seeds`` batches, per (``K_d``, verified fraction). docs/ADAPTIVE_VERIFICATION.md, "Closed batches",
quotes its output. The verified fraction is an input: in the H200 runs of the M3 slice at 500 requests the
budget did not bind (nearly every draft was verified), so this model does not describe them.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_e2e import ACCEPTANCE_PROFILES  # noqa: E402
from spec_decode.synthetic import conditional_rates  # noqa: E402

# the embedded default's per-position acceptance on held-out code (bench_e2e's "default" profile)
RATES = ACCEPTANCE_PROFILES["default"]
CASES = ((1, 0.74), (3, 0.8), (3, 0.5), (7, 0.4))  # (K_d, verified fraction of the drafts)


def batch_steps(rows: int, tokens: int, draft_len: int, fraction: float, rows_behind_first: bool, seed: int,
                concentration: float = 10.0) -> int:
    rng = np.random.default_rng(seed)
    cond = conditional_rates(RATES)
    p = np.stack([rng.beta(concentration * c, concentration * (1 - c), size=rows) for c in cond[:draft_len]], 1)
    survival = np.cumprod(p, axis=1)
    left = np.full(rows, tokens)
    steps = 0
    while (left > 0).any():
        live = left > 0
        budget = int(fraction * live.sum() * draft_len)
        # the engine's closed-batch priority: tokens left in whole steps of 1 + K_d (survival <= 1 < 2 a step)
        key = survival + (2.0 * (left[:, None] // (1 + draft_len)) if rows_behind_first else 0.0)
        key = np.where(live[:, None], key, -np.inf)
        won = np.argsort(-key.ravel(), kind="stable")[:budget] // draft_len
        caps = np.bincount(won, minlength=rows)
        accepted = np.cumprod(rng.random((rows, draft_len)) < p, axis=1)
        emitted = 1 + (accepted * (np.arange(draft_len)[None, :] < caps[:, None])).sum(1)
        left = np.where(live, np.maximum(left - emitted, 0), 0)
        steps += 1
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=149)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    print("| K_d | verified fraction | steps, by survival | steps, rows behind first |\n|---|---|---|---|")
    for draft_len, fraction in CASES:
        mean = [np.mean([batch_steps(args.rows, args.tokens, draft_len, fraction, behind, s)
                         for s in range(args.seeds)]) for behind in (False, True)]
        print(f"| {draft_len} | {fraction} | {mean[0]:.1f} | {mean[1]:.1f} |")


if __name__ == "__main__":
    main()
