"""vLLM's sampling parameters in the engine: penalties, min-p, min_tokens, stop strings and n samples per prompt.

Greedy with penalties equals target-only greedy with the same penalties (numpy, written independently), in the
host loop (with preemption and recompute) and the device loop; min_tokens holds EOS back; stop strings cut the
text before the match (a match spanning tokens included); n samples have their own seed streams and share the
prompt's pages; every bad setting is refused before any device work. The distributions under sampling are checked
in tests/test_engine_sampling.py. CPU, f32, reference kernels, one shared engine.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.platform import loops_unrolled
from spec_decode import Engine, SamplingParams
from spec_decode.programs import pack_plan, unpack_plan
from spec_decode.sampling_params import apply_penalties, filter_logits, filter_logits_by_search
from spec_decode.step import StepPlan
from spec_decode.stop_strings import StopStrings
from tests.engine_models import (
    EOS,
    VOCAB,
    bigram_drafter,
    damped_target,
    filtered_probs,
    greedy_reference,
    penalized,
    random_prompts,
)

PENALTIES = dict(repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.4)


class PairTokenizer:
    """Token t decodes to two letters, so a stop string can span two tokens."""

    def decode(self, ids):
        return "".join(chr(65 + t % 26) + chr(97 + (7 * t) % 26) for t in ids)


@pytest.fixture(scope="module")
def target():
    return damped_target()


@pytest.fixture(scope="module")
def engine(target):
    # 2 slots, one token bucket (K = 3); 16 pages of 4 tokens: two long requests cannot both finish (preemption)
    return Engine(target, bigram_drafter(target, block_size=3), num_speculative_tokens=3, verification="fixed",
                  cost_table=None, max_num_seqs=2, max_model_len=48, num_pages=16, max_num_batched_tokens=16,
                  min_token_bucket=32, device_loop_token_buckets=1, implementation="reference",
                  tokenizer=PairTokenizer())


def reference(target, prompt, new, *, min_tokens=0, stop=(EOS,), **penalties):
    kw = dict(repetition=penalties.get("repetition_penalty", 1.0), frequency=penalties.get("frequency_penalty", 0.0),
              presence=penalties.get("presence_penalty", 0.0))

    def transform(logits, out):
        logits = penalized(logits, prompt, out, **kw)
        if len(out) < min_tokens:
            logits[list(stop)] = -np.inf
        return logits

    return greedy_reference(target, prompt, new, stop=stop, length=48, transform=transform)


def test_greedy_with_penalties_equals_target_only_greedy_with_penalties(engine, target):
    prompts = random_prompts(3, [6, 19, 25], seed=3)
    new = 22
    want = [reference(target, p, new, stop=(), **PENALTIES) for p in prompts]
    plain = [reference(target, p, new, stop=()) for p in prompts]
    assert all(w != q for w, q in zip(want, plain))  # the penalties change every greedy output
    mixed = [SamplingParams(max_new_tokens=new, ignore_eos=True, **PENALTIES),
             SamplingParams(max_new_tokens=new, ignore_eos=True),
             SamplingParams(max_new_tokens=new, ignore_eos=True, **PENALTIES)]
    host = engine.generate(prompts, sampling_params=mixed, progress=False)
    assert [r.token_ids for r in host] == [want[0], plain[1], want[2]]  # a per-row switch
    assert host.stats["preemptions"] > 0  # a recomputed request's history came back whole
    for loop in ("host", "device"):
        res = engine.generate(prompts, max_new_tokens=new, ignore_eos=True, loop=loop, progress=False, **PENALTIES)
        assert [r.token_ids for r in res] == want, loop
        assert res.stats["compiles"] == 0
    # sampled, fixed K: both loops verify the same drafts with the same keys, so they give the same tokens
    kw = dict(max_new_tokens=new, ignore_eos=True, temperature=1.0, min_p=0.05, seed=4, progress=False, **PENALTIES)
    host, dev = (engine.generate(prompts, loop=loop, **kw) for loop in ("host", "device"))
    assert [r.token_ids for r in host] == [r.token_ids for r in dev]


def test_min_tokens_holds_eos_back(engine, target):
    prompt = random_prompts(1, [5])[0]
    plain = reference(target, prompt, 12)
    assert plain[-1] == EOS and len(plain) < 6  # without min_tokens it stops early
    want = reference(target, prompt, 12, min_tokens=6)
    assert EOS not in want[:5] and want != plain
    for loop in ("host", "device"):
        res = engine.generate([prompt], max_new_tokens=12, min_tokens=6, loop=loop, progress=False)
        assert res[0].token_ids == want, loop
    # with penalties too, and min_tokens == max_new_tokens: EOS never comes
    res = engine.generate([prompt], max_new_tokens=8, min_tokens=8, progress=False, **PENALTIES)
    assert res[0].token_ids == reference(target, prompt, 8, min_tokens=8, **PENALTIES)
    assert res[0].finish_reason == "length"


def test_stop_strings_cut_the_text_before_the_match(engine):
    tok = PairTokenizer()
    prompt = random_prompts(1, [9], seed=5)[0]
    full = engine.generate([prompt], max_new_tokens=14, ignore_eos=True, progress=False)[0]
    texts = [tok.decode(full.token_ids[:n]) for n in range(15)]
    assert texts[14] == full.text
    stop = texts[14][11:13]  # the 6th token's 2nd letter, the 7th's 1st: a lower-upper pair spans two tokens

    def first_match(min_tokens):
        """(tokens kept, text kept): the first token that completes a match in the text it adds."""
        for n in range(max(min_tokens, 1), 15):
            i = texts[n].find(stop, max(0, len(texts[n - 1]) - len(stop) + 1))
            if i >= 0:
                return n, texts[n][:i]
        return 14, texts[14]

    keep, text = first_match(0)
    assert keep <= 7 and stop not in text  # tokens 6 and 7 (1-based) complete it, or an earlier pair
    for loop in ("host", "device"):
        res = engine.generate([prompt], max_new_tokens=14, ignore_eos=True, stop=["zzz", stop], loop=loop,
                              progress=False)[0]
        assert (res.token_ids, res.text) == (full.token_ids[:keep], text), loop
        assert res.finish_reason == "stop" and res.stats["stop_string"] == stop
    # the step that completes the match emitted tokens after it: their log-probabilities go with them
    scored = engine.generate([prompt], sampling_params=SamplingParams(max_new_tokens=14, ignore_eos=True, stop=stop,
                                                                      logprobs=1), progress=False)[0]
    assert scored.token_ids == full.token_ids[:keep]
    assert [t.token_id for t in scored.logprobs] == scored.token_ids
    streamed = []
    for _, new in engine.stream([prompt], max_new_tokens=14, ignore_eos=True, stop=stop):
        streamed += new
    assert streamed == full.token_ids[:keep]
    # min_tokens: a match completed before that many tokens does not count (and is not found later)
    late = engine.generate([prompt], max_new_tokens=14, ignore_eos=True, stop=stop, min_tokens=keep + 1,
                           progress=False)[0]
    keep_late, text_late = first_match(keep + 1)
    assert (late.token_ids, late.text) == (full.token_ids[:keep_late], text_late) and keep_late > keep


def test_n_samples_have_their_own_seed_streams_and_share_the_prompt(engine):
    prompts = random_prompts(2, [13, 10], seed=7)
    res = engine.generate(prompts, n=3, temperature=1.0, seed=11, max_new_tokens=6, ignore_eos=True,
                          progress=False)
    assert len(res) == 6
    assert [(r.stats["prompt_index"], r.stats["sample"]) for r in res] == [(i, j) for i in range(2) for j in range(3)]
    assert res.stats["prefix_cache_tokens"] >= 2 * 12 + 2 * 8  # samples 1, 2 reuse the full pages of sample 0
    for i, p in enumerate(prompts):
        outs = [res[3 * i + j].token_ids for j in range(3)]
        assert len({tuple(o) for o in outs}) > 1  # distinct seed streams
        for j in range(3):  # sample j of prompt i samples with seed + i * n + j, like a request of its own
            one = engine.generate([p], sampling_params=SamplingParams(temperature=1.0, seed=11 + 3 * i + j,
                                                                      max_new_tokens=6, ignore_eos=True),
                                  progress=False)[0]
            assert one.token_ids == outs[j]
    # through SamplingParams: sample j samples with seed + j
    res = engine.generate([prompts[0]], sampling_params=SamplingParams(temperature=1.0, seed=12, n=2,
                                                                       max_new_tokens=6, ignore_eos=True),
                          progress=False)
    assert res[1].token_ids == engine.generate([prompts[0]], temperature=1.0, seed=13, max_new_tokens=6,
                                               ignore_eos=True, progress=False)[0].token_ids


@pytest.mark.parametrize("kw,match", [
    (dict(min_p=1.5), "min_p must be in"), (dict(min_p=-0.1), "min_p must be in"),
    (dict(min_p=float("nan")), "min_p must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number > 0"),
    (dict(presence_penalty=-0.5), "presence_penalty must be a finite number >= 0"),
    (dict(presence_penalty=float("nan")), "presence_penalty must be a finite number >= 0"),
    (dict(frequency_penalty=-1.0), "frequency_penalty must be a finite number >= 0"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty must be a finite number >= 0"),
    (dict(n=0), r"n \(samples per prompt\) must be an integer >= 1"),
    (dict(n=2.0), r"n \(samples per prompt\) must be an integer >= 1"),
    (dict(stop=""), "stop holds an empty string at position 0"),
    (dict(stop=["ab", ""]), "stop holds an empty string at position 1"),
    (dict(stop=[3]), "stop holds 3 at position 0: stop sequences must be strings"),
    (dict(min_tokens=9, max_new_tokens=8), r"min_tokens must be an integer in \[0, max_new_tokens=8\]"),
    (dict(min_tokens=-1), r"min_tokens must be an integer in \[0"),
    (dict(n=4, seed=2**31 - 2), "not below 2"),
])
def test_bad_sampling_settings_are_refused_before_any_device_work(target, kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
    fresh = Engine(target, None, verification="none", max_num_seqs=1, max_model_len=16, implementation="reference",
                   tokenizer=PairTokenizer())
    with pytest.raises(ValueError, match=match):
        fresh.generate([[1, 5, 6]], progress=False, **kw)
    assert fresh.warmup_report is None and fresh._state is None  # nothing compiled, no state allocated


def test_settings_the_engine_cannot_serve_are_refused(target):
    no_tokenizer = Engine(target, None, verification="none", max_num_seqs=1, max_model_len=16,
                          implementation="reference")
    with pytest.raises(ValueError, match="prompt 0 has stop strings .* no tokenizer"):
        no_tokenizer.generate([[1, 5, 6]], stop=["ab"])
    greedy_only = Engine(target, None, verification="none", max_num_seqs=1, max_model_len=16, sampling=False,
                         implementation="reference")
    with pytest.raises(ValueError, match="prompt 0 has a penalty .* sampling=False"):
        greedy_only.generate([[1, 5, 6]], repetition_penalty=1.2)
    with pytest.raises(ValueError, match="prompt 0 has min_tokens=2: .* sampling=False"):
        greedy_only.generate([[1, 5, 6]], min_tokens=2)
    assert greedy_only.warmup_report is None and no_tokenizer.warmup_report is None


def test_transforms_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (4, VOCAB))
    prompts = [[1, 5, 5, 9], [2], [7, 8], [3]]
    outputs = [[5, 6, 6, 6], [], [7, 30, 30], [4]]
    counts = np.stack([np.bincount(o, minlength=VOCAB) for o in outputs]).astype(np.int32)
    mask = np.zeros((4, VOCAB), bool)
    for i, p in enumerate(prompts):
        mask[i, p] = True
    rep, freq, pres = np.asarray([1.5, 1.0, 0.7, 2.0]), np.asarray([0.5, 0.0, 1.0, 0.0]), np.asarray([0.3, 2.0, 0., 1.])
    temps = np.asarray([1.0, 0.5, 2.0, 1.0])
    got = apply_penalties(jnp.asarray(logits / temps[:, None], jnp.float32), jnp.asarray(counts), jnp.asarray(mask),
                          jnp.asarray(rep, jnp.float32), jnp.asarray(freq, jnp.float32),
                          jnp.asarray(pres, jnp.float32), temperature=jnp.asarray(temps, jnp.float32))
    want = np.stack([penalized(logits[i], prompts[i], outputs[i], repetition=rep[i], frequency=freq[i],
                               presence=pres[i]) / temps[i] for i in range(4)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    min_p, top_p = np.asarray([0.0, 0.1, 0.3, 1.0]), np.asarray([1.0, 0.9, 0.8, 1.0])
    out = filter_logits(jnp.asarray(logits, jnp.float32), jnp.zeros(4, jnp.int32), jnp.asarray(top_p, jnp.float32),
                        jnp.asarray(min_p, jnp.float32))
    probs = np.array(jnp.exp(out - jnp.max(out, -1, keepdims=True)), np.float64)
    probs /= probs.sum(-1, keepdims=True)
    for i in range(4):
        np.testing.assert_allclose(probs[i], filtered_probs(logits[i], min_p=min_p[i], top_p=top_p[i]), atol=1e-6)
    assert (probs[3] > 0).sum() == 1  # min_p 1: the argmax alone


def test_threshold_search_filter_equals_the_sort():
    """filter_logits_by_search (the vocabulary shards' filter, docs/PARALLELISM.md) keeps exactly what the sort keeps:
    ties at the top-k and nucleus boundaries, -0.0 beside +0.0, a constant row, k past the vocabulary, min-p; with
    its bisection unrolled (a GPU's program) and rolled (a CPU's)."""
    rng = np.random.default_rng(11)
    n, v = 24, 96
    x = (rng.normal(size=(n, v)) * 3).astype(np.float32)
    x[:, 10] = x[:, 40]  # ties
    x[:, 70] = x[:, 40]
    x[1] = 0.5  # a constant row
    x[2, :30] = -0.0
    x[2, 30:60] = 0.0
    x[3] = np.round(x[3])  # many ties everywhere
    top_k = rng.integers(0, v + 10, n).astype(np.int32)
    top_k[::3] = 0
    top_p = rng.uniform(0.05, 1.0, n).astype(np.float32)
    top_p[::4] = 1.0
    min_p = rng.uniform(0.0, 0.3, n).astype(np.float32)
    min_p[::2] = 0.0
    args = [jnp.asarray(a) for a in (x, top_k, top_p, min_p)]
    want = np.asarray(filter_logits(*args))
    for unroll in (True, False):
        with loops_unrolled(unroll):
            got = np.asarray(jax.jit(lambda *a: filter_logits_by_search(*a))(*args))  # a new trace per setting
        np.testing.assert_array_equal(got, want, err_msg=f"unrolled={unroll}")
    assert (want[~np.isin(np.arange(n), [1])] < -1e30).any()  # the filters did remove tokens


def test_stop_strings_match_only_new_text_after_min_tokens():
    tok = PairTokenizer()
    ids = [0, 1, 2, 3, 0, 1]  # "Aa" "Bh" "Co" "Dv" "Aa" "Bh"
    s = StopStrings(("aB",), tok)
    assert s.feed(ids[:1]) is None and s.feed(ids[:3]) == 2 and s.text == "A" and s.matched == "aB"
    late = StopStrings(("aB", "vA"), tok, min_tokens=3)
    assert late.feed(ids) == 5 and late.text == "AaBhCoD" and late.matched == "vA"  # "aB" at tokens 1-2: too early


def test_the_packed_plan_carries_every_sampling_field():
    rng = np.random.default_rng(1)
    r, t, m, b = 3, 8, 2, 4
    ints = {f: rng.integers(0, 50, r).astype(np.int32) for f in ("rows", "prefill_len", "prefill_start",
                                                                 "resume_token", "scheduled", "top_k", "seed",
                                                                 "limit", "prefill_emitted", "min_tokens")}
    floats = {f: rng.random(r).astype(np.float32) for f in ("temperature", "top_p", "min_p", "repetition_penalty",
                                                            "presence_penalty", "frequency_penalty")}
    plan = StepPlan(**ints, **floats, prefill_last=np.asarray([True, False, True]),
                    prefill_tokens=rng.integers(0, 9, t).astype(np.int32),
                    block_tables=rng.integers(0, 9, (r, b)).astype(np.int32), budget=np.asarray(5, np.int32),
                    stop_ids=rng.integers(-1, 9, (r, m)).astype(np.int32), commit=np.asarray(True))
    back = unpack_plan(jnp.asarray(pack_plan(plan)), num_rows=r, num_tokens=t, num_stop_ids=m)
    for name in list(ints) + list(floats) + ["prefill_last", "prefill_tokens", "block_tables", "budget", "stop_ids",
                                             "commit"]:
        np.testing.assert_array_equal(np.asarray(getattr(back, name)), np.asarray(getattr(plan, name)), name)
    # a plan without the transform fields packs them as off
    bare = unpack_plan(jnp.asarray(pack_plan(dataclasses.replace(plan, min_tokens=None, min_p=None,
                                                                 repetition_penalty=None))),
                       num_rows=r, num_tokens=t, num_stop_ids=m)
    assert np.all(np.asarray(bare.min_tokens) == 0) and np.all(np.asarray(bare.min_p) == 0)
    assert np.all(np.asarray(bare.repetition_penalty) == 1)
