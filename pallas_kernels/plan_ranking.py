"""The adaptive planner's ranking pass in two kernels: the value of every budget a verification plan can choose.

The device loop plans every iteration (docs/ADAPTIVE_VERIFICATION.md, "The planner's cost in the device loop"):
for each of a few draft lengths it needs the expected tokens per second of verifying the top ``b`` drafts, by
survival over the whole batch, at each compiled verify size's upper edge. In plain XLA that pass is about twenty
small fusions (62 us an iteration at 512 rows on an H200, against a 0.9 ms step), each a kernel launch and a
round of latency. Here it is two Pallas kernels:

1. **pairs** (grid ``rows / BR x K``): for every draft ``i`` (row, position ``p``), how many scheduled drafts come
   before it at each position ``q`` and their summed survival, cumulative over ``q``: ``count[p, row, q]`` and
   ``total[p, row, q]``. A draft ``j`` comes before ``i`` when its survival is larger, or equal with a lower
   flat index ``row * K + position``. ``O((R K)^2)`` compares, spread over ``R K / BR`` programs.
2. **select** (one program): per column (a draft length with its compiled sizes), the rank and the prefix gain
   of each of its drafts (its count and total at the length's last position), then the value of ``0``, each
   size's upper edge and ``maxB``, the first near-best of them, and the smallest budget in that size reaching
   the near-best value: the same ``(b, value(b), value(maxB), maxB)`` per column as the reference.

:func:`ranked_plan_curves_reference` is the same pass in jnp (the CPU path, and the oracle of the tests). The two
agree exactly on integer outputs except where float32 sums of survival, added in a different order, put two
candidate values within ``TIE_RTOL`` of each other.

Inputs (all device arrays; nothing syncs with the host):

* ``survival f32[R, K]``: each row's survival ``cumprod(confidence)`` with ``-inf`` past its scheduled drafts
  (``spec_decode.allocator.survival``);
* ``counts int32[4]``: ``(rows in the step, sampling rows, non-draft tokens, verify-logits rows cap)``;
* ``draft_costs f32[M]``: the draft cost by rows in the step (index clipped to ``M - 1``);
* ``step_costs f32[C, W]``: per column, the step cost at each of its compiled sizes (padded with the last);
* static ``column_lengths`` (a column's drafts are the scheduled ones at positions below its length) and
  ``column_sizes`` (per column, its compiled packed-token sizes, ascending, non-empty).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import next_pow2, out_of_bounds_where
from pallas_kernels.platform import resolve_auto, resolve_interpret

__all__ = ["TIE_RTOL", "ranked_plan_curves", "ranked_plan_curves_reference", "supports"]

# float32 ties: values within this relative distance of the best count as ties
TIE_RTOL = 1e-6
_INT_MAX = int(np.iinfo(np.int32).max)


def _check(survival, counts, draft_costs, step_costs, column_lengths, column_sizes):
    if survival.ndim != 2:
        raise ValueError(f"survival must be f32[R, K], got shape {survival.shape}")
    if counts.shape != (4,):
        raise ValueError(f"counts must be int32[4] (rows, sampling rows, non-draft tokens, cap), got {counts.shape}")
    if draft_costs.ndim != 1 or draft_costs.shape[0] == 0:
        raise ValueError(f"draft_costs must be f32[M] with M >= 1, got shape {draft_costs.shape}")
    lengths = tuple(int(d) for d in column_lengths)
    sizes = tuple(tuple(int(t) for t in s) for s in column_sizes)
    if len(sizes) != len(lengths) or not all(sizes) or any(list(s) != sorted(s) for s in sizes):
        raise ValueError(f"column_sizes must give ascending, non-empty sizes for each of {lengths}, got {column_sizes}")
    width = max(len(s) for s in sizes)
    if step_costs.shape != (len(lengths), width):
        raise ValueError(f"step_costs must be f32[{len(lengths)}, {width}], got shape {step_costs.shape}")
    return lengths, sizes


def ranked_plan_curves_reference(survival, counts, draft_costs, step_costs, *, column_lengths, column_sizes,
                                 implementation: str = "reference", interpret: bool | None = None,
                                 chip: str | None = None, num_warps: int = 8):
    """The ranking pass in jnp: ``(b int32[C], value(b) f32[C], value(maxB) f32[C], maxB int32[C])``
    (:func:`ranked_plan_curves`' signature; the launch arguments are ignored).

    Per column ``l`` (length ``d_l``, sizes ``S_l``): its drafts are the finite survivals at positions ``< d_l``;
    ``maxB = max(0, min(their count, cap - rows))``; ``value(b) = (sampling rows + the summed survival of its top
    ``b`` drafts) / (draft_costs[rows] + step cost at the smallest size holding non-draft tokens + b)``, ``-inf``
    where no size holds the step or ``b > maxB``; ``b`` is the smallest budget whose value is within
    :data:`TIE_RTOL` of the best (within a size the value grows with ``b``, so the best is at ``0``, a size's
    upper edge or ``maxB``)."""
    del implementation, interpret, chip, num_warps
    lengths, sizes = _check(survival, counts, draft_costs, step_costs, column_lengths, column_sizes)
    a = jnp.asarray(survival, jnp.float32)
    flat = a.reshape(-1)
    n, n_len = flat.shape[0], len(lengths)
    num_rows, nnd = counts[0], counts[2]
    s = counts[1].astype(jnp.float32)
    cols = jnp.arange(n_len)
    k = a.shape[1]
    pos = jnp.tile(jnp.arange(k, dtype=jnp.int32), a.shape[0])
    finite = jnp.isfinite(flat)
    av = jnp.where(finite, flat, 0.0)
    limit = jnp.asarray(lengths, jnp.int32)
    mine = finite[:, None] & (pos[:, None] < limit[None, :])  # [N, L]
    max_b = jnp.maximum(0, jnp.minimum(jnp.sum(mine, axis=0, dtype=jnp.int32), counts[3] - num_rows))
    width = step_costs.shape[1]
    tb = jnp.asarray([list(b) + [_INT_MAX] * (width - len(b)) for b in sizes], jnp.int32)  # [L, W]
    nb = jnp.asarray([len(b) for b in sizes], jnp.int32)
    draft = draft_costs[jnp.clip(num_rows, 0, draft_costs.shape[0] - 1)]

    def paid_index(b):  # [..., L] -> the index of the smallest size holding n_nd + b (nb: none does)
        return jnp.sum((tb < (nnd + b)[..., None]).astype(jnp.int32), axis=-1)

    def value(b, g):  # [..., L]
        idx = paid_index(b)
        fits = idx < nb
        cost = draft + step_costs[cols, jnp.minimum(idx, width - 1)]
        return jnp.where(fits & (b <= max_b), g / jnp.maximum(cost, 1e-12), -jnp.inf), cost

    if n == 0:  # no drafts at all
        v0 = value(jnp.zeros((n_len,), jnp.int32), jnp.full((n_len,), s))[0]
        return jnp.zeros((n_len,), jnp.int32), v0, v0, max_b
    # one pass over the pairs: rank[i, l] drafts of length l come before draft i (more survival, or as much and
    # a lower index), and prefix[i, l] the summed survival of those and of i: the gain of the top rank + 1. The
    # lengths are nested (length l's drafts are the scheduled ones at positions < lengths[l]), so one [N, N]
    # pass counts the drafts ahead of i at each position, and a running sum over the positions gives every
    # length's rank and prefix: N^2 work, not N^2 L.
    i = jnp.arange(n, dtype=jnp.int32)
    ahead = ((av[None, :] > av[:, None]) | ((av[None, :] == av[:, None]) & (i[None, :] < i[:, None]))) \
        & finite[None, :]  # [i, j]: j is scheduled and comes before i
    ahead = ahead.reshape(n, a.shape[0], k)  # [i, row of j, position of j]
    count_at = jnp.cumsum(jnp.sum(ahead.astype(jnp.int32), axis=1), axis=1)  # [N, K]: ahead at positions <= p
    sum_at = jnp.cumsum(jnp.sum(jnp.where(ahead, av.reshape(1, a.shape[0], k), 0.0), axis=1), axis=1)
    upto = jnp.clip(limit - 1, 0, k - 1)  # length l counts positions <= lengths[l] - 1 (none for length 0)
    rank = jnp.where(limit[None, :] > 0, count_at[:, upto], 0)  # [N, L]
    prefix = av[:, None] + jnp.where(limit[None, :] > 0, sum_at[:, upto], 0.0)

    def top_gain(b):  # [L, C] budgets -> s + the summed survival of each length's top b drafts
        inside = mine[:, :, None] & (rank[:, :, None] < b[None])
        return s + jnp.max(jnp.where(inside, prefix[:, :, None], 0.0), axis=0)

    # candidates, ascending per length: 0, each size's upper edge, maxB
    edges = jnp.clip(tb - nnd, 0, max_b[:, None])
    cand = jnp.concatenate([jnp.zeros((n_len, 1), jnp.int32), edges, max_b[:, None]], axis=1)  # [L, C]
    vals, costs = value(cand.T, top_gain(cand).T)  # [C, L]
    best = jnp.max(vals, axis=0)
    near = best - TIE_RTOL * jnp.abs(best)
    e = jnp.argmax(vals >= near[None, :], axis=0)  # the first near-best candidate
    top, cost_e = cand[cols, e], costs[e, cols]
    # the smallest b with the same size as that candidate (above the size below it), and the smallest b whose
    # gain reaches the near-best value at that size's cost
    j = paid_index(top)
    low = jnp.where(j > 0, tb[cols, jnp.maximum(j - 1, 0)] - nnd + 1, 0)
    need = near * cost_e - s
    reach = jnp.min(jnp.where(mine & (prefix >= need[None, :]), rank + 1, _INT_MAX), axis=0)
    b = jnp.clip(jnp.where(need <= 0, 0, reach), jnp.maximum(low, 0), top)
    b = jnp.where(jnp.isfinite(best), b, 0).astype(jnp.int32)
    v_b = jnp.where(jnp.isfinite(best), value(b, top_gain(b[:, None])[:, 0])[0], best)
    return b, v_b, vals[-1], max_b


# ------------------------------------------------------------------------------------------------------------
# Kernel 1: the pairs.
# ------------------------------------------------------------------------------------------------------------

# Elements one program holds at once: a tile of drafts i by drafts j in the pair pass, every draft in the select.
_TILE = 4096


def _pairs_kernel(a_ref, rank_ref, prefix_ref, *, rows: int, rows_p2: int, k: int, ranked: tuple, block_i: int):
    """Program ``(rb, p)``: drafts ``i = (rb * BI + [0, BI), position p)`` against every draft ``j``, one
    ``[BI, Rp]`` tile per position (``a_ref`` is the survival transposed, ``[K, R]``). Writes, per ranked length
    ``d``, the drafts ahead of ``i`` at positions ``< d`` and ``i``'s survival plus theirs, at flat index
    ``p * Rp + row``."""
    rb, p = pl.program_id(0), pl.program_id(1)
    ri = rb * block_i + lax.broadcasted_iota(jnp.int32, (block_i,), 0)
    ok_i = ri < rows
    a_i = plgpu.load(a_ref.at[p, jnp.where(ok_i, ri, 0)], mask=ok_i, other=-jnp.inf)
    av_i = jnp.where(a_i > -jnp.inf, a_i, 0.0)
    idx_i = (ri * k + p)[:, None]

    def tile(rj, q):
        ok_j = rj < rows
        a_j = plgpu.load(a_ref.at[q, jnp.where(ok_j, rj, 0)], mask=ok_j, other=-jnp.inf)
        fin_j = a_j > -jnp.inf
        av_j = jnp.where(fin_j, a_j, 0.0)[None, :]
        ahead = fin_j[None, :] & ((av_j > av_i[:, None]) | ((av_j == av_i[:, None]) & ((rj * k + q)[None, :] < idx_i)))
        return jnp.sum(ahead.astype(jnp.int32), axis=1), jnp.sum(jnp.where(ahead, av_j, 0.0), axis=1)

    rj = lax.broadcasted_iota(jnp.int32, (rows_p2,), 0)
    per_q = [tile(rj, q) for q in range(k)]
    zero = (jnp.zeros((block_i,), jnp.int32), jnp.zeros((block_i,), jnp.float32))
    dest = out_of_bounds_where(ok_i, p * rows_p2 + ri, k * rows_p2)
    count, total = zero
    for q in range(k):
        count, total = count + per_q[q][0], total + per_q[q][1]
        for slot, d in enumerate(ranked):
            if min(d, k) == q + 1:  # length d counts the drafts ahead at positions <= d - 1
                plgpu.store(rank_ref.at[slot, dest], count, mask=ok_i)
                plgpu.store(prefix_ref.at[slot, dest], av_i + total, mask=ok_i)


# ------------------------------------------------------------------------------------------------------------
# Kernel 2: the candidates and the budget of each column.
# ------------------------------------------------------------------------------------------------------------


def _pick(vec, iota, at):
    """``vec[at]`` for a traced scalar index (0 where out of range), as a masked sum (no gather in-kernel)."""
    return jnp.sum(jnp.where(iota == at, vec, jnp.zeros_like(vec)))


def _select_kernel(a_ref, rank_ref, prefix_ref, counts_ref, draft_ref, step_ref, b_ref, vb_ref, vf_ref, mb_ref,
                   *, rows: int, rows_p2: int, k: int, lengths: tuple, sizes: tuple, ranked: tuple, num_draft: int,
                   width_p2: int):
    """One program: every draft at once as a flat vector ``i = p * Rp + row`` (``Kp * Rp`` elements), every
    column in turn."""
    num_rows, nnd, cap = counts_ref[0], counts_ref[2], counts_ref[3]
    s = counts_ref[1].astype(jnp.float32)
    draft = draft_ref[jnp.clip(num_rows, 0, num_draft - 1)]
    n = next_pow2(k) * rows_p2
    i = lax.broadcasted_iota(jnp.int32, (n,), 0)
    pos, row = i // rows_p2, i % rows_p2
    ok = (pos < k) & (row < rows)
    idx = jnp.where(ok, i, 0)  # where a draft's rank and prefix sit (the pair kernel's flat index)
    a = plgpu.load(a_ref.at[jnp.where(ok, pos, 0), jnp.where(ok, row, 0)], mask=ok, other=-jnp.inf)
    finite = a > -jnp.inf
    ci = lax.broadcasted_iota(jnp.int32, (width_p2,), 0)  # candidates: 0, each size's upper edge, maxB, (maxB ..)
    oc = lax.broadcasted_iota(jnp.int32, (b_ref.shape[0],), 0)
    outs = [jnp.zeros(oc.shape, jnp.int32), jnp.zeros(oc.shape, jnp.float32), jnp.zeros(oc.shape, jnp.float32),
            jnp.zeros(oc.shape, jnp.int32)]
    for col, (length, sz) in enumerate(zip(lengths, sizes)):
        mine = finite & (pos < length)
        if length > 0:
            slot = ranked.index(length)
            rank = plgpu.load(rank_ref.at[slot, idx], mask=ok, other=0)
            prefix = plgpu.load(prefix_ref.at[slot, idx], mask=ok, other=0.0)
        else:
            rank, prefix = jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.float32)
        max_b = jnp.maximum(0, jnp.minimum(jnp.sum(mine.astype(jnp.int32)), cap - num_rows))
        costs = [step_ref[col, w] for w in range(len(sz))]

        def size_index(b, sz=sz):  # the smallest size holding nnd + b (len(sz): none does)
            return sum((jnp.where(nnd + b > t, jnp.int32(1), jnp.int32(0)) for t in sz), jnp.zeros_like(b))

        def value(b, g, sz=sz, costs=costs, max_b=max_b):
            at = size_index(b)
            cost = draft + sum((jnp.where(at == w, c, 0.0) for w, c in enumerate(costs[:-1])),
                               jnp.where(at >= len(sz) - 1, costs[-1], 0.0))
            return jnp.where((at < len(sz)) & (b <= max_b), g / jnp.maximum(cost, 1e-12), -jnp.inf), cost

        def gain(b, mine=mine, rank=rank, prefix=prefix):  # the summed survival of the top b drafts
            return jnp.max(jnp.where(mine & (rank < b), prefix, 0.0))

        edges = sum((jnp.where(ci == w + 1, jnp.clip(t - nnd, 0, max_b), 0) for w, t in enumerate(sz)),
                    jnp.zeros((width_p2,), jnp.int32))
        cand = jnp.where(ci == 0, 0, jnp.where(ci <= len(sz), edges, max_b))  # [Cp]
        top = sum((jnp.where(ci == c, gain(_pick(cand, ci, c)), 0.0) for c in range(1, len(sz) + 2)),
                  jnp.zeros((width_p2,), jnp.float32))
        vals, cost_c = value(cand, s + top)
        best = jnp.max(vals)
        feasible = best > -jnp.inf
        near = best - TIE_RTOL * jnp.abs(best)
        e = jnp.min(jnp.where(vals >= near, ci, width_p2))
        top_b, cost_e = _pick(cand, ci, e), _pick(cost_c, ci, e)
        j = size_index(top_b)
        below = sum((jnp.where(j - 1 == w, jnp.int32(t), jnp.int32(0)) for w, t in enumerate(sz)), jnp.int32(0))
        low = jnp.where(j > 0, below - nnd + 1, 0)
        need = near * cost_e - s
        reach = jnp.min(jnp.where(mine & (prefix >= need), rank + 1, _INT_MAX))
        b = jnp.minimum(jnp.maximum(jnp.where(need <= 0, 0, reach), jnp.maximum(low, 0)), top_b)
        b = jnp.where(feasible, b, 0)
        v_b = jnp.where(feasible, value(b, s + gain(b))[0], best)
        here = oc == col
        for o, (out, x) in enumerate(zip(outs, (b, v_b, _pick(vals, ci, len(sz) + 1), max_b))):
            outs[o] = jnp.where(here, x, out)
    keep = oc < len(lengths)
    for ref, out in zip((b_ref, vb_ref, vf_ref, mb_ref), outs):
        plgpu.store(ref.at[oc], out, mask=keep)


# ------------------------------------------------------------------------------------------------------------
# Entry point.
# ------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("column_lengths", "column_sizes", "interpret", "num_warps"))
def _ranked_plan_curves_pallas(survival, counts, draft_costs, step_costs, *, column_lengths, column_sizes,
                               interpret: bool, num_warps: int):
    rows, k = survival.shape
    rows_p2 = next_pow2(rows)
    block_i = min(rows_p2, max(1, _TILE // rows_p2))
    ranked = tuple(sorted({int(d) for d in column_lengths if d > 0}))
    flat = next_pow2(k) * rows_p2
    a_t = survival.astype(jnp.float32).T  # [K, R]: each position's row of drafts is contiguous
    slots = max(len(ranked), 1)
    rank, prefix = pl.pallas_call(
        functools.partial(_pairs_kernel, rows=rows, rows_p2=rows_p2, k=k, ranked=ranked, block_i=block_i),
        out_shape=(jax.ShapeDtypeStruct((slots, flat), jnp.int32), jax.ShapeDtypeStruct((slots, flat), jnp.float32)),
        grid=(rows_p2 // block_i, k),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="plan_ranking_pairs",
    )(a_t)
    cols_p2 = next_pow2(len(column_lengths))
    width_p2 = next_pow2(max(len(s) for s in column_sizes) + 2)
    b, v_b, v_full, max_b = pl.pallas_call(
        functools.partial(_select_kernel, rows=rows, rows_p2=rows_p2, k=k, lengths=column_lengths,
                          sizes=column_sizes, ranked=ranked, num_draft=draft_costs.shape[0], width_p2=width_p2),
        out_shape=(jax.ShapeDtypeStruct((cols_p2,), jnp.int32), jax.ShapeDtypeStruct((cols_p2,), jnp.float32),
                   jax.ShapeDtypeStruct((cols_p2,), jnp.float32), jax.ShapeDtypeStruct((cols_p2,), jnp.int32)),
        grid=(1,),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="plan_ranking_select",
    )(a_t, rank, prefix, counts.astype(jnp.int32), draft_costs.astype(jnp.float32), step_costs.astype(jnp.float32))
    n_cols = len(column_lengths)
    return b[:n_cols], v_b[:n_cols], v_full[:n_cols], max_b[:n_cols]


def supports(rows: int, k: int) -> bool:
    """Whether the kernels take ``rows x K`` drafts: a pair tile spans every row, and the select kernel holds
    every draft in one program (up to 2,048 rows at K <= 8)."""
    return next_pow2(rows) <= _TILE // 2 and next_pow2(k) * next_pow2(rows) <= 4 * _TILE


def ranked_plan_curves(survival, counts, draft_costs, step_costs, *, column_lengths, column_sizes,
                       implementation: str = "auto", interpret: bool | None = None, chip: str | None = None,
                       num_warps: int = 8):
    """The ranking pass (see the module docstring): ``(b, value(b), value(maxB), maxB)``, one entry per column.

    ``implementation``: ``"pallas"`` (the two kernels), ``"reference"`` (:func:`ranked_plan_curves_reference`),
    or ``"auto"``: the kernels on a GPU where :func:`supports` the shape (interpret mode with ``interpret=True``),
    the reference elsewhere.
    ``chip`` is accepted for the compile gate's uniform call and unused: the kernels have one launch shape."""
    del chip
    survival = jnp.asarray(survival)
    counts = jnp.asarray(counts)
    draft_costs = jnp.asarray(draft_costs)
    step_costs = jnp.asarray(step_costs)
    lengths, sizes = _check(survival, counts, draft_costs, step_costs, column_lengths, column_sizes)
    impl = resolve_auto(implementation, interpret=interpret, supported=lambda: supports(*survival.shape))
    if impl == "pallas" and not supports(*survival.shape):
        raise ValueError(f"the ranking kernels hold every draft in one program: {survival.shape[0]} rows x "
                         f"K = {survival.shape[1]} is too many (implementation='reference' takes any size)")
    if impl == "reference" or survival.shape[0] * survival.shape[1] == 0:
        return ranked_plan_curves_reference(survival, counts, draft_costs, step_costs, column_lengths=lengths,
                                            column_sizes=sizes)
    return _ranked_plan_curves_pallas(survival, counts, draft_costs, step_costs, column_lengths=lengths,
                                      column_sizes=sizes, interpret=resolve_interpret(interpret),
                                      num_warps=num_warps)
