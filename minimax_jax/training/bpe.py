"""Training the embedded default's byte-level BPE tokenizer with the ``tokenizers`` library.

GPT-2 style byte-level BPE (no normaliser, the GPT-2 split regex, no prefix space), so every text round-trips
exactly. The special tokens come first (ids ``0..3``): ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` and the DSpark
drafter's ``<|mask|>``; then the 256 byte symbols; then the merges. Training is deterministic for a given list
of texts in a given order.

The directory written by :func:`save_tokenizer` is what :func:`minimax_jax.tokenizer.load_tokenizer` reads:
``tokenizer.json`` and ``tokenizer_config.json`` (naming the special tokens, as HF repositories do).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

BOS, EOS, PAD, MASK = "<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, MASK)


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` ids (special tokens included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be >= {len(SPECIAL_TOKENS) + 256} (specials + 256 bytes), got "
                         f"{vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"internal: special token {t} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def save_tokenizer(backend, directory: str | os.PathLike, *, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and an HF-style ``tokenizer_config.json`` into ``directory``."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    backend.save(os.path.join(directory, "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "mask_token": MASK,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
