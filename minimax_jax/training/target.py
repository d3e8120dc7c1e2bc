"""Training the MiniMax-M3-shaped target: training forward, loss, router balancing, held-out bits per byte.

**Training forward.** :func:`train_forward` walks the project's own :class:`MiniMaxM3ForCausalLM` modules (the
same projections, norms, RoPE, MSA selection functions, ``grouped_attention`` and MLPs as
``MiniMaxM3ForCausalLM.__call__``; ``tests/test_training.py`` checks its logits equal the plain forward's) and
also returns what training needs from inside the layers:

* **MSA indexer distillation** (DeepSeek-V3.2's lightning-indexer recipe, at block level). Top-k selection gives
  the indexer no gradient, so on every sparse layer the indexer is trained with a KL loss: the target is the
  *dense* causal attention of the layer's own queries and keys (detached), its probability mass per key block,
  averaged over the query heads of each KV group; the prediction is the softmax of the indexer's block scores
  (the max-pooled scores the selection ranks). Both are restricted to the blocks the selection actually
  chooses among (visible, not forced local) and renormalised. The indexer reads a detached copy of the layer
  input, so this loss trains the indexer only, and the language-model loss never reaches the indexer.
* **Dense warm-up**: for the first steps the sparse layers attend densely (causal) while the indexer learns;
  then selection is switched on. (The model is trained and shipped sparse.)
* **Selection recall**: the share of the dense attention mass inside the selected blocks, for tokens that have
  more visible blocks than ``index_topk_blocks`` (a number for the model card).
* **Router load**: tokens per expert of every MoE layer. The router is balanced without an auxiliary loss, as in
  DeepSeek-V3 / MiniMax-M3: after each step ``e_score_correction_bias += rate * sign(mean_load - load)``
  (the bias only shifts the top-k choice, so it is updated outside the optimiser).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax import msa
from minimax_jax.attention import MASK_VALUE, grouped_attention
from minimax_jax.layers import swigluoai
from minimax_jax.model import MiniMaxM3ForCausalLM
from minimax_jax.training.loop import apply_updates, cast_floats, global_norm

_TINY = 1e-30


def is_router_bias(path, _value) -> bool:
    """nnx filter: the routers' ``e_score_correction_bias`` (updated by balancing, not by the optimiser)."""
    return bool(path) and path[-1] == "e_score_correction_bias"


# ----------------------------------------------------------------------------------------------- forward
def attention_block_mass(q: jax.Array, k: jax.Array, positions: jax.Array, *, block_size: int) -> jax.Array:
    """Dense causal attention mass per key block, averaged over the query heads of each KV group.

    ``q [B, S, H, D]``, ``k [B, S, G, D]`` (normed, rotated), ``positions int32[B, S]`` -> ``f32[B, G, S, NB]``.
    """
    b, s, h, d = q.shape
    g = k.shape[2]
    nb = -(-s // block_size)
    qg = q.reshape(b, s, g, h // g, d)
    scores = jnp.einsum("bqgnd,bkgd->bgnqk", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
    causal = jnp.arange(s)[None, None, None, None, :] <= positions[:, None, None, :, None]
    probs = jax.nn.softmax(jnp.where(causal, scores, MASK_VALUE), axis=-1)
    probs = jnp.where(causal, probs, 0.0)
    probs = jnp.pad(probs, ((0, 0),) * 4 + ((0, nb * block_size - s),))
    return probs.reshape(b, g, h // g, s, nb, block_size).sum(-1).mean(axis=2)


def indexer_distillation(block_scores: jax.Array, mass: jax.Array, positions: jax.Array, *, block_size: int,
                         local_blocks: int) -> tuple[jax.Array, jax.Array]:
    """KL(target mass || softmax(indexer block scores)) over the candidate blocks of each (token, group).

    Candidates: visible blocks that are not forced (``b <= pos // block - local_blocks``). Returns the summed KL
    and the number of (token, group) pairs with at least two candidates (the others carry no ranking).
    """
    q_block = positions // block_size  # [B, S]
    nb = block_scores.shape[-1]
    cand = jnp.arange(nb)[None, None, None, :] <= (q_block - local_blocks)[:, None, :, None]  # [B, 1, S, NB]
    logp = jax.nn.log_softmax(jnp.where(cand, block_scores, MASK_VALUE), axis=-1)
    t = jnp.where(cand, jax.lax.stop_gradient(mass), 0.0)
    t = t / jnp.maximum(jnp.sum(t, axis=-1, keepdims=True), _TINY)
    kl = jnp.sum(jnp.where(cand & (t > 0), t * (jnp.log(jnp.maximum(t, _TINY)) - logp), 0.0), axis=-1)  # [B,G,S]
    counted = jnp.broadcast_to(jnp.sum(cand, axis=-1) >= 2, kl.shape)
    return jnp.sum(jnp.where(counted, kl, 0.0)), jnp.sum(counted).astype(jnp.float32)


def selection_recall(selected: jax.Array, mass: jax.Array, positions: jax.Array, *, block_size: int,
                     topk: int) -> tuple[jax.Array, jax.Array]:
    """Summed share of the dense attention mass inside the selected blocks, over (token, group) pairs with
    more than ``topk`` visible blocks, and their number. ``selected int32[B, G, S, topk]``."""
    nb = mass.shape[-1]
    onehot = (selected[..., None] == jnp.arange(nb)).any(axis=-2)  # [B, G, S, NB]
    share = jnp.sum(jnp.where(onehot, mass, 0.0), axis=-1)  # [B, G, S]
    live = jnp.broadcast_to((positions // block_size + 1 > topk)[:, None, :], share.shape)
    return jnp.sum(jnp.where(live, share, 0.0)), jnp.sum(live).astype(jnp.float32)


def _attention(attn, x, positions, cos, sin, *, dense: bool, distill: bool):
    """One attention block as in ``Attention.__call__``, plus the indexer's distillation terms."""
    c = attn.cfg
    b, s, _ = x.shape
    q, k, v = attn.project_qkv(x, cos, sin)
    zero = jnp.zeros((), jnp.float32)
    aux = {"kl_sum": zero, "kl_count": zero, "recall_sum": zero, "recall_count": zero}
    if not attn.is_sparse:
        causal = jnp.arange(s)[None, None, None, :] <= positions[:, None, :, None]
        allowed = jnp.broadcast_to(causal, (b, c.num_key_value_heads, s, s))
    else:
        iq, ik = attn.indexer.project(jax.lax.stop_gradient(x) if distill else x, cos, sin)
        scores = msa.block_scores(iq, ik, positions, block_size=c.index_block_size)
        sel = msa.select_blocks(jax.lax.stop_gradient(scores), positions, block_size=c.index_block_size,
                                topk=c.index_topk_blocks, local_blocks=c.index_local_blocks)
        if dense:
            causal = jnp.arange(s)[None, None, None, :] <= positions[:, None, :, None]
            allowed = jnp.broadcast_to(causal, (b, c.num_key_value_heads, s, s))
        else:
            allowed = msa.selection_key_mask(sel, positions, s, block_size=c.index_block_size)
        if distill:
            mass = jax.lax.stop_gradient(attention_block_mass(q, k, positions, block_size=c.index_block_size))
            aux["kl_sum"], aux["kl_count"] = indexer_distillation(
                scores, mass, positions, block_size=c.index_block_size, local_blocks=c.index_local_blocks)
            aux["recall_sum"], aux["recall_count"] = selection_recall(
                sel, mass, positions, block_size=c.index_block_size, topk=c.index_topk_blocks)
    out = grouped_attention(q, k, v, allowed, scale=c.head_dim ** -0.5)
    return attn.o_proj(out.reshape(b, s, -1)), aux


def moe_all_experts(moe, x: jax.Array) -> jax.Array:
    """``MoE.__call__`` computed by running every token through every routed expert and weighting by the
    router's (zero for unselected experts) weights: the same function and roundings as the grouped
    ``ragged_dot`` path, without ``ragged_dot``'s backward (whose GPU lowering we cannot rely on); ``E / k``
    times the routed FLOPs, which is small at the default's 8 experts of 64."""
    c = moe.cfg
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    weights, experts = moe.gate(x2)  # [N, k]
    full = jnp.zeros((x2.shape[0], c.num_local_experts), jnp.float32)
    full = full.at[jnp.arange(x2.shape[0])[:, None], experts].add(weights)  # [N, E]
    wgu, wd = moe.experts_gate_up[...], moe.experts_down[...]
    h = jnp.einsum("nd,edf->enf", x2.astype(wgu.dtype), wgu, preferred_element_type=jnp.float32).astype(wgu.dtype)
    h = swigluoai(h, alpha=c.swiglu_alpha, limit=c.swiglu_limit, beta=c.swiglu_beta)
    y = jnp.einsum("enf,efd->end", h, wd, preferred_element_type=jnp.float32).astype(wd.dtype).astype(jnp.float32)
    out = jnp.einsum("end,ne->nd", y, full)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x2).astype(jnp.float32)
    return out.astype(x.dtype).reshape(shape)


def train_forward(model: MiniMaxM3ForCausalLM, input_ids: jax.Array, *, dense: bool = False,
                  distill: bool = True, moe_impl: str = "model") -> tuple[jax.Array, dict]:
    """Residual stream after the last layer ``[B, S, d]`` (before the final norm) and the training aux terms.

    ``dense=True`` makes sparse layers attend densely (warm-up); ``dense=False, distill=False`` computes exactly
    ``model.hidden_states(input_ids)[0]``. ``moe_impl``: "model" (the model's grouped ``ragged_dot`` MoE) or
    "all_experts" (:func:`moe_all_experts`, the same function). Aux: ``kl_sum, kl_count, recall_sum,
    recall_count`` (summed over sparse layers) and ``expert_load f32[L_moe, E]`` (token-expert assignments).
    """
    if moe_impl not in ("model", "all_experts"):
        raise ValueError(f"moe_impl must be 'model' or 'all_experts', got {moe_impl!r}")
    cfg = model.cfg
    b, s = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    cos, sin = model.rope(positions)
    x = model.embed(input_ids)
    totals = {"kl_sum": 0.0, "kl_count": 0.0, "recall_sum": 0.0, "recall_count": 0.0}
    loads = []
    for i, layer in enumerate(model.layers):
        attn_out, aux = _attention(layer.self_attn, layer.input_layernorm(x), positions, cos, sin, dense=dense,
                                   distill=distill)
        totals = {k: totals[k] + aux[k] for k in totals}
        h = x + attn_out
        hn = layer.post_attention_layernorm(h)
        if cfg.is_moe_layer(i):
            _, experts = layer.mlp.gate(jax.lax.stop_gradient(hn).reshape(-1, hn.shape[-1]))
            loads.append(jnp.bincount(experts.reshape(-1), length=cfg.num_local_experts).astype(jnp.float32))
        x = h + (moe_all_experts(layer.mlp, hn) if moe_impl == "all_experts" and cfg.is_moe_layer(i)
                 else layer.mlp(hn))
    totals["expert_load"] = jnp.stack(loads) if loads else jnp.zeros((0, 1), jnp.float32)
    return x, totals


def token_nll(model: MiniMaxM3ForCausalLM, hidden: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood ``f32[B, S]`` of ``labels`` under ``model.logits(hidden)``."""
    logits = model.logits(hidden)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return lse - picked


# ----------------------------------------------------------------------------------------------- training step
def router_bias_update(biases, loads: jax.Array, moe_layer_ids, rate: float):
    """``bias += rate * sign(mean(load) - load)`` for every MoE layer (``loads f32[L_moe, E]``)."""
    flat = dict(nnx.to_flat_state(biases))
    for j, i in enumerate(moe_layer_ids):
        path = ("layers", i, "mlp", "gate", "e_score_correction_bias")
        var = flat[path]
        load = loads[j]
        new = var.get_value() + rate * jnp.sign(jnp.mean(load) - load)
        flat[path] = var.replace(new.astype(var.get_value().dtype))
    return nnx.from_flat_state(flat)


def make_train_step(graphdef, optimizer, moe_layer_ids, *, compute_dtype, kl_weight: float = 1.0,
                    bias_rate: float = 1e-3, pad_id: int | None = None, moe_impl: str = "all_experts"):
    """``step(state, batch int32[B, S + 1], lr, dense=...) -> (state, metrics)``, jitted (state donated).

    ``state = {"params": f32 State, "biases": State, "opt": optimiser state}``; ``graphdef`` from
    ``nnx.split(model, is_router_bias, nnx.Param)`` of a model built in ``compute_dtype``; ``moe_layer_ids`` from
    its config. The loss is ``CE + kl_weight * indexer KL``; the router biases move by ``bias_rate`` per step.
    ``moe_impl`` as in :func:`train_forward` (default "all_experts": no ``ragged_dot`` in the backward pass).
    """

    def loss_fn(params, biases, batch, dense):
        model = nnx.merge(graphdef, biases, cast_floats(params, compute_dtype))
        inputs, labels = batch[:, :-1], batch[:, 1:]
        hidden, aux = train_forward(model, inputs, dense=dense, moe_impl=moe_impl)
        nll = token_nll(model, hidden, labels)
        mask = jnp.ones_like(nll) if pad_id is None else (labels != pad_id).astype(jnp.float32)
        ce = jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        kl = aux["kl_sum"] / jnp.maximum(aux["kl_count"], 1.0)
        return ce + kl_weight * kl, (ce, kl, aux)

    @functools.partial(jax.jit, static_argnames=("dense",), donate_argnums=(0,))
    def step(state, batch, lr, dense: bool = False):
        grads, (ce, kl, aux) = jax.grad(loss_fn, has_aux=True)(state["params"], state["biases"], batch, dense)
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        params = apply_updates(state["params"], updates, lr)
        loads = aux["expert_load"]
        biases = state["biases"]
        metrics = {"loss": ce + kl_weight * kl, "ce": ce, "indexer_kl": kl,
                   "recall": aux["recall_sum"] / jnp.maximum(aux["recall_count"], 1.0),
                   "grad_norm": global_norm(grads)}
        if moe_layer_ids:
            biases = router_bias_update(biases, loads, moe_layer_ids, bias_rate)
            frac = loads / jnp.maximum(jnp.sum(loads, axis=-1, keepdims=True), 1.0)
            metrics["max_load"] = jnp.max(frac) * frac.shape[-1]  # 1.0 = perfectly balanced
        return {"params": params, "biases": biases, "opt": opt}, metrics

    return step


# ----------------------------------------------------------------------------------------------- evaluation
@functools.partial(jax.jit, static_argnums=(0,))
def _eval_batch(graphdef, state, windows, token_bytes, bos_id, pad_id):
    model = nnx.merge(graphdef, state)
    inputs, labels = windows[:, :-1], windows[:, 1:]
    # the plain causal forward (train_forward without distillation computes exactly model.hidden_states; tested)
    # plus the router loads
    hidden, aux = train_forward(model, inputs, distill=False)
    nll = token_nll(model, hidden, labels)
    counted = (labels != pad_id) & (labels != bos_id)
    return (jnp.sum(jnp.where(counted, nll, 0.0)), jnp.sum(jnp.where(counted, token_bytes[labels], 0)),
            jnp.sum(counted), aux["expert_load"])


def heldout_bits_per_byte(model: MiniMaxM3ForCausalLM, windows: np.ndarray, token_bytes: np.ndarray, *,
                          batch_size: int, bos_id: int, pad_id: int) -> dict:
    """Bits per UTF-8 byte of held-out text under the plain causal forward (the shipped computation).

    ``windows int32[W, S]`` from :func:`minimax_jax.training.corpus.eval_windows`; every label that is not
    padding or a document's BOS counts (EOS included: the end of a file is part of the text), and the bytes are
    those the labels stand for (``token_bytes``). Returns ``bpb``, ``nll_per_token`` (nats), ``tokens``,
    ``bytes`` and ``expert_load``: per MoE layer, the share of token-expert assignments of each expert.
    """
    graphdef, state = nnx.split(model)
    nll = nbytes = ntok = 0.0
    loads = None
    token_bytes = jnp.asarray(token_bytes, jnp.int32)
    w = np.asarray(windows, np.int32)
    for start in range(0, w.shape[0], batch_size):
        chunk = w[start:start + batch_size]
        if chunk.shape[0] < batch_size:  # one compiled shape: pad with all-padding rows
            chunk = np.concatenate([chunk, np.full((batch_size - chunk.shape[0], w.shape[1]), pad_id, np.int32)])
        a, b, c, ld = jax.device_get(_eval_batch(graphdef, state, jnp.asarray(chunk), token_bytes, bos_id, pad_id))
        nll, nbytes, ntok = nll + float(a), nbytes + float(b), ntok + float(c)
        loads = ld if loads is None else loads + ld
    frac = loads / np.maximum(loads.sum(axis=-1, keepdims=True), 1.0)
    return {"bpb": nll / math.log(2.0) / max(nbytes, 1.0), "nll_per_token": nll / max(ntok, 1.0),
            "tokens": int(ntok), "bytes": int(nbytes),
            "expert_load": {f"layer_{i}": [round(float(x), 4) for x in frac[j]]
                            for j, i in enumerate(model.cfg.moe_layer_ids)}}
