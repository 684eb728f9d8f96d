"""Polymorphing runtimes of one text model: their lengths, latency profiles and capacity within the SLO (Arlo §3.3).

Arlo serves one model as several static-shape runtimes, each compiled for one `max_length`. This module holds the
plain-data side of that:

* `choose_runtime_lengths` reads a measured latency staircase (latency of a static runtime by max length) and puts
  one runtime at the top of each step, where the next length would make the latency jump (Arlo §3.3: "one runtime
  per 64-length step" for TensorRT Bert; here the step is found in the measurement, not assumed).
* `RuntimeProfile` is one runtime's latency by batch size, its capacity within the SLO (Arlo's M_i) and the
  mean-latency mapping from per-instance load to latency (Arlo's L_i in Eq. 1).

Pure Python: the measurements come from `models.runtimes.static_runtime` (torch) or from the paper-shaped
reproduction profiles in `placement.arlo.paper_profiles`.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from placement.core.latency_table import LatencyTable, table_latency_s

#: Arlo §3.3: "Within each 64 length step, the latency change is tiny, usually less than 5%".
DEFAULT_STEP_TOLERANCE = 0.05


def choose_runtime_lengths(lengths_tokens: Sequence[int], latencies_s: Sequence[float],
                           step_tolerance: float = DEFAULT_STEP_TOLERANCE,
                           max_runtimes: int | None = None) -> list[int]:
    """Runtime max lengths from a latency staircase (Arlo §3.3).

    Scanning lengths upwards, a step starts at some length and goes on while the latency stays within
    `step_tolerance` of the step's first latency; the runtime for that step is compiled at the step's last
    length (no shorter runtime would be meaningfully faster for the requests it covers). The longest measured
    length is always a runtime. With `max_runtimes`, the tolerance is doubled until the steps fit.
    """
    if len(lengths_tokens) != len(latencies_s) or not lengths_tokens:
        raise ValueError("lengths_tokens and latencies_s must be non-empty and of equal length")
    if step_tolerance <= 0:
        raise ValueError(f"step_tolerance must be > 0, got {step_tolerance}")
    if max_runtimes is not None and max_runtimes < 1:
        raise ValueError(f"max_runtimes must be >= 1, got {max_runtimes}")
    order = sorted(range(len(lengths_tokens)), key=lambda k: lengths_tokens[k])
    lengths = [int(lengths_tokens[k]) for k in order]
    latencies = [float(latencies_s[k]) for k in order]
    if any(value <= 0 for value in latencies):
        raise ValueError("latencies_s must be > 0")
    tolerance = step_tolerance
    while True:
        chosen: list[int] = []
        step_start_latency = latencies[0]
        for index in range(1, len(lengths)):
            if latencies[index] > step_start_latency * (1.0 + tolerance):
                chosen.append(lengths[index - 1])
                step_start_latency = latencies[index]
        chosen.append(lengths[-1])
        if max_runtimes is None or len(chosen) <= max_runtimes:
            return chosen
        tolerance *= 2.0


def ideal_runtime_length(max_lengths_tokens: Sequence[int], length_tokens: int) -> int:
    """The request's ideal runtime (Arlo §3.4, Alg. 1 lines 18-19): the shortest max length that takes
    `length_tokens`; ValueError naming the longest runtime when none does."""
    lengths = sorted(max_lengths_tokens)
    if not lengths:
        raise ValueError("no runtime max lengths given")
    index = bisect.bisect_left(lengths, length_tokens)
    if index == len(lengths):
        raise ValueError(f"request of {length_tokens} tokens exceeds the longest runtime ({lengths[-1]} tokens)")
    return lengths[index]


class RuntimeProfile(BaseModel):
    """One static-shape runtime: max length, latency by batch size, and what the SLO allows it to take."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_length_tokens: int = Field(ge=1, description="Longest request (tokens, specials included) the runtime accepts.")
    batch_latency_s: LatencyTable = Field(description="Batch size -> seconds one padded batch takes.")
    max_batch_size: int = Field(ge=1, description="Batch size the runtime is compiled for (Arlo: fixed and small).")
    slo_s: float = Field(gt=0, description="Latency objective of the request stream, in seconds.")

    @model_validator(mode="after")
    def _check(self) -> "RuntimeProfile":
        if self.max_batch_size not in self.batch_latency_s:
            raise ValueError(f"max_batch_size {self.max_batch_size} has no entry in batch_latency_s")
        return self

    def batch_latency(self, batch_size: float) -> float:
        """Latency of one batch, linearly interpolated between profiled sizes and kept non-decreasing."""
        return float(table_latency_s(self.batch_latency_s, batch_size, beyond="flat", monotone=True))

    @property
    def capacity_requests(self) -> int:
        """Arlo's M_i: requests one instance completes within the SLO, in full batches back to back."""
        full_batches = math.floor(self.slo_s / self.batch_latency_s[self.max_batch_size])
        return full_batches * self.max_batch_size

    def mean_latency_s(self, load_requests):
        """Arlo's L_i(B): mean latency of a request when one instance receives B requests per SLO period.

        Arlo profiles L_i as batch size -> latency; to also price queueing (an instance near its capacity M_i makes
        every request wait), plexserve reads B as an arrival rate of B / SLO and adds the M/D/1 mean wait of full
        batches: wait = T_b * rho / (2 (1 - rho)), rho = B / (SLO * b / T_b), continued linearly beyond
        rho = RHO_CAP so that overloaded instances stay finite but steeply priced. Non-decreasing in B, which
        the exact allocation relies on. Accepts arrays.
        """
        load = np.asarray(load_requests, dtype=float)
        result = queueing_latency_s(load, self.batch_latency(1), self.batch_latency_s[self.max_batch_size],
                                    self.max_batch_size, self.slo_s)
        return float(result) if result.ndim == 0 else result


    def profiled_latency_s(self, load_requests):
        """Arlo §3.4 as published: L_i(B) read from the profiled latency table (batch size -> latency) at B,
        linearly interpolated between profiled sizes and continued along the last segment past the largest
        (per sample for a one-size table); no queueing term. Non-decreasing in B. Accepts arrays."""
        load = np.asarray(load_requests, dtype=float)
        result = np.vectorize(lambda b: table_latency_s(self.batch_latency_s, b, beyond="last_slope", monotone=True),
                              otypes=[float])(load)
        return float(result) if result.ndim == 0 else result

    def allocation_latency_s(self, load_requests, objective: str = "queueing"):
        """L_i(B) of the allocation objective (Arlo Eq. 1): 'queueing' (the project default,
        :meth:`mean_latency_s`) or 'paper' (:meth:`profiled_latency_s`)."""
        check_objective(objective)
        return self.mean_latency_s(load_requests) if objective == "queueing" else self.profiled_latency_s(load_requests)


#: Utilisation beyond which the M/D/1 wait is continued linearly (it diverges at 1).
RHO_CAP = 0.95
#: L_i(B) of the allocation objective: the project's M/D/1-priced latency, or the paper's profiled table (§3.4).
ALLOCATION_OBJECTIVES = ("queueing", "paper")


def check_objective(objective: str) -> str:
    """ValueError naming `objective` unless it is one of :data:`ALLOCATION_OBJECTIVES`."""
    if objective not in ALLOCATION_OBJECTIVES:
        raise ValueError(f"objective={objective!r}: choose one of {ALLOCATION_OBJECTIVES}")
    return objective


def queueing_latency_s(load, single_s: float, batch_s: float, batch_size: int, slo_s: float):
    """Mean latency at `load` requests per SLO period: one request's own latency plus the M/D/1 wait (see above)."""
    rho = np.asarray(load, dtype=float) * batch_s / (slo_s * batch_size)
    capped = np.minimum(rho, RHO_CAP)
    wait = capped / (2.0 * (1.0 - capped))
    slope = 1.0 / (2.0 * (1.0 - RHO_CAP) ** 2)
    wait = wait + np.maximum(rho - RHO_CAP, 0.0) * slope
    return single_s + batch_s * wait


class RuntimeProfileSet(BaseModel):
    """All runtimes of one model, sorted by max length; the longest is the model's own limit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Name of the served model.")
    source: str = Field(description="Where the figures come from: 'measured:<device>' or 'paper:<figure>' (a "
                                    "reproduction).")
    runtimes: list[RuntimeProfile] = Field(min_length=1,
                                           description="One profile per runtime, by increasing max length.")

    @model_validator(mode="after")
    def _check(self) -> "RuntimeProfileSet":
        lengths = [r.max_length_tokens for r in self.runtimes]
        if lengths != sorted(set(lengths)):
            raise ValueError(f"runtimes must have distinct max_length_tokens in increasing order, got {lengths}")
        return self

    @property
    def max_lengths(self) -> list[int]:
        return [r.max_length_tokens for r in self.runtimes]

    def ideal_index(self, length_tokens: int) -> int:
        """Index of the shortest runtime that accepts `length_tokens` (the request's ideal runtime)."""
        return self.max_lengths.index(ideal_runtime_length(self.max_lengths, length_tokens))

    def requests_per_bin(self, lengths_tokens: Sequence[int], window_s: float) -> list[float]:
        """Arlo's Q_i: mean requests per SLO period whose ideal runtime is i, from lengths seen over `window_s`."""
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        counts = [0] * len(self.runtimes)
        bounds = self.max_lengths
        for length in lengths_tokens:
            index = bisect.bisect_left(bounds, length)
            counts[min(index, len(counts) - 1)] += 1
        slo_s = self.runtimes[0].slo_s
        return [count / window_s * slo_s for count in counts]
