"""Benchmark and serving-size parity check of the ragged MSA indexer (``pallas_kernels.indexer``).

For each case (requests x tokens per request x context) and each launch variant: parity against the jnp
reference (exact-match fraction and score equivalence), median time, unique bytes moved, achieved bytes/s, the
percentage of the measured HBM copy bandwidth and the speed-up over the jnp reference under ``jax.jit``.

Unique bytes (the floor any implementation must move): every visible index key once
(``sum_r seq_len_r * D * itemsize``), the live index queries, the int32 output and the used block-table
entries.

    PYTHONPATH=. python3 scripts/bench_indexer.py --json docs/bench_results/indexer_h200.json
    PYTHONPATH=. python3 scripts/bench_indexer.py --quick   # small shapes; runs on CPU in interpret mode

``run(...)`` returns the rows (a list of dicts) for ``scripts/bench_kernels.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.indexer import (
    index_block_scores_reference,
    ragged_index_topk,
    ragged_index_topk_reference,
)
from pallas_kernels.tuning import indexer_launch_config, resolve_chip
from scripts.bench_common import (
    environment,
    hbm_ceiling,
    measure_bandwidths,
    print_table,
    time_fn_batched,
    time_stats_one_call,
    write_json,
)


@dataclasses.dataclass(frozen=True)
class Case:
    requests: int
    q_len: int  # tokens per request; 0 = ragged 1..8 with zero-length padding rows and padding slots
    context: int  # seq_len of every request (ragged: the maximum)
    page: int = 128
    dim: int = 128
    heads: int = 4
    topk: int = 16
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        q = "1..8" if self.q_len == 0 else str(self.q_len)
        ctx = f"{self.context // 1024}K" if self.context % 1024 == 0 else str(self.context)
        return f"{self.requests}x{q}x{ctx}"


SERVING_CASES = [
    Case(512, 8, 4096),
    Case(512, 1, 4096),
    Case(512, 8, 32768),
    Case(512, 1, 32768),
    Case(1, 8, 32768),
    Case(512, 0, 32768),
]

# Launch variants per case name ({} = the policy's choice). The first entry is the default.
SERVING_VARIANTS = {
    "512x8x4K": [{}, {"num_stages": 2}, {"num_warps": 2}, {"num_splits": 2}],
    "512x1x4K": [{}],
    "512x8x32K": [{}, {"num_splits": 1}],
    "512x1x32K": [{}, {"num_splits": 1}],
    "1x8x32K": [{}, {"select_rows": 16, "select_num_warps": 4}, {"num_splits": 32}, {"num_splits": 128}],
    "512x1..8x32K": [{}, {"num_splits": 1}, {"num_splits": 2}],
}
# Call 1 on the H200 (docs/bench_results/indexer_h200_call1.json) also swept num_stages 2/3/4, num_warps 4/8,
# pages_per_step 1/2 and num_splits at 4K and 32K: num_warps 4, one page per step and the fused path won.

QUICK_CASES = [
    Case(8, 4, 256, page=16, dim=32, topk=4, dtype="float32"),
    Case(6, 0, 256, page=16, dim=32, topk=4, dtype="float32"),
]
QUICK_VARIANTS = {"8x4x256": [{}, {"num_splits": 2}], "6x1..8x256": [{}]}


def make_inputs(case: Case, *, seed: int = 0, num_sets: int = 1):
    """``num_sets`` argument tuples over one shared index cache (disjoint pages per set, so timing rotates
    through more bytes than the L2 holds) plus the host-side ``seq_lens``/``query_start_loc`` of set 0."""
    rng = np.random.default_rng(seed)
    r = case.requests
    nb = case.context // case.page
    if case.q_len == 0:  # ragged: 1..8 tokens, 1/16 zero-length padding rows, padding slots after the batch
        q_lens = rng.integers(1, 9, r)
        q_lens[rng.random(r) < 1 / 16] = 0
        seq_lens = np.where(q_lens > 0, q_lens + rng.integers(0, case.context - 8, r), 0)
        t_cap = int(-(-(q_lens.sum() + 100) // 256) * 256)
    else:
        q_lens = np.full(r, case.q_len)
        seq_lens = np.full(r, case.context)
        t_cap = int(q_lens.sum())
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n_blocks = -(-seq_lens // case.page)
    pages_per_set = int(r * nb)
    num_pages = pages_per_set * num_sets
    dtype = jnp.dtype(case.dtype)
    key = jax.random.PRNGKey(seed)
    kc = jax.random.normal(key, (num_pages, case.page, case.dim), jnp.float32).astype(dtype)
    sets = []
    perm = rng.permutation(num_pages).astype(np.int32)
    for s in range(num_sets):
        pages = perm[s * pages_per_set : (s + 1) * pages_per_set].reshape(r, nb)
        bt = np.where(np.arange(nb)[None, :] < n_blocks[:, None], pages, -1).astype(np.int32)
        q = jax.random.normal(jax.random.fold_in(key, s + 1), (t_cap, case.heads, case.dim), jnp.float32)
        sets.append(
            (q.astype(dtype), kc, jnp.asarray(bt), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(qsl))
        )
    return sets, seq_lens, qsl


def cost_model(case: Case, seq_lens, qsl, t_cap: int) -> dict:
    """Unique bytes and useful FLOPs of one call."""
    isz = jnp.dtype(case.dtype).itemsize
    n_tok = int(qsl[-1])
    key_bytes = int(seq_lens.sum()) * case.dim * isz
    q_bytes = n_tok * case.heads * case.dim * isz
    out_bytes = t_cap * case.heads * case.topk * 4
    meta_bytes = int((-(-seq_lens // case.page)).sum()) * 4 + (2 * len(seq_lens) + 1) * 4
    q_lens = np.diff(qsl)
    # Useful scores: token i of a request sees seq_len - q_len + i + 1 keys.
    keys_seen = int(
        sum(int(q) * (int(s) - int(q)) + int(q) * (int(q) + 1) // 2 for q, s in zip(q_lens, seq_lens))
    )
    return {
        "unique_bytes": key_bytes + q_bytes + out_bytes + meta_bytes,
        "key_bytes": key_bytes,
        "flops": 2 * case.heads * case.dim * keys_seen,
    }


def check_parity(out, ref, pooled, *, local_blocks: int = 1) -> dict:
    """Exact-match fraction and score equivalence (selections equal up to exact fp32 ties)."""
    out = np.asarray(out)
    ref = np.asarray(ref)
    pooled = np.asarray(pooled, np.float64)
    exact_rows = float(np.mean(np.all(out == ref, axis=-1)))
    same_valid = bool(np.array_equal(out >= 0, ref >= 0))
    srt = np.sort(out, axis=-1)
    duplicates = int(np.sum((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)))
    in_range = bool(np.all(out < pooled.shape[-1]))
    local_ok = (
        bool(np.array_equal(out[..., :local_blocks], ref[..., :local_blocks])) if local_blocks else True
    )
    both = (out >= 0) & (ref >= 0)
    both[..., :local_blocks] = False  # forced blocks are compared by id above
    so = np.take_along_axis(pooled, np.clip(out, 0, pooled.shape[-1] - 1), -1)[both]
    sr = np.take_along_axis(pooled, np.clip(ref, 0, pooled.shape[-1] - 1), -1)[both]
    diff = np.abs(so - sr)
    tol = 1e-3 + 1e-4 * np.abs(sr)
    max_diff = float(diff.max()) if diff.size else 0.0
    scores_ok = bool(np.all(diff <= tol)) if diff.size else True
    return {
        "exact_rows": exact_rows,
        "equivalent": same_valid and duplicates == 0 and in_range and local_ok and scores_ok,
        "max_score_diff": max_diff,
    }


def run(
    cases=None,
    *,
    variants=None,
    check: bool = True,
    time_reference: bool = True,
    copy_bandwidth: float | None = None,
    log=print,
    json_path: str | None = None,
) -> list[dict]:
    """Benchmark ``cases`` x their ``variants``; returns one row per (case, variant)."""
    cases = SERVING_CASES if cases is None else cases
    variants = SERVING_VARIANTS if variants is None else variants
    bandwidths = {}
    if copy_bandwidth is None:
        bandwidths = measure_bandwidths(1 << 30 if jax.default_backend() != "cpu" else 1 << 24)
        copy_bandwidth = hbm_ceiling(bandwidths)
    log(
        f"HBM copy bandwidth: {copy_bandwidth / 1e9:.1f} GB/s on {environment()['device']}; all (GB/s): "
        + json.dumps({k: round(v / 1e9, 1) if isinstance(v, float) else v for k, v in bandwidths.items()})
    )
    chip = resolve_chip(None)
    rows: list[dict] = []
    for case in cases:
        try:
            cache_bytes = case.requests * case.context * case.dim * jnp.dtype(case.dtype).itemsize
            num_sets = int(max(1, min(8, (256 << 20) // max(cache_bytes, 1))))
            sets, seq_lens, qsl = make_inputs(case, num_sets=num_sets)
            t_cap = sets[0][0].shape[0]
            cost = cost_model(case, seq_lens, qsl, t_cap)
            ref_fn = jax.jit(lambda *a, _k=case.topk: ragged_index_topk_reference(*a, topk=_k))
            ref_out = pooled = None
            if check:
                ref_out = np.asarray(ref_fn(*sets[0]))
                pooled = np.asarray(index_block_scores_reference(*sets[0]))
            t_ref = None
            if time_reference:
                t_ref = time_fn_batched(ref_fn, sets, reps=3, warmup=1)
            policy = indexer_launch_config(
                num_tokens=t_cap,
                num_requests=case.requests,
                num_heads=case.heads,
                max_blocks=case.context // case.page,
                page_size=case.page,
                chip=chip,
            )
        except Exception as e:  # noqa: BLE001  (report and go on with the next case)
            log(f"{case.name}: setup failed: {e!r}")
            rows.append({"case": case.name, "variant": "setup", "error": repr(e)[:500]})
            continue
        for var in variants.get(case.name, [{}]):
            row = dict(
                case=case.name,
                variant=",".join(f"{k}={v}" for k, v in var.items()) or "default",
                config=dataclasses.asdict(dataclasses.replace(policy, **var)),
                num_sets=num_sets,
                **cost,
            )
            try:
                fn = jax.jit(lambda *a, _v=var, _k=case.topk: ragged_index_topk(*a, topk=_k, **_v))
                t0 = time.perf_counter()
                out = jax.block_until_ready(fn(*sets[0]))
                row["compile_s"] = time.perf_counter() - t0
                if check:
                    row.update(check_parity(out, ref_out, pooled))
                ts = time_stats_one_call(fn, sets, reps=20)
                t = ts["median"]
                row.update(
                    time_us=t * 1e6,
                    time_min_us=ts["min"] * 1e6,
                    time_max_us=ts["max"] * 1e6,
                    gbps=cost["unique_bytes"] / t / 1e9,
                    pct_hbm=100 * cost["unique_bytes"] / t / copy_bandwidth,
                    tflops=cost["flops"] / t / 1e12,
                )
                if t_ref is not None:
                    row.update(ref_time_us=t_ref * 1e6, speedup_vs_ref=t_ref / t)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:2000]
                log(traceback.format_exc()[-3000:])
            rows.append(row)
            log(
                json.dumps(
                    {
                        k: row.get(k)
                        for k in (
                            "case",
                            "variant",
                            "time_us",
                            "pct_hbm",
                            "exact_rows",
                            "equivalent",
                            "speedup_vs_ref",
                            "compile_s",
                            "error",
                        )
                    }
                )
            )
            if json_path:
                write_json(
                    json_path,
                    {
                        "environment": environment(),
                        "copy_bandwidth_Bps": copy_bandwidth,
                        "bandwidths_Bps": bandwidths,
                        "rows": rows,
                    },
                )
    return rows


COLUMNS = [
    "case",
    "variant",
    "time_us",
    "time_max_us",
    "gbps",
    "pct_hbm",
    "ref_time_us",
    "speedup_vs_ref",
    "exact_rows",
    "equivalent",
    "error",
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (CPU smoke run)")
    ap.add_argument("--json", default=None, help="write the rows and the environment here")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--cases", default=None, help="comma-separated case names to keep")
    args = ap.parse_args(argv)
    cases, variants = (QUICK_CASES, QUICK_VARIANTS) if args.quick else (SERVING_CASES, SERVING_VARIANTS)
    if args.cases:
        keep = set(args.cases.split(","))
        cases = [c for c in cases if c.name in keep]
    rows = run(cases, variants=variants, check=not args.no_check, json_path=args.json)
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
