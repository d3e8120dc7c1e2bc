"""scripts/profile_step.py at tiny shapes on CPU: the table and JSON structure, the roofline arithmetic, the
op chain against the whole jitted step, and the FLOP / byte formulas against XLA's own count and a hand
count."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from scripts import profile_step as ps

H200 = ps.CHIP_PEAKS["h200"]
ROW_KEYS = {
    "op",
    "layer",
    "group",
    "in_sum",
    "time_ms",
    "flops",
    "bytes",
    "roofline_ms",
    "bound",
    "ratio",
    "flag",
    "achieved_TBps",
    "achieved_TFLOPs",
    "note",
}


def quiet(*_):
    pass


def check_rows(profile: dict):
    """Every row: positive time, roofline = max(bytes / HBM, FLOPs / peak), ratio and flag from it; the
    summary sums the rows that are part of the step."""
    rows = profile["rows"]
    for r in rows:
        assert ROW_KEYS <= set(r), r["op"]
        assert r["time_ms"] > 0 and r["bytes"] > 0 and r["flops"] >= 0
        want = 1e3 * max(r["bytes"] / H200.hbm_bytes_per_s, r["flops"] / H200.bf16_flops_per_s)
        assert r["roofline_ms"] == pytest.approx(want, rel=1e-9)
        assert r["bound"] == (
            "hbm" if r["bytes"] / H200.hbm_bytes_per_s >= r["flops"] / H200.bf16_flops_per_s else "compute"
        )
        assert r["ratio"] == pytest.approx(r["time_ms"] / r["roofline_ms"])
        assert r["flag"] == (r["ratio"] > ps.FLAG_RATIO)
    s = profile["summary"]
    part = [r for r in rows if r["in_sum"]]
    assert s["sum_of_ops_ms"] == pytest.approx(sum(r["time_ms"] for r in part))
    assert s["bytes"] == pytest.approx(sum(r["bytes"] for r in part))
    assert s["gap_ms"] == pytest.approx(s["whole_step_ms"] - s["sum_of_ops_ms"])
    assert s["whole_step_ms"] > 0
    assert set(s["flagged"]) == {r["op"] for r in part if r["flag"]}
    table = ps.format_table(ps.table_rows(profile))
    assert table.splitlines()[0].split()[:4] == ["op", "time_ms", "roofline_ms", "ratio"]
    assert "= sum of ops" in table and "= whole step" in table
    assert len(table.splitlines()) == len(rows) + 3


def test_verify_profile(tmp_path):
    """One dense + one MSA/MoE layer at 4 requests x 8 tokens: every op of forward_ragged is there, the op
    chain gives the whole step's logits, and XLA's cost analysis agrees with the LM head's and o_proj's
    counts."""
    out = tmp_path / "p.json"
    args = ps.parse_args(
        ["--tiny", "--skip-draft", "--shapes", "4x8", "--iters", "1", "--warmup", "0", "--out", str(out)]
    )
    ops = []
    result = ps.run(args, log=quiet, ops_out=ops)
    (prof,) = result["profiles"]
    names = [r["op"] for r in prof["rows"]]
    dense = [
        "input_norm",
        "qkv_proj",
        "cache_write",
        "paged_attention",
        "o_proj",
        "post_norm",
        "dense_mlp",
        "residual",
    ]
    msa = [
        "input_norm",
        "qkv_proj",
        "indexer_proj",
        "cache_write",
        "index_topk",
        "sparse_attention",
        "o_proj",
        "post_norm",
        "router",
        "routed_experts",
        "shared_expert",
        "moe_combine+residual",
    ]
    assert names == (
        ["metadata+rope", "embed"]
        + [f"L0.dense.mlp.{n}" for n in dense]
        + [f"L1.msa.moe.{n}" for n in msa]
        + ["final_norm", "lm_head"]
    )
    check_rows(prof)
    assert prof["summary"]["chain_vs_step_rel_err"] < 1e-5
    assert prof["routed_excludes_router"]  # the routed-experts op ran with the router's output given
    assert prof["tokens"] == 32 and prof["logit_rows"] == 32

    # FLOPs / bytes against XLA's count of the same jitted op (its HLO cost analysis, before fusion).
    by_name = {o.name: o for o in ops}

    def xla_cost(op):
        cost = op.fn.lower(*op.args).cost_analysis()
        return cost[0] if isinstance(cost, list) else cost

    head = by_name["lm_head"]
    cost = xla_cost(head)
    assert cost["flops"] == pytest.approx(head.flops, rel=1e-6)  # 2 N d V
    assert cost["bytes accessed"] == pytest.approx(head.bytes, rel=1e-6)  # W + h + fp32 logits
    for name in ("L0.dense.mlp.o_proj", "L1.msa.moe.o_proj"):
        assert xla_cost(by_name[name])["flops"] == pytest.approx(
            by_name[name].flops, rel=0.02
        )  # + residual add
    mlp = by_name["L0.dense.mlp.dense_mlp"]
    assert xla_cost(mlp)["flops"] == pytest.approx(mlp.flops, rel=0.1)  # matmuls; swigluoai is elementwise

    # The JSON on disk: the same rows.
    on_disk = json.loads(out.read_text())
    assert on_disk["chip"]["hbm_bytes_per_s"] == H200.hbm_bytes_per_s
    assert on_disk["environment"]["dispatch_ms"] > 0
    assert [r["op"] for r in on_disk["profiles"][0]["rows"]] == names


def test_draft_profile(tmp_path):
    """A 1-layer drafter at R = 4, K = 7 on a paged cache with shuffled pages: the draft-step ops, the context
    write and the engine's table install beside it (not in the sum), the chain's tokens equal draft_step's, the
    floor is the context read plus the LM head."""
    out = tmp_path / "d.json"
    result = ps.main(
        [
            "--tiny",
            "--skip-verify",
            "--draft-layers",
            "1",
            "--draft-rows",
            "4",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--out",
            str(out),
        ]
    )
    (prof,) = result["profiles"]
    assert prof["shape"] == "R4xK7xL1" and prof["block_size"] == 7
    names = [r["op"] for r in prof["rows"]]
    step = [
        "block_inputs",
        "D0.input_norm",
        "D0.qkv_proj",
        "D0.draft_attention[reference]",
        "D0.o_proj",
        "D0.post_norm",
        "D0.mlp",
        "final_norm",
        "lm_head",
        "sampling",
    ]
    beside = ["ctx.feature_proj", "ctx.context_kv", "ctx.scatter", "engine.install_tables"]
    assert names == step + beside
    assert [r["op"] for r in prof["rows"] if r["in_sum"]] == step
    check_rows(prof)
    s = prof["summary"]
    assert s["chain_tokens_match"] == 1.0
    for key in ("whole_draft_step_ms", "whole_draft_step[reference]_ms", "whole_engine_draft_rows_ms",
                "whole_append_context_ms"):
        assert s[key] > 0
    assert prof["attention_implementations"] == ["reference"]  # auto on CPU
    rows = {r["op"]: r for r in prof["rows"]}
    assert s["floor"]["bytes"] == rows["D0.draft_attention[reference]"]["bytes"] + rows["lm_head"]["bytes"]
    assert s["floor"]["flops"] == rows["lm_head"]["flops"]
    # Hand count of the draft attention: 4 rows x 7 slots x 4 heads x (128 context + 7 block keys) x 16 x 4;
    # bytes: context K/V of 4 rows x 128 x 2 KV heads x 16, block K/V, q and out (fp32 in the tiny run), the
    # lengths and the 4 x 128 / 16 block-table entries of the 16-token pages read.
    att = rows["D0.draft_attention[reference]"]
    assert prof["page"] == 16 and att["page"] == 16
    assert att["flops"] == 4 * 7 * 4 * (128 + 7) * 16 * 4
    assert att["bytes"] == (4 * 128 * 2 * 16 * 2 + 28 * 2 * 16 * 2 + 2 * 28 * 4 * 16) * 4 + 4 * 4 + 4 * 8 * 4
    assert json.loads(out.read_text())["profiles"][0]["shape"] == "R4xK7xL1"


def test_union_bytes_and_sparse_flops_by_hand():
    """The sparse-attention byte and FLOP models against brute-force loops on a small selection."""
    rng = np.random.default_rng(0)
    page, topk, groups, heads, dim = 4, 3, 2, 3, 8
    q_lens = [3, 0, 5, 1]
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    seq = [13, 0, 20, 4]
    pos = np.concatenate([s - q + np.arange(q) for s, q in zip(seq, q_lens)])
    sel = np.full((qsl[-1], groups, topk), -1)
    for t, p in enumerate(pos):
        for g in range(groups):
            picks = rng.choice(p // page + 1, size=min(topk, p // page + 1), replace=False)
            sel[t, g, : len(picks)] = picks
    block_bytes = 2 * page * dim * 2
    got, mean = ps._union_bytes(sel, qsl, block_bytes)
    unions = [
        len({int(b) for t in range(qsl[r], qsl[r + 1]) for b in sel[t, g] if b >= 0})
        for r in range(len(q_lens))
        for g in range(groups)
    ]
    assert got == sum(unions) * block_bytes and mean == pytest.approx(np.mean(unions))
    flops = ps._sparse_useful_flops(sel, pos, page=page, heads_per_group=heads, head_dim=dim)
    keys = sum(
        1 for t, p in enumerate(pos) for g in range(groups) for j in range(p + 1) if j // page in sel[t, g]
    )
    assert flops == keys * heads * dim * 4


def test_layer_and_shape_parsing():
    assert ps.parse_layers("dense,msa") == [ps._SHORT["dense"], ps._SHORT["msa"]]
    assert ps.parse_layers("full+moe") == [(ps.FULL_ATTENTION, ps.MOE_MLP)]
    assert ps.parse_shapes(ps.M3_SHAPES) == [(64, 8), (256, 8), (512, 1), (512, 8)]
    with pytest.raises(ValueError, match="layer"):
        ps.parse_layers("dense,attn")
    assert ps.roofline(989e12, 1.0, H200) == (pytest.approx(1.0), "compute")
    assert jax.default_backend() == "cpu"
