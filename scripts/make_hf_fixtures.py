"""Build the HF-parity golden files in ``tests/fixtures/`` from the public reference implementation.

Run under Python 3.11 with torch (CPU) and transformers 5.23 (not needed by CI or by the package):

    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors numpy
    /tmp/hfenv/bin/python scripts/make_hf_fixtures.py

It builds a small random ``MiniMaxM3VLForCausalLM`` (2 dense + 2 sparse attention layers, dense and MoE MLPs,
GQA group 2, partial RoPE, index block 4 / top-3 so 64-token sequences really drop blocks), randomises the norm
weights and routing biases, and writes:

* ``hf_tiny/``: ``save_pretrained`` output (HF transformers names, single safetensors file);
* ``minimax_tiny/``: the same weights under the MiniMax original names with a ``language_model.`` prefix,
  sharded in two files with ``model.safetensors.index.json``, and a legacy-dialect ``config.json``
  (``text_config``, ``sparse_attention_config``, ``moe_layer_freq``, top-level ``rope_theta``, no
  ``swiglu_beta``);
* ``golden.npz``: input ids and the reference float32 logits.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import MiniMaxM3VLForCausalLM
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

SEED = 1234

TEXT = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=32, dense_intermediate_size=64, shared_intermediate_size=32, num_local_experts=4,
    num_experts_per_tok=2, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0, rms_norm_eps=1e-6,
    max_position_embeddings=4096, index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=3,
    index_local_blocks=1, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rotary_dim=8,
)
LAYER_TYPES = ["full_attention", "full_attention", "minimax_m3_sparse", "minimax_m3_sparse"]
MLP_TYPES = ["dense", "sparse", "dense", "sparse"]
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}


def build_model() -> MiniMaxM3VLForCausalLM:
    torch.manual_seed(SEED)
    cfg = MiniMaxM3VLTextConfig(**TEXT, layer_types=LAYER_TYPES, mlp_layer_types=MLP_TYPES, rope_parameters=ROPE)
    cfg._attn_implementation = "eager"
    model = MiniMaxM3VLForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))  # Gemma norms: (1 + w), so w != 0 matters
            elif name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] == TEXT["num_local_experts"]:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))  # decisive routing
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def to_original_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF transformers names -> MiniMax original names (with the ``language_model.`` prefix of the VL release)."""
    out = {}
    for k, v in state.items():
        v = v.contiguous()
        if k == "lm_head.weight":
            out["language_model.lm_head.weight"] = v
            continue
        assert k.startswith("model."), k
        k = k.replace(".self_attn.indexer.", ".self_attn.index_")
        if ".mlp.experts.gate_up_proj" in k:  # [E, 2I, d] -> w1 (gate) / w3 (up), each [I, d]
            base = k.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts")
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"language_model.{base}.{e}.w1.weight"] = v[e, :inter].clone()
                out[f"language_model.{base}.{e}.w3.weight"] = v[e, inter:].clone()
            continue
        if ".mlp.experts.down_proj" in k:  # [E, d, I] -> w2 [d, I]
            base = k.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts")
            for e in range(v.shape[0]):
                out[f"language_model.{base}.{e}.w2.weight"] = v[e].clone()
            continue
        if ".mlp.gate.e_score_correction_bias" in k:
            out["language_model." + k.replace(".mlp.gate.e_score_correction_bias",
                                              ".block_sparse_moe.e_score_correction_bias")] = v
            continue
        if ".mlp.gate.weight" in k:
            out["language_model." + k.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = v
            continue
        if ".gate_up_proj.weight" in k:  # dense MLP or shared expert: split into gate_proj / up_proj
            kk = k.replace(".mlp.shared_experts.", ".block_sparse_moe.shared_experts.")
            inter = v.shape[0] // 2
            out["language_model." + kk.replace(".gate_up_proj.", ".gate_proj.")] = v[:inter].clone()
            out["language_model." + kk.replace(".gate_up_proj.", ".up_proj.")] = v[inter:].clone()
            continue
        if ".mlp.shared_experts.down_proj" in k:
            out["language_model." + k.replace(".mlp.shared_experts.", ".block_sparse_moe.shared_experts.")] = v
            continue
        out["language_model." + k] = v
    return out


def legacy_config() -> dict:
    text = {k: v for k, v in TEXT.items() if not k.startswith("index_")}
    text.update(
        model_type="minimax_m3_vl_text", hidden_act="swigluoai", rope_theta=ROPE["rope_theta"],
        moe_layer_freq=[int(t == "sparse") for t in MLP_TYPES],
        sparse_attention_config={
            "sparse_attention_freq": [int(t == "minimax_m3_sparse") for t in LAYER_TYPES],
            "sparse_num_index_heads": TEXT["index_n_heads"], "sparse_index_dim": TEXT["index_head_dim"],
            "sparse_block_size": TEXT["index_block_size"], "sparse_topk_blocks": TEXT["index_topk_blocks"],
            "sparse_local_block": TEXT["index_local_blocks"],
        },
    )
    return {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "text_config": text, "vision_config": {"hidden_size": 32}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    model = build_model()
    hf_dir = os.path.join(out, "hf_tiny")
    model.save_pretrained(hf_dir, safe_serialization=True)
    print("saved", hf_dir, sorted(os.listdir(hf_dir)))

    # Original MiniMax names, sharded in two files.
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    orig = to_original_names(state)
    mm_dir = os.path.join(out, "minimax_tiny")
    os.makedirs(mm_dir, exist_ok=True)
    names = sorted(orig)
    shards = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: orig[k] for k in part}, os.path.join(mm_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(v.numel() * v.element_size() for v in orig.values())
    with open(os.path.join(mm_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(mm_dir, "config.json"), "w") as f:
        json.dump(legacy_config(), f, indent=2)

    # Inputs and expected logits: a batch of two 64-token rows, and one 53-token row (not a block multiple).
    rng = np.random.default_rng(SEED)
    inputs = {"ids_64": rng.integers(0, TEXT["vocab_size"], size=(2, 64)),
              "ids_53": rng.integers(0, TEXT["vocab_size"], size=(1, 53))}
    golden = {}
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.indexer.register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(i, out.detach().clone()))
        for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None
    ]
    with torch.no_grad():
        for name, ids in inputs.items():
            captured.clear()
            logits = model(input_ids=torch.from_numpy(ids), use_cache=False).logits
            golden[name] = ids.astype(np.int32)
            golden["logits_" + name[4:]] = logits.float().numpy()
            # The sparse layers' selections too, to pin down where a mismatch would come from.
            for i, sel in captured.items():
                golden[f"selection_{name[4:]}_layer{i}"] = sel.numpy().astype(np.int32)
    for h in hooks:
        h.remove()
    np.savez_compressed(os.path.join(out, "golden.npz"), **golden)
    sizes = {root: sum(os.path.getsize(os.path.join(root, f)) for f in fs) for root, _, fs in os.walk(out)}
    print("fixture bytes:", sum(sizes.values()), sizes)


if __name__ == "__main__":
    main()
