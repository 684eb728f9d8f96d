"""What both routers share: Serve's `choose_replicas` contract around a ranking of the candidate replicas."""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


class RankingRouter(FIFOMixin, RequestRouter):
    """A router that ranks the candidates: Serve tries the first rank, then the next when a replica is full.

    The request backs off between attempts (`should_backoff`): a replica at `max_ongoing_requests` is full for a
    while, and retrying at once would only spin."""

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        return self.rank(candidate_replicas, pending_request)

    def rank(self, candidate_replicas: List[RunningReplica],
             pending_request: Optional[PendingRequest]) -> List[List[RunningReplica]]:
        """The candidates in the order to try them, as Serve's ranks (a rank's replicas are equally good)."""
        raise NotImplementedError
