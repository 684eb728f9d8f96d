"""Baselines in the planner's interface (AlpaServe §6.2): Selective Replication, round robin, and Clockwork++.

* Selective Replication (SR): AlpaServe's placement algorithm without model parallelism (every group one device).
* Round robin: models dealt to single devices in turn, replicas added while memory lasts (no simulator).
* Clockwork++: re-places with SR's algorithm at every window boundary on that window's actual traffic, with zero
  swap cost (the paper's upper bound of Clockwork). Windows are simulated one after another with empty queues at
  each boundary (in-flight work is not carried over), a simplification of a zero-cost swap.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from placement.alpaserve.planner import PlannerConfig, plan
from placement.alpaserve.simulator import SimulatorConfig, simulate
from placement.core.placement_plan import GroupPlacement, Placement, SearchStats
from placement.core.profiles import ParallelConfig, ProfileSet
from placement.core.workload import Workload

logger = logging.getLogger(__name__)

#: Clockwork++ window (AlpaServe §6.2 footnote 5: 60 s for MAF1; re-placement every two windows).
DEFAULT_CLOCKWORK_WINDOW_S = 120.0


def selective_replication(model_names: Sequence[str], profiles: ProfileSet, workload: Workload, num_devices: int,
                          device_memory_bytes: int, config: PlannerConfig | None = None) -> Placement:
    """SR: the AlpaServe planner restricted to single-device groups running whole models, their replicas chosen
    by Alg. 1 alone (without the planner's load-proportional candidate, which is Serve's layout, not SR's)."""
    config = replace(config or PlannerConfig(), allow_model_parallelism=False, load_proportional_candidate=False,
                     name="selective_replication")
    return plan(model_names, profiles, workload, num_devices, device_memory_bytes, config)


def round_robin(model_names: Sequence[str], profiles: ProfileSet, workload: Workload, num_devices: int,
                device_memory_bytes: int, simulator: SimulatorConfig | None = None) -> Placement:
    """Deal models to devices in turn (model i to device i mod N, then the next round of replicas) while they fit."""
    started = time.perf_counter()
    single = ParallelConfig()
    weight = {n: profiles.models[n].get(single).weight_bytes_per_device() for n in model_names}
    hosted: list[list[str]] = [[] for _ in range(num_devices)]
    used = [0] * num_devices
    device = 0
    progress = True
    while progress:
        progress = False
        for name in model_names:
            for attempt in range(num_devices):  # next device, in turn, that can still take it
                d = (device + attempt) % num_devices
                if name not in hosted[d] and used[d] + weight[name] <= device_memory_bytes:
                    hosted[d].append(name)
                    used[d] += weight[name]
                    device = (d + 1) % num_devices
                    progress = True
                    break
    groups = [GroupPlacement(num_devices=1, config=single, models=m) for m in hosted if m]
    result = Placement(groups=groups)
    attainment = simulate(result, profiles, workload, simulator).slo_attainment()
    stats = SearchStats(planner="round_robin", wall_time_s=time.perf_counter() - started, simulations=1)
    return result.model_copy(update={"predicted_slo_attainment": attainment, "stats": stats})


@dataclass
class WindowPlacement:
    start_s: float
    end_s: float
    placement: Placement
    requests: int
    served: int


@dataclass
class DynamicResult:
    """Clockwork++'s placements over time and what they achieved."""

    windows: list[WindowPlacement] = field(default_factory=list)

    @property
    def slo_attainment(self) -> float:
        total = sum(w.requests for w in self.windows)
        return sum(w.served for w in self.windows) / total if total else 1.0


def clockwork_plus_plus(model_names: Sequence[str], profiles: ProfileSet, workload: Workload, num_devices: int,
                        device_memory_bytes: int, window_s: float = DEFAULT_CLOCKWORK_WINDOW_S,
                        config: PlannerConfig | None = None) -> DynamicResult:
    """Clockwork++ (AlpaServe §6.2): every `window_s`, SR's algorithm on that window's actual arrivals."""
    if window_s <= 0:
        raise ValueError(f"window_s={window_s}: must be > 0")
    config = replace(config or PlannerConfig(), allow_model_parallelism=False, name="clockwork++")
    result = DynamicResult()
    if not len(workload):
        return result
    start = float(workload.arrival_s[0])
    end = float(workload.arrival_s[-1])
    edges = np.arange(start, end + window_s, window_s)
    for lo, hi in zip(edges, edges[1:]):
        part = workload.window(lo, hi)
        if not len(part):
            continue
        placement = plan(model_names, profiles, part, num_devices, device_memory_bytes, config)
        served = int(simulate(placement, profiles, part, config.simulator).served.sum())
        result.windows.append(WindowPlacement(float(lo), float(hi), placement, len(part), served))
        logger.debug("clockwork++ window [%.0f, %.0f): %d requests, %d served", lo, hi, len(part), served)
    return result
