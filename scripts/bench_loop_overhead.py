"""The device loop's cost per call and per iteration, and whether changing branches between calls costs.

    PYTHONPATH=. python3 scripts/bench_loop_overhead.py --out FILE.json [--slots 512] [--modes adaptive fixed3]
        [--sampling-loop | --contexts 112 240 368 [--rounds 5]]

For each mode an engine of the embedded default (bf16, greedy programs, ``--slots`` slots, 2048-token prefill
chunks) is built and warmed up; then its greedy device-loop program runs timing calls (``LoopInputs.timing_branch``:
one branch forced every iteration, every slot decoding at a context of a quarter of ``max_model_len``, nothing
committed, as the engine's cost-table profile does):

- 12 calls of 1 iteration and 6 of 13 on the main branch (draft length 3 at 2048 tokens when compiled, else the
  last): ``per_iteration_ms`` is the slope, ``per_call_intercept_ms`` what a call costs beyond its iterations
  (the launch, the inputs' transfer, the read-back, the loop's set-up);
- 6 calls of 0 iterations (the loop's predicate false at once);
- 12 calls of 1 iteration alternating between the main branch and each other branch in turn: a branch that the
  previous call did not run pays whatever XLA redoes for it (a CUDA graph's update) here.

Wall time from the call to the read-back of its step count, on the host (``time.perf_counter``).

``--contexts C ...``: instead, what the engine's cost table leaves out (it times every branch once, at a quarter
of ``max_model_len``, every slot decoding): each branch's time per iteration at each context ``C`` (every slot's
state set to ``C`` tokens), in two shapes: a full batch (``min(R, T)`` slots, ``T - min(R, T)`` drafts among them)
and, for a branch below its length's full size, a wave's tail (``T // (1 + K_d)`` slots drafting ``K_d`` each);
one iteration as the slope of calls of 1 and 13 iterations, medians of ``--rounds`` interleaved rounds.

``--sampling-loop``: instead, what it would cost to serve greedy rows with the sampling loop (one device loop per
engine instead of two). The engine is built with the sampling programs and only its two device loops are compiled
(no step program, no cost table); then for every branch, one iteration's time (the slope of calls of 1 and 13
iterations, interleaved between the two programs, medians) in the greedy loop and in the sampling loop, every
row greedy (temperature 0) in both.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

MODES = {"adaptive": dict(num_speculative_tokens=7, verification="adaptive"),
         "fixed3": dict(num_speculative_tokens=3, verification="fixed"),
         "fixed7": dict(num_speculative_tokens=7, verification="fixed")}


def measure(eng) -> dict:
    """The timing calls of the module docstring on ``eng`` (warmed up, with a device loop)."""
    branch_list, timer, context = eng._loop_branch_timer(eng._loop_programs[(False, None)])
    branches = set(branch_list)

    def run(branch, steps: int) -> float:
        return 1e3 * timer(*branch, steps)

    main = (3, 2048) if (3, 2048) in branches else branch_list[-1]
    others = [b for b in branch_list if b != main] or [main]
    for _ in range(3):
        run(main, 1)
    one = [run(main, 1) for _ in range(12)]
    thirteen = [run(main, 13) for _ in range(6)]
    zero = [run(main, 0) for _ in range(6)]
    alternating = []
    for i in range(12):
        b = main if i % 2 == 0 else others[(i // 2) % len(others)]
        alternating.append((f"{b[0]}/{b[1]}", run(b, 1)))
    name = f"{main[0]}/{main[1]}"
    slope = (np.median(thirteen) - np.median(one)) / 12
    return {"branches": [f"{d}/{t}" for d, t in branch_list], "main_branch": name, "context": context,
            "one_iteration_ms": one, "thirteen_iterations_ms": thirteen, "zero_iterations_ms": zero,
            "alternating_one_iteration_ms": alternating,
            "per_iteration_ms": float(slope), "per_call_intercept_ms": float(np.median(one) - slope),
            "zero_iteration_call_ms": float(np.median(zero)),
            "alternating_main_ms": float(np.median([v for b, v in alternating if b == name])),
            "alternating_other_ms": float(np.median([v for b, v in alternating if b != name] or [np.nan]))}


def shapes(d: int, t: int, slots: int) -> list[tuple[str, int]]:
    """``(name, live slots)`` of the timing runs of branch ``(d, t)`` (module docstring, ``--contexts``)."""
    full = min(slots, t)
    out = [("full", full)]
    tail = t // (1 + d)
    if d and 0 < tail < full:
        out.append(("tail", tail))
    return out


def context_sweep(eng, contexts, rounds: int = 5) -> dict:
    """The ``--contexts`` timings of the module docstring on ``eng`` (warmed up, with a greedy device loop)."""
    program = eng._loop_programs[(False, None)]
    out = {"contexts": list(contexts), "rounds": rounds, "rows": []}
    for c in contexts:
        branch_list, timer, context = eng._loop_branch_timer(program, context=c)
        runs = [(d, t, name, live) for d, t in branch_list for name, live in shapes(d, t, eng.max_num_seqs)]
        calls = {(i, n): [] for i in range(len(runs)) for n in (1, 13)}
        for d, t, _, live in runs:  # a first call of each shape, untimed
            timer(d, t, 1, live)
        for _ in range(rounds):
            for i, (d, t, _, live) in enumerate(runs):
                for n in (1, 13):
                    calls[i, n].append(1e3 * timer(d, t, n, live))
        for i, (d, t, name, live) in enumerate(runs):
            ms = float((np.median(calls[i, 13]) - np.median(calls[i, 1])) / 12)
            out["rows"].append({"context": context, "branch": f"{d}/{t}", "shape": name, "live": live,
                                "drafts": min(t - live, live * d), "ms_per_iteration": ms,
                                "calls_ms": {str(n): calls[i, n] for n in (1, 13)}})
            print(f"bench_loop_overhead: context {context} {d}/{t} {name} ({live} slots): {ms:.3f} ms per iteration",
                  flush=True)
    eng._state = eng._init_state()  # the timing runs left every slot at a context: start clean
    return out


def compare_loops(eng, rounds: int = 6) -> dict:
    """The ``--sampling-loop`` timings of the module docstring on ``eng`` (both device loops compiled)."""
    timers = {name: eng._loop_branch_timer(eng._loop_programs[(sampled, None)], sampling=sampled)
              for name, sampled in (("greedy", False), ("sampling", True))}
    branch_list = timers["greedy"][0]
    out = {"context": timers["greedy"][2], "branches": {}}
    for d, t in branch_list:
        calls = {(name, n): [] for name in timers for n in (1, 13)}
        for name in timers:  # a first call of each shape, untimed
            timers[name][1](d, t, 1)
        for _ in range(rounds):
            for name in timers:
                for n in (1, 13):
                    calls[name, n].append(1e3 * timers[name][1](d, t, n))
        per_it = {name: (np.median(calls[name, 13]) - np.median(calls[name, 1])) / 12 for name in timers}
        out["branches"][f"{d}/{t}"] = {"greedy_ms_per_iteration": float(per_it["greedy"]),
                                       "sampling_ms_per_iteration": float(per_it["sampling"]),
                                       "ratio": float(per_it["sampling"] / per_it["greedy"]),
                                       "calls_ms": {f"{name}/{n}": v for (name, n), v in calls.items()}}
        print(f"bench_loop_overhead: {d}/{t}: greedy {per_it['greedy']:.3f} ms, sampling {per_it['sampling']:.3f} ms "
              f"per iteration", flush=True)
    return out


def build_loops(eng) -> None:
    """Compile ``eng``'s greedy and sampling device loops alone (no step program, no cost table)."""
    from spec_decode.programs import compile_in_pool

    eng._state = eng._init_state()
    names = [("loop", False, None), ("loop", True, None)]
    done, _ = compile_in_pool(((n, eng._lowering(n)) for n in names), total=len(names), progress=False, desc="loops")
    for n in names:
        eng._loop_programs[n[1:]] = done[n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for the rows")
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["adaptive", "fixed3"])
    ap.add_argument("--max-model-len", type=int, default=448)
    ap.add_argument("--sampling-loop", action="store_true",
                    help="greedy rows in the sampling loop against the greedy loop, per branch (module docstring)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help="each branch's time per iteration at these contexts, full batch and tail (module docstring)")
    ap.add_argument("--rounds", type=int, default=5, help="--contexts: interleaved rounds per timing")
    args = ap.parse_args(argv)
    if args.sampling_loop and args.contexts:
        ap.error("--sampling-loop and --contexts are separate runs")
    step = 1 + max(MODES[m]["num_speculative_tokens"] for m in args.modes)  # a step's positions (the engine's rule)
    for c in args.contexts or ():
        if not 0 < c <= args.max_model_len - step:
            ap.error(f"--contexts: {c} does not leave a step's {step} positions within --max-model-len "
                     f"{args.max_model_len}")

    import jax
    import jax.numpy as jnp

    from minimax_jax.default import load_default
    from spec_decode import Engine

    target, drafter, _ = load_default(dtype=jnp.bfloat16)
    rows = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "slots": args.slots}
    for mode in args.modes:
        if args.sampling_loop:
            eng = Engine(target, drafter, max_num_seqs=args.slots, max_model_len=args.max_model_len,
                         max_num_batched_tokens=2048, sampling=True, cost_table=None,
                         device_loop_sampling_token_buckets=4, **MODES[mode])  # the greedy loop's branches
            build_loops(eng)
            rows[mode] = compare_loops(eng)
            del eng
            continue
        eng = Engine(target, drafter, max_num_seqs=args.slots, max_model_len=args.max_model_len,
                     max_num_batched_tokens=2048, sampling=False, **MODES[mode])
        eng.warmup()
        if args.contexts:
            rows[mode] = context_sweep(eng, args.contexts, args.rounds)
            del eng
            continue
        rows[mode] = measure(eng)
        summary = {k: round(v, 3) for k, v in rows[mode].items() if k.endswith("_ms") and isinstance(v, float)}
        print(f"bench_loop_overhead: {mode}: {json.dumps(summary)}", flush=True)
        del eng
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
