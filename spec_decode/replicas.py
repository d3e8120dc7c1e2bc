"""Data parallelism for offline batches: replicas of a tensor-parallel engine over a mesh's ``"data"`` axis
(docs/PARALLELISM.md, "A data axis").

:class:`ReplicatedEngine` builds one :class:`~spec_decode.engine.Engine` per row of the mesh's ``"data"`` axis,
each on its own ``"tensor"`` group of devices with its own copy of the parameters, splits a ``generate`` call's
prompts across them (contiguous, balanced: replica ``i`` takes the ``i``-th slice), runs the replicas at once (one
thread each; the devices work in parallel, the threads mostly wait on them), and returns the results in prompt
order, with the run statistics of every replica and their sum. Request ``j`` keeps the seed it would have had in
one engine (``seed + j``, or its own ``SamplingParams``), so greedy outputs equal one engine's and sampled outputs
do not depend on how the prompts were split.

Several processes (``jax.distributed``; the mesh's data axis spanning them): every process builds the same object
from the same arguments and calls ``generate`` with the same prompts; each builds and runs only the replicas whose
devices it owns (a replica's tensor group lies within one process), and the results are then exchanged
(:func:`jax.experimental.multihost_utils.process_allgather` of each process's pickled results, padded to one
length), so every process returns all of them in prompt order.
"""

from __future__ import annotations

import concurrent.futures
import pickle
import time

import jax
import numpy as np
from flax import nnx

from minimax_jax import sharding
from spec_decode.request import SAMPLING_KEYWORDS
from spec_decode.results import GenerationResults
from spec_decode.sampling_params import SamplingParams

__all__ = ["ReplicatedEngine"]


class ReplicatedEngine:
    """``mesh.shape["data"]`` engines over the same model (see the module docstring). ``engine_kwargs`` go to
    every replica's :class:`~spec_decode.engine.Engine` (``max_num_seqs`` is per replica).

    ``engines`` holds this process's replicas (all of them in one process), ``replica_ids`` their rows of the
    data axis and ``owners`` the process of every row."""

    def __init__(self, target, drafter, *, mesh, **engine_kwargs):
        from jax.sharding import Mesh

        from spec_decode.engine import Engine

        if sharding.DATA not in mesh.shape or sharding.TENSOR not in mesh.shape:
            raise ValueError(f"mesh must have {sharding.DATA!r} and {sharding.TENSOR!r} axes, got {tuple(mesh.shape)}")
        if "mesh" in engine_kwargs or "tensor_parallel_size" in engine_kwargs:
            raise ValueError("the replicas' meshes come from mesh: pass no tensor_parallel_size or mesh of their own")
        devices = np.asarray(mesh.devices).reshape(mesh.shape[sharding.DATA], mesh.shape[sharding.TENSOR])
        self.owners = []
        for i, row in enumerate(devices):
            procs = sorted({d.process_index for d in row})
            if len(procs) > 1:
                raise ValueError(f"replica {i} (row {i} of the mesh's {sharding.DATA!r} axis) has devices of processes "
                                 f"{procs}: each replica's {sharding.TENSOR!r} group must lie within one process")
            self.owners.append(procs[0])
        me = jax.process_index()
        self.replica_ids = [i for i, owner in enumerate(self.owners) if owner == me]
        self.engines = []
        for i in self.replica_ids:
            sub = Mesh(devices[i].reshape(1, -1), (sharding.DATA, sharding.TENSOR))
            t = nnx.clone(target)  # each replica places its own copy (the given modules stay where they are)
            d = nnx.clone(drafter) if drafter is not None else None
            self.engines.append(Engine(t, d, mesh=sub, **engine_kwargs))

    @property
    def num_replicas(self) -> int:
        """Replicas over every process (the rows of the data axis)."""
        return len(self.owners)

    @property
    def multiprocess(self) -> bool:
        return len(set(self.owners)) > 1

    def warmup(self):
        return [e.warmup() for e in self.engines]

    def reset_prefix_cache(self) -> int:
        """:meth:`Engine.reset_prefix_cache` on every replica this process runs: the pages they had cached."""
        return sum(e.reset_prefix_cache() for e in self.engines)

    def generate(self, prompts, *, sampling_params=None, seed: int | None = None, **kwargs) -> GenerationResults:
        """:meth:`Engine.generate` over the replicas: the prompts split, the results in prompt order
        (``results.stats["replicas"]``: each replica's run statistics; ``output_tokens_per_s`` over the call). In
        several processes every process passes the same arguments and gets every result."""
        prompts = list(prompts)
        n = len(prompts)
        if sampling_params is None:  # request j keeps the seed one engine would give it
            given = {k: kwargs.pop(k) for k in SAMPLING_KEYWORDS if k != "seed" and kwargs.get(k) is not None}
            samples = given.get("n", 1)
            sampling_params = [SamplingParams(**given, seed=(seed or 0) + j * samples) for j in range(n)]
        elif seed is not None:
            raise ValueError("give seed or sampling_params, not both")
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * n
        if len(params) != n:
            raise ValueError(f"sampling_params holds {len(params)} entries for {n} prompts")
        cuts = np.linspace(0, n, self.num_replicas + 1).round().astype(int)
        parts = [(int(a), int(b)) for a, b in zip(cuts, cuts[1:])]

        def run(j):
            a, b = parts[self.replica_ids[j]]
            if a == b:
                return None
            return self.engines[j].generate(prompts[a:b], sampling_params=params[a:b], **kwargs)

        for e in self.engines:  # compile one replica at a time (the compile counter is per process)
            e.warmup()
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(self.engines))) as pool:
            outs = list(pool.map(run, range(len(self.engines))))
        wall = time.perf_counter() - t0
        mine = {i: None if out is None else (list(out), out.stats) for i, out in zip(self.replica_ids, outs)}
        if self.multiprocess:
            mine, wall = _exchange(mine, wall)
        done = [mine[i] for i in range(self.num_replicas) if mine.get(i) is not None]
        results = [r for out, _ in done for r in out]
        stats = [st for _, st in done]
        tokens = sum(s["output_tokens"] for s in stats)
        return GenerationResults(results, {"replicas": stats, "output_tokens": tokens, "wall_time_s": wall,
                                           "output_tokens_per_s": tokens / wall if wall else 0.0})


def _exchange(mine: dict, wall: float) -> tuple[dict, float]:
    """Every process's ``{replica: (results, stats)}`` merged on every process (and the slowest wall time): each
    process's pickled share, padded to the longest, gathered with ``process_allgather``."""
    from jax.experimental import multihost_utils

    blob = np.frombuffer(pickle.dumps((mine, wall)), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([blob.size], np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: blob.size] = blob
    blobs = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    merged, slowest = {}, 0.0
    for size, row in zip(sizes, blobs):
        share, t = pickle.loads(row[: int(size)].tobytes())
        merged.update({i: v for i, v in share.items() if v is not None or i not in merged})
        slowest = max(slowest, t)
    return merged, slowest
