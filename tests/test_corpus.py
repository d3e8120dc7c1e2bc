"""Training corpus: deterministic split, token stream layout, bytes per token, windows, prompts."""

import hashlib
import json
import os

import numpy as np
import pytest

from minimax_jax.default import DEFAULT_DIR
from minimax_jax.tokenizer import load_tokenizer
from minimax_jax.training import corpus

TOKENIZER_DIR = os.path.join(DEFAULT_DIR, "tokenizer")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER_DIR)


def test_split_is_a_pure_function_of_the_path():
    paths = ["token.py", "os.py", "json/decoder.py", "test/test_grammar.py", "encodings/cp858.py", "a/b/c.py"]
    for p in paths:
        digest = hashlib.sha256(("minimax-jax/default-corpus/v1:" + p).encode()).digest()
        want = int.from_bytes(digest[:8], "big") / 2.0**64
        assert corpus.split_fraction(p) == want
        assert corpus.is_heldout(p) == (want < 0.03)
    # the committed prompts come from held-out files
    assert corpus.is_heldout("token.py") and corpus.is_heldout("encodings/cp858.py")
    split = corpus.split_paths(reversed(paths))
    assert split == corpus.split_paths(paths)
    assert sorted(split["train"] + split["heldout"]) == sorted(paths)
    assert split["heldout"] == sorted(p for p in paths if corpus.is_heldout(p))
    # about 3% of many paths
    many = [f"pkg{i}/mod{i}.py" for i in range(20000)]
    frac = len(corpus.split_paths(many)["heldout"]) / len(many)
    assert 0.025 < frac < 0.035
    with pytest.raises(ValueError, match="heldout_fraction"):
        corpus.split_paths(paths, 1.5)


def test_list_sources_skips_site_packages(tmp_path):
    for rel in ("a.py", "b.txt", "pkg/c.py", "site-packages/x.py", "pkg/__pycache__/c.py", "dist-packages/y.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    (tmp_path / "bad.py").write_bytes(b"# \xff\xfe latin-1\n")
    assert corpus.list_sources(tmp_path) == ["a.py", "bad.py", "pkg/c.py"]
    docs, skipped = corpus.read_documents(tmp_path, corpus.list_sources(tmp_path))
    assert [d.path for d in docs] == ["a.py", "pkg/c.py"] and skipped == ["bad.py"]


def test_token_stream_layout_and_bytes(tok, tmp_path):
    docs = [corpus.Document("x.py", "import os\n\nprint(os.sep)\n"), corpus.Document("y.py", "caf\u00e9 = 1\n"),
            corpus.Document("z.py", "")]
    stream = corpus.tokenize_documents(tok, docs, batch_size=2)
    assert stream.tokens.dtype == np.uint16 and stream.num_documents == 3
    for i, d in enumerate(docs):
        ids = stream.document(i).tolist()
        assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id and ids[1:-1] == tok.encode(d.text)
    byte_len = corpus.token_byte_lengths(tok)
    assert byte_len[:4].tolist() == [0, 0, 0, 0]
    assert int(byte_len[stream.tokens].sum()) == sum(len(d.text.encode()) for d in docs)
    corpus.save_stream(tmp_path, "train", stream)
    back = corpus.load_stream(tmp_path, "train")
    assert np.array_equal(back.tokens, stream.tokens) and back.files == ("x.py", "y.py", "z.py")
    with pytest.raises(FileNotFoundError, match="prepare_corpus"):
        corpus.load_stream(tmp_path, "heldout")


def test_windows():
    tokens = np.arange(100, dtype=np.uint16)
    w = corpus.eval_windows(tokens, 10, pad_id=9999)
    # every token after the first is a label exactly once
    labels = w[:, 1:].reshape(-1)
    labels = labels[labels != 9999]
    assert sorted(labels.tolist()) == list(range(1, 100))
    assert w[0, 0] == 0 and w[1, 0] == 9
    sub = corpus.eval_windows(tokens, 10, pad_id=9999, max_windows=3)
    assert sub.shape == (3, 10) and sub[0, 0] == 0 and sub[-1, 0] == w[-1, 0]
    a = corpus.sample_windows(tokens, 4, 11, seed=1, step=7)
    assert a.shape == (4, 11) and a.dtype == np.int32
    assert np.array_equal(a, corpus.sample_windows(tokens, 4, 11, seed=1, step=7))
    assert not np.array_equal(a, corpus.sample_windows(tokens, 4, 11, seed=1, step=8))
    assert np.all(np.diff(a, axis=1) == 1)  # contiguous slices of the stream


def test_committed_prompts_and_stream_prompts(tok):
    with open(os.path.join(DEFAULT_DIR, "prompts.json"), encoding="utf-8") as f:
        raw = json.load(f)
    prompts = corpus.load_prompts(os.path.join(DEFAULT_DIR, "prompts.json"))
    assert raw["interpreter"].startswith("CPython 3.12") and len(prompts) == 32
    assert {p["kind"] for p in prompts} == set(corpus.PROMPT_KINDS)
    assert len({p["source"] for p in prompts}) == 32
    assert all(corpus.is_heldout(p["source"]) and p["text"].endswith("\n") for p in prompts)
    docs = [corpus.Document(f"d{i}.py", "x = 1\n" * (20 * (i + 1))) for i in range(3)]
    stream = corpus.tokenize_documents(tok, docs)
    got = corpus.stream_prompts(stream, 5, 8, exclude_files=["d0.py"], stride=16)
    assert len(got) == 5 and all(len(p) == 8 for p in got)
    assert got[0] == stream.document(1)[:8].tolist() and got[1] == stream.document(2)[:8].tolist()
    assert got[2] == stream.document(1)[16:24].tolist()
