"""A model-parallel group: a model split over Ray actors by a `ParallelPlan`, with pipelined requests.

`ModelParallelGroup` creates one `StageActor` per (stage, shard), lets each load only its share of the weights,
and chains the stages through Ray object references: `submit` queues a request on every stage at once, each
actor runs its calls in submission order, and an activation moves on as soon as its producer has it. So while
stage 2 runs request i, stage 1 already runs request i+1 (AlpaServe §3: inter-op parallelism pipelines
consecutive requests). The group can live in a driver or inside a Ray Serve replica, with its actors pinned to
the replica's placement-group bundles. A dead actor surfaces as `GroupFailedError`; `rebuild()` replaces the
whole group.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from models.device import CPU_RESOURCE, GPU_RESOURCE
from models.layers import ActivationState
from parallel.plan import ParallelPlan
from parallel.stage_actor import StageActor
from parallel.stage_layers import ModelSource

logger = logging.getLogger(__name__)

#: Logical CPUs each stage actor asks Ray for (one thread each; more than 2 actors may share 2 cores).
DEFAULT_ACTOR_NUM_CPUS = 0.5
#: Seconds `result` waits for a request before it raises.
DEFAULT_RESULT_TIMEOUT_S = 300.0


class GroupFailedError(RuntimeError):
    """An actor of the group died or failed; the group must be rebuilt (`ModelParallelGroup.rebuild`)."""


@dataclass
class PendingRequest:
    """The object references of one submitted request: the final output and every stage shard's call."""

    output: ray.ObjectRef
    calls: list[tuple[str, ray.ObjectRef]] = field(default_factory=list)


def submit_chain(rows: Sequence[Sequence], state: ActivationState) -> PendingRequest:
    """Put `state` once and queue `forward` on every actor of every row (stage), each stage taking shard 0's output
    of the one before: the runtime's call pattern, also what the profiler relays to price a hop."""
    current = ray.put(state)
    calls: list[tuple[str, ray.ObjectRef]] = []
    for s, row in enumerate(rows):
        refs = [actor.forward.remote(current) for actor in row]
        calls += [(f"stage {s} shard {rank}", ref) for rank, ref in enumerate(refs)]
        current = refs[0]
    return PendingRequest(output=current, calls=calls)


class ModelParallelGroup:
    """A model split by `plan` over `plan.num_actors` Ray actors.

    placement_group / bundle_indices: pin actor k (stage-major: stage s shard r is k = s * degree + r) to
    `bundle_indices[k]` of `placement_group`, e.g. the bundles of the Ray Serve replica that owns the group.
    """

    def __init__(self, source: ModelSource, plan: ParallelPlan, placement_group: PlacementGroup | None = None,
                 bundle_indices: Sequence[int] | None = None, num_cpus_per_actor: float = DEFAULT_ACTOR_NUM_CPUS,
                 num_threads_per_actor: int = 1, actor_resources: dict[str, float] | None = None,
                 num_gpus_per_actor: float = 0.0):
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
        self._start()

    # ---- life cycle ----

    def _actor_options(self, index: int) -> dict:
        options: dict = {"num_cpus": self.num_cpus_per_actor, "num_gpus": self.num_gpus_per_actor, "max_restarts": 0}
        if self.actor_resources:
            options["resources"] = dict(self.actor_resources)
        if self.placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=self.bundle_indices[index])
        return options

    def _start(self) -> None:
        degree = self.plan.intra_op_degree
        self.actors = []
        for s, stage in enumerate(self.plan.stages):
            row = []
            for rank in range(degree):
                options = self._actor_options(s * degree + rank)
                row.append(StageActor.options(**options).remote(self.source, stage, s, rank, degree,
                                                                self.num_threads_per_actor,
                                                                GPU_RESOURCE if self.num_gpus_per_actor > 0
                                                                else CPU_RESOURCE))
            self.actors.append(row)
        try:
            setups = []
            for row in self.actors:
                address, port = (None, None)
                if degree > 1:
                    address, port = ray.get(row[0].rendezvous_address.remote())
                setups.append([actor.setup.remote(address, port) for actor in row])
            self.weight_bytes = [ray.get(row) for row in setups]
        except (RayActorError, RayTaskError) as error:
            self.shutdown()
            raise GroupFailedError(f"model-parallel group for {self.source.name!r} failed to start: {error}") from error
        logger.info("group %s: %d stages x %d shards, weight bytes per actor %s", self.source.name, len(self.actors),
                    degree, self.weight_bytes)

    def shutdown(self) -> None:
        for row in self.actors:
            for actor in row:
                try:
                    ray.kill(actor)
                except Exception:  # noqa: BLE001 - already dead is fine
                    pass
        self.actors = []

    def rebuild(self) -> None:
        """Kill whatever is left of the group and start it again with fresh actors."""
        logger.warning("rebuilding model-parallel group %s", self.source.name)
        self.shutdown()
        self._start()

    # ---- requests ----

    def submit(self, state: ActivationState) -> PendingRequest:
        """Queue one batch on every stage; returns at once (requests pipeline through the stages)."""
        if not self.actors:
            raise GroupFailedError(f"model-parallel group for {self.source.name!r} is shut down; call rebuild()")
        return submit_chain(self.actors, state)

    def result(self, pending: PendingRequest, timeout_s: float = DEFAULT_RESULT_TIMEOUT_S) -> ActivationState:
        """Wait for one request; a dead or failing actor raises `GroupFailedError` naming it."""
        remaining = dict((ref, name) for name, ref in pending.calls)
        while remaining:
            ready, _ = ray.wait(list(remaining), num_returns=1, timeout=timeout_s)
            if not ready:
                raise GroupFailedError(f"model-parallel group for {self.source.name!r}: no result within {timeout_s} s")
            ref = ready[0]
            name = remaining.pop(ref)
            try:
                ray.get(ref)
            except RayActorError as error:
                raise GroupFailedError(f"{name} of model {self.source.name!r} died; rebuild the group: "
                                       f"{error}") from error
            except RayTaskError as error:
                raise GroupFailedError(f"{name} of model {self.source.name!r} failed: {error}") from error
            except GetTimeoutError as error:  # pragma: no cover - wait() said ready
                raise GroupFailedError(str(error)) from error
        return ray.get(pending.output)

    async def infer_async(self, state: ActivationState, timeout_s: float = DEFAULT_RESULT_TIMEOUT_S) -> ActivationState:
        """`infer` for an asyncio caller: awaits the stages' object references without blocking its event loop,
        so several batches can be in flight in the stages at once."""
        pending = self.submit(state)
        names = {ref: name for name, ref in pending.calls}

        async def checked(ref: ray.ObjectRef) -> None:
            try:
                await ref
            except RayActorError as error:
                raise GroupFailedError(f"{names[ref]} of model {self.source.name!r} died; rebuild the group: "
                                       f"{error}") from error
            except RayTaskError as error:
                raise GroupFailedError(f"{names[ref]} of model {self.source.name!r} failed: {error}") from error

        try:
            await asyncio.wait_for(asyncio.gather(*(checked(ref) for _, ref in pending.calls)), timeout=timeout_s)
        except asyncio.TimeoutError:
            raise GroupFailedError(f"model-parallel group for {self.source.name!r}: no result "
                                   f"within {timeout_s} s") from None
        return await pending.output

    def infer(self, state: ActivationState) -> ActivationState:
        return self.result(self.submit(state))

    def infer_many(self, states: Sequence[ActivationState]) -> list[ActivationState]:
        """Submit all batches at once (they pipeline through the stages), then collect them in order."""
        pending = [self.submit(state) for state in states]
        return [self.result(p) for p in pending]

    def actor_handles(self) -> list[list]:
        return [list(row) for row in self.actors]
