"""Tensor and expert parallelism: the mesh, how every parameter and cache is split over it, and memory plans
(docs/PARALLELISM.md).

The mesh has a ``"tensor"`` axis of ``N`` devices (and a ``"data"`` axis of replicas for offline batches). Over the
tensor axis:

* **attention**: query heads are split (``q_proj`` by columns, ``o_proj`` by rows). KV heads are split where
  ``N <= num_key_value_heads``; where ``N`` exceeds them they are **replicated at load time** to ``N`` stored heads
  (MiniMax-M3's 4 KV heads at TP 8: each head on two devices), so every device holds exactly its heads and no
  ``jnp.repeat`` runs per step. The MSA index heads follow the same rule; the index key (one head shared by the
  index heads) is replicated;
* **dense MLPs and the shared expert**: column-parallel ``gate_up`` (split as stored, ``[gate; up]``: XLA pairs
  the halves), row-parallel ``down``: one reduction per block;
* **linears kept as MX tensors** (``w_q [out, in / pack]``, ``w_scale [out, in / 32]``, checkpoint layout): split
  like the dense kernel along its outputs or inputs; a row-parallel split (``o_proj``, ``down``) takes the scale
  blocks with their inputs, and is refused where a device's share of the inputs would cut a 32-input block;
* **routed experts** (dense, or kept as MX tensors with their scales): expert parallelism over the same devices,
  ``num_local_experts / N`` experts each, tokens
  replicated to every shard, a ``psum`` after the grouped GEMM (sglang-jax's design; it runs on XLA:CPU). The
  router and ``e_score_correction_bias`` (fp32) are replicated;
* **embeddings and ``lm_head``**: split over the vocabulary;
* **paged caches**: K/V split by stored KV head, the MSA index keys replicated, page tables replicated;
* norms are replicated.

:func:`param_layout` gives each parameter's stored shape and :class:`jax.sharding.PartitionSpec`;
:func:`memory_plan` adds up per-device bytes from the real shapes with ``jax.eval_shape`` (nothing is
allocated), for the weights and for a KV pool of a given concurrency and context.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from minimax_jax.cache import page_size_for
from minimax_jax.config import MiniMaxM3Config

__all__ = ["DATA", "TENSOR", "MemoryPlan", "ParamLayout", "column_map", "head_axis", "largest_fit", "make_mesh",
           "memory_plan", "on_local_heads", "param_layout", "param_rule", "replicate_heads", "shard_module",
           "state_shardings",
           "stored_config", "stored_heads"]

TENSOR = "tensor"
DATA = "data"


def make_mesh(tensor_parallel_size: int, *, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A ``("data", "tensor")`` mesh over the first ``data * tensor`` devices (``devices``: an explicit list)."""
    tp, dp = int(tensor_parallel_size), int(data_parallel_size)
    if tp < 1 or dp < 1:
        raise ValueError(f"tensor_parallel_size and data_parallel_size must be >= 1, got {tp} and {dp}")
    devs = list(jax.devices() if devices is None else devices)
    if tp * dp > len(devs):
        raise ValueError(f"a mesh of {dp} x {tp} devices needs {tp * dp}, {len(devs)} available")
    return Mesh(np.asarray(devs[: tp * dp], dtype=object).reshape(dp, tp), (DATA, TENSOR))


def on_local_heads(fn, mesh: Mesh | None, head_axes, out_axis: int):
    """``fn`` on each device's own heads: inside ``shard_map`` over ``mesh``'s tensor axis, argument ``i`` split on
    its axis ``head_axes[i]`` (``None``: replicated), the output split on its axis ``out_axis``. With the heads
    stored for the mesh (:func:`replicate_heads`) every device sees the same GQA ratio, so a kernel written for
    one device runs unchanged on ``H / N`` query and ``H_kv / N`` KV heads. ``mesh=None``: ``fn`` itself."""
    if mesh is None:
        return fn

    def spec(axis):
        return PartitionSpec() if axis is None else PartitionSpec(*([None] * axis), TENSOR)

    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(a) for a in head_axes), out_specs=spec(out_axis),
                         check_vma=False)


def stored_heads(num_heads: int, tensor_parallel_size: int, *, what: str = "heads") -> int:
    """Heads kept after load-time replication: ``num_heads`` when the tensor axis splits them evenly, else ``N``
    (each head on ``N / num_heads`` devices). Raises when neither divides the other."""
    n = int(tensor_parallel_size)
    if n <= num_heads:
        if num_heads % n:
            raise ValueError(f"{num_heads} {what} do not split over tensor_parallel_size={n}")
        return num_heads
    if n % num_heads:
        raise ValueError(f"tensor_parallel_size={n} is not a multiple of the {num_heads} {what} (each head must be "
                         f"replicated the same number of times)")
    return n


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One parameter on the mesh: its shape in the checkpoint, its stored shape (KV heads replicated), and its
    partition spec over the stored shape."""

    shape: tuple[int, ...]
    stored_shape: tuple[int, ...]
    spec: PartitionSpec
    dtype: object

    def device_bytes(self, mesh_shape: Mapping[str, int]) -> int:
        """Bytes one device holds."""
        n = math.prod(self.stored_shape)
        for axis in self.spec:
            if axis is not None:
                n //= mesh_shape[axis]
        return n * jnp.dtype(self.dtype).itemsize


def _path(path) -> str:
    """``layers/3/self_attn/q_proj/kernel`` from a pytree path (nnx's trailing ``.value`` dropped)."""
    parts = []
    for p in path:
        part = getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))
        if part != "value":
            parts.append(str(part))
    return "/".join(parts)


# The routed experts' parameters (layers.MoE), expert axis first: dense, or kept as MX tensors with their scales.
EXPERT_PARAMS = ("experts_gate_up", "experts_down", "w_gate_up_q", "w_gate_up_scale", "w_down_q", "w_down_scale")


# A linear's parameters: the dense ``kernel [in, out]``, or the MX tensors ``w_q [out, in / pack]`` and
# ``w_scale [out, in / 32]`` of a quantized one (layers.QuantizedLinear).
LINEAR_PARAMS = ("kernel", "w_q", "w_scale")


def head_axis(name: str) -> int:
    """The output axis of the linear parameter at ``name``: the last of a ``kernel``, the first of MX tensors."""
    return 0 if name.rsplit("/", 1)[-1] in ("w_q", "w_scale") else -1


def _linear_rule(name: str, shape: tuple[int, ...], role: str, heads: tuple[int, int] | None, tp: int):
    """(stored shape, spec) of a linear's parameter split by its outputs (``"column"``) or inputs (``"row"``);
    ``heads``: ``(stored heads, head_dim)`` of outputs stored for the mesh."""
    t = TENSOR
    out_axis = head_axis(name) % 2
    stored = list(shape)
    if heads is not None:
        stored[out_axis] = heads[0] * heads[1]
    axis = out_axis if role == "column" else 1 - out_axis
    if role == "row" and name.endswith("/w_scale") and shape[1] % tp:
        raise ValueError(f"{name}: a row-parallel MX linear with {shape[1] * 32} inputs ({shape[1]} scale blocks of "
                         f"32) does not split over tensor_parallel_size={tp}: each device's {shape[1] * 32 / tp:g} "
                         f"inputs would cut a 32-input scale block; use a tensor-parallel size that divides "
                         f"{shape[1]}, or load with quantization='dequantize'")
    spec = [None, None]
    spec[axis] = t
    return tuple(stored), PartitionSpec(*spec)


def param_rule(name: str, shape: tuple[int, ...], cfg: MiniMaxM3Config, tp: int) -> tuple[tuple[int, ...], PartitionSpec]:
    """(stored shape, spec) of the parameter at ``name`` (a ``/``-joined path)."""
    t = TENSOR
    parts = name.rsplit("/", 2)
    module, leaf = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    if name.endswith("embed_tokens") or name == "embed_tokens":
        return shape, PartitionSpec(t, None)
    if name.endswith("lm_head"):
        return shape, PartitionSpec(None, t)
    if leaf in LINEAR_PARAMS:
        if "/indexer/" in name:
            if module == "q_proj":
                heads = stored_heads(cfg.index_n_heads, tp, what="index heads")
                return _linear_rule(name, shape, "column", (heads, cfg.index_head_dim), tp)
            return shape, PartitionSpec()  # the shared index key
        if module == "q_proj":
            stored_heads(cfg.num_attention_heads, tp, what="query heads")
            return _linear_rule(name, shape, "column", None, tp)
        if module in ("k_proj", "v_proj"):
            heads = stored_heads(cfg.num_key_value_heads, tp, what="KV heads")
            return _linear_rule(name, shape, "column", (heads, cfg.head_dim), tp)
        if module == "gate_up_proj":
            return _linear_rule(name, shape, "column", None, tp)
        if module in ("o_proj", "down_proj"):
            return _linear_rule(name, shape, "row", None, tp)
    if name.endswith(EXPERT_PARAMS):
        if cfg.num_local_experts % tp:
            raise ValueError(f"{cfg.num_local_experts} experts do not split over tensor_parallel_size={tp}")
        return shape, PartitionSpec(t, None, None)
    return shape, PartitionSpec()  # norms, the router and its bias, the indexer's norms


def param_layout(module_fn, cfg: MiniMaxM3Config, tensor_parallel_size: int) -> dict[str, ParamLayout]:
    """``{path: ParamLayout}`` of every parameter of the module ``module_fn()`` builds (traced with
    ``jax.eval_shape``: no parameter is allocated). ``cfg`` is the config whose heads the rules read (the target's,
    or a drafter's layer config)."""
    from flax import nnx

    shapes = jax.eval_shape(lambda: nnx.state(module_fn()))
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        name = _path(path)
        stored, spec = param_rule(name, tuple(leaf.shape), cfg, tensor_parallel_size)
        out[name] = ParamLayout(tuple(leaf.shape), stored, spec, leaf.dtype)
    return out


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of a deployment (``memory_plan``)."""

    tensor_parallel_size: int
    weight_bytes: int  # one device's parameters (target, and drafter when given)
    drafter_bytes: int  # of which the drafter's
    kv_bytes_per_page: int  # one page of the pool on one device (every layer's K/V heads it stores, index keys)
    page_size: int
    checkpoint_bytes: int  # the whole model as stored (all devices, before replication)

    def kv_bytes(self, concurrency: int, context: int) -> int:
        """One device's KV pool for ``concurrency`` requests of ``context`` tokens."""
        return concurrency * -(-context // self.page_size) * self.kv_bytes_per_page

    def device_bytes(self, concurrency: int, context: int) -> int:
        return self.weight_bytes + self.kv_bytes(concurrency, context)


def memory_plan(cfg: MiniMaxM3Config, *, tensor_parallel_size: int, dtype=jnp.bfloat16, kv_dtype=None,
                drafter_cfg=None, bytes_per_weight=None) -> MemoryPlan:
    """Per-device bytes of ``cfg`` (and its DSpark drafter ``drafter_cfg``) over ``tensor_parallel_size`` devices,
    from the real shapes (``jax.eval_shape``) and :func:`param_layout`.

    ``bytes_per_weight``: optional ``name -> bytes per element`` (None: the parameter's dtype) for the target's
    parameters stored in another format, e.g. the routed experts kept as MXFP4 (``0.5 + 1/32``: packed elements
    and one E8M0 scale per 32) or MXFP8 (``1 + 1/32``), docs/CHECKPOINTS.md."""
    from flax import nnx

    from minimax_jax.model import MiniMaxM3ForCausalLM

    tp = int(tensor_parallel_size)
    mesh_shape = {TENSOR: tp, DATA: 1}
    layout = param_layout(lambda: MiniMaxM3ForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)), cfg, tp)
    def per(name, p):
        b = None if bytes_per_weight is None else bytes_per_weight(name)
        return jnp.dtype(p.dtype).itemsize if b is None else b

    weights = int(sum(p.device_bytes(mesh_shape) / jnp.dtype(p.dtype).itemsize * per(n, p) for n, p in layout.items()))
    stored = int(sum(math.prod(p.shape) * per(n, p) for n, p in layout.items()))
    draft = 0
    if drafter_cfg is not None:
        from minimax_jax.drafter import DSparkDrafter

        dlayout = param_layout(lambda: DSparkDrafter(drafter_cfg, rngs=nnx.Rngs(0), dtype=dtype),
                               drafter_cfg.layer_config, tp)
        # the drafter shares the target's embeddings and LM head (not counted twice)
        draft = sum(p.device_bytes(mesh_shape) for name, p in dlayout.items()
                    if not (name.endswith("embed_tokens") or name.endswith("lm_head")))
    item = jnp.dtype(dtype if kv_dtype is None else kv_dtype).itemsize
    page = page_size_for(cfg)
    kv_heads = stored_heads(cfg.num_key_value_heads, tp, what="KV heads") // tp
    kv = 2 * cfg.num_hidden_layers * kv_heads * page * cfg.head_dim
    idx = len(cfg.sparse_layer_ids) * page * cfg.index_head_dim  # replicated
    if drafter_cfg is not None:  # the drafter's context K/V shares the pages
        lc = drafter_cfg.layer_config
        kv += 2 * lc.num_hidden_layers * (stored_heads(lc.num_key_value_heads, tp, what="KV heads") // tp) * page * \
            lc.head_dim
    return MemoryPlan(tp, weights + draft, draft, (kv + idx) * item, page, stored)


def largest_fit(plan: MemoryPlan, device_bytes: int, *, context: int, reserve_fraction: float = 0.1) -> int:
    """The largest concurrency whose KV pool at ``context`` tokens fits one device of ``device_bytes`` next to the
    weights, keeping ``reserve_fraction`` of the device for activations and the compiler (0 when nothing fits)."""
    free = int(device_bytes * (1 - reserve_fraction)) - plan.weight_bytes
    per_request = plan.kv_bytes(1, context)
    return max(0, free // per_request)


# ----------------------------------------------------------------------------------------------- placing a model
def replicate_heads(model, tensor_parallel_size: int):
    """A copy of the target ``model`` whose KV heads (and the MSA index heads, one per KV group) are replicated to
    :func:`stored_heads` (the model's own object when nothing needs replicating). Stored head ``j`` is original
    head ``j // (N / H_kv)``, so query head ``h`` still reads original head ``h // (H / H_kv)``: the same model.
    The given model is left as it is."""
    from flax import nnx

    from minimax_jax.model import MiniMaxM3ForCausalLM

    cfg = model.cfg
    new_cfg = stored_config(cfg, tensor_parallel_size)
    if new_cfg == cfg:
        return model
    state = nnx.state(model)
    flat = dict(nnx.to_flat_state(state))
    for key, var in flat.items():
        name = "/".join(str(k) for k in key)
        cols = column_map(name, cfg, tensor_parallel_size)
        if cols is not None:
            var.value = jnp.take(var.value, cols, axis=head_axis(name))
    new = nnx.eval_shape(lambda: MiniMaxM3ForCausalLM(new_cfg, dtype=model.dtype, rngs=nnx.Rngs(0)))
    nnx.update(new, nnx.from_flat_state(flat))
    return new


def replicate_drafter_heads(drafter, tensor_parallel_size: int):
    """:func:`replicate_heads` for a DSpark drafter: its draft layers' KV heads replicated to the mesh (a new module
    when any is; the given one is left as it is). The drafter's block attention reads them as its layers do."""
    from flax import nnx

    from minimax_jax.drafter import DSparkDrafter

    cfg = drafter.cfg
    layer_cfg = stored_config(cfg.layer_config, tensor_parallel_size)
    if layer_cfg == cfg.layer_config:
        return drafter
    flat = dict(nnx.to_flat_state(nnx.state(drafter)))
    for key, var in flat.items():
        name = "/".join(str(k) for k in key)
        cols = column_map(name, cfg.layer_config, tensor_parallel_size)
        if cols is not None:
            var.value = jnp.take(var.value, cols, axis=head_axis(name))
    new_cfg = dataclasses.replace(cfg, layer_config=layer_cfg)
    new = nnx.eval_shape(lambda: DSparkDrafter(new_cfg, dtype=drafter.dtype, rngs=nnx.Rngs(0)))
    nnx.update(new, nnx.from_flat_state(flat))
    return new


def stored_config(cfg: MiniMaxM3Config, tensor_parallel_size: int) -> MiniMaxM3Config:
    """``cfg`` with its KV heads (and the MSA index heads, one per KV group) at :func:`stored_heads`."""
    changes = {"num_key_value_heads": stored_heads(cfg.num_key_value_heads, tensor_parallel_size, what="KV heads")}
    if cfg.index_n_heads is not None:
        changes["index_n_heads"] = stored_heads(cfg.index_n_heads, tensor_parallel_size, what="index heads")
    return cfg.replace(**changes) if any(getattr(cfg, k) != v for k, v in changes.items()) else cfg


def column_map(name: str, cfg: MiniMaxM3Config, tensor_parallel_size: int) -> np.ndarray | None:
    """For a parameter whose heads are replicated on the mesh (``k_proj``, ``v_proj``, the indexer's ``q_proj``;
    a ``kernel`` or the MX ``w_q`` / ``w_scale``): the original index of every stored output, along the
    parameter's :func:`head_axis` (stored head ``j`` is original head ``j // (N / H)``); else None."""
    module = name.rsplit("/", 1)[0]
    if name.rsplit("/", 1)[-1] not in LINEAR_PARAMS:
        return None
    if module.endswith(("self_attn/k_proj", "self_attn/v_proj")):
        heads, dim = cfg.num_key_value_heads, cfg.head_dim
    elif module.endswith("indexer/q_proj"):
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
    else:
        return None
    stored = stored_heads(heads, tensor_parallel_size)
    if stored == heads:
        return None
    head = np.arange(stored) // (stored // heads)
    return (head[:, None] * dim + np.arange(dim)[None, :]).reshape(-1)


def loader_placement(mesh: Mesh, cfg: MiniMaxM3Config, abstract_module):
    """The ``placement`` of :func:`minimax_jax.safetensors_io.load_weights` for a module loaded onto ``mesh``:
    ``path -> (sharding, checkpoint shape, head map, head axis)``, the rules read from ``cfg`` (the checkpoint's
    heads) and the checkpoint shapes from ``abstract_module`` (built from ``cfg``). Every rule is evaluated here,
    so a parameter that does not split over the mesh raises before any tensor is read."""
    from flax import nnx

    tp = mesh.shape[TENSOR]
    shapes = {p: var.get_value().shape for p, var in nnx.to_flat_state(nnx.state(abstract_module))}
    # every rule up front: a parameter that does not split over the mesh is refused before any tensor is read
    specs = {p: param_rule("/".join(map(str, p)), shape, cfg, tp)[1] for p, shape in shapes.items()}

    def placement(path):
        name = "/".join(map(str, path))
        return (jax.sharding.NamedSharding(mesh, specs[path]), shapes[path], column_map(name, cfg, tp),
                head_axis(name))

    return placement


def shard_module(module, mesh: Mesh, cfg: MiniMaxM3Config, *, replicate: bool = False):
    """Place ``module``'s parameters on ``mesh`` by :func:`param_layout` (``replicate``: every parameter on every
    device). Heads must already be stored for the mesh (:func:`replicate_heads`). Updates the module in place."""
    from flax import nnx

    tp = mesh.shape[TENSOR]
    state = nnx.state(module)
    flat = dict(nnx.to_flat_state(state))
    for key, var in flat.items():
        name = "/".join(str(k) for k in key)
        if replicate:
            spec = PartitionSpec()
        else:
            stored, spec = param_rule(name, tuple(var.value.shape), cfg, tp)
            if stored != tuple(var.value.shape):
                raise ValueError(f"{name} has shape {var.value.shape}, the mesh stores {stored}: replicate the "
                                 f"heads first (replicate_heads)")
        var.value = jax.device_put(var.value, jax.sharding.NamedSharding(mesh, spec))
    nnx.update(module, nnx.from_flat_state(flat))
    return module


def state_shardings(state, mesh: Mesh):
    """Shardings of an engine's decode state on ``mesh``: the target's K/V pages and the drafter's context K/V split
    by head, everything else (index keys, per-slot arrays, the estimator) replicated."""
    from jax.sharding import NamedSharding

    from minimax_jax.cache import PagedCache

    rep = NamedSharding(mesh, PartitionSpec())
    heads = NamedSharding(mesh, PartitionSpec(TENSOR))

    def cache_spec(c: PagedCache):
        return PagedCache(k=[heads] * len(c.k), v=[heads] * len(c.v), index_k=[rep] * len(c.index_k))

    out = dataclasses.replace(jax.tree.map(lambda _: rep, state), cache=cache_spec(state.cache))
    if state.draft_cache is not None:
        layer_heads = NamedSharding(mesh, PartitionSpec(None, TENSOR))  # [L, H_kv, P, page, D]
        out = dataclasses.replace(out, draft_cache=dataclasses.replace(out.draft_cache, k=layer_heads, v=layer_heads))
    return out
