"""What a simulation says about each request: the one result type every simulator in placement/ reports.

Each simulator keeps its own figures (AlpaServe's per-group utilisation, Arlo's p98, OTAS's utility ledger, TCB's
batch count), and all of them also give a `RequestOutcomes`: per request, in the order the requests were given,
its arrival, its deadline, when it finished (NaN if it never ran), its status and the utility it earned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SERVED = 0  # finished within its SLO
LATE = 1  # finished after its deadline
REJECTED = 2  # refused at admission, dropped or evicted while queued (its deadline could no longer be met)
UNPLACED = 3  # nothing hosts its model
UNSERVED = 4  # still waiting when the trace ended

STATUS_NAMES = {SERVED: "served", LATE: "late", REJECTED: "rejected", UNPLACED: "unplaced", UNSERVED: "unserved"}


@dataclass
class RequestOutcomes:
    """Per request: arrival, deadline, finish (NaN unless it ran), status and utility earned, seconds."""

    arrival_s: np.ndarray
    deadline_s: np.ndarray
    finish_s: np.ndarray
    status: np.ndarray
    utility: np.ndarray | None = None  # earned per request; None where the system prices no request

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        fields = {"deadline_s": self.deadline_s, "finish_s": self.finish_s, "status": self.status}
        if self.utility is not None:
            fields["utility"] = self.utility
        for name, values in fields.items():
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} requests")

    def __len__(self) -> int:
        return len(self.arrival_s)

    def counts(self) -> dict[str, int]:
        """Requests per status name."""
        found = np.bincount(np.asarray(self.status, dtype=np.int64), minlength=len(STATUS_NAMES))
        return {name: int(found[code]) for code, name in STATUS_NAMES.items()}

    def slo_attainment(self) -> float:
        """Share of all requests finished within their SLO (1.0 for no requests)."""
        return float(np.mean(self.status == SERVED)) if len(self) else 1.0

    def latency_s(self) -> np.ndarray:
        """Finish - arrival of every request that ran (served or late)."""
        ran = (self.status == SERVED) | (self.status == LATE)
        return self.finish_s[ran] - self.arrival_s[ran]

    def latency_percentile_s(self, percentile: float) -> float:
        latency = self.latency_s()
        return float(np.percentile(latency, percentile)) if len(latency) else math.nan

    def total_utility(self) -> float:
        return float(self.utility.sum()) if self.utility is not None else math.nan
