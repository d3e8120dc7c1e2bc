"""Tokenizers: a thin wrapper over a HF ``tokenizer.json`` (the ``tokenizers`` library).

:func:`load_tokenizer` reads the layout HF repositories use: ``tokenizer.json`` (the model, pre-tokenizer,
decoder and the added tokens) and, beside it, an optional ``tokenizer_config.json`` naming the special tokens
(``bos_token``, ``eos_token``, ``pad_token``, ``mask_token``; each a string or an ``{"content": ...}`` object).
Extra end-of-sequence ids may come from a ``generation_config.json`` or ``config.json`` beside it
(``eos_token_id``: an int or a list). The same code loads the embedded default's byte-level BPE and a real
MiniMax-M3 ``tokenizer.json`` (byte-level BPE with added special tokens).

``encode`` never adds special tokens on its own (pass ``add_bos=True``), and ``decode`` is exact for byte-level
BPE: ``decode(encode(text)) == text`` for any text without special-token strings in it.

The chat template comes from ``tokenizer_config.json``'s ``chat_template`` (a string, or HF's list of named
templates, ``default`` first), else from a ``chat_template.jinja`` file beside it. :meth:`Tokenizer.apply_chat_template`
renders it with jinja2 in a sandboxed environment the way HF transformers does (``trim_blocks``, ``lstrip_blocks``,
the ``loopcontrols`` extension, the globals ``raise_exception`` and ``strftime_now``, a ``tojson`` filter that keeps
non-ASCII text), with ``messages``, ``add_generation_prompt``, ``tools`` and the special token strings
(``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``) in its context; no transformers at run time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "mask_token")


class TokenizerError(ValueError):
    """A missing, corrupt or inconsistent tokenizer file: the message names the file and the problem."""


class Tokenizer:
    """Text <-> token ids, with the special ids the model and the drafter need.

    Attributes:
      bos_token_id, pad_token_id, mask_token_id: ints, or None when the tokenizer has no such token
        (``mask_token_id`` is the DSpark drafter's MASK; real target tokenizers may lack it).
      eos_token_ids: tuple of end-of-sequence ids (``eos_token_id`` is the first, or None).
      vocab_size: number of ids, added tokens included.
    """

    def __init__(self, backend, *, bos_token: str | None = None, eos_tokens: Sequence[str] = (),
                 pad_token: str | None = None, mask_token: str | None = None,
                 extra_eos_token_ids: Iterable[int] = (), name: str = "tokenizer",
                 chat_template: str | None = None, unk_token: str | None = None):
        self._tok = backend
        self.name = name
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_tokens[0] if eos_tokens else None,
                               "pad_token": pad_token, "unk_token": unk_token}
        self.chat_template = chat_template
        self._template = None if chat_template is None else _compile_template(chat_template, name)

        def token_id(token: str | None, key: str) -> int | None:
            if token is None:
                return None
            i = backend.token_to_id(token)
            if i is None:
                raise TokenizerError(f"{name}: {key} {token!r} is not in the vocabulary")
            return int(i)

        self.bos_token_id = token_id(bos_token, "bos_token")
        self.pad_token_id = token_id(pad_token, "pad_token")
        self.mask_token_id = token_id(mask_token, "mask_token")
        eos = [token_id(t, "eos_token") for t in eos_tokens]
        for i in extra_eos_token_ids:
            if not 0 <= int(i) < self.vocab_size:
                raise TokenizerError(f"{name}: eos_token_id {i} is outside the vocabulary [0, {self.vocab_size})")
            eos.append(int(i))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))  # ordered, no duplicates

    # ------------------------------------------------------------------ properties
    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Ids of every token the backend marks as special (the added special tokens)."""
        return tuple(sorted(int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """``text -> ids`` (no special tokens added unless ``add_bos``)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise TokenizerError(f"{self.name} has no bos_token: cannot add_bos")
            ids = [self.bos_token_id] + ids
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts at once (the backend parallelises); no special tokens added."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """``ids -> text``; special tokens are dropped unless ``skip_special_tokens=False``."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tokenize: bool = True, tools: Sequence[Mapping[str, Any]] | None = None,
                            **context: Any) -> list[int] | str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the checkpoint's chat template.

        ``add_generation_prompt``: end with the assistant turn's opening, so the model answers. ``tokenize``:
        return token ids (special-token strings the template writes become their ids; nothing else is added),
        else the text. ``tools`` and any further keywords go to the template's context.

        Raises:
          TokenizerError: the tokenizer has no chat template, or the template raised (its ``raise_exception``
            message is kept) or failed to render.
        """
        if self._template is None:
            raise TokenizerError(f"{self.name} has no chat template (no chat_template in {TOKENIZER_CONFIG_FILE} "
                                 f"and no {CHAT_TEMPLATE_FILE} beside it)")
        if isinstance(messages, (str, bytes)) or not all(isinstance(m, Mapping) for m in messages):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} mappings")
        import jinja2

        values = {**self.special_tokens, **context}
        try:
            text = self._template.render(messages=[dict(m) for m in messages], tools=tools,
                                         add_generation_prompt=add_generation_prompt, **values)
        except _TemplateError as e:
            raise TokenizerError(f"{self.name}: the chat template refused the messages: {e}") from None
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.name}: the chat template failed to render: {e}") from None
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={list(self.eos_token_ids)}, pad={self.pad_token_id}, mask={self.mask_token_id})")


# ----------------------------------------------------------------------------------------------- chat templates
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class _TemplateError(Exception):
    """Raised by a template's ``raise_exception(message)``."""


def _raise_exception(message):
    raise _TemplateError(message)


def _strftime_now(fmt):
    import datetime

    return datetime.datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str, name: str):
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ImportError("chat templates need the 'jinja2' package: pip install jinja2") from e
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{name}: the chat template is not valid jinja2 (line {e.lineno}: {e.message})") from None


def _chat_template_from(cfg: Mapping[str, Any] | None, cfg_file: str, directory: str) -> str | None:
    """``chat_template`` of tokenizer_config.json (a string, or ``[{"name", "template"}]`` with ``default`` taken
    first), else the ``chat_template.jinja`` file beside it, else None."""
    value = None if cfg is None else cfg.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if not named or not all(isinstance(t, str) for t in named.values()):
            raise TokenizerError(f"{cfg_file}: chat_template must be a string or a list of "
                                 f"{{'name': ..., 'template': ...}} objects")
        value = named.get("default", next(iter(named.values())))
    if value is not None and not isinstance(value, str):
        raise TokenizerError(f"{cfg_file}: chat_template must be a string, got {type(value).__name__}")
    if value is None:
        file = os.path.join(directory, CHAT_TEMPLATE_FILE)
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                value = f.read()
    return value


# ----------------------------------------------------------------------------------------------- loading
def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None


def _token_content(value: Any, key: str, path: str) -> str | None:
    """A special token in tokenizer_config.json: a string, an ``{"content": ...}`` object, or null."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{path}: {key} must be a string or an object with 'content', got {value!r}")


def _eos_ids_from(path: str) -> list[int]:
    if not os.path.isfile(path):
        return []
    raw = _read_json(path)
    if not isinstance(raw, Mapping):
        return []
    eos = raw.get("eos_token_id")
    if eos is None and isinstance(raw.get("text_config"), Mapping):
        eos = raw["text_config"].get("eos_token_id")
    if eos is None:
        return []
    eos = eos if isinstance(eos, (list, tuple)) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        raise TokenizerError(f"{path}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    return list(eos)


def load_tokenizer(path: str | os.PathLike, *, bos_token: str | None = None, eos_token: str | None = None,
                   pad_token: str | None = None, mask_token: str | None = None) -> Tokenizer:
    """Load a tokenizer from a directory holding ``tokenizer.json`` (or that file itself).

    Special tokens and the chat template come from ``tokenizer_config.json`` beside it (keyword arguments
    override the tokens; the template may also be a ``chat_template.jinja`` file); extra end-of-sequence ids from
    ``generation_config.json`` / ``config.json`` (``eos_token_id``) when present.

    Raises:
      FileNotFoundError: no ``tokenizer.json`` at ``path``.
      TokenizerError: a file that is not valid JSON or not a tokenizer, a special token not in the vocabulary, or
        a chat template that is not valid jinja2.
    """
    try:
        import tokenizers
        from tokenizers import Tokenizer as Backend
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ImportError("the 'tokenizers' package is required: pip install tokenizers") from e

    path = os.fspath(path)
    if os.path.isdir(path):
        directory, file = path, os.path.join(path, TOKENIZER_FILE)
    else:
        directory, file = os.path.dirname(path) or ".", path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no {TOKENIZER_FILE} at {file}")
    raw = _read_json(file)
    if not isinstance(raw, Mapping) or "model" not in raw:
        raise TokenizerError(f"{file} is not a tokenizers file (no 'model' object)")
    try:
        backend = Backend.from_str(json.dumps(raw))
    except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exceptions
        raise TokenizerError(f"{file} could not be loaded by the tokenizers library "
                             f"({tokenizers.__version__}): {e}") from None

    specials: dict[str, str | None] = dict.fromkeys(SPECIAL_TOKEN_KEYS)
    cfg_file = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    cfg, unk = None, None
    if os.path.isfile(cfg_file):
        cfg = _read_json(cfg_file)
        if not isinstance(cfg, Mapping):
            raise TokenizerError(f"{cfg_file} must hold a JSON object")
        for key in SPECIAL_TOKEN_KEYS:
            specials[key] = _token_content(cfg.get(key), key, cfg_file)
        unk = _token_content(cfg.get("unk_token"), "unk_token", cfg_file)
    chat_template = _chat_template_from(cfg, cfg_file, directory)
    for key, value in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token),
                       ("mask_token", mask_token)):
        if value is not None:
            specials[key] = value
    extra_eos: list[int] = []
    for fname in ("generation_config.json", "config.json"):
        extra_eos += _eos_ids_from(os.path.join(directory, fname))
    return Tokenizer(backend, bos_token=specials["bos_token"],
                     eos_tokens=() if specials["eos_token"] is None else (specials["eos_token"],),
                     pad_token=specials["pad_token"], mask_token=specials["mask_token"],
                     extra_eos_token_ids=extra_eos, name=file, chat_template=chat_template, unk_token=unk)


__all__ = ["CHAT_TEMPLATE_FILE", "Tokenizer", "TokenizerError", "load_tokenizer"]
