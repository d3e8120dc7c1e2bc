"""Small target/drafter pairs for the engine tests, built so that speculation is actually exercised.

A random target and a random drafter agree on almost nothing, so every draft would be rejected and the
acceptance paths (several accepted drafts, the bonus token, a stop token inside the accepted drafts) would go
untested. :func:`bigram_pair` builds a pair that agrees most of the time but not always:

* the target is a tiny MiniMax-M3 (MSA and MoE layers, selection live beyond ``topk * block`` = 12 tokens) whose
  layers are damped, so its logits are close to a bigram table ``M[x] = norm(embed[x]) @ lm_head`` plus a
  context-dependent perturbation from the (damped) attention and MLPs;
* the drafter ignores its backbone (final norm weight -1: ``h = 0``) and drafts from its vanilla Markov head
  ``B_k = W2 W1[x_{k-1}]`` set to that bigram table, so it proposes the target's bigram guess.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax import DSparkConfig, MiniMaxM3Config, init_drafter, init_model
from minimax_jax.layers import rms_norm

VOCAB = 32
MASK = VOCAB - 1
EOS = 2


def target_config(**overrides) -> MiniMaxM3Config:
    return MiniMaxM3Config.tiny(vocab_size=VOCAB, eos_token_id=(EOS,), bos_token_id=1, max_position_embeddings=512,
                                **overrides)


def damped_target(seed: int = 0, damping: float = 0.15, sharpness: float = 6.0, **overrides):
    """A tiny target whose logits are mostly a (sharp) bigram table, perturbed by context."""
    model = init_model(target_config(**overrides), dtype=jnp.float32, seed=seed)
    for layer in model.layers:
        attn = layer.self_attn
        attn.o_proj.kernel[...] = attn.o_proj.kernel[...] * damping
        mlp = layer.mlp
        down = mlp.down_proj.kernel if hasattr(mlp, "down_proj") else mlp.experts_down
        down[...] = down[...] * damping
        if getattr(mlp, "shared_experts", None) is not None:
            mlp.shared_experts.down_proj.kernel[...] = mlp.shared_experts.down_proj.kernel[...] * damping
    model.lm_head[...] = model.lm_head[...] * sharpness
    return model


def bigram_table(target) -> np.ndarray:
    """``M[x] = final_norm(embed[x]) @ lm_head``: the target's logits with every layer switched off."""
    e = target.embed_tokens[...]
    h = rms_norm(e, target.norm.weight[...], target.cfg.rms_norm_eps)
    return np.asarray(h @ target.lm_head[...], np.float32)


def bigram_drafter(target, *, block_size: int = 7, confidence: bool = True, seed: int = 1):
    """A DSpark drafter for ``target`` that drafts the target's bigram guess (see the module docstring)."""
    cfg = DSparkConfig.for_target(target.cfg, mask_token_id=MASK, block_size=block_size, num_draft_layers=1,
                                  target_layer_ids=(1, 3), markov_rank=VOCAB, markov_head_type="vanilla",
                                  enable_confidence_head=confidence, confidence_head_with_markov=confidence)
    drafter = init_drafter(cfg, target, seed=seed)
    drafter.norm.weight[...] = -jnp.ones_like(drafter.norm.weight[...])  # (1 + w) = 0: h = 0, U = 0
    drafter.markov_head.markov_w1[...] = jnp.eye(VOCAB, dtype=jnp.float32)
    drafter.markov_head.markov_w2.kernel[...] = jnp.asarray(bigram_table(target))
    return drafter


def greedy_reference(target, prompt, max_new_tokens: int, *, stop=(EOS,), length: int = 128, transform=None
                     ) -> list[int]:
    """Greedy target-only decoding with the plain causal forward (one compiled program of ``length`` tokens).

    ``transform(logits f64[V], output so far) -> logits``: applied before the argmax (penalties, min_tokens)."""
    forward = _padded_forward(length)
    seq = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        ids = np.zeros((1, length), np.int32)
        ids[0, : len(seq)] = seq
        logits = np.asarray(forward(target, jnp.asarray(ids))[0, len(seq) - 1], np.float64)
        if transform is not None:
            logits = transform(logits, out)
        tok = int(np.argmax(logits))
        out.append(tok)
        seq.append(tok)
        if tok in stop:
            break
    return out


_FORWARDS: dict = {}


def _padded_forward(length: int):
    if length not in _FORWARDS:
        _FORWARDS[length] = nnx.jit(lambda m, x: m(x))
    return _FORWARDS[length]


def target_probs(target, prefixes: list[list[int]], temperature: float = 1.0, length: int = 64) -> np.ndarray:
    """``p_t(. | prefix)`` for each prefix (the plain forward, float64 softmax)."""
    forward = _padded_forward(length)
    ids = np.zeros((len(prefixes), length), np.int32)
    for i, p in enumerate(prefixes):
        ids[i, : len(p)] = p
    logits = np.asarray(forward(target, jnp.asarray(ids)), np.float64)
    last = logits[np.arange(len(prefixes)), [len(p) - 1 for p in prefixes]] / temperature
    last -= last.max(-1, keepdims=True)
    p = np.exp(last)
    return p / p.sum(-1, keepdims=True)


def random_prompts(n: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1] + [int(x) for x in rng.integers(3, VOCAB - 1, size=int(L) - 1)] for L in
            (lengths if hasattr(lengths, "__len__") else [lengths] * n)]



def penalized(logits: np.ndarray, prompt, output, *, repetition: float = 1.0, frequency: float = 0.0,
              presence: float = 0.0) -> np.ndarray:
    """vLLM's penalties on one row of raw logits (numpy, written independently of the engine's jnp version)."""
    out = np.array(logits, np.float64)
    counts = np.bincount(np.asarray(output, np.int64), minlength=out.shape[-1]) if len(output) else \
        np.zeros(out.shape[-1])
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    return out - frequency * counts - presence * (counts > 0)


def filtered_probs(logits: np.ndarray, temperature: float = 1.0, *, min_p: float = 0.0, top_p: float = 1.0
                   ) -> np.ndarray:
    """softmax(logits / T), then min-p, then top-p (renormalised), for one row (numpy)."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if min_p > 0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        srt = np.sort(p)[::-1]
        before = np.cumsum(srt) - srt
        thresh = np.min(np.where(before < top_p, srt, np.inf))
        p = np.where(p >= thresh, p, 0.0)
        p /= p.sum()
    return p


def target_logits(target, prefixes: list[list[int]], length: int = 64) -> np.ndarray:
    """The raw next-token logits after each prefix (the plain forward, float64)."""
    forward = _padded_forward(length)
    ids = np.zeros((len(prefixes), length), np.int32)
    for i, p in enumerate(prefixes):
        ids[i, : len(p)] = p
    logits = np.asarray(forward(target, jnp.asarray(ids)), np.float64)
    return logits[np.arange(len(prefixes)), [len(p) - 1 for p in prefixes]]
