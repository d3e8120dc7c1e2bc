"""Training the DSpark drafter on a frozen target: many-anchor training forward and the DeepSpec loss.

**Training forward** (:func:`block_hidden_many`): for each sequence, ``A`` anchors at positions ``a``; block
inputs ``[x_a, MASK x (K - 1)]`` at positions ``a .. a + K - 1``; each block attends to the context positions
``j < a`` (keys/values projected once per sequence from ``H_ctx``) and bidirectionally to its own ``K`` slots.
It runs the drafter's own ``DraftLayer`` modules with a training attention core (:func:`many_block_attention`)
that shares one context among all blocks of a sequence instead of one context copy per anchor; for each anchor
it equals ``DSparkDrafter.block_hidden_reference`` (tested).

**Loss** (DeepSpec, docs/DRAFTER.md), per block slot ``k = 0..K-1`` (slot ``k`` predicts token ``a + k + 1``):

* ``p_d = softmax(U_k + B_k)``: the draft distribution with the Markov bias teacher-forced on the ground truth
  (``x_{k-1}`` = token ``a + k``, the anchor for ``k = 0``; ``MarkovHead.block_bias``);
* ``p_t``: the frozen target's distribution for the same token (its logits at position ``a + k``);
* ``loss = 0.1 CE(p_d, y) + 0.9 ||p_d - p_t||_1 + 1.0 BCE(c_k, 1 - 0.5 ||p_d - p_t||_1)`` with the confidence
  ``c_k = sigmoid(w . [h_k ; e_k] + b)`` and its label detached (``1 - TV`` is the probability that a draft from
  ``p_d`` is accepted by the stochastic rule at temperature 1);
* each term averaged with position weights ``exp(-k / 4)`` over slots whose label lies inside the window and is
  not padding or a document's BOS.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.attention import MASK_VALUE
from minimax_jax.layers import rope_cos_sin
from minimax_jax.training.loop import apply_updates, cast_floats, global_norm

LOSS_WEIGHTS = {"ce": 0.1, "l1": 0.9, "bce": 1.0}
POSITION_DECAY = 4.0


# ----------------------------------------------------------------------------------------------- target side
def target_features_and_logits(target, input_ids: jax.Array, layer_ids: Sequence[int]):
    """One frozen target forward: ``(features [B, S, m*d], logits f32[B, S, V])``.

    The features are what :func:`minimax_jax.drafter.capture_target_features` returns (residual stream after
    each of ``layer_ids``, -1 = embeddings), computed in the same pass as the logits.
    """
    layers = [i for i in layer_ids if i >= 0]
    final, captured = target.hidden_states(input_ids, capture_layers=layers)
    by_id = dict(zip(layers, captured))
    feats = [target.embed(input_ids) if i < 0 else by_id[i] for i in layer_ids]
    return jnp.concatenate(feats, axis=-1), target.logits(final)


# ----------------------------------------------------------------------------------------------- drafter side
def many_block_attention(q, k_ctx, v_ctx, ctx_visible, k_blk, v_blk, *, scale: float, block: int) -> jax.Array:
    """``draft_attention`` for ``A`` blocks of one sequence sharing its context.

    ``q [B, A*K, H, D]``; ``k_ctx, v_ctx [B, S, G, D]``; ``ctx_visible bool[B, A*K, S]``;
    ``k_blk, v_blk [B, A*K, G, D]`` (block ``i`` = rows ``i*K .. i*K+K-1``) -> ``[B, A*K, H, D]``. Each row attends
    to its visible context and to the ``K`` keys of its own block, under one fp32 softmax.
    """
    b, n, h, d = q.shape
    g = k_ctx.shape[2]
    a, hpg = n // block, h // g
    qg = q.reshape(b, n, g, hpg, d)
    s_ctx = jnp.einsum("bqgnd,bsgd->bgnqs", qg, k_ctx, preferred_element_type=jnp.float32) * scale
    vis = ctx_visible[:, None, None, :, :]
    s_ctx = jnp.where(vis, s_ctx, MASK_VALUE)
    qb = qg.reshape(b, a, block, g, hpg, d)
    kb = k_blk.reshape(b, a, block, g, d)
    vb = v_blk.reshape(b, a, block, g, d)
    s_blk = jnp.einsum("baqgnd,bakgd->bgnaqk", qb, kb, preferred_element_type=jnp.float32) * scale
    s_blk = s_blk.reshape(b, g, hpg, n, block)
    m = jnp.maximum(jnp.max(s_ctx, axis=-1), jnp.max(s_blk, axis=-1))[..., None]
    p_ctx = jnp.where(vis, jnp.exp(s_ctx - m), 0.0)
    p_blk = jnp.exp(s_blk - m)
    denom = jnp.sum(p_ctx, axis=-1) + jnp.sum(p_blk, axis=-1)  # [B, G, n, A*K]
    out_ctx = jnp.einsum("bgnqs,bsgd->bgnqd", p_ctx.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32)
    p_blk = p_blk.reshape(b, g, hpg, a, block, block).astype(v_blk.dtype)
    out_blk = jnp.einsum("bgnaqk,bakgd->bgnaqd", p_blk, vb, preferred_element_type=jnp.float32)
    out = (out_ctx + out_blk.reshape(b, g, hpg, n, d)) / denom[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, n, h, d).astype(q.dtype)


def block_hidden_many(drafter, features: jax.Array, input_ids: jax.Array, anchor_pos: jax.Array) -> jax.Array:
    """Final-normed block hidden states ``h [B, A, K, d]`` for ``A`` anchors per sequence.

    ``features [B, S, m*d]`` target features of positions ``0..S-1``; ``input_ids int32[B, S]``;
    ``anchor_pos int32[B, A]`` in ``[0, S)``. Block ``(b, i)`` = ``[x_a, MASK ...]`` at positions ``a..a+K-1`` with
    context ``j < a``: for each anchor the same as ``drafter.block_hidden_reference(features[b], x_a, a)``.
    """
    cfg = drafter.cfg
    c = cfg.layer_config
    kk = cfg.block_size
    b, s = input_ids.shape
    a = anchor_pos.shape[1]
    h_ctx = drafter.project_features(features)  # [B, S, d]
    cos_c, sin_c = rope_cos_sin(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), c.rotary_dim,
                                c.rope_theta)
    anchors = jnp.take_along_axis(input_ids, anchor_pos, axis=1)  # [B, A]
    ids = jnp.concatenate([anchors[..., None], jnp.full((b, a, kk - 1), cfg.mask_token_id, jnp.int32)], axis=-1)
    x = jnp.take(drafter.embed_tokens[...], ids.reshape(b, a * kk), axis=0).astype(drafter.dtype)
    positions = (anchor_pos[..., None] + jnp.arange(kk, dtype=jnp.int32)).reshape(b, a * kk)
    cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta)
    row_anchor = jnp.repeat(anchor_pos, kk, axis=1)  # [B, A*K]
    visible = jnp.arange(s)[None, None, :] < row_anchor[:, :, None]  # [B, A*K, S]
    attention = functools.partial(many_block_attention, block=kk)
    for layer in drafter.layers:
        k_ctx, v_ctx = layer.context_kv(h_ctx, cos_c, sin_c)
        x = layer(x, cos, sin, k_ctx, v_ctx, visible, attention=attention)
    return drafter.norm(x).reshape(b, a, kk, -1)


def gather_block_targets(input_ids: jax.Array, anchor_pos: jax.Array, block_size: int, *, bos_id: int | None,
                         pad_id: int | None):
    """``(prev int32[B, A, K], labels int32[B, A, K], valid bool[B, A, K])``: slot ``k`` reads ``x_{a+k}`` (the
    Markov head's teacher-forced previous token) and predicts ``x_{a+k+1}``; a slot is valid when its label is
    inside the window and not padding / a document's BOS."""
    s = input_ids.shape[1]
    pos = anchor_pos[..., None] + jnp.arange(block_size, dtype=jnp.int32)  # [B, A, K]
    b = input_ids.shape[0]

    def flat(p):
        return jnp.take_along_axis(input_ids, jnp.clip(p, 0, s - 1).reshape(b, -1), axis=1).reshape(p.shape)

    prev, labels = flat(pos), flat(pos + 1)
    valid = pos + 1 < s
    for bad in (bos_id, pad_id):
        if bad is not None:
            valid = valid & (labels != bad)
    return prev, labels, valid


def position_weights(block_size: int) -> jax.Array:
    return jnp.exp(-jnp.arange(block_size, dtype=jnp.float32) / POSITION_DECAY)


def deepspec_terms(drafter, h: jax.Array, prev: jax.Array, labels: jax.Array, target_logits: jax.Array) -> dict:
    """Per-slot loss terms ``[B, A, K]``: ``ce``, ``l1`` (``||p_d - p_t||_1``), ``bce``, plus ``accept``
    (``1 - TV``), ``top1`` (argmax of ``p_d`` equals the label) and ``conf`` (sigmoid of the confidence logit).

    ``h [B, A, K, d]``; ``target_logits f32[B, A, K, V]`` the target's logits for the same tokens.
    """
    b, a, kk, d = h.shape
    rows_h, rows_prev = h.reshape(b * a, kk, d), prev.reshape(b * a, kk)
    logits = drafter.logits(rows_h)
    if drafter.markov_head is not None:
        logits = logits + drafter.markov_head.block_bias(rows_prev, rows_h)
    logits = logits.reshape(b, a, kk, -1)
    logp_d = jax.nn.log_softmax(logits, axis=-1)
    p_d = jnp.exp(logp_d)
    p_t = jax.lax.stop_gradient(jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1))
    ce = -jnp.take_along_axis(logp_d, labels[..., None], axis=-1)[..., 0]
    l1 = jnp.sum(jnp.abs(p_d - p_t), axis=-1)
    accept = jax.lax.stop_gradient(1.0 - 0.5 * l1)
    out = {"ce": ce, "l1": l1, "accept": accept,
           "top1": (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)}
    if drafter.confidence_head is not None:
        feats = rows_h
        if drafter.cfg.confidence_head_with_markov:
            feats = jnp.concatenate([rows_h, drafter.markov_head.embed(rows_prev).astype(rows_h.dtype)], axis=-1)
        z = drafter.confidence_head(feats).reshape(b, a, kk).astype(jnp.float32)
        out["bce"] = jax.nn.softplus(z) - accept * z  # BCE(sigmoid(z), accept) in logit form
        out["conf"] = jax.nn.sigmoid(z)
    return out


def weighted_mean(term: jax.Array, valid: jax.Array, weights: jax.Array) -> jax.Array:
    w = valid.astype(jnp.float32) * weights
    return jnp.sum(term * w) / jnp.maximum(jnp.sum(w), 1e-9)


def deepspec_loss(terms: dict, valid: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """``0.1 CE + 0.9 L1 + 1.0 BCE``, each a position-weighted mean over valid slots."""
    kk = valid.shape[-1]
    weights = position_weights(kk) if weights is None else weights
    total = LOSS_WEIGHTS["ce"] * weighted_mean(terms["ce"], valid, weights)
    total = total + LOSS_WEIGHTS["l1"] * weighted_mean(terms["l1"], valid, weights)
    if "bce" in terms:
        total = total + LOSS_WEIGHTS["bce"] * weighted_mean(terms["bce"], valid, weights)
    return total


def sample_anchors(batch: int, seq_len: int, num_anchors: int, block_size: int, seed: int, step: int) -> np.ndarray:
    """``int32[B, A]`` distinct anchor positions per sequence in ``[1, S - 2]`` (at least one context position
    and one label), a pure function of (seed, step)."""
    hi = seq_len - 2
    if num_anchors > hi:
        raise ValueError(f"num_anchors {num_anchors} exceeds the {hi} usable anchor positions of a {seq_len}-token "
                         f"window")
    rng = np.random.default_rng([int(seed), int(step), 1])
    out = np.stack([np.sort(rng.choice(hi, size=num_anchors, replace=False)) + 1 for _ in range(batch)])
    return out.astype(np.int32)


# ----------------------------------------------------------------------------------------------- training step
def make_train_step(target_graphdef, drafter_graphdef, optimizer, *, compute_dtype, bos_id: int | None,
                    pad_id: int | None):
    """``step(state, target_state, shared, batch int32[B, S], anchors int32[B, A], lr) -> (state, metrics)``.

    ``state = {"params": f32 drafter Params, "opt": ...}`` (donated); ``target_state`` the frozen target's
    ``nnx.split`` state; ``shared`` the drafter's non-Param state (the target's embeddings / LM head).
    """

    def loss_fn(params, shared, target_state, batch, anchors):
        target = nnx.merge(target_graphdef, target_state)
        drafter = nnx.merge(drafter_graphdef, cast_floats(params, compute_dtype), shared)
        cfg = drafter.cfg
        features, t_logits = target_features_and_logits(target, batch, cfg.target_layer_ids)
        features, t_logits = jax.lax.stop_gradient(features), jax.lax.stop_gradient(t_logits)
        h = block_hidden_many(drafter, features, batch, anchors)
        prev, labels, valid = gather_block_targets(batch, anchors, cfg.block_size, bos_id=bos_id, pad_id=pad_id)
        s = batch.shape[1]
        pos = jnp.clip(anchors[..., None] + jnp.arange(cfg.block_size), 0, s - 1)  # [B, A, K]
        tl = jnp.take_along_axis(t_logits, pos.reshape(pos.shape[0], -1)[..., None], axis=1)
        tl = tl.reshape(*pos.shape, -1)
        terms = deepspec_terms(drafter, h, prev, labels, tl)
        return deepspec_loss(terms, valid), (terms, valid)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state, target_state, shared, batch, anchors, lr):
        grads, (terms, valid) = jax.grad(loss_fn, has_aux=True)(state["params"], shared, target_state, batch,
                                                                 anchors)
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        params = apply_updates(state["params"], updates, lr)
        kk = valid.shape[-1]
        w = position_weights(kk)
        metrics = {"loss": deepspec_loss(terms, valid, w), "grad_norm": global_norm(grads)}
        for name in ("ce", "l1", "bce"):
            if name in terms:
                metrics[name] = weighted_mean(terms[name], valid, w)
        v = valid.astype(jnp.float32)
        for name in ("top1", "accept", "conf"):
            if name in terms:
                per_slot = jnp.sum(terms[name] * v, axis=(0, 1)) / jnp.maximum(jnp.sum(v, axis=(0, 1)), 1.0)
                metrics[f"{name}_first"] = per_slot[0]
                metrics[f"{name}_last"] = per_slot[-1]
        return {"params": params, "opt": opt}, metrics

    return step
