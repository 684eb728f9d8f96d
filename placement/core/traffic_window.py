"""Live traffic statistics: what the ingress reports and what the placement controller judges.

The ingress records one `RequestRecord` per request (model, arrival time, input length, outcome, latency) and
sends them in batches; the controller keeps the records of the last observation window in a `TrafficWindow` and
turns them into the inputs of its policies: per-model arrival times for the workload fit
(`ObservedTraffic`), SLO attainment, and input-length histograms (Arlo's runtime allocation).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Iterable, Literal, Sequence

import numpy as np

Outcome = Literal["ok", "rejected", "failed", "invalid"]
#: Input-length histogram bin edges, tokens (the last bin is open-ended).
LENGTH_BIN_EDGES_TOKENS = (0, 16, 32, 64, 128, 256, 512)


@dataclass
class ObservedTraffic:
    """What the ingress saw during one observation window."""

    model_names: list[str]
    arrival_s: list[np.ndarray]  # per model: arrival times, seconds from the window's start
    duration_s: float
    slo_s: list[float]  # per model


@dataclass(frozen=True)
class RequestRecord:
    model: str
    arrival_s: float  # wall-clock (time.time()) seconds
    outcome: Outcome
    latency_ms: float | None = None  # answered requests only
    slo_met: bool = False
    input_tokens: int = 0  # text models: tokens of the longest text in the request

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "RequestRecord":
        return cls(**data)


@dataclass
class ModelWindowStats:
    requests: int
    answered: int
    slo_met: int
    rejected: int
    failed: int

    @property
    def attainment(self) -> float | None:
        """SLO attainment over every request that was not invalid (rejected and failed ones count as missed)."""
        return self.slo_met / self.requests if self.requests else None


class TrafficWindow:
    """The records of the last `window_s` seconds (bounded by `max_records`)."""

    def __init__(self, window_s: float, max_records: int = 1_000_000):
        if window_s <= 0:
            raise ValueError(f"window_s={window_s}: must be > 0")
        self.window_s = window_s
        self.records: deque[RequestRecord] = deque(maxlen=max_records)

    def add(self, records: Iterable[RequestRecord]) -> None:
        for record in records:
            if record.outcome != "invalid":
                self.records.append(record)

    def trim(self, now_s: float) -> None:
        while self.records and self.records[0].arrival_s < now_s - self.window_s:
            self.records.popleft()

    def _recent(self, now_s: float) -> list[RequestRecord]:
        self.trim(now_s)
        return sorted(self.records, key=lambda r: r.arrival_s)

    def observed(self, now_s: float, model_names: Sequence[str], slo_s: Sequence[float]) -> ObservedTraffic:
        """Per-model arrival times relative to the window's start, for the workload fit."""
        start = now_s - self.window_s
        recent = self._recent(now_s)
        arrivals = [np.array([r.arrival_s - start for r in recent if r.model == name]) for name in model_names]
        return ObservedTraffic(list(model_names), arrivals, self.window_s, list(slo_s))

    def stats(self, now_s: float) -> dict[str, ModelWindowStats]:
        out: dict[str, ModelWindowStats] = {}
        for record in self._recent(now_s):
            s = out.setdefault(record.model, ModelWindowStats(0, 0, 0, 0, 0))
            s.requests += 1
            s.answered += record.outcome == "ok"
            s.slo_met += record.outcome == "ok" and record.slo_met
            s.rejected += record.outcome == "rejected"
            s.failed += record.outcome == "failed"
        return out

    def length_histogram(self, now_s: float, model: str) -> list[int]:
        """Requests per input-length bin (LENGTH_BIN_EDGES_TOKENS) of one model."""
        lengths = [r.input_tokens for r in self._recent(now_s) if r.model == model]
        edges = [*LENGTH_BIN_EDGES_TOKENS, np.inf]
        return np.histogram(lengths, bins=edges)[0].astype(int).tolist()
