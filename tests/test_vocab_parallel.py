"""The sampler on the vocabulary shards (docs/PARALLELISM.md, "The sampler on the mesh"), on 8 virtual CPU devices
in a subprocess: at TP 2 and 4 the rejection sampler (greedy, stochastic, per-request temperatures), plain sampling,
min-p / top-k / top-p and the log-probabilities' top tokens give one device's results on logits split over the
vocabulary; the compiled sampler and an engine's compiled greedy step gather no vocabulary row between devices."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import os, re
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["MINIMAX_JAX_COMPILATION_CACHE"] = "0"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from jax.sharding import NamedSharding, PartitionSpec as P
    from minimax_jax import sharding
    from spec_decode.logprobs import step_logprobs
    from spec_decode.rejection import rejection_sample_packed, sample_tokens
    from spec_decode.sampling_params import filter_logits

    def gathers(compiled):
        # the shapes of every all-gather in a compiled program, e.g. [16, 2] (tuple-shaped ones included)
        shapes = []
        for line in compiled.as_text().splitlines():
            if " all-gather(" in line or " all-gather-start(" in line:
                lhs = line.split(" all-gather")[0].split("=", 1)[1]
                shapes += [[int(d) for d in dims.split(",") if d] for dims in re.findall(r"\\[([0-9,]*)\\]", lhs)]
        return shapes

    rng = np.random.default_rng(7)
    R, K, V = 6, 3, 256
    q_len = np.array([4, 1, 3, 4, 2, 0])
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_len)]), jnp.int32)
    T = 24  # packed rows, padding after qsl[R]
    logits = (rng.normal(size=(T, V)) * 2.5).astype(np.float32)
    logits[:, 100] = logits[:, 37]  # ties across shard boundaries (TP 2: 37 and 100 on one device; TP 4: not)
    logits[:, 200] = logits[:, 37]
    dprobs = rng.dirichlet(np.full(V, 0.2), (R, K)).astype(np.float32)
    drafts = rng.integers(0, V, (R, K)).astype(np.int32)
    for r in range(R):  # some drafts are the target's argmax (accepted greedily), or likely under both
        for j in range(max(q_len[r] - 1, 0)):
            if j % 2 == 0:
                drafts[r, j] = int(np.argmax(logits[qsl[r] + j]))
                dprobs[r, j] = 0.5 * dprobs[r, j] + 0.5 * np.exp(logits[qsl[r] + j]) / np.exp(logits[qsl[r] + j]).sum()
    seeds = jnp.arange(R, dtype=jnp.int32) + 11
    pos = jnp.arange(R, dtype=jnp.int32) * 5
    temps = jnp.asarray([0.0, 0.7, 1.0, 1.3, 0.5, 1.0], jnp.float32)
    top_k = jnp.asarray(rng.integers(0, 40, T), jnp.int32).at[::3].set(0)
    top_p = jnp.asarray(rng.uniform(0.2, 1.0, T), jnp.float32).at[::4].set(1.0)
    min_p = jnp.asarray(rng.uniform(0.0, 0.2, T), jnp.float32).at[::2].set(0.0)

    one = {}
    for temp in (0.0, 0.8, "mixed"):
        t = temps if temp == "mixed" else temp
        one[temp] = rejection_sample_packed(jnp.asarray(logits), qsl, drafts, jnp.asarray(dprobs), seeds, pos,
                                            temperature=t)
    one_sample = sample_tokens(jnp.asarray(logits), jnp.arange(T, dtype=jnp.int32), jnp.arange(T, dtype=jnp.int32),
                               temperature=0.9)
    one_filter = filter_logits(jnp.asarray(logits), top_k, top_p, min_p)
    nl = T
    lp_args = dict(temperature=temps, lr=jnp.asarray(np.repeat(np.arange(R), 4)[:nl], jnp.int32),
                   lqsl=jnp.asarray([0, 4, 8, 12, 16, 20, 24], jnp.int32), out_tokens=jnp.asarray(drafts[:, :1].repeat(4, 1)),
                   prompt_owner=jnp.full((nl,), -1, jnp.int32), prompt_offset=jnp.full((nl,), -1, jnp.int32),
                   prefill_tokens=jnp.zeros((T,), jnp.int32), qsl=qsl, prefill_len=jnp.zeros((R,), jnp.int32),
                   next_prompt_token=jnp.zeros((R,), jnp.int32))
    one_lp = step_logprobs(jnp.asarray(logits), jnp.asarray(one_filter), **lp_args)
    assert int(np.sum(np.asarray(one["mixed"].num_accepted))) > 0

    for tp in (2, 4):
        mesh = sharding.make_mesh(tp)
        split = jax.device_put(jnp.asarray(logits), NamedSharding(mesh, P(None, sharding.TENSOR)))
        dsplit = jax.device_put(jnp.asarray(dprobs), NamedSharding(mesh, P(None, None, sharding.TENSOR)))
        assert split.addressable_shards[0].data.shape == (T, V // tp)
        for temp, want in one.items():
            t = temps if temp == "mixed" else temp
            got = rejection_sample_packed(split, qsl, drafts, dsplit, seeds, pos, temperature=t, mesh=mesh)
            for a, b in zip(want, got):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        got = sample_tokens(split, jnp.arange(T, dtype=jnp.int32), jnp.arange(T, dtype=jnp.int32), temperature=0.9,
                            mesh=mesh)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(one_sample))
        got_filter = filter_logits(split, top_k, top_p, min_p, mesh=mesh)
        np.testing.assert_array_equal(np.asarray(got_filter), np.asarray(one_filter))
        lp = step_logprobs(split, got_filter, mesh=mesh, **lp_args)
        np.testing.assert_array_equal(np.asarray(lp.token_top_ids), np.asarray(one_lp.token_top_ids))
        np.testing.assert_allclose(np.asarray(lp.token_top_logprobs), np.asarray(one_lp.token_top_logprobs),
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lp.token_logprobs), np.asarray(one_lp.token_logprobs),
                                   rtol=1e-6, atol=1e-6)

        # the compiled sampler: filter, stochastic rejection and the top tokens on the shards; what crosses devices
        # is per-row values, R x N pairs and the top-20 candidates, never a [rows, V] slab
        def sampler(x, d):
            f = filter_logits(x, top_k, top_p, min_p, mesh=mesh)
            out = rejection_sample_packed(f, qsl, drafts, d, seeds, pos, temperature=temps, mesh=mesh)
            return out, step_logprobs(x, f, mesh=mesh, **lp_args).token_top_ids
        shapes = gathers(jax.jit(sampler).lower(split, dsplit).compile())
        assert shapes and all(max(s) < V for s in shapes), shapes
        print("sampler", tp, shapes)

    # an engine's compiled greedy step at TP 2 (drafter included): its gathers are (max, index) pairs per row
    from spec_decode import Engine
    from tests.engine_models import bigram_drafter, damped_target
    target = damped_target(damping=0.3, num_attention_heads=16, num_key_value_heads=2, index_n_heads=2, head_dim=16,
                           num_local_experts=8, num_experts_per_tok=2)
    eng = Engine(target, bigram_drafter(target, block_size=4), num_speculative_tokens=3, verification="fixed",
                 tensor_parallel_size=2, sampling=False, device_loop=False, max_num_seqs=4, max_model_len=96,
                 max_num_batched_tokens=32, implementation="reference", min_token_bucket=32, cost_table=None)
    eng.warmup()
    vocab = target.cfg.vocab_size
    for key, compiled in eng._programs._compiled.items():
        shapes = gathers(compiled)
        assert shapes and all(s[-1] == 2 and s[0] <= key.logit_rows for s in shapes), (key, shapes)
        assert all(vocab not in s for s in shapes), (key, shapes)
        print("greedy program", key.tokens, shapes)
""")


@pytest.mark.slow
def test_sampler_on_vocabulary_shards_matches_one_device():
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("sampler") == 2 and proc.stdout.count("greedy program") >= 1, proc.stdout
