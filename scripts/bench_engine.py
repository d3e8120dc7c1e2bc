"""Engine throughput at serving concurrency, start-up cold and warm, and prefix caching.

    PYTHONPATH=. python3 scripts/bench_engine.py --out DIR [--requests 8 64 256] [--modes none fixed adaptive]
        [--loops host device] [--prompt-len 256] [--max-new-tokens 128] [--startup 8 64 256] [--prefix]

**Throughput.** For each (verification mode, concurrency ``n``) an engine with ``max_num_seqs = n`` is built and
warmed up (the closed program set compiled, the cost table profiled: ``startup_s``), runs one warm-up generate
on one prompt set, then the timed generate on *another* set of the same shape (``scripts/workloads.py``: windows
of held-out Python sources the default never saw, distinct prompts, EOS ignored). ``timed_compiles`` counts XLA
compilations during the timed call with JAX's monitoring events (the closed set makes it 0). Host and device
loops run on the same engine; ``match`` is the fraction of requests whose tokens equal the host loop's.

**Start-up** (``--startup N ...``): construction plus ``warmup()`` of the adaptive engine at ``N`` slots, in a
fresh process with an empty compilation cache (cold), then again in another fresh process on that cache (warm).
Each row splits the warm-up into tracing + lowering (``lower_s``), compilation or cache loads (``compile_s``)
and the rest (``warmup_other_s``: the cost table). Each process then generates once on prompts the warm-up never
saw, in both loops (``generate``: seconds, compilations counted by JAX's events, and a digest of the tokens, which
must be the same cold and warm). ``XLA_FLAGS`` from the environment reach both processes and are recorded.
``--startup-profile`` adds a cProfile listing of the warm start-up; ``--startup-trace`` runs it under JAX's
profiler instead and lists what the host threads did by event name (where the loads of stored executables go;
its start-up time then holds the profiler's own start and stop). ``--startup-loads`` then loads every stored
executable alone, one after another, in a third fresh process (a ``loads`` row: each file's size, whether it holds
compiled GPU code or PTX, its load time); ``--startup-cache-dir DIR`` keeps the cache and the store under
``DIR/{slots}`` for a later look (``--load-store DIR/{slots}/executables`` runs the loads alone).
``--draft-lengths 0,1,3,7`` builds every adaptive engine (start-up, throughput, prefix caching) with those draft
lengths instead of the default ``0, 3, K``; rows record the lengths.

**Prefix caching** (``--prefix``): 550-token prompts whose first 200 tokens are shared, one new token each (so
the call is prefill), with the cache on and off: prefill seconds per request, at each chunk size of
``--prefix-chunk`` (default 512).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_common import draft_lengths_arg, refuse_lengths_above_k  # noqa: E402
from scripts.workloads import heldout_windows  # noqa: E402


def load_pair(dtype):
    from minimax_jax.default import load_default

    return load_default(dtype=dtype)


def meta(args) -> dict:
    dev = jax.devices()[0]
    return {"device": f"{dev.platform}:{getattr(dev, 'device_kind', '?')}", "jax": jax.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "args": vars(args)}


def startup_once(n: int, dtype_name: str, k: int, max_model_len: int, profile_to: str | None = None,
                 sampling_loop_buckets: int = 1, draft_lengths: tuple[int, ...] | None = None,
                 trace_to: str | None = None) -> dict:
    """Construction + warm-up of one engine (run inside a fresh process); with ``profile_to``, under cProfile,
    the 40 functions of largest cumulative time written to that file; with ``trace_to``, under JAX's profiler,
    the host threads' activity by event name (``op_trace.host_activity``) written to that file as JSON and its
    ten largest rows kept in the row (``trace_top``)."""
    from spec_decode import Engine

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[dtype_name]
    target, drafter, tokenizer = load_pair(dtype)
    prof = None
    if profile_to:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    built = []

    def build():
        built.append(Engine(target, drafter, num_speculative_tokens=k, verification="adaptive", max_num_seqs=n,
                            max_model_len=max_model_len, tokenizer=tokenizer, precompile=True,
                            device_loop_sampling_token_buckets=sampling_loop_buckets, draft_lengths=draft_lengths))

    t0 = time.perf_counter()
    activity = None
    if trace_to:
        from scripts.op_trace import host_activity

        activity = host_activity(build, top=60)
    else:
        build()
    total = time.perf_counter() - t0
    eng = built[0]
    if activity is not None:
        with open(trace_to, "w") as f:
            json.dump(activity, f, indent=1)
    if prof is not None:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
        with open(profile_to, "w") as f:
            f.write(buf.getvalue())
    rep = eng.warmup_report
    # then one generate on prompts the warm-up never saw, in both loops: on a warm start it runs the executables
    # loaded from the store; it must compile nothing, and its tokens must equal the cold process's
    from spec_decode.programs import compile_counter

    prompts = heldout_windows(tokenizer, min(n, 8), 256, offset=3 * n, bos=tokenizer.bos_token_id)
    gen = {}
    for loop in ("host", "device"):
        t = time.perf_counter()
        with compile_counter(cache_loads=True) as compiled:
            res = eng.generate(prompts, max_new_tokens=32, ignore_eos=True, loop=loop)
        gen[loop] = {"seconds": time.perf_counter() - t, "compiles": len(compiled),
                     "tokens_digest": hashlib.sha256(json.dumps([r.token_ids for r in res]).encode()).hexdigest()[:16]}
    # warm-up's parts: tracing + lowering (one thread), XLA compilation or cache loads (a thread pool), and the
    # rest (the cost table, profiled or loaded); construction is the remainder of startup_s
    return {"slots": n, "startup_s": total, "draft_lengths": list(eng.draft_lengths), "programs": rep.programs,
            "compiled": rep.compiled, "warmup_s": rep.seconds, "lower_s": rep.lower_seconds,
            "compile_s": rep.compile_seconds,
            "warmup_other_s": rep.seconds - rep.lower_seconds - rep.compile_seconds - rep.load_seconds,
            "loaded": rep.loaded, "load_s": rep.load_seconds, "slowest_compiles": rep.slowest,
            "generate": gen, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            **({"trace_top": activity[:10]} if activity is not None else {})}


def load_each(store: str) -> list[dict]:
    """Every executable of the store directory ``store`` loaded alone, one after another, in this process, slowest
    first: its file's size, what its payload holds (``elf_images``: compiled GPU code; ``ptx_modules``: code the
    driver would compile at load), and the seconds its unpickling and ``deserialize_and_load`` took; the slowest
    is loaded a second time (``reload_s``: what a process-wide cache saves)."""
    import pickle

    from spec_decode.executable_store import from_bytes

    def load(raw: bytes) -> float:
        t = time.perf_counter()
        from_bytes(raw)
        return time.perf_counter() - t

    rows, raws = [], {}
    for name in sorted(n for n in os.listdir(store) if n.endswith(".exe")):
        with open(os.path.join(store, name), "rb") as f:
            raws[name] = raw = f.read()
        payload = pickle.loads(raw)[0]
        rows.append({"file": name, "bytes": len(raw), "elf_images": payload.count(b"\x7fELF"),
                     "ptx_modules": payload.count(b".version "), "load_s": load(raw)})
    rows.sort(key=lambda r: -r["load_s"])
    if rows:
        rows[0]["reload_s"] = load(raws[rows[0]["file"]])
    return rows


def run_startup(args, out_rows: list) -> None:
    for n in args.startup:
        with contextlib.ExitStack() as stack:
            if args.startup_cache_dir:  # kept after the run (to inspect or load again); empty at the start (main)
                cache = os.path.join(args.startup_cache_dir, str(n))
                os.makedirs(cache, exist_ok=True)
            else:
                cache = stack.enter_context(tempfile.TemporaryDirectory())
            # the executable store lives beside the cache directory ($MINIMAX_JAX_CACHE_DIR/../executables): a
            # subdirectory keeps it inside this temporary one, so no earlier run's programs make a cold start warm
            env = {**os.environ, "MINIMAX_JAX_CACHE_DIR": os.path.join(cache, "jax"),
                   "MINIMAX_JAX_COMPILATION_CACHE": "1"}
            for phase in ("cold", "warm"):
                cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--startup-child", str(n),
                       "--dtype", args.dtype, "--k", str(args.k), "--max-model-len", str(args.max_model_len),
                       "--sampling-loop-buckets", str(args.sampling_loop_buckets)]
                if args.draft_lengths:
                    cmd += ["--draft-lengths", ",".join(map(str, args.draft_lengths))]
                if args.startup_profile and phase == "warm":  # (cProfile would slow the cold tracing too)
                    cmd += ["--startup-profile-to", os.path.join(args.out, f"startup_profile_{n}_{phase}.txt")]
                if args.startup_trace and phase == "warm":
                    cmd += ["--startup-trace-to", os.path.join(args.out, f"startup_trace_{n}_{phase}.json")]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                if proc.returncode != 0:
                    print(proc.stderr[-2000:], file=sys.stderr)
                    raise SystemExit(f"start-up child failed ({phase}, {n} slots)")
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                row["phase"] = phase
                row["sampling_loop_buckets"] = args.sampling_loop_buckets
                out_rows.append(row)
                print(json.dumps(row), flush=True)
            if args.startup_loads:  # each stored executable loaded alone, in another fresh process
                cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--load-store",
                       os.path.join(cache, "executables")]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                if proc.returncode != 0:
                    print(proc.stderr[-2000:], file=sys.stderr)
                    raise SystemExit(f"loading the stored executables one by one failed ({n} slots)")
                loads = json.loads(proc.stdout.strip().splitlines()[-1])
                row = {"slots": n, "phase": "loads", "executables": len(loads),
                       "load_s_sum": sum(r["load_s"] for r in loads), "loads": loads}
                out_rows.append(row)
                print(json.dumps({**row, "loads": loads[:5]}), flush=True)


def run_throughput(args, target, drafter, tokenizer, out_rows: list, save) -> None:
    from spec_decode import Engine
    from spec_decode.programs import compile_counter

    bos = tokenizer.bos_token_id
    for mode in args.modes:
        for n in args.requests:
            t0 = time.perf_counter()
            eng = Engine(target, drafter, num_speculative_tokens=args.k, verification=mode, max_num_seqs=n,
                         max_model_len=args.max_model_len, tokenizer=tokenizer,
                         async_scheduling=not args.sync, precompile=True,
                         draft_lengths=args.draft_lengths if mode == "adaptive" else None)
            startup = time.perf_counter() - t0
            warm_prompts = heldout_windows(tokenizer, n, args.prompt_len, offset=0, bos=bos)
            timed_prompts = heldout_windows(tokenizer, n, args.prompt_len, offset=n, bos=bos)
            kw = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True}
            tokens = {}
            for loop in args.loops:
                extra = {"progress": False} if loop == "host" else {}
                eng.generate(warm_prompts, loop=loop, **kw, **extra)
                with compile_counter(cache_loads=True) as compiled:
                    res = eng.generate(timed_prompts, loop=loop, **kw, **extra)
                tokens[loop] = [r.token_ids for r in res]
                st = res.stats
                row = {"mode": mode, "loop": loop, "requests": n, "k": eng.k, "startup_s": startup,
                       "programs": eng.warmup_report.programs, "wall_s": st["wall_time_s"], "steps": st["steps"],
                       "output_tokens": st["output_tokens"], "output_tokens_per_s": st["output_tokens_per_s"],
                       "ms_per_step": 1e3 * st["wall_time_s"] / max(st["steps"], 1),
                       "host_ms_per_step": 1e3 * st["host_time_per_step_s"],
                       "mean_acceptance_length": st["mean_acceptance_length"],
                       "mean_verified_drafts_per_step": st["mean_verified_drafts_per_step"],
                       "timed_compiles": len(compiled), "async": not args.sync,
                       "draft_lengths": list(eng.draft_lengths),
                       **{key: v for key, v in st.items() if key.startswith("host_") and key.endswith("_per_step")}}
                if loop != "host" and "host" in tokens:
                    row["match"] = float(np.mean([a == b for a, b in zip(tokens["host"], tokens[loop])]))
                row["sampling_loop_buckets"] = args.sampling_loop_buckets
                out_rows.append(row)
                print(json.dumps(row), flush=True)
                save()


def run_prefix(args, target, drafter, tokenizer, out_rows: list, save) -> None:
    from spec_decode import Engine

    n, length, shared = args.prefix_requests, 550, 200
    for chunk, cache_on in [(c, on) for c in args.prefix_chunk for on in (False, True)]:
        # prefill only: the host loop runs it, so the device loop is left out of the warm-up
        eng = Engine(target, drafter, num_speculative_tokens=args.k, verification="adaptive", max_num_seqs=n,
                     max_model_len=length + 32, tokenizer=tokenizer, enable_prefix_caching=cache_on,
                     max_num_batched_tokens=chunk, device_loop=False, precompile=True,
                     draft_lengths=args.draft_lengths)
        warm = heldout_windows(tokenizer, n, length, offset=0, shared_prefix=shared, prefix_index=0,
                               bos=tokenizer.bos_token_id)
        eng.generate(warm, max_new_tokens=1, progress=False)
        # other shared prefixes for the timed calls: their pages are not cached yet
        eng.record_launches = True  # each step's launch and read-back times (the row's launch_timeline)
        runs = []
        for i in range(args.prefix_sets):
            timed = heldout_windows(tokenizer, n, length, offset=n * (1 + i), shared_prefix=shared,
                                    prefix_index=1 + i, bos=tokenizer.bos_token_id)
            runs.append(eng.generate(timed, max_new_tokens=1, progress=False).stats)
        st = runs[0]
        wall = sum(r["wall_time_s"] for r in runs)
        row = {"bench": "prefix", "prefix_caching": cache_on, "requests": n, "prompt_len": length,
               "shared_prefix": shared, "max_num_batched_tokens": chunk, "sets": len(runs),
               "steps": [r["steps"] for r in runs], "per_set_wall_s": [r["wall_time_s"] for r in runs],
               "wall_s": wall, "prefill_s_per_request": wall / (n * len(runs)), "prefill_tokens": st["prefill_tokens"],
               "prefix_cache_tokens": st["prefix_cache_tokens"], "hit_rate": st["prefix_cache_hit_rate"],
               **{key: [r.get(key) for r in runs] for key in ("host_schedule_ms_per_step",
                                                               "host_dispatch_ms_per_step",
                                                               "host_commit_ms_per_step")},
               "launch_timeline": st.get("launch_timeline")}
        out_rows.append(row)
        print(json.dumps(row), flush=True)
        save()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, nargs="*", default=[8, 64, 256])
    ap.add_argument("--modes", nargs="+", default=["none", "fixed", "adaptive"])
    ap.add_argument("--loops", nargs="+", choices=["host", "device"], default=["host", "device"])
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--sync", action="store_true", help="async_scheduling=False")
    ap.add_argument("--startup", type=int, nargs="*", default=[])
    ap.add_argument("--prefix", action="store_true")
    ap.add_argument("--prefix-requests", type=int, default=64)
    ap.add_argument("--prefix-sets", type=int, default=2, help="timed calls per prefix-caching row, each on "
                    "its own shared prefix")
    ap.add_argument("--prefix-chunk", type=int, nargs="+", default=[512],
                    help="prefill chunk sizes (Engine(max_num_batched_tokens=...)) of the prefix-caching rows")
    ap.add_argument("--startup-profile", action="store_true",
                    help="run the warm start-up under cProfile: startup_profile_{slots}_warm.txt in --out")
    ap.add_argument("--startup-trace", action="store_true",
                    help="run the warm start-up under JAX's profiler: the host threads' activity by event name "
                         "(XLA's executable loading among them) in startup_trace_{slots}_warm.json in --out")
    ap.add_argument("--sampling-loop-buckets", type=int, default=1,
                    help="start-up: Engine(device_loop_sampling_token_buckets=...), the sampling loop's verify sizes "
                         "per draft length (4: the greedy loop's, as before 2026-12-05)")
    ap.add_argument("--draft-lengths", type=draft_lengths_arg, default=None, metavar="D1,D2,...",
                    help="the adaptive engines' draft lengths (Engine(draft_lengths=...); default: 0,3,K), "
                         "e.g. 0,3,7")
    ap.add_argument("--startup-loads", action="store_true",
                    help="after the warm start-up, load every stored executable alone in a fresh process: its "
                         "size, whether it holds compiled GPU code or PTX, and its load time (a 'loads' row)")
    ap.add_argument("--startup-cache-dir", default=None,
                    help="start-up: keep the compilation cache and the executable store under DIR/{slots} (empty "
                         "at the start) instead of a temporary directory")
    ap.add_argument("--load-store", default=None, metavar="DIR",
                    help="only load every executable of the store DIR alone, one after another, and print their "
                         "rows as JSON (what --startup-loads runs)")
    ap.add_argument("--startup-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--startup-profile-to", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--startup-trace-to", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    refuse_lengths_above_k(ap, args.draft_lengths, args.k)
    if args.startup_profile and args.startup_trace:
        ap.error("--startup-profile and --startup-trace profile the same warm start-up two ways: give one")
    for n in args.startup if args.startup_cache_dir else ():
        cache = os.path.join(args.startup_cache_dir, str(n))
        if os.path.isdir(cache) and os.listdir(cache):
            ap.error(f"--startup-cache-dir: {cache} is not empty, so the start-up there would not be cold")
    if args.load_store is not None:
        if not os.path.isdir(args.load_store):
            ap.error(f"--load-store: {args.load_store} is not a directory")
        print(json.dumps(load_each(args.load_store)))
        return
    if args.startup_child is not None:
        print(json.dumps(startup_once(args.startup_child, args.dtype, args.k, args.max_model_len,
                                      args.startup_profile_to, args.sampling_loop_buckets, args.draft_lengths,
                                      args.startup_trace_to)))
        return
    os.makedirs(args.out, exist_ok=True)
    rows: list = []
    info = meta(args)

    def save():
        with open(os.path.join(args.out, "engine_bench.json"), "w") as f:  # a cut run keeps its rows
            json.dump({"meta": info, "rows": rows}, f, indent=1)

    if args.startup:
        run_startup(args, rows)
        save()
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    target, drafter, tokenizer = load_pair(dtype)
    if args.prefix:
        run_prefix(args, target, drafter, tokenizer, rows, save)
    if args.requests:
        run_throughput(args, target, drafter, tokenizer, rows, save)
    save()


if __name__ == "__main__":
    main()
