"""Benchmark prompts that the embedded default never saw: windows cut from held-out Python sources.

The embedded default was trained on the Python standard library minus a held-out split that depends only on each
file's path (``minimax_jax.training.corpus``: about 3% of the files). :func:`heldout_windows` tokenizes the
held-out files of the interpreter running the benchmark and cuts non-overlapping windows from them, files
interleaved, so every prompt is a distinct piece of real code (never a repeated snippet) and two calls with
different ``offset`` get different windows (warm-up on one set, time on another). Past the non-overlapping windows
come the windows shifted by half their length.

``shared_prefix=P`` makes every prompt start with the same ``P`` tokens (a window of its own, as a system prompt
would be), followed by ``length - P`` tokens of its own window: the prefix-caching workload.
"""

from __future__ import annotations

import numpy as np

_TOKENS: dict[int, list[list[int]]] = {}


def _heldout_tokens(tokenizer) -> list[list[int]]:
    if id(tokenizer) not in _TOKENS:
        from minimax_jax.training.corpus import load_split_documents

        docs, _ = load_split_documents()
        _TOKENS[id(tokenizer)] = [list(tokenizer.encode(d.text)) for d in docs["heldout"]]
    return _TOKENS[id(tokenizer)]


def warmup_windows(tokenizer, n: int, length: int, *, bos: int | None = None) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` tokens cut from the *training* split (files in path order, consecutive
    windows), for a warm-up call at the timed call's concurrency: it shares no text with any held-out window, so
    every held-out window stays free for the timed sets. Tokenizes only as many files as the windows need."""
    from minimax_jax.training.corpus import list_sources, read_documents, split_paths

    if n < 1:
        raise ValueError(f"warm-up windows: n must be at least 1, got {n}")
    body = length - (1 if bos is not None else 0)
    if body < 1:
        raise ValueError(f"a warm-up window of {length} tokens leaves no room after the BOS")
    out: list[list[int]] = []
    for path in sorted(split_paths(list_sources(None))["train"]):
        docs, _ = read_documents(None, [path])
        for doc in docs:
            tokens = list(tokenizer.encode(doc.text))
            for start in range(0, len(tokens) - body + 1, body):
                out.append(([bos] if bos is not None else []) + tokens[start:start + body])
                if len(out) == n:
                    return out
    raise ValueError(f"the training files give {len(out)} windows of {body} tokens, {n} asked")


def heldout_windows(tokenizer, n: int, length: int, *, offset: int = 0, shared_prefix: int = 0,
                    prefix_index: int = 0, bos: int | None = None) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens (see the module docstring); ``offset`` skips that many windows first.

    ``prefix_index`` picks another shared prefix (the ``i``-th from the end of the longest held-out file). With
    ``bos`` each prompt starts with it (the default's training documents did)."""
    files = _heldout_tokens(tokenizer)
    body = length - shared_prefix - (1 if bos is not None else 0)
    if body < 1:
        raise ValueError(f"length {length} leaves no room after a shared prefix of {shared_prefix}")
    # windows round-robin over the files: window j of file f is tokens [j * body, (j + 1) * body); when those run
    # out, the windows shifted by half a window (distinct starts, so no page of one equals a page of another)
    per_file = [len(t) // body for t in files]
    order = []
    for j in range(max(per_file, default=0)):
        order += [(f, j) for f, m in enumerate(per_file) if j < m]
    shifted = [len(t) // body - (1 if len(t) % body < body // 2 else 0) for t in files]
    for j in range(max(shifted, default=0)):
        order += [(f, j + 0.5) for f, m in enumerate(shifted) if j < m]
    prefix: list[int] = []
    if shared_prefix:
        longest = int(np.argmax([len(t) for t in files]))
        end = len(files[longest]) - prefix_index * shared_prefix
        start = end - shared_prefix  # near the end of the longest file; no window is cut from there
        prefix = files[longest][start:end]
        reserved = len(files[longest]) - (prefix_index + 1) * shared_prefix
        order = [(f, j) for f, j in order if not (f == longest and (j + 1) * body > reserved)]
    need = offset + n
    if need > len(order):
        raise ValueError(f"the held-out files give {len(order)} distinct windows of {body} tokens, {need} asked")
    out = []
    for f, j in order[offset:need]:
        head = [bos] if bos is not None else []
        start = int(j * body)
        out.append(head + prefix + files[f][start:start + body])
    return out
