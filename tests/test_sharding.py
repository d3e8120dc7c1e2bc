"""Memory plans and parameter layouts on a tensor-parallel mesh (``minimax_jax.sharding``): the plan's arithmetic
for MiniMax-M3 against an independent count from the published shapes, and on 8 virtual CPU devices the bytes
each device really holds once the parameters are placed by their partition specs."""

import os
import subprocess
import sys
import textwrap

import pytest

from minimax_jax import MiniMaxM3Config
from minimax_jax.sharding import largest_fit, memory_plan, stored_heads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def m3_device_params(tp: int) -> tuple[int, int]:
    """(bytes of the BF16 checkpoint, bytes one device stores at TP ``tp``), counted from M3's shapes (the
    router's ``e_score_correction_bias`` is fp32, everything else bf16)."""
    d, v, n, h, hkv, hd = 6144, 200064, 60, 64, 4, 128
    hi, di, e, inter, shared, dense = 4, 128, 128, 3072, 3072, 12288
    kv_stored = max(hkv, tp)
    idx_stored = max(hi, tp)
    norms = 2 * d  # input and post-attention norms
    total = device = 2 * v * d + d  # embeddings, lm_head, final norm
    device = 2 * v * d // tp + d
    for layer in range(n):
        attn = d * h * hd + 2 * d * hkv * hd + h * hd * d + 2 * hd
        attn_dev = d * h * hd // tp + 2 * d * kv_stored * hd // tp + h * hd * d // tp + 2 * hd
        if layer >= 3:  # MSA: the indexer's query heads, its shared key, two norms
            attn += d * hi * di + d * di + 2 * di
            attn_dev += d * idx_stored * di // tp + d * di + 2 * di
            mlp = e * 3 * d * inter + 3 * d * shared + d * e + 2 * e  # the fp32 bias: two bf16's worth
            mlp_dev = e * 3 * d * inter // tp + 3 * d * shared // tp + d * e + 2 * e
        else:
            mlp = 3 * d * dense
            mlp_dev = 3 * d * dense // tp
        total += attn + mlp + norms
        device += attn_dev + mlp_dev + norms
    return 2 * total, 2 * device


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_m3_plan_matches_an_independent_count(tp):
    """BF16 MiniMax-M3 (about 426B parameters): the plan's checkpoint and per-device bytes equal the count from the
    published shapes, KV and index heads replicated past their count; the KV page holds the device's own heads."""
    cfg = MiniMaxM3Config.m3()
    plan = memory_plan(cfg, tensor_parallel_size=tp)
    total, device = m3_device_params(tp)
    assert plan.checkpoint_bytes == total
    assert plan.weight_bytes == device
    assert 425e9 < total / 2 < 430e9  # parameters
    kv_heads_per_device = max(1, 4 // tp)
    assert plan.kv_bytes_per_page == 2 * 128 * (2 * 60 * kv_heads_per_device * 128 + 57 * 128)  # page 128
    fit = largest_fit(plan, 141 * 10**9, context=4096)
    assert fit == max(0, (int(141e9 * 0.9) - plan.weight_bytes) // plan.kv_bytes(1, 4096))
    assert (fit > 0) == (tp == 8)  # BF16 M3 needs 8 H200s


def test_heads_that_do_not_split_are_refused():
    assert stored_heads(4, 8) == 8 and stored_heads(4, 2) == 4 and stored_heads(4, 4) == 4
    with pytest.raises(ValueError, match="multiple"):
        stored_heads(4, 6)
    with pytest.raises(ValueError, match="do not split"):
        stored_heads(6, 4)
    with pytest.raises(ValueError, match="experts do not split"):
        memory_plan(MiniMaxM3Config.tiny(), tensor_parallel_size=8)  # 4 experts


@pytest.mark.slow
def test_placed_shards_hold_what_the_plan_says():
    """8 virtual CPU devices: a tiny M3-shaped model (16 query / 2 KV heads, 2 index heads, 8 experts) placed by
    its partition specs at TP 1, 2, 4 and 8 (stored shapes: KV and index heads replicated at 4 and 8); the bytes of
    the shards on device 0 equal the plan's per-device weights."""
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax, jax.numpy as jnp
        from flax import nnx
        from jax.sharding import NamedSharding
        from minimax_jax import MiniMaxM3Config
        from minimax_jax.model import MiniMaxM3ForCausalLM
        from minimax_jax.sharding import make_mesh, memory_plan, param_layout
        cfg = MiniMaxM3Config.tiny(num_attention_heads=16, num_key_value_heads=2, head_dim=16, hidden_size=64,
                                   index_n_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=512)
        assert len(jax.devices()) == 8
        for tp in (1, 2, 4, 8):
            mesh = make_mesh(tp)
            layout = param_layout(lambda: MiniMaxM3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), cfg, tp)
            held = 0
            for name, p in layout.items():
                x = jax.device_put(jnp.zeros(p.stored_shape, p.dtype), NamedSharding(mesh, p.spec))
                held += sum(s.data.nbytes for s in x.addressable_shards if s.device == mesh.devices.flat[0])
            plan = memory_plan(cfg, tensor_parallel_size=tp, dtype=jnp.float32)
            assert held == plan.weight_bytes, (tp, held, plan.weight_bytes)
            print("tp", tp, held)
    """)
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("tp ") == 4


@pytest.mark.slow
def test_sharded_loading_reads_each_slice_once():
    """8 virtual CPU devices: both fixture checkpoints (HF names, one file; MiniMax names, per-expert tensors, two
    shards) loaded with a TP 2 and a TP 4 mesh give the unsharded load's model (KV and index heads replicated at
    TP 4) with every parameter split as its layout says, and the loader reads exactly the checkpoint's tensor bytes:
    each slice once, however many devices hold it. A drafter saved for the HF fixture loads onto the TP 4 mesh the
    same way (its draft layers' KV heads replicated)."""
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        from safetensors import safe_open
        from minimax_jax import load_model, sharding
        from minimax_jax import safetensors_io

        counted = []
        orig_init = safetensors_io.SafetensorsReader.__init__
        def init(self, *a, **kw):
            orig_init(self, *a, **kw)
            counted.append(self)
        safetensors_io.SafetensorsReader.__init__ = init
        fixtures = os.path.join("tests", "fixtures")
        for name in ("hf_tiny", "minimax_tiny"):
            path = os.path.join(fixtures, name)
            files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
            total = 0
            for f in files:
                with safe_open(f, framework="np") as h:
                    total += sum(h.get_tensor(k).nbytes for k in h.keys())
            ref = load_model(path, dtype=jnp.float32)
            ids = jnp.asarray([[1, 5, 9, 200, 17, 3, 3, 80, 41, 7, 2, 99, 13, 6, 250, 11]], jnp.int32)
            want = np.asarray(ref(ids))
            for tp in (2, 4):
                mesh = sharding.make_mesh(tp)
                counted.clear()
                model = load_model(path, dtype=jnp.float32, mesh=mesh)
                assert counted[0].bytes_read == total, (name, tp, counted[0].bytes_read, total)
                assert model.cfg.num_key_value_heads == max(2, tp)
                for p, var in nnx.to_flat_state(nnx.state(model)):
                    x = var.get_value()
                    spec = sharding.param_rule("/".join(map(str, p)), x.shape, model.cfg, tp)[1]
                    assert x.sharding.spec == spec, (p, x.sharding.spec, spec)
                same = sharding.replicate_heads(ref, tp)
                for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(same))):
                    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(p))
                np.testing.assert_allclose(np.asarray(model(ids)), want, rtol=2e-5, atol=2e-5)
                print("loaded", name, tp, total)
        # a drafter for the HF fixture, saved and loaded onto the TP 4 mesh with its target
        import tempfile
        from minimax_jax import DSparkConfig, init_drafter, load_drafter, save_drafter
        ref = load_model(os.path.join(fixtures, "hf_tiny"), dtype=jnp.float32)
        dcfg = DSparkConfig.for_target(ref.cfg, mask_token_id=255, block_size=4, num_draft_layers=1,
                                       target_layer_ids=(1, 3), markov_rank=8, markov_head_type="gated",
                                       enable_confidence_head=True, confidence_head_with_markov=True)
        drafter = init_drafter(dcfg, ref, seed=3)
        with tempfile.TemporaryDirectory() as tmp:
            save_drafter(drafter, tmp)
            files = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".safetensors")]
            total = 0
            for f in files:
                with safe_open(f, framework="np") as h:
                    total += sum(h.get_tensor(k).nbytes for k in h.keys())
            mesh = sharding.make_mesh(4)
            target = load_model(os.path.join(fixtures, "hf_tiny"), dtype=jnp.float32, mesh=mesh)
            counted.clear()
            placed = load_drafter(tmp, target, mesh=mesh)
            assert counted[0].bytes_read == total, (counted[0].bytes_read, total)
            assert placed.cfg.layer_config.num_key_value_heads == 4
            same = sharding.replicate_drafter_heads(load_drafter(tmp, ref), 4)
            for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(placed)), nnx.to_flat_state(nnx.state(same))):
                np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(p))
            q = placed.layers[0].self_attn.q_proj.kernel[...]
            assert q.addressable_shards[0].data.shape[1] == q.shape[1] // 4
            print("loaded drafter", total)
    """)
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("loaded") == 5 and "loaded drafter" in proc.stdout, proc.stdout
