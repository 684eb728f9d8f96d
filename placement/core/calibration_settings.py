"""How the live controller recalibrates its simulator's service times from the ingress's records (plain data: a
spec's `controller.calibration` section; the fit is `placement/alpaserve/service_calibration.py`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: Default latency quantile matched: high enough to see the queueing in bursts (what decides SLO attainment), low
#: enough that a window of a few hundred answers still holds dozens of requests beyond it.
DEFAULT_QUANTILE = 0.9
#: Fewest answered requests a window must hold to be calibrated on.
DEFAULT_MIN_ANSWERED = 50
#: Weight of the factor in force when a new window's fit is blended in (geometric mean).
DEFAULT_SMOOTHING = 0.5


class ServiceCalibrationSettings(BaseModel):
    """Online calibration of the service-time factor (see the module doc)."""

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
