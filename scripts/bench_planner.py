"""The device planner's cost per loop iteration (issue 22): ``choose_plan_device`` inside a ``lax.fori_loop``,
as the device loop runs it, at the default engine's draft lengths and device-loop sizes.

Variants: ``sorted`` (one sort and prefix sums over the ranked survival), ``ranked`` (the sort-free pass over
bucket edges in jnp, table lookups in every iteration), ``prepared`` (the same with the table's costs computed
once before the loop) and ``kernels`` (``prepared`` with the pass in Pallas kernels,
``pallas_kernels.plan_ranking``: what ``spec_decode.device_loop`` runs on a GPU). Each iteration feeds the planner confidences that depend
on the previous plan, so XLA can neither hoist nor skip it. Reports microseconds per iteration (the loop's
wall over its iterations, minus an empty loop's) and, on a GPU, the kernels per iteration from a profiler trace.

    PYTHONPATH=. python3 scripts/bench_planner.py --out $OUT/planner --rows 8 64 256 512
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.budget import choose_plan_device, prepare_plan_device
from spec_decode.cost_table import CostTable, CostTableArrays

LENGTHS = (0, 1, 3, 7)


def sizes_for(rows: int) -> tuple[tuple[int, ...], ...]:
    """Up to four sizes per length ending at ``rows * (1 + K_d)``, spaced by ``rows``: the shape of the device
    loop's sizes (the engine derives its own from its settings), enough to time the planner."""
    out = []
    for d in LENGTHS:
        top = rows * (1 + d)
        out.append(tuple(sorted({max(rows, top - i * rows) for i in range(min(d + 1, 4))})))
    return tuple(out)


def make_loop(rows: int, k: int, variant: str, iters: int):
    buckets = sizes_for(rows)
    table = CostTable.from_step_times({(d, t): 1e-3 * (0.4 + 0.05 * d + 2e-4 * t) for d, b in zip(LENGTHS, buckets)
                                       for t in b})
    arr = CostTableArrays.from_table(table)

    def run(conf, sched, arr):
        prepared = (prepare_plan_device(arr, draft_lengths=LENGTHS, token_buckets=buckets, max_rows=rows)
                    if variant in ("prepared", "kernels") else None)

        def body(i, c):
            conf, acc = c
            if variant == "empty":
                b, li = jnp.sum(sched), jnp.asarray(0)
            else:
                b, li = choose_plan_device(conf, sched, num_rows=jnp.int32(rows), num_sampling_rows=jnp.int32(rows),
                                           num_non_draft_tokens=jnp.int32(rows), cost_table=arr,
                                           max_total_logit_rows=rows * (k + 1), draft_lengths=LENGTHS,
                                           token_buckets=None if variant == "sorted" else buckets, prepared=prepared,
                                           implementation="pallas" if variant == "kernels" else "reference")
            # the next iteration's confidences depend on this plan: nothing is loop-invariant
            conf = jnp.roll(conf, 1, axis=0) * (0.999 + 1e-6 * (b + li).astype(jnp.float32))
            return conf, acc + b + li

        return jax.lax.fori_loop(0, iters, body, (conf, jnp.zeros((), jnp.int32)))[1]

    return jax.jit(run), arr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256, 512])
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--variants", nargs="+", default=["sorted", "ranked", "prepared", "kernels"])
    ap.add_argument("--trace", action="store_true", help="also count kernels per iteration (GPU)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    rows_out = []
    for rows in args.rows:
        conf = rng.uniform(0.3, 1.0, (rows, args.k)).astype(np.float32)
        sched = np.full(rows, args.k, np.int32)
        base = None
        for variant in ["empty"] + list(args.variants):
            fn, arr = make_loop(rows, args.k, variant, args.iters)
            jax.block_until_ready(fn(conf, sched, arr))
            walls = []
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(conf, sched, arr))
                walls.append(time.perf_counter() - t0)
            us = 1e6 * float(np.median(walls)) / args.iters
            if variant == "empty":
                base = us
            row = {"rows": rows, "variant": variant, "us_per_iteration": us,
                   "us_over_empty_loop": us - base, "device": jax.devices()[0].device_kind}
            if args.trace and variant != "empty" and jax.default_backend() == "gpu":
                from scripts import op_trace

                text = fn.lower(conf, sched, arr).compile().as_text()
                events, _ = op_trace.trace(lambda: fn(conf, sched, arr), op_trace.module_name(text))
                kernels = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
                row["kernels_per_iteration"] = len(kernels) / args.iters
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "bench_planner.json"), "w") as f:
        json.dump({"rows": rows_out, "iters": args.iters, "jax": jax.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
