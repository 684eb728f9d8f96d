"""The OTAS replica scheduler: batch forming, eviction, token allocation and utility accounting on any clock.

The flow of otas-v2 §III-A (Fig. 5) for one replica that executes batches one at a time:

1. `submit`: a query joins a batch of the queue by Alg. 1 (`placement/otas/adaptive_batching.py`); its arrival feeds the
   rate estimate q.
2. `next_batch(now)`: queries that can no longer meet their deadline even at the fastest setting are evicted;
   the allocator (Alg. 2/3, `placement/otas/token_allocation.py`, or a baseline) assigns gamma to the
   deadline-sorted queue; the first batch with a gamma is taken out and returned as a `Dispatch`.
3. `complete(dispatch, finish_s, correct)`: every query is accounted by outcome: served correct in time (earns
   u_r), served wrong, late, or evicted (earn nothing) -- the alpha_r of problem (1).

The simulator (`placement/otas/simulation.py`) and a live replica call the same object with their own clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

from placement.otas.adaptive_batching import AdaptiveBatcher, AdaptiveBatchingParams, OtasBatch, OtasRequest
from placement.otas.token_allocation import ArrivalRateEstimator, TokenAllocator

Outcome = Literal["correct", "wrong", "in_time", "late", "evicted"]
#: "in_time": served before its deadline with correctness unknown (live traffic has no labels).
OUTCOMES: tuple[Outcome, ...] = ("correct", "wrong", "in_time", "late", "evicted")


@dataclass
class UtilityLedger:
    """Utility and counts by outcome (OTAS §V: utility is earned only by accurate results within the deadline)."""

    utility: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: {o: 0 for o in OUTCOMES})
    gamma_counts: dict[int, int] = field(default_factory=dict)  # batches run per gamma
    batch_sizes: list[int] = field(default_factory=list)

    def record(self, request: OtasRequest, outcome: Outcome, earned: float = 0.0) -> None:
        self.counts[outcome] += 1
        self.utility += earned

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def ratios(self) -> dict[str, float]:
        total = max(1, self.total)
        return {o: self.counts[o] / total for o in OUTCOMES}


@dataclass
class Dispatch:
    """A batch to execute now at `gamma`, after `setup_s` (model switching baselines only)."""

    batch: OtasBatch
    gamma: int
    start_s: float
    setup_s: float
    method: str


class OtasScheduler:
    """One replica's OTAS policy: Alg. 1 batching + eviction + an allocator (Alg. 2/3 or a baseline) + accounting."""

    def __init__(self, allocator: TokenAllocator, batching: AdaptiveBatchingParams | None = None, start_s: float = 0.0,
                 rate_window_s: float = 1.0):
        self.allocator = allocator
        self.batcher = AdaptiveBatcher(batching)
        self.start_s = start_s
        self.rate = ArrivalRateEstimator(rate_window_s)
        self.queue: list[OtasBatch] = []  # creation order (Alg. 1 searches it newest first)
        self.ledger = UtilityLedger()

    @property
    def num_waiting(self) -> int:
        return sum(len(b) for b in self.queue)

    def submit(self, request: OtasRequest) -> None:
        """Alg. 1: add the query to a batch of the queue."""
        self.rate.record(request.arrival_s)
        self.batcher.add(self.queue, request)

    def evict_hopeless(self, now_s: float) -> list[OtasRequest]:
        """Remove queries that would miss their deadline even alone at the allocator's fastest setting."""
        fastest = self.allocator.min_latency_s(1)
        evicted: list[OtasRequest] = []
        kept_batches = []
        for batch in self.queue:
            keep = [r for r in batch.requests if now_s + fastest < r.deadline_s]
            evicted.extend(r for r in batch.requests if now_s + fastest >= r.deadline_s)
            if keep:
                batch.requests = keep
                kept_batches.append(batch)
        self.queue = kept_batches
        for request in evicted:
            self.ledger.record(request, "evicted")
        return evicted

    def next_batch(self, now_s: float) -> tuple[Dispatch | None, list[OtasRequest]]:
        """(the batch to run now or None, the queries evicted now)."""
        evicted = self.evict_hopeless(now_s)
        if not self.queue:
            return None, evicted
        plan = self.allocator.allocate(self.queue, now_s, self.rate.rate_rps(now_s), now_s - self.start_s)
        for batch, gamma in zip(plan.batches, plan.gammas):
            if gamma is not None:
                self.queue.remove(batch)
                batch.gamma = gamma
                self.ledger.gamma_counts[gamma] = self.ledger.gamma_counts.get(gamma, 0) + 1
                self.ledger.batch_sizes.append(len(batch))
                return Dispatch(batch, gamma, now_s, plan.setup_s, plan.method), evicted
        return None, evicted

    def complete(self, dispatch: Dispatch, finish_s: float, correct: Sequence[bool] | None = None,
                 expected_accuracy: Sequence[float] | None = None) -> None:
        """Account every query of a finished batch; `correct` when labels are known, else expected utility."""
        for i, request in enumerate(dispatch.batch.requests):
            if finish_s > request.deadline_s:
                self.ledger.record(request, "late")
            elif correct is not None:
                self.ledger.record(request, "correct" if correct[i] else "wrong",
                                   request.utility if correct[i] else 0.0)
            else:
                accuracy = expected_accuracy[i] if expected_accuracy is not None else 1.0
                self.ledger.record(request, "in_time", request.utility * accuracy)

    def drain(self) -> list[OtasRequest]:
        """Evict everything still queued (end of a trace, or shutdown)."""
        left = [r for batch in self.queue for r in batch.requests]
        self.queue = []
        for request in left:
            self.ledger.record(request, "evicted")
        return left
