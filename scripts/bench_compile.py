"""Where the engine's cold start goes: each program of the closed set lowered, then compiled alone, under several
sets of XLA options, and what its module holds.

    PYTHONPATH=. python3 scripts/bench_compile.py --out DIR [--slots 256] [--programs loop step-top step-small]
        [--options default parallel] [--implementation auto] [--draft-lengths 0,3,7]

The engine is the adaptive K = 7 default at ``--slots`` slots (bf16), with the compilation cache and the executable
store off, so every compile is a real one. Each selected program is lowered once (``lower_s``: tracing and
lowering), then compiled once per option set, one after another (no other compile contends: the start-up bench
compiles 39 programs on 16 threads at once). Option sets (``Lowered.compile(compiler_options=...)``):

* ``default``: XLA's defaults;
* ``parallel`` / ``serial``: the LLVM module split across 16 compile threads, or compiled on one
  (``xla_gpu_force_compilation_parallelism``);
* ``no-autotune``: ``xla_gpu_autotune_level=0``.

A lowered program compiled again with the same options comes from JAX's in-memory cache, so each option set
compiles once; XLA's own in-process caches (autotuning results among them) may still favour the later sets. Each row also counts, in the
lowered module, the Pallas (Triton) kernel calls and how many distinct kernels they are (XLA compiles each distinct
one once per module), and times a serialize / deserialize-and-load round trip of the executable (what a warm
start from the executable store pays per program).

``--implementation reference`` builds the engine on the plain-jnp kernels (no Pallas kernel in any module): the
difference to ``auto`` is what compiling the Triton kernels costs.

Programs: ``loop`` (the greedy device loop), ``loop-sampling``, ``step-top`` (the largest greedy step),
``step-small`` (the smallest sampling step), or any ``StepKey`` repr printed by the start-up bench.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

os.environ.setdefault("MINIMAX_JAX_COMPILATION_CACHE", "0")  # every compile a real one

import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.bench_common import draft_lengths_arg, refuse_lengths_above_k  # noqa: E402

OPTIONS = {
    "default": {},
    "parallel": {"xla_gpu_force_compilation_parallelism": 16},
    "serial": {"xla_gpu_force_compilation_parallelism": 1},
    "no-autotune": {"xla_gpu_autotune_level": 0},
}
_SSA = re.compile(r"%[\w#:.]+")
_STEP_KEY = re.compile(r"StepKey\(tokens=(?P<tokens>\d+), logit_rows=(?P<rows>\d+), sampling=(?P<sampling>True|False), "
                       r"draft_len=(?P<draft>-?\d+)\)")


def program_names(engine, wanted: list[str]) -> list:
    """The programs ``wanted`` names (the module docstring's names, or ``StepKey`` reprs) of ``engine``."""
    greedy = sorted(k for k in engine.step_keys if not k.sampling)
    sampling = sorted(k for k in engine.step_keys if k.sampling)
    named = {"loop": ("loop", False, None), "loop-sampling": ("loop", True, None), "step-top": greedy[-1],
             "step-small": sampling[0] if sampling else greedy[0]}
    return [named[w] if w in named else parse_step_key(w) for w in wanted]


def parse_step_key(text: str):
    """A ``StepKey`` from its repr (as the start-up bench's ``slowest_compiles`` print them)."""
    from spec_decode.buckets import StepKey

    m = _STEP_KEY.fullmatch(text.strip())
    if m is None:
        raise SystemExit(f"bench_compile: not a program name or a StepKey repr: {text!r}")
    return StepKey(int(m["tokens"]), int(m["rows"]), m["sampling"] == "True", int(m["draft"]))


def module_stats(text: str) -> dict:
    """Pallas kernel calls in a lowered (StableHLO) module, and how many distinct kernels they are."""
    calls = [_SSA.sub("%", line.strip()) for line in text.splitlines() if "@__gpu$xla.gpu.triton" in line]
    return {"triton_calls": len(calls), "triton_distinct": len(set(calls)), "module_chars": len(text)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--implementation", default="auto", choices=("auto", "pallas", "reference"))
    ap.add_argument("--programs", nargs="+", default=["loop", "step-top", "step-small"])
    ap.add_argument("--sampling-loop-buckets", type=int, default=1,
                    help="Engine(device_loop_sampling_token_buckets=...): the sampling loop's sizes per draft length")
    ap.add_argument("--options", nargs="+", default=["default", "parallel"], choices=sorted(OPTIONS))
    ap.add_argument("--draft-lengths", type=draft_lengths_arg, default=None, metavar="D1,D2,...",
                    help="Engine(draft_lengths=...) (default: 0,3,K): the loops' branches follow them")
    args = ap.parse_args()
    refuse_lengths_above_k(ap, args.draft_lengths, args.k)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)

    from jax.experimental import serialize_executable

    from minimax_jax.default import load_default
    from spec_decode import Engine

    target, drafter, tokenizer = load_default(dtype=jnp.bfloat16)
    eng = Engine(target, drafter, num_speculative_tokens=args.k, verification="adaptive", max_num_seqs=args.slots,
                 max_model_len=args.max_model_len, tokenizer=tokenizer, compilation_cache=False,
                 implementation=args.implementation,
                 device_loop_sampling_token_buckets=args.sampling_loop_buckets, draft_lengths=args.draft_lengths)
    eng._state = eng._init_state()
    from scripts.bench_engine import meta as engine_meta

    rows = []
    meta = {**engine_meta(args), "xla_flags": os.environ.get("XLA_FLAGS", ""), "closed_set": len(eng.step_keys),
            "draft_lengths": list(eng.draft_lengths)}

    def save():
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)

    for name in program_names(eng, args.programs):
        t = time.perf_counter()
        low = eng._lowering(name)()
        row = {"program": str(name), "lower_s": round(time.perf_counter() - t, 3), **module_stats(low.as_text()),
               "compile_s": {}}
        if isinstance(name, tuple):  # a device loop: its lax.switch branches, a whole step per (length, bucket)
            row["branches"] = sum(len(b) for b in eng._loop_config_of(name[1]).token_buckets)
        exe = None
        for opt in args.options:
            t = time.perf_counter()
            exe = low.compile(compiler_options=OPTIONS[opt] or None)
            row["compile_s"][opt] = round(time.perf_counter() - t, 3)
            print(f"{name}: {opt} {row['compile_s'][opt]:.1f} s", file=sys.stderr, flush=True)
        t = time.perf_counter()
        payload = serialize_executable.serialize(exe)
        row["serialize_s"] = round(time.perf_counter() - t, 3)
        row["serialized_bytes"] = len(payload[0])
        t = time.perf_counter()
        serialize_executable.deserialize_and_load(*payload)
        row["load_s"] = round(time.perf_counter() - t, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()
    save()


if __name__ == "__main__":
    main()
