"""scripts/profile_step.py and scripts/op_trace.py at tiny shapes on CPU: per-op times read from a profiler
trace of the real whole step (every op's named scope found, with kernels and a positive time; the rows add up
to the traced busy time, within each run's span and wall), the roofline arithmetic, the table and JSON, and the
byte / FLOP formulas against hand counts."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tuning
from scripts import op_trace
from scripts import profile_step as ps

H200 = ps.CHIP_PEAKS["h200"]
ROW_KEYS = {
    "op",
    "scope",
    "layer",
    "group",
    "in_sum",
    "time_ms",
    "kernels",
    "fused",
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
# On CPU XLA fuses a layer's closing residual add (and the MoE's combine) into the next op's kernel: those rows
# may have no kernel of their own. Every other op must show up in the trace.
MAY_FUSE = ("residual", "moe_combine")


def quiet(*_):
    pass


def check_rows(profile: dict):
    """Every row: a real time (finite, >= 0; > 0 with kernels), roofline = max(bytes / HBM, FLOPs / peak),
    ratio and flag from it; the summary sums the rows of the step, which add up to the trace's busy time,
    within the traced calls' device span and host wall."""
    rows = profile["rows"]
    for r in rows:
        assert ROW_KEYS <= set(r), r["op"]
        assert isinstance(r["time_ms"], float) and math.isfinite(r["time_ms"]) and r["time_ms"] >= 0, r
        if r["op"] == op_trace.UNATTRIBUTED or r["bytes"] is None:
            continue
        assert r["bytes"] > 0 and r["flops"] >= 0
        assert (r["kernels"] > 0) == (r["time_ms"] > 0) == (not r["fused"]), r
        if r["fused"]:
            assert r["op"].rsplit(".", 1)[-1] in MAY_FUSE, r["op"]
        want = 1e3 * max(r["bytes"] / H200.hbm_bytes_per_s, r["flops"] / H200.bf16_flops_per_s)
        assert r["roofline_ms"] == pytest.approx(want, rel=1e-9)
        assert r["bound"] == (
            "hbm" if r["bytes"] / H200.hbm_bytes_per_s >= r["flops"] / H200.bf16_flops_per_s else "compute"
        )
        if r["fused"]:
            assert r["ratio"] is None and not r["flag"]
        else:
            assert r["ratio"] == pytest.approx(r["time_ms"] / r["roofline_ms"])
            assert r["flag"] == (r["ratio"] > ps.FLAG_RATIO)
    s = profile["summary"]
    part = [r for r in rows if r["in_sum"]]
    assert s["sum_of_ops_ms"] == pytest.approx(sum(r["time_ms"] for r in part))
    assert s["bytes"] == pytest.approx(sum(r["bytes"] for r in part if r["bytes"] is not None))
    assert s["gap_ms"] == pytest.approx(s["whole_step_ms"] - s["sum_of_ops_ms"])
    assert s["whole_step_ms"] > 0 and s["trace_platform"] == "cpu" and s["trace_runs"] == 2
    assert s["sum_of_ops_ms"] == pytest.approx(s["device_busy_ms"], rel=1e-6)
    assert 0 < s["device_busy_ms"] <= s["device_span_ms"] * (1 + 1e-9)
    assert s["device_span_ms"] <= s["traced_wall_ms"]
    assert 0 <= s["unattributed_share"] < 0.25
    assert set(s["flagged"]) == {r["op"] for r in part if r["flag"]}
    table = ps.format_table(ps.table_rows(profile))
    assert table.splitlines()[0].split()[:4] == ["op", "time_ms", "roofline_ms", "ratio"]
    assert "= sum of ops" in table and "= whole step" in table and "= device span" in table
    assert len(table.splitlines()) == len(rows) + 4


def test_verify_profile(tmp_path):
    """One dense + one MSA/MoE layer at 4 requests x 8 tokens: every op of forward_ragged is a row with its
    scope's traced time, and the data-dependent roofline terms come from the step's own selections."""
    out = tmp_path / "p.json"
    args = ps.parse_args(["--tiny", "--skip-draft", "--shapes", "4x8", "--iters", "1", "--warmup", "0",
                          "--trace-calls", "2", "--out", str(out)])
    result = ps.run(args, log=quiet)
    (prof,) = result["profiles"]
    names = [r["op"] for r in prof["rows"]]
    dense = ["input_norm", "qkv_proj", "cache_write", "paged_attention", "o_proj", "post_norm", "dense_mlp",
             "residual"]
    msa = ["input_norm", "qkv_proj", "indexer_proj", "cache_write", "index_topk", "sparse_attention", "o_proj",
           "post_norm", "router", "routed_experts", "shared_expert", "moe_combine", "residual"]
    want = (["metadata+rope", "embed"] + [f"L0.dense.mlp.{n}" for n in dense] + [f"L1.msa.moe.{n}" for n in msa]
            + ["final_norm", "lm_head"])
    assert names[: len(want)] == want
    assert names[len(want):] in ([], [op_trace.UNATTRIBUTED])  # no scope outside the roofline model
    check_rows(prof)
    rows = {r["op"]: r for r in prof["rows"]}
    assert rows["L1.msa.moe.qkv_proj"]["scope"] == "layer1/qkv_proj"
    assert prof["tokens"] == 32 and prof["logit_rows"] == 32 and prof["summary"]["logits_finite"]
    # Hand counts: the LM head (2 N d V; W, h, fp32 logits); the sparse layer's selections are the step's
    # (topk 4 blocks of 16 of 128-token contexts: a request's union holds 4..8 blocks per KV head).
    n, d, v = 32, 64, 512
    assert rows["lm_head"]["flops"] == 2 * n * d * v
    assert rows["lm_head"]["bytes"] == (d * v + n * d + n * v) * 4
    assert 4 <= rows["L1.msa.moe.sparse_attention"]["union_mean_blocks"] <= 8
    assert 1 <= rows["L1.msa.moe.routed_experts"]["experts_hit"] <= 8

    on_disk = json.loads(out.read_text())
    assert on_disk["chip"]["hbm_bytes_per_s"] == H200.hbm_bytes_per_s and on_disk["method"] == "trace"
    assert on_disk["environment"]["dispatch_ms"] > 0
    assert [r["op"] for r in on_disk["profiles"][0]["rows"]] == names


def test_draft_profile(tmp_path):
    """A 1-layer drafter at R = 4, K = 7 on a paged cache with shuffled pages: the draft-step ops from the
    trace of draft_step, the context write (append_context_packed_step) beside it (not in the sum), the floor
    is the context read plus the LM head."""
    out = tmp_path / "d.json"
    result = ps.main(["--tiny", "--skip-verify", "--draft-layers", "1", "--draft-rows", "4", "--iters", "1",
                      "--warmup", "0", "--trace-calls", "2", "--out", str(out)])
    (prof,) = result["profiles"]
    assert prof["shape"] == "R4xK7xL1" and prof["block_size"] == 7
    names = [r["op"] for r in prof["rows"]]
    step = ["block_inputs", "D0.input_norm", "D0.qkv_proj", "D0.draft_attention[reference]", "D0.o_proj",
            "D0.post_norm", "D0.mlp", "final_norm", "lm_head", "sampling", "confidence_head"]
    beside = ["ctx.positions", "ctx.feature_proj", "ctx.context_kv", "ctx.scatter"]
    assert [n for n in names if n != op_trace.UNATTRIBUTED] == step + beside
    assert [r["op"] for r in prof["rows"] if r["in_sum"] and r["op"] != op_trace.UNATTRIBUTED] == step
    check_rows(prof)
    s = prof["summary"]
    assert s["tokens_match[reference]"] == 1.0 and s["tokens_finite"]
    for key in ("whole_draft_step_ms", "whole_draft_step[reference]_ms", "whole_append_context_ms",
                "context_write_sum_ms"):
        assert s[key] > 0
    assert prof["attention_implementations"] == ["reference"]  # auto on CPU
    rows = {r["op"]: r for r in prof["rows"]}
    assert all(rows[n]["kernels"] > 0 for n in beside)
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


def test_engine_step_profile():
    """spec_decode/step.py's whole step (4 decode rows drafting and verifying K = 7): its parts are found in the
    trace, with the drafter's and the target's ops inside ``draft`` and ``verify``."""
    result = ps.main(["--tiny", "--skip-verify", "--skip-draft", "--engine-rows", "4", "--draft-layers", "1",
                      "--iters", "1", "--warmup", "0", "--trace-calls", "2"])
    (prof,) = result["profiles"]
    assert prof["step"] == "engine" and prof["tokens"] == 32
    check_rows(prof)
    s = prof["summary"]
    assert {"install_tables", "draft", "pack", "verify", "rejection", "bookkeeping"} <= set(s["ms_by_part"])
    assert all(v > 0 for v in s["ms_by_part"].values()) and s["tokens_finite"]
    assert sum(s["ms_by_part"].values()) <= s["sum_of_ops_ms"] * (1 + 1e-9)
    rows = {r["op"]: r for r in prof["rows"]}
    for name in ("draft.D0.draft_attention", "draft.lm_head", "verify.L1.msa.moe.sparse_attention",
                 "verify.lm_head", "ctx.context_kv"):
        assert rows[name]["kernels"] > 0 and rows[name]["time_ms"] > 0, name
    assert rows["verify.L1.msa.moe.qkv_proj"]["scope"] == "verify/layer1/qkv_proj"


def test_trace_attribution_of_named_scopes():
    """op_trace on a small program: HLO instructions map to their scopes, every scope's kernels are found in
    the trace of the real run, and a 4x larger matmul takes longer than a small one."""

    def f(x, w):
        with jax.named_scope("big"):
            y = jnp.tanh(x @ w) @ w
        with jax.named_scope("small"):
            z = jnp.tanh(y[:64, :64] @ w[:64, :64])
        return z.sum()

    x = jnp.ones((512, 512), jnp.float32)
    w = jnp.full((512, 512), 1e-3, jnp.float32)
    compiled = jax.jit(f).lower(x, w).compile()
    scopes = op_trace.hlo_scopes(compiled.as_text())
    assert {s for s in scopes.values() if s} == {("big",), ("small",)}
    assert op_trace.module_name(compiled.as_text()) == "jit_f"
    times = op_trace.profile_compiled(compiled, lambda: compiled(x, w), calls=3)
    assert times.runs == 3 and times.platform == "cpu"
    assert times.scopes[("big",)] > times.scopes[("small",)] > 0
    assert sum(times.scopes.values()) == pytest.approx(times.busy_s)
    assert times.busy_s <= times.span_s <= times.wall_s


def test_host_activity_nests_and_sums_by_name():
    """Host events sum by name per thread: a parent's self time excludes what nests in it; a name run on two
    threads counts both. A traced compile shows XLA's compiler annotations."""
    ms = 1_000_000
    t0 = [(0, 10 * ms, "load"), (1 * ms, 3 * ms, "parse"), (5 * ms, 2 * ms, "parse"), (20 * ms, 1 * ms, "load")]
    t1 = [(0, 4 * ms, "parse")]
    rows = {r["name"]: r for r in op_trace.activity_rows([t0, t1])}
    assert rows["load"] == {"name": "load", "count": 2, "total_ms": 11.0, "self_ms": 6.0, "max_ms": 10.0,
                            "threads": 1}
    assert rows["parse"] == {"name": "parse", "count": 3, "total_ms": 9.0, "self_ms": 9.0, "max_ms": 4.0,
                             "threads": 2}
    assert [r["name"] for r in op_trace.activity_rows([t0, t1])] == ["parse", "load"]
    x = jnp.arange(float(np.random.default_rng().integers(3, 50)))
    rows = op_trace.host_activity(lambda: jax.jit(lambda v: jnp.cos(v) * 3)(x), top=200)
    assert rows and all(0 <= r["self_ms"] <= r["total_ms"] + 1e-3 and r["count"] >= 1 for r in rows)
    assert any("Compile" in r["name"] for r in rows)


def test_overlap_sharing_and_run_split():
    """Overlapping events share their common time equally; runs split at run ids, else at the widest gaps."""
    ev = op_trace.Event
    a, b, c = ev("a", 0, 10, None, "t0"), ev("b", 5, 10, None, "t1"), ev("c", 100, 4, None, "t0")
    assert op_trace._shared_durations([a, b, c]) == [7.5, 7.5, 4.0]
    assert [[e.op for e in r] for r in op_trace.split_runs([c, a, b], 2)] == [["a", "b"], ["c"]]
    tagged = [ev("x", 0, 1, 7, "t"), ev("y", 2, 1, 8, "t"), ev("z", 3, 1, 7, "t")]
    assert [[e.op for e in r] for r in op_trace.split_runs(tagged, 2)] == [["x", "z"], ["y"]]
    # a while thunk around its body's thunks: only the body's count
    parent, child = ev("while.1", 0, 10, 1, "t"), ev("dot.2", 1, 3, 1, "t")
    assert op_trace._innermost([parent, child]) == [child]
    assert op_trace.scope_of("jit(step)/layer0/index_topk/jit(ragged_index_topk)/while/body/eval_jaxpr/add") == (
        "layer0", "index_topk")
    assert op_trace.scope_of("jit(f)/layer0/paged_attention/tgjd,tgkpd->tgjkp/dot_general") == (
        "layer0", "paged_attention")


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
    with pytest.raises(ValueError, match="draft attention"):
        ps.draft_attention_impls("triton")
    assert ps.roofline(989e12, 1.0, H200) == (pytest.approx(1.0), "compute")
    assert jax.default_backend() == "cpu"
    # the roofline constants live with the chip vocabulary (pallas_kernels.tuning), one family per GPU model
    assert all(peak.chip in tuning.TABLES for peak in tuning.PEAKS.values())
    assert tuning.detect_peak() is None and ps.parse_args(["--tiny"]).chip == tuning.DEFAULT_PEAK
