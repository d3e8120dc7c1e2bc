"""Compile every Pallas kernel for AMD gfx942 / gfx950 and NVIDIA sm_90 on a CPU and report its resources.

    pip install -e '.[amd]'                                   # the pinned pair: jax 0.12.0.1 + triton 3.9.0
    PYTHONPATH=. python3 scripts/compile_kernels.py --out compile.json          # all serving sizes
    PYTHONPATH=. python3 scripts/compile_kernels.py --gate --check               # the CI gate's subset

Each kernel entry point (``scripts.compile_check.KERNELS``) is lowered deviceless at M3 shapes for each
serving size (``BATCHES``; ``--gate``: the CI gate's ``GATE_CASES``) with the launch tables of the target's
chip (gfx942: ``cdna3``, gfx950: ``cdna4``, sm_90: ``hopper``), and every distinct Triton kernel is compiled with
the pip triton wheel (``--jobs`` processes): registers (VGPR / AGPR / SGPR on AMD), LDS / shared memory, spills and occupancy (waves per SIMD
on AMD, warps and blocks per SM on sm_90). Prints one markdown table per target and the problems (compile
errors, spills, scratch, AMD kernels under 2 waves per SIMD); ``--check`` exits 1 when there are any.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax


def main(argv: list[str] | None = None) -> int:
    from scripts import compile_check as cc

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the reports as JSON here")
    ap.add_argument("--targets", default=",".join(t.name for t in cc.TARGETS),
                    help="comma-separated subset of " + ", ".join(t.name for t in cc.TARGETS))
    ap.add_argument("--gate", action="store_true", help="only the CI gate's cases (GATE_CASES)")
    ap.add_argument("--check", action="store_true", help="exit 1 on any problem")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: all cores)")
    ap.add_argument("--quiet", action="store_true", help="no per-kernel progress lines")
    args = ap.parse_args(argv)

    reason = cc.toolchain_unavailable()
    if reason:
        print(f"cannot compile: {reason}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    known = {t.name: t for t in cc.TARGETS}
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown targets {unknown}; choose from {sorted(known)}")
    targets = [known[n] for n in names]
    cases = cc.GATE_CASES if args.gate else cc.all_cases()

    import triton

    start = time.perf_counter()
    log = None if args.quiet else (lambda line: print(f"[{time.perf_counter() - start:6.1f} s] {line}", flush=True))
    reports = cc.compile_all(targets, cases, jobs=args.jobs, log=log)
    elapsed = time.perf_counter() - start
    problems = cc.problems(reports)

    for t in targets:
        print(f"\n### {t.name} (`{t.chip}` tables)\n")
        print(cc.markdown_table(reports, t.name))
    print(f"\n{len(reports)} kernels compiled in {elapsed:.1f} s (jax {jax.__version__}, triton {triton.__version__})")
    print("problems:" if problems else "problems: none")
    for p in problems:
        print(f"  {p}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "jax": jax.__version__,
                    "triton": triton.__version__,
                    "targets": [t.name for t in targets],
                    "cases": [c.label for c in cases],
                    "seconds": round(elapsed, 1),
                    "kernels": [r.to_json() for r in reports],
                    "problems": problems,
                },
                f,
                indent=1,
            )
        print(f"wrote {args.out}")
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
