"""The device loop's cost per call and per iteration, and whether changing branches between calls costs.

    PYTHONPATH=. python3 scripts/bench_loop_overhead.py --out FILE.json [--slots 512] [--modes adaptive fixed3]
        [--main-branch 3/256] [--context 320] [--rounds 6] [--dump-hlo DIR] [--trace-calls 20]
        [--sampling-loop | --contexts 112 240 368 [--live 4 8] [--rounds 5]]

Modes are ``scripts/bench_e2e.py``'s (``adaptive``, ``adaptive@3``, ``adaptive@0,3,7``, ``fixed3`` ...; ``--k`` is
the adaptive engines' K). For each mode an engine of the embedded default (bf16, greedy programs, ``--slots``
slots, 2048-token prefill chunks) is built and its greedy device loop compiled alone (no step program and no cost
table: a timing run forces its branch, so the table's values change nothing it runs, and the planner's kernels
still run in every plan); then the loop runs timing calls (``LoopInputs.timing_branch``: one branch forced every
iteration, every slot decoding at ``--context`` tokens (default a quarter of ``max_model_len``), nothing
committed, as the engine's cost-table profile does). Every engine stays alive, and the calls run in ``--rounds``
interleaved rounds (each round: every engine in turn), so drift between engines' measurements cancels:

- per round, 4 calls of 1 iteration and 2 of 13 on the main branch (``--main-branch D/T``; default draft length 3
  at 2048 tokens when compiled, else the last): ``per_iteration_ms`` is the slope of the medians,
  ``per_call_intercept_ms`` what a call costs beyond its iterations (the launch, the inputs' transfer, the
  read-back, the loop's set-up). A call of 13 iterations runs ``1 + ceil(12 / plan_interval)`` epochs (a call's
  first is one step), so the slope holds ``1 / plan_interval`` of a plan and a switch per iteration;
- per round, 2 calls of 0 iterations (the loop's predicate false at once);
- after the rounds, 12 calls of 1 iteration alternating between the main branch and each other branch in turn: a
  branch that the previous call did not run pays whatever XLA redoes for it (a CUDA graph's update) here.

Wall time from the call to the read-back of its outputs (one vector, holding the step count; before session 34
the step count alone), on the host (``time.perf_counter``; the inputs are sent before the clock starts). Two
engines that run the same branch (the K = 7 engine's length-3 program is the K = 3 engine's: session 29) differ
here only by what their loops hold beside it: the plan, the switch over their branches, the epoch's bookkeeping.
``--trace-calls N``: after the rounds, ``N`` calls of 0 iterations and ``N`` of 1 (the main branch) per mode run
under the profiler (``scripts/op_trace.py:host_activity``, the runtime's finer annotations on): what the host
threads did in a call, by event name, summed over the ``N`` calls (``zero_call_trace``, ``one_call_trace``), so
the per-call cost of a loop with more branches can be read by name. ``--dump-hlo DIR`` writes each greedy loop's
optimized HLO (``DIR/MODE.hlo.gz``) for ``scripts/hlo_report.py``.

``--contexts C ...``: instead, what the engine's cost table leaves out (it times every branch once, at a quarter
of ``max_model_len``, every slot decoding): each branch's time per iteration at each context ``C`` (every slot's
state set to ``C`` tokens), in two shapes: a full batch (``min(R, T)`` slots, ``T - min(R, T)`` drafts among them)
and, for a branch below its length's full size, a wave's tail (``T // (1 + K_d)`` slots drafting ``K_d`` each);
with ``--live N ...`` also ``N`` slots decoding (``K_d`` drafts each at most, the rest of the branch's tokens
padding): a wave's last rows in a bucket larger than they fill, as a length with few small buckets runs them
(docs/ADAPTIVE_VERIFICATION.md, "What the table does not see"). One iteration as the slope of calls of 1 and 13
iterations, medians of ``--rounds`` interleaved rounds. E.g. ``--slots 64 --modes adaptive@3 --contexts 112 352
--live 4 8 16``: the same few rows at 32, 64, 128 and 256 tokens.

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


def measure(engines: dict, *, main: tuple[int, int] | None, context: int | None, rounds: int,
            trace_calls: int = 0, log=print) -> dict:
    """The timing calls of the module docstring on ``engines`` (mode -> engine with its greedy device loop
    compiled, holding the branch ``main`` when given), in ``rounds`` interleaved rounds, then ``trace_calls``
    traced calls of 0 and of 1 iteration per mode (``--trace-calls``). One result per mode."""
    timers = {}
    for mode, eng in engines.items():
        branch_list, timer, ctx = eng._loop_branch_timer(eng._loop_programs[(False, None)], context=context)
        here = main if main is not None else (3, 2048) if (3, 2048) in branch_list else branch_list[-1]
        timers[mode] = (branch_list, timer, ctx, here)

    def run(mode, branch, steps: int) -> float:
        return 1e3 * timers[mode][1](*branch, steps)

    calls = {mode: {"one": [], "thirteen": [], "zero": []} for mode in engines}
    for mode, (_, _, _, here) in timers.items():  # first calls, untimed
        for _ in range(3):
            run(mode, here, 1)
        run(mode, here, 13)
    for i in range(rounds):
        for mode, (_, _, _, here) in timers.items():
            c = calls[mode]
            c["one"] += [run(mode, here, 1) for _ in range(4)]
            c["thirteen"] += [run(mode, here, 13) for _ in range(2)]
            c["zero"] += [run(mode, here, 0) for _ in range(2)]
        log(f"bench_loop_overhead: round {i + 1}/{rounds}: " + ", ".join(
            f"{m}: {(np.median(c['thirteen']) - np.median(c['one'])) / 12:.4f} ms per iteration"
            for m, c in calls.items()))
    out = {}
    for mode, (branch_list, _, ctx, here) in timers.items():
        others = [b for b in branch_list if b != here] or [here]
        alternating = []
        for i in range(12):
            b = here if i % 2 == 0 else others[(i // 2) % len(others)]
            alternating.append((f"{b[0]}/{b[1]}", run(mode, b, 1)))
        c = calls[mode]
        name = f"{here[0]}/{here[1]}"
        slope = (np.median(c["thirteen"]) - np.median(c["one"])) / 12
        eng = engines[mode]
        out[mode] = {"branches": [f"{d}/{t}" for d, t in branch_list], "main_branch": name, "context": ctx,
                     "draft_lengths": list(eng.draft_lengths), "plan_interval": eng.device_loop_plan_interval,
                     "rounds": rounds, "one_iteration_ms": c["one"], "thirteen_iterations_ms": c["thirteen"],
                     "zero_iterations_ms": c["zero"], "alternating_one_iteration_ms": alternating,
                     "per_iteration_ms": float(slope), "per_call_intercept_ms": float(np.median(c["one"]) - slope),
                     "zero_iteration_call_ms": float(np.median(c["zero"])),
                     "alternating_main_ms": float(np.median([v for b, v in alternating if b == name])),
                     "alternating_other_ms": float(np.median([v for b, v in alternating if b != name] or [np.nan]))}
        if trace_calls:
            from scripts.op_trace import host_activity

            def calls_of(steps):
                for _ in range(trace_calls):
                    run(mode, here, steps)  # each call waits for its read-back

            for key, steps in (("zero_call_trace", 0), ("one_call_trace", 1)):
                out[mode][key] = {"calls": trace_calls,
                                  "rows": host_activity(lambda: calls_of(steps), top=60, level=3)}
                top = ", ".join(f"{r['name'][:48]} {r['self_ms'] / trace_calls:.3f}" for r in out[mode][key]["rows"][:6])
                log(f"bench_loop_overhead: {mode}: {key} (ms a call, own time): {top}")
    return out


def shapes(d: int, t: int, slots: int, live: tuple[int, ...] = ()) -> list[tuple[str, int]]:
    """``(name, live slots)`` of the timing runs of branch ``(d, t)`` (module docstring, ``--contexts``; ``live``:
    the ``--live`` counts)."""
    full = min(slots, t)
    out = [("full", full)]
    tail = t // (1 + d)
    if d and 0 < tail < full:
        out.append(("tail", tail))
    out += [(f"live {n}", n) for n in live if 0 < n < full and n != tail]
    return out


def context_sweep(eng, contexts, rounds: int = 5, live: tuple[int, ...] = ()) -> dict:
    """The ``--contexts`` timings of the module docstring on ``eng`` (with its greedy device loop compiled)."""
    program = eng._loop_programs[(False, None)]
    out = {"contexts": list(contexts), "live": list(live), "rounds": rounds, "rows": []}
    for c in contexts:
        branch_list, timer, context = eng._loop_branch_timer(program, context=c)
        runs = [(d, t, name, n) for d, t in branch_list for name, n in shapes(d, t, eng.max_num_seqs, live)]
        calls = {(i, n): [] for i in range(len(runs)) for n in (1, 13)}
        for d, t, _, slots in runs:  # a first call of each shape, untimed
            timer(d, t, 1, slots)
        for _ in range(rounds):
            for i, (d, t, _, slots) in enumerate(runs):
                for n in (1, 13):
                    calls[i, n].append(1e3 * timer(d, t, n, slots))
        for i, (d, t, name, slots) in enumerate(runs):
            ms = float((np.median(calls[i, 13]) - np.median(calls[i, 1])) / 12)
            out["rows"].append({"context": context, "branch": f"{d}/{t}", "shape": name, "live": slots,
                                "drafts": min(t - slots, slots * d), "ms_per_iteration": ms,
                                "calls_ms": {str(n): calls[i, n] for n in (1, 13)}})
            print(f"bench_loop_overhead: context {context} {d}/{t} {name} ({slots} slots): {ms:.3f} ms per iteration",
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


def build_loops(eng, *, sampling: bool = True) -> None:
    """Compile ``eng``'s greedy device loop, and with ``sampling`` its sampling one, alone (no step program, no
    cost table)."""
    from spec_decode.programs import compile_in_pool

    eng._state = eng._init_state()
    names = [("loop", False, None)] + ([("loop", True, None)] if sampling else [])
    done, _ = compile_in_pool(((n, eng._lowering(n)) for n in names), total=len(names), progress=False, desc="loops")
    for n in names:
        eng._loop_programs[n[1:]] = done[n]


def main(argv=None) -> int:
    from scripts.bench_common import mode_settings

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for the rows")
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--k", type=int, default=7, help="K of the adaptive modes (fixedN: N)")
    ap.add_argument("--modes", nargs="+", default=["adaptive", "fixed3"],
                    help="scripts/bench_e2e.py's modes: adaptive, adaptive@D1,D2,..., fixedN, ...")
    ap.add_argument("--max-model-len", type=int, default=448)
    ap.add_argument("--main-branch", default=None, metavar="D/T",
                    help="the branch the timing calls run (draft length / packed tokens); default 3/2048 where "
                         "compiled, else the last")
    ap.add_argument("--context", type=int, default=None,
                    help="every slot's context in the timing calls (default a quarter of --max-model-len)")
    ap.add_argument("--dump-hlo", default=None, metavar="DIR", help="write each greedy loop's optimized HLO here")
    ap.add_argument("--sampling-loop", action="store_true",
                    help="greedy rows in the sampling loop against the greedy loop, per branch (module docstring)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help="each branch's time per iteration at these contexts, full batch and tail (module docstring)")
    ap.add_argument("--live", type=int, nargs="+", default=[], metavar="N",
                    help="--contexts: also time each branch with N slots decoding (the rest of its tokens padding)")
    ap.add_argument("--trace-calls", type=int, default=0, metavar="N",
                    help="also trace N calls of 0 and of 1 iteration per mode on the host (module docstring)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved rounds (default 6; --contexts: 5)")
    args = ap.parse_args(argv)
    if args.sampling_loop and args.contexts:
        ap.error("--sampling-loop and --contexts are separate runs")
    settings = {}
    for m in args.modes:
        try:
            settings[m] = mode_settings(m, args.k)
        except ValueError as e:
            ap.error(str(e))
        if settings[m]["num_speculative_tokens"] == 0:
            ap.error(f"mode {m!r}: the timing runs need a speculative engine")
    main_branch = None
    if args.main_branch is not None:
        try:
            main_branch = tuple(int(x) for x in args.main_branch.split("/"))
            if len(main_branch) != 2:
                raise ValueError
        except ValueError:
            ap.error(f"--main-branch takes DRAFT_LENGTH/TOKENS such as 3/256, got {args.main_branch!r}")
    if args.live and not args.contexts:
        ap.error("--live goes with --contexts")
    if any(n < 1 or n > args.slots for n in args.live):
        ap.error(f"--live counts must lie in [1, --slots {args.slots}], got {args.live}")
    if (args.sampling_loop or args.contexts) and (args.main_branch or args.context is not None or args.dump_hlo):
        ap.error("--main-branch, --context and --dump-hlo go with the forced-branch timing, not with --sampling-loop "
                 "or --contexts")
    if args.sampling_loop and any(len(v.get("draft_lengths", ())) > 1 for v in settings.values()):
        ap.error("--sampling-loop builds its engines without a cost table: one draft length per mode (adaptive, "
                 "adaptive@D, fixedN)")
    if args.trace_calls and (args.sampling_loop or args.contexts):
        ap.error("--trace-calls goes with the forced-branch timing, not with --sampling-loop or --contexts")
    if args.trace_calls < 0:
        ap.error(f"--trace-calls must be at least 0, got {args.trace_calls}")
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    rounds = args.rounds or (5 if args.contexts else 6)
    step = 1 + max(v["num_speculative_tokens"] for v in settings.values())  # a step's positions (the engine's rule)
    for c in list(args.contexts or ()) + ([args.context] if args.context is not None else []):
        if not 0 < c <= args.max_model_len - step:
            ap.error(f"context {c} does not leave a step's {step} positions within --max-model-len "
                     f"{args.max_model_len}")

    import gzip
    import os

    import jax
    import jax.numpy as jnp

    from minimax_jax.default import load_default
    from scripts.hlo_report import hlo_text
    from spec_decode import Engine

    target, drafter, _ = load_default(dtype=jnp.bfloat16)
    rows = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "slots": args.slots,
            "command": " ".join(sys.argv)}
    engines = {}
    for mode in args.modes:
        kw = dict(settings[mode])
        if args.sampling_loop:
            eng = Engine(target, drafter, max_num_seqs=args.slots, max_model_len=args.max_model_len,
                         max_num_batched_tokens=2048, sampling=True, cost_table=None,
                         device_loop_sampling_token_buckets=4, **kw)  # the greedy loop's branches
            build_loops(eng)
            rows[mode] = compare_loops(eng)
            del eng
            continue
        # the planner's lengths as the engine would plan them; its table is never profiled (nothing here reads it)
        eng = Engine(target, drafter, max_num_seqs=args.slots, max_model_len=args.max_model_len,
                     max_num_batched_tokens=2048, sampling=False,
                     cost_table="profile" if kw["verification"] == "adaptive" else None, **kw)
        branches = eng.loop_config.branches
        if main_branch is not None and not args.contexts and main_branch not in branches:  # before any compile
            raise SystemExit(f"bench_loop_overhead: {mode} has no branch {args.main_branch} (its branches: "
                             f"{' '.join(f'{d}/{t}' for d, t in branches)})")
        build_loops(eng, sampling=False)
        if args.contexts:
            rows[mode] = context_sweep(eng, args.contexts, rounds, tuple(args.live))
            del eng
            continue
        if args.dump_hlo:
            os.makedirs(args.dump_hlo, exist_ok=True)
            with gzip.open(os.path.join(args.dump_hlo, f"{mode.replace(',', '_').replace('@', '_')}.hlo.gz"),
                           "wt") as f:
                f.write(hlo_text(eng._loop_programs[(False, None)]))
        engines[mode] = eng
    if engines:
        rows.update(measure(engines, main=main_branch, context=args.context, rounds=rounds,
                            trace_calls=args.trace_calls))
        for mode in engines:
            summary = {k: round(v, 4) for k, v in rows[mode].items() if k.endswith("_ms") and isinstance(v, float)}
            print(f"bench_loop_overhead: {mode}: {json.dumps(summary)}", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
