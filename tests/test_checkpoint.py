"""load_model error reporting on corrupted checkpoints, renames, and the orbax round trip."""

import json
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from minimax_jax import (
    CheckpointError,
    ConfigError,
    MiniMaxM3Config,
    load_model,
    restore_checkpoint,
    save_checkpoint,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
GOLDEN = np.load(os.path.join(FIXTURES, "golden.npz"))


def copy_fixture(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    return dst


def rewrite_single(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def test_renamed_tensor_is_reported_missing_and_unexpected(tmp_path):
    d = copy_fixture("hf_tiny", tmp_path)
    rewrite_single(d, lambda t: t.__setitem__("model.layers.2.self_attn.indexer.qproj.weight",
                                              t.pop("model.layers.2.self_attn.indexer.q_proj.weight")))
    with pytest.raises(CheckpointError) as e:
        load_model(d, dtype=jnp.float32)
    msg = str(e.value)
    assert "missing (1): model.layers.2.self_attn.indexer.q_proj.weight" in msg
    assert "unexpected (1): model.layers.2.self_attn.indexer.qproj.weight" in msg


def test_wrong_shape_and_several_problems_in_one_error(tmp_path):
    d = copy_fixture("hf_tiny", tmp_path)

    def corrupt(t):
        t["model.layers.1.mlp.experts.down_proj"] = t["model.layers.1.mlp.experts.down_proj"][:, :, :16].copy()
        del t["model.norm.weight"]
        t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"].T.copy()

    rewrite_single(d, corrupt)
    with pytest.raises(CheckpointError) as e:
        load_model(d, dtype=jnp.float32)
    msg = str(e.value)
    assert "model.layers.1.mlp.experts.down_proj: expected shape (4, 64, 32), found (4, 64, 16)" in msg
    assert "model.layers.0.self_attn.q_proj.weight: expected shape (64, 64)" not in msg  # square: transposes fit
    assert "missing (1): model.norm.weight" in msg


def test_sharded_original_names_missing_expert(tmp_path):
    d = copy_fixture("minimax_tiny", tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "language_model.model.layers.3.block_sparse_moe.experts.2.w3.weight"
    shard = d / index["weight_map"][name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard)
    del index["weight_map"][name]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing \(1\): model\.layers\.3\.block_sparse_moe\.experts\.2\.w3"):
        load_model(d, dtype=jnp.float32)


def test_missing_shard_file(tmp_path):
    d = copy_fixture("minimax_tiny", tmp_path)
    os.remove(d / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="shard files that do not exist"):
        load_model(d, dtype=jnp.float32)


def test_broken_config(tmp_path):
    d = copy_fixture("hf_tiny", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        load_model(d, dtype=jnp.float32)


def test_config_that_disagrees_with_weights(tmp_path):
    d = copy_fixture("hf_tiny", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mis-shaped \(4\)"):
        load_model(d, dtype=jnp.float32)


def test_explicit_rename_table_and_ignored_vision_tensors(tmp_path):
    d = copy_fixture("hf_tiny", tmp_path)

    def custom(t):
        t["my.final_norm"] = t.pop("model.norm.weight")
        t["vision_tower.patch.weight"] = np.zeros((2, 2), np.float32)

    rewrite_single(d, custom)
    model = load_model(d, dtype=jnp.float32, rename={"my.final_norm": "model.norm.weight"})
    out = np.asarray(model(jnp.asarray(GOLDEN["ids_53"])))
    np.testing.assert_allclose(out, GOLDEN["logits_53"], atol=1e-4)


def test_bf16_load_and_orbax_round_trip(tmp_path):
    model = load_model(os.path.join(FIXTURES, "minimax_tiny"), dtype=jnp.bfloat16)
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    ids = jnp.asarray(GOLDEN["ids_53"])
    before = np.asarray(model(ids))
    # bf16 weights track the fp32 reference loosely (a discrete routing/selection flip moves single rows)
    err = np.abs(before - GOLDEN["logits_53"])
    assert err.mean() < 0.05 * np.abs(GOLDEN["logits_53"]).mean()
    assert np.median(err.max(-1)) < 0.1
    save_checkpoint(model, tmp_path / "ckpt")
    restored = restore_checkpoint(tmp_path / "ckpt")
    assert restored.embed_tokens[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(restored(ids)), before)


def test_integer_tensor_for_a_float_parameter_is_reported_with_the_other_problems(tmp_path):
    d = copy_fixture("hf_tiny", tmp_path)

    def corrupt(t):
        t["model.norm.weight"] = np.zeros(t["model.norm.weight"].shape, np.int64)  # used to load as zeros
        t["model.layers.0.self_attn.k_norm.weight"] = np.ones((3,), np.float32)

    rewrite_single(d, corrupt)
    with pytest.raises(CheckpointError) as e:
        load_model(d, dtype=jnp.float32)
    msg = str(e.value)
    assert ("wrong dtype (1): model.norm.weight: found int64, but the float32 parameter norm.weight needs a "
            "floating-point tensor" in msg)
    assert "mis-shaped (1): model.layers.0.self_attn.k_norm.weight: expected shape (16,), found (3,)" in msg


@pytest.mark.parametrize("fixture, victim", [("hf_tiny", "model.safetensors"),
                                             ("minimax_tiny", "model-00002-of-00002.safetensors")])
def test_truncated_safetensors_file_is_named(tmp_path, fixture, victim):
    d = copy_fixture(fixture, tmp_path)
    f = d / victim
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])  # a download cut short
    want = f"cannot read the safetensors file {f}: it looks truncated or corrupt"
    with pytest.raises(CheckpointError, match=re.escape(want)):
        load_model(d, dtype=jnp.float32)


def test_path_to_a_file_or_nowhere(tmp_path):
    d = os.path.join(FIXTURES, "hf_tiny")
    for name in ("model.safetensors", "config.json"):
        with pytest.raises(NotADirectoryError) as e:
            load_model(os.path.join(d, name), dtype=jnp.float32)
        assert str(e.value) == (f"expected a model checkpoint directory with config.json and *.safetensors, got the "
                                f"file {os.path.join(d, name)}; pass its directory {d}")
    nowhere = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=re.escape(f"no model checkpoint at {nowhere}: the path does not")):
        load_model(nowhere)
    # with an explicit config a single safetensors file is a checkpoint
    cfg = MiniMaxM3Config.from_pretrained(d)
    model = load_model(os.path.join(d, "model.safetensors"), dtype=jnp.float32, config=cfg)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(GOLDEN["ids_53"]))), GOLDEN["logits_53"], atol=1e-4)
    with pytest.raises(CheckpointError, match="expected a .safetensors file or a checkpoint directory"):
        load_model(os.path.join(d, "config.json"), dtype=jnp.float32, config=cfg)


def test_restore_checkpoint_on_what_is_not_an_orbax_checkpoint(tmp_path):
    hf = os.path.join(FIXTURES, "hf_tiny")
    with pytest.raises(CheckpointError) as e:
        restore_checkpoint(hf)
    assert str(e.value) == (f"{hf} is not an orbax checkpoint written by save_checkpoint (a directory without the "
                            f"'state' folder save_checkpoint writes); it holds safetensors: read it with load_model")
    nowhere = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=re.escape(f"no orbax checkpoint at {nowhere}: the path does not")):
        restore_checkpoint(nowhere)
    with pytest.raises(CheckpointError, match=r"is not an orbax checkpoint written by save_checkpoint \(a file\)"):
        restore_checkpoint(os.path.join(hf, "config.json"))
