"""Workloads: request arrivals for many models, with per-request SLO, input length, task and utility.

A :class:`Workload` is plain arrays sorted by arrival time, the form the simulator consumes. Arrival processes
(:mod:`placement.core.arrivals`) draw arrival times; popularity (uniform or power law, AlpaServe §6.3 uses exponent 0.5)
splits a total rate over models; length distributions draw per-request input lengths for the length-aware policies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
