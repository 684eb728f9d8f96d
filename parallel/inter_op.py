"""Inter-op pass: slice a model's layer view into contiguous pipeline stages (AlpaServe §4.1).

AlpaServe reformulates Alpa's inter-op dynamic program for serving, where only the forward pass runs: it
minimises the largest stage latency,

    F(s, k) = min_{1 <= i <= k} max{ F(s-1, i-1), latency(i, k) }          (AlpaServe §4.1, the DP for F)

where F(s, k) is the best maximal stage latency when layers 1..k form s stages and latency(i, k) is the latency
of one stage made of layers i..k. Here latency(i, k) is the sum of the profiled layer latencies (or the intra-op
pass's optimum for the stage when it is sharded) plus the cost of receiving the stage's input; a stage whose
weights exceed the per-device memory budget has infinite latency. The program is exact; ties go to the
earliest cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

#: latency(i, k) of a stage of layers [i, k) (0-based, end exclusive); math.inf when the stage is infeasible.
StageLatencyFn = Callable[[int, int], float]


@dataclass(frozen=True)
class StagePartition:
    """Contiguous stages as [start, end) layer ranges, and the largest stage latency."""

    bounds: list[tuple[int, int]]
    stage_latencies_s: list[float]

    @property
    def max_stage_latency_s(self) -> float:
        return max(self.stage_latencies_s)

    @property
    def num_stages(self) -> int:
        return len(self.bounds)


def slice_stages(num_layers: int, num_stages: int, latency: StageLatencyFn) -> StagePartition | None:
    """The partition of `num_layers` layers into `num_stages` non-empty contiguous stages minimising the largest
    stage latency (AlpaServe §4.1 DP); None when no partition is feasible (every one has an infinite stage)."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages must be in [1, num_layers={num_layers}], got {num_stages}")
    cache: dict[tuple[int, int], float] = {}

    def stage(i: int, k: int) -> float:
        if (i, k) not in cache:
            cache[(i, k)] = float(latency(i, k))
        return cache[(i, k)]

    # best[s][k]: F(s, k) over layers [0, k); cut[s][k]: start of the last stage in the optimum.
    best = [[math.inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[-1] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for k in range(s, num_layers + 1):
            for i in range(s - 1, k):  # last stage is layers [i, k), the first s-1 stages cover [0, i)
                if math.isinf(best[s - 1][i]):
                    continue
                value = max(best[s - 1][i], stage(i, k))
                if value < best[s][k]:
                    best[s][k], cut[s][k] = value, i
    if math.isinf(best[num_stages][num_layers]):
        return None
    bounds: list[tuple[int, int]] = []
    k = num_layers
    for s in range(num_stages, 0, -1):
        i = cut[s][k]
        bounds.append((i, k))
        k = i
    bounds.reverse()
    return StagePartition(bounds=bounds, stage_latencies_s=[stage(i, k) for i, k in bounds])


def summed_stage_latency(layer_latency_s: Sequence[float], receive_s: Sequence[float], weight_bytes: Sequence[int],
                         memory_budget_bytes: float) -> StageLatencyFn:
    """AlpaServe's latency(i, k) from per-layer figures: the layers' summed latency plus the cost of receiving the
    stage's input (`receive_s[i]`: the input of layer i arriving from elsewhere); infinite when the stage's
    weights exceed `memory_budget_bytes`."""
    if not len(layer_latency_s) == len(receive_s) == len(weight_bytes):
        raise ValueError("layer_latency_s, receive_s and weight_bytes need one entry per layer")

    def latency(i: int, k: int) -> float:
        if sum(weight_bytes[i:k]) > memory_budget_bytes:
            return math.inf
        return receive_s[i] + sum(layer_latency_s[i:k])

    return latency
