"""Per-op times of a compiled program read from a profiler trace of its real runs (issue 23).

The model puts a ``jax.named_scope`` on each op (``minimax_jax.decode.forward_ragged``, the drafter,
``spec_decode/step.py``). A scope is metadata only: XLA keeps it as the ``op_name`` of every HLO instruction
traced under it (``jit(step)/layer0/qkv_proj/dot_general``) and it changes nothing the program computes. This
module turns a trace back into per-scope times:

1. :func:`hlo_scopes` reads the compiled program's text (``compiled.as_text()``: the optimised HLO, the names the
   runtime launches) into ``instruction name -> scope path``: the ``op_name`` without its last part (the
   primitive) and without the parts transforms add (``jit(...)``, ``while``, ``body`` ...). A fusion without
   metadata takes the most common scope of the instructions it fuses.
2. :func:`trace` runs a callable under ``jax.profiler.trace`` and reads the xspace back
   (``jax.profiler.ProfileData``): the events of the program's module that carry an ``hlo_op`` stat. On a GPU
   those are the kernels on the device planes' stream lines; on CPU, where XLA runs the thunks on host threads,
   the host plane's thunk events (innermost ones only: a ``while`` thunk's body thunks nest inside it).
3. :func:`attribute` sums, per run of the program, each event's duration onto its instruction's scope.
   Events that overlap in time (CPU thunks run concurrently; GPU streams may) share the overlapping time
   equally, so the per-scope times of one run add up to its busy time, never beyond its span (first event
   start to last event end). Events with no scope (copies XLA inserted, kernels of instructions without
   metadata) are ``UNATTRIBUTED``.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import re
import tempfile
import time
import warnings
from collections.abc import Callable

import jax

UNATTRIBUTED = "(unattributed)"
# Name-stack parts JAX adds for transforms and control flow; never a scope of the model.
_TRANSFORM_PARTS = {"while", "body", "cond", "branch", "shard_map", "checkpoint", "remat", "pjit", "closed_call",
                    "custom_jvp_call", "custom_vjp_call", "scan", "switch", "jvp", "transpose", "vmap",
                    "eval_jaxpr"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def scope_of(op_name: str) -> tuple[str, ...]:
    """The named-scope path of an HLO ``op_name``: ``"jit(step)/layer0/qkv_proj/jit(f)/dot_general"`` ->
    ``("layer0", "qkv_proj")``."""
    parts = op_name.split("/")[:-1]
    return tuple(p for p in parts if p and "(" not in p and "->" not in p and p not in _TRANSFORM_PARTS
                 and not p.startswith("branch_"))


def module_name(hlo_text: str) -> str:
    """``HloModule jit_step, ...`` -> ``"jit_step"``: the name trace events carry as ``hlo_module``."""
    first = hlo_text.lstrip().split("\n", 1)[0]
    if not first.startswith("HloModule "):
        raise ValueError(f"not an HLO module's text (first line {first[:80]!r})")
    return first.split()[1].rstrip(",")


def _norm(name: str) -> str:
    return re.sub(r"[.\-]", "_", name)


def hlo_scopes(hlo_text: str) -> dict[str, tuple[str, ...]]:
    """``instruction name -> scope path`` for every instruction of the compiled module's text; the names are
    also keyed with ``.`` / ``-`` as ``_`` (how GPU kernels are named after their fusion)."""
    own: dict[str, tuple[str, ...]] = {}
    calls: dict[str, str] = {}
    in_comp: dict[str, list[tuple[str, ...]]] = collections.defaultdict(list)
    comp = None
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and "=" not in line.split("{", 1)[0]:
            m = _COMPUTATION.match(line)
            comp = m.group(1) if m else None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name = m.group(1)
        op = _OP_NAME.search(line)
        scope = scope_of(op.group(1)) if op else ()
        own[name] = scope
        if comp is not None and scope:
            in_comp[comp].append(scope)
        c = _CALLS.search(line)
        if c:
            calls[name] = c.group(1)
    out = {}
    for name, scope in own.items():
        if not scope and name in calls and in_comp.get(calls[name]):
            scope = collections.Counter(in_comp[calls[name]]).most_common(1)[0][0]
        out[name] = scope
        out.setdefault(_norm(name), scope)
    return out


@dataclasses.dataclass(frozen=True)
class Event:
    """One kernel (GPU) or thunk (CPU) of the traced program."""

    op: str  # the HLO instruction (``hlo_op`` stat, else the event's name)
    start_ns: float
    dur_ns: float
    run: object  # the execution it belongs to (``run_id`` stat; None when the trace has none)
    line: str
    name: str = ""  # the event's own name (a GPU kernel's name)


def _stat(stats: dict, key: str):
    v = stats.get(key)
    return v.decode() if isinstance(v, bytes) else v


def _events_of(data, module: str | None) -> tuple[list[Event], str]:
    """The module's events (``None``: every module's): ``(events, "gpu" | "cpu")``."""
    device, host = [], []
    for plane in data.planes:
        on_device = plane.name.startswith("/device:") and "CPU" not in plane.name
        lines = list(plane.lines)
        if on_device and any("stream" in ln.name.lower() for ln in lines):
            lines = [ln for ln in lines if "stream" in ln.name.lower()]  # not the derived "XLA Ops" lines
        for line in lines:
            for e in line.events:
                with warnings.catch_warnings():  # "builtin type event_stats has no __module__" (jax 0.12)
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stats = dict(getattr(e, "stats", None) or ())
                mod = _stat(stats, "hlo_module")
                op = _stat(stats, "hlo_op")
                if mod is not None and module is not None and mod != module:
                    continue
                if on_device:
                    if mod is None and op is None and e.name.startswith("end:"):
                        continue
                    device.append(Event(op or e.name, e.start_ns, e.duration_ns, _stat(stats, "run_id"), line.name,
                                        e.name))
                elif op is not None and (mod == module or (module is None and mod is not None)):
                    host.append(Event(op, e.start_ns, e.duration_ns, _stat(stats, "run_id"), line.name, e.name))
    if device:
        return device, "gpu"
    return _innermost(host), "cpu"


def _innermost(events: list[Event]) -> list[Event]:
    """Drop events that contain another event of the same line (a while thunk around its body's thunks)."""
    out = []
    by_line = collections.defaultdict(list)
    for e in events:
        by_line[e.line].append(e)
    for evs in by_line.values():
        evs.sort(key=lambda e: (e.start_ns, -e.dur_ns))
        for i, e in enumerate(evs):
            end = e.start_ns + e.dur_ns
            nxt = evs[i + 1] if i + 1 < len(evs) else None
            if nxt is not None and nxt.start_ns < end and nxt.start_ns + nxt.dur_ns <= end:
                continue  # a parent
            out.append(e)
    return out


def trace(run: Callable[[], object], module: str | None, *, log_dir: str | None = None
          ) -> tuple[list[Event], str]:
    """Run ``run()`` (which must wait for its results) under the profiler; the events of ``module`` (``None``:
    of every program) and the platform they were read from (``"gpu"``: device kernels, ``"cpu"``: host
    thunks)."""

    def read(data):
        events, platform = _events_of(data, module)
        if not events and module is not None:  # module names spelled otherwise: nothing else ran in the trace
            events, platform = _events_of(data, None)
            platform += " (module not found: every program's events)"
        return events, platform

    return _profiled(run, read, log_dir=log_dir)


def _profiled(run: Callable[[], object], read: Callable, *, log_dir: str | None = None, options=None):
    """``read(data)`` of the profiler's xspace (``jax.profiler.ProfileData``) for one traced ``run()`` (waited
    for), written under ``log_dir`` (default: a temporary directory)."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        d = log_dir or tmp
        with jax.profiler.trace(d, profiler_options=options):
            jax.block_until_ready(run())
        files = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))
        if not files:
            raise RuntimeError(f"the profiler wrote no xplane.pb under {d}")
        return read(ProfileData.from_file(files[-1]))


def split_runs(events: list[Event], calls: int) -> list[list[Event]]:
    """The events of each of ``calls`` runs: by ``run_id`` when every event has one, else by the ``calls - 1``
    widest gaps between consecutive events (the runs were synchronised one by one)."""
    if not events:
        return []
    if all(e.run is not None for e in events):
        groups = collections.defaultdict(list)
        for e in events:
            groups[e.run].append(e)
        runs = sorted(groups.values(), key=lambda g: min(e.start_ns for e in g))
        return runs
    evs = sorted(events, key=lambda e: e.start_ns)
    ends, gaps = [], []
    reach = evs[0].start_ns + evs[0].dur_ns
    for i in range(1, len(evs)):
        gaps.append((evs[i].start_ns - reach, i))
        reach = max(reach, evs[i].start_ns + evs[i].dur_ns)
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[: max(calls - 1, 0)])
    for c in cuts:
        ends.append(c)
    bounds = [0, *ends, len(evs)]
    return [evs[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _shared_durations(events: list[Event]) -> list[float]:
    """Each event's duration with overlapping time split equally among the events running at that time."""
    points = sorted({e.start_ns for e in events} | {e.start_ns + e.dur_ns for e in events})
    share = [0.0] * len(events)
    order = sorted(range(len(events)), key=lambda i: events[i].start_ns)
    active: list[int] = []
    nxt = 0
    for a, b in zip(points, points[1:]):
        while nxt < len(order) and events[order[nxt]].start_ns <= a:
            active.append(order[nxt])
            nxt += 1
        active = [i for i in active if events[i].start_ns + events[i].dur_ns > a]
        if active:
            for i in active:
                share[i] += (b - a) / len(active)
    return share


@dataclasses.dataclass
class ScopeTimes:
    """Seconds per run (mean over the traced runs) of each scope path, and of the whole run."""

    scopes: dict[tuple[str, ...], float]  # scope path -> seconds (UNATTRIBUTED: ``(UNATTRIBUTED,)``)
    span_s: float  # mean over runs of first event start -> last event end
    busy_s: float  # mean over runs of the time some event ran (the sum of ``scopes``)
    kernel_sum_s: float  # mean over runs of the raw event durations (overlaps counted twice)
    runs: int
    events_per_run: float
    platform: str
    unattributed_ops: dict[str, float]  # the biggest unattributed instructions / kernels, seconds per run
    kernels: dict[tuple[str, ...], float] = dataclasses.field(default_factory=dict)  # events per run per scope
    wall_s: float | None = None  # mean host wall time of a traced call (profile_compiled)

    @property
    def unattributed_s(self) -> float:
        return self.scopes.get((UNATTRIBUTED,), 0.0)

    def total(self, prefix: tuple[str, ...]) -> float:
        """Seconds of every scope under ``prefix``."""
        return sum(t for s, t in self.scopes.items() if s[: len(prefix)] == prefix)


def attribute(events: list[Event], scopes: dict[str, tuple[str, ...]], *, calls: int,
              platform: str = "") -> ScopeTimes:
    """Per-scope seconds per run of ``events`` (:func:`trace`) with ``scopes`` (:func:`hlo_scopes`)."""
    runs = split_runs(events, calls)
    if not runs:
        raise RuntimeError("the trace holds no event of the program (wrong module name, or no profiler data)")
    totals: dict[tuple[str, ...], float] = collections.defaultdict(float)
    counts: dict[tuple[str, ...], int] = collections.defaultdict(int)
    missing: dict[str, float] = collections.defaultdict(float)
    spans, busy, raw = [], [], []
    for run in runs:
        shares = _shared_durations(run)
        for e, s in zip(run, shares):
            # a kernel a command buffer launched carries the buffer's thunk as its op: its own name is the fusion's
            scope = scopes.get(e.op) or scopes.get(_norm(e.op)) or scopes.get(_norm(e.name)) or ()
            if not scope:
                scope = (UNATTRIBUTED,)
                missing[e.op] += s * 1e-9
            totals[scope] += s * 1e-9
            counts[scope] += 1
        spans.append(1e-9 * (max(e.start_ns + e.dur_ns for e in run) - min(e.start_ns for e in run)))
        busy.append(1e-9 * sum(shares))
        raw.append(1e-9 * sum(e.dur_ns for e in run))
    n = len(runs)
    top = dict(sorted(((k, v / n) for k, v in missing.items()), key=lambda kv: -kv[1])[:12])
    return ScopeTimes({k: v / n for k, v in totals.items()}, sum(spans) / n, sum(busy) / n,
                      sum(raw) / n, n, sum(len(r) for r in runs) / n, platform, top,
                      {k: v / n for k, v in counts.items()})


def profile_compiled(compiled, run_once: Callable[[], object], *, calls: int) -> ScopeTimes:
    """Trace ``calls`` synchronised runs of ``run_once()`` (which calls ``compiled``) and attribute them;
    ``wall_s`` of the result is the mean host wall time of those traced calls (each one's events run inside
    it, so ``busy_s <= span_s <= wall_s``)."""
    text = compiled.as_text()
    module = module_name(text)
    walls = []

    def many():
        out = None
        for _ in range(calls):
            t0 = time.perf_counter()
            out = jax.block_until_ready(run_once())
            walls.append(time.perf_counter() - t0)
        return out

    events, platform = trace(many, module)
    times = attribute(events, hlo_scopes(text), calls=calls, platform=platform)
    times.wall_s = sum(walls) / len(walls)
    return times


def kernel_times(fn, arg_sets, *, calls: int = 20) -> dict | None:
    """Device-side timing of ``calls`` back-to-back calls of ``fn`` from a profiler trace (GPU only, else None;
    a failed trace is ``{"error": ...}``, so profiling stays optional for a benchmark).

    ``device_us``: median per call of the summed kernel durations; ``span_us``: median per call of first kernel
    start to last kernel end (kernels plus the gaps between them inside one call, none of the host's dispatch
    time between calls); ``kernels``: mean microseconds per call per kernel name."""
    from pallas_kernels.platform import on_gpu

    if not on_gpu():
        return None
    try:
        for i in range(3):
            jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))

        def run():
            return [fn(*arg_sets[i % len(arg_sets)]) for i in range(calls)]

        events, _ = trace(run, None)
    except Exception as e:  # noqa: BLE001  (profiling is optional: keep the timings)
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    events = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    if not events:
        return {"device_events": 0}
    events.sort(key=lambda e: e.start_ns)
    if all(e.run is None for e in events) and len(events) % calls == 0:  # back to back: equal groups per call
        per = len(events) // calls
        runs = [events[i * per:(i + 1) * per] for i in range(calls)]
    else:
        runs = split_runs(events, calls)
    spans = sorted(max(e.start_ns + e.dur_ns for e in r) - min(e.start_ns for e in r) for r in runs)
    busy = sorted(sum(e.dur_ns for e in r) for r in runs)
    names: dict[str, float] = collections.defaultdict(float)
    for e in events:
        names[(e.name or e.op)[:80]] += e.dur_ns / len(runs) / 1e3
    return {"device_us": busy[len(busy) // 2] / 1e3, "span_us": spans[len(spans) // 2] / 1e3,
            "kernels": {k: round(v, 2) for k, v in names.items()}, "calls_found": len(runs)}


def host_activity(run: Callable[[], object], *, top: int = 40, level: int = 2) -> list[dict]:
    """What the host threads did while ``run()`` ran (XLA's and JAX's own trace annotations: compilation passes,
    executable loading, lowering, and at ``level`` 3 the runtime's finer ones, such as each thunk's execution), by
    event name: the ``top`` names of largest self time (:func:`activity_rows`). Device planes are left out, and so
    are Python calls (the Python tracer is off: it would slow what is timed)."""
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    opts.host_tracer_level = level

    def read(data):
        return [[(e.start_ns, e.duration_ns, e.name) for e in line.events]
                for plane in data.planes if not plane.name.startswith("/device:") for line in plane.lines]

    return activity_rows(_profiled(run, read, options=opts))[:top]


def activity_rows(lines: list[list[tuple[float, float, str]]]) -> list[dict]:
    """Events ``(start_ns, duration_ns, name)`` of each thread, summed by name, largest self time first.

    Each row: ``name``, ``count``, ``total_ms`` (inclusive), ``self_ms`` (less the events nested in it on the same
    thread), ``max_ms`` (the longest single event: in a warm start, the largest executable's load) and
    ``threads`` (how many threads ran it)."""
    rows: dict[str, dict] = {}
    for events in lines:
        seen: set[str] = set()
        stack: list[list] = []  # [end_ns, name, duration_ns, nested_ns]

        def close():
            end, name, dur, nested = stack.pop()
            r = rows.setdefault(name, {"name": name, "count": 0, "total_ms": 0.0, "self_ms": 0.0, "max_ms": 0.0,
                                       "threads": 0})
            r["count"] += 1
            r["total_ms"] += dur / 1e6
            r["max_ms"] = max(r["max_ms"], dur / 1e6)
            r["self_ms"] += max(dur - nested, 0.0) / 1e6
            if name not in seen:
                seen.add(name)
                r["threads"] += 1
            if stack:
                stack[-1][3] += dur

        for start, dur, name in sorted(events, key=lambda t: (t[0], -t[1])):
            while stack and stack[-1][0] <= start:
                close()
            stack.append([start + dur, name, dur, 0.0])
        while stack:
            close()
    out = sorted(rows.values(), key=lambda r: -r["self_ms"])
    for r in out:
        for key in ("total_ms", "self_ms", "max_ms"):
            r[key] = round(r[key], 3)
    return out
