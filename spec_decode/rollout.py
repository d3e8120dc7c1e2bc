"""Cache-free speculative decoding rollouts: acceptance statistics and STS records for a trained pair.

This is an *evaluation harness*, not the serving engine: each step runs the plain causal forward of the target
over a fixed-size token buffer (no KV cache) and the drafter's from-scratch ``block_hidden_reference``, so it is
simple and exact (the target's output for a position depends only on the tokens before it). One step:

1. the buffer holds each row's committed tokens and, after them, the ``K`` drafts of the previous step; the
   target forward gives the verify logits at the anchor and draft positions and the drafter's features;
2. the project's rejection sampler (:func:`spec_decode.rejection.rejection_sample`, greedy or stochastic)
   accepts a prefix of the first ``num_verify`` drafts and emits one corrected / bonus token;
3. the drafter drafts the next block from the new anchor with context strictly before it (those features come
   from the same forward: the accepted drafts are the committed tokens) and the drafts go into the buffer.

The first step is the prefill: no drafts are verified and the first token is sampled from the last prompt
position. Every verify step of a live row yields one record ``(confidence logits of its K drafts,
num_accepted, num_verified)``: what acceptance statistics and sequential temperature scaling consume.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.calibration import fit_sts
from spec_decode.rejection import STREAM_DRAFT, rejection_sample, sampling_key


@dataclasses.dataclass
class RolloutResult:
    """Per prompt: ``tokens`` (generated, prompt excluded). Per verify step of a live row: ``num_accepted``,
    ``num_verified`` and the drafts' raw ``confidence_logits [N, K_block]`` (None without a confidence head)."""

    tokens: list[list[int]]
    num_accepted: np.ndarray
    num_verified: np.ndarray
    confidence_logits: np.ndarray | None
    num_verify: int
    temperature: float
    row_ids: np.ndarray | None = None  # prompt index of each record

    @property
    def steps(self) -> int:
        return int(self.num_accepted.size)

    def summary(self) -> dict:
        """Mean acceptance length (emitted tokens per verify step, bonus included) and the share of steps whose
        draft ``k`` (1-based) was accepted."""
        a = self.num_accepted
        k = self.num_verify
        per_pos = [float(np.mean(a >= i)) if a.size else float("nan") for i in range(1, k + 1)]
        return {"K": k, "temperature": self.temperature, "steps": self.steps,
                "acceptance_length": float(np.mean(a + 1)) if a.size else float("nan"),
                "accepted_per_position": per_pos,
                "emitted_tokens": int(sum(len(t) for t in self.tokens))}


def _layer_ids(drafter) -> tuple[int, ...]:
    return tuple(int(i) for i in drafter.cfg.target_layer_ids)


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "temperature"))
def _rollout_step(tgraph, tstate, dgraph, dstate, buf, lengths, drafts, draft_probs, num_verified, active, seeds, *,
                  temperature: float):
    target, drafter = nnx.merge(tgraph, tstate), nnx.merge(dgraph, dstate)
    r, length = buf.shape
    kk = drafts.shape[1]
    layer_ids = _layer_ids(drafter)
    layers = [i for i in layer_ids if i >= 0]
    final, captured = target.hidden_states(buf, capture_layers=layers)
    anchor_pos = lengths - 1
    rows = jnp.clip(anchor_pos[:, None] + jnp.arange(kk + 1, dtype=jnp.int32), 0, length - 1)
    verify_logits = target.logits(jnp.take_along_axis(final, rows[..., None], axis=1))  # [R, K+1, V]
    out = rejection_sample(verify_logits, drafts, draft_probs, num_verified, seeds, anchor_pos,
                           temperature=temperature, row_mask=active)
    slots = anchor_pos[:, None] + 1 + jnp.arange(kk + 1, dtype=jnp.int32)
    write = jnp.arange(kk + 1)[None, :] < out.num_emitted[:, None]
    ridx = jnp.broadcast_to(jnp.arange(r)[:, None], slots.shape)
    buf = buf.at[ridx, jnp.where(write, slots, length)].set(out.output_tokens, mode="drop")
    new_len = lengths + out.num_emitted

    by_id = dict(zip(layers, captured))
    features = jnp.concatenate([target.embed(buf) if i < 0 else by_id[i] for i in layer_ids], axis=-1)
    new_anchor_pos = new_len - 1
    anchors = jnp.take_along_axis(buf, new_anchor_pos[:, None], axis=1)[:, 0]
    h = drafter.block_hidden_reference(features, anchors, new_anchor_pos)
    if temperature > 0:
        keys = jax.vmap(lambda s, p: sampling_key(s, p, STREAM_DRAFT))(seeds, new_anchor_pos)
        dout = drafter.sample_block(h, anchors, temperature, keys)
    else:
        dout = drafter.sample_block(h, anchors, 0.0, None)
    dslots = new_len[:, None] + jnp.arange(kk, dtype=jnp.int32)
    ridx = jnp.broadcast_to(jnp.arange(r)[:, None], dslots.shape)
    buf = buf.at[ridx, jnp.where(dslots < length, dslots, length)].set(dout.tokens, mode="drop")
    conf = dout.confidence_logits if dout.confidence_logits is not None else jnp.zeros(dout.tokens.shape)
    return buf, new_len, dout.tokens, dout.probs, conf, out.num_accepted, out.num_emitted, out.output_tokens


def speculative_rollout(target, drafter, prompts: Sequence[Sequence[int]], *, num_verify: int, temperature: float,
                        max_new_tokens: int, seed: int = 0, eos_token_ids: Sequence[int] = (),
                        pad_id: int = 0, length: int | None = None) -> RolloutResult:
    """Generate up to ``max_new_tokens`` per prompt with speculative decoding, verifying ``num_verify`` drafts
    per step (``1 <= num_verify <= block_size``; the drafter always drafts its whole block). ``temperature`` 0 is
    greedy (the output is then the target's own greedy continuation). Rows stop at an EOS token.

    ``length``: the token buffer's size (one compilation per (rows, length, greedy or not)); default: the
    longest prompt + ``max_new_tokens`` + two blocks, rounded up to 64."""
    kk = drafter.cfg.block_size
    if not 1 <= num_verify <= kk:
        raise ValueError(f"num_verify must be in [1, block_size={kk}], got {num_verify}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    r = len(prompts)
    p_max = max(len(p) for p in prompts)
    need = p_max + max_new_tokens + 2 * kk + 2
    if length is None:
        length = -(-need // 64) * 64
    elif length < need:
        raise ValueError(f"length {length} is too small for prompts of {p_max} tokens + {max_new_tokens} new")
    buf = np.full((r, length), pad_id, np.int32)
    for i, p in enumerate(prompts):
        buf[i, :len(p)] = p
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    vocab = target.cfg.vocab_size
    drafts = jnp.zeros((r, kk), jnp.int32)
    probs = jnp.zeros((r, kk, vocab), jnp.float32)
    seeds = jnp.asarray(seed + np.arange(r), jnp.int32)
    tgraph, tstate = nnx.split(target)
    dgraph, dstate = nnx.split(drafter)
    eos = {int(e) for e in eos_token_ids}
    generated: list[list[int]] = [[] for _ in range(r)]
    active = np.ones((r,), bool)
    prev_conf = np.zeros((r, kk), np.float32)
    acc_rec, ver_rec, conf_rec, row_rec = [], [], [], []
    first = True
    buf_d, len_d = jnp.asarray(buf), jnp.asarray(lengths)
    while active.any():
        nv = np.where(active, 0 if first else num_verify, 0).astype(np.int32)
        buf_d, len_d, drafts, probs, conf, n_acc, n_emit, out_tok = _rollout_step(
            tgraph, tstate, dgraph, dstate, buf_d, len_d, drafts, probs, jnp.asarray(nv), jnp.asarray(active),
            seeds, temperature=float(temperature))
        n_acc, n_emit, out_tok, conf_h = jax.device_get((n_acc, n_emit, out_tok, conf))
        for i in np.flatnonzero(active):
            if not first:
                acc_rec.append(int(n_acc[i]))
                ver_rec.append(int(nv[i]))
                conf_rec.append(prev_conf[i].copy())
                row_rec.append(int(i))
            for t in out_tok[i, :n_emit[i]].tolist():
                generated[i].append(int(t))
                if int(t) in eos or len(generated[i]) >= max_new_tokens:
                    active[i] = False
                    break
        prev_conf = np.asarray(conf_h, np.float32)
        first = False
    has_conf = drafter.confidence_head is not None
    return RolloutResult(
        tokens=generated, num_accepted=np.asarray(acc_rec, np.int64), num_verified=np.asarray(ver_rec, np.int64),
        confidence_logits=np.asarray(conf_rec, np.float32).reshape(-1, kk) if has_conf else None,
        num_verify=num_verify, temperature=float(temperature), row_ids=np.asarray(row_rec, np.int64))


def batched_rollout(target, drafter, prompts: Sequence[Sequence[int]], *, rows: int, **kw) -> RolloutResult:
    """:func:`speculative_rollout` over ``prompts`` in batches of exactly ``rows`` (the last one padded with
    repeats of its first prompt, whose records are dropped): one compiled shape for any number of prompts."""
    parts = []
    for start in range(0, len(prompts), rows):
        chunk = list(prompts[start:start + rows])
        real = len(chunk)
        chunk += [chunk[0]] * (rows - real)
        res = speculative_rollout(target, drafter, chunk, **kw)
        if real < rows:
            res = _drop_rows(res, real)
        parts.append(res)
    return RolloutResult(
        tokens=[t for p in parts for t in p.tokens], num_accepted=np.concatenate([p.num_accepted for p in parts]),
        num_verified=np.concatenate([p.num_verified for p in parts]),
        confidence_logits=None if parts[0].confidence_logits is None else np.concatenate(
            [p.confidence_logits for p in parts]),
        num_verify=parts[0].num_verify, temperature=parts[0].temperature,
        row_ids=np.concatenate([p.row_ids + i * rows for i, p in enumerate(parts)]))


def _drop_rows(res: RolloutResult, keep: int) -> RolloutResult:
    rows = res.row_ids < keep
    return dataclasses.replace(
        res, tokens=res.tokens[:keep], num_accepted=res.num_accepted[rows], num_verified=res.num_verified[rows],
        confidence_logits=None if res.confidence_logits is None else res.confidence_logits[rows],
        row_ids=res.row_ids[rows])


# ----------------------------------------------------------------------------------------------- calibration
def ece_report(result: RolloutResult, temperatures: Sequence[float] | None) -> list[float]:
    """Per-position ECE (20 bins) of the cumulative confidence product against "the first k drafts were all
    accepted", on ``result``'s records, with the given STS temperatures (None: the raw confidences).

    Uses :func:`minimax_jax.calibration.fit_sts` with a one-point grid ``[1.0]`` on pre-scaled logits, so the
    labelling of censored rows is the calibration module's."""
    if result.confidence_logits is None or result.steps == 0:
        return []
    logits = result.confidence_logits[:, :result.num_verify]
    if temperatures is not None:
        logits = logits / np.asarray(temperatures, np.float64)[:result.num_verify]
    fit = fit_sts(logits, result.num_accepted, result.num_verified, grid=[1.0])
    return [float(x) for x in fit.ece_after]


def fit_temperatures(results: Sequence[RolloutResult]):
    """Fit STS on the records of ``results`` (all with the drafter's whole block verified)."""
    logits = np.concatenate([r.confidence_logits for r in results])
    acc = np.concatenate([r.num_accepted for r in results])
    ver = np.concatenate([r.num_verified for r in results])
    return fit_sts(logits, acc, ver)
