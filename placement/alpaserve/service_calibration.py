"""Service times from what the live system answered: one factor on the profiled latencies, fitted so that the
simulator reproduces the latencies the ingress measured (a plexserve addition for issue 18; AlpaServe §6.2 feeds
its simulator profiled latencies and never checks them against the serving system).

Profiled latencies are lone requests on an idle device. The live system differs in two opposite ways: the devices
share the host with the ingress and each other (each request slower), and the serving engine batches the requests
that queue for a model (each request cheaper under load: a burst is answered far faster than lone times add up to).
Which one wins depends on the load, so neither the lone times nor a closed-loop throughput probe predict the
attainment of real traffic (a probe at full load overstates the per-request time, and a simulator fed it falls
well below the real attainment).

`calibrate_service_scale` replays the requests of an observation window (their real arrival times, on the placement
that served them) in the simulator at a trial factor, and bisects the factor (on a log scale) until the simulated
figure equals the observed one. The figure is the window's **SLO attainment** (rejected requests count as misses)
when the window missed some SLOs: that is what the controller predicts, and under SLO admission the answered
requests' latencies stop near the SLO, so their quantile says little about how far the system is overloaded. A
window in which every request met its SLO pins no factor by its attainment (any fast enough one reproduces it), nor
does one whose misses no speed avoids (a model no group hosts): it is fitted on the `quantile` of the answered
requests' latencies instead. The simulator is the one the planner and the
controller use, with the same policy objects; only the latency table is scaled. Calibrate on requests *before* the
ones a prediction is judged on (the controller: the last window, for the next decision).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

import numpy as np

from placement.alpaserve.simulator import SERVED, SimulationResult, SimulatorConfig, simulate
from placement.alpaserve.transition import scaled_profiles
from placement.core.calibration_settings import DEFAULT_MIN_ANSWERED, DEFAULT_QUANTILE
from placement.core.placement_plan import Placement
from placement.core.profiles import ProfileSet
from placement.core.traffic_window import ObservedTraffic
from placement.core.workload import Workload

#: Range of factors searched: a batching engine may serve far faster than lone requests suggest, a busy host slower.
MIN_SCALE = 0.02
MAX_SCALE = 20.0
#: Bisection steps on log(scale): the bracket shrinks to (MAX_SCALE / MIN_SCALE) ** (2 ** -steps), ~1% for 12.
BISECTION_STEPS = 12


@dataclass(frozen=True)
class ServiceCalibration:
    """One calibration: the factor and what it was fitted to."""

    scale: float  # factor on every profiled stage latency
    observed_latency_s: float  # the quantile of the answered requests' latencies, measured
    simulated_latency_s: float  # the same quantile simulated at `scale`
    quantile: float
    answered: int  # answered requests the quantile is taken over
    target: str = "latency_quantile"  # what was matched: "attainment" or "latency_quantile"
    observed_attainment: float = 1.0  # SLO attainment of the window's requests, measured
    simulated_attainment: float = 1.0  # the same simulated at `scale`

    def to_json(self) -> dict:
        return asdict(self)


def simulated_latency_quantile(placement: Placement, profiles: ProfileSet, workload: Workload,
                               config: SimulatorConfig, quantile: float, scale: float = 1.0,
                               scored: np.ndarray | None = None) -> float:
    """The `quantile` of the simulated latencies (finish minus arrival) of the requests served (of the `scored`
    ones, a mask; default all), NaN if none."""
    profiles = scaled_profiles(profiles, scale) if scale != 1.0 else profiles
    return _served_latency_quantile(simulate(placement, profiles, workload, config), quantile, scored)


def _served_latency_quantile(result: SimulationResult, quantile: float, scored: np.ndarray | None) -> float:
    served = (result.status == SERVED) & (True if scored is None else scored)
    if not served.any():
        return float("nan")
    return float(np.quantile(result.finish_s[served] - result.workload.arrival_s[served], quantile))


def calibrate_service_scale(placement: Placement, profiles: ProfileSet, workload: Workload, latency_s: np.ndarray,
                            config: SimulatorConfig | None = None, quantile: float = DEFAULT_QUANTILE,
                            min_answered: int = DEFAULT_MIN_ANSWERED,
                            match_attainment: bool = True, warmup_s: float = 0.0) -> ServiceCalibration | None:
    """The factor on `profiles`' latencies at which the simulator, replaying `workload` on `placement`, reaches the
    SLO attainment the live system did (`latency_s`: per request of `workload`, seconds; NaN for requests not
    answered) or, when every request met its SLO (or without `match_attainment`), answers with the same latency
    `quantile`. None when fewer than `min_answered` were answered. Both figures move one way with the factor (queues
    only lengthen as every request gets slower), so a bisection on log(factor) finds it; a target outside
    [MIN_SCALE, MAX_SCALE] gives the bound. With `warmup_s`, the requests of the workload's first `warmup_s` seconds
    are simulated but not scored: a window cut out of running traffic starts with the queues its earlier requests
    left, which the simulator (starting empty) builds from them."""
    if not 0 < quantile < 1:
        raise ValueError(f"quantile={quantile}: must be in (0, 1)")
    latency_s = np.asarray(latency_s, dtype=float)
    if latency_s.shape != (len(workload),):
        raise ValueError(f"latency_s: {latency_s.shape[0] if latency_s.ndim else 0} values for {len(workload)} "
                         "requests")
    scored = workload.arrival_s >= (workload.arrival_s.min() if len(workload) else 0.0) + warmup_s
    answered = np.isfinite(latency_s) & scored
    if answered.sum() < min_answered or not placement.groups:
        return None
    config = config or SimulatorConfig()
    observed_quantile = float(np.quantile(latency_s[answered], quantile))
    met = answered & (np.nan_to_num(latency_s, nan=np.inf) <= workload.slo_s)
    observed_attainment = float(met[scored].mean())

    # One simulation per factor, memoised: the attainment guard, the bisection's bounds and the factor it returns
    # ask both figures of the same factors.
    @functools.cache
    def simulated_at(scale: float) -> SimulationResult:
        return simulate(placement, scaled_profiles(profiles, scale), workload, config)

    def latency_at(scale: float) -> float:
        value = _served_latency_quantile(simulated_at(scale), quantile, scored)
        return np.inf if np.isnan(value) else value

    def attainment_at(scale: float) -> float:
        return float((simulated_at(scale).status == SERVED)[scored].mean())

    # Misses that no service speed avoids (a model no group hosts) say nothing about the factor.
    by_attainment = (match_attainment and observed_attainment < 1.0
                     and attainment_at(MIN_SCALE) > observed_attainment)

    # A figure that grows with the factor, and its observed value.
    if by_attainment:
        grows, target = (lambda scale: -attainment_at(scale)), -observed_attainment
    else:
        grows, target = latency_at, observed_quantile
    scale = bisect_log(grows, target, MIN_SCALE, MAX_SCALE, BISECTION_STEPS)
    return ServiceCalibration(scale=scale, observed_latency_s=observed_quantile,
                              simulated_latency_s=latency_at(scale), quantile=quantile, answered=int(answered.sum()),
                              target="attainment" if by_attainment else "latency_quantile",
                              observed_attainment=observed_attainment, simulated_attainment=attainment_at(scale))


def bisect_log(grows, target: float, low: float, high: float, steps: int) -> float:
    """The factor in [low, high] at which `grows(factor)` (non-decreasing) crosses `target`, bisected `steps` times
    on log(factor); a target outside the range gives the bound."""
    if grows(low) >= target:
        return low
    if grows(high) <= target:
        return high
    log_low, log_high = np.log(low), np.log(high)
    for _ in range(steps):
        middle = (log_low + log_high) / 2
        if grows(float(np.exp(middle))) < target:
            log_low = middle
        else:
            log_high = middle
    return float(np.exp((log_low + log_high) / 2))


def records_view(config: SimulatorConfig, client_round_trip_s: float) -> SimulatorConfig:
    """The simulated system as the ingress's records see it: `config` with its request overhead (counted from the
    client) less `client_round_trip_s`, the way from the client to the ingress replica and back, which the ingress's
    clock does not see (`rayserve_apps/ingress/request_clock.py`). A refit on the records compares the simulator's
    latencies with theirs; with the whole overhead it would ask every request for that round trip more than the
    records hold and fit the service times short by it (the factors would come out below those fitted on the
    client's latencies, and the simulator optimistic)."""
    if client_round_trip_s < 0:
        raise ValueError(f"client_round_trip_s={client_round_trip_s}: must be >= 0")
    if client_round_trip_s > config.request_overhead_s:
        raise ValueError(f"client_round_trip_ms={1e3 * client_round_trip_s:g}: the client's round trip to the ingress "
                         f"is part of the request overhead and cannot exceed it "
                         f"(request_overhead_ms={1e3 * config.request_overhead_s:g})")
    if client_round_trip_s == 0:
        return config
    return replace(config, request_overhead_s=config.request_overhead_s - client_round_trip_s)


def observed_workload(traffic: ObservedTraffic) -> tuple[Workload, np.ndarray]:
    """The window's requests as a workload (real arrival times, the models' SLOs) and their measured latencies
    (seconds, NaN where not answered), in arrival order."""
    if traffic.latency_s is None:
        raise ValueError("traffic.latency_s: the observation carries no latencies")
    arrival = np.concatenate([np.asarray(a, dtype=float) for a in traffic.arrival_s] + [np.zeros(0)])
    model = np.concatenate([np.full(len(a), m, dtype=np.int32) for m, a in enumerate(traffic.arrival_s)]
                           + [np.zeros(0, dtype=np.int32)])
    latency = np.concatenate([np.asarray(x, dtype=float) for x in traffic.latency_s] + [np.zeros(0)])
    if len(latency) != len(arrival):
        raise ValueError(f"traffic.latency_s: {len(latency)} latencies for {len(arrival)} arrivals")
    order = np.argsort(arrival, kind="stable")
    slo = np.asarray(traffic.slo_s, dtype=float)[model]
    workload = Workload(list(traffic.model_names), arrival[order], model[order], slo[order])
    return workload, latency[order]
