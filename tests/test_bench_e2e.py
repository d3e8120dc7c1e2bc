"""``scripts/bench_e2e.py`` on CPU at tiny sizes: the embedded default in f32, two requests, three modes, both
loops and the calibration rollout; then a second call that resumes (records nothing new) and ``--plot-only``.
The report helpers (mode parsing, ratio and markdown tables) on synthetic rows."""

import json
import os

import numpy as np
import pytest

from scripts import bench_e2e
from spec_decode.engine import DEVICE_LOOP_PLAN_INTERVAL

ROW_KEYS = {"n", "mode", "loop", "K", "draft_lengths", "output_tokens_per_s", "ms_per_output_token",
            "mean_acceptance_length", "mean_verified_drafts_per_step", "mean_drafted_tokens_per_step",
            "draft_length_per_step", "per_position_acceptance", "predicted_per_position_acceptance",
            "calibration_error", "timed_compiles", "startup_s", "host_time_per_step_s", "wall_time_s",
            "match_none", "token_digests", "per_set_wall_s", "per_set_decode_loop_s", "decode_loop_tokens_per_s",
            "per_set_verify_steps", "per_set_ms_per_loop_iteration", "per_set_plan"}

TINY = ["--dtype", "float32", "--requests", "2", "--modes", "none", "fixed2", "adaptive", "--loops", "host",
        "device", "--prompt-len", "32", "--max-new-tokens", "8", "--min-token-bucket", "32",
        "--max-num-batched-tokens", "32"]


@pytest.mark.slow
def test_sweep_and_calibration_on_cpu(tmp_path, capsys):
    out = tmp_path / "e2e"
    bench_e2e.main(["--out", str(out), *TINY, "--calibration", "--calibration-prompts", "2",
                    "--calibration-new-tokens", "8", "--dump-loop-hlo"])
    for name in ("bench_e2e.jsonl", "bench_e2e.json", "bench_e2e.md", "tokens_per_s.png", "adaptive_ratio.png",
                 "calibration.json", "reliability.png"):
        assert (out / name).is_file(), name
    rows = [json.loads(line) for line in (out / "bench_e2e.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["loop"]) for r in rows] == [(m, lp) for m in ("none", "fixed2", "adaptive")
                                                       for lp in ("host", "device")]
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["n"] == 2 and r["output_tokens_per_s"] > 0 and r["ms_per_output_token"] > 0
        assert r["timed_compiles"] == 0
        assert r["match_none"] == 1.0  # greedy, f32: every mode gives the target's own tokens
        assert r["prefix_cache_tokens"] == 0
        if r["loop"] == "device":
            assert r["match_host"] == 1.0
            # the loop program's HLO, written and summarised: a while loop whose body runs the step
            assert (out / r["loop_hlo"]["file"]).is_file()
            roles = [c["role"] for c in r["loop_hlo"]["computations"]]
            assert sum(role.endswith(": body") for role in roles) >= 1
            if r["mode"] == "adaptive":  # several draft lengths: a switch over them
                assert any(": branch " in role for role in roles)
            assert 0 < r["per_set_decode_loop_s"][0] < r["per_set_wall_s"][0] and r["decode_loop_tokens_per_s"] > 0
            # the loop's iterations: 8 new tokens, the first from the prefill, so 7 one token at a time (none)
            # and fewer with accepted drafts; its milliseconds per iteration from them
            assert all(1 <= it <= 7 for it in r["per_set_verify_steps"])
            assert r["K"] > 0 or r["per_set_verify_steps"] == [7] * len(r["per_set_verify_steps"])
            assert r["per_set_ms_per_loop_iteration"][0] == pytest.approx(
                1e3 * r["per_set_decode_loop_s"][0] / r["per_set_verify_steps"][0])
        else:
            assert set(r["per_set_decode_loop_s"]) == {None} and r["decode_loop_tokens_per_s"] is None
            assert set(r["per_set_ms_per_loop_iteration"]) == {None}
        assert sum(r["per_set_wall_s"]) == pytest.approx(r["wall_time_s"])
        # each set's plan, one entry per verify step; the first set's lengths are draft_length_per_step
        assert len(r["per_set_plan"]) == len(r["per_set_verify_steps"])
        for plan, steps in zip(r["per_set_plan"], r["per_set_verify_steps"]):
            assert {key: len(v) for key, v in plan.items()} == dict.fromkeys(plan, steps), plan
            assert all(0 <= v <= b for v, b in zip(plan["verified"], plan["budget"])), plan
            assert all(t > 0 for t in plan["verify_tokens"]) and set(plan["draft_length"]) <= {0, *r["draft_lengths"]}
        assert r["per_set_plan"][0]["draft_length"] == r["draft_length_per_step"]
        assert r["K"] == {"none": 0, "fixed2": 2, "adaptive": 7}[r["mode"]]
        if r["mode"] != "none":
            assert r["mean_acceptance_length"] >= 1.0
            assert len(r["per_position_acceptance"]) == r["K"]
    summary = json.loads((out / "bench_e2e.json").read_text())
    assert summary["meta"]["args"]["requests"] == [2] and len(summary["rows"]) == len(rows)
    md = (out / "bench_e2e.md").read_text()
    assert "| requests | none | fixed2 | adaptive |" in md and "adaptive/best" in md

    cal = json.loads((out / "calibration.json").read_text())
    kk = cal["K"]
    assert kk == 7 and cal["records"] > 0
    for key in ("mean_predicted", "observed", "ece"):
        assert len(cal[key]) == kk and all(0.0 <= x <= 1.0 for x in cal[key]), (key, cal[key])
    assert cal["ece"] == pytest.approx(cal["ece_check"], abs=1e-6)  # the rollout module's own ECE
    assert all(sum(p["bins"]["count"]) == p["count"] for p in cal["per_position"])

    # a second call on the same directory resumes: every configuration is recorded, nothing runs again
    capsys.readouterr()
    bench_e2e.main(["--out", str(out), *TINY])
    assert "recorded already, skipped" in capsys.readouterr().out
    assert len((out / "bench_e2e.jsonl").read_text().splitlines()) == len(rows)

    redraw = tmp_path / "redraw"
    bench_e2e.main(["--plot-only", str(out / "bench_e2e.jsonl"), "--out", str(redraw)])
    assert {"tokens_per_s.png", "adaptive_ratio.png", "bench_e2e.md"} <= set(os.listdir(redraw))


@pytest.mark.slow
def test_interleaved_timed_sets(tmp_path, monkeypatch):
    """``--interleave``: the engines warm up first, then each mode makes one settling call, then the timed sets run
    in rounds with the modes' order rotated (fixed2+pi2, fixed2+pi3, none; then fixed2+pi3, none, fixed2+pi2);
    ``none``'s row is written first and the others' ``match_none`` reads it. The two fixed2 modes differ only in
    their plan interval: they run on one engine (fixed2+pi2's), each call at its own interval."""
    from spec_decode import Engine

    calls, generate, engines = [], Engine.generate, {}

    def logged(self, prompts, **kw):
        engines.setdefault(id(self), len(engines))
        calls.append((engines[id(self)], self.device_loop_plan_interval, tuple(prompts[0][:8])))
        return generate(self, prompts, **kw)

    monkeypatch.setattr(Engine, "generate", logged)
    out = tmp_path / "il"
    # fixed2 at two plan intervals of its own (+piN): one engine, each call at its mode's, each row records it
    bench_e2e.main(["--out", str(out), "--dtype", "float32", "--requests", "2", "--modes", "fixed2+pi2",
                    "fixed2+pi3", "none", "--loops", "device", "--prompt-len", "32", "--max-new-tokens", "6",
                    "--min-token-bucket", "32", "--max-num-batched-tokens", "32", "--timed-sets", "2",
                    "--interleave"])
    rows = [json.loads(line) for line in (out / "bench_e2e.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["none", "fixed2+pi2", "fixed2+pi3"]
    assert [r["plan_interval"] for r in rows] == [DEVICE_LOOP_PLAN_INTERVAL, 2, 3]
    assert [r["engine_built_by"] for r in rows] == ["none", "fixed2+pi2", "fixed2+pi2"]
    assert rows[2]["startup_s"] is None and rows[1]["startup_s"] > 0
    assert all(r["timed_compiles"] == 0 and len(r["per_set_wall_s"]) == 2 and r["interleaved"] for r in rows)
    assert rows[1]["match_none"] == rows[2]["match_none"] == 1.0  # f32: the same tokens
    # the warm-up calls, then the settling calls (their prompts: training-split windows, the same as the
    # warm-up's), then the rounds on the held-out sets; engine 0 serves both fixed2 modes, at 2 and at 3
    who = [(e, i) for e, i, _ in calls]
    fixed2, fixed3, none = (0, 2), (0, 3), (1, DEVICE_LOOP_PLAN_INTERVAL)
    assert who == [fixed2, fixed3, none] * 2 + [fixed2, fixed3, none, fixed3, none, fixed2], who
    prompts = [p for _, _, p in calls]
    assert prompts[3:6] == prompts[0:3]
    first, second = prompts[6], prompts[9]
    assert set(prompts[6:9]) == {first} and set(prompts[9:12]) == {second} and first != second
    assert prompts[0] not in (first, second)
    with pytest.raises(SystemExit):
        bench_e2e.main(["--out", str(out), "--interleave", "--loops", "host", "device"])


def test_modes_and_tables():
    assert bench_e2e.mode_settings("fixed3", 7) == {"verification": "fixed", "num_speculative_tokens": 3}
    assert bench_e2e.mode_settings("adaptive-held", 7)["draft_lengths"] == (7,)
    assert bench_e2e.mode_settings("adaptive-calibrated", 7)["confidence"] == "calibrated"
    assert bench_e2e.mode_settings("none", 7)["num_speculative_tokens"] == 0
    with pytest.raises(ValueError):
        bench_e2e.mode_settings("fixedK", 7)
    # adaptive with given draft lengths: on a K = 7 engine drafting 3 only, beside fixed3's K = 3 engine
    assert bench_e2e.mode_settings("adaptive@3,1", 7) == {"verification": "adaptive", "num_speculative_tokens": 7,
                                                          "draft_lengths": (1, 3)}
    # any mode with its own number of loop buckets per draft length (Engine(device_loop_token_buckets=N))
    assert bench_e2e.mode_settings("adaptive+lb2", 7) == {"verification": "adaptive", "num_speculative_tokens": 7,
                                                          "device_loop_token_buckets": 2}
    assert bench_e2e.mode_settings("fixed3+lb1", 7)["device_loop_token_buckets"] == 1
    # ... or its own plan interval (Engine(device_loop_plan_interval=N)), the suffixes in any order
    assert bench_e2e.mode_settings("fixed3+pi8", 7) == {"verification": "fixed", "num_speculative_tokens": 3,
                                                        "device_loop_plan_interval": 8}
    assert (bench_e2e.mode_settings("adaptive+pi2+lb3", 7) == bench_e2e.mode_settings("adaptive+lb3+pi2", 7)
            == {"verification": "adaptive", "num_speculative_tokens": 7, "device_loop_token_buckets": 3,
                "device_loop_plan_interval": 2})
    for bad in ("adaptive+lb0", "adaptive+lb", "adaptive+x2", "fixedK+lb2", "adaptive+pi0", "adaptive+lb2+lb3"):
        with pytest.raises(ValueError, match="lbN|unknown mode|twice"):
            bench_e2e.mode_settings(bad, 7)
    for bad in ("adaptive@", "adaptive@8", "adaptive@x", "adaptive@-1"):
        with pytest.raises(ValueError, match="draft lengths"):
            bench_e2e.mode_settings(bad, 7)
    rows = [{"n": n, "mode": m, "loop": "host", "output_tokens_per_s": v}
            for n, m, v in ((8, "none", 100.0), (8, "fixed7", 200.0), (8, "fixed3", 250.0), (8, "adaptive", 245.0),
                            (64, "none", 400.0), (64, "adaptive", 300.0))]
    ratios = {e["n"]: e for e in bench_e2e.ratio_rows(rows)}
    assert ratios[8]["best_baseline"] == "fixed3"
    assert ratios[8]["adaptive/best"] == pytest.approx(0.98)
    assert ratios[8]["adaptive/fixed7"] == pytest.approx(1.225)
    assert ratios[64]["adaptive/best"] == pytest.approx(0.75) and ratios[64]["adaptive/fixed7"] is None
    md = bench_e2e.markdown(rows)
    assert "| 64 | 400 | - | - | 300 |" in md  # columns: none, fixed3, fixed7, adaptive
    held = rows + [{"n": 8, "mode": "adaptive@3", "loop": "host", "output_tokens_per_s": 240.0}]
    assert bench_e2e.adaptive_modes(held) == ["adaptive", "adaptive@3"]
    assert bench_e2e.adaptive_modes(held + [{"n": 8, "mode": "adaptive+lb2"}]) == ["adaptive", "adaptive+lb2",
                                                                                  "adaptive@3"]
    assert {e["n"]: e for e in bench_e2e.ratio_rows(held)}[8]["adaptive@3/best"] == pytest.approx(0.96)
    assert "adaptive@3/best" in bench_e2e.markdown(held)
    # the decode loop's own tokens/s (device rows): a second table, from the rows that carry it
    loop_rows = [{"n": 8, "mode": m, "loop": "device", "output_tokens_per_s": 1.0, "decode_loop_tokens_per_s": v}
                 for m, v in (("none", 500.0), ("fixed3", 800.0), ("adaptive", 820.0))]
    (e,) = bench_e2e.ratio_rows(loop_rows, "decode_loop_tokens_per_s")
    assert e["best_baseline"] == "fixed3" and e["adaptive/best"] == pytest.approx(1.025)
    assert bench_e2e.ratio_rows(rows, "decode_loop_tokens_per_s") == []  # host rows carry none
    md = bench_e2e.markdown(loop_rows)
    assert "decode loop only" in md and "| device | 8 | fixed3 | 800 | 1.025 | - | - |" in md
    # whether adaptive decoded the best baseline's text: the share of requests with its tokens (bf16 ties differ)
    digests = {"none": ["a", "b", "c", "d"], "fixed3": ["a", "x", "c", "y"], "adaptive": ["a", "b", "c", "d"]}
    tok_rows = [{**r, "token_digests": digests[r["mode"]]} for r in loop_rows]
    (e,) = bench_e2e.ratio_rows(tok_rows, "decode_loop_tokens_per_s")
    assert e["adaptive/same_tokens"] == pytest.approx(0.5)
    assert "| device | 8 | fixed3 | 800 | 1.025 | - | 0.500 |" in bench_e2e.markdown(tok_rows)
    # the median set-by-set ratio, on the sets of equal iteration counts only: set 1 (10 against 11 iterations)
    # and the zero-time set 3 are left out, and set 2's 40% outlier does not move it as it moves the pooled ratio
    sets = {"fixed3": ([0.60, 0.61, 0.90, 0.0, 0.62], [68, 10, 65, 60, 70]),
            "adaptive": ([0.62, 0.50, 0.63, 0.64, 0.64], [68, 11, 65, 60, 70])}
    set_rows = [{**r, **({"per_set_ms_per_loop_iteration": sets[r["mode"]][0],
                          "per_set_verify_steps": sets[r["mode"]][1]} if r["mode"] in sets else {})}
                for r in loop_rows]
    (e,) = bench_e2e.ratio_rows(set_rows, "decode_loop_tokens_per_s")
    assert e["adaptive/best_median_set"] == pytest.approx(np.median([0.60 / 0.62, 0.90 / 0.63, 0.62 / 0.64]))
    assert "adaptive/best_median_set" not in bench_e2e.ratio_rows(set_rows)[0]  # the whole call's table: none
    md = bench_e2e.markdown(set_rows)
    assert "adaptive/best, median set |" in md and f"| 1.025 | - | - | {e['adaptive/best_median_set']:.3f} |" in md
    assert bench_e2e.median_set_ratio({"per_set_ms_per_loop_iteration": [0.6]}, {}) is None
    assert "median set" not in bench_e2e.markdown(loop_rows)  # rows without sets: no column

    # the prefill chunk is part of a configuration: a resumed sweep at another chunk size runs again, and rows
    # from before rows recorded it were measured at 512
    with pytest.raises(SystemExit):  # a clear argparse error before any model loads
        bench_e2e.parse_args(["--out", "x", "--warm-requests", "0"])
    args = bench_e2e.parse_args(["--out", "x"])
    assert args.max_num_batched_tokens == 2048
    row = bench_e2e.this_row(args, 8, "fixed3", "device")
    assert row["max_num_batched_tokens"] == 2048
    old = {k: v for k, v in row.items() if k != "max_num_batched_tokens"}
    assert bench_e2e.config_key(old) == bench_e2e.config_key({**row, "max_num_batched_tokens": 512})
    assert bench_e2e.config_key(old) != bench_e2e.config_key(row)


@pytest.mark.slow
def test_m3_slice_with_emulated_acceptance_on_cpu(tmp_path):
    """``--model m3-slice --m3-tiny`` (the slice's structure at test widths, random weights) with an emulated
    acceptance length of 3 (rates 1, 1, 0, ...), balanced routing and a shared prefix, in both loops: rows say the
    acceptance was emulated, every verify step emits 3 tokens, and the prefix cache served the shared tokens and
    only those (the device loop, timed second on the same prompts, starts from an empty cache as the host did)."""
    out = tmp_path / "m3"
    bench_e2e.main(["--out", str(out), "--model", "m3-slice", "--m3-tiny", "--m3-layers", "3", "--dtype", "float32",
                    "--requests", "2", "--modes", "fixed3", "--loops", "host", "device", "--prompt-len", "48",
                    "--max-new-tokens", "10", "--min-token-bucket", "32", "--max-num-batched-tokens", "48",
                    "--synthetic-acceptance-length", "3", "--shared-prefix", "16", "--timed-sets", "1",
                    "--implementation", "reference", "--balanced-routing"])
    rows = [json.loads(line) for line in (out / "bench_e2e.jsonl").read_text().splitlines()]
    assert [r["loop"] for r in rows] == ["host", "device"]
    for row in rows:
        assert row["model"] == "m3-slice" and row["acceptance"] == "emulated" and row["balanced_routing"]
        assert row["synthetic_rates"] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        assert row["mean_acceptance_length"] == pytest.approx(3.0)
    # the second request reads the first one's 16 shared tokens, and nothing of the previous loop's prompts
    page = rows[0]["prefix_cache_tokens"]
    assert 0 < page <= 16 and rows[1]["prefix_cache_tokens"] == page
    with pytest.raises(SystemExit):  # random weights without emulated acceptance would measure noise
        bench_e2e.parse_args(["--out", str(out), "--model", "m3-slice"])


def test_named_acceptance_profiles_and_the_published_workload(tmp_path):
    """``--synthetic-acceptance-profile`` gives non-increasing rates whose acceptance length is the profile's
    (3.43 for the default's measured one, 2.30 for the flat one); ``--workload published`` sets the seed's shape;
    a profile beside explicit rates is refused."""
    base = ["--out", str(tmp_path), "--model", "m3-slice"]
    lengths = {}
    for name in ("default", "flat"):
        args = bench_e2e.parse_args(base + ["--synthetic-acceptance-profile", name])
        rates = args.synthetic_rates
        assert len(rates) == 7 and all(a >= b for a, b in zip(rates, rates[1:])) and 0 < rates[-1] <= rates[0] <= 1
        lengths[name] = 1 + sum(rates)
    assert lengths["default"] == pytest.approx(3.43, abs=0.01) and lengths["flat"] == pytest.approx(2.30, abs=0.01)
    args = bench_e2e.parse_args(base + ["--synthetic-acceptance-profile", "flat", "--workload", "published"])
    assert (args.prompt_len, args.shared_prefix, args.max_new_tokens) == (550, 200, 150)
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(base + ["--synthetic-acceptance-profile", "flat", "--synthetic-acceptance-length", "3"])
