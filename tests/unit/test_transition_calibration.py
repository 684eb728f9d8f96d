"""The loading slowdown refitted on the requests of a rollout as it ran (synthetic profiles, real simulator)."""

import numpy as np
import pytest

from placement.alpaserve.paper_profiles import model_profile
from placement.alpaserve.placement_rollout import SlotLayout
from placement.alpaserve.planner import PlannerConfig
from placement.alpaserve.replanning import ReplanPolicy
from placement.alpaserve.simulator import SERVED, SimulatorConfig, simulate
from placement.alpaserve.transition import TransitionModel, rollout_timeline, scaled_profiles
from placement.alpaserve.transition_calibration import (
    MAX_LOADING_SLOWDOWN,
    MIN_LOADING_SLOWDOWN,
    ObservedRollout,
    RolloutRun,
    calibrate_loading_slowdown,
)
from placement.core.calibration_settings import ServiceCalibrationSettings
from placement.core.placement_plan import GroupPlacement, Placement
from placement.core.profiles import ParallelConfig, ProfileSet
from placement.core.traffic_window import ObservedTraffic
from placement.core.workload import Workload

GIB = 1024**3
LATENCY_S = 0.1
SLO_S = 0.5
MODELS = ["a", "b", "c"]
#: The slowdown the "live" rollout below ran at.
TRUE_SLOWDOWN = 3.0


def profiles() -> ProfileSet:
    return ProfileSet(source="synthetic", device="stand-in",
                      models={m: model_profile(m, GIB, LATENCY_S) for m in MODELS})


def group(*models: str) -> GroupPlacement:
    return GroupPlacement(num_devices=1, config=ParallelConfig(), models=list(models))


def swap_rollout() -> RolloutRun:
    """Slot 0 swaps b for c beside a (1 s of Serve updates, then 4 s loading c): a keeps its group throughout."""
    transition = TransitionModel(step_overhead_s=1.0, actor_start_s=0.0, load_bandwidth_bytes_per_s=GIB / 4)
    spans, rollout_s = rollout_timeline(SlotLayout(slots=[group("a", "b"), group("c")]),
                                        Placement(groups=[group("a", "c"), group("c")]), profiles(), 2, transition,
                                        horizon_s=0.0)
    return RolloutRun(start_s=100.0, end_s=100.0 + rollout_s, spans=tuple(s for s in spans if s.end_s > s.start_s))


def requests_during(rollout: RolloutRun, rate_per_s: float, seed: int = 0) -> Workload:
    """Poisson requests for a during the rollout, arrival times from its start."""
    rng = np.random.default_rng(seed)
    duration = rollout.end_s - rollout.start_s
    arrival = np.sort(rng.uniform(0.0, duration, rng.poisson(rate_per_s * duration)))
    return Workload(MODELS, arrival, np.zeros(len(arrival), dtype=np.int32), np.full(len(arrival), SLO_S))


def live_latencies(rollout: RolloutRun, workload: Workload, slowdown: float) -> np.ndarray:
    """The rollout as the live system would have served it at `slowdown` (span by span); NaN: not answered."""
    latency = np.full(len(workload), np.nan)
    for span in rollout.spans:
        index = np.flatnonzero((workload.arrival_s >= span.start_s) & (workload.arrival_s < span.end_s))
        used = scaled_profiles(profiles(), slowdown) if span.loading else profiles()
        result = simulate(span.placement, used, workload.take(index), SimulatorConfig())
        served = result.status == SERVED
        latency[index[served]] = result.finish_s[served] - workload.arrival_s[index[served]]
    return latency


def test_the_slowdown_a_rollout_ran_at_is_recovered_from_the_attainment_it_had():
    rollout = swap_rollout()
    assert [s.loading for s in rollout.spans] == [False, True]
    workload = requests_during(rollout, rate_per_s=6.0)
    latency = live_latencies(rollout, workload, TRUE_SLOWDOWN)
    fitted = calibrate_loading_slowdown([ObservedRollout(rollout.spans, workload, latency)], profiles(),
                                        SimulatorConfig())
    assert fitted is not None and fitted.requests == len(workload)
    # Attainment moves in steps of one request, so the fit lands in the band of slowdowns that reproduce it.
    assert fitted.slowdown == pytest.approx(TRUE_SLOWDOWN, rel=0.2)
    assert fitted.simulated_attainment == pytest.approx(fitted.observed_attainment, abs=2 / len(workload))
    assert fitted.observed_attainment < 0.9  # the load did cost serving: the fit had something to match


def test_the_fit_is_clamped_and_needs_requests_during_the_loading():
    rollout = swap_rollout()
    workload = requests_during(rollout, rate_per_s=6.0)

    def fit(latency: np.ndarray, requests: Workload = workload):
        return calibrate_loading_slowdown([ObservedRollout(rollout.spans, requests, latency)], profiles(),
                                          SimulatorConfig())

    # Every request met its SLO: loading cost nothing measurable.
    all_met = np.full(len(workload), LATENCY_S)
    assert fit(all_met).slowdown == MIN_LOADING_SLOWDOWN
    # Nothing answered: serving stopped, as slow as the search goes.
    assert fit(np.full(len(workload), np.nan)).slowdown == MAX_LOADING_SLOWDOWN
    # A request or two during the load pin nothing.
    sparse = requests_during(rollout, rate_per_s=0.4, seed=3)
    assert fit(np.full(len(sparse), LATENCY_S), sparse) is None
    with pytest.raises(ValueError, match="latency_s"):
        fit(all_met[:-1])


def policy(refit: bool = True) -> ReplanPolicy:
    return ReplanPolicy(profiles=profiles(), num_devices=2, device_memory_bytes=4 * GIB,
                        planner=PlannerConfig(max_group_devices=1),
                        transition=TransitionModel(loading_slowdown=1.0),
                        calibration=ServiceCalibrationSettings(loading_smoothing=0.5, refit_loading_slowdown=refit))


def observed(workload: Workload, latency: np.ndarray) -> ObservedTraffic:
    per_model = [np.flatnonzero(workload.model == m) for m in range(len(MODELS))]
    duration = swap_rollout().end_s - swap_rollout().start_s
    return ObservedTraffic(MODELS, [workload.arrival_s[i] for i in per_model], duration, [SLO_S] * len(MODELS),
                           [latency[i] for i in per_model])


def test_the_policy_blends_the_fit_into_the_slowdown_its_moves_are_priced_with():
    rollout = swap_rollout()
    workload = requests_during(rollout, rate_per_s=6.0)
    traffic = observed(workload, live_latencies(rollout, workload, TRUE_SLOWDOWN))
    replan = policy()
    current = Placement(groups=[group("a", "b"), group("c")])
    target = Placement(groups=[group("a", "c"), group("c")])
    horizon = Workload(MODELS, np.linspace(0.0, 30.0, 240), np.zeros(240, dtype=np.int32), np.full(240, SLO_S))
    before = replan._held_out_scores("local", target, current, [horizon], 30.0)[1]
    fitted = replan.calibrate_transition(rollout, traffic)
    # Geometric blend with the 1.0 in force, half and half.
    assert replan.transition.loading_slowdown == pytest.approx(np.sqrt(fitted.slowdown))
    assert replan.transition.loading_slowdown > 1.3
    # The same move through its rollout now costs more.
    assert replan._held_out_scores("local", target, current, [horizon], 30.0)[1] < before
    # The next rollout's fit pools both rollouts' requests.
    again = requests_during(rollout, rate_per_s=6.0, seed=1)
    pooled = replan.calibrate_transition(rollout, observed(again, live_latencies(rollout, again, TRUE_SLOWDOWN)))
    assert (pooled.rollouts, pooled.requests) == (2, len(workload) + len(again))
    # A rollout on an idle system adds nothing to the pool and refits nothing.
    idle = Workload(MODELS, np.zeros(0), np.zeros(0, dtype=np.int32), np.zeros(0))
    assert replan.calibrate_transition(rollout, observed(idle, np.zeros(0))) is None
    assert len(replan.observed_rollouts) == 2
    # With the refit off the slowdown stays as the spec gave it.
    frozen = policy(refit=False)
    assert frozen.calibrate_transition(rollout, traffic) is None
    assert frozen.transition.loading_slowdown == 1.0
