"""The embedded default: a clear error while the weights are absent, and the whole training pipeline in smoke
size (corpus -> tokenizer -> target with a resume -> drafter + STS -> export) loading through load_default."""

import importlib.util
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.default import DEFAULT_DIR, DefaultModelMissing, check_default_present, load_default

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_missing_default_says_how_to_build(tmp_path):
    with pytest.raises(DefaultModelMissing, match="train_default.sh") as e:
        load_default(path=tmp_path)
    assert str(tmp_path / "target" / "model.safetensors") in str(e.value)
    try:  # the package's own default: present once the trained weights are committed
        check_default_present()
    except DefaultModelMissing as err:
        assert "minimax_jax/assets/default" in str(err) or "this package" in str(err)
    else:
        target, drafter, tokenizer = load_default()
        assert target.cfg.vocab_size == tokenizer.vocab_size and drafter.cfg.sts_temperatures is not None


@pytest.mark.slow
def test_smoke_pipeline_end_to_end(tmp_path, capsys):
    tok, corp = tmp_path / "tok", tmp_path / "corpus"
    assert script("prepare_corpus").main(["--out", str(corp), "--tokenizer-dir", str(tok), "--train-tokenizer",
                                          "--vocab-size", "384", "--max-files", "40",
                                          "--heldout-fraction", "0.1"]) == 0
    common = ["--corpus", str(corp), "--tokenizer", str(tok)]
    target_run = tmp_path / "target"
    train_target = script("train_target")
    # stopped after 3 of 6 steps, then resumed: the run finishes where it left off
    assert train_target.main(["--smoke", *common, "--run-dir", str(target_run), "--stop-after", "3"]) == 0
    first = json.loads((target_run / "results.json").read_text())
    assert first["steps"] == 3 and not first["finished"]
    assert train_target.main(["--smoke", *common, "--run-dir", str(target_run)]) == 0
    assert "resuming from step 3" in capsys.readouterr().out
    res_t = json.loads((target_run / "results.json").read_text())
    assert res_t["steps"] == 6 and res_t["finished"] and np.isfinite(res_t["heldout_bpb_bf16_export"])
    steps_logged = [r["step"] for r in map(json.loads, (target_run / "metrics.jsonl").read_text().splitlines())
                    if "ce" in r]
    assert steps_logged == sorted(set(steps_logged)) and steps_logged[-1] == 6
    assert (target_run / "loss.png").stat().st_size > 0

    drafter_run = tmp_path / "drafter"
    assert script("train_drafter").main(["--smoke", *common, "--target", str(target_run / "export"),
                                         "--run-dir", str(drafter_run), "--report-ks", "3,7"]) == 0
    res_d = json.loads((drafter_run / "results.json").read_text())
    assert set(res_d["report"]) == {"K3_greedy", "K7_greedy", "K3_T1", "K7_T1"}
    assert len(res_d["sts_temperatures"]) == 7 and "ece_after_sts" in res_d["report"]["K7_T1"]
    assert (drafter_run / "completions.md").read_text().count("Completion:") == 2

    dest = tmp_path / "default"
    dest.mkdir()
    shutil.copy(os.path.join(DEFAULT_DIR, "prompts.json"), dest / "prompts.json")
    assert script("export_default").main([
        "--target", str(target_run / "export"), "--drafter", str(drafter_run / "export"), "--tokenizer", str(tok),
        "--dest", str(dest), "--target-results", str(target_run / "results.json"),
        "--drafter-results", str(drafter_run / "results.json"), "--new-tokens", "4"]) == 0
    assert "| 7 | T = 1 |" in capsys.readouterr().out
    target, drafter, tokenizer = load_default(path=dest)
    assert target.embed_tokens[...].dtype == jnp.bfloat16 and tokenizer.vocab_size == 384
    assert drafter.cfg.sts_temperatures == tuple(res_d["sts_temperatures"])
    assert drafter.cfg.mask_token_id == tokenizer.mask_token_id
    # an over-budget default is refused
    with pytest.raises(SystemExit, match="budget"):
        script("export_default").main(["--target", str(target_run / "export"), "--drafter",
                                       str(drafter_run / "export"), "--tokenizer", str(tok), "--dest",
                                       str(tmp_path / "x"), "--max-bytes", "1000"])
