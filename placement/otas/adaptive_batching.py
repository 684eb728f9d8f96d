"""OTAS adaptive batching (otas-v2 §III-C, Algorithm 1): group queries with similar arrival, deadline and utility.

A query r has arrival s_r, deadline d_r = s_r + l_r and utility u_r. A batch b has s_b = min s_r, d_b = min d_r and
u_b = the utility of its first query. A new query joins the newest batch that satisfies all of

* arrival:  s_b + delta >= s_r        (the first query of the batch has not waited longer than delta; older
                                       batches are older still, so the search stops there),
* size:     |B_b| < epsilon,
* deadline: |d_b - d_r| <= eta,
* utility:  |u_b - u_r| <= mu,

else it opens a new batch at the end of the queue. Pure Python: times are the caller's clock (simulated or live).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


@dataclass
class OtasRequest:
    """One query: task, s_r, d_r, u_r, and an opaque payload the executor needs (image, future)."""

    task_id: str
    arrival_s: float  # s_r
    deadline_s: float  # d_r = s_r + l_r
    utility: float  # u_r
    payload: Any = None
    request_id: int = field(default_factory=itertools.count().__next__)


@dataclass
class OtasBatch:
    """A batch of the queue B; `gamma` is set by token allocation (None: not scheduled to run now)."""

    requests: list[OtasRequest]
    gamma: int | None = None

    @property
    def arrival_s(self) -> float:  # s_b
        return min(r.arrival_s for r in self.requests)

    @property
    def deadline_s(self) -> float:  # d_b
        return min(r.deadline_s for r in self.requests)

    @property
    def first_utility(self) -> float:  # u_b
        return self.requests[0].utility

    @property
    def mean_utility(self) -> float:  # \bar{U}_b of Alg. 3
        return sum(r.utility for r in self.requests) / len(self.requests)

    def __len__(self) -> int:
        return len(self.requests)


class AdaptiveBatchingParams(BaseModel):
    """Parameters of OTAS Alg. 1 (defaults: the paper's §V setup)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    delta_s: float = Field(default=0.5, gt=0,
                           description="OTAS Alg. 1 delta: longest wait of a batch's first query before the batch "
                                       "closes, in seconds.")
    epsilon: int = Field(default=64, ge=1, description="OTAS Alg. 1 epsilon: largest batch size.")
    eta_s: float = Field(default=0.5, ge=0,
                         description="OTAS Alg. 1 eta: largest deadline difference within a batch, in seconds.")
    mu: float = Field(default=0.8, ge=0,
                      description="OTAS Alg. 1 mu: largest utility difference to the batch's first query.")


def parse_batching_params(params: dict[str, Any]) -> AdaptiveBatchingParams:
    """Validate spec params; ValueError names the field."""
    from pydantic import ValidationError

    try:
        return AdaptiveBatchingParams(**params)
    except ValidationError as error:
        fields = ", ".join(".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in error.errors())
        raise ValueError(f"invalid adaptive batching params: {fields}") from None


class AdaptiveBatcher:
    """OTAS Algorithm 1: add a query to a batch of the queue (kept in creation order) or open a new batch."""

    def __init__(self, params: AdaptiveBatchingParams | None = None):
        self.params = params or AdaptiveBatchingParams()

    def add(self, queue: list[OtasBatch], request: OtasRequest) -> OtasBatch:
        p = self.params
        for batch in reversed(queue):  # Alg. 1 line 1: b from N_B down to 1
            if batch.arrival_s + p.delta_s < request.arrival_s:  # line 2: arrival time
                break
            if len(batch) >= p.epsilon:  # line 5: batch size
                continue
            if abs(batch.deadline_s - request.deadline_s) > p.eta_s:  # line 8: finish time
                continue
            if abs(batch.first_utility - request.utility) > p.mu:  # line 11: utility
                continue
            batch.requests.append(request)  # line 14
            return batch
        batch = OtasBatch([request])  # line 17: new batch
        queue.append(batch)
        return batch
