"""Emulated acceptance (``spec_decode.synthetic``): the rates and their validation, the latent profiles, and an
engine on a random tiny pair whose measured acceptance matches the rates, with adaptive verification trimming
where the cost table makes trimming pay (CPU, f32, reference kernels)."""

import numpy as np
import pytest

from spec_decode import Engine, SamplingParams
from spec_decode.cost_table import CostTable
from spec_decode.synthetic import acceptance_rates, conditional_rates, emulated_confidences, request_profiles
from tests.engine_models import bigram_drafter as make_drafter
from tests.engine_models import damped_target, random_prompts

RATES = (0.8, 0.55, 0.3, 0.12)
COMMON = dict(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64, implementation="reference",
              min_token_bucket=32, device_loop=False, sampling=False, enable_prefix_caching=False)


def test_rates_from_a_length_and_validation():
    assert acceptance_rates(7, length=3.4) == pytest.approx((1.0, 1.0, 0.4, 0.0, 0.0, 0.0, 0.0))
    assert acceptance_rates(3, length=4) == (1.0, 1.0, 1.0)
    assert acceptance_rates(3, length=1) == (0.0, 0.0, 0.0)
    assert acceptance_rates(4, rates=RATES) == RATES
    assert conditional_rates((0.8, 0.4, 0.0, 0.0)) == pytest.approx((0.8, 0.5, 0.0, 0.0))
    for kw, match in ((dict(rates=(0.5, 0.6)), "non-increasing"), (dict(rates=(0.5,)), "K = 2"),
                      (dict(rates=(1.2, 0.5)), r"\[0, 1\]"), (dict(length=0.5), r"\[1, K \+ 1"),
                      (dict(length=3.5), r"\[1, K \+ 1"), (dict(), "not both"),
                      (dict(rates=(0.5, 0.2), length=2.0), "not both"), (dict(rates="ab"), "numbers|K = 2")):
        with pytest.raises(ValueError, match=match):
            acceptance_rates(2, **kw)


def test_profiles_average_to_the_rates():
    """Over many seeds the profiles' mean survival is the unconditional rate; 0 and 1 stay exact; they depend on
    the seed alone; noise moves the confidences and not the profiles."""
    base = conditional_rates((1.0, 0.7, 0.35, 0.0))
    seeds = np.arange(4000, dtype=np.int32)
    p = np.asarray(request_profiles(seeds, base, concentration=10.0))
    assert p.shape == (4000, 4) and np.all(p[:, 0] == 1.0) and np.all(p[:, 3] == 0.0)
    np.testing.assert_allclose(np.cumprod(p, axis=1).mean(0), (1.0, 0.7, 0.35, 0.0), atol=0.02)
    assert 0.1 < p[:, 1].std() < 0.2  # Beta(7, 3): sd 0.138
    np.testing.assert_array_equal(p[:10], np.asarray(request_profiles(seeds[:10], base, concentration=10.0)))
    noisy = np.asarray(emulated_confidences(p, seeds, noise=1.0))
    assert np.abs(noisy[:, 1] - p[:, 1]).mean() > 0.05
    np.testing.assert_array_equal(np.asarray(emulated_confidences(p, seeds, noise=0.0)), p)


@pytest.fixture(scope="module")
def pair():
    target = damped_target(damping=0.3)
    return target, make_drafter(target, block_size=4)


def _run(engine, n=96, new=40):
    prompts = random_prompts(n, [10 + i % 7 for i in range(n)], seed=9)
    params = [SamplingParams(max_new_tokens=new, ignore_eos=True, seed=100 + i) for i in range(n)]
    return engine.generate(prompts, sampling_params=params, progress=False)


def test_emulated_acceptance_matches_the_rates_and_adaptive_trims(pair):
    """Fixed K = 4 verifies every draft: the measured acceptance of the first k drafts is r_k within sampling
    error (over 1,000 request-steps). Adaptive under a table where each verified token costs as much as a whole
    step's overhead verifies fewer drafts than fixed K and accepts more per verified draft, with the emulated
    (calibrated) confidences; both say the acceptance was emulated."""
    target, drafter = pair
    fixed = Engine(target, drafter, num_speculative_tokens=4, verification="fixed", cost_table=None,
                   synthetic_acceptance_rates=RATES, **COMMON)
    res = _run(fixed)
    st = res.stats
    assert st["acceptance"] == "emulated"
    steps = sum(r.stats["target_steps"] for r in res)
    assert steps > 1000
    got = np.asarray(st["per_position_acceptance"])
    tol = 3 * np.sqrt(np.asarray(RATES) * (1 - np.asarray(RATES)) / steps) + 0.06  # sampling + profile spread
    assert np.all(np.abs(got - RATES) < tol), (got, RATES)
    # calibrated by construction: predicted and observed agree
    assert st["calibration_error"] < 0.05, st["calibration_error"]

    steep = CostTable.from_measurements({32: 1.0, 64: 2.0, 128: 4.0})
    adaptive = Engine(target, drafter, num_speculative_tokens=4, verification="adaptive", cost_table=steep,
                      synthetic_acceptance_rates=RATES, **COMMON)
    ares = _run(adaptive)
    a = ares.stats
    assert a["acceptance"] == "emulated"
    assert a["mean_verified_drafts_per_step"] < 0.8 * st["mean_verified_drafts_per_step"]
    acc_per_verified = {name: sum(sum(r.stats["accepted_per_position"]) for r in rr) /
                        sum(sum(r.stats["verified_per_position"]) for r in rr) for name, rr in (("f", res), ("a", ares))}
    assert acc_per_verified["a"] > acc_per_verified["f"] + 0.05, acc_per_verified
    real = Engine(target, drafter, num_speculative_tokens=4, verification="fixed", cost_table=None, **COMMON)
    assert _run(real, n=2, new=4).stats["acceptance"] == "real"


def test_bad_synthetic_settings_are_refused(pair):
    target, drafter = pair
    for kw, match in ((dict(synthetic_acceptance_rates=(0.5, 0.6, 0.1, 0.0)), "non-increasing"),
                      (dict(synthetic_acceptance_length=9.0), r"\[1, K \+ 1"),
                      (dict(synthetic_acceptance_length=2.0, synthetic_confidence_noise=-1.0), "noise"),
                      (dict(synthetic_acceptance_length=2.0, synthetic_concentration=0.0), "concentration")):
        with pytest.raises(ValueError, match=match):
            Engine(target, drafter, num_speculative_tokens=4, verification="fixed", cost_table=None, **kw, **COMMON)
    with pytest.raises(ValueError, match="drafts nothing"):
        Engine(target, None, verification="none", synthetic_acceptance_length=2.0, **COMMON)


def test_a_closed_batch_verifies_the_rows_behind_first(pair, monkeypatch):
    """A closed batch (as many requests as slots, nothing waiting) under a table that trims: with the rows' tokens
    left as the allocation's priority the batch ends sooner than when survival alone ranks the drafts, because the
    requests with low emulated rates are no longer the ones left without verified drafts on every step. Both
    loops; the device loop's waves are closed too."""
    import spec_decode.step as step_module

    target, drafter = pair
    # 8 rows: a 16-token step (8 drafts verified) pays, a 32-token one does not, so a third of the drafts is verified
    table = CostTable.from_measurements({8: 1.0, 16: 1.3, 32: 2.6, 64: 5.2})
    kw = dict(num_speculative_tokens=4, verification="adaptive", cost_table=table, synthetic_acceptance_rates=RATES,
              synthetic_concentration=2.0, **{**COMMON, "device_loop": True, "min_token_bucket": 8})

    def run(engine, loop):
        return _run(engine, n=8, new=40) if loop == "host" else engine.generate(
            random_prompts(8, [10 + i % 7 for i in range(8)], seed=9), loop="device",
            sampling_params=[SamplingParams(max_new_tokens=40, ignore_eos=True, seed=100 + i) for i in range(8)])

    with_priority = Engine(target, drafter, **kw)
    steps = {loop: run(with_priority, loop).stats for loop in ("host", "device")}
    del with_priority
    plain = step_module.allocate_drafts
    monkeypatch.setattr(step_module, "allocate_drafts", lambda c, s, b, priority=None: plain(c, s, b))
    by_survival = Engine(target, drafter, **kw)
    for loop in ("host", "device"):
        alone = run(by_survival, loop).stats
        assert steps[loop]["verify_steps"] < alone["verify_steps"], (loop, steps[loop]["verify_steps"],
                                                                      alone["verify_steps"])
