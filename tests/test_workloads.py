"""``scripts/workloads.py``: the benchmark prompt sets. Held-out windows are distinct and two offsets never share
one; warm-up windows come from the training split (no text shared with any held-out window) and have the asked
length."""

import os

import pytest

from minimax_jax.default import DEFAULT_DIR
from minimax_jax.tokenizer import load_tokenizer
from scripts.workloads import heldout_windows, warmup_windows


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(os.path.join(DEFAULT_DIR, "tokenizer"))


def test_heldout_sets_at_two_offsets_share_no_window(tok):
    a = heldout_windows(tok, 16, 64, bos=tok.bos_token_id)
    b = heldout_windows(tok, 16, 64, offset=16, bos=tok.bos_token_id)
    assert all(len(w) == 64 and w[0] == tok.bos_token_id for w in a + b)
    assert len({tuple(w) for w in a + b}) == 32


def test_warmup_windows_are_training_text_of_the_asked_length(tok):
    n, length = 40, 64
    warm = warmup_windows(tok, n, length, bos=tok.bos_token_id)
    assert len(warm) == n and all(len(w) == length and w[0] == tok.bos_token_id for w in warm)
    assert len({tuple(w) for w in warm}) == n
    # no 16-token run of a warm-up window occurs in the held-out windows of the same length
    held = heldout_windows(tok, 64, length, bos=tok.bos_token_id)
    runs = {tuple(w[i:i + 16]) for w in held for i in range(1, length - 16)}
    assert not any(tuple(w[i:i + 16]) in runs for w in warm for i in range(1, length - 16))
    plain = warmup_windows(tok, 3, 10)  # without a BOS: the whole window is text, and the sets are reproducible
    assert [len(w) for w in plain] == [10] * 3 and plain == warmup_windows(tok, 3, 10)
    with pytest.raises(ValueError, match="at least 1"):
        warmup_windows(tok, 0, length)
    with pytest.raises(ValueError, match="no room"):
        warmup_windows(tok, 1, 1, bos=tok.bos_token_id)
