"""The placement controller's decision: given the traffic just observed, keep the running placement or move.

AlpaServe plans once, offline (§4.2); plexserve re-plans as traffic changes. Each period the controller hands this
policy what it observed (per-model arrival times, from which rate and CV are fitted per window as for a trace,
§6.2) and the running placement. The policy fits the traffic, resamples a workload, and simulates three candidates:

1. **keep** the running placement;
2. **rehost**: AlpaServe Alg. 1 on the running group partition and parallel configurations (a warm start from the
   current placement: only hosted models change, so no replica restarts);
3. **replan**: AlpaServe Alg. 2 from scratch (new groups restart their deployments).

It moves only when the best candidate's predicted SLO attainment beats keeping by at least `min_gain`, and then
prefers the rehost unless the full re-plan is better by `min_gain` again: a change must pay for its disruption.
The decision is plain data, written to the decision log as it is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from placement.alpaserve.planner import PlannerConfig, place_unplaced, plan, select_models
from placement.alpaserve.simulator import simulate
from placement.core.placement_plan import Placement
from placement.core.profiles import ProfileSet
from placement.core.traces import fit_arrivals
from placement.core.traffic_window import ObservedTraffic

logger = logging.getLogger(__name__)

CandidateName = Literal["keep", "rehost", "replan"]
#: Shortest workload the candidates are simulated on, seconds: a short period is resampled for longer.
MIN_HORIZON_S = 60.0


class ModelTrafficFit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rate_per_s: float = Field(description="Fitted arrival rate of the last fit window, requests per second.")
    cv: float = Field(description="Fitted coefficient of variation of inter-arrival times (Gamma process).")
    requests: int = Field(description="Requests observed in the whole window.")


class Candidate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: CandidateName = Field(description="keep, rehost (Alg. 1 on the running groups) or replan (Alg. 2).")
    placement: Placement = Field(description="The candidate placement.")
    predicted_attainment: float = Field(description="SLO attainment the simulator predicts on the fitted traffic, 0..1.")


class ReplanDecision(BaseModel):
    """One decision, as the decision log stores it."""

    model_config = ConfigDict(extra="forbid")

    traffic: dict[str, ModelTrafficFit] = Field(description="Per model: the fitted traffic the candidates were judged on.")
    candidates: list[Candidate] = Field(description="Every candidate with its predicted attainment.")
    chosen: CandidateName = Field(description="The candidate to run from now on.")
    predicted_gain: float = Field(description="Predicted attainment of the chosen candidate minus keeping, 0..1.")
    reason: str = Field(description="Why, in words.")
    planning_s: float = Field(description="Seconds the decision took to compute.")

    def candidate(self, name: CandidateName) -> Candidate:
        return next(c for c in self.candidates if c.name == name)

    @property
    def placement(self) -> Placement:
        return self.candidate(self.chosen).placement


@dataclass
class ReplanPolicy:
    """Keep or move, from observed traffic (see the module doc)."""

    profiles: ProfileSet
    num_devices: int
    device_memory_bytes: int
    planner: PlannerConfig
    min_gain: float = 0.02  # predicted attainment gain (0..1) a change must bring
    fit_window_s: float = 10.0  # rate/CV windows within an observation; the last one is planned for (§6.2 fit)
    seed: int = 0

    def fit(self, traffic: ObservedTraffic) -> tuple[dict[str, ModelTrafficFit], np.ndarray, np.ndarray]:
        fitted = fit_arrivals(traffic.model_names, traffic.arrival_s, min(self.fit_window_s, traffic.duration_s), traffic.duration_s)
        rates, cvs = fitted.rates[:, -1], fitted.cvs[:, -1]
        fits = {name: ModelTrafficFit(rate_per_s=float(rates[m]), cv=float(cvs[m]), requests=len(traffic.arrival_s[m]))
                for m, name in enumerate(traffic.model_names)}
        return fits, rates, cvs

    def workload(self, traffic: ObservedTraffic, rates: np.ndarray, cvs: np.ndarray):
        """The traffic of the last fit window, resampled over the planning horizon."""
        from placement.core.traces import FittedTrace

        horizon = max(traffic.duration_s, MIN_HORIZON_S)
        trace = FittedTrace(traffic.model_names, horizon, rates[:, None], cvs[:, None])
        return trace.resample(traffic.slo_s, seed=self.seed)

    def decide(self, current: Placement, traffic: ObservedTraffic) -> ReplanDecision:
        started = time.perf_counter()
        fits, rates, cvs = self.fit(traffic)
        workload = self.workload(traffic, rates, cvs)
        names = traffic.model_names
        keep = self._attainment(current, workload) if len(workload) else 1.0
        candidates = [Candidate(name="keep", placement=current, predicted_attainment=keep)]
        if len(workload):
            groups = [(g.num_devices, g.config) for g in current.groups]
            rehost = select_models(names, self.profiles, workload, groups, self.device_memory_bytes, self.planner)
            replan = plan(names, self.profiles, workload, self.num_devices, self.device_memory_bytes, self.planner,
                          warm_start=current)
            for name, placement in (("rehost", rehost), ("replan", replan)):
                # Models without recent traffic keep (at least) one replica: the live system still answers them.
                complete, left_out = place_unplaced(placement, names, self.profiles, self.device_memory_bytes)
                if left_out:
                    logger.warning("replan: %s leaves %s without a group; not a candidate", name, left_out)
                    continue
                # Judged as deployed: with the models place_unplaced added (Alg. 1's own figure counts them as
                # unserved), on the same simulator and workload as keep.
                complete = complete.normalize()
                candidates.append(Candidate(name=name, placement=complete, predicted_attainment=self._attainment(complete, workload)))
        chosen, reason = self._choose(candidates)
        gain = next(c for c in candidates if c.name == chosen).predicted_attainment - keep
        decision = ReplanDecision(traffic=fits, candidates=candidates, chosen=chosen, predicted_gain=gain, reason=reason,
                                  planning_s=time.perf_counter() - started)
        logger.info("replan: %s (%s)", chosen, reason)
        return decision

    def _attainment(self, placement: Placement, workload) -> float:
        return simulate(placement, self.profiles, workload, self.planner.simulator).slo_attainment()

    def _choose(self, candidates: Sequence[Candidate]) -> tuple[CandidateName, str]:
        by_name = {c.name: c for c in candidates}
        keep = by_name["keep"].predicted_attainment
        if len(by_name) == 1:
            return "keep", "nothing to compare: no traffic observed, or no candidate hosts every model"
        best = max(c.predicted_attainment for c in candidates)
        if best - keep < self.min_gain:
            return "keep", f"best predicted gain {best - keep:+.3f} is below min_gain {self.min_gain}"
        rehost = by_name["rehost"].predicted_attainment if "rehost" in by_name else -1.0
        replan = by_name["replan"].predicted_attainment if "replan" in by_name else -1.0
        if rehost - keep >= self.min_gain and replan - rehost < self.min_gain:
            return "rehost", f"rehosting on the running groups gains {rehost - keep:+.3f}; a new partition would add {replan - rehost:+.3f}"
        return "replan", f"a new partition gains {replan - keep:+.3f} ({replan - rehost:+.3f} over rehosting)"
