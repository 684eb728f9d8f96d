"""Live traffic statistics: what the ingress reports and what the placement controller judges.

The ingress records one `RequestRecord` per request (model, arrival time, input length, outcome, latency) and
sends them in batches; the controller keeps the records of its longest observation window in one `TrafficWindow`
and turns them into the inputs of its policies, each over its own seconds (`window_s` of each query): per-model
arrival times for the workload fit (`ObservedTraffic`), SLO attainment, and input-length histograms (Arlo's runtime
allocation).
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
    #: per model, aligned with arrival_s: latency of each answered request, seconds (NaN: not answered)
    latency_s: list[np.ndarray] | None = None


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
    """The records of the last `window_s` seconds (bounded by `max_records`). Each query looks back over the whole
    window or, with its own `window_s`, over its last that many seconds: one store serves consumers with different
    windows (the controller's period, its service-time refit, Arlo's allocation period)."""

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

    def _lookback_s(self, window_s: float | None) -> float:
        """The seconds a query looks back: its own `window_s`, at most the store's."""
        if window_s is None:
            return self.window_s
        if not 0 < window_s <= self.window_s:
            raise ValueError(f"window_s={window_s}: must be in (0, {self.window_s:g}] (the seconds this traffic "
                             f"window keeps)")
        return window_s

    def _since(self, now_s: float, start_s: float) -> list[RequestRecord]:
        """The records that arrived at `start_s` or later, by arrival time (only those are sorted: the shift test
        asks for its last two windows every second of a store that may hold an allocation period)."""
        self.trim(now_s)
        return sorted((r for r in self.records if r.arrival_s >= start_s), key=lambda r: r.arrival_s)

    def recent(self, now_s: float, window_s: float | None = None) -> list[RequestRecord]:
        """The records of the last `window_s` seconds (default: the whole window), by arrival time."""
        return self._since(now_s, now_s - self._lookback_s(window_s))

    def observed(self, now_s: float, model_names: Sequence[str], slo_s: Sequence[float],
                 settle_s: float = 0.0, since_s: float | None = None, window_s: float | None = None) -> ObservedTraffic:
        """Per-model arrival times relative to the window's start, for the workload fit, over the last `window_s`
        seconds (default: the whole window). With `settle_s`, the requests that arrived in the window's last
        `settle_s` seconds are left out (and the window ends there): a request is recorded when it ends, so the
        window's newest arrivals hold its fast answers and not yet its slow ones, and a service-time fit on them
        would see the system faster than it was. With `since_s` (wall clock), the window starts there if that is
        later than its own start (e.g. at the last placement change)."""
        start = now_s - self._lookback_s(window_s)
        start = start if since_s is None else max(start, since_s)
        if not 0 <= settle_s < now_s - start:
            raise ValueError(f"settle_s={settle_s}: must be in [0, {now_s - start:g}) (the window's seconds)")
        recent = [r for r in self._since(now_s, start) if r.arrival_s < now_s - settle_s or settle_s == 0]
        arrivals = [np.array([r.arrival_s - start for r in recent if r.model == name]) for name in model_names]
        latencies = [np.array([r.latency_ms / 1000.0 if r.outcome == "ok" and r.latency_ms is not None else np.nan
                               for r in recent if r.model == name]) for name in model_names]
        return ObservedTraffic(list(model_names), arrivals, now_s - start - settle_s, list(slo_s), latencies)

    def stats(self, now_s: float, window_s: float | None = None) -> dict[str, ModelWindowStats]:
        """Per model: requests and outcomes of the last `window_s` seconds (default: the whole window)."""
        out: dict[str, ModelWindowStats] = {}
        for record in self.recent(now_s, window_s):
            s = out.setdefault(record.model, ModelWindowStats(0, 0, 0, 0, 0))
            s.requests += 1
            s.answered += record.outcome == "ok"
            s.slo_met += record.outcome == "ok" and record.slo_met
            s.rejected += record.outcome == "rejected"
            s.failed += record.outcome == "failed"
        return out

    def length_histogram(self, now_s: float, model: str) -> list[int]:
        """Requests per input-length bin (LENGTH_BIN_EDGES_TOKENS) of one model."""
        lengths = [r.input_tokens for r in self.recent(now_s) if r.model == model]
        edges = [*LENGTH_BIN_EDGES_TOKENS, np.inf]
        return np.histogram(lengths, bins=edges)[0].astype(int).tolist()


@dataclass(frozen=True)
class RateShift:
    """A per-model rate change between two adjacent windows."""

    model: str
    before_per_s: float
    after_per_s: float
    z: float  # standardised difference of the two counts
    dispersion: float = 1.0  # the counts' index of dispersion the test assumed (`count_dispersion`)

    def to_json(self) -> dict:
        return asdict(self)


#: Inter-arrival gaps a window needs before its squared CV counts towards the dispersion of `detect_rate_shifts`.
MIN_GAPS_FOR_DISPERSION = 4


def count_dispersion(arrival_s: Sequence[np.ndarray]) -> float:
    """The index of dispersion of request counts (count variance over count mean) that arrival times in separate
    windows imply, at least 1 (Poisson's): the mean squared CV of the inter-arrival gaps within each window that holds
    at least MIN_GAPS_FOR_DISPERSION gaps. For a renewal process the count variance over a window holding many
    arrivals tends to CV^2 times the count mean (the renewal central limit theorem), so Gamma arrivals with CV 3
    (AlpaServe §3.1's bursty traffic) spread their counts nine times as widely as Poisson's. Gaps are measured
    within each window, so a rate that changes between the windows does not inflate the estimate."""
    squared_cvs = []
    for times in arrival_s:
        gaps = np.diff(np.sort(np.asarray(times, dtype=float)))
        if len(gaps) >= MIN_GAPS_FOR_DISPERSION and gaps.mean() > 0:
            squared_cvs.append(float(gaps.var() / gaps.mean() ** 2))
    return max(1.0, float(np.mean(squared_cvs))) if squared_cvs else 1.0


def detect_rate_shifts(window: TrafficWindow, now_s: float, model_names: Sequence[str], window_s: float,
                       z_threshold: float, min_ratio: float, min_requests: int) -> list[RateShift]:
    """Two-window rate test (a plexserve addition to react within a period): per model, the request counts n1 in
    [now - 2w, now - w) and n2 in [now - w, now). Under an unchanged rate, (n2 - n1) / sqrt(D (n1 + n2)) is about
    standard normal, D the counts' index of dispersion (`count_dispersion`: 1 for Poisson arrivals, about CV^2 for
    bursty ones, estimated from the gaps within each window); a shift is |z| >= z_threshold with a rate ratio of at
    least `min_ratio` and n1 + n2 >= `min_requests` (a count test on too few requests is noise). Without D, every
    burst of Gamma traffic with CV 3 would pass for a shift and trigger a decision that changes nothing."""
    if window_s <= 0 or 2 * window_s > window.window_s:
        raise ValueError(f"window_s={window_s}: must be > 0 and two windows must fit the traffic window "
                         f"({window.window_s} s)")
    arrivals: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in model_names}
    for record in window.recent(now_s, 2 * window_s):
        if record.model in arrivals:
            arrivals[record.model][int(record.arrival_s >= now_s - window_s)].append(record.arrival_s)
    shifts = []
    for name, (before, after) in arrivals.items():
        n1, n2 = len(before), len(after)
        if n1 + n2 < min_requests:
            continue
        dispersion = count_dispersion([np.asarray(before), np.asarray(after)])
        z = (n2 - n1) / np.sqrt(dispersion * (n1 + n2))
        ratio = max(n1, n2) / max(min(n1, n2), 1)
        if abs(z) >= z_threshold and ratio >= min_ratio:
            shifts.append(RateShift(name, n1 / window_s, n2 / window_s, float(z), dispersion))
    return shifts


#: Step, seconds, of the candidate change times `estimate_change_s` scores.
CHANGE_GRID_S = 0.1


def estimate_change_s(window: TrafficWindow, now_s: float, model_names: Sequence[str], lookback_s: float,
                      min_side_s: float) -> float | None:
    """When the rates of `model_names` changed within the last `lookback_s` seconds (a plexserve addition, for the
    decision after a detected shift): the maximum-likelihood single change point of piecewise-constant Poisson rates,
    one rate per model before and one after, scored every CHANGE_GRID_S seconds at least `min_side_s` from either end
    of the lookback (wall clock, as the records' arrivals). None without a record of those models in it.

    With rates r1 = n1 / t1 before and r2 = n2 / t2 after a candidate time, each model's log-likelihood is
    n1 log r1 + n2 log r2 - (n1 + n2) (the last term does not depend on the split); the candidate with the largest
    sum over the models wins. The two-window test (`detect_rate_shifts`) says that the rate changed; this says
    when, so that the decision fits the traffic since then and neither waits for a whole window of it nor fits a
    window that straddles the change."""
    if lookback_s <= 2 * min_side_s or min_side_s < 0:
        raise ValueError(f"lookback_s={lookback_s}, min_side_s={min_side_s}: the lookback must be longer than "
                         "twice min_side_s (>= 0)")
    start = now_s - lookback_s
    wanted = set(model_names)
    arrivals: dict[str, list[float]] = {name: [] for name in wanted}
    for record in window.recent(now_s, lookback_s):
        if record.model in wanted:
            arrivals[record.model].append(record.arrival_s)
    per_model = [np.asarray(a) for a in arrivals.values() if a]  # sorted: `recent` returns them by arrival time
    if not per_model:
        return None
    candidates = np.arange(start + min_side_s, now_s - min_side_s + 1e-9, CHANGE_GRID_S)
    log_likelihood = np.zeros(len(candidates))
    for times in per_model:
        before = np.searchsorted(times, candidates).astype(float)
        after = len(times) - before
        for count, seconds in ((before, candidates - start), (after, now_s - candidates)):
            with np.errstate(divide="ignore", invalid="ignore"):
                log_likelihood += np.where(count > 0, count * np.log(count / seconds), 0.0)
    return float(candidates[int(np.argmax(log_likelihood))])
