"""The controller's keep-or-move policy and the traffic statistics it judges (synthetic profiles: a stand-in)."""

import numpy as np
import pytest

from placement.alpaserve.paper_profiles import model_profile
from placement.alpaserve.planner import PlannerConfig
from placement.alpaserve.replanning import ObservedTraffic, ReplanPolicy
from placement.core.placement_plan import GroupPlacement, Placement
from placement.core.profiles import ParallelConfig, ProfileSet
from placement.core.traces import fit_arrivals
from placement.core.traffic_window import RequestRecord, TrafficWindow

GIB = 1024**3
MODELS = ["a", "b", "c"]
LATENCY_S = 0.1
SLO_S = 0.5


def policy(min_gain: float = 0.02) -> ReplanPolicy:
    profiles = ProfileSet(source="synthetic", device="stand-in", models={m: model_profile(m, GIB, LATENCY_S) for m in MODELS})
    return ReplanPolicy(profiles=profiles, num_devices=3, device_memory_bytes=16 * GIB, planner=PlannerConfig(max_group_devices=2),
                        min_gain=min_gain, fit_window_s=20.0)


def one_per_device() -> Placement:
    return Placement(groups=[GroupPlacement(num_devices=1, config=ParallelConfig(), models=[m]) for m in MODELS])


def poisson(rate: float, duration_s: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.sort(rng.uniform(0, duration_s, rng.poisson(rate * duration_s)))


def traffic(rates: dict[str, float], duration_s: float = 60.0) -> ObservedTraffic:
    return ObservedTraffic(MODELS, [poisson(rates.get(m, 0.0), duration_s, k) for k, m in enumerate(MODELS)], duration_s, [SLO_S] * 3)


def test_a_model_outgrowing_its_group_is_rehosted_on_the_running_groups():
    decision = policy().decide(one_per_device(), traffic({"a": 25.0}))
    keep = decision.candidate("keep").predicted_attainment
    assert keep < 0.6  # one device serves at most 10 requests/s of a
    assert decision.chosen in ("rehost", "replan") and decision.predicted_gain >= 0.3
    hosts = sum("a" in g.models for g in decision.placement.groups)
    assert hosts >= 2
    assert decision.placement.models() == set(MODELS)  # b and c had no traffic, yet stay hosted
    assert decision.traffic["a"].rate_per_s == pytest.approx(25.0, rel=0.25)


def test_candidates_are_judged_as_deployed_with_the_models_alg1_left_out():
    from placement.alpaserve.simulator import simulate

    replan = policy()
    # Only a has traffic: Alg. 1 leaves b and c out and the candidates host them. With traffic everywhere, Alg. 1's
    # own figure (its group order, its run) differs from a simulation of the placement deployed.
    for rates in ({"a": 25.0}, {"a": 25.0, "b": 6.0, "c": 4.0}):
        observed = traffic(rates)
        decision = replan.decide(one_per_device(), observed)
        _, fitted_rates, cvs = replan.fit(observed)
        workload = replan.workload(observed, fitted_rates, cvs)
        assert len(decision.candidates) == 3
        for candidate in decision.candidates:
            assert candidate.placement.models() == set(MODELS)
            simulated = simulate(candidate.placement, replan.profiles, workload, replan.planner.simulator).slo_attainment()
            assert candidate.predicted_attainment == pytest.approx(simulated, abs=1e-12), (rates, candidate.name)


def test_balanced_traffic_the_placement_serves_is_kept():
    decision = policy().decide(one_per_device(), traffic({"a": 2.0, "b": 2.0, "c": 2.0}))
    assert decision.chosen == "keep" and "below min_gain" in decision.reason


def test_no_traffic_keeps_without_simulating_candidates():
    decision = policy().decide(one_per_device(), traffic({}))
    assert decision.chosen == "keep" and [c.name for c in decision.candidates] == ["keep"]


def test_a_high_min_gain_keeps_even_a_gainful_move():
    decision = policy(min_gain=1.0).decide(one_per_device(), traffic({"a": 25.0}))
    assert decision.chosen == "keep"


def test_fit_arrivals_recovers_rate_and_cv_per_window():
    regular = np.arange(0.0, 60.0, 0.1)  # 10/s, CV 0
    fitted = fit_arrivals(["x", "y"], [regular, poisson(5.0, 60.0, 1)], window_s=30.0, duration_s=60.0)
    assert fitted.rates.shape == (2, 2)
    assert fitted.rates[0] == pytest.approx([10.0, 10.0], rel=0.01)
    assert fitted.cvs[0, 0] < 0.1 and 0.7 < fitted.cvs[1, 0] < 1.3
    with pytest.raises(ValueError, match="window_s"):
        fit_arrivals(["x"], [regular], window_s=0, duration_s=60.0)


def test_traffic_window_keeps_the_last_period_and_counts_outcomes():
    window = TrafficWindow(window_s=10.0)
    window.add([RequestRecord("a", 100.0, "ok", 5.0, True, 12), RequestRecord("a", 105.0, "rejected"),
                RequestRecord("b", 106.0, "ok", 900.0, False, 300), RequestRecord("a", 107.0, "invalid")])
    stats = window.stats(now_s=110.0)
    assert (stats["a"].requests, stats["a"].slo_met, stats["a"].rejected) == (2, 1, 1)
    assert stats["a"].attainment == 0.5 and stats["b"].attainment == 0.0
    observed = window.observed(now_s=112.0, model_names=["a", "b"], slo_s=[1.0, 1.0])  # the record at 100 s is out
    assert [list(a) for a in observed.arrival_s] == [[3.0], [4.0]]
    assert window.length_histogram(112.0, "b") == [0, 0, 0, 0, 0, 1, 0]
    assert RequestRecord.from_json(RequestRecord("a", 1.0, "ok").to_json()) == RequestRecord("a", 1.0, "ok")
