"""A model whose routed experts are kept as MX tensors (``cfg.expert_quantization``) == the same model with the
experts ``dequantize``d to dense f32: the MoE block through the dequantizing kernel (interpret mode, padding
tokens masked), the whole model's logits (plain forward, and the packed forward with the kernel), the random
init's params (valid MX tensors, traceable), the sharding rules and expert parallelism on 2 virtual devices."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minimax_jax import sharding
from minimax_jax.cache import init_cache, page_size_for
from minimax_jax.config import ConfigError, MiniMaxM3Config
from minimax_jax.decode import RaggedBatch, forward_ragged
from minimax_jax.layers import MoE, random_mx_weights
from minimax_jax.model import MiniMaxM3ForCausalLM
from pallas_kernels.mx_formats import check_mx_shapes, dequantize
from pallas_kernels.mx_grouped_gemm import dense_weights
from tests.test_grouped_gemm import fresh_seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MX_PARAMS = ("w_gate_up_q", "w_gate_up_scale", "w_down_q", "w_down_scale")


def quantized_and_dense(fmt: str, seed: int):
    """``(quantized model, the same model with dense dequantized experts)``, f32: one seed, so every other
    parameter is drawn identically (the MoE draws two expert keys either way)."""
    qm = MiniMaxM3ForCausalLM(MiniMaxM3Config.tiny(expert_quantization=fmt), dtype=jnp.float32,
                              rngs=nnx.Rngs(seed))
    dm = MiniMaxM3ForCausalLM(MiniMaxM3Config.tiny(), dtype=jnp.float32, rngs=nnx.Rngs(seed))
    for q, d in zip(qm.layers, dm.layers, strict=True):
        if isinstance(q.mlp, MoE):
            d.mlp.experts_gate_up[...] = dense_weights(q.mlp.w_gate_up_q[...], q.mlp.w_gate_up_scale[...],
                                                       jnp.float32)
            d.mlp.experts_down[...] = dense_weights(q.mlp.w_down_q[...], q.mlp.w_down_scale[...], jnp.float32)
    return qm, dm


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_quantized_model_matches_dequantized_model(fmt):
    seed = fresh_seed()
    qm, dm = quantized_and_dense(fmt, seed)
    cfg = qm.cfg
    flat_q = {"/".join(map(str, k)): v[...] for k, v in nnx.to_flat_state(nnx.state(qm))}
    flat_d = {"/".join(map(str, k)): v[...] for k, v in nnx.to_flat_state(nnx.state(dm))}
    shared = [k for k in flat_q if k in flat_d]
    assert len(shared) == len(flat_d) - 2 * len(cfg.moe_layer_ids)  # all but the dense experts
    for k in shared:
        np.testing.assert_array_equal(flat_q[k], flat_d[k], err_msg=k)
    # the random init: valid MX tensors in the checkpoint's [E, out, in] layout, scales varying per block
    moe = qm.layers[cfg.moe_layer_ids[0]].mlp
    e, d, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    check_mx_shapes(fmt, moe.w_gate_up_q.shape, moe.w_gate_up_q.dtype, moe.w_gate_up_scale.shape,
                    moe.w_gate_up_scale.dtype, in_features=d, name="w_gate_up_q")
    check_mx_shapes(fmt, moe.w_down_q.shape, moe.w_down_q.dtype, moe.w_down_scale.shape, moe.w_down_scale.dtype,
                    in_features=i, name="w_down_q")
    assert moe.w_gate_up_q.shape[:2] == (e, 2 * i) and moe.w_down_q.shape[:2] == (e, d)
    assert len(np.unique(np.asarray(moe.w_gate_up_scale[...]))) == 3
    rms = float(jnp.sqrt(jnp.mean(dequantize(fmt, moe.w_gate_up_q[...], moe.w_gate_up_scale[...]) ** 2)))
    assert 0.005 < rms < 0.08, rms

    rng = np.random.default_rng(seed)
    # 1. The MoE block: the dequantizing kernel (interpret mode) with masked (padding) tokens == the dense
    #    block's ragged_dot path, f32 tight.
    x = jnp.asarray(rng.standard_normal((11, cfg.hidden_size)), jnp.float32)
    mask = jnp.asarray(rng.random(11) < 0.7)
    got = moe(x, implementation="pallas", interpret=True, token_mask=mask)
    want = dm.layers[cfg.moe_layer_ids[0]].mlp(x, token_mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")
    # 2. Logits of the plain forward (the MoE's default path: dequantize + ragged_dot).
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    np.testing.assert_allclose(qm(ids), dm(ids), rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    # 3. The packed forward with the dequantizing kernel in every MoE layer (a padding slot at the end) ==
    #    the dense model's packed forward on the reference path.
    n, t = 9, 12
    page = page_size_for(cfg)
    nb = -(-n // page)
    batch = RaggedBatch(jnp.pad(ids[0], (0, t - n)), jnp.asarray([0, n], jnp.int32), jnp.asarray([n], jnp.int32),
                        jnp.arange(nb, dtype=jnp.int32)[None])
    h_q = forward_ragged(qm, init_cache(cfg, nb, dtype=jnp.float32), batch, implementation="reference",
                         moe_implementation="pallas", interpret=True)[0]
    h_d = forward_ragged(dm, init_cache(dm.cfg, nb, dtype=jnp.float32), batch, implementation="reference")[0]
    np.testing.assert_allclose(qm.logits(h_q[:n]), dm.logits(h_d[:n]), rtol=1e-5, atol=1e-5,
                               err_msg=f"seed {seed}")


def test_config_sharding_and_abstract_init():
    with pytest.raises(ConfigError, match="expert_quantization must be None, 'mxfp4' or 'mxfp8'"):
        MiniMaxM3Config.tiny(expert_quantization="int4")
    with pytest.raises(ConfigError, match="needs intermediate_size to be a multiple of 32"):
        MiniMaxM3Config.tiny(expert_quantization="mxfp4", intermediate_size=48)
    with pytest.raises(ValueError, match="fmt must be one of"):
        random_mx_weights(jax.random.PRNGKey(0), "fp4", (2, 32, 64))
    cfg = MiniMaxM3Config.tiny(expert_quantization="mxfp4")
    layout = sharding.param_layout(lambda: MiniMaxM3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), cfg, 2)
    mx = {k: v for k, v in layout.items() if k.rsplit("/", 1)[-1] in MX_PARAMS}
    assert len(mx) == 4 * len(cfg.moe_layer_ids)
    for name, p in mx.items():
        assert p.spec == jax.sharding.PartitionSpec(sharding.TENSOR, None, None), name
    # the 428B preset's quantized experts, abstractly (jax.eval_shape: the random init traces)
    m3 = MiniMaxM3Config.m3().replace(expert_quantization="mxfp4")
    plan = sharding.memory_plan(m3, tensor_parallel_size=8)
    dense = sharding.memory_plan(MiniMaxM3Config.m3(), tensor_parallel_size=8)
    experts = len(m3.moe_layer_ids) * m3.num_local_experts * 3 * m3.hidden_size * m3.intermediate_size
    assert dense.checkpoint_bytes - plan.checkpoint_bytes == experts * 2 - round(experts * (0.5 + 1 / 32))


EP_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from flax import nnx
    from minimax_jax import sharding
    from minimax_jax.config import MiniMaxM3Config
    from minimax_jax.layers import MoE
    cfg = MiniMaxM3Config.tiny(expert_quantization="mxfp8")
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((10, cfg.hidden_size)), jnp.float32)
    mask = jnp.arange(10) < 8
    want = moe(x, implementation="reference", token_mask=mask)
    mesh = sharding.make_mesh(2)
    sharding.shard_module(moe, mesh, cfg)
    q = moe.w_gate_up_q[...]
    assert q.addressable_shards[0].data.shape[0] == q.shape[0] // 2, q.sharding
    got = moe(x, implementation="pallas", interpret=True, token_mask=mask, mesh=mesh)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    print("ok", float(jnp.max(jnp.abs(got - want))))
""")


def test_expert_parallel_quantized_experts():
    """Expert parallelism over 2 virtual CPU devices (a subprocess): each device runs the dequantizing kernel on
    its own half of the MX experts (split along the expert axis, as ``experts_gate_up``), a psum adds them."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    res = subprocess.run([sys.executable, "-c", EP_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
