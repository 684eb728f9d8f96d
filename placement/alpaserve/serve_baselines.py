"""Ray Serve's own ways to serve many models, simulated beside AlpaServe's placements (issue 57): one deployment
per model, and model multiplexing.

The two layouts are the baselines a Ray Serve user would set up from Serve's documentation:

* **One deployment per model** (Serve's deployment guide, `@serve.batch`, `autoscaling_config`): every model has
  replicas of its own, each replica holding only that model's weights, several replicas of different models may share
  a device (fractional resources). `proportional_deployments` gives each model a replica count proportional to its
  offered load (rate x single-request latency), as many replicas as the devices' memory holds: the count Serve's
  autoscaler (target ongoing requests per replica, so replicas in proportion to the requests in flight, Little's law)
  reaches at or past saturation once capped by the cluster's resources. It is a fixed stand-in: the simulated counts
  do not follow a change of traffic during a run, as live autoscaling would after its delays. AlpaServe's Selective
  Replication (§6.2, :func:`placement.alpaserve.baselines.selective_replication`) places the same kind of layout
  (single-device replicas, several models per device) but chooses the replicas by simulation and serves with
  AlpaServe's SLO admission, so it is a stronger baseline than this one, not the same.
* **Model multiplexing** (Ray Serve's "Model Multiplexing" guide, `ray.serve.multiplexed`): one deployment whose
  replicas load models on demand, at most `max_num_models_per_replica` (k) at a time, evicting the least recently
  used one (the `ray.serve.multiplexed` API reference). Serve's multiplexing serves models of one shape with different
  weights, so `multiplexed_deployments` makes one multiplexed deployment per model architecture, k as many of its
  models as fit a device's memory, the devices split between the deployments in proportion to their offered load.

The simulation (:func:`simulate_serve`), an event-driven simulator on the same profiles, workloads and outcome types
as AlpaServe's (§4.2's simulator, :mod:`placement.alpaserve.simulator`), models what Serve does:

* **Routing** (Serve's `MultiplexMixin.apply_multiplex_routing` and `rank_replicas_via_multiplex`): among the
  replicas of the request's deployment that still accept a request (fewer than `max_ongoing_requests` in flight),
  first those that hold its model, else those with the fewest models, else any; within that tier the least loaded
  (fewest requests in flight; ties: lowest replica id: a deterministic stand-in for Serve's power-of-two choices).
  A replica "holds" a model once requests for it are routed there (the router learns at once). A request no replica
  accepts waits at the router, in arrival order, until one frees a slot. Deployments without multiplexing route the
  same way among their replicas.
* **Batching** (`@serve.batch`): per replica and model, a batch starts collecting when its first request is taken
  and closes when it holds `max_batch_size` requests or `batch_wait_timeout_s` has passed; one batch at a time per
  batcher (`max_concurrent_batches=1`). A device runs the batches of all replicas on it one after another, in the
  order they close. `max_batch_size` 1 stands for a deployment without `@serve.batch`: each request goes to its
  device as it arrives.
* **Swaps**: a batch whose model is not in its replica's cache first loads it (`load_s` of that model, occupying the
  device), evicting the least recently used model when the cache holds k; a batch's start counts as a use.
* **No admission**: Serve runs every request it accepts; a request that finishes past its deadline counts as a miss
  (LATE), and none is dropped.

Multiplexed replicas start warm: each deployment's models, hottest first by the given rates and cycling, are dealt to
its replicas' caches in turn until they are full (a system that has served this traffic before). As in Serve, a
model's requests stay on the replicas that hold it until those are full (`max_ongoing_requests`); only then does
another replica load it.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from placement.core.profiles import ParallelConfig, ProfileSet
from placement.core.workload import Workload
from placement.sim.outcomes import LATE, SERVED, UNPLACED, RequestOutcomes

#: Serve's defaults: `@serve.batch(max_batch_size=10, batch_wait_timeout_s=0.01)`, `max_ongoing_requests=5`.
SERVE_DEFAULT_MAX_BATCH_SIZE = 10
SERVE_DEFAULT_BATCH_WAIT_TIMEOUT_S = 0.01
SERVE_DEFAULT_MAX_ONGOING_REQUESTS = 5
#: A host-to-device copy rate for the swap estimate where no load time is measured: PCIe 3.0 x16 from pinned host
#: memory (AlpaServe's V100s), bytes per second. Loading from disk or object storage is slower.
PCIE3_HOST_TO_DEVICE_BYTES_PER_S = 12e9

# Event kinds, in the order they are handled at equal times: a batch finishing frees its slots before a request
# arriving at the same instant is routed (as AlpaServe's simulator retires finished requests first); a batch
# timer closes after the arrivals of its instant joined it.
_DONE, _ARRIVAL, _TIMER = 0, 1, 2


@dataclass(frozen=True)
class ServeBatching:
    """How every replica batches and how many requests it accepts (`@serve.batch` and `max_ongoing_requests`)."""

    max_batch_size: int = SERVE_DEFAULT_MAX_BATCH_SIZE
    batch_wait_timeout_s: float = SERVE_DEFAULT_BATCH_WAIT_TIMEOUT_S
    max_ongoing_requests: int = SERVE_DEFAULT_MAX_ONGOING_REQUESTS

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size}: must be >= 1")
        if not self.batch_wait_timeout_s >= 0:
            raise ValueError(f"batch_wait_timeout_s={self.batch_wait_timeout_s}: must be >= 0")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests={self.max_ongoing_requests}: must be >= 1")


@dataclass(frozen=True)
class ServeDeployment:
    """One Serve deployment: the models it serves and the device of each of its replicas (one replica per entry).

    `max_models_per_replica` None: a plain deployment, every replica holds all of `models` for good (one model for
    one deployment per model). k: a multiplexed deployment (`@serve.multiplexed(max_num_models_per_replica=k)`)."""

    name: str
    models: tuple[str, ...]
    replica_devices: tuple[int, ...]
    max_models_per_replica: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "replica_devices", tuple(int(d) for d in self.replica_devices))
        if not self.models:
            raise ValueError(f"deployment {self.name!r}: models must not be empty")
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"deployment {self.name!r}: a model is listed twice")
        if self.max_models_per_replica is not None and self.max_models_per_replica < 1:
            raise ValueError(f"deployment {self.name!r}: max_models_per_replica={self.max_models_per_replica}: must "
                             "be >= 1")

    @property
    def multiplexed(self) -> bool:
        return self.max_models_per_replica is not None


@dataclass(frozen=True)
class ServeLayout:
    """Deployments on `num_devices` devices; every model belongs to at most one deployment."""

    deployments: tuple[ServeDeployment, ...]
    num_devices: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "deployments", tuple(self.deployments))
        if self.num_devices < 1:
            raise ValueError(f"num_devices={self.num_devices}: must be >= 1")
        seen: set[str] = set()
        for d in self.deployments:
            if any(not 0 <= device < self.num_devices for device in d.replica_devices):
                raise ValueError(f"deployment {d.name!r}: a replica device lies outside 0..{self.num_devices - 1}")
            twice = seen.intersection(d.models)
            if twice:
                raise ValueError(f"models {sorted(twice)} belong to two deployments")
            seen.update(d.models)

    def device_weight_bytes(self, profiles: ProfileSet) -> np.ndarray:
        """Weight bytes each device may hold at most: a plain replica all its models, a multiplexed one k of its
        deployment's largest."""
        used = np.zeros(self.num_devices, dtype=np.int64)
        for d in self.deployments:
            sizes = sorted((_weight_bytes(profiles, m) for m in d.models), reverse=True)
            per_replica = sum(sizes) if not d.multiplexed else sum(sizes[: d.max_models_per_replica])
            for device in d.replica_devices:
                used[device] += per_replica
        return used

    def check_memory(self, profiles: ProfileSet, device_memory_bytes: int) -> None:
        used = self.device_weight_bytes(profiles)
        worst = int(np.argmax(used)) if len(used) else 0
        if len(used) and used[worst] > device_memory_bytes:
            raise ValueError(f"device {worst} holds up to {used[worst]} weight bytes, beyond device_memory_bytes="
                             f"{device_memory_bytes}")


def _weight_bytes(profiles: ProfileSet, name: str) -> int:
    if name not in profiles.models:
        raise ValueError(f"model {name!r} has no profile")
    return profiles.models[name].get(ParallelConfig()).weight_bytes_per_device()


def swap_load_seconds(profiles: ProfileSet, model_names: Sequence[str],
                      bytes_per_s: float = PCIE3_HOST_TO_DEVICE_BYTES_PER_S) -> dict[str, float]:
    """The estimated seconds to load each model onto a device: its weight bytes over a host-to-device copy rate
    (no disk, no deserialization: the most favourable case for swapping)."""
    if not bytes_per_s > 0:
        raise ValueError(f"bytes_per_s={bytes_per_s}: must be > 0")
    return {name: _weight_bytes(profiles, name) / bytes_per_s for name in model_names}


# ------------------------------------------------------------------------------------------------------ layouts
def offered_load(profiles: ProfileSet, model_names: Sequence[str], rates: Sequence[float]) -> np.ndarray:
    """Each model's offered load: requests per second x single-request latency on one device (busy devices)."""
    return np.asarray([float(r) * profiles.models[n].single_device_latency() for n, r in zip(model_names, rates)])


def proportional_deployments(model_names: Sequence[str], profiles: ProfileSet, rates: Sequence[float],
                             num_devices: int, device_memory_bytes: int) -> ServeLayout:
    """One deployment per model, replica counts in proportion to the offered load (Serve autoscaling's settled
    count, see the module docstring), as many replicas as the devices' memory holds.

    Every model first gets one replica, heaviest load first; then, while one fits, the model with the most load per
    replica gets another. Each replica goes to the device with room (and no replica of that model yet) that carries
    the least load so far. Raises ValueError if some model fits on no device."""
    names = list(model_names)
    if len(rates) != len(names):
        raise ValueError(f"{len(rates)} rates for {len(names)} models")
    load = offered_load(profiles, names, rates)
    weight = [_weight_bytes(profiles, n) for n in names]
    free = np.full(num_devices, int(device_memory_bytes), dtype=np.int64)
    device_load = np.zeros(num_devices)
    devices: list[list[int]] = [[] for _ in names]

    def add(m: int) -> bool:
        room = [d for d in range(num_devices) if free[d] >= weight[m] and d not in devices[m]]
        if not room:
            return False
        target = min(room, key=lambda d: (device_load[d], d))
        for d in devices[m]:  # the model's load spreads evenly over its replicas
            device_load[d] -= load[m] / len(devices[m])
        devices[m].append(target)
        free[target] -= weight[m]
        for d in devices[m]:
            device_load[d] += load[m] / len(devices[m])
        return True

    for m in sorted(range(len(names)), key=lambda i: (-load[i], i)):
        if not add(m):
            raise ValueError(f"model {names[m]!r} ({weight[m]} bytes) fits on no device "
                             f"(device_memory_bytes={device_memory_bytes}, {num_devices} devices)")
    full: set[int] = set()
    while len(full) < len(names):
        m = max((i for i in range(len(names)) if i not in full), key=lambda i: (load[i] / len(devices[i]), -i))
        if load[m] <= 0 or not add(m):
            full.add(m)
    deployments = [ServeDeployment(name=n, models=(n,), replica_devices=tuple(devices[m])) for m, n in enumerate(names)]
    return ServeLayout(tuple(deployments), num_devices)


def _largest_remainder(shares: np.ndarray, total: int, minimum: int = 1) -> list[int]:
    """`total` items split in proportion to `shares`, each at least `minimum` (largest remainders get the rest)."""
    count = len(shares)
    if total < minimum * count:
        raise ValueError(f"{total} devices for {count} deployments of at least {minimum} replica(s) each")
    weights = np.asarray(shares, dtype=float)
    weights = weights / weights.sum() if weights.sum() > 0 else np.full(count, 1.0 / count)
    spare = total - minimum * count
    exact = weights * spare
    given = np.floor(exact).astype(int)
    order = sorted(range(count), key=lambda i: (-(exact[i] - given[i]), i))
    for i in order[: spare - int(given.sum())]:
        given[i] += 1
    return [minimum + int(g) for g in given]


def multiplexed_deployments(model_names: Sequence[str], profiles: ProfileSet, rates: Sequence[float],
                            num_devices: int, device_memory_bytes: int, architecture_of: Mapping[str, str],
                            max_models_per_replica: int | None = None) -> ServeLayout:
    """One multiplexed deployment per architecture (`architecture_of[model]`), one replica per device, the devices
    split in proportion to each deployment's offered load (at least one each). k is `max_models_per_replica` or, by
    default, as many of the deployment's largest models as fit `device_memory_bytes`. Raises ValueError where a model
    fits no device or there are fewer devices than architectures."""
    names = list(model_names)
    if len(rates) != len(names):
        raise ValueError(f"{len(rates)} rates for {len(names)} models")
    missing = [n for n in names if n not in architecture_of]
    if missing:
        raise ValueError(f"architecture_of names no architecture for {missing}")
    load = offered_load(profiles, names, rates)
    groups: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        groups.setdefault(architecture_of[n], []).append(i)
    archs = sorted(groups)
    counts = _largest_remainder(np.asarray([load[groups[a]].sum() for a in archs]), num_devices)
    deployments, next_device = [], 0
    for arch, count in zip(archs, counts):
        members = groups[arch]
        largest = max(_weight_bytes(profiles, names[i]) for i in members)
        if largest > device_memory_bytes:
            raise ValueError(f"a model of {arch!r} ({largest} bytes) does not fit device_memory_bytes="
                             f"{device_memory_bytes}")
        k = max_models_per_replica or int(device_memory_bytes // largest)
        deployments.append(ServeDeployment(name=f"multiplexed-{arch}", models=tuple(names[i] for i in members),
                                           replica_devices=tuple(range(next_device, next_device + count)),
                                           max_models_per_replica=min(k, len(members))))
        next_device += count
    return ServeLayout(tuple(deployments), num_devices)


# --------------------------------------------------------------------------------------------------- simulation
@dataclass
class _Replica:
    index: int
    device: int
    deployment: int
    capacity: int | None  # k of a multiplexed replica; None: holds its models for good
    cache: OrderedDict = field(default_factory=OrderedDict)  # model -> None, least recently used first
    inflight: int = 0
    pending: dict = field(default_factory=dict)  # model -> requests routed here and not finished

    def holds(self, m: int) -> bool:
        return m in self.cache or self.pending.get(m, 0) > 0

    def num_models(self) -> int:
        return len(set(self.cache).union(m for m, c in self.pending.items() if c > 0))


@dataclass
class _Batcher:
    queue: deque = field(default_factory=deque)
    busy: bool = False  # a batch closed and not finished (max_concurrent_batches=1)
    collecting: bool = False
    token: int = 0


@dataclass
class ServeSimulationResult:
    """Per request: start (of its batch, after any load), finish, replica, status and batch size; per replica the
    loads (swaps) it made."""

    workload: Workload
    start_s: np.ndarray
    finish_s: np.ndarray
    replica: np.ndarray
    status: np.ndarray
    batch_size: np.ndarray
    swapped: np.ndarray  # per request: 1 if its batch paid a load
    loads_per_replica: np.ndarray

    @property
    def outcomes(self) -> RequestOutcomes:
        """The per-request outcomes every simulator reports (placement.sim)."""
        deadline = self.workload.arrival_s + self.workload.slo_s
        return RequestOutcomes(self.workload.arrival_s, deadline, self.finish_s, self.status)

    @property
    def served(self) -> np.ndarray:
        return self.status == SERVED

    def slo_attainment(self) -> float:
        """Share of all requests finished within their SLO (late and unplaced count as misses)."""
        return float(self.served.mean()) if len(self.status) else 1.0

    @property
    def total_loads(self) -> int:
        return int(self.loads_per_replica.sum())


def _warm_fill(replicas: Sequence[_Replica], hottest: Sequence[int], k: int) -> None:
    """Deal the models, hottest first and cycling through them, to the replicas in turn, one slot per turn, until
    every cache is full or holds every model: the hottest models get the most copies."""
    turn = 0
    for _ in range(k):
        for replica in replicas:
            if len(replica.cache) >= min(k, len(hottest)):
                continue
            while hottest[turn % len(hottest)] in replica.cache:
                turn += 1
            replica.cache[hottest[turn % len(hottest)]] = None
            turn += 1


def _latency_table(profiles: ProfileSet, names: Sequence[str], max_batch: int) -> np.ndarray:
    """float64[model, batch size]: single-device latency of a batch (row 0 unused)."""
    table = np.full((len(names), max_batch + 1), math.nan)
    for m, name in enumerate(names):
        if name in profiles.models and profiles.models[name].has(ParallelConfig()):
            profile = profiles.models[name].get(ParallelConfig())
            for b in range(1, max_batch + 1):
                table[m, b] = profile.latency(b)
    return table


def simulate_serve(layout: ServeLayout, profiles: ProfileSet, workload: Workload,
                   batching: ServeBatching | None = None, load_s: Mapping[str, float] | float | None = None,
                   warm_rates: Sequence[float] | None = None) -> ServeSimulationResult:
    """Simulate `workload` on Serve deployments (module docstring): Serve's routing, `@serve.batch`, LRU swaps at
    `load_s` (seconds per model, one figure for every model, or None: :func:`swap_load_seconds`), no admission.
    `warm_rates` (per workload model) orders the warm start of multiplexed caches (None: the workload's own rates).
    Deterministic for its inputs."""
    batching = batching or ServeBatching()
    names = list(workload.model_names)
    index = {n: i for i, n in enumerate(names)}
    num_models = len(names)
    for d in layout.deployments:
        for n in d.models:
            if n in index and not (n in profiles.models and profiles.models[n].has(ParallelConfig())):
                raise ValueError(f"deployment {d.name!r}: model {n!r} has no single-device profile")
    if load_s is None:
        loads = swap_load_seconds(profiles, [n for d in layout.deployments for n in d.models if n in index])
    elif isinstance(load_s, (int, float)):
        if not load_s >= 0:
            raise ValueError(f"load_s={load_s}: must be >= 0")
        loads = {n: float(load_s) for n in names}
    else:
        loads = dict(load_s)
    load_of = np.asarray([float(loads.get(n, 0.0)) for n in names])
    latency = _latency_table(profiles, names, batching.max_batch_size)
    deployment_of = np.full(num_models, -1, dtype=np.int64)
    replicas: list[_Replica] = []
    deployment_replicas: list[list[_Replica]] = []
    warm = np.asarray(warm_rates, dtype=float) if warm_rates is not None else workload.rates()
    for di, d in enumerate(layout.deployments):
        own = []
        for device in d.replica_devices:
            replica = _Replica(index=len(replicas), device=device, deployment=di, capacity=d.max_models_per_replica)
            replicas.append(replica)
            own.append(replica)
        deployment_replicas.append(own)
        members = [index[n] for n in d.models if n in index]
        for m in members:
            deployment_of[m] = di
        if not d.multiplexed:
            for replica in own:
                for m in members:
                    replica.cache[m] = None
        elif own and members:
            _warm_fill(own, sorted(members, key=lambda m: (-warm[m], m)), d.max_models_per_replica)

    n = len(workload)
    arrival = workload.arrival_s
    deadline = workload.arrival_s + workload.slo_s
    model = workload.model
    start = np.full(n, math.nan)
    finish = np.full(n, math.nan)
    assigned = np.full(n, -1, dtype=np.int64)
    status = np.zeros(n, dtype=np.int8)
    batch_size = np.zeros(n, dtype=np.int64)
    swapped = np.zeros(n, dtype=np.int8)
    loads_made = np.zeros(len(replicas), dtype=np.int64)
    batchers: dict[tuple[int, int], _Batcher] = {}
    device_jobs: list[deque] = [deque() for _ in range(layout.num_devices)]
    device_busy = [False] * layout.num_devices
    router_queue: list[deque] = [deque() for _ in layout.deployments]
    limit = batching.max_ongoing_requests
    unbatched = batching.max_batch_size == 1  # no @serve.batch: each request goes to its device as it comes
    events: list = []
    seq = 0

    def push(time: float, kind: int, payload) -> None:
        nonlocal seq
        heapq.heappush(events, (time, kind, seq, payload))
        seq += 1

    def route(i: int) -> _Replica | None:
        """Serve's multiplex routing tiers over the replicas that accept a request; None: all are full."""
        m = int(model[i])
        own = deployment_replicas[deployment_of[m]]
        open_ = [r for r in own if r.inflight < limit]
        if not open_:
            return None
        if layout.deployments[deployment_of[m]].multiplexed:
            holders = [r for r in open_ if r.holds(m)]
            if holders:
                open_ = holders
            else:
                fewest = min(r.num_models() for r in own)
                tier = [r for r in open_ if r.num_models() == fewest]
                open_ = tier or open_
        return min(open_, key=lambda r: (r.inflight, r.index))

    def assign(i: int, replica: _Replica, now: float) -> None:
        m = int(model[i])
        assigned[i] = replica.index
        replica.inflight += 1
        replica.pending[m] = replica.pending.get(m, 0) + 1
        key = (replica.index, m)
        batcher = batchers.get(key)
        if batcher is None:
            batcher = batchers[key] = _Batcher()
        batcher.queue.append(i)
        if not batcher.busy or unbatched:
            if len(batcher.queue) >= batching.max_batch_size:
                close(replica, m, batcher, now)
            elif not batcher.collecting:
                collect(replica, m, batcher, now)

    def collect(replica: _Replica, m: int, batcher: _Batcher, now: float) -> None:
        batcher.collecting = True
        batcher.token += 1
        push(now + batching.batch_wait_timeout_s, _TIMER, (replica.index, m, batcher.token))

    def close(replica: _Replica, m: int, batcher: _Batcher, now: float) -> None:
        batcher.collecting = False
        batcher.busy = not unbatched
        size = min(len(batcher.queue), batching.max_batch_size)
        members = [batcher.queue.popleft() for _ in range(size)]
        device_jobs[replica.device].append((replica, m, members))
        if not device_busy[replica.device]:
            run_next(replica.device, now)

    def run_next(device: int, now: float) -> None:
        if not device_jobs[device]:
            device_busy[device] = False
            return
        replica, m, members = device_jobs[device].popleft()
        setup = 0.0
        if m in replica.cache:
            replica.cache.move_to_end(m)
        else:  # a swap: evict the least recently used model if the cache is full, then load
            if replica.capacity is not None and len(replica.cache) >= replica.capacity:
                replica.cache.popitem(last=False)
            replica.cache[m] = None
            setup = float(load_of[m])
            loads_made[replica.index] += 1
            swapped[members] = 1
        begin = now + setup
        end = begin + float(latency[m, len(members)])
        start[members] = begin
        batch_size[members] = len(members)
        device_busy[device] = True
        push(end, _DONE, (device, replica, m, members))

    for i in range(n):
        if deployment_of[model[i]] < 0:
            status[i] = UNPLACED
            continue
        push(float(arrival[i]), _ARRIVAL, i)

    while events:
        now, kind, _, payload = heapq.heappop(events)
        if kind == _ARRIVAL:
            i = payload
            replica = route(i)
            if replica is None:
                router_queue[deployment_of[model[i]]].append(i)
            else:
                assign(i, replica, now)
        elif kind == _TIMER:
            r, m, token = payload
            batcher = batchers[(r, m)]
            if batcher.collecting and batcher.token == token and not batcher.busy and batcher.queue:
                close(replicas[r], m, batcher, now)
        else:
            device, replica, m, members = payload
            for i in members:
                finish[i] = now
                status[i] = SERVED if now <= deadline[i] else LATE
            replica.inflight -= len(members)
            replica.pending[m] -= len(members)
            run_next(device, now)  # the device takes its next closed batch before this batcher closes another
            batcher = batchers[(replica.index, m)]
            batcher.busy = False
            if batcher.queue:
                if len(batcher.queue) >= batching.max_batch_size:
                    close(replica, m, batcher, now)
                else:
                    collect(replica, m, batcher, now)
            waiting = router_queue[replica.deployment]
            while waiting:
                target = route(waiting[0])
                if target is None:
                    break
                assign(waiting.popleft(), target, now)
    return ServeSimulationResult(workload, start, finish, assigned, status, batch_size, swapped, loads_made)


@dataclass
class ServeEngine:
    """:func:`simulate_serve` as a `placement.sim.SimulationEngine`."""

    layout: ServeLayout
    profiles: ProfileSet
    workload: Workload
    batching: ServeBatching | None = None
    load_s: Mapping[str, float] | float | None = None
    warm_rates: Sequence[float] | None = None

    def run(self) -> ServeSimulationResult:
        return simulate_serve(self.layout, self.profiles, self.workload, self.batching, self.load_s, self.warm_rates)
