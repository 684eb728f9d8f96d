"""The discrete-event simulator: closed-form fidelity (M/D/1, AlpaServe §3.4 pipeline), invariants, and that the
compiled kernel and the reference loop (which calls the policy objects) agree."""

import math

import numpy as np
import pytest

from placement.alpaserve.batching import MaxBatchWithinSLO
from placement.alpaserve.dispatch import EarliestFinishDispatch, GroupView, RoundRobinDispatch, ShortestQueueDispatch
from placement.alpaserve.simulator import LATE, REJECTED, SERVED, UNPLACED, SimulatorConfig, simulate
from placement.core.arrivals import GammaProcess, PoissonProcess
from placement.core.placement_plan import GroupPlacement, Placement
from placement.core.profiles import ConfigProfile, ModelProfile, ParallelConfig, ProfileSet, StageProfile
from placement.core.workload import ModelTraffic, Workload, generate_workload

GB = 10**9


def synthetic_profile(name: str, latency_s: float, weight_bytes: int = GB, batch_slope: float = 0.5) -> ModelProfile:
    """Exact stage latencies: pipeline_stages even stages summing to latency_s (no overhead)."""
    configs = []
    for stages in (1, 2, 4):
        per_stage = latency_s / stages
        configs.append(ConfigProfile(
            config=ParallelConfig(pipeline_stages=stages),
            stages=[StageProfile(latency_s={1: per_stage, 8: per_stage * (1 + batch_slope * 7)},
                                 weight_bytes_per_device=weight_bytes // stages) for _ in range(stages)],
        ))
    return ModelProfile(name=name, configs=configs)


def profiles(latencies: dict[str, float]) -> ProfileSet:
    models = {n: synthetic_profile(n, lat) for n, lat in latencies.items()}
    return ProfileSet(source="synthetic", device="test", models=models)


def poisson_workload(names, rates, duration_s, slo_s=math.inf, seed=0) -> Workload:
    traffic = [ModelTraffic(PoissonProcess(rate), slo_s) for rate in rates]
    return generate_workload(names, traffic, duration_s, seed=seed)


def no_admission() -> SimulatorConfig:
    return SimulatorConfig(dispatch=ShortestQueueDispatch(slo_admission=False))


def test_md1_mean_latency_matches_closed_form():
    """Poisson arrivals, one device, deterministic service: W = D + lambda D^2 / (2 (1 - lambda D)) (§3.4)."""
    service, rate = 0.1, 6.0  # utilisation 0.6
    workload = poisson_workload(["m"], [rate], duration_s=100_000 / rate, seed=3)
    assert len(workload) >= 95_000
    placement = Placement(groups=[GroupPlacement(num_devices=1, config=ParallelConfig(), models=["m"])])
    result = simulate(placement, profiles({"m": service}), workload, no_admission())
    latency = result.finish_s - workload.arrival_s
    expected = service + rate * service**2 / (2 * (1 - rate * service))
    assert latency.mean() == pytest.approx(expected, rel=0.02)


def test_pipeline_mean_latency_matches_alpaserve_formula():
    """AlpaServe §3.4: two models on a 2-stage pipeline, W = D_s + lambda D_m^2 / (2 (1 - lambda D_m))."""
    single, total_rate = 0.2, 7.0  # D_s = 0.2, D_m = 0.1, utilisation of the pipeline 0.7
    workload = poisson_workload(["a", "b"], [total_rate * 0.3, total_rate * 0.7], duration_s=100_000 / total_rate,
                                seed=4)
    placement = Placement(groups=[GroupPlacement(num_devices=2, config=ParallelConfig(pipeline_stages=2),
                                                 models=["a", "b"])])
    result = simulate(placement, profiles({"a": single, "b": single}), workload, no_admission())
    latency = result.finish_s - workload.arrival_s
    d_m = single / 2
    expected = single + total_rate * d_m**2 / (2 * (1 - total_rate * d_m))
    assert latency.mean() == pytest.approx(expected, rel=0.02)
    # Consecutive requests overlap: some request starts before the previous one finished.
    order = np.argsort(result.start_s)
    assert np.any(result.start_s[order][1:] < result.finish_s[order][:-1])


def two_group_case(seed=0, cv=4.0, slo_scale=3.0, duration_s=200.0):
    lat = {"a": 0.1, "b": 0.2, "c": 0.15}
    names = list(lat)
    traffic = [ModelTraffic(GammaProcess(rate, cv), slo_scale * lat[n]) for n, rate in zip(names, [6.0, 3.0, 2.0])]
    workload = generate_workload(names, traffic, duration_s, seed=seed)
    placement = Placement(groups=[
        GroupPlacement(num_devices=2, config=ParallelConfig(pipeline_stages=2), models=["a", "b"]),
        GroupPlacement(num_devices=1, config=ParallelConfig(), models=["a", "c"]),
    ])
    return placement, profiles(lat), workload


@pytest.mark.parametrize("batching", [None, MaxBatchWithinSLO(4)])
def test_invariants(batching):
    placement, profs, workload = two_group_case()
    result = simulate(placement, profs, workload, SimulatorConfig(batching=batching))
    done = (result.status == SERVED) | (result.status == LATE)
    assert done.sum() > 0.5 * len(workload)
    # Nothing is served before it arrives; every served request lies in a group hosting its model.
    assert np.all(result.start_s[done] >= workload.arrival_s[done])
    assert np.all(result.finish_s[done] > result.start_s[done])
    for g, group in enumerate(placement.groups):
        hosted = [workload.model_names.index(n) for n in group.models]
        assert np.all(np.isin(workload.model[done & (result.group == g)], hosted))
        # FCFS per group: start times follow arrival order.
        mine = np.flatnonzero(done & (result.group == g))
        if batching is None:
            assert np.all(np.diff(result.start_s[mine]) >= 0)
    # With admission no request finishes late; rejected ones are never counted as served.
    assert not np.any(result.status == LATE)
    rejected = result.status == REJECTED
    assert rejected.sum() > 0
    assert np.all(np.isnan(result.finish_s[rejected]))
    assert result.slo_attainment() == pytest.approx(1 - rejected.mean())
    # Batch limits honoured.
    limit = batching.max_batch_size if batching else 1
    assert result.batch_size[done].max() <= limit
    if batching is not None:
        assert result.batch_size[done].max() > 1
        # Requests of one batch share start and finish and belong to one model.
        key = np.stack([result.group[done], result.start_s[done]], axis=1)
        _, inverse, counts = np.unique(key, axis=0, return_inverse=True, return_counts=True)
        assert np.array_equal(counts[inverse.ravel()], result.batch_size[done])


def test_unplaced_requests_are_misses():
    placement, profs, workload = two_group_case()
    only_a = Placement(groups=[GroupPlacement(num_devices=1, config=ParallelConfig(), models=["a"])])
    result = simulate(only_a, profs, workload)
    is_a = workload.model == 0
    assert np.all(result.status[~is_a] == UNPLACED)
    assert result.slo_attainment() <= is_a.mean()


def test_without_admission_late_requests_are_not_attained():
    placement, profs, workload = two_group_case(slo_scale=1.5)
    result = simulate(placement, profs, workload, no_admission())
    late = result.status == LATE
    assert late.sum() > 0
    latency = result.finish_s - workload.arrival_s
    assert np.all(latency[late] > workload.slo_s[late])
    assert not np.any(result.status == REJECTED)


@pytest.mark.parametrize("dispatch", [ShortestQueueDispatch, EarliestFinishDispatch, RoundRobinDispatch])
@pytest.mark.parametrize("batching", [None, MaxBatchWithinSLO(3)])
@pytest.mark.parametrize("contention", [0.0, 0.3])
def test_compiled_kernel_matches_reference_loop(dispatch, batching, contention):
    placement, profs, workload = two_group_case(duration_s=60.0, seed=2)
    config = SimulatorConfig(dispatch=dispatch(), batching=batching, request_overhead_s=0.002,
                             response_overhead_s=0.001, host_contention_per_busy_device=contention)
    fast = simulate(placement, profs, workload, config)
    config = SimulatorConfig(dispatch=dispatch(), batching=batching, request_overhead_s=0.002,
                             response_overhead_s=0.001, host_contention_per_busy_device=contention)
    slow = simulate(placement, profs, workload, config, reference=True)
    for field in ("start_s", "finish_s"):
        np.testing.assert_array_equal(getattr(fast, field), getattr(slow, field))
    for field in ("status", "group", "batch_size"):
        np.testing.assert_array_equal(getattr(fast, field), getattr(slow, field))
    np.testing.assert_allclose(fast.group_busy_seconds(), slow.group_busy_seconds())
    np.testing.assert_allclose(fast.device_seconds(), slow.device_seconds())


def test_host_contention_slows_a_batch_that_starts_while_another_group_computes():
    """Two one-device groups on one host: a request that starts while the other group computes takes
    1 + host_contention times its profiled latency; one that starts while the other is idle takes it unchanged,
    and without contention nothing changes."""
    service = 0.1
    single = ParallelConfig()
    placement = Placement(groups=[GroupPlacement(num_devices=1, config=single, models=["a"]),
                                  GroupPlacement(num_devices=1, config=single, models=["b"])])
    arrival = np.array([0.0, 0.05, 0.5])  # b starts while a computes; the last a finds both idle
    workload = Workload(["a", "b"], arrival, np.array([0, 1, 0], dtype=np.int32), np.full(3, 10.0))
    profs = profiles({"a": service, "b": service})
    for engine in (False, True):
        shared = simulate(placement, profs, workload, SimulatorConfig(host_contention_per_busy_device=0.5),
                          reference=engine)
        latency = shared.finish_s - workload.arrival_s
        np.testing.assert_allclose(latency, [service, 1.5 * service, service])
        np.testing.assert_allclose(shared.group_busy_seconds(), [2 * service, 1.5 * service])
        # Each request's device time has the slowdown too (not the profiled latency alone), so the utilisation
        # bins add up to the groups' busy seconds.
        np.testing.assert_allclose(shared.device_seconds(), [service, 1.5 * service, service])
        np.testing.assert_allclose(shared.utilization(bin_s=1.0).sum(axis=1), shared.group_busy_seconds())
    alone = simulate(placement, profs, workload, SimulatorConfig())
    np.testing.assert_allclose(alone.finish_s - workload.arrival_s, [service] * 3)
    with pytest.raises(ValueError, match="host_contention_per_busy_device"):
        SimulatorConfig(host_contention_per_busy_device=-0.1)


class SendEverythingToGroupZero:
    """A custom policy object: the simulator's reference loop must call it."""

    name = "group_zero"

    def __init__(self):
        self.calls = 0

    def choose(self, model, now_s, deadline_s, groups):
        self.calls += 1
        assert all(isinstance(view, GroupView) for view in groups)
        hosts = [view.group_id for view in groups if model in view.models]
        return 0 if 0 in hosts else (hosts[0] if hosts else None)


def test_custom_dispatch_policy_is_called():
    placement, profs, workload = two_group_case(duration_s=30.0)
    policy = SendEverythingToGroupZero()
    result = simulate(placement, profs, workload, SimulatorConfig(dispatch=policy))
    assert policy.calls == len(workload)
    a_or_b = np.isin(workload.model, [0, 1])
    assert np.all(result.group[a_or_b] == 0)


def test_deterministic_and_summary():
    placement, profs, workload = two_group_case(duration_s=50.0)
    first = simulate(placement, profs, workload).summary()
    second = simulate(placement, profs, workload).summary()
    assert first.to_dict() == second.to_dict()
    assert set(first.per_model_attainment) == {"a", "b", "c"}
    assert 0 <= first.latency.p50_s <= first.latency.p99_s
    assert len(first.mean_group_utilization) == 2 and all(0 < u <= 1 for u in first.mean_group_utilization)
    assert "SLO attainment" in first.describe()


def test_utilization_counts_every_served_request_and_is_bounded():
    placement, profs, workload = two_group_case(duration_s=100.0)
    result = simulate(placement, profs, workload)
    bin_s = 10.0
    util = result.utilization(bin_s=bin_s)
    assert util.shape[0] == 2
    assert np.all(util >= 0) and util.max() <= 1.0 + 0.2  # start-bin attribution may spill a little over a bin
    # Unbatched, a served request keeps its group's devices busy for its model's single-device latency in total
    # (stages x per-stage latency, intra-op degree 1), so the bins add up to exactly that work.
    latency_s = np.array([0.1, 0.2, 0.15])[workload.model]
    done = (result.status == SERVED) | (result.status == LATE)
    expected = np.bincount(result.group[done], weights=latency_s[done], minlength=2)
    assert expected.min() > 0
    assert (util * bin_s * np.array([[2], [1]])).sum(axis=1) == pytest.approx(expected)
    assert result.group_busy_seconds() == pytest.approx(expected)


def test_dispatch_policies_by_name_and_their_decisions():
    from placement.alpaserve.dispatch import make_dispatch
    views = [
        GroupView(group_id=0, models=frozenset({"a"}), queue_length=3, free_at_s=1.0, finish_if_dispatched_s=1.5),
        GroupView(group_id=1, models=frozenset({"a", "b"}), queue_length=1, free_at_s=2.0, finish_if_dispatched_s=2.5),
        GroupView(group_id=2, models=frozenset({"b"}), queue_length=0, free_at_s=0.0, finish_if_dispatched_s=0.5),
    ]
    shortest = make_dispatch("shortest_queue")
    assert shortest.choose("a", 0.0, 10.0, views) == 1
    assert shortest.choose("a", 0.0, 2.0, views) is None  # group 1 cannot finish by the deadline: rejected
    assert make_dispatch("shortest_queue", slo_admission=False).choose("a", 0.0, 2.0, views) == 1
    assert make_dispatch("earliest_finish").choose("a", 0.0, 10.0, views) == 0
    rr = make_dispatch("round_robin")
    assert [rr.choose("b", 0.0, 10.0, views) for _ in range(3)] == [1, 2, 1]
    assert shortest.choose("c", 0.0, 10.0, views) is None
    with pytest.raises(ValueError, match="policies.dispatch.name"):
        make_dispatch("random")
    with pytest.raises(ValueError, match="params"):
        make_dispatch("shortest_queue", timeout=1)


def test_batch_policy_respects_limit_and_deadlines():
    policy = MaxBatchWithinSLO(max_batch_size=3)
    finish = lambda b: 1.0 + 0.5 * b  # noqa: E731
    assert policy.batch_size(0.0, [10.0, 10.0, 10.0, 10.0], finish) == 3
    assert policy.batch_size(0.0, [10.0, 1.9, 10.0], finish) == 1  # the second request's deadline stops the batch
    assert policy.batch_size(0.0, [1.0], finish) == 0  # even alone the head misses: caller drops it
    with pytest.raises(ValueError, match="max_batch_size"):
        MaxBatchWithinSLO(0)


def test_dispatch_from_deployment_spec():
    from placement.alpaserve.dispatch import dispatch_from_spec
    from placement.core.deployment_spec import parse_spec
    base = {"models": [{"name": "m", "kind": "text", "source": "package:all-minilm-l6-v2"}]}
    assert isinstance(dispatch_from_spec(parse_spec(base)), ShortestQueueDispatch)
    spec = parse_spec({**base, "policies": {"dispatch": {"name": "round_robin", "params": {"slo_admission": False}}}})
    policy = dispatch_from_spec(spec, "m")
    assert isinstance(policy, RoundRobinDispatch) and policy.slo_admission is False
    bad = parse_spec({**base, "policies": {"dispatch": {"name": "nope"}}})
    with pytest.raises(ValueError, match="policies.dispatch.name"):
        dispatch_from_spec(bad)
