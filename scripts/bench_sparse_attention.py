"""Benchmark: ragged block-sparse attention (and dense paged attention) at M3 TP1 shapes.

M3 TP1: 64 query / 4 KV heads of 128, topk 16, page 128, bf16. Sizes are ``requests x query tokens x
context``:
512x8x4K (verification, K = 7), 512x1x4K (decode), 1x8x32K (one long request, verification).

Selections are realistic rather than uniform: per (request, KV head) shared block scores plus small per-token
noise (``noise`` x the score spread), the local block forced, top-k of the rest, so the tokens of a request
mostly agree and the per-request union is what a real indexer would give. The union size is reported.

Per size and launch variant a row reports: time (median of back-to-back replays, rotating cache copies so the
L2 does not serve repeated runs; for the latency-bound sizes also ``time_ms_loop``, calls chained in one
jitted loop, which removes Python dispatch), unique bytes (what the kernel must read: each union block's K and
V once per (request tile, KV head), plus q, output and metadata), the per-token bytes a per-token kernel would
read, the saving, achieved bytes/s and % of the measured HBM copy rate, executed tensor-core TFLOP/s (union
blocks x query-tile rows) and useful TFLOP/s (selected visible keys only), the jnp reference under jit and the
ratio, and parity against the reference (max / mean abs error on bf16 outputs vs an fp32 reference).

``run(...) -> list[dict]`` is the library entry point (``scripts/bench_kernels.py`` imports it); ``main()``
prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import sparse_attention as _sa
from pallas_kernels.attention_walk import tile_prepass
from pallas_kernels.paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.platform import on_gpu, resolve_interpret
from pallas_kernels.sparse_attention import (
    ragged_sparse_attention,
    ragged_sparse_attention_reference,
    union_block_counts,
)
from pallas_kernels.tuning import (
    MAX_SPARSE_BLOCK_Q,
    paged_attention_launch_config,
    sparse_attention_launch_config,
)
from scripts import bench_common, bench_shapes, op_trace

M3 = bench_shapes.m3_attention()  # 64 query / 4 KV heads of 128, page 128, topk 16


def _sizes(batches) -> dict:
    return {b.size if b.context >= 1024 else f"{b.requests}x{b.tokens}x{b.context}":
            {"num_requests": b.requests, "q_len": b.tokens, "context": b.context} for b in batches}


SIZES = _sizes(bench_shapes.ATTENTION_BATCHES)  # 512x8x4K, 512x1x4K, 1x8x32K
# Tiny size for a CPU smoke run of the whole bench path (interpret mode), not a measurement.
QUICK_SIZES = _sizes(bench_shapes.ATTENTION_QUICK)
# Copy-rate probe size: 1 GiB is far past the L2 (~60 MB); back-to-back timing keeps ``reps`` outputs alive,
# so 4 GiB x 20 outputs does not fit beside XLA's preallocated pool on a 141 GB H200 (it ran out of memory).
COPY_BYTES = 1 << 30
# Targets (issue 6) and the per-token split-K kernel other engines use, both measured on an H200.
TARGET_MS = {"512x8x4K": 0.75, "512x1x4K": 0.55, "1x8x32K": 0.040}
PER_TOKEN_KERNEL_MS = {"512x8x4K": 2.6, "512x1x4K": 0.55, "1x8x32K": 0.079}


@dataclasses.dataclass(frozen=True)
class Inputs:
    q: jax.Array
    caches: list  # [(k_cache, v_cache)] copies, rotated while timing
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    block_indices: jax.Array


def make_inputs(
    key,
    *,
    num_requests: int,
    q_len: int,
    context: int,
    num_q_heads: int = 64,
    num_kv_heads: int = 4,
    head_dim: int = 128,
    page: int = 128,
    topk: int = 16,
    noise: float = 0.2,  # float("inf"): independent selections
    copies: int = 1,
    dtype=jnp.bfloat16,
) -> Inputs:
    """Every request has ``context`` tokens including its ``q_len`` new ones; pages are a random
    permutation."""
    max_blocks = -(-context // page)
    num_pages = num_requests * max_blocks
    num_tokens = num_requests * q_len
    kq, kp, ks, kn, kc = jax.random.split(key, 5)
    tables = jax.random.permutation(kp, num_pages).astype(jnp.int32).reshape(num_requests, max_blocks)
    q = jax.random.normal(kq, (num_tokens, num_q_heads, head_dim), dtype)
    caches = []
    for c in range(copies):
        k1, k2 = jax.random.split(jax.random.fold_in(kc, c))
        caches.append(
            (
                jax.random.normal(k1, (num_kv_heads, num_pages, page, head_dim), dtype),
                jax.random.normal(k2, (num_kv_heads, num_pages, page, head_dim), dtype),
            )
        )
    seq_lens = jnp.full((num_requests,), context, jnp.int32)
    qsl = (jnp.arange(num_requests + 1) * q_len).astype(jnp.int32)
    # Shared per-(request, KV head) block scores + per-token noise; local block forced; top-k, -1 tail.
    pos = context - q_len + jnp.arange(q_len)
    n_visible = pos // page + 1  # [q_len]
    base = jax.random.normal(ks, (num_requests, 1, num_kv_heads, max_blocks))
    token_scores = jax.random.normal(kn, (num_requests, q_len, num_kv_heads, max_blocks))
    # noise = inf: every token ranks the blocks on its own (no agreement beyond the forced local block)
    scores = token_scores if noise == float("inf") else base + noise * token_scores
    b = jnp.arange(max_blocks)
    vis = b[None, :] < n_visible[:, None]  # [q_len, nb]
    scores = jnp.where(vis[None, :, None, :], scores, -jnp.inf)
    scores = jnp.where((b[None, :] == (n_visible - 1)[:, None])[None, :, None, :], jnp.inf, scores)
    k = min(topk, max_blocks)
    vals, idx = jax.lax.top_k(scores, k)
    idx = jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)
    if k < topk:
        idx = jnp.concatenate([idx, jnp.full(idx.shape[:-1] + (topk - k,), -1, jnp.int32)], axis=-1)
    block_indices = idx.reshape(num_tokens, num_kv_heads, topk)
    return Inputs(q, caches, tables, seq_lens, qsl, block_indices)


def _union_blocks(inp: Inputs, block_q: int, dense: bool) -> np.ndarray:
    """Blocks each (request tile of ``block_q`` tokens, KV head) program reads, one entry per program."""
    page = inp.caches[0][0].shape[2]
    if not dense:
        return np.asarray(
            union_block_counts(
                inp.query_start_loc, inp.seq_lens, inp.block_indices, page=page, block_q=block_q
            )
        )
    # Dense: each tile reads blocks 0 .. cdiv(last pos + 1, page) once per KV head.
    seq = np.asarray(inp.seq_lens)
    qsl = np.asarray(inp.query_start_loc)
    tiles = []
    for r, s in enumerate(seq):
        ql = int(qsl[r + 1] - qsl[r])
        for t in range(0, ql, block_q):
            last = int(s) - ql + min(t + block_q, ql) - 1
            tiles += [last // page + 1] * inp.caches[0][0].shape[0]
    return np.asarray(tiles)


def bytes_and_flops(inp: Inputs, *, block_q: int, dense: bool) -> dict:
    """The bytes model (docs/kernels/sparse_attention.md) evaluated on the actual selections.

    ``unique_bytes`` is what must come from HBM: each block's K and V once per (request, KV head) -- the union
    over all of a request's tokens -- plus q, the output and the metadata. ``tile_kv_bytes`` is what the
    programs read: once per (request tile of ``block_q`` tokens, KV head); with several tiles per request the
    repeats of a block are served by the L2 when the tiles run together (adjacent program ids). Executed
    FLOPs follow the tiles (every row of a tile pays for every block of its tile's union)."""
    q = inp.q
    _num_tokens, num_q_heads, head_dim = q.shape
    k_cache = inp.caches[0][0]
    num_kv_heads, _, page, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    item = k_cache.dtype.itemsize
    block_kv_bytes = 2 * page * head_dim * item  # K and V of one block, one KV head
    seq = np.asarray(inp.seq_lens)
    qsl = np.asarray(inp.query_start_loc)
    q_lens = qsl[1:] - qsl[:-1]
    pos = np.concatenate([s - ql + np.arange(ql) for s, ql in zip(seq, q_lens)])
    rows = max(16, 1 << max(0, block_q * group - 1).bit_length())
    tile_blocks = _union_blocks(inp, block_q, dense)
    request_q = min(MAX_SPARSE_BLOCK_Q, 1 << max(0, int(q_lens.max()) - 1).bit_length())
    request_blocks = tile_blocks if request_q == block_q else _union_blocks(inp, request_q, dense)
    union_sizes = tile_blocks[tile_blocks > 0]
    if dense:
        per_token = int(np.sum(pos // page + 1)) * num_kv_heads
        useful = int(np.sum(pos + 1)) * num_q_heads
    else:
        sel = np.asarray(inp.block_indices)[: qsl[-1]]
        valid = sel >= 0
        per_token = int(valid.sum())
        # Keys per (token, group): selected blocks, causal-clipped in the local block.
        kept = np.minimum((pos[:, None, None] - sel * page + 1), page) * valid
        useful = int(np.clip(kept, 0, page).sum()) * group
    unique_kv = int(np.sum(request_blocks)) * block_kv_bytes
    io = 2 * q.size * q.dtype.itemsize + inp.block_indices.size * 4 + inp.block_tables.size * 4
    executed_flops = int(np.sum(tile_blocks)) * rows * page * head_dim * 4
    return {
        "union_mean": float(np.mean(union_sizes)) if len(union_sizes) else 0.0,
        "union_max": int(np.max(union_sizes)) if len(union_sizes) else 0,
        "request_union_mean": float(np.mean(request_blocks[request_blocks > 0]))
        if request_blocks.any()
        else 0.0,
        "unique_bytes": unique_kv + io,
        "unique_kv_bytes": unique_kv,
        "tile_kv_bytes": int(np.sum(tile_blocks)) * block_kv_bytes,
        "per_token_kv_bytes": int(per_token) * block_kv_bytes,
        "sharing_saving": (int(per_token) * block_kv_bytes) / max(unique_kv, 1),
        "executed_flops": executed_flops,
        "useful_flops": int(useful) * head_dim * 4,
    }


def _attn_fn(dense: bool, implementation: str, scale: float, variant: dict):
    if dense:
        fn = ragged_paged_attention if implementation == "pallas" else ragged_paged_attention_reference
    else:
        fn = ragged_sparse_attention if implementation == "pallas" else ragged_sparse_attention_reference
    if implementation == "reference":
        return jax.jit(functools.partial(fn, scale=scale))
    return functools.partial(fn, scale=scale, implementation="pallas", **variant)


def _arg_sets(inp: Inputs, dense: bool):
    sets = []
    for k_cache, v_cache in inp.caches:
        a = (inp.q, k_cache, v_cache, inp.block_tables, inp.seq_lens, inp.query_start_loc)
        sets.append(a if dense else a + (inp.block_indices,))
    return sets


def time_in_loop(fn, arg_sets, *, iters: int = 50) -> float:
    """Seconds per call with ``iters`` calls chained inside one jitted ``fori_loop`` (no Python dispatch per
    call; each call's q depends on the previous output through ``+ 0 * out[0, 0, 0]``, which XLA cannot
    fold)."""

    def many(*args):
        def body(_, out):
            q = args[0] + (0 * out[0, 0, 0]).astype(args[0].dtype)
            return fn(q, *args[1:])

        return jax.lax.fori_loop(0, iters, body, jnp.zeros(args[0].shape, args[0].dtype))

    many = jax.jit(many)
    jax.block_until_ready(many(*arg_sets[0]))
    samples = []
    for i in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(many(*arg_sets[i % len(arg_sets)]))
        samples.append((time.perf_counter() - t0) / iters)
    return sorted(samples)[len(samples) // 2]


def device_times(fn, arg_sets, *, calls: int = 20) -> dict | None:
    """Device-side timing from a profiler trace of ``calls`` back-to-back calls (GPU only, else None):
    ``scripts/op_trace.kernel_times``."""
    return op_trace.kernel_times(fn, arg_sets, calls=calls)


def _time_prepass(inp: Inputs, cfg, dense: bool) -> dict:
    """Seconds per call of the tile (dense) / tile and union (sparse) pre-pass kernel alone (back to back, and
    chained in one loop)."""
    common = {"num_tokens": inp.q.shape[0], "config": cfg, "interpret": resolve_interpret(None)}
    if dense:
        fn = jax.jit(lambda qsl, seq: [tile_prepass(qsl, seq, kind="paged", **common)])
        args = (inp.query_start_loc, inp.seq_lens)
    else:
        fn = jax.jit(functools.partial(_sa._tile_union_prepass, page=inp.caches[0][0].shape[2], **common))
        args = (inp.query_start_loc, inp.seq_lens, inp.block_tables, inp.block_indices)
    jax.block_until_ready(fn(*args))
    profile = device_times(fn, [args])

    def many(qsl, *rest):
        def body(_, carry):
            # A dependency XLA cannot fold away (tile rows are >= -1), so the calls stay in the loop.
            return fn(qsl + (carry[0][0, 0] == -12345).astype(qsl.dtype), *rest)

        return jax.lax.fori_loop(0, 50, body, fn(qsl, *rest))

    many = jax.jit(many)
    jax.block_until_ready(many(*args))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(many(*args))
        samples.append((time.perf_counter() - t0) / 51)
    return {
        "batched": bench_common.time_fn_batched(fn, [args], reps=20),
        "loop": sorted(samples)[len(samples) // 2],
        "profile": profile,
    }


def _add_profile(row: dict, profile: dict | None) -> None:
    """Device time from the profiler: ``device_ms`` (kernels' summed durations per call) and ``span_ms``
    (first kernel start to last kernel end per call); the per-kernel split in ``kernels_us``."""
    if not profile:
        return
    if "device_us" in profile:
        row["device_ms"] = profile["device_us"] / 1e3
        row["span_ms"] = profile["span_us"] / 1e3
        row["kernels_us"] = profile["kernels"]
        if row.get("variant") != "prepass" and row["span_ms"] > 0:
            sec = row["span_ms"] * 1e-3
            row["pct_hbm_span"] = 100.0 * row["unique_bytes"] / sec / row["hbm_bytes_per_s"]
            row["tflops_executed_span"] = row["executed_flops"] / sec / 1e12
    else:
        row["profile_note"] = f"unexpected trace: {profile}"


def _load_module(path: str):
    name = "baseline_" + path.rsplit("/", 1)[-1].removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod


def _errors(out, ref) -> dict:
    d = jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))
    return {
        "max_abs_err": float(jnp.max(d)),
        "mean_abs_err": float(jnp.mean(d)),
        "nan": bool(jnp.any(jnp.isnan(out.astype(jnp.float32)))),
    }


def run(
    sizes: list[str] | None = None,
    variants: dict[str, list[dict]] | None = None,
    *,
    dense_sizes: list[str] | None = (),
    noise: float = 0.2,
    reference: bool = True,
    copies: int | None = None,
    reps: int = 20,
    hbm_bytes_per_s: float | None = None,
    seed: int = 0,
    baseline=None,
    json_path: str | None = None,
    environment: dict | None = None,
    log=print,
) -> list[dict]:
    """Time the kernel (policy default plus ``variants[size]`` launch overrides; ``variants["paged:" + size]``
    for the dense kernel) at each size; see module doc.

    Also a ``prepass`` row per size (the tile/union pre-pass kernel alone, default launch) and, with
    ``baseline`` (a module with the same entry points, e.g. an earlier version of the kernel file), a
    ``baseline`` row timing its default launch on the same inputs. With ``json_path`` the rows so far are
    rewritten there after every row (a run cut short keeps what it measured)."""
    sizes = list(SIZES) if sizes is None else sizes
    variants = variants or {}
    if hbm_bytes_per_s is None:
        hbm_bytes_per_s = bench_common.measure_copy_bandwidth(COPY_BYTES)
    gpu = on_gpu()
    peak_note = bench_common.device_name()
    rows = []
    jobs = [(s, False) for s in sizes] + [(s, True) for s in (dense_sizes or ())]
    for name, dense in jobs:
        shape = {**SIZES, **QUICK_SIZES}[name]
        n_copies = (
            copies if copies is not None else (16 if shape["num_requests"] * shape["context"] <= 65536 else 2)
        )
        inp = make_inputs(jax.random.PRNGKey(seed), **shape, **M3, noise=noise, copies=n_copies)
        scale = M3["head_dim"] ** -0.5
        arg_sets = _arg_sets(inp, dense)
        ref_out, ref_ms = None, None
        if reference:
            try:
                ref_fn = _attn_fn(dense, "reference", scale, {})
                ref_out = jax.block_until_ready(ref_fn(*arg_sets[0]))
                ref_ms = 1e3 * bench_common.time_fn_batched(ref_fn, arg_sets, reps=max(3, reps // 4))
            except Exception as e:  # noqa: BLE001  (an OOM must not lose the other rows)
                log(f"[{name}] reference failed: {type(e).__name__}: {str(e)[:200]}")
        policy_args = {
            "num_tokens": inp.q.shape[0],
            "num_requests": shape["num_requests"],
            "num_q_heads": M3["num_q_heads"],
            "num_kv_heads": M3["num_kv_heads"],
            "max_blocks": inp.block_tables.shape[1],
            "page": M3["page"],
            "head_dim": M3["head_dim"],
            "itemsize": inp.q.dtype.itemsize,
        }
        if dense:
            policy = paged_attention_launch_config(**policy_args)
        else:
            policy = sparse_attention_launch_config(topk=M3["topk"], **policy_args)
        loop_timing = inp.q.shape[0] * shape["context"] <= 8 * 32768  # latency-bound sizes
        jobs_here = [{}] + list(variants.get(("paged:" if dense else "") + name, []))
        jobs_here.append({"_prepass": True})
        if hasattr(baseline, "ragged_paged_attention" if dense else "ragged_sparse_attention"):
            jobs_here.append({"_baseline": True})
        for variant in jobs_here:
            special = next((k for k in variant if k.startswith("_")), None)
            if special == "_baseline":  # the earlier module's own launch policy (its backend / dense API)
                cfg = baseline.attention_launch_config(backend=None, topk=M3["topk"], dense=dense, **policy_args)
            else:
                cfg = dataclasses.replace(
                    policy, **{k: v for k, v in variant.items() if k in dataclasses.asdict(policy)}
                )
            row = dict(
                kernel="paged" if dense else "sparse",
                size=name,
                **shape,
                noise=noise,
                variant=special[1:]
                if special
                else ("default" if not variant else ",".join(f"{k}={v}" for k, v in variant.items())),
                **{f"cfg_{k}": v for k, v in dataclasses.asdict(cfg).items()},
                target_ms=None if dense else TARGET_MS.get(name),
                per_token_kernel_ms=None if dense else PER_TOKEN_KERNEL_MS.get(name),
                ref_ms=ref_ms,
                hbm_bytes_per_s=hbm_bytes_per_s,
                device=peak_note,
            )
            row.update(bytes_and_flops(inp, block_q=cfg.block_q, dense=dense))
            try:
                if special == "_prepass":
                    t = _time_prepass(inp, cfg, dense)
                    row.update(time_ms=1e3 * t["batched"], time_ms_loop=1e3 * t["loop"])
                    _add_profile(row, t["profile"])
                    log(_one_line(row))
                    rows.append(row)
                    continue  # (written with the next row)
                if special == "_baseline":
                    base = baseline.ragged_paged_attention if dense else baseline.ragged_sparse_attention
                    fn = functools.partial(base, scale=scale, implementation="pallas")
                else:
                    fn = _attn_fn(dense, "pallas", scale, variant)
                t0 = time.perf_counter()
                out = jax.block_until_ready(fn(*arg_sets[0]))
                row["compile_s"] = time.perf_counter() - t0
                if ref_out is not None:
                    row.update(_errors(out, ref_out))
                sec = bench_common.time_fn_batched(fn, arg_sets, reps=reps)
                row["time_ms"] = 1e3 * sec
                row["achieved_bytes_per_s"] = row["unique_bytes"] / sec
                row["pct_hbm"] = 100.0 * row["achieved_bytes_per_s"] / hbm_bytes_per_s
                row["tflops_executed"] = row["executed_flops"] / sec / 1e12
                row["tflops_useful"] = row["useful_flops"] / sec / 1e12
                if ref_ms:
                    row["speedup_vs_ref"] = ref_ms / row["time_ms"]
                if row["per_token_kernel_ms"]:
                    row["speedup_vs_per_token_kernel"] = row["per_token_kernel_ms"] / row["time_ms"]
                if loop_timing:
                    row["time_ms_loop"] = 1e3 * time_in_loop(fn, arg_sets)
                if loop_timing or special or not variant:
                    _add_profile(row, device_times(fn, arg_sets))
                best = min(row["time_ms"], row.get("time_ms_loop") or row["time_ms"])
                if row["target_ms"]:
                    row["meets_target"] = best <= row["target_ms"]
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(_one_line(row))
            rows.append(row)
            if json_path:
                payload = {"environment": environment or {}, "hbm_copy_bytes_per_s": hbm_bytes_per_s}
                bench_common.write_json(json_path, {**payload, "rows": rows})
        del inp, arg_sets, ref_out
        if gpu:
            jax.clear_caches()
    return rows


COLUMNS = [
    "kernel",
    "size",
    "noise",
    "variant",
    "cfg_block_q",
    "cfg_num_splits",
    "cfg_num_warps",
    "cfg_num_stages",
    "cfg_block_k",
    "time_ms",
    "time_ms_loop",
    "span_ms",
    "target_ms",
    "union_mean",
    "unique_bytes",
    "pct_hbm",
    "pct_hbm_span",
    "tflops_executed",
    "tflops_useful",
    "sharing_saving",
    "ref_ms",
    "speedup_vs_ref",
    "max_abs_err",
    "mean_abs_err",
    "error",
]


def _one_line(row: dict) -> str:
    keys = [
        "kernel",
        "size",
        "variant",
        "time_ms",
        "pct_hbm",
        "tflops_executed",
        "union_mean",
        "max_abs_err",
        "error",
    ]
    return " ".join(f"{k}={bench_common._fmt(row.get(k))}" for k in keys if row.get(k) is not None)


# Launch variants (each a dict of ``ragged_sparse_attention`` overrides) timed by ``--sweep``, around the CUDA
# policy (sparse verify: 64-row tiles, 4 warps, 32-key steps, 3 stages; see tuning.TABLES["hopper"]).
# 128-row tiles (8 tokens x 16 heads: each request's union read once per KV head). Registers / shared memory per
# program from the pip-triton sm_90 compile (scripts.compile_check), which XLA's own Triton may differ from:
_Q8 = {"block_q": 8, "num_warps": 8, "block_k": 64, "num_stages": 5}  # 188 registers, 129 KiB: one per SM
_Q8_SWEEP = [
    {"block_q": 8, "num_warps": 8, "block_k": 32, "num_stages": 3},  # 126 registers, 64 KiB: two per SM
    {"block_q": 8, "num_warps": 8, "block_k": 64, "num_stages": 3},
    {"block_q": 8, "num_warps": 4, "block_k": 32, "num_stages": 3},  # one warpgroup: 255 registers, spills 12
    {"block_q": 8, "num_warps": 4, "block_k": 32, "num_stages": 4},
    {"block_q": 8, "num_warps": 4, "block_k": 64, "num_stages": 3},  # spills 144
    _Q8,
]
DEFAULT_SWEEP = {
    "512x8x4K": [
        {"num_stages": 3},  # ~166 registers, 49 KiB: three programs per SM, one K/V step in flight
        {"num_stages": 7},  # four K/V buffers
        {"block_k": 64, "num_stages": 3},
        *_Q8_SWEEP,
    ],
    "512x1x4K": [{"num_stages": 5}],
    "1x8x32K": [{"num_splits": 8}, {"num_splits": 32}, {**_Q8, "num_splits": 16}],
    "paged:1x8x32K": [{"num_splits": 32}],
}


def _baseline(sparse_path: str | None, dense_path: str | None):
    """A namespace with an earlier version's ``ragged_sparse_attention`` / ``ragged_paged_attention``: files of
    the layout before ``tuning.py`` (commit 58866cb and earlier), whose ``sparse_attention.py`` held both kernels
    and ``attention_launch_config(backend=..., dense=...)``."""
    if not sparse_path:
        return None
    import types

    sparse = _load_module(sparse_path)
    ns = types.SimpleNamespace(
        ragged_sparse_attention=sparse.ragged_sparse_attention,
        attention_launch_config=sparse.attention_launch_config,
    )
    if dense_path:
        # The earlier paged_attention.py imports its kernel from pallas_kernels.sparse_attention: point that
        # name at the earlier module while it loads.
        saved = sys.modules.get("pallas_kernels.sparse_attention")
        sys.modules["pallas_kernels.sparse_attention"] = sparse
        try:
            ns.ragged_paged_attention = _load_module(dense_path).ragged_paged_attention
        finally:
            sys.modules["pallas_kernels.sparse_attention"] = saved
    return ns


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated subset of " + ",".join(SIZES))
    p.add_argument("--dense-sizes", default="", help="sizes to run ragged_paged_attention at")
    p.add_argument("--sweep", action="store_true", help="also time the launch variants of DEFAULT_SWEEP")
    p.add_argument(
        "--noise",
        default="0.2",
        help="comma list of per-token noise levels (request agreement: 0 = every token of a request picks the "
        "same blocks); 'independent' = each token ranks the blocks on its own; each level is a full run",
    )
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None, help="write rows and environment here")
    p.add_argument("--baseline", default=None, help="path of an earlier sparse_attention.py to time beside")
    p.add_argument(
        "--baseline-dense", default=None, help="path of an earlier paged_attention.py (dense rows)"
    )
    a = p.parse_args(argv)
    env = bench_common.environment()
    bandwidths = bench_common.measure_bandwidths(COPY_BYTES)
    hbm = bench_common.hbm_ceiling(bandwidths)
    env.update(bandwidths_Bps=bandwidths)
    print(f"# {env}  HBM copy ceiling {hbm / 1e12:.3f} TB/s", flush=True)
    try:
        noises = [float("inf") if n.strip() == "independent" else float(n) for n in a.noise.split(",") if n.strip()]
    except ValueError:
        p.error(f"--noise: expected numbers or 'independent', got {a.noise!r}")
    rows = []
    for noise in noises:
        rows += run(
            [s for s in a.sizes.split(",") if s],
            DEFAULT_SWEEP if a.sweep else None,
            dense_sizes=[s for s in a.dense_sizes.split(",") if s],
            noise=noise,
            reference=not a.no_reference,
            reps=a.reps,
            hbm_bytes_per_s=hbm,
            baseline=_baseline(a.baseline, a.baseline_dense),
            # rows so far, per noise level (a run cut short keeps them); all levels go to --json at the end
            json_path=None if a.json is None else str(Path(a.json).with_suffix(f".noise{noise}.json")),
            environment=env,
        )
    if a.json:
        bench_common.write_json(a.json, {"environment": env, "hbm_copy_bytes_per_s": hbm, "rows": rows})
    bench_common.print_table(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
