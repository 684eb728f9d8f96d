"""Service-time calibration from answered latencies (issue 18): the simulator, fed the calibrated factor, reproduces
what a live system measured. The "live" systems here are simulators with known behaviour (a batching engine, or
slower devices), so the expected factor is known; synthetic profiles are stand-ins."""

import numpy as np
import pytest

from placement.alpaserve.batching import MaxBatchWithinSLO
from placement.alpaserve.deployment_planning import replan_policy
from placement.alpaserve.dispatch import make_dispatch
from placement.alpaserve.planner import PlannerConfig
from placement.alpaserve.replanning import ReplanPolicy
from placement.alpaserve.service_calibration import (
    MIN_SCALE,
    calibrate_service_scale,
    observed_workload,
    simulated_latency_quantile,
)
from placement.alpaserve.simulator import SERVED, SimulatorConfig, simulate
from placement.alpaserve.transition import scaled_profiles
from placement.core.arrivals import GammaProcess
from placement.core.calibration_settings import ServiceCalibrationSettings
from placement.core.deployment_spec import parse_spec
from placement.core.placement_plan import GroupPlacement, Placement
from placement.core.profiles import ConfigProfile, ModelProfile, ParallelConfig, ProfileSet, StageProfile
from placement.core.traffic_window import ObservedTraffic, RequestRecord, TrafficWindow
from placement.core.workload import ModelTraffic, Workload, generate_workload

MODELS = ["a", "b"]
LONE_S = 0.03
SLO_S = 0.25
#: A batch of this many costs BATCH_COST_FACTOR lone requests in the "live" batching engine.
MAX_BATCH = 16
BATCH_COST_FACTOR = 3.0
SHARES = (0.7, 0.3)


def profiles(table: dict[int, float]) -> ProfileSet:
    return ProfileSet(source="synthetic", device="stand-in", models={
        m: ModelProfile(name=m, configs=[ConfigProfile(config=ParallelConfig(), stages=[
            StageProfile(latency_s=table, weight_bytes_per_device=1)])]) for m in MODELS})


LONE = profiles({1: LONE_S})
BATCHED = profiles({1: LONE_S, MAX_BATCH: BATCH_COST_FACTOR * LONE_S})
PLAIN = SimulatorConfig(dispatch=make_dispatch("shortest_queue"))
BATCHING = SimulatorConfig(dispatch=make_dispatch("shortest_queue"), batching=MaxBatchWithinSLO(MAX_BATCH))


def both_everywhere() -> Placement:
    return Placement(groups=[GroupPlacement(num_devices=1, config=ParallelConfig(), models=MODELS) for _ in range(2)])


def trace(rate: float, seed: int, duration_s: float = 60.0):
    return generate_workload(MODELS, [ModelTraffic(GammaProcess(rate * s, 2.0), SLO_S) for s in SHARES], duration_s,
                             seed=seed)


def live_latencies(workload, live_profiles, config) -> np.ndarray:
    result = simulate(both_everywhere(), live_profiles, workload, config)
    return np.where(result.status == SERVED, result.finish_s - workload.arrival_s, np.nan)


def test_a_batching_engine_is_cheaper_per_request_and_the_calibrated_factor_reproduces_its_throughput():
    # 90 requests/s on two devices of 30 ms lone requests (capacity 67/s unbatched): only batching keeps up.
    workload = trace(90.0, seed=1)
    latency = live_latencies(workload, BATCHED, BATCHING)
    calibration = calibrate_service_scale(both_everywhere(), LONE, workload, latency, PLAIN)
    assert calibration is not None and calibration.scale < 0.7
    assert calibration.simulated_latency_s == pytest.approx(calibration.observed_latency_s, rel=0.03)
    answered_live = np.isfinite(latency).sum()
    served = lambda p: int((simulate(both_everywhere(), p, workload, PLAIN).status == SERVED).sum())  # noqa: E731
    assert served(LONE) < 0.8 * answered_live  # the lone-request times lose a fifth of the live throughput
    assert served(scaled_profiles(LONE, calibration.scale)) >= 0.98 * answered_live
    # And it predicts another trace of the same traffic (held out) within the fidelity target.
    held_out = trace(90.0, seed=7)
    live = simulate(both_everywhere(), BATCHED, held_out, BATCHING).slo_attainment()
    calibrated = simulate(both_everywhere(), scaled_profiles(LONE, calibration.scale), held_out, PLAIN).slo_attainment()
    assert abs(live - calibrated) <= 0.03
    assert live - simulate(both_everywhere(), LONE, held_out, PLAIN).slo_attainment() > 0.1


@pytest.mark.parametrize("slowdown", [0.6, 1.7])
def test_devices_slower_or_faster_than_profiled_are_recovered(slowdown):
    workload = trace(40.0, seed=2)
    latency = live_latencies(workload, scaled_profiles(LONE, slowdown), PLAIN)
    calibration = calibrate_service_scale(both_everywhere(), LONE, workload, latency, PLAIN)
    assert calibration.scale == pytest.approx(slowdown, rel=0.05)


def test_a_window_that_missed_slos_is_fitted_on_its_attainment():
    """Under SLO admission the answered latencies stop near the SLO; the window's attainment (rejections count as
    misses) is what the controller predicts, so an overloaded window is fitted on it."""
    workload = trace(55.0, seed=8)
    latency = live_latencies(workload, scaled_profiles(LONE, 2.0), PLAIN)
    calibration = calibrate_service_scale(both_everywhere(), LONE, workload, latency, PLAIN)
    assert calibration.target == "attainment" and calibration.observed_attainment < 0.95
    assert calibration.simulated_attainment == pytest.approx(calibration.observed_attainment, abs=0.01)
    assert calibration.scale == pytest.approx(2.0, rel=0.1)
    # A window in which every request met its SLO pins no factor by attainment: the latency quantile decides.
    light = trace(5.0, seed=8)
    calibration = calibrate_service_scale(both_everywhere(), LONE, light, live_latencies(light, LONE, PLAIN), PLAIN)
    assert calibration.target == "latency_quantile" and calibration.observed_attainment == 1.0
    # Misses that no speed avoids (requests for a model no group hosts) do not push the factor to the bound.
    only_a = Placement(groups=[GroupPlacement(num_devices=1, config=ParallelConfig(), models=["a"])])
    latency = simulate(only_a, LONE, light, PLAIN).finish_s - light.arrival_s
    latency[light.model == 1] = np.nan
    calibration = calibrate_service_scale(only_a, LONE, light, latency, PLAIN, min_answered=10)
    assert calibration.observed_attainment < 0.9 and calibration.scale == pytest.approx(1.0, rel=0.1)


def test_a_window_cut_from_running_traffic_scores_only_requests_after_its_warmup():
    """The requests of a window's first seconds fill the simulated queues (the live ones held the earlier requests'
    backlog) but are not scored: here they all missed, every later one met its SLO."""
    workload = trace(20.0, seed=9)
    latency = live_latencies(workload, LONE, PLAIN)
    early = workload.arrival_s < workload.arrival_s.min() + 5.0
    latency[early] = np.nan
    whole = calibrate_service_scale(both_everywhere(), LONE, workload, latency, PLAIN)
    assert whole.target == "attainment" and whole.observed_attainment < 0.95
    warmed = calibrate_service_scale(both_everywhere(), LONE, workload, latency, PLAIN, warmup_s=5.0)
    assert warmed.observed_attainment == 1.0 and warmed.target == "latency_quantile"
    assert warmed.answered == int((~early).sum()) and warmed.scale == pytest.approx(1.0, rel=0.1)


def test_a_target_beyond_the_searched_range_gives_its_bound():
    workload = trace(20.0, seed=3)
    latency = np.full(len(workload), 1e-6)  # faster than any factor can make the simulator
    assert calibrate_service_scale(both_everywhere(), LONE, workload, latency, PLAIN).scale == MIN_SCALE


def test_too_few_answers_or_bad_input():
    workload = trace(20.0, seed=4)
    latency = np.full(len(workload), np.nan)
    latency[:10] = 0.05
    assert calibrate_service_scale(both_everywhere(), LONE, workload, latency, PLAIN, min_answered=11) is None
    with pytest.raises(ValueError, match="quantile"):
        calibrate_service_scale(both_everywhere(), LONE, workload, latency, PLAIN, quantile=1.0)
    with pytest.raises(ValueError, match="latency_s"):
        calibrate_service_scale(both_everywhere(), LONE, workload, latency[:-1], PLAIN)


def test_observed_window_becomes_a_workload_in_arrival_order_with_its_latencies():
    window = TrafficWindow(10.0)
    window.add([RequestRecord("b", 103.0, "ok", latency_ms=40.0, slo_met=True),
                RequestRecord("a", 101.0, "ok", latency_ms=20.0, slo_met=True),
                RequestRecord("a", 105.0, "rejected"),
                RequestRecord("a", 102.0, "invalid")])
    observed = window.observed(110.0, MODELS, [SLO_S, 2 * SLO_S])
    workload, latency = observed_workload(observed)
    assert workload.arrival_s.tolist() == [1.0, 3.0, 5.0]
    assert [workload.model_names[m] for m in workload.model] == ["a", "b", "a"]
    assert workload.slo_s.tolist() == [SLO_S, 2 * SLO_S, SLO_S]
    np.testing.assert_allclose(latency, [0.02, 0.04, np.nan])
    with pytest.raises(ValueError, match="latency_s"):
        observed_workload(ObservedTraffic(MODELS, observed.arrival_s, 10.0, [SLO_S] * 2))


def test_a_settled_window_leaves_out_its_newest_arrivals_whose_slow_answers_are_not_in_yet():
    window = TrafficWindow(10.0)
    window.add([RequestRecord("a", 101.0, "ok", latency_ms=20.0, slo_met=True),
                RequestRecord("a", 108.5, "ok", latency_ms=20.0, slo_met=True),  # its slow peers still run
                RequestRecord("b", 109.0, "rejected")])
    settled = window.observed(110.0, MODELS, [SLO_S] * 2, settle_s=2.0)
    assert [a.tolist() for a in settled.arrival_s] == [[1.0], []] and settled.duration_s == 8.0
    assert [a.tolist() for a in window.observed(110.0, MODELS, [SLO_S] * 2).arrival_s] == [[1.0, 8.5], [9.0]]
    with pytest.raises(ValueError, match="settle_s"):
        window.observed(110.0, MODELS, [SLO_S] * 2, settle_s=10.0)


def test_a_window_since_the_last_placement_change_leaves_out_the_records_before_it():
    window = TrafficWindow(60.0)
    window.add([RequestRecord("a", 60.0, "ok", latency_ms=20.0, slo_met=True),  # served by the former placement
                RequestRecord("a", 95.0, "ok", latency_ms=20.0, slo_met=True),
                RequestRecord("b", 105.0, "ok", latency_ms=20.0, slo_met=True)])
    since = window.observed(110.0, MODELS, [SLO_S] * 2, settle_s=2.0, since_s=90.0)
    assert [a.tolist() for a in since.arrival_s] == [[5.0], [15.0]] and since.duration_s == 18.0
    whole = window.observed(110.0, MODELS, [SLO_S] * 2, settle_s=2.0, since_s=10.0)  # the window is shorter
    assert [a.tolist() for a in whole.arrival_s] == [[10.0, 45.0], [55.0]] and whole.duration_s == 58.0
    with pytest.raises(ValueError, match="settle_s"):
        window.observed(110.0, MODELS, [SLO_S] * 2, settle_s=2.0, since_s=109.0)


def observed_from(workload, latency) -> ObservedTraffic:
    per_model = [np.flatnonzero(workload.model == m) for m in range(len(MODELS))]
    return ObservedTraffic(MODELS, [workload.arrival_s[i] for i in per_model], 60.0, [SLO_S] * 2,
                           [latency[i] for i in per_model])


def replan(calibration: ServiceCalibrationSettings | None) -> ReplanPolicy:
    return ReplanPolicy(profiles=LONE, num_devices=2, device_memory_bytes=16,
                        planner=PlannerConfig(max_group_devices=1), calibration=calibration)


def test_the_policy_recalibrates_its_profiles_from_the_window_and_smooths():
    workload = trace(40.0, seed=5)
    observed = observed_from(workload, live_latencies(workload, scaled_profiles(LONE, 2.0), PLAIN))
    policy = replan(ServiceCalibrationSettings(smoothing=0.5))
    first = policy.calibrate(both_everywhere(), observed)
    assert first.scale == pytest.approx(2.0, rel=0.05)
    assert policy.service_scale == first.scale  # the first fit is taken as it is
    assert policy.profiles.models["a"].configs[0].latency() == pytest.approx(LONE_S * first.scale)
    assert policy.base_profiles is LONE
    # A window at the profiled speed: half way there (geometric).
    faster = observed_from(workload, live_latencies(workload, LONE, PLAIN))
    second = policy.calibrate(both_everywhere(), faster)
    assert policy.service_scale == pytest.approx(np.sqrt(first.scale * second.scale), rel=1e-6)
    assert policy.last_calibration == second
    # By default each window's fit is taken as it is (the overlapping windows are the smoothing).
    plain = replan(ServiceCalibrationSettings())
    plain.calibrate(both_everywhere(), observed)
    refitted = plain.calibrate(both_everywhere(), faster)
    assert plain.service_scale == pytest.approx(refitted.scale, rel=1e-9)
    # The simulator the policy judges with sees the calibrated latencies.
    assert simulated_latency_quantile(both_everywhere(), policy.profiles, workload, PLAIN, 0.5) > \
        simulated_latency_quantile(both_everywhere(), LONE, workload, PLAIN, 0.5)


def test_a_refit_on_the_ingress_records_leaves_out_the_clients_round_trip_to_the_ingress():
    """The simulator's request overhead counts from the client; the ingress's records start when the request reaches
    it and end before the answer is back: a round trip shorter. Simulated with the whole overhead, the refit fits
    the service times short by that round trip (and the simulator turns optimistic); less it, it recovers them."""
    overhead_s, round_trip_s, slowdown = 0.02, 0.012, 1.5
    client_view = SimulatorConfig(dispatch=make_dispatch("shortest_queue"), request_overhead_s=overhead_s)
    workload = trace(5.0, seed=10)  # light load: latencies near the service time, where the round trip shows
    client_latency = live_latencies(workload, scaled_profiles(LONE, slowdown), client_view)
    # The ingress receives each request half a round trip after its client sent it.
    shifted = Workload(MODELS, workload.arrival_s + round_trip_s / 2, workload.model, workload.slo_s)
    records = observed_from(shifted, client_latency - round_trip_s)

    def refitted(settings: ServiceCalibrationSettings) -> ReplanPolicy:
        policy = ReplanPolicy(profiles=LONE, num_devices=2, device_memory_bytes=16,
                              planner=PlannerConfig(max_group_devices=1, simulator=client_view), calibration=settings)
        policy.calibrate(both_everywhere(), records)
        return policy

    less = refitted(ServiceCalibrationSettings(client_round_trip_ms=1e3 * round_trip_s))
    whole = refitted(ServiceCalibrationSettings())
    assert less.service_scale == pytest.approx(slowdown, rel=0.05)
    assert whole.service_scale < 0.9 * less.service_scale
    # The decisions still judge with the whole overhead (the client's view); only the refits see the records' view.
    assert less.planner.simulator.request_overhead_s == overhead_s
    assert less.records_simulator.request_overhead_s == pytest.approx(overhead_s - round_trip_s)
    with pytest.raises(ValueError, match="client_round_trip_ms"):
        refitted(ServiceCalibrationSettings(client_round_trip_ms=1e3 * overhead_s + 1))


def test_without_calibration_settings_or_latencies_the_profiles_stay():
    workload = trace(40.0, seed=6)
    observed = observed_from(workload, live_latencies(workload, scaled_profiles(LONE, 2.0), PLAIN))
    policy = replan(None)
    assert policy.calibrate(both_everywhere(), observed) is None and policy.profiles is LONE
    policy = replan(ServiceCalibrationSettings())
    no_latencies = ObservedTraffic(MODELS, observed.arrival_s, 60.0, [SLO_S] * 2)
    assert policy.calibrate(both_everywhere(), no_latencies) is None and policy.service_scale == 1.0


def test_the_controller_spec_switches_calibration(tmp_path):
    LONE.save(tmp_path / "profiles.json")
    spec = {"cluster": {"num_devices": 2, "device_memory_bytes": 1024},
            "models": [{"name": m, "kind": "text", "source": "package:all-minilm-l6-v2", "slo_ms": 250}
                       for m in MODELS],
            "placement": both_everywhere().model_dump(mode="json"),
            "planning": {"profiles": {"path": str(tmp_path / "profiles.json")}},
            "controller": {"calibration": {"quantile": 0.8}}}
    assert replan_policy(parse_spec(spec), tmp_path).calibration.quantile == 0.8
    spec["controller"] = {"calibrate_service": False}
    assert replan_policy(parse_spec(spec), tmp_path).calibration is None
    spec["controller"] = {"calibration": {"quantile": 1.5}}
    with pytest.raises(ValueError, match="quantile"):
        parse_spec(spec)
    spec["controller"] = {"calibration": {"window_s": 0}}
    with pytest.raises(ValueError, match="window_s"):
        parse_spec(spec)
    # The client's round trip to the ingress is part of the request overhead the simulator adds.
    spec["controller"] = {"calibration": {"client_round_trip_ms": 4.0}}
    with pytest.raises(ValueError, match="client_round_trip_ms=4 exceeds planning.simulation.request_overhead_ms=0"):
        parse_spec(spec)
    spec["planning"]["simulation"] = {"request_overhead_ms": 6.0}
    assert replan_policy(parse_spec(spec), tmp_path).records_simulator.request_overhead_s == pytest.approx(0.002)
