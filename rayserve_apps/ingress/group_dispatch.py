"""Ingress-side dispatch across device groups: which group deployment serves a request (AlpaServe §4.3).

The ingress is the one sender of requests to the groups, so it knows each group's queue (requests it sent and
that have not come back). Per (group, model) it estimates the service time as the median of the latest answered
requests' measurements (robust to one stalled request; none before `MIN_LATENCY_SAMPLES` answers, since the
first answer after a start or a rebuild includes the model's warm-up), and an idle group with a stale estimate
gets one request as a probe. A queue depth at which requests met their deadlines in the last
`PROVEN_DEPTH_WINDOW_S` is admitted without the estimate (`GroupState.proven`). For each request it builds
`placement.alpaserve.dispatch.GroupView`s and asks the policy object the simulator asks; `None` means no group
hosting the model can finish the request within its SLO, and the ingress answers 503 at once.

The views differ in one respect: here a request's predicted finish counts every request in flight ahead of it, while
the batching simulator's counts only the batch running (its batch former drops later what can no longer finish).
Each side keeps its own rule, since neither does better with the other's: the groups' engines cannot drop at a
batch's start as exactly as the simulator's batch former does, and the simulator's service-time factor absorbs the
difference.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from placement.alpaserve.dispatch import DispatchPolicy, GroupView
from rayserve_apps import metrics
from rayserve_apps.requests import RequestError

#: Latest measurements per (group, model) whose median is the service-time estimate: one stall (a replica being
#: replaced, a model loading beside it) must not refuse a model's requests for long.
LATENCY_SAMPLES = 15
#: Answers measured before the estimate may refuse anything: the median of fewer is one request's time, and the first
#: request after a replica starts or a model is rebuilt pays for warm-up (a cold first answer alone would refuse a
#: burst).
MIN_LATENCY_SAMPLES = 3
#: Seconds without a measurement after which an idle group's estimate is re-checked by admitting one request.
PROBE_AFTER_S = 2.0
#: Seconds for which a queue depth at which requests met their deadlines counts as proven (see `GroupState.proven`).
PROVEN_DEPTH_WINDOW_S = 2.0


@dataclass
class GroupState:
    models: frozenset[str]
    in_flight: int = 0
    #: model -> estimated seconds one request takes in this group (None until measured).
    service_s: dict[str, float] = field(default_factory=dict)
    #: model -> when (time.monotonic()) its estimate was last measured.
    measured_at_s: dict[str, float] = field(default_factory=dict)
    #: model -> the latest per-request service times measured.
    samples: dict[str, deque] = field(default_factory=dict)
    #: model -> (answered at, queue depth it was sent at) of requests answered within their deadline in the last
    #: `PROVEN_DEPTH_WINDOW_S`, depths decreasing (a sliding-window maximum). A request that would join the queue
    #: at no more than the deepest of them is admitted without the estimate: measured evidence that this depth
    #: meets the SLO beats a per-request estimate that lags when load rises and batches grow (a lagging estimate
    #: refuses closed-loop clients at capacity, and each refusal's own CPU cost keeps it refusing).
    proven: dict[str, deque] = field(default_factory=dict)

    def proven_depth(self, model: str, now_s: float) -> int:
        window = self.proven.get(model)
        while window and now_s - window[0][0] > PROVEN_DEPTH_WINDOW_S:
            window.popleft()
        return window[0][1] if window else 0

    def prove(self, model: str, depth: int, now_s: float) -> None:
        window = self.proven.setdefault(model, deque())
        while window and window[-1][1] <= depth:
            window.pop()
        window.append((now_s, depth))


class GroupDispatcher:
    """Tracks in-flight requests per group slot and asks a dispatch policy where each request goes."""

    def __init__(self, routes: list[list[str]], policy: DispatchPolicy):
        self.policy = policy
        self.groups = [GroupState(models=frozenset(models)) for models in routes]

    def set_routes(self, routes: list[list[str]]) -> None:
        """Adopt new per-slot model sets. A slot whose models change keeps its queue (requests in flight there
        still come back) but forgets the service times of models it no longer hosts."""
        if len(routes) != len(self.groups):
            raise ValueError(f"routes name {len(routes)} group slots; this application runs {len(self.groups)}")
        for state, models in zip(self.groups, routes):
            state.models = frozenset(models)
            state.service_s = {m: s for m, s in state.service_s.items() if m in state.models}
            state.measured_at_s = {m: t for m, t in state.measured_at_s.items() if m in state.models}
            state.samples = {m: d for m, d in state.samples.items() if m in state.models}
            state.proven = {m: d for m, d in state.proven.items() if m in state.models}

    def _view(self, index: int, model: str, now_s: float) -> GroupView:
        state = self.groups[index]
        service = state.service_s.get(model, 0.0)
        if state.in_flight == 0 and now_s - state.measured_at_s.get(model, now_s) > PROBE_AFTER_S:
            # An idle group whose estimate is stale gets one request as a probe: an estimate inflated by a slow
            # spell (a model loading beside it, a rebuild) would otherwise refuse that model for ever.
            service = 0.0
        if state.in_flight + 1 <= state.proven_depth(model, now_s):
            service = 0.0  # requests sent at this depth met their deadlines moments ago
        # Requests ahead of this one finish first (FCFS); the estimate is optimistic until measured.
        return GroupView(group_id=index, models=state.models, queue_length=state.in_flight,
                         free_at_s=now_s + state.in_flight * service,
                         finish_if_dispatched_s=now_s + (state.in_flight + 1) * service)

    def choose(self, model: str, now_s: float, deadline_s: float) -> int | None:
        views = [self._view(i, model, now_s) for i in range(len(self.groups))]
        return self.policy.choose(model, now_s, deadline_s, views)

    async def admit_and_send(self, model: str, deadline_s: float, send: Callable[[int], Awaitable[Any]]) -> Any:
        """Choose a slot for one request of `model` and `await send(slot)`, counting it in that slot's queue and
        measuring its service time; a request that no slot can finish by `deadline_s` (on `time.monotonic()`) is
        refused at once with 503, before any call leaves the ingress."""
        now = time.monotonic()
        slot = self.choose(model, now, deadline_s)
        if slot is None:
            raise self._refusal(model)
        ahead = self.started(slot)
        latency = None
        try:
            result = await send(slot)
            latency = time.monotonic() - now
            return result
        finally:
            self.finished(slot, model, latency, ahead, met=latency is not None and now + latency <= deadline_s)

    def _refusal(self, model: str) -> RequestError:
        hosts = self.hosts(model)
        if not hosts:  # between two steps of a re-placement that moves the model's only group
            metrics.rejections_total().inc(tags={"model": model, "reason": "not_hosted"})
            return RequestError(503, "not_hosted", f"model {model!r}: no group hosts the model right now "
                                "(a re-placement is moving it); retry")
        metrics.rejections_total().inc(tags={"model": model, "reason": "slo_unattainable"})
        return RequestError(503, "slo_unattainable", f"model {model!r}: no group hosting the model can finish it "
                            f"within its SLO ({len(hosts)} hosting groups busy)")

    def hosts(self, model: str) -> list[int]:
        return [i for i, g in enumerate(self.groups) if model in g.models]

    def started(self, group: int) -> int:
        """Count a request sent to `group`; returns how many were in flight there before it."""
        ahead = self.groups[group].in_flight
        self.groups[group].in_flight += 1
        return ahead

    def finished(self, group: int, model: str, latency_s: float | None, ahead: int = 0, met: bool = False) -> None:
        """Count a request answered; `latency_s` (None when it failed) updates the service-time estimate, and
        `met` (answered by its deadline) proves the depth it was sent at (`ahead` + 1)."""
        state = self.groups[group]
        state.in_flight -= 1
        if met:
            state.prove(model, ahead + 1, time.monotonic())
        if latency_s is not None:
            # The request waited behind `ahead` others (FCFS), so its own share is about latency / (ahead + 1).
            sample = latency_s / (ahead + 1)
            state.measured_at_s[model] = time.monotonic()
            samples = state.samples.setdefault(model, deque(maxlen=LATENCY_SAMPLES))
            samples.append(sample)
            if len(samples) >= MIN_LATENCY_SAMPLES:
                state.service_s[model] = statistics.median(samples)
