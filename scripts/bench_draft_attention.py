"""Benchmark the DSpark draft-attention kernel at M3 draft shapes, with a small launch sweep.

    PYTHONPATH=. python3 scripts/bench_draft_attention.py --out $OUT/draft_attention.json
    PYTHONPATH=. python3 scripts/bench_draft_attention.py --quick    # tiny shapes, CPU interpret smoke run

Shapes: K = 7 draft slots, 64 query / 4 KV heads of 128, bf16, a 2-layer paged draft cache (``--page``-token
pages, 128: M3's MSA block) of ``--context`` + 16 positions per row read in place at layer 1, every row at
``--context`` visible tokens on SHUFFLED pages (the block tables are a random permutation of the pool, so no
row's pages are contiguous, as in a long-running engine); R = 64 and 512 rows. Per launch variant (the policy's
default first, then ``SWEEP`` overrides): the time (median of back-to-back calls, two cache copies rotated),
the bytes any implementation must read (each row's visible context K and V once per KV head, the block-table
entries, q, the block's K/V and the output), % of ``--hbm`` and the max abs error against the jnp path (bf16
output). The drafter's plain-jnp path (the context gathered through the block tables,
``minimax_jax.draft_attention.draft_attention`` with a length mask: it reads the whole table width and
materialises fp32 scores) is timed beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import draft_attention as da
from pallas_kernels.tuning import PEAKS, draft_attention_launch_config
from scripts import bench_common, bench_shapes
from scripts.profile_step import normal_arrays

SWEEP = [
    {"block_s": 32},
    {"block_s": 128},
    {"num_stages": 2},
    {"num_stages": 4},
    {"num_warps": 4},  # 255 registers in the sm_90 compile, spills (compile_check)
    {"num_warps": 4, "block_s": 32},  # 227 registers, no spills
    {"num_warps": 4, "block_s": 32, "num_stages": 4},
    {"block_h": 8},
    {"block_h": 8, "num_warps": 4, "block_s": 64},
    {"num_splits": 2},
    {"num_splits": 4},
]


def make(rows, context, *, page=128, layers=2, k=7, heads=64, kv_heads=4, dim=128, copies=2, seed=0):
    """Random inputs made on the device (``profile_step.normal_arrays``): ``layers`` layers of pages (the kernel
    reads the last one in place: its access pattern does not depend on how many there are) and shuffled block
    tables, ``cdiv(context + 16, page)`` pages per row."""
    nb = -(-(context + 16) // page)
    num_pages = rows * nb
    cache = (layers, kv_heads, num_pages, page, dim)
    specs = [((rows, k, heads, dim), jnp.bfloat16)] + [((rows, k, kv_heads, dim), jnp.bfloat16)] * 2
    q, kb, vb, *flat = normal_arrays(specs + [(cache, jnp.bfloat16)] * (2 * copies), seed)
    caches = [(flat[2 * c], flat[2 * c + 1]) for c in range(copies)]
    tables = jnp.asarray(np.random.default_rng(seed + 1).permutation(num_pages).reshape(rows, nb), jnp.int32)
    lengths = jnp.full((rows,), context, jnp.int32)
    floor = rows * kv_heads * context * dim * 2 * 2 + (2 * q.size + 2 * kb.size) * 2 + rows * -(-context // page) * 4
    return q, caches, tables, lengths, kb, vb, floor


def jnp_path(q, kc, vc, tables, lengths, kb, vb, *, layer, scale):
    from minimax_jax.draft_attention import draft_attention

    capacity = tables.shape[1] * kc.shape[3]
    visible = (jnp.arange(capacity)[None, :] < lengths[:, None])[:, None, :]
    k_ctx = da.paged_context(kc[layer], tables)
    v_ctx = jnp.where(visible[:, 0, :, None, None], da.paged_context(vc[layer], tables), 0)
    return draft_attention(q, k_ctx, v_ctx, visible, kb, vb, scale=scale)


_M3 = bench_shapes.m3_attention()
M3 = {"heads": _M3["num_q_heads"], "kv_heads": _M3["num_kv_heads"], "dim": _M3["head_dim"]}


def run(rows_list, context, *, hbm, sweep, reps, page=128, shape=M3, interpret=False, log=print):
    out = []
    for rows in rows_list:
        q, caches, tables, lengths, kb, vb, floor = make(rows, context, page=page, **shape)
        scale = shape["dim"] ** -0.5
        arg_sets = [(q, kc, vc, tables, lengths, kb, vb) for kc, vc in caches]
        ref = jax.jit(functools.partial(jnp_path, layer=1, scale=scale))
        want = ref(*arg_sets[0]).astype(jnp.float32)
        t_ref = bench_common.time_fn_batched(ref, arg_sets, reps=max(3, reps // 4))
        base = draft_attention_launch_config(
            num_rows=rows,
            block_size=7,
            num_q_heads=shape["heads"],
            num_kv_heads=shape["kv_heads"],
            capacity=tables.shape[1] * page,
            page_size=page,
            head_dim=shape["dim"],
        )
        for variant in [{}] + list(sweep):
            config = dataclasses.replace(base, **variant)
            row = {
                "rows": rows,
                "context": context,
                "page": page,
                "variant": ",".join(f"{k}={v}" for k, v in variant.items()) or "default",
                **{f"cfg_{k}": v for k, v in dataclasses.asdict(config).items()},
                "floor_bytes": floor,
                "jnp_ms": 1e3 * t_ref,
            }
            try:
                fn = jax.jit(
                    functools.partial(
                        da.draft_attention_pallas, scale=scale, layer=1, config=config, interpret=interpret
                    )
                )
                got = fn(*arg_sets[0]).astype(jnp.float32)
                row["max_abs_err"] = float(jnp.max(jnp.abs(got - want)))
                sec = bench_common.time_fn_batched(fn, arg_sets, reps=reps)
                row.update(time_ms=1e3 * sec, pct_hbm=100 * floor / sec / hbm, vs_jnp=t_ref / sec)
            except Exception as e:  # noqa: BLE001  (a variant that does not compile must not lose the others)
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            log(json.dumps(row))
            out.append(row)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(map(str, bench_shapes.DRAFT_ROWS)))
    p.add_argument("--context", type=int, default=bench_shapes.CONTEXT)
    p.add_argument("--page", type=int, default=_M3["page"], help="draft cache page size (the target's: M3's MSA block)")
    p.add_argument("--hbm", type=float, default=PEAKS["h200"].hbm_bytes_per_s,
                   help="bytes/s the %% column is quoted against")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode: a CPU smoke run")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.quick:  # interpret mode on tiny shapes: only that every path runs
        tiny = {"heads": 4, "kv_heads": 2, "dim": 16}
        rows = run(
            [2],
            40,
            hbm=a.hbm,
            sweep=[{"block_s": 8, "block_h": 1}, {"num_splits": 2}],
            reps=1,
            page=16,
            shape=tiny,
            interpret=True,
        )
        return 0 if all("error" not in r for r in rows) else 1
    env = bench_common.environment()
    print(f"# {env}", flush=True)
    rows = run(
        [int(r) for r in a.rows.split(",")],
        a.context,
        hbm=a.hbm,
        sweep=[] if a.no_sweep else SWEEP,
        reps=a.reps,
        page=a.page,
    )
    if a.out:
        bench_common.write_json(a.out, {"environment": env, "hbm_bytes_per_s": a.hbm, "rows": rows})
    bench_common.print_table(
        rows, ["rows", "variant", "time_ms", "pct_hbm", "jnp_ms", "vs_jnp", "max_abs_err", "error"]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
