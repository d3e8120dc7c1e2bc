"""Tiny random checkpoints in the schemas of the published MiniMax-M3 releases, for the loader's tests.

    python scripts/make_checkpoint_fixtures.py OUT_DIR [--kinds bf16 mxfp8 mxfp4]

Each kind is a directory with ``config.json``, two safetensors shards and ``model.safetensors.index.json``, and a
``tokenizer.json`` + ``tokenizer_config.json`` with a ``chat_template`` (docs/CHECKPOINTS.md has the schemas and
where each fact comes from):

* ``bf16`` (``MiniMaxAI/MiniMax-M3``): the VL wrapper (``model_type: minimax_m3_vl``, architecture
  ``MiniMaxM3SparseForConditionalGeneration``, the text model under ``text_config`` with ``num_mtp_modules: 1``),
  MiniMax tensor names under ``language_model.`` (experts ``w1`` / ``w3`` / ``w2``), vision tower, projector and
  patch-merge tensors beside them, no ``mtp.*`` tensors; bf16 weights, the router and its
  ``e_score_correction_bias`` fp32;
* ``mxfp8`` (``MiniMaxAI/MiniMax-M3-MXFP8``): the same with ``quantization_config = {quant_method: mxfp8,
  activation_scheme: dynamic, weight_block_size: [1, 32], ignored_layers: [...]}``; every linear the list does not
  name is a float8_e4m3fn ``weight`` with a uint8 E8M0 ``weight_scale_inv [N, K/32]``;
* ``mxfp4`` (``amd/MiniMax-M3-MXFP4``): a Quark config (OCP MXFP4 weights, dynamic MXFP4 activations, ``exclude``
  globs keeping attention, the dense layers' MLPs, the router and ``lm_head`` in bf16); the routed and shared
  experts are packed uint8 ``weight [N, K/2]`` with a uint8 ``weight_scale [N, K/32]``.

Each quantized kind also gets a ``<kind>_dense`` twin: the same checkpoint without ``quantization_config``, every
quantized weight replaced by its decoded float32 values (``pallas_kernels.mx_formats.dequantize``): the reference
a dequantizing load must reproduce. Which linears this script quantizes is its own statement of each release (the
lists below), so a loader that reads the config's globs differently fails the tests. A few seconds, a few MB.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from minimax_jax.checkpoint import weight_plan
from minimax_jax.config import MiniMaxM3Config
from minimax_jax.safetensors_io import identity
from pallas_kernels import mx_formats

KINDS = ("bf16", "mxfp8", "mxfp4")
SEED = 2025
BF16 = ml_dtypes.bfloat16

# the chat fixture's special tokens (illustrative: a MiniMax-style turn syntax, not the release's template)
SPECIALS = ("<bos>", "<eos>", "<pad>", "]~b]", "[e~[")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ m['role']) }}"
    "{% endif %}"
    "]~b]{{ m['role'] }}\n{{ m['content'] }}[e~[\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}]~b]assistant\n{% endif %}"
)


def fixture_config() -> MiniMaxM3Config:
    """The tiny MiniMax-M3 of the fixtures: every input dimension a multiple of the MX block (32), and those of the
    row-parallel linears (``o_proj``, the dense and shared ``down_proj``) of 128, so TP 2 and TP 4 meshes split
    their scale blocks (2 KV and index heads: replicated at TP 4); the vocabulary holds the byte-level
    tokenizer's 256 bytes and its special tokens, padded to a multiple of 8."""
    return MiniMaxM3Config.tiny(vocab_size=264, bos_token_id=256, eos_token_id=(257,),  # padded, as releases are
                                head_dim=32, dense_intermediate_size=128, shared_intermediate_size=128)


def vl_config(cfg: MiniMaxM3Config, quantization: dict | None) -> dict:
    text = cfg.to_dict()
    text["num_mtp_modules"] = 1
    out = {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "text_config": text,
        "vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "patch_size": 14},
        "projector_hidden_size": 32,
        "torch_dtype": "bfloat16",
    }
    if quantization is not None:
        out["quantization_config"] = quantization
    return out


def mxfp8_config(cfg: MiniMaxM3Config) -> dict:
    ignored = ["lm_head", "model.embed_tokens", "vision_tower", "multi_modal_projector", "patch_merge_mlp"]
    ignored += [f"model.layers.{i}.block_sparse_moe.gate" for i in cfg.moe_layer_ids]
    return {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
            "ignored_layers": ignored}


def quark_config() -> dict:
    fp4 = {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1, "group_size": 32, "symmetric": None,
           "scale_format": "e8m0", "scale_calculation_mode": "even", "round_method": "half_even"}
    return {
        "quant_method": "quark",
        "global_quant_config": {"weight": {**fp4, "is_dynamic": False}, "input_tensors": {**fp4, "is_dynamic": True},
                                "output_tensors": None, "bias": None, "target_device": None},
        "layer_quant_config": {}, "layer_type_quant_config": {},
        "exclude": ["*self_attn*", "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj", "*block_sparse_moe.gate",
                    "lm_head", "*vision_tower*", "*multi_modal_projector*", "*patch_merge_mlp*"],
        "export": {"kv_cache_group": [], "pack_method": "reorder", "weight_format": "real_quantized",
                   "weight_merge_groups": None},
        "quant_mode": "eager_mode", "version": "0.11",
    }


def quantized_by_release(kind: str, name: str) -> bool:
    """This script's own account of which linears each release quantizes (text-model names)."""
    if kind == "mxfp8":
        return not (name == "lm_head.weight" or name.endswith("block_sparse_moe.gate.weight"))
    if kind == "mxfp4":
        return ".block_sparse_moe.experts." in name or ".block_sparse_moe.shared_experts." in name
    return False


def text_tensors(cfg: MiniMaxM3Config, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], set[str]]:
    """Random float32 tensors under the MiniMax names of the text model, and the names of its linears."""
    tensors, linears = {}, set()
    for alts in weight_plan(cfg).values():
        src = alts["minimax"]
        for name, shape in zip(src.names, src.shapes):
            if name.endswith("e_score_correction_bias"):
                x = 0.1 * rng.standard_normal(shape)
            elif "norm" in name:
                x = 0.3 * rng.standard_normal(shape)  # Gemma norms: (1 + w)
            elif name.endswith("block_sparse_moe.gate.weight"):
                x = 0.5 * rng.standard_normal(shape)  # decisive routing
            else:
                x = 0.08 * rng.standard_normal(shape)
            tensors[name] = x.astype(np.float32)
            if src.combine is not identity:
                linears.add(name)
    return tensors, linears


def vision_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {"vision_tower.patch_embed.proj.weight": (32, 3 * 14 * 14),
              "vision_tower.blocks.0.attn.qkv.weight": (96, 32), "vision_tower.blocks.0.norm1.weight": (32,),
              "multi_modal_projector.linear_1.weight": (32, 32), "patch_merge_mlp.fc1.weight": (32, 128)}
    return {k: (0.05 * rng.standard_normal(s)).astype(BF16) for k, s in shapes.items()}


def _prefixed(name: str) -> str:
    return "language_model." + name  # model.* -> language_model.model.*, lm_head.* -> language_model.lm_head.*


def write_sharded(out: str, tensors: dict[str, np.ndarray], cfg: MiniMaxM3Config) -> None:
    """Two shards (the first layers half and embeddings; the rest) with ``model.safetensors.index.json``."""
    half = cfg.num_hidden_layers // 2
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")

    def shard(name):
        parts = name.split(".")
        if "layers" in parts:
            return 0 if int(parts[parts.index("layers") + 1]) < half else 1
        return 0 if "embed_tokens" in name else 1

    groups = [{}, {}]
    for name, x in tensors.items():
        groups[shard(name)][name] = np.ascontiguousarray(x)
    os.makedirs(out, exist_ok=True)
    for f, g in zip(files, groups):
        save_file(g, os.path.join(out, f))
    index = {"metadata": {"total_size": int(sum(x.nbytes for x in tensors.values()))},
             "weight_map": {n: files[shard(n)] for n in sorted(tensors)}}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def write_tokenizer(out: str) -> None:
    """A byte-level BPE over the 256 bytes (no merges) plus :data:`SPECIALS`, and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: (ord(c))))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}, f, indent=2)


def _write_config(out: str, data: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(data, f, indent=2)


def make_fixture(kind: str, root: str, *, seed: int = SEED) -> dict[str, str]:
    """Write ``root/<kind>`` (and ``root/<kind>_dense`` for a quantized kind); returns ``{name: directory}``."""
    if kind not in KINDS:
        raise ValueError(f"unknown fixture kind {kind!r}; kinds: {', '.join(KINDS)}")
    cfg = fixture_config()
    rng = np.random.default_rng(seed)
    dense, linears = text_tensors(cfg, rng)
    vision = vision_tensors(rng)
    stored, twin = {}, {}
    fmt = {"mxfp8": "mxfp8", "mxfp4": "mxfp4"}.get(kind)
    scale = {"mxfp8": "weight_scale_inv", "mxfp4": "weight_scale"}.get(kind)
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        for name, x in dense.items():
            fp32 = name.endswith("e_score_correction_bias") or name.endswith("block_sparse_moe.gate.weight")
            if name in linears and quantized_by_release(kind, name):
                q, s = mx_formats.quantize_reference(fmt, x)
                stored[_prefixed(name)] = q
                stored[_prefixed(name[: -len("weight")] + scale)] = s
                twin[_prefixed(name)] = np.asarray(mx_formats.dequantize(fmt, q, s, dtype=np.float32))
            else:
                value = x if fp32 else x.astype(BF16)
                stored[_prefixed(name)] = value
                twin[_prefixed(name)] = value
    stored.update(vision)
    twin.update(vision)
    out = {kind: os.path.join(root, kind)}
    quant = {"mxfp8": mxfp8_config(cfg), "mxfp4": quark_config()}.get(kind)
    _write_config(out[kind], vl_config(cfg, quant))
    write_sharded(out[kind], stored, cfg)
    write_tokenizer(out[kind])
    if quant is not None:
        out[kind + "_dense"] = os.path.join(root, kind + "_dense")
        _write_config(out[kind + "_dense"], vl_config(cfg, None))
        write_sharded(out[kind + "_dense"], twin, cfg)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    for kind in args.kinds:
        for name, path in make_fixture(kind, args.out, seed=args.seed).items():
            print(f"{name}: {path}")


if __name__ == "__main__":
    main()
