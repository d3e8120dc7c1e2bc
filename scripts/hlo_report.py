"""What a compiled program launches, read from its optimized HLO: per control-flow computation (the entry, each
while loop's condition and body, each conditional's branches), the kernels it launches and the bytes its copies move.

A GPU runs an XLA while loop and a conditional from the host (a predicate or branch index read back per iteration),
so the device loop's per-iteration overhead is the work of its body and of the branch it takes. Copies are the
easiest overhead to miss: a profiler that sums kernel time does not count a device-to-device memcpy, and an XLA
copy of a decode state that the buffer assignment could not alias moves the whole KV pool.

    python3 scripts/hlo_report.py program.hlo[.gz] [...] [--top 8] [--json out.json]

``hlo_text(compiled)`` gives the text of a ``jax.stages.Compiled`` (``bench_e2e.py --dump-loop-hlo`` writes the
device loop's). Counts are of HLO instructions: a fusion is one kernel, a custom call one kernel or library call
(Triton kernels from Pallas, cuBLAS GEMMs), a copy one memcpy or copy kernel. Command buffers (CUDA graphs) group
launches; they do not remove the instructions listed here.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP = re.compile(r"(?<![\w.%\-])([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"\b(condition|body|branch_computations|true_computation|false_computation|to_apply|calls)="
                    r"(\{[^}]*\}|%?[\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# instructions that launch nothing on their own
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency"}


def hlo_text(compiled) -> str:
    """The optimized HLO of a compiled JAX program (a ``jax.stages.Compiled``)."""
    text = compiled.as_text()
    if not text:
        raise ValueError("this executable carries no HLO text (loaded from a serialized executable?)")
    return text


def shape_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type (a tuple's elements summed)."""
    total = 0
    for dtype, dims in _SHAPE.findall(type_text):
        if dtype not in _BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dtype]
    return total


def parse(text: str) -> dict:
    """``{computation: [(name, op, type_text, rest), ...]}`` and the entry's name under ``"__entry__"``."""
    comps: dict = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _COMP.match(line)
            if m and not line.lstrip().startswith(("HloModule", "//")):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    comps["__entry__"] = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rhs = m.group(2), m.group(3)
        op = _OP.search(rhs)
        if op is None:
            continue
        comps[current].append((name, op.group(1), rhs[:op.start()], rhs))
    return comps


def _called(rest: str) -> dict[str, list[str]]:
    out = {}
    for key, val in _CALLS.findall(rest):
        out[key] = [v.strip().lstrip("%") for v in val.strip("{}").split(",") if v.strip()]
    return out


def report(text: str, top: int = 8) -> list[dict]:
    """One row per control computation reachable from the entry (depth first): its role, kernels (fusions,
    custom calls by target, copies, sorts and other launching ops) and its largest copies."""
    comps = parse(text)
    entry = comps.pop("__entry__", None)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    rows, seen = [], set()

    def visit(comp: str, role: str, depth: int):
        if comp in seen or comp not in comps:
            return
        seen.add(comp)
        ops = collections.Counter()
        targets = collections.Counter()
        copies = []
        children = []
        for name, op, type_text, rest in comps[comp]:
            if op in _FREE:
                continue
            ops[op] += 1
            if op == "custom-call":
                t = _TARGET.search(rest)
                targets[t.group(1) if t else "?"] += 1
            if op in ("copy", "copy-start"):
                copies.append((shape_bytes(type_text), name, type_text.strip()))
            called = _called(rest)
            if op == "while":
                children += [(called.get("condition", [None])[0], f"while {name}: condition"),
                             (called.get("body", [None])[0], f"while {name}: body")]
            elif op == "conditional":
                branches = called.get("branch_computations") or (called.get("true_computation", [])
                                                                  + called.get("false_computation", []))
                children += [(b, f"conditional {name}: branch {i}") for i, b in enumerate(branches)]
            elif op == "call":
                children += [(c, f"call {name}") for c in called.get("to_apply", []) + called.get("calls", [])]
        copies.sort(reverse=True)
        launches = sum(n for op, n in ops.items() if op not in ("while", "conditional", "call"))
        rows.append({"computation": comp, "role": role, "depth": depth, "launching_ops": launches,
                     "ops": dict(ops.most_common()), "custom_call_targets": dict(targets.most_common()),
                     "copies": len(copies), "copy_bytes": sum(b for b, _, _ in copies),
                     "largest_copies": [{"bytes": b, "name": n, "type": t[:160]} for b, n, t in copies[:top]]})
        for child, child_role in children:
            if child:
                visit(child, child_role, depth + 1)

    visit(entry, "entry", 0)
    return rows


def _read(path: str) -> str:
    if path.endswith(".gz"):
        with gzip.open(path, "rt") as f:
            return f.read()
    with open(path) as f:
        return f.read()


def _mb(b: int) -> str:
    return f"{b / 2 ** 20:.1f} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="optimized HLO text files (.hlo or .hlo.gz)")
    ap.add_argument("--top", type=int, default=5, help="largest copies listed per computation")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    everything = {}
    for path in args.files:
        rows = report(_read(path), top=args.top)
        everything[path] = rows
        print(f"== {path}")
        for r in rows:
            kinds = ", ".join(f"{op} {n}" for op, n in r["ops"].items())
            print(f"{'  ' * r['depth']}{r['role']} [{r['computation']}]: {r['launching_ops']} launching ops "
                  f"({kinds}); copies {r['copies']}, {_mb(r['copy_bytes'])}")
            if r["custom_call_targets"]:
                print(f"{'  ' * r['depth']}  custom calls: {r['custom_call_targets']}")
            for c in r["largest_copies"]:
                if c["bytes"] >= 2 ** 20:
                    print(f"{'  ' * r['depth']}  copy {c['name']}: {_mb(c['bytes'])} {c['type']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
