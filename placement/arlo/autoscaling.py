"""Target-tracking autoscaling of a polymorphing model's instances (Arlo §3.3 "Resource auto-scaling", §4).

Scale out: when the 98th-percentile latency of recently completed requests reaches 95% of the SLO, add one
instance, loaded with the runtime of the longest max length (it can take any request). Scale in: when the p98
stays below 50% of the SLO for a whole `scale_in_period_s` (Arlo: 60 s), release the least busy instance. After
either action the periodic Runtime Scheduler re-balances runtimes over the new instance count.

`TargetTrackingAutoscaler.decide(now, recent latencies, instance loads)` returns a `ScalingDecision`; the simulator
and the live controller apply it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

#: Arlo §4: thresholds as fractions of the SLO and the scale-in observation period.
ARLO_SCALE_OUT_FRACTION = 0.95
ARLO_SCALE_IN_FRACTION = 0.50
ARLO_SCALE_IN_PERIOD_S = 60.0
#: Arlo §4 tracks the 98th percentile.
TRACKED_PERCENTILE = 98.0
#: Not in the paper: wait this long after a scale-out before the next, so a new instance can take load first.
DEFAULT_SCALE_OUT_COOLDOWN_S = 5.0


class AutoscalingParams(BaseModel):
    """Target tracking parameters (policy role 'polymorphing', params key 'autoscaling')."""

    model_config = ConfigDict(extra="forbid")

    slo_ms: float = Field(gt=0, description="Latency objective, in milliseconds.")
    scale_out_fraction: float = Field(default=ARLO_SCALE_OUT_FRACTION, gt=0, le=1,
                                      description="Scale out when p98 >= this x SLO.")
    scale_in_fraction: float = Field(default=ARLO_SCALE_IN_FRACTION, gt=0, lt=1,
                                     description="Scale in when p98 stays < this x SLO.")
    scale_in_period_s: float = Field(default=ARLO_SCALE_IN_PERIOD_S, gt=0,
                                     description="How long p98 must stay low before a scale-in, in seconds.")
    scale_out_cooldown_s: float = Field(default=DEFAULT_SCALE_OUT_COOLDOWN_S, ge=0,
                                        description="Least time between two scale-outs, in seconds.")
    min_instances: int = Field(default=1, ge=1, description="Never scale in below this many instances.")
    max_instances: int = Field(default=1_000_000, ge=1, description="Never scale out above this many instances.")


@dataclass(frozen=True)
class ScalingDecision:
    action: Literal["none", "scale_out", "scale_in"]
    max_length_tokens: int | None = None   # scale_out: the runtime the new instance loads
    instance_id: Hashable | None = None    # scale_in: the instance to release
    p98_s: float | None = None


@dataclass
class TargetTrackingAutoscaler:
    """Arlo §4 target tracking; one object per request stream."""

    params: AutoscalingParams
    longest_max_length_tokens: int
    _low_since_s: float | None = None
    _last_scale_out_s: float = -float("inf")
    _history: list = field(default_factory=list)

    def decide(self, now_s: float, recent_latencies_s: Sequence[float],
               instance_loads: dict[Hashable, int]) -> ScalingDecision:
        """One check: `recent_latencies_s` of requests completed since the last check, loads per instance."""
        if not recent_latencies_s:
            return ScalingDecision("none")
        p98 = float(np.percentile(np.asarray(recent_latencies_s, dtype=float), TRACKED_PERCENTILE))
        slo_s = self.params.slo_ms / 1000.0
        if p98 >= self.params.scale_out_fraction * slo_s:
            self._low_since_s = None
            if (now_s - self._last_scale_out_s >= self.params.scale_out_cooldown_s
                    and len(instance_loads) < self.params.max_instances):
                self._last_scale_out_s = now_s
                return ScalingDecision("scale_out", max_length_tokens=self.longest_max_length_tokens, p98_s=p98)
            return ScalingDecision("none", p98_s=p98)
        if p98 < self.params.scale_in_fraction * slo_s:
            if self._low_since_s is None:
                self._low_since_s = now_s
            if (now_s - self._low_since_s >= self.params.scale_in_period_s
                and len(instance_loads) > self.params.min_instances):
                self._low_since_s = now_s  # a fresh period before the next release
                victim = min(instance_loads, key=lambda iid: (instance_loads[iid], str(iid)))
                return ScalingDecision("scale_in", instance_id=victim, p98_s=p98)
            return ScalingDecision("none", p98_s=p98)
        self._low_since_s = None
        return ScalingDecision("none", p98_s=p98)
