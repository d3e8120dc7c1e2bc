"""Per-op profile of one verify step and one DSpark draft step at MiniMax-M3 width (issue 15).

    PYTHONPATH=. python3 scripts/profile_step.py --out $OUT/profile.json               # M3 width (GPU)
    PYTHONPATH=. python3 scripts/profile_step.py --shapes 512x8 --skip-draft --out ... # one verify shape
    PYTHONPATH=. python3 scripts/profile_step.py --tiny --out /tmp/p.json              # CPU smoke run

**Verify step.** A slice of MiniMax-M3 (hidden 6144, 64 query / 4 KV heads of 128, 128 experts top-4 of 3072,
the full 200,064-token vocabulary) with ``--layers`` layers (``dense`` = full attention + dense MLP, ``msa`` =
MSA sparse attention + MoE; ``full+moe`` / ``msa+dense`` spell out other mixes), random bf16 weights made on
the device, a paged cache with every request at ``--context`` tokens (this step's tokens included) on shuffled
pages filled with random keys and values. Shapes ``RxQ``: ``R`` requests of ``Q`` new tokens each. The step is
:func:`minimax_jax.decode.forward_ragged` plus the logits of every verified row (``R x Q`` rows, full
vocabulary), exactly what ``decode.make_step_fn`` jits. It is cut into the ops of ``forward_ragged`` (metadata
+ RoPE, embedding, per layer: input norm, q/k/v projections with q/k norms and RoPE, the indexer projection,
the cache writes, the indexer top-k kernel, sparse or dense paged attention, ``o_proj`` + residual, the
post-attention norm, the dense MLP or router / routed experts / shared expert / combine, then the final norm
and the LM head over the verified rows). Each op is its own jitted function, fed the intermediate values of
one run of the whole chain (so the routing, the selections and the union of selected blocks are those of the
real step); the chain's logits are compared with the whole step's (``chain_vs_step_rel_err``).

**Draft step.** A DSpark drafter of ``--draft-layers`` M3-width draft layers (the target's attention shape,
dense MLP of 12288) on a paged draft cache (the target's page size) of ``--context`` tokens per row on SHUFFLED
pages (a random permutation of the pool: no row owns a contiguous run), block size ``--draft-k``, the
target's full-vocabulary LM head over ``R x K`` rows: block inputs, per layer norm / q,k,v / draft attention
(``--draft-attention`` implementations, each its own row: the Pallas kernel and the jnp path) / ``o_proj`` /
norm / MLP, final norm, LM head, sampling (greedy, or temperature 1 with probabilities: ``--draft-sampling``).
Beside the step (not in its sum): the context write after verification (feature projection ``fc`` +
``hidden_norm``, every layer's context K/V, the scatter into the cache's pages; ``R x (1 + K)`` feature rows)
and the engine's table install (``spec_decode/step.py`` writes the step's block tables into the draft cache's
rows of its slots, ``DraftCache.with_block_tables``). Whole steps: ``draft_step`` per implementation and the
engine's form (the table install, then ``block_hidden(..., cache_rows=slot)``: the kernel reads the slots'
pages in place).

**Timing.** Per op: ``--warmup`` calls, then the median of ``--iters`` calls each synchronised with
``block_until_ready``. Ops that update a cache donate it (on GPU) and get their output back as the next call's
input, as the engine does; the whole step is timed the same way. ``dispatch_ms`` (an empty jitted op) is the
per-call host floor that small ops cannot go under; ``--device-times`` also reads each non-donating op's
kernel time from a profiler trace (GPU).

**Roofline.** Per op: bytes that must move (weights, op inputs and outputs, cache reads: e.g. sparse attention
reads each block in the union of a request's selections once per KV head; intermediates inside an op are not
counted) and FLOPs (2 per multiply-add), ``roofline = max(bytes / HBM, FLOPs / peak)`` with the chip constants
of :data:`CHIP_PEAKS` (``--chip``), ``ratio = measured / roofline``; ops over :data:`FLAG_RATIO` are flagged.

``--implementation`` picks the attention / indexer kernels (``auto``: compiled Pallas on GPU, as the engine);
``--moe-implementation a,b`` is handed to the MoE (``implementation=`` of ``MoE.routed`` and
``moe_implementation=`` of ``forward_ragged``, where those parameters exist) and profiles each value; the JSON
records whether it was applied. ``--draft-attention`` lists the drafter's attention implementations.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import inspect
import json
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.cache import PagedCache, page_size_for, slot_mapping, write_tokens
from minimax_jax.config import DENSE_MLP, FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION, MiniMaxM3Config
from minimax_jax.decode import RaggedBatch, choose_implementation, forward_ragged
from minimax_jax.draft_attention import draft_attention
from minimax_jax.draft_cache import DraftCache
from minimax_jax.draft_step import append_context_packed_step, draft_step
from minimax_jax.drafter import DSparkDrafter
from minimax_jax.drafter_config import DSparkConfig
from minimax_jax.layers import MoE, rope_cos_sin
from minimax_jax.model import MiniMaxM3ForCausalLM
from pallas_kernels import draft_attention as draft_attention_kernel
from pallas_kernels.indexer import ragged_index_topk
from pallas_kernels.metadata import token_positions, token_to_request
from pallas_kernels.paged_attention import ragged_paged_attention
from pallas_kernels.platform import on_gpu
from pallas_kernels.sparse_attention import ragged_sparse_attention


# ----------------------------------------------------------------------------------------------- chips
@dataclasses.dataclass(frozen=True)
class ChipPeak:
    """Roofline constants of one chip: the HBM rate used for the roofline (achievable), the nominal one, and
    the dense bf16 tensor-core peak."""

    name: str
    hbm_bytes_per_s: float
    hbm_nominal_bytes_per_s: float
    bf16_flops_per_s: float
    note: str = ""


CHIP_PEAKS = {
    "h200": ChipPeak(
        "NVIDIA H200 SXM",
        4.3e12,
        4.8e12,
        989e12,
        "achievable HBM: the 4.0-4.2 TB/s copy rates measured in docs/BENCHMARKS.md",
    ),
    "h100": ChipPeak("NVIDIA H100 SXM", 3.0e12, 3.35e12, 989e12, "achievable HBM assumed 0.9 x nominal"),
    "mi300x": ChipPeak("AMD MI300X", 4.3e12, 5.3e12, 1307e12, "achievable HBM assumed ~0.8 x nominal"),
}
FLAG_RATIO = 3.0  # ops slower than this many rooflines are flagged

# Verify shapes of issue 15 (requests x new tokens per request) and the draft rows.
M3_SHAPES = "64x8,256x8,512x1,512x8"
TINY_SHAPES = "4x8,8x1"


def roofline(flops: float, nbytes: float, chip: ChipPeak) -> tuple[float, str]:
    """``(seconds, bound)``: ``max(bytes / HBM, flops / peak)`` and the term that wins (``"hbm"`` or
    ``"compute"``)."""
    t_mem, t_flop = nbytes / chip.hbm_bytes_per_s, flops / chip.bf16_flops_per_s
    return (t_mem, "hbm") if t_mem >= t_flop else (t_flop, "compute")


# ----------------------------------------------------------------------------------------------- configs
_ATTN = {"dense": FULL_ATTENTION, "full": FULL_ATTENTION, "msa": SPARSE_ATTENTION, "sparse": SPARSE_ATTENTION}
_MLP = {"dense": DENSE_MLP, "moe": MOE_MLP}
_SHORT = {"dense": (FULL_ATTENTION, DENSE_MLP), "msa": (SPARSE_ATTENTION, MOE_MLP)}


def parse_layers(spec: str) -> list[tuple[str, str]]:
    """``"dense,msa"`` -> ``[(full_attention, dense), (minimax_m3_sparse, sparse)]``; ``attn+mlp`` items
    (``full+moe``, ``msa+dense``) name both halves."""
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in _SHORT:
            out.append(_SHORT[item])
            continue
        attn, _, mlp = item.partition("+")
        if attn not in _ATTN or mlp not in _MLP:
            raise ValueError(
                f"layer {item!r}: use dense, msa or ATTN+MLP with ATTN in {sorted(_ATTN)} and MLP "
                f"in {sorted(_MLP)}"
            )
        out.append((_ATTN[attn], _MLP[mlp]))
    if not out:
        raise ValueError("--layers names no layer")
    return out


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        r, _, q = item.lower().partition("x")
        out.append((int(r), int(q)))
    return out


def target_config(layers: list[tuple[str, str]], *, tiny: bool) -> MiniMaxM3Config:
    """The M3 shape (or a tiny one for CPU tests) with the given layers."""
    kinds = {
        "num_hidden_layers": len(layers),
        "layer_types": tuple(a for a, _ in layers),
        "mlp_layer_types": tuple(m for _, m in layers),
    }
    if tiny:
        return MiniMaxM3Config.tiny(
            vocab_size=512, hidden_size=64, index_block_size=16, index_topk_blocks=4, index_n_heads=2, **kinds
        )
    return MiniMaxM3Config.m3().replace(**kinds)


# ----------------------------------------------------------------------------------------------- ops
class Ref:
    """An op argument that lives in the mutable ``state`` dict (caches): resolved at call time, and replaced
    by the op's output when the op donates it."""

    def __init__(self, key: str):
        self.key = key

    def get(self, state):
        return state[self.key]

    def set(self, state, value):
        state[self.key] = value


class PagedRef(Ref):
    """The target's :class:`PagedCache` from per-layer state entries ``k{i}``, ``v{i}``, ``x{j}``."""

    def __init__(self, num_layers: int, num_sparse: int):
        self.k = [f"k{i}" for i in range(num_layers)]
        self.v = [f"v{i}" for i in range(num_layers)]
        self.x = [f"x{j}" for j in range(num_sparse)]

    def get(self, state):
        return PagedCache([state[k] for k in self.k], [state[v] for v in self.v], [state[x] for x in self.x])

    def set(self, state, cache):
        for names, arrays in ((self.k, cache.k), (self.v, cache.v), (self.x, cache.index_k)):
            for n, a in zip(names, arrays):
                state[n] = a


class DraftRef(Ref):
    """A :class:`DraftCache` from state entries ``dk``, ``dv`` and fixed ``lengths`` and ``block_tables`` (an
    op's new lengths are dropped: every op sees the same context)."""

    def __init__(self, lengths, block_tables):
        self.lengths, self.block_tables = lengths, block_tables

    def get(self, state):
        return DraftCache(state["dk"], state["dv"], self.lengths, self.block_tables)

    def set(self, state, cache):
        state["dk"], state["dv"] = cache.k, cache.v


@dataclasses.dataclass
class Op:
    name: str
    fn: Callable
    args: tuple
    flops: float
    bytes: float
    layer: str = ""
    group: str = ""
    feedback: dict = dataclasses.field(default_factory=dict)  # {arg index: output index or None (the output)}
    in_sum: bool = True  # part of the step the whole-step time is compared with
    note: str = ""
    detail: dict = dataclasses.field(default_factory=dict)


def _donate() -> bool:
    return jax.default_backend() != "cpu"  # XLA:CPU ignores donation (with a warning)


# XLA options of every program the profile compiles: --tiny on CPU trades code quality for compile time.
COMPILER_OPTIONS: dict = {}
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def layer_op(add: Callable, tag: str) -> Callable:
    """``op(name, fn, args, flops, bytes, group, **kw)``: ``add`` an :class:`Op` of layer ``tag`` named
    ``"{tag}.{name}"`` (the per-layer ops of the verify and the draft step)."""

    def op(name, fn, args, flops, nbytes, group, **kw):
        return add(Op(f"{tag}.{name}", fn, args, flops=float(flops), bytes=float(nbytes), layer=tag, group=group,
                      **kw))

    return op


def _jit(fn, **kw):
    return jax.jit(fn, compiler_options=COMPILER_OPTIONS or None, **kw)


def call_op(op: Op, state: dict):
    """Run ``op`` once on its (resolved) arguments; donated arguments are replaced by the op's outputs."""
    args = [a.get(state) if isinstance(a, Ref) else a for a in op.args]
    out = op.fn(*args)
    for ai, oi in op.feedback.items():
        op.args[ai].set(state, out if oi is None else out[oi])
    return out


def time_call(call: Callable, *, warmup: int, iters: int) -> dict:
    """Median / min seconds of ``call()`` over ``iters`` calls after ``warmup``, each synchronised."""
    for _ in range(warmup):
        jax.block_until_ready(call())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        ts.append(time.perf_counter() - t0)
    return {"median": statistics.median(ts), "min": min(ts)}


def dispatch_floor(*, iters: int = 50) -> float:
    """Seconds of an empty jitted op with ``block_until_ready``: the host floor of any op's time."""
    x = jnp.zeros((8,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    return time_call(lambda: f(x), warmup=5, iters=iters)["median"]


def module_fn(module, method: Callable, **jit_kw):
    """``(jitted f(state, *args), state)`` with ``f = method(nnx.merge(graphdef, state), *args)``: a module's
    weights are passed as an argument (never baked into the program)."""
    graphdef, state = nnx.split(module)

    def f(st, *args):
        return method(nnx.merge(graphdef, st), *args)

    return _jit(f, **jit_kw), state


def _nbytes(*arrays) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(arrays)))


def _rms_cost(rows: int, dim: int, itemsize: int) -> tuple[float, float]:
    """RMSNorm: read and write ``rows x dim``, the weight; ~4 FLOPs per element."""
    return 4.0 * rows * dim, float(2 * rows * dim * itemsize + dim * itemsize)


def _arg_names(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


class _FixedRouting:
    """Stands in for a MoE module inside a traced op: ``gate(x)`` returns precomputed ``(weights, experts)``,
    every other attribute is the module's. ``gate_called`` says whether the MoE's code asked its router."""

    def __init__(self, moe, weights, experts):
        self.__dict__.update(_moe=moe, _routing=(weights, experts), gate_called=False)

    def __getattr__(self, name):
        return getattr(self.__dict__["_moe"], name)

    def gate(self, x):
        del x
        self.__dict__["gate_called"] = True
        return self.__dict__["_routing"]


# ----------------------------------------------------------------------------------------------- verify step
@dataclasses.dataclass
class VerifyInputs:
    batch: RaggedBatch
    logit_rows: jax.Array
    num_requests: int
    q_len: int
    context: int


SMALL_RANDOM = 1 << 22  # elements: below this, random values come from numpy (no XLA:CPU threefry compile)
RANDOM_CHUNK = 1 << 26  # elements per device draw of a large array


def normal_arrays(specs: list[tuple[tuple[int, ...], object]], seed: int, stddev: float = 1.0) -> list:
    """One ``normal(0, stddev)`` array per ``(shape, dtype)``. At M3 sizes they are drawn on the device by ONE
    compiled program (JAX's threefry; some arrays exceed 2^32 elements, which its partitionable counters
    handle); small totals (tiny CPU runs) come from numpy, because XLA:CPU takes about a second to compile
    each threefry draw."""
    sizes = [math.prod(shape) for shape, _ in specs]
    if sum(sizes) <= SMALL_RANDOM:
        rng = np.random.default_rng(seed)
        return [
            jnp.asarray((rng.standard_normal(n, np.float32) * stddev).reshape(shape), dtype)
            for n, (shape, dtype) in zip(sizes, specs)
        ]

    def draw(key, shape, dtype):
        n = math.prod(shape)
        if n <= RANDOM_CHUNK:
            return jax.random.normal(key, shape, dtype)
        # Large arrays (experts 4.8e9 elements, the draft cache 5.4e9) in 2^26-element chunks: bounded
        # temporaries and counters whatever the PRNG implementation does with one huge draw.
        chunks = jax.lax.map(
            lambda k: jax.random.normal(k, (RANDOM_CHUNK,), dtype),
            jax.random.split(key, -(-n // RANDOM_CHUNK)),
        )
        return chunks.reshape(-1)[:n].reshape(shape)

    def make():
        keys = jax.random.split(jax.random.key(seed), len(specs))
        return [draw(k, shape, dtype) * jnp.asarray(stddev, dtype) for k, (shape, dtype) in zip(keys, specs)]

    return jax.jit(make)()


def make_random(cls, *args, seed: int, stddev: float = 0.02, **kwargs):
    """``cls(*args, **kwargs, rngs=...)`` with every parameter drawn from ``normal(0, stddev)`` by
    :func:`normal_arrays` (made on the device, never a per-parameter compile). Norm weights and biases are
    random too, which changes nothing a profile measures."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(*args, **kwargs, rngs=nnx.Rngs(seed))))
    leaves, treedef = jax.tree.flatten(abstract)
    arrays = normal_arrays([(x.shape, x.dtype) for x in leaves], seed, stddev)
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))


def make_target(cfg: MiniMaxM3Config, *, dtype, seed: int) -> MiniMaxM3ForCausalLM:
    """Random weights, created on the default device."""
    return make_random(MiniMaxM3ForCausalLM, cfg, dtype=dtype, seed=seed)


def make_paged_state(cfg: MiniMaxM3Config, num_pages: int, *, dtype, seed: int) -> dict:
    """Per-layer caches filled with random values (made on the device): ``k{i}``, ``v{i}``, ``x{j}``."""
    page = cfg.index_block_size
    shape = (cfg.num_key_value_heads, num_pages, page, cfg.head_dim)
    shapes = {f"{kv}{i}": shape for i in range(cfg.num_hidden_layers) for kv in "kv"}
    shapes.update(
        {f"x{j}": (num_pages, page, cfg.index_head_dim) for j, _ in enumerate(cfg.sparse_layer_ids)}
    )
    return random_arrays(shapes, dtype, seed)


def random_arrays(shapes: dict, dtype, seed: int) -> dict:
    """``{name: normal(shape)}`` (:func:`normal_arrays`)."""
    return dict(zip(shapes, normal_arrays([(s, dtype) for s in shapes.values()], seed)))


def make_verify_inputs(
    cfg, *, num_requests: int, q_len: int, context: int, num_pages: int, seed: int
) -> VerifyInputs:
    """Every request at ``context`` tokens (this step's ``q_len`` included), pages a random permutation of the
    pool, random token ids; every packed token needs logits (verification)."""
    page = cfg.index_block_size
    nb = -(-context // page)
    if num_requests * nb > num_pages:
        raise ValueError(
            f"{num_requests} x {context} tokens need {num_requests * nb} pages, the pool has {num_pages}"
        )
    rng = np.random.default_rng(seed + 1)  # small integer arrays: host-made
    tables = rng.permutation(num_pages)[: num_requests * nb].reshape(num_requests, nb)
    t = num_requests * q_len
    batch = RaggedBatch(
        input_ids=jnp.asarray(rng.integers(0, cfg.vocab_size, t), jnp.int32),
        query_start_loc=(jnp.arange(num_requests + 1, dtype=jnp.int32) * q_len),
        seq_lens=jnp.full((num_requests,), context, jnp.int32),
        block_tables=jnp.asarray(tables, jnp.int32),
    )
    return VerifyInputs(batch, jnp.arange(t, dtype=jnp.int32), num_requests, q_len, context)


def _union_bytes(sel: np.ndarray, qsl: np.ndarray, block_bytes: int) -> tuple[int, float]:
    """Bytes of K/V a per-request kernel must read: each block in the union of a request's selections, once
    per KV head (``sel int32[T, G, topk]``, -1 padded); and the mean union size."""
    unions = []
    for r in range(len(qsl) - 1):
        s = sel[qsl[r] : qsl[r + 1]]
        for g in range(sel.shape[1]):
            u = np.unique(s[:, g])
            unions.append(int(np.sum(u >= 0)))
    return int(sum(unions)) * block_bytes, float(np.mean(unions)) if unions else 0.0


def _sparse_useful_flops(
    sel: np.ndarray, pos: np.ndarray, *, page: int, heads_per_group: int, head_dim: int
) -> float:
    """QK^T and PV FLOPs over the keys each (token, head) attends: its selected blocks, causally clipped."""
    valid = sel >= 0
    keys = np.clip(pos[:, None, None] - sel * page + 1, 0, page) * valid
    return 4.0 * float(keys.sum()) * heads_per_group * head_dim


def build_verify_ops(
    model: MiniMaxM3ForCausalLM,
    state: dict,
    inp: VerifyInputs,
    *,
    implementation: str,
    moe_implementation: str | None,
) -> tuple[list[Op], jax.Array, dict]:
    """The ops of one verify step, each run once in order (so every op's inputs are the real intermediates).

    Returns ``(ops, chain logits, info)``.
    """
    cfg = model.cfg
    batch = inp.batch
    t = batch.num_tokens
    r_rows = inp.num_requests
    page = cfg.index_block_size
    num_pages = state["k0"].shape[1]
    dtype = state["k0"].dtype
    b = jnp.dtype(dtype).itemsize
    d, h, g, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    kernel_impl = choose_implementation(implementation, cfg, page_size=page, dtype=dtype)
    kernel_kw = {"implementation": kernel_impl, "interpret": None}
    meta = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    qsl_np = np.asarray(batch.query_start_loc)
    seq_np = np.asarray(batch.seq_lens)
    pos_np = np.concatenate(
        [s - (qsl_np[i + 1] - qsl_np[i]) + np.arange(qsl_np[i + 1] - qsl_np[i]) for i, s in enumerate(seq_np)]
    ).astype(np.int64)
    ops: list[Op] = []
    info = {"kernel_implementation": kernel_impl, "moe_implementation": moe_implementation}

    def add(op: Op):  # run (and compile) each op once, to completion: nothing queued behind the timings
        ops.append(op)
        return jax.block_until_ready(call_op(op, state))

    # ---- metadata + RoPE (token -> request, positions, cache slots, cos/sin)
    def meta_fn(qsl, seq_lens, tables):
        req = token_to_request(qsl, t)
        pos = token_positions(qsl, seq_lens, req)
        slots = slot_mapping(tables, req, pos, page_size=page, num_pages=num_pages)
        cos, sin = rope_cos_sin(jnp.maximum(pos, 0), cfg.rotary_dim, cfg.rope_theta)
        return req, slots, cos, sin

    req, slots, cos, sin = add(
        Op(
            "metadata+rope",
            _jit(meta_fn),
            (batch.query_start_loc, batch.seq_lens, batch.block_tables),
            flops=0.0,
            bytes=float(
                _nbytes(batch.query_start_loc, batch.seq_lens, batch.block_tables)
                + t * 4 * 3
                + t * cfg.rotary_dim * 4
            ),
            group="meta",
        )
    )

    # ---- embedding
    def embed_fn(table, ids, req):
        return jnp.where((req >= 0)[:, None], jnp.take(table, jnp.where(req >= 0, ids, 0), axis=0), 0)

    x = add(
        Op(
            "embed",
            _jit(embed_fn),
            (model.embed_tokens[...], batch.input_ids, req),
            flops=0.0,
            bytes=float(2 * t * d * b + 2 * t * 4),
            group="embed",
        )
    )

    sparse_slot = {layer: j for j, layer in enumerate(cfg.sparse_layer_ids)}
    scale = hd**-0.5
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        tag = (
            f"L{i}."
            + ("msa" if attn.is_sparse else "dense")
            + "."
            + ("moe" if isinstance(layer.mlp, MoE) else "mlp")
        )

        op = layer_op(add, tag)

        fn, st = module_fn(layer.input_layernorm, lambda m, a: m(a))
        xn = op("input_norm", fn, (st, x), *_rms_cost(t, d, b), "norm")

        fn, st = module_fn(attn, lambda m, a, c, s: m.project_qkv(a, c, s))
        w_qkv = d * (h + 2 * g) * hd
        q, k, v = op(
            "qkv_proj",
            fn,
            (st, xn, cos, sin),
            2 * t * w_qkv,
            (w_qkv + t * d + t * (h + 2 * g) * hd) * b,
            "proj",
            note="q/k/v projections, q/k norms, RoPE",
        )
        if attn.is_sparse:
            hi, di = cfg.index_n_heads, cfg.index_head_dim
            fn, st = module_fn(attn.indexer, lambda m, a, c, s: m.project(a, c, s))
            w_idx = d * (hi + 1) * di
            iq, ik = op(
                "indexer_proj",
                fn,
                (st, xn, cos, sin),
                2 * t * w_idx,
                (w_idx + t * d + t * (hi + 1) * di) * b,
                "proj",
            )
            j = sparse_slot[i]

            def write3(kc, vc, xc, k_, v_, ik_, sl):
                return write_tokens(kc, k_, sl), write_tokens(vc, v_, sl), write_tokens(xc, ik_, sl)

            donate = (0, 1, 2) if _donate() else ()
            op(
                "cache_write",
                _jit(write3, donate_argnums=donate),
                (Ref(f"k{i}"), Ref(f"v{i}"), Ref(f"x{j}"), k, v, ik, slots),
                0,
                2 * t * (2 * g * hd + di) * b + t * 4,
                "cache",
                feedback={0: 0, 1: 1, 2: 2},
                note="K, V and index-K of the step's tokens into the paged caches (donated)",
            )
            topk = cfg.index_topk_blocks
            fn = _jit(
                functools.partial(
                    ragged_index_topk, topk=topk, local_blocks=cfg.index_local_blocks, **kernel_kw
                )
            )
            ctx_pages = int(np.sum(-(-seq_np // page)))
            sel = op(
                "index_topk",
                fn,
                (iq, Ref(f"x{j}"), *meta),
                2.0 * float(np.sum(pos_np + 1)) * hi * di,
                ctx_pages * page * di * b + t * hi * di * b + t * hi * topk * 4 + _nbytes(*meta),
                "indexer",
                note="reads each request's visible index keys once (whole pages)",
            )
            sel_np = np.asarray(sel)
            union_bytes, union_mean = _union_bytes(sel_np, qsl_np, 2 * page * hd * b)
            io = 2 * t * h * hd * b + sel_np.size * 4 + _nbytes(*meta)
            flops = _sparse_useful_flops(sel_np, pos_np, page=page, heads_per_group=h // g, head_dim=hd)
            fn = _jit(functools.partial(ragged_sparse_attention, scale=scale, **kernel_kw))
            o = op(
                "sparse_attention",
                fn,
                (q, Ref(f"k{i}"), Ref(f"v{i}"), *meta, sel),
                flops,
                union_bytes + io,
                "attention",
                note=f"K/V of the union of each request's selections once per KV head "
                f"(mean union {union_mean:.1f} blocks; topk {topk})",
                detail={
                    "union_mean_blocks": union_mean,
                    "topk_floor_bytes": r_rows * g * topk * 2 * page * hd * b + io,
                },
            )
        else:

            def write2(kc, vc, k_, v_, sl):
                return write_tokens(kc, k_, sl), write_tokens(vc, v_, sl)

            donate = (0, 1) if _donate() else ()
            op(
                "cache_write",
                _jit(write2, donate_argnums=donate),
                (Ref(f"k{i}"), Ref(f"v{i}"), k, v, slots),
                0,
                2 * t * 2 * g * hd * b + t * 4,
                "cache",
                feedback={0: 0, 1: 1},
                note="K and V of the step's tokens into the paged caches (donated)",
            )
            ctx_pages = int(np.sum(-(-seq_np // page)))
            fn = _jit(functools.partial(ragged_paged_attention, scale=scale, **kernel_kw))
            o = op(
                "paged_attention",
                fn,
                (q, Ref(f"k{i}"), Ref(f"v{i}"), *meta),
                4.0 * float(np.sum(pos_np + 1)) * h * hd,
                ctx_pages * page * g * hd * b * 2 + 2 * t * h * hd * b + _nbytes(*meta),
                "attention",
                note="every visible page's K/V once per KV head",
            )

        fn, st = module_fn(attn, lambda m, x_, o_: x_ + m.o_proj(o_.reshape(o_.shape[0], -1)))
        hres = op(
            "o_proj",
            fn,
            (st, x, o),
            2 * t * h * hd * d,
            (h * hd * d + t * h * hd + 2 * t * d) * b,
            "proj",
            note="o_proj + residual",
        )
        fn, st = module_fn(layer.post_attention_layernorm, lambda m, a: m(a))
        hn = op("post_norm", fn, (st, hres), *_rms_cost(t, d, b), "norm")

        mlp = layer.mlp
        if isinstance(mlp, MoE):
            e, kk, im, ish = (
                cfg.num_local_experts,
                cfg.num_experts_per_tok,
                cfg.intermediate_size,
                cfg.shared_intermediate_size,
            )
            fn, st = module_fn(mlp.gate, lambda m, a: m(a))
            weights, experts = op(
                "router", fn, (st, hn), 2 * t * d * e, (d * e + t * d) * b + t * kk * 8, "moe"
            )
            hit = int(np.unique(np.asarray(experts)).size)
            # the MoE as forward_ragged runs it: its implementation, or the attention kernels' choice
            moe_kw = {"implementation": moe_implementation or implementation}
            info["moe_routed_takes_implementation"] = True
            probe = {}

            def routed(m, a, w_, e_, moe_kw=moe_kw, probe=probe):
                proxy = _FixedRouting(m, w_, e_)
                out = MoE.routed(proxy, a, **moe_kw)
                probe["router_bypassed"] = proxy.gate_called
                return out

            fn, st = module_fn(mlp, routed)
            y_routed = op(
                "routed_experts",
                fn,
                (st, hn, weights, experts),
                6.0 * t * kk * d * im,
                (hit * 3 * d * im + t * d) * b + t * d * 4 + t * kk * 8,
                "moe",
                note=f"{hit} of {e} experts hit; weights of each hit expert read once",
                detail={"experts_hit": hit},
            )
            if not probe.get("router_bypassed", False):
                ops[-1].note += "; INCLUDES the router (MoE.routed did not call self.gate)"
            info["routed_excludes_router"] = bool(probe.get("router_bypassed", False))
            if mlp.shared_experts is not None:
                fn, st = module_fn(mlp.shared_experts, lambda m, a: m(a))
                y_shared = op(
                    "shared_expert", fn, (st, hn), 6.0 * t * d * ish, (3 * d * ish + 2 * t * d) * b, "moe"
                )
            else:
                y_shared = jnp.zeros_like(hn)

            def combine(h_, r_, s_, req_):
                out = (r_ + s_.astype(jnp.float32)).astype(h_.dtype)
                return jnp.where((req_ >= 0)[:, None], h_ + out, 0)

            x = op(
                "moe_combine+residual",
                _jit(combine),
                (hres, y_routed, y_shared, req),
                3 * t * d,
                (3 * t * d) * b + t * d * 4,
                "other",
            )
        else:
            i_d = cfg.dense_intermediate_size
            fn, st = module_fn(mlp, lambda m, a: m(a))
            y = op("dense_mlp", fn, (st, hn), 6.0 * t * d * i_d, (3 * d * i_d + 2 * t * d) * b, "mlp")

            def residual(h_, y_, req_):
                return jnp.where((req_ >= 0)[:, None], h_ + y_, 0)

            x = op("residual", _jit(residual), (hres, y, req), t * d, 3 * t * d * b, "other")

    # ---- final norm and LM head over the verified rows
    n = inp.logit_rows.shape[0]
    vocab = cfg.vocab_size
    fn, st = module_fn(model.norm, lambda m, a, rows: m(a[rows]))
    hfin = add(Op("final_norm", fn, (st, x, inp.logit_rows), *_rms_cost(n, d, b), group="norm"))

    def lm_head(w, a):
        return jnp.dot(a.astype(w.dtype), w, preferred_element_type=jnp.float32)

    logits = add(
        Op(
            "lm_head",
            _jit(lm_head),
            (model.lm_head[...], hfin),
            flops=2.0 * n * d * vocab,
            bytes=float(d * vocab * b + n * d * b + n * vocab * 4),
            group="head",
            note=f"{n} verified rows x {vocab} vocab, fp32 logits",
        )
    )
    info["logit_rows"] = n
    return ops, logits, info


def make_verify_step(model, *, implementation: str, moe_implementation: str | None):
    """The whole step as ``decode.make_step_fn`` jits it (cache donated), plus ``moe_implementation=`` when
    ``forward_ragged`` takes it. Returns ``(jitted step, applied)``."""
    graphdef, _ = nnx.split(model)
    kw = {}
    if moe_implementation and "moe_implementation" in _arg_names(forward_ragged):
        kw["moe_implementation"] = moe_implementation

    def step(params, cache, batch, logit_rows):
        m = nnx.merge(graphdef, params)
        hidden, _, cache = forward_ragged(m, cache, batch, implementation=implementation, **kw)
        return m.logits(hidden[logit_rows]), cache

    return _jit(step, donate_argnums=(1,) if _donate() else ()), bool(kw)


# ----------------------------------------------------------------------------------------------- draft step
def make_drafter(
    cfg: MiniMaxM3Config,
    model: MiniMaxM3ForCausalLM,
    *,
    num_layers: int,
    block_size: int,
    num_features: int,
    markov_rank: int,
    markov_type: str,
    confidence: bool,
    dtype,
    seed: int,
) -> DSparkDrafter:
    """A random DSpark drafter of ``num_layers`` target-shaped draft layers sharing the target's embeddings
    and LM head (features from ``num_features`` target layers of a 60-layer target, as the published M3
    drafters read)."""
    n_target = 60
    feature_target = cfg.replace(
        num_hidden_layers=n_target,
        layer_types=(FULL_ATTENTION,) * n_target,
        mlp_layer_types=(DENSE_MLP,) * n_target,
    )
    dcfg = DSparkConfig.for_target(
        feature_target,
        mask_token_id=cfg.vocab_size - 1,
        block_size=block_size,
        num_draft_layers=num_layers,
        num_target_features=num_features,
        markov_rank=markov_rank,
        markov_head_type=markov_type if markov_rank else None,
        enable_confidence_head=confidence,
        confidence_head_with_markov=bool(confidence and markov_rank),
    )
    return make_random(
        DSparkDrafter,
        dcfg,
        embed_tokens=model.embed_tokens[...],
        lm_head=model.lm_head[...],
        dtype=dtype,
        seed=seed,
    )


@dataclasses.dataclass
class DraftInputs:
    anchors: jax.Array
    anchor_positions: jax.Array
    lengths: jax.Array
    temperature: jax.Array
    keys: jax.Array | None
    features: jax.Array  # [R * (1 + K), m*d] packed context features of a verify step
    feature_qsl: jax.Array
    start: jax.Array
    num_new: jax.Array
    slots: jax.Array  # the engine's slot of each row (a permutation)
    block_tables: jax.Array  # int32[R, nb] each row's pages: a shuffled share of the pool


def draft_pages(drafter: DSparkDrafter, num_rows: int, capacity: int) -> tuple[int, int, int]:
    """``(page, blocks per row, pool pages)`` of the profiled draft cache: the target's page size (the draft
    layers' MSA block), ``cdiv(capacity, page)`` blocks per row, one pool page per row block."""
    page = page_size_for(drafter.cfg.layer_config)
    nb = -(-capacity // page)
    return page, nb, num_rows * nb


def make_draft_inputs(
    drafter: DSparkDrafter, num_rows: int, context: int, capacity: int, *, sampling: str, seed: int
) -> DraftInputs:
    cfg = drafter.cfg
    _, nb, num_pages = draft_pages(drafter, num_rows, capacity)
    k = cfg.block_size
    rng = np.random.default_rng(seed + 2)  # small integer arrays: host-made
    t = num_rows * (1 + k)
    sample = sampling == "sample"
    (features,) = normal_arrays([((t, cfg.feature_size), drafter.dtype)], seed + 4)
    return DraftInputs(
        anchors=jnp.asarray(rng.integers(0, cfg.vocab_size, num_rows), jnp.int32),
        anchor_positions=jnp.full((num_rows,), context, jnp.int32),
        lengths=jnp.full((num_rows,), context, jnp.int32),
        temperature=jnp.full((num_rows,), 1.0 if sample else 0.0, jnp.float32),
        keys=jax.random.split(jax.random.key(seed + 5), num_rows) if sample else None,
        features=features,
        feature_qsl=jnp.arange(num_rows + 1, dtype=jnp.int32) * (1 + k),
        start=jnp.full((num_rows,), context, jnp.int32),
        num_new=jnp.full((num_rows,), 1 + k, jnp.int32),
        slots=jnp.asarray(rng.permutation(num_rows), jnp.int32),
        block_tables=jnp.asarray(rng.permutation(num_pages).reshape(num_rows, nb), jnp.int32),
    )


def make_draft_state(drafter: DSparkDrafter, num_rows: int, capacity: int, *, seed: int) -> dict:
    """The draft cache's pages ``dk, dv [L, H_kv, P, page, D]``, random."""
    c = drafter.cfg.layer_config
    page, _, num_pages = draft_pages(drafter, num_rows, capacity)
    shape = (c.num_hidden_layers, c.num_key_value_heads, num_pages, page, c.head_dim)
    return random_arrays({"dk": shape, "dv": shape}, drafter.dtype, seed + 3)


def _draft_attention_fn(implementation: str):
    """``f(q, k_cache, v_cache, block_tables, lengths, kb, vb, *, layer, scale)`` for one implementation:
    ``"pallas"`` is the kernel (``pallas_kernels.draft_attention``: the whole paged cache in place, reads each
    row's pages up to its length), ``"reference"`` the drafter's jnp path (``block_hidden``'s: the context of
    ``cache[layer]`` gathered through the tables, :func:`minimax_jax.draft_attention.draft_attention` with a
    length mask; reads the whole table width)."""
    if implementation == "pallas":
        return functools.partial(draft_attention_kernel.draft_attention, implementation="pallas")
    if implementation != "reference":
        raise ValueError(
            f"draft attention implementation must be pallas or reference, got {implementation!r}"
        )

    def f(q, kc, vc, tables, lengths, kb, vb, *, layer, scale):
        capacity = tables.shape[1] * kc.shape[3]
        visible = (jnp.arange(capacity, dtype=jnp.int32)[None, :] < lengths[:, None])[:, None, :]
        k_ctx = draft_attention_kernel.paged_context(kc[layer], tables)
        v_ctx = jnp.where(visible[:, 0, :, None, None], draft_attention_kernel.paged_context(vc[layer], tables), 0)
        return draft_attention(q, k_ctx, v_ctx, visible, kb, vb, scale=scale)

    return f


def draft_attention_impls(spec: str) -> list[str]:
    """``--draft-attention``: a comma list of ``pallas`` / ``reference``; ``auto`` is both on a GPU (the
    kernel first: the one in the step's sum and in the whole step) and the jnp path alone elsewhere."""
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        out += (["pallas", "reference"] if on_gpu() else ["reference"]) if item == "auto" else [item]
    return list(dict.fromkeys(out))


def build_draft_ops(
    drafter: DSparkDrafter, state: dict, inp: DraftInputs, *, attention_impls: list[str], sampling: str
) -> tuple[list[Op], dict]:
    """The ops of one draft step (then, not in the step's sum, the context write and the engine's table install),
    each run once in order. Returns ``(ops, chain outputs)``."""
    cfg = drafter.cfg
    c = cfg.layer_config
    r_rows, k = inp.anchors.shape[0], cfg.block_size
    m_rows = r_rows * k
    d, h, g, hd, i_d, vocab = (
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.dense_intermediate_size,
        c.vocab_size,
    )
    b = jnp.dtype(drafter.dtype).itemsize
    page = state["dk"].shape[3]
    capacity = inp.block_tables.shape[1] * page
    n_layers = c.num_hidden_layers
    ops: list[Op] = []

    def add(op: Op):  # run (and compile) each op once, to completion: nothing queued behind the timings
        ops.append(op)
        return jax.block_until_ready(call_op(op, state))

    def block_inputs(dr, anchors, anchor_pos, lengths):
        x, (cos, sin) = dr._block_inputs(anchors, anchor_pos)
        return x, cos, sin, jnp.minimum(lengths, anchor_pos.astype(jnp.int32))

    graphdef, dstate = nnx.split(drafter)
    fn = _jit(lambda st, *a: block_inputs(nnx.merge(graphdef, st), *a))
    x, cos, sin, end = add(
        Op(
            "block_inputs",
            fn,
            (dstate, inp.anchors, inp.anchor_positions, inp.lengths),
            flops=0.0,
            bytes=float(2 * m_rows * d * b + m_rows * c.rotary_dim * 4),
            group="embed",
            note="anchor + mask embeddings, RoPE, context ends",
        )
    )
    ctx_len = float(np.sum(np.asarray(end)))
    ctx_pages = float(np.sum(-(-np.asarray(end) // page)))
    scale = hd**-0.5
    for li, layer in enumerate(drafter.layers):
        tag = f"D{li}"

        op = layer_op(add, tag)

        fn, st = module_fn(layer.input_layernorm, lambda m, a: m(a))
        xn = op("input_norm", fn, (st, x), *_rms_cost(m_rows, d, b), "norm")
        fn, st = module_fn(layer.self_attn, lambda m, a, c_, s_: m.project_qkv(a, c_, s_))
        w_qkv = d * (h + 2 * g) * hd
        q, kb, vb = op(
            "qkv_proj",
            fn,
            (st, xn, cos, sin),
            2 * m_rows * w_qkv,
            (w_qkv + m_rows * d + m_rows * (h + 2 * g) * hd) * b,
            "proj",
        )
        att_flops = 4.0 * (ctx_len * k + r_rows * k * k) * h * hd
        att_bytes = (ctx_len * g * hd * 2 + m_rows * g * hd * 2 + 2 * m_rows * h * hd) * b + r_rows * 4 \
            + ctx_pages * 4  # lengths, and the block-table entries of the pages read
        o = None
        for impl in attention_impls:
            fn = _jit(functools.partial(_draft_attention_fn(impl), layer=li, scale=scale))
            out = op(
                f"draft_attention[{impl}]",
                fn,
                (q, Ref("dk"), Ref("dv"), inp.block_tables, end, kb, vb),
                att_flops,
                att_bytes,
                "attention",
                in_sum=o is None,
                note="context K/V up to each row's length (its shuffled pages) once per KV head + the block's keys"
                + ("" if o is None else " (alternative implementation: not in the sum)"),
                detail={"capacity": capacity, "page": page, "mean_context": ctx_len / max(r_rows, 1)},
            )
            o = out if o is None else o
        fn, st = module_fn(layer.self_attn, lambda m, x_, o_: x_ + m.o_proj(o_.reshape(*o_.shape[:2], -1)))
        hres = op(
            "o_proj",
            fn,
            (st, x, o),
            2 * m_rows * h * hd * d,
            (h * hd * d + m_rows * h * hd + 2 * m_rows * d) * b,
            "proj",
            note="o_proj + residual",
        )
        fn, st = module_fn(layer.post_attention_layernorm, lambda m, a: m(a))
        hn = op("post_norm", fn, (st, hres), *_rms_cost(m_rows, d, b), "norm")
        fn, st = module_fn(layer.mlp, lambda m, h_, a: h_ + m(a))
        x = op(
            "mlp",
            fn,
            (st, hres, hn),
            6.0 * m_rows * d * i_d,
            (3 * d * i_d + 3 * m_rows * d) * b,
            "mlp",
            note="dense swigluoai MLP + residual",
        )

    fn, st = module_fn(drafter.norm, lambda m, a: m(a))
    hfin = add(Op("final_norm", fn, (st, x), *_rms_cost(m_rows, d, b), group="norm"))

    def lm_head(w, a):  # slot-major [K, R, V], as DSparkDrafter.sample_block computes it
        return jnp.dot(jnp.swapaxes(a, 0, 1).astype(w.dtype), w, preferred_element_type=jnp.float32)

    u = add(
        Op(
            "lm_head",
            _jit(lm_head),
            (drafter.lm_head[...], hfin),
            flops=2.0 * m_rows * d * vocab,
            bytes=float(d * vocab * b + m_rows * d * b + m_rows * vocab * 4),
            group="head",
            note=f"{r_rows} x {k} rows x {vocab} vocab, fp32 logits",
        )
    )

    sample = sampling == "sample"

    class _Logits:  # sample_block with the LM head's output given: the sampling alone
        def __init__(self, dr, logits):
            self.__dict__.update(_dr=dr, _u=logits)

        def __getattr__(self, name):
            return getattr(self.__dict__["_dr"], name)

        def logits(self, hh):
            del hh
            return self.__dict__["_u"]

    def sampling_fn(dr, u_, h_, anchors, temps, keys):
        return DSparkDrafter.sample_block(_Logits(dr, u_), h_, anchors, temps, keys, return_probs=sample)

    fn = _jit(lambda st, *a: sampling_fn(nnx.merge(graphdef, st), *a))
    markov = cfg.markov_rank
    samp_flops = m_rows * vocab * (8.0 if sample else 2.0) + 2.0 * m_rows * markov * vocab
    samp_bytes = m_rows * vocab * 4 * (2 if sample else 1) + markov * vocab * b + m_rows * d * b
    out = add(
        Op(
            "sampling",
            fn,
            (dstate, u, hfin, inp.anchors, inp.temperature, inp.keys),
            flops=samp_flops,
            bytes=float(samp_bytes),
            group="sample",
            note=("temperature 1, probabilities written" if sample else "greedy, no probabilities")
            + (f"; Markov rank {markov}" if markov else ""),
        )
    )

    # ---- beside the step: context write after verification, the engine's table install
    t_ctx = inp.features.shape[0]
    m_feat = cfg.num_target_features
    fn, st = module_fn(drafter, lambda m, f_: m.project_features(f_))
    h_ctx = add(
        Op(
            "ctx.feature_proj",
            fn,
            (st, inp.features),
            flops=2.0 * t_ctx * m_feat * d * d,
            bytes=float((m_feat * d * d + t_ctx * m_feat * d + t_ctx * d) * b),
            group="context",
            in_sum=False,
            note=f"fc + hidden_norm over {t_ctx} = R x (1 + K) verified positions",
        )
    )

    def ctx_positions(qsl, start):
        req = token_to_request(qsl, t_ctx)
        rr = jnp.maximum(req, 0)
        i = jnp.arange(t_ctx, dtype=jnp.int32) - qsl[rr]
        return req, start[rr] + i

    req, positions = _jit(ctx_positions)(inp.feature_qsl, inp.start)
    fn, st = module_fn(drafter, lambda m, hc, p: m.context_kv(hc, jnp.maximum(p, 0)))
    w_kv = d * 2 * g * hd
    k_new, v_new = add(
        Op(
            "ctx.context_kv",
            fn,
            (st, h_ctx, positions),
            flops=2.0 * t_ctx * w_kv * n_layers,
            bytes=float((w_kv * n_layers + t_ctx * d + 2 * t_ctx * g * hd * n_layers) * b),
            group="context",
            in_sum=False,
            note="every draft layer's context K (normed, RoPE) and V",
        )
    )

    def scatter(kc, vc, tables, k_, v_, rows, p):
        slots = slot_mapping(tables, rows, p, page_size=kc.shape[3], num_pages=kc.shape[2])
        write = jax.vmap(write_tokens, in_axes=(0, 0, None))  # over the layers
        return write(kc, k_, slots), write(vc, v_, slots)

    donate = (0, 1) if _donate() else ()
    add(
        Op(
            "ctx.scatter",
            _jit(scatter, donate_argnums=donate),
            (Ref("dk"), Ref("dv"), inp.block_tables, k_new, v_new, req, positions),
            flops=0.0,
            bytes=float(2 * 2 * t_ctx * g * hd * n_layers * b + t_ctx * 4),
            group="context",
            in_sum=False,
            feedback={0: 0, 1: 1},
            note="the page scatter of DSparkDrafter.write_context (cache donated)",
        )
    )

    def install(cache_tables, tables, slots):
        return cache_tables.at[slots].set(tables)

    add(
        Op(
            "engine.install_tables",
            _jit(install),
            (inp.block_tables, inp.block_tables, inp.slots),
            flops=0.0,
            bytes=float(3 * inp.block_tables.size * 4),
            group="engine",
            in_sum=False,
            note="spec_decode/step.py's with_block_tables: the step's tables into its slots' rows (int32)",
        )
    )
    return ops, {"h": hfin, "tokens": out.tokens}


# ----------------------------------------------------------------------------------------------- timing, rows
def op_row(op: Op, t: dict, chip: ChipPeak, device: dict | None = None) -> dict:
    roof, bound = roofline(op.flops, op.bytes, chip)
    row = {
        "op": op.name,
        "layer": op.layer,
        "group": op.group,
        "in_sum": op.in_sum,
        "time_ms": 1e3 * t["median"],
        "min_ms": 1e3 * t["min"],
        "flops": op.flops,
        "bytes": op.bytes,
        "roofline_ms": 1e3 * roof,
        "bound": bound,
        "note": op.note,
        **op.detail,
    }
    row["ratio"] = row["time_ms"] / row["roofline_ms"] if roof > 0 else None
    row["flag"] = bool(row["ratio"] is not None and row["ratio"] > FLAG_RATIO)
    row["achieved_TBps"] = op.bytes / t["median"] / 1e12
    row["achieved_TFLOPs"] = op.flops / t["median"] / 1e12
    if device and "device_us" in device:
        row["device_ms"] = device["device_us"] / 1e3
        row["device_ratio"] = row["device_ms"] / row["roofline_ms"] if roof > 0 else None
    elif device:
        row["device_note"] = str(device)[:200]
    return row


def time_ops(
    ops: list[Op], state: dict, chip: ChipPeak, *, warmup: int, iters: int, device_times: bool, log=print
) -> list[dict]:
    """Time every op: non-donating ops first (their cache arguments stay valid), then the donating ones."""
    rows = {}
    order = [o for o in ops if not o.feedback] + [o for o in ops if o.feedback]
    for op in order:
        t = time_call(functools.partial(call_op, op, state), warmup=warmup, iters=iters)
        dev = None
        if device_times and not op.feedback:
            dev = _device_times(op, state)
        rows[op.name] = op_row(op, t, chip, dev)
        log(_one_line(rows[op.name]))
    return [rows[o.name] for o in ops]


def _device_times(op: Op, state: dict):
    from jax.profiler import ProfileData  # noqa: F401  (fails early off GPU builds without the profiler)

    from scripts.bench_sparse_attention import device_times

    args = [a.get(state) if isinstance(a, Ref) else a for a in op.args]
    return device_times(op.fn, [tuple(args)], calls=10)


def summarise(rows: list[dict], whole: dict | None, chip: ChipPeak) -> dict:
    part = [r for r in rows if r["in_sum"]]
    flops = sum(r["flops"] for r in part)
    nbytes = sum(r["bytes"] for r in part)
    roof, bound = roofline(flops, nbytes, chip)
    out = {
        "sum_of_ops_ms": sum(r["time_ms"] for r in part),
        "flops": flops,
        "bytes": nbytes,
        "roofline_ms": 1e3 * roof,
        "bound": bound,
        "serial_roofline_ms": sum(r["roofline_ms"] for r in part),
        "flagged": [r["op"] for r in part if r["flag"]],
    }
    if whole:
        out.update(whole)
        out["gap_ms"] = out["whole_step_ms"] - out["sum_of_ops_ms"]
        out["whole_vs_roofline"] = out["whole_step_ms"] / out["roofline_ms"] if roof > 0 else None
    by_group = {}
    for r in part:
        by_group[r["group"]] = by_group.get(r["group"], 0.0) + r["time_ms"]
    out["ms_by_group"] = by_group
    return out


def _rel_err(a, b) -> float:
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


def profile_verify(
    model,
    state: dict,
    shape: tuple[int, int],
    *,
    context: int,
    implementation: str,
    moe_implementation: str | None,
    chip: ChipPeak,
    warmup: int,
    iters: int,
    device_times: bool,
    seed: int,
    log=print,
    ops_out: list | None = None,
) -> dict:
    """Profile one verify shape (``ops_out``, when given, receives the ops: tests inspect them)."""
    cfg = model.cfg
    r_rows, q_len = shape
    num_pages = state["k0"].shape[1]
    inp = make_verify_inputs(
        cfg, num_requests=r_rows, q_len=q_len, context=context, num_pages=num_pages, seed=seed
    )
    name = f"{r_rows}x{q_len}"
    log(
        f"# verify {name}: {r_rows} requests x {q_len} tokens at {context} context, "
        f"MoE implementation {moe_implementation or '(default)'}"
    )
    t0 = time.perf_counter()
    ops, chain_logits, info = build_verify_ops(
        model, state, inp, implementation=implementation, moe_implementation=moe_implementation
    )
    info["build_s"] = time.perf_counter() - t0
    if ops_out is not None:
        ops_out.extend(ops)
    rows = time_ops(ops, state, chip, warmup=warmup, iters=iters, device_times=device_times, log=log)
    step, applied = make_verify_step(
        model, implementation=implementation, moe_implementation=moe_implementation
    )
    params = nnx.state(model)
    whole_op = Op(
        "whole_step",
        step,
        (params, PagedRef(cfg.num_hidden_layers, len(cfg.sparse_layer_ids)), inp.batch, inp.logit_rows),
        0.0,
        0.0,
        feedback={1: 1},
    )
    t0 = time.perf_counter()
    logits, _ = call_op(whole_op, state)
    jax.block_until_ready(logits)
    compile_s = time.perf_counter() - t0
    err = _rel_err(chain_logits, logits)
    del logits, chain_logits
    t = time_call(functools.partial(call_op, whole_op, state), warmup=max(warmup, 1), iters=iters)
    whole = {
        "whole_step_ms": 1e3 * t["median"],
        "whole_step_min_ms": 1e3 * t["min"],
        "whole_step_compile_s": compile_s,
        "chain_vs_step_rel_err": err,
        "moe_implementation_applied_to_step": applied,
    }
    summary = summarise(rows, whole, chip)
    if moe_implementation and not (applied or info.get("moe_routed_takes_implementation")):
        log(
            f"# WARNING: MoE implementation {moe_implementation!r} was not applied: neither MoE.routed takes "
            f"implementation= nor forward_ragged moe_implementation="
        )
    log(
        f"# verify {name}: whole step {summary['whole_step_ms']:.3f} ms, sum of ops "
        f"{summary['sum_of_ops_ms']:.3f} ms (gap {summary['gap_ms']:+.3f} ms), roofline "
        f"{summary['roofline_ms']:.3f} ms, chain vs step rel err {err:.2e}"
    )
    return {
        "step": "verify",
        "shape": name,
        "num_requests": r_rows,
        "q_len": q_len,
        "context": context,
        "tokens": r_rows * q_len,
        "implementation": implementation,
        **info,
        "summary": summary,
        "rows": rows,
    }


def _draft_step_wholes(drafter, inp: DraftInputs, *, sampling: str, impls: list[str]) -> list[Op]:
    """The whole draft step as the engine can run it: ``draft_step`` (the public entry point) per attention
    implementation; then, with the first implementation, the engine's form (``spec_decode/step.py``: the step's
    block tables installed into its slots' rows, ``block_hidden(..., cache_rows=slot)`` reading the slots'
    pages in place, ``sample_block``)."""
    graphdef, dstate = nnx.split(drafter)
    sample = sampling == "sample"
    cache = DraftRef(inp.lengths, inp.block_tables)
    ops = []
    for impl in impls:

        def run(st, cache_, anchors, pos, temps, keys, impl=impl):
            return draft_step(
                graphdef,
                st,
                cache_,
                anchors,
                pos,
                temps,
                keys,
                return_probs=sample,
                validate=False,
                implementation=impl,
            )

        ops.append(
            Op(
                f"whole_draft_step[{impl}]",
                _jit(run),  # as an engine calls it: inside its jitted step (no host-side checks per call)
                (dstate, cache, inp.anchors, inp.anchor_positions, inp.temperature, inp.keys),
                0.0,
                0.0,
            )
        )

    @_jit
    def engine(st, cache_, tables, slots, anchors, pos, temps, keys):
        dr = nnx.merge(graphdef, st)
        c = cache_.with_block_tables(tables, slots)
        c = dataclasses.replace(c, lengths=c.lengths.at[slots].set(cache_.lengths))
        hh = dr.block_hidden(c, anchors, pos, cache_rows=slots, implementation=impls[0])
        return dr.sample_block(hh, anchors, temps, keys, return_probs=sample)

    args = (dstate, cache, inp.block_tables, inp.slots, inp.anchors, inp.anchor_positions, inp.temperature,
            inp.keys)
    ops.append(Op("whole_engine_draft_rows", engine, args, 0.0, 0.0))
    return ops


def profile_draft(
    drafter,
    num_rows: int,
    *,
    context: int,
    capacity: int,
    attention_impls: list[str],
    sampling: str,
    chip: ChipPeak,
    warmup: int,
    iters: int,
    device_times: bool,
    seed: int,
    log=print,
) -> dict:
    cfg = drafter.cfg
    n_layers = cfg.num_draft_layers
    name = f"R{num_rows}xK{cfg.block_size}xL{n_layers}"
    log(
        f"# draft {name}: {num_rows} rows, K = {cfg.block_size}, {n_layers} draft layers, {context} context "
        f"(capacity {capacity}), {sampling}"
    )
    state = make_draft_state(drafter, num_rows, capacity, seed=seed)
    inp = make_draft_inputs(drafter, num_rows, context, capacity, sampling=sampling, seed=seed)
    t0 = time.perf_counter()
    ops, chain = build_draft_ops(drafter, state, inp, attention_impls=attention_impls, sampling=sampling)
    build_s = time.perf_counter() - t0
    rows = time_ops(ops, state, chip, warmup=warmup, iters=iters, device_times=device_times, log=log)
    wholes = {}
    for op in _draft_step_wholes(drafter, inp, sampling=sampling, impls=attention_impls):
        out = jax.block_until_ready(call_op(op, state))
        if op.name.startswith("whole_draft_step"):  # the chain's tokens and the step's (same rows)
            wholes[f"chain_tokens_match{op.name[16:]}"] = float(
                np.mean(np.asarray(out.tokens) == np.asarray(chain["tokens"]))
            )
        t = time_call(functools.partial(call_op, op, state), warmup=max(warmup, 1), iters=iters)
        wholes[op.name + "_ms"] = 1e3 * t["median"]
        log(f"  {op.name:<40} {wholes[op.name + '_ms']:10.4f} ms")
    wholes["whole_draft_step_ms"] = wholes[f"whole_draft_step[{attention_impls[0]}]_ms"]
    wholes["chain_tokens_match"] = wholes[f"chain_tokens_match[{attention_impls[0]}]"]
    graphdef, dstate = nnx.split(drafter)

    def append(st, k, v, lengths, tables, feats, qsl, start, num_new):
        cache = DraftCache(k, v, lengths, tables)
        out = append_context_packed_step(graphdef, st, cache, feats, qsl, start, num_new, validate=False)
        return out.k, out.v

    app = Op(  # only the K/V pools are donated: every call sees the same lengths and tables
        "append_context",
        _jit(append, donate_argnums=(1, 2) if _donate() else ()),
        (dstate, Ref("dk"), Ref("dv"), inp.lengths, inp.block_tables, inp.features, inp.feature_qsl, inp.start,
         inp.num_new),
        0.0,
        0.0,
        feedback={1: 0, 2: 1},
    )
    t = time_call(functools.partial(call_op, app, state), warmup=max(warmup, 1), iters=iters)
    wholes["whole_append_context_ms"] = 1e3 * t["median"]
    summary = summarise(rows, {"whole_step_ms": wholes["whole_draft_step_ms"], **wholes}, chip)
    ctx_rows = [r for r in rows if r["group"] == "context"]
    summary["context_write_sum_ms"] = sum(r["time_ms"] for r in ctx_rows)
    summary["context_write_roofline_ms"] = sum(r["roofline_ms"] for r in ctx_rows)
    # The floor: the draft cache read (K/V up to each row's length) plus the LM head over R x K rows.
    att = [r for r in rows if "draft_attention" in r["op"] and r["in_sum"]]
    head = next(r for r in rows if r["op"] == "lm_head")
    floor_bytes = sum(r["bytes"] for r in att) + head["bytes"]
    floor_flops = head["flops"]
    summary["floor"] = {
        "bytes": floor_bytes,
        "flops": floor_flops,
        "serial_ms": 1e3 * (floor_bytes / chip.hbm_bytes_per_s + floor_flops / chip.bf16_flops_per_s),
        "overlapped_ms": 1e3 * roofline(floor_flops, floor_bytes, chip)[0],
    }
    log(
        f"# draft {name}: draft_step {wholes['whole_draft_step_ms']:.3f} ms (engine form "
        f"{wholes['whole_engine_draft_rows_ms']:.3f} ms), sum of ops {summary['sum_of_ops_ms']:.3f} ms, "
        f"floor {summary['floor']['serial_ms']:.3f} ms serial; append_context "
        f"{wholes['whole_append_context_ms']:.3f} ms"
    )
    del state, ops, chain
    gc.collect()
    return {
        "step": "draft",
        "shape": name,
        "num_rows": num_rows,
        "block_size": cfg.block_size,
        "draft_layers": n_layers,
        "context": context,
        "capacity": capacity,
        "page": page_size_for(cfg.layer_config),
        "sampling": sampling,
        "markov_rank": cfg.markov_rank,
        "attention_implementations": attention_impls,
        "build_s": build_s,
        "summary": summary,
        "rows": rows,
    }


# ----------------------------------------------------------------------------------------------- output
COLUMNS = [
    "op",
    "time_ms",
    "roofline_ms",
    "ratio",
    "flag",
    "bound",
    "GB",
    "GFLOP",
    "TBps",
    "TFLOPs",
    "device_ms",
]


def table_rows(profile: dict) -> list[dict]:
    out = []
    for r in profile["rows"]:
        out.append(
            {
                "op": r["op"] + ("" if r["in_sum"] else " *"),
                "time_ms": r["time_ms"],
                "roofline_ms": r["roofline_ms"],
                "ratio": r["ratio"],
                "flag": "FLAG" if r["flag"] else "",
                "bound": r["bound"],
                "GB": r["bytes"] / 1e9,
                "GFLOP": r["flops"] / 1e9,
                "TBps": r["achieved_TBps"],
                "TFLOPs": r["achieved_TFLOPs"],
                "device_ms": r.get("device_ms"),
            }
        )
    s = profile["summary"]
    out.append(
        {
            "op": "= sum of ops",
            "time_ms": s["sum_of_ops_ms"],
            "roofline_ms": s["roofline_ms"],
            "ratio": s["sum_of_ops_ms"] / s["roofline_ms"] if s["roofline_ms"] else None,
            "bound": s["bound"],
            "GB": s["bytes"] / 1e9,
            "GFLOP": s["flops"] / 1e9,
        }
    )
    out.append(
        {
            "op": "= whole step",
            "time_ms": s.get("whole_step_ms"),
            "roofline_ms": s["roofline_ms"],
            "ratio": s.get("whole_vs_roofline"),
        }
    )
    return out


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def format_table(rows: list[dict], columns=COLUMNS) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def _one_line(row: dict) -> str:
    ratio = "" if row["ratio"] is None else f" x{row['ratio']:.2f}"
    flag = " FLAG" if row["flag"] else ""
    return f"  {row['op']:<40} {row['time_ms']:10.4f} ms  roofline {row['roofline_ms']:9.4f} ms{ratio}{flag}"


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return x


def environment() -> dict:
    d = jax.devices()[0]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": f"{d.platform}:{getattr(d, 'device_kind', '?')}",
        "jax": jax.__version__,
        "python": sys.version.split()[0],
    }


# ----------------------------------------------------------------------------------------------- main
def run(args, log=print, ops_out: list | None = None) -> dict:
    """Profile what ``args`` (:func:`parse_args`) asks for; returns the JSON payload (also written to
    ``args.out``). ``ops_out`` receives the verify ops (tests)."""
    chip = CHIP_PEAKS[args.chip]
    dtype = jnp.dtype(args.dtype)
    layers = parse_layers(args.layers)
    cfg = target_config(layers, tiny=args.tiny)
    shapes = parse_shapes(args.shapes) if not args.skip_verify else []
    draft_rows = [int(s) for s in args.draft_rows.split(",") if s] if not args.skip_draft else []
    draft_layers = [int(s) for s in args.draft_layers.split(",") if s]
    moe_impls = [s for s in args.moe_implementation.split(",") if s] or [None]
    env = environment()
    env["dispatch_ms"] = 1e3 * dispatch_floor()
    result = {
        "environment": env,
        "chip": dataclasses.asdict(chip),
        "flag_ratio": FLAG_RATIO,
        "config": {
            "tiny": args.tiny,
            "layers": args.layers,
            "context": args.context,
            "dtype": args.dtype,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "heads": [cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim],
            "experts": [cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size],
            "implementation": args.implementation,
            "moe_implementation": args.moe_implementation,
            "draft_attention": args.draft_attention,
            "warmup": args.warmup,
            "iters": args.iters,
        },
        "profiles": [],
    }
    log(
        f"# {env}; chip constants {chip.name}: HBM {chip.hbm_bytes_per_s / 1e12:.2f} TB/s, bf16 "
        f"{chip.bf16_flops_per_s / 1e12:.0f} TFLOP/s"
    )

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(_jsonable(result), f, indent=1)

    t0 = time.perf_counter()
    model = make_target(cfg, dtype=dtype, seed=args.seed)
    jax.block_until_ready(nnx.state(model))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    log(
        f"# target slice: {len(layers)} layers, {n_params / 1e9:.2f}B parameters, made in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    if shapes:
        page = cfg.index_block_size
        num_pages = max(r for r, _ in shapes) * -(-args.context // page)
        state = make_paged_state(cfg, num_pages, dtype=dtype, seed=args.seed)
        for shape in shapes:
            for moe_impl in moe_impls:
                prof = profile_verify(
                    model,
                    state,
                    shape,
                    context=args.context,
                    implementation=args.implementation,
                    moe_implementation=moe_impl,
                    chip=chip,
                    warmup=args.warmup,
                    iters=args.iters,
                    device_times=args.device_times,
                    seed=args.seed,
                    log=log,
                    ops_out=ops_out,
                )
                result["profiles"].append(prof)
                log(format_table(table_rows(prof)))
                save()
                gc.collect()
        del state
        gc.collect()
    impls = draft_attention_impls(args.draft_attention)
    capacity = args.context + args.capacity_slack
    for n_layers in draft_layers if draft_rows else []:
        drafter = make_drafter(
            cfg,
            model,
            num_layers=n_layers,
            block_size=args.draft_k,
            num_features=args.draft_features,
            markov_rank=args.markov_rank,
            markov_type=args.markov_type,
            confidence=not args.no_confidence_head,
            dtype=dtype,
            seed=args.seed + n_layers,
        )
        for r in draft_rows:
            prof = profile_draft(
                drafter,
                r,
                context=args.context,
                capacity=capacity,
                attention_impls=impls,
                sampling=args.draft_sampling,
                chip=chip,
                warmup=args.warmup,
                iters=args.iters,
                device_times=args.device_times,
                seed=args.seed,
                log=log,
            )
            result["profiles"].append(prof)
            log(format_table(table_rows(prof)))
            save()
        del drafter
        gc.collect()
    save()
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tiny", action="store_true", help="tiny config and shapes: a CPU smoke run of every path"
    )
    p.add_argument(
        "--shapes", default=None, help=f"verify shapes RxQ (default {M3_SHAPES}; tiny {TINY_SHAPES})"
    )
    p.add_argument(
        "--layers", default="dense,msa", help="target layers: dense, msa, or ATTN+MLP (full+moe ...)"
    )
    p.add_argument("--context", type=int, default=None, help="tokens per request (default 4096; tiny 128)")
    p.add_argument(
        "--implementation", default="auto", help="attention / indexer kernels: auto, pallas, reference"
    )
    p.add_argument(
        "--moe-implementation",
        default="",
        help="comma list of MoE implementations to profile (passed where the MoE takes one)",
    )
    p.add_argument("--draft-rows", default=None, help="draft rows R (default 64,512; tiny 4)")
    p.add_argument("--draft-layers", default=None, help="draft layer counts (default 1,5; tiny 1,2)")
    p.add_argument("--draft-k", type=int, default=7, help="draft block size K")
    p.add_argument("--draft-features", type=int, default=5, help="target feature layers the drafter reads")
    p.add_argument(
        "--draft-attention",
        default="auto",
        help="comma list of draft attention implementations, pallas / reference (the first is in the step's "
        "sum and the whole steps); auto: pallas,reference on a GPU, reference elsewhere",
    )
    p.add_argument("--draft-sampling", choices=("greedy", "sample"), default="greedy")
    p.add_argument("--markov-rank", type=int, default=0)
    p.add_argument("--markov-type", default="vanilla")
    p.add_argument("--no-confidence-head", action="store_true")
    p.add_argument("--capacity-slack", type=int, default=16, help="draft cache capacity = context + this")
    p.add_argument("--skip-verify", action="store_true")
    p.add_argument("--skip-draft", action="store_true")
    p.add_argument("--chip", choices=sorted(CHIP_PEAKS), default="h200", help="roofline constants")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per op (default 2; tiny 1)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per op (default 10; tiny 2)")
    p.add_argument("--device-times", action="store_true", help="also profiler kernel times per op (GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON here")
    return p


def parse_args(argv=None):
    a = parser().parse_args(argv)
    tiny = a.tiny
    COMPILER_OPTIONS.clear()
    if tiny and jax.default_backend() == "cpu":
        COMPILER_OPTIONS.update(FAST_CPU_COMPILE)
    a.shapes = a.shapes or (TINY_SHAPES if tiny else M3_SHAPES)
    a.context = a.context or (128 if tiny else 4096)
    a.draft_rows = a.draft_rows or ("4" if tiny else "64,512")
    a.draft_layers = a.draft_layers or ("1,2" if tiny else "1,5")
    a.warmup = a.warmup if a.warmup is not None else (1 if tiny else 2)
    a.iters = a.iters if a.iters is not None else (2 if tiny else 10)
    if tiny and a.dtype == "bfloat16":
        a.dtype = "float32"  # exact chain-vs-step comparison on CPU
    return a


def main(argv=None) -> dict:
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
