"""A move priced through its rollout, and the one-replica moves from the running placement (synthetic profiles)."""

import numpy as np
import pytest

from placement.alpaserve.local_search import neighbours
from placement.alpaserve.paper_profiles import model_profile
from placement.alpaserve.placement_rollout import SlotLayout
from placement.alpaserve.simulator import SimulatorConfig
from placement.alpaserve.transition import TransitionModel, attainment_through, rollout_timeline, scaled_profiles
from placement.core.placement_plan import GroupPlacement, Placement
from placement.core.profiles import ParallelConfig, ProfileSet
from placement.core.workload import Workload

GIB = 1024**3
LATENCY_S = 0.1


def profiles(load_s: dict[str, float] | None = None) -> ProfileSet:
    models = {m: model_profile(m, GIB, LATENCY_S) for m in "abc"}
    for name, seconds in (load_s or {}).items():
        models[name].configs[0] = models[name].configs[0].model_copy(update={"load_s": seconds})
    return ProfileSet(source="synthetic", device="stand-in", models=models)


def group(*models: str) -> GroupPlacement:
    return GroupPlacement(num_devices=1, config=ParallelConfig(), models=list(models))


def test_a_rehost_loads_only_what_it_adds_and_serves_what_stays_routed_meanwhile():
    current = SlotLayout(slots=[group("a"), group("b")])
    target = Placement(groups=[group("a", "c"), group("b")])
    transition = TransitionModel(step_overhead_s=1.0, actor_start_s=2.0, load_bandwidth_bytes_per_s=GIB / 4)
    spans, rollout_s = rollout_timeline(current, target, profiles(), 2, transition, horizon_s=30.0)
    # The overhead, c's new actor process, and its 1 GiB at a quarter GiB per second.
    assert rollout_s == pytest.approx(1.0 + 2.0 + 4.0)
    # The step's overhead (config updates, routing) serves at full speed; only its load slows the devices.
    assert [(s.start_s, s.end_s, s.loading) for s in spans] == [(0.0, 1.0, False), (1.0, 7.0, True),
                                                                (7.0, 30.0, False)]
    for span in spans[:2]:
        assert [g.models for g in span.placement.groups] == [["a"], ["b"]]  # c does not serve before it is loaded
    assert sorted(map(sorted, (g.models for g in spans[2].placement.groups))) == [["a", "c"], ["b"]]
    # A load time measured with the profile wins over the stand-in bandwidth.
    _, measured = rollout_timeline(current, target, profiles({"c": 9.0}), 2, transition, horizon_s=30.0)
    assert measured == pytest.approx(1.0 + 2.0 + 9.0)


def test_a_swap_reloads_the_dropped_models_actors_instead_of_starting_processes():
    """The group replica recycles the actors of a model it drops for the model it adds (`GroupReplica.reconfigure`),
    so a swap costs the weights alone; a second added model still starts its own actors."""
    transition = TransitionModel(step_overhead_s=0.0, actor_start_s=5.0, load_bandwidth_bytes_per_s=GIB)
    current = SlotLayout(slots=[group("a", "b"), group("c")])
    _, swap_s = rollout_timeline(current, Placement(groups=[group("a", "c"), group("c")]), profiles(), 2, transition,
                                 horizon_s=10.0)
    assert swap_s == pytest.approx(1.0)  # c's weights into b's actors
    _, grow_s = rollout_timeline(SlotLayout(slots=[group("a"), group("c")]),
                                 Placement(groups=[group("b", "c"), group("c")]), profiles(), 2, transition,
                                 horizon_s=10.0)
    assert grow_s == pytest.approx(1.0 + 5.0 + 1.0)  # b reuses a's actors, c starts its own


def test_a_new_group_restarts_a_replica_and_loads_all_its_models():
    current = SlotLayout(slots=[group("a"), None])
    target = Placement(groups=[group("a"), group("b", "c")])
    transition = TransitionModel(step_overhead_s=0.0, replica_start_s=3.0, actor_start_s=0.5,
                                 load_bandwidth_bytes_per_s=GIB)
    spans, rollout_s = rollout_timeline(current, target, profiles(), 2, transition, horizon_s=10.0)
    assert rollout_s == pytest.approx(3.0 + 2 * 0.5 + 2.0)  # the replica, then b's and c's actors and weights


def test_requests_that_arrive_while_nothing_serves_them_are_missed_and_loading_slows_serving():
    current = SlotLayout(slots=[group("a"), group("b")])
    target = Placement(groups=[group("a", "c"), group("b")])
    transition = TransitionModel(step_overhead_s=0.0, actor_start_s=0.0, load_bandwidth_bytes_per_s=GIB / 10,
                                 loading_slowdown=3.0)
    spans, _ = rollout_timeline(current, target, profiles(), 2, transition, horizon_s=20.0)
    c_requests = Workload(["a", "b", "c"], np.array([1.0, 5.0, 15.0]), np.array([2, 2, 2]), np.full(3, 0.5))
    # only the one after t=10
    assert attainment_through(spans, profiles(), c_requests, SimulatorConfig()) == pytest.approx(1 / 3)
    # 0.1 s, 0.3 s while loading
    a_request = Workload(["a", "b", "c"], np.array([1.0]), np.array([0]), np.array([0.25]))
    assert attainment_through(spans, profiles(), a_request, SimulatorConfig()) == 1.0
    slowed = scaled_profiles(profiles(), transition.loading_slowdown)
    assert attainment_through(spans, profiles(), a_request, SimulatorConfig(), loading_profiles=slowed) == 0.0


def test_local_moves_keep_every_model_hosted_and_fit_memory():
    current = Placement(groups=[group("a", "b"), group("c")])
    moves = dict(neighbours(current, ["a", "b", "c"], profiles(), device_memory_bytes=int(2.5 * GIB)))
    assert "add a to group 1" in moves and "add c to group 0" not in moves  # group 0 holds two models: full
    assert "move a from group 0 to group 1" in moves
    assert not any(d.startswith("remove") for d in moves)  # every model has a single replica
    for placement in moves.values():
        assert placement.models() == {"a", "b", "c"}
        placement.check_memory(profiles(), int(2.5 * GIB))
    replicated = Placement(groups=[group("a", "b"), group("a", "c")])
    moves = dict(neighbours(replicated, ["a", "b", "c"], profiles(), device_memory_bytes=int(2.5 * GIB)))
    assert ("remove a from group 0" in moves and "swap a for c in group 0" in moves
            and "remove b from group 0" not in moves)


def test_two_window_rate_test_flags_a_shift_and_not_steady_poisson_traffic():
    from placement.core.traffic_window import RequestRecord, TrafficWindow, detect_rate_shifts

    rng = np.random.default_rng(0)
    window = TrafficWindow(window_s=20.0)
    steady = np.sort(rng.uniform(0, 20, 200))  # b: 10/s throughout
    a_before = np.sort(rng.uniform(0, 10, 20))  # a: 2/s, then 12/s
    a_after = np.sort(rng.uniform(10, 20, 120))
    window.add([RequestRecord("b", float(t), "ok") for t in steady]
               + [RequestRecord("a", float(t), "ok") for t in [*a_before, *a_after]])
    shifts = detect_rate_shifts(window, 20.0, ["a", "b", "c"], window_s=10.0, z_threshold=4.0, min_ratio=1.5,
                                min_requests=20)
    assert [s.model for s in shifts] == ["a"]
    assert (shifts[0].before_per_s == pytest.approx(2.0) and shifts[0].after_per_s == pytest.approx(12.0)
            and shifts[0].z > 4)
    # Too few requests: no judgement.
    assert detect_rate_shifts(window, 20.0, ["a"], 10.0, 4.0, 1.5, min_requests=1000) == []
    with pytest.raises(ValueError, match="window_s"):
        detect_rate_shifts(window, 20.0, ["a"], 15.0, 4.0, 1.5, 20)


def test_the_rate_test_allows_for_bursty_arrivals_and_still_flags_a_shift_in_them():
    """Gamma arrivals with CV 3 at an unchanged rate spread their counts about nine times as widely as Poisson's:
    a test that assumes Poisson counts takes their bursts for shifts, the test with the gaps' dispersion does not;
    an eighteenfold change of the same bursty traffic is still flagged."""
    from placement.core.traffic_window import RequestRecord, TrafficWindow, count_dispersion, detect_rate_shifts

    rng = np.random.default_rng(1)

    def gamma_arrivals(rate: float, start: float, end: float, cv: float = 3.0) -> list[float]:
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=int(4 * rate * (end - start)) + 50)
        return [float(t) for t in start + np.cumsum(gaps) if t < end]

    def shifts_in(arrivals: list[float], now_s: float, window_s: float) -> list:
        window = TrafficWindow(window_s=2 * window_s)
        window.add(RequestRecord("m", t, "ok") for t in arrivals if t < now_s)
        return detect_rate_shifts(window, now_s, ["m"], window_s=window_s, z_threshold=4.0, min_ratio=1.5,
                                  min_requests=20)

    false_alarms = poisson_alarms = 0
    for _ in range(60):
        arrivals = gamma_arrivals(6.0, 0.0, 10.0)
        n1, n2 = sum(t < 5.0 for t in arrivals), len(arrivals) - sum(t < 5.0 for t in arrivals)
        ratio = max(n1, n2) / max(min(n1, n2), 1)
        poisson_alarms += n1 + n2 >= 20 and ratio >= 1.5 and abs(n2 - n1) / np.sqrt(n1 + n2) >= 4.0
        false_alarms += bool(shifts_in(arrivals, 10.0, 5.0))
    assert poisson_alarms >= 5 and false_alarms <= poisson_alarms / 4
    shifts = shifts_in(gamma_arrivals(2.0, 0.0, 10.0) + gamma_arrivals(36.0, 10.0, 20.0), 20.0, 10.0)
    assert [s.model for s in shifts] == ["m"] and shifts[0].dispersion > 2.0
    # Periodic (under-dispersed) arrivals keep Poisson's dispersion as the floor.
    assert count_dispersion([np.arange(0, 5, 0.5), np.arange(5, 10, 0.1)]) == 1.0


def test_the_controller_plans_on_one_thread_at_low_cpu_priority():
    """The simulations that judge candidate placements run on a thread PLANNING_NICE_INCREMENT nicer than the
    replica (never less nice: Ray's workers start at 15 and a root process could otherwise raise them), so that on
    cores shared with the replicas a decision yields to the requests in flight; the calling thread keeps its own
    priority."""
    import os
    import threading

    from rayserve_apps.control.controller import PLANNING_NICE_INCREMENT, planning_executor

    def nice_and_thread() -> tuple[int, int]:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), threading.get_native_id()

    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    executor = planning_executor()
    try:
        first, second = executor.submit(nice_and_thread).result(), executor.submit(nice_and_thread).result()
    finally:
        executor.shutdown()
    assert first[0] == min(19, own + PLANNING_NICE_INCREMENT) and first[1] == second[1] != threading.get_native_id()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
