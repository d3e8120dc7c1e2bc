"""Cut the in-repo lm-evaluation-harness task's items from the embedded default's held-out files.

``python scripts/make_eval_task.py`` writes ``spec_decode/lm_eval_tasks/heldout_next_line.jsonl``: one item per
held-out standard-library file (``minimax_jax.training.corpus``: files the default never trained on), a few
lines of real code as the prompt and the next line as the target, both short in the default's tokens.
The file is committed (the held-out split depends on the interpreter's standard library); rerun it only to
change the task.
"""

from __future__ import annotations

import argparse
import json
import os

from minimax_jax.default import DEFAULT_DIR
from minimax_jax.tokenizer import load_tokenizer
from minimax_jax.training.corpus import load_split_documents

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spec_decode", "lm_eval_tasks",
                   "heldout_next_line.jsonl")


def items(tokenizer, n: int, *, context_lines: int = 8, max_prompt_tokens: int = 96, max_target_tokens: int = 16):
    """``n`` items ``{"path", "prompt", "target"}``, one per held-out file (sorted paths). The target line's
    indentation but its last space ends the prompt (``"\\n   "`` is one token of the default's tokenizer, the last
    space starts the next word's), so the prompt's tokens are a prefix of the whole text's: what the model saw in
    training, and what lm_eval's context / continuation split expects."""
    docs, _ = load_split_documents()
    out = []
    for doc in sorted(docs["heldout"], key=lambda d: d.path):
        lines = doc.text.splitlines(keepends=True)
        # a target line a third of the way in: past the imports, with code before it
        for start in range(len(lines) // 3, len(lines) - context_lines - 1):
            context, line = lines[start:start + context_lines], lines[start + context_lines].rstrip("\n")
            body = line.lstrip(" ")
            if not body or body.startswith("#") or not context[-1].strip() or "\t" in line:
                continue
            indent = len(line) - len(body)
            prompt = "".join(context) + line[:max(indent - 1, 0)]
            target = line[max(indent - 1, 0):]
            p_ids, whole = tokenizer.encode(prompt), tokenizer.encode(prompt + target)
            if (whole[:len(p_ids)] == p_ids and len(p_ids) <= max_prompt_tokens
                    and len(whole) - len(p_ids) <= max_target_tokens):
                out.append({"path": doc.path, "prompt": prompt, "target": target})
                break
        if len(out) == n:
            break
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=12)
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(os.path.join(DEFAULT_DIR, "tokenizer"))
    rows = items(tokenizer, args.n)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} items to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
