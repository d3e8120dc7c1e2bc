"""Tokenizer wrapper: the committed default tokenizer round-trips held-out code; HF-style loading and errors."""

import json
import os

import pytest

from minimax_jax.default import DEFAULT_DIR
from minimax_jax.tokenizer import TokenizerError, load_tokenizer

TOKENIZER_DIR = os.path.join(DEFAULT_DIR, "tokenizer")
PROMPTS = os.path.join(DEFAULT_DIR, "prompts.json")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER_DIR)


def test_default_special_tokens(tok):
    assert tok.vocab_size == 4096
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 1, 2, 3)
    assert tok.eos_token_ids == (1,)
    assert [tok.id_to_token(i) for i in range(4)] == ["<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"]
    assert tok.special_token_ids == (0, 1, 2, 3)


def test_round_trip_held_out_code(tok):
    with open(PROMPTS, encoding="utf-8") as f:
        prompts = [p["text"] for p in json.load(f)["prompts"]]
    assert len(prompts) == 32
    text = "\n".join(prompts) + "\tdef f(x):\n        return 'caf\u00e9 \u2603 \U0001f600'  # \u00fcnicode\r\n"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids) and 0 not in ids
    assert tok.decode(ids) == text
    # code compresses: well under one token per byte
    assert len(ids) < 0.5 * len(text.encode("utf-8"))
    # special tokens: added with add_bos / written literally, dropped or kept by decode
    with_specials = tok.encode(text, add_bos=True) + [tok.eos_token_id]
    assert with_specials[0] == 0 and with_specials[1:-1] == ids
    assert tok.decode(with_specials) == text
    assert tok.decode(with_specials, skip_special_tokens=False) == "<|bos|>" + text + "<|eos|>"
    assert tok.encode("x<|mask|>y") == tok.encode("x") + [3] + tok.encode("y")
    assert tok.encode_batch(["a = 1", "b"]) == [tok.encode("a = 1"), tok.encode("b")]


def test_decode_rejects_out_of_vocabulary(tok):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([5, 4096])


def _tiny_hf_tokenizer(path, *, specials_as_objects: bool):
    """A byte-level BPE with added special tokens at the end, like a real MiniMax-M3 tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["def main():\n    return 0\n"] * 10, trainer=trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    t.add_special_tokens(["]~!b[", "[e~["])
    os.makedirs(path, exist_ok=True)
    t.save(os.path.join(path, "tokenizer.json"))
    bos = {"content": "]~!b[", "special": True} if specials_as_objects else "]~!b["
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": bos, "eos_token": "[e~[", "pad_token": None}, f)
    return t


def test_hf_layout_with_added_tokens(tmp_path):
    backend = _tiny_hf_tokenizer(tmp_path / "m", specials_as_objects=True)
    with open(tmp_path / "m" / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [backend.token_to_id("[e~["), 7]}, f)
    tok = load_tokenizer(tmp_path / "m" / "tokenizer.json")
    assert tok.bos_token_id == backend.token_to_id("]~!b[")
    assert tok.eos_token_ids == (backend.token_to_id("[e~["), 7)
    assert tok.pad_token_id is None and tok.mask_token_id is None
    assert tok.vocab_size == backend.get_vocab_size(with_added_tokens=True)
    assert tok.decode(tok.encode("def main():\n  return 42\n")) == "def main():\n  return 42\n"
    # keyword overrides (e.g. naming a MASK token the config does not list)
    tok2 = load_tokenizer(tmp_path / "m", mask_token="[e~[")
    assert tok2.mask_token_id == backend.token_to_id("[e~[")


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))
    with pytest.raises(TokenizerError, match="not a tokenizers file"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unknown"}}))
    with pytest.raises(TokenizerError, match="could not be loaded"):
        load_tokenizer(tmp_path)
    _tiny_hf_tokenizer(tmp_path / "m", specials_as_objects=False)
    with pytest.raises(TokenizerError, match="mask_token '<\\|nope\\|>' is not in the vocabulary"):
        load_tokenizer(tmp_path / "m", mask_token="<|nope|>")
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"bos_token": 5}))
    with pytest.raises(TokenizerError, match="bos_token must be a string"):
        load_tokenizer(tmp_path / "m")
