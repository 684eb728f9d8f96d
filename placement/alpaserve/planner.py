"""The AlpaServe placement planner (§4.2): Algorithm 1 (simulator-guided greedy model selection with beam search,
and its fast variant) inside Algorithm 2 (enumeration of model buckets, device buckets, group partitions and
parallel configurations, with the paper's pruning), under a per-device memory constraint.

Selective Replication (SR, §6.2) is this planner with model parallelism switched off (every group one device);
see :mod:`placement.alpaserve.baselines` for SR, round robin and Clockwork++.

The defaults follow the paper. Three speed-ups beyond it are opt-in (`PlannerConfig`), used by the benchmarks
for the 48-model x 64-device case: several replicas per simulation in the fast variant (`replicas_per_round`),
models ranked by unserved requests per weight byte (`fast_rank`), and candidates screened on the leading part
of the workload before the best few are planned on all of it (`screen_fraction`, `screen_keep`).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from placement.core.placement_plan import GroupPlacement, Placement, SearchStats
from placement.core.profiles import ParallelConfig, ProfileSet
from placement.alpaserve.simulator import LatencyCache, SimulatorConfig, simulate_groups
from placement.core.workload import Workload

logger = logging.getLogger(__name__)

#: Models whose single-device latencies differ by more than this factor never share a bucket (§4.2: convoy effect).
DEFAULT_BUCKET_LATENCY_RATIO = 2.0
#: Bucket boundaries are only placed between consecutive latency levels that differ by more than this factor.
DEFAULT_BUCKET_GAP_RATIO = 1.2
#: At most this many model buckets are enumerated.
DEFAULT_MAX_BUCKETS = 3
#: Device-bucket pruning (§4.2): keep splits whose per-bucket "capacity / demand" ratios differ by at most this
#: factor between the best- and worst-served bucket.
DEFAULT_DEVICE_BUCKET_DISCREPANCY = 2.0
#: ... and of those, at most this many splits, closest to proportional first.
DEFAULT_MAX_DEVICE_SPLITS = 3
#: replicas_per_round = 0: place about (replicas that fit in memory) / this many replicas per simulation.
AUTO_ROUNDS = 8
#: Largest device group considered (AlpaServe §6 uses up to 32 GPUs per group for 104B models).
DEFAULT_MAX_GROUP_DEVICES = 16


@dataclass
class PlannerConfig:
    """Knobs of Algorithms 1 and 2."""

    beam_size: int = 1  # AlpaServe Alg. 1: k (beam size)
    fast: bool = True  # the fast variant of Alg. 1: simulate once per placed replica (§4.2)
    replicas_per_round: int = 1  # fast variant: replicas placed per simulation (1 = the paper; 0 = auto, see below)
    patience: int | None = None  # fast variant: stop after this many rounds without a better attainment
    fast_rank: str = "unserved"  # fast variant: 'unserved' (the paper) or 'unserved_per_byte' (knapsack-like)
    allow_model_parallelism: bool = True  # False: Selective Replication (single-device groups only)
    max_group_devices: int = DEFAULT_MAX_GROUP_DEVICES
    group_sizes: tuple[int, ...] | None = None  # None: powers of two up to max_group_devices
    bucket_latency_ratio: float = DEFAULT_BUCKET_LATENCY_RATIO
    bucket_gap_ratio: float = DEFAULT_BUCKET_GAP_RATIO
    max_buckets: int = DEFAULT_MAX_BUCKETS
    device_bucket_discrepancy: float = DEFAULT_DEVICE_BUCKET_DISCREPANCY
    max_device_splits: int = DEFAULT_MAX_DEVICE_SPLITS
    screen_fraction: float = 1.0  # Alg. 2 speed-up: first rank candidates on this leading share of the workload...
    screen_keep: int = 2  # ... and re-run only this many best candidates per bucket on the whole workload
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)
    name: str = "alpaserve"

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam_size={self.beam_size}: must be >= 1")
        if self.fast_rank not in ("unserved", "unserved_per_byte"):
            raise ValueError(f"fast_rank={self.fast_rank!r}: choose 'unserved' or 'unserved_per_byte'")
        if self.max_group_devices < 1:
            raise ValueError(f"max_group_devices={self.max_group_devices}: must be >= 1")


@dataclass
class _Problem:
    """What every step of the search needs: the models, their profiles, the workload and the memory budget."""

    profiles: ProfileSet
    workload: Workload
    device_memory_bytes: int
    config: PlannerConfig
    stats: SearchStats
    cache: LatencyCache = None
    weights: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        batching = self.config.simulator.batching
        self.cache = LatencyCache(self.profiles, batching.max_batch_size if batching is not None else 1)


@dataclass
class _Selection:
    """A candidate model selection on fixed groups (Alg. 1's `sel`)."""

    groups: list[tuple[int, ParallelConfig]]
    models: list[list[str]]
    memory: list[list[int]]  # per group, per stage: weight bytes per device
    attainment: float = -1.0
    good: int = 0  # requests served within SLO

    def placement(self) -> Placement:
        return Placement(groups=[GroupPlacement(num_devices=n, config=c, models=list(m))
                                 for (n, c), m in zip(self.groups, self.models)])

    def key(self) -> tuple:
        return tuple(tuple(sorted(m)) for m in self.models)

    def copy(self) -> "_Selection":
        return _Selection(self.groups, [list(m) for m in self.models], [list(m) for m in self.memory],
                          self.attainment, self.good)


def _stage_weights(problem: _Problem, name: str, config: ParallelConfig) -> list[int] | None:
    key = (name, config.intra_op_degree, config.pipeline_stages)
    if key not in problem.weights:
        model = problem.profiles.models[name]
        problem.weights[key] = ([stage.weight_bytes_per_device for stage in model.get(config).stages]
                                if model.has(config) else None)
    return problem.weights[key]


def _fits(problem: _Problem, sel: _Selection, g: int, name: str) -> bool:
    """AlpaServe §4.2 memory constraint: every stage of the group keeps its weights within a device's memory."""
    if name in sel.models[g]:
        return False
    weights = _stage_weights(problem, name, sel.groups[g][1])
    if weights is None:
        return False
    return all(used + w <= problem.device_memory_bytes for used, w in zip(sel.memory[g], weights))


def _add(problem: _Problem, sel: _Selection, g: int, name: str) -> _Selection:
    new = sel.copy()
    new.models[g].append(name)
    weights = _stage_weights(problem, name, sel.groups[g][1])
    new.memory[g] = [used + w for used, w in zip(new.memory[g], weights)]
    return new


def _evaluate(problem: _Problem, sel: _Selection, workload: Workload):
    groups = [(n, c, m) for (n, c), m in zip(sel.groups, sel.models)]
    result = simulate_groups(groups, problem.cache, workload, problem.config.simulator)
    problem.stats.simulations += 1
    sel.good = int(result.served.sum())
    sel.attainment = sel.good / max(len(workload), 1)
    return result


def greedy_selection(problem: _Problem, models: Sequence[str], groups: list[tuple[int, ParallelConfig]],
                     workload: Workload) -> _Selection:
    """AlpaServe Alg. 1: add (model, group) replicas greedily by simulated SLO attainment, keeping the top
    `beam_size` selections each round, until no replica fits; return the best selection seen.

    With `config.fast` (the heuristic of §4.2): simulate once per round and give the model with the most unserved
    requests to the feasible group with the lowest utilisation (O((M + G) R S) instead of O(M G R S B)).
    """
    empty = _Selection(groups, [[] for _ in groups],
                       [[0] * c.pipeline_stages for _, c in groups])
    if problem.config.fast:
        return _fast_greedy(problem, models, empty, workload)
    best = empty
    _evaluate(problem, best, workload)
    beam = [empty]
    while True:
        seen: set[tuple] = set()
        new_sels: list[_Selection] = []
        for sel in beam:
            for name in models:
                for g in range(len(groups)):
                    if not _fits(problem, sel, g, name):
                        continue
                    candidate = _add(problem, sel, g, name)
                    if candidate.key() in seen:
                        continue
                    seen.add(candidate.key())
                    _evaluate(problem, candidate, workload)
                    new_sels.append(candidate)
        if not new_sels:
            break
        new_sels.sort(key=lambda s: -s.attainment)  # stable: ties keep enumeration order
        beam = new_sels[: problem.config.beam_size]
        if beam[0].attainment > best.attainment:
            best = beam[0]
    return best


def _fast_greedy(problem: _Problem, models: Sequence[str], sel: _Selection, workload: Workload) -> _Selection:
    """The fast heuristic of §4.2: simulate, then give the model with the most unserved requests to the feasible
    group with the lowest utilisation; repeat until no replica fits. With `replicas_per_round` > 1 the next models
    by unserved requests are placed in the same round, each group's utilisation raised by the load the new replica
    is expected to take (its requests / replicas x its device-seconds per request)."""
    index = {name: i for i, name in enumerate(workload.model_names)}
    total = np.bincount(workload.model, minlength=len(workload.model_names))
    span = max(workload.duration_s, 1e-9)
    devices = np.array([n for n, _ in sel.groups], dtype=float)
    per_round = problem.config.replicas_per_round
    if per_round == 0:
        memory = sum(n * problem.device_memory_bytes for n, _ in sel.groups)
        mean_weight = float(np.mean([_min_weight(problem, n) for n in models])) if models else 1.0
        per_round = max(1, round(memory / mean_weight / AUTO_ROUNDS))
    best: _Selection | None = None
    stale = 0
    exhausted: set[str] = set()  # models that fit no group any more (memory only fills up)
    while True:
        result = _evaluate(problem, sel, workload)
        if best is None or sel.attainment > best.attainment:
            best, stale = sel.copy(), 0
        else:
            stale += 1
        if sel.attainment >= 1.0 or (problem.config.patience is not None and stale >= problem.config.patience):
            break
        _, good = result.per_model_counts()
        unserved = {name: int(total[index[name]] - good[index[name]]) if name in index else 0 for name in models}
        utilization = result.group_busy_seconds() / (devices * span)
        replicas = {name: 0 for name in models}
        for placed in sel.models:
            for name in placed:
                replicas[name] = replicas.get(name, 0) + 1
        placed_now = 0
        if problem.config.fast_rank == "unserved_per_byte":
            value = {n: unserved[n] / _min_weight(problem, n) for n in models}
        else:
            value = unserved
        for name in sorted(models, key=lambda n: (-value[n], n)):
            if unserved[name] == 0 or placed_now >= per_round:
                break
            if name in exhausted:
                continue
            feasible = [g for g in range(len(sel.groups)) if _fits(problem, sel, g, name)]
            if not feasible:
                exhausted.add(name)
                continue
            g = min(feasible, key=lambda g: (utilization[g], len(sel.models[g]), g))
            sel = _add(problem, sel, g, name)
            placed_now += 1
            if name in index:
                config = sel.groups[g][1]
                work = problem.cache.get(name, config)[1].sum() * config.intra_op_degree
                utilization[g] += total[index[name]] / (replicas[name] + 1) * work / (devices[g] * span)
        if placed_now == 0:
            break
    return best


def _min_weight(problem: _Problem, name: str) -> float:
    """Total weight bytes of a model (over all devices), the memory a replica costs."""
    key = ("total", name)
    if key not in problem.weights:
        profile = problem.profiles.models[name]
        problem.weights[key] = float(min(sum(s.weight_bytes_per_device for s in c.stages) * c.config.intra_op_degree
                                         for c in profile.configs)) or 1.0
    return problem.weights[key]


# ------------------------------------------------------------------------------------------- Algorithm 2
def model_buckets(profiles: ProfileSet, models: Sequence[str], latency_ratio: float, max_buckets: int,
                  gap_ratio: float = 1.0) -> list[list[list[str]]]:
    """`get_potential_model_buckets` (§4.2): every split of the models, sorted by single-device latency, into
    contiguous buckets such that no bucket holds two models whose latencies differ by more than `latency_ratio`;
    boundaries lie only where consecutive latencies differ by more than `gap_ratio` (pruning)."""
    latency = {name: _reference_latency(profiles, name) for name in models}
    ordered = sorted(models, key=lambda n: (latency[n], n))
    levels = sorted({round(latency[n], 9) for n in ordered})
    gaps = [i for i in range(1, len(levels)) if levels[i] > gap_ratio * levels[i - 1]]
    options = []
    for cuts in range(0, min(max_buckets, len(gaps) + 1)):
        for points in itertools.combinations(gaps, cuts):
            edges = [levels[0] - 1] + [levels[p] for p in points] + [math.inf]
            buckets = [[n for n in ordered if lo <= round(latency[n], 9) < hi] for lo, hi in zip(edges, edges[1:])]
            buckets = [b for b in buckets if b]
            if all(latency[b[-1]] <= latency_ratio * latency[b[0]] for b in buckets):
                options.append(buckets)
    if not options:  # the ratio forces more buckets than allowed: split at every level
        options.append([[n for n in ordered if round(latency[n], 9) == level] for level in levels])
    return options


def _reference_latency(profiles: ProfileSet, name: str) -> float:
    model = profiles.models[name]
    if model.has(ParallelConfig()):
        return model.single_device_latency()
    return min(c.latency() * c.config.num_devices for c in model.configs)


def device_buckets(num_devices: int, demands: Sequence[float], discrepancy: float, max_splits: int,
                   minimum: Sequence[int]) -> list[tuple[int, ...]]:
    """`get_potential_device_buckets` (§4.2): ways to give each bucket devices, pruned to splits whose
    capacity-to-demand ratios (devices / demand) differ by at most `discrepancy` across buckets, closest to the
    proportional split first. `minimum[i]` devices are needed to hold bucket i's models once."""
    k = len(demands)
    if k == 1:
        return [(num_devices,)]
    total = sum(demands) or 1.0
    proportional = [num_devices * d / total for d in demands]
    splits, fallback = [], []
    for counts in _compositions(num_devices, k):
        distance = sum(abs(c - p) for c, p in zip(counts, proportional))
        fallback.append((distance, counts))
        if any(c < m for c, m in zip(counts, minimum)):
            continue
        ratios = [c / max(d, 1e-12) for c, d in zip(counts, demands)]
        if max(ratios) > discrepancy * min(ratios):
            continue
        splits.append((distance, counts))
    if not splits:  # nothing survives the pruning: keep the splits closest to proportional
        splits = fallback
    splits.sort()
    return [counts for _, counts in splits[:max_splits]]


def _compositions(n: int, k: int):
    if k == 1:
        yield (n,)
        return
    for first in range(1, n - k + 2):
        for rest in _compositions(n - first, k - 1):
            yield (first,) + rest


def group_partitions(num_devices: int, config: PlannerConfig) -> list[list[int]]:
    """`get_potential_group_partitions` (§4.2 pruning): equal groups of size s, plus one last group with the rest."""
    if not config.allow_model_parallelism:
        return [[1] * num_devices]
    sizes = config.group_sizes or tuple(2**i for i in range(int(math.log2(config.max_group_devices)) + 1))
    partitions = []
    for size in sizes:
        if size > num_devices or size > config.max_group_devices:
            continue
        groups = [size] * (num_devices // size)
        if num_devices % size:
            groups.append(num_devices % size)
        partitions.append(groups)
    return partitions


def parallel_configs(profiles: ProfileSet, models: Sequence[str], sizes: Sequence[int],
                     allow_model_parallelism: bool) -> list[list[ParallelConfig]]:
    """`get_potential_parallel_configs` (§4.2 pruning): one configuration shared by all equal groups; the last,
    smaller group keeps the same intra-op degree when it divides its size (else pipeline only)."""
    if not allow_model_parallelism:
        return [[ParallelConfig() for _ in sizes]]
    common = set.intersection(*[{c.config for c in profiles.models[n].configs} for n in models])
    size = sizes[0]
    options = []
    for config in sorted(common, key=lambda c: (c.intra_op_degree, c.pipeline_stages)):
        if config.num_devices != size:
            continue
        configs = [config] * sum(1 for s in sizes if s == size)
        for last in sizes[len(configs):]:
            op = config.intra_op_degree if last % config.intra_op_degree == 0 else 1
            configs.append(ParallelConfig(intra_op_degree=op, pipeline_stages=last // op))
        options.append(configs)
    return options


@dataclass
class _BucketResult:
    selection: _Selection
    requests: int


def plan(model_names: Sequence[str], profiles: ProfileSet, workload: Workload, num_devices: int,
         device_memory_bytes: int, config: PlannerConfig | None = None) -> Placement:
    """AlpaServe Alg. 2: enumerate model buckets, device buckets, group partitions and parallel configurations,
    place each bucket with Alg. 1 on its share of the workload, and keep the best concatenation."""
    config = config or PlannerConfig()
    started = time.perf_counter()
    missing = [n for n in model_names if n not in profiles.models]
    if missing:
        raise ValueError(f"models without a profile: {missing}")
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices}: must be >= 1")
    stats = SearchStats(planner=config.name)
    problem = _Problem(profiles, workload, device_memory_bytes, config, stats)
    names = list(model_names)
    rates = workload.rates()
    index = {n: i for i, n in enumerate(workload.model_names)}
    demand = {n: (rates[index[n]] if n in index else 0.0) * _reference_latency(profiles, n) for n in names}
    cache: dict[tuple, _BucketResult] = {}
    best: tuple[float, list[_Selection]] | None = None
    bucket_options = model_buckets(profiles, names, config.bucket_latency_ratio, config.max_buckets,
                                   config.bucket_gap_ratio)
    logger.info("%s: %d models, %d devices, %d model-bucket options", config.name, len(names), num_devices, len(bucket_options))
    if all(len(buckets) > num_devices for buckets in bucket_options):
        bucket_options = [[sorted(names)]]  # fewer devices than buckets: one bucket for all models
    for buckets in bucket_options:
        if len(buckets) > num_devices:
            continue
        minimum = [_min_devices(profiles, b, device_memory_bytes) for b in buckets]
        splits = device_buckets(num_devices, [sum(demand[n] for n in b) for b in buckets],
                                config.device_bucket_discrepancy, config.max_device_splits, minimum)
        for split in splits:
            chosen = []
            for bucket, devices in zip(buckets, split):
                key = (tuple(bucket), devices)
                if key not in cache:
                    cache[key] = _best_for_bucket(problem, bucket, devices)
                chosen.append(cache[key])
            good = sum(r.selection.good for r in chosen)
            attainment = good / max(len(workload), 1)
            if best is None or attainment > best[0]:
                best = (attainment, [r.selection for r in chosen])
                logger.info("%s: new best %.4f with buckets of %s models on %s devices", config.name, attainment,
                            [len(b) for b in buckets], list(split))
    if best is None:
        raise ValueError(f"no feasible placement of {len(names)} models on {num_devices} devices "
                         f"with device_memory_bytes={device_memory_bytes}")
    groups = [group for sel in best[1] for group in sel.placement().groups if group.models]
    stats.wall_time_s = time.perf_counter() - started
    return Placement(groups=groups, predicted_slo_attainment=best[0], stats=stats)


def select_models(model_names: Sequence[str], profiles: ProfileSet, workload: Workload,
                  groups: Sequence[tuple[int, ParallelConfig]], device_memory_bytes: int,
                  config: PlannerConfig | None = None) -> Placement:
    """AlpaServe Alg. 1 alone, on a fixed group partition and parallel configurations: which models each given
    group hosts. The live controller's warm start: re-selecting models on the running groups restarts nothing."""
    config = config or PlannerConfig()
    stats = SearchStats(planner=f"{config.name}-select")
    started = time.perf_counter()
    problem = _Problem(profiles, workload, device_memory_bytes, config, stats)
    selection = greedy_selection(problem, list(model_names), list(groups), workload)
    stats.wall_time_s = time.perf_counter() - started
    placement = selection.placement()
    return placement.model_copy(update={"predicted_slo_attainment": max(selection.attainment, 0.0), "stats": stats})


def place_unplaced(placement: Placement, model_names: Sequence[str], profiles: ProfileSet,
                   device_memory_bytes: int) -> tuple[Placement, list[str]]:
    """Give every model of `model_names` that no group hosts one replica, in the group with the fewest models whose
    devices still have room for it; returns the placement and the models that fit nowhere.

    Alg. 1 places replicas for the requests of its workload only, so a model without recent traffic would be left
    out; a live system must still answer it (a replica without traffic costs memory, not attainment)."""
    groups = [group.model_copy(update={"models": list(group.models)}) for group in placement.groups]
    left_out = []
    for name in model_names:
        if any(name in group.models for group in groups):
            continue
        model = profiles.models[name]
        fitting = []
        for index, group in enumerate(groups):
            if not model.has(group.config):
                continue
            used = [0] * group.config.pipeline_stages
            for hosted in group.models:
                for k, stage in enumerate(profiles.models[hosted].get(group.config).stages):
                    used[k] += stage.weight_bytes_per_device
            extra = [stage.weight_bytes_per_device for stage in model.get(group.config).stages]
            if all(u + e <= device_memory_bytes for u, e in zip(used, extra)):
                fitting.append(index)
        if not fitting:
            left_out.append(name)
            continue
        target = min(fitting, key=lambda i: (len(groups[i].models), i))
        groups[target].models.append(name)
    return placement.model_copy(update={"groups": groups}), left_out


def _min_devices(profiles: ProfileSet, bucket: Sequence[str], device_memory_bytes: int) -> int:
    weights = sum(profiles.models[n].get(ParallelConfig()).weight_bytes_per_device()
                  if profiles.models[n].has(ParallelConfig()) else 0 for n in bucket)
    return max(1, math.ceil(weights / device_memory_bytes) if weights else 1)


def _best_for_bucket(problem: _Problem, bucket: Sequence[str], devices: int) -> _BucketResult:
    """The inner loops of Alg. 2 for one bucket: every group partition x parallel configuration, Alg. 1 each.

    With `screen_fraction` < 1 every candidate is first ranked by Alg. 1 on the leading part of the workload and
    only the `screen_keep` best are re-run on all of it (a pruning speed-up beyond the paper's)."""
    workload = problem.workload.for_models(bucket)
    candidates = [list(zip(sizes, configs))
                  for sizes in group_partitions(devices, problem.config)
                  for configs in parallel_configs(problem.profiles, bucket, sizes, problem.config.allow_model_parallelism)]
    logger.info("%s: bucket of %d models on %d devices: %d candidate partitions x configs (%d simulations so far)",
                problem.config.name, len(bucket), devices, len(candidates), problem.stats.simulations)
    fraction = problem.config.screen_fraction
    if fraction < 1.0 and len(candidates) > problem.config.screen_keep and len(workload) > 1:
        start = workload.arrival_s[0]
        screen = workload.window(start, start + fraction * workload.duration_s)
        scored = []
        for order, groups in enumerate(candidates):
            sel = greedy_selection(problem, bucket, groups, screen)
            problem.stats.candidates += 1
            scored.append((-sel.good, order))
        scored.sort()
        candidates = [candidates[order] for _, order in scored[: problem.config.screen_keep]]
    best: _Selection | None = None
    for groups in candidates:
        sel = greedy_selection(problem, bucket, groups, workload)
        problem.stats.candidates += 1
        logger.debug("bucket of %d models on %d devices, groups %s: %.4f", len(bucket), devices,
                     [f"{n}:{c.key()}" for n, c in groups], sel.attainment)
        if best is None or sel.good > best.good:
            best = sel
    if best is None:
        best = _Selection([], [], [])
    return _BucketResult(best, len(workload))
