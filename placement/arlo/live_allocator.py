"""Arlo's Runtime Scheduler for the live app: re-allocate a polymorphing model's runtimes every period (Arlo §3.3).

The placement controller receives one `RequestRecord` per request from the ingress. Every controller period it
hands a polymorphing model's `LiveRuntimeAllocator` the input lengths (`RequestRecord.input_tokens`) seen over its
window and the deployment's current assignment (replica rank -> runtime max length, `PolymorphAssignmentParams`). Once
per `period_s` (Arlo §5: 120 s) the allocator

1. turns the lengths into Arlo's Q_i, the mean requests per SLO period in each runtime's length bin
   (`RuntimeProfileSet.requests_per_bin`);
2. solves Arlo's Eq. 1-7 exactly for the N_i summing to `num_instances` (`solve_allocation`), falling back to
   `proportional_allocation` when Eq. 3 cannot hold on that many instances, as `PeriodicRuntimeAllocator` does
   (adding instances is target-tracking autoscaling's job, `placement.arlo.autoscaling`);
3. keeps the previous counts when they are as good (Eq. 1 within `change_tolerance` of the optimum), so ties and
   an idle window never swap runtimes;
4. maps the counts onto replica ranks changing the fewest replicas
   (`placement.arlo.instance_replacement.rank_assignment`, Arlo §4 "Instance replacement") and returns the
   declarative update `(num_replicas, user_config)` with the same contents as
   `rayserve_apps.contracts.allocation_update` (placement/ does not import rayserve_apps).

Pure Python: no torch, no Ray. The decision is plain data (`AllocationDecision`), written to the decision log as is.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from placement.arlo.instance_replacement import rank_assignment
from placement.arlo.runtime_allocation import (
    ARLO_ALLOCATION_PERIOD_S,
    RuntimeAllocation,
    allocation_lower_bounds,
    evaluate_allocation,
    proportional_allocation,
    solve_allocation,
)
from placement.arlo.runtimes import RuntimeProfile, RuntimeProfileSet

logger = logging.getLogger(__name__)

#: Source tag of a profile set derived from the capacities M_i instead of measured latencies.
DERIVED_PROFILE_SOURCE = "derived:capacities"
#: Relative slack of Eq. 1 within which the previous counts are kept (0: only exact ties keep them).
DEFAULT_CHANGE_TOLERANCE = 0.0
#: Absolute slack of Eq. 1 (seconds of total latency) for comparing costs, so float noise counts as a tie.
_COST_EPSILON_S = 1e-12

Solver = Literal["exact", "proportional", "kept"]


def profiles_from_capacities(capacities: Mapping[int, int], slo_s: float, model: str = "") -> RuntimeProfileSet:
    """A `RuntimeProfileSet` derived from capacities alone, for `solve_allocation` when no profile was measured.

    Derived, not measured: a runtime whose capacity is M_i requests within the SLO is modelled as one instance
    completing M_i requests back to back, i.e. batch latency slo_s / M_i at batch size 1 (nudged down by one ulp
    where floating point would make `capacity_requests` round to M_i - 1). Its L_i(B) is then
    `RuntimeProfile.mean_latency_s`: that latency plus the M/D/1 wait at utilisation B / M_i. Every latency scales
    with slo_s, so the allocation depends only on the ratios of the M_i and on Q_i / M_i (Arlo §3.3, Eq. 1-7).
    """
    if not capacities:
        raise ValueError("capacities must name at least one runtime")
    if not slo_s > 0:
        raise ValueError(f"slo_s must be > 0, got {slo_s}")
    runtimes = []
    for length in sorted(capacities):
        capacity = capacities[length]
        if length < 1:
            raise ValueError(f"capacities: runtime max length {length} must be >= 1")
        if capacity < 1:
            raise ValueError(f"capacities[{length}]={capacity}: capacity within the SLO (Arlo M_i) must be >= 1")
        seconds = slo_s / capacity
        if math.floor(slo_s / seconds) < capacity:
            seconds = math.nextafter(seconds, 0.0)
        runtime = RuntimeProfile(max_length_tokens=length, batch_latency_s={1: seconds}, max_batch_size=1, slo_s=slo_s)
        assert runtime.capacity_requests == capacity, (length, capacity, runtime.capacity_requests)
        runtimes.append(runtime)
    return RuntimeProfileSet(model=model or "unnamed", source=DERIVED_PROFILE_SOURCE, runtimes=runtimes)


class LiveAllocatorParams(BaseModel):
    """The keys of `PolymorphingPolicyParams` the allocator reads (the others, routing and runtime build, are
    ignored)."""

    model_config = ConfigDict(extra="ignore")

    capacities: dict[int, int] = Field(min_length=1,
                                       description="Runtime max length -> capacity within the SLO (Arlo M_i).")
    initial_counts: dict[int, int] | None = Field(default=None, description="Runtime max length -> replicas at start.")
    allocation_period_s: float = Field(default=ARLO_ALLOCATION_PERIOD_S, gt=0,
                                       description="Seconds between re-allocations (Arlo §5: 120 s).")

    @field_validator("capacities")
    @classmethod
    def _positive_capacities(cls, value: dict[int, int]) -> dict[int, int]:
        for length, capacity in value.items():
            if length < 1 or capacity < 1:
                raise ValueError(f"capacities[{length}]={capacity}: max lengths and capacities must be >= 1")
        return value


class AllocationDecision(BaseModel):
    """One re-allocation: counts per runtime, the inputs it used, and the declarative update realising it."""

    model_config = ConfigDict(frozen=True)

    now_s: float = Field(description="When the decision was taken (the caller's clock).")
    window_s: float = Field(description="Seconds of traffic the lengths covered.")
    num_requests: int = Field(description="Requests with a length counted in the window.")
    requests_per_slo: dict[int, float] = Field(description="Arlo Q_i by runtime max length: mean requests per SLO "
                                                           "period in its bin.")
    counts: dict[int, int] = Field(description="Arlo N_i by runtime max length; sums to num_instances.")
    previous_counts: dict[int, int] = Field(description="Instances per runtime max length before the decision.")
    changed: bool = Field(description="Whether counts or the rank assignment differ from before (else nothing to "
                                      "apply).")
    solver: Solver = Field(description="exact: Eq. 1-7 by DP; proportional: Eq. 3 infeasible, Q_i/M_i shares; kept: "
                                       "previous counts as good as the optimum.")
    total_latency_s: float = Field(description="Arlo Eq. 1 objective of counts under the Q_i (seconds summed over "
                                               "requests).")
    assignment: dict[int, int] = Field(description="Replica rank -> runtime max length, fewest ranks changed.")
    replicas_changed: int = Field(description="Ranks switching runtime, added, or released vs previous_assignment.")
    num_replicas: int = Field(description="Serve num_replicas of the runtime deployment.")
    user_config: dict[str, Any] = Field(description="Serve user_config: PolymorphAssignmentParams as JSON (assignment, "
                                                    "version).")

    def update(self) -> tuple[int, dict[str, Any]]:
        """`(num_replicas, user_config)`, as `allocation_update` returns them."""
        return self.num_replicas, self.user_config


class LiveRuntimeAllocator:
    """Arlo's Runtime Scheduler (§3.3, Eq. 1-7; period from §5) as a policy the live controller calls each period.

    Paper names: Q_i requests per SLO period in bin i, M_i capacity within the SLO, N_i instances, G = num_instances.
    """

    def __init__(self, capacities: Mapping[int, int], slo_s: float, num_instances: int | None = None,
                 period_s: float = ARLO_ALLOCATION_PERIOD_S, initial_counts: Mapping[int, int] | None = None,
                 profiles: RuntimeProfileSet | None = None, change_tolerance: float = DEFAULT_CHANGE_TOLERANCE,
                 model: str = "", start_s: float | None = None, initial_version: int = 0):
        """`capacities`: max length -> M_i; `num_instances` (G): default sum(initial_counts) or one per runtime;
        `profiles`: measured profiles with the same max lengths (default: `profiles_from_capacities`);
        `start_s`: when the first period starts (default: the first `decide` call)."""
        # pydantic's ValidationError is a ValueError whose message names the field.
        params = LiveAllocatorParams.model_validate({"capacities": dict(capacities), "initial_counts": initial_counts,
                                                     "allocation_period_s": period_s})
        if not slo_s > 0:
            raise ValueError(f"slo_s must be > 0, got {slo_s}")
        if not change_tolerance >= 0:
            raise ValueError(f"change_tolerance must be >= 0, got {change_tolerance}")
        if initial_version < 0:
            raise ValueError(f"initial_version must be >= 0, got {initial_version}")
        self.capacities = dict(sorted(params.capacities.items()))
        self.max_lengths = list(self.capacities)
        if params.initial_counts is not None:
            unknown = sorted(set(params.initial_counts) - set(self.capacities))
            if unknown:
                raise ValueError(f"initial_counts names runtimes without a capacity: {unknown}")
            if any(count < 0 for count in params.initial_counts.values()):
                raise ValueError(f"initial_counts must be >= 0, got {params.initial_counts}")
        if num_instances is None:
            num_instances = sum(params.initial_counts.values()) if params.initial_counts else len(self.capacities)
        if num_instances < 1:
            raise ValueError("num_instances must be >= 1 (Arlo Eq. 7 keeps one instance of the longest), got "
                             f"{num_instances}")
        if profiles is None:
            profiles = profiles_from_capacities(self.capacities, slo_s, model)
        elif profiles.max_lengths != self.max_lengths:
            raise ValueError(f"profiles: runtimes {profiles.max_lengths} differ from capacities {self.max_lengths}")
        self.profiles = profiles
        self.slo_s = float(slo_s)
        self.num_instances = int(num_instances)
        self.period_s = params.allocation_period_s
        self.change_tolerance = float(change_tolerance)
        self.version = int(initial_version)
        self._last_decision_s = start_s

    @classmethod
    def from_policy_params(cls, params: Mapping[str, Any], slo_s: float, num_instances: int | None = None,
                           model: str = "", **kwargs: Any) -> "LiveRuntimeAllocator":
        """From a model's `policies.polymorphing.params` (a `PolymorphingPolicyParams` dict; unrelated keys ignored)."""
        parsed = LiveAllocatorParams.model_validate(dict(params))
        return cls(parsed.capacities, slo_s, num_instances=num_instances, period_s=parsed.allocation_period_s,
                   initial_counts=parsed.initial_counts, model=model, **kwargs)

    def decide(self, now_s: float, records_lengths: Sequence[int], window_s: float,
               previous_assignment: Mapping[int, int], previous_version: int | None = None,
               num_instances: int | None = None) -> AllocationDecision | None:
        """A new allocation once `period_s` has passed since the last decision (or the start), else None.

        `records_lengths`: input tokens of the requests seen over the last `window_s` seconds (lengths < 1, records
        without a text, are skipped; lengths beyond the longest runtime count in its bin); `previous_assignment`:
        the deployment's current replica rank -> max length; `previous_version`: its user_config version (default:
        the allocator's own counter). The returned user_config carries version + 1 when anything changes.
        `num_instances`: a new G from now on (e.g. after autoscaling added or released an instance).
        """
        if num_instances is not None:
            if num_instances < 1:
                raise ValueError("num_instances must be >= 1 (Arlo Eq. 7 keeps one instance of the longest), got "
                                 f"{num_instances}")
            self.num_instances = int(num_instances)
        if self._last_decision_s is None:
            self._last_decision_s = now_s
            return None
        if now_s - self._last_decision_s < self.period_s:
            return None
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        previous = self._check_assignment(previous_assignment)
        self._last_decision_s = now_s
        lengths = [int(length) for length in records_lengths if length >= 1]
        q = self.profiles.requests_per_bin(lengths, window_s)  # Arlo Q_i
        previous_counts = {length: 0 for length in self.max_lengths}
        previous_counts.update(Counter(previous.values()))
        allocation, solver = self._solve(q, previous_counts)
        counts = allocation.counts()
        assignment = rank_assignment(previous, counts)
        changed = counts != previous_counts or assignment != previous
        if previous_version is not None:
            self.version = previous_version
        if changed:
            self.version += 1
        replicas_changed = sum(1 for rank in set(previous) | set(assignment)
                               if previous.get(rank) != assignment.get(rank))
        user_config = {"assignment": {str(rank): length for rank, length in assignment.items()},
                       "version": self.version}
        decision = AllocationDecision(
            now_s=now_s, window_s=window_s, num_requests=len(lengths), requests_per_slo=dict(zip(self.max_lengths, q)),
            counts=counts, previous_counts=previous_counts, changed=changed, solver=solver,
            total_latency_s=allocation.total_latency_s, assignment=assignment, replicas_changed=replicas_changed,
            num_replicas=len(assignment), user_config=user_config)
        logger.info("arlo allocation %s: Q=%s counts %s -> %s (%s, %d replicas changed)", self.profiles.model,
                    [round(x, 3) for x in q], previous_counts, counts, solver, replicas_changed)
        return decision

    # --- helpers ----------------------------------------------------------------------------------------------------
    def _check_assignment(self, previous_assignment: Mapping[int, int]) -> dict[int, int]:
        previous: dict[int, int] = {}
        for rank, length in previous_assignment.items():
            try:
                rank_int, length_int = int(rank), int(length)
            except (TypeError, ValueError):
                raise ValueError(f"previous_assignment[{rank!r}]={length!r}: ranks and max lengths must be "
                                 "integers") from None
            if rank_int < 0 or length_int not in self.capacities:
                raise ValueError(f"previous_assignment[{rank_int}]={length_int}: rank must be >= 0 and the max length "
                                 f"one of the runtimes {self.max_lengths}")
            previous[rank_int] = length_int
        return previous

    def _solve(self, q: list[float], previous_counts: dict[int, int]) -> tuple[RuntimeAllocation, Solver]:
        try:
            best = solve_allocation(self.profiles, q, self.num_instances)
            solver: Solver = "exact"
        except ValueError as error:
            logger.warning("allocation infeasible on %d instances (%s); capacity-proportional fallback",
                           self.num_instances, error)
            best, solver = proportional_allocation(self.profiles, q, self.num_instances), "proportional"
        kept = self._previous_if_as_good(q, previous_counts, best)
        return (kept, "kept") if kept is not None else (best, solver)

    def _previous_if_as_good(self, q: list[float], previous_counts: dict[int, int],
                             best: RuntimeAllocation) -> RuntimeAllocation | None:
        """The previous counts' allocation when they are valid (Eq. 2, 3, 7) and within the tolerance of `best`."""
        instances = [previous_counts[length] for length in self.max_lengths]
        if sum(instances) != self.num_instances or instances == best.instances:
            return None
        bounds = allocation_lower_bounds(self.profiles, q)
        if any(n < bound for n, bound in zip(instances, bounds)):
            return None
        try:
            previous = evaluate_allocation(self.profiles, q, instances)
        except ValueError:
            return None
        if previous.total_latency_s <= best.total_latency_s * (1.0 + self.change_tolerance) + _COST_EPSILON_S:
            return previous
        return None



def apply_scaling(assignment: Mapping[int, int], action: Literal["scale_out", "scale_in"],
                  longest_max_length_tokens: int) -> dict[int, int]:
    """The replica rank -> runtime max length assignment after a target-tracking action (Arlo §3.3 "Resource
    auto-scaling", §4; `placement.arlo.autoscaling.TargetTrackingAutoscaler` decides the action).

    scale_out adds rank N with the longest runtime (it can take any request). scale_in releases the highest rank:
    in the live app Serve picks the replica it stops and keeps ranks contiguous, and every replica runs its rank's
    runtime, so a particular instance cannot be released there (Arlo's least-busy choice applies in the simulator).
    When the release leaves no instance of the longest runtime (Arlo Eq. 7), the highest remaining rank takes it.
    The next periodic re-allocation re-balances the runtimes over the new instance count.
    """
    ranks = dict(sorted((int(rank), int(length)) for rank, length in assignment.items()))
    if list(ranks) != list(range(len(ranks))):
        raise ValueError(f"assignment ranks must be 0..N-1, got {sorted(ranks)}")
    if action == "scale_out":
        ranks[len(ranks)] = longest_max_length_tokens
        return ranks
    if action != "scale_in":
        raise ValueError(f"action must be 'scale_out' or 'scale_in', got {action!r}")
    if len(ranks) <= 1:
        raise ValueError("scale_in needs at least two instances (Arlo Eq. 7 keeps one of the longest runtime)")
    ranks.pop(len(ranks) - 1)
    if longest_max_length_tokens not in ranks.values():
        ranks[len(ranks) - 1] = longest_max_length_tokens
    return ranks
