"""Benchmark: the MoE's routed experts at M3 width: lax.ragged_dot, the XLA fallback, the Pallas grouped GEMM.

M3: hidden 6144, 128 experts, top-4, intermediate 3072, bf16, random weights (9.66 GB gate/up + 4.83 GB down).
Sizes: 512 and 4096 tokens (2048 and 16384 (token, expert) pairs). Routing: ``uniform`` (each token's top-4
drawn uniformly without replacement) or ``skewed`` (Gumbel top-4 over a Zipf(1) popularity: expert ``e`` is
``~1 / (e + 1)`` likely, so a few experts take a large share and many get nothing).

Per (size, routing) and implementation (``reference`` = ``lax.ragged_dot``, ``xla`` = the dropless fallback,
``pallas`` = the kernel; ``pallas`` launch variants with ``--sweep``), two rows:

* ``gate_up``: ``grouped_matmul`` with the fused swigluoai over the expert-sorted rows;
* ``moe``: the whole routed MoE given the router's output (``layers.routed_experts``: sort, gather, gate/up,
  down, weighting, scatter back onto the tokens).

Each row: median time (back-to-back calls, ``bench_common.time_stats``), the weight-read floor (the active
experts' weight bytes / 4.3e12 B/s, H200 HBM), the FLOP roofline (useful FLOPs / 989e12, H200 dense bf16),
``pct_of_bound`` (the larger of the two over the time), errors against ``reference`` (fp32 max / mean abs and
max relative to the reference's max) and, on a GPU with ``--profile``, device time from a profiler trace.

    PYTHONPATH=. python3 scripts/bench_moe.py --out docs/bench_results/moe_h200.json
    PYTHONPATH=. python3 scripts/bench_moe.py --sweep --out /tmp/moe_sweep.json   # launch variants too
    PYTHONPATH=. python3 scripts/bench_moe.py --tiny --out /tmp/moe_tiny.json     # CPU smoke run (interpret)
    PYTHONPATH=. python3 scripts/bench_moe.py --quantization mxfp4 --out /tmp/moe_mxfp4.json

``--quantization mxfp4|mxfp8``: the experts kept as MX tensors (``layers.random_mx_weights``: the checkpoint's
``[out, in]`` layout, E8M0 scales per 32 inputs), bf16 rows; the implementations are then
``mx_grouped_gemm``'s (``reference`` = dequantize + ``lax.ragged_dot``, ``xla`` = dequantize + the fallback,
``pallas`` = the dequantizing kernel) and the floor is the quantized bytes (elements plus scales). Every row
also carries ``spec_floor_ms`` (the same bytes at the H200's 4.8 TB/s data-sheet rate) and ``bf16_floor_ms``
(the bf16 experts' bytes at 4.3 TB/s: what keeping the weights quantized saves).

``run(...) -> list[dict]`` is the library entry point; ``main()`` prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.layers import random_mx_weights, routed_experts
from pallas_kernels import grouped_gemm as gg
from pallas_kernels import mx_grouped_gemm as mg
from pallas_kernels.platform import on_gpu
from pallas_kernels.tuning import (
    MX_WEIGHT_BYTES,
    PEAKS,
    grouped_matmul_launch_config,
    mx_grouped_matmul_launch_config,
)
from scripts import bench_common, bench_shapes

_H200 = PEAKS["h200"]
HBM_BYTES_PER_S = _H200.hbm_bytes_per_s  # H200 HBM3e, achievable
SPEC_BYTES_PER_S = _H200.hbm_nominal_bytes_per_s  # H200 data sheet
PEAK_FLOPS = _H200.bf16_flops_per_s  # H200 dense bf16 tensor cores
_M3_MOE = bench_shapes.m3_moe()
SWIGLU = _M3_MOE["swiglu"]  # M3's swigluoai (alpha, limit, beta)


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    experts: int
    top_k: int
    inter: int
    dtype: str
    tokens: tuple[int, ...]


M3 = Shape(hidden=_M3_MOE["hidden"], experts=_M3_MOE["experts"], top_k=_M3_MOE["top_k"], inter=_M3_MOE["inter"],
           dtype="bfloat16", tokens=bench_shapes.MOE_TOKENS)
TINY = Shape(hidden=64, experts=8, top_k=2, inter=32, dtype="bfloat16", tokens=(8, 32))

# Launch variants of the kernel (grouped_matmul overrides, gate/up and down alike) timed by --sweep.
SWEEP = [
    {"block_m": 16, "block_n": 64, "block_k": 128, "num_stages": 4},
    {"block_m": 16, "block_n": 128, "block_k": 64, "num_stages": 3},
    {"block_m": 16, "block_n": 256, "block_k": 64, "num_stages": 3, "num_warps": 8},
    {"block_m": 32, "block_n": 128, "block_k": 64, "num_stages": 4},
    {"block_m": 64, "block_n": 128, "block_k": 64, "num_stages": 3},
    {"block_m": 64, "block_n": 64, "block_k": 64, "num_stages": 4},
    {"block_m": 128, "block_n": 64, "block_k": 64, "num_stages": 3, "num_warps": 8},
    {"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 3, "num_warps": 8},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 4},  # block_k from the shared-memory budget
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "group_m": 4},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "group_m": 16},
    {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 4},
    {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 4, "group_m": 16},
    {"group_m": 1},
    {"group_m": 32},
]


def make_routing(key, num_tokens: int, shape: Shape, routing: str):
    """``(weights f32[N, k], experts int32[N, k])``: distinct experts per token, weights summing to 2."""
    kg, kw = jax.random.split(key)
    noise = jax.random.gumbel(kg, (num_tokens, shape.experts))
    if routing == "skewed":
        noise = noise - jnp.log(jnp.arange(1, shape.experts + 1, dtype=jnp.float32))  # Zipf(1) popularity
    elif routing != "uniform":
        raise ValueError(f"routing must be 'uniform' or 'skewed', got {routing!r}")
    _, experts = jax.lax.top_k(noise, shape.top_k)
    weights = jax.random.uniform(kw, (num_tokens, shape.top_k), minval=0.1, maxval=1.0)
    return 2.0 * weights / jnp.sum(weights, axis=-1, keepdims=True), experts.astype(jnp.int32)


def make_weights(key, shape: Shape):
    dtype = jnp.dtype(shape.dtype)
    k1, k2 = jax.random.split(key)
    e, d, i = shape.experts, shape.hidden, shape.inter
    wgu = (jax.random.normal(k1, (e, d, 2 * i), jnp.float32) * d**-0.5).astype(dtype)
    wd = (jax.random.normal(k2, (e, i, d), jnp.float32) * i**-0.5).astype(dtype)
    return wgu, wd


def make_mx_weights(key, shape: Shape, fmt: str):
    """``((gate_up elements, scales), (down elements, scales))`` in the checkpoint's ``[E, out, in]`` layout."""
    k1, k2 = jax.random.split(key)
    e, d, i = shape.experts, shape.hidden, shape.inter
    gu = jax.jit(random_mx_weights, static_argnums=(1, 2))(k1, fmt, (e, 2 * i, d))
    dn = jax.jit(random_mx_weights, static_argnums=(1, 2))(k2, fmt, (e, d, i))
    return gu, dn


def sorted_rows(x, experts, num_experts: int):
    """The rows ``grouped_matmul`` takes: tokens gathered in expert order, and the group sizes."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return x[order // experts.shape[1]], group_sizes


def bytes_and_flops(group_sizes: np.ndarray, shape: Shape, num_rows: int, quantization: str | None = None) -> dict:
    """Weight bytes of the active experts (``quantization``: MX elements plus scales) and useful FLOPs."""
    item = jnp.dtype(shape.dtype).itemsize if quantization is None else MX_WEIGHT_BYTES[quantization]
    active = int(np.sum(group_sizes > 0))
    d, i = shape.hidden, shape.inter
    gu_w = round(active * d * 2 * i * item)
    dn_w = round(active * i * d * item)
    gu_flops = 2 * num_rows * d * 2 * i
    dn_flops = 2 * num_rows * i * d
    return {
        "active_experts": active,
        "max_group": int(group_sizes.max()),
        "empty_experts": int(np.sum(group_sizes == 0)),
        "gate_up": {"weight_bytes": gu_w, "flops": gu_flops},
        "moe": {"weight_bytes": gu_w + dn_w, "flops": gu_flops + dn_flops},
    }


def _errors(out, ref) -> dict:
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    d = np.abs(o - r)
    return {
        "max_abs_err": float(d.max()),
        "mean_abs_err": float(d.mean()),
        "max_rel_err": float(d.max() / max(float(np.abs(r).max()), 1e-30)),
        "nan": bool(np.isnan(o).any()),
    }


def _mx_fns(impl: str, variant: dict, shape: Shape, num_rows: int, fmt: str):
    """:func:`_fns` for MX experts: ``gate_up(xs, q, scale, gs)``, ``moe(x, weights, experts, gu_q, gu_scale,
    dn_q, dn_scale)``."""
    gate_up = jax.jit(functools.partial(mg.mx_grouped_matmul, swiglu=SWIGLU, implementation=impl, **variant))
    configs = {}
    if variant:
        common = {"num_rows": num_rows, "num_groups": shape.experts, "fmt": fmt, **variant}
        configs = {
            "gate_up_config": mx_grouped_matmul_launch_config(k=shape.hidden, n=shape.inter, fused=True, **common),
            "down_config": mx_grouped_matmul_launch_config(k=shape.inter, n=shape.hidden, **common),
        }

    def moe(x, weights, experts, gu_q, gu_scale, dn_q, dn_scale):
        return routed_experts(x, weights, experts, gu_q, dn_q, w_gate_up_scale=gu_scale, w_down_scale=dn_scale,
                              swiglu=SWIGLU, implementation=impl, **configs)

    return gate_up, jax.jit(moe)


def _fns(impl: str, variant: dict, shape: Shape, num_rows: int):
    """Jitted ``gate_up(xs, wgu, gs)`` and ``moe(x, weights, experts, wgu, wd)`` for one implementation."""
    gate_up = jax.jit(functools.partial(gg.grouped_matmul, swiglu=SWIGLU, implementation=impl, **variant))
    configs = {}
    if variant:  # the variant's overrides on the policy of each of moe_ffn's two kernels
        common = {"num_rows": num_rows, "num_groups": shape.experts, **variant}
        configs = {
            "gate_up_config": grouped_matmul_launch_config(k=shape.hidden, n=shape.inter, fused=True,
                                                           **common),
            "down_config": grouped_matmul_launch_config(k=shape.inter, n=shape.hidden, **common),
        }
    moe = functools.partial(routed_experts, swiglu=SWIGLU, implementation=impl, **configs)
    return gate_up, jax.jit(moe)


def run(
    shape: Shape = M3,
    *,
    routings: tuple[str, ...] = ("uniform", "skewed"),
    implementations: tuple[str, ...] = ("reference", "xla", "pallas"),
    sweep: bool = False,
    reps: int = 10,
    samples: int = 5,
    profile: bool = False,
    quantization: str | None = None,
    seed: int = 0,
    json_path: str | None = None,
    environment: dict | None = None,
    log=print,
) -> list[dict]:
    """Time every (tokens, routing, implementation[, variant]) of ``shape``; see the module docstring
    (``quantization``: the experts kept as ``"mxfp4"`` / ``"mxfp8"``)."""
    key = jax.random.PRNGKey(seed)
    if quantization is None:
        wgu, wd = make_weights(jax.random.fold_in(key, 1), shape)
    else:
        (gu_q, gu_s), (dn_q, dn_s) = make_mx_weights(jax.random.fold_in(key, 1), shape, quantization)
    dtype = jnp.dtype(shape.dtype)
    rows = []
    for num_tokens in shape.tokens:
        num_rows = num_tokens * shape.top_k
        x = jax.random.normal(jax.random.fold_in(key, 2), (num_tokens, shape.hidden), jnp.float32)
        x = x.astype(dtype)
        for routing in routings:
            weights, experts = make_routing(jax.random.fold_in(key, 3), num_tokens, shape, routing)
            xs, gs = sorted_rows(x, experts, shape.experts)
            model = bytes_and_flops(np.asarray(gs), shape, num_rows, quantization)
            bf16 = bytes_and_flops(np.asarray(gs), shape, num_rows)
            refs = {}
            jobs = [(impl, {}) for impl in implementations]
            if sweep and "pallas" in implementations:
                jobs += [("pallas", v) for v in SWEEP]
            for impl, variant in jobs:
                try:
                    if quantization is None:
                        gate_up, moe = _fns(impl, variant, shape, num_rows)
                        parts = (("gate_up", gate_up, (xs, wgu, gs)), ("moe", moe, (x, weights, experts, wgu, wd)))
                    else:
                        gate_up, moe = _mx_fns(impl, variant, shape, num_rows, quantization)
                        parts = (("gate_up", gate_up, (xs, gu_q, gu_s, gs)),
                                 ("moe", moe, (x, weights, experts, gu_q, gu_s, dn_q, dn_s)))
                except Exception as e:  # noqa: BLE001  (a variant the policy rejects)
                    log(f"[{num_tokens} {routing} {impl} {variant}] {type(e).__name__}: {str(e)[:200]}")
                    continue
                for part, fn, args in parts:
                    row = {
                        "part": part,
                        "tokens": num_tokens,
                        "pairs": num_rows,
                        "routing": routing,
                        "impl": impl,
                        "quantization": quantization or shape.dtype,
                        "variant": ",".join(f"{k}={v}" for k, v in variant.items()) or "default",
                        "active_experts": model["active_experts"],
                        "max_group": model["max_group"],
                        "empty_experts": model["empty_experts"],
                        **model[part],
                    }
                    row["floor_ms"] = 1e3 * row["weight_bytes"] / HBM_BYTES_PER_S
                    row["spec_floor_ms"] = 1e3 * row["weight_bytes"] / SPEC_BYTES_PER_S
                    row["bf16_floor_ms"] = 1e3 * bf16[part]["weight_bytes"] / HBM_BYTES_PER_S
                    row["roofline_ms"] = 1e3 * row["flops"] / PEAK_FLOPS
                    if impl == "pallas":
                        kernels = {"gu": (shape.hidden, shape.inter, True),
                                   "dn": (shape.inter, shape.hidden, False)}
                        for name, (k, n, fused) in kernels.items():
                            common = dict(num_rows=num_rows, num_groups=shape.experts, k=k, n=n, fused=fused,
                                          **variant)
                            cfg = (grouped_matmul_launch_config(**common) if quantization is None else
                                   mx_grouped_matmul_launch_config(fmt=quantization, **common))
                            row[f"cfg_{name}"] = dataclasses.asdict(cfg)
                    try:
                        t0 = time.perf_counter()
                        out = jax.block_until_ready(fn(*args))
                        row["first_call_s"] = time.perf_counter() - t0
                        if impl == "reference" and not variant:
                            refs[part] = out
                        if part in refs:
                            row.update(_errors(out, refs[part]))
                        n_reps = reps if impl != "reference" else max(2, reps // 4)
                        t = bench_common.time_stats(fn, [args], reps=n_reps, samples=samples)
                        row["time_ms"] = 1e3 * t["median"]
                        row["time_ms_min"] = 1e3 * t["min"]
                        bound = max(row["floor_ms"], row["roofline_ms"])
                        row["pct_of_bound"] = 100.0 * bound / row["time_ms"]
                        row["weight_TBps"] = row["weight_bytes"] / (row["time_ms"] * 1e-3) / 1e12
                        row["TFLOPs"] = row["flops"] / (row["time_ms"] * 1e-3) / 1e12
                        if profile and on_gpu():
                            from scripts.op_trace import kernel_times

                            prof = kernel_times(fn, [args])
                            if prof and "span_us" in prof:
                                row["span_ms"] = prof["span_us"] / 1e3
                                row["kernels_us"] = prof.get("kernels")
                        del out
                    except Exception as e:  # noqa: BLE001  (an OOM or a bad variant must not lose the rest)
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    log(_one_line(row))
                    rows.append(row)
                    if json_path:
                        bench_common.write_json(json_path, {"environment": environment or {}, "shape":
                                                            dataclasses.asdict(shape), "rows": rows})
            if on_gpu():
                jax.clear_caches()
    return rows


COLUMNS = ["part", "tokens", "routing", "impl", "quantization", "variant", "max_group", "time_ms", "floor_ms",
           "spec_floor_ms", "bf16_floor_ms", "roofline_ms", "pct_of_bound", "weight_TBps", "TFLOPs", "max_rel_err",
           "error"]


def _one_line(row: dict) -> str:
    keys = ["part", "tokens", "routing", "impl", "variant", "time_ms", "floor_ms", "roofline_ms",
            "pct_of_bound", "max_rel_err", "error"]
    return " ".join(f"{k}={bench_common._fmt(row.get(k))}" for k in keys if row.get(k) is not None)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run, interpret mode)")
    p.add_argument("--tokens", default=None, help="token counts (default 512,4096; tiny 8,32)")
    p.add_argument("--routing", default="uniform,skewed")
    p.add_argument("--impls", default="reference,xla,pallas")
    p.add_argument("--sweep", action="store_true", help="also time the kernel's launch variants (SWEEP)")
    p.add_argument("--profile", action="store_true", help="device time from a profiler trace (GPU)")
    p.add_argument("--quantization", choices=("mxfp4", "mxfp8"), default=None,
                   help="experts kept as MX tensors (the dequantizing kernel and its references)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None, help="write rows and environment to this JSON file")
    a = p.parse_args(argv)
    shape = TINY if a.tiny else M3
    if a.tokens:
        shape = dataclasses.replace(shape, tokens=tuple(int(t) for t in a.tokens.split(",") if t))
    env = bench_common.environment()
    print(f"# {env}\n# shape {shape}; floor at {HBM_BYTES_PER_S / 1e12} TB/s, roofline at "
          f"{PEAK_FLOPS / 1e12} TFLOP/s", flush=True)
    rows = run(
        shape,
        routings=tuple(r for r in a.routing.split(",") if r),
        implementations=tuple(i for i in a.impls.split(",") if i),
        sweep=a.sweep,
        reps=2 if a.tiny else a.reps,
        samples=2 if a.tiny else 5,
        profile=a.profile,
        quantization=a.quantization,
        json_path=a.out,
        environment=env,
    )
    if a.out:
        bench_common.write_json(a.out, {"environment": env, "shape": dataclasses.asdict(shape), "rows": rows})
    bench_common.print_table(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
