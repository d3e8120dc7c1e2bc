"""The engine at serving concurrency: a closed program set (nothing compiles after warm-up, whatever arrives),
async scheduling (the same greedy tokens as the synchronous loop), prefix caching (the same tokens, shared pages
never written by another request, eviction under a tiny pool), the persistent compilation cache (a second process
compiles nothing). CPU, f32, reference kernels."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pallas_kernels.platform import loops_unrolled, unroll_loops
from spec_decode import Engine, SamplingParams
from spec_decode.programs import compile_counter
from spec_decode.scheduler import Scheduler
from tests.engine_models import EOS, VOCAB, bigram_drafter, damped_target, greedy_reference, random_prompts

COMMON = dict(max_num_seqs=3, max_model_len=96, max_num_batched_tokens=16, implementation="reference")
GREEDY = dict(COMMON, sampling=False)  # greedy tests: the greedy programs alone (the device loop too: multi-step launches)


@pytest.fixture(scope="module")
def target():
    return damped_target(damping=0.3)


@pytest.fixture(scope="module")
def drafter(target):
    return bigram_drafter(target, block_size=7)


def mixed_params(rng, n):
    """Random lengths, greedy and sampled rows (temperature, top-k, top-p, min-p), stop ids, ignore_eos,
    penalties and min_tokens (greedy or sampled)."""
    out = []
    for _ in range(n):
        kw = dict(max_new_tokens=int(rng.integers(1, 14)), seed=int(rng.integers(0, 1000)))
        kind = rng.integers(0, 5)
        if kind == 1:
            kw.update(temperature=float(rng.uniform(0.5, 1.5)))
        elif kind == 2:
            kw.update(temperature=1.0, top_k=int(rng.integers(1, 8)), top_p=float(rng.uniform(0.5, 1.0)))
        elif kind == 3:
            kw.update(stop_token_ids=tuple(int(x) for x in rng.integers(3, VOCAB, size=rng.integers(1, 4))),
                      ignore_eos=bool(rng.integers(0, 2)))
        elif kind == 4:
            kw.update(temperature=float(rng.choice([0.0, 1.0])), min_p=0.05, repetition_penalty=1.3,
                      frequency_penalty=0.5, presence_penalty=0.2,
                      min_tokens=int(rng.integers(0, min(3, kw["max_new_tokens"] + 1))))
        out.append(SamplingParams(**kw))
    return out


@pytest.mark.parametrize("mode, k, async_scheduling", [("adaptive", 3, True), ("fixed", 7, False), ("none", 0, True)])
def test_nothing_compiles_after_warm_up(target, drafter, mode, k, async_scheduling):
    """Warm-up compiles the closed set; then fresh random prompt sets of random lengths, greedy and sampled rows
    mixed, admissions and finishes at random steps, through the host loop, a stream and the device loop: zero XLA
    compilations, counted by JAX's own monitoring events."""
    eng = Engine(target, drafter if k else None, num_speculative_tokens=k, verification=mode,
                 async_scheduling=async_scheduling, precompile=True, **COMMON)
    # every step program, the two device loops, the token-history writer (penalties)
    assert eng.warmup_report.programs == len(eng.step_keys) + 3
    rng = np.random.default_rng(7)
    with compile_counter(cache_loads=True) as compiled:  # a program loaded from a persistent cache counts too
        for call in range(3):
            n = int(rng.integers(1, 8))
            prompts = random_prompts(n, rng.integers(2, 60, size=n), seed=100 + call)
            params = mixed_params(rng, n)
            res = eng.generate(prompts, sampling_params=params, progress=False)
            assert res.stats["compiles"] == 0
            assert all(1 <= len(r.token_ids) <= p.max_new_tokens for r, p in zip(res, params))
            for _ in eng.stream(prompts[:2], sampling_params=params[:2]):
                pass
            dev = eng.generate(prompts, sampling_params=params, loop="device")
            assert dev.stats["compiles"] == 0
    assert compiled == []
    eng.warmup()  # idempotent
    assert compiled == []


def test_async_and_sync_scheduling_give_the_same_greedy_tokens(target, drafter):
    """Async scheduling (the host plans step n+1 before reading step n back) with preemption under a tiny page
    pool and more requests than slots: the tokens are the synchronous loop's and target-only decoding's."""
    prompts = random_prompts(6, [20, 15, 30, 13, 26, 40], seed=3)
    max_new = [12, 9, 16, 5, 14, 11]
    refs = [greedy_reference(target, p, n) for p, n in zip(prompts, max_new)]
    params = [SamplingParams(max_new_tokens=m) for m in max_new]
    engines = []  # both alive: the second engine (same programs) reuses the first one's instead of compiling
    for async_scheduling in (True, False):
        eng = Engine(target, drafter, num_speculative_tokens=3, verification="adaptive", cost_table=None,
                     async_scheduling=async_scheduling, num_pages=16, **GREEDY)
        engines.append(eng)
        res = eng.generate(prompts, sampling_params=params, progress=False)
        assert [r.token_ids for r in res] == refs, f"async_scheduling={async_scheduling}"
        assert res.stats["preemptions"] > 0 and res.stats["async_scheduling"] == async_scheduling
        for r, ref in zip(res, refs):
            assert r.finish_reason == ("stop" if ref[-1] == EOS else "length")


def test_prefix_caching_shares_pages_and_changes_no_output(target, drafter, monkeypatch):
    """Requests sharing a 40-token prefix: with the cache on, later requests reuse its pages (hit rate > 0, fewer
    prefill tokens); every write of every step lands on pages its request owns alone (Scheduler.check_writes);
    the tokens equal the cache-off run's and target-only decoding's; a tiny pool evicts and still agrees."""
    monkeypatch.setattr(Scheduler, "check_writes", True)
    rng = np.random.default_rng(0)
    prefix = [1] + [int(x) for x in rng.integers(3, VOCAB - 1, size=39)]
    prompts = [prefix + [int(x) for x in rng.integers(3, VOCAB - 1, size=n)] for n in (5, 11, 2, 17, 8)]
    params = [SamplingParams(max_new_tokens=m) for m in (10, 6, 12, 4, 9)]
    refs = [greedy_reference(target, p, s.max_new_tokens) for p, s in zip(prompts, params)]
    runs, engines = {}, {}
    for name, kw in (("off", dict(enable_prefix_caching=False)), ("on", {})):
        engines[name] = eng = Engine(target, drafter, num_speculative_tokens=3, verification="fixed",
                                     **{**GREEDY, **kw})
        runs[name] = eng.generate(prompts, sampling_params=params, progress=False)
        assert [r.token_ids for r in runs[name]] == refs, name
    # a pool of 20 pages: the cached pages of earlier calls are evicted (LRU) to make room; outputs stay exact
    tiny = Engine(target, drafter, num_speculative_tokens=3, verification="fixed", num_pages=20, **GREEDY)
    other = random_prompts(1, [70], seed=9)[0]
    for prompt_set in ([prompts[0], prompts[1]], [other], [prompts[2], prompts[0]], [other]):
        res = tiny.generate(prompt_set, max_new_tokens=6, progress=False)
        assert [r.token_ids for r in res] == [greedy_reference(target, p, 6) for p in prompt_set]
    assert tiny.pool.stats["evictions"] > 0
    on, off = runs["on"].stats, runs["off"].stats
    assert off["prefix_cache_hit_rate"] == 0 and on["prefix_cache_hit_rate"] > 0.3
    assert on["prefill_tokens"] + on["prefix_cache_tokens"] == off["prefill_tokens"]
    assert on["prefill_tokens"] <= off["prefill_tokens"] - 3 * 40  # 3+ reused the 40-token prefix
    # a second call on the same engine hits the pages the first one left cached (they outlive the run); the
    # cache-on engine serves, its cache emptied first (as a fresh engine's)
    eng = engines["on"]
    assert eng.reset_prefix_cache() > 0  # the earlier call's prompt pages
    eng.generate(prompts[:1], sampling_params=params[:1], progress=False)
    again = eng.generate(prompts[1:2], sampling_params=params[1:2], progress=False)
    assert again.stats["prefix_cache_tokens"] == 40 and again[0].token_ids == refs[1]
    # reset_prefix_cache: the next call prefills its whole prompt, with the same tokens; refused while a stream
    # of this thread holds the engine, which it leaves serving
    stream = eng.stream(prompts[:1], max_new_tokens=2)
    next(stream)
    with pytest.raises(RuntimeError, match="already running"):
        eng.reset_prefix_cache()
    stream.close()
    eng.generate(prompts[:1], sampling_params=params[:1], progress=False)  # caches the shared prefix again
    assert eng.reset_prefix_cache() > 0
    assert eng.reset_prefix_cache() == 0
    fresh = eng.generate(prompts[1:2], sampling_params=params[1:2], progress=False)
    assert fresh.stats["prefix_cache_tokens"] == 0 and fresh[0].token_ids == refs[1]


def test_a_closed_calls_prefill_drafts_nothing(target, drafter, monkeypatch):
    """Adaptive steps that carry a prefill chunk draft nothing while every request of the call has a slot and no
    decode row has more tokens left than a request still prefilling (those requests set when the call ends); they
    plan as usual when requests wait for slots to free, or when a decode row is the one behind. The tokens are
    target-only greedy decoding's in every case."""
    from spec_decode.cost_table import CostTable

    # verification is free and drafting nearly so: the planner drafts all 3 positions wherever it plans
    table = CostTable.from_measurements({8: 1.0, 16: 1.0, 32: 1.0}, draft_lengths={0: 0.0, 1: 0.001, 3: 0.002})
    eng = Engine(target, drafter, num_speculative_tokens=3, verification="adaptive", cost_table=table,
                 draft_lengths=(0, 1, 3), **{**GREEDY, "max_num_seqs": 4, "device_loop": False, "min_token_bucket": 8})
    assert 32 in eng.buckets_by_length[0]  # a full 16-token chunk beside 4 decode rows
    seen = []
    schedule = Scheduler.schedule

    def recorded(self, **kw):
        step = schedule(self, **kw)
        if step is not None:
            seen.append((step.num_prefill_tokens, step.num_decode, step.key.draft_len))
        return step

    monkeypatch.setattr(Scheduler, "schedule", recorded)

    def run(lengths, new, seed):
        seen.clear()
        prompts = random_prompts(len(lengths), lengths, seed=seed)
        res = eng.generate(prompts, sampling_params=[SamplingParams(max_new_tokens=m, ignore_eos=True) for m in new],
                           progress=False)
        assert [r.token_ids for r in res] == [greedy_reference(target, p, m, stop=()) for p, m in zip(prompts, new)]
        mixed = [d for pre, dec, d in seen if pre and dec]
        decode_only = [d for pre, dec, d in seen if dec and not pre]
        assert mixed and decode_only, seen
        return mixed, decode_only

    mixed, decode_only = run([20, 18, 22, 19], [8] * 4, seed=21)  # 4 requests, 4 slots
    assert set(mixed) == {0} and 3 in decode_only, (mixed, decode_only)
    mixed, _ = run([20, 18, 22, 19, 17, 21], [8] * 6, seed=22)  # 2 requests wait for a slot to free
    assert 3 in mixed, mixed
    mixed, _ = run([20, 18, 22, 19], [40, 4, 4, 4], seed=23)  # the first request is the one behind
    assert 3 in mixed, mixed


def test_a_second_process_loads_every_program_as_an_executable(tmp_path):
    """A fresh process with the same engine loads every program from the executable store (no tracing, no
    compilation) and generates the same tokens; with the stored files damaged, they are dropped (a warning) and the
    programs come from JAX's persistent compilation cache instead (traced, not compiled). On a CPU those are not
    stored again: such an executable serialises without its code, and the process after would fail at its first
    step (``Function ... not found``); it takes them from the JAX cache too, with the same tokens."""
    script = textwrap.dedent("""
        import os, sys, warnings
        sys.path.insert(0, os.getcwd())
        import tests.conftest  # CPU settings of the suite
        from spec_decode import Engine
        from spec_decode.programs import compile_counter
        from tests.engine_models import bigram_drafter, damped_target, random_prompts
        target = damped_target(damping=0.3)
        drafter = bigram_drafter(target, block_size=4)
        prompts = random_prompts(2, [9, 14], seed=4)
        with warnings.catch_warnings(record=True) as caught, compile_counter() as compiled:
            warnings.simplefilter("always")
            eng = Engine(target, drafter, num_speculative_tokens=3,
                         verification="fixed", max_num_seqs=2, max_model_len=48, max_num_batched_tokens=8,
                         implementation="reference", sampling=False)
            assert eng.compilation_cache_dir == os.environ["MINIMAX_JAX_CACHE_DIR"], eng.compilation_cache_dir
            report = eng.warmup()
            res = eng.generate(prompts, max_new_tokens=6, progress=False)
        dropped = sum("dropping the stored executable" in str(w.message) for w in caught)
        print("REPORT", report.programs, report.compiled, report.loaded, dropped, len(compiled), len(report.slowest))
        print("TOKENS", [r.token_ids for r in res])
    """)
    cache = tmp_path / "jax"
    env = {**os.environ, "MINIMAX_JAX_COMPILATION_CACHE": "1", "MINIMAX_JAX_CACHE_DIR": str(cache),
           "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = []
    for phase in ("cold", "warm", "damaged", "after"):
        if phase == "damaged":
            for f in (tmp_path / "executables").iterdir():
                f.write_bytes(f.read_bytes()[:100])
        proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = {x.split()[0]: x.split(None, 1)[1] for x in proc.stdout.splitlines() if x.startswith(("REPORT", "TOK"))}
        runs.append((tuple(int(v) for v in lines["REPORT"].split()), lines["TOKENS"]))
    (cold, tokens), (warm, warm_tokens), (damaged, damaged_tokens), (after, after_tokens) = runs
    programs = cold[0]
    assert programs > 0 and cold[1] >= programs and cold[2] == 0, cold
    # every program loaded (the longest loads timed in the report); nothing compiled, warm-up or call
    assert warm == (programs, 0, programs, 0, 0, min(programs, 6)), warm
    assert damaged[0] == programs and damaged[1] == 0 and damaged[2] == 0 and damaged[3] == programs, damaged
    assert after[:5] == (programs, 0, 0, 0, 0), after  # from the JAX cache again: nothing loaded, none compiled
    assert cold[5] == min(programs, 6), cold  # the longest compilations
    assert tokens == warm_tokens == damaged_tokens == after_tokens
    assert any(cache.iterdir()) and not list((tmp_path / "executables").iterdir())  # cache loads are not stored


def test_engines_with_the_same_settings_share_their_programs(target, drafter):
    """A second engine with the same settings, over another target of the same config (other weights), compiles
    nothing: it reuses the first one's programs (weights are arguments, not part of a program), and generates that
    target's own greedy tokens."""
    kw = dict(num_speculative_tokens=3, verification="fixed", precompile=True, **GREEDY)
    first = Engine(target, drafter, **kw)
    other = damped_target(damping=0.5, seed=4)
    prompts = random_prompts(2, [11, 17], seed=21)
    with compile_counter(cache_loads=True) as compiled:
        second = Engine(other, bigram_drafter(other, block_size=7), **kw)
        res = second.generate(prompts, max_new_tokens=8, progress=False)
    assert compiled == [] and second.warmup_report.loaded == second.warmup_report.programs == \
        first.warmup_report.programs
    assert [r.token_ids for r in res] == [greedy_reference(other, p, 8) for p in prompts]
    # every program was lowered without Python stack frames (spec_decode.programs.without_source_frames)
    texts = [c.as_text() for c in (*first._programs._compiled.values(), *first._loop_programs.values())]
    assert len(texts) == first.warmup_report.programs and not any("stack_frame_id" in t for t in texts)


def test_programs_are_lowered_without_stack_frames(no_persistent_cache):
    """compile_in_pool lowers without Python stack frames in the locations (a GPU executable's load formats every
    instruction's frames): the compiled module names its ops and carries no frame, where the same function lowered
    outside it carries them."""
    import jax
    import jax.numpy as jnp

    from spec_decode.programs import compile_in_pool

    def fn(x):
        with jax.named_scope("scoped"):
            return jnp.sin(x) * 2 + jnp.cos(x)

    x = jnp.ones(8)
    plain = jax.jit(lambda v: fn(v) + 1).lower(x).compile().as_text()
    done, _ = compile_in_pool([("p", lambda: jax.jit(lambda v: fn(v) + 1).lower(x))], total=1, progress=False,
                              desc="test")
    text = done["p"].as_text()
    assert "stack_frame_id" in plain and "stack_frame_id" not in text
    assert 'op_name="jit(<lambda>)/scoped/sin"' in text  # named scopes stay (the profilers read them)
    np.testing.assert_array_equal(np.asarray(done["p"](x)), np.asarray(fn(x) + 1))


def test_compile_counter_counts_persistent_cache_loads_when_asked(own_persistent_cache):
    """compile_counter() counts XLA compilations only; with ``cache_loads=True`` a program that JAX's persistent
    cache served counts too (what "nothing compiles after warm-up" means where such a cache is on: the suite's,
    or a user's)."""
    import jax
    import jax.numpy as jnp

    from spec_decode.programs import compile_counter

    x = jnp.ones(5)

    def ready():  # a new function each time: the jit's in-memory caches miss, the persistent one may not
        return jax.jit(lambda v: jnp.tanh(v) * 3 - v).lower(x).compile()

    with compile_counter() as compiled, compile_counter(cache_loads=True) as made:
        ready()
    assert len(compiled) == len(made) == 1
    with compile_counter() as compiled, compile_counter(cache_loads=True) as made:
        ready()
    assert compiled == [] and len(made) == 1


def test_the_executable_store_keys_change_with_the_engine(target, drafter):
    """A program's key in the executable store covers the engine's settings: the same engine gives the same keys,
    another model length or another drafter config other keys (the weights are arguments: not in a key), and so do
    the step's short loops traced unrolled (a GPU's form) instead of rolled."""
    def keys(**kw):
        eng = Engine(target, kw.pop("drafter", drafter), num_speculative_tokens=3, verification="fixed",
                     **{**GREEDY, **kw})
        names = list(eng._programs.missing) + [("loop", False, None)]
        eng._state = eng._init_state()
        return eng._program_digests(names)

    base = keys()
    assert keys() == base and len(set(base.values())) == len(base)
    assert not set(keys(max_model_len=GREEDY["max_model_len"] + 16).values()) & set(base.values())
    other = bigram_drafter(target, block_size=4)  # another drafter config (its weights alone would not count)
    assert not set(keys(drafter=other).values()) & set(base.values())
    with loops_unrolled(not unroll_loops()):
        assert not set(keys().values()) & set(base.values())


def test_the_store_loads_the_device_loops_first(target, drafter, tmp_path):
    """A warm start loads the longest programs first (the device loops, then the sampling steps, as warm-up
    compiles them): queued last, a loop would start only as the pool's first round of step programs ended."""
    from spec_decode.executable_store import ExecutableStore

    order = []

    class Recording(ExecutableStore):
        def load(self, digest):
            order.append(digest)
            return super().load(digest)

    eng = Engine(target, drafter, num_speculative_tokens=3, verification="fixed", **GREEDY)
    eng._executables = Recording(str(tmp_path))
    eng._state = eng._init_state()
    loops = [("loop", False, None), ("loop", True, None)]
    names = list(eng._programs.missing) + ["history"] + loops
    digests = eng._program_digests(names)
    # an empty store, and no program of this process under that code key: nothing loads
    assert eng._load_executables(digests, "no program of this process") == {}
    assert len(order) == len(names) and set(order[:2]) == {digests[n] for n in loops}, order
    assert order[-1] == digests["history"]


def test_a_profiled_cost_table_is_kept_and_loaded_by_the_next_engine(target, drafter, tmp_path, monkeypatch):
    """The warm-up profile is saved under a key of what the timings depend on; an engine with the same key loads it
    instead of profiling, one with other settings profiles its own. Within the process, a second engine with the
    same key and code takes the first one's table, files or not."""
    from spec_decode import compilation_cache

    monkeypatch.setenv("MINIMAX_JAX_COMPILATION_CACHE", "1")
    monkeypatch.setenv("MINIMAX_JAX_CACHE_DIR", str(tmp_path / "jax"))
    monkeypatch.setattr(compilation_cache, "enable", lambda path=None: None)  # keep JAX's own cache off here
    kw = dict(num_speculative_tokens=3, verification="adaptive", precompile=True, device_loop=False, sampling=False,
              **{**COMMON, "min_token_bucket": 16})
    first = Engine(target, drafter, **kw)
    files = list((tmp_path / "cost_tables").iterdir())
    assert len(files) == 1 and first.cost_table is not None
    beside = Engine(target, drafter, **kw, compilation_cache=False)  # no files: the process's table, not a profile
    assert beside.cost_table is first.cost_table and beside.warmup_report.compiled == 0
    calls = []
    monkeypatch.setattr(Engine, "_profile_host_steps", lambda self, bar: calls.append(self) or 0)
    second = Engine(target, drafter, **kw)
    assert calls == [] and second.cost_table.verify_seconds == first.cost_table.verify_seconds
    assert second.cost_table.draft_lengths == first.cost_table.draft_lengths == (0, 3)
    assert second.cost_table.draft_length_seconds == first.cost_table.draft_length_seconds
    other = Engine(target, drafter, **{**kw, "max_num_seqs": 2})
    assert calls == [other]  # another key: profiled (here: the patched profiler)
