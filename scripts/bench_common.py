"""Timing and roofline helpers shared by the benchmark scripts (GPU; they also run, slowly, on CPU).

Timing follows the device METHOD: warm up, then the median of many timed replays, each synchronised with
``block_until_ready``; inputs rotate among several copies so repeated runs do not just measure the L2 cache.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp


def draft_lengths_arg(text: str) -> tuple[int, ...]:
    """The argparse type of ``--draft-lengths`` (and of ``bench_e2e.py``'s ``adaptive@D1,D2,...`` modes):
    ``"0,3,7"`` -> ``(0, 3, 7)``, sorted and distinct, none negative; the caller checks them against K."""
    try:
        lengths = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        lengths = ()
    if not lengths or lengths[0] < 0:
        raise argparse.ArgumentTypeError(f"draft lengths are comma-separated integers >= 0 such as 0,3,7, got {text!r}")
    return lengths


def refuse_lengths_above_k(ap: argparse.ArgumentParser, lengths: tuple[int, ...] | None, k: int) -> None:
    """``ap.error`` (exit 2, before any model loads) when ``--draft-lengths`` has a length above ``--k``."""
    if lengths and lengths[-1] > k:
        ap.error(f"--draft-lengths {lengths} must lie in [0, K={k}] (--k)")


def mode_settings(mode: str, k: int) -> dict:
    """Engine keywords of a mode: ``verification``, ``num_speculative_tokens`` and the mode's extra keywords.

    Suffixes change one engine setting each, in any order: ``MODE+lbN`` is ``MODE`` with
    ``Engine(device_loop_token_buckets=N)`` (N verify sizes per draft length in the greedy device loop) and
    ``MODE+piN`` with ``Engine(device_loop_plan_interval=N)`` (a plan held for up to N device-loop iterations), e.g.
    ``adaptive+lb2`` or ``adaptive+pi8`` beside ``adaptive`` and ``fixed3``, in one interleaved run (where modes that
    differ only in a plan interval of 2 or more share one engine: ``scripts/bench_e2e.config_steps``)."""
    if "+" in mode:
        base, _, suffix = mode.rpartition("+")
        keys = {"lb": "device_loop_token_buckets", "pi": "device_loop_plan_interval"}
        name, number = suffix[:2], suffix[2:]
        if name not in keys or not number.isdigit() or int(number) < 1:
            raise ValueError(f"mode {mode!r}: a suffix is +lbN (N >= 1 loop buckets per draft length) or +piN "
                             f"(N >= 1 device-loop iterations per plan), got +{suffix}")
        settings = mode_settings(base, k)
        if keys[name] in settings:
            raise ValueError(f"mode {mode!r}: +{name} given twice")
        return {**settings, keys[name]: int(number)}
    if mode == "none":
        return {"verification": "none", "num_speculative_tokens": 0}
    if mode.startswith("fixed") and mode[5:].isdigit():
        return {"verification": "fixed", "num_speculative_tokens": int(mode[5:])}
    if mode == "adaptive":
        return {"verification": "adaptive", "num_speculative_tokens": k}
    if mode == "adaptive-held":
        return {"verification": "adaptive", "num_speculative_tokens": k, "draft_lengths": (k,)}
    if mode == "adaptive-calibrated":
        return {"verification": "adaptive", "num_speculative_tokens": k, "confidence": "calibrated"}
    if mode.startswith("adaptive@"):
        try:
            lengths = draft_lengths_arg(mode[len("adaptive@"):])
        except argparse.ArgumentTypeError:
            lengths = ()
        if not lengths or not all(0 <= d <= k for d in lengths):
            raise ValueError(f"mode {mode!r}: adaptive@D1,D2,... takes draft lengths in [0, K={k}]")
        return {"verification": "adaptive", "num_speculative_tokens": k, "draft_lengths": lengths}
    raise ValueError(f"unknown mode {mode!r} (none, fixed1..fixed7, adaptive, adaptive-held, adaptive-calibrated, "
                     f"adaptive@D1,D2,..., any of them +lbN and/or +piN)")


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def time_calls(call: Callable[[], object], *, warmup: int = 3, iters: int = 30) -> dict:
    """Seconds of ``call()`` (which returns its outputs; each call is synchronised with ``block_until_ready``)
    over ``iters`` calls after ``warmup``: ``{"median", "min", "max"}``. The one per-call timer of the scripts:
    a call that threads state (a donated cache fed back) keeps it in its closure."""
    for _ in range(warmup):
        jax.block_until_ready(call())
    samples = []
    for _ in range(max(iters, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        samples.append(time.perf_counter() - t0)
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def time_fn(fn: Callable, arg_sets: Sequence[tuple], *, warmup: int = 3, iters: int = 30) -> float:
    """Median seconds of ``fn(*args)`` over ``iters`` calls, cycling through ``arg_sets`` (:func:`time_calls`)."""
    i = iter(range(1 << 62))
    return time_calls(lambda: fn(*arg_sets[next(i) % len(arg_sets)]), warmup=warmup, iters=iters)["median"]


def time_stats(fn: Callable, arg_sets: Sequence[tuple], *, reps: int = 20, samples: int = 7,
               warmup: int = 2) -> dict:
    """Per-call seconds of ``reps`` back-to-back calls synchronised once: median, min and max of ``samples``.

    Hides per-call host dispatch (a few microseconds) that ``time_fn`` would include; use it for kernels whose
    run time is comparable to dispatch latency.
    """
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    ts = []
    for _ in range(samples):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*arg_sets[i % len(arg_sets)]) for i in range(reps)])
        ts.append((time.perf_counter() - t0) / reps)
    return {"median": statistics.median(ts), "min": min(ts), "max": max(ts)}


def time_fn_batched(fn: Callable, arg_sets: Sequence[tuple], *, reps: int = 20, warmup: int = 2) -> float:
    """Median per-call seconds of back-to-back calls (see :func:`time_stats`)."""
    return time_stats(fn, arg_sets, reps=reps, samples=5, warmup=warmup)["median"]


def time_stats_one_call(fn: Callable, arg_sets: Sequence[tuple], *, reps: int = 20, samples: int = 7) -> dict:
    """Like :func:`time_stats`, but all ``arg_sets`` run inside ONE jitted call, so host dispatch (tens of
    microseconds per jitted call) is paid once per ``len(arg_sets)`` kernel calls; seconds per kernel call."""
    n = len(arg_sets)
    if n == 1:
        return time_stats(fn, arg_sets, reps=reps, samples=samples)
    multi = jax.jit(lambda sets: [fn(*a) for a in sets])
    t = time_stats(multi, [(list(arg_sets),)], reps=max(1, reps // n) + 1, samples=samples)
    return {k: v / n for k, v in t.items()}


def measure_copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate in bytes/s (bytes read plus bytes written) of a jnp ``x + 1``.

    Copies are queued back to back and synchronised once: synchronising every call under-reads the ceiling by
    25-30% on an H200. ``reps`` outputs stay alive, so keep ``nbytes`` around 1 GiB (4 GiB x 20 outputs ran out
    of memory beside XLA's preallocated pool).
    """
    n = nbytes // 4
    xs = [jnp.arange(n, dtype=jnp.float32) + i for i in range(2)]
    copy = jax.jit(lambda x: x + 1.0)  # one read, one write per element
    t = time_stats(copy, [(x,) for x in xs], reps=10, samples=5, warmup=3)["median"]
    return 2 * n * 4 / t


def measure_bandwidths(nbytes: int = 1 << 30) -> dict:
    """HBM ceilings in bytes/s: a jnp copy, a jnp read-only reduction and, when PyTorch sees a GPU, a torch
    device-to-device copy timed with CUDA events. ``hbm_ceiling`` picks the copy rate to quote against."""
    out = {"jnp_copy": measure_copy_bandwidth(nbytes)}
    n = nbytes // 4
    xs = [jnp.arange(n, dtype=jnp.float32) + i for i in range(2)]
    t = time_stats(jax.jit(lambda x: jnp.sum(x)), [(x,) for x in xs], reps=10, samples=5)["median"]
    out["jnp_read"] = n * 4 / t
    del xs
    try:
        import torch

        if torch.cuda.is_available():
            a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
            b = torch.empty_like(a)
            for _ in range(3):
                b.copy_(a)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                b.copy_(a)
            stop.record()
            torch.cuda.synchronize()
            out["torch_copy"] = 2 * a.numel() * 20 / (start.elapsed_time(stop) / 1e3)
            del a, b
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001  (torch is optional)
        out["torch_error"] = repr(e)[:200]
    return out


def hbm_ceiling(bandwidths: dict) -> float:
    """The copy rate (read + write bytes/s) that percentages of HBM bandwidth are quoted against."""
    return max(v for k, v in bandwidths.items() if k.endswith("_copy"))


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
