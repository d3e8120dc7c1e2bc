#!/usr/bin/env python
"""Prepare the embedded default's corpus: split the stdlib sources, (re)train the tokenizer, write the held-out
prompts, and pre-tokenise both splits into uint16 arrays under ``out/corpus/`` (git-ignored; carried to the GPU).

    python scripts/prepare_corpus.py                       # reuse the committed tokenizer, tokenise the corpus
    python scripts/prepare_corpus.py --train-tokenizer --write-prompts   # rebuild the committed assets too
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    from minimax_jax.default import DEFAULT_DIR
    from minimax_jax.training import corpus

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/corpus", help="where the token arrays go")
    ap.add_argument("--tokenizer-dir", default=os.path.join(DEFAULT_DIR, "tokenizer"))
    ap.add_argument("--train-tokenizer", action="store_true", help="retrain even if tokenizer.json exists")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--write-prompts", action="store_true", help="(re)write the held-out prompts file")
    ap.add_argument("--prompts-file", default=os.path.join(DEFAULT_DIR, "prompts.json"))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--root", default=None, help="source directory (default: this interpreter's stdlib)")
    ap.add_argument("--heldout-fraction", type=float, default=corpus.HELDOUT_FRACTION)
    ap.add_argument("--max-files", type=int, default=None, help="deterministic subset (smoke tests)")
    args = ap.parse_args(argv)
    corpus.prepare_corpus(args.out, args.tokenizer_dir, root=args.root, heldout_fraction=args.heldout_fraction,
                          train_tokenizer=args.train_tokenizer, vocab_size=args.vocab_size,
                          prompts_file=args.prompts_file if args.write_prompts else None,
                          num_prompts=args.num_prompts, max_files=args.max_files)
    return 0


if __name__ == "__main__":
    sys.exit(main())
