"""Benchmark the Pallas kernels at serving sizes: the ragged MSA indexer and ragged block-sparse / dense paged
attention. One HBM ceiling is measured first and every percentage is quoted against it.

    PYTHONPATH=. python3 scripts/bench_kernels.py --out $OUT                 # both kernels (GPU)
    PYTHONPATH=. python3 scripts/bench_kernels.py --kernels indexer --out /tmp/b
    PYTHONPATH=. python3 scripts/bench_kernels.py --quick                     # tiny shapes; CPU smoke run

Writes ``indexer.json`` and ``sparse_attention.json`` (rows + environment) under ``--out`` and prints a
summary table last. Per-kernel details (cases, variants, bytes models) live in ``scripts/bench_indexer.py`` and
``scripts/bench_sparse_attention.py``; the design notes in ``docs/kernels/`` explain the rooflines.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

from scripts import bench_common, bench_indexer, bench_sparse_attention

SUMMARY = ["kernel", "case", "variant", "time_us", "unique_MB", "TBps", "pct_hbm", "vs_ref", "parity"]


def _indexer_summary(r: dict) -> dict:
    return dict(kernel="indexer", case=r.get("case"), variant=r.get("variant"), time_us=r.get("time_us"),
                unique_MB=(r.get("unique_bytes") or 0) / 1e6, TBps=(r.get("gbps") or 0) / 1e3,
                pct_hbm=r.get("pct_hbm"), vs_ref=r.get("speedup_vs_ref"),
                parity=("ok" if r.get("equivalent") else "FAIL") if "equivalent" in r else (r.get("error") or "")[:40])


def _attention_summary(r: dict) -> dict:
    t = r.get("time_ms_loop") or r.get("time_ms")
    return dict(kernel=r.get("kernel"), case=r.get("size"), variant=r.get("variant"),
                time_us=None if t is None else 1e3 * t, unique_MB=(r.get("unique_bytes") or 0) / 1e6,
                TBps=None if not t else (r.get("unique_bytes") or 0) / (t * 1e-3) / 1e12, pct_hbm=r.get("pct_hbm"),
                vs_ref=r.get("speedup_vs_ref"),
                parity=(r.get("error") or "")[:40]
                or (f"max {r['max_abs_err']:.1e}" if r.get("max_abs_err") is not None else "not checked"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="indexer,sparse_attention")
    ap.add_argument("--out", default=None, help="directory for the JSON results")
    ap.add_argument("--sweep", action="store_true", help="also time launch variants")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, for a CPU smoke run")
    args = ap.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = set(kernels) - {"indexer", "sparse_attention"}
    if unknown:
        ap.error(f"unknown kernels {sorted(unknown)}")
    env = bench_common.environment()
    on_cpu = jax.default_backend() == "cpu"
    bandwidths = bench_common.measure_bandwidths(1 << 24 if on_cpu else 1 << 30)
    hbm = bench_common.hbm_ceiling(bandwidths)
    env["bandwidths_Bps"] = bandwidths
    print(f"# {env}\n# HBM copy ceiling {hbm / 1e12:.3f} TB/s", flush=True)
    summary = []
    if args.out:
        os.makedirs(args.out, exist_ok=True)

    if "indexer" in kernels:
        cases = bench_indexer.QUICK_CASES if args.quick else bench_indexer.SERVING_CASES
        variants = None if args.sweep else {}
        rows = bench_indexer.run(cases, variants=variants, copy_bandwidth=hbm, time_reference=not args.quick,
                                 json_path=os.path.join(args.out, "indexer.json") if args.out else None)
        summary += [_indexer_summary(r) for r in rows]

    if "sparse_attention" in kernels:
        sizes = list(bench_sparse_attention.QUICK_SIZES if args.quick else bench_sparse_attention.SIZES)
        rows = bench_sparse_attention.run(
            sizes, bench_sparse_attention.DEFAULT_SWEEP if args.sweep else None,
            dense_sizes=[] if args.quick else ["512x1x4K", "1x8x32K"], reference=not args.quick,
            hbm_bytes_per_s=hbm)
        if args.out:
            bench_common.write_json(os.path.join(args.out, "sparse_attention.json"),
                                    {"environment": env, "hbm_copy_bytes_per_s": hbm, "rows": rows})
        summary += [_attention_summary(r) for r in rows]

    bench_common.print_table(summary, SUMMARY)
    return 0 if all("FAIL" not in str(r.get("parity")) for r in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
