#!/usr/bin/env python
"""Train the embedded default's DSpark drafter on the frozen target, calibrate its confidences (STS) and report
acceptance on held-out prompts.

    python scripts/train_drafter.py --target out/target_run/export --max-minutes 8    # GPU, resumable
    python scripts/train_drafter.py --smoke --target <smoke target export> ...         # CPU, seconds

Phases: (1) DeepSpec training (features of the frozen bf16 target as shipped, random anchors, block [anchor,
MASK x 6], loss 0.1 CE + 0.9 L1 + 1.0 BCE with weights exp(-k/4)), stopped at the plan or the time limit with a
checkpoint; (2) export (bf16, DeepSpec names) and reload; (3) rollouts of cache-free speculative decoding on
held-out calibration prompts (K = 7, greedy and T = 1) -> sequential temperature scaling; (4) rollouts on the
committed held-out prompts at K = 3, 5, 7, greedy and T = 1 -> acceptance, ECE before/after STS, greedy
completions. Writes ``--run-dir``: ``ckpt/``, ``metrics.jsonl``, ``loss.png``, ``export/`` (config.json with
``sts_temperatures`` + model.safetensors), ``results.json``, ``completions.md``.
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
    ap.add_argument("--target", default="out/target_run/export", help="the exported target (config + safetensors)")
    ap.add_argument("--run-dir", default="out/drafter_run")
    ap.add_argument("--preset", choices=["default", "smoke"], default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny drafter, few steps, short rollouts (CPU)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 32; smoke 2)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024; smoke 64)")
    ap.add_argument("--anchors", type=int, default=None, help="anchors per sequence (default 64; smoke 6)")
    ap.add_argument("--steps", type=int, default=None, help="planned steps (default: fit --max-minutes)")
    ap.add_argument("--max-epochs", type=float, default=20.0, help="cap of the plan, passes over the train split")
    ap.add_argument("--max-minutes", type=float, default=8.0)
    ap.add_argument("--reserve-minutes", type=float, default=None, help="kept for STS + evaluation (default 3)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=float, default=0.04)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--compute-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--prompts", default=os.path.join(DEFAULT_DIR, "prompts.json"), help="held-out report prompts")
    ap.add_argument("--num-prompts", type=int, default=None, help="report prompts used (default all; smoke 2)")
    ap.add_argument("--calib-prompts", type=int, default=None, help="held-out calibration prompts (32; smoke 2)")
    ap.add_argument("--calib-prompt-len", type=int, default=None, help="tokens per calibration prompt (128)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="tokens per rollout row (256; smoke 8)")
    ap.add_argument("--rollout-rows", type=int, default=None, help="rows per rollout batch (32; smoke 2)")
    ap.add_argument("--report-ks", default="3,5,7")
    ap.add_argument("--eval-only", action="store_true", help="skip training: calibrate and report an export")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--checkpoint-minutes", type=float, default=2.0)
    ap.add_argument("--stop-after", type=int, default=None, help="at most this many steps in this invocation")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    smoke = args.smoke or args.preset == "smoke"
    args.preset = args.preset or ("smoke" if smoke else "default")
    defaults = {"batch": (2, 32), "seq_len": (64, 1024), "anchors": (6, 64), "reserve_minutes": (0.0, 3.0),
                "calib_prompts": (2, 32), "calib_prompt_len": (16, 128), "max_new_tokens": (8, 256),
                "rollout_rows": (2, 32), "num_prompts": (2, None)}
    for name, (small, big) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if smoke else big)
    if smoke and args.steps is None:
        args.steps = 4
        args.log_every = 2
    args.report_ks = tuple(int(k) for k in args.report_ks.split(","))
    return args


def main(argv: list[str] | None = None) -> int:
    global _START
    if argv is not None:  # called in-process (tests): the time budget starts now, not at import
        _START = time.time()
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from minimax_jax import load_drafter, load_model, save_drafter
    from minimax_jax.tokenizer import load_tokenizer
    from minimax_jax.training import corpus, presets
    from spec_decode import rollout as ro

    def stamp():
        return f"[{(time.time() - _START) / 60:.1f} min]"

    os.makedirs(args.run_dir, exist_ok=True)
    tokenizer = load_tokenizer(args.tokenizer)
    corpus.check_corpus_tokenizer(args.corpus, args.tokenizer)
    train = corpus.load_stream(args.corpus, "train")
    heldout = corpus.load_stream(args.corpus, "heldout")
    if tokenizer.mask_token_id is None:
        raise SystemExit(f"the tokenizer at {args.tokenizer} has no mask_token: the drafter needs one")
    target = load_model(args.target, dtype=jnp.bfloat16)  # the frozen target, exactly as shipped
    if target.cfg.vocab_size != tokenizer.vocab_size:
        raise SystemExit(f"target vocab_size {target.cfg.vocab_size} != tokenizer vocab_size {tokenizer.vocab_size}")
    dcfg = presets.drafter_config(args.preset, target.cfg, mask_token_id=tokenizer.mask_token_id)
    n_params = presets.drafter_param_count(dcfg)
    presets.check_budget("drafter", n_params, presets.DRAFTER_MAX_PARAMS)
    print(f"{stamp()} drafter ({args.preset}): {n_params:,} parameters ({2 * n_params / 1e6:.2f} MB in bf16), "
          f"{dcfg.num_draft_layers} layers, features of target layers {list(dcfg.target_layer_ids)}, "
          f"{dcfg.markov_head_type} Markov head rank {dcfg.markov_rank}, K = {dcfg.block_size}; "
          f"devices {jax.devices()}")

    export_dir = os.path.join(args.run_dir, "export")
    results: dict = {"preset": args.preset, "parameters": n_params, "config": dcfg.to_dict()}
    if not args.eval_only:
        results.update(train_phase(args, target, dcfg, tokenizer, train, export_dir, stamp))

    # ---------------------------------------------------------------- calibration and report on what ships
    drafter = load_drafter(export_dir, target, dtype=jnp.bfloat16)
    prompts_meta = corpus.load_prompts(args.prompts)
    prompts_meta = prompts_meta[:args.num_prompts] if args.num_prompts else prompts_meta
    report_prompts = [tokenizer.encode(p["text"], add_bos=True) for p in prompts_meta]
    calib_prompts = corpus.stream_prompts(heldout, args.calib_prompts, args.calib_prompt_len,
                                          exclude_files=[p.get("source") for p in prompts_meta])
    if not calib_prompts:
        raise SystemExit("no held-out calibration prompts could be made")
    p_max = max(len(p) for p in report_prompts + calib_prompts)
    length = -(-(p_max + args.max_new_tokens + 2 * dcfg.block_size + 2) // 64) * 64
    kw = {"rows": args.rollout_rows, "max_new_tokens": args.max_new_tokens,
          "eos_token_ids": tokenizer.eos_token_ids, "pad_id": tokenizer.pad_token_id, "length": length,
          "seed": args.seed}
    kk = dcfg.block_size
    calib = [ro.batched_rollout(target, drafter, calib_prompts, num_verify=kk, temperature=t, **kw)
             for t in (0.0, 1.0)]
    fit = ro.fit_temperatures(calib)
    print(f"{stamp()} STS on {sum(c.steps for c in calib)} held-out steps: T = "
          f"{[round(t, 3) for t in fit.temperatures]}")
    report = {}
    for temp in (0.0, 1.0):
        for k in args.report_ks:
            res = ro.batched_rollout(target, drafter, report_prompts, num_verify=k, temperature=temp, **kw)
            key = f"K{k}_{'greedy' if temp == 0 else 'T1'}"
            report[key] = res.summary()
            if k == kk:
                report[key]["ece_before_sts"] = ro.ece_report(res, None)
                report[key]["ece_after_sts"] = ro.ece_report(res, fit.temperatures)
                if temp == 0:
                    completions = res.tokens
            print(f"{stamp()} {key}: acceptance length {report[key]['acceptance_length']:.3f}, per position "
                  f"{[round(x, 3) for x in report[key]['accepted_per_position']]}")
    drafter.set_sts_temperatures(fit.temperatures)
    save_drafter(drafter, export_dir, dtype=jnp.bfloat16)
    reloaded = load_drafter(export_dir, target, dtype=jnp.bfloat16)
    if reloaded.cfg.sts_temperatures != tuple(fit.temperatures):
        raise SystemExit("internal: the saved drafter lost its STS temperatures")

    lines = ["# Greedy completions of held-out prompts (K = 7 speculative decoding = the target's greedy output)\n"]
    for p, toks in list(zip(prompts_meta, completions))[:3]:
        lines += [f"## {p.get('source', '?')} ({p.get('kind', '?')})\n", "Prompt:\n", "```python",
                  p["text"].rstrip("\n"), "```\n", "Completion:\n", "```python",
                  tokenizer.decode(toks).rstrip("\n"), "```\n"]
    with open(os.path.join(args.run_dir, "completions.md"), "w") as f:
        f.write("\n".join(lines))
    results.update({
        "sts_temperatures": list(fit.temperatures), "sts_fit_ece_before": list(fit.ece_before),
        "sts_fit_ece_after": list(fit.ece_after), "sts_fit_rows": list(fit.num_observed),
        "calibration_prompts": len(calib_prompts), "report_prompts": len(report_prompts),
        "max_new_tokens": args.max_new_tokens, "report": report,
        "export_bytes": sum(os.path.getsize(os.path.join(export_dir, f)) for f in os.listdir(export_dir)),
        "device": str(jax.devices()[0]), "wall_minutes": (time.time() - _START) / 60.0,
    })
    with open(os.path.join(args.run_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: results[k] for k in ("parameters", "sts_temperatures", "export_bytes", "wall_minutes")},
                     indent=1))
    return 0


def train_phase(args, target, dcfg, tokenizer, train, export_dir, stamp) -> dict:
    import jax.numpy as jnp
    from flax import nnx

    from minimax_jax import init_drafter, save_drafter
    from minimax_jax.training import corpus, loop
    from minimax_jax.training import dspark as ds

    compute_dtype = getattr(jnp, args.compute_dtype)
    drafter = init_drafter(dcfg, target, dtype=jnp.float32, seed=args.seed)  # f32 master weights
    drafter.dtype = compute_dtype  # block inputs are cast to the compute dtype
    dgraph, params, shared = nnx.split(drafter, nnx.Param, ...)
    tgraph, tstate = nnx.split(target)
    optimizer = loop.make_optimizer(weight_decay=args.weight_decay, clip_norm=args.clip)
    state = {"params": params, "opt": optimizer.init(params)}
    ckpt = loop.Checkpointer(os.path.join(args.run_dir, "ckpt"))
    metrics = loop.MetricsLog(os.path.join(args.run_dir, "metrics.jsonl"))
    run_meta = {"step": 0, "planned_steps": args.steps, "config": dcfg.to_dict(),
                "target_config": target.cfg.to_dict(), "batch": args.batch, "seq_len": args.seq_len,
                "anchors": args.anchors, "seed": args.seed}
    restored = ckpt.restore(loop.abstract_like(state))
    if restored is not None:
        state, old = restored
        for key in ("config", "target_config", "batch", "seq_len", "anchors"):
            if old.get(key) != run_meta[key]:
                raise SystemExit(f"{args.run_dir} holds a run with another {key}: use a new --run-dir")
        run_meta = {**run_meta, **old}
        metrics.trim(run_meta["step"])
        print(f"{stamp()} resuming from step {run_meta['step']} (planned {run_meta['planned_steps']})")
    else:
        metrics.trim(0)

    tokens_per_step = args.batch * args.seq_len
    settings = loop.LoopSettings(
        max_minutes=args.max_minutes, reserve_minutes=args.reserve_minutes, planned_steps=run_meta["planned_steps"],
        max_steps=max(1, int(args.max_epochs * train.tokens.size / tokens_per_step)), warmup=args.warmup,
        peak_lr=args.lr, log_every=args.log_every, eval_every=10**9, checkpoint_minutes=args.checkpoint_minutes, stop_after=args.stop_after)
    step_jit = ds.make_train_step(tgraph, dgraph, optimizer, compute_dtype=compute_dtype,
                                  bos_id=tokenizer.bos_token_id, pad_id=tokenizer.pad_token_id)

    def step_fn(state, step, lr, phase):
        batch = corpus.sample_windows(train.tokens, args.batch, args.seq_len, args.seed + 1, step)
        anchors = ds.sample_anchors(args.batch, args.seq_len, args.anchors, dcfg.block_size, args.seed, step)
        return step_jit(state, tstate, shared, jnp.asarray(batch), jnp.asarray(anchors), jnp.float32(lr))

    train_loop = loop.TrainLoop(settings, run_dir=args.run_dir, checkpointer=ckpt, metrics=metrics,
                                start_time=_START, desc="drafter")
    state, run_meta = train_loop.run(state, run_meta, step_fn)
    step = run_meta["step"]
    print(f"{stamp()} stopped at step {step} of {run_meta['planned_steps']} ({run_meta['stop_reason']})")
    master = nnx.merge(dgraph, state["params"], shared)
    save_drafter(master, export_dir, dtype=jnp.bfloat16)
    ckpt.close()
    records = metrics.records()
    loop.plot_curves(records, os.path.join(args.run_dir, "loss.png"), title=f"DSpark drafter ({args.preset})",
                     series=(("loss", "DeepSpec loss"), ("ce", "CE"), ("l1", "L1(p_d - p_t)"), ("bce", "BCE"),
                             ("accept_first", "1 - TV, slot 1"), ("top1_first", "top-1 accuracy, slot 1")))
    last = [r for r in records if "loss" in r]
    plan = [r for r in records if r.get("event") == "plan"]
    return {"steps": step, "planned_steps": run_meta["planned_steps"], "finished": run_meta["finished"],
            "stop_reason": run_meta["stop_reason"], "batch": args.batch, "seq_len": args.seq_len,
            "anchors": args.anchors, "epochs": step * tokens_per_step / train.tokens.size,
            "seconds_per_step": plan[-1]["seconds_per_step"] if plan else None,
            "final_train": last[-1] if last else None}


if __name__ == "__main__":
    sys.exit(main())
