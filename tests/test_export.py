"""save_model writes HF-named safetensors that load_model reads back exactly."""

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from minimax_jax import MiniMaxM3Config, init_model, load_model
from minimax_jax.export import model_tensors, save_model


def test_round_trip_and_names(tmp_path):
    cfg = MiniMaxM3Config.tiny()  # dense + MoE MLPs, full + MSA layers, shared expert
    model = init_model(cfg, dtype=jnp.float32, seed=3)
    # non-zero norms and router biases, so a wrong transform cannot hide behind zeros
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if var.get_value().ndim == 1:
            var.set_value(jnp.linspace(-0.5, 0.5, var.get_value().shape[0], dtype=var.get_value().dtype))
    save_model(model, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and "model.layers.2.self_attn.indexer.q_proj.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names and "lm_head.weight" in names
    back = load_model(tmp_path, dtype=jnp.float32)
    a = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    b = dict(nnx.to_flat_state(nnx.state(back, nnx.Param)))
    assert a.keys() == b.keys()
    for k, var in a.items():
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(b[k].get_value()), err_msg=str(k))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(back(ids)))
    # torch layout on disk: [out, in] and stacked experts [E, 2I, d]
    t = model_tensors(model)
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (cfg.num_attention_heads * cfg.head_dim,
                                                                  cfg.hidden_size)
    np.testing.assert_array_equal(t["model.layers.1.mlp.experts.gate_up_proj"][2],
                                  np.asarray(model.layers[1].mlp.experts_gate_up[...][2]).T)


def test_bf16_export_keeps_router_bias_fp32(tmp_path):
    cfg = MiniMaxM3Config.tiny()
    model = init_model(cfg, dtype=jnp.float32, seed=0)
    bias = model.layers[1].mlp.gate.e_score_correction_bias
    bias.set_value(jnp.asarray([1e-3, 2e-3 + 1e-7, -3e-3, 0.25], jnp.float32))
    save_model(model, tmp_path, dtype=jnp.bfloat16)
    t = load_file(str(tmp_path / "model.safetensors"))
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == np.float32
    assert str(t["model.embed_tokens.weight"].dtype) == "bfloat16"
    back = load_model(tmp_path, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(back.layers[1].mlp.gate.e_score_correction_bias[...]),
                                  np.asarray(bias[...]))
    np.testing.assert_array_equal(np.asarray(back.embed_tokens[...]),
                                  np.asarray(model.embed_tokens[...].astype(jnp.bfloat16)))
