"""Replay a request trace through a batch scheduler on a simulated clock (TCB §5.1's time slots).

One engine runs one batch at a time: when it is idle and requests wait, the scheduler forms a batch
(placement/tcb/batch_scheduler.py) and the batch occupies the engine for `batch_latency_s(decision)` seconds, a
latency model measured on the real engine (benchmarks/concat_batching.py) or given. A request earns its utility
1/l_n (TCB Eq. 9) when its batch finishes by its deadline; requests dropped by the scheduler, or finishing late,
earn nothing and are counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from placement.sim.outcomes import LATE, REJECTED, SERVED, UNSERVED, RequestOutcomes
from placement.tcb.batch_scheduler import BatchDecision, BatchScheduler, TextRequest


@dataclass
class ReplayResult:
    """Totals of one replay."""

    utility: float = 0.0  #: TCB Eq. 9 over requests finished by their deadline
    completed: int = 0  #: finished by their deadline
    late: int = 0  #: scheduled, but finished after their deadline
    dropped: int = 0  #: dropped by the scheduler (deadline passed while waiting)
    unserved: int = 0  #: still waiting when the trace ended
    num_batches: int = 0
    busy_s: float = 0.0  #: engine time spent in batches
    end_s: float = 0.0  #: clock when the last batch finished
    outcomes: RequestOutcomes | None = None  #: per request, in the order given (placement.sim)

    def utility_per_s(self, duration_s: float) -> float:
        return self.utility / duration_s if duration_s > 0 else 0.0


def replay(requests: Sequence[TextRequest], scheduler: BatchScheduler,
           batch_latency_s: Callable[[BatchDecision], float]) -> ReplayResult:
    """Run the trace to the end: every request is completed, late, dropped or (if never schedulable) unserved."""
    arrivals = sorted(requests, key=lambda r: r.arrival_s)
    result = ReplayResult()
    position = {id(request): k for k, request in enumerate(requests)}
    finish_s = np.full(len(requests), np.nan)
    status = np.full(len(requests), UNSERVED, dtype=np.int8)
    earned = np.zeros(len(requests))
    queue: list[TextRequest] = []
    now = 0.0
    next_arrival = 0
    while next_arrival < len(arrivals) or queue:
        if not queue:
            now = max(now, arrivals[next_arrival].arrival_s)
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_s <= now:
            queue.append(arrivals[next_arrival])
            next_arrival += 1
        decision = scheduler.form_batch(now, queue)
        result.dropped += len(decision.dropped)
        for request in decision.dropped:
            status[position[id(request)]] = REJECTED
        queue = decision.remaining(queue)
        if decision.is_empty:
            if next_arrival >= len(arrivals):
                break
            now = max(now, arrivals[next_arrival].arrival_s)
            continue
        latency = batch_latency_s(decision)
        now += latency
        result.busy_s += latency
        result.num_batches += 1
        for request in decision.requests:
            k = position[id(request)]
            finish_s[k] = now
            if now <= request.deadline_s:
                result.completed += 1
                result.utility += request.utility
                status[k], earned[k] = SERVED, request.utility
            else:
                result.late += 1
                status[k] = LATE
    result.unserved = len(queue)
    result.end_s = now
    result.outcomes = RequestOutcomes(np.array([r.arrival_s for r in requests]),
                                      np.array([r.deadline_s for r in requests]), finish_s, status, earned)
    return result


@dataclass
class ReplayEngine:
    """:func:`replay` as a `placement.sim.SimulationEngine`."""

    requests: Sequence[TextRequest]
    scheduler: BatchScheduler
    batch_latency_s: Callable[[BatchDecision], float]

    def run(self) -> ReplayResult:
        return replay(self.requests, self.scheduler, self.batch_latency_s)
