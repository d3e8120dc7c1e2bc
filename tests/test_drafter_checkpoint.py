"""DeepSpec-format drafter checkpoints: save/load round trips, name dialects, corrupted files, config errors."""

import json
import os
import re
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from minimax_jax import CheckpointError, ConfigError
from minimax_jax.config import MiniMaxM3Config
from minimax_jax.drafter import init_drafter
from minimax_jax.drafter_checkpoint import drafter_weight_plan, load_drafter, save_drafter
from minimax_jax.drafter_config import DSparkConfig
from minimax_jax.model import init_model

TCFG = MiniMaxM3Config.tiny(layer_types=("full_attention",) * 4, mlp_layer_types=("dense",) * 4)
D, V = TCFG.hidden_size, TCFG.vocab_size

# (name, drafter options, MLP naming scheme written)
CASES = {
    "vanilla": ({"markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
                     "confidence_head_with_markov": True, "sts_temperatures": (1.0, 1.2, 1.5, 2.0)}, "minimax"),
    "gated": ({"markov_rank": 8, "markov_head_type": "gated", "enable_confidence_head": True,
                   "confidence_head_with_markov": True}, "hf"),
    "rnn": ({"markov_rank": 4, "markov_head_type": "rnn", "num_draft_layers": 2}, "minimax"),
    "plain": ({"target_layer_ids": (2,), "enable_confidence_head": True}, "hf"),
}


@pytest.fixture(scope="module")
def target():
    return init_model(TCFG, dtype=jnp.float32, seed=0)


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    """name -> (drafter, directory written by save_drafter)."""
    out = {}
    for i, (name, (opts, scheme)) in enumerate(CASES.items()):
        kw = {"mask_token_id": V - 1, "block_size": 4, "num_draft_layers": 1, "target_layer_ids": (0, 2)}
        kw.update(opts)
        drafter = init_drafter(DSparkConfig.for_target(TCFG, **kw), target, seed=i)
        # non-zero norm weights and biases, so a mix-up between tensors would show
        for _, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
            if var[...].ndim == 1:
                var[...] = jnp.asarray(np.random.default_rng(i).normal(0, 0.1, var[...].shape), var[...].dtype)
        path = tmp_path_factory.mktemp(name)
        save_drafter(drafter, path, scheme=scheme)
        out[name] = (drafter, path)
    return out


def params(module):
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def copy_dir(src, tmp_path):
    dst = tmp_path / "drafter"
    shutil.copytree(src, dst)
    return dst


def rewrite(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip(saved, target, name):
    drafter, path = saved[name]
    names = set(load_file(path / "model.safetensors"))
    scheme = CASES[name][1]
    expected = {n for alt in drafter_weight_plan(drafter.cfg).values() for n in alt[scheme].names}
    assert names == expected
    assert "fc.weight" in names and "norm.weight" in names and "hidden_norm.weight" in names
    assert ("layers.0.mlp.gate_up_proj.weight" in names) == (scheme == "hf")
    if drafter.cfg.markov_rank:
        shapes = {n: a.shape for n, a in load_file(path / "model.safetensors").items()}
        assert shapes["markov_head.markov_w1.weight"] == (V, drafter.cfg.markov_rank)
        assert shapes["markov_head.markov_w2.weight"] == (V, drafter.cfg.markov_rank)
    loaded = load_drafter(path, target)
    assert loaded.cfg == drafter.cfg
    a, b = params(drafter), params(loaded)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=str(k))
    assert loaded.embed_tokens[...] is target.embed_tokens[...]
    assert loaded.lm_head[...] is target.lm_head[...]


def test_bf16_file_and_name_dialects(saved, target, tmp_path):
    """bf16 tensors, a VL-style prefix, ``decoder_layer.``, ``final_norm``, frozen embedding / head copies, a
    sharded index: all load to the same parameters (up to the bf16 rounding)."""
    drafter, _ = saved["gated"]
    d = tmp_path / "dialect"
    save_drafter(drafter, d, scheme="minimax", dtype=jnp.bfloat16)
    tensors = load_file(d / "model.safetensors")
    assert tensors["fc.weight"].dtype == ml_dtypes.bfloat16
    os.remove(d / "model.safetensors")

    def rename(n):
        n = n.replace("norm.weight", "final_norm.weight") if n == "norm.weight" else n
        if n.startswith("layers."):
            i, rest = n.split(".", 2)[1:]
            n = f"layers.{i}.decoder_layer.{rest}"
        return "language_model.model.dspark." + n

    renamed = {rename(n): a for n, a in tensors.items()}
    renamed["language_model.model.dspark.embed_tokens.weight"] = np.zeros((V, D), ml_dtypes.bfloat16)
    renamed["language_model.model.dspark.lm_head.weight"] = np.zeros((V, D), ml_dtypes.bfloat16)
    names = sorted(renamed)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: renamed[n] for n in part}, d / fname)
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    loaded = load_drafter(d, target)
    a, b = params(drafter), params(loaded)
    for k in a:
        want = np.asarray(a[k].astype(ml_dtypes.bfloat16).astype(np.float32))
        np.testing.assert_array_equal(b[k], want, err_msg=str(k))


def test_corrupted_checkpoint_lists_every_problem(saved, target, tmp_path):
    d = copy_dir(saved["vanilla"][1], tmp_path)

    def corrupt(t):
        del t["markov_head.markov_w1.weight"]
        t["layers.0.mlp.gate_proj.wieght"] = t.pop("layers.0.mlp.gate_proj.weight")
        t["fc.weight"] = t["fc.weight"].T.copy()
        t["confidence_head.proj.weight"] = t["confidence_head.proj.weight"][:, :D].copy()  # no Markov part
        t["lm_head.weight"] = np.zeros((D, V), np.float32)  # a torch-layout copy must be [V, d]
        t["layers.0.self_attn.q_proj.weight_scale_inv"] = np.zeros((2, 2), np.float32)

    rewrite(d, corrupt)
    with pytest.raises(CheckpointError) as e:
        load_drafter(d, target)
    msg = str(e.value)
    assert "missing (2): layers.0.mlp.gate_proj.weight, markov_head.markov_w1.weight" in msg
    # (up_proj is unused without its gate_proj partner, as in the target loader)
    assert ("unexpected (3): layers.0.mlp.gate_proj.wieght, layers.0.mlp.up_proj.weight, "
            "layers.0.self_attn.q_proj.weight_scale_inv" in msg)
    assert "quantised drafter weights are not supported" in msg
    assert f"fc.weight: expected shape ({D}, {2 * D}), found ({2 * D}, {D})" in msg
    assert f"confidence_head.proj.weight: expected shape (1, {D + 8}), found (1, {D})" in msg
    assert f"lm_head.weight: expected shape ({V}, {D}) (shared with the target), found ({D}, {V})" in msg


def test_config_errors(saved, target, tmp_path):
    src = saved["rnn"][1]
    cases = [
        (lambda c: c.update(hidden_size=96), "hidden_size 96 != target hidden_size 64"),
        (lambda c: c.update(vocab_size=512), "vocab_size 512 != target vocab_size 256"),
        (lambda c: c.update(num_target_layers=60), "num_target_layers 60 != the target's 4 layers"),
        (lambda c: c.update(target_layer_ids=[0, 4]), "exceed the target's 4 layers"),
        (lambda c: c.pop("mask_token_id"), "missing 'mask_token_id'"),
        (lambda c: c.update(markov_head_type="lstm"), "markov_head_type must be one of"),
        (lambda c: c.update(mlp_layer_types=["sparse", "sparse"]), "draft layers use 'dense' only"),
    ]
    for i, (fn, msg) in enumerate(cases):
        d = copy_dir(src, tmp_path / str(i))
        edit_config(d, fn)
        with pytest.raises(ConfigError, match=msg):
            load_drafter(d, target)
    # a config that disagrees with the tensors: one draft layer declared, two in the file
    d = copy_dir(src, tmp_path / "layers")
    edit_config(d, lambda c: c.update(num_hidden_layers=1, layer_types=["full_attention"],
                                      mlp_layer_types=["dense"]))
    with pytest.raises(CheckpointError, match=r"unexpected \(\d+\): layers\.1\."):
        load_drafter(d, target)


def test_default_target_layer_ids_from_fc_shape(saved, target, tmp_path):
    """Without target_layer_ids the default formula runs with m = fc in-features / d and the target's N."""
    d = copy_dir(saved["plain"][1], tmp_path)
    edit_config(d, lambda c: (c.pop("target_layer_ids"), c.pop("num_target_layers")))
    loaded = load_drafter(d, target)
    assert loaded.cfg.target_layer_ids == (2,)  # N = 4, m = 1 -> [N // 2]


def test_wrong_dtype_truncated_file_and_file_path(saved, target, tmp_path):
    """The drafter loader shares the target's checks: an integer tensor for a float parameter joins the collected
    error, a truncated file is named, a file path gets a clear error."""
    d = copy_dir(saved["rnn"][1], tmp_path / "dtype")

    def corrupt(t):
        t["fc.weight"] = t["fc.weight"].astype(np.int32)
        del t["norm.weight"]

    rewrite(d, corrupt)
    with pytest.raises(CheckpointError) as e:
        load_drafter(d, target)
    msg = str(e.value)
    assert "wrong dtype (1): fc.weight: found int32, but the float32 parameter fc.kernel needs a floating-point" in msg
    assert "missing (1): norm.weight" in msg

    d = copy_dir(saved["rnn"][1], tmp_path / "truncated")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match=re.escape(f"cannot read the safetensors file {f}: it looks truncated")):
        load_drafter(d, target)

    with pytest.raises(NotADirectoryError, match="expected a drafter checkpoint directory with config.json"):
        load_drafter(saved["rnn"][1] / "model.safetensors", target)


def test_declared_confidence_head_without_weights_loads_without_it(saved, target, tmp_path):
    name = next(n for n, (d, _) in saved.items() if d.has_confidence_head)
    drafter, src = saved[name]
    d = copy_dir(src, tmp_path)
    rewrite(d, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("confidence_head.")]])
    with pytest.warns(UserWarning, match="no confidence_head tensors: loaded without a confidence head"):
        loaded = load_drafter(d, target)
    assert not loaded.has_confidence_head and not loaded.cfg.enable_confidence_head
    want = {k: v for k, v in params(drafter).items() if k[0] != "confidence_head"}
    got = params(loaded)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    # only SOME head tensors missing is a broken checkpoint, not an absent head
    d2 = copy_dir(src, tmp_path / "partial")
    rewrite(d2, lambda t: t.pop("confidence_head.proj.bias"))
    with pytest.raises(CheckpointError, match="confidence_head.proj.bias"):
        load_drafter(d2, target)
