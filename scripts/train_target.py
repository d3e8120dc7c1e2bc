#!/usr/bin/env python
"""Train the embedded default's MiniMax-M3-shaped target on the pre-tokenised stdlib corpus.

    python scripts/prepare_corpus.py                        # once: out/corpus/
    python scripts/train_target.py --max-minutes 8          # GPU; resumes from out/target_run/ckpt if present
    python scripts/train_target.py --smoke                  # CPU, seconds: a tiny config through the same code

Writes into ``--run-dir``: ``ckpt/`` (orbax, resumable), ``metrics.jsonl``, ``loss.png``, ``results.json`` and
``export/`` (``config.json`` + ``model.safetensors`` in bf16, HF names: what ships). Training stops at the planned
step count or before ``--max-minutes`` (with a checkpoint), then evaluates and exports either way.
See docs/MODEL_CARD.md for the recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_START = time.time()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv):
    from minimax_jax.default import DEFAULT_DIR

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="out/corpus")
    ap.add_argument("--tokenizer", default=os.path.join(DEFAULT_DIR, "tokenizer"))
    ap.add_argument("--run-dir", default="out/target_run")
    ap.add_argument("--preset", choices=["default", "smoke"], default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny config, few steps, small eval (CPU, same code)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 32; smoke 4)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024; smoke 64)")
    ap.add_argument("--steps", type=int, default=None, help="planned steps (default: fit --max-minutes)")
    ap.add_argument("--max-epochs", type=float, default=6.0, help="cap of the plan, in passes over the train split")
    ap.add_argument("--max-minutes", type=float, default=8.0, help="wall-clock limit of this invocation")
    ap.add_argument("--reserve-minutes", type=float, default=None, help="kept for evaluation/export (default 1.5)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=float, default=0.03, help="warmup, fraction of the plan")
    ap.add_argument("--dense-warmup", type=float, default=0.05,
                    help="fraction of the plan trained with dense attention in the sparse layers")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--kl-weight", type=float, default=1.0, help="weight of the indexer distillation loss")
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="router bias update per step")
    ap.add_argument("--compute-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--eval-windows", type=int, default=None, help="held-out windows per periodic eval (48)")
    ap.add_argument("--eval-batch", type=int, default=None)
    ap.add_argument("--final-eval-windows", type=int, default=None,
                    help="held-out windows of the final evaluation (default: all; smoke: --eval-windows)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=0, help="steps between held-out evals (0: 8 per run)")
    ap.add_argument("--checkpoint-minutes", type=float, default=2.0)
    ap.add_argument("--stop-after", type=int, default=None, help="at most this many steps in this invocation")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    smoke = args.smoke or args.preset == "smoke"
    args.preset = args.preset or ("smoke" if smoke else "default")
    defaults = {"batch": (4, 32), "seq_len": (64, 1024), "eval_windows": (4, 48), "eval_batch": (4, 16),
                "reserve_minutes": (0.0, 1.5)}
    for name, (small, big) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if smoke else big)
    if smoke and args.final_eval_windows is None:
        args.final_eval_windows = args.eval_windows
    if smoke and args.steps is None:
        args.steps = 6
        args.dense_warmup = 0.34
        args.log_every = 2
        args.eval_every = 3
    return args


def main(argv: list[str] | None = None) -> int:
    global _START
    if argv is not None:  # called in-process (tests): the time budget starts now, not at import
        _START = time.time()
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from minimax_jax.checkpoint import load_model
    from minimax_jax.export import save_model
    from minimax_jax.model import init_model
    from minimax_jax.tokenizer import load_tokenizer
    from minimax_jax.training import corpus, loop, presets
    from minimax_jax.training import target as tt

    compute_dtype = getattr(jnp, args.compute_dtype)  # jnp.bfloat16: the dtype load_model(dtype=...) records
    os.makedirs(args.run_dir, exist_ok=True)
    tokenizer = load_tokenizer(args.tokenizer)
    meta_corpus = corpus.check_corpus_tokenizer(args.corpus, args.tokenizer)
    train = corpus.load_stream(args.corpus, "train")
    heldout = corpus.load_stream(args.corpus, "heldout")
    token_bytes = corpus.token_byte_lengths(tokenizer)

    cfg = presets.target_config(args.preset, vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    n_params = presets.target_param_count(cfg)
    presets.check_budget("target", n_params, presets.TARGET_MAX_PARAMS)
    print(f"[{(time.time() - _START) / 60:.1f} min] target ({args.preset}): {n_params:,} parameters ({2 * n_params / 1e6:.2f} MB in bf16); "
          f"{cfg.num_hidden_layers} layers, {len(cfg.sparse_layer_ids)} MSA, {len(cfg.moe_layer_ids)} MoE; "
          f"train {train.tokens.size:,} tokens, held out {heldout.tokens.size:,}; devices {jax.devices()}")

    model = init_model(cfg, dtype=jnp.float32, seed=args.seed)  # f32 master weights
    graphdef, biases, params = nnx.split(model, tt.is_router_bias, nnx.Param)
    optimizer = loop.make_optimizer(weight_decay=args.weight_decay, clip_norm=args.clip)
    state = {"params": params, "biases": biases, "opt": optimizer.init(params)}
    del model

    ckpt = loop.Checkpointer(os.path.join(args.run_dir, "ckpt"))
    metrics = loop.MetricsLog(os.path.join(args.run_dir, "metrics.jsonl"))
    run_meta = {"step": 0, "planned_steps": args.steps, "config": cfg.to_dict(), "batch": args.batch,
                "seq_len": args.seq_len, "seed": args.seed}
    restored = ckpt.restore(loop.abstract_like(state))
    if restored is not None:
        state, old = restored
        if old.get("config") != run_meta["config"] or old.get("batch") != args.batch \
                or old.get("seq_len") != args.seq_len:
            raise SystemExit(f"{args.run_dir} holds a run with another config / batch / sequence length: use a "
                             f"new --run-dir")
        run_meta = {**run_meta, **old}
        metrics.trim(run_meta["step"])
        print(f"resuming from step {run_meta['step']} (planned {run_meta['planned_steps']})")
    else:
        metrics.trim(0)

    tokens_per_step = args.batch * args.seq_len
    max_steps = max(1, int(args.max_epochs * train.tokens.size / tokens_per_step))
    settings = loop.LoopSettings(
        max_minutes=args.max_minutes, reserve_minutes=args.reserve_minutes, planned_steps=run_meta["planned_steps"],
        max_steps=max_steps, warmup=args.warmup, peak_lr=args.lr, log_every=args.log_every, eval_every=args.eval_every,
        checkpoint_minutes=args.checkpoint_minutes, stop_after=args.stop_after, expected_phases=2 if args.dense_warmup > 0 else 1)
    step_fn_jit = tt.make_train_step(graphdef, optimizer, cfg.moe_layer_ids, compute_dtype=compute_dtype,
                                     kl_weight=args.kl_weight, bias_rate=args.bias_rate,
                                     pad_id=tokenizer.pad_token_id)
    pad, bos = tokenizer.pad_token_id, tokenizer.bos_token_id
    eval_windows = corpus.eval_windows(heldout.tokens, args.seq_len + 1, pad, max_windows=args.eval_windows)

    def phase(step, planned):
        if args.dense_warmup <= 0:
            return "sparse"
        return "dense" if planned is None or step < round(args.dense_warmup * planned) else "sparse"

    def step_fn(state, step, lr, phase):
        batch = corpus.sample_windows(train.tokens, args.batch, args.seq_len + 1, args.seed, step)
        return step_fn_jit(state, jnp.asarray(batch), jnp.float32(lr), dense=phase == "dense")

    def compute_model(state):
        m = nnx.merge(graphdef, state["biases"], loop.cast_floats(state["params"], compute_dtype))
        m.dtype = compute_dtype  # the graph of load_model(dtype=compute_dtype): evaluations share one compile
        return m

    def eval_fn(state, step):
        r = tt.heldout_bits_per_byte(compute_model(state), eval_windows, token_bytes, batch_size=args.eval_batch,
                                     bos_id=bos, pad_id=pad)
        load = np.asarray(list(r["expert_load"].values()))
        return {"heldout_bpb": r["bpb"], "heldout_max_load": float(load.max() * load.shape[-1]) if load.size else 0}

    train_loop = loop.TrainLoop(settings, run_dir=args.run_dir, checkpointer=ckpt, metrics=metrics,
                                start_time=_START, desc="target")

    state, run_meta = train_loop.run(state, run_meta, step_fn, eval_fn=eval_fn, phase_fn=phase)
    step = run_meta["step"]
    print(f"[{(time.time() - _START) / 60:.1f} min] stopped at step {step} of {run_meta['planned_steps']} ({run_meta['stop_reason']})")

    # ---------------------------------------------------------------- export, then evaluate what ships
    export_dir = os.path.join(args.run_dir, "export")
    master = nnx.merge(graphdef, state["biases"], state["params"])
    save_model(master, export_dir, dtype=jnp.bfloat16)
    shipped = load_model(export_dir, dtype=jnp.bfloat16)
    full_windows = corpus.eval_windows(heldout.tokens, args.seq_len + 1, pad, max_windows=args.final_eval_windows)
    final = tt.heldout_bits_per_byte(shipped, full_windows, token_bytes, batch_size=args.eval_batch, bos_id=bos,
                                     pad_id=pad)
    print(f"[{(time.time() - _START) / 60:.1f} min] exported and re-evaluated: held-out {final['bpb']:.4f} bits/byte")
    records = metrics.records()
    last_train = [r for r in records if "ce" in r]
    plan_rec = [r for r in records if r.get("event") == "plan"]
    results = {
        "preset": args.preset, "parameters": n_params, "config": cfg.to_dict(),
        "export_bytes": sum(os.path.getsize(os.path.join(export_dir, f)) for f in os.listdir(export_dir)),
        "steps": step, "planned_steps": run_meta["planned_steps"], "finished": run_meta["finished"],
        "stop_reason": run_meta["stop_reason"], "batch": args.batch, "seq_len": args.seq_len,
        "tokens_seen": step * tokens_per_step, "epochs": step * tokens_per_step / train.tokens.size,
        "seconds_per_step": plan_rec[-1]["seconds_per_step"] if plan_rec else None,
        "heldout_bpb_bf16_export": final["bpb"], "heldout_nll_per_token": final["nll_per_token"],
        "heldout_tokens": final["tokens"], "heldout_bytes": final["bytes"],
        "final_train": last_train[-1] if last_train else None, "expert_load_heldout": final["expert_load"],
        "device": str(jax.devices()[0]), "corpus": {k: meta_corpus[k] for k in ("interpreter", "splits")},
        "wall_minutes": (time.time() - _START) / 60.0,
    }
    with open(os.path.join(args.run_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    loop.plot_curves(records, os.path.join(args.run_dir, "loss.png"), title=f"target ({args.preset})",
                     series=(("ce", "train CE (nats/token)"), ("heldout_bpb", "held-out bits/byte"),
                             ("indexer_kl", "indexer KL"), ("recall", "MSA selection recall"),
                             ("max_load", "max expert load (x mean)")))
    ckpt.close()
    print(json.dumps({k: results[k] for k in ("parameters", "steps", "epochs", "heldout_bpb_bf16_export",
                                              "export_bytes", "wall_minutes")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
