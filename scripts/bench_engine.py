"""Engine throughput and host overhead: steps/s, output tokens/s and host time per step at several concurrencies,
for the host loop (continuous batching) and the device loop (jitted offline batch decoding).

    PYTHONPATH=. python3 scripts/bench_engine.py --out DIR [--model default|random] [--requests 1 8 64]
        [--loops host device]

For each (verification mode, concurrency) it runs one warm-up generate call (compiles every bucket it meets),
then a timed one on fresh prompts, and records wall time, steps, output tokens, mean acceptance length and the
host time per step (scheduling, planning the budget, packing the plan, reading back the step's output and
bookkeeping: everything outside the device call). The device loop runs the same batch in one program; its
host time is planning the batch and reading back the outputs, spread over its steps; ``match`` is the fraction
of requests whose tokens equal the host loop's (greedy). ``--model random`` uses a small MiniMax-M3-shaped random pair
(acceptance is then near 0 for the speculative modes: the rows measure the machinery, not the speed-up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np


def random_pair(dtype):
    from minimax_jax import DSparkConfig, MiniMaxM3Config, init_drafter, init_model

    cfg = MiniMaxM3Config.tiny(
        vocab_size=4100, hidden_size=256, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=1,
        head_dim=32, rotary_dim=16, index_n_heads=1, index_head_dim=32, index_block_size=16, index_topk_blocks=4,
        intermediate_size=256, dense_intermediate_size=768, shared_intermediate_size=256, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=(2,))
    target = init_model(cfg, dtype=dtype, seed=0)
    dcfg = DSparkConfig.for_target(cfg, mask_token_id=3, block_size=7, num_draft_layers=1, target_layer_ids=(1, 3),
                                   markov_rank=32, markov_head_type="vanilla", enable_confidence_head=True,
                                   confidence_head_with_markov=True)
    return target, init_drafter(dcfg, target, seed=1), None


def prompts_for(n, vocab, length, seed, tokenizer=None):
    """``n`` prompts of ``length`` tokens: held-out code for the default model, random ids otherwise."""
    rng = np.random.default_rng(seed)
    if tokenizer is None:
        return [[1] + rng.integers(4, vocab, size=length - 1).tolist() for _ in range(n)]
    from minimax_jax.default import load_prompts

    texts = load_prompts()
    ids = [tokenizer.encode(t) for t in texts]
    order = rng.permutation(len(ids))
    out = []
    for i in range(n):
        p = ids[order[i % len(ids)]]
        reps = -(-length // max(len(p), 1))
        out.append((p * reps)[:length])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", choices=["default", "random"], default="default")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--modes", nargs="+", default=["none", "fixed", "adaptive"])
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--loops", nargs="+", choices=["host", "device"], default=["host"])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]

    from spec_decode import Engine

    if args.model == "default":
        from minimax_jax.default import load_default

        target, drafter, tokenizer = load_default(dtype=dtype)
    else:
        target, drafter, tokenizer = random_pair(dtype)
    vocab = target.cfg.vocab_size
    dev = jax.devices()[0]
    meta = {"device": f"{dev.platform}:{getattr(dev, 'device_kind', '?')}", "jax": jax.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "model": args.model,
            "args": vars(args)}
    rows = []
    for mode in args.modes:
        for n in args.requests:
            eng = Engine(target, drafter, num_speculative_tokens=args.k, verification=mode, max_num_seqs=n,
                         max_model_len=args.prompt_len + args.max_new_tokens + 16, tokenizer=tokenizer)
            kw = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True}
            prompts = prompts_for(n, vocab, args.prompt_len, 0, tokenizer)
            tokens = {}
            for loop in args.loops:
                extra = {"progress": False} if loop == "host" else {}
                t0 = time.perf_counter()
                eng.generate(prompts, loop=loop, **kw, **extra)  # compiles (and profiles) what the timed run meets
                warm = time.perf_counter() - t0
                res = eng.generate(prompts, loop=loop, **kw, **extra)
                tokens[loop] = [r.token_ids for r in res]
                st = res.stats
                row = {"mode": mode, "loop": loop, "requests": n, "k": args.k if mode != "none" else 0,
                       "warmup_s": warm, "wall_s": st["wall_time_s"], "steps": st["steps"],
                       "steps_per_s": st["steps"] / st["wall_time_s"], "output_tokens": st["output_tokens"],
                       "output_tokens_per_s": st["output_tokens_per_s"],
                       "host_ms_per_step": 1e3 * st["host_time_per_step_s"],
                       "mean_acceptance_length": st["mean_acceptance_length"],
                       "mean_verified_drafts_per_step": st["mean_verified_drafts_per_step"],
                       "compiles": eng.num_compiles, "timed_compiles": st["compiles"]}
                if loop == "device":
                    row["device_s"] = st["device_time_s"]
                    row["token_buckets"] = st["token_buckets"]
                if loop != "host" and "host" in tokens:
                    row["match"] = float(np.mean([a == b for a, b in zip(tokens["host"], tokens[loop])]))
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(os.path.join(args.out, "engine_bench.json"), "w") as f:  # a cut run keeps its rows
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{'mode':9s} {'loop':6s} {'req':>4s} {'steps/s':>8s} {'tok/s':>9s} {'host ms/step':>12s} {'acc len':>7s}")
    for r in rows:
        print(f"{r['mode']:9s} {r['loop']:6s} {r['requests']:4d} {r['steps_per_s']:8.1f} "
              f"{r['output_tokens_per_s']:9.1f} {r['host_ms_per_step']:12.2f} {r['mean_acceptance_length']:7.2f}")


if __name__ == "__main__":
    main()
