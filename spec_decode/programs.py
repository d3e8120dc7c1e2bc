"""The engine's compiled programs: the closed set of step programs (and the device loop's), compiled ahead.

:class:`StepPrograms` jits the pure step of :mod:`spec_decode.step` once per :class:`~spec_decode.buckets.StepKey`
of the engine's closed set, with the decode state donated. :meth:`StepPrograms.compile` lowers each program
(tracing, in this thread) and compiles the lowered programs in a thread pool (XLA compiles outside the GIL),
with a progress bar. After it, running a step never compiles anything.

:func:`compile_counter` counts XLA backend compilations with JAX's own monitoring events, independently of the
engine's bookkeeping (tests and benchmarks use it to prove that nothing compiled).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import sys
import threading

import jax
import numpy as np

from spec_decode.buckets import StepKey
from spec_decode.step import StepConfig, StepPlan, make_step_fn

__all__ = ["CompileReport", "StepPrograms", "compile_counter", "compile_in_pool", "on_mesh"]

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # timed around compile-or-load-from-cache
_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # recorded inside it, in the same thread, on a load
_listener_lock = threading.Lock()
_counters: list[list[str]] = []
_listening = False
_pending_hits = threading.local()


def _on_duration(name, secs, **kwargs):
    if name != _BACKEND_COMPILE:
        return
    if getattr(_pending_hits, "n", 0):  # loaded from the persistent cache: not a compilation
        _pending_hits.n -= 1
        return
    for c in list(_counters):
        c.append(name)


def _on_event(name, **kwargs):
    if name == _CACHE_HIT:
        _pending_hits.n = getattr(_pending_hits, "n", 0) + 1


@contextlib.contextmanager
def compile_counter():
    """``with compile_counter() as compiled: ...``: ``len(compiled)`` is the number of XLA backend compilations
    inside the block (all threads), as JAX's monitoring reports them; programs loaded from the persistent
    compilation cache do not count."""
    global _listening
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
    seen: list[str] = []
    _counters.append(seen)
    try:
        yield seen
    finally:
        _counters.remove(seen)


@dataclasses.dataclass
class CompileReport:
    """What :meth:`StepPrograms.compile` (or the engine's warm-up) did."""

    programs: int = 0  # programs made ready
    compiled: int = 0  # XLA backend compilations (0 when every program came from the persistent cache)
    seconds: float = 0.0
    lower_seconds: float = 0.0  # tracing and lowering (one thread)
    compile_seconds: float = 0.0  # XLA compilation or cache loads (the thread pool)

    def __str__(self) -> str:
        cached = self.programs - min(self.compiled, self.programs)
        return (f"{self.programs} programs ready in {self.seconds:.1f} s ({self.compiled} compiled, {cached} from "
                f"the compilation cache; {self.lower_seconds:.1f} s tracing, {self.compile_seconds:.1f} s "
                f"compiling)")


def compile_in_pool(lowered: dict, *, progress: bool, desc: str) -> dict:
    """Compile ``{key: jax.stages.Lowered}`` in a thread pool; ``{key: compiled}``."""
    if not lowered:
        return {}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(lowered), unit="program", desc=desc, file=sys.stderr, leave=False)
    workers = max(1, min(len(lowered), os.cpu_count() or 1, 16))
    out = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(low.compile): key for key, low in lowered.items()}
        for fut in concurrent.futures.as_completed(futures):
            out[futures[fut]] = fut.result()
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return out


_INT_FIELDS = ("rows", "prefill_len", "prefill_start", "prefill_last", "resume_token", "scheduled", "top_k", "seed",
               "limit", "prefill_emitted")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedPlan:
    """A host :class:`~spec_decode.step.StepPlan` in three arrays (three transfers instead of seventeen)."""

    ints: jax.Array  # int32[R, 10 + M + B]  the per-row integer fields, the stop ids, the block table
    floats: jax.Array  # f32[R, 2]            temperature, top_p
    tokens: jax.Array  # int32[T + 2]         the prefill tokens, then the budget and the commit flag


def pack_plan(plan: StepPlan) -> PackedPlan:
    """Numpy side: the plan's arrays stacked by dtype."""
    cols = [np.asarray(getattr(plan, f), np.int32)[:, None] for f in _INT_FIELDS]
    ints = np.concatenate(cols + [np.asarray(plan.stop_ids, np.int32), np.asarray(plan.block_tables, np.int32)],
                          axis=1)
    floats = np.stack([np.asarray(plan.temperature, np.float32), np.asarray(plan.top_p, np.float32)], axis=1)
    tokens = np.concatenate([np.asarray(plan.prefill_tokens, np.int32),
                             np.asarray([plan.budget, plan.commit], np.int32)])
    return PackedPlan(ints, floats, tokens)


def unpack_plan(packed: PackedPlan, *, num_stop_ids: int) -> StepPlan:
    """Device side (traced): the :class:`StepPlan` back, by slicing."""
    n = len(_INT_FIELDS)
    f = {name: packed.ints[:, i] for i, name in enumerate(_INT_FIELDS)}
    f["prefill_last"] = f["prefill_last"] != 0
    return StepPlan(**f, stop_ids=packed.ints[:, n:n + num_stop_ids], block_tables=packed.ints[:, n + num_stop_ids:],
                    temperature=packed.floats[:, 0], top_p=packed.floats[:, 1], prefill_tokens=packed.tokens[:-2],
                    budget=packed.tokens[-2], commit=packed.tokens[-1] != 0)


def on_mesh(fn, mesh):
    """``fn(target_params, drafter_params, state, x) -> (state, out)`` with the returned state constrained to the
    engine's placement on ``mesh`` (``minimax_jax.sharding.state_shardings``), so a donated state keeps its layout
    from step to step and every step runs the program compiled for it; ``fn`` itself without a mesh."""
    if mesh is None:
        return fn
    from minimax_jax.sharding import state_shardings

    def placed(target_params, drafter_params, state, x):
        new_state, out = fn(target_params, drafter_params, state, x)
        return jax.lax.with_sharding_constraint(new_state, state_shardings(new_state, mesh)), out

    return placed


class StepPrograms:
    """One compiled step program per key of the closed set (``keys``), the state donated. A program takes the
    plan packed (:class:`PackedPlan`): :meth:`run` packs and sends a host plan in three transfers."""

    def __init__(self, target, drafter, base: StepConfig, keys: tuple[StepKey, ...], *, num_stop_ids: int,
                 mesh=None):
        self.keys = tuple(keys)
        self.mesh = mesh
        self._fns = {}
        for key in self.keys:
            step = make_step_fn(target, drafter, dataclasses.replace(
                base, num_logit_rows=key.logit_rows, sampling=key.sampling,
                draft_len=None if key.draft_len < 0 else key.draft_len))

            def packed_step(target_params, drafter_params, state, packed, step=step):
                return step(target_params, drafter_params, state, unpack_plan(packed, num_stop_ids=num_stop_ids))

            self._fns[key] = jax.jit(on_mesh(packed_step, mesh), donate_argnums=(2,))
        self._compiled: dict[StepKey, object] = {}

    @property
    def ready(self) -> bool:
        return len(self._compiled) == len(self.keys)

    def lower(self, target_params, drafter_params, state, plan_for) -> dict:
        """``{key: Lowered}`` of the programs not compiled yet; ``plan_for(key)`` gives an example host plan."""
        return {key: self._fns[key].lower(target_params, drafter_params, state, pack_plan(plan_for(key)))
                for key in self.keys if key not in self._compiled}

    def install(self, compiled: dict) -> None:
        self._compiled.update(compiled)

    def run(self, key: StepKey, target_params, drafter_params, state, plan: StepPlan):
        """Run the program of ``key`` on a host plan (dispatch only: returns device futures). A key outside the
        closed set is a bug, never a compile."""
        fn = self._compiled.get(key)
        if fn is None:
            raise RuntimeError(f"no compiled program for {key}: not in the engine's closed set {self.keys} (or "
                               f"Engine.warmup() was not run)")
        return fn(target_params, drafter_params, state, self.put(pack_plan(plan)))

    def put(self, tree):
        """Host arrays to the device(s): replicated over the mesh, or to the default device."""
        if self.mesh is None:
            return jax.device_put(tree)
        return jax.device_put(tree, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

