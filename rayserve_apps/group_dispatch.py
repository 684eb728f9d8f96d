"""Ingress-side dispatch across device groups: which group deployment serves a request (AlpaServe §4.3).

The ingress is the one sender of requests to the groups, so it knows each group's queue (requests it sent and
that have not come back). Per (group, model) it keeps a running estimate of the service time, measured from
answered requests. For each request it builds the same `placement.dispatch.GroupView`s the simulator builds and
asks the same policy object; `None` means no group hosting the model can finish the request within its SLO, and
the ingress answers 503 at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from placement.dispatch import DispatchPolicy, GroupView
from placement.placement_plan import Placement

#: Weight of a new latency measurement in the running estimate (exponential moving average).
LATENCY_EWMA_WEIGHT = 0.3


@dataclass
class GroupState:
    models: frozenset[str]
    in_flight: int = 0
    #: model -> estimated seconds one request takes in this group (None until measured).
    service_s: dict[str, float] = field(default_factory=dict)


class GroupDispatcher:
    """Tracks in-flight requests per group and asks a dispatch policy where each request goes."""

    def __init__(self, placement: Placement, policy: DispatchPolicy):
        self.policy = policy
        self.groups = [GroupState(models=frozenset(group.models)) for group in placement.groups]

    def set_placement(self, placement: Placement) -> None:
        """Adopt new hosted-model sets, keeping queues and estimates of groups that stay."""
        for index, group in enumerate(placement.groups):
            if index < len(self.groups):
                self.groups[index].models = frozenset(group.models)
            else:
                self.groups.append(GroupState(models=frozenset(group.models)))
        del self.groups[len(placement.groups):]

    def _view(self, index: int, model: str, now_s: float) -> GroupView:
        state = self.groups[index]
        service = state.service_s.get(model, 0.0)
        # Requests ahead of this one finish first (FCFS); the estimate is optimistic until measured.
        return GroupView(group_id=index, models=state.models, queue_length=state.in_flight,
                         free_at_s=now_s + state.in_flight * service,
                         finish_if_dispatched_s=now_s + (state.in_flight + 1) * service)

    def choose(self, model: str, now_s: float, deadline_s: float) -> int | None:
        views = [self._view(i, model, now_s) for i in range(len(self.groups))]
        return self.policy.choose(model, now_s, deadline_s, views)

    def hosts(self, model: str) -> list[int]:
        return [i for i, g in enumerate(self.groups) if model in g.models]

    def started(self, group: int) -> int:
        """Count a request sent to `group`; returns how many were in flight there before it."""
        ahead = self.groups[group].in_flight
        self.groups[group].in_flight += 1
        return ahead

    def finished(self, group: int, model: str, latency_s: float | None, ahead: int = 0) -> None:
        """Count a request answered; `latency_s` (None when it failed) updates the service-time estimate."""
        state = self.groups[group]
        state.in_flight -= 1
        if latency_s is not None:
            # The request waited behind `ahead` others (FCFS), so its own share is about latency / (ahead + 1).
            sample = latency_s / (ahead + 1)
            previous = state.service_s.get(model)
            state.service_s[model] = sample if previous is None else (1 - LATENCY_EWMA_WEIGHT) * previous + LATENCY_EWMA_WEIGHT * sample
