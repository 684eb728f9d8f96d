"""The AlpaServe placement planner (§4.2): Algorithm 1 (simulator-guided greedy model selection with beam search,
and its fast variant) inside Algorithm 2 (enumeration of model buckets, device buckets, group partitions and
parallel configurations, with the paper's pruning), under a per-device memory constraint.

Selective Replication (SR, §6.2) is this planner with model parallelism switched off (every group one device);
see :mod:`placement.alpaserve.baselines` for SR, round robin and Clockwork++.

Beyond the paper (each a `PlannerConfig` field; issue 15 measured why, see benchmarks/planner_quality.py):

* the enumeration adds two-size ("uneven") group partitions to the paper's equal groups, and every parallel
  configuration of a group size is a candidate (so "every group 4 devices, 4 stages" always is);
* candidates are ranked cheaply first (the fast variant with about an eighth of the replicas per simulation, on
  the leading half of the workload) and only the best few are planned in full (`screen_keep`, `screen_fraction`);
* the fast variant keeps filling memory once every planning request is served (`fill_memory`): more replicas
  absorb the bursts a finite planning sample lacks;
* candidates that serve the planning workload about equally well (within `tie_tolerance`, both above
  :data:`STRESS_MIN_ATTAINMENT`) are told apart by denser replays of it (`stress_factors`): on bursty traffic
  (CV 4) every partition may serve a 100 s sample fully while one-device groups miss many more held-out SLOs;
* (model buckets, device split) pairs are ranked by their screened candidates and only the best few planned in
  full (`combos_keep`); all models in one bucket is also a candidate (`one_bucket_candidate`): the paper's
  latency-ratio rule can cut the winner (it does on the six-model Table 1 mix);
* where the case is small enough (`lookahead_budget_requests`), the fast variant simulates a few models per round
  (`lookahead`) and a budgeted local search follows it (`refine_simulations`): close to beam search's
  attainment at a fraction of its simulations;
* a warm start: `plan(..., warm_start=running)` also scores the running placement and its groups re-selected;
* Serve's one-deployment-per-model layout is a candidate too (`load_proportional_candidate`): single-device groups,
  each model with replicas in proportion to its offered load (rate x latency) while memory lasts. On steady,
  unskewed traffic Alg. 1's greedy, one replica at a time, can end below this layout; with it among the
  candidates the search returns no less than it.

`PlannerConfig.paper()` is the paper's search (Alg. 1 greedy, every divisor group size x profiled configuration
planned in full, ranked by planning attainment); `PlannerConfig()`, the project default, is the improved search
above. benchmarks/paper_claims.py scores both on held-out traffic. Further opt-in speed-ups for large cases:
several replicas per simulation in the full run too (`replicas_per_round`), and models ranked by unserved requests
per weight byte (`fast_rank`).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from placement.alpaserve.serve_baselines import proportional_deployments
from placement.alpaserve.simulator import LatencyCache, SimulatorConfig, simulate_groups
from placement.core.placement_plan import GroupPlacement, Placement, SearchStats
from placement.core.profiles import ParallelConfig, ProfileSet
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
#: Alg. 2 candidates planned in full after the cheap screening (0: every candidate in full, the paper's search).
DEFAULT_SCREEN_KEEP = 3
#: Simulations the local search after the fast variant may spend (0: none, the paper's fast variant). Measured
#: on planner_speed's 12-model x 8-device mix: the greedy alone ends 0.02-0.04 below beam search of size 3.
DEFAULT_REFINE_SIMULATIONS = 150
#: Local search: moves tried per step for the models with the most unserved requests (this many models)...
REFINE_TOP_MODELS = 3
#: ... against this many hosted replicas of the models with the fewest unserved requests per replica.
REFINE_SPARE_REPLICAS = 6
#: Look-ahead fast variant: models simulated per round under each of the two rankings...
DEFAULT_LOOKAHEAD = 3
#: ... used only where (replicas that fit) x (candidates per round) x (requests) stays within this many simulated
#: requests (about a fifth of a second of the compiled simulator): the 12-model x 8-device cases, not 48 x 64.
DEFAULT_LOOKAHEAD_BUDGET_REQUESTS = 5e6
#: (Model buckets, device split) pairs whose buckets are planned in full, the best by their screened candidates.
DEFAULT_COMBOS_KEEP = 3
#: Leading share of the (bucket's) workload the cheap screening ranks candidates on.
DEFAULT_SCREEN_FRACTION = 0.5
#: Uneven partitions: shares of the devices given to the larger of two group sizes...
UNEVEN_SHARES = (0.25, 0.5, 0.75)
#: ... pairing only the group sizes whose equal partitions screened best (this many of them).
UNEVEN_TOP_SIZES = 3
#: Candidates whose planning attainments differ by at most this are ranked by their attainment under stress.
DEFAULT_TIE_TOLERANCE = 0.001
#: Stress replays of the planning workload, this many times faster. A finite planning sample of bursty (CV 4)
#: traffic is often served fully by every candidate, while longer traffic holds denser bursts than the sample;
#: a moderately denser replay ranks candidates as held-out traffic does (on the 48 x 64 AlpaServe test case x1.5
#: orders one-, two-, four- and eight-device groups as held-out traffic does; x2 and more reward raw throughput,
#: which held-out traffic does not; benchmarks/planner_quality.py measures it).
DEFAULT_STRESS_FACTORS = (1.25, 1.5)
#: ... and only where both serve at least this share of the planning workload: under overload the replays measure
#: raw throughput, which the planning attainment already ranks (there the replays can prefer a partition that
#: serves less of the held-out traffic).
STRESS_MIN_ATTAINMENT = 0.99
#: How Alg. 2 enumerates group sizes: powers of two (the project default, with two-size partitions beside them) or
#: every divisor of the bucket's device count (the paper's equal groups with no remainder group).
GROUP_SIZE_RULES = ("powers_of_two", "divisors")
#: `PlannerConfig.paper()`: the largest group it enumerates (AlpaServe §6 uses groups of up to 32 GPUs for 104B
#: models; sizes no model has a profile for yield no candidate).
PAPER_MAX_GROUP_DEVICES = 64
#: `PlannerConfig.paper()`: device splits kept after the discrepancy pruning (§4.2 prunes by discrepancy only).
PAPER_MAX_DEVICE_SPLITS = 10**6


@dataclass
class PlannerConfig:
    """Knobs of Algorithms 1 and 2. The defaults are the project's improved search (module docstring);
    :meth:`paper` gives the search as published."""

    beam_size: int = 1  # AlpaServe Alg. 1: k (beam size)
    fast: bool = True  # the fast variant of Alg. 1: simulate once per placed replica (§4.2)
    replicas_per_round: int = 1  # fast variant: replicas placed per simulation (1 = the paper; 0 = auto, see below)
    patience: int | None = None  # fast variant: stop after this many rounds without a better attainment
    fast_rank: str = "unserved"  # fast variant: 'unserved' (the paper) or 'unserved_per_byte' (knapsack-like)
    allow_model_parallelism: bool = True  # False: Selective Replication (single-device groups only)
    max_group_devices: int = DEFAULT_MAX_GROUP_DEVICES
    group_sizes: tuple[int, ...] | None = None  # None: group_size_rule decides
    group_size_rule: str = "powers_of_two"  # 'powers_of_two' up to max_group_devices, or 'divisors' of the devices
    bucket_latency_ratio: float = DEFAULT_BUCKET_LATENCY_RATIO
    bucket_gap_ratio: float = DEFAULT_BUCKET_GAP_RATIO
    max_buckets: int = DEFAULT_MAX_BUCKETS
    device_bucket_discrepancy: float = DEFAULT_DEVICE_BUCKET_DISCREPANCY
    max_device_splits: int = DEFAULT_MAX_DEVICE_SPLITS
    screen_fraction: float = DEFAULT_SCREEN_FRACTION  # Alg. 2 speed-up: rank candidates on this leading share...
    screen_keep: int = DEFAULT_SCREEN_KEEP  # candidates per bucket planned in full after screening (0: all)
    uneven_partitions: bool = True  # Alg. 2: also two-size group partitions (beyond the paper's equal groups)
    combos_keep: int = DEFAULT_COMBOS_KEEP  # (model buckets, device split) pairs planned in full after screening
    one_bucket_candidate: bool = True  # Alg. 2: also all models in one bucket where the latency ratio splits them
    refine_simulations: int = DEFAULT_REFINE_SIMULATIONS  # fast variant (1 replica per round): local-search budget
    lookahead: int = DEFAULT_LOOKAHEAD  # fast variant: models simulated per round per ranking (0: the paper's)
    lookahead_budget_requests: float = DEFAULT_LOOKAHEAD_BUDGET_REQUESTS  # ... where rounds x candidates x requests fit
    fill_memory: bool = True  # fast variant: keep adding replicas once every request is served (ties: fuller wins)
    stress_factors: tuple[float, ...] = DEFAULT_STRESS_FACTORS  # ranking tie-break replays; () = the paper's ranking
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE  # attainment gap below which the stress replays decide
    load_proportional_candidate: bool = True  # Alg. 2: also single-device replicas in proportion to offered load
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)
    name: str = "alpaserve"

    @classmethod
    def paper(cls, fast: bool = False, **overrides) -> "PlannerConfig":
        """AlpaServe §4.2 as published: Alg. 1's simulator-guided greedy (beam size k = 1; `fast=True`: the
        paper's own heuristic for large workloads, one simulation per replica, the model with the most unserved
        requests to the least utilised group, stopping once every request is served) inside Alg. 2's enumeration:
        every group size that divides the bucket's devices (so no remainder group is ever formed), every parallel
        configuration profiled for that size, every device split that passes the paper's discrepancy pruning,
        every candidate planned in full and ranked by planning attainment alone.

        What the project default (`PlannerConfig()`) changes, each measured in benchmarks/planner_quality.py and
        benchmarks/paper_claims.py: the fast variant with a look-ahead and a local search (`lookahead`,
        `refine_simulations`), memory filled once every planning request is served (`fill_memory`), power-of-two
        group sizes plus two-size partitions (`uneven_partitions`), cheap screening of candidates
        (`screen_keep`, `combos_keep`), the all-in-one-bucket and load-proportional candidates and stress replays
        that break ties (`stress_factors`)."""
        settings = dict(beam_size=1, fast=fast, replicas_per_round=1, fast_rank="unserved",
                        max_group_devices=PAPER_MAX_GROUP_DEVICES, group_sizes=None, group_size_rule="divisors",
                        max_device_splits=PAPER_MAX_DEVICE_SPLITS, screen_keep=0, uneven_partitions=False,
                        one_bucket_candidate=False, refine_simulations=0, lookahead=0, fill_memory=False,
                        stress_factors=(), load_proportional_candidate=False, name="alpaserve-paper")
        settings.update(overrides)
        return cls(**settings)

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam_size={self.beam_size}: must be >= 1")
        if self.group_size_rule not in GROUP_SIZE_RULES:
            raise ValueError(f"group_size_rule={self.group_size_rule!r}: choose one of {GROUP_SIZE_RULES}")
        if self.fast_rank not in ("unserved", "unserved_per_byte"):
            raise ValueError(f"fast_rank={self.fast_rank!r}: choose 'unserved' or 'unserved_per_byte'")
        if self.max_group_devices < 1:
            raise ValueError(f"max_group_devices={self.max_group_devices}: must be >= 1")
        if self.lookahead < 0:
            raise ValueError(f"lookahead={self.lookahead}: must be >= 0")
        if self.refine_simulations < 0:
            raise ValueError(f"refine_simulations={self.refine_simulations}: must be >= 0")
        if self.combos_keep < 1:
            raise ValueError(f"combos_keep={self.combos_keep}: must be >= 1")
        if self.screen_keep < 0:
            raise ValueError(f"screen_keep={self.screen_keep}: must be >= 0")
        if not 0.0 < self.screen_fraction <= 1.0:
            raise ValueError(f"screen_fraction={self.screen_fraction}: must be in (0, 1]")
        if any(f <= 1.0 for f in self.stress_factors):
            raise ValueError(f"stress_factors={self.stress_factors}: every factor must be > 1")
        if self.tie_tolerance < 0:
            raise ValueError(f"tie_tolerance={self.tie_tolerance}: must be >= 0")


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
        if self.cache is None:
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
        if _lookahead_affordable(problem, models, groups, workload):
            return _refine(problem, models, _lookahead_greedy(problem, models, empty, workload), workload)
        return _refine(problem, models, _fast_greedy(problem, models, empty, workload), workload)
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
    sel = sel.copy()
    room = _Room(problem, sel, models)
    while True:
        result = _evaluate(problem, sel, workload)
        if best is None or sel.attainment > best.attainment or (
                problem.config.fill_memory and sel.attainment >= best.attainment):
            best, stale = sel.copy(), 0
        else:
            stale += 1
        saturated = sel.attainment >= 1.0
        if (saturated and not problem.config.fill_memory) or (
                problem.config.patience is not None and stale >= problem.config.patience):
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
        if saturated:  # every request served: fill the memory left in one round, busiest replicas first
            per_round = math.inf
        load = {n: total[index[n]] / (replicas[n] + 1) if n in index else 0.0 for n in models}
        for name in sorted(models, key=lambda n: (-value[n], -load[n], n)):
            if placed_now >= per_round or (unserved[name] == 0 and not problem.config.fill_memory):
                break
            if name in exhausted:
                continue
            feasible = room.feasible(name)
            if not len(feasible):
                exhausted.add(name)
                continue
            g = int(min(feasible, key=lambda g: (utilization[g], len(sel.models[g]), g)))
            room.add(g, name)
            sel.models[g].append(name)  # in place: `best` holds its own copy
            sel.memory[g] = [int(x) for x in room.used[g, : len(sel.memory[g])]]
            placed_now += 1
            if name in index:
                config = sel.groups[g][1]
                work = problem.cache.get(name, config)[1].sum() * config.intra_op_degree
                utilization[g] += total[index[name]] / (replicas[name] + 1) * work / (devices[g] * span)
        if placed_now == 0:
            break
    return best


def _lookahead_affordable(problem: _Problem, models: Sequence[str], groups: Sequence[tuple[int, ParallelConfig]],
                          workload: Workload) -> bool:
    """Whether the look-ahead variant's simulated requests (rounds x candidates x requests) fit its budget."""
    if problem.config.lookahead <= 0 or problem.config.replicas_per_round != 1 or not models:
        return False
    memory = sum(n * problem.device_memory_bytes for n, _ in groups)
    rounds = memory / float(np.mean([_min_weight(problem, n) for n in models]))
    return rounds * 2 * problem.config.lookahead * len(workload) <= problem.config.lookahead_budget_requests


def _lookahead_greedy(problem: _Problem, models: Sequence[str], sel: _Selection, workload: Workload) -> _Selection:
    """The fast variant of §4.2 with a look-ahead (beyond the paper), for cases small enough to afford it: each
    round simulates the `lookahead` best models by unserved requests and the `lookahead` best by unserved
    requests per weight byte, each on its feasible group with the lowest utilisation, and keeps the best; once
    every request is served (or no model with unserved requests fits) the plain fast variant fills the memory
    left. Between the fast variant (one
    simulation per replica) and Alg. 1's beam search (models x groups x beam per replica)."""
    index = {name: i for i, name in enumerate(workload.model_names)}
    total = np.bincount(workload.model, minlength=len(workload.model_names))
    span = max(workload.duration_s, 1e-9)
    devices = np.array([n for n, _ in sel.groups], dtype=float)
    room = _Room(problem, sel, models)
    result = _evaluate(problem, sel, workload)
    best = sel
    while sel.attainment < 1.0:
        _, good = result.per_model_counts()
        unserved = {n: int(total[index[n]] - good[index[n]]) if n in index else 0 for n in models}
        utilization = result.group_busy_seconds() / (devices * span)
        open_models = [n for n in models if unserved[n] > 0 and len(room.feasible(n))]
        by_count = sorted(open_models, key=lambda n: (-unserved[n], n))[: problem.config.lookahead]
        by_byte = sorted(open_models,
                         key=lambda n: (-unserved[n] / _min_weight(problem, n), n))[: problem.config.lookahead]
        chosen = None
        for name in dict.fromkeys(by_count + by_byte):
            g = int(min(room.feasible(name), key=lambda g: (utilization[g], len(sel.models[g]), g)))
            candidate = _add(problem, sel, g, name)
            candidate_result = _evaluate(problem, candidate, workload)
            if chosen is None or candidate.good > chosen[0].good:
                chosen = (candidate, candidate_result, g, name)
        if chosen is None:  # no model with unserved requests fits any more: fill what is left below
            break
        sel, result, g, name = chosen
        room.add(g, name)
        if sel.attainment > best.attainment or (problem.config.fill_memory and sel.attainment >= best.attainment):
            best = sel
    if problem.config.fill_memory:
        filled = _fast_greedy(problem, models, sel, workload)
        if filled.attainment >= best.attainment:
            best = filled
    return best


def _refine(problem: _Problem, models: Sequence[str], sel: _Selection, workload: Workload) -> _Selection:
    """Local search after the fast variant (beyond the paper), within `refine_simulations` simulations: for the
    :data:`REFINE_TOP_MODELS` models with the most unserved requests, try adding a replica to a group with room,
    or swapping it for one of :data:`REFINE_SPARE_REPLICAS` hosted replicas of models with more than one replica
    and the fewest unserved requests per replica, or dropping such a replica (which relieves its group); take the
    first move that serves more requests and start again. Alg. 1's beam search explores these placements at many times
    the simulations."""
    budget = problem.config.refine_simulations
    if budget <= 0 or problem.config.replicas_per_round != 1 or not sel.groups or sel.attainment >= 1.0:
        return sel
    index = {name: i for i, name in enumerate(workload.model_names)}
    spent = 0
    while spent < budget:
        result = simulate_groups([(n, c, m) for (n, c), m in zip(sel.groups, sel.models)], problem.cache, workload,
                                 problem.config.simulator)
        total, good = result.per_model_counts()
        unserved = {n: int(total[index[n]] - good[index[n]]) if n in index else 0 for n in models}
        replicas = {n: sum(n in placed for placed in sel.models) for n in models}
        needy = [n for n in sorted(models, key=lambda n: (-unserved[n], n)) if unserved[n] > 0][:REFINE_TOP_MODELS]
        spare = sorted(((g, m) for g, placed in enumerate(sel.models) for m in placed
                        if m not in needy and replicas.get(m, 0) > 1),
                       key=lambda gm: (unserved.get(gm[1], 0) / replicas[gm[1]], -replicas[gm[1]], gm))
        spare = spare[:REFINE_SPARE_REPLICAS]
        moves = [(g, None, n) for n in needy for g in range(len(sel.groups)) if _fits(problem, sel, g, n)]
        moves += [(g, out, n) for n in needy for g, out in spare if n not in sel.models[g]]
        moves += [(g, out, None) for g, out in spare]
        improved = False
        for g, out, into in moves:
            candidate = _move(problem, sel, g, out, into)
            if candidate is None:
                continue
            if spent >= budget:
                break
            _evaluate(problem, candidate, workload)
            spent += 1
            if candidate.good > sel.good:
                sel, improved = candidate, True
                break
        if not improved:
            break
    return sel


def _move(problem: _Problem, sel: _Selection, g: int, out: str | None, into: str | None) -> _Selection | None:
    """`sel` with replica `out` removed from group g and `into` added to it (either may be None); None if the
    result breaks the memory constraint."""
    new = sel.copy()
    if out is not None:
        new.models[g].remove(out)
        weights = _stage_weights(problem, out, sel.groups[g][1])
        new.memory[g] = [used - w for used, w in zip(new.memory[g], weights)]
    if into is not None:
        if not _fits(problem, new, g, into):
            return None
        new = _add(problem, new, g, into)
    return new


class _Room:
    """The memory constraint of §4.2 as arrays (used bytes per group and stage, which group hosts which model), so
    the fast variant checks a model against every group at once."""

    def __init__(self, problem: _Problem, sel: _Selection, models: Sequence[str]):
        num_stages = max((c.pipeline_stages for _, c in sel.groups), default=1)
        self.budget = problem.device_memory_bytes
        self.used = np.zeros((len(sel.groups), num_stages))
        for g, memory in enumerate(sel.memory):
            self.used[g, : len(memory)] = memory
        self.column = {name: i for i, name in enumerate(models)}
        self.hosted = np.zeros((len(sel.groups), len(models)), dtype=bool)
        for g, placed in enumerate(sel.models):
            for name in placed:
                if name in self.column:
                    self.hosted[g, self.column[name]] = True
        self.need: dict[str, np.ndarray] = {}
        configs = sorted({c for _, c in sel.groups}, key=lambda c: (c.intra_op_degree, c.pipeline_stages))
        which = np.array([configs.index(c) for _, c in sel.groups], dtype=np.int64)
        for name in models:
            rows = np.zeros((len(configs), num_stages))
            for i, config in enumerate(configs):
                weights = _stage_weights(problem, name, config)
                if weights is None:
                    rows[i] = np.inf
                else:
                    rows[i, : len(weights)] = weights
            self.need[name] = rows[which]

    def feasible(self, name: str) -> np.ndarray:
        """Indices of the groups that can still take a replica of `name`."""
        fits = np.all(self.used + self.need[name] <= self.budget, axis=1) & ~self.hosted[:, self.column[name]]
        return np.flatnonzero(fits)

    def add(self, g: int, name: str) -> None:
        self.used[g] += self.need[name][g]
        self.hosted[g, self.column[name]] = True


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
    partitions = []
    for size in _group_sizes(num_devices, config):
        groups = [size] * (num_devices // size)
        if num_devices % size:
            groups.append(num_devices % size)
        partitions.append(groups)
    return partitions


def _group_sizes(num_devices: int, config: PlannerConfig) -> list[int]:
    if config.group_sizes:
        sizes = config.group_sizes
    elif config.group_size_rule == "divisors":
        sizes = tuple(s for s in range(1, num_devices + 1) if num_devices % s == 0)
    else:
        sizes = tuple(2**i for i in range(int(math.log2(config.max_group_devices)) + 1))
    return [s for s in sizes if s <= num_devices and s <= config.max_group_devices]


def uneven_partitions(num_devices: int, config: PlannerConfig) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Two-size partitions beyond the paper's pruning (which keeps equal groups only, §4.2): `(large, n_large),
    (small, n_small)` with about each share of :data:`UNEVEN_SHARES` of the devices in groups of the larger size;
    devices left over by both sizes are not used (the sizes are powers of two, so none are when the count is)."""
    if not config.allow_model_parallelism or not config.uneven_partitions:
        return []
    sizes = _group_sizes(num_devices, config)
    seen, options = set(), []
    for small, large in itertools.combinations(sizes, 2):
        for share in UNEVEN_SHARES:
            n_large = round(share * num_devices / large)
            n_small = (num_devices - n_large * large) // small
            if n_large < 1 or n_small < 1 or (large, n_large, small, n_small) in seen:
                continue
            seen.add((large, n_large, small, n_small))
            options.append(((large, n_large), (small, n_small)))
    return options


def parallel_configs(profiles: ProfileSet, models: Sequence[str], sizes: Sequence[int],
                     allow_model_parallelism: bool) -> list[list[ParallelConfig]]:
    """`get_potential_parallel_configs` (§4.2 pruning): one configuration shared by all equal groups; the last,
    smaller group keeps the same intra-op degree when it divides its size and every model has a profile for it,
    else pipeline only if profiled; a remainder group with neither profile is not formed (its devices stay idle:
    a group no model can run on would host nothing). Each option lists (size, configuration) per formed group."""
    if not allow_model_parallelism:
        return [[ParallelConfig() for _ in sizes]]
    size = sizes[0]
    options = []
    for config in _common_configs(profiles, models, size):
        configs = [config] * sum(1 for s in sizes if s == size)
        for last in sizes[len(configs):]:
            op = config.intra_op_degree if last % config.intra_op_degree == 0 else 1
            candidates = [ParallelConfig(intra_op_degree=op, pipeline_stages=last // op),
                          ParallelConfig(intra_op_degree=1, pipeline_stages=last)]
            profiled = [c for c in candidates if c in _common_configs(profiles, models, last)]
            configs.append(profiled[0] if profiled else None)
        options.append(configs)
    return options


def _common_configs(profiles: ProfileSet, models: Sequence[str], size: int) -> list[ParallelConfig]:
    """Every parallel configuration of `size` devices that all `models` have a profile for."""
    common = set.intersection(*[{c.config for c in profiles.models[n].configs} for n in models])
    return sorted((c for c in common if c.num_devices == size), key=lambda c: (c.intra_op_degree, c.pipeline_stages))


def _stressed(workload: Workload, factor: float) -> Workload:
    """The workload replayed `factor` times faster (same requests, same SLOs): its bursts `factor` times denser."""
    start = workload.arrival_s[0] if len(workload) else 0.0
    return Workload(workload.model_names, start + (workload.arrival_s - start) / factor, workload.model,
                    workload.slo_s, workload.input_length_tokens, workload.task, workload.utility)


@dataclass
class _Scored:
    """A candidate's selection and its ranking score (requests served, then requests served under stress)."""

    selection: _Selection
    requests: int
    stress_good: int = 0
    stress_requests: int = 0

    @property
    def attainment(self) -> float:
        return self.selection.good / self.requests if self.requests else 1.0

    def better_than(self, other: "_Scored | None", tolerance: float) -> bool:
        """Alg. 2's comparison: more requests served within SLO; attainments within `tolerance` of each other are
        told apart by attainment under stress (beyond the paper: a planning sample that every candidate serves
        fully says nothing of the bursts it lacks, see :data:`DEFAULT_STRESS_FACTORS`)."""
        if other is None:
            return True
        total = max(self.requests, other.requests, 1)
        gap = (self.selection.good - other.selection.good) / total
        saturated = min(self.attainment, other.attainment) >= STRESS_MIN_ATTAINMENT
        if abs(gap) > tolerance or not (saturated and self.stress_requests and other.stress_requests):
            return gap > 0
        mine = self.stress_good / self.stress_requests
        theirs = other.stress_good / other.stress_requests
        return mine > theirs or (mine == theirs and gap > 0)

    @staticmethod
    def concat(parts: Sequence["_Scored"]) -> "_Scored":
        """Buckets' results together: one selection over all their groups."""
        merged = _Selection([g for p in parts for g in p.selection.groups],
                            [m for p in parts for m in p.selection.models],
                            [m for p in parts for m in p.selection.memory], good=sum(p.selection.good for p in parts))
        return _Scored(merged, sum(p.requests for p in parts), sum(p.stress_good for p in parts),
                       sum(p.stress_requests for p in parts))


def _score(problem: _Problem, sel: _Selection, workload: Workload, stressed: Sequence[Workload]) -> _Scored:
    """Attainment (already simulated by Alg. 1) plus requests served on each stressed replay."""
    scored = _Scored(sel, len(workload))
    for heavy in stressed:
        groups = [(n, c, m) for (n, c), m in zip(sel.groups, sel.models)]
        result = simulate_groups(groups, problem.cache, heavy, problem.config.simulator)
        problem.stats.simulations += 1
        scored.stress_good += int(result.served.sum())
        scored.stress_requests += len(heavy)
    return scored


def plan(model_names: Sequence[str], profiles: ProfileSet, workload: Workload, num_devices: int,
         device_memory_bytes: int, config: PlannerConfig | None = None,
         warm_start: Placement | None = None) -> Placement:
    """AlpaServe Alg. 2: enumerate model buckets, device buckets, group partitions and parallel configurations,
    place each bucket with Alg. 1 on its share of the workload, and keep the best concatenation. With screening
    on and more than `combos_keep` (model buckets, device split) pairs, the pairs are ranked by their buckets'
    best screened candidates first and only the best `combos_keep` are planned in full.

    `warm_start`, a running placement: it is a candidate as it runs, and so are its groups with their models
    re-selected by Alg. 1, so the search never returns a placement that serves fewer planning requests."""
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
    cache: dict[tuple, _Scored] = {}
    best: _Scored | None = None
    if warm_start is not None:
        best = _warm_candidates(problem, names, warm_start, num_devices)
    if config.load_proportional_candidate:
        proportional = _load_proportional_candidate(problem, names, num_devices)
        if proportional is not None and proportional.better_than(best, config.tie_tolerance):
            best = proportional
    bucket_options = model_buckets(profiles, names, config.bucket_latency_ratio, config.max_buckets,
                                   config.bucket_gap_ratio)
    logger.info("%s: %d models, %d devices, %d model-bucket options", config.name, len(names), num_devices,
                len(bucket_options))
    if all(len(buckets) > num_devices for buckets in bucket_options):
        bucket_options = [[sorted(names)]]  # fewer devices than buckets: one bucket for all models
    elif config.one_bucket_candidate and all(len(buckets) > 1 for buckets in bucket_options):
        bucket_options.append([sorted(names)])
    combos = []
    for buckets in bucket_options:
        if len(buckets) > num_devices:
            continue
        minimum = [_min_devices(profiles, b, device_memory_bytes) for b in buckets]
        splits = device_buckets(num_devices, [sum(demand[n] for n in b) for b in buckets],
                                config.device_bucket_discrepancy, config.max_device_splits, minimum)
        combos += [(buckets, split) for split in splits]
    screened: dict[tuple, _Screened] = {}
    if config.screen_keep and len(combos) > config.combos_keep:
        # Beyond the paper: rank (model buckets, device split) pairs by their buckets' best screened candidates
        # and run Alg. 1 in full only on the `combos_keep` best.
        ranked = []
        for order, (buckets, split) in enumerate(combos):
            parts = []
            for bucket, devices in zip(buckets, split):
                key = (tuple(bucket), devices)
                if key not in screened:
                    screened[key] = _screen_bucket(problem, bucket, devices)
                parts.append(screened[key].estimate)
            ranked.append((_Scored.concat(parts), order, (buckets, split)))
        combos = _top(ranked, config.combos_keep, config.tie_tolerance)
    for buckets, split in combos:
        chosen = []
        for bucket, devices in zip(buckets, split):
            key = (tuple(bucket), devices)
            if key not in cache:
                cache[key] = _best_for_bucket(problem, bucket, devices, screened.get(key))
            chosen.append(cache[key])
        candidate = _Scored.concat(chosen)
        if candidate.better_than(best, config.tie_tolerance):
            best = candidate
            logger.info("%s: new best %.4f with buckets of %s models on %s devices", config.name,
                        candidate.selection.good / max(len(workload), 1), [len(b) for b in buckets], list(split))
    if best is None:
        raise ValueError(f"no feasible placement of {len(names)} models on {num_devices} devices "
                         f"with device_memory_bytes={device_memory_bytes}")
    groups = [group for group in best.selection.placement().groups if group.models]
    stats.wall_time_s = time.perf_counter() - started
    return Placement(groups=groups, predicted_slo_attainment=best.selection.good / max(len(workload), 1), stats=stats)


def _warm_candidates(problem: _Problem, names: Sequence[str], running: Placement, num_devices: int) -> _Scored | None:
    """The warm start's two candidates (the running placement as is, less models no longer asked for; its groups
    re-selected by Alg. 1), the better one; None when the running placement no longer fits the cluster (more
    devices, a model or configuration without a profile, weights beyond the memory)."""
    if running.num_devices > num_devices or not running.groups:
        return None
    models = problem.profiles.models
    if any(n not in models or not models[n].has(g.config) for g in running.groups for n in g.models):
        return None
    try:
        running.check_memory(problem.profiles, problem.device_memory_bytes)
    except ValueError:
        return None
    groups = [(g.num_devices, g.config) for g in running.groups]
    hosted = [[n for n in g.models if n in names] for g in running.groups]
    workload, stressed = problem.workload, _stress_set(problem, problem.workload)
    incumbent = _Selection(groups, hosted, [[0] * c.pipeline_stages for _, c in groups])
    _evaluate(problem, incumbent, workload)
    best = _score(problem, incumbent, workload, stressed)
    reselected = _score(problem, greedy_selection(problem, names, groups, workload), workload, stressed)
    problem.stats.candidates += 2
    return reselected if reselected.better_than(best, problem.config.tie_tolerance) else best


def _load_proportional_candidate(problem: _Problem, names: Sequence[str], num_devices: int) -> _Scored | None:
    """Serve's one-deployment-per-model layout as a candidate of Alg. 2 (beyond the paper): single-device groups,
    replicas in proportion to offered load (:func:`placement.alpaserve.serve_baselines.proportional_deployments`),
    scored like every candidate. None where some model has no single-device profile or fits on no device."""
    single = ParallelConfig()
    if not names or any(not problem.profiles.models[n].has(single) for n in names):
        return None
    rate = dict(zip(problem.workload.model_names, problem.workload.rates()))
    try:
        layout = proportional_deployments(names, problem.profiles, [rate.get(n, 0.0) for n in names], num_devices,
                                          problem.device_memory_bytes)
    except ValueError:
        return None
    hosted: list[list[str]] = [[] for _ in range(num_devices)]
    for deployment in layout.deployments:
        for device in deployment.replica_devices:
            hosted[device] += deployment.models
    memory = [[sum(_stage_weights(problem, n, single)[0] for n in models)] for models in hosted]
    selection = _Selection([(1, single)] * num_devices, hosted, memory)
    workload = problem.workload
    _evaluate(problem, selection, workload)
    problem.stats.candidates += 1
    return _score(problem, selection, workload, _stress_set(problem, workload))


def _stress_set(problem: _Problem, workload: Workload) -> list[Workload]:
    return [_stressed(workload, f) for f in problem.config.stress_factors] if len(workload) > 1 else []


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


@dataclass
class _Screened:
    """A bucket's screening: the best screened candidate's score (an estimate) and the candidates kept."""

    estimate: _Scored
    keep: list


def _best_for_bucket(problem: _Problem, bucket: Sequence[str], devices: int,
                     screened: _Screened | None = None) -> _Scored:
    """The inner loops of Alg. 2 for one bucket: group partitions x parallel configurations, Alg. 1 each.

    Candidates: the paper's equal-group partitions with every parallel configuration of their size, and (beyond
    the paper's pruning) two-size partitions of the :data:`UNEVEN_TOP_SIZES` best-screened sizes, each size with
    its best-screened configuration (unscreened: every configuration pair). With more than `screen_keep`
    of them, every candidate is first ranked cheaply (:func:`_screen_bucket`) and only the `screen_keep` best
    are re-run with the configured Alg. 1 on all of it; `screen_keep=0` plans every candidate in full."""
    config = problem.config
    workload = problem.workload.for_models(bucket)
    stressed = _stress_set(problem, workload)
    uniform = _uniform_candidates(problem, bucket, devices)
    if len(workload) <= 1:  # no traffic to tell candidates apart: the equal partitions suffice
        return _plan_candidates(problem, bucket, devices, uniform, workload, stressed)
    if not 0 < config.screen_keep < len(uniform) + len(uneven_partitions(devices, config)):
        candidates = uniform + _uneven_candidates(problem, bucket, devices, None)
        return _plan_candidates(problem, bucket, devices, candidates, workload, stressed)
    screened = screened or _screen_bucket(problem, bucket, devices)
    return _plan_candidates(problem, bucket, devices, screened.keep, workload, stressed)


def _uniform_candidates(problem: _Problem, bucket: Sequence[str], devices: int) -> list:
    return [[(size, config) for size, config in zip(sizes, configs) if config is not None]
            for sizes in group_partitions(devices, problem.config)
            for configs in parallel_configs(problem.profiles, bucket, sizes, problem.config.allow_model_parallelism)]


def _screen_bucket(problem: _Problem, bucket: Sequence[str], devices: int) -> _Screened:
    """The cheap ranking of a bucket's candidates (beyond the paper): the fast variant with about an eighth of the
    replicas per simulation, on the leading `screen_fraction` of the bucket's workload, scored like Alg. 2 scores
    (requests served, then the stress replays); equal partitions first, then two-size partitions of the best
    sizes. Keeps the `screen_keep` best."""
    config = problem.config
    workload = problem.workload.for_models(bucket)
    start = workload.arrival_s[0] if len(workload) else 0.0
    screen = workload.window(start, start + config.screen_fraction * workload.duration_s) \
        if config.screen_fraction < 1.0 and len(workload) > 1 else workload
    screen_stressed = _stress_set(problem, screen)
    quick = _Problem(problem.profiles, screen, problem.device_memory_bytes,
                     replace(config, fast=True, replicas_per_round=0, refine_simulations=0, lookahead=0), problem.stats,
                     problem.cache, problem.weights)
    uniform = _uniform_candidates(problem, bucket, devices)
    ranked = [(_score(quick, greedy_selection(quick, bucket, groups, screen), screen, screen_stressed), order, groups)
              for order, groups in enumerate(uniform)]
    best_config: dict[int, tuple[_Scored, ParallelConfig]] = {}
    for scored, _, groups in ranked:
        size, group_config = groups[0]
        if size not in best_config or scored.better_than(best_config[size][0], config.tie_tolerance):
            best_config[size] = (scored, group_config)
    top_sizes = _top([(scored, size, size) for size, (scored, _) in best_config.items()], UNEVEN_TOP_SIZES,
                     config.tie_tolerance)
    uneven = _uneven_candidates(problem, bucket, devices, {s: best_config[s][1] for s in top_sizes})
    ranked += [(_score(quick, greedy_selection(quick, bucket, groups, screen), screen, screen_stressed),
                len(ranked) + order, groups) for order, groups in enumerate(uneven)]
    problem.stats.candidates += len(ranked)
    keep = _top(ranked, config.screen_keep, config.tie_tolerance)
    estimate = next(scored for scored, _, groups in ranked if groups is keep[0]) if keep else \
        _Scored(_Selection([], [], []), len(screen))
    logger.info("%s: bucket of %d models on %d devices: screened %d candidates, best %s",
                config.name, len(bucket), devices, len(ranked), [_describe(groups) for groups in keep])
    return _Screened(estimate, keep)


def _top(ranked: list[tuple[_Scored, int, list]], count: int, tolerance: float) -> list:
    """The `count` best candidates by :meth:`_Scored.better_than` (selection by repeated maximum: the comparison
    with a tolerance is no total order to sort by)."""
    left = list(ranked)
    kept = []
    while left and len(kept) < count:
        best = 0
        for i in range(1, len(left)):
            if left[i][0].better_than(left[best][0], tolerance):
                best = i
        kept.append(left.pop(best)[2])
    return kept


def _uneven_candidates(problem: _Problem, bucket: Sequence[str], devices: int,
                       chosen: dict[int, ParallelConfig] | None) -> list[list[tuple[int, ParallelConfig]]]:
    """Two-size partitions, each size with `chosen[size]` (None: every configuration pair of the two sizes)."""
    candidates = []
    for (large, n_large), (small, n_small) in uneven_partitions(devices, problem.config):
        if chosen is not None:
            pairs = [(chosen[large], chosen[small])] if large in chosen and small in chosen else []
        else:
            pairs = itertools.product(_common_configs(problem.profiles, bucket, large),
                                      _common_configs(problem.profiles, bucket, small))
        for big_config, small_config in pairs:
            candidates.append([(large, big_config)] * n_large + [(small, small_config)] * n_small)
    return candidates


def _plan_candidates(problem: _Problem, bucket: Sequence[str], devices: int, candidates: list,
                     workload: Workload, stressed: Sequence[Workload]) -> _Scored:
    """Alg. 1 in full on each candidate; the best by Alg. 2's comparison (:meth:`_Scored.better_than`)."""
    best: _Scored | None = None
    for groups in candidates:
        scored = _score(problem, greedy_selection(problem, bucket, groups, workload), workload, stressed)
        problem.stats.candidates += 1
        logger.debug("bucket of %d models on %d devices, groups %s: %.4f", len(bucket), devices, _describe(groups),
                     scored.selection.attainment)
        if scored.better_than(best, problem.config.tie_tolerance):
            best = scored
    return best or _Scored(_Selection([], [], []), len(workload))


def _describe(groups: Sequence[tuple[int, ParallelConfig]]) -> str:
    """'16x4:op1-pp4' for 16 groups of 4 devices running op1-pp4 (runs of equal groups collapsed)."""
    return " + ".join(f"{len(list(run))}x{n}:{c.key()}" for (n, c), run in itertools.groupby(groups))
