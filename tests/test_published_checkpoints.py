"""The published MiniMax-M3 checkpoint schemas (BF16 VL wrapper, MXFP8, Quark MXFP4), from tiny random fixtures
made by scripts/make_checkpoint_fixtures.py: names, configs, dequantizing loads against their dense twins, keep-mode
loads (experts and every other quantized linear as shipped) against the dequantizing ones, sharded (mesh) loads of
both, and every kind of bad input refused before any tensor is read."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file, save_file

from minimax_jax import CheckpointError, ConfigError, MiniMaxM3Config, load_model, sharding
from minimax_jax import safetensors_io as sio
from minimax_jax.checkpoint import _expected_shapes, _linear_names, text_model_name, weight_plan
from minimax_jax.export import save_model
from minimax_jax.model import MiniMaxM3ForCausalLM
from minimax_jax.quantization import DequantizingReader, matches_rule, read_quantization_config
from pallas_kernels import mx_formats
from scripts.make_checkpoint_fixtures import make_fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = jnp.asarray([[256, 5, 9, 200, 17, 3, 3, 80, 41, 7, 2, 99, 13, 6, 250, 11, 258, 40, 33, 1]], jnp.int32)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    out = {}
    for kind in ("bf16", "mxfp8", "mxfp4"):
        out.update(make_fixture(kind, str(root)))
    return out


def copy(fixtures, kind, tmp_path):
    dst = tmp_path / kind
    shutil.copytree(fixtures[kind], dst)
    return dst


def stored_tensors(path):
    """Every tensor of a fixture, read with the project's reader (numpy cannot load float8 with safetensors)."""
    r = sio.SafetensorsReader(path)
    return {n: r.read(n) for n in r.names}


def flat(model):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


# ----------------------------------------------------------------------------------------------- names and config
def test_bf16_vl_release_loads_as_shipped(fixtures, capsys):
    cfg = MiniMaxM3Config.from_pretrained(fixtures["bf16"])  # text_config, num_mtp_modules: no warning, no error
    model = load_model(fixtures["bf16"], dtype=jnp.float32)
    err = capsys.readouterr().err
    assert ("load_model: skipped 5 tensors the text model does not use (projector 1, patch merge 1, vision tower 3)"
            in err)
    t = stored_tensors(fixtures["bf16"])
    assert t["language_model.model.layers.1.block_sparse_moe.gate.weight"].dtype == np.float32
    assert t["language_model.model.layers.1.block_sparse_moe.e_score_correction_bias"].dtype == np.float32
    assert t["language_model.model.embed_tokens.weight"].dtype == jnp.bfloat16
    assert not any("mtp" in n for n in t)
    np.testing.assert_array_equal(np.asarray(model.embed_tokens[...]), t["language_model.model.embed_tokens.weight"])
    p = "language_model.model.layers.3.block_sparse_moe.experts.2."
    gate_up = np.asarray(model.layers[3].mlp.experts_gate_up[...])[2]
    np.testing.assert_array_equal(gate_up, np.concatenate([t[p + "w1.weight"], t[p + "w3.weight"]], 0).T)
    np.testing.assert_array_equal(np.asarray(model.layers[3].mlp.experts_down[...])[2], t[p + "w2.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.gate.kernel[...]),
                                  t["language_model.model.layers.1.block_sparse_moe.gate.weight"].T)
    assert model.cfg == cfg
    assert np.isfinite(np.asarray(model(IDS))).all()


# ----------------------------------------------------------------------------------------------- dequantize
@pytest.mark.parametrize("kind", ["mxfp8", "mxfp4"])
def test_dequantize_equals_the_dense_twin(fixtures, kind):
    """Every quantized weight decoded on load gives exactly the parameters, and so the logits, of the same
    checkpoint stored dense (f32); what is quantized follows the config's lists, tensor by tensor."""
    quant = load_model(fixtures[kind], dtype=jnp.float32, quantization="dequantize")
    dense = load_model(fixtures[kind + "_dense"], dtype=jnp.float32)
    a, b = flat(quant), flat(dense)
    assert a.keys() == b.keys()
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
    np.testing.assert_allclose(np.asarray(quant(IDS)), np.asarray(dense(IDS)), rtol=1e-6, atol=1e-6)
    # the decoded weights are not the random originals: the fixture really is quantized
    t = stored_tensors(fixtures[kind])
    scale = "weight_scale_inv" if kind == "mxfp8" else "weight_scale"
    quantized = {n[: -len(scale)] for n in t if n.endswith(scale)}
    # attention 4 x 4, indexer 2 x 2, dense MLPs 2 x 3, routed 2 x 4 x 3 and shared 2 x 3 experts
    want = {"mxfp8": 4 * 4 + 2 * 2 + 2 * 3 + 2 * (4 * 3 + 3), "mxfp4": 2 * (4 * 3 + 3)}[kind]
    assert len(quantized) == want
    assert not any("self_attn" in n for n in quantized) or kind == "mxfp8"
    assert not any(n.endswith("block_sparse_moe.gate.") or n.startswith("language_model.lm_head") for n in quantized)


def test_dequantize_bf16_rounds_once(fixtures):
    """bf16 loads decode in f32 and round once: equal to the f32 load cast to bf16."""
    f32 = flat(load_model(fixtures["mxfp4"], dtype=jnp.float32, quantization="dequantize"))
    bf16 = flat(load_model(fixtures["mxfp4"], dtype=jnp.bfloat16, quantization="dequantize"))
    for path, x in f32.items():
        want = x if x.dtype == np.float32 and bf16[path].dtype == np.float32 else x.astype(jnp.bfloat16)
        np.testing.assert_array_equal(bf16[path], want, err_msg=str(path))


def test_sliced_decode_matches_whole_decode(fixtures):
    """The sharded loader's path: any column slice decodes as the slice of the whole decoded tensor."""
    cfg = MiniMaxM3Config.from_pretrained(fixtures["mxfp4"])
    plan = weight_plan(cfg)
    raw = json.load(open(os.path.join(fixtures["mxfp4"], "config.json")))
    reader = DequantizingReader(sio.SafetensorsReader(fixtures["mxfp4"], rename=text_model_name),
                                read_quantization_config(raw), linear_names=_linear_names(plan),
                                expected_shapes=_expected_shapes(plan))
    name = "model.layers.1.block_sparse_moe.experts.0.w2.weight"  # [64, 32]: one block of 32 columns
    whole = reader.read(name)
    assert whole.shape == reader.shape(name) == (64, 32) and reader.is_floating(name)
    name2 = "model.layers.1.block_sparse_moe.experts.1.w1.weight"  # [32, 64]: two blocks
    whole2 = reader.read(name2)
    for r0, r1, c0, c1 in [(0, 64, 0, 32), (5, 17, 3, 29), (0, 1, 31, 32)]:
        np.testing.assert_array_equal(reader.read_slice(name, (slice(r0, r1), slice(c0, c1))), whole[r0:r1, c0:c1])
    for c0, c1 in [(0, 64), (16, 48), (32, 64), (30, 34), (63, 64)]:
        np.testing.assert_array_equal(reader.read_slice(name2, (slice(2, 9), slice(c0, c1))), whole2[2:9, c0:c1])


@pytest.mark.slow
def test_loading_onto_a_mesh(fixtures):
    """4 virtual CPU devices: the MXFP4 and MXFP8 fixtures loaded onto TP 2 and TP 4 meshes give the unsharded
    load's parameters (heads replicated at TP 4) and logits, dequantized (decoded per slice) and in keep mode (the
    MX tensors and their scales split with the linear: o_proj's and down_proj's scale blocks with their inputs,
    the replicated KV and index heads' rows with their scales)."""
    code = textwrap.dedent(f"""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        from minimax_jax import load_model, sharding
        jax.config.update("jax_default_matmul_precision", "highest")
        ids = jnp.asarray({np.asarray(IDS).tolist()}, jnp.int32)
        for path in {[fixtures["mxfp4"], fixtures["mxfp8"]]!r}:
            deq = np.asarray(load_model(path, dtype=jnp.float32, quantization="dequantize")(ids))
            for mode in ("dequantize", "keep"):
                ref = load_model(path, dtype=jnp.float32, quantization=mode)
                want = np.asarray(ref(ids))
                np.testing.assert_allclose(want, deq, rtol=1e-6, atol=1e-6)
                for tp in (2, 4):
                    model = load_model(path, dtype=jnp.float32, quantization=mode, mesh=sharding.make_mesh(tp))
                    assert model.cfg == sharding.stored_config(ref.cfg, tp)
                    same = sharding.replicate_heads(ref, tp)
                    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)),
                                              nnx.to_flat_state(nnx.state(same))):
                        a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
                        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), p
                    if mode == "keep":
                        shared = model.layers[1].mlp.shared_experts.down_proj  # row-parallel: [d, I/32] by columns
                        s = shared.w_scale[...]
                        assert s.addressable_shards[0].data.shape == (s.shape[0], s.shape[1] // tp), s.shape
                        q = shared.w_q[...]
                        assert q.addressable_shards[0].data.shape == (q.shape[0], q.shape[1] // tp), q.shape
                    if mode == "keep" and "mxfp8" in path:
                        k = model.layers[0].self_attn.k_proj.w_q[...]  # column-parallel: heads by rows
                        assert k.shape[0] == max(2, tp) * 32 and k.addressable_shards[0].data.shape[0] == 32
                        o = model.layers[0].self_attn.o_proj.w_scale[...]
                        assert o.addressable_shards[0].data.shape == (64, 4 // tp)
                    np.testing.assert_allclose(np.asarray(model(ids)), want, rtol=2e-5, atol=2e-5)
                    print("placed", mode, tp)
    """)
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("placed") == 8, proc.stdout


# ----------------------------------------------------------------------------------------------- keep
def _keep_config(cfg, fmt):
    return dataclasses.replace(cfg, expert_quantization=fmt)


@pytest.mark.parametrize("kind, fmt, scale, elem", [("mxfp4", "mxfp4", "weight_scale", np.uint8),
                                                    ("mxfp8", "mxfp8", "weight_scale_inv", jnp.float8_e4m3fn)])
def test_keep_mode_plan_reads_the_experts_as_shipped(fixtures, kind, fmt, scale, elem):
    """The keep-mode weight plan builds w_gate_up_q [E, 2I, d/2|d] (rows [0, I) w1, [I, 2I) w3), w_gate_up_scale
    [E, 2I, d/32], w_down_q [E, d, I/2|I] and w_down_scale [E, d, I/32] bit-identical to the shipped tensors."""
    dense_cfg = MiniMaxM3Config.from_pretrained(fixtures[kind])
    cfg = _keep_config(dense_cfg, fmt)
    plan = weight_plan(cfg)
    kept = {k: v for k, v in plan.items() if k[-1].startswith("w_")}
    assert sorted({k[-1] for k in kept}) == ["w_down_q", "w_down_scale", "w_gate_up_q", "w_gate_up_scale"]
    e, d, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    pack = 2 if fmt == "mxfp4" else 1
    want_shapes = {"w_gate_up_q": ((e, 2 * i, d // pack), elem), "w_gate_up_scale": ((e, 2 * i, d // 32), np.uint8),
                   "w_down_q": ((e, d, i // pack), elem), "w_down_scale": ((e, d, i // 32), np.uint8)}
    state = nnx.from_flat_state({k: nnx.Param(jnp.zeros(*want_shapes[k[-1]])) for k in kept})
    raw = json.load(open(os.path.join(fixtures[kind], "config.json")))
    names = {n for src in kept.values() for n in src["minimax"].names}
    reader = DequantizingReader(sio.SafetensorsReader(fixtures[kind], rename=text_model_name),
                                read_quantization_config(raw), linear_names=_linear_names(weight_plan(dense_cfg)),
                                expected_shapes=_expected_shapes(weight_plan(dense_cfg)), keep=names.__contains__)
    loaded = dict(nnx.to_flat_state(sio.load_weights(kept, reader, state, kind="model", against="keep", prefer="minimax",
                                                     ignore=re.compile("."))))
    t = stored_tensors(fixtures[kind])
    for layer in cfg.moe_layer_ids:
        p = f"language_model.model.layers.{layer}.block_sparse_moe.experts."
        got = {k[-1]: np.asarray(v.get_value()) for k, v in loaded.items() if k[1] == layer}
        for name, (shape, dtype) in want_shapes.items():
            assert got[name].shape == shape and got[name].dtype == np.dtype(dtype), name
        for j in range(e):
            for q, s, parts in (("w_gate_up_q", "w_gate_up_scale", ("w1", "w3")), ("w_down_q", "w_down_scale", ("w2",))):
                w = np.concatenate([t[f"{p}{j}.{x}.weight"] for x in parts], 0)
                sc = np.concatenate([t[f"{p}{j}.{x}.{scale}"] for x in parts], 0)
                assert got[q][j].tobytes() == w.tobytes() and got[s][j].tobytes() == sc.tobytes()
        # and the kept arrays decode to the dense twin's experts (JAX layout there)
        dense = load_model(fixtures[kind + "_dense"], dtype=jnp.float32).layers[layer].mlp
        np.testing.assert_array_equal(np.swapaxes(np.asarray(mx_formats.dequantize(fmt, got["w_gate_up_q"],
                                                                                   got["w_gate_up_scale"])), 1, 2),
                                      np.asarray(dense.experts_gate_up[...]))
        np.testing.assert_array_equal(np.swapaxes(np.asarray(mx_formats.dequantize(fmt, got["w_down_q"],
                                                                                   got["w_down_scale"])), 1, 2),
                                      np.asarray(dense.experts_down[...]))


def _module_path(name: str) -> str:
    """A shipped linear's module (``language_model.model.layers.0.self_attn.index_q_proj``) as the model's path
    (``layers.0.self_attn.indexer.q_proj``); gate and up parts name their fused ``gate_up_proj``."""
    m = name.removeprefix("language_model.model.")
    m = re.sub(r"self_attn\.index_([qk])_proj", r"self_attn.indexer.\1_proj", m)
    m = m.replace("block_sparse_moe.shared_experts.", "mlp.shared_experts.")
    return re.sub(r"\.(gate|up)_proj$", ".gate_up_proj", m)


@pytest.mark.parametrize("kind, scale", [("mxfp8", "weight_scale_inv"), ("mxfp4", "weight_scale")])
def test_keep_mode_holds_every_quantized_linear_quantized(fixtures, kind, scale):
    """Keep mode (the default) holds the routed experts and every other quantized linear as shipped (the MXFP8
    release's attention, index projections, dense MLPs and shared expert; the Quark release's shared expert),
    cfg.quantized_linears names exactly those, and the logits equal the dequantizing load's (f32) and the dense
    twin's."""
    model = load_model(fixtures[kind], dtype=jnp.float32)
    t = stored_tensors(fixtures[kind])
    quantized = {n[: -len("." + scale)] for n in t if n.endswith(scale) and ".experts." not in n}
    want = sorted({_module_path(n) for n in quantized})
    assert sorted(model.cfg.quantized_linears) == want and model.cfg.linear_quantization == kind
    assert len(want) == {"mxfp8": 4 * 4 + 2 * 2 + 2 * 2 + 2 * 2, "mxfp4": 2 * 2}[kind]
    modules = {".".join(map(str, p[:-1])): p[:-1] for p, _ in nnx.to_flat_state(nnx.state(model))
               if p[-1] == "w_q"}
    assert sorted(modules) == want  # and every other linear is dense
    by_module = {}
    for n in quantized:
        by_module.setdefault(_module_path(n), []).append(n)
    for path, names in by_module.items():
        layer = model
        for part in modules[path]:
            layer = layer[part] if isinstance(part, int) else getattr(layer, part)
        names = sorted(names, key=lambda n: not n.endswith("gate_proj"))  # [gate; up]
        assert np.asarray(layer.w_q[...]).tobytes() == np.concatenate([t[n + ".weight"] for n in names]).tobytes()
        assert np.asarray(layer.w_scale[...]).tobytes() == np.concatenate([t[f"{n}.{scale}"] for n in names]).tobytes()
    p = "language_model.model.layers.3.block_sparse_moe.experts.1."
    mlp = model.layers[3].mlp
    assert np.asarray(mlp.w_gate_up_q[...])[1].tobytes() == np.concatenate(
        [t[p + "w1.weight"], t[p + "w3.weight"]], 0).tobytes()
    assert np.asarray(mlp.w_down_scale[...])[1].tobytes() == t[p + "w2." + scale].tobytes()
    got = np.asarray(model(IDS))
    deq = load_model(fixtures[kind], dtype=jnp.float32, quantization="dequantize")
    np.testing.assert_allclose(got, np.asarray(deq(IDS)), rtol=1e-6, atol=1e-6)
    dense = load_model(fixtures[kind + "_dense"], dtype=jnp.float32)
    np.testing.assert_allclose(got, np.asarray(dense(IDS)), rtol=1e-5, atol=1e-5)
    assert MiniMaxM3Config.from_pretrained(model.cfg.to_dict()) == model.cfg  # save_checkpoint's round trip
    with pytest.raises(CheckpointError, match="holds MX tensors"):
        save_model(model, "unused")


def test_mx_linears_that_a_mesh_would_cut_are_refused():
    """A row-parallel MX linear whose per-device inputs would cut a 32-input scale block is refused, naming the
    parameter; so are quantized_linears entries that are not linears of the model."""
    cfg = MiniMaxM3Config.tiny(linear_quantization="mxfp8", quantized_linears=("layers.0.self_attn.o_proj",))
    model = lambda: MiniMaxM3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))  # noqa: E731
    layout = sharding.param_layout(model, cfg, 2)  # o_proj: 64 inputs, 2 blocks: one per device
    assert layout["layers/0/self_attn/o_proj/w_scale"].spec == PartitionSpec(None, sharding.TENSOR)
    assert layout["layers/0/self_attn/o_proj/w_q"].spec == PartitionSpec(None, sharding.TENSOR)
    with pytest.raises(ValueError, match=re.escape("layers/0/self_attn/o_proj/w_scale: a row-parallel MX linear "
                                                   "with 64 inputs (2 scale blocks of 32) does not split over "
                                                   "tensor_parallel_size=4")):
        sharding.param_layout(model, cfg, 4)
    for bad, message in [(("layers.0.mlp.shared_experts.down_proj",), "not a linear of this model"),
                         (("layers.1.self_attn.indexer.q_proj",), "not a linear of this model"),
                         (("lm_head",), "not a linear of this model")]:
        with pytest.raises(ConfigError, match=message):
            MiniMaxM3Config.tiny(linear_quantization="mxfp4", quantized_linears=bad)
    with pytest.raises(ConfigError, match="both set or neither"):
        MiniMaxM3Config.tiny(linear_quantization="mxfp4")
    with pytest.raises(ConfigError, match="has 48 inputs, not a multiple of 32"):
        MiniMaxM3Config.tiny(dense_intermediate_size=48, linear_quantization="mxfp4",
                             quantized_linears=("layers.0.mlp.down_proj",))


# ----------------------------------------------------------------------------------------------- rules
def test_exclusion_rules():
    n = "language_model.model.layers.3.block_sparse_moe.gate"
    assert matches_rule(n, "model.layers.3.block_sparse_moe.gate")  # component run, inside the VL prefix
    assert matches_rule(n, "*block_sparse_moe.gate")
    assert not matches_rule(n + "_proj", "model.layers.3.block_sparse_moe.gate")
    assert not matches_rule("model.layers.13.block_sparse_moe.gate", "model.layers.3.block_sparse_moe.gate")
    assert matches_rule("vision_tower.blocks.0.attn.qkv", "vision_tower")
    assert matches_rule("model.layers.0.self_attn.q_proj", "*self_attn*")
    assert matches_rule("model.layers.0.mlp.gate_proj", "*mlp.gate_proj")
    assert not matches_rule("model.layers.1.block_sparse_moe.shared_experts.gate_proj", "*mlp.gate_proj")
    assert matches_rule("model.layers.7.self_attn.o_proj", r"re:model\.layers\.\d+\.self_attn")
    assert not matches_rule("lm_head", r"re:model\.")


@pytest.mark.parametrize("change, key", [
    ({"quant_method": "fp8"}, "quant_method='fp8'"),
    ({"quant_method": "gptq"}, "quant_method='gptq'"),
    ({"weight_block_size": [128, 128]}, "weight_block_size"),
    ({"activation_scheme": "static"}, "activation_scheme"),
    ({"ignored_layers": "lm_head"}, "ignored_layers"),
])
def test_unsupported_mxfp8_configs_are_named(change, key):
    q = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
         "ignored_layers": ["lm_head"], **change}
    with pytest.raises(ConfigError, match=re.escape(key)):
        read_quantization_config({"quantization_config": q})


@pytest.mark.parametrize("where, value, key", [
    ("weight", {"scale_format": "fp8_e4m3"}, "weight.scale_format='fp8_e4m3'"),
    ("weight", {"group_size": 16}, "weight.group_size=16"),
    ("weight", {"dtype": "int4"}, "weight.dtype='int4'"),
    ("weight", {"qscheme": "per_channel"}, "weight.qscheme='per_channel'"),
    ("input_tensors", {"is_dynamic": False}, "input_tensors: static activation scales"),
    ("output_tensors", {"dtype": "fp8_e4m3"}, "output_tensors"),
    ("layer_quant_config", {"*down_proj": {"weight": {"dtype": "fp8_e4m3"}}}, "layer_quant_config['*down_proj']"),
    ("export", {"kv_cache_group": ["*k_proj"]}, "kv_cache_group"),
])
def test_unsupported_quark_configs_are_named(where, value, key):
    from scripts.make_checkpoint_fixtures import quark_config

    q = quark_config()
    g = q["global_quant_config"]
    if where in ("weight", "input_tensors"):
        g[where] = {**g[where], **value}
    elif where == "output_tensors":
        g[where] = value
    else:
        q[where] = {**q[where], **value}
    with pytest.raises(ConfigError, match=re.escape(key)):
        read_quantization_config({"quantization_config": q})


def test_quantization_config_is_read_by_from_pretrained(fixtures, tmp_path):
    assert read_quantization_config(json.load(open(os.path.join(fixtures["mxfp8"], "config.json")))).method == "mxfp8"
    d = copy(fixtures, "mxfp4", tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw["quantization_config"]["global_quant_config"]["weight"]["scale_format"] = "ue4m3"
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="scale_format='ue4m3' is not supported"):
        load_model(d, dtype=jnp.float32, quantization="dequantize")


# ----------------------------------------------------------------------------------------------- bad tensors
def rewrite(d, fn, shard="model-00001-of-00002.safetensors"):
    """Apply ``fn(tensors)`` to a shard of an MXFP4 fixture (bf16 and uint8 only; the first holds layers 0 and 1)
    and rewrite the index to match, so that only the tampering is wrong."""
    index_file = d / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    tensors = load_file(d / shard)
    fn(tensors)
    save_file(tensors, d / shard)
    index["weight_map"] = {**{n: f for n, f in index["weight_map"].items() if f != shard},
                           **dict.fromkeys(tensors, shard)}
    index_file.write_text(json.dumps(index))


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Bad input must be refused from headers alone: reading any tensor data fails the test."""
    def boom(self, *a, **k):
        raise AssertionError("tensor data was read before the error")
    monkeypatch.setattr(sio.SafetensorsReader, "read", boom)
    monkeypatch.setattr(sio.SafetensorsReader, "read_slice", boom)


E = "language_model.model.layers.1.block_sparse_moe.experts.0."


@pytest.mark.parametrize("tamper, message", [
    (lambda t: t.__setitem__(E + "w1.weight_scale", t[E + "w1.weight_scale"][:, :1].copy()),
     f"{E}w1.weight: scales (32, 1) do not match the weight: expected (32, 2)"),
    (lambda t: t.__setitem__(E + "w2.weight_scale", t[E + "w2.weight_scale"].astype(np.float32)),
     f"{E}w2.weight: E8M0 scales must be uint8, got float32"),
    (lambda t: (t.__setitem__(E + "w3.weight", t[E + "w3.weight"][:, :16].copy()),
                t.__setitem__(E + "w3.weight_scale", t[E + "w3.weight_scale"][:, :1].copy())),
     f"{E}w3.weight: mxfp4 weight (32, 16) has 16 columns; an input dimension of 64 packs into 32 "
     f"(the config's input dimension is 64)"),
    (lambda t: t.__setitem__(E + "w1.weight", t[E + "w1.weight"].view(np.int8)),
     f"{E}w1.weight: mxfp4 elements must be uint8, got int8"),
    (lambda t: t.pop(E + "w2.weight_scale"),
     f"{E}w2.weight: no exclude entry matches {E}w2, so quantization_config says it is mxfp4, but there is no "
     f"{E}w2.weight_scale"),
    (lambda t: t.__setitem__("language_model.model.layers.0.self_attn.q_proj.weight_scale",
                             np.full((64, 2), 127, np.uint8)),
     "language_model.model.layers.0.self_attn.q_proj.weight_scale: language_model.model.layers.0.self_attn.q_proj is "
     "excluded from quantization by the exclude entry '*self_attn*', yet carries a weight_scale"),
])
def test_bad_quantized_tensors_are_named_before_any_read(fixtures, tmp_path, tamper, message, no_tensor_reads):
    d = copy(fixtures, "mxfp4", tmp_path)
    rewrite(d, tamper)
    with pytest.raises(CheckpointError) as e:
        load_model(d, dtype=jnp.float32, quantization="dequantize")
    assert message in str(e.value), str(e.value)


def test_shards_that_disagree_with_the_index_are_named(fixtures, tmp_path):
    d = copy(fixtures, "mxfp4", tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert index["weight_map"][name] == first
    a, b = load_file(d / first), load_file(d / second)
    b[name] = a.pop(name)  # moved to the other shard, the index not updated
    save_file(a, d / first)
    save_file(b, d / second)
    with pytest.raises(CheckpointError) as e:
        load_model(d, dtype=jnp.float32, quantization="dequantize")
    msg = str(e.value)
    assert "model.safetensors.index.json disagrees with its shards" in msg
    assert f"{first} lacks 1 tensor(s) the index places in it: {name}" in msg
    assert f"{second} holds 1 tensor(s) the index does not place in it: {name} (index: {first})" in msg


def test_scales_without_a_quantization_config_are_explained(fixtures, tmp_path):
    d = copy(fixtures, "mxfp4", tmp_path)
    raw = json.loads((d / "config.json").read_text())
    del raw["quantization_config"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="read as quantised only with the quantization_config"):
        load_model(d, dtype=jnp.float32)
