"""Arrival processes (rate and CV, statistically with fixed seeds), popularity, lengths and request fields."""

import numpy as np
import pytest

from placement.core.arrivals import GammaProcess, MarkovModulatedProcess, PoissonProcess
from placement.core.workload import (
    ClippedNormalLength,
    EmpiricalLength,
    FixedLength,
    ModelTraffic,
    Workload,
    gamma_workload,
    generate_workload,
    power_law_popularity,
    uniform_popularity,
)


def rate_and_cv(arrivals: np.ndarray, duration_s: float) -> tuple[float, float]:
    gaps = np.diff(arrivals)
    return len(arrivals) / duration_s, gaps.std() / gaps.mean()


def test_poisson_rate_and_cv():
    arrivals = PoissonProcess(20.0).generate(0.0, 5000.0, np.random.default_rng(0))
    rate, cv = rate_and_cv(arrivals, 5000.0)
    assert rate == pytest.approx(20.0, rel=0.02)
    assert cv == pytest.approx(1.0, rel=0.03)
    assert np.all(np.diff(arrivals) >= 0) and arrivals[0] >= 0 and arrivals[-1] < 5000.0


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_rate_and_cv(cv):
    arrivals = GammaProcess(10.0, cv).generate(100.0, 20000.0, np.random.default_rng(1))
    rate, measured_cv = rate_and_cv(arrivals, 20000.0)
    assert rate == pytest.approx(10.0, rel=0.06)
    assert measured_cv == pytest.approx(cv, rel=0.06)
    assert arrivals[0] >= 100.0


def test_markov_modulated_is_bursty_with_the_stationary_rate():
    process = MarkovModulatedProcess(rates=(2.0, 40.0), mean_dwell_s=(20.0, 2.0))
    arrivals = process.generate(0.0, 40000.0, np.random.default_rng(2))
    rate, cv = rate_and_cv(arrivals, 40000.0)
    assert process.mean_rate == pytest.approx((2 * 20 + 40 * 2) / 22)
    assert rate == pytest.approx(process.mean_rate, rel=0.06)
    assert cv > 1.5  # burstier than Poisson


def test_popularity():
    assert np.allclose(uniform_popularity(4), 0.25)
    shares = power_law_popularity(4, 0.5)
    assert shares.sum() == pytest.approx(1.0)
    assert shares[0] / shares[3] == pytest.approx(2.0)  # (1/1)^-0.5 / (4)^-0.5


def test_lengths():
    rng = np.random.default_rng(3)
    assert np.all(FixedLength(64).sample(10, rng) == 64)
    clipped = ClippedNormalLength(100, 80, min_tokens=16, max_tokens=128).sample(5000, rng)
    assert clipped.min() == 16 and clipped.max() == 128
    empirical = EmpiricalLength((1, 10, 100), (3, 1)).sample(20000, rng)
    assert np.mean(empirical < 10) == pytest.approx(0.75, abs=0.02)
    with pytest.raises(ValueError):
        EmpiricalLength((1, 10), (1, 2))


def test_generated_workload_fields_and_determinism():
    traffic = [
        ModelTraffic(PoissonProcess(5.0), slo_s=0.5, lengths=FixedLength(32), tasks=(0, 1), utility=2.0),
        ModelTraffic(GammaProcess(10.0, 3.0), slo_s=1.0),
    ]
    first = generate_workload(["a", "b"], traffic, 200.0, seed=7)
    second = generate_workload(["a", "b"], traffic, 200.0, seed=7)
    assert np.array_equal(first.arrival_s, second.arrival_s) and np.array_equal(first.model, second.model)
    assert np.all(np.diff(first.arrival_s) >= 0)
    is_a = first.model == 0
    assert np.all(first.slo_s[is_a] == 0.5) and np.all(first.slo_s[~is_a] == 1.0)
    assert np.all(first.input_length_tokens[is_a] == 32)
    assert set(first.task[is_a]) == {0, 1} and np.all(first.utility[is_a] == 2.0)
    rates = first.rates()
    assert rates[0] == pytest.approx(5.0, rel=0.2)
    other = generate_workload(["a", "b"], traffic, 200.0, seed=8)
    assert not np.array_equal(first.arrival_s[:10], other.arrival_s[:10])


def test_gamma_workload_power_law_split_and_slo_scale():
    workload = gamma_workload(["a", "b", "c", "d"], total_rate=40.0, cv=1.0, slo_s=1.0, duration_s=500.0,
                              popularity_exponent=1.0, seed=0)
    rates = workload.rates()
    assert rates.sum() == pytest.approx(40.0, rel=0.05)
    assert rates[0] > rates[1] > rates[3]
    scaled = workload.with_slo_scale([0.1, 0.2, 0.3, 0.4], 5.0)
    assert np.allclose(scaled.slo_s, 5.0 * np.array([0.1, 0.2, 0.3, 0.4])[workload.model])
    sub = workload.for_models(["b"])
    assert np.all(sub.model == 1) and len(sub) == np.sum(workload.model == 1)
    window = workload.window(100.0, 200.0)
    assert window.arrival_s.min() >= 100.0 and window.arrival_s.max() < 200.0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="cv"):
        GammaProcess(1.0, 0.0).generate(0, 10, np.random.default_rng(0))
    with pytest.raises(ValueError, match="sorted"):
        Workload(["a"], np.array([1.0, 0.5]), np.array([0, 0]), 1.0)
    with pytest.raises(ValueError, match="duration_s"):
        generate_workload(["a"], [ModelTraffic(PoissonProcess(1.0), 1.0)], 0.0)
