"""Arrival processes: when requests come, the one place every simulation and benchmark draws them from.

Two forms of the same processes:

* vectorised, on a numpy Generator: Poisson, Gamma(rate, CV) as in AlpaServe §3.2/§6.2 (a renewal process whose
  inter-arrival times have mean 1 / rate and coefficient of variation CV), and a Markov-modulated Poisson process
  for bursts. `placement.core.workload` builds multi-model workloads from them.
* streamed, on a `random.Random`: `poisson_arrivals` yields one arrival per exponential draw, so a caller can
  draw each request's other attributes (type, length, luck) from the same stream in between, as the OTAS
  (otas-v2 §V) and TCB (§6.2.4) traces do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np


class ArrivalProcess(Protocol):
    """Draws sorted arrival times in [start_s, start_s + duration_s)."""

    def generate(self, start_s: float, duration_s: float, rng: np.random.Generator) -> np.ndarray: ...


def _renewal_arrivals(draw, rate: float, start_s: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Arrivals of a renewal process whose inter-arrival times `draw(rng, n)` has mean 1 / rate."""
    if rate <= 0 or duration_s <= 0:
        return np.empty(0)
    expected = rate * duration_s
    chunks, t, count = [], start_s, int(expected + 5 * np.sqrt(expected) + 16)
    end = start_s + duration_s
    while t < end:
        times = t + np.cumsum(draw(rng, count))
        chunks.append(times)
        t = times[-1]
    arrivals = np.concatenate(chunks)
    return arrivals[arrivals < end]


@dataclass(frozen=True)
class PoissonProcess:
    """Poisson arrivals: exponential inter-arrival times (CV = 1)."""

    rate: float  # requests per second

    def generate(self, start_s: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
        return _renewal_arrivals(lambda r, n: r.exponential(1.0 / self.rate, n), self.rate, start_s, duration_s, rng)


@dataclass(frozen=True)
class GammaProcess:
    """Gamma renewal process parameterised by rate and CV of the inter-arrival times (AlpaServe §6.2, Clockwork).

    Inter-arrival ~ Gamma(shape = 1 / cv^2, scale = cv^2 / rate): mean 1 / rate, coefficient of variation cv.
    """

    rate: float  # requests per second
    cv: float  # coefficient of variation of inter-arrival times

    def generate(self, start_s: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
        if self.cv <= 0:
            raise ValueError(f"cv={self.cv}: the coefficient of variation must be > 0")
        shape, scale = 1.0 / self.cv**2, self.cv**2 / max(self.rate, 1e-300)
        return _renewal_arrivals(lambda r, n: r.gamma(shape, scale, n), self.rate, start_s, duration_s, rng)


@dataclass(frozen=True)
class MarkovModulatedProcess:
    """Markov-modulated Poisson process (bursts): a continuous-time Markov chain over states, Poisson within each.

    `rates[i]` is the arrival rate in state i; the chain stays in state i for Exp(mean_dwell_s[i]) seconds and then
    jumps to another state, chosen uniformly (two states: a quiet and a burst state).
    """

    rates: tuple[float, ...]  # requests per second in each state
    mean_dwell_s: tuple[float, ...]  # mean time spent in each state, seconds

    def __post_init__(self) -> None:
        if len(self.rates) != len(self.mean_dwell_s) or len(self.rates) < 1:
            raise ValueError("rates and mean_dwell_s need the same, non-zero length")

    @property
    def mean_rate(self) -> float:
        """Long-run rate: rates weighted by the stationary time share (uniform jumps -> share ∝ dwell time)."""
        dwell = np.asarray(self.mean_dwell_s)
        return float(np.dot(self.rates, dwell) / dwell.sum())

    def generate(self, start_s: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
        n_states = len(self.rates)
        state = int(rng.integers(n_states))
        t, end, parts = start_s, start_s + duration_s, []
        while t < end:
            stay = min(rng.exponential(self.mean_dwell_s[state]), end - t)
            if self.rates[state] > 0:
                parts.append(PoissonProcess(self.rates[state]).generate(t, stay, rng))
            t += stay
            if n_states > 1:
                state = int((state + 1 + rng.integers(n_states - 1)) % n_states)
        return np.concatenate(parts) if parts else np.empty(0)


def poisson_arrivals(rate_per_s: float, start_s: float, end_s: float, rng: random.Random) -> Iterator[float]:
    """Poisson arrival times in [start_s, end_s), drawn lazily: one `rng.expovariate(rate_per_s)` per arrival
    (and one more that ends the stream), nothing else, so the caller's own draws in between keep their place."""
    if rate_per_s <= 0:
        return
    t = start_s
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= end_s:
            return
        yield t
