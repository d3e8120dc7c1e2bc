"""The lm-evaluation-harness adapter (spec_decode/lm_eval_adapter.py) on the embedded default: the in-repo held-out
next-line task gives the same greedy answers and the same log-likelihoods under none, fixed and adaptive
verification. Skipped when the ``lm_eval`` extra is not installed (its host-side helpers are tested anyway)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.default import DefaultModelMissing, load_default

TASKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spec_decode", "lm_eval_tasks")


def test_in_repo_task_files():
    import json

    with open(os.path.join(TASKS, "heldout_next_line.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) >= 8 and all(r["prompt"] and r["target"].strip() for r in rows)
    assert len({r["path"] for r in rows}) == len(rows)  # one item per held-out file


def test_adapter_host_helpers():
    pytest.importorskip("lm_eval")
    from spec_decode.lm_eval_adapter import cut_at_stop

    assert cut_at_stop("a = 1\nb = 2", ["\n"]) == "a = 1"
    assert cut_at_stop("abcXYdef", ["Y", "c"]) == "ab"
    assert cut_at_stop("abc", None) == "abc" and cut_at_stop("abc", "") == "abc"


@pytest.fixture(scope="module")
def default():
    try:
        return load_default(dtype=jnp.float32)
    except DefaultModelMissing:
        pytest.skip("the embedded default is not present")


def test_task_same_under_every_verification(default):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from spec_decode import Engine
    from spec_decode.lm_eval_adapter import MiniMaxJaxLM

    target, drafter, tok = default
    manager = TaskManager(include_path=TASKS)
    runs = {}
    for mode in ("none", "fixed", "adaptive"):
        # one packed-token bucket (64: a 48-token prefill chunk with 4 slots x (1 + K)): a greedy and a sampling
        # program per engine (generate_until is greedy, the log-likelihoods' prompt_logprobs sample)
        engine = Engine(target, drafter if mode != "none" else None, verification=mode, num_speculative_tokens=3,
                        max_num_seqs=4, max_model_len=128, max_num_batched_tokens=48, min_token_bucket=64,
                        implementation="reference", device_loop=False, cost_table=None, tokenizer=tok)
        out = lm_eval.simple_evaluate(model=MiniMaxJaxLM(engine=engine), task_manager=manager, log_samples=True,
                                      bootstrap_iters=0, limit=8, tasks=["minimax_heldout_next_line", "minimax_heldout_next_line_ll"])
        runs[mode] = out
    gen = {m: [s["resps"][0][0] for s in r["samples"]["minimax_heldout_next_line"]] for m, r in runs.items()}
    ll = {m: [s["resps"][0][0] for s in r["samples"]["minimax_heldout_next_line_ll"]] for m, r in runs.items()}
    assert gen["none"] == gen["fixed"] == gen["adaptive"]
    assert any(g.strip() for g in gen["none"])  # the default completes something
    for m in ("fixed", "adaptive"):
        np.testing.assert_allclose([x[0] for x in ll[m]], [x[0] for x in ll["none"]], rtol=1e-5, atol=1e-4)
        assert [x[1] for x in ll[m]] == [x[1] for x in ll["none"]]
        assert runs[m]["results"]["minimax_heldout_next_line"]["exact_match,none"] == \
            runs["none"]["results"]["minimax_heldout_next_line"]["exact_match,none"]
