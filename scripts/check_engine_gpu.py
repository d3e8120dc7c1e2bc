"""Greedy engine outputs on a GPU (compiled kernels): adaptive and fixed speculation == plain decoding ("none"),
in the host loop and in the device loop.

    PYTHONPATH=. python3 scripts/check_engine_gpu.py [--n 8] [--max-new-tokens 64] [--loops host device]

Runs the embedded default through the engine in the three modes (and each loop) on held-out prompts and reports
whether the token ids agree with the host loop's plain decoding. bf16 weights: a near-tie between two logits can flip an argmax between differently batched
programs, so a disagreement is reported with the first position where it happens rather than treated as a crash.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax.numpy as jnp


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    ap.add_argument("--loops", nargs="+", choices=["host", "device"], default=["host"])
    args = ap.parse_args()
    from minimax_jax.default import load_default, load_prompts
    from spec_decode import Engine

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    target, drafter, tok = load_default(dtype=dtype)
    prompts = load_prompts()[: args.n]
    outs = {}
    for mode in ("none", "fixed", "adaptive"):
        eng = Engine(target, drafter, verification=mode, max_num_seqs=4, max_model_len=1024, tokenizer=tok)
        for loop in args.loops:
            res = eng.generate(prompts, max_new_tokens=args.max_new_tokens, progress=False, loop=loop)
            outs[mode, loop] = [r.token_ids for r in res]
            print(mode, loop, eng.implementation, json.dumps({k: v for k, v in res.stats.items() if k not in
                                                              ("verified_drafts_per_step", "budget_per_step")}))
    ok = True
    ref = outs["none", args.loops[0]]
    for (mode, loop), got in outs.items():
        for i, (a, b) in enumerate(zip(got, ref)):
            if a != b:
                ok = False
                first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                print(f"{mode} ({loop} loop): prompt {i} differs from 'none' ({args.loops[0]} loop) at token {first}")
    print("greedy outputs identical across modes and loops" if ok else "DIFFERENCES (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
