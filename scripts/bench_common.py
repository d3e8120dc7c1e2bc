"""Timing and roofline helpers shared by the benchmark scripts (GPU; they also run, slowly, on CPU).

Timing follows the device METHOD: warm up, then the median of many timed replays, each synchronised with
``block_until_ready``; inputs rotate among several copies so repeated runs do not just measure the L2 cache.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def time_fn(fn: Callable, arg_sets: Sequence[tuple], *, warmup: int = 3, iters: int = 30) -> float:
    """Median seconds of ``fn(*args)`` over ``iters`` calls, cycling through ``arg_sets``."""
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    samples = []
    for i in range(iters):
        args = arg_sets[i % len(arg_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_fn_batched(fn: Callable, arg_sets: Sequence[tuple], *, reps: int = 20, warmup: int = 2) -> float:
    """Median per-call seconds when ``reps`` calls are queued back to back and synchronised once.

    Hides per-call host dispatch (a few microseconds) that ``time_fn`` would include; use it for kernels whose
    run time is comparable to dispatch latency.
    """
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        outs = [fn(*arg_sets[i % len(arg_sets)]) for i in range(reps)]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def measure_copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written.

    Copies are queued back to back and synchronised once (``time_fn_batched``): synchronising every call
    under-reads the ceiling by 25-30% on an H200 (2.9-3.2 TB/s instead of about 4.2 TB/s).
    """
    n = nbytes // 4
    xs = [jnp.arange(n, dtype=jnp.float32) + i for i in range(2)]
    copy = jax.jit(lambda x: x + 1.0)  # one read, one write per element
    t = time_fn_batched(copy, [(x,) for x in xs], reps=20, warmup=3)
    return 2 * n * 4 / t


def environment() -> dict:
    info = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device_name(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)


def print_table(rows: Sequence[dict], columns: Sequence[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
