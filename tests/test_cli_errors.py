"""The command line (spec_decode.cli): every error in what the user typed is one stderr line
``minimax-jax: error: ...`` with exit status 2, settings errors print nothing to stdout, ``--help`` still works."""

import os
import subprocess
import sys

import pytest

from spec_decode.cli import UsageError, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_TINY = os.path.join(ROOT, "tests", "fixtures", "hf_tiny")
PREFIX = "minimax-jax: error:"


def one_error_line(err: str, match: str | None = None) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(PREFIX), lines
    assert "Traceback" not in err
    if match is not None:
        assert match in lines[0], lines[0]
    return lines[0]


def run_cli(*argv, module="spec_decode"):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


# B1: argparse's own errors printed usage plus a message; now one line, exit 2
@pytest.mark.parametrize("argv, match", [
    (["generate", "--max-new-tokens", "abc"], "argument --max-new-tokens: invalid int value: 'abc'"),
    (["generate", "--verification", "bogus"], "argument --verification: invalid choice: 'bogus'"),
    (["generate", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    ([], "the following arguments are required"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["forward", "--model", HF_TINY, "--ids", "1 x 2"], "token ids must be integers"),
    (["forward", "--model", HF_TINY, "--max-new-tokens", "-2"], "must be >= 0"),
])
def test_argument_errors_are_one_line(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    one_error_line(err, match)
    assert out == ""


def test_help_still_prints_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    assert "--max-new-tokens" in capsys.readouterr().out


# B2: settings errors came after the prompt had been printed (on the same line); now before anything
@pytest.mark.parametrize("argv, match", [
    (["generate", "--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
    (["generate", "--temperature", "nan"], "--temperature must be a finite number"),
    (["generate", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["generate", "--top-k", "-3"], "--top-k must be an integer >= 0"),
    (["generate", "--seed", "-1"], "--seed must be an integer in [0, 2**31)"),
    (["generate", "--seed", str(2**31)], "--seed must be an integer in [0, 2**31)"),
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
    (["generate", "--k", "0"], "--k must be >= 1"),
    (["generate", "--max-model-len", "1"], "--max-model-len must be >= 2"),
    (["generate", ""], "the prompt is empty"),
    (["generate", "--ids", ""], "--ids is empty"),
    (["generate", "--stream", "--loop", "device"], "--stream needs --loop host"),
    (["generate", "--repetition-penalty", "0"], "--repetition-penalty must be a finite number > 0"),
    (["generate", "--presence-penalty", "-1"], "--presence-penalty must be a finite number >= 0"),
    (["generate", "--frequency-penalty", "inf"], "--frequency-penalty must be a finite number >= 0"),
    (["generate", "--min-p", "2"], "--min-p must be in [0, 1]"),
    (["generate", "--min-tokens", "200"], "--min-tokens must be an integer in [0, max_new_tokens=96]"),
    (["generate", "--stop", ""], "--stop holds an empty string at position 0"),
])
def test_settings_are_checked_before_anything_is_printed(capsys, argv, match):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    one_error_line(err, match)
    assert out == ""


def test_a_prompt_too_long_for_max_model_len_is_refused_before_printing(capsys):
    assert main(["generate", "a b c d e f g h i j k l m n o p", "--max-model-len", "4", "--k", "1"]) == 2
    out, err = capsys.readouterr()
    one_error_line(err, "more than max_model_len - 1 = 3")
    assert out == ""


# B3: values no named check caught (OverflowError, TypeError) ended in a traceback with status 1
def test_huge_ids_end_as_one_line_through_the_module():
    for argv in (["generate", "--ids", "99999999999999999999999", "--max-new-tokens", "2"],
                 ["forward", "--model", HF_TINY, "--ids", "1 99999999999999999999999"]):
        res = run_cli(*argv)
        assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
        one_error_line(res.stderr, "99999999999999999999999, outside the vocabulary")
        assert res.stdout == ""


def test_module_entry_points():
    res = run_cli("generate", "--top-p", "2")
    assert res.returncode == 2 and res.stdout == ""
    one_error_line(res.stderr, "--top-p must be in (0, 1]")
    old = run_cli("generate", module="minimax_jax")
    assert old.returncode == 2 and old.stdout == ""
    one_error_line(old.stderr, "the command line is 'minimax-jax' (or 'python -m spec_decode')")


def test_debug_still_raises():
    with pytest.raises(UsageError, match="temperature"):
        main(["--debug", "generate", "--temperature", "-1"])
