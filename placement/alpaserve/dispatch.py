"""Dispatch: which device group serves a request (AlpaServe §4.3), as policy objects the live router reuses.

A policy sees the request's model, the time, its deadline and a pure-data view of each group, and returns a
group id, or None to reject. The default is AlpaServe's: the shortest queue among the groups hosting the model,
with SLO admission (a request that cannot finish by its deadline is rejected at once).

The simulator runs the built-in policies in a compiled kernel (selected by `kernel_code`); any other object with
the same `choose` method runs in the simulator's reference loop, and both give the same decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

#: Codes the compiled simulator kernel understands.
KERNEL_SHORTEST_QUEUE = 0
KERNEL_ROUND_ROBIN = 1
KERNEL_EARLIEST_FINISH = 2


@dataclass(frozen=True)
class GroupView:
    """What a dispatch policy may know of one group at the moment of a decision."""

    group_id: int
    models: frozenset[str]  # the models the group hosts
    queue_length: int  # requests dispatched to the group and not finished yet
    free_at_s: float  # when the group's first pipeline stage can take a new request
    finish_if_dispatched_s: float  # predicted finish of this request if sent here now (batch of 1)


class DispatchPolicy(Protocol):
    name: str

    def choose(self, model: str, now_s: float, deadline_s: float, groups: Sequence[GroupView]) -> int | None: ...


def _hosts(model: str, groups: Sequence[GroupView]) -> list[GroupView]:
    return sorted((g for g in groups if model in g.models), key=lambda g: g.group_id)


def _admit(view: GroupView, deadline_s: float, slo_admission: bool) -> int | None:
    if slo_admission and view.finish_if_dispatched_s > deadline_s:
        return None
    return view.group_id


@dataclass
class ShortestQueueDispatch:
    """AlpaServe §4.3: the group with the fewest unfinished requests among those hosting the model (ties: lowest
    group id); with `slo_admission`, reject the request if that group cannot finish it by its deadline."""

    slo_admission: bool = True
    name: str = "shortest_queue"
    kernel_code: int = KERNEL_SHORTEST_QUEUE

    def choose(self, model: str, now_s: float, deadline_s: float, groups: Sequence[GroupView]) -> int | None:
        hosts = _hosts(model, groups)
        if not hosts:
            return None
        best = min(hosts, key=lambda g: (g.queue_length, g.group_id))
        return _admit(best, deadline_s, self.slo_admission)


@dataclass
class EarliestFinishDispatch:
    """The hosting group predicted to finish the request first (ties: lowest group id), with SLO admission."""

    slo_admission: bool = True
    name: str = "earliest_finish"
    kernel_code: int = KERNEL_EARLIEST_FINISH

    def choose(self, model: str, now_s: float, deadline_s: float, groups: Sequence[GroupView]) -> int | None:
        hosts = _hosts(model, groups)
        if not hosts:
            return None
        best = min(hosts, key=lambda g: (g.finish_if_dispatched_s, g.group_id))
        return _admit(best, deadline_s, self.slo_admission)


@dataclass
class RoundRobinDispatch:
    """Each model's requests cycle over the groups hosting it (ordered by group id), with SLO admission."""

    slo_admission: bool = True
    name: str = "round_robin"
    kernel_code: int = KERNEL_ROUND_ROBIN
    _next: dict[str, int] = field(default_factory=dict, repr=False)

    def choose(self, model: str, now_s: float, deadline_s: float, groups: Sequence[GroupView]) -> int | None:
        hosts = _hosts(model, groups)
        if not hosts:
            return None
        turn = self._next.get(model, 0)
        self._next[model] = turn + 1
        return _admit(hosts[turn % len(hosts)], deadline_s, self.slo_admission)


DISPATCH_POLICIES = {
    "shortest_queue": ShortestQueueDispatch,
    "earliest_finish": EarliestFinishDispatch,
    "round_robin": RoundRobinDispatch,
}


def make_dispatch(name: str, **params) -> DispatchPolicy:
    """A dispatch policy by its registered name (the spec's `policies.dispatch`)."""
    if name not in DISPATCH_POLICIES:
        raise ValueError(f"policies.dispatch.name={name!r}: choose one of {sorted(DISPATCH_POLICIES)}")
    allowed = {"slo_admission"}
    unknown = set(params) - allowed
    if unknown:
        raise ValueError(f"policies.dispatch.params: unknown field(s) {sorted(unknown)}; allowed {sorted(allowed)}")
    if "slo_admission" in params and not isinstance(params["slo_admission"], bool):
        raise ValueError("policies.dispatch.params.slo_admission must be true or false")
    return DISPATCH_POLICIES[name](**params)


def dispatch_from_spec(spec, model: str | None = None) -> DispatchPolicy:
    """The dispatch policy a DeploymentSpec names (`policies.dispatch`, per model or spec-wide); default
    shortest queue with SLO admission."""
    chosen = spec.policy("dispatch", model)
    if chosen is None:
        return ShortestQueueDispatch()
    return make_dispatch(chosen.name, **chosen.params)
