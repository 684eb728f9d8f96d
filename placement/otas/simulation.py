"""A discrete-event simulation of one OTAS replica on the simulator's clock, driven by a measured profile.

Queries arrive from a trace; the replica executes one batch at a time (OTAS §III-A: "the execution engine is
responsible for sequentially executing the batches"); whenever it is free it asks the `OtasScheduler` for the next
batch. A batch takes the profiled latency of its (gamma, size) plus any setup delay (model switching baselines).
Whether a served query is correct is decided by the query's own uniform draw against the profiled accuracy of its
task at the batch's gamma, so every policy sees the same queries with the same luck (paired comparison).

Also here: the two trace shapes of the OTAS evaluation (§V "Workloads"): a fluctuating Poisson trace (the rate
changes every second) and a bursty trace (mostly low load with short bursts, like the MAF trace of Fig. 8b).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from placement.core.arrivals import poisson_arrivals
from placement.otas.adaptive_batching import OtasRequest
from placement.otas.profile import OtasProfile
from placement.otas.replica_scheduler import OtasScheduler, UtilityLedger
from placement.sim.outcomes import LATE, REJECTED, SERVED, RequestOutcomes


@dataclass(frozen=True)
class QueryType:
    """One row of OTAS Table II: task, latency requirement, utility."""

    task_id: str
    slo_s: float
    utility: float


@dataclass(frozen=True)
class TraceQuery:
    arrival_s: float
    query_type: QueryType
    draw: float  # uniform in [0, 1): correct iff draw < accuracy(task, gamma)


def fluctuating_poisson_trace(rates_rps: list[float], query_types: list[QueryType], seed: int) -> list[TraceQuery]:
    """Poisson arrivals whose rate is `rates_rps[i]` during second i (OTAS §V synthetic workload)."""
    rng = random.Random(seed)
    trace = []
    for second, rate in enumerate(rates_rps):
        for t in poisson_arrivals(rate, float(second), second + 1.0, rng):
            trace.append(TraceQuery(t, rng.choice(query_types), rng.random()))
    return trace


def fluctuating_rates(duration_s: int, low_rps: float, high_rps: float, seed: int) -> list[float]:
    """A rate per second drawn uniformly in [low, high] (OTAS Fig. 8a: 200-700 req/s every second)."""
    rng = random.Random(seed)
    return [rng.uniform(low_rps, high_rps) for _ in range(duration_s)]


def bursty_rates(duration_s: int, base_rps: float, burst_rps: float, burst_probability: float,
                 seed: int) -> list[float]:
    """Mostly `base_rps` with jitter, and bursts of `burst_rps` in a `burst_probability` share of the seconds."""
    rng = random.Random(seed)
    rates = []
    for _ in range(duration_s):
        if rng.random() < burst_probability:
            rates.append(burst_rps * rng.uniform(0.8, 1.2))
        else:
            rates.append(base_rps * rng.uniform(0.5, 1.5))
    return rates


@dataclass
class SimulationResult:
    ledger: UtilityLedger
    num_queries: int
    max_utility: float  # every query served correctly in time
    switches: int = 0
    details: dict = field(default_factory=dict)
    outcomes: RequestOutcomes | None = None  # per query, in trace order (placement.sim): evicted ones are rejected

    @property
    def success_ratio(self) -> float:
        return self.ledger.counts["correct"] / max(1, self.num_queries)


#: Whether a served query is correct, given the query, its task and the batch's gamma.
Grader = Callable[[TraceQuery, str, int], bool]


def simulate(trace: list[TraceQuery], scheduler: OtasScheduler, profile: OtasProfile,
             grade: Grader | None = None) -> SimulationResult:
    """Run the trace through one replica; every query ends as correct, wrong, late or evicted.

    `grade` decides correctness; None: the query's draw against the profiled accuracy (the profile is then its
    own ground truth). benchmarks/paper_claims.py grades by the ViT's prediction on a held-out image instead."""
    now, index, busy_until = 0.0, 0, -math.inf
    position = {id(query): k for k, query in enumerate(trace)}
    finish_s = np.full(len(trace), np.nan)
    status = np.full(len(trace), REJECTED, dtype=np.int8)  # until it runs: evicted while queued, or at the end
    earned = np.zeros(len(trace))
    while True:
        while index < len(trace) and trace[index].arrival_s <= now:
            query = trace[index]
            scheduler.submit(OtasRequest(query.query_type.task_id, query.arrival_s,
                                         query.arrival_s + query.query_type.slo_s,
                                         query.query_type.utility, payload=query))
            index += 1
        if busy_until <= now:
            dispatch, _ = scheduler.next_batch(now)
            if dispatch is not None:
                batch = dispatch.batch
                finish = now + dispatch.setup_s + profile.batch_latency_s(dispatch.gamma, len(batch))
                if grade is None:
                    correct = [r.payload.draw < profile.task_accuracy(r.task_id, dispatch.gamma)
                               for r in batch.requests]
                else:
                    correct = [bool(grade(r.payload, r.task_id, dispatch.gamma)) for r in batch.requests]
                scheduler.complete(dispatch, finish, correct)
                busy_until = finish
                for request, right in zip(batch.requests, correct):
                    k = position[id(request.payload)]
                    finish_s[k] = finish
                    status[k] = SERVED if finish <= request.deadline_s else LATE
                    earned[k] = request.utility if right and finish <= request.deadline_s else 0.0
        upcoming = []
        if index < len(trace):
            upcoming.append(trace[index].arrival_s)
        if busy_until > now:
            upcoming.append(busy_until)
        elif scheduler.queue and index >= len(trace):
            # Idle, nothing arrives and nothing is runnable now: re-check once the first deadline can be evicted.
            upcoming.append(min(b.deadline_s for b in scheduler.queue))
        if not upcoming:
            break
        now = max(now, min(upcoming))
    scheduler.drain()
    max_utility = sum(q.query_type.utility for q in trace)
    switches = getattr(scheduler.allocator, "switches", 0)
    arrival = np.array([q.arrival_s for q in trace])
    deadline = np.array([q.arrival_s + q.query_type.slo_s for q in trace])
    outcomes = RequestOutcomes(arrival, deadline, finish_s, status, earned)
    return SimulationResult(scheduler.ledger, len(trace), max_utility, switches, outcomes=outcomes)


@dataclass
class OtasEngine:
    """:func:`simulate` as a `placement.sim.SimulationEngine`."""

    trace: list[TraceQuery]
    scheduler: OtasScheduler
    profile: OtasProfile

    def run(self) -> SimulationResult:
        return simulate(self.trace, self.scheduler, self.profile)
