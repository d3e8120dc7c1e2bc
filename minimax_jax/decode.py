"""The incremental (paged, ragged) forward of MiniMax-M3: prefill chunks and verify steps of 1..1+K tokens.

One call processes a packed batch of tokens from many requests (docs/ARCHITECTURE.md):

* ``input_ids: int32[T]`` packed tokens; slots at or beyond ``query_start_loc[R]`` are padding;
* ``query_start_loc: int32[R + 1]``, ``seq_lens: int32[R]`` (lengths including this step's tokens; 0 for a
  padding row), ``block_tables: int32[R, max_blocks]``.

Per layer the new tokens' K, V (and index-K on sparse layers) are written into the paged caches *before* any
attention or indexing runs, so a draft token sees the drafts before it. Sparse layers then run
``ragged_index_topk`` and ``ragged_sparse_attention``; dense layers ``ragged_paged_attention``, with the layer's
sliding window (``cfg.layer_window``) where the config gives one (the pages stay allocated; the kernels skip
the pages before a window). The request of a
token and its position come from the device-side metadata helpers only (binary search over
``query_start_loc``), never from host lengths.

``implementation`` selects the kernels: ``"pallas"`` (compiled Triton on a GPU, Pallas interpret mode on CPU),
``"reference"`` (the plain-jnp ``*_reference`` of each kernel) or ``"auto"`` (the default: the compiled Pallas
kernels on a GPU where every kernel the model runs ``supports`` its shapes, otherwise the references; see
:func:`choose_implementation`). MoE layers get the same name and resolve ``"auto"`` on their own
(``pallas_kernels.grouped_gemm``: the grouped-GEMM kernel on a GPU, else the dropless XLA fallback;
``"reference"`` is ``lax.ragged_dot``). Interpret mode is for tests, far too slow to serve from: only an
explicit ``"pallas"`` on CPU or ``interpret=True`` runs it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from minimax_jax.cache import PagedCache, check_cache, slot_mapping, write_tokens
from minimax_jax.config import MiniMaxM3Config
from minimax_jax.model import MiniMaxM3ForCausalLM
from minimax_jax.sharding import on_local_heads
from pallas_kernels import indexer, paged_attention, sparse_attention
from pallas_kernels.indexer import ragged_index_topk
from pallas_kernels.metadata import token_positions, token_to_request
from pallas_kernels.paged_attention import ragged_paged_attention
from pallas_kernels.platform import resolve_auto
from pallas_kernels.sparse_attention import ragged_sparse_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RaggedBatch:
    """Device metadata of one packed step. ``R`` rows (padding rows included), ``T`` packed slots."""

    input_ids: jax.Array        # int32[T]
    query_start_loc: jax.Array  # int32[R + 1]
    seq_lens: jax.Array         # int32[R]
    block_tables: jax.Array     # int32[R, max_blocks]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]


def pack_batch(allocator, rows, chunks, num_tokens: int) -> RaggedBatch:
    """Host side: pack this step's new tokens into a :class:`RaggedBatch` of ``num_tokens`` slots.

    ``rows`` lists a request id per batch row (``None`` for a zero-length padding row); ``chunks`` maps a request
    id to ``(start, tokens)``: the step's tokens at positions ``start..``. A listed request without a chunk is an
    idle row (length 0 this step, its current length as ``seq_len``). ``allocator.ensure`` grows each request's
    pages first, so the block tables cover the new tokens. Slots past the packed tokens are padding.
    """
    ids, qsl, seq_lens = [], [0], []
    for rid in rows:
        if rid is None or rid not in chunks:
            qsl.append(qsl[-1])
            seq_lens.append(0 if rid is None else allocator.lengths.get(rid, 0))
            continue
        start, toks = chunks[rid]
        allocator.ensure(rid, start + len(toks))
        ids.extend(int(t) for t in toks)
        qsl.append(qsl[-1] + len(toks))
        seq_lens.append(start + len(toks))
    if len(ids) > num_tokens:
        raise ValueError(f"{len(ids)} new tokens do not fit the {num_tokens}-slot batch")
    ids += [0] * (num_tokens - len(ids))
    return RaggedBatch(jnp.asarray(ids, jnp.int32), jnp.asarray(qsl, jnp.int32), jnp.asarray(seq_lens, jnp.int32),
                       jnp.asarray(allocator.block_table(rows)))


def unpack_rows(rows, chunks, packed) -> dict:
    """The inverse of :func:`pack_batch`'s packing: ``{request id: packed[its slots]}`` for every request of
    ``rows`` with a chunk this step (``packed`` has one leading entry per packed slot, e.g. logits ``[T, V]``)."""
    out, off = {}, 0
    for rid in rows:
        if rid is None or rid not in chunks:
            continue
        n = len(chunks[rid][1])
        out[rid] = packed[off: off + n]
        off += n
    return out


def check_batch(batch: RaggedBatch, *, vocab_size: int | None = None, num_pages: int | None = None,
                page_size: int | None = None, max_positions: int | None = None) -> None:
    """Static shape/dtype checks (and value checks when the arrays are concrete), with errors naming the field."""
    t, r = batch.input_ids.shape, batch.seq_lens.shape
    if len(t) != 1:
        raise ValueError(f"input_ids must be int32[T], got shape {t}")
    if len(r) != 1:
        raise ValueError(f"seq_lens must be int32[R], got shape {r}")
    if batch.query_start_loc.shape != (r[0] + 1,):
        raise ValueError(f"query_start_loc must be int32[R + 1] = [{r[0] + 1}], got {batch.query_start_loc.shape}")
    if batch.block_tables.ndim != 2 or batch.block_tables.shape[0] != r[0]:
        raise ValueError(f"block_tables must be int32[R={r[0]}, max_blocks], got {batch.block_tables.shape}")
    for name in ("input_ids", "query_start_loc", "seq_lens", "block_tables"):
        if not jnp.issubdtype(getattr(batch, name).dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {getattr(batch, name).dtype}")
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(batch)):
        return
    import numpy as np

    qsl = np.asarray(batch.query_start_loc)
    lens = np.diff(qsl)
    seq = np.asarray(batch.seq_lens)
    if qsl[0] != 0 or (lens < 0).any() or qsl[-1] > t[0]:
        raise ValueError(f"query_start_loc must start at 0, be non-decreasing and end <= T={t[0]}, got {qsl}")
    if (seq < lens).any():
        bad = int(np.argmax(seq < lens))
        raise ValueError(f"seq_lens[{bad}]={seq[bad]} is shorter than the row's {lens[bad]} new tokens")
    if max_positions is not None and seq.size and seq.max() > max_positions:
        bad = int(np.argmax(seq))
        raise ValueError(f"seq_lens[{bad}]={seq[bad]} exceeds the model's {max_positions} positions "
                         f"(max_position_embeddings)")
    if page_size is not None:
        nb = -(-seq // page_size)
        if (nb > batch.block_tables.shape[1]).any():
            raise ValueError(f"a row needs {nb.max()} blocks but block_tables holds {batch.block_tables.shape[1]}")
        if num_pages is not None:
            bt = np.asarray(batch.block_tables)
            for row in range(r[0]):
                used = bt[row, : nb[row]]
                if used.size and (used.min() < 0 or used.max() >= num_pages):
                    raise ValueError(f"block_tables[{row}] names a page outside [0, {num_pages})")
    if vocab_size is not None:
        ids = np.asarray(batch.input_ids)[: qsl[-1]]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ValueError(f"input_ids holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def choose_implementation(implementation: str, cfg: MiniMaxM3Config, *, page_size: int, dtype,
                          interpret: bool | None = None) -> str:
    """Resolve ``"auto"`` to ``"pallas"`` or ``"reference"`` (``"pallas"`` and ``"reference"`` pass through).

    ``"auto"``: with ``interpret=True``, Pallas interpret mode (tests). Otherwise the compiled Pallas kernels when
    the default device is a GPU and every kernel the model runs (``ragged_paged_attention`` on dense layers,
    ``ragged_index_topk`` and ``ragged_sparse_attention`` on sparse ones) ``supports`` the config's shapes
    (``page_size``, head dims, heads, top-k) and the cache ``dtype`` on this chip; else the plain-jnp references
    (on CPU, or shapes a kernel cannot compile).
    """
    def supported() -> bool:
        heads = {"num_q_heads": cfg.num_attention_heads, "num_kv_heads": cfg.num_key_value_heads}
        ok = len(cfg.sparse_layer_ids) == cfg.num_hidden_layers or paged_attention.supports(
            page_size=page_size, head_dim=cfg.head_dim, dtype=dtype, **heads)
        if cfg.sparse_layer_ids:
            ok = ok and indexer.supports(page_size=page_size, index_head_dim=cfg.index_head_dim,
                                         num_index_heads=cfg.index_n_heads, dtype=dtype)
            ok = ok and sparse_attention.supports(page_size=page_size, head_dim=cfg.head_dim,
                                                  topk=cfg.index_topk_blocks, dtype=dtype, **heads)
        return ok

    return resolve_auto(implementation, interpret=interpret, supported=supported)


def forward_ragged(
    model: MiniMaxM3ForCausalLM,
    cache: PagedCache,
    batch: RaggedBatch,
    *,
    capture_layers: Sequence[int] = (),
    implementation: str = "auto",
    interpret: bool | None = None,
    moe_implementation: str | None = None,
    mesh=None,
) -> tuple[jax.Array, list[jax.Array], PagedCache]:
    """Run the packed tokens through the model, writing their K/V/index-K into ``cache``.

    ``implementation`` picks the attention and indexer kernels and, unless ``moe_implementation`` names another
    (``"auto" | "pallas" | "xla" | "reference"``, ``pallas_kernels.grouped_gemm``), the MoE experts' products.

    Returns ``(hidden [T, d], captured [T, d] per capture layer, new cache)``. ``hidden`` is the residual stream
    after the last layer (before the final norm); ``model.logits(hidden[rows])`` gives the logits of the rows that
    need them (bounded verify logits: never all ``T x V`` unless asked). Padding slots produce garbage-free zeros
    in attention and never write the caches.

    ``mesh`` (a ``jax.sharding.Mesh`` with a ``"tensor"`` axis, the model's heads stored for it: docs/PARALLELISM.md):
    the attention and indexer kernels run per device inside ``shard_map``, on the device's own query, KV and index
    heads (the GQA ratio is the same on every device), with the ragged metadata replicated; XLA partitions the rest.

    The body is :func:`forward_ragged_layers` (which also returns each layer's selections and MLP input); every
    op runs under a ``jax.named_scope`` (``metadata``, ``embed``, ``layer{i}/qkv_proj`` ...: docs/BENCHMARKS.md),
    metadata only, which ``scripts/profile_step.py`` reads back from a profiler trace.
    """
    bad = [i for i in capture_layers if not 0 <= i < model.cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"capture_layers {bad} are not layers of this {model.cfg.num_hidden_layers}-layer model "
                         f"(the embedding output, -1, is the caller's: model.embed(input_ids))")
    x, layers, cache = forward_ragged_layers(model, cache, batch, implementation=implementation, interpret=interpret,
                                             moe_implementation=moe_implementation, mesh=mesh)
    return x, [layers[i].x for i in capture_layers], cache


@dataclasses.dataclass(frozen=True)
class LayerOutput:
    """What one layer of :func:`forward_ragged_layers` produced: ``x [T, d]`` the residual stream after it;
    ``selections int32[T, H_kv, topk]`` the indexer's block picks (sparse layers, else None); ``mlp_input [T, d]``
    what its MLP (the MoE's router) read. Unused fields cost nothing under ``jit`` (dead code)."""

    x: jax.Array
    selections: jax.Array | None
    mlp_input: jax.Array


def forward_ragged_layers(model: MiniMaxM3ForCausalLM, cache: PagedCache, batch: RaggedBatch, *,
                          implementation: str = "auto", interpret: bool | None = None,
                          moe_implementation: str | None = None, mesh=None
                          ) -> tuple[jax.Array, list[LayerOutput], PagedCache]:
    """:func:`forward_ragged`'s body: ``(hidden [T, d], one LayerOutput per layer, new cache)``.

    The per-layer outputs are the seam a profiler reads the data-dependent sizes of the step from (the sparse
    layers' block selections, the MoE layers' router inputs) without rebuilding any part of the model."""
    cfg = model.cfg
    check_cache(cache, cfg)
    check_batch(batch, page_size=cache.page_size, max_positions=cfg.max_position_embeddings)
    t = batch.num_tokens
    page = cache.page_size
    with jax.named_scope("metadata"):
        req = token_to_request(batch.query_start_loc, t)
        pos = token_positions(batch.query_start_loc, batch.seq_lens, req)
        slots = slot_mapping(batch.block_tables, req, pos, page_size=page, num_pages=cache.num_pages)
        valid = (req >= 0)[:, None]
        cos, sin = model.rope(jnp.maximum(pos, 0))
    kernel_kw = {"implementation": choose_implementation(implementation, cfg, page_size=page,
                                                         dtype=cache.k[0].dtype, interpret=interpret),
                 "interpret": interpret}
    meta = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    # The MoE resolves "auto" itself (grouped_gemm.resolve_implementation: its kernel, else the XLA fallback);
    # padding slots are routed to no expert.
    moe_kw = {"implementation": implementation if moe_implementation is None else moe_implementation,
              "interpret": interpret, "token_mask": req >= 0, "mesh": mesh}

    local = _per_device(mesh)
    with jax.named_scope("embed"):
        x = jnp.where(valid, model.embed(jnp.where(req >= 0, batch.input_ids, 0)), 0)
    new_k, new_v, new_index_k = list(cache.k), list(cache.v), list(cache.index_k)
    outputs = []
    sparse_slot = {layer: i for i, layer in enumerate(cfg.sparse_layer_ids)}
    scale = cfg.head_dim ** -0.5
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        sel = None
        attn_kw = {"scale": scale, "window": cfg.layer_window(i), **kernel_kw}
        with jax.named_scope(f"layer{i}"):
            with jax.named_scope("input_norm"):
                xn = layer.input_layernorm(x)
            with jax.named_scope("qkv_proj"):
                q, k, v = attn.project_qkv(xn, cos, sin)  # [T, H, D], [T, H_kv, D]
            with jax.named_scope("cache_write"):
                new_k[i] = write_tokens(new_k[i], k, slots)
                new_v[i] = write_tokens(new_v[i], v, slots)
            if attn.is_sparse:
                j = sparse_slot[i]
                with jax.named_scope("indexer_proj"):
                    iq, ik = attn.indexer.project(xn, cos, sin)  # [T, H_idx, D_idx], [T, D_idx]
                with jax.named_scope("cache_write"):
                    new_index_k[j] = write_tokens(new_index_k[j], ik, slots)
                with jax.named_scope("index_topk"):
                    sel = local(functools.partial(ragged_index_topk, topk=cfg.index_topk_blocks,
                                                  local_blocks=cfg.index_local_blocks, **kernel_kw),
                                "h", "r", *"rrr")(iq, new_index_k[j], *meta)
                with jax.named_scope("sparse_attention"):
                    o = local(functools.partial(ragged_sparse_attention, **attn_kw),
                              "h", "k", "k", *"rrr", "h")(q, new_k[i], new_v[i], *meta, sel)
            else:
                with jax.named_scope("paged_attention"):
                    o = local(functools.partial(ragged_paged_attention, **attn_kw),
                              "h", "k", "k", *"rrr")(q, new_k[i], new_v[i], *meta)
            with jax.named_scope("o_proj"):  # o_proj + residual
                h = x + attn.o_proj(o.reshape(t, -1))
            with jax.named_scope("post_norm"):
                hn = layer.post_attention_layernorm(h)
            if cfg.is_moe_layer(i):  # router / routed_experts / shared_expert / moe_combine: the MoE's own scopes
                y = layer.mlp(hn, **moe_kw)
            else:
                with jax.named_scope("dense_mlp"):
                    y = layer.mlp(hn)
            with jax.named_scope("residual"):
                x = jnp.where(valid, h + y, 0)
        outputs.append(LayerOutput(x, sel, hn))
    return x, outputs, PagedCache(new_k, new_v, new_index_k)


def _per_device(mesh):
    """``local(fn, *kinds)(*args)``: ``fn`` on each device's heads inside ``shard_map`` over the mesh's tensor axis
    (no mesh: ``fn`` itself). Argument kinds: ``"h"`` a ``[T, heads, ...]`` array split on its heads (the output is
    one too), ``"k"`` a ``[heads, ...]`` cache split on its heads, ``"r"`` replicated."""
    axes = {"h": 1, "k": 0, "r": None}
    return lambda fn, *kinds: on_local_heads(fn, mesh, [axes[c] for c in kinds], axes["h"])


def make_step_fn(model: MiniMaxM3ForCausalLM, *, capture_layers: Sequence[int] = (),
                 implementation: str = "auto", interpret: bool | None = None, donate_cache: bool = True,
                 moe_implementation: str | None = None):
    """A jitted ``step(params, cache, batch, logit_rows) -> (logits [N, V], captured, cache)``.

    The model's graph is static (``nnx.split``); ``params`` is its state, passed as an argument so the compiled
    program does not embed the weights (Flax Gemma sampler style). ``logit_rows int32[N]`` picks the packed rows
    whose logits are needed (bounded verify logits). The cache is donated: it is updated in place.
    ``moe_implementation``: :func:`forward_ragged`'s (``None``: ``implementation``).
    """
    from flax import nnx

    graphdef, _ = nnx.split(model)

    def step(params, cache, batch, logit_rows):
        m = nnx.merge(graphdef, params)
        hidden, captured, cache = forward_ragged(m, cache, batch, capture_layers=tuple(capture_layers),
                                                 implementation=implementation, interpret=interpret,
                                                 moe_implementation=moe_implementation)
        return m.logits(hidden[logit_rows]), captured, cache

    return jax.jit(step, donate_argnums=(1,) if donate_cache else ())
