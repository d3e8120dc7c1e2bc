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
import time

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.buckets import StepKey
from spec_decode.step import StepConfig, StepPlan, make_step_fn

__all__ = ["CompileReport", "StepPrograms", "compile_counter", "compile_in_pool", "on_mesh", "without_source_frames"]

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # timed around compile-or-load-from-cache
_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # recorded inside it, in the same thread, on a load
_listener_lock = threading.Lock()
_counters: list[tuple[list[str], bool]] = []  # (the names seen, whether persistent-cache loads count)
_listening = False
_pending_hits = threading.local()
_thread_loads = threading.local()  # persistent-cache loads this thread has seen (never decremented)


def _on_duration(name, secs, **kwargs):
    if name != _BACKEND_COMPILE:
        return
    loaded = bool(getattr(_pending_hits, "n", 0))  # loaded from the persistent cache: not a compilation
    if loaded:
        _pending_hits.n -= 1
    for c, cache_loads in list(_counters):
        if cache_loads or not loaded:
            c.append(name)


def _on_event(name, **kwargs):
    if name == _CACHE_HIT:
        _pending_hits.n = getattr(_pending_hits, "n", 0) + 1
        _thread_loads.n = getattr(_thread_loads, "n", 0) + 1


def _listen() -> None:
    """Register the monitoring listeners (once per process)."""
    global _listening
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _listening = True


@contextlib.contextmanager
def compile_counter(*, cache_loads: bool = False):
    """``with compile_counter() as compiled: ...``: ``len(compiled)`` is the number of XLA backend compilations
    inside the block (all threads), as JAX's monitoring reports them; programs loaded from the persistent
    compilation cache do not count, unless ``cache_loads``: then ``compiled`` counts every program made ready in
    the block, compiled or loaded (a jit cache miss either way; what "nothing compiles after warm-up" means when
    a persistent cache could serve the miss)."""
    _listen()
    seen: list[str] = []
    entry = (seen, cache_loads)
    _counters.append(entry)
    try:
        yield seen
    finally:
        _counters.remove(entry)


@dataclasses.dataclass
class CompileReport:
    """What :meth:`StepPrograms.compile` (or the engine's warm-up) did."""

    programs: int = 0  # programs made ready
    compiled: int = 0  # XLA backend compilations (0 when every program came from the persistent cache)
    seconds: float = 0.0
    lower_seconds: float = 0.0  # tracing and lowering (the calling thread)
    compile_seconds: float = 0.0  # XLA compilation or cache loads (a thread pool), beyond what overlapped lowering
    loaded: int = 0  # programs loaded from the executable store (neither traced nor compiled)
    load_seconds: float = 0.0  # loading them
    slowest: tuple = ()  # (program, seconds) of the longest compilations or loads (either cache), longest first

    def __str__(self) -> str:
        cached = max(self.programs - self.loaded - self.compiled, 0)
        return (f"{self.programs} programs ready in {self.seconds:.1f} s ({self.loaded} loaded as executables in "
                f"{self.load_seconds:.1f} s, {self.compiled} compiled, {cached} from the compilation cache; "
                f"{self.lower_seconds:.1f} s tracing, {self.compile_seconds:.1f} s compiling)")

    def __add__(self, other: CompileReport) -> CompileReport:
        return CompileReport(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def without_source_frames():
    """A context in which programs are lowered without Python stack frames in their locations
    (``jax_traceback_in_locations_limit = 0``): the HLO then carries each op's name (``jax.named_scope`` included)
    and no stack frames.

    Why: a GPU executable builds a profiler annotation for every HLO instruction when it is created, at the end of
    a compilation and at every load from the executable store, and with stack frames that construction sorts
    and formats each instruction's frames. A native profile of loading the 256-slot greedy device loop (H100,
    ``py-spy --native``) put two thirds of the load there (XLA's ``ModuleAnnotations``); without the frames the
    loop loaded in 5.3 s instead of 9.5, and the warm start took 5.6 s instead of 10.8 (docs/ENGINE.md,
    "Start-up"). Tracebacks of errors raised while tracing are Python's own and keep every frame."""
    try:
        from jax._src import config as jax_config

        return jax_config.traceback_in_locations_limit(0)
    except (ImportError, AttributeError):  # another JAX version: lower as it does by default
        return contextlib.nullcontext()


def compile_in_pool(programs, *, total: int, progress: bool, desc: str,
                    seconds: dict | None = None, from_cache: set | None = None) -> tuple[dict, float]:
    """Lower each ``(key, lower)`` of ``programs`` in this thread (``lower()`` returns a ``jax.stages.Lowered``:
    tracing holds the GIL) and compile it in a thread pool as soon as it is lowered (XLA compiles outside the
    GIL), so tracing overlaps compiling; each is lowered :func:`without_source_frames`. Put the longest
    compilations first: they start first and do not trail the rest. Returns ``({key: compiled}, seconds spent
    lowering)``; ``seconds``, when given, gets each key's compile time (in its worker); ``from_cache``, when
    given, the keys that JAX's persistent compilation cache served instead of a compilation."""
    _listen()

    def timed(key, low):
        t = time.perf_counter()
        loads = getattr(_thread_loads, "n", 0)  # the cache's load event fires in this (the compiling) thread
        out = low.compile()
        if seconds is not None:
            seconds[key] = time.perf_counter() - t
        if from_cache is not None and getattr(_thread_loads, "n", 0) > loads:
            from_cache.add(key)
        return out

    bar = None
    if progress and total:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="program", desc=desc, file=sys.stderr, leave=False)
    workers = max(1, min(total, os.cpu_count() or 1, 16))
    out, futures, lowering = {}, {}, 0.0
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for key, lower in programs:
            t = time.perf_counter()
            with without_source_frames():
                low = lower()
            lowering += time.perf_counter() - t
            futures[pool.submit(timed, key, low)] = key
        for fut in concurrent.futures.as_completed(futures):
            out[futures[fut]] = fut.result()
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return out, lowering


_INT_FIELDS = ("rows", "prefill_len", "prefill_start", "prefill_last", "resume_token", "scheduled", "top_k", "seed",
               "limit", "prefill_emitted", "min_tokens", "prompt_logprobs", "next_prompt_token")
# per-row float fields, bit-cast; the value a plan without the field (None) packs
_FLOAT_FIELDS = (("temperature", 0.0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                 ("presence_penalty", 0.0), ("frequency_penalty", 0.0))
_INT_FILL = {"min_tokens": 0, "prompt_logprobs": 0, "next_prompt_token": 0}  # what a field left None packs


def _row_field(plan: StepPlan, name: str, fill, dtype) -> np.ndarray:
    v = getattr(plan, name)
    return np.full(np.shape(plan.rows), fill, dtype) if v is None else np.asarray(v, dtype)


def pack_plan(plan: StepPlan) -> np.ndarray:
    """Numpy side: the whole plan in one flat ``int32`` vector (one transfer per step): the per-row integer fields,
    the stop ids and the block table (``int32[R, C]``, row-major), the six float fields bit-cast (``[R, 6]``:
    temperature, top_p, min_p, the repetition, presence and frequency penalties), then the prefill tokens, the
    budget, the commit flag and the closed-batch flag (``T + 3``). A transform or log-probability field a plan
    leaves None packs as off (``closed`` as False)."""
    cols = [_row_field(plan, f, _INT_FILL.get(f), np.int32)[:, None] for f in _INT_FIELDS]
    ints = np.concatenate(cols + [np.asarray(plan.stop_ids, np.int32), np.asarray(plan.block_tables, np.int32)],
                          axis=1)
    floats = np.stack([_row_field(plan, f, fill, np.float32) for f, fill in _FLOAT_FIELDS], axis=1)
    return np.concatenate([ints.ravel(), floats.view(np.int32).ravel(), np.asarray(plan.prefill_tokens, np.int32),
                           np.asarray([plan.budget, plan.commit, bool(plan.closed)], np.int32)])


def unpack_plan(packed: jax.Array, *, num_rows: int, num_tokens: int, num_stop_ids: int) -> StepPlan:
    """Device side (traced): the :class:`StepPlan` of ``num_rows`` rows and ``num_tokens`` packed token slots back
    from :func:`pack_plan`'s vector, by static slicing."""
    n, nf = len(_INT_FIELDS), len(_FLOAT_FIELDS)
    int_size = packed.shape[0] - nf * num_rows - num_tokens - 3
    if int_size <= 0 or int_size % num_rows:
        raise ValueError(f"a packed plan of {packed.shape[0]} values does not hold {num_rows} rows and "
                         f"{num_tokens} tokens")
    ints = packed[:int_size].reshape(num_rows, int_size // num_rows)
    floats = jax.lax.bitcast_convert_type(packed[int_size:int_size + nf * num_rows],
                                          jnp.float32).reshape(num_rows, nf)
    tail = packed[int_size + nf * num_rows:]
    f = {name: ints[:, i] for i, name in enumerate(_INT_FIELDS)}
    f["prefill_last"] = f["prefill_last"] != 0
    f["prompt_logprobs"] = f["prompt_logprobs"] != 0
    f.update({name: floats[:, i] for i, (name, _) in enumerate(_FLOAT_FIELDS)})
    return StepPlan(**f, stop_ids=ints[:, n:n + num_stop_ids], block_tables=ints[:, n + num_stop_ids:],
                    prefill_tokens=tail[:-3], budget=tail[-3], commit=tail[-2] != 0,
                    closed=tail[-1] != 0)


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
    plan packed (:func:`pack_plan`): :meth:`run` packs and sends a host plan of ``num_rows`` rows in one
    transfer."""

    def __init__(self, target, drafter, base: StepConfig, keys: tuple[StepKey, ...], *, num_rows: int,
                 num_stop_ids: int, mesh=None):
        self.keys = tuple(keys)
        self.mesh = mesh
        self._fns = {}
        for key in self.keys:
            step = make_step_fn(target, drafter, dataclasses.replace(
                base, num_logit_rows=key.logit_rows, sampling=key.sampling,
                draft_len=None if key.draft_len < 0 else key.draft_len))

            def packed_step(target_leaves, drafter_leaves, state, packed, step=step, tokens=key.tokens):
                target_params, drafter_params = self._unflatten(target_leaves, drafter_leaves)
                plan = unpack_plan(packed, num_rows=num_rows, num_tokens=tokens, num_stop_ids=num_stop_ids)
                return step(target_params, drafter_params, state, plan)

            self._fns[key] = jax.jit(on_mesh(packed_step, mesh), donate_argnums=(2,))
        self._compiled: dict[StepKey, object] = {}
        self._params = None  # (target_params, drafter_params, their leaves, their treedefs), set on first use

    def _flat(self, target_params, drafter_params):
        """The parameters as two tuples of arrays: a program takes them flat, so a launch flattens no module
        state in Python (the engine's parameters never change, so their leaves are computed once)."""
        p = self._params
        if p is None or p[0] is not target_params or p[1] is not drafter_params:
            lt, tt = jax.tree.flatten(target_params)
            ld, td = jax.tree.flatten(drafter_params)
            p = self._params = (target_params, drafter_params, (tuple(lt), tuple(ld)), (tt, td))
        return p[2]

    def _unflatten(self, target_leaves, drafter_leaves):
        tt, td = self._params[3]
        return jax.tree.unflatten(tt, target_leaves), jax.tree.unflatten(td, drafter_leaves)

    @property
    def ready(self) -> bool:
        return len(self._compiled) == len(self.keys)

    @property
    def missing(self) -> tuple[StepKey, ...]:
        """The keys without a program yet."""
        return tuple(key for key in self.keys if key not in self._compiled)

    def flat_params(self, target_params, drafter_params) -> tuple:
        """The parameters as the programs take them (two tuples of arrays)."""
        return self._flat(target_params, drafter_params)

    def lowering(self, key: StepKey, target_params, drafter_params, state, plan_for):
        """A function that lowers ``key``'s program (``plan_for(key)`` gives an example host plan)."""
        flat = self._flat(target_params, drafter_params)
        return lambda: self._fns[key].lower(*flat, state, pack_plan(plan_for(key)))

    def install(self, compiled: dict) -> None:
        self._compiled.update(compiled)

    def run(self, key: StepKey, target_params, drafter_params, state, plan: StepPlan | np.ndarray):
        """Run the program of ``key`` on a host plan, or one already packed by :func:`pack_plan` (dispatch only:
        returns device futures). A key outside the closed set is a bug, never a compile."""
        fn = self._compiled.get(key)
        if fn is None:
            raise RuntimeError(f"no compiled program for {key}: not in the engine's closed set {self.keys} (or "
                               f"Engine.warmup() was not run)")
        packed = plan if isinstance(plan, np.ndarray) else pack_plan(plan)
        return fn(*self._flat(target_params, drafter_params), state, self.put(packed))

    def put(self, tree):
        """Host arrays to the device(s): replicated over the mesh, or to the default device."""
        if self.mesh is None:
            return jax.device_put(tree)
        return jax.device_put(tree, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

