"""End-to-end sweep: output tokens/s of every verification mode at every concurrency, host and device loops; and
the confidence head's calibration on unseen code (a reliability diagram).

    PYTHONPATH=. python3 scripts/bench_e2e.py --out DIR [--requests 1 8 32 64 128 256 512] [--modes ...]
        [--loops host device] [--prompt-len 256] [--max-new-tokens 128] [--dtype bfloat16] [--time-budget-s S]
        [--calibration] [--resume DIR/bench_e2e.jsonl]
    PYTHONPATH=. python3 scripts/bench_e2e.py --plot-only DIR/bench_e2e.jsonl     # tables and plots from rows

On the H200 (calls of at most 10 minutes; rows survive a cut, and a later call resumes from them: on the same
``--out``, or, when each call starts with an empty ``$OUT``, from the previous call's rows copied into the tree):

    PYTHONPATH=. python3 scripts/bench_e2e.py --out $OUT/e2e --requests 1 8 64 --time-budget-s 540
    PYTHONPATH=. python3 scripts/bench_e2e.py --out $OUT/e2e --requests 1 8 64 --time-budget-s 540 \
        --resume bench_rows/e2e_part1.jsonl                # the first call's bench_e2e.jsonl, copied back
    PYTHONPATH=. python3 scripts/bench_e2e.py --out $OUT/cal --requests --calibration   # reliability only

**Modes.** ``none`` (plain decoding, one token per step), ``fixed1``..``fixed7`` (every request verifies its K
drafts, K = 1..7), ``adaptive`` (K = 7, the confidence head's survival ranked against the profiled cost table,
default draft lengths), ``adaptive-held`` (adaptive with the draft length held at K: ``draft_lengths=(7,)``) and
``adaptive-calibrated`` (adaptive with the head's confidences recalibrated online: ``confidence="calibrated"``);
``adaptive@D1,D2,...`` is adaptive with those draft lengths (``adaptive@3``: a K = ``--k`` engine that always
drafts 3 and plans its budget, beside ``fixed3``'s K = 3 engine, isolates what K itself costs). The last three need
the Engine keywords ``draft_lengths`` / ``confidence``; on an Engine without them those modes are skipped with a
message. Any mode may carry suffixes that change one engine setting each (``scripts/bench_common.mode_settings``):
``+lbN`` the device loop's verify sizes per draft length, ``+piN`` its plan interval (``adaptive+pi8`` beside
``adaptive`` times plans held for 8 iterations against the default's, interleaved in one process).

**One configuration** (concurrency ``n``, mode): an engine with ``max_num_seqs = n`` and ``max_model_len`` =
prompt + output + 64 rounded up to a page; ``warmup()`` compiles its closed program set and profiles the cost
table (``startup_s``, kept apart from the timed call). Per loop: one warm-up ``generate`` on ``n`` held-out prompts
(``scripts/workloads.py``: windows of Python sources the default never saw, distinct prompts), then the timed
``generate`` on ``n`` *other* held-out prompts of the same shape (the same timed set for every mode and loop at
that ``n``, so their tokens compare). Prefill chunks of ``--max-num-batched-tokens`` (2048 by default; until
session 17 it was 512, under which 64-256 host-launched prefill steps were 70-80% of the wall at 128-512
requests; rows record it, and rows of another chunk size are other configurations). Greedy, EOS ignored, prefix
caching off unless asked for or a prefix is shared (``--workload published``). Both loops run on one engine
(host, then device); each loop starts from an empty prefix cache (``Engine.reset_prefix_cache``), so it never
reads the pages the previous loop cached for the same prompts. ``timed_compiles``: XLA compilations during the
timed call (0: the closed set).

**Row fields.** ``output_tokens_per_s`` (every request's tokens, the one sampled at prefill included, over the
timed call's wall time); ``ms_per_output_token`` = wall / (output tokens / n): the per-request inter-token latency;
``mean_acceptance_length`` (tokens emitted per verify step, bonus included); ``mean_verified_drafts_per_step``
(over the batch); ``mean_drafted_tokens_per_step`` / ``draft_length_per_step`` (None on an Engine that does not
report them); ``per_position_acceptance`` / ``predicted_per_position_acceptance`` / ``calibration_error`` (observed
vs predicted survival at the verified positions); ``host_time_per_step_s`` (the first timed set's); ``wall_time_s``
(every timed set's together) and ``per_set_wall_s``; ``per_set_decode_loop_s`` (device rows: the decode loop's
seconds of each set, the rest being its prefill waves and host work; None on the host loop),
``per_set_verify_steps`` (each set's verify steps: on the device loop, its iterations) with
``per_set_ms_per_loop_iteration`` (device rows), and ``decode_loop_tokens_per_s`` (the tokens the loop emitted,
all but each request's first, over those seconds); ``per_set_plan`` (each set's draft length, packed tokens, budget
and verified drafts per step, where ``draft_length_per_step`` holds the first set's lengths only);
``match_host`` (device rows: fraction of
requests whose tokens equal the host loop's) and ``match_none`` (fraction equal to mode ``none``'s at the same
``n`` and loop; greedy, so every mode should give 1.0 in f32; bf16 near-ties can flip); ``interleaved`` (timed
with ``--interleave``: in rounds with the other modes, after a settling call) and ``engine_built_by`` (the mode
whose engine the row ran on: with ``--interleave``, modes that differ only in a plan interval of 2 or more share
one engine, its programs and its cost table). Rows carry a digest per request's tokens so the matches survive
split runs.

**Outputs** in ``--out``: ``bench_e2e.jsonl`` (a row per (n, mode, loop), appended and flushed as each finishes;
an existing file resumes: its configurations are skipped), ``bench_e2e.json`` (``meta`` + all rows),
``bench_e2e.md`` (tokens/s table per loop: rows concurrency, columns modes; and the ratio of each adaptive mode
to the best of ``none``/``fixed1..7``, and to ``fixed7``), ``tokens_per_s.png``, ``adaptive_ratio.png`` (reference
lines at 0.98 and 1.05). ``--time-budget-s``: a new configuration starts only if the elapsed time plus the previous
configuration's duration fits.

**Calibration** (``--calibration``): ``spec_decode.rollout.batched_rollout`` with full verification (every draft
of the block verified), greedy, on ``--calibration-prompts`` held-out windows x ``--calibration-new-tokens``.
Prediction for position ``k`` = the survival the drafter's calibrated confidences give, ``prod_{i<=k}
sigmoid(logit_i / T_i)`` (the drafter's STS temperatures), against "the first ``k`` drafts were all accepted"
(``minimax_jax.calibration.acceptance_labels``) at the verified positions; ECE per position with 20 bins
(``expected_calibration_error``). ``calibration.json``: per-position mean predicted / observed, ECE calibrated and
raw, per-bin counts / mean predicted / observed frequency; ``reliability.png``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import hashlib
import inspect
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.bench_common import mode_settings  # noqa: E402  (re-exported: the modes' engine keywords)

ALL_MODES = ["none"] + [f"fixed{k}" for k in range(1, 8)] + ["adaptive", "adaptive-held", "adaptive-calibrated"]
BASELINES = ["none"] + [f"fixed{k}" for k in range(1, 8)]
ADAPTIVE = ["adaptive", "adaptive-held", "adaptive-calibrated"]
ROWS_FILE, JSON_FILE, MD_FILE = "bench_e2e.jsonl", "bench_e2e.json", "bench_e2e.md"
NUM_BINS = 20


# ----------------------------------------------------------------------------------------------- modes
def adaptive_modes(rows: list[dict]) -> list[str]:
    """The adaptive modes of ``rows``: the named ones first, then ``adaptive@...`` and suffixed (``+lbN``,
    ``+piN``) ones."""
    present = {r["mode"] for r in rows}
    return [m for m in ADAPTIVE if m in present] + sorted(m for m in present if m.startswith("adaptive")
                                                          and m not in ADAPTIVE)


def engine_accepts(name: str) -> bool:
    from spec_decode import Engine

    return name in inspect.signature(Engine.__init__).parameters


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def digest(tokens) -> str:
    return hashlib.sha1(np.asarray(tokens, np.int64).tobytes()).hexdigest()[:12]


def clean(v):
    """JSON-safe: NaN/inf -> None, numpy scalars and tuples to plain values."""
    if isinstance(v, dict):
        return {str(k): clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    if isinstance(v, np.ndarray):
        return clean(v.tolist())
    if isinstance(v, (np.floating, float)):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, np.integer):
        return int(v)
    return v


def config_key(row: dict) -> tuple:
    """A configuration's identity (a resumed sweep skips the keys it has); the plan interval stays the last field
    (:func:`timed_prompts_key` drops it)."""
    rates = row.get("synthetic_rates")
    return (row["n"], row["mode"], row["loop"], row["prompt_len"], row["max_new_tokens"], row["dtype"],
            row.get("model", "default"), tuple(rates) if rates else None, row.get("shared_prefix", 0),
            row.get("tensor_parallel_size"), row.get("max_num_batched_tokens", 512), row.get("temperature", 0.0),
            row.get("sampling_loop_buckets", 1) if row.get("temperature") else None,
            row.get("draft_length_buckets", 2), row.get("prompt_sets", 1), row.get("plan_interval", 1))


def timed_prompts_key(row: dict) -> tuple:
    """What fixes a row's timed prompts and their reference tokens: its :func:`config_key` without the mode, the
    loop and the plan interval (the key's last field), so rows that decoded the same prompts compare
    (``match_none``, ``match_host``) whatever engine settings their modes carry."""
    key = config_key(row)
    return key[:1] + key[3:-1]


def loop_and_steps(loop: str, args) -> tuple[str, int]:
    """``host``, ``device`` or ``host@M`` (the host loop with ``M`` decode steps per launch) -> (loop, M)."""
    base, _, m = loop.partition("@")
    if base not in ("host", "device") or (m and (base != "host" or not m.isdigit() or int(m) < 1)):
        raise SystemExit(f"bench_e2e: --loops takes host, device or host@M (M >= 1), got {loop!r}")
    return base, (int(m) if m else args.decode_steps_per_launch) if base == "host" else 0


def this_row(args, n: int, mode: str, loop: str) -> dict:
    """The key fields of a configuration's row (what ``config_key`` reads)."""
    return {"n": n, "mode": mode, "loop": loop, "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
            "dtype": args.dtype, "model": args.model, "shared_prefix": args.shared_prefix,
            "tensor_parallel_size": args.tensor_parallel_size, "max_num_batched_tokens": args.max_num_batched_tokens,
            "synthetic_rates": list(args.synthetic_rates) if args.synthetic_rates else None,
            "temperature": args.temperature, "sampling_loop_buckets": args.sampling_loop_buckets,
            "draft_length_buckets": args.draft_length_buckets,
            "plan_interval": mode_settings(mode, args.k).get("device_loop_plan_interval", args.plan_interval),
            # 2: the warm-up on training-split windows at the timed concurrency, the timed sets from held-out window
            # 0 (1: a warm-up of min(n, 64) held-out windows, the timed sets after them)
            "prompt_sets": 2}


def load_rows(path: str) -> list[dict]:
    rows = []
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:  # a line cut by a killed run
                        print(f"bench_e2e: skipping a damaged line of {path}", file=sys.stderr)
    return rows


def matches(a: list[str] | None, b: list[str] | None) -> float | None:
    if not a or not b or len(a) != len(b):
        return None
    return float(np.mean([x == y for x, y in zip(a, b)]))


# ----------------------------------------------------------------------------------------------- the sweep
def dump_loop_hlo(eng, out: str, n: int, mode: str) -> dict | None:
    """Write the greedy device loop's optimized HLO to ``OUT/hlo/loop_<n>_<mode>.hlo.gz``; return a summary of
    its control computations (:func:`scripts.hlo_report.report`): kernels and copy bytes per iteration's body and
    per branch."""
    import gzip

    from scripts.hlo_report import hlo_text, report

    program = eng._loop_programs.get((False, None))
    if program is None:
        return None
    try:
        text = hlo_text(program)
    except (ValueError, AttributeError) as e:  # an executable loaded from the store carries no text
        return {"error": str(e)}
    os.makedirs(os.path.join(out, "hlo"), exist_ok=True)
    path = os.path.join(out, "hlo", f"loop_{n}_{mode.replace(',', '-')}.hlo.gz")
    with gzip.open(path, "wt") as f:
        f.write(text)
    return {"file": os.path.relpath(path, out),
            "computations": [{key: r[key] for key in ("role", "launching_ops", "ops", "copies", "copy_bytes",
                                                       "largest_copies")} for r in report(text, top=3)]}


def run_config(args, target, drafter, tokenizer, n: int, mode: str, loops: list[str], done_rows: list[dict],
               write_row) -> None:
    """One (n, mode): build and warm up an engine, then a warm-up and a timed generate per loop in ``loops``."""
    for _ in config_steps(args, target, drafter, tokenizer, n, mode, loops, done_rows, write_row):
        pass


def config_steps(args, target, drafter, tokenizer, n: int, mode: str, loops: list[str], done_rows: list[dict],
                 write_row, settle: bool = False, engines: dict | None = None):
    """:func:`run_config` as a generator: it yields once its engine is warm (the warm-up call run) and after each
    timed set, so that ``--interleave`` can run the modes' timed sets in turns; the row is written at the end.

    ``settle``: after that first yield, one more untimed call on the warm-up prompts (and a yield), which
    ``--interleave`` runs once every engine is built: an engine's first call after other engines were built and
    warmed up ran 14-65 ms slower than its later ones (docs/BENCHMARKS.md, session 28).

    ``engines`` (``--interleave``'s, one for its modes): modes whose settings differ only in a plan interval of 2
    or more (``adaptive`` and ``adaptive+pi8``) run on one engine, the first one's, each setting its interval
    before each of its calls (the interval is a value of each call: docs/ENGINE.md, "The device loop"). They
    share its programs, state and cost table (profiled at the first mode's interval), so the interval is the one
    thing that differs between their rows; a row names the mode that built its engine (``engine_built_by``)."""
    from minimax_jax.cache import page_size_for
    from scripts.workloads import heldout_windows, warmup_windows
    from spec_decode import Engine
    from spec_decode.programs import compile_counter

    settings = mode_settings(mode, args.k)
    extra = {key: v for key, v in settings.items() if key not in ("verification", "num_speculative_tokens")}
    k_mode = settings["num_speculative_tokens"]
    if args.tensor_parallel_size is not None:  # on a mesh, even of one device (the sharded code at TP 1)
        from minimax_jax.sharding import make_mesh

        extra["mesh"] = make_mesh(args.tensor_parallel_size)
    if args.synthetic_rates is not None and k_mode > 0:  # P(the first k accepted) does not depend on K
        extra.update(synthetic_acceptance_rates=tuple(args.synthetic_rates[:k_mode]),
                     synthetic_confidence_noise=args.synthetic_confidence_noise)
    max_model_len = round_up(args.prompt_len + args.max_new_tokens + 64, page_size_for(target.cfg))
    interval = extra.pop("device_loop_plan_interval", args.plan_interval)
    # --interleave: modes that differ only in a plan interval of 2 or more run on one engine (see above)
    share_key = (n, tuple(sorted((key, repr(v)) for key, v in settings.items() if key != "device_loop_plan_interval")),
                 tuple(loops))
    shared = engines.get(share_key) if engines is not None and interval > 1 else None
    if shared is not None:
        eng, built_by, report = shared
        construct_s = startup_s = None  # the building mode's row has them
    else:
        built_by = mode
        t0 = time.perf_counter()
        eng = Engine(target, drafter if settings["verification"] != "none" else None,
                     num_speculative_tokens=settings["num_speculative_tokens"],
                     verification=settings["verification"], max_num_seqs=n, max_model_len=max_model_len,
                     max_num_batched_tokens=args.max_num_batched_tokens, min_token_bucket=args.min_token_bucket,
                     tokenizer=tokenizer if args.model == "default" else None,  # the slice's vocabulary is M3's
                     enable_prefix_caching=args.prefix_caching or args.shared_prefix > 0,
                     implementation=args.implementation,
                     device_loop=any(loop_and_steps(lp, args) != ("host", 1) for lp in loops),
                     decode_steps_per_launch=args.decode_steps_per_launch, precompile=False,
                     sampling=args.sampling or args.temperature > 0,
                     device_loop_sampling_token_buckets=args.sampling_loop_buckets,
                     draft_length_buckets=args.draft_length_buckets, device_loop_plan_interval=interval, **extra)
        construct_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        report = eng.warmup()
        startup_s = time.perf_counter() - t1
        if engines is not None and interval > 1:
            engines[share_key] = (eng, mode, report)
    loop_hlo = dump_loop_hlo(eng, args.out, n, mode) if args.dump_loop_hlo else None
    bos = tokenizer.bos_token_id
    # the warm-up call runs at the timed calls' concurrency (the first device-loop call at a new occupancy is slower
    # than later ones, docs/BENCHMARKS.md) on windows of the training split, so every held-out window is left to
    # the timed sets; with --shared-prefix its prompts share another prefix than the timed ones
    n_warm = min(n, args.warm_requests or n)  # parse_args: at least 1
    share = dict(shared_prefix=args.shared_prefix, prefix_index=0) if args.shared_prefix else {}
    head = 1 if bos is not None else 0
    if args.shared_prefix:
        other = heldout_windows(tokenizer, 1, args.prompt_len, bos=bos, **{**share, "prefix_index": 1})[0]
        warm_prompts = [other[:head + args.shared_prefix] + w[head:]
                        for w in warmup_windows(tokenizer, n_warm, args.prompt_len - args.shared_prefix, bos=bos)]
    else:
        warm_prompts = warmup_windows(tokenizer, n_warm, args.prompt_len, bos=bos)
    timed_sets = []  # the first is every mode's common set (its tokens are compared); later ones add timing
    for i in range(args.timed_sets):
        try:
            timed_sets.append(heldout_windows(tokenizer, n, args.prompt_len, offset=n * i, bos=bos, **share))
        except ValueError:  # the held-out files give no more distinct windows
            break
    if not timed_sets:
        raise SystemExit(f"bench_e2e: the held-out files give fewer than {n} windows of {args.prompt_len} "
                         f"tokens: no timed set at n={n}")
    # sampled rows (--temperature): one seed per request, so every mode and loop draws from the same streams
    kw = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True, "temperature": args.temperature,
          "progress": False, **({"seed": 0} if args.temperature > 0 else {})}

    def generate(prompts, loop, eng=eng):
        eng.device_loop_plan_interval = interval  # this mode's, on an engine another mode may share
        return eng.generate(prompts, loop=loop, **kw)

    here = timed_prompts_key(this_row(args, n, mode, ""))

    def on_these_prompts():  # rows recorded so far on this n's timed prompts (interleaved modes finish together,
        # so it is read again when a row is made)
        return [r for r in done_rows if timed_prompts_key(r) == here]

    by_loop = {r["loop"]: r for r in on_these_prompts() if r["mode"] == mode}
    for loop in loops:
        base, steps_per_launch = loop_and_steps(loop, args)
        if base == "host":
            eng.decode_steps_per_launch = steps_per_launch
        # every loop starts from an empty prefix cache: the previous loop's timed call left these very prompts'
        # pages cached, and a second loop reading them would skip their prefill (with a shared prefix, the
        # timed call still shares it between its own requests)
        eng.reset_prefix_cache()
        generate(warm_prompts, base)
        yield
        if settle:  # the warm-up call again: the timed sets see the prefix cache the warm-up call left either way
            eng.reset_prefix_cache()
            generate(warm_prompts, base)
            yield
        runs = []
        # interleaved, another mode's timed sets run between these; a compile there would count here too
        with compile_counter(cache_loads=True) as compiled:
            for prompts in timed_sets:
                eng.record_launches = bool(args.launch_timeline)  # the timed calls' launch timeline (host loop)
                runs.append(generate(prompts, base))
                eng.record_launches = False
                yield
        eng.device_loop_plan_interval = interval  # loop_profile calls the engine itself
        profile = loop_profile(eng, timed_sets[0], kw) if args.trace_loop and base == "device" else None
        res = runs[0]
        st = res.stats
        wall = sum(r.stats["wall_time_s"] for r in runs)
        out_tokens = sum(r.stats["output_tokens"] for r in runs)
        row = {
            **this_row(args, n, mode, loop),  # the configuration's key fields
            "verification": eng.mode, "K": eng.k, "balanced_routing": args.balanced_routing,
            "acceptance": st.get("acceptance", "real"),
            "draft_lengths": getattr(eng, "draft_lengths", extra.get("draft_lengths")),
            "confidence": getattr(eng, "confidence", None), "max_model_len": max_model_len,
            "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall if wall else 0.0,
            "per_set_tokens_per_s": [r.stats["output_tokens_per_s"] for r in runs],
            # each set's wall and, on the device loop, its decode loop's seconds (the rest: the prefill waves and
            # the host), and the loop's own tokens/s (every token but each request's first, which its prefill emits)
            "per_set_wall_s": [r.stats["wall_time_s"] for r in runs],
            "per_set_decode_loop_s": [r.stats.get("device_time_s") for r in runs],
            # each set's verify steps (device rows: the loop's iterations over the set's waves; in a closed wave
            # the slowest request sets them) and the loop's milliseconds per iteration
            "per_set_verify_steps": [r.stats["verify_steps"] for r in runs],
            "per_set_ms_per_loop_iteration": [1e3 * r.stats["device_time_s"] / r.stats["verify_steps"]
                                              if r.stats.get("device_time_s") and r.stats["verify_steps"] else None
                                              for r in runs],
            # each set's plan, step by step (``draft_length_per_step`` below is the first set's alone): the draft
            # length, the packed tokens of the program that ran, the budget and the drafts verified
            "per_set_plan": [{"draft_length": r.stats.get("draft_length_per_step"),
                              "verify_tokens": r.stats.get("verify_tokens_per_step"),
                              "budget": r.stats.get("budget_per_step"),
                              "verified": r.stats.get("verified_drafts_per_step")} for r in runs],
            "decode_loop_tokens_per_s": _loop_tokens_per_s(runs, n),
            "ms_per_output_token": 1e3 * wall / (out_tokens / n) if out_tokens else None,
            "mean_draft_length": st.get("mean_draft_length"),
            "lower_s": getattr(report, "lower_seconds", None), "compile_s": getattr(report, "compile_seconds", None),
            "wall_time_s": wall, "steps": st["steps"], "verify_steps": st["verify_steps"],
            "ms_per_step": 1e3 * wall / max(sum(r.stats["steps"] for r in runs), 1),
            "mean_acceptance_length": st["mean_acceptance_length"],
            "mean_verified_drafts_per_step": st["mean_verified_drafts_per_step"],
            "mean_drafted_tokens_per_step": st.get("mean_drafted_tokens_per_step"),
            "draft_length_per_step": st.get("draft_length_per_step"),
            "per_position_acceptance": st["per_position_acceptance"],
            "predicted_per_position_acceptance": st["predicted_per_position_acceptance"],
            "calibration_error": st["calibration_error"],
            "timed_compiles": len(compiled), "construct_s": construct_s, "startup_s": startup_s,
            "engine_built_by": built_by,  # --interleave: the mode whose engine this one shares (itself if none)
            "interleaved": settle,  # --interleave: timed in rounds with the other modes, after a settling call
            "warmup_programs": report.programs, "warmup_compiled": report.compiled,
            "host_time_per_step_s": st["host_time_per_step_s"],
            **{key: st[key] for key in ("host_schedule_ms_per_step", "host_dispatch_ms_per_step",
                                        "host_commit_ms_per_step", "multi_step_launches",
                                        "steps_in_multi_step_launches", "empty_launches", "launch_timeline")
                         if key in st},
            "decode_steps_per_launch": steps_per_launch if base == "host" else None,
            "prefix_cache_tokens": st["prefix_cache_tokens"], "preemptions": st["preemptions"],
            # the verify logits' bound: at most max_total_logit_rows rows of V float32 logits in any step
            "max_total_logit_rows": eng.max_total_logit_rows,
            "verify_logits_bytes_bound": 4 * eng.max_total_logit_rows * target.cfg.vocab_size,
            "peak_device_bytes": device_peak_bytes(),
            "token_digests": [digest(r.token_ids) for r in res],
            "cost_table": eng.cost_table.to_dict() if eng.cost_table is not None else None,
            "loop_profile": profile,
            "loop_hlo": loop_hlo if base == "device" else None,
        }
        if loop != "host" and "host" in by_loop:
            row["match_host"] = matches(by_loop["host"]["token_digests"], row["token_digests"])
        none_rows = [r for r in on_these_prompts() if r["mode"] == "none"]
        ref = next((r for r in none_rows if r["loop"] == loop), none_rows[0] if none_rows else None)
        if mode == "none" and ref is None:
            ref = row
        row["match_none"] = matches(ref["token_digests"], row["token_digests"]) if ref is not None else None
        row = clean(row)
        by_loop[loop] = row
        done_rows.append(row)
        write_row(row)
        loop_s = row["per_set_decode_loop_s"]
        in_loop = (f" (decode loop {row['decode_loop_tokens_per_s']:.0f} tok/s, sets "
                   + " / ".join(f"{1e3 * x:.1f}" for x in loop_s) + " ms in "
                   + " / ".join(str(x) for x in row["per_set_verify_steps"]) + " iterations)"
                   ) if row.get("decode_loop_tokens_per_s") else ""
        print(f"bench_e2e: n={n} {mode} {loop}: {row['output_tokens_per_s']:.1f} tok/s{in_loop}, "
              f"{row['ms_per_output_token'] or 0:.3f} ms/token, acceptance {row['mean_acceptance_length']:.2f}, "
              f"compiles {row['timed_compiles']}, match_none {row['match_none']}", flush=True)
        del res
    del eng
    gc.collect()


def device_peak_bytes() -> int | None:
    """The device's peak bytes in use so far in this process (None where the backend does not say: CPU)."""
    import jax

    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def run_sweep(args, pair, rows: list[dict], rows_path: str, t_start: float, write_outputs) -> None:
    target, drafter, tokenizer = pair
    done = {config_key(r) for r in rows}
    last_config_s = 0.0
    with open(rows_path, "a") as f:
        def write_row(row):
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

        for n in args.requests:
            todo = []
            for mode in args.modes:
                loops = [lp for lp in args.loops if config_key(this_row(args, n, mode, lp)) not in done]
                if not loops:
                    print(f"bench_e2e: n={n} {mode}: recorded already, skipped", flush=True)
                    continue
                missing = [key for key in mode_settings(mode, args.k) if key not in (
                    "verification", "num_speculative_tokens") and not engine_accepts(key)]
                if missing:
                    print(f"bench_e2e: n={n} {mode}: skipped: this Engine has no {', '.join(missing)} argument",
                          flush=True)
                    continue
                todo.append((mode, loops))
            # what runs as one configuration: each mode, or (--interleave) all of them together
            if args.interleave and todo:
                units = [(" ".join(m for m, _ in todo) + " interleaved",
                          lambda: run_interleaved(args, pair, n, todo, rows, write_row))]
            else:
                units = [(mode, lambda mode=mode, loops=loops: run_config(args, target, drafter, tokenizer, n, mode,
                                                                          loops, rows, write_row))
                         for mode, loops in todo]
            for label, run in units:
                elapsed = time.perf_counter() - t_start
                if args.time_budget_s is not None and elapsed + last_config_s > args.time_budget_s:
                    print(f"bench_e2e: time budget: {elapsed:.0f} s elapsed + {last_config_s:.0f} s for the last "
                          f"configuration > {args.time_budget_s:.0f} s; stopping before n={n} {label}", flush=True)
                    return
                c0 = time.perf_counter()
                run()
                last_config_s = time.perf_counter() - c0
                print(f"bench_e2e: n={n} {label}: configuration took {last_config_s:.1f} s", flush=True)
                write_outputs()


def run_interleaved(args, pair, n: int, group: list[tuple[str, list[str]]], rows: list[dict], write_row) -> None:
    """``--interleave``: every mode of ``group`` builds and warms up its engine (all alive at once); each engine
    then makes one more untimed call (the settling round: on an H100 an engine's first call after the others were
    built ran 14-65 ms slower, more the more loop branches it has, and ``none`` not at all, session 28); then the
    timed sets run in rounds, set ``i`` of every mode in round ``i``, the modes' order rotated by one each round,
    so that a drift of the machine (clocks, another tenant) falls on every mode alike. The rows are written at the
    end, ``none`` first (the others' ``match_none`` reads it)."""
    target, drafter, tokenizer = pair
    engines: dict = {}  # modes that differ only in a plan interval share one (config_steps)
    steps = [(mode, config_steps(args, target, drafter, tokenizer, n, mode, loops, rows, write_row, settle=True,
                                 engines=engines)) for mode, loops in group]
    for _, gen in steps:
        next(gen)  # build, warm up, the warm-up call
    for _, gen in steps:
        next(gen)  # the settling call, once every engine exists
    for i in range(args.timed_sets):
        k = i % len(steps)
        for _, gen in steps[k:] + steps[:k]:
            next(gen, None)  # one timed set (a mode whose sets ran out writes its row)
    for _, gen in sorted(steps, key=lambda s: s[0] != "none"):
        for _ in gen:
            pass
    engines.clear()


# Named emulated-acceptance profiles: the unconditional rates P(the first k drafts are accepted), k = 1..7.
ACCEPTANCE_PROFILES = {
    # observed for the embedded default's drafter on 64 held-out code windows (greedy, full verification, 2,409
    # verify steps: docs/BENCHMARKS.md "Reliability of the confidence head", calibration_default_cpu_f32.json)
    "default": (0.8796, 0.5832, 0.3831, 0.2399, 0.1706, 0.1017, 0.0722),
    # flatter: every draft survives its predecessor with probability 0.57 (acceptance length 2.30, what the
    # seed's run at concurrency 512 saw)
    "flat": tuple(round(0.57 ** k, 4) for k in range(1, 8)),
}


def load_pair(args):
    """The embedded default, or (``--model m3-slice``) a few MiniMax-M3 layers at the real widths with random
    weights and a DSpark drafter at M3 width (``--m3-tiny``: the same structure at test widths), with the default's
    tokenizer for the prompts (emulated acceptance makes their content irrelevant to the drafts' fate)."""
    import jax.numpy as jnp

    from minimax_jax.default import load_default

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    target, drafter, tokenizer = load_default(dtype=dtype)
    if args.model == "default":
        return target, drafter, tokenizer
    from minimax_jax import MiniMaxM3Config
    from minimax_jax.config import DENSE_MLP, FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION
    from minimax_jax.drafter import init_drafter
    from minimax_jax.drafter_config import DSparkConfig
    from minimax_jax.model import init_model

    n = args.m3_layers
    kinds = dict(num_hidden_layers=n, layer_types=(FULL_ATTENTION,) + (SPARSE_ATTENTION,) * (n - 1),
                 mlp_layer_types=(DENSE_MLP,) + (MOE_MLP,) * (n - 1))
    vocab = max(target.cfg.vocab_size, 512)
    kinds["balanced_routing"] = bool(args.balanced_routing)
    if args.m3_tiny:
        cfg = MiniMaxM3Config.tiny(vocab_size=vocab, **kinds)
    else:
        cfg = MiniMaxM3Config.m3().replace(**kinds)
    m3 = init_model(cfg, dtype=dtype, seed=0)
    dcfg = DSparkConfig.for_target(cfg, mask_token_id=cfg.vocab_size - 1, block_size=7, num_draft_layers=1,
                                   target_layer_ids=tuple(range(min(3, n))), markov_rank=64 if not args.m3_tiny else 8,
                                   markov_head_type="gated", enable_confidence_head=True,
                                   confidence_head_with_markov=True)
    return m3, init_drafter(dcfg, m3, dtype=dtype, seed=1), tokenizer


# ----------------------------------------------------------------------------------------------- calibration
def reliability_bins(pred: np.ndarray, target: np.ndarray, num_bins: int = NUM_BINS) -> dict:
    """Per bin (the binning of ``minimax_jax.calibration.expected_calibration_error``): count, mean prediction,
    observed frequency (None for an empty bin)."""
    p = np.clip(np.asarray(pred, np.float64), 1e-8, 1 - 1e-8)
    b = np.minimum((p * num_bins).astype(np.int64), num_bins - 1)
    counts = np.bincount(b, minlength=num_bins)
    sp = np.bincount(b, weights=p, minlength=num_bins)
    st = np.bincount(b, weights=np.asarray(target, np.float64), minlength=num_bins)
    safe = np.maximum(counts, 1)
    return {"edges": np.linspace(0, 1, num_bins + 1).tolist(), "count": counts.tolist(),
            "mean_predicted": [float(x) if c else None for x, c in zip(sp / safe, counts)],
            "observed": [float(x) if c else None for x, c in zip(st / safe, counts)]}


def run_calibration(args, target, drafter, tokenizer) -> dict:
    from minimax_jax.calibration import acceptance_labels, apply_sts, expected_calibration_error
    from scripts.workloads import heldout_windows
    from spec_decode.rollout import batched_rollout, ece_report

    if drafter.confidence_head is None:
        raise SystemExit("bench_e2e: --calibration needs a drafter with a confidence head")
    kk = drafter.cfg.block_size
    temps = drafter.cfg.sts_temperatures
    prompts = heldout_windows(tokenizer, args.calibration_prompts, args.calibration_prompt_len,
                              offset=args.calibration_offset, bos=tokenizer.bos_token_id)
    t0 = time.perf_counter()
    res = batched_rollout(target, drafter, prompts, rows=min(args.calibration_rows, len(prompts)), num_verify=kk,
                          temperature=0.0, max_new_tokens=args.calibration_new_tokens)
    seconds = time.perf_counter() - t0
    conf = np.clip(np.asarray(apply_sts(res.confidence_logits[:, :kk], temps), np.float64), 0.0, 1.0)
    surv = np.cumprod(conf, axis=1)  # what the allocator ranks drafts by
    labels, observed = acceptance_labels(res.num_accepted, res.num_verified, kk)
    per_pos = []
    for k in range(kk):
        obs = observed[:, k]
        pred, tgt = surv[obs, k], labels[obs, k].astype(np.float64)
        per_pos.append({"k": k + 1, "count": int(obs.sum()),
                        "mean_predicted": float(pred.mean()) if pred.size else None,
                        "observed": float(tgt.mean()) if tgt.size else None,
                        "ece": expected_calibration_error(pred, tgt, num_bins=NUM_BINS),
                        "bins": reliability_bins(pred, tgt)})
    summary = res.summary()
    out = {"prompts": len(prompts), "prompt_len": args.calibration_prompt_len,
           "max_new_tokens": args.calibration_new_tokens, "K": kk, "num_verify": kk, "temperature": 0.0,
           "sts_temperatures": list(temps) if temps is not None else None, "records": res.steps,
           "acceptance_length": summary["acceptance_length"], "rollout_s": seconds, "num_bins": NUM_BINS,
           "mean_predicted": [p["mean_predicted"] for p in per_pos], "observed": [p["observed"] for p in per_pos],
           "ece": [p["ece"] for p in per_pos], "ece_check": ece_report(res, temps),
           "ece_uncalibrated": ece_report(res, None), "count": [p["count"] for p in per_pos],
           "per_position": per_pos}
    return clean(out)


def plot_reliability(cal: dict, path: str) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    fig, (ax, hx) = plt.subplots(2, 1, figsize=(6.5, 8), gridspec_kw={"height_ratios": [3, 1.3]}, sharex=True)
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    cmap = plt.get_cmap("viridis")
    kk = len(cal["per_position"])
    centers = (np.arange(cal["num_bins"]) + 0.5) / cal["num_bins"]
    width = 1.0 / cal["num_bins"] / max(kk, 1)
    for i, p in enumerate(cal["per_position"]):
        b = p["bins"]
        keep = [j for j, c in enumerate(b["count"]) if c]
        color = cmap(i / max(kk - 1, 1))
        ece = p["ece"]
        ax.plot([b["mean_predicted"][j] for j in keep], [b["observed"][j] for j in keep], "o-", ms=3, color=color,
                label=f"k={p['k']} (ECE {ece:.3f})" if ece is not None else f"k={p['k']}")
        hx.bar(centers - 0.5 / cal["num_bins"] + (i + 0.5) * width, b["count"], width=width, color=color)
    ax.set_ylabel("observed: first k drafts all accepted")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(f"confidence head on held-out code: {cal['prompts']} prompts x {cal['max_new_tokens']} tokens, "
                 f"{cal['records']} steps", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    hx.set_yscale("log")
    hx.set_xlabel("predicted survival prod_{i<=k} c_i (calibrated)")
    hx.set_ylabel("count")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------- reports
def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_e2e: matplotlib is not installed: no plots (re-draw later with --plot-only)", file=sys.stderr)
        return None
    return plt


def _loops(rows: list[dict]) -> list[str]:
    seen = {r["loop"] for r in rows}
    return [lp for lp in ("host", "device") if lp in seen] + sorted(lp for lp in seen if lp not in ("host", "device"))


def _latest(rows: list[dict]) -> dict:
    """(loop, mode, n) -> the last row recorded for it."""
    out = {}
    for r in rows:
        out[(r["loop"], r["mode"], r["n"])] = r
    return out


def ratio_rows(rows: list[dict], metric: str = "output_tokens_per_s") -> list[dict]:
    """Per (loop, n): the best baseline (none, fixed1..7) and each adaptive mode's ratio to it and to fixed7, on
    ``metric`` (a row's whole-call tokens/s, or ``decode_loop_tokens_per_s``: the device loop's own, without the
    prefill waves and the host, where the whole call's varies by 10-20% between runs at 256-512 requests). Rows
    without the metric are left out.

    ``{mode}/same_tokens``: the share of requests whose tokens equal the best baseline's (first timed set; None
    without digests). In bf16 a near-tie can flip a token between modes; a request's continuation then differs,
    and with it the number of iterations the closed batch needs, so below 1.0 the ratio also compares different
    text (docs/BENCHMARKS.md, session 26).

    ``{mode}/best_median_set`` (decode-loop metric): the median over the timed sets of the best baseline's
    milliseconds per loop iteration over the mode's, set by set, on the sets where both ran the same number of
    iterations (:func:`median_set_ratio`). A set now and then runs 20-40% slow for one mode alone, which moves the
    pooled ratio by several percent on a handful of sets (docs/BENCHMARKS.md, session 37); the median does not
    follow it."""
    table = {key: r for key, r in _latest(rows).items() if r.get(metric)}
    out = []
    for loop in _loops(rows):
        for n in sorted({r["n"] for r in rows if r["loop"] == loop}):
            base = {m: table[(loop, m, n)][metric] for m in BASELINES if (loop, m, n) in table}
            if not base:
                continue
            best = max(base, key=base.get)
            entry = {"loop": loop, "n": n, "best_baseline": best, "best_tokens_per_s": base[best]}
            for m in adaptive_modes(rows):
                if (loop, m, n) in table:
                    row = table[(loop, m, n)]
                    entry[f"{m}/best"] = row[metric] / base[best]
                    entry[f"{m}/fixed7"] = row[metric] / base["fixed7"] if "fixed7" in base else None
                    entry[f"{m}/same_tokens"] = matches(table[(loop, best, n)].get("token_digests"),
                                                        row.get("token_digests"))
                    if metric == "decode_loop_tokens_per_s":
                        entry[f"{m}/best_median_set"] = median_set_ratio(row, table[(loop, best, n)])
            out.append(entry)
    return out


def median_set_ratio(row: dict, base: dict) -> float | None:
    """The median over timed sets ``i`` of ``base``'s milliseconds per loop iteration in set ``i`` over ``row``'s
    (above 1: ``row`` is faster), on the sets where both ran the same number of iterations (the same text decoded
    to the same length; the interleaved modes time set ``i`` in the same round). None without such sets."""
    ms, base_ms = row.get("per_set_ms_per_loop_iteration"), base.get("per_set_ms_per_loop_iteration")
    steps, base_steps = row.get("per_set_verify_steps"), base.get("per_set_verify_steps")
    if not (ms and base_ms and steps and base_steps):
        return None
    ratios = [b / a for a, b, i, j in zip(ms, base_ms, steps, base_steps) if i == j and a and b]
    return float(np.median(ratios)) if ratios else None


def markdown(rows: list[dict]) -> str:
    table = _latest(rows)
    modes = [m for m in ALL_MODES if any(r["mode"] == m for r in rows)]
    modes += sorted({r["mode"] for r in rows} - set(modes))
    lines = []
    for loop in _loops(rows):
        ns = sorted({r["n"] for r in rows if r["loop"] == loop})
        lines += [f"### output tokens/s, {loop} loop", "", "| requests | " + " | ".join(modes) + " |",
                  "|---" * (len(modes) + 1) + "|"]
        for n in ns:
            cells = [f"{table[(loop, m, n)]['output_tokens_per_s']:,.0f}" if (loop, m, n) in table else "-"
                     for m in modes]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    for metric, title in (("output_tokens_per_s", "whole call"), ("decode_loop_tokens_per_s", "decode loop only")):
        ratios = ratio_rows(rows, metric)
        if not ratios:
            continue
        present = [m for m in adaptive_modes(rows) if any(f"{m}/best" in e for e in ratios)]
        cols = [f"{m}/best" for m in present] + [f"{m}/fixed7" for m in present]
        same = [f"{m}/same_tokens" for m in present]
        median = [f"{m}/best_median_set" for m in present if any(e.get(f"{m}/best_median_set") for e in ratios)]
        lines += [f"### adaptive / best of none, fixed1..7 (target >= 0.98) and / fixed7 (target >= 1.05), {title}",
                  "", "| loop | requests | best baseline | its tokens/s | " + " | ".join(cols) + " | "
                  + " | ".join(f"{m}: tokens as best's" for m in present)
                  + "".join(f" | {c.split('/')[0]}/best, median set" for c in median) + " |",
                  "|---" * (len(cols) + len(same) + len(median) + 4) + "|"]
        for e in ratios:
            cells = [f"{e[c]:.3f}" if e.get(c) is not None else "-" for c in cols + same + median]
            lines.append(f"| {e['loop']} | {e['n']} | {e['best_baseline']} | {e['best_tokens_per_s']:,.0f} | "
                         + " | ".join(cells) + " |")
        lines += ["", "(tokens as best's: the share of requests whose tokens equal the best baseline's; below 1.000, "
                  "bf16 near-ties made the two decode different text, and the ratio compares different work)", ""]
    return "\n".join(lines)


def _mode_color(plt, mode: str):
    if mode == "none":
        return "k"
    if mode in ADAPTIVE:
        return f"C{1 + ADAPTIVE.index(mode)}"
    if mode.startswith("fixed") and mode[5:].isdigit():
        return plt.get_cmap("Blues")(0.3 + 0.7 * int(mode[5:]) / 7)
    return "grey"


def plot_sweep(rows: list[dict], out_dir: str) -> bool:
    plt = _pyplot()
    if plt is None or not rows:
        return False
    table = _latest(rows)
    loops = _loops(rows)
    adaptive = adaptive_modes(rows)
    modes = [m for m in ALL_MODES if any(r["mode"] == m for r in rows)] + [m for m in adaptive if m not in ALL_MODES]
    fig, axes = plt.subplots(1, len(loops), figsize=(6.5 * len(loops), 4.8), squeeze=False)
    for ax, loop in zip(axes[0], loops):
        for m in modes:
            pts = sorted((n, r["output_tokens_per_s"]) for (lp, mm, n), r in table.items() if lp == loop and mm == m)
            if pts:
                style = "-" if m in adaptive else ("--" if m == "none" else ":")
                ax.plot(*zip(*pts), style, marker="o", ms=3, color=_mode_color(plt, m),
                        lw=2 if m in adaptive else 1, label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{loop} loop")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "tokens_per_s.png"), dpi=120)
    plt.close(fig)

    ratios = ratio_rows(rows)
    fig, axes = plt.subplots(1, len(loops), figsize=(6.5 * len(loops), 4.5), squeeze=False)
    for ax, loop in zip(axes[0], loops):
        entries = [e for e in ratios if e["loop"] == loop]
        for i, m in enumerate(adaptive_modes(rows)):
            for suffix, style in (("best", "-"), ("fixed7", "--")):
                pts = [(e["n"], e[f"{m}/{suffix}"]) for e in entries if e.get(f"{m}/{suffix}") is not None]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", ms=3, color=f"C{i}", label=f"{m} / {suffix}")
        ax.axhline(0.98, color="k", lw=0.8, ls=":", label="0.98 (vs best)")
        ax.axhline(1.05, color="r", lw=0.8, ls=":", label="1.05 (vs fixed7)")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("tokens/s ratio")
        ax.set_title(f"{loop} loop: adaptive / best of none, fixed1..7")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "adaptive_ratio.png"), dpi=120)
    plt.close(fig)
    return True


def write_reports(rows: list[dict], out_dir: str, info: dict | None, *, quiet: bool = False) -> None:
    if info is not None:
        with open(os.path.join(out_dir, JSON_FILE), "w") as f:
            json.dump({"meta": info, "rows": rows}, f, indent=1)
    md = markdown(rows)
    with open(os.path.join(out_dir, MD_FILE), "w") as f:
        f.write(md + "\n")
    if not quiet:
        print(md, flush=True)
    plot_sweep(rows, out_dir)


def meta(args) -> dict:
    from scripts.bench_engine import meta as engine_meta

    info = engine_meta(args)
    info["argv"] = sys.argv[1:]
    return info


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output directory (required unless --plot-only)")
    ap.add_argument("--requests", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256, 512])
    ap.add_argument("--modes", nargs="+", default=list(ALL_MODES))
    ap.add_argument("--loops", nargs="+", default=["host", "device"],
                    help="host, device, or host@M: the host loop with M decode steps per launch (a row of its own)")
    ap.add_argument("--k", type=int, default=7, help="K of the adaptive modes")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="prefill tokens per step (2048: the prefill launches do not swamp the decode in the wall)")
    ap.add_argument("--min-token-bucket", type=int, default=8)
    ap.add_argument("--implementation", default="auto", help="Engine(implementation=...): auto, pallas, reference")
    ap.add_argument("--prefix-caching", action="store_true", help="keep the prefix cache on (off by default)")
    ap.add_argument("--warm-requests", type=int, default=None,
                    help="prompts in the warm-up call (default: the requests; training-split windows)")
    ap.add_argument("--timed-sets", type=int, default=3,
                    help="distinct prompt sets timed per configuration (tokens and wall summed; the first set's "
                         "tokens are compared across modes)")
    ap.add_argument("--model", choices=["default", "m3-slice"], default="default",
                    help="the embedded default, or a few MiniMax-M3 layers at full width with random weights "
                         "(use with --synthetic-acceptance-*)")
    ap.add_argument("--m3-layers", type=int, default=4, help="m3-slice: layers (1 dense full-attention, the rest "
                                                             "MSA + MoE)")
    ap.add_argument("--m3-tiny", action="store_true", help="m3-slice at test widths (CPU)")
    ap.add_argument("--balanced-routing", action="store_true",
                    help="m3-slice: route tokens to experts round-robin with equal weights (MiniMaxM3Config."
                         "balanced_routing), the expert load of a trained router instead of random weights")
    ap.add_argument("--synthetic-acceptance-length", type=float, default=None,
                    help="emulated acceptance (Engine(synthetic_acceptance_length=...)): tokens per step, bonus "
                         "included; fixed K < 7 takes the first K of the 7 rates")
    ap.add_argument("--synthetic-acceptance-rates", type=float, nargs="+", default=None,
                    help="emulated acceptance: 7 unconditional rates P(the first k drafts are accepted)")
    ap.add_argument("--synthetic-acceptance-profile", choices=sorted(ACCEPTANCE_PROFILES), default=None,
                    help="emulated acceptance from a named profile: 'default' (the embedded default's drafter on "
                         "held-out code, acceptance length 3.43), 'flat' (a conditional rate of 0.57 everywhere, "
                         "length 2.30)")
    ap.add_argument("--synthetic-confidence-noise", type=float, default=0.0)
    ap.add_argument("--workload", choices=["heldout", "published"], default="heldout",
                    help="'published': the seed's workload, 550-token prompts whose first 200 tokens every "
                         "request shares (prefix caching on), 150 new tokens (sets --prompt-len, --shared-prefix, "
                         "--max-new-tokens)")
    ap.add_argument("--tensor-parallel-size", type=int, default=None,
                    help="run on a mesh of this many devices (1: the sharded code on one device); default: no mesh")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens every prompt shares (prefix caching on); the published workload: 200 of 550")
    ap.add_argument("--sampling", action="store_true",
                    help="compile the sampling programs too (the sweep is greedy: Engine(sampling=False) by default)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample every request at this temperature (seeded; the sampling programs and loop run)")
    ap.add_argument("--draft-length-buckets", type=int, default=2,
                    help="Engine(draft_length_buckets=...): the packed-token sizes each draft length below K compiles")
    ap.add_argument("--interleave", action="store_true",
                    help="build every mode's engine of a concurrency first (all alive at once), make one untimed "
                         "settling call on each, then run their timed sets in rounds, the modes' order rotated each "
                         "round (one loop only); modes that differ only in a plan interval >= 2 (+piN) share one "
                         "engine, each calling it at its own interval")
    ap.add_argument("--plan-interval", type=int, default=None,
                    help="Engine(device_loop_plan_interval=...): device-loop iterations per plan, every mode (default: "
                         "the Engine's; rows before session 27 planned every iteration)")
    ap.add_argument("--sampling-loop-buckets", type=int, default=1,
                    help="Engine(device_loop_sampling_token_buckets=...): the sampling device loop's verify sizes "
                         "per draft length")
    ap.add_argument("--decode-steps-per-launch", type=int, default=16,
                    help="the host loop's multi-step launches (Engine(decode_steps_per_launch=...)); 1: off")
    ap.add_argument("--launch-timeline", action="store_true",
                    help="host-loop rows carry each launch's times (Engine.record_launches): launch_timeline")
    ap.add_argument("--trace-loop", action="store_true",
                    help="device loop: trace one more call and record the loop's kernels and time per iteration "
                         "by scope (row field loop_profile)")
    ap.add_argument("--dump-loop-hlo", action="store_true",
                    help="write the greedy device loop's optimized HLO to OUT/hlo/ and record what its while body "
                         "and branches launch and copy (scripts/hlo_report.py; row field loop_hlo)")
    ap.add_argument("--time-budget-s", type=float, default=None)
    ap.add_argument("--resume", default=None, help="rows to resume from (default: OUT/bench_e2e.jsonl if present)")
    ap.add_argument("--fresh", action="store_true", help="start a new OUT/bench_e2e.jsonl (ignore recorded rows)")
    ap.add_argument("--plot-only", default=None, metavar="ROWS.jsonl", help="tables and plots from recorded rows")
    ap.add_argument("--calibration", action="store_true", help="also the reliability evaluation")
    ap.add_argument("--calibration-prompts", type=int, default=64)
    ap.add_argument("--calibration-prompt-len", type=int, default=None, help="default: --prompt-len")
    ap.add_argument("--calibration-new-tokens", type=int, default=128)
    ap.add_argument("--calibration-rows", type=int, default=64, help="rollout batch (one compiled shape)")
    ap.add_argument("--calibration-offset", type=int, default=0, help="held-out windows skipped first")
    args = ap.parse_args(argv)
    if args.plot_only is None and not args.out:
        ap.error("--out is required (or --plot-only ROWS.jsonl)")
    if args.warm_requests is not None and args.warm_requests < 1:
        ap.error(f"--warm-requests must be at least 1, got {args.warm_requests}")
    for lp in args.loops:
        loop_and_steps(lp, args)
    for m in args.modes:
        try:
            mode_settings(m, args.k)
        except ValueError as e:
            ap.error(str(e))
    if args.calibration_prompt_len is None:
        args.calibration_prompt_len = args.prompt_len
    if args.interleave and len(args.loops) != 1:
        ap.error(f"--interleave takes one loop, got --loops {' '.join(args.loops)}")
    if args.plan_interval is None:
        from spec_decode.engine import DEVICE_LOOP_PLAN_INTERVAL

        args.plan_interval = DEVICE_LOOP_PLAN_INTERVAL
    elif args.plan_interval < 1:
        ap.error(f"--plan-interval must be at least 1, got {args.plan_interval}")
    if args.workload == "published":
        args.prompt_len, args.shared_prefix, args.max_new_tokens = 550, 200, 150
    named = args.synthetic_acceptance_profile
    if named is not None:
        if args.synthetic_acceptance_length is not None or args.synthetic_acceptance_rates is not None:
            ap.error("give one of --synthetic-acceptance-profile, -length, -rates")
        args.synthetic_acceptance_rates = list(ACCEPTANCE_PROFILES[named][:args.k])
    args.synthetic_rates = None
    if args.synthetic_acceptance_length is not None or args.synthetic_acceptance_rates is not None:
        from spec_decode.synthetic import acceptance_rates

        try:
            args.synthetic_rates = acceptance_rates(args.k, rates=args.synthetic_acceptance_rates,
                                                    length=args.synthetic_acceptance_length)
        except ValueError as e:
            ap.error(str(e))
    if args.model == "m3-slice" and args.synthetic_rates is None:
        ap.error("--model m3-slice has random weights: give --synthetic-acceptance-length or -rates")
    return args



def loop_profile(eng, prompts, kw) -> dict:
    """One more device-loop ``generate`` of ``prompts`` under the profiler (nothing compiles: the timed calls ran
    these programs): the loop program's kernels per iteration, attributed to the loop's scopes (``plan``: the
    device planner; ``step/...``: the step's phases, ``step/draft/allocate`` the per-request split), and the
    loop's span against its busy time (the gap: device idle inside the loop, the host driving the while loop and
    its switch). Milliseconds and kernels per loop iteration."""
    from scripts import op_trace

    program = eng._loop_programs.get((False, None))
    if program is None or not hasattr(program, "as_text"):
        return {"error": "no greedy loop program with HLO text"}
    text = program.as_text()
    box = {}

    def run():
        box["res"] = eng.generate(prompts, loop="device", **kw)
        return 0

    try:
        events, platform = op_trace.trace(run, op_trace.module_name(text))
        times = op_trace.attribute(events, op_trace.hlo_scopes(text), calls=1, platform=platform)
    except Exception as e:  # noqa: BLE001  (profiling is optional: keep the timed rows)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    iters = max(len(box["res"].stats.get("draft_length_per_step") or []), 1)

    def group(scope):
        depth = 3 if scope[:3] == ("step", "draft", "allocate") else 2 if scope[:1] == ("step",) else 1
        return "/".join(scope[:depth])

    ms, kernels = collections.defaultdict(float), collections.defaultdict(float)
    for scope, sec in times.scopes.items():
        ms[group(scope)] += 1e3 * sec / iters
    for scope, cnt in times.kernels.items():
        kernels[group(scope)] += cnt / iters
    return {"platform": platform, "iterations": iters, "span_ms_per_iteration": 1e3 * times.span_s / iters,
            "busy_ms_per_iteration": 1e3 * times.busy_s / iters,
            "idle_ms_per_iteration": 1e3 * (times.span_s - times.busy_s) / iters,
            "kernels_per_iteration": times.events_per_run / iters,
            "scope_ms_per_iteration": dict(sorted(ms.items(), key=lambda kv: -kv[1])),
            "scope_kernels_per_iteration": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
            "unattributed_ops_ms_per_iteration": {op: 1e3 * sec / iters for op, sec in times.unattributed_ops.items()},
            "decode_loop_s": box["res"].stats.get("device_time_s"),
            "example_events": [[e.op, e.name[:80]] for e in events[:8]]}


def _loop_tokens_per_s(runs, n: int) -> float | None:
    """Tokens the device loop emitted per second of the loop (None for host-loop runs)."""
    loop_s = [r.stats.get("device_time_s") for r in runs]
    if any(x is None for x in loop_s) or not sum(loop_s):
        return None
    return sum(r.stats["output_tokens"] - n for r in runs) / sum(loop_s)

def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot_only is not None:
        out_dir = args.out or os.path.dirname(os.path.abspath(args.plot_only))
        os.makedirs(out_dir, exist_ok=True)
        write_reports(load_rows(args.plot_only), out_dir, None)
        return
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    rows_path = os.path.join(args.out, ROWS_FILE)
    if args.fresh and os.path.exists(rows_path):
        os.remove(rows_path)
    rows = load_rows(rows_path)
    if args.resume and os.path.abspath(args.resume) != os.path.abspath(rows_path):
        extra = load_rows(args.resume)
        with open(rows_path, "a") as f:  # the resumed rows join this directory's file
            for r in extra:
                f.write(json.dumps(r) + "\n")
        rows += extra
    if rows:
        print(f"bench_e2e: resuming: {len(rows)} rows recorded", flush=True)
    info = meta(args)

    def write_outputs():
        write_reports(rows, args.out, info, quiet=True)

    pair = load_pair(args)
    if args.requests and args.modes:
        run_sweep(args, pair, rows, rows_path, t_start, write_outputs)
    if args.calibration:
        cal = run_calibration(args, *pair)
        with open(os.path.join(args.out, "calibration.json"), "w") as f:
            json.dump({"meta": info, **cal}, f, indent=1)
        plot_reliability(cal, os.path.join(args.out, "reliability.png"))
        print("bench_e2e: calibration: " + json.dumps({key: cal[key] for key in (
            "records", "acceptance_length", "mean_predicted", "observed", "ece", "ece_uncalibrated")}), flush=True)
    write_reports(rows, args.out, info)
    print(f"bench_e2e: done in {time.perf_counter() - t_start:.1f} s; rows in {rows_path}", flush=True)


if __name__ == "__main__":
    main()
