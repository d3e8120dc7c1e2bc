"""The training corpus of the embedded default: the Python standard library's ``.py`` sources.

* **Files**: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (test packages included), except
  ``site-packages`` / ``dist-packages`` and ``__pycache__``. Files that are not valid UTF-8 (a few encoding tests)
  are skipped and counted.
* **Split**: a file is held out iff ``sha256(SPLIT_SALT + relative posix path)`` read as a fraction of 2**64 is
  below ``heldout_fraction`` (3%). It depends only on the path, so it is the same on every machine and
  interpreter version (a file present in two versions lands on the same side).
* **Token stream**: documents in sorted path order, each as ``[BOS] tokens [EOS]``, concatenated into one
  ``uint16`` array; ``doc_offsets int64[D + 1]`` marks where each document's BOS sits.
* **On disk** (``out/corpus/`` by default, git-ignored): ``{split}.tokens.npy``, ``{split}.offsets.npy``,
  ``{split}.files.json`` and ``meta.json`` (tokenizer hash, interpreter, counts, bytes).
* **Windows**: training draws uniformly random windows of ``S + 1`` tokens (inputs ``[:S]``, labels ``[1:]``),
  a pure function of (seed, step), so a resumed run sees the same batches. Held-out evaluation tiles the stream
  with windows of ``S`` tokens overlapping by one token, so every token but the first is predicted exactly once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import sysconfig
from collections.abc import Iterable, Sequence

import numpy as np

SPLIT_SALT = "minimax-jax/default-corpus/v1:"
HELDOUT_FRACTION = 0.03
SPLITS = ("train", "heldout")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


# ----------------------------------------------------------------------------------------------- files
def stdlib_root() -> str:
    """The running interpreter's standard-library directory."""
    return sysconfig.get_paths()["stdlib"]


def list_sources(root: str | os.PathLike | None = None) -> list[str]:
    """Sorted relative posix paths of the ``.py`` files under ``root`` (default: the stdlib)."""
    root = os.fspath(root or stdlib_root())
    if not os.path.isdir(root):
        raise FileNotFoundError(f"no source directory at {root}")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        rel_dir = os.path.relpath(dirpath, root)
        for f in filenames:
            if f.endswith(".py"):
                rel = f if rel_dir == "." else os.path.join(rel_dir, f)
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def split_fraction(relpath: str) -> float:
    """The path's deterministic position in [0, 1): the first 8 bytes of ``sha256(SPLIT_SALT + relpath)``."""
    digest = hashlib.sha256((SPLIT_SALT + relpath).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(relpath: str, heldout_fraction: float = HELDOUT_FRACTION) -> bool:
    return split_fraction(relpath) < heldout_fraction


def split_paths(relpaths: Iterable[str], heldout_fraction: float = HELDOUT_FRACTION) -> dict[str, list[str]]:
    """``{"train": [...], "heldout": [...]}``, each sorted."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    out: dict[str, list[str]] = {"train": [], "heldout": []}
    for p in sorted(relpaths):
        out["heldout" if is_heldout(p, heldout_fraction) else "train"].append(p)
    return out


@dataclasses.dataclass(frozen=True)
class Document:
    path: str  # relative posix path
    text: str


def read_documents(root: str | os.PathLike | None, relpaths: Sequence[str]) -> tuple[list[Document], list[str]]:
    """``(documents, skipped)``: files that are not valid UTF-8 are skipped (their paths returned)."""
    root = os.fspath(root or stdlib_root())
    docs, skipped = [], []
    for rel in relpaths:
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        try:
            docs.append(Document(rel, raw.decode("utf-8")))
        except UnicodeDecodeError:
            skipped.append(rel)
    return docs, skipped


def load_split_documents(root: str | os.PathLike | None = None, heldout_fraction: float = HELDOUT_FRACTION):
    """``({"train": docs, "heldout": docs}, skipped_paths)`` for the sources under ``root``."""
    paths = split_paths(list_sources(root), heldout_fraction)
    docs, skipped = {}, []
    for split in SPLITS:
        docs[split], bad = read_documents(root, paths[split])
        skipped += bad
    return docs, skipped


def interpreter_description() -> str:
    return f"{platform.python_implementation()} {platform.python_version()}"


# ----------------------------------------------------------------------------------------------- token stream
@dataclasses.dataclass(frozen=True)
class TokenStream:
    """One split as a flat token stream: ``tokens uint16[N]`` and ``offsets int64[D + 1]`` (BOS of each doc)."""

    tokens: np.ndarray
    offsets: np.ndarray
    files: tuple[str, ...] = ()

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    def document(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` including its BOS and EOS."""
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]


def tokenize_documents(tokenizer, docs: Sequence[Document], *, batch_size: int = 64) -> TokenStream:
    """``[BOS] doc [EOS]`` for every document, concatenated (uint16: the vocabulary must fit in 65536)."""
    if tokenizer.bos_token_id is None or tokenizer.eos_token_id is None:
        raise ValueError("the corpus needs a tokenizer with bos_token and eos_token")
    if tokenizer.vocab_size > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"vocab_size {tokenizer.vocab_size} does not fit the uint16 corpus arrays")
    parts, offsets, n = [], [0], 0
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for start in range(0, len(docs), batch_size):
        chunk = docs[start:start + batch_size]
        for ids in tokenizer.encode_batch([d.text for d in chunk]):
            arr = np.empty(len(ids) + 2, np.uint16)
            arr[0], arr[-1] = bos, eos
            arr[1:-1] = ids
            parts.append(arr)
            n += arr.size
            offsets.append(n)
    tokens = np.concatenate(parts) if parts else np.zeros((0,), np.uint16)
    return TokenStream(tokens, np.asarray(offsets, np.int64), tuple(d.path for d in docs))


def save_stream(directory: str | os.PathLike, split: str, stream: TokenStream) -> None:
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    np.save(os.path.join(directory, f"{split}.tokens.npy"), stream.tokens)
    np.save(os.path.join(directory, f"{split}.offsets.npy"), stream.offsets)
    with open(os.path.join(directory, f"{split}.files.json"), "w") as f:
        json.dump(list(stream.files), f)


def load_stream(directory: str | os.PathLike, split: str, *, mmap: bool = True) -> TokenStream:
    directory = os.fspath(directory)
    tok_file = os.path.join(directory, f"{split}.tokens.npy")
    if not os.path.isfile(tok_file):
        raise FileNotFoundError(f"no {split} corpus at {tok_file}: run scripts/prepare_corpus.py first")
    tokens = np.load(tok_file, mmap_mode="r" if mmap else None)
    offsets = np.load(os.path.join(directory, f"{split}.offsets.npy"))
    files_file = os.path.join(directory, f"{split}.files.json")
    files = ()
    if os.path.isfile(files_file):
        with open(files_file) as f:
            files = tuple(json.load(f))
    if tokens.dtype != np.uint16 or offsets.ndim != 1 or (offsets.size and offsets[-1] != tokens.size):
        raise ValueError(f"corrupt corpus in {directory}: tokens {tokens.dtype}{tokens.shape}, offsets "
                         f"ending at {offsets[-1] if offsets.size else None}")
    return TokenStream(tokens, offsets, files)


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_meta(directory: str | os.PathLike) -> dict:
    path = os.path.join(os.fspath(directory), "meta.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no corpus meta.json at {path}: run scripts/prepare_corpus.py first")
    with open(path) as f:
        return json.load(f)


def check_corpus_tokenizer(directory: str | os.PathLike, tokenizer_dir: str | os.PathLike) -> dict:
    """The corpus meta, after checking it was tokenised with ``tokenizer_dir/tokenizer.json``."""
    meta = load_meta(directory)
    want = file_sha256(os.path.join(os.fspath(tokenizer_dir), "tokenizer.json"))
    if meta.get("tokenizer_sha256") != want:
        raise ValueError(f"the corpus in {os.fspath(directory)} was tokenised with another tokenizer "
                         f"(sha256 {meta.get('tokenizer_sha256')}) than {os.fspath(tokenizer_dir)} ({want}): "
                         f"re-run scripts/prepare_corpus.py")
    return meta


# ----------------------------------------------------------------------------------------------- bytes per token
def token_byte_lengths(tokenizer) -> np.ndarray:
    """``int32[V]``: the UTF-8 bytes each token stands for (0 for special tokens).

    Byte-level BPE only: every character of a token string stands for exactly one byte, so the length of the
    token string is its byte count, and summing over a token sequence gives the byte length of its text.
    """
    import tokenizers

    if not isinstance(tokenizer.backend.pre_tokenizer, tokenizers.pre_tokenizers.ByteLevel):
        raise ValueError("token_byte_lengths needs a byte-level BPE tokenizer (ByteLevel pre-tokenizer)")
    special = set(tokenizer.special_token_ids)
    out = np.zeros((tokenizer.vocab_size,), np.int32)
    for i in range(tokenizer.vocab_size):
        tok = tokenizer.id_to_token(i)
        if tok is not None and i not in special:
            out[i] = len(tok)
    return out


# ----------------------------------------------------------------------------------------------- windows
def sample_windows(tokens: np.ndarray, batch: int, length: int, seed: int, step: int) -> np.ndarray:
    """``int32[batch, length]`` windows at uniformly random offsets; a pure function of ``(seed, step)``."""
    n = tokens.shape[0]
    if n < length:
        raise ValueError(f"the token stream ({n} tokens) is shorter than one window of {length}")
    rng = np.random.default_rng([int(seed), int(step)])
    starts = rng.integers(0, n - length + 1, size=batch)
    idx = starts[:, None] + np.arange(length)[None, :]
    return np.asarray(tokens[idx], np.int32)


def eval_windows(tokens: np.ndarray, length: int, pad_id: int, *, max_windows: int | None = None) -> np.ndarray:
    """``int32[W, length]`` windows tiling the stream with an overlap of one token (window ``i`` starts at
    ``i * (length - 1)``), so each token after the first is a label exactly once; the tail is padded with
    ``pad_id`` (labels equal to ``pad_id`` must be masked). ``max_windows`` keeps evenly spaced windows."""
    n = tokens.shape[0]
    if length < 2:
        raise ValueError(f"length must be >= 2, got {length}")
    stride = length - 1
    count = max(1, -(-(n - 1) // stride))
    idx = np.arange(count)
    if max_windows is not None and max_windows < count:
        idx = np.unique(np.linspace(0, count - 1, max_windows).round().astype(np.int64))
    out = np.full((idx.size, length), pad_id, np.int32)
    for row, i in enumerate(idx):
        chunk = np.asarray(tokens[i * stride:i * stride + length], np.int32)
        out[row, :chunk.size] = chunk
    return out


# ----------------------------------------------------------------------------------------------- prompts
_DEF = re.compile(r"^(\s*)(async\s+def|def)\s+\w+\s*\(.*\)\s*(->\s*[^:]+)?:\s*$")
_CLASS = re.compile(r"^(\s*)class\s+\w+.*:\s*$")


def _opening(text: str, max_lines: int, max_chars: int) -> str | None:
    lines = text.splitlines(keepends=True)
    out = ""
    for line in lines[:max_lines]:
        if len(out) + len(line) > max_chars:
            break
        out += line
    return out if len(out.strip()) >= 40 and out.endswith("\n") else None


def _header(text: str, pattern: re.Pattern, context_lines: int, max_chars: int, which: int) -> str | None:
    """Up to ``context_lines`` lines before a matching header line plus the header itself (``which``-th
    match, modulo the number of matches); ends with a newline so the model writes the body."""
    lines = text.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if pattern.match(line.rstrip("\n")) and line.endswith("\n")]
    if not hits:
        return None
    i = hits[which % len(hits)]
    start = max(0, i - context_lines)
    out = "".join(lines[start:i + 1])
    while len(out) > max_chars and start < i:
        start += 1
        out = "".join(lines[start:i + 1])
    return out if len(out) <= max_chars and len(out.strip()) >= 20 else None


PROMPT_KINDS = ("file_opening", "function_header", "class_header")


def make_prompts(docs: Sequence[Document], num_prompts: int = 32, *, max_chars: int = 600) -> list[dict]:
    """Held-out prompts: file openings, function headers and class headers of different held-out files.

    Files are visited in a hash order of their paths (stable across machines); kinds rotate
    ``file_opening, function_header, file_opening, function_header, class_header`` so about 40% are openings,
    40% function headers and 20% class headers. One prompt per file.
    """
    cycle = ("file_opening", "function_header", "file_opening", "function_header", "class_header")
    order = sorted(docs, key=lambda d: hashlib.sha256(d.path.encode()).hexdigest())
    prompts: list[dict] = []
    k = 0
    used = set()
    for attempt in range(3):  # later passes accept any kind a file can give
        for d in order:
            if len(prompts) >= num_prompts:
                break
            if d.path in used:
                continue
            kinds = [cycle[k % len(cycle)]] if attempt == 0 else list(PROMPT_KINDS)
            for kind in kinds:
                which = int(hashlib.sha256(d.path.encode()).hexdigest()[:8], 16)
                if kind == "file_opening":
                    text = _opening(d.text, 12, max_chars)
                elif kind == "function_header":
                    text = _header(d.text, _DEF, 4, max_chars, which)
                else:
                    text = _header(d.text, _CLASS, 3, max_chars, which)
                if text is not None:
                    prompts.append({"id": len(prompts), "kind": kind, "source": d.path, "text": text})
                    used.add(d.path)
                    k += 1
                    break
    if len(prompts) < num_prompts:
        raise ValueError(f"only {len(prompts)} prompts could be made from {len(docs)} held-out files")
    return prompts


def save_prompts(path: str | os.PathLike, prompts: Sequence[dict], meta: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**meta, "prompts": list(prompts)}, f, indent=1, ensure_ascii=False)
        f.write("\n")


def load_prompts(path: str | os.PathLike) -> list[dict]:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no prompts file at {path}")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    prompts = raw.get("prompts") if isinstance(raw, dict) else None
    if not isinstance(prompts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                for p in prompts):
        raise ValueError(f"{path} must hold {{'prompts': [{{'text': ...}}, ...]}}")
    return prompts


# ----------------------------------------------------------------------------------------------- preparation
def prepare_corpus(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, *,
                   root: str | os.PathLike | None = None, heldout_fraction: float = HELDOUT_FRACTION,
                   train_tokenizer: bool = False, vocab_size: int = 4096, model_max_length: int = 2048,
                   prompts_file: str | os.PathLike | None = None, num_prompts: int = 32,
                   max_files: int | None = None, log=print) -> dict:
    """Read and split the sources, train the tokenizer (when asked or missing), write the prompts (when
    ``prompts_file`` is given) and the tokenised splits plus ``meta.json`` into ``out_dir``. Returns the meta.

    ``max_files`` keeps a deterministic subset (hash order of the paths): small corpora for smoke tests.
    """
    from minimax_jax.tokenizer import load_tokenizer
    from minimax_jax.training import bpe

    root = os.fspath(root or stdlib_root())
    paths = list_sources(root)
    if max_files is not None:
        paths = sorted(sorted(paths, key=lambda p: hashlib.sha256(p.encode()).hexdigest())[:max_files])
    split = split_paths(paths, heldout_fraction)
    if not split["heldout"] or not split["train"]:
        raise ValueError(f"the split of {len(paths)} files under {root} leaves an empty side: "
                         f"{ {k: len(v) for k, v in split.items()} }")
    docs, skipped = {}, []
    for name in SPLITS:
        docs[name], bad = read_documents(root, split[name])
        skipped += bad
    log(f"{len(paths)} files under {root}: {len(docs['train'])} train, {len(docs['heldout'])} held out, "
        f"{len(skipped)} skipped (not UTF-8)")

    tok_file = os.path.join(os.fspath(tokenizer_dir), "tokenizer.json")
    if train_tokenizer or not os.path.isfile(tok_file):
        log(f"training a {vocab_size}-token byte-level BPE on the train split ...")
        backend = bpe.train_bpe((d.text for d in docs["train"]), vocab_size)
        bpe.save_tokenizer(backend, tokenizer_dir, model_max_length=model_max_length)
    tokenizer = load_tokenizer(tokenizer_dir)
    info = {"interpreter": interpreter_description(), "stdlib_root": root, "split_salt": SPLIT_SALT,
            "heldout_fraction": heldout_fraction, "skipped_files": skipped}
    if prompts_file is not None:
        prompts = make_prompts(docs["heldout"], num_prompts)
        save_prompts(prompts_file, prompts, {"description": "held-out prompts of the embedded default "
                                             "(files of the held-out split of the stdlib corpus)",
                                             **{k: v for k, v in info.items() if k != "stdlib_root"}})
        log(f"wrote {len(prompts)} prompts to {prompts_file}")

    meta = {**info, "tokenizer_sha256": file_sha256(tok_file), "vocab_size": tokenizer.vocab_size,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "mask_token_id": tokenizer.mask_token_id, "splits": {}}
    byte_len = token_byte_lengths(tokenizer)
    for name in SPLITS:
        stream = tokenize_documents(tokenizer, docs[name])
        save_stream(out_dir, name, stream)
        n_bytes = sum(len(d.text.encode("utf-8")) for d in docs[name])
        counted = int(byte_len[np.asarray(stream.tokens)].sum())
        if counted != n_bytes:
            raise RuntimeError(f"internal: {name} tokens stand for {counted} bytes, the texts have {n_bytes}")
        meta["splits"][name] = {"files": len(docs[name]), "bytes": n_bytes, "tokens": int(stream.tokens.size),
                                "bytes_per_token": n_bytes / max(1, stream.tokens.size - 2 * len(docs[name]))}
        log(f"{name}: {len(docs[name])} files, {n_bytes / 1e6:.2f} MB, {stream.tokens.size / 1e6:.2f} M tokens "
            f"({meta['splits'][name]['bytes_per_token']:.2f} bytes/token)")
    with open(os.path.join(os.fspath(out_dir), "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def stream_prompts(stream: TokenStream, num_prompts: int, length: int, *, exclude_files: Sequence[str] = (),
                   stride: int = 1024) -> list[list[int]]:
    """Token prompts of ``length`` tokens from a split's documents (not those in ``exclude_files``): windows at
    offsets ``0, stride, 2 * stride, ...`` of each document (a document's first window starts with its BOS),
    taken round-robin over the documents until ``num_prompts`` are collected (fewer if the split runs out)."""
    skip = set(exclude_files)
    docs = [i for i in range(stream.num_documents) if not stream.files or stream.files[i] not in skip]
    prompts: list[list[int]] = []
    offset = 0
    while len(prompts) < num_prompts:
        added = False
        for i in docs:
            doc = stream.document(i)
            if offset + length + 1 <= doc.size:
                prompts.append([int(t) for t in doc[offset:offset + length]])
                added = True
                if len(prompts) == num_prompts:
                    break
        if not added:
            break
        offset += stride
    return prompts
