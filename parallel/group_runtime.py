"""A model-parallel group: a model split over Ray actors by a `ParallelPlan`, with pipelined requests.

`ModelParallelGroup` creates one `StageActor` per (stage, shard), lets each load only its share of the weights,
and wires the stages with the stage transport (`parallel.stage_transport`: `torch.distributed` point-to-point in
a process group of the actors and the owner, NCCL between GPUs, gloo elsewhere): `submit` sends a request to the
first stage, each actor runs its requests in arrival order and sends each output straight to the next stage, and
the last stage's answer comes back to the group's owner. So while stage 2 runs request i, stage 1 already runs
request i+1 (AlpaServe §3: inter-op parallelism pipelines consecutive requests), with no Ray task per request and
stage. The group can live in a driver or inside a Ray Serve replica, with its actors pinned to the replica's
placement-group bundles. A dead actor surfaces as `GroupFailedError` naming it; `rebuild()` replaces the whole group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import Future
from typing import Iterator, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from models.device import CPU_RESOURCE, GPU_RESOURCE
from models.layers import ActivationState
from parallel.plan import ParallelPlan
from parallel.stage_actor import StageActor
from parallel.stage_layers import ModelSource
from parallel.stage_transport import PipelineTransport, TransportError

logger = logging.getLogger(__name__)

#: Logical CPUs each stage actor asks Ray for (one thread each; more than 2 actors may share 2 cores).
DEFAULT_ACTOR_NUM_CPUS = 0.5
#: Seconds `result` waits for a request before it raises.
DEFAULT_RESULT_TIMEOUT_S = 300.0
#: Seconds a broken group waits for each actor's ping when it looks for the one that died.
DIAGNOSE_TIMEOUT_S = 10.0


class GroupFailedError(RuntimeError):
    """An actor of the group died or failed; the group must be rebuilt (`ModelParallelGroup.rebuild`)."""


class ModelParallelGroup:
    """A model split by `plan` over `plan.num_actors` Ray actors.

    placement_group / bundle_indices: pin actor k (stage-major: stage s shard r is k = s * degree + r) to
    `bundle_indices[k]` of `placement_group`, e.g. the bundles of the Ray Serve replica that owns the group.
    reuse_actors: the running actors another group handed over (`release`), one per stage on the same bundles; they
    load this model's stages in place (`StageShard.reload`) instead of new actor processes starting.
    """

    def __init__(self, source: ModelSource, plan: ParallelPlan, placement_group: PlacementGroup | None = None,
                 bundle_indices: Sequence[int] | None = None, num_cpus_per_actor: float = DEFAULT_ACTOR_NUM_CPUS,
                 num_threads_per_actor: int = 1, actor_resources: dict[str, float] | None = None,
                 num_gpus_per_actor: float = 0.0, reuse_actors: Sequence[Sequence] | None = None):
        if bundle_indices is not None and placement_group is None:
            raise ValueError("bundle_indices needs a placement_group")
        if placement_group is not None:
            bundle_indices = list(range(plan.num_actors)) if bundle_indices is None else list(bundle_indices)
            if len(bundle_indices) != plan.num_actors:
                raise ValueError(f"bundle_indices has {len(bundle_indices)} entries for {plan.num_actors} actors")
        self.source = source
        self.plan = plan
        self.placement_group = placement_group
        self.bundle_indices = bundle_indices
        self.num_cpus_per_actor = num_cpus_per_actor
        self.num_threads_per_actor = num_threads_per_actor
        self.actor_resources = actor_resources or {}
        self.num_gpus_per_actor = num_gpus_per_actor
        self.actors: list[list] = []
        self.weight_bytes: list[list[int]] = []
        self.transport: PipelineTransport | None = None
        self._start(reuse_actors)

    # ---- life cycle ----

    def _actor_options(self, index: int) -> dict:
        options: dict = {"num_cpus": self.num_cpus_per_actor, "num_gpus": self.num_gpus_per_actor, "max_restarts": 0}
        if self.actor_resources:
            options["resources"] = dict(self.actor_resources)
        if self.placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=self.bundle_indices[index])
        return options

    def can_reuse(self, actors: Sequence[Sequence]) -> bool:
        """Whether `actors` (another group's `release()`, on the same bundles) can run this group's plan: one
        unsharded actor per stage, as many stages."""
        return self.plan.intra_op_degree == 1 and len(actors) == len(self.plan.stages) and all(
            len(row) == 1 for row in actors)

    def _start(self, reuse_actors: Sequence[Sequence] | None = None) -> None:
        degree = self.plan.intra_op_degree
        if reuse_actors is not None and not self.can_reuse(reuse_actors):
            raise ValueError(f"group {self.source.name!r}: {[len(row) for row in reuse_actors]} actors per stage "
                             f"cannot run a plan of {len(self.plan.stages)} stages x {degree} shards")
        self.actors = []
        for s, stage in enumerate(self.plan.stages):
            row = []
            for rank in range(degree):
                if reuse_actors is not None:
                    row.append(reuse_actors[s][rank])
                    continue
                options = self._actor_options(s * degree + rank)
                row.append(StageActor.options(**options).remote(self.source, stage, s, rank, degree,
                                                                self.num_threads_per_actor,
                                                                GPU_RESOURCE if self.num_gpus_per_actor > 0
                                                                else CPU_RESOURCE))
            self.actors.append(row)
        try:
            setups = []
            for s, row in enumerate(self.actors):
                if reuse_actors is not None:  # the processes are up: each loads this model's stage in place
                    setups.append([actor.reload.remote(self.source, self.plan.stages[s], s) for actor in row])
                    continue
                address, port = (None, None)
                if degree > 1:
                    address, port = ray.get(row[0].rendezvous_address.remote())
                setups.append([actor.setup.remote(address, port) for actor in row])
            self.weight_bytes = [ray.get(row) for row in setups]
            self.transport = PipelineTransport(self.actors, diagnose=self._dead_actor)
        except (RayActorError, RayTaskError, GetTimeoutError, OSError, RuntimeError) as error:
            self.shutdown()
            raise GroupFailedError(f"model-parallel group for {self.source.name!r} failed to start: {error}") from error
        logger.info("group %s: %d stages x %d shards, weight bytes per actor %s", self.source.name, len(self.actors),
                    degree, self.weight_bytes)

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.close(stop_stages=False)  # the actors die next
            self.transport = None
        for row in self.actors:
            for actor in row:
                try:
                    ray.kill(actor)
                except Exception:  # noqa: BLE001 - already dead is fine
                    pass
        self.actors = []

    def release(self) -> list[list]:
        """Close the transport and hand over the actors, alive and still holding their layers, for another model to
        reload (`reuse_actors`); this group is shut down afterwards."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        actors, self.actors = self.actors, []
        return actors

    def rebuild(self) -> None:
        """Kill whatever is left of the group and start it again with fresh actors."""
        logger.warning("rebuilding model-parallel group %s", self.source.name)
        self.shutdown()
        self._start()

    # ---- requests ----

    def submit(self, state: ActivationState) -> Future:
        """Queue one batch for the first stage; returns at once (requests pipeline through the stages). The future
        holds the last stage's output; `result` and `infer_async` turn its failures into `GroupFailedError`."""
        transport = self.transport
        if transport is None:
            raise GroupFailedError(f"model-parallel group for {self.source.name!r} is shut down; call rebuild()")
        try:
            return transport.submit(state)
        except TransportError as error:
            raise GroupFailedError(str(error)) from error

    def result(self, pending: Future, timeout_s: float = DEFAULT_RESULT_TIMEOUT_S) -> ActivationState:
        """Wait for one request; a dead or failing actor raises `GroupFailedError` naming it."""
        with self._failures_as_group_failed(timeout_s):
            return pending.result(timeout=timeout_s)

    async def infer_async(self, state: ActivationState, timeout_s: float = DEFAULT_RESULT_TIMEOUT_S) -> ActivationState:
        """`infer` for an asyncio caller: awaits the answer without blocking its event loop, so several batches can
        be in flight in the stages at once."""
        pending = self.submit(state)
        with self._failures_as_group_failed(timeout_s):
            return await asyncio.wait_for(asyncio.wrap_future(pending), timeout=timeout_s)

    @contextlib.contextmanager
    def _failures_as_group_failed(self, timeout_s: float) -> Iterator[None]:
        """A wait for an answer, blocking or awaited: no answer within `timeout_s` (both waits raise the builtin
        TimeoutError since Python 3.11) or a broken transport becomes `GroupFailedError`."""
        try:
            yield
        except TimeoutError:
            raise GroupFailedError(f"model-parallel group for {self.source.name!r}: no result "
                                   f"within {timeout_s} s") from None
        except TransportError as error:
            raise GroupFailedError(str(error)) from error

    def _dead_actor(self) -> str:
        """Why the transport broke, for the requests that fail: the first actor that no longer answers a ping ('' when
        every actor answers: the transport's own reason stands)."""
        for s, row in enumerate(self.actors):
            for rank, actor in enumerate(row):
                try:
                    ray.get(actor.ping.remote(), timeout=DIAGNOSE_TIMEOUT_S)
                except (RayActorError, GetTimeoutError) as error:
                    return (f"stage {s} shard {rank} of model {self.source.name!r} died; rebuild the group: "
                            f"{type(error).__name__}")
        return ""

    def infer(self, state: ActivationState) -> ActivationState:
        return self.result(self.submit(state))

    def infer_many(self, states: Sequence[ActivationState]) -> list[ActivationState]:
        """Submit all batches at once (they pipeline through the stages), then collect them in order."""
        pending = [self.submit(state) for state in states]
        return [self.result(p) for p in pending]

    def actor_handles(self) -> list[list]:
        return [list(row) for row in self.actors]
