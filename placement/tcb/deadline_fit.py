"""A formed batch cut to what can finish by its deadlines (AlpaServe §6.5's batching rule on TCB's batches).

TCB §5.2 excludes a waiting request from a batch once its deadline has passed, so a request scheduled just before
its deadline still runs and finishes after it: late, on device time the others needed. AlpaServe §6.5 batches only
what finishes in time: the largest batch whose finish meets every deadline in it, and a request that cannot finish
even alone is dropped (our simulator's `placement.alpaserve.batching.MaxBatchWithinSLO`). `fit_to_deadlines`
applies that rule to a TCB scheduler's decision, given the predicted seconds of a batch of so many tokens.

Units. The texts that arrived together (one call from the ingress: equal `arrival_s`) are kept in the batch or put
back in the queue together, since the call is answered when all of its texts are: a call split over two batches
would hold the first batch's answers back. Within a call, a client request is the texts with one deadline; the
request is dropped as a whole (its texts still queued too) when the call's texts cannot finish by its deadline.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from placement.tcb.batch_scheduler import BatchDecision, TextRequest

#: batch_seconds(tokens) -> predicted seconds from a batch's start to its answers.
BatchSeconds = Callable[[int], float]


def _tokens(requests: Sequence[TextRequest]) -> int:
    return sum(r.length_tokens for r in requests)


def fit_to_deadlines(decision: BatchDecision, queue: Sequence[TextRequest], now_s: float,
                     batch_seconds: BatchSeconds) -> BatchDecision:
    """The decision cut to the longest prefix of its calls, earliest deadline first, whose predicted finish meets
    every deadline in it (AlpaServe §6.5); requests that cannot finish even with their call alone are dropped,
    with their texts still in `queue`. What is cut stays queued (`BatchDecision.remaining`)."""
    calls: dict[float, list[TextRequest]] = {}
    for request in decision.requests:
        calls.setdefault(request.arrival_s, []).append(request)
    late_requests: set[tuple[float, float]] = set()  # (arrival_s, deadline_s) of the dropped client requests
    fitting: list[list[TextRequest]] = []
    for call in calls.values():
        while call:  # the call alone, without the requests it cannot finish in time
            finish_s = now_s + batch_seconds(_tokens(call))
            late = {(r.arrival_s, r.deadline_s) for r in call if r.deadline_s < finish_s}
            if not late:
                fitting.append(call)
                break
            late_requests |= late
            call = [r for r in call if (r.arrival_s, r.deadline_s) not in late]
    by_deadline = sorted(((min(r.deadline_s for r in call), call) for call in fitting), key=lambda pair: pair[0])
    kept: set[int] = set()
    tokens, earliest_s = 0, math.inf
    for call_deadline_s, call in by_deadline:  # AlpaServe §6.5: the longest prefix whose finish meets every deadline
        with_call = tokens + _tokens(call)
        earliest_with_call = min(earliest_s, call_deadline_s)
        if kept and now_s + batch_seconds(with_call) > earliest_with_call:
            break
        kept.update(id(r) for r in call)
        tokens, earliest_s = with_call, earliest_with_call
    dropped = list(decision.dropped)
    already = {id(r) for r in dropped}
    dropped += [r for r in queue if (r.arrival_s, r.deadline_s) in late_requests and id(r) not in already]
    slots = None if decision.slots is None else [s for s in ([r for r in slot if id(r) in kept]
                                                              for slot in decision.slots) if s]
    return BatchDecision(rows=[[r for r in row if id(r) in kept] for row in decision.rows], dropped=dropped,
                         slot_size_tokens=decision.slot_size_tokens, slots=slots)
