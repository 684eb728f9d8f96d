"""Batch forming: how many queued requests of one model run together (AlpaServe §6.5's batching strategy).

When a group's first stage frees up it takes the model of its oldest queued request and batches as many of that
model's queued requests (in arrival order) as fit, up to `max_batch_size`, while every request in the batch still
meets its deadline. A policy gets the time, the deadlines of the candidates and a function that predicts the
batch's finish time, and returns the batch size (0: even alone the head request misses its deadline; the caller
drops it). The simulator's compiled kernel implements the same rule for :class:`MaxBatchWithinSLO`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence


class BatchPolicy(Protocol):
    name: str
    max_batch_size: int

    def batch_size(self, now_s: float, deadlines_s: Sequence[float], finish_time: Callable[[int], float]) -> int: ...


@dataclass(frozen=True)
class MaxBatchWithinSLO:
    """The largest prefix of the queue (at most `max_batch_size`) whose predicted finish meets every deadline in it."""

    max_batch_size: int = 1
    name: str = "max_batch_within_slo"

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size}: must be >= 1")

    def batch_size(self, now_s: float, deadlines_s: Sequence[float], finish_time: Callable[[int], float]) -> int:
        size, earliest_deadline = 0, float("inf")
        for candidate, deadline in enumerate(deadlines_s[: self.max_batch_size], start=1):
            earliest_deadline = min(earliest_deadline, deadline)
            if finish_time(candidate) > earliest_deadline:
                break
            size = candidate
        return size
