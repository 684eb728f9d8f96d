"""A Ray Serve `RequestRouter` that applies Arlo's multi-level queue (Alg. 1) to polymorphing runtime replicas.

Every replica of a `PolymorphRuntimeDeployment` reports its runtime's max length and capacity (replica metadata,
refreshed by routing stats after a runtime swap) and its outstanding requests (routing stats). The router keeps a
`placement.arlo.request_scheduler.ArloDispatch` over those replicas — the same object the simulator drives — and for
each request asks it which replica to use, from the request's token count (the longest token id list in its first
argument, or a `num_tokens` keyword). The router counts a replica's outstanding requests itself, up when Serve
sends a request (`on_send_request`) and down when it completes (`on_request_completed`), as Arlo counts at
dispatch; a replica's own report (`record_routing_stats`) raises the count when other routers also send to it.

The chosen replica is the first rank; the other replicas that can take the length follow by (max length,
congestion), so Serve can fall back when the first is at `max_ongoing_requests`.
"""

from __future__ import annotations

from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, RunningReplica

from placement.arlo.request_scheduler import ARLO_ALPHA, ARLO_LAMBDA, ARLO_MAX_LEVELS, ArloDispatch, ArloDispatchParams
from rayserve_apps.contracts import STATS_CAPACITY, STATS_MAX_LENGTH, STATS_OUTSTANDING
from rayserve_apps.routers.ranking import RankingRouter


def request_length_tokens(pending_request: Optional[PendingRequest]) -> int | None:
    """Token count of a request: `num_tokens` keyword, else the longest list in its first argument."""
    if pending_request is None:
        return None
    num_tokens = pending_request.kwargs.get("num_tokens")
    if isinstance(num_tokens, int):
        return num_tokens
    if pending_request.args:
        first = pending_request.args[0]
        if isinstance(first, list) and first and all(isinstance(ids, list) for ids in first):
            return max(len(ids) for ids in first)
    token_ids = pending_request.kwargs.get("token_ids")
    if isinstance(token_ids, list) and token_ids and all(isinstance(ids, list) for ids in token_ids):
        return max(len(ids) for ids in token_ids)
    return None


def replica_runtime(replica: RunningReplica) -> tuple[int, int] | None:
    """(max length, capacity) of a replica's current runtime; routing stats win over the start-up metadata."""
    for source in (replica.routing_stats, replica.replica_metadata):
        if STATS_MAX_LENGTH in source and STATS_CAPACITY in source:
            return int(source[STATS_MAX_LENGTH]), int(source[STATS_CAPACITY])
    return None


class PolymorphRouter(RankingRouter):
    """Arlo Alg. 1 over one deployment's runtime replicas."""

    def initialize_state(self, threshold: float = ARLO_LAMBDA, decay: float = ARLO_ALPHA,
                         max_levels: int = ARLO_MAX_LEVELS, **kwargs: Any) -> None:
        self.params = ArloDispatchParams(threshold=threshold, decay=decay, max_levels=max_levels)
        self._sent: dict[Any, int] = {}  # replica id -> requests this router sent and not yet completed
        self._layout: tuple = ()
        self._policy: ArloDispatch | None = None

    def _sync_policy(self, replicas: List[RunningReplica]) -> ArloDispatch | None:
        """Rebuild the multi-level queue when replicas or their runtimes change; refresh outstanding counts."""
        runtimes = {r.replica_id: replica_runtime(r) for r in replicas}
        layout = tuple(sorted((str(rid), rt) for rid, rt in runtimes.items() if rt is not None))
        if layout != self._layout:
            capacities: dict[int, int] = {}
            for runtime in runtimes.values():
                if runtime is not None:
                    capacities[runtime[0]] = runtime[1]
            self._policy = ArloDispatch(capacities, **self.params.model_dump()) if capacities else None
            if self._policy is not None:
                for rid, runtime in runtimes.items():
                    if runtime is not None:
                        self._policy.add_instance(rid, runtime[0])
            self._layout = layout
        if self._policy is not None:
            for replica in replicas:
                if runtimes.get(replica.replica_id) is not None:
                    reported = int(replica.routing_stats.get(STATS_OUTSTANDING, 0))
                    outstanding = max(self._sent.get(replica.replica_id, 0), reported)
                    if self._policy.outstanding(replica.replica_id) != outstanding:
                        self._policy.set_outstanding(replica.replica_id, outstanding)
        return self._policy

    def rank(self, candidate_replicas: List[RunningReplica],
             pending_request: Optional[PendingRequest]) -> List[List[RunningReplica]]:
        policy = self._sync_policy(candidate_replicas)
        silent = [r for r in candidate_replicas if replica_runtime(r) is None]
        if policy is None:
            return [silent]
        length = request_length_tokens(pending_request)
        if length is None:
            length = max(policy.max_lengths)  # unknown length: only the longest runtime is safe
        by_id = {r.replica_id: r for r in candidate_replicas}
        try:
            chosen = policy.choose_instance(length)
        except ValueError:
            return [[r] for r in candidate_replicas]  # too long for every runtime: the replica answers the error
        able = [r for r in candidate_replicas if (rt := replica_runtime(r)) is not None and rt[0] >= length
                and r.replica_id != chosen]
        able.sort(key=lambda r: (replica_runtime(r)[0], policy.outstanding(r.replica_id) / replica_runtime(r)[1]))
        ranks = [[by_id[chosen]]] + [[r] for r in able]
        if silent:
            ranks.append(silent)
        return ranks

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)
        self._sent[replica_id] = self._sent.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        count = self._sent.get(replica_id, 0)
        if count > 1:
            self._sent[replica_id] = count - 1
        else:
            self._sent.pop(replica_id, None)
