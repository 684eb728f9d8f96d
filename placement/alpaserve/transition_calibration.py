"""The loading slowdown from what the live system answered during its own rollouts (a plexserve addition for issue
18; AlpaServe never re-places a running system, so it has no transition to price).

`transition.py` prices a rollout with one factor, `TransitionModel.loading_slowdown`: while a step loads weights,
every device serves that many times slower. A benchmark can measure it once (`benchmarks/fidelity.py`: the answers
closed-loop clients lose while a model loads), but what a load costs depends on the cluster (devices that share a
host's cores slow each other; GPUs of their own barely do) and on the load the rollout meets. After each rollout the
controller replays the requests that arrived during it (their real arrival times) through the rollout's steps as
they ran (`RolloutRun`: each step's routes; its Serve updates, timed, at full speed; its slot changes, timed, as
loading) at a trial slowdown, and a bisection on log(slowdown) finds the one at which the simulated SLO attainment
equals the measured one (`calibrate_loading_slowdown`). A rollout holds a few dozen requests, so the fit pools the
last `DEFAULT_POOLED_ROLLOUTS` rollouts' requests; the policy blends it with the slowdown in force and prices the
next moves with it (`ReplanPolicy.calibrate_transition`). The fit also absorbs what the span model leaves out (each
span's queues start empty, a step's Serve updates are charged to its load): it is the factor at which the model
reproduces the attainment a real rollout had.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from placement.alpaserve.service_calibration import bisect_log
from placement.alpaserve.simulator import SimulatorConfig
from placement.alpaserve.transition import Span, attainment_through, scaled_profiles
from placement.core.profiles import ProfileSet
from placement.core.workload import Workload

#: Range of slowdowns searched: 1 (loading costs serving nothing) to a step that serves (almost) nothing.
MIN_LOADING_SLOWDOWN = 1.0
MAX_LOADING_SLOWDOWN = 10.0
#: Bisection steps on log(slowdown): the bracket shrinks to 10 ** (2 ** -steps), ~0.5% for 9.
BISECTION_STEPS = 9
#: Fewest requests during the pooled rollouts' loading spans that pin a slowdown.
DEFAULT_MIN_LOADING_REQUESTS = 10
#: Rollouts whose requests one fit pools (the newest ones): a rollout of a few seconds holds a few dozen requests,
#: too few for a steady fit on its own (single-rollout fits vary severalfold within one fidelity run).
DEFAULT_POOLED_ROLLOUTS = 4


@dataclass(frozen=True)
class RolloutRun:
    """A rollout as it ran: wall-clock start and end (seconds), and its steps' spans relative to the start (each
    step's routes; its Serve updates at full speed, its slot changes `loading`)."""

    start_s: float
    end_s: float
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class ObservedRollout:
    """A rollout's steps as they ran and the requests that arrived during it (arrival times relative to its start;
    `latency_s` per request, NaN where not answered)."""

    spans: tuple[Span, ...]
    workload: Workload
    latency_s: np.ndarray

    def __post_init__(self) -> None:
        if len(self.latency_s) != len(self.workload):
            raise ValueError(f"latency_s has {len(self.latency_s)} entries for {len(self.workload)} requests")

    def loading_requests(self) -> int:
        """Requests that arrived while a step loaded."""
        arrival = self.workload.arrival_s
        return int(sum(((arrival >= span.start_s) & (arrival < span.end_s)).sum()
                       for span in self.spans if span.loading))

    def met(self) -> int:
        """Requests answered within their SLO."""
        latency = np.nan_to_num(self.latency_s, nan=np.inf)
        return int((latency <= self.workload.slo_s).sum())


@dataclass(frozen=True)
class LoadingCalibration:
    """One fit of the loading slowdown on the pooled rollouts."""

    slowdown: float  # the fitted factor on every latency while a step loads
    observed_attainment: float  # SLO attainment of the requests that arrived during the rollouts, measured
    simulated_attainment: float  # the same simulated through the rollouts' steps at `slowdown`
    rollouts: int  # rollouts pooled
    requests: int  # requests that arrived during them
    loading_requests: int  # of which while a step loaded

    def to_json(self) -> dict:
        return asdict(self)


def calibrate_loading_slowdown(rollouts: Sequence[ObservedRollout], profiles: ProfileSet, config: SimulatorConfig,
                               min_loading_requests: int = DEFAULT_MIN_LOADING_REQUESTS) -> LoadingCalibration | None:
    """The loading slowdown at which the rollouts' requests, each rollout served span by span
    (`attainment_through`, the loading spans on `profiles` times the trial slowdown), meet as many SLOs together as
    the live system's did. Attainment falls with the slowdown, so a bisection on log(slowdown) finds it; clamped to
    [MIN_LOADING_SLOWDOWN, MAX_LOADING_SLOWDOWN]. None when fewer than `min_loading_requests` requests arrived while
    a step loaded (nothing to fit on)."""
    requests = sum(len(r.workload) for r in rollouts)
    loading = sum(r.loading_requests() for r in rollouts)
    if loading < min_loading_requests:
        return None
    observed = sum(r.met() for r in rollouts) / requests

    @functools.cache  # the bisection's bound and the slowdown it returns are asked for again below
    def simulated(slowdown: float) -> float:
        slowed = scaled_profiles(profiles, slowdown)
        return sum(attainment_through(r.spans, profiles, r.workload, config, slowed) * len(r.workload)
                   for r in rollouts if len(r.workload)) / requests

    # Attainment falls as the slowdown grows: bisect on its negative.
    slowdown = bisect_log(lambda trial: -simulated(trial), -observed, MIN_LOADING_SLOWDOWN, MAX_LOADING_SLOWDOWN,
                          BISECTION_STEPS)
    return LoadingCalibration(slowdown, observed, simulated(slowdown), len(rollouts), requests, loading)
