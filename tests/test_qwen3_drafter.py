"""The Qwen3-style DSpark drafter (``Qwen3DSparkModel``, the schema of ``nvidia/MiniMax-M3-DSpark``): fixtures
written by ``scripts/make_drafter_fixture.py`` into temporary directories, loaded with ``load_drafter``; one draft
step against a float64 numpy restatement of the block and heads written from the published math (not the
drafter's code); the config's bad inputs; the engine lossless with it (host and device loops, adaptive and fixed
verification), on one device and on a TP 2 mesh (8 virtual CPU devices, in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from minimax_jax import load_drafter, save_drafter
from minimax_jax.config import ConfigError, MiniMaxM3Config
from minimax_jax.draft_step import append_context_step, draft_step
from minimax_jax.drafter_config import (
    DSparkConfig,
    Qwen3DSparkConfig,
    drafter_config_class,
    drafter_config_from_pretrained,
)
from minimax_jax.safetensors_io import CheckpointError
from scripts.make_drafter_fixture import qwen3_dspark_config, write_qwen3_dspark_fixture
from spec_decode import Engine, SamplingParams
from spec_decode.cost_table import CostTable
from tests.engine_models import MASK, VOCAB, bigram_table, damped_target, greedy_reference, random_prompts

WINDOW = 8
FIXTURE = dict(hidden_size=64, vocab_size=VOCAB, num_target_layers=4, target_layer_ids=[1, 3], mask_token_id=MASK,
               num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16, intermediate_size=48, block_size=8,
               markov_rank=8, window=WINDOW)


@pytest.fixture(scope="module")
def target():
    return damped_target()


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_dspark")
    write_qwen3_dspark_fixture(path, seed=0, **FIXTURE)
    return path


# ----------------------------------------------------------------------------------------------- numpy restatement
def _rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    """Qwen3's rotate-half RoPE over the whole head: ``x [N, H, D]`` at ``pos [N]``."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    f = pos[:, None].astype(np.float64) * inv[None]
    cos, sin = np.cos(f)[:, None], np.sin(f)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def numpy_draft(t, cfg, embed, lm_head, feats, anchor, window):
    """One greedy draft block of one request from the checkpoint tensors ``t`` (float64): context features
    ``feats [S, m*d]`` at positions ``0..S-1``, the anchor at position ``S``. ModelOpt's DFlash/DSpark module
    (Qwen3 decoder layers with K/V injection), its non-causal sliding-window mask, vLLM's Markov and confidence
    heads. Returns (tokens [K], probs [K, V], confidences [K])."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    dfl = cfg["dflash_config"]
    k_slots, h, g, hd = dfl["block_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta, s = cfg["rope_theta"], feats.shape[0]
    ctx = _rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"])  # [S, d]
    x = embed[[anchor] + [dfl["mask_token_id"]] * (k_slots - 1)].astype(np.float64)  # [K, d]
    qpos = s + np.arange(k_slots)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w = {n: t[p + n] for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                   "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")}
        kc = _rope(_rms((ctx @ w["self_attn.k_proj.weight"].T).reshape(s, g, hd), w["self_attn.k_norm.weight"]),
                   np.arange(s), theta)
        vc = (ctx @ w["self_attn.v_proj.weight"].T).reshape(s, g, hd)
        xn = _rms(x, t[p + "input_layernorm.weight"])
        q = _rope(_rms((xn @ w["self_attn.q_proj.weight"].T).reshape(k_slots, h, hd), w["self_attn.q_norm.weight"]),
                  qpos, theta)
        kb = _rope(_rms((xn @ w["self_attn.k_proj.weight"].T).reshape(k_slots, g, hd), w["self_attn.k_norm.weight"]),
                   qpos, theta)
        vb = (xn @ w["self_attn.v_proj.weight"].T).reshape(k_slots, g, hd)
        o = np.zeros((k_slots, h, hd))
        for k in range(k_slots):
            seen = [j for j in range(s) if j > qpos[k] - window]  # context within the window; the block: all
            for qh in range(h):
                grp = qh // (h // g)
                keys = np.concatenate([kc[seen, grp], kb[:, grp]])
                vals = np.concatenate([vc[seen, grp], vb[:, grp]])
                sc = keys @ q[k, qh] / np.sqrt(hd)
                pr = np.exp(sc - sc.max())
                o[k, qh] = pr @ vals / pr.sum()
        x = x + o.reshape(k_slots, -1) @ w["self_attn.o_proj.weight"].T
        xn = _rms(x, t[p + "post_attention_layernorm.weight"])
        gate, up = xn @ t[p + "mlp.gate_proj.weight"].T, xn @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    hid = _rms(x, t["norm.weight"])
    u = hid @ np.asarray(lm_head, np.float64)  # the target's head
    prev, toks, probs, conf = anchor, [], [], []
    for k in range(k_slots):
        e = t["markov_w1.weight"][prev]
        logits = u[k] + t["markov_w2.weight"] @ e
        z = np.exp(logits - logits.max())
        probs.append(z / z.sum())
        c = t["confidence_proj.weight"][0] @ np.concatenate([hid[k], e]) + t["confidence_proj.bias"][0]
        conf.append(1 / (1 + np.exp(-c)))
        prev = int(np.argmax(logits))
        toks.append(prev)
    return np.array(toks), np.array(probs), np.array(conf)


def test_draft_step_matches_a_numpy_restatement(target, fixture_dir):
    """Three requests, contexts of 0, 5 (shorter than the window) and 19 positions (longer): tokens, draft
    distributions and confidences of one greedy draft step equal the float64 restatement, through the jnp
    attention and the Pallas kernel (interpret mode), from the paged cache and from scratch."""
    drafter = load_drafter(fixture_dir, target)
    assert isinstance(drafter.cfg, Qwen3DSparkConfig) and drafter.cfg.sliding_window == WINDOW
    assert drafter.cfg.confidence_head_with_markov and drafter.fc.kernel[...].dtype == jnp.float32
    cfg = json.loads((fixture_dir / "config.json").read_text())
    tensors = load_file(str(fixture_dir / "model.safetensors"))
    rng = np.random.default_rng(7)
    lengths = np.array([0, 5, 19], np.int32)
    s = int(lengths.max())
    feats = (rng.standard_normal((3, s, 2 * 64)) * 2.0).astype(np.float32)
    anchors = np.array([4, 9, 17], np.int32)
    embed, lm_head = np.asarray(target.embed_tokens[...]), np.asarray(target.lm_head[...])
    want = [numpy_draft(tensors, cfg, embed, lm_head, feats[r, : lengths[r]], anchors[r], WINDOW) for r in range(3)]

    graphdef, state = nnx.split(drafter)
    cache = drafter.init_cache(3, 32, page_size=4)
    cache = append_context_step(graphdef, state, cache, jnp.asarray(feats), jnp.zeros(3, jnp.int32),
                                jnp.asarray(lengths))
    for impl in ("reference", "pallas"):
        out = draft_step(graphdef, state, cache, jnp.asarray(anchors), jnp.asarray(lengths), implementation=impl,
                         interpret=True)
        for r in range(3):
            toks, probs, conf = want[r]
            np.testing.assert_array_equal(np.asarray(out.tokens[r]), toks, err_msg=f"{impl} row {r}")
            np.testing.assert_allclose(np.asarray(out.confidences[r]), conf, atol=2e-4, err_msg=f"{impl} row {r}")
    # the draft distributions (a greedy step returns one-hots): the block from scratch, the Markov bias
    # teacher-forced on the restatement's greedy prefix
    h = drafter.block_hidden_reference(jnp.asarray(feats), jnp.asarray(anchors), jnp.asarray(lengths))
    for r in range(3):
        toks, probs, _ = want[r]
        prev = np.concatenate([[anchors[r]], toks[:-1]])
        bias = drafter.markov_head.block_bias(jnp.asarray(prev[None]), h[r : r + 1])[0]
        logits = np.asarray(drafter.logits(h[r]) + bias, np.float64)
        got = np.exp(logits - logits.max(-1, keepdims=True))
        np.testing.assert_allclose(got / got.sum(-1, keepdims=True), probs, atol=2e-5, err_msg=f"row {r}")


def test_name_schemes_shards_and_dtype(target, fixture_dir, tmp_path):
    """vLLM's nested head names and a sharded checkpoint with an index load the same weights as ModelOpt's flat
    names; save_drafter round-trips; the float32 checkpoint is cast to the requested dtype (bf16)."""
    base = load_drafter(fixture_dir, target)
    write_qwen3_dspark_fixture(tmp_path / "vllm", seed=0, names="vllm", shards=3, **FIXTURE)
    other = load_drafter(tmp_path / "vllm", target)
    for a, b in zip(jax.tree.leaves(nnx.state(base)), jax.tree.leaves(nnx.state(other))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    save_drafter(base, tmp_path / "saved")  # save_drafter writes the Qwen3DSparkModel schema back
    again = load_drafter(tmp_path / "saved", target)
    assert again.cfg == base.cfg
    for a, b in zip(jax.tree.leaves(nnx.state(base)), jax.tree.leaves(nnx.state(again))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    half = load_drafter(fixture_dir, target, dtype=jnp.bfloat16)
    assert half.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16


def test_config_choice_and_bad_input(target, fixture_dir, tmp_path):
    """The class follows ``architectures``; target_layer_ids past the target, causal or mixed layers, another
    activation or RoPE, a missing window and a confidence head of another width are refused, naming the key or
    tensor; MiniMax-block drafters read their MLP width from intermediate_size and honour a window too."""
    cfg = qwen3_dspark_config(**FIXTURE)
    assert drafter_config_class(cfg) is Qwen3DSparkConfig
    assert drafter_config_class({**cfg, "architectures": ["DFlashDraftModel"]}) is Qwen3DSparkConfig
    with pytest.raises(ConfigError, match="projector_type"):
        drafter_config_class({**cfg, "architectures": ["DFlashDraftModel"],
                              "dflash_config": {**cfg["dflash_config"], "projector_type": "domino"}})
    parsed = drafter_config_from_pretrained(cfg)
    assert parsed == drafter_config_from_pretrained(parsed.to_dict())
    assert (parsed.layer_config.num_key_value_heads, parsed.layer_config.dense_intermediate_size) == (1, 48)

    def bad(change, match, dfl=None):
        c = json.loads(json.dumps(cfg))
        c.update(change)
        c["dflash_config"].update(dfl or {})
        with pytest.raises(ConfigError, match=match):
            Qwen3DSparkConfig.from_pretrained(c)

    bad({}, r"dflash_config\.target_layer_ids", {"target_layer_ids": [1, 4]})  # the target has 4 layers
    bad({}, r"dflash_config\.causal", {"causal": True})
    bad({"layer_types": ["sliding_attention", "full_attention"]}, "mix", {"use_swa": False})
    bad({"layer_types": ["sliding_attention"] * 2}, "layer_types", {"use_swa": False, "causal": None})
    bad({"hidden_act": "gelu"}, "hidden_act")
    bad({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "yarn")
    bad({"attention_bias": True}, "attention_bias")
    bad({"sliding_window": None}, "swa_window_size", {"swa_window_size": None})
    # the drafter config's own target check: target_layer_ids that exceed THIS target, at load time
    c = json.loads(json.dumps(cfg))
    del c["num_target_layers"], c["dflash_config"]["num_target_layers"]
    c["dflash_config"]["target_layer_ids"] = [1, 12]
    (tmp_path / "far").mkdir()
    (tmp_path / "far" / "config.json").write_text(json.dumps(c))
    for f in fixture_dir.iterdir():
        if f.suffix == ".safetensors":
            (tmp_path / "far" / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ConfigError, match=r"dflash_config\.target_layer_ids.*exceed the target's 4 layers"):
        load_drafter(tmp_path / "far", target)
    # a confidence head of width d + r must be d + r (here: d + 3) -> named as mis-shaped
    t = load_file(str(fixture_dir / "model.safetensors"))
    t["confidence_proj.weight"] = t["confidence_proj.weight"][:, :67]
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(tmp_path / "odd" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="confidence_proj.weight"):
        load_drafter(tmp_path / "odd", target)
    # MiniMax-block drafters: the MLP width from intermediate_size (NeMo), and a window when the config asks
    mm = DSparkConfig.for_target(target.cfg, mask_token_id=MASK, target_layer_ids=(1, 3)).to_dict()
    del mm["dense_intermediate_size"]
    mm["intermediate_size"] = 40
    mm["dflash_config"] = {"use_swa": True, "swa_window_size": 12}
    parsed = DSparkConfig.from_pretrained(mm)
    assert parsed.layer_config.dense_intermediate_size == 40 and parsed.sliding_window == 12
    # the target: a switch without a window is refused, naming the key (windows: tests/test_config.py)
    tc = target.cfg.to_dict()
    with pytest.raises(ConfigError, match="use_sliding_window"):
        MiniMaxM3Config.from_pretrained({**tc, "use_sliding_window": True})


# ----------------------------------------------------------------------------------------------- the engine
PROMPT_LENS = [20, 13, 26]  # longer than the window: the windowed context is live
MAX_NEW = [12, 7, 10]
# one token bucket, one draft length, greedy programs only: few programs to compile
COMMON = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64, implementation="reference",
              min_token_bucket=64, device_loop_token_buckets=1, async_scheduling=False, sampling=False,
              draft_lengths=(8,), cost_table=CostTable.from_measurements({8: 1.0, 64: 1.5}))


@pytest.fixture(scope="module")
def engine_drafter(target, tmp_path_factory):
    """The Qwen3 fixture drafter, its Markov head set to the target's bigram guess (rank = vocabulary) and its
    backbone's output scaled down, so drafts are often accepted and still depend on the windowed backbone."""
    path = tmp_path_factory.mktemp("qwen3_engine")
    write_qwen3_dspark_fixture(path, seed=1, **{**FIXTURE, "markov_rank": VOCAB})
    drafter = load_drafter(path, target)
    drafter.norm.weight[...] = drafter.norm.weight[...] * 0.02
    drafter.markov_head.markov_w1[...] = jnp.eye(VOCAB, dtype=jnp.float32)
    drafter.markov_head.markov_w2.kernel[...] = jnp.asarray(bigram_table(target))
    return drafter


@pytest.mark.parametrize("mode", ["adaptive", "fixed"])
def test_engine_is_lossless_with_the_qwen3_drafter(target, engine_drafter, mode):
    """Greedy outputs with the Qwen3 drafter (K = 8, the block's every slot) equal target-only greedy decoding,
    through the host loop and the device loop."""
    prompts = random_prompts(len(PROMPT_LENS), PROMPT_LENS, seed=5)
    refs = [greedy_reference(target, p, n, length=64) for p, n in zip(prompts, MAX_NEW)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = Engine(target, engine_drafter, num_speculative_tokens=8, verification=mode, **COMMON)
    params = [SamplingParams(max_new_tokens=n) for n in MAX_NEW]
    for loop in ("host", "device"):
        res = eng.generate(prompts, sampling_params=params, loop=loop)
        assert [r.token_ids for r in res] == refs, loop
    assert res.stats["mean_acceptance_length"] > 1.2  # drafts were accepted: the speculative paths ran


MESH_SCRIPT = textwrap.dedent("""
    import os, sys, tempfile, warnings
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["MINIMAX_JAX_COMPILATION_CACHE"] = "0"
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    jax.config.update("jax_default_matmul_precision", "highest")
    from minimax_jax import load_drafter, sharding
    from scripts.make_drafter_fixture import write_qwen3_dspark_fixture
    from spec_decode import Engine, SamplingParams
    from tests.engine_models import bigram_table, damped_target, greedy_reference, random_prompts
    from tests.test_qwen3_drafter import COMMON, FIXTURE, MAX_NEW, PROMPT_LENS, VOCAB

    # the published drafter's 32 query heads over 8 KV heads, scaled down: 8 over 2 (split at TP 2, replicated at 4)
    path = tempfile.mkdtemp()
    write_qwen3_dspark_fixture(path, seed=1, **{**FIXTURE, "markov_rank": VOCAB, "num_heads": 8, "num_kv_heads": 2})
    target = damped_target()
    ref = load_drafter(path, target)
    for tp in (2, 4):
        mesh = sharding.make_mesh(tp)
        placed = load_drafter(path, target, mesh=mesh)  # each device reads its slices
        assert placed.cfg.layer_config.num_key_value_heads == max(2, tp)
        same = sharding.replicate_drafter_heads(ref, tp)
        for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(placed)), nnx.to_flat_state(nnx.state(same))):
            np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(p))
        q = placed.layers[0].self_attn.q_proj.kernel[...]
        assert q.addressable_shards[0].data.shape == (q.shape[0], q.shape[1] // tp)
        k = placed.layers[0].self_attn.k_proj.kernel[...]
        assert k.shape[1] == max(2, tp) * 16 and k.addressable_shards[0].data.shape[1] == 16
        print("loaded", tp)

    # the engine on a TP 2 mesh, the drafter loaded onto it: greedy outputs equal one device's (target-only
    # greedy decoding, which the one-device engine gives: test_engine_is_lossless_with_the_qwen3_drafter)
    prompts = random_prompts(len(PROMPT_LENS), PROMPT_LENS, seed=5)
    refs = [greedy_reference(target, p, n, length=64) for p, n in zip(prompts, MAX_NEW)]
    mesh = sharding.make_mesh(2)
    target = sharding.replicate_heads(damped_target(), 2)
    sharding.shard_module(target, mesh, target.cfg)
    drafter = load_drafter(path, target, mesh=mesh)
    drafter.norm.weight[...] = drafter.norm.weight[...] * 0.02
    drafter.markov_head.markov_w1[...] = jnp.eye(VOCAB, dtype=jnp.float32)
    drafter.markov_head.markov_w2.kernel[...] = jnp.asarray(bigram_table(target))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = Engine(target, drafter, num_speculative_tokens=8, verification="adaptive", mesh=mesh, **COMMON)
    params = [SamplingParams(max_new_tokens=n) for n in MAX_NEW]
    for loop in ("host", "device"):
        res = eng.generate(prompts, sampling_params=params, loop=loop)
        assert [r.token_ids for r in res] == refs, loop
        assert res.stats["mean_acceptance_length"] > 1.2, res.stats
        print("engine", loop)
    dk = eng._state.draft_cache.k  # [L, H_kv, P, page, D]: the drafter's context K/V split by head
    assert dk.addressable_shards[0].data.shape[1] == dk.shape[1] // 2, dk.shape
    dq = eng.drafter.layers[1].self_attn.o_proj.kernel[...]
    assert dq.addressable_shards[0].data.shape[0] == dq.shape[0] // 2, dq.shape
""")


@pytest.mark.slow
def test_qwen3_drafter_on_a_mesh():
    """8 virtual CPU devices: the Qwen3 drafter (8 query over 2 KV heads) loaded onto TP 2 and TP 4 meshes gives
    the unsharded load's parameters (KV heads replicated at TP 4), each device holding its heads; the engine on a
    TP 2 mesh with it gives one device's greedy outputs, host and device loops, on a split drafter and draft
    cache."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], capture_output=True, text=True, timeout=600, env=env,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("loaded") == 2 and proc.stdout.count("engine") == 2, proc.stdout
