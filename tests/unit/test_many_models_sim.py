"""Serve's many-model baselines in the simulator (issue 57, step 6): model multiplexing with LRU swaps, one deployment
per model, the shifting-popularity workload, and the direction of the cluster comparison on a small instance."""

from __future__ import annotations

import numpy as np
import pytest

from placement.alpaserve.dispatch import ShortestQueueDispatch
from placement.alpaserve.paper_profiles import GB
from placement.alpaserve.serve_baselines import (
    ServeBatching,
    ServeDeployment,
    ServeEngine,
    ServeLayout,
    multiplexed_deployments,
    proportional_deployments,
    simulate_serve,
    swap_load_seconds,
)
from placement.alpaserve.simulator import SimulatorConfig, simulate
from placement.core.arrivals import PoissonProcess
from placement.core.placement_plan import GroupPlacement, Placement
from placement.core.profiles import ConfigProfile, ModelProfile, ParallelConfig, ProfileSet, StageProfile
from placement.core.workload import ModelTraffic, ShiftingPopularity, Workload, generate_workload
from placement.sim import LATE, SERVED, SimulationEngine


def synthetic_profiles(names, latency_s=0.05, weight_bytes=GB) -> ProfileSet:
    models = {}
    for n in names:
        stage = StageProfile(latency_s={1: latency_s, 2: 1.5 * latency_s, 4: 2.5 * latency_s},
                             weight_bytes_per_device=weight_bytes)
        models[n] = ModelProfile(name=n, configs=[ConfigProfile(config=ParallelConfig(), stages=[stage])])
    return ProfileSet(source="synthetic", device="test", models=models)


ONE_AT_A_TIME = ServeBatching(max_batch_size=1, batch_wait_timeout_s=0.0, max_ongoing_requests=10**9)


# ---- multiplexing -------------------------------------------------------------------------------------------------
def test_a_miss_pays_the_load_time_before_its_batch():
    profiles = synthetic_profiles(["a", "b"], latency_s=0.1)
    workload = Workload(["a", "b"], np.array([0.0, 1.0]), np.array([1, 1]), np.array([10.0, 10.0]))
    layout = ServeLayout((ServeDeployment("mux", ("a", "b"), (0,), max_models_per_replica=1),), 1)
    # Warm start by the given rates: 'a' is resident, so the first 'b' request swaps, the second hits.
    result = simulate_serve(layout, profiles, workload, ONE_AT_A_TIME, load_s=0.7, warm_rates=[1.0, 0.0])
    assert result.swapped.tolist() == [1, 0]
    assert result.finish_s[0] == pytest.approx(0.0 + 0.7 + 0.1)
    assert result.finish_s[1] == pytest.approx(1.0 + 0.1)
    assert result.total_loads == 1


def test_k1_two_alternating_models_swap_on_every_request():
    profiles = synthetic_profiles(["a", "b"], latency_s=0.05)
    times = np.arange(20) * 1.0
    workload = Workload(["a", "b"], times, np.arange(20) % 2, np.full(20, 5.0))
    layout = ServeLayout((ServeDeployment("mux", ("a", "b"), (0,), max_models_per_replica=1),), 1)
    result = simulate_serve(layout, profiles, workload, ONE_AT_A_TIME, load_s=0.3, warm_rates=[0.0, 1.0])
    assert result.swapped.tolist() == [1] * 20  # 'b' starts resident; 'a', 'b', 'a', ... each evicts the other
    assert result.total_loads == 20
    np.testing.assert_allclose(result.finish_s - times, 0.35)
    # with room for both, nothing swaps (both start resident)
    roomy = ServeLayout((ServeDeployment("mux", ("a", "b"), (0,), max_models_per_replica=2),), 1)
    assert simulate_serve(roomy, profiles, workload, ONE_AT_A_TIME, load_s=0.3).total_loads == 0


def test_lru_evicts_the_least_recently_used_model():
    profiles = synthetic_profiles(["a", "b", "c"], latency_s=0.01)
    # k = 2, warm with a and b (a hotter): a, b resident; then c evicts the LRU one.
    order = [0, 1, 0, 2, 0, 1]  # b is least recently used when c comes, so c evicts b, and b swaps in again
    workload = Workload(["a", "b", "c"], np.arange(6) * 1.0, np.array(order), np.full(6, 5.0))
    layout = ServeLayout((ServeDeployment("mux", ("a", "b", "c"), (0,), max_models_per_replica=2),), 1)
    result = simulate_serve(layout, profiles, workload, ONE_AT_A_TIME, load_s=0.2, warm_rates=[3.0, 2.0, 1.0])
    assert result.swapped.tolist() == [0, 0, 0, 1, 0, 1]


def test_with_every_model_resident_it_matches_the_per_model_replica_simulation():
    names = ["a", "b", "c"]
    profiles = synthetic_profiles(names, latency_s=0.04)
    traffic = [ModelTraffic(PoissonProcess(rate), 0.1) for rate in (35.0, 18.0, 9.0)]
    workload = generate_workload(names, traffic, 30.0, seed=3)
    devices = 3
    mux = ServeLayout((ServeDeployment("mux", tuple(names), tuple(range(devices)), max_models_per_replica=3),),
                      devices)
    served = simulate_serve(mux, profiles, workload, ONE_AT_A_TIME, load_s=5.0)
    assert served.total_loads == 0
    # AlpaServe's simulator: one single-device group per device hosting every model, shortest queue, no admission.
    placement = Placement(groups=[GroupPlacement(num_devices=1, config=ParallelConfig(), models=names)] * devices)
    no_admission = SimulatorConfig(dispatch=ShortestQueueDispatch(slo_admission=False))
    plain = simulate(placement, profiles, workload, no_admission)
    np.testing.assert_allclose(served.finish_s, plain.finish_s)
    np.testing.assert_array_equal(served.status, plain.status)
    assert served.slo_attainment() == pytest.approx(plain.slo_attainment())
    assert 0.0 < served.slo_attainment() < 1.0  # the case is loaded enough to tell the engines apart


def test_serve_batch_closes_on_size_or_timeout_and_never_drops():
    profiles = synthetic_profiles(["a"], latency_s=0.1)
    arrivals = np.array([0.0, 0.001, 0.002, 0.003, 0.5])
    workload = Workload(["a"], arrivals, np.zeros(5), np.full(5, 0.2))
    layout = ServeLayout((ServeDeployment("a", ("a",), (0,)),), 1)
    batching = ServeBatching(max_batch_size=4, batch_wait_timeout_s=0.05, max_ongoing_requests=8)
    result = simulate_serve(layout, profiles, workload, batching)
    assert result.batch_size.tolist() == [4, 4, 4, 4, 1]
    assert result.start_s[0] == pytest.approx(0.003)  # closed when full, before the timeout
    assert result.start_s[4] == pytest.approx(0.55)  # alone: closed by the timeout
    assert result.finish_s[0] == pytest.approx(0.003 + 0.25)  # batch of 4: 2.5 x the single latency
    # No admission: the batch of four misses its 0.2 s SLO and still runs (late, not rejected).
    assert result.status.tolist() == [LATE] * 4 + [SERVED]


def test_full_replicas_make_requests_wait_at_the_router():
    profiles = synthetic_profiles(["a"], latency_s=0.1)
    workload = Workload(["a"], np.array([0.0, 0.0, 0.0]), np.zeros(3), np.full(3, 1.0))
    layout = ServeLayout((ServeDeployment("a", ("a",), (0,)),), 1)
    batching = ServeBatching(max_batch_size=1, batch_wait_timeout_s=0.0, max_ongoing_requests=1)
    result = simulate_serve(layout, profiles, workload, batching)
    np.testing.assert_allclose(result.finish_s, [0.1, 0.2, 0.3])


def test_engine_follows_the_simulation_contract():
    profiles = synthetic_profiles(["a"])
    workload = Workload(["a"], np.array([0.0]), np.zeros(1), np.full(1, 1.0))
    engine = ServeEngine(ServeLayout((ServeDeployment("a", ("a",), (0,)),), 1), profiles, workload)
    assert isinstance(engine, SimulationEngine)
    assert engine.run().outcomes.slo_attainment() == 1.0


def test_layouts_respect_the_memory_budget_and_the_load():
    names = ["small-0", "small-1", "big-0"]
    profiles = ProfileSet(source="synthetic", device="test", models={
        **synthetic_profiles(names[:2], weight_bytes=2 * GB).models,
        **synthetic_profiles(names[2:], latency_s=0.2, weight_bytes=6 * GB).models})
    rates = [10.0, 1.0, 2.0]
    per_model = proportional_deployments(names, profiles, rates, 4, 7 * GB)
    per_model.check_memory(profiles, 7 * GB)
    assert all(d.replica_devices for d in per_model.deployments)
    # one replica per device fits: the devices go in proportion to the load, each model keeping one
    two = proportional_deployments(names[:2], profiles, [10.0, 1.0], 8, 2 * GB)
    assert {d.name: len(d.replica_devices) for d in two.deployments} == {"small-0": 7, "small-1": 1}
    mux = multiplexed_deployments(names, profiles, rates, 4, 7 * GB,
                                  {"small-0": "small", "small-1": "small", "big-0": "big"})
    mux.check_memory(profiles, 7 * GB)
    assert {d.name: d.max_models_per_replica for d in mux.deployments} == {"multiplexed-big": 1,
                                                                          "multiplexed-small": 2}
    assert sum(len(d.replica_devices) for d in mux.deployments) == 4
    with pytest.raises(ValueError, match="fits on no device"):
        proportional_deployments(names, profiles, rates, 4, 5 * GB)
    assert swap_load_seconds(profiles, ["big-0"], bytes_per_s=3 * GB)["big-0"] == pytest.approx(2.0)


# ---- the workload -------------------------------------------------------------------------------------------------
def traffic(**overrides) -> ShiftingPopularity:
    fields = dict(model_names=tuple(f"m{i}" for i in range(8)), total_rate_per_s=200.0, cv=3.0,
                  slo_s=tuple([0.5] * 8), duration_s=600.0, popularity_exponent=1.0, shift_at_s=300.0, order_seed=4)
    fields.update(overrides)
    return ShiftingPopularity(**fields)


def test_inter_arrival_cv_is_at_least_three_on_a_long_trace():
    spec = traffic(model_names=("only",), slo_s=(1.0,), total_rate_per_s=50.0, duration_s=4000.0, shift_at_s=None)
    gaps = np.diff(spec.workload(seed=1).arrival_s)
    assert gaps.std() / gaps.mean() >= 3.0 * 0.85  # sampling noise of a heavy-tailed CV on ~2e5 gaps
    assert len(gaps) == pytest.approx(50.0 * 4000.0, rel=0.1)


def test_hot_models_change_at_the_set_time():
    spec = traffic()
    before, after = spec.hot_models(2), spec.hot_models(2, after_shift=True)
    assert not set(before) & set(after)
    workload = spec.workload(seed=2)
    first, second = workload.window(0.0, 300.0), workload.window(300.0, 600.0)
    count = lambda w, name: int(np.sum(w.model == w.model_names.index(name)))  # noqa: E731
    assert count(first, before[0]) > 3 * count(second, before[0])
    assert count(second, after[0]) > 3 * count(first, after[0])
    np.testing.assert_allclose(spec.rates_before().sum(), 200.0)
    np.testing.assert_allclose(np.sort(spec.rates_before()), np.sort(spec.rates_after()))


def test_workload_is_deterministic_by_seed_and_slo_scaled():
    spec = ShiftingPopularity.with_slo_scale(["a", "b"], [0.1, 0.4], 5.0, total_rate_per_s=20.0, cv=3.0,
                                             duration_s=100.0, shift_at_s=50.0)
    one, again, other = spec.workload(seed=7), spec.workload(seed=7), spec.workload(seed=8)
    np.testing.assert_array_equal(one.arrival_s, again.arrival_s)
    np.testing.assert_array_equal(one.model, again.model)
    assert len(one) != len(other) or not np.array_equal(one.arrival_s, other.arrival_s)
    np.testing.assert_allclose(sorted(set(one.slo_s.tolist())), [0.5, 2.0])
    with pytest.raises(ValueError, match="shift_at_s"):
        traffic(shift_at_s=700.0)


# ---- the cluster case, small --------------------------------------------------------------------------------------
def test_cluster_case_direction_on_a_small_instance():
    """On a small mix (2 x 3 Table 1 models, 8 devices, bursty traffic), plexserve's placement holds 99 % SLO
    attainment to a higher rate than Serve's multiplexing and one deployment per model, and no lower than SR."""
    from benchmarks.many_models import CaseSettings, run_sweep

    settings = CaseSettings(architectures=("bert-1.3b", "bert-2.7b", "moe-1.3b"), instances=2, num_devices=8,
                            duration_s=120.0, rates=(4.0, 8.0, 16.0))
    result = run_sweep(settings)
    held = result["rate_at_99"]
    assert held["plexserve"] is not None
    for other in ("serve_multiplexed", "serve_deployments"):
        assert held[other] is None or held["plexserve"] > held[other]
    assert held["sr"] is None or held["plexserve"] >= held["sr"]
    assert all(len(curve) >= 1 for curve in result["curves"].values())
