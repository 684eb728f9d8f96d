"""How the live controller recalibrates its simulator's service times, and the loading slowdown it prices rollouts
with, from the ingress's records (plain data: a spec's `controller.calibration` section; the fits are
`placement/alpaserve/service_calibration.py` and `placement/alpaserve/transition_calibration.py`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: Default latency quantile matched: high enough to see the queueing in bursts (what decides SLO attainment), low
#: enough that a window of a few hundred answers still holds dozens of requests beyond it.
DEFAULT_QUANTILE = 0.9
#: Fewest answered requests a window must hold to be calibrated on.
DEFAULT_MIN_ANSWERED = 50
#: Weight of the factor in force when a new window's fit is blended in (geometric mean). Zero: a 30 s window refitted
#: every 10 s period already overlaps the two before it, and a blend on top only delays the factor. The factor a
#: window needs rises over a controller run's first minute, so a delayed factor lags low and leaves the simulator
#: optimistic (`benchmarks/fidelity_replay.py` scores the smoothing on a fidelity run's records).
DEFAULT_SMOOTHING = 0.0
#: Weight of the loading slowdown in force when a rollout's fit is blended in (geometric mean): a fit rests on the
#: few dozen requests of the last rollouts, and one rollout's fits vary severalfold within one run.
DEFAULT_LOADING_SMOOTHING = 0.5
#: Seconds of records each fit replays. A one-period window (10 s in the fidelity benchmark) holds a few dozen
#: requests of one load regime, and its fits swing from period to period; a longer window steadies the fit but lags
#: the traffic. 30 s is the window of 10, 30, 60 and 90 s that gives the smallest simulated-minus-real gap
#: (`abs_gap_max`) when `benchmarks/fidelity_replay.py` replays the refit on fidelity runs' records.
DEFAULT_WINDOW_S = 30.0
#: SLOs after its arrival by which a request has ended (answered, refused or missed): the service-time refit leaves
#: out the requests of the window's last CALIBRATION_SETTLE_SLOS SLOs (plus a report period), and scores none of its
#: first as many seconds (their queues, built by earlier requests, are what the window's simulation starts without).
CALIBRATION_SETTLE_SLOS = 2.0


def calibration_settle_s(max_slo_s: float, report_period_s: float, period_s: float) -> float:
    """Seconds at the end of a calibration window whose requests a refit leaves out (and at its start, scores not):
    CALIBRATION_SETTLE_SLOS of the longest SLO plus one traffic-report period, at most a quarter period."""
    return min(CALIBRATION_SETTLE_SLOS * max_slo_s + report_period_s, period_s / 4)


class ServiceCalibrationSettings(BaseModel):
    """Online calibration of the service-time factor and of the loading slowdown (see the module doc)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quantile: float = Field(default=DEFAULT_QUANTILE, gt=0, lt=1,
                            description="Latency quantile of the answered requests the simulator must reproduce "
                                        "in a window where every SLO was met.")
    min_answered: int = Field(default=DEFAULT_MIN_ANSWERED, ge=1,
                              description="Fewest answered requests in the window for a fit; fewer keep the factor.")
    match_attainment: bool = Field(default=True,
                                   description="Fit a window that missed some SLOs on its SLO attainment (rejections "
                                               "count as misses); false: always on the latency quantile.")
    smoothing: float = Field(default=DEFAULT_SMOOTHING, ge=0, lt=1,
                             description="Weight of the factor in force against a new window's fit (0: take the "
                                         "new fit as it is).")
    loading_smoothing: float = Field(default=DEFAULT_LOADING_SMOOTHING, ge=0, lt=1,
                                     description="Weight of the loading slowdown in force against a rollout's refit "
                                                 "(0: take the new fit as it is).")
    window_s: float = Field(default=DEFAULT_WINDOW_S, gt=0,
                            description="Seconds of ingress records a fit replays (at least one controller period), "
                                        "starting no earlier than the last placement change "
                                        "or calibration restart.")
    client_round_trip_ms: float = Field(default=0.0, ge=0,
                                        description="Milliseconds of each request's latency that its client sees "
                                                    "and the ingress's records do not: the way back from the "
                                                    "ingress replica to the client, and the way there unless the "
                                                    "clients stamp their send time (`X-Request-Start`, "
                                                    "`sent_at_s`); the clients' latency less the answers' "
                                                    "`ingress_latency_ms`, on average. Part of "
                                                    "`planning.simulation.request_overhead_ms`, which counts from "
                                                    "the client: the refits simulate the records with the request "
                                                    "overhead less these, as the ingress's clock counts; the "
                                                    "decisions judge with the whole overhead.")
    refit_loading_slowdown: bool = Field(default=True,
                                         description="After each rollout, refit the transition model's loading "
                                                     "slowdown on the requests that arrived during it, blended with "
                                                     "the one in force by `loading_smoothing`; false: keep the "
                                                     "spec's.")
