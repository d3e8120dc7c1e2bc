"""Tensor parallelism on 8 virtual CPU devices (``--xla_force_host_platform_device_count=8``, in a subprocess):
a tiny model with MiniMax-M3's head ratios scaled down (16 query heads over 2 KV heads, 2 index heads, 8 experts
top-2, a shared expert) gives the unsharded model's logits at TP 1, 2, 4 and 8 (KV and index heads replicated at 4
and 8), its packed forward with the kernels per device (attention and indexer on local heads, experts on local
experts, inside shard_map; reference and Pallas interpret kernels) the unsharded one's at TP 2 and 8, and the
engine's greedy outputs at TP 8 equal target-only greedy decoding on one device, plain and with adaptive
verification under a trimming cost table, host and device loops, on parameters and KV pages that really are
split."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["MINIMAX_JAX_COMPILATION_CACHE"] = "0"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from minimax_jax import sharding
    from spec_decode import CostTable, Engine, SamplingParams
    from tests.engine_models import bigram_drafter, damped_target, greedy_reference, random_prompts

    SHAPE = dict(num_attention_heads=16, num_key_value_heads=2, index_n_heads=2, head_dim=16,
                 num_local_experts=8, num_experts_per_tok=2)
    assert len(jax.devices()) == 8

    def fresh():
        return damped_target(damping=0.3, **SHAPE)

    ids = jnp.asarray([random_prompts(1, [40], seed=4)[0]], jnp.int32)
    want = np.asarray(fresh()(ids))
    for tp in (1, 2, 4, 8):
        mesh = sharding.make_mesh(tp)
        model = sharding.replicate_heads(fresh(), tp)
        sharding.shard_module(model, mesh, model.cfg)
        q = model.layers[0].self_attn.q_proj.kernel[...]
        assert q.addressable_shards[0].data.shape[1] == q.shape[1] // tp
        assert model.cfg.num_key_value_heads == max(2, tp)
        got = np.asarray(model(ids))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        print("logits", tp, float(np.abs(got - want).max()))

    # the packed forward with the kernels per device (shard_map on local heads and experts), reference and Pallas
    # (interpret mode) kernels, against the unsharded packed forward
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from minimax_jax.cache import init_cache, page_size_for
    from minimax_jax.decode import RaggedBatch, forward_ragged
    base = fresh()
    page = page_size_for(base.cfg)
    n = ids.shape[1]
    nb = -(-n // page)
    batch = RaggedBatch(ids[0], jnp.asarray([0, n], jnp.int32), jnp.asarray([n], jnp.int32),
                        jnp.arange(nb, dtype=jnp.int32)[None])
    for impl in ("reference", "pallas"):
        kw = dict(implementation=impl, interpret=True if impl == "pallas" else None)
        want_h = np.asarray(forward_ragged(base, init_cache(base.cfg, nb, dtype=jnp.float32), batch, **kw)[0])
        for tp in (2, 8):
            mesh = sharding.make_mesh(tp)
            model = sharding.replicate_heads(fresh(), tp)
            sharding.shard_module(model, mesh, model.cfg)
            cache = init_cache(model.cfg, nb, dtype=jnp.float32)
            heads, rep = NamedSharding(mesh, P(sharding.TENSOR)), NamedSharding(mesh, P())
            cache = type(cache)(k=[jax.device_put(x, heads) for x in cache.k],
                                v=[jax.device_put(x, heads) for x in cache.v],
                                index_k=[jax.device_put(x, rep) for x in cache.index_k])
            g, st = nnx.split(model)
            run = jax.jit(lambda st, c, b: forward_ragged(nnx.merge(g, st), c, b, mesh=mesh, **kw)[0])
            got = np.asarray(run(st, cache, batch))
            np.testing.assert_allclose(got, want_h, rtol=2e-5, atol=2e-5)
            print("packed", impl, tp, float(np.abs(got - want_h).max()))

    prompts = random_prompts(5, [20, 15, 30, 13, 26], seed=3)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (12, 9, 16, 5, 14)]
    common = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=32, implementation="reference",
                  min_token_bucket=32, sampling=False, cost_table=None, device_loop_token_buckets=1)
    # adaptive under a cost table where trimming pays (the budget then differs from step to step: every device must
    # agree on it) and plain decoding; fixed K is adaptive's program with every draft verified
    steep = CostTable.from_measurements({32: 1.0, 64: 3.0, 128: 6.0})
    # one device's target-only greedy decoding (every engine on one device gives it: tests/test_engine.py)
    ref = [greedy_reference(fresh(), p, m, stop=()) for p, m in zip(prompts, (12, 9, 16, 5, 14))]
    for mode, k in (("none", 0), ("adaptive", 3)):
        for tp in (8,):  # KV and index heads replicated, every parameter split 8 ways
            target = fresh()
            drafter = bigram_drafter(target, block_size=4) if k else None
            eng = Engine(target, drafter, num_speculative_tokens=k, verification=mode, tensor_parallel_size=tp,
                         **{**common, "cost_table": steep if mode == "adaptive" else None})
            host = [r.token_ids for r in eng.generate(prompts, sampling_params=params)]
            dev = [r.token_ids for r in eng.generate(prompts, sampling_params=params, loop="device")]
            if tp > 1:
                kv = eng._state.cache.k[0]
                assert kv.addressable_shards[0].data.shape[0] == kv.shape[0] // tp, kv.shape
                if k:  # the drafter's layers and its context K/V are split too
                    dq = eng.drafter.layers[0].self_attn.q_proj.kernel[...]
                    assert dq.addressable_shards[0].data.shape[1] == dq.shape[1] // tp, dq.shape
                    dk = eng._state.draft_cache.k
                    assert dk.addressable_shards[0].data.shape[1] == dk.shape[1] // tp, dk.shape
            assert host == ref and dev == ref, (mode, tp)
            print("engine", mode, tp, sum(map(len, host)))

    # a data axis: 4 replicas of a TP 2 engine, 7 prompts split 2/2/2/1, results in prompt order
    from spec_decode.replicas import ReplicatedEngine
    target = fresh()
    rep = ReplicatedEngine(target, bigram_drafter(target, block_size=4), mesh=sharding.make_mesh(2, data_parallel_size=4),
                           num_speculative_tokens=3, verification="fixed", **{**common, "device_loop": False})
    more = prompts + random_prompts(2, [11, 17], seed=8)
    more_params = params + [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 2
    one = Engine(fresh(), bigram_drafter(fresh(), block_size=4), num_speculative_tokens=3, verification="fixed",
                 **{**common, "device_loop": False})
    want = [r.token_ids for r in one.generate(more, sampling_params=more_params)]
    got = rep.generate(more, sampling_params=more_params)
    assert [r.token_ids for r in got] == want
    assert len(got.stats["replicas"]) == 4 and [len(e.mesh.devices.flat) for e in rep.engines] == [2] * 4
    assert len({d for e in rep.engines for d in e.mesh.devices.flat}) == 8
    cached = sum(e.pool.num_evictable for e in rep.engines)  # the prompts' full pages, left cached
    assert cached > 0 and rep.reset_prefix_cache() == cached and all(e.pool.num_evictable == 0 for e in rep.engines)
    print("replicas", got.stats["output_tokens"])
""")


@pytest.mark.slow
def test_tensor_parallel_logits_and_greedy_outputs_match_one_device():
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=1500, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("logits") == 4 and proc.stdout.count("engine") == 2, proc.stdout
    assert proc.stdout.count("packed") == 4, proc.stdout
    assert proc.stdout.count("replicas") == 1, proc.stdout


DRAFTER_SCRIPT = textwrap.dedent("""
    import dataclasses, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from minimax_jax import DSparkConfig, init_drafter, sharding
    from tests.engine_models import MASK, damped_target

    target = damped_target(damping=0.3, num_attention_heads=16, num_key_value_heads=2, index_n_heads=2, head_dim=16,
                           num_local_experts=8, num_experts_per_tok=2)
    # a drafter whose backbone matters (random weights): 16 query heads over 2 KV heads, like the target's layers
    cfg = DSparkConfig.for_target(target.cfg, mask_token_id=MASK, block_size=4, num_draft_layers=1,
                                  target_layer_ids=(1, 3))
    r, cap = 3, 32
    rng = np.random.default_rng(0)
    feats = jnp.asarray(rng.normal(size=(r, 20, 2 * target.cfg.hidden_size)), jnp.float32)
    lengths = jnp.asarray([20, 7, 0], jnp.int32)
    anchors, rows = jnp.asarray([5, 9, 11], jnp.int32), jnp.asarray([1, 0, -1], jnp.int32)  # row 2: no context

    def drafts(drafter, cache, impl, mesh):
        g, st = nnx.split(drafter)
        def f(st, c):
            m = nnx.merge(g, st)
            h = m.block_hidden(c, anchors, lengths[jnp.maximum(rows, 0)], cache_rows=rows, implementation=impl,
                               interpret=True if impl == "pallas" else None, mesh=mesh)
            return h, m.sample_block(h, anchors, 0.0).tokens
        if mesh is not None:
            assert "shard_map" in str(jax.make_jaxpr(f)(st, cache))
        return jax.jit(f)(st, cache)

    def cache_for(drafter):
        return drafter.append_context(drafter.init_cache(r, cap, dtype=jnp.float32), feats, jnp.zeros(r, jnp.int32),
                                      lengths)

    one = init_drafter(cfg, target, seed=3)
    want = {impl: drafts(one, cache_for(one), impl, None) for impl in ("reference", "pallas")}
    for tp in (2, 4):  # 4: the draft layer's KV heads replicated to 4
        mesh = sharding.make_mesh(tp)
        drafter = sharding.replicate_drafter_heads(init_drafter(cfg, target, seed=3), tp)
        sharding.shard_module(drafter, mesh, drafter.cfg.layer_config)
        cache = cache_for(drafter)
        heads = NamedSharding(mesh, P(None, sharding.TENSOR))
        cache = dataclasses.replace(cache, k=jax.device_put(cache.k, heads), v=jax.device_put(cache.v, heads))
        assert cache.k.addressable_shards[0].data.shape[1] == max(2, tp) // tp
        for impl in ("reference", "pallas"):
            h, toks = drafts(drafter, cache, impl, mesh)
            np.testing.assert_allclose(np.asarray(h), np.asarray(want[impl][0]), rtol=2e-5, atol=2e-5)
            np.testing.assert_array_equal(np.asarray(toks), np.asarray(want[impl][1]))
            print("drafter", impl, tp, float(np.abs(np.asarray(h) - np.asarray(want[impl][0])).max()))
""")


@pytest.mark.slow
def test_drafter_block_attention_per_device_matches_one_device():
    """The drafter's block attention inside shard_map on local heads (reference and Pallas interpret kernels) at
    TP 2 and 4: the block hidden states and greedy drafts of one device, from a cache split by KV head."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", DRAFTER_SCRIPT], capture_output=True, text=True, timeout=900,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("drafter") == 4, proc.stdout
