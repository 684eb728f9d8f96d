"""Runtime allocation: how many instances each polymorphing runtime gets (Arlo §3.3, Eq. 1-7).

Given G devices, runtimes i = 1..I sorted by max length, the mean requests per SLO period in each runtime's length
bin (Q_i), each runtime's capacity within the SLO (M_i) and its load -> mean latency mapping (L_i), choose
instance counts N_i that minimise the total latency (Eq. 1)

    min  sum_i L_i(B_i) * C_i
    s.t. sum_i N_i = G                                           (Eq. 2)
         N_i >= floor(Q_i / M_i)                                  (Eq. 3)
         R_0 = 0,  R_i = max(R_{i-1} + Q_i - N_i M_i, 0)           (Eq. 4, overflow demoted to longer runtimes)
         C_i = min(R_{i-1} + Q_i, N_i M_i) for i < I,  C_I = R_{I-1} + Q_I     (Eq. 5)
         B_i = C_i / N_i                                          (Eq. 6)
         N_I >= 1                                                 (Eq. 7)

`solve_allocation` solves it exactly by dynamic programming over runtimes with state (devices used, overflow R):
for a fixed prefix, the rest of the cost is non-decreasing in R (more demoted requests never make a later runtime
faster) and feasibility does not depend on R, so per devices-used count only the Pareto front of (R, cost so far)
needs to be kept. A runtime either absorbs everything that reaches it (R becomes 0; only the cheapest such state
per device count survives) or is saturated (it serves N_i M_i at L_i(M_i) and passes the rest on). The brute-force
`solve_allocation_brute_force` enumerates every N and is what the tests check the DP against.

`PeriodicRuntimeAllocator` re-solves every `period_s` (Arlo §5: 120 s) from the lengths seen since the last period.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from placement.arlo.runtimes import RHO_CAP, RuntimeProfileSet, check_objective

logger = logging.getLogger(__name__)

#: Arlo §5 "Parameter settings": the Runtime Scheduler's period.
ARLO_ALLOCATION_PERIOD_S = 120.0
#: States whose cost differs by less than this (seconds of total latency) count as equal when pruning.
_COST_EPSILON = 1e-12


@dataclass(frozen=True)
class RuntimeAllocation:
    """The solution of Eq. 1-7: instances per runtime and the resulting flow of requests."""

    max_lengths_tokens: list[int]
    instances: list[int]            # Arlo Eq. 1-7: N_i
    served_requests: list[float]    # Arlo Eq. 5: C_i
    overflow_requests: list[float]  # Arlo Eq. 4: R_i
    per_instance_load: list[float]  # Arlo Eq. 6: B_i
    total_latency_s: float          # Arlo Eq. 1: the objective

    def counts(self) -> dict[int, int]:
        """max length -> instances."""
        return dict(zip(self.max_lengths_tokens, self.instances))


def allocation_lower_bounds(profiles: RuntimeProfileSet, requests_per_slo: Sequence[float]) -> list[int]:
    """Eq. 3 and Eq. 7: the fewest instances each runtime may get."""
    bounds = [math.floor(q / r.capacity_requests) if r.capacity_requests > 0 else 0
              for q, r in zip(requests_per_slo, profiles.runtimes)]
    bounds[-1] = max(bounds[-1], 1)
    return bounds


def evaluate_allocation(profiles: RuntimeProfileSet, requests_per_slo: Sequence[float],
                        instances: Sequence[int], objective: str = "queueing") -> RuntimeAllocation:
    """Eq. 4-6 and the objective (Eq. 1) of one allocation, straight from the formulas (no feasibility check).
    `objective`: L_i as 'queueing' (the project default) or 'paper' (the profiled table, §3.4)."""
    check_objective(objective)
    served, overflow, loads = [], [], []
    carried = 0.0  # R_{i-1}
    total = 0.0
    last = len(profiles.runtimes) - 1
    for i, (runtime, q, n) in enumerate(zip(profiles.runtimes, requests_per_slo, instances)):
        demand = carried + q
        c = demand if i == last else min(demand, n * runtime.capacity_requests)
        carried = 0.0 if i == last else max(demand - n * runtime.capacity_requests, 0.0)
        b = c / n if n > 0 else 0.0
        if c > 0:
            if n == 0:
                raise ValueError(f"runtime {runtime.max_length_tokens} serves {c} requests with 0 instances")
            total += runtime.allocation_latency_s(b, objective) * c
        served.append(c)
        overflow.append(carried)
        loads.append(b)
    return RuntimeAllocation(profiles.max_lengths, list(instances), served, overflow, loads, total)


def _check_inputs(profiles: RuntimeProfileSet, requests_per_slo: Sequence[float], num_devices: int) -> list[int]:
    if len(requests_per_slo) != len(profiles.runtimes):
        raise ValueError(f"requests_per_slo has {len(requests_per_slo)} entries for {len(profiles.runtimes)} runtimes")
    if any(q < 0 for q in requests_per_slo):
        raise ValueError("requests_per_slo must be >= 0")
    bounds = allocation_lower_bounds(profiles, requests_per_slo)
    if num_devices < sum(bounds):
        raise ValueError(f"num_devices={num_devices} is below the {sum(bounds)} instances the load needs within the "
                         f"SLO (Arlo Eq. 3 and 7: {bounds})")
    return bounds


def solve_allocation_brute_force(profiles: RuntimeProfileSet, requests_per_slo: Sequence[float],
                                 num_devices: int, objective: str = "queueing") -> RuntimeAllocation:
    """Every N with sum G and N_i >= the Eq. 3/7 bounds; exponential, for tests on small cases."""
    bounds = _check_inputs(profiles, requests_per_slo, num_devices)
    slack = num_devices - sum(bounds)
    best: RuntimeAllocation | None = None
    for extra in itertools.product(range(slack + 1), repeat=len(bounds) - 1):
        if sum(extra) > slack:
            continue
        instances = [b + e for b, e in zip(bounds, extra)]
        instances.append(bounds[-1] + slack - sum(extra))
        candidate = evaluate_allocation(profiles, requests_per_slo, instances, objective)
        if best is None or candidate.total_latency_s < best.total_latency_s - _COST_EPSILON:
            best = candidate
    assert best is not None
    return best


@dataclass
class _Front:
    """Pareto states of the DP after some runtimes: devices used, overflow R, cost so far, and the choices."""

    devices: np.ndarray
    overflow: np.ndarray
    cost: np.ndarray
    parent: np.ndarray   # index into the previous front
    choice: np.ndarray   # N_i taken at this runtime


def _pareto(devices: np.ndarray, overflow: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Indices of states not dominated by another state with the same devices (<= overflow and <= cost)."""
    order = np.lexsort((cost, overflow, devices))
    d, c = devices[order], cost[order]
    group = np.cumsum(np.r_[True, d[1:] != d[:-1]])
    span = float(c.max() - c.min()) + 1.0 if len(c) else 1.0
    # Later groups are shifted below every earlier value, so a running minimum restarts at each group.
    shifted = c - group * span
    running = np.minimum.accumulate(shifted)
    keep = np.r_[True, shifted[1:] < running[:-1] - _COST_EPSILON]
    return order[keep]


class _LatencyCurve:
    """L_i(B) of one runtime as a fast array function (the same formula as RuntimeProfile.mean_latency_s; with
    objective 'paper', RuntimeProfile.profiled_latency_s)."""

    def __init__(self, runtime, objective: str = "queueing") -> None:
        self.runtime, self.objective = runtime, objective
        self.single = runtime.batch_latency(1)
        self.batch_s = runtime.batch_latency_s[runtime.max_batch_size]
        self.rho_per_load = self.batch_s / (runtime.slo_s * runtime.max_batch_size)
        self.slope = 1.0 / (2.0 * (1.0 - RHO_CAP) ** 2)

    def __call__(self, load: np.ndarray) -> np.ndarray:
        if self.objective == "paper":
            return self.runtime.profiled_latency_s(load)
        rho = load * self.rho_per_load
        capped = np.minimum(rho, RHO_CAP)
        return (self.single
                + self.batch_s * (capped / (2.0 * (1.0 - capped)) + np.maximum(rho - RHO_CAP, 0.0) * self.slope))


def solve_allocation(profiles: RuntimeProfileSet, requests_per_slo: Sequence[float],
                     num_devices: int, objective: str = "queueing") -> RuntimeAllocation:
    """Exact solution of Arlo Eq. 1-7 by Pareto dynamic programming (see the module docstring).

    `objective` chooses L_i in Eq. 1: 'queueing' (the project default: one request's latency plus the M/D/1 wait
    at load B, :meth:`RuntimeProfile.mean_latency_s`, which prices instances near capacity M_i) or 'paper' (§3.4
    as published: the profiled latency table read at B, :meth:`RuntimeProfile.profiled_latency_s`).
    benchmarks/paper_claims.py scores both on a trace the allocation did not see."""
    check_objective(objective)
    bounds = _check_inputs(profiles, requests_per_slo, num_devices)
    runtimes = profiles.runtimes
    last = len(runtimes) - 1
    reserve_after = [sum(bounds[i + 1:]) for i in range(len(bounds))]
    fronts: list[_Front] = []
    inverse_n = 1.0 / np.maximum(np.arange(num_devices + 1), 1)
    front = _Front(np.zeros(1, dtype=np.int64), np.zeros(1), np.zeros(1), np.full(1, -1), np.zeros(1, dtype=np.int64))
    for i in range(last):
        runtime, q, m = runtimes[i], float(requests_per_slo[i]), runtimes[i].capacity_requests
        saturated_cost_per_instance = m * runtime.allocation_latency_s(m, objective) if m > 0 else 0.0
        n_max_total = num_devices - reserve_after[i]
        # Absorbing states (R = 0): for each device count the cheapest, found by a sliding minimum per state.
        absorb_cost = np.full(num_devices + 1, math.inf)
        absorb_parent = np.full(num_devices + 1, -1)
        absorb_choice = np.zeros(num_devices + 1, dtype=np.int64)
        sat_devices, sat_overflow, sat_cost, sat_parent, sat_choice = [], [], [], [], []
        latency = _LatencyCurve(runtime, objective)
        own_demand_cost = q * latency(q * inverse_n) if q > 0 else np.zeros(num_devices + 1)  # Q_i L_i(Q_i / n)
        for s in range(len(front.devices)):
            g, demand, c = int(front.devices[s]), float(front.overflow[s]) + q, float(front.cost[s])
            n_hi = n_max_total - g
            if n_hi < bounds[i]:
                continue
            if demand <= 0:
                n_absorb = bounds[i]
            elif m <= 0:
                n_absorb = n_hi + 1
            else:
                n_absorb = max(bounds[i], math.ceil(demand / m - 1e-12))
            if n_absorb <= n_hi:
                lo, hi = g + n_absorb, g + n_hi + 1
                if demand > 0 and front.overflow[s] == 0.0:  # every R = 0 state shares D = Q_i: one curve per level
                    values = c + own_demand_cost[n_absorb:n_hi + 1]
                elif demand > 0:
                    values = c + demand * latency(demand * inverse_n[max(n_absorb, 1):n_hi + 1])
                    if n_absorb == 0:  # zero instances cannot absorb a positive demand
                        values = np.r_[math.inf, values]
                else:
                    values = np.full(n_hi + 1 - n_absorb, c)
                window = absorb_cost[lo:hi]
                better = np.flatnonzero(values < window - _COST_EPSILON)
                if better.size:
                    window[better] = values[better]
                    absorb_parent[lo:hi][better] = s
                    absorb_choice[lo:hi][better] = n_absorb + better
            if bounds[i] < min(n_absorb, n_hi + 1):  # saturated: serve n*M at L_i(M), pass the rest on
                ns = np.arange(bounds[i], min(n_absorb, n_hi + 1))
                sat_devices.append(g + ns)
                sat_overflow.append(demand - ns * m)
                sat_cost.append(c + ns * saturated_cost_per_instance)
                sat_parent.append(np.full(len(ns), s))
                sat_choice.append(ns)
        absorbed = np.nonzero(np.isfinite(absorb_cost))[0]
        devices = np.concatenate([absorbed] + sat_devices).astype(np.int64)
        overflow = np.concatenate([np.zeros(len(absorbed))] + sat_overflow).astype(float)
        cost = np.concatenate([absorb_cost[absorbed]] + sat_cost).astype(float)
        parent = np.concatenate([absorb_parent[absorbed]] + sat_parent).astype(np.int64)
        choice = np.concatenate([absorb_choice[absorbed]] + sat_choice).astype(np.int64)
        keep = _pareto(devices, overflow, cost)
        fronts.append(front)
        front = _Front(devices[keep], overflow[keep], cost[keep], parent[keep], choice[keep])
        logger.debug("runtime %d: %d states", i, len(keep))
    # Last runtime (Eq. 5, 7): it takes every device left and everything that reaches it.
    runtime, q = runtimes[last], float(requests_per_slo[last])
    n_last = num_devices - front.devices
    demand = front.overflow + q
    valid = n_last >= bounds[last]
    total = np.where(valid,
                     front.cost + demand * runtime.allocation_latency_s(demand / np.maximum(n_last, 1), objective),
                     math.inf)
    best = int(np.argmin(total))
    instances = [int(n_last[best])]
    fronts.append(front)
    state = best
    for level in range(last, 0, -1):
        instances.append(int(fronts[level].choice[state]))
        state = int(fronts[level].parent[state])
    instances.reverse()
    return evaluate_allocation(profiles, requests_per_slo, instances, objective)


class PeriodicAllocatorParams(BaseModel):
    """Parameters of the periodic Runtime Scheduler (policy role 'polymorphing', params key 'allocation')."""

    model_config = ConfigDict(extra="forbid")

    period_s: float = Field(default=ARLO_ALLOCATION_PERIOD_S, gt=0,
                            description="Seconds between re-allocations (Arlo: 120 s).")


@dataclass
class PeriodicRuntimeAllocator:
    """Arlo's Runtime Scheduler (§3.3): re-solve Eq. 1-7 every period from the lengths seen in it."""

    profiles: RuntimeProfileSet
    period_s: float = ARLO_ALLOCATION_PERIOD_S
    _lengths: list[int] = field(default_factory=list)
    _window_start_s: float | None = None

    def observe(self, now_s: float, length_tokens: int) -> None:
        """Record one arriving request's length."""
        if self._window_start_s is None:
            self._window_start_s = now_s
        self._lengths.append(length_tokens)

    def maybe_reallocate(self, now_s: float, num_devices: int) -> RuntimeAllocation | None:
        """A new allocation when a period has passed since the window opened, else None."""
        if self._window_start_s is None:
            self._window_start_s = now_s
            return None
        elapsed = now_s - self._window_start_s
        if elapsed < self.period_s:
            return None
        q = self.profiles.requests_per_bin(self._lengths, elapsed)
        self._lengths = []
        self._window_start_s = now_s
        try:
            return solve_allocation(self.profiles, q, num_devices)
        except ValueError as error:
            # Overloaded beyond Eq. 3: keep the floors as far as devices go, rest to the longest (autoscaling's job).
            logger.warning("allocation infeasible (%s); falling back to capacity-proportional floors", error)
            return proportional_allocation(self.profiles, q, num_devices)


def proportional_allocation(profiles: RuntimeProfileSet, requests_per_slo: Sequence[float],
                            num_devices: int) -> RuntimeAllocation:
    """Instances in proportion to each bin's instance demand Q_i/M_i (largest remainder), the longest >= 1.

    Used when Eq. 3 cannot hold (too few devices) and as the INFaaS-like baseline's allocation.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    demand = np.array([q / max(r.capacity_requests, 1) for q, r in zip(requests_per_slo, profiles.runtimes)])
    instances = np.zeros(len(demand), dtype=np.int64)
    instances[-1] = 1
    remaining = num_devices - 1
    if demand.sum() > 0 and remaining > 0:
        share = demand / demand.sum() * remaining
        instances += np.floor(share).astype(np.int64)
        leftover = num_devices - int(instances.sum())
        for index in np.argsort(-(share - np.floor(share)))[:leftover]:
            instances[index] += 1
    else:
        instances[-1] += remaining
    return evaluate_allocation(profiles, requests_per_slo, [int(n) for n in instances])
