"""Bad input to ``Engine.generate`` / ``stream`` gets a clear ``ValueError`` before any device work, and never
changes the engine: one test per defect users hit (spec_decode.request.build_requests). CPU, f32, reference
kernels, one shared engine."""

import numpy as np
import pytest

from spec_decode import Engine, SamplingParams
from spec_decode.request import build_requests
from tests.engine_models import EOS, VOCAB, bigram_drafter, damped_target, greedy_reference

PROMPT = [1, 5, 9, 4, 17, 8, 3]
NEW = 5


class CharTokenizer:
    """A tokenizer for string prompts: BOS 1, then one id in [3, 23) per character."""

    bos_token_id = 1

    def encode(self, text, add_bos=False):
        return ([1] if add_bos else []) + [3 + ord(c) % 20 for c in text]

    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def target():
    return damped_target(damping=0.3)


@pytest.fixture(scope="module")
def engine(target):
    return Engine(target, bigram_drafter(target, block_size=7), num_speculative_tokens=3, verification="adaptive",
                  cost_table=None, max_num_seqs=2, max_model_len=96, max_num_batched_tokens=16,
                  implementation="reference", tokenizer=CharTokenizer(), min_token_bucket=32, device_loop=False)


@pytest.fixture(scope="module")
def reference(target):
    return greedy_reference(target, PROMPT, NEW)


def tokens(engine, prompts, **kw):
    return [r.token_ids for r in engine.generate(prompts, progress=False, **kw)]


def build(prompts, keywords=None, sampling_params=None, **kw):
    args = dict(tokenizer=CharTokenizer(), vocab_size=VOCAB, eos_token_ids=(EOS,), max_model_len=96,
                max_stop_ids=8, keywords=keywords or {}, sampling_params=sampling_params)
    return build_requests(prompts, **{**args, **kw})


# 1. an empty string became BOS alone and generated
def test_empty_string_prompt_is_refused(engine):
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([""], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate(["ab", ""], max_new_tokens=2)
    assert build(["ab"])[0].prompt == [1, 3 + ord("a") % 20, 3 + ord("b") % 20]  # BOS kept for text


# 2. float ids were truncated (281.7 -> 281), digit strings parsed
@pytest.mark.parametrize("bad", [281.7, 5.0, True, "7", np.float32(3.0), None, [4]])
def test_non_integer_token_ids_are_refused(engine, bad):
    with pytest.raises(ValueError, match=rf"prompt 0 holds {bad!r} at position 3: token ids must be integers"
                       .replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        engine.generate([[1, 5, 6, bad]], max_new_tokens=2)


@pytest.mark.parametrize("array", [np.asarray([1, 5, 6, 2], np.float32), np.asarray([True, False, True])])
def test_arrays_of_non_integers_are_refused(engine, array):
    with pytest.raises(ValueError, match=r"prompt 0 holds .* at position 0: token ids must be integers"):
        engine.generate([array], max_new_tokens=2)


def test_numpy_integer_prompts_are_accepted(engine, reference):
    want = tokens(engine, [PROMPT], max_new_tokens=NEW)
    assert want == [reference]
    assert tokens(engine, [np.asarray(PROMPT, np.int64)], max_new_tokens=NEW) == want
    assert tokens(engine, [[np.int32(t) for t in PROMPT]], max_new_tokens=NEW) == want


# 3. overflow / type errors naming nothing
@pytest.mark.parametrize("prompt, match", [
    (42, "prompt 0 must be a string or a list of token ids, got int"),
    (None, "prompt 0 must be a string or a list of token ids, got NoneType"),
    (b"abc", "prompt 0 must be a string or a list of token ids, got bytes"),
    ([1, 2**70], rf"prompt 0 holds token id {2**70}, outside the vocabulary \[0, {VOCAB}\)"),
    (np.ones((2, 3), np.int32), "prompt 0 must be a list of token ids"),
])
def test_unrepresentable_prompts_give_value_errors(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([prompt], max_new_tokens=2)


def test_top_k_beyond_the_vocabulary_keeps_everything(engine, reference):
    assert build([PROMPT], {"top_k": 2**40})[0].params.top_k == VOCAB
    assert tokens(engine, [PROMPT], max_new_tokens=NEW, top_k=2**40) == [reference]
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        engine.generate([PROMPT], top_k=2.5)


# 4. numpy scalars were refused as "must be a finite number >= 0"
def test_numpy_scalars_are_accepted(engine, reference):
    p = SamplingParams(temperature=np.float32(0.0), top_k=np.int64(5), top_p=np.float64(1.0), seed=np.int64(5),
                       max_new_tokens=np.int64(5), stop_token_ids=np.asarray([7]), ignore_eos=np.bool_(False))
    assert (type(p.temperature), type(p.top_k), type(p.top_p), type(p.seed), type(p.max_new_tokens),
            type(p.ignore_eos), type(p.stop_token_ids[0])) == (float, int, float, int, int, bool, int)
    got = tokens(engine, [PROMPT], temperature=np.float32(0.0), top_k=np.int64(5), max_new_tokens=np.int64(NEW),
                 seed=np.int64(5))
    assert got == [reference]
    for bad in (dict(top_k=np.float32(5)), dict(max_new_tokens=5.0), dict(stop_token_ids=[2.0])):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# 5. keywords next to sampling_params were silently ignored
def test_keywords_with_sampling_params_are_refused(engine):
    with pytest.raises(ValueError, match=r"not both \(got temperature=0.5 with sampling_params\)"):
        engine.generate([PROMPT], temperature=0.5, sampling_params=SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=r"got max_new_tokens=3, seed=4 with sampling_params"):
        list(engine.stream([PROMPT], max_new_tokens=3, seed=4, sampling_params=[SamplingParams()]))
    # the defaults are not "passed": sampling_params alone is fine
    assert len(build([PROMPT], sampling_params=SamplingParams(max_new_tokens=2))) == 1


# 6. the prompt-length error named max_position_embeddings (512 here) for the engine's max_model_len (96)
def test_prompt_length_error_names_max_model_len(engine):
    with pytest.raises(ValueError, match=r"prompt 1 has 96 tokens, more than max_model_len - 1 = 95"):
        engine.generate([PROMPT, [1] * 96], max_new_tokens=2)
    assert len(build([[1] * 95])[0].prompt) == 95


# 7. generate(seed=2**31) sampled like seed=0
def test_seeds_are_below_2_31(engine):
    assert [r.params.seed for r in build([PROMPT] * 3, {"seed": 7})] == [7, 8, 9]
    assert [r.params.seed for r in build([PROMPT] * 2, {"seed": 2**31 - 2})] == [2**31 - 2, 2**31 - 1]
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*31\), got 2147483648"):
        engine.generate([PROMPT], seed=2**31)
    with pytest.raises(ValueError, match=r"seed \+ 1 = 2147483648 is not below 2\*\*31"):
        engine.generate([PROMPT, PROMPT], seed=2**31 - 1)
    with pytest.raises(ValueError, match="seed must be an integer"):
        engine.generate([PROMPT], seed=-1)
    with pytest.raises(ValueError, match="seed must be an integer"):
        SamplingParams(seed=2**31)


# 8. a request with 20 stop ids widened an engine-wide array and broke every later call
def test_too_many_stop_ids_are_refused_and_change_nothing(engine, target, reference):
    assert tokens(engine, [PROMPT], max_new_tokens=NEW) == [reference]  # compiled
    width = engine.num_stop_ids
    with pytest.raises(ValueError, match=r"prompt 0 has 21 stop token ids \(EOS included\), more than the "
                                         r"engine's limit of 16; raise it with Engine\(max_stop_token_ids=\.\.\.\)"):
        engine.generate([PROMPT], max_new_tokens=NEW, stop_token_ids=list(range(3, 23)))
    assert engine.num_stop_ids == width == 16
    assert tokens(engine, [PROMPT], max_new_tokens=NEW) == [reference]
    no_stop = greedy_reference(target, PROMPT, NEW, stop=())
    assert tokens(engine, [PROMPT], max_new_tokens=NEW, ignore_eos=True) == [no_stop]
    # at the limit (7 + EOS) is fine; never stopping ids here, so the output is the reference
    unused = [t for t in range(3, VOCAB) if t not in reference][:7]
    assert tokens(engine, [PROMPT], max_new_tokens=NEW, stop_token_ids=unused) == [reference]


def test_build_requests_is_pure():
    args = dict(tokenizer=None, vocab_size=VOCAB, eos_token_ids=(EOS,), max_model_len=96, max_stop_ids=2,
                keywords={"stop_token_ids": [3, 4]}, sampling_params=None)
    with pytest.raises(ValueError, match="limit of 2"):
        build_requests([PROMPT], **args)
    assert args["keywords"] == {"stop_token_ids": [3, 4]}
    with pytest.raises(ValueError, match="prompt 0 is a string but the engine has no tokenizer"):
        build_requests(["x"], **{**args, "keywords": {}})


# 9. the checks that were there stay
@pytest.mark.parametrize("kwargs, match", [
    (dict(stop_token_ids=[VOCAB]), rf"prompt 0: stop_token_ids holds {VOCAB}, outside the vocabulary"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(ignore_eos="no"), "ignore_eos"),
    (dict(max_new_tokens=90), "KV pages, more than the pool's"),
])
def test_existing_checks_stay(target, kwargs, match):
    small = Engine(target, None, verification="none", max_num_seqs=1, max_model_len=96, num_pages=2,
                   implementation="reference")
    with pytest.raises(ValueError, match=match):
        small.generate([PROMPT], **kwargs)


# ----------------------------------------------------------------------------------------------- engine state
def test_plain_sampling_without_speculation(target):
    """verification="none" with temperature > 0 failed after device work (no draft distribution was passed)."""
    eng = Engine(target, None, verification="none", max_num_seqs=2, max_model_len=96, max_num_batched_tokens=16,
                 implementation="reference", min_token_bucket=32, device_loop=False)
    a = tokens(eng, [PROMPT] * 3, max_new_tokens=NEW, temperature=0.8, seed=4, ignore_eos=True)
    b = tokens(eng, [PROMPT] * 3, max_new_tokens=NEW, temperature=0.8, seed=4, ignore_eos=True)
    assert a == b and all(len(t) == NEW for t in a)  # reproducible from the seed
    assert len({tuple(t) for t in a}) > 1  # request i samples with seed + i: different streams
    assert all(0 <= x < VOCAB for t in a for x in t)


def test_generate_inside_an_open_stream_is_refused_and_the_stream_is_intact(engine, reference):
    """A generate() started while a stream() of the same engine is suspended reused the stream's slot and pages;
    now it is refused with a clear error and the stream resumes with the right tokens."""
    stream = engine.stream([PROMPT], max_new_tokens=NEW)
    got = list(next(stream)[1])
    with pytest.raises(RuntimeError, match="already running a generate\\(\\) or stream\\(\\) in this thread"):
        engine.generate([PROMPT], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="already running"):
        next(engine.stream([PROMPT], max_new_tokens=2))
    for _, new in stream:
        got.extend(new)
    assert got == reference
    assert tokens(engine, [PROMPT], max_new_tokens=NEW) == [reference]  # the engine is free again
    closed = engine.stream([PROMPT, PROMPT], max_new_tokens=NEW)
    next(closed)
    closed.close()  # breaking out of a stream frees its slots and the engine
    assert tokens(engine, [PROMPT], max_new_tokens=NEW) == [reference]


def test_two_threads_on_one_engine_are_serialised(engine, target, reference):
    """Two threads calling generate() on one engine died with 'Array has been deleted' or returned corrupted
    tokens; now the second waits for the first and both get the reference tokens."""
    import threading

    other = [1, 12, 6, 22, 9, 3, 14, 7]
    other_ref = greedy_reference(target, other, NEW)
    results, errors = {}, []

    def work(name, prompts):
        try:
            for _ in range(3):
                results.setdefault(name, []).append(tokens(engine, prompts, max_new_tokens=NEW))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=("a", [PROMPT, other])),
               threading.Thread(target=work, args=("b", [other, PROMPT, PROMPT]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert results["a"] == [[reference, other_ref]] * 3
    assert results["b"] == [[other_ref, reference, reference]] * 3


def test_a_launch_that_fails_surfaces_and_leaves_the_engine_usable(engine, reference):
    """A step whose launch raises (on the launcher thread, with steps still in flight) reaches the caller as
    that exception, after the launched steps finish; the engine then serves the next call with the right tokens,
    in the async and the synchronous loop."""
    programs = engine._programs
    run = programs.run
    for async_scheduling in (True, False):
        calls = {"n": 0}

        def failing(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("launch failed on purpose")
            return run(*args, **kwargs)

        engine.async_scheduling = async_scheduling
        programs.run = failing
        try:
            with pytest.raises(RuntimeError, match="launch failed on purpose"):
                tokens(engine, [PROMPT, PROMPT], max_new_tokens=NEW)
        finally:
            programs.run = run
            engine.async_scheduling = True
        assert calls["n"] == 4
        assert tokens(engine, [PROMPT, PROMPT], max_new_tokens=NEW) == [reference, reference]


def test_a_failed_prefill_leaves_no_unwritten_page_in_the_prefix_cache(engine, target):
    """The scheduler registers a prompt's pages in the prefix cache when it plans their prefill; if that step
    never runs, a later request with the same prompt must not reuse them (it would read pages never written)."""
    long = [1] + [3 + (7 * i) % 19 for i in range(40)]
    want = greedy_reference(target, long, NEW)
    programs = engine._programs
    run = programs.run

    def failing(*args, **kwargs):
        raise RuntimeError("prefill failed on purpose")

    programs.run = failing
    try:
        with pytest.raises(RuntimeError, match="prefill failed on purpose"):
            tokens(engine, [long], max_new_tokens=NEW)
    finally:
        programs.run = run
    res = engine.generate([long], max_new_tokens=NEW, progress=False)
    assert res.stats["prefix_cache_tokens"] == 0
    assert res[0].token_ids == want


# ----------------------------------------------------------------------------------------------- property test
def test_random_mixtures_of_valid_and_invalid_requests_never_corrupt_the_engine(engine, reference):
    """Random mixtures of valid and invalid calls (bad prompts, bad settings, too many stop ids, mixed keywords)
    at one engine; after each call a fixed greedy request still returns its reference tokens."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    good_prompt = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=30).map(lambda p: [1] + p)
    bad_prompt = st.sampled_from([[], "", [1, VOCAB], [1, -3], [1.5, 2], ["7"], None, 42, [1] * 96, [2**70]])
    good_kw = st.fixed_dictionaries({}, optional={
        "max_new_tokens": st.integers(1, 6), "temperature": st.sampled_from([0.0, 0.7, np.float32(1.0)]),
        "top_k": st.sampled_from([0, 3, 2**40]), "top_p": st.sampled_from([1.0, 0.6]),
        "seed": st.integers(0, 1000), "stop_token_ids": st.lists(st.integers(3, VOCAB - 1), max_size=3)})
    bad_kw = st.sampled_from([{"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2}, {"max_new_tokens": 0},
                              {"seed": 2**31}, {"stop_token_ids": list(range(3, 23))}, {"temperature": "hot"},
                              {"sampling_params": SamplingParams(), "temperature": 0.5}])
    call = st.tuples(st.lists(st.one_of(good_prompt, good_prompt, bad_prompt), min_size=1, max_size=3),
                     st.one_of(good_kw, good_kw, bad_kw))

    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(call)
    def run(args):
        prompts, kw = args
        try:
            res = engine.generate(prompts, progress=False, **{"max_new_tokens": 4, **kw})
            assert all(1 <= len(r.token_ids) <= 6 for r in res)
        except ValueError:
            pass
        assert tokens(engine, [PROMPT], max_new_tokens=NEW) == [reference]

    run()
