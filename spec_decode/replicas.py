"""Data parallelism for offline batches: replicas of a tensor-parallel engine over a mesh's ``"data"`` axis
(docs/PARALLELISM.md, "A data axis").

:class:`ReplicatedEngine` builds one :class:`~spec_decode.engine.Engine` per row of the mesh's ``"data"`` axis,
each on its own ``"tensor"`` group of devices with its own copy of the parameters, splits a ``generate`` call's
prompts across them (contiguous, balanced: replica ``i`` takes the ``i``-th slice), runs the replicas at once (one
thread each; the devices work in parallel, the threads mostly wait on them), and returns the results in prompt
order, with the run statistics of every replica and their sum. Request ``j`` keeps the seed it would have had in
one engine (``seed + j``, or its own ``SamplingParams``), so greedy outputs equal one engine's and sampled outputs
do not depend on how the prompts were split. One process: every replica's devices must be this process's.
"""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
from flax import nnx

from minimax_jax import sharding
from spec_decode.request import SAMPLING_KEYWORDS
from spec_decode.results import GenerationResults
from spec_decode.sampling_params import SamplingParams

__all__ = ["ReplicatedEngine"]


class ReplicatedEngine:
    """``mesh.shape["data"]`` engines over the same model (see the module docstring). ``engine_kwargs`` go to
    every replica's :class:`~spec_decode.engine.Engine` (``max_num_seqs`` is per replica)."""

    def __init__(self, target, drafter, *, mesh, **engine_kwargs):
        from jax.sharding import Mesh

        from spec_decode.engine import Engine

        if sharding.DATA not in mesh.shape or sharding.TENSOR not in mesh.shape:
            raise ValueError(f"mesh must have {sharding.DATA!r} and {sharding.TENSOR!r} axes, got {tuple(mesh.shape)}")
        if "mesh" in engine_kwargs or "tensor_parallel_size" in engine_kwargs:
            raise ValueError("the replicas' meshes come from mesh: pass no tensor_parallel_size or mesh of their own")
        devices = np.asarray(mesh.devices).reshape(mesh.shape[sharding.DATA], mesh.shape[sharding.TENSOR])
        self.engines = []
        for row in devices:
            sub = Mesh(row.reshape(1, -1), (sharding.DATA, sharding.TENSOR))
            t = nnx.clone(target)  # each replica places its own copy (the given modules stay where they are)
            d = nnx.clone(drafter) if drafter is not None else None
            self.engines.append(Engine(t, d, mesh=sub, **engine_kwargs))

    @property
    def num_replicas(self) -> int:
        return len(self.engines)

    def warmup(self):
        return [e.warmup() for e in self.engines]

    def generate(self, prompts, *, sampling_params=None, seed: int | None = None, **kwargs) -> GenerationResults:
        """:meth:`Engine.generate` over the replicas: the prompts split, the results in prompt order
        (``results.stats["replicas"]``: each replica's run statistics; ``output_tokens_per_s`` over the call)."""
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

        def run(i):
            a, b = parts[i]
            if a == b:
                return None
            return self.engines[i].generate(prompts[a:b], sampling_params=params[a:b], **kwargs)

        for e in self.engines:  # compile one replica at a time (the compile counter is per process)
            e.warmup()
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.num_replicas) as pool:
            outs = list(pool.map(run, range(self.num_replicas)))
        wall = time.perf_counter() - t0
        results = [r for out in outs if out is not None for r in out]
        stats = [out.stats for out in outs if out is not None]
        tokens = sum(s["output_tokens"] for s in stats)
        return GenerationResults(results, {"replicas": stats, "output_tokens": tokens, "wall_time_s": wall,
                                           "output_tokens_per_s": tokens / wall if wall else 0.0})
