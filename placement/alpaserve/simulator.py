"""The discrete-event simulator: how a placement serves a workload (AlpaServe §5), deterministic for a workload.

Each device group runs a pipeline of `pipeline_stages` stages. A request dispatched to a group enters stage k as
soon as it has left stage k-1 and stage k is free, so consecutive requests overlap (AlpaServe §3.4). Groups serve
FCFS. Dispatch is a :mod:`placement.alpaserve.dispatch` policy (default: shortest queue with SLO admission, §4.3);
batching is an optional :mod:`placement.alpaserve.batching` policy (§6.5). Fixed per-request overheads (before the first
stage and after the last) are named parameters.

Devices that share one host (a plexserve addition, not in AlpaServe, whose devices are GPUs of their own): with
`host_contention_per_busy_device` > 0 a batch's stage latencies are that much longer per device of the *other*
groups busy when the batch starts (running a batch, or holding a request ready to start one). It is the stand-in for
logical devices that are shares of the same CPU cores, where a device serves slower while its neighbours compute;
on a GPU cluster it is 0.

Two engines give identical results:

* a compiled kernel (numba, when installed) for the built-in policies: millions of requests per second;
* a reference loop in plain Python that calls any policy object through its `choose` / `batch_size` methods.

Statuses: served within its SLO, served late (only without admission), rejected (admission said no, or the
batch former found it could no longer finish in time), unplaced (no group hosts its model). Only the first
counts towards SLO attainment.
"""

from __future__ import annotations

import logging
import math
from collections import namedtuple
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from placement.alpaserve.batching import BatchPolicy, MaxBatchWithinSLO
from placement.alpaserve.dispatch import (
    KERNEL_EARLIEST_FINISH,
    KERNEL_ROUND_ROBIN,
    DispatchPolicy,
    GroupView,
    ShortestQueueDispatch,
)
from placement.core.placement_plan import Placement
from placement.core.profiles import ParallelConfig, ProfileSet
from placement.core.workload import Workload
from placement.sim.outcomes import LATE, REJECTED, SERVED, UNPLACED, RequestOutcomes

try:  # numba compiles the kernels; without it they run as (slow) plain Python with the same results.
    from numba import njit
    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is a declared dependency
    HAVE_NUMBA = False

    def njit(*args, **kwargs):
        if args and callable(args[0]):
            return args[0]
        return lambda f: f

logger = logging.getLogger(__name__)

# Statuses (placement.sim.outcomes): SERVED, LATE (possible only without SLO admission), REJECTED (refused at
# admission or dropped by the batch former), UNPLACED (no group hosts the model).

#: Default width of the utilisation time bins, seconds.
DEFAULT_UTILIZATION_BIN_S = 1.0
#: Latency percentiles reported in summaries.
LATENCY_PERCENTILES = (50, 90, 99)
#: Largest host-contention share per busy device accepted (a device ten times slower per busy neighbour is a typo).
MAX_HOST_CONTENTION = 10.0


@dataclass
class SimulatorConfig:
    """How the simulated system behaves."""

    dispatch: DispatchPolicy = field(default_factory=ShortestQueueDispatch)
    batching: BatchPolicy | None = None  # None: every request runs alone
    request_overhead_s: float = 0.0  # fixed time before the first stage (ingress, dispatch, transfer)
    response_overhead_s: float = 0.0  # fixed time after the last stage (result transfer)
    # A batch's stage latencies grow by this share per device of the other groups busy when it starts (devices
    # sharing a host's cores; 0: devices of their own, as AlpaServe's GPUs).
    host_contention_per_busy_device: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.host_contention_per_busy_device <= MAX_HOST_CONTENTION:
            raise ValueError(f"host_contention_per_busy_device={self.host_contention_per_busy_device}: must be in "
                             f"[0, {MAX_HOST_CONTENTION}]")


# --------------------------------------------------------------------------------------------- compiled tables
@dataclass
class _Tables:
    """The placement and profiles as dense arrays indexed by (group, model, batch size, stage)."""

    host_ptr: np.ndarray  # int64[M + 1]: groups hosting model m are host_groups[host_ptr[m]:host_ptr[m + 1]]
    host_groups: np.ndarray  # int64, sorted by group id within a model
    group_ptr: np.ndarray  # int64[G + 1]: models of group g are group_models[group_ptr[g]:group_ptr[g + 1]]
    group_models: np.ndarray  # int64
    latency: np.ndarray  # float64[G, M, B + 1, K]: stage latency of a batch of b (b >= 1) requests
    num_stages: np.ndarray  # int64[G]
    intra_op: np.ndarray  # int64[G]
    num_devices: np.ndarray  # int64[G]


class LatencyCache:
    """Stage latencies of (model, parallel config) by batch size as arrays, computed once (planners simulate
    thousands of placements over the same profiles)."""

    def __init__(self, profiles: ProfileSet, max_batch_size: int = 1):
        self.profiles = profiles
        self.max_batch_size = max_batch_size
        self._latency: dict[tuple[str, int, int], np.ndarray | None] = {}
        self._config_tables: dict[tuple, np.ndarray] = {}

    def get(self, name: str, config: ParallelConfig) -> np.ndarray | None:
        """float64[max_batch_size + 1, pipeline_stages] (row b: a batch of b; row 0 unused), None without a profile."""
        key = (name, config.intra_op_degree, config.pipeline_stages)
        if key not in self._latency:
            if name not in self.profiles.models:
                raise ValueError(f"model {name!r} has no profile")
            model = self.profiles.models[name]
            table = None
            if model.has(config):
                profile = model.get(config)  # stage times include the profile's per-hop overhead
                table = np.zeros((self.max_batch_size + 1, len(profile.stages)))
                for b in range(1, self.max_batch_size + 1):
                    table[b] = profile.stage_latencies(b)
            self._latency[key] = table
        return self._latency[key]

    def config_table(self, config: ParallelConfig, model_names: tuple[str, ...], num_stages: int) -> np.ndarray:
        """float64[models, max_batch_size + 1, num_stages]: every model's latencies under `config` (zeros for models
        without that configuration), padded to `num_stages` stages."""
        key = (config.intra_op_degree, config.pipeline_stages, model_names, num_stages)
        table = self._config_tables.get(key)
        if table is None:
            table = np.zeros((len(model_names), self.max_batch_size + 1, num_stages))
            for m, name in enumerate(model_names):
                if name in self.profiles.models:
                    own = self.get(name, config)
                    if own is not None:
                        table[m, :, : own.shape[1]] = own
            self._config_tables[key] = table
        return table


#: A device group as the simulator needs it: (devices, parallel config, hosted model names).
GroupSpec = tuple[int, ParallelConfig, Sequence[str]]


def build_tables(groups: Sequence[GroupSpec], cache: LatencyCache, model_names: Sequence[str]) -> _Tables:
    """Dense latency tables for the groups (models outside `model_names` are skipped). Row [g, m] holds model m's
    latencies under group g's configuration; the kernels read it only for the models g hosts."""
    names_key = tuple(model_names)
    index = {name: i for i, name in enumerate(names_key)}
    num_models = len(names_key)
    max_stages = max((config.pipeline_stages for _, config, _ in groups), default=1)
    hosts: list[list[int]] = [[] for _ in range(num_models)]
    group_models: list[list[int]] = []
    for g, (_, config, names) in enumerate(groups):
        members = []
        for name in names:  # (simulate() has checked that every hosted model has a profile for `config`)
            m = index.get(name)
            if m is None:
                continue  # a placed model the workload never asks for
            hosts[m].append(g)
            members.append(m)
        group_models.append(sorted(members))
    if groups:
        latency = np.stack([cache.config_table(config, names_key, max_stages) for _, config, _ in groups])
    else:
        latency = np.zeros((0, num_models, cache.max_batch_size + 1, max_stages))
    host_ptr = np.zeros(num_models + 1, dtype=np.int64)
    host_ptr[1:] = np.cumsum([len(h) for h in hosts])
    group_ptr = np.zeros(len(groups) + 1, dtype=np.int64)
    group_ptr[1:] = np.cumsum([len(m) for m in group_models])
    flat = lambda lists: np.asarray([x for sub in lists for x in sub], dtype=np.int64)  # noqa: E731
    return _Tables(
        host_ptr=host_ptr, host_groups=flat(hosts), group_ptr=group_ptr, group_models=flat(group_models),
        latency=latency,
        num_stages=np.asarray([config.pipeline_stages for _, config, _ in groups], dtype=np.int64),
        intra_op=np.asarray([config.intra_op_degree for _, config, _ in groups], dtype=np.int64),
        num_devices=np.asarray([n for n, _, _ in groups], dtype=np.int64),
    )


# ------------------------------------------------------------------------------------------------- kernels
# The kernel keeps its state in a few arrays with named rows or columns (arrays passed inside tuples, or through
# many small inlined helpers, cost numba reference counting on every use: several times the simulation itself):
#   times  float64[5, N]   per request: arrival, deadline, start of the first stage, finish, busy device-seconds
#   ids    int64[8, N]     per request: model, group, batch size, status, and its successor in three lists
#   groups int64[G, 9]     per group: ends and length of its queue and of its started list, stages, intra-op degree,
#                          devices
#   stage_free float64[G, K], busy float64[G], model_queue int64[G, M, 2] (head, tail of one model's queue)
# plus the latency table, the routing table (host_ptr, host_groups, turn) and `_KernelKnobs` (scalars only).
ARRIVAL, DEADLINE, START, FINISH, DEVICE_S = range(5)
_TIME_FIELDS = 5
# The lists: a group's queued requests in arrival order, the queued requests of one (group, model) from which
# batches are cut, and a group's started, unfinished requests (finish times ascend); TAKEN marks a queued request
# already batched or dropped (it leaves the arrival-order list lazily).
MODEL, GROUP, BATCH, STATUS, NEXT_QUEUED, NEXT_OF_MODEL, NEXT_STARTED, TAKEN = range(8)
_ID_FIELDS = 8
QHEAD, QTAIL, QUEUED, FHEAD, FTAIL, INFLIGHT, NUM_STAGES, INTRA_OP, DEVICES = range(9)
_GROUP_FIELDS = 9
_KernelKnobs = namedtuple("_KernelKnobs", ["policy", "admission", "max_batch", "request_overhead", "response_overhead",
                                           "host_contention"])


@dataclass
class _KernelArrays:
    """Everything the kernels read and write, built from a workload and the tables."""

    times: np.ndarray
    ids: np.ndarray
    groups: np.ndarray
    stage_free: np.ndarray
    busy: np.ndarray
    model_queue: np.ndarray
    turn: np.ndarray

    @classmethod
    def build(cls, workload: Workload, tables: _Tables) -> "_KernelArrays":
        n, num_groups, num_models = len(workload), len(tables.num_stages), len(tables.host_ptr) - 1
        times = np.empty((_TIME_FIELDS, n))
        times[ARRIVAL] = workload.arrival_s
        np.add(workload.arrival_s, workload.slo_s, out=times[DEADLINE])
        times[DEVICE_S] = 0.0  # a request that never runs charges no device
        ids = np.empty((_ID_FIELDS, n), np.int64)  # the kernels write every other field of every request
        ids[MODEL] = workload.model
        ids[BATCH] = 1
        groups = np.full((num_groups, _GROUP_FIELDS), -1, np.int64)
        groups[:, QUEUED] = 0
        groups[:, INFLIGHT] = 0
        groups[:, NUM_STAGES] = tables.num_stages
        groups[:, INTRA_OP] = tables.intra_op
        groups[:, DEVICES] = tables.num_devices
        return cls(times, ids, groups, np.zeros((num_groups, tables.latency.shape[3])), np.zeros(num_groups),
                   np.full((num_groups, num_models, 2), -1, np.int64), np.zeros(num_models, np.int64))

    def result(self, workload: Workload, tables: _Tables) -> "SimulationResult":
        return SimulationResult(workload, self.times[START], self.times[FINISH], self.ids[GROUP],
                                self.ids[STATUS].astype(np.int8), self.ids[BATCH], tables, self.busy,
                                self.times[DEVICE_S])


def _kernel_knobs(config: SimulatorConfig, max_batch: int) -> tuple:
    return _KernelKnobs(int(getattr(config.dispatch, "kernel_code", 0)),
                        bool(getattr(config.dispatch, "slo_admission", True)), int(max_batch),
                        float(config.request_overhead_s), float(config.response_overhead_s),
                        float(config.host_contention_per_busy_device))


@njit(cache=True)
def _pipeline_finish(latency, stage_free, num_stages, g, m, b, enter_s, slowdown):
    """Finish time of a batch of b entering group g's pipeline at enter_s (stage k starts when k is free), every
    stage `slowdown` times its profiled latency."""
    time = enter_s
    for k in range(num_stages):
        if stage_free[g, k] > time:
            time = stage_free[g, k]
        time += latency[g, m, b, k] * slowdown
    return time


@njit(cache=True)
def _pipeline_run(latency, stage_free, num_stages, g, m, b, enter_s, slowdown):
    """Run a batch through group g's pipeline, occupying every stage; returns (start of stage 0, finish)."""
    time = enter_s
    start = enter_s
    for k in range(num_stages):
        if stage_free[g, k] > time:
            time = stage_free[g, k]
        if k == 0:
            start = time
        time += latency[g, m, b, k] * slowdown
        stage_free[g, k] = time
    return start, time


@njit(cache=True, inline="always")
def _host_slowdown(g, enter_s, times, groups, stage_free, knobs):
    """Factor on the stage latencies of a batch that group g starts at max(enter_s, its first stage free): one plus
    `host_contention` per device of the other groups busy then (a batch in their pipeline, or a queued request
    ready to start one)."""
    if knobs.host_contention == 0.0:
        return 1.0
    at = enter_s if enter_s > stage_free[g, 0] else stage_free[g, 0]
    busy = 0
    for other in range(groups.shape[0]):
        if other == g:
            continue
        if (stage_free[other, groups[other, NUM_STAGES] - 1] > at
                or (groups[other, QUEUED] > 0
                    and times[ARRIVAL, groups[other, QHEAD]] + knobs.request_overhead <= at)):
            busy += groups[other, DEVICES]
    return 1.0 + knobs.host_contention * busy


@njit(cache=True)
def _not_run(i, status, times, ids):
    """Request i ends without running (unplaced or rejected)."""
    ids[STATUS, i] = status
    ids[GROUP, i] = -1
    times[START, i] = np.nan
    times[FINISH, i] = np.nan


@njit(cache=True, inline="always")
def _start_batch(g, m, size, enter, head, times, ids, groups, stage_free, busy, latency, knobs, slowdown):
    """Run the `size` requests of model m that follow each other from `head` (NEXT_OF_MODEL links) as one batch
    through group g's pipeline from `enter`: occupy its stages, charge its device time (to g, and in equal shares to
    the requests), record each request's start, finish (response overhead included), batch size and status, and
    append it to the group's started list. Returns the request after the batch (meaningless for an unqueued
    request, whose link is never set)."""
    s, f = _pipeline_run(latency, stage_free, groups[g, NUM_STAGES], g, m, size, enter, slowdown)
    device_s = 0.0
    for k in range(groups[g, NUM_STAGES]):
        device_s += latency[g, m, size, k] * slowdown * groups[g, INTRA_OP]
    busy[g] += device_s
    f += knobs.response_overhead
    r = head
    for _ in range(size):
        following = ids[NEXT_OF_MODEL, r]
        times[START, r] = s
        times[FINISH, r] = f
        times[DEVICE_S, r] = device_s / size
        ids[BATCH, r] = size
        ids[STATUS, r] = SERVED if f <= times[DEADLINE, r] else LATE
        if groups[g, FTAIL] == -1:
            groups[g, FHEAD] = r
        else:
            ids[NEXT_STARTED, groups[g, FTAIL]] = r
        groups[g, FTAIL] = r
        ids[NEXT_STARTED, r] = -1
        groups[g, INFLIGHT] += 1
        r = following
    return r


@njit(cache=True)
def _advance_group(g, t, times, ids, groups, stage_free, busy, model_queue, latency, knobs):
    """Start every batch of group g whose start time is <= t (AlpaServe §6.5 batching, FCFS across models,
    `MaxBatchWithinSLO`): the oldest queued request's model goes next, with the longest prefix of that model's
    queue whose finish meets every deadline in it; a head that misses its deadline even alone is dropped."""
    while groups[g, QUEUED] > 0:
        h = groups[g, QHEAD]
        m = ids[MODEL, h]
        enter = times[ARRIVAL, h] + knobs.request_overhead
        if stage_free[g, 0] > enter:
            enter = stage_free[g, 0]
        if enter > t:
            return
        slowdown = _host_slowdown(g, enter, times, groups, stage_free, knobs)
        size = 0
        earliest = np.inf
        r = h
        while r != -1 and size < knobs.max_batch and times[ARRIVAL, r] + knobs.request_overhead <= enter:
            d = times[DEADLINE, r] if times[DEADLINE, r] < earliest else earliest
            finish = _pipeline_finish(latency, stage_free, groups[g, NUM_STAGES], g, m, size + 1, enter, slowdown)
            if finish + knobs.response_overhead > d:
                break
            earliest = d
            size += 1
            r = ids[NEXT_OF_MODEL, r]
        if size == 0:
            ids[STATUS, h] = REJECTED
            times[START, h] = np.nan
            times[FINISH, h] = np.nan
            r = ids[NEXT_OF_MODEL, h]
            ids[TAKEN, h] = 1
            removed = 1
        else:
            r = _start_batch(g, m, size, enter, h, times, ids, groups, stage_free, busy, latency, knobs, slowdown)
            taken = h
            for _ in range(size):
                ids[TAKEN, taken] = 1
                taken = ids[NEXT_OF_MODEL, taken]
            removed = size
        model_queue[g, m, 0] = r
        if r == -1:
            model_queue[g, m, 1] = -1
        groups[g, QUEUED] -= removed
        head = groups[g, QHEAD]
        while head != -1 and ids[TAKEN, head]:
            head = ids[NEXT_QUEUED, head]
        groups[g, QHEAD] = head
        if head == -1:
            groups[g, QTAIL] = -1


@njit(cache=True)
def _enqueue(i, g, m, ids, groups, model_queue):
    """Queue request i at group g: at the end of the group's list and of its model's list there."""
    ids[NEXT_QUEUED, i] = -1
    ids[NEXT_OF_MODEL, i] = -1
    ids[TAKEN, i] = 0
    if model_queue[g, m, 1] == -1:
        model_queue[g, m, 0] = i
    else:
        ids[NEXT_OF_MODEL, model_queue[g, m, 1]] = i
    model_queue[g, m, 1] = i
    if groups[g, QTAIL] == -1:
        groups[g, QHEAD] = i
    else:
        ids[NEXT_QUEUED, groups[g, QTAIL]] = i
    groups[g, QTAIL] = i
    groups[g, QUEUED] += 1


@njit(cache=True)
def _kernel(times, ids, groups, stage_free, busy, model_queue, host_ptr, host_groups, turn, latency, knobs, batching):
    """Every request in arrival order: dispatch to a group hosting its model (AlpaServe §4.3: the shortest queue,
    counting queued and started, unfinished requests; the earliest finish; or round robin), SLO admission (run
    alone from now, would it finish by its deadline?), then straight into the group's pipeline, or, with
    `batching`, into the group's queue, from which `_advance_group` cuts batches. One kernel for both, so the
    dispatch and admission are written once; the helpers it calls are the ones the hot loop can afford (a call
    passes every array argument, an inlined one costs reference counting)."""
    for i in range(times.shape[1]):
        t = times[ARRIVAL, i]
        m = ids[MODEL, i]
        lo = host_ptr[m]
        hi = host_ptr[m + 1]
        if lo == hi:
            _not_run(i, UNPLACED, times, ids)
            continue
        enter = t + knobs.request_overhead
        best = -1
        best_key = np.inf
        for j in range(lo, hi):
            g = host_groups[j]
            if batching and groups[g, QUEUED] > 0:  # start the batches due by t, so the queue is current
                ready = times[ARRIVAL, groups[g, QHEAD]] + knobs.request_overhead
                if stage_free[g, 0] > ready:
                    ready = stage_free[g, 0]
                if ready <= t:
                    _advance_group(g, t, times, ids, groups, stage_free, busy, model_queue, latency, knobs)
            h = groups[g, FHEAD]  # retire the started requests finished by t
            while h != -1 and times[FINISH, h] <= t:
                h = ids[NEXT_STARTED, h]
                groups[g, INFLIGHT] -= 1
            groups[g, FHEAD] = h
            if h == -1:
                groups[g, FTAIL] = -1
            if knobs.policy == KERNEL_ROUND_ROBIN:
                continue
            if knobs.policy == KERNEL_EARLIEST_FINISH:
                key = _pipeline_finish(latency, stage_free, groups[g, NUM_STAGES], g, m, 1, enter,
                                       _host_slowdown(g, enter, times, groups, stage_free, knobs))
            else:
                key = float(groups[g, QUEUED] + groups[g, INFLIGHT])
            if key < best_key:
                best_key = key
                best = g
        if knobs.policy == KERNEL_ROUND_ROBIN:
            best = host_groups[lo + turn[m] % (hi - lo)]
            turn[m] += 1
        g = best
        slowdown = _host_slowdown(g, enter, times, groups, stage_free, knobs)
        if knobs.admission:
            alone = _pipeline_finish(latency, stage_free, groups[g, NUM_STAGES], g, m, 1, enter, slowdown)
            if alone + knobs.response_overhead > times[DEADLINE, i]:
                _not_run(i, REJECTED, times, ids)
                continue
        ids[GROUP, i] = g
        if batching:
            _enqueue(i, g, m, ids, groups, model_queue)
            continue
        _start_batch(g, m, 1, enter, i, times, ids, groups, stage_free, busy, latency, knobs, slowdown)  # one
    if batching:
        for g in range(groups.shape[0]):
            _advance_group(g, np.inf, times, ids, groups, stage_free, busy, model_queue, latency, knobs)


# ------------------------------------------------------------------------------------- reference engine
class _ReferenceEngine:
    """The same simulation in plain Python, calling the policy objects: any DispatchPolicy / BatchPolicy works."""

    def __init__(self, tables: _Tables, groups: Sequence[GroupSpec], model_names: list[str], config: SimulatorConfig,
                 workload: Workload, max_batch: int):
        self.t = tables
        self.names = model_names
        self.cfg = config
        self.w = workload
        self.max_batch = max_batch
        n, num_groups = len(workload), len(groups)
        known = set(model_names)
        self.group_names = [frozenset(name for name in names if name in known) for _, _, names in groups]
        self.stage_free = np.zeros((num_groups, tables.latency.shape[3]))
        self.start = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.group = np.full(n, -1, dtype=np.int64)
        self.status = np.zeros(n, dtype=np.int8)
        self.batch = np.ones(n, dtype=np.int64)
        self.unfinished: list[list[int]] = [[] for _ in range(num_groups)]  # FIFO, finish times ascending
        self.queues: list[dict[int, list[int]]] = [{} for _ in range(num_groups)]  # per model FIFO
        self.busy = np.zeros(num_groups)  # device-seconds per group
        self.device_s = np.zeros(n)  # device-seconds per request: its share of its batch's

    def _finish(self, g: int, m: int, b: int, enter: float) -> float:
        return float(_pipeline_finish(self.t.latency, self.stage_free, self.t.num_stages[g], g, m, b, enter,
                                      self._slowdown(g, enter)))

    def _run_batch(self, g: int, m: int, requests: list[int], enter: float) -> tuple[float, float]:
        """Occupy group g's pipeline with a batch of model m's `requests` and charge its device time to them
        (equal shares); (start of stage 0, finish)."""
        b = len(requests)
        slowdown = self._slowdown(g, enter)
        device_s = float(self.t.latency[g, m, b, : self.t.num_stages[g]].sum()) * slowdown * self.t.intra_op[g]
        self.busy[g] += device_s
        self.device_s[requests] = device_s / b
        return _pipeline_run(self.t.latency, self.stage_free, self.t.num_stages[g], g, m, b, enter, slowdown)

    def _slowdown(self, g: int, enter: float) -> float:
        """`_host_slowdown` of the compiled kernel: the other groups' devices busy when g's batch would start."""
        contention = self.cfg.host_contention_per_busy_device
        if contention == 0.0:
            return 1.0
        at = max(enter, float(self.stage_free[g, 0]))
        busy = 0
        for other in range(len(self.queues)):
            ready = [q[0] for q in self.queues[other].values() if q]
            if other != g and (self.stage_free[other, self.t.num_stages[other] - 1] > at or any(
                    self.w.arrival_s[r] + self.cfg.request_overhead_s <= at for r in ready)):
                busy += int(self.t.num_devices[other])
        return 1.0 + contention * busy

    def _retire(self, g: int, now: float) -> None:
        done = self.unfinished[g]
        while done and self.finish[done[0]] <= now:
            done.pop(0)

    def _view(self, g: int, m: int, now: float) -> GroupView:
        queued = sum(len(q) for q in self.queues[g].values())
        enter = now + self.cfg.request_overhead_s
        return GroupView(group_id=g, models=self.group_names[g], queue_length=queued + len(self.unfinished[g]),
                         free_at_s=float(self.stage_free[g, 0]),
                         finish_if_dispatched_s=self._finish(g, m, 1, enter) + self.cfg.response_overhead_s)

    def run(self) -> None:
        w, cfg, t = self.w, self.cfg, self.t
        batching = cfg.batching is not None
        for i in range(len(w)):
            now, m = float(w.arrival_s[i]), int(w.model[i])
            deadline = now + float(w.slo_s[i])
            hosts = t.host_groups[t.host_ptr[m]:t.host_ptr[m + 1]]
            if len(hosts) == 0:
                self.status[i] = UNPLACED
                continue
            views = []
            for g in hosts:
                if batching:
                    self._advance(int(g), now)
                self._retire(int(g), now)
                views.append(self._view(int(g), m, now))
            choice = cfg.dispatch.choose(self.names[m], now, deadline, views)
            if choice is None:  # the policy rejected it (SLO admission)
                self.status[i] = REJECTED
                continue
            g = int(choice)
            self.group[i] = g
            enter = now + cfg.request_overhead_s
            if batching:
                self.queues[g].setdefault(m, []).append(i)
                continue
            s, f = self._run_batch(g, m, [i], enter)
            self.start[i], self.finish[i] = s, f + cfg.response_overhead_s
            self.status[i] = SERVED if self.finish[i] <= deadline else LATE
            self.unfinished[g].append(i)
        if batching:
            for g in range(len(self.queues)):
                self._advance(g, math.inf)

    def _advance(self, g: int, now: float) -> None:
        w, cfg = self.w, self.cfg
        queues = self.queues[g]
        while any(queues.values()):
            m = min((q[0], mm) for mm, q in queues.items() if q)[1]
            queue = queues[m]
            head = queue[0]
            enter = max(float(w.arrival_s[head]) + cfg.request_overhead_s, float(self.stage_free[g, 0]))
            if enter > now:
                return
            ready = [r for r in queue[: self.max_batch] if w.arrival_s[r] + cfg.request_overhead_s <= enter]
            deadlines = [float(w.arrival_s[r] + w.slo_s[r]) for r in ready]
            size = cfg.batching.batch_size(enter, deadlines,
                                           lambda b: self._finish(g, m, b, enter) + cfg.response_overhead_s)
            size = min(size, len(ready))
            if size == 0:
                queue.pop(0)
                self.status[head] = REJECTED
                continue
            s, f = self._run_batch(g, m, queue[:size], enter)
            f += cfg.response_overhead_s
            for r in queue[:size]:
                self.start[r], self.finish[r], self.batch[r] = s, f, size
                self.status[r] = SERVED if f <= w.arrival_s[r] + w.slo_s[r] else LATE
                self.unfinished[g].append(r)
            del queue[:size]


# ------------------------------------------------------------------------------------------------ results
@dataclass
class LatencyStats:
    """Latency (finish - arrival) of the requests that were served, seconds."""

    count: int
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float


@dataclass
class SimulationSummary:
    """What a person (or the CLI's JSON) wants to know about one simulation."""

    num_requests: int
    slo_attainment: float
    served: int
    late: int
    rejected: int
    unplaced: int
    latency: LatencyStats
    per_model_attainment: dict[str, float]
    mean_group_utilization: list[float]

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        lat = self.latency
        lines = [
            f"requests: {self.num_requests}  SLO attainment: {self.slo_attainment:.4f}",
            f"served {self.served}, late {self.late}, rejected {self.rejected}, unplaced {self.unplaced}",
            f"latency (served): mean {lat.mean_s * 1e3:.1f} ms, p50 {lat.p50_s * 1e3:.1f} ms, "
            f"p90 {lat.p90_s * 1e3:.1f} ms, p99 {lat.p99_s * 1e3:.1f} ms",
            "group utilisation: " + ", ".join(f"{u:.2f}" for u in self.mean_group_utilization),
        ]
        worst = sorted(self.per_model_attainment.items(), key=lambda kv: kv[1])[:5]
        lines.append("lowest per-model attainment: " + ", ".join(f"{k} {v:.3f}" for k, v in worst))
        return "\n".join(lines)


@dataclass
class SimulationResult:
    """Per request: start (first stage), finish, group, status and batch size; plus the tables used."""

    workload: Workload
    start_s: np.ndarray
    finish_s: np.ndarray
    group: np.ndarray
    status: np.ndarray
    batch_size: np.ndarray
    tables: _Tables
    busy_device_s: np.ndarray  # per group: stage latencies of its batches (host slowdown included) x intra-op devices
    request_device_s: np.ndarray  # per request: its equal share of its batch's, 0 for one never run

    @property
    def served(self) -> np.ndarray:
        return self.status == SERVED

    @property
    def outcomes(self) -> RequestOutcomes:
        """The per-request outcomes every simulator reports (placement.sim)."""
        deadline = self.workload.arrival_s + self.workload.slo_s
        return RequestOutcomes(self.workload.arrival_s, deadline, self.finish_s, self.status)

    def slo_attainment(self) -> float:
        """Share of all requests finished within their SLO (rejected, late and unplaced count as misses)."""
        return float(self.served.mean()) if len(self.status) else 1.0

    def per_model_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(requests, requests served within SLO) per model index."""
        num_models = len(self.workload.model_names)
        total = np.bincount(self.workload.model, minlength=num_models)
        good = np.bincount(self.workload.model[self.served], minlength=num_models)
        return total, good

    def per_model_attainment(self) -> dict[str, float]:
        total, good = self.per_model_counts()
        return {name: float(good[i] / total[i]) for i, name in enumerate(self.workload.model_names) if total[i]}

    def latency_stats(self) -> LatencyStats:
        done = (self.status == SERVED) | (self.status == LATE)
        latency = self.finish_s[done] - self.workload.arrival_s[done]
        if not len(latency):
            return LatencyStats(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        p50, p90, p99 = np.percentile(latency, LATENCY_PERCENTILES)
        return LatencyStats(int(len(latency)), float(latency.mean()), float(p50), float(p90), float(p99),
                            float(latency.max()))

    def device_seconds(self) -> np.ndarray:
        """Busy device-seconds of each request: its share of its batch's stage latencies (host slowdown included)
        x intra-op devices; per group they add up to `group_busy_seconds`."""
        return self.request_device_s

    def group_busy_seconds(self) -> np.ndarray:
        """Busy device-seconds per group (both engines count them as they run batches)."""
        return self.busy_device_s

    def utilization(self, bin_s: float = DEFAULT_UTILIZATION_BIN_S) -> np.ndarray:
        """[group, time bin] busy fraction of the group's devices; a request's work is counted in the bin where it
        starts (an approximation that matters only for bins shorter than a request)."""
        num_groups = len(self.tables.num_stages)
        if not len(self.status) or not num_groups:
            return np.zeros((num_groups, 0))
        t0 = self.workload.arrival_s[0]
        done = np.flatnonzero(self.group >= 0)
        done = done[~np.isnan(self.start_s[done])]
        bins = ((self.start_s[done] - t0) // bin_s).astype(np.int64)
        num_bins = int(bins.max()) + 1 if len(bins) else 1
        busy = np.zeros((num_groups, num_bins))
        np.add.at(busy, (self.group[done], bins), self.device_seconds()[done])
        return busy / (bin_s * self.tables.num_devices[:, None])

    def summary(self) -> SimulationSummary:
        counts = np.bincount(self.status, minlength=4)
        span = max(self.workload.duration_s, 1e-9)
        mean_util = self.group_busy_seconds() / (span * np.maximum(self.tables.num_devices, 1))
        return SimulationSummary(
            num_requests=len(self.status), slo_attainment=self.slo_attainment(),
            served=int(counts[SERVED]), late=int(counts[LATE]), rejected=int(counts[REJECTED]),
            unplaced=int(counts[UNPLACED]), latency=self.latency_stats(),
            per_model_attainment=self.per_model_attainment(), mean_group_utilization=[float(u) for u in mean_util],
        )


def simulate(placement: Placement, profiles: ProfileSet, workload: Workload, config: SimulatorConfig | None = None,
             *, reference: bool = False) -> SimulationResult:
    """Simulate `workload` on `placement`. Built-in policies run compiled unless `reference` asks for the Python
    loop; other policy objects always run in the Python loop."""
    config = config or SimulatorConfig()
    max_batch = config.batching.max_batch_size if config.batching is not None else 1
    groups = [(group.num_devices, group.config, group.models) for group in placement.groups]
    for g, (_, group_config, names) in enumerate(groups):
        for name in names:
            if name not in profiles.models:
                raise ValueError(f"groups.{g}.models: {name!r} has no profile")
            if not profiles.models[name].has(group_config):
                raise ValueError(f"groups.{g}: model {name!r} has no profile for {group_config.key()}")
    return simulate_groups(groups, LatencyCache(profiles, max_batch), workload, config, reference=reference)


def simulate_groups(groups: Sequence[GroupSpec], cache: LatencyCache, workload: Workload,
                    config: SimulatorConfig | None = None, *, reference: bool = False) -> SimulationResult:
    """:func:`simulate` on groups given as (devices, config, model names), with a reusable latency cache."""
    config = config or SimulatorConfig()
    names = list(workload.model_names)
    max_batch = config.batching.max_batch_size if config.batching is not None else 1
    if cache.max_batch_size < max_batch:
        raise ValueError(f"latency cache holds batch sizes up to {cache.max_batch_size}, batching needs {max_batch}")
    tables = build_tables(groups, cache, names)
    if cache.max_batch_size > max_batch:
        tables.latency = np.ascontiguousarray(tables.latency[:, :, : max_batch + 1])
    kernel_code = getattr(config.dispatch, "kernel_code", None)
    compiled = (not reference and kernel_code is not None
                and type(config.dispatch).__module__ == ShortestQueueDispatch.__module__
                and (config.batching is None or isinstance(config.batching, MaxBatchWithinSLO)))
    if not compiled:
        engine = _ReferenceEngine(tables, groups, names, config, workload, max_batch)
        engine.run()
        return SimulationResult(workload, engine.start, engine.finish, engine.group, engine.status, engine.batch,
                                tables, engine.busy, engine.device_s)
    arrays = _KernelArrays.build(workload, tables)
    knobs = _kernel_knobs(config, max_batch)
    a = arrays
    _kernel(a.times, a.ids, a.groups, a.stage_free, a.busy, a.model_queue, tables.host_ptr, tables.host_groups, a.turn,
            tables.latency, knobs, config.batching is not None)
    return arrays.result(workload, tables)


@dataclass
class AlpaServeEngine:
    """:func:`simulate` as a `placement.sim.SimulationEngine`."""

    placement: Placement
    profiles: ProfileSet
    workload: Workload
    config: SimulatorConfig | None = None
    reference: bool = False

    def run(self) -> SimulationResult:
        return simulate(self.placement, self.profiles, self.workload, self.config, reference=self.reference)
