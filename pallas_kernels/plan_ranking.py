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

__all__ = ["TIE_RTOL", "ranked_plan_curves", "ranked_plan_curves_reference"]

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


def ranked_plan_curves_reference(survival, counts, draft_costs, step_costs, *, column_lengths, column_sizes):
    """The ranking pass in jnp: ``(b int32[C], value(b) f32[C], value(maxB) f32[C], maxB int32[C])``.

    Per column ``l`` (length ``d_l``, sizes ``S_l``): its drafts are the finite survivals at positions ``< d_l``;
    ``maxB = max(0, min(their count, cap - rows))``; ``value(b) = (sampling rows + the summed survival of its top
    ``b`` drafts) / (draft_costs[rows] + step cost at the smallest size holding non-draft tokens + b)``, ``-inf``
    where no size holds the step or ``b > maxB``; ``b`` is the smallest budget whose value is within
    :data:`TIE_RTOL` of the best (within a size the value grows with ``b``, so the best is at ``0``, a size's
    upper edge or ``maxB``)."""
    lengths, sizes = _check(survival, counts, draft_costs, step_costs, column_lengths, column_sizes)
    a = survival.astype(jnp.float32)
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


def _pairs_kernel(a_ref, count_ref, total_ref, *, rows: int, k: int, block_i: int, block_j: int):
    """Program ``(rb, p)``: drafts ``(rb * BI + [0, BI), p)``; a loop over every row's drafts in ``block_j``
    steps. Writes ``count[p, row, q]`` / ``total[p, row, q]`` cumulative over ``q``."""
    rb, p = pl.program_id(0), pl.program_id(1)
    ri = rb * block_i + lax.broadcasted_iota(jnp.int32, (block_i,), 0)
    ok_i = ri < rows
    a_i = plgpu.load(a_ref.at[jnp.where(ok_i, ri, 0), p], mask=ok_i, other=-jnp.inf)
    fin_i = a_i > -jnp.inf
    av_i = jnp.where(fin_i, a_i, 0.0)[:, None]
    idx_i = (ri * k + p)[:, None]

    def step(c, carry):
        counts, totals = carry
        rj = c * block_j + lax.broadcasted_iota(jnp.int32, (block_j,), 0)
        ok_j = rj < rows
        new_counts, new_totals = [], []
        for q in range(k):
            a_j = plgpu.load(a_ref.at[jnp.where(ok_j, rj, 0), q], mask=ok_j, other=-jnp.inf)
            fin_j = a_j > -jnp.inf
            av_j = jnp.where(fin_j, a_j, 0.0)[None, :]
            idx_j = (rj * k + q)[None, :]
            ahead = fin_j[None, :] & ((av_j > av_i) | ((av_j == av_i) & (idx_j < idx_i)))  # [BI, BJ]
            new_counts.append(counts[q] + jnp.sum(ahead.astype(jnp.int32), axis=1))
            new_totals.append(totals[q] + jnp.sum(jnp.where(ahead, av_j, 0.0), axis=1))
        return tuple(new_counts), tuple(new_totals)

    zeros_i = jnp.zeros((block_i,), jnp.int32)
    zeros_f = jnp.zeros((block_i,), jnp.float32)
    steps = next_pow2(rows) // block_j
    counts, totals = lax.fori_loop(0, steps, step, ((zeros_i,) * k, (zeros_f,) * k))
    dest = out_of_bounds_where(ok_i, ri, rows)
    running_c, running_t = zeros_i, zeros_f
    for q in range(k):
        running_c, running_t = running_c + counts[q], running_t + totals[q]
        plgpu.store(count_ref.at[p, dest, q], running_c, mask=ok_i)
        plgpu.store(total_ref.at[p, dest, q], running_t, mask=ok_i)


# ------------------------------------------------------------------------------------------------------------
# Kernel 2: the candidates and the budget of each column.
# ------------------------------------------------------------------------------------------------------------


def _pick(vec, iota, at):
    """``vec[at]`` for a traced scalar index (0 where out of range), as a masked sum (no gather in-kernel)."""
    return jnp.sum(jnp.where(iota == at, vec, jnp.zeros_like(vec)))


def _select_kernel(a_ref, count_ref, total_ref, counts_ref, draft_ref, step_ref, b_ref, vb_ref, vf_ref, mb_ref,
                   *, rows: int, k: int, lengths: tuple, sizes: tuple, block_i: int, num_draft: int, width_p2: int):
    n_cols = len(lengths)
    cols_p2 = b_ref.shape[0]
    num_rows, s_int, nnd, cap = counts_ref[0], counts_ref[1], counts_ref[2], counts_ref[3]
    s = s_int.astype(jnp.float32)
    draft = draft_ref[jnp.clip(num_rows, 0, num_draft - 1)]
    steps = next_pow2(rows) // block_i
    ii = lax.broadcasted_iota(jnp.int32, (block_i,), 0)
    ci = lax.broadcasted_iota(jnp.int32, (width_p2,), 0)  # candidates: 0, each size's upper edge, maxB, (maxB ..)

    def drafts_at(c, p, upto):
        """Chunk ``c`` of position ``p``'s drafts: ``(mine, rank, prefix)`` of the column counting positions
        ``<= upto``."""
        r = c * block_i + ii
        ok = r < rows
        safe = jnp.where(ok, r, 0)
        a = plgpu.load(a_ref.at[safe, p], mask=ok, other=-jnp.inf)
        mine = ok & (a > -jnp.inf)
        av = jnp.where(mine, a, 0.0)
        rank = plgpu.load(count_ref.at[p, safe, upto], mask=ok, other=0)
        prefix = av + plgpu.load(total_ref.at[p, safe, upto], mask=ok, other=0.0)
        return mine, rank, prefix

    # drafts per position (every column's maxB is a sum of them)
    per_position = []
    for p in range(k):
        def count_step(c, acc, p=p):
            r = c * block_i + ii
            ok = r < rows
            a = plgpu.load(a_ref.at[jnp.where(ok, r, 0), p], mask=ok, other=-jnp.inf)
            return acc + jnp.sum((ok & (a > -jnp.inf)).astype(jnp.int32))
        per_position.append(lax.fori_loop(0, steps, count_step, jnp.int32(0)))

    oc = lax.broadcasted_iota(jnp.int32, (cols_p2,), 0)
    out_b = jnp.zeros((cols_p2,), jnp.int32)
    out_vb = jnp.zeros((cols_p2,), jnp.float32)
    out_vf = jnp.zeros((cols_p2,), jnp.float32)
    out_mb = jnp.zeros((cols_p2,), jnp.int32)
    for col, (length, sz) in enumerate(zip(lengths, sizes)):
        npos = min(length, k)  # the positions this column's drafts sit at
        upto = max(npos - 1, 0)
        mine_total = sum(per_position[:npos], jnp.int32(0))
        max_b = jnp.maximum(0, jnp.minimum(mine_total, cap - num_rows))
        costs = [step_ref[col, w] for w in range(len(sz))]

        def size_index(b, sz=sz):  # the smallest size holding nnd + b (len(sz): none does)
            return sum((jnp.where(nnd + b > t, jnp.int32(1), jnp.int32(0)) for t in sz), jnp.zeros_like(b))

        def value(b, g, sz=sz, costs=costs, max_b=max_b):
            idx = size_index(b)
            cost = draft + sum((jnp.where(idx == w, c, 0.0) for w, c in enumerate(costs[:-1])),
                               jnp.where(idx >= len(sz) - 1, costs[-1], 0.0))
            ok = (idx < len(sz)) & (b <= max_b)
            return jnp.where(ok, g / jnp.maximum(cost, 1e-12), -jnp.inf), cost

        edges = sum((jnp.where(ci == w + 1, jnp.clip(t - nnd, 0, max_b), 0) for w, t in enumerate(sz)),
                    jnp.zeros((width_p2,), jnp.int32))
        cand = jnp.where(ci == 0, 0, jnp.where(ci <= len(sz), edges, max_b))  # [Cp]

        def top_step(c, top, p, cand=cand, upto=upto):
            mine, rank, prefix = drafts_at(c, p, upto)
            inside = mine[:, None] & (rank[:, None] < cand[None, :])
            return jnp.maximum(top, jnp.max(jnp.where(inside, prefix[:, None], 0.0), axis=0))

        top = jnp.zeros((width_p2,), jnp.float32)
        for p in range(npos):
            top = lax.fori_loop(0, steps, functools.partial(top_step, p=p), top)
        vals, cost_c = value(cand, s + top)
        best = jnp.max(vals)
        finite = best > -jnp.inf
        near = best - TIE_RTOL * jnp.abs(best)
        e = jnp.min(jnp.where(vals >= near, ci, width_p2))
        top_b, cost_e = _pick(cand, ci, e), _pick(cost_c, ci, e)
        j = size_index(top_b)
        below = sum((jnp.where(j - 1 == w, jnp.int32(t), jnp.int32(0)) for w, t in enumerate(sz)), jnp.int32(0))
        low = jnp.where(j > 0, below - nnd + 1, 0)
        need = near * cost_e - s

        def reach_step(c, reach, p, need=need, upto=upto):
            mine, rank, prefix = drafts_at(c, p, upto)
            return jnp.minimum(reach, jnp.min(jnp.where(mine & (prefix >= need), rank + 1, _INT_MAX)))

        reach = jnp.int32(_INT_MAX)
        for p in range(npos):
            reach = lax.fori_loop(0, steps, functools.partial(reach_step, p=p), reach)
        b = jnp.minimum(jnp.maximum(jnp.where(need <= 0, 0, reach), jnp.maximum(low, 0)), top_b)
        b = jnp.where(finite, b, 0)

        def gain_step(c, gain, p, b=b, upto=upto):
            mine, rank, prefix = drafts_at(c, p, upto)
            return jnp.maximum(gain, jnp.max(jnp.where(mine & (rank < b), prefix, 0.0)))

        gain = jnp.float32(0.0)
        for p in range(npos):
            gain = lax.fori_loop(0, steps, functools.partial(gain_step, p=p), gain)
        v_b = jnp.where(finite, value(b, s + gain)[0], best)
        v_full = _pick(vals, ci, len(sz) + 1)
        here = oc == col
        out_b = jnp.where(here, b, out_b)
        out_vb = jnp.where(here, v_b, out_vb)
        out_vf = jnp.where(here, v_full, out_vf)
        out_mb = jnp.where(here, max_b, out_mb)
    keep = oc < n_cols
    plgpu.store(b_ref.at[oc], out_b, mask=keep)
    plgpu.store(vb_ref.at[oc], out_vb, mask=keep)
    plgpu.store(vf_ref.at[oc], out_vf, mask=keep)
    plgpu.store(mb_ref.at[oc], out_mb, mask=keep)


# ------------------------------------------------------------------------------------------------------------
# Entry point.
# ------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("column_lengths", "column_sizes", "interpret", "num_warps"))
def _ranked_plan_curves_pallas(survival, counts, draft_costs, step_costs, *, column_lengths, column_sizes,
                               interpret: bool, num_warps: int):
    rows, k = survival.shape
    rows_p2 = next_pow2(rows)
    block_i = min(rows_p2, 32)
    block_j = min(rows_p2, 64)
    a = survival.astype(jnp.float32)
    count, total = pl.pallas_call(
        functools.partial(_pairs_kernel, rows=rows, k=k, block_i=block_i, block_j=block_j),
        out_shape=(jax.ShapeDtypeStruct((k, rows, k), jnp.int32), jax.ShapeDtypeStruct((k, rows, k), jnp.float32)),
        grid=(rows_p2 // block_i, k),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="plan_ranking_pairs",
    )(a)
    n_cols = len(column_lengths)
    cols_p2 = next_pow2(n_cols)
    width_p2 = next_pow2(max(len(s) for s in column_sizes) + 2)
    select_i = min(rows_p2, 128)
    b, v_b, v_full, max_b = pl.pallas_call(
        functools.partial(_select_kernel, rows=rows, k=k, lengths=column_lengths, sizes=column_sizes,
                          block_i=select_i, num_draft=draft_costs.shape[0], width_p2=width_p2),
        out_shape=(jax.ShapeDtypeStruct((cols_p2,), jnp.int32), jax.ShapeDtypeStruct((cols_p2,), jnp.float32),
                   jax.ShapeDtypeStruct((cols_p2,), jnp.float32), jax.ShapeDtypeStruct((cols_p2,), jnp.int32)),
        grid=(1,),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="plan_ranking_select",
    )(a, count, total, counts.astype(jnp.int32), draft_costs.astype(jnp.float32), step_costs.astype(jnp.float32))
    return b[:n_cols], v_b[:n_cols], v_full[:n_cols], max_b[:n_cols]


def ranked_plan_curves(survival, counts, draft_costs, step_costs, *, column_lengths, column_sizes,
                       implementation: str = "auto", interpret: bool | None = None, chip: str | None = None,
                       num_warps: int = 4):
    """The ranking pass (see the module docstring): ``(b, value(b), value(maxB), maxB)``, one entry per column.

    ``implementation``: ``"pallas"`` (the two kernels), ``"reference"`` (:func:`ranked_plan_curves_reference`),
    or ``"auto"``: the kernels on a GPU (interpret mode with ``interpret=True``), the reference elsewhere.
    ``chip`` is accepted for the compile gate's uniform call and unused: the kernels have one launch shape."""
    del chip
    survival = jnp.asarray(survival)
    counts = jnp.asarray(counts)
    draft_costs = jnp.asarray(draft_costs)
    step_costs = jnp.asarray(step_costs)
    lengths, sizes = _check(survival, counts, draft_costs, step_costs, column_lengths, column_sizes)
    impl = resolve_auto(implementation, interpret=interpret, supported=lambda: True)
    if impl == "reference" or survival.shape[0] * survival.shape[1] == 0:
        return ranked_plan_curves_reference(survival, counts, draft_costs, step_costs, column_lengths=lengths,
                                            column_sizes=sizes)
    return _ranked_plan_curves_pallas(survival, counts, draft_costs, step_costs, column_lengths=lengths,
                                      column_sizes=sizes, interpret=resolve_interpret(interpret),
                                      num_warps=num_warps)
