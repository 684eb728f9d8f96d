"""Workloads: request arrivals for many models, with per-request SLO, input length, task and utility.

A :class:`Workload` is plain arrays sorted by arrival time, the form the simulator consumes. Arrival processes
(:mod:`placement.core.arrivals`) draw arrival times; popularity (uniform or power law, AlpaServe §6.3 uses exponent 0.5)
splits a total rate over models; length distributions draw per-request input lengths for the length-aware policies.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

import numpy as np

from placement.core.arrivals import ArrivalProcess, GammaProcess

#: Input length written when no length distribution is given (tokens).
DEFAULT_INPUT_LENGTH_TOKENS = 128


def uniform_popularity(num_models: int) -> np.ndarray:
    """Equal shares."""
    return np.full(num_models, 1.0 / num_models)


def power_law_popularity(num_models: int, exponent: float) -> np.ndarray:
    """Share of model i proportional to (i + 1) ** -exponent (AlpaServe §6.3 uses exponent 0.5)."""
    weights = np.arange(1, num_models + 1, dtype=float) ** -exponent
    return weights / weights.sum()


class LengthDistribution(Protocol):
    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray: ...


@dataclass(frozen=True)
class FixedLength:
    tokens: int

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.tokens, dtype=np.int32)


@dataclass(frozen=True)
class ClippedNormalLength:
    """Normal(mean, std) rounded and clipped to [min_tokens, max_tokens]."""

    mean_tokens: float
    std_tokens: float
    min_tokens: int = 1
    max_tokens: int = 512

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        draws = np.rint(rng.normal(self.mean_tokens, self.std_tokens, n))
        return np.clip(draws, self.min_tokens, self.max_tokens).astype(np.int32)


@dataclass(frozen=True)
class EmpiricalLength:
    """An empirical histogram: lengths drawn from `bin_edges_tokens` bins with `counts`, uniformly within a bin."""

    bin_edges_tokens: tuple[int, ...]
    counts: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.bin_edges_tokens) != len(self.counts) + 1 or sum(self.counts) <= 0:
            raise ValueError("bin_edges_tokens needs len(counts) + 1 edges and counts a positive sum")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        probs = np.asarray(self.counts, dtype=float) / sum(self.counts)
        bins = rng.choice(len(probs), size=n, p=probs)
        low = np.asarray(self.bin_edges_tokens[:-1])[bins]
        high = np.asarray(self.bin_edges_tokens[1:])[bins]
        return rng.integers(low, np.maximum(high, low + 1)).astype(np.int32)


@dataclass
class Workload:
    """Requests sorted by arrival: which model, when, by when (SLO), how long an input, which task, what utility."""

    model_names: list[str]
    arrival_s: np.ndarray  # float64, sorted
    model: np.ndarray  # int32 index into model_names
    slo_s: np.ndarray  # float64 per request
    input_length_tokens: np.ndarray = field(default=None)  # int32
    task: np.ndarray = field(default=None)  # int32 task id
    utility: np.ndarray = field(default=None)  # float64

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        self.arrival_s = np.asarray(self.arrival_s, dtype=np.float64)
        self.model = np.asarray(self.model, dtype=np.int32)
        self.slo_s = np.broadcast_to(np.asarray(self.slo_s, dtype=np.float64), (n,)).copy()
        if self.input_length_tokens is None:
            self.input_length_tokens = np.full(n, DEFAULT_INPUT_LENGTH_TOKENS, dtype=np.int32)
        if self.task is None:
            self.task = np.zeros(n, dtype=np.int32)
        if self.utility is None:
            self.utility = np.ones(n)
        for name in ("model", "slo_s", "input_length_tokens", "task", "utility"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"workload field {name} has {len(getattr(self, name))} entries for {n} requests")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("arrival_s must be sorted")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0

    def take(self, index: np.ndarray) -> "Workload":
        return Workload(self.model_names, self.arrival_s[index], self.model[index], self.slo_s[index],
                        self.input_length_tokens[index], self.task[index], self.utility[index])

    def for_models(self, names: Sequence[str]) -> "Workload":
        """Only the requests of the named models (model indices unchanged)."""
        wanted = np.isin(self.model, [self.model_names.index(n) for n in names if n in self.model_names])
        return self.take(np.flatnonzero(wanted))

    def window(self, start_s: float, end_s: float) -> "Workload":
        lo, hi = np.searchsorted(self.arrival_s, [start_s, end_s])
        return self.take(np.arange(lo, hi))

    def rates(self) -> np.ndarray:
        """Observed requests per second of each model."""
        span = max(self.duration_s, 1e-9)
        return np.bincount(self.model, minlength=len(self.model_names)) / span

    def with_slo_scale(self, single_latency_s: Sequence[float], scale: float) -> "Workload":
        """SLO of every request = scale x its model's single-device latency (AlpaServe §6.2 'SLO scale')."""
        slo = np.asarray(single_latency_s, dtype=float)[self.model] * scale
        return Workload(self.model_names, self.arrival_s, self.model, slo, self.input_length_tokens, self.task,
                        self.utility)

    @staticmethod
    def merge(parts: Sequence["Workload"]) -> "Workload":
        """Requests of several workloads over the same model list, sorted by arrival (stable)."""
        if not parts:
            raise ValueError("merge needs at least one workload")
        names = parts[0].model_names
        if any(p.model_names != names for p in parts):
            raise ValueError("merged workloads must share model_names")
        cat = lambda f: np.concatenate([getattr(p, f) for p in parts])  # noqa: E731
        arrival = cat("arrival_s")
        order = np.argsort(arrival, kind="stable")
        return Workload(names, arrival[order], cat("model")[order], cat("slo_s")[order],
                        cat("input_length_tokens")[order], cat("task")[order], cat("utility")[order])


@dataclass(frozen=True)
class ModelTraffic:
    """One model's arrivals and request attributes."""

    process: ArrivalProcess
    slo_s: float
    lengths: LengthDistribution | None = None
    tasks: tuple[int, ...] = (0,)  # task ids drawn uniformly per request
    utility: float = 1.0


def generate_workload(model_names: Sequence[str], traffic: Sequence[ModelTraffic], duration_s: float,
                      seed: int = 0, start_s: float = 0.0) -> Workload:
    """Draw every model's arrivals independently (one child seed per model) and merge them by time."""
    if len(model_names) != len(traffic):
        raise ValueError(f"{len(traffic)} traffic entries for {len(model_names)} models")
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s}: must be > 0")
    names = list(model_names)
    rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(len(names))]
    parts = []
    for index, (spec, rng) in enumerate(zip(traffic, rngs)):
        arrivals = spec.process.generate(start_s, duration_s, rng)
        n = len(arrivals)
        lengths = spec.lengths.sample(n, rng) if spec.lengths is not None else None
        tasks = np.asarray(spec.tasks, dtype=np.int32)[rng.integers(len(spec.tasks), size=n)]
        parts.append(Workload(names, arrivals, np.full(n, index), np.full(n, spec.slo_s), lengths, tasks,
                              np.full(n, spec.utility)))
    return Workload.merge(parts)


def gamma_workload(model_names: Sequence[str], total_rate: float, cv: float, slo_s: Sequence[float] | float,
                   duration_s: float, popularity_exponent: float | None = None, seed: int = 0) -> Workload:
    """One Gamma(rate_i, cv) process per model, rates split by a power law (None: uniformly)."""
    n = len(model_names)
    shares = uniform_popularity(n) if popularity_exponent is None else power_law_popularity(n, popularity_exponent)
    slos = np.broadcast_to(np.asarray(slo_s, dtype=float), (n,))
    traffic = [ModelTraffic(GammaProcess(total_rate * share, cv), float(slo)) for share, slo in zip(shares, slos)]
    return generate_workload(model_names, traffic, duration_s, seed)


#: Arrivals of a renewal process drawn before a trace starts, so the trace sees the process in its steady state.
STATIONARY_BURN_IN_ARRIVALS = 100.0


@dataclass(frozen=True)
class ShiftingPopularity:
    """Open-loop traffic for many models whose hot models change mid-run: each model's arrivals are a Gamma renewal
    process (AlpaServe §3.2 / §6.2: rate and CV of the inter-arrival times), the models' rates follow a power law over
    their popularity ranks (Zipf-like, AlpaServe §6.3), and at `shift_at_s` the ranks are rotated by
    `rank_rotation` (default: half the models), so the hot models become middling and middling ones hot. Each
    model's SLO is given per model (AlpaServe §6.2's SLO scale: `with_slo_scale`).

    Which model holds which rank is a seeded permutation (`order_seed`), fixed for the traffic; `workload(seed)`
    draws one realisation of the arrivals (one child seed per model and segment), so a planning and a held-out
    realisation share the popularity and differ in their arrivals."""

    model_names: tuple[str, ...]
    total_rate_per_s: float
    cv: float
    slo_s: tuple[float, ...]
    duration_s: float
    popularity_exponent: float = 1.0
    shift_at_s: float | None = None
    rank_rotation: int | None = None
    order_seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_names", tuple(self.model_names))
        object.__setattr__(self, "slo_s", tuple(float(s) for s in self.slo_s))
        n = len(self.model_names)
        if n < 1:
            raise ValueError("model_names: at least one model")
        if len(set(self.model_names)) != n:
            raise ValueError("model_names: a model is named twice")
        if len(self.slo_s) != n:
            raise ValueError(f"slo_s has {len(self.slo_s)} entries for {n} models")
        if any(not s > 0 for s in self.slo_s):
            raise ValueError("slo_s: every SLO must be > 0 seconds")
        if not self.total_rate_per_s > 0:
            raise ValueError(f"total_rate_per_s={self.total_rate_per_s}: must be > 0")
        if not self.cv > 0:
            raise ValueError(f"cv={self.cv}: must be > 0")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s={self.duration_s}: must be > 0")
        if self.popularity_exponent < 0:
            raise ValueError(f"popularity_exponent={self.popularity_exponent}: must be >= 0")
        if self.shift_at_s is not None and not 0 < self.shift_at_s < self.duration_s:
            raise ValueError(f"shift_at_s={self.shift_at_s}: must lie inside (0, duration_s={self.duration_s})")

    @classmethod
    def with_slo_scale(cls, model_names: Sequence[str], single_latency_s: Sequence[float], slo_scale: float,
                       **fields) -> "ShiftingPopularity":
        """Each model's SLO = `slo_scale` x its single-request latency (AlpaServe §6.2 'SLO scale')."""
        if not slo_scale > 0:
            raise ValueError(f"slo_scale={slo_scale}: must be > 0")
        if len(single_latency_s) != len(model_names):
            raise ValueError(f"{len(single_latency_s)} latencies for {len(model_names)} models")
        return cls(model_names=tuple(model_names), slo_s=tuple(slo_scale * float(s) for s in single_latency_s),
                   **fields)

    @property
    def rotation(self) -> int:
        return len(self.model_names) // 2 if self.rank_rotation is None else self.rank_rotation % len(self.model_names)

    def ranks_before(self) -> np.ndarray:
        """Each model's popularity rank before the shift (0: hottest), a permutation drawn from `order_seed`."""
        return np.random.default_rng(self.order_seed).permutation(len(self.model_names))

    def ranks_after(self) -> np.ndarray:
        """Each model's rank after the shift: its rank before, rotated by `rotation` (the same without a shift)."""
        if self.shift_at_s is None:
            return self.ranks_before()
        return (self.ranks_before() + self.rotation) % len(self.model_names)

    def _rates(self, ranks: np.ndarray) -> np.ndarray:
        return self.total_rate_per_s * power_law_popularity(len(self.model_names), self.popularity_exponent)[ranks]

    def rates_before(self) -> np.ndarray:
        """Requests per second of each model before the shift."""
        return self._rates(self.ranks_before())

    def rates_after(self) -> np.ndarray:
        """Requests per second of each model after the shift."""
        return self._rates(self.ranks_after())

    def mean_rates(self) -> np.ndarray:
        """Each model's rate averaged over the whole duration."""
        if self.shift_at_s is None:
            return self.rates_before()
        share = self.shift_at_s / self.duration_s
        return share * self.rates_before() + (1 - share) * self.rates_after()

    def hot_models(self, count: int, after_shift: bool = False) -> list[str]:
        """The `count` most popular models, hottest first, before (or after) the shift."""
        ranks = self.ranks_after() if after_shift else self.ranks_before()
        return [self.model_names[i] for i in np.argsort(ranks)[:count]]

    def scaled(self, rate_factor: float) -> "ShiftingPopularity":
        """The same traffic at `rate_factor` times the total rate."""
        if not rate_factor > 0:
            raise ValueError(f"rate_factor={rate_factor}: must be > 0")
        return replace(self, total_rate_per_s=self.total_rate_per_s * rate_factor)

    def workload(self, seed: int = 0) -> Workload:
        """One realisation of the arrivals, sorted, every request with its model's SLO.

        Each model's arrivals are one Gamma renewal process of rate 1 and CV `cv` in operational time, mapped onto
        the clock through the model's cumulative rate (rate before the shift, then after it), so the process runs on
        across the shift; it starts `STATIONARY_BURN_IN_ARRIVALS` arrivals before the trace, so the trace sees it in
        its steady state (a bursty renewal process started at an arrival carries (CV^2 - 1) / 2 extra arrivals)."""
        names = list(self.model_names)
        before, after = self.rates_before(), self.rates_after()
        shift = self.duration_s if self.shift_at_s is None else self.shift_at_s
        parts = []
        for m, child in enumerate(np.random.SeedSequence(seed).spawn(len(names))):
            rng = np.random.default_rng(child)
            horizon = before[m] * shift + after[m] * (self.duration_s - shift)  # operational time of the trace
            burn_in = STATIONARY_BURN_IN_ARRIVALS
            ticks = GammaProcess(1.0, self.cv).generate(-burn_in, burn_in + horizon, rng)
            ticks = ticks[ticks >= 0.0]
            head = before[m] * shift
            arrivals = np.where(ticks < head, ticks / before[m], shift + (ticks - head) / max(after[m], 1e-300))
            arrivals = arrivals[arrivals < self.duration_s]
            parts.append(Workload(names, arrivals, np.full(len(arrivals), m), np.full(len(arrivals),
                                                                                         self.slo_s[m])))
        return Workload.merge(parts)
