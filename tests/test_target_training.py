"""Target training: the training forward is the model's forward; indexer distillation, router balancing, the
schedule, resumable loop and bits per byte against independent computations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minimax_jax import init_model
from minimax_jax.model import abstract_model
from minimax_jax.training import loop, presets
from minimax_jax.training import target as tt

CFG = presets.target_config("smoke", vocab_size=300, bos_token_id=0, eos_token_id=1, pad_token_id=2)
RNG = np.random.default_rng(0)
# 40 tokens, index blocks of 8, top-2: tokens of blocks 2..4 have a live selection
IDS = jnp.asarray(RNG.integers(4, 300, (2, 40)), jnp.int32)


@pytest.fixture(scope="module")
def model():
    m = init_model(CFG, dtype=jnp.float32, seed=0)
    # a sharper indexer than the 0.02 init, so selections differ from block order
    for layer in m.layers:
        if layer.self_attn.is_sparse:
            ix = layer.self_attn.indexer
            ix.q_proj.kernel[...] = jnp.asarray(RNG.standard_normal(ix.q_proj.kernel.shape), jnp.float32)
            ix.k_proj.kernel[...] = jnp.asarray(RNG.standard_normal(ix.k_proj.kernel.shape), jnp.float32)
    return m


@nnx.jit(static_argnames=("dense", "distill", "moe_impl"))
def forward(m, ids, dense=False, distill=True, moe_impl="model"):
    hidden, aux = tt.train_forward(m, ids, dense=dense, distill=distill, moe_impl=moe_impl)
    return m.logits(hidden), aux


def test_train_forward_is_the_model_forward(model):
    want = np.asarray(nnx.jit(lambda m, x: m(x))(model, IDS))
    for distill in (False, True):
        for impl in ("model", "all_experts"):
            got, aux = forward(model, IDS, distill=distill, moe_impl=impl)
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5, err_msg=f"{distill} {impl}")
    assert aux["expert_load"].shape == (len(CFG.moe_layer_ids), CFG.num_local_experts)
    # every token picks num_experts_per_tok experts in every MoE layer
    np.testing.assert_array_equal(np.asarray(aux["expert_load"]).sum(-1), IDS.size * CFG.num_experts_per_tok)
    # 2 sparse layers x 2 groups x 2 rows x tokens with >= 2 candidate blocks (positions 16..39)
    assert float(aux["kl_count"]) == 2 * 2 * 2 * 24
    assert 0.0 < float(aux["recall_sum"]) / float(aux["recall_count"]) < 1.0


def test_dense_warmup_equals_selecting_every_block(model):
    dense, _ = forward(model, IDS, dense=True)
    sparse, _ = forward(model, IDS, dense=False)
    assert float(jnp.max(jnp.abs(dense - sparse))) > 1e-4  # selection is live at 40 tokens
    everything = CFG.replace(index_topk_blocks=5)  # 5 blocks of 8 = every block: MSA == dense attention
    graphdef, _ = nnx.split(abstract_model(everything, dtype=jnp.float32))
    wide = nnx.merge(graphdef, nnx.state(model))
    np.testing.assert_allclose(np.asarray(dense), np.asarray(wide(IDS)), atol=2e-5, rtol=1e-5)


def test_attention_block_mass_against_numpy():
    b, s, h, g, d, blk = 1, 6, 4, 2, 3, 4
    q = RNG.standard_normal((b, s, h, d)).astype(np.float32)
    k = RNG.standard_normal((b, s, g, d)).astype(np.float32)
    pos = np.arange(s)[None]
    got = np.asarray(tt.attention_block_mass(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos), block_size=blk))
    want = np.zeros((b, g, s, 2))
    for hh in range(h):
        gg = hh // (h // g)
        for t in range(s):
            sc = np.array([q[0, t, hh] @ k[0, j, gg] / math.sqrt(d) for j in range(t + 1)])
            p = np.exp(sc - sc.max())
            p /= p.sum()
            for j in range(t + 1):
                want[0, gg, t, j // blk] += p[j] / (h // g)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_indexer_distillation_by_hand():
    # block 2, one local block; 8 positions -> 4 blocks; candidates: blocks <= pos // 2 - 1
    scores = np.array([[[[0.0, 1.0, 2.0, 3.0]] * 8]], np.float32)  # [B=1, G=1, S=8, NB=4]
    mass = np.array([[[[0.5, 0.3, 0.2, 0.0]] * 8]], np.float32)
    pos = np.arange(8)[None]
    kl, count = tt.indexer_distillation(jnp.asarray(scores), jnp.asarray(mass), jnp.asarray(pos), block_size=2,
                                        local_blocks=1)
    want = 0.0
    for p in range(8):
        cands = list(range(p // 2))  # blocks 0 .. pos//2 - 1
        if len(cands) < 2:
            continue
        t = mass[0, 0, p, cands] / mass[0, 0, p, cands].sum()
        logq = scores[0, 0, p, cands] - np.log(np.exp(scores[0, 0, p, cands]).sum())
        want += float(np.sum(t * (np.log(t) - logq)))
    assert float(count) == 4  # positions 4..7
    np.testing.assert_allclose(float(kl), want, rtol=1e-5)
    # recall: share of mass in the selected blocks, tokens with more than topk visible blocks
    sel = jnp.asarray([[[[0, 3]] * 8]], jnp.int32)
    r, n = tt.selection_recall(sel, jnp.asarray(mass), jnp.asarray(pos), block_size=2, topk=2)
    assert float(n) == 4 and float(r) == pytest.approx(4 * 0.5)


def test_train_step_trains_the_indexer_only_through_its_loss():
    m = init_model(CFG, dtype=jnp.float32, seed=1)
    graphdef, biases, params = nnx.split(m, tt.is_router_bias, nnx.Param)
    # no decay, no clipping (a global norm would couple the two losses' updates): Adam is elementwise
    opt = loop.make_optimizer(weight_decay=0.0, clip_norm=1e9)
    batch = jnp.asarray(RNG.integers(4, 300, (2, 41)), jnp.int32)

    def run(kl_weight):
        step = tt.make_train_step(graphdef, opt, CFG.moe_layer_ids, compute_dtype=jnp.float32, kl_weight=kl_weight,
                                  bias_rate=0.01, pad_id=2)
        p = jax.tree.map(jnp.copy, params)
        state = {"params": p, "biases": jax.tree.map(jnp.copy, biases), "opt": opt.init(p)}
        new, metrics = step(state, batch, jnp.float32(1e-2), dense=False)
        return new, {k: float(v) for k, v in metrics.items()}

    def indexer_params(state):
        flat = nnx.to_flat_state(state["params"])
        return {p: np.asarray(v.get_value()) for p, v in flat if "indexer" in p}

    before = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params) if "indexer" in p}
    lm_only, _ = run(0.0)
    both, met1 = run(1.0)
    assert all(np.array_equal(before[p], v) for p, v in indexer_params(lm_only).items())
    assert any(not np.array_equal(before[p], v) for p, v in indexer_params(both).items())
    assert math.isfinite(met1["loss"]) and met1["indexer_kl"] > 0 and met1["loss"] > met1["ce"]
    # the non-indexer weights moved identically: the indexer loss does not reach them
    for p, v in nnx.to_flat_state(both["params"]):
        if "indexer" not in p:
            np.testing.assert_array_equal(np.asarray(v.get_value()),
                                          np.asarray(dict(nnx.to_flat_state(lm_only["params"]))[p].get_value()))
    # aux-loss-free balancing: every router bias moved by exactly +-rate or 0
    for _, v in nnx.to_flat_state(both["biases"]):
        assert set(np.round(np.asarray(v.get_value()) / 0.01).tolist()) <= {-1.0, 0.0, 1.0}


def test_router_bias_update_direction():
    m = init_model(CFG, dtype=jnp.float32, seed=0)
    _, biases, _ = nnx.split(m, tt.is_router_bias, nnx.Param)
    loads = jnp.asarray([[10.0, 0.0, 5.0, 5.0], [4.0, 4.0, 4.0, 4.0]])
    new = tt.router_bias_update(biases, loads, CFG.moe_layer_ids, 0.5)
    np.testing.assert_array_equal(np.asarray(new["layers"][1]["mlp"]["gate"]["e_score_correction_bias"][...]),
                                  [-0.5, 0.5, 0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(new["layers"][2]["mlp"]["gate"]["e_score_correction_bias"][...]),
                                  [0.0, 0.0, 0.0, 0.0])


def test_cast_floats_keeps_the_router_bias_fp32():
    state = nnx.state(init_model(CFG, dtype=jnp.float32, seed=0))
    cast = loop.cast_floats(state, jnp.bfloat16)
    assert cast["layers"][1]["mlp"]["gate"]["e_score_correction_bias"][...].dtype == jnp.float32
    assert cast["layers"][1]["mlp"]["gate"]["kernel"][...].dtype == jnp.bfloat16
    assert cast["embed_tokens"][...].dtype == jnp.bfloat16


def test_lr_schedule():
    kw = {"peak": 1.0, "warmup": 10, "total": 110, "final_ratio": 0.1}
    assert loop.lr_schedule(0, **kw) == pytest.approx(0.1)
    assert loop.lr_schedule(9, **kw) == pytest.approx(1.0)
    assert loop.lr_schedule(60, **kw) == pytest.approx(0.55)
    assert loop.lr_schedule(110, **kw) == pytest.approx(0.1)
    assert loop.lr_schedule(500, **kw) == pytest.approx(0.1)


def test_loop_resumes_exactly(tmp_path):
    """Stopped after 3 steps and resumed, a run ends where an uninterrupted one does (plan, schedule, data)."""

    def step_fn(state, step, lr, phase):
        target = jnp.asarray(np.random.default_rng(step).standard_normal(3), jnp.float32)
        w = state["w"] - lr * (state["w"] - target)
        return {"w": w, "n": state["n"] + 1}, {"loss": jnp.sum((w - target) ** 2)}

    def run(run_dir, stop_after):
        ckpt = loop.Checkpointer(run_dir / "ckpt")
        metrics = loop.MetricsLog(run_dir / "metrics.jsonl")
        state = {"w": jnp.zeros(3, jnp.float32), "n": jnp.zeros((), jnp.int32)}
        meta = {"step": 0, "planned_steps": None}
        restored = ckpt.restore(loop.abstract_like(state))
        if restored is not None:
            state, meta = restored
            metrics.trim(meta["step"])
        settings = loop.LoopSettings(max_minutes=10, reserve_minutes=0, planned_steps=meta["planned_steps"] or 7,
                                     max_steps=100, warmup=2, peak_lr=0.5, log_every=1, stop_after=stop_after)
        tl = loop.TrainLoop(settings, run_dir=str(run_dir), checkpointer=ckpt, metrics=metrics,
                            start_time=__import__("time").time(), desc="toy")
        state, meta = tl.run(state, meta, step_fn)
        ckpt.close()
        return state, meta, metrics.records()

    whole, _, _ = run(tmp_path / "a", None)
    _, meta_part, _ = run(tmp_path / "b", 3)
    assert meta_part["step"] == 3 and not meta_part["finished"] and meta_part["stop_reason"] == "stop-after"
    resumed, meta_res, records = run(tmp_path / "b", None)
    assert meta_res["step"] == 7 and meta_res["finished"] and int(resumed["n"]) == 7
    np.testing.assert_array_equal(np.asarray(resumed["w"]), np.asarray(whole["w"]))
    assert [r["step"] for r in records] == list(range(1, 8))  # logged once each across the two invocations


def test_heldout_bits_per_byte_by_hand(model):
    windows = np.asarray(RNG.integers(4, 300, (3, 12)), np.int32)
    windows[1, 5] = 0  # a document start: its label does not count
    windows[2, 8:] = 2  # padding
    token_bytes = RNG.integers(1, 5, 300).astype(np.int32)
    got = tt.heldout_bits_per_byte(model, windows, token_bytes, batch_size=2, bos_id=0, pad_id=2)
    logits = np.asarray(model(jnp.asarray(windows[:, :-1])), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = nbytes = 0.0
    for r in range(3):
        for t in range(11):
            y = windows[r, t + 1]
            if y in (0, 2):
                continue
            nll -= logp[r, t, y]
            nbytes += token_bytes[y]
    assert got["tokens"] == 3 * 11 - 1 - 4 and got["bytes"] == nbytes
    assert got["bpb"] == pytest.approx(nll / math.log(2) / nbytes, rel=1e-5)
    assert set(got["expert_load"]) == {"layer_1", "layer_2"}


def test_presets_fit_the_budget():
    cfg = presets.target_config("default", vocab_size=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    n = presets.target_param_count(cfg)
    dcfg = presets.drafter_config("default", cfg, mask_token_id=3)
    nd = presets.drafter_param_count(dcfg)
    assert n <= presets.TARGET_MAX_PARAMS and nd <= presets.DRAFTER_MAX_PARAMS
    assert 2 * (n + nd) + 200_000 <= presets.SHIPPED_MAX_BYTES  # bf16 weights + tokenizer and configs
    assert cfg.index_block_size >= 16 and cfg.head_dim >= 16 and cfg.max_position_embeddings >= 2048
    assert cfg.index_n_heads == cfg.num_key_value_heads and dcfg.block_size == 7
    with pytest.raises(ValueError, match="over the shipping budget"):
        presets.check_budget("target", n + 1, n)
