#!/usr/bin/env python
"""Install trained exports as the embedded default (``minimax_jax/assets/default/``) and check the size budget.

    python scripts/export_default.py --target out/target_run/export --drafter out/drafter_run/export \\
        --target-results out/target_run/results.json --drafter-results out/drafter_run/results.json

Checks that the three parts fit together (vocabulary, special ids, the drafter on the target), that everything
shipped stays under 16 MB, copies ``config.json`` + ``model.safetensors`` of each model (and the tokenizer, when
``--tokenizer`` is another one) into ``--dest``, loads the result through ``load_default`` and prints a greedy
completion of the first held-out prompt, plus (with the results files) the numbers for docs/MODEL_CARD.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL_FILES = ("config.json", "model.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def shipped_files(target: str, drafter: str, tokenizer: str) -> list[str]:
    files = [os.path.join(target, f) for f in MODEL_FILES] + [os.path.join(drafter, f) for f in MODEL_FILES]
    files += [os.path.join(tokenizer, f) for f in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer, f))]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise SystemExit(f"missing files: {missing}")
    return files


def card_numbers(target_results: dict | None, drafter_results: dict | None) -> str:
    """A markdown summary of the numbers docs/MODEL_CARD.md asks for."""
    out = []
    if target_results:
        t = target_results
        out += [(f"- target: {t['parameters']:,} parameters, {t['export_bytes'] / 1e6:.2f} MB on disk; "
                 f"{t['steps']} steps of {t['batch']} x {t['seq_len']} tokens ({t['epochs']:.2f} epochs, "
                 f"{t.get('seconds_per_step') or float('nan'):.3f} s/step) on {t['device']}, "
                 f"{t['wall_minutes']:.1f} min"),
                (f"- held-out bits per byte (bf16 export): {t['heldout_bpb_bf16_export']:.4f} "
                 f"({t['heldout_bytes']:,} bytes)")]
        if t.get("final_train"):
            f = t["final_train"]
            nan = float("nan")
            out.append(f"- final train CE {f.get('ce', nan):.4f} nats/token, indexer KL "
                       f"{f.get('indexer_kl', nan):.4f}, MSA selection recall {f.get('recall', nan):.3f}")
        out.append(f"- held-out expert load (share per expert): {json.dumps(t.get('expert_load_heldout'))}")
    if drafter_results:
        d = drafter_results
        out.append(f"- drafter: {d['parameters']:,} parameters, {d['export_bytes'] / 1e6:.2f} MB on disk; "
                   f"{d.get('steps', '?')} steps ({d.get('epochs', float('nan')):.2f} epochs)")
        out.append("")
        out.append("| K | mode | acceptance length | accepted per position |")
        out.append("|---|---|---|---|")
        for key, r in d["report"].items():
            mode = "greedy" if r["temperature"] == 0 else f"T = {r['temperature']:g}"
            per = ", ".join(f"{x:.2f}" for x in r["accepted_per_position"])
            out.append(f"| {r['K']} | {mode} | {r['acceptance_length']:.2f} | {per} |")
        out.append("")
        out.append(f"- STS temperatures: {[round(x, 3) for x in d['sts_temperatures']]}")
        for key, r in d["report"].items():
            if "ece_before_sts" in r:
                before, after = (", ".join(f"{x:.3f}" for x in r[f"ece_{w}_sts"]) for w in ("before", "after"))
                out.append(f"- ECE ({key}) before STS: {before}; after: {after}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from minimax_jax.default import DEFAULT_DIR

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="exported target directory")
    ap.add_argument("--drafter", required=True, help="exported drafter directory (with STS temperatures)")
    ap.add_argument("--tokenizer", default=os.path.join(DEFAULT_DIR, "tokenizer"))
    ap.add_argument("--dest", default=DEFAULT_DIR)
    ap.add_argument("--max-bytes", type=int, default=None, help="size budget (default 16 MB)")
    ap.add_argument("--target-results", default=None)
    ap.add_argument("--drafter-results", default=None)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args(argv)

    import jax.numpy as jnp

    from minimax_jax import load_drafter, load_model
    from minimax_jax.default import load_default
    from minimax_jax.tokenizer import load_tokenizer
    from minimax_jax.training import corpus, presets
    from spec_decode import rollout

    budget = args.max_bytes or presets.SHIPPED_MAX_BYTES
    files = shipped_files(args.target, args.drafter, args.tokenizer)
    total = sum(os.path.getsize(f) for f in files)
    for f in files:
        print(f"  {os.path.getsize(f) / 1e6:8.3f} MB  {f}")
    print(f"  {total / 1e6:8.3f} MB  total (budget {budget / 1e6:.1f} MB)")
    if total > budget:
        raise SystemExit(f"the default would ship {total:,} bytes, over the {budget:,}-byte budget")

    # the parts must fit together before anything is copied
    tokenizer = load_tokenizer(args.tokenizer)
    target = load_model(args.target, dtype=jnp.bfloat16)
    drafter = load_drafter(args.drafter, target)
    if drafter.cfg.sts_temperatures is None:
        print("warning: the drafter has no STS temperatures (train_drafter.py stores them after calibration)")
    if target.cfg.vocab_size != tokenizer.vocab_size or drafter.cfg.mask_token_id != tokenizer.mask_token_id:
        raise SystemExit("the target / drafter do not fit the tokenizer (vocab_size or mask_token_id)")
    del target, drafter

    for part, src, names in (("target", args.target, MODEL_FILES), ("drafter", args.drafter, MODEL_FILES),
                             ("tokenizer", args.tokenizer, TOKENIZER_FILES)):
        dst = os.path.join(args.dest, part)
        if os.path.abspath(src) == os.path.abspath(dst):
            continue
        if os.path.isdir(dst):
            shutil.rmtree(dst)
        os.makedirs(dst)
        for name in names:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    print(f"installed into {args.dest}")

    target, drafter, tokenizer = load_default(path=args.dest)
    prompt = corpus.load_prompts(os.path.join(DEFAULT_DIR, "prompts.json"))[0]["text"]
    res = rollout.speculative_rollout(target, drafter, [tokenizer.encode(prompt, add_bos=True)], num_verify=7,
                                      temperature=0.0, max_new_tokens=args.new_tokens,
                                      eos_token_ids=tokenizer.eos_token_ids)
    print(f"greedy completion of prompt 0 through load_default (speculative, K = 7: acceptance length "
          f"{res.summary()['acceptance_length']:.2f}):")
    print(prompt + tokenizer.decode(res.tokens[0]))

    def read(path):
        if not path:
            return None
        with open(path) as f:
            return json.load(f)

    numbers = card_numbers(read(args.target_results), read(args.drafter_results))
    if numbers:
        print("\nnumbers for docs/MODEL_CARD.md:\n" + numbers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
