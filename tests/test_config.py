"""MiniMaxM3Config: the config.json dialects of real checkpoints, validation errors, the 428B preset."""

import json
import os

import jax
import jax.numpy as jnp
import pytest

from minimax_jax.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    SPARSE_ATTENTION,
    ConfigError,
    ConfigWarning,
    MiniMaxM3Config,
)
from minimax_jax.model import abstract_model

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def load_json(name):
    with open(os.path.join(FIXTURES, name, "config.json")) as f:
        return json.load(f)


def test_hf_and_legacy_dialects_agree():
    hf = MiniMaxM3Config.from_pretrained(os.path.join(FIXTURES, "hf_tiny"))
    legacy = MiniMaxM3Config.from_pretrained(os.path.join(FIXTURES, "minimax_tiny"))
    assert hf == legacy
    assert hf.rotary_dim == 8 and hf.rope_theta == 10000.0 and hf.swiglu_beta == 1.0
    assert hf.layer_types == (FULL_ATTENTION, FULL_ATTENTION, SPARSE_ATTENTION, SPARSE_ATTENTION)
    assert hf.mlp_layer_types == ("dense", "sparse", "dense", "sparse")


def test_round_trip_and_file_path(tmp_path):
    cfg = MiniMaxM3Config.tiny()
    cfg.save(tmp_path)
    assert MiniMaxM3Config.from_pretrained(tmp_path) == cfg
    assert MiniMaxM3Config.from_pretrained(tmp_path / "config.json") == cfg


def test_rope_theta_nested_and_partial_factor():
    raw = MiniMaxM3Config.tiny().to_dict()
    del raw["rope_theta"], raw["rotary_dim"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25}
    cfg = MiniMaxM3Config.from_pretrained(raw)
    assert cfg.rope_theta == 5e6 and cfg.rotary_dim == 4


def test_real_m3_keys():
    """The key set of the real release (legacy sparse dict, moe_layer_freq, no swiglu_beta) under text_config."""
    n = 60
    text = {
        "vocab_size": 200064, "hidden_size": 6144, "num_hidden_layers": n, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "rotary_dim": 64, "rope_theta": 5000000, "rms_norm_eps": 1e-6,
        "intermediate_size": 3072, "dense_intermediate_size": 12288, "shared_intermediate_size": 3072,
        "num_local_experts": 128, "num_experts_per_tok": 4, "routed_scaling_factor": 2.0, "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0, "hidden_act": "swigluoai", "moe_layer_freq": [0, 0, 0] + [1] * (n - 3),
        "sparse_attention_config": {"sparse_attention_freq": [0, 0, 0] + [1] * (n - 3), "sparse_num_index_heads": 4,
                                    "sparse_index_dim": 128, "sparse_block_size": 128, "sparse_topk_blocks": 16,
                                    "sparse_local_block": 1},
        "bos_token_id": 200034, "eos_token_id": 200020,
    }
    cfg = MiniMaxM3Config.from_pretrained({"text_config": text, "vision_config": {}})
    assert cfg == MiniMaxM3Config.m3()


def test_m3_preset_constructs_abstractly():
    model = abstract_model(MiniMaxM3Config.m3(), dtype=jnp.bfloat16)
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    n = sum(x.size for x in leaves)
    assert 4.0e11 < n < 4.4e11, n


@pytest.mark.parametrize("change, key", [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": -1}, "hidden_size"),
    ({"hidden_size": "big"}, "hidden_size"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"layer_types": ["full_attention", "x", "full_attention", "full_attention"]}, "layer_types[1]"),
    ({"mlp_layer_types": ["dense"] * 5}, "mlp_layer_types"),
    ({"index_n_heads": 4}, "index_n_heads"),
    ({"rotary_dim": 7}, "rotary_dim"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "rope_type"),
    ({"rope_theta": 1.0, "rope_parameters": {"rope_theta": 2.0}}, "rope_theta"),
    ({"rotary_dim": 16, "partial_rotary_factor": 0.5}, "rotary_dim"),
    ({"sparse_attention_config": {"sparse_topk_blocks": 7}, "index_topk_blocks": 3}, "index_topk_blocks"),
    ({"moe_layer_freq": [1, 0]}, "moe_layer_freq"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_act": "silu"}, "hidden_act"),
    ({"hidden_act": "swiglu"}, "hidden_act"),
    ({"attention_output_gate": True}, "attention_output_gate"),
    ({"use_index_cache": True}, "use_index_cache"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"use_gemma_norm": "yes"}, "use_gemma_norm"),
    ({"sparse_attention_config": {"sparse_score_type": "mean"}}, "sparse_score_type"),
    ({"text_config": 5}, "text_config"),
])
def test_errors_name_the_key(change, key):
    raw = MiniMaxM3Config.tiny().to_dict()
    for k in ("layer_types", "mlp_layer_types") if "moe_layer_freq" in change else ():
        raw.pop(k)
    raw.update(change)
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        MiniMaxM3Config.from_pretrained(raw)


F, W, S = FULL_ATTENTION, SLIDING_ATTENTION, SPARSE_ATTENTION


@pytest.mark.parametrize("change, types, window", [
    ({}, (F, F, S, S), None),  # the published form: no window
    ({"sliding_window": None, "use_sliding_window": False}, (F, F, S, S), None),
    ({"sliding_window": 4096, "use_sliding_window": False}, (F, F, S, S), None),  # switched off: dropped
    ({"sliding_window": 64}, (W, W, S, S), 64),  # model-wide: the dense layers slide, MSA layers take none
    ({"sliding_window": 64, "use_sliding_window": True}, (W, W, S, S), 64),
    ({"sliding_window": 7, "layer_types": [F, W, S, S]}, (F, W, S, S), 7),  # per layer, HF style
])
def test_sliding_window_keys(change, types, window):
    raw = {**load_json("hf_tiny"), **change}
    cfg = MiniMaxM3Config.from_pretrained(raw)
    assert cfg.layer_types == types and cfg.sliding_window == window
    assert [cfg.layer_window(i) for i in range(4)] == [window if t == W else None for t in types]
    assert MiniMaxM3Config.from_pretrained(cfg.to_dict()) == cfg


@pytest.mark.parametrize("change, message", [
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"sliding_window": -5}, "sliding_window must be a positive integer"),
    ({"sliding_window": True}, "sliding_window must be a positive integer"),
    ({"sliding_window": 2.5}, "sliding_window must be an integer"),
    ({"sliding_window": [8, None, None, None]}, "per-layer list"),
    ({"use_sliding_window": True}, "use_sliding_window is true but sliding_window is not set"),
    ({"use_sliding_window": "yes", "sliding_window": 8}, "use_sliding_window must be true or false"),
    ({"layer_types": [W, F, S, S]}, r"layer_types\[0\] is 'sliding_attention' but there is no sliding window"),
    ({"layer_types": [W, F, S, S], "sliding_window": 8, "use_sliding_window": False}, "no sliding window"),
    ({"sliding_window": 8, "max_window_layers": 2}, "max_window_layers"),
    ({"sliding_window": 8, "layer_types": [S, S, S, S]}, "MSA layers"),
])
def test_sliding_window_refusals_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        MiniMaxM3Config.from_pretrained({**load_json("hf_tiny"), **change})


def test_sliding_window_dataclass_validation():
    tiny = MiniMaxM3Config.tiny(layer_types=(W, F, S, S), sliding_window=5)
    assert tiny.layer_window(0) == 5 and tiny.layer_window(1) is None and tiny.layer_window(2) is None
    with pytest.raises(ConfigError, match="no layer is 'sliding_attention'"):
        MiniMaxM3Config.tiny(sliding_window=5)
    with pytest.raises(ConfigError, match="sliding_window is not set"):
        MiniMaxM3Config.tiny(layer_types=(W, F, S, S))
    with pytest.raises(ConfigError, match="positive integer"):
        MiniMaxM3Config.tiny(layer_types=(W, F, S, S), sliding_window=0)
    # max_window_layers without a window is bookkeeping (Qwen2-style configs write it), not an error
    MiniMaxM3Config.from_pretrained({**load_json("hf_tiny"), "max_window_layers": 28})


def test_broken_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        MiniMaxM3Config.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):
        MiniMaxM3Config.from_pretrained(tmp_path / "nope")


def test_required_keys_are_named_all_at_once():
    with pytest.raises(ConfigError, match="missing required keys: vocab_size, hidden_size, num_hidden_layers, "
                       "num_attention_heads, num_key_value_heads, layer_types"):
        MiniMaxM3Config.from_pretrained({})
    raw = MiniMaxM3Config.tiny().to_dict()
    for k in ("vocab_size", "num_local_experts", "index_topk_blocks"):
        del raw[k]
    with pytest.raises(ConfigError) as e:
        MiniMaxM3Config.from_pretrained(raw)
    assert "vocab_size" in str(e.value) and "num_local_experts" in str(e.value) and "index_topk_blocks" in str(e.value)


def test_sizes_are_required_only_for_the_layer_kinds_present():
    raw = MiniMaxM3Config.tiny(layer_types=(FULL_ATTENTION,) * 4, mlp_layer_types=("dense",) * 4).to_dict()
    for k in ("intermediate_size", "num_local_experts", "num_experts_per_tok", "shared_intermediate_size",
              "index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks"):
        del raw[k]
    cfg = MiniMaxM3Config.from_pretrained(raw)
    assert cfg.num_local_experts is None and cfg.index_topk_blocks is None and cfg.moe_layer_ids == ()
    assert MiniMaxM3Config.from_pretrained(cfg.to_dict()) == cfg


def test_constructor_needs_the_shape_and_keywords():
    with pytest.raises(TypeError, match="vocab_size"):
        MiniMaxM3Config()
    with pytest.raises(ConfigError, match="dense_intermediate_size is required"):
        MiniMaxM3Config.tiny(dense_intermediate_size=None)
    with pytest.raises(ConfigError, match="shared_intermediate_size is required"):
        MiniMaxM3Config.tiny(shared_intermediate_size=None)


def test_true_defaults_fill_omitted_keys():
    raw = MiniMaxM3Config.tiny().to_dict()
    for k in ("rms_norm_eps", "swiglu_alpha", "swiglu_limit", "swiglu_beta", "routed_scaling_factor",
              "index_local_blocks", "use_gemma_norm", "rotary_dim", "rope_theta", "head_dim"):
        del raw[k]
    cfg = MiniMaxM3Config.from_pretrained(raw)
    assert (cfg.rms_norm_eps, cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_beta) == (1e-6, 1.702, 7.0, 1.0)
    assert (cfg.routed_scaling_factor, cfg.index_local_blocks, cfg.use_gemma_norm) == (2.0, 1, True)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_theta) == (16, 8, 5e6)  # 64 / 4 heads; half rotated


def test_unknown_keys_warn_once_listing_them():
    raw = MiniMaxM3Config.tiny().to_dict()
    raw["num_hiden_layers"] = 4
    raw["sparse_attention_config"] = {"sparse_blok_size": 4}
    with pytest.warns(ConfigWarning) as rec:
        MiniMaxM3Config.from_pretrained(raw)
    assert len(rec) == 1
    assert "num_hiden_layers" in str(rec[0].message) and "sparse_attention_config.sparse_blok_size" in str(
        rec[0].message)


def test_known_keys_of_real_configs_do_not_warn(recwarn):
    raw = MiniMaxM3Config.tiny().to_dict()
    raw.update(architectures=["MiniMaxM3SparseForCausalLM"], use_qk_norm=True, qk_norm_type="per_head",
               scoring_func="sigmoid", use_routing_bias=True, attention_output_gate=False, n_shared_experts=1,
               num_mtp_modules=1, use_index_cache=False, index_topk_freq=1, torch_dtype="bfloat16")
    MiniMaxM3Config.from_pretrained(raw)
    assert not [w for w in recwarn if issubclass(w.category, ConfigWarning)]


def test_special_ids_outside_the_vocabulary_load_as_absent():
    raw = MiniMaxM3Config.tiny().to_dict()
    raw.update(bos_token_id=200034, eos_token_id=[200020, 2], pad_token_id=999)
    with pytest.warns(ConfigWarning, match="treated as absent: eos_token_id 200020, bos_token_id 200034, "
                      "pad_token_id 999"):
        cfg = MiniMaxM3Config.from_pretrained(raw)
    assert cfg.bos_token_id is None and cfg.pad_token_id is None and cfg.eos_token_id == (2,)
    with pytest.raises(ConfigError, match="bos_token_id"):  # the constructor itself stays strict
        MiniMaxM3Config.tiny(bos_token_id=300)


def test_silu_written_by_transformers_loads_as_swigluoai(recwarn):
    raw = MiniMaxM3Config.tiny().to_dict()
    raw.update(hidden_act="silu", transformers_version="5.23.0")
    assert MiniMaxM3Config.from_pretrained(raw) == MiniMaxM3Config.tiny()
    assert not [w for w in recwarn if issubclass(w.category, ConfigWarning)]


def test_not_a_text_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\x00\xff\xfe binary")
    with pytest.raises(ConfigError, match="not a text file"):
        MiniMaxM3Config.from_pretrained(tmp_path)
