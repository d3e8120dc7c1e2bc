"""Where the host loop's time per step goes: the launch of one step program, piece by piece.

    PYTHONPATH=. python3 scripts/profile_dispatch.py --out DIR [--requests 64] [--mode fixed] [--calls 50]

Builds the engine (embedded default, bf16, greedy), runs a warm-up ``generate`` and a timed one under cProfile
(top functions by own time), then times the launch of the largest decode program in isolation, chained on its
donated state, split into: packing the plan (numpy), sending it (``device_put``), the call of the compiled
program, ``copy_to_host_async`` of the outputs, and the device time (``block_until_ready`` after each call).
``XLA_FLAGS`` given in the environment apply (compare command-buffer settings across runs).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.workloads import heldout_windows  # noqa: E402


def _median_ms(xs):
    return float(np.median(xs) * 1e3)


def summarize_trace(tdir: str, top: int = 40) -> list:
    """Host-side events of a perfetto trace: (name, count, total ms, longest ms), by total time."""
    import collections
    import glob
    import gzip

    path = sorted(glob.glob(os.path.join(tdir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    events = json.load(gzip.open(path)).get("traceEvents", [])
    pids = {e["pid"]: e["args"].get("name", "") for e in events if e.get("ph") == "M" and e.get("name") ==
            "process_name"}
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in events:
        if e.get("ph") != "X" or "/device:" in pids.get(e.get("pid"), ""):
            continue
        a = agg[(pids.get(e.get("pid"), "?")[:20], e["name"][:90])]
        a[0] += 1
        a[1] += e.get("dur", 0) / 1e3
        a[2] = max(a[2], e.get("dur", 0) / 1e3)
    rows = sorted(([p, n, c, round(t, 3), round(m, 3)] for (p, n), (c, t, m) in agg.items()), key=lambda r: -r[3])
    dev = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "/device:" in pids.get(e.get("pid"), ""):
            dev["kernels"] += 1
            dev["kernel_ms"] += e.get("dur", 0) / 1e3
    return [["device", "kernels (5 calls)", dev["kernels"], round(dev["kernel_ms"], 3), 0]] + rows[:top]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--mode", default="fixed", choices=["none", "fixed", "adaptive"])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tag", default="default")
    ap.add_argument("--trace", action="store_true", help="also trace 5 isolated launches with jax.profiler and "
                    "summarize the host events by name (perfetto trace under --out)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    from minimax_jax.default import load_default
    from spec_decode import Engine
    from spec_decode.programs import pack_plan

    target, drafter, tok = load_default(dtype=jnp.bfloat16)
    n = args.requests
    eng = Engine(target, drafter, num_speculative_tokens=7, verification=args.mode, max_num_seqs=n,
                 max_model_len=512, tokenizer=tok, sampling=False)
    t0 = time.perf_counter()
    eng.warmup()
    warm_s = time.perf_counter() - t0
    prompts = heldout_windows(tok, 3 * n, 128)
    from spec_decode import SamplingParams

    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    eng.generate(prompts[:n], sampling_params=sp)
    prof = cProfile.Profile()
    prof.enable()
    res = eng.generate(prompts[n:2 * n], sampling_params=sp)
    prof.disable()
    stats = res.stats
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)

    # the largest decode program, launched in isolation on a plan captured from the scheduler
    row = {"tag": args.tag, "xla_flags": os.environ.get("XLA_FLAGS", ""), "requests": n, "mode": args.mode,
           "warmup_s": warm_s, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "tokens_per_s": stats.get("output_tokens_per_s") or stats.get("tokens_per_s"),
           "host_ms_per_step": {k: v for k, v in stats.items() if k.startswith("host_") and k.endswith("ms_per_step")},
           "leaves": {"target_params": len(jax.tree.leaves(eng._target_params)),
                      "drafter_params": len(jax.tree.leaves(eng._drafter_params)),
                      "state": len(jax.tree.leaves(eng._state))}}
    # capture real plans: run the host loop's scheduler by hand for a few steps
    captured = []
    orig = eng._launch

    def spy(step):
        captured.append(step)
        return orig(step)

    eng._launch = spy
    eng.generate(prompts[2 * n:3 * n], sampling_params=sp)
    eng._launch = orig
    decode = [st for st in captured if st.num_decode == n] or captured
    step = max(decode, key=lambda st: st.key.tokens)
    row["key"] = str(step.key)
    progs = eng._programs
    fn = progs._compiled[step.key]
    flat = progs._flat(eng._target_params, eng._drafter_params)
    pack_s, put_s, call_s, copy_s, dev_s = [], [], [], [], []
    state = eng._state
    for i in range(args.calls):
        a = time.perf_counter()
        packed = pack_plan(step.plan)
        b = time.perf_counter()
        x = progs.put(packed)
        c = time.perf_counter()
        state, out = fn(*flat, state, x)
        d = time.perf_counter()
        for leaf in jax.tree.leaves(out):
            leaf.copy_to_host_async()
        e = time.perf_counter()
        jax.block_until_ready((state, out))
        f = time.perf_counter()
        if i >= 3:
            pack_s.append(b - a), put_s.append(c - b), call_s.append(d - c), copy_s.append(e - d)
            dev_s.append(f - e)
    # back-to-back calls without waiting: the rate the host can launch at
    t = time.perf_counter()
    for _ in range(args.calls):
        state, out = fn(*flat, state, progs.put(pack_plan(step.plan)))
    launched = time.perf_counter() - t
    jax.block_until_ready(state)
    pipelined = time.perf_counter() - t
    # is the GIL released while the program launches? a counting thread's rate alone, then during the launches
    import threading

    def count_for(flag, box):
        c = 0
        while not flag.is_set():
            c += 1
        box.append(c)

    rates = []
    for launching in (False, True):
        flag, box = threading.Event(), []
        th = threading.Thread(target=count_for, args=(flag, box))
        t = time.perf_counter()
        th.start()
        if launching:
            for _ in range(args.calls):
                state, out = fn(*flat, state, progs.put(pack_plan(step.plan)))
        else:
            time.sleep(0.1)
        w = time.perf_counter() - t
        flag.set()
        th.join()
        jax.block_until_ready(state)
        rates.append(box[0] / w)
    row["counter_rate_during_launch_over_alone"] = rates[1] / rates[0]
    if args.trace:
        tdir = os.path.join(args.out, f"trace_{args.tag}")
        with jax.profiler.trace(tdir, create_perfetto_trace=True):
            for _ in range(5):
                state, out = fn(*flat, state, progs.put(pack_plan(step.plan)))
                jax.block_until_ready(state)
        row["trace_summary"] = summarize_trace(tdir)
    eng._state = state
    row.update(pack_ms=_median_ms(pack_s), put_ms=_median_ms(put_s), call_ms=_median_ms(call_s),
               copy_async_ms=_median_ms(copy_s), wait_after_ms=_median_ms(dev_s),
               out_leaves=len(jax.tree.leaves(out)),
               launch_only_ms_per_call=1e3 * launched / args.calls,
               pipelined_ms_per_call=1e3 * pipelined / args.calls)
    print(json.dumps(row, indent=1))
    print(s.getvalue()[:6000])
    with open(os.path.join(args.out, f"dispatch_{args.tag}_{n}_{args.mode}.json"), "w") as fh:
        json.dump(row, fh, indent=1)
    with open(os.path.join(args.out, f"dispatch_{args.tag}_{n}_{args.mode}_cprofile.txt"), "w") as fh:
        fh.write(s.getvalue())


if __name__ == "__main__":
    main()
