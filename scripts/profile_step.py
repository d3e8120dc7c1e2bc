"""Per-op profile of one verify step and one DSpark draft step at MiniMax-M3 width (issues 15, 23).

    PYTHONPATH=. python3 scripts/profile_step.py --out $OUT/profile.json               # M3 width (GPU)
    PYTHONPATH=. python3 scripts/profile_step.py --shapes 512x8 --skip-draft --out ... # one verify shape
    PYTHONPATH=. python3 scripts/profile_step.py --skip-verify --skip-draft --engine-rows 64 ...  # engine step
    PYTHONPATH=. python3 scripts/profile_step.py --tiny --engine-rows 4 --out /tmp/p.json  # CPU smoke run

**How an op is timed.** The REAL whole step runs, compiled once, and the profiler reads each op's time back
from a ``jax.profiler`` trace of it: every op of the model runs under a ``jax.named_scope`` (metadata only,
free at run time), XLA keeps the scope path as the ``op_name`` of each HLO instruction, and
``scripts/op_trace.py`` maps every kernel of the trace (its ``hlo_op``) to its instruction's scope and sums the
kernels' durations per scope (time that kernels overlap is shared among them, so the rows of a run add up to
its busy time). Nothing is rebuilt op by op: a row's time is that of the kernels the step itself launched for
the op. A kernel XLA fused across ops is counted once, under the op of the fusion's root (the op that computes
its output; ``fused`` in the row names ops left with no kernel of their own). Kernels of instructions with no
scope (copies XLA inserted) are the ``(unattributed)`` row, whose share the summary reports.

**Verify step.** A slice of MiniMax-M3 (hidden 6144, 64 query / 4 KV heads of 128, 128 experts top-4 of 3072,
the full 200,064-token vocabulary) with ``--layers`` layers (``dense`` = full attention + dense MLP, ``msa`` =
MSA sparse attention + MoE; ``full+moe`` / ``msa+dense`` spell out other mixes), random bf16 weights made on
the device, a paged cache with every request at ``--context`` tokens (this step's tokens included) on shuffled
pages filled with random keys and values. Shapes ``RxQ``: ``R`` requests of ``Q`` new tokens each
(``scripts/bench_shapes.py``). The step is ``decode.make_step_fn``'s program (the cache donated on GPU):
:func:`minimax_jax.decode.forward_ragged` plus the logits of every verified row (``R x Q`` rows, full
vocabulary). Its rows are the scopes of ``forward_ragged`` (``metadata`` + RoPE, ``embed``, per layer
``input_norm``, ``qkv_proj`` with q/k norms and RoPE, ``indexer_proj``, ``cache_write``, ``index_topk``,
``sparse_attention`` or ``paged_attention``, ``o_proj`` + residual, ``post_norm``, ``dense_mlp`` or the MoE's
``router`` / ``routed_experts`` / ``shared_expert`` / ``moe_combine``, the ``residual``), then ``final_norm``
and ``lm_head`` (``model.logits``). The data-dependent sizes of the roofline (the union of each request's
block selections, the experts hit) come from the same step's :func:`minimax_jax.decode.forward_ragged_layers`
(the function ``forward_ragged`` runs), which also returns each layer's selections and router input.

**Draft step.** A DSpark drafter of ``--draft-layers`` M3-width draft layers (the target's attention shape,
dense MLP of 12288) on a paged draft cache (the target's page size) of ``--context`` tokens per row on SHUFFLED
pages, block size ``--draft-k``, the target's full-vocabulary LM head over ``R x K`` rows. The step is
:func:`minimax_jax.draft_step.draft_step` (inside a jitted caller, as an engine runs it), once per
``--draft-attention`` implementation; its rows are the drafter's scopes (``block_inputs``, per layer
``input_norm`` / ``qkv_proj`` / ``draft_attention`` / ``o_proj`` / ``post_norm`` / ``mlp``, ``final_norm``,
``lm_head``, ``markov_head``, ``sampling``, ``confidence_head``). The first implementation's rows make the step;
the others add their ``draft_attention`` rows and whole-step time beside it (not in the sum). Beside the step
too: the context write after verification (:func:`minimax_jax.draft_step.append_context_packed_step`: positions,
feature projection ``fc`` + ``hidden_norm``, every layer's context K/V, the page scatter; ``R x (1 + K)``
feature rows), traced the same way.

**Engine step** (``--engine-rows R``). ``spec_decode/step.py``'s whole step over ``R`` decode rows, each
drafting and verifying ``--draft-k`` tokens (greedy, ``mode="fixed"``, ``commit=False`` so every call sees the
same lengths; a drafter of the first ``--draft-layers`` count reading the target's layers): rows for its parts
(``install_tables``, ``draft``, ``pack``, ``verify``, ``rejection``, ``bookkeeping``; ``ms_by_part`` in the
summary) and, inside ``draft`` and ``verify``, the drafter's and the target's ops with their rooflines (prefixed
``draft.`` / ``verify.``; the verify rows' selections from a probe batch of the same shape). Time that no op
scope claims inside a part (the allocation in ``draft``, the logit-row gather in ``verify``) is the part's own
row.

**CUDA graphs.** XLA runs a GPU program's kernels as command buffers (CUDA graphs), which the trace shows as one
``command_buffer`` op: the profiler turns them off (``--xla_gpu_enable_command_buffer=`` in ``XLA_FLAGS``, set
before JAX starts, unless ``XLA_FLAGS`` already names the option or ``--keep-command-buffers`` is given), so
the whole-step times are without graphs too (the engine runs with them: compare with its own timings).

**Timing.** Whole steps: ``--warmup`` calls, then the median of ``--iters`` calls, each synchronised
(``scripts/bench_common.time_calls``; a donated cache is fed back as the engine does). Per op: the mean over
``--trace-calls`` traced calls. ``dispatch_ms`` (an empty jitted op) is the per-call host floor.

**Roofline.** Per op: bytes that must move (weights, op inputs and outputs, cache reads: e.g. sparse attention
reads each block in the union of a request's selections once per KV head; intermediates inside an op are not
counted) and FLOPs (2 per multiply-add), ``roofline = max(bytes / HBM, FLOPs / peak)`` with the constants of
``pallas_kernels.tuning.PEAKS`` (``--chip``; default the device's), ``ratio = measured / roofline``; ops over
:data:`FLAG_RATIO` are flagged.

``--implementation`` picks the attention / indexer kernels (``auto``: compiled Pallas on GPU, as the engine);
``--moe-implementation a,b`` profiles the step once per MoE implementation (``forward_ragged``'s
``moe_implementation``). ``--draft-attention`` lists the drafter's attention implementations.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
import warnings

if "--keep-command-buffers" not in sys.argv and "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    # A CUDA graph (XLA command buffer) shows in the trace as one op, its kernels unattributed: the per-op
    # attribution needs them off (set before JAX starts); the whole step is then timed without them as well
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.cache import PagedCache, page_size_for
from minimax_jax.config import DENSE_MLP, FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION, MiniMaxM3Config
from minimax_jax.decode import RaggedBatch, choose_implementation, forward_ragged_layers, make_step_fn
from minimax_jax.draft_cache import DraftCache
from minimax_jax.draft_step import append_context_packed_step, draft_step
from minimax_jax.drafter import DSparkDrafter
from minimax_jax.drafter_config import DSparkConfig
from minimax_jax.model import MiniMaxM3ForCausalLM
from pallas_kernels.platform import loops_unrolled, on_gpu
from pallas_kernels.tuning import DEFAULT_PEAK, PEAKS, ChipPeak, detect_peak
from scripts import bench_common, bench_shapes, op_trace

CHIP_PEAKS = PEAKS  # the chips --chip takes (pallas_kernels.tuning.PEAKS)
FLAG_RATIO = 3.0  # ops slower than this many rooflines are flagged

M3_SHAPES = ",".join(f"{r}x{q}" for r, q in bench_shapes.PROFILE_VERIFY)
TINY_SHAPES = ",".join(f"{r}x{q}" for r, q in bench_shapes.TINY_VERIFY)


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
    return bench_shapes.m3().replace(**kinds)


def _donate() -> bool:
    return jax.default_backend() != "cpu"  # XLA:CPU ignores donation (with a warning)


# XLA options of every program the profile compiles: --tiny on CPU trades code quality for compile time.
COMPILER_OPTIONS: dict = {}
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compile(jitted, *args):
    """``(compiled, seconds)``: ``jitted`` lowered for ``args`` and compiled with :data:`COMPILER_OPTIONS`."""
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile(COMPILER_OPTIONS or None)
    return compiled, time.perf_counter() - t0


def dispatch_floor(*, iters: int = 50) -> float:
    """Seconds of an empty jitted op with ``block_until_ready``: the host floor of any call's time."""
    x = jnp.zeros((8,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    return bench_common.time_calls(lambda: f(x), warmup=5, iters=iters)["median"]


# ----------------------------------------------------------------------------------------------- random inputs
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


def make_paged_cache(cfg: MiniMaxM3Config, num_pages: int, *, dtype, seed: int) -> PagedCache:
    """The target's paged caches filled with random values (made on the device)."""
    page = cfg.index_block_size
    n, ns = cfg.num_hidden_layers, len(cfg.sparse_layer_ids)
    kv = ((cfg.num_key_value_heads, num_pages, page, cfg.head_dim), dtype)
    arrays = normal_arrays([kv] * (2 * n) + [((num_pages, page, cfg.index_head_dim), dtype)] * ns, seed)
    return PagedCache(arrays[:n], arrays[n:2 * n], arrays[2 * n:])


@dataclasses.dataclass
class VerifyInputs:
    batch: RaggedBatch
    logit_rows: jax.Array
    num_requests: int
    q_len: int
    context: int


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


# ----------------------------------------------------------------------------------------------- roofline model
@dataclasses.dataclass
class Cost:
    """The roofline model of one op: FLOPs and bytes that must move, its group, a note and extra fields."""

    name: str  # the row's name (``L1.msa.moe.router``)
    flops: float
    bytes: float
    group: str
    layer: str = ""
    note: str = ""
    detail: dict = dataclasses.field(default_factory=dict)


def _nbytes(*arrays) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(arrays)))


def _rms_cost(rows: int, dim: int, itemsize: int) -> tuple[float, float]:
    """RMSNorm: read and write ``rows x dim``, the weight; ~4 FLOPs per element."""
    return 4.0 * rows * dim, float(2 * rows * dim * itemsize + dim * itemsize)


def layer_tag(cfg: MiniMaxM3Config, i: int) -> str:
    """``L1.msa.moe``: a target layer's row prefix (its attention and MLP kinds)."""
    return f"L{i}." + ("msa" if i in cfg.sparse_layer_ids else "dense") + "." + (
        "moe" if cfg.is_moe_layer(i) else "mlp")


def verify_costs(cfg: MiniMaxM3Config, inp: VerifyInputs, *, dtype, selections: dict, experts_hit: dict
                 ) -> dict[tuple[str, ...], Cost]:
    """``{scope path: Cost}`` of every op of the verify step, in step order. ``selections`` (sparse layer ->
    ``int32[T, H_kv, topk]``) and ``experts_hit`` (MoE layer -> experts with a token) are the step's own
    (:func:`verify_probe`)."""
    batch = inp.batch
    t = batch.num_tokens
    page = cfg.index_block_size
    b = jnp.dtype(dtype).itemsize
    d, h, g, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    meta = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    qsl_np = np.asarray(batch.query_start_loc)
    seq_np = np.asarray(batch.seq_lens)
    pos_np = np.concatenate(
        [s - (qsl_np[i + 1] - qsl_np[i]) + np.arange(qsl_np[i + 1] - qsl_np[i]) for i, s in enumerate(seq_np)]
    ).astype(np.int64)
    ctx_pages = int(np.sum(-(-seq_np // page)))
    out: dict[tuple[str, ...], Cost] = {}
    out[("metadata",)] = Cost("metadata+rope", 0.0, float(_nbytes(*meta) + t * 4 * 3 + t * cfg.rotary_dim * 4),
                              "meta", note="token -> request, positions, cache slots, RoPE cos/sin")
    out[("embed",)] = Cost("embed", 0.0, float(2 * t * d * b + 2 * t * 4), "embed")
    for i in range(cfg.num_hidden_layers):
        tag, sc = layer_tag(cfg, i), f"layer{i}"

        def op(name, flops, nbytes, group, note="", detail=None, tag=tag, sc=sc):
            out[(sc, name)] = Cost(f"{tag}.{name}", float(flops), float(nbytes), group, tag, note, detail or {})

        op("input_norm", *_rms_cost(t, d, b), "norm")
        w_qkv = d * (h + 2 * g) * hd
        op("qkv_proj", 2 * t * w_qkv, (w_qkv + t * d + t * (h + 2 * g) * hd) * b, "proj",
           "q/k/v projections, q/k norms, RoPE")
        sparse = i in cfg.sparse_layer_ids
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        if sparse:
            w_idx = d * (hi + 1) * di
            op("indexer_proj", 2 * t * w_idx, (w_idx + t * d + t * (hi + 1) * di) * b, "proj")
        op("cache_write", 0, 2 * t * (2 * g * hd + (di if sparse else 0)) * b + t * 4, "cache",
           "K, V" + (" and index-K" if sparse else "") + " of the step's tokens into the paged caches")
        if sparse:
            topk = cfg.index_topk_blocks
            op("index_topk", 2.0 * float(np.sum(pos_np + 1)) * hi * di,
               ctx_pages * page * di * b + t * hi * di * b + t * hi * topk * 4 + _nbytes(*meta), "indexer",
               "reads each request's visible index keys once (whole pages)")
            sel_np = selections[i]
            union_bytes, union_mean = _union_bytes(sel_np, qsl_np, 2 * page * hd * b)
            io = 2 * t * h * hd * b + sel_np.size * 4 + _nbytes(*meta)
            flops = _sparse_useful_flops(sel_np, pos_np, page=page, heads_per_group=h // g, head_dim=hd)
            op("sparse_attention", flops, union_bytes + io, "attention",
               f"K/V of the union of each request's selections once per KV head (mean union {union_mean:.1f} "
               f"blocks; topk {topk})",
               {"union_mean_blocks": union_mean,
                "topk_floor_bytes": inp.num_requests * g * topk * 2 * page * hd * b + io})
        else:
            op("paged_attention", 4.0 * float(np.sum(pos_np + 1)) * h * hd,
               ctx_pages * page * g * hd * b * 2 + 2 * t * h * hd * b + _nbytes(*meta), "attention",
               "every visible page's K/V once per KV head")
        op("o_proj", 2 * t * h * hd * d, (h * hd * d + t * h * hd + 2 * t * d) * b, "proj", "o_proj + residual")
        op("post_norm", *_rms_cost(t, d, b), "norm")
        if cfg.is_moe_layer(i):
            e, kk, im, ish = (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
                              cfg.shared_intermediate_size)
            hit = experts_hit[i]
            op("router", 2 * t * d * e, (d * e + t * d) * b + t * kk * 8, "moe")
            op("routed_experts", 6.0 * t * kk * d * im, (hit * 3 * d * im + t * d) * b + t * d * 4 + t * kk * 8,
               "moe", f"{hit} of {e} experts hit; weights of each hit expert read once", {"experts_hit": hit})
            if ish > 0:
                op("shared_expert", 6.0 * t * d * ish, (3 * d * ish + 2 * t * d) * b, "moe")
            op("moe_combine", t * d, t * d * 4 + (2 if ish > 0 else 1) * t * d * b, "other",
               "routed (fp32) + shared expert, to the model dtype")
        else:
            i_d = cfg.dense_intermediate_size
            op("dense_mlp", 6.0 * t * d * i_d, (3 * d * i_d + 2 * t * d) * b, "mlp")
        op("residual", t * d, 3 * t * d * b, "other", "h + mlp, padding slots zeroed")
    n = inp.logit_rows.shape[0]
    vocab = cfg.vocab_size
    f, nb = _rms_cost(n, d, b)
    out[("final_norm",)] = Cost("final_norm", f, nb + n * d * b, "norm", note="the verified rows' gather + norm")
    out[("lm_head",)] = Cost("lm_head", 2.0 * n * d * vocab, float(d * vocab * b + n * d * b + n * vocab * 4),
                             "head", note=f"{n} verified rows x {vocab} vocab, fp32 logits")
    return out


def draft_costs(drafter: DSparkDrafter, inp: DraftInputs, *, page: int, sampling: str
                ) -> dict[tuple[str, ...], Cost]:
    """``{scope path: Cost}`` of the draft step's ops, in step order (scopes of ``DSparkDrafter.block_hidden``
    and ``sample_block``)."""
    cfg = drafter.cfg
    c = cfg.layer_config
    r_rows, k = inp.anchors.shape[0], cfg.block_size
    m_rows = r_rows * k
    d, h, g, hd, i_d, vocab = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                               c.dense_intermediate_size, c.vocab_size)
    b = jnp.dtype(drafter.dtype).itemsize
    capacity = inp.block_tables.shape[1] * page
    end = np.minimum(np.asarray(inp.lengths), np.asarray(inp.anchor_positions))
    ctx_len, ctx_pages = float(np.sum(end)), float(np.sum(-(-end // page)))
    out: dict[tuple[str, ...], Cost] = {}
    out[("block_inputs",)] = Cost("block_inputs", 0.0, float(2 * m_rows * d * b + m_rows * c.rotary_dim * 4),
                                  "embed", note="anchor + mask embeddings, RoPE, context ends")
    for li in range(c.num_hidden_layers):
        tag, sc = f"D{li}", f"draft_layer{li}"

        def op(name, flops, nbytes, group, note="", detail=None, tag=tag, sc=sc):
            out[(sc, name)] = Cost(f"{tag}.{name}", float(flops), float(nbytes), group, tag, note, detail or {})

        op("input_norm", *_rms_cost(m_rows, d, b), "norm")
        w_qkv = d * (h + 2 * g) * hd
        op("qkv_proj", 2 * m_rows * w_qkv, (w_qkv + m_rows * d + m_rows * (h + 2 * g) * hd) * b, "proj")
        op("draft_attention", 4.0 * (ctx_len * k + r_rows * k * k) * h * hd,
           (ctx_len * g * hd * 2 + m_rows * g * hd * 2 + 2 * m_rows * h * hd) * b + r_rows * 4 + ctx_pages * 4,
           "attention", "context K/V up to each row's length (its shuffled pages) once per KV head + the "
           "block's keys", {"capacity": capacity, "page": page, "mean_context": ctx_len / max(r_rows, 1)})
        op("o_proj", 2 * m_rows * h * hd * d, (h * hd * d + m_rows * h * hd + 2 * m_rows * d) * b, "proj",
           "o_proj + residual")
        op("post_norm", *_rms_cost(m_rows, d, b), "norm")
        op("mlp", 6.0 * m_rows * d * i_d, (3 * d * i_d + 3 * m_rows * d) * b, "mlp", "dense MLP + residual")
    out[("final_norm",)] = Cost("final_norm", *_rms_cost(m_rows, d, b), "norm")
    out[("lm_head",)] = Cost("lm_head", 2.0 * m_rows * d * vocab,
                             float(d * vocab * b + m_rows * d * b + m_rows * vocab * 4), "head",
                             note=f"{r_rows} x {k} rows x {vocab} vocab, fp32 logits")
    markov = cfg.markov_rank
    if markov:
        out[("markov_head",)] = Cost("markov_head", 2.0 * m_rows * markov * vocab,
                                     float(markov * vocab * b + 2 * m_rows * vocab * 4), "head",
                                     note=f"rank {markov} ({cfg.markov_head_type}) bias added to the logits")
    sample = sampling == "sample"
    out[("sampling",)] = Cost("sampling", m_rows * vocab * (8.0 if sample else 2.0),
                              float(m_rows * vocab * 4 * (2 if sample else 1)), "sample",
                              note="temperature 1, probabilities written" if sample else "greedy, no probabilities")
    if cfg.enable_confidence_head:
        f_in = cfg.confidence_input_dim
        out[("confidence_head",)] = Cost("confidence_head", 2.0 * m_rows * f_in, float((f_in + m_rows * f_in) * b),
                                         "head")
    return out


def context_costs(drafter: DSparkDrafter, inp: DraftInputs) -> dict[tuple[str, ...], Cost]:
    """``{scope path: Cost}`` of the context write after verification (``DSparkDrafter.write_context``)."""
    cfg = drafter.cfg
    c = cfg.layer_config
    d, g, hd, n_layers = c.hidden_size, c.num_key_value_heads, c.head_dim, c.num_hidden_layers
    b = jnp.dtype(drafter.dtype).itemsize
    t_ctx, m_feat = inp.features.shape[0], cfg.num_target_features
    w_kv = d * 2 * g * hd
    root = "context_write"
    return {
        (root, "positions"): Cost("ctx.positions", 0.0, float(t_ctx * 4 * 3), "context",
                                  note="packed token -> row, position"),
        (root, "feature_proj"): Cost("ctx.feature_proj", 2.0 * t_ctx * m_feat * d * d,
                                     float((m_feat * d * d + t_ctx * m_feat * d + t_ctx * d) * b), "context",
                                     note=f"fc + hidden_norm over {t_ctx} = R x (1 + K) verified positions"),
        (root, "context_kv"): Cost("ctx.context_kv", 2.0 * t_ctx * w_kv * n_layers,
                                   float((w_kv * n_layers + t_ctx * d + 2 * t_ctx * g * hd * n_layers) * b),
                                   "context", note="every draft layer's context K (normed, RoPE) and V"),
        (root, "scatter"): Cost("ctx.scatter", 0.0, float(2 * 2 * t_ctx * g * hd * n_layers * b + t_ctx * 4),
                                "context", note="the page scatter of DSparkDrafter.write_context"),
    }


# ----------------------------------------------------------------------------------------------- rows
def _match(scope: tuple[str, ...], costs: dict) -> tuple[str, ...] | None:
    """The longest prefix of ``scope`` that is an op of ``costs`` (``layer0/index_topk/eval_jaxpr`` ->
    ``layer0/index_topk``)."""
    for n in range(len(scope), 0, -1):
        if scope[:n] in costs:
            return scope[:n]
    return None


def op_row(cost: Cost, seconds: float, chip: ChipPeak, *, in_sum: bool, scope: str, kernels: int) -> dict:
    roof, bound = roofline(cost.flops, cost.bytes, chip)
    row = {
        "op": cost.name,
        "scope": scope,
        "layer": cost.layer,
        "group": cost.group,
        "in_sum": in_sum,
        "time_ms": 1e3 * seconds,
        "kernels": kernels,
        "fused": kernels == 0,
        "flops": cost.flops,
        "bytes": cost.bytes,
        "roofline_ms": 1e3 * roof,
        "bound": bound,
        "note": cost.note + ("; no kernel of its own: XLA fused it into a neighbour's" if kernels == 0 else ""),
        **cost.detail,
    }
    row["ratio"] = row["time_ms"] / row["roofline_ms"] if roof > 0 and kernels else None
    row["flag"] = bool(row["ratio"] is not None and row["ratio"] > FLAG_RATIO)
    row["achieved_TBps"] = cost.bytes / seconds / 1e12 if seconds > 0 else None
    row["achieved_TFLOPs"] = cost.flops / seconds / 1e12 if seconds > 0 else None
    return row


def scope_rows(times: op_trace.ScopeTimes, costs: dict[tuple[str, ...], Cost], chip: ChipPeak, *,
               in_sum: bool = True, root: tuple[str, ...] = (), suffix: str = "") -> list[dict]:
    """One row per op of ``costs`` (in their order) with the traced seconds of its scope (and the scopes under
    it), then a row per traced scope the cost model does not know (no roofline), then ``(unattributed)``."""
    secs = dict.fromkeys(costs, 0.0)
    kernels = dict.fromkeys(costs, 0)
    extra: dict[str, float] = {}
    for scope, s in times.scopes.items():
        if scope == (op_trace.UNATTRIBUTED,):
            continue
        inner = scope[len(root):] if scope[: len(root)] == root else scope
        key = _match(inner, costs)
        if key is None:
            extra["/".join(scope)] = extra.get("/".join(scope), 0.0) + s
        else:
            secs[key] += s
            kernels[key] += times.kernels.get(scope, 0)
    rows = []
    for key, cost in costs.items():
        c = dataclasses.replace(cost, name=cost.name + suffix)
        rows.append(op_row(c, secs[key], chip, in_sum=in_sum, scope="/".join(root + key), kernels=kernels[key]))
    for name, s in extra.items():
        rows.append(_plain_row(name, s, in_sum, "scope without a roofline model"))
    if times.unattributed_s and in_sum:
        top = ", ".join(f"{k} {1e6 * v:.1f} us" for k, v in list(times.unattributed_ops.items())[:5])
        rows.append(_plain_row(op_trace.UNATTRIBUTED, times.unattributed_s, in_sum,
                               f"kernels of instructions with no scope: {top}"))
    return rows


def _plain_row(name: str, seconds: float, in_sum: bool, note: str) -> dict:
    return {"op": name, "scope": name, "layer": "", "group": "other", "in_sum": in_sum, "time_ms": 1e3 * seconds,
            "kernels": None, "fused": False, "flops": None, "bytes": None, "roofline_ms": None, "bound": None,
            "note": note, "ratio": None, "flag": False, "achieved_TBps": None, "achieved_TFLOPs": None}


def summarise(rows: list[dict], whole: dict, times: op_trace.ScopeTimes, chip: ChipPeak) -> dict:
    part = [r for r in rows if r["in_sum"]]
    modelled = [r for r in part if r["bytes"] is not None]
    flops = sum(r["flops"] for r in modelled)
    nbytes = sum(r["bytes"] for r in modelled)
    roof, bound = roofline(flops, nbytes, chip)
    out = {
        "sum_of_ops_ms": sum(r["time_ms"] for r in part),
        "flops": flops,
        "bytes": nbytes,
        "roofline_ms": 1e3 * roof,
        "bound": bound,
        "serial_roofline_ms": sum(r["roofline_ms"] for r in modelled),
        "flagged": [r["op"] for r in part if r["flag"]],
        "fused_ops": [r["op"] for r in part if r["fused"]],
        **trace_summary(times),
        **whole,
    }
    out["gap_ms"] = out["whole_step_ms"] - out["sum_of_ops_ms"]
    out["whole_vs_roofline"] = out["whole_step_ms"] / out["roofline_ms"] if roof > 0 else None
    by_group: dict[str, float] = {}
    for r in part:
        by_group[r["group"]] = by_group.get(r["group"], 0.0) + r["time_ms"]
    out["ms_by_group"] = by_group
    return out


def trace_summary(times: op_trace.ScopeTimes) -> dict:
    """The trace's whole-run figures: span, busy time, the unattributed share."""
    return {
        "trace_platform": times.platform,
        "trace_runs": times.runs,
        "events_per_run": times.events_per_run,
        "device_span_ms": 1e3 * times.span_s,
        "device_busy_ms": 1e3 * times.busy_s,
        "kernel_sum_ms": 1e3 * times.kernel_sum_s,
        "traced_wall_ms": None if times.wall_s is None else 1e3 * times.wall_s,
        "unattributed_ms": 1e3 * times.unattributed_s,
        "unattributed_share": times.unattributed_s / times.busy_s if times.busy_s > 0 else 0.0,
        "unattributed_ops_us": {k: 1e6 * v for k, v in times.unattributed_ops.items()},
    }


# ----------------------------------------------------------------------------------------------- verify step
def verify_probe(model, cache: PagedCache, inp: VerifyInputs, *, implementation: str,
                 moe_implementation: str | None) -> tuple[dict, dict]:
    """The step's own data-dependent sizes, from :func:`minimax_jax.decode.forward_ragged_layers` on the same
    inputs: ``({sparse layer: selections int32[T, H_kv, topk]}, {MoE layer: experts hit})`` (the router of
    each MoE layer on the input its MLP read)."""
    cfg = model.cfg
    graphdef, params = nnx.split(model)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]

    def probe(params, cache, batch):
        m = nnx.merge(graphdef, params)
        _, layers, _ = forward_ragged_layers(m, cache, batch, implementation=implementation,
                                             moe_implementation=moe_implementation)
        return ({i: layers[i].selections for i in cfg.sparse_layer_ids},
                {i: m.layers[i].mlp.gate(layers[i].mlp_input)[1] for i in moe_layers})

    compiled, _ = _compile(jax.jit(probe), params, cache, inp.batch)
    sel, experts = compiled(params, cache, inp.batch)
    n = int(np.asarray(inp.batch.query_start_loc)[-1])  # packed tokens (the rest is padding: routed nowhere)
    return ({i: np.asarray(s) for i, s in sel.items()},
            {i: int(np.unique(np.asarray(e)[:n]).size) for i, e in experts.items()})


def profile_verify(
    model,
    cache: PagedCache,
    shape: tuple[int, int],
    *,
    context: int,
    implementation: str,
    moe_implementation: str | None,
    chip: ChipPeak,
    warmup: int,
    iters: int,
    trace_calls: int,
    seed: int,
    log=print,
) -> tuple[dict, PagedCache]:
    """Profile one verify shape: ``(profile, the cache)`` (the step donates the cache it is given on GPU)."""
    cfg = model.cfg
    r_rows, q_len = shape
    inp = make_verify_inputs(cfg, num_requests=r_rows, q_len=q_len, context=context, num_pages=cache.num_pages,
                             seed=seed)
    name = f"{r_rows}x{q_len}"
    log(f"# verify {name}: {r_rows} requests x {q_len} tokens at {context} context, MoE implementation "
        f"{moe_implementation or 'as the attention kernels'}")
    step = make_step_fn(model, implementation=implementation, moe_implementation=moe_implementation,
                        donate_cache=_donate())
    params = nnx.state(model)
    compiled, compile_s = _compile(step, params, cache, inp.batch, inp.logit_rows)
    t0 = time.perf_counter()
    selections, experts_hit = verify_probe(model, cache, inp, implementation=implementation,
                                           moe_implementation=moe_implementation)
    probe_s = time.perf_counter() - t0
    state = {"cache": cache}

    def call():
        logits, _, state["cache"] = compiled(params, state["cache"], inp.batch, inp.logit_rows)
        return logits

    finite = bool(jnp.all(jnp.isfinite(call())))
    t = bench_common.time_calls(call, warmup=warmup, iters=iters)
    times = op_trace.profile_compiled(compiled, call, calls=trace_calls)
    costs = verify_costs(cfg, inp, dtype=cache.k[0].dtype, selections=selections, experts_hit=experts_hit)
    rows = scope_rows(times, costs, chip)
    for r in rows:
        log(_one_line(r))
    whole = {
        "whole_step_ms": 1e3 * t["median"],
        "whole_step_min_ms": 1e3 * t["min"],
        "whole_step_compile_s": compile_s,
        "logits_finite": finite,
        "moe_implementation_applied_to_step": True,
    }
    summary = summarise(rows, whole, times, chip)
    log(f"# verify {name}: whole step {summary['whole_step_ms']:.3f} ms, device span "
        f"{summary['device_span_ms']:.3f} ms, sum of ops {summary['sum_of_ops_ms']:.3f} ms "
        f"({100 * summary['unattributed_share']:.1f}% unattributed), roofline {summary['roofline_ms']:.3f} ms")
    prof = {
        "step": "verify",
        "shape": name,
        "num_requests": r_rows,
        "q_len": q_len,
        "context": context,
        "tokens": r_rows * q_len,
        "implementation": implementation,
        "kernel_implementation": choose_implementation(implementation, cfg, page_size=cache.page_size,
                                                       dtype=cache.k[0].dtype),
        "moe_implementation": moe_implementation,
        "logit_rows": int(inp.logit_rows.shape[0]),
        "probe_s": probe_s,
        "summary": summary,
        "rows": rows,
    }
    return prof, state["cache"]


# ----------------------------------------------------------------------------------------------- draft step
def make_draft_cache(drafter: DSparkDrafter, inp: DraftInputs, capacity: int, *, seed: int) -> DraftCache:
    """The draft cache: random pages ``k, v [L, H_kv, P, page, D]``, the inputs' lengths and shuffled tables."""
    c = drafter.cfg.layer_config
    page, _, num_pages = draft_pages(drafter, inp.anchors.shape[0], capacity)
    shape = (c.num_hidden_layers, c.num_key_value_heads, num_pages, page, c.head_dim)
    k, v = normal_arrays([(shape, drafter.dtype)] * 2, seed + 3)
    return DraftCache(k, v, inp.lengths, inp.block_tables)


def _traced(compiled, call, *, warmup: int, iters: int, trace_calls: int) -> tuple[dict, op_trace.ScopeTimes]:
    t = bench_common.time_calls(call, warmup=warmup, iters=iters)
    return t, op_trace.profile_compiled(compiled, call, calls=trace_calls)


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
    trace_calls: int,
    seed: int,
    log=print,
) -> dict:
    cfg = drafter.cfg
    n_layers = cfg.num_draft_layers
    name = f"R{num_rows}xK{cfg.block_size}xL{n_layers}"
    log(f"# draft {name}: {num_rows} rows, K = {cfg.block_size}, {n_layers} draft layers, {context} context "
        f"(capacity {capacity}), {sampling}")
    inp = make_draft_inputs(drafter, num_rows, context, capacity, sampling=sampling, seed=seed)
    cache = make_draft_cache(drafter, inp, capacity, seed=seed)
    graphdef, dstate = nnx.split(drafter)
    sample = sampling == "sample"
    costs = draft_costs(drafter, inp, page=cache.page_size, sampling=sampling)
    rows, wholes, tokens0, times0 = [], {}, None, None
    for impl in attention_impls:

        def whole(st, cache_, anchors, pos, temps, keys, impl=impl):  # as an engine calls it: inside its jit
            return draft_step(graphdef, st, cache_, anchors, pos, temps, keys, return_probs=sample, validate=False,
                              implementation=impl)

        args = (dstate, cache, inp.anchors, inp.anchor_positions, inp.temperature, inp.keys)
        compiled, compile_s = _compile(jax.jit(whole), *args)
        out = compiled(*args)
        tokens = np.asarray(out.tokens)
        t, times = _traced(compiled, lambda compiled=compiled, args=args: compiled(*args).tokens, warmup=warmup,
                           iters=iters, trace_calls=trace_calls)
        named = {k: dataclasses.replace(c, name=f"{c.name}[{impl}]") if k[-1] == "draft_attention" else c
                 for k, c in costs.items()}
        if tokens0 is None:  # the first implementation is the step
            tokens0, times0 = tokens, times
            rows += scope_rows(times, named, chip)
            wholes["whole_draft_step_compile_s"] = compile_s
        else:  # an alternative: its attention rows beside the step
            rows += [r for r in scope_rows(times, {k: c for k, c in named.items() if k[-1] == "draft_attention"},
                                           chip, in_sum=False)]
        wholes[f"whole_draft_step[{impl}]_ms"] = 1e3 * t["median"]
        wholes[f"device_span[{impl}]_ms"] = 1e3 * times.span_s
        wholes[f"tokens_match[{impl}]"] = float(np.mean(tokens == tokens0))
        log(f"  whole_draft_step[{impl}]  {1e3 * t['median']:10.4f} ms (device span {1e3 * times.span_s:.4f} ms)")
    wholes["whole_step_ms"] = wholes["whole_draft_step_ms"] = wholes[f"whole_draft_step[{attention_impls[0]}]_ms"]
    wholes["tokens_finite"] = bool(np.all((tokens0 >= 0) & (tokens0 < cfg.layer_config.vocab_size)))

    # beside the step: the context write after verification (only the K/V pages are donated: every call sees
    # the same lengths and tables)
    def append(st, k, v, lengths, tables, feats, qsl, start, num_new):
        out = append_context_packed_step(graphdef, st, DraftCache(k, v, lengths, tables), feats, qsl, start,
                                         num_new, validate=False)
        return out.k, out.v

    pages = {"k": cache.k, "v": cache.v}
    fixed = (inp.lengths, inp.block_tables, inp.features, inp.feature_qsl, inp.start, inp.num_new)
    compiled, _ = _compile(jax.jit(append, donate_argnums=(1, 2) if _donate() else ()), dstate, cache.k, cache.v,
                           *fixed)

    def call_append():
        pages["k"], pages["v"] = compiled(dstate, pages["k"], pages["v"], *fixed)
        return pages["k"]

    t, times = _traced(compiled, call_append, warmup=warmup, iters=iters, trace_calls=trace_calls)
    ctx_rows = scope_rows(times, context_costs(drafter, inp), chip, in_sum=False)
    rows += ctx_rows
    wholes["whole_append_context_ms"] = 1e3 * t["median"]
    wholes["append_context_device_span_ms"] = 1e3 * times.span_s
    for r in rows:
        log(_one_line(r))
    summary = summarise(rows, wholes, times0, chip)
    summary["context_write_sum_ms"] = sum(r["time_ms"] for r in ctx_rows)
    summary["context_write_roofline_ms"] = sum(r["roofline_ms"] or 0.0 for r in ctx_rows)
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
    log(f"# draft {name}: draft_step {wholes['whole_draft_step_ms']:.3f} ms (device span "
        f"{summary['device_span_ms']:.3f} ms), sum of ops {summary['sum_of_ops_ms']:.3f} ms, floor "
        f"{summary['floor']['serial_ms']:.3f} ms serial; append_context {wholes['whole_append_context_ms']:.3f} ms")
    del cache
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
        "summary": summary,
        "rows": rows,
    }


# ----------------------------------------------------------------------------------------------- engine step
def _prefixed(costs: dict, root: str, prefix: str) -> dict:
    return {(root, *k): dataclasses.replace(c, name=f"{prefix}{c.name}") for k, c in costs.items()}


def profile_engine(
    model,
    num_rows: int,
    *,
    context: int,
    num_draft_layers: int,
    block_size: int,
    num_features: int,
    implementation: str,
    chip: ChipPeak,
    warmup: int,
    iters: int,
    trace_calls: int,
    seed: int,
    log=print,
) -> dict:
    """One speculative step of the engine (``spec_decode.step.make_step_fn``, greedy, ``mode="fixed"``, every
    row drafting and verifying K tokens, ``commit=False`` so every call sees the same lengths), traced: its parts
    (``install_tables``, ``draft``, ``pack``, ``verify``, ``rejection``, ``bookkeeping``) and, inside ``draft``
    and ``verify``, the drafter's and the target's ops with their rooflines. The verify rows' data-dependent
    sizes come from a probe batch of the same shape (the anchor and random draft ids at each row's context)."""
    from spec_decode.step import StepConfig, StepPlan, init_state
    from spec_decode.step import make_step_fn as make_engine_step

    cfg = model.cfg
    dtype = model.dtype
    k = block_size
    dcfg = DSparkConfig.for_target(cfg, mask_token_id=cfg.vocab_size - 1, block_size=k,
                                   num_draft_layers=num_draft_layers,
                                   target_layer_ids=tuple(range(min(num_features, cfg.num_hidden_layers))),
                                   enable_confidence_head=True)
    drafter = make_random(DSparkDrafter, dcfg, embed_tokens=model.embed_tokens[...], lm_head=model.lm_head[...],
                          dtype=dtype, seed=seed + 11)
    page = page_size_for(cfg)
    max_model_len = context + 1 + k + 16
    nb = -(-max_model_len // page)
    num_pages = num_rows * nb
    name = f"R{num_rows}xK{k}xL{num_draft_layers}"
    log(f"# engine step {name}: {num_rows} decode rows at {context} context, K = {k} drafted and verified, "
        f"{num_draft_layers} draft layers")
    state = init_state(model, drafter, num_slots=num_rows, num_pages=num_pages, max_model_len=max_model_len,
                       num_speculative_tokens=k, use_estimator=False)
    rng = np.random.default_rng(seed + 12)
    tables = jnp.asarray(rng.permutation(num_pages).reshape(num_rows, nb), jnp.int32)
    dc = state.draft_cache
    dk, dv = normal_arrays([(dc.k.shape, dc.k.dtype)] * 2, seed + 13)
    lengths = jnp.full((num_rows,), context, jnp.int32)
    state = dataclasses.replace(
        state, cache=make_paged_cache(cfg, num_pages, dtype=dtype, seed=seed),
        draft_cache=dataclasses.replace(dc, k=dk, v=dv, lengths=lengths), num_cached=lengths,
        last_token=jnp.asarray(rng.integers(0, cfg.vocab_size, num_rows), jnp.int32))
    r, t = num_rows, num_rows * (1 + k)

    def z(dt=np.int32):
        return np.zeros(r, dt)

    plan = StepPlan(rows=np.arange(r, dtype=np.int32), prefill_tokens=np.zeros(t, np.int32), prefill_len=z(),
                    prefill_start=z(), prefill_last=z(bool), resume_token=np.full(r, -1, np.int32),
                    block_tables=np.asarray(tables), scheduled=np.full(r, k, np.int32),
                    budget=np.asarray(r * k, np.int32), temperature=z(np.float32), top_k=z(),
                    top_p=np.ones(r, np.float32), seed=np.arange(r, dtype=np.int32),
                    limit=np.full(r, max_model_len, np.int32), prefill_emitted=z(),
                    stop_ids=np.full((r, 1), -1, np.int32), commit=np.asarray(False))
    plan = jax.tree.map(jnp.asarray, plan)
    config = StepConfig(num_speculative_tokens=k, mode="fixed", num_logit_rows=t, implementation=implementation,
                        capture_layers=dcfg.target_layer_ids)
    step = jax.jit(make_engine_step(model, drafter, config), donate_argnums=(2,) if _donate() else ())
    tparams, dparams = nnx.state(model), nnx.state(drafter)
    # the verify batch's shape for the roofline: every row's anchor + K drafts at context + 1 + K
    v_inp = make_verify_inputs(cfg, num_requests=r, q_len=1 + k, context=context + 1 + k, num_pages=num_pages,
                               seed=seed)
    v_inp = dataclasses.replace(v_inp, batch=dataclasses.replace(v_inp.batch, block_tables=tables))
    selections, experts_hit = verify_probe(model, state.cache, v_inp, implementation=implementation,
                                           moe_implementation=None)
    compiled, compile_s = _compile(step, tparams, dparams, state, plan)
    holder = {"state": state}

    def call():
        holder["state"], out = compiled(tparams, dparams, holder["state"], plan)
        return out.tokens

    tokens = np.asarray(call())
    t_whole, times = _traced(compiled, call, warmup=warmup, iters=iters, trace_calls=trace_calls)
    d_inp = dataclasses.replace(make_draft_inputs(drafter, r, context, nb * page, sampling="greedy", seed=seed),
                                block_tables=tables)
    ctx = dataclasses.replace(d_inp, features=jax.ShapeDtypeStruct((t, dcfg.feature_size), dtype))
    costs = {
        ("install_tables",): Cost("install_tables", 0.0, float(3 * r * nb * 4), "engine",
                                  note="the step's block tables into its slots' draft-cache rows (int32)"),
        **_prefixed(draft_costs(drafter, d_inp, page=page, sampling="greedy"), "draft", "draft."),
        **_prefixed(verify_costs(cfg, v_inp, dtype=dtype, selections=selections, experts_hit=experts_hit),
                    "verify", "verify."),
        # the step computes the write's positions itself (bookkeeping), then DSparkDrafter.write_context
        **{("bookkeeping", *key): c for key, c in context_costs(drafter, ctx).items() if key[-1] != "positions"},
    }
    rows = scope_rows(times, costs, chip)
    for row in rows:
        log(_one_line(row))
    parts = ("install_tables", "draft", "pack", "verify", "rejection", "bookkeeping", "logprobs")
    whole = {"whole_step_ms": 1e3 * t_whole["median"], "whole_step_min_ms": 1e3 * t_whole["min"],
             "whole_step_compile_s": compile_s,
             "tokens_finite": bool(np.all((tokens >= -1) & (tokens < cfg.vocab_size))),
             "ms_by_part": {p: 1e3 * times.total((p,)) for p in parts if times.total((p,)) > 0}}
    summary = summarise(rows, whole, times, chip)
    log(f"# engine step {name}: whole step {summary['whole_step_ms']:.3f} ms, device span "
        f"{summary['device_span_ms']:.3f} ms; by part (ms) "
        + ", ".join(f"{p} {v:.3f}" for p, v in summary["ms_by_part"].items()))
    del state, drafter
    gc.collect()
    return {
        "step": "engine",
        "shape": name,
        "num_rows": r,
        "block_size": k,
        "draft_layers": num_draft_layers,
        "context": context,
        "tokens": t,
        "implementation": implementation,
        "summary": summary,
        "rows": rows,
    }


def draft_attention_impls(spec: str) -> list[str]:
    """``--draft-attention``: a comma list of ``pallas`` / ``reference``; ``auto`` is both on a GPU (the
    kernel first: the one in the step's sum) and the jnp path alone elsewhere."""
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item not in ("auto", "pallas", "reference"):
            raise ValueError(f"draft attention implementation must be auto, pallas or reference, got {item!r}")
        out += (["pallas", "reference"] if on_gpu() else ["reference"]) if item == "auto" else [item]
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------------------------------- output
COLUMNS = ["op", "time_ms", "roofline_ms", "ratio", "flag", "bound", "GB", "GFLOP", "TBps", "TFLOPs", "kernels"]


def table_rows(profile: dict) -> list[dict]:
    out = []
    for r in profile["rows"]:
        out.append({
            "op": r["op"] + ("" if r["in_sum"] else " *"),
            "time_ms": r["time_ms"],
            "roofline_ms": r["roofline_ms"],
            "ratio": r["ratio"],
            "flag": "FLAG" if r["flag"] else "",
            "bound": r["bound"],
            "GB": None if r["bytes"] is None else r["bytes"] / 1e9,
            "GFLOP": None if r["flops"] is None else r["flops"] / 1e9,
            "TBps": r["achieved_TBps"],
            "TFLOPs": r["achieved_TFLOPs"],
            "kernels": r["kernels"],
        })
    s = profile["summary"]
    out.append({
        "op": "= sum of ops",
        "time_ms": s["sum_of_ops_ms"],
        "roofline_ms": s["roofline_ms"],
        "ratio": s["sum_of_ops_ms"] / s["roofline_ms"] if s["roofline_ms"] else None,
        "bound": s["bound"],
        "GB": s["bytes"] / 1e9,
        "GFLOP": s["flops"] / 1e9,
    })
    out.append({"op": "= device span", "time_ms": s["device_span_ms"], "roofline_ms": s["roofline_ms"]})
    out.append({"op": "= whole step", "time_ms": s.get("whole_step_ms"), "roofline_ms": s["roofline_ms"],
                "ratio": s.get("whole_vs_roofline")})
    return out


def format_table(rows: list[dict], columns=COLUMNS) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _one_line(row: dict) -> str:
    ratio = "" if row["ratio"] is None else f" x{row['ratio']:.2f}"
    roof = "" if row["roofline_ms"] is None else f"  roofline {row['roofline_ms']:9.4f} ms"
    flag = " FLAG" if row["flag"] else ""
    return f"  {row['op']:<40} {row['time_ms']:10.4f} ms{roof}{ratio}{flag}"


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
    env = bench_common.environment()
    env["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    env["python"] = sys.version.split()[0]
    return env


# ----------------------------------------------------------------------------------------------- main
def run(args, log=print) -> dict:
    """Profile what ``args`` (:func:`parse_args`) asks for; returns the JSON payload (also written to
    ``args.out``)."""
    chip = PEAKS[args.chip]
    dtype = jnp.dtype(args.dtype)
    layers = parse_layers(args.layers)
    cfg = target_config(layers, tiny=args.tiny)
    shapes = parse_shapes(args.shapes) if not args.skip_verify else []
    draft_rows = [int(s) for s in args.draft_rows.split(",") if s] if not args.skip_draft else []
    draft_layers = [int(s) for s in args.draft_layers.split(",") if s]
    moe_impls = [s for s in args.moe_implementation.split(",") if s] or [None]
    impls = draft_attention_impls(args.draft_attention)
    env = environment()
    env["dispatch_ms"] = 1e3 * dispatch_floor()
    result = {
        "environment": env,
        "chip": dataclasses.asdict(chip),
        "flag_ratio": FLAG_RATIO,
        "method": "trace",  # per-op times from a profiler trace of the whole step (issue 23)
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
            "trace_calls": args.trace_calls,
        },
        "profiles": [],
    }
    log(f"# {env}; chip constants {chip.name}: HBM {chip.hbm_bytes_per_s / 1e12:.2f} TB/s, bf16 "
        f"{chip.bf16_flops_per_s / 1e12:.0f} TFLOP/s")

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(_jsonable(result), f, indent=1)

    t0 = time.perf_counter()
    model = make_target(cfg, dtype=dtype, seed=args.seed)
    jax.block_until_ready(nnx.state(model))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    log(f"# target slice: {len(layers)} layers, {n_params / 1e9:.2f}B parameters, made in "
        f"{time.perf_counter() - t0:.1f} s")
    common = dict(chip=chip, warmup=args.warmup, iters=args.iters, trace_calls=args.trace_calls, seed=args.seed,
                  log=log)
    if shapes:
        num_pages = max(r for r, _ in shapes) * -(-args.context // cfg.index_block_size)
        cache = make_paged_cache(cfg, num_pages, dtype=dtype, seed=args.seed)
        for shape in shapes:
            for moe_impl in moe_impls:
                prof, cache = profile_verify(model, cache, shape, context=args.context,
                                             implementation=args.implementation, moe_implementation=moe_impl,
                                             **common)
                result["profiles"].append(prof)
                log(format_table(table_rows(prof)))
                save()
                gc.collect()
        del cache
        gc.collect()
    engine_rows = [int(x) for x in args.engine_rows.split(",") if x]
    for r in engine_rows:
        prof = profile_engine(model, r, context=args.context, num_draft_layers=draft_layers[0],
                              block_size=args.draft_k, num_features=args.draft_features,
                              implementation=args.implementation, **common)
        result["profiles"].append(prof)
        log(format_table(table_rows(prof)))
        save()
        gc.collect()
    capacity = args.context + args.capacity_slack
    for n_layers in draft_layers if draft_rows else []:
        drafter = make_drafter(cfg, model, num_layers=n_layers, block_size=args.draft_k,
                               num_features=args.draft_features, markov_rank=args.markov_rank,
                               markov_type=args.markov_type, confidence=not args.no_confidence_head, dtype=dtype,
                               seed=args.seed + n_layers)
        for r in draft_rows:
            prof = profile_draft(drafter, r, context=args.context, capacity=capacity, attention_impls=impls,
                                 sampling=args.draft_sampling, **common)
            result["profiles"].append(prof)
            log(format_table(table_rows(prof)))
            save()
        del drafter
        gc.collect()
    save()
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny config and shapes: a CPU smoke run of every path")
    p.add_argument("--shapes", default=None, help=f"verify shapes RxQ (default {M3_SHAPES}; tiny {TINY_SHAPES})")
    p.add_argument("--layers", default="dense,msa", help="target layers: dense, msa, or ATTN+MLP (full+moe ...)")
    p.add_argument("--context", type=int, default=None,
                   help=f"tokens per request (default {bench_shapes.CONTEXT}; tiny {bench_shapes.TINY_CONTEXT})")
    p.add_argument("--implementation", default="auto", help="attention / indexer kernels: auto, pallas, reference")
    p.add_argument("--moe-implementation", default="",
                   help="comma list of MoE implementations to profile (forward_ragged's moe_implementation)")
    p.add_argument("--draft-rows", default=None,
                   help=f"draft rows R (default {','.join(map(str, bench_shapes.DRAFT_ROWS))}; tiny 4)")
    p.add_argument("--draft-layers", default=None, help="draft layer counts (default 1,5; tiny 1,2)")
    p.add_argument("--draft-k", type=int, default=bench_shapes.DRAFT_BLOCK, help="draft block size K")
    p.add_argument("--draft-features", type=int, default=5, help="target feature layers the drafter reads")
    p.add_argument("--draft-attention", default="auto",
                   help="comma list of draft attention implementations, pallas / reference (the first is the "
                   "step's; the others add their attention rows beside it); auto: pallas,reference on a GPU, "
                   "reference elsewhere")
    p.add_argument("--draft-sampling", choices=("greedy", "sample"), default="greedy")
    p.add_argument("--markov-rank", type=int, default=0)
    p.add_argument("--markov-type", default="vanilla")
    p.add_argument("--no-confidence-head", action="store_true")
    p.add_argument("--capacity-slack", type=int, default=16, help="draft cache capacity = context + this")
    p.add_argument("--engine-rows", default="",
                   help="decode rows of an engine-step profile (spec_decode/step.py, K drafted and verified per "
                   "row, the first --draft-layers count); empty: none")
    p.add_argument("--skip-verify", action="store_true")
    p.add_argument("--skip-draft", action="store_true")
    p.add_argument("--chip", choices=sorted(PEAKS), default=None,
                   help=f"roofline constants (pallas_kernels.tuning.PEAKS; default the device's, else {DEFAULT_PEAK})")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per step (default 2; tiny 1)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per step (default 10; tiny 2)")
    p.add_argument("--trace-calls", type=int, default=None, help="traced calls per step (default 5; tiny 2)")
    p.add_argument("--keep-command-buffers", action="store_true",
                   help="leave XLA's CUDA graphs on (the per-op rows are then one unattributed command buffer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON here")
    return p


def parse_args(argv=None):
    a = parser().parse_args(argv)
    tiny = a.tiny
    COMPILER_OPTIONS.clear()
    if tiny and jax.default_backend() == "cpu":
        COMPILER_OPTIONS.update(FAST_CPU_COMPILE)
    a.chip = a.chip or detect_peak() or DEFAULT_PEAK
    a.shapes = a.shapes or (TINY_SHAPES if tiny else M3_SHAPES)
    a.context = a.context or (bench_shapes.TINY_CONTEXT if tiny else bench_shapes.CONTEXT)
    a.draft_rows = a.draft_rows or ",".join(map(str, bench_shapes.TINY_DRAFT_ROWS if tiny else bench_shapes.DRAFT_ROWS))
    a.draft_layers = a.draft_layers or ("1,2" if tiny else "1,5")
    a.warmup = a.warmup if a.warmup is not None else (1 if tiny else 2)
    a.iters = a.iters if a.iters is not None else (2 if tiny else 10)
    a.trace_calls = a.trace_calls if a.trace_calls is not None else (2 if tiny else 5)
    if a.trace_calls < 1:
        raise ValueError(f"--trace-calls must be >= 1, got {a.trace_calls}")
    if tiny and a.dtype == "bfloat16":
        a.dtype = "float32"
    return a


def main(argv=None) -> dict:
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    # the GPU's program on any backend: on a CPU a rolled loop's ops would lose their name scopes in the trace
    with loops_unrolled():
        return run(parse_args(argv))


if __name__ == "__main__":
    main()
