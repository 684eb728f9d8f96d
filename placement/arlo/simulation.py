"""A small discrete-event simulation of one polymorphing request stream (Arlo §5.2), pure Python.

Instances execute one request at a time (Arlo serves with a fixed batch of 1), first come first served, each on
the runtime it is allocated; a request costs its runtime's latency (a static runtime's, padded to its max length,
or the dynamic runtime's at the request's own length) plus a fixed per-request overhead (Arlo §5.2.1: 0.8 ms). A
dispatch policy from `placement.arlo.request_scheduler` picks the instance at arrival and is told of every completion,
so the congestion it sees is exactly the outstanding requests. Every `period_s` the Runtime Scheduler re-solves the
allocation from the lengths seen in the last period (`placement.arlo.runtime_allocation`) and the fewest instances
switch runtime (`placement.arlo.instance_replacement`); a switching instance finishes its queue on the old runtime
first.

Schemes (Arlo §5): ``arlo`` (Eq. 1-7 + Alg. 1), ``ilb`` and ``ig`` (Eq. 1-7 + the §5.2.3 dispatch baselines),
``st`` (every instance on the longest static runtime), ``dt`` (every instance on the dynamic runtime), and
``infaas`` (instances in proportion to demand, bin-packing dispatch).
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from placement.arlo.instance_replacement import plan_replacement
from placement.arlo.request_scheduler import DISPATCH_POLICIES, IntraGroupLoadBalance, MultiLevelQueue
from placement.arlo.runtime_allocation import proportional_allocation, solve_allocation
from placement.arlo.runtimes import RuntimeProfileSet
from placement.sim.outcomes import LATE, SERVED, RequestOutcomes

logger = logging.getLogger(__name__)

#: Arlo §5.2.1: fixed per-request overhead added in its simulator (network, host-to-device copies).
ARLO_OVERHEAD_S = 0.8e-3
SCHEMES = ("arlo", "ilb", "ig", "st", "dt", "infaas")
#: The dynamic runtime is modelled as one level whose "max length" is the model's limit.
_DT_LEVEL = "dt"


@dataclass(frozen=True)
class SimulationResult:
    scheme: str
    latencies_s: np.ndarray
    slo_s: float
    arrivals_s: np.ndarray | None = None  # per request, as given to `simulate`

    @property
    def outcomes(self) -> RequestOutcomes:
        """The per-request outcomes every simulator reports (placement.sim): every request runs (Arlo rejects none),
        served when within the SLO, else late."""
        arrivals = np.asarray(self.arrivals_s, dtype=float)
        status = np.where(self.latencies_s <= self.slo_s, SERVED, LATE).astype(np.int8)
        return RequestOutcomes(arrivals, arrivals + self.slo_s, arrivals + self.latencies_s, status)

    @property
    def mean_s(self) -> float:
        return float(self.latencies_s.mean())

    @property
    def p98_s(self) -> float:
        return float(np.percentile(self.latencies_s, 98))

    @property
    def slo_attainment(self) -> float:
        return float((self.latencies_s <= self.slo_s).mean())

    def summary(self) -> dict:
        return {"mean_ms": self.mean_s * 1e3, "p98_ms": self.p98_s * 1e3, "slo_attainment": self.slo_attainment}


def _allocation_counts(scheme: str, profiles: RuntimeProfileSet, requests_per_slo: Sequence[float],
                       num_devices: int, objective: str = "queueing") -> dict[int, int]:
    if scheme == "infaas":
        return proportional_allocation(profiles, requests_per_slo, num_devices).counts()
    try:
        return solve_allocation(profiles, requests_per_slo, num_devices, objective).counts()
    except ValueError:  # more load than Eq. 3 allows: keep serving with the demand-proportional split
        return proportional_allocation(profiles, requests_per_slo, num_devices).counts()


def simulate(scheme: str, profiles: RuntimeProfileSet, arrivals_s: np.ndarray, lengths_tokens: np.ndarray,
             num_devices: int, initial_lengths_tokens: np.ndarray | None = None, period_s: float = 120.0,
             dynamic_latency_s: Callable[[int], float] | None = None, overhead_s: float = ARLO_OVERHEAD_S,
             dispatch_kwargs: dict | None = None, allocation_objective: str = "queueing") -> SimulationResult:
    """Latency of every request of a trace under one scheme; `allocation_objective` is L_i of Eq. 1
    ('queueing', the project default, or 'paper', see `solve_allocation`)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if len(arrivals_s) != len(lengths_tokens) or len(arrivals_s) == 0:
        raise ValueError("arrivals_s and lengths_tokens must be non-empty and of equal length")
    longest = profiles.max_lengths[-1]
    service_of_length = {r.max_length_tokens: r.batch_latency(1) + overhead_s for r in profiles.runtimes}
    slo_s = profiles.runtimes[0].slo_s
    periodic = scheme in ("arlo", "ilb", "ig", "infaas")

    if scheme == "st":
        policy: MultiLevelQueue = IntraGroupLoadBalance({longest: profiles.runtimes[-1].capacity_requests})
        runtime_of = {k: longest for k in range(num_devices)}
    elif scheme == "dt":
        if dynamic_latency_s is None:
            raise ValueError("scheme 'dt' needs dynamic_latency_s")
        policy = IntraGroupLoadBalance({longest: profiles.runtimes[-1].capacity_requests})
        runtime_of = {k: longest for k in range(num_devices)}
    else:
        history = initial_lengths_tokens if initial_lengths_tokens is not None else lengths_tokens[:1000]
        window = max(float(arrivals_s[min(len(history), len(arrivals_s)) - 1] - arrivals_s[0]), 1e-3)
        q = profiles.requests_per_bin(history, window)
        counts = _allocation_counts(scheme, profiles, q, num_devices, allocation_objective)
        policy_cls = {"arlo": DISPATCH_POLICIES["arlo"], "ilb": DISPATCH_POLICIES["ilb"], "ig": DISPATCH_POLICIES["ig"],
                      "infaas": DISPATCH_POLICIES["bin_packing"]}[scheme]
        # Dispatch congestion uses the capacity with the per-request overhead included: what an instance really
        # completes within the SLO here (the allocation keeps the profile's M_i, as Arlo's profiler measures it).
        capacities = {r.max_length_tokens: max(1, int(slo_s // service_of_length[r.max_length_tokens]))
                      for r in profiles.runtimes}
        policy = policy_cls(capacities, **(dispatch_kwargs or {})) if scheme == "arlo" else policy_cls(capacities)
        runtime_of, k = {}, 0
        for length, count in counts.items():
            for _ in range(count):
                runtime_of[k] = length
                k += 1
    for instance, length in runtime_of.items():
        policy.add_instance(instance, length)

    free_at = [0.0] * num_devices
    completions: list[tuple[float, int]] = []
    latencies = np.empty(len(arrivals_s))
    next_period = float(arrivals_s[0]) + period_s
    seen: list[int] = []
    period_start = float(arrivals_s[0])
    dispatch, complete = policy.dispatch, policy.complete
    dynamic = scheme == "dt"
    for index in range(len(arrivals_s)):
        now = float(arrivals_s[index])
        length = int(lengths_tokens[index])
        while completions and completions[0][0] <= now:
            complete(heapq.heappop(completions)[1])
        if periodic:
            seen.append(length)
            if now >= next_period:
                q = profiles.requests_per_bin(seen, now - period_start)
                counts = _allocation_counts(scheme, profiles, q, num_devices, allocation_objective)
                loads = {iid: policy.outstanding(iid) for iid in runtime_of}
                plan = plan_replacement(runtime_of, counts, loads)
                for change in plan.changes:
                    outstanding = policy.outstanding(change.instance_id)
                    policy.remove_instance(change.instance_id)
                    policy.add_instance(change.instance_id, change.to_max_length_tokens, outstanding)
                    runtime_of[change.instance_id] = change.to_max_length_tokens
                logger.debug("t=%.0fs %s re-allocation: %d instances switch runtime", now, scheme, plan.num_changed)
                seen, period_start, next_period = [], now, now + period_s
        instance = dispatch(length)
        service = dynamic_latency_s(length) + overhead_s if dynamic else service_of_length[runtime_of[instance]]
        finish = max(now, free_at[instance]) + service
        free_at[instance] = finish
        heapq.heappush(completions, (finish, instance))
        latencies[index] = finish - now
    return SimulationResult(scheme, latencies, slo_s, np.asarray(arrivals_s, dtype=float))


@dataclass
class ArloEngine:
    """:func:`simulate` as a `placement.sim.SimulationEngine`; `options` are its keyword arguments."""

    scheme: str
    profiles: RuntimeProfileSet
    arrivals_s: np.ndarray
    lengths_tokens: np.ndarray
    num_devices: int
    options: dict = field(default_factory=dict)

    def run(self) -> SimulationResult:
        return simulate(self.scheme, self.profiles, self.arrivals_s, self.lengths_tokens, self.num_devices,
                        **self.options)
