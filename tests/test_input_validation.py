"""Bad input gets a clear error naming the problem before any device work: model inputs, caches, the CLI."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax import MiniMaxM3Config, init_model, load_model
from minimax_jax.cache import check_cache, init_cache
from minimax_jax.decode import RaggedBatch, forward_ragged
from minimax_jax.layers import RMSNorm
from minimax_jax.model import check_input_ids
from spec_decode.cli import main

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module")
def model():
    return init_model(MiniMaxM3Config.tiny(max_position_embeddings=64), dtype=jnp.float32)


@pytest.mark.parametrize("ids, match", [
    ([[1, 2, 256]], r"token id 256, outside the vocabulary \[0, 256\)"),
    ([[1, -3, 2]], r"token id -3, outside the vocabulary"),
    (np.zeros((1, 0), np.int32), "empty"),
    ([[]], "empty"),
    (np.ones((1, 65), np.int32), "65 tokens, more than the model's maximum of 64"),
    ([[1.0, 2.0]], "integer token ids"),
    ([1, 2, 3], "rank 2"),
])
def test_forward_rejects_bad_ids(model, ids, match):
    with pytest.raises(ValueError, match=match):
        model(ids)


def test_the_longest_prompt_passes_the_check(model):
    assert check_input_ids(np.ones((1, 64), np.int32), 256, max_length=64).shape == (1, 64)


def test_cache_with_the_wrong_page_size_is_refused(model):
    cfg = model.cfg
    bad = init_cache(cfg.replace(index_block_size=8), 4, dtype=jnp.float32)  # page 8, model block 4
    with pytest.raises(ValueError, match="page size 8 differs from the model's index_block_size 4"):
        check_cache(bad, cfg)
    batch = RaggedBatch(jnp.zeros((4,), jnp.int32), jnp.asarray([0, 4], jnp.int32), jnp.asarray([4], jnp.int32),
                        jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="page size"):
        forward_ragged(model, bad, batch, implementation="reference")
    with pytest.raises(ValueError, match="index-K layers"):
        check_cache(init_cache(cfg.replace(layer_types=("full_attention",) * 4), 4), cfg)


def test_batch_past_the_maximum_position_is_refused(model):
    cache = init_cache(model.cfg, 32, dtype=jnp.float32)
    batch = RaggedBatch(jnp.zeros((4,), jnp.int32), jnp.asarray([0, 4], jnp.int32), jnp.asarray([68], jnp.int32),
                        jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match="seq_lens\\[0\\]=68 exceeds the model's 64 positions"):
        forward_ragged(model, cache, batch, implementation="reference")


def test_plain_rms_norm_when_not_gemma():
    x = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    w = np.linspace(0.5, 2.0, 8).astype(np.float32)
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w
    norm = RMSNorm(8, eps=1e-6, dtype=jnp.float32, gemma=False)
    assert np.allclose(np.asarray(norm.weight[...]), 1.0)  # identity at init
    norm.weight[...] = jnp.asarray(w)
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, rtol=1e-5)
    gemma = RMSNorm(8, eps=1e-6, dtype=jnp.float32)
    gemma.weight[...] = jnp.asarray(w - 1.0)
    np.testing.assert_allclose(np.asarray(gemma(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)


def test_use_gemma_norm_false_model_matches_shifted_weights(tmp_path):
    """A checkpoint with plain norms (w) equals the Gemma model with weights w - 1."""
    import jax
    from flax import nnx

    cfg = MiniMaxM3Config.tiny()
    gemma = init_model(cfg, dtype=jnp.float32, seed=3)
    plain = init_model(cfg.replace(use_gemma_norm=False), dtype=jnp.float32, seed=3)
    state = nnx.state(gemma, nnx.Param)
    shifted = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 1.0 if "norm" in jax.tree_util.keystr(path) and "weight" in jax.tree_util.keystr(path)
        else x, state)
    nnx.update(plain, shifted)
    ids = np.random.default_rng(1).integers(0, 256, size=(2, 20)).astype(np.int32)
    forward = jax.jit(lambda m, x: m(x))
    np.testing.assert_allclose(np.asarray(forward(plain, ids)), np.asarray(forward(gemma, ids)), rtol=1e-4,
                               atol=1e-5)


# ----------------------------------------------------------------------------------------------- CLI
HF_TINY = os.path.join(FIXTURES, "hf_tiny")


@pytest.mark.parametrize("argv, match", [
    (["forward", "--model", HF_TINY, "--ids", "1 2 300"], "token id 300, outside the vocabulary [0, 256)"),
    (["forward", "--model", HF_TINY, "--ids", "-1 2"], "token id -1"),
    (["forward", "--model", HF_TINY, "--ids", ""], "empty"),
    (["forward", "--model", "/nonexistent/dir"], "/nonexistent/dir"),
])
def test_cli_errors_are_one_line(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("minimax-jax: error:")]
    assert len(errors) == 1 and match in errors[0], err
    assert not any("Traceback" in line for line in err)


def test_cli_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="token id 300"):
        main(["--debug", "forward", "--model", HF_TINY, "--ids", "1 2 300"])


def test_cli_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["forward", "--model", HF_TINY, "--max-new-tokens", "-2"])
    assert e.value.code == 2
    assert "must be >= 0" in capsys.readouterr().err


def test_cli_forward_runs(capsys):
    assert main(["forward", "--model", HF_TINY, "--max-new-tokens", "0"]) == 0
    out = capsys.readouterr().out
    assert "greedy new ids : []" in out and "shape (1, 8, 256)" in out
    assert load_model(HF_TINY, dtype=jnp.float32).cfg.vocab_size == 256


def test_cli_generate_on_the_embedded_default(capsys):
    assert main(["generate", "def add(a, b):", "--max-new-tokens", "6", "--k", "3", "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def add(a, b):") and "verification adaptive, K = 3" in out
    assert "acceptance length" in out


@pytest.mark.parametrize("argv, match", [
    (["generate", "--drafter", "/tmp/x"], "--drafter needs --model"),
    (["generate", "--model", HF_TINY, "x"], "--verification adaptive needs a drafter"),
    (["generate", "--model", HF_TINY, "--verification", "none", "x"], "no tokenizer"),
    (["generate", "--ids", "1 5 999999", "--max-new-tokens", "2"], "token id 999999"),
    (["generate", "x", "--k", "9"], "num_speculative_tokens must be in [1, 7]"),
])
def test_cli_generate_errors_are_one_line(capsys, argv, match):
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("minimax-jax: error:")]
    assert len(err) == 1 and match in err[0], err
