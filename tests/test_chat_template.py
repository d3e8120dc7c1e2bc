"""Chat templates from a checkpoint directory: tokenizer_config.json's chat_template rendered with sandboxed
jinja2 (HF's conventions), tokenized with the special tokens as single ids; Engine.chat on top of it."""

import json
import shutil
import types

import pytest

from minimax_jax.tokenizer import CHAT_TEMPLATE_FILE, TokenizerError, load_tokenizer
from scripts.make_checkpoint_fixtures import write_tokenizer
from spec_decode.engine import Engine

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? ünï"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(str(d))
    return d


def with_config(src, tmp_path, **changes):
    dst = tmp_path / "tok"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del cfg[k]
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_renders_and_tokenizes_like_the_template_says(tok_dir):
    tok = load_tokenizer(tok_dir)
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert text == ("<bos>]~b]system\nBe brief.[e~[\n]~b]user\n2+2? ünï[e~[\n]~b]assistant\n")
    no_prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text[: -len("]~b]assistant\n")]
    ids = tok.apply_chat_template(MESSAGES)
    turn, end = tok.token_to_id("]~b]"), tok.token_to_id("[e~[")
    assert ids[0] == tok.bos_token_id and ids.count(turn) == 3 and ids.count(end) == 2
    assert ids == tok.encode(text)  # nothing added beyond what the template writes
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_template_errors_are_tokenizer_errors(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    with pytest.raises(TokenizerError, match="refused the messages: unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(TypeError, match="list of"):
        tok.apply_chat_template("hello")
    # the sandbox: no attribute walks out of the template
    evil = with_config(tok_dir, tmp_path, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TokenizerError, match="failed to render"):
        load_tokenizer(evil).apply_chat_template(MESSAGES)


def test_broken_or_missing_templates(tok_dir, tmp_path):
    bad = with_config(tok_dir, tmp_path, chat_template="{% for m in messages %}{{ m }")
    with pytest.raises(TokenizerError, match="not valid jinja2"):
        load_tokenizer(bad)
    shutil.rmtree(bad)
    none = with_config(tok_dir, tmp_path, chat_template=None)
    tok = load_tokenizer(none)
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match="has no chat template"):
        tok.apply_chat_template(MESSAGES)
    # a chat_template.jinja file beside the config is read when the config has none
    (none / CHAT_TEMPLATE_FILE).write_text("{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    assert load_tokenizer(none).apply_chat_template(MESSAGES, tokenize=False) == "BE BRIEF.2+2? ÜNÏ"


def test_named_templates_hf_globals_and_tojson(tok_dir, tmp_path):
    templates = [{"name": "tool_use", "template": "tools"},
                 {"name": "default", "template": "{{ eos_token }}|{{ tools | tojson }}|{{ extra }}|"
                                                 "{{ strftime_now('%Y') | length }}"}]
    d = with_config(tok_dir, tmp_path, chat_template=templates)
    tok = load_tokenizer(d)
    out = tok.apply_chat_template(MESSAGES, tokenize=False, tools=[{"name": "sum", "doc": "ünï"}], extra=7)
    assert out == '<eos>|[{"name": "sum", "doc": "ünï"}]|7|4'


def test_engine_chat_renders_then_generates(tok_dir):
    tok = load_tokenizer(tok_dir)
    calls = []

    def generate(prompts, **kw):
        calls.append((prompts, kw))
        return ["result"]

    engine = types.SimpleNamespace(tokenizer=tok, generate=generate)
    assert Engine.chat(engine, MESSAGES, max_new_tokens=5) == "result"
    assert calls == [([tok.apply_chat_template(MESSAGES)], {"max_new_tokens": 5})]
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        Engine.chat(types.SimpleNamespace(tokenizer=None, generate=generate), MESSAGES)
