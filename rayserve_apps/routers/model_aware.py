"""A Ray Serve `RequestRouter` that sends a model's request only to replicas hosting it, by shortest queue.

Each group replica reports, through `record_routing_stats`, the models it hosts and its queue length. For a
request whose first argument is a model name, the router builds one `placement.alpaserve.dispatch.GroupView` per
candidate replica and asks the same dispatch policy the simulator uses (AlpaServe §4.3, shortest queue) which replica to
rank first; the others follow by queue length, so Serve can fall back when the first is full. Replicas that
have not reported yet are kept as a last rank.
"""

from __future__ import annotations

from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, RunningReplica

from placement.alpaserve.dispatch import GroupView, ShortestQueueDispatch
from rayserve_apps.contracts import STATS_MODELS, STATS_QUEUE_LENGTH
from rayserve_apps.routers.ranking import RankingRouter


def requested_model(pending_request: Optional[PendingRequest]) -> str | None:
    """The model a request is for: its first positional argument, or its `model` keyword."""
    if pending_request is None:
        return None
    if pending_request.args and isinstance(pending_request.args[0], str):
        return pending_request.args[0]
    model = pending_request.kwargs.get("model")
    return model if isinstance(model, str) else None


class ModelAwareRouter(RankingRouter):
    """Shortest queue among the replicas that host the requested model."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = ShortestQueueDispatch(slo_admission=False)

    def _queue_length(self, replica: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        reported = replica.routing_stats.get(STATS_QUEUE_LENGTH, 0)
        return int(max(cached or 0, reported))

    def rank(self, candidate_replicas: List[RunningReplica],
             pending_request: Optional[PendingRequest]) -> List[List[RunningReplica]]:
        model = requested_model(pending_request)
        reported = [r for r in candidate_replicas if STATS_MODELS in r.routing_stats]
        silent = [r for r in candidate_replicas if STATS_MODELS not in r.routing_stats]
        hosts = [r for r in reported if model is None or model in r.routing_stats[STATS_MODELS]]
        views = [GroupView(group_id=i, models=frozenset(r.routing_stats[STATS_MODELS]),
                           queue_length=self._queue_length(r),
                           free_at_s=0.0, finish_if_dispatched_s=0.0) for i, r in enumerate(hosts)]
        ranks: List[List[RunningReplica]] = []
        if model is not None and views:
            first = self.policy.choose(model, 0.0, float("inf"), views)
            if first is not None:
                ranks.append([hosts[first]])
                rest = sorted((r for i, r in enumerate(hosts) if i != first), key=self._queue_length)
                ranks.extend([r] for r in rest)
        elif views:
            ranks.extend([r] for r in sorted(hosts, key=self._queue_length))
        if silent:
            ranks.append(silent)
        return ranks
