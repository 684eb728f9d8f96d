"""A group replica: one device group of a placement, running its hosted models on the model-parallel runtime.

Each group of a placement (AlpaServe §4.2) becomes one Serve deployment whose replica reserves the group's
devices as a placement group: bundle 0 holds the replica itself, bundles 1..n one device each. Every hosted model
runs as a `parallel.ModelParallelGroup` whose (stage, shard) actors are pinned to those device bundles, so the
models of a group share its devices and its parallel configuration, and consecutive requests pipeline through
the stages (AlpaServe §3).

Why a placement group and not Serve's gang scheduling: a gang is a set of *replicas* scheduled together, each
routed to independently by Serve; a model-parallel group is one serving unit whose stages must see every request
in order. One replica owning the bundles of its devices, with plain Ray actors for the stages, keeps a request's
path through the stages inside the group and lets Serve route whole requests to whole groups.

Text models run on the ConcatBatching path (TCB §4.1): the texts of a request are packed into rows of at most
the model's input limit, with per-request positions and a block-diagonal attention mask; the group's stages run
the encoder body and the replica pools each request's tokens. Vision models run their whole layer view.

A polymorphing text model (`policies.polymorphing: {name: arlo}`) placed in a group composes Arlo with the group
instead of getting runtime replicas of its own: the group replica is one instance that holds every runtime of the
model (its stages share the weights, so a runtime is only a shape), and a request's packed rows take the width of
its ideal runtime (Arlo §3.4, Alg. 1 lines 18-19: the shortest max length that fits its longest text), untrimmed.
The stages therefore only ever see the few static row widths that Arlo's staircase chose, the shapes a compiled
stage would be built for; texts longer than the longest runtime are refused. Arlo's instance allocation and
multi-level queue do not apply inside a group: AlpaServe's placement decides the group's instances.

The hosted models are the replica's `user_config`; `reconfigure()` loads new models first, then stops routing
to the dropped ones, drains their in-flight requests and frees them, all without restarting the replica. A model
that arrives while another leaves (a swap) takes over the leaving model's stage actors once they are drained, and
loads its weights into those running processes instead of starting new ones.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch
from ray import serve
from ray.util import get_current_placement_group

from models.device import device_reservation
from models.task_registry import artifacts_config
from models.text_encoder import TextTokenizer, load_text_pooling, load_text_tokenizer
from models.vit import check_image_batch
from ops.packing import PackedBatch
from ops.pooling import DEFAULT_POOLING, Pooling
from parallel.group_runtime import GroupFailedError, ModelParallelGroup
from parallel.plan import ParallelPlan, PlanOrigin, stored_or_even
from parallel.stage_layers import ModelSource
from placement.core.deployment_spec import ModelSpec
from placement.core.profiles import ParallelConfig
from rayserve_apps import metrics
from rayserve_apps.contracts import STATS_MODELS, STATS_QUEUE_LENGTH
from rayserve_apps.engine import (
    DeviceSlots,
    ImageBatchFormer,
    ServingEngine,
    StagedOtasBackend,
    StagedTextBackend,
    StagedVisionBackend,
    TextBatchFormer,
    answer_requests,
    batching_scheduler_for,
)
from rayserve_apps.engine.otas_executor import OtasExecutor, OtasMetrics, load_otas_parts, token_adaptation_params
from rayserve_apps.replicas.text import check_text_request, text_batch_metrics

logger = logging.getLogger("ray.serve")

#: Share of a device bundle each stage actor asks for: a group can host up to this many models' actors per device.
MAX_MODELS_PER_GROUP = 8
#: Seconds `reconfigure` waits for a dropped model's in-flight requests before freeing it anyway.
DRAIN_TIMEOUT_S = 60.0
#: Poll interval while draining.
DRAIN_POLL_S = 0.05


def model_source(spec: ModelSpec) -> ModelSource:
    """What a stage actor needs to load its share of a served model."""
    if spec.kind == "vision" and spec.in_chans != 3:
        timm_kwargs = {**spec.timm_kwargs, "in_chans": spec.in_chans}
    else:
        timm_kwargs = dict(spec.timm_kwargs)
    return ModelSource(
        name=spec.name, kind=spec.kind, source=spec.source, checkpoint_path=spec.checkpoint_path,
        num_classes=spec.num_classes or 1000, image_size_px=spec.image_size_px or 224, timm_kwargs=timm_kwargs,
    )


@dataclass
class HostedModel:
    """A model running on this group's devices, with its in-flight count for draining and routing."""

    spec: ModelSpec
    runtime: ModelParallelGroup
    tokenizer: TextTokenizer | None
    #: Text models: the checkpoint's pooling, applied here to the stages' token states.
    pooling: Pooling = DEFAULT_POOLING
    #: The model's serving engine: its queue, batch former and the stage actors as backend.
    engine: ServingEngine | None = None
    #: Token-adaptation vision models: the OTAS query front of `engine` (its task registry holds the heads).
    otas: OtasExecutor | None = None
    #: Longest text in tokens (text models): the spec's, the tokenizer's, the scheduler's and Arlo's limits.
    limit_tokens: int = 0
    in_flight: int = 0
    #: Arlo runtime max lengths of a polymorphing text model (empty: rows are trimmed to the longest used row).
    runtime_lengths_tokens: tuple[int, ...] = ()
    #: Forward passes by row width in tokens (how often each runtime shape ran).
    passes_by_width: Counter = field(default_factory=Counter)
    #: Cleared while the model's stage actors are being rebuilt after a failure; requests wait for it.
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    rebuilds: int = 0
    #: Where the stage cuts come from: "planned" (the plan stored with the profile) or "even" (`ParallelPlan.even`).
    plan_origin: PlanOrigin = "even"

    def __post_init__(self) -> None:
        self.ready.set()


@serve.deployment
class GroupReplica:
    """Serves the models of one device group; its hosted models come from `user_config`."""

    def __init__(self, group_name: str, device_resource: str):
        self.group_name = group_name
        self.device_resource = device_resource
        self.placement_group = get_current_placement_group()
        #: The parallel configuration every hosted model runs with; None while the slot is empty.
        self.config: ParallelConfig | None = None
        #: The batches the group runs at once over all its models, one per stage (new with each config).
        self.device_slots = DeviceSlots(1)
        self.models: dict[str, HostedModel] = {}
        self.placement_version = -1
        #: Model -> stored plan (ParallelPlan JSON) for the current config, from `user_config["plans"]`.
        self.stored_plans: dict[str, dict[str, Any]] = {}
        self._even_logged: set[tuple[str, str]] = set()
        self.started_at_s = time.time()
        self._queue_gauge = metrics.group_queue_length()
        #: Replaced engines answering what they still hold.
        self._draining: set[asyncio.Task] = set()

    # ---- hosted models ----

    def _start_model(self, spec: ModelSpec, reuse_actors: list[list] | None = None) -> HostedModel:
        assert self.config is not None
        tokenizer = load_text_tokenizer(spec.source) if spec.kind == "text" else None
        source = model_source(spec)
        otas_parts = None
        otas = token_adaptation_params(spec) if spec.kind == "vision" else None
        if otas is not None:
            if self.config.intra_op_degree != 1:
                raise ValueError(f"group {self.group_name}: model {spec.name!r} uses token adaptation, whose blocks "
                                 "are not split by tensor parallelism; its group needs intra_op_degree 1, "
                                 f"got {self.config.key()}")
            otas_parts = (otas, *load_otas_parts(spec, otas))
            source = source.model_copy(update={"adaptive_artifacts": otas.artifacts})
        # Text: the stages run embeddings and blocks; pooling of packed rows happens here, per request.
        num_layers = _num_layers(source) - (1 if spec.kind == "text" else 0)
        plan, plan_origin = self._plan_for(spec.name, num_layers)
        bundle_indices = None
        if self.placement_group is not None:
            # Bundle 0 is the replica's own; stage s shard r runs on the device bundle 1 + s * degree + r.
            bundle_indices = [1 + k for k in range(plan.num_actors)]
        # Each stage actor takes its model's share of its device bundle: num_gpus on GPUs, the logical resource on CPUs.
        reservation = device_reservation(self.device_resource, 1.0 / MAX_MODELS_PER_GROUP)
        runtime = ModelParallelGroup(
            source, plan, placement_group=self.placement_group, bundle_indices=bundle_indices, num_cpus_per_actor=0.0,
            num_threads_per_actor=self._threads_per_device(),
            actor_resources=reservation.get("resources"), num_gpus_per_actor=reservation.get("num_gpus", 0.0),
            reuse_actors=reuse_actors,
        )
        logger.info("group %s: started %s (%s%s)", self.group_name, spec.name, self.config.key(),
                    ", in a dropped model's stage actors" if reuse_actors is not None else "")
        hosted = HostedModel(spec=spec, runtime=runtime, tokenizer=tokenizer, plan_origin=plan_origin,
                             pooling=load_text_pooling(spec.source) if spec.kind == "text" else DEFAULT_POOLING)
        if spec.kind == "vision":
            self._attach_vision_engine(hosted, otas_parts)
        return hosted

    def _plan_for(self, model: str, num_layers: int) -> tuple[ParallelPlan, PlanOrigin]:
        """The plan stored with the model's profile for this config, else even cuts (logged once per model and
        config)."""
        assert self.config is not None
        plan, origin = stored_or_even(self.stored_plans.get(model), num_layers, self.config.pipeline_stages,
                                      self.config.intra_op_degree)
        if origin == "even" and (model, self.config.key()) not in self._even_logged:
            self._even_logged.add((model, self.config.key()))
            logger.info("group %s: no planned stage cuts for %s under %s in the profiles; falling back to even cuts",
                        self.group_name, model, self.config.key())
        return plan, origin

    def _threads_per_device(self) -> int:
        """Torch threads of each stage actor: one per whole CPU of its device bundle, at least one."""
        if self.placement_group is None or len(self.placement_group.bundle_specs) < 2:
            return 1
        return max(1, math.floor(self.placement_group.bundle_specs[1].get("CPU", 1.0)))

    def _device_bundles(self) -> int:
        """Device bundles this replica holds (bundle 0 is its own)."""
        return len(self.placement_group.bundle_specs) - 1 if self.placement_group is not None else 0

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply a new set of hosted models (and parallel configuration): load the new, then drain and drop the old,
        without a replica restart. The devices themselves are the slot's placement-group bundles."""
        specs = [ModelSpec.model_validate(m) for m in user_config.get("models", [])]
        if len(specs) > MAX_MODELS_PER_GROUP:
            raise ValueError(f"group {self.group_name}: {len(specs)} models exceed "
                             f"MAX_MODELS_PER_GROUP={MAX_MODELS_PER_GROUP}")
        config = ParallelConfig.model_validate(user_config["config"]) if user_config.get("config") else None
        if specs and config is None:
            raise ValueError(f"group {self.group_name}: user_config.config is required when models are hosted")
        num_devices = int(user_config.get("num_devices", config.num_devices if config else 0))
        if config is not None and config.num_devices != num_devices:
            raise ValueError(f"group {self.group_name}: config {config.key()} does not use num_devices={num_devices}")
        if self.placement_group is not None and num_devices > self._device_bundles():
            raise ValueError(f"group {self.group_name}: user_config.num_devices={num_devices} but the replica holds "
                             f"{self._device_bundles()} device bundles")
        plans = user_config.get("plans", {})
        restart_all = config != self.config
        self.config = config
        if restart_all:  # every model restarts, so every engine is new and takes the new slots
            self.device_slots = DeviceSlots(config.pipeline_stages if config else 1)
        changed_plans = {name for name in set(plans) | set(self.stored_plans)
                         if plans.get(name) != self.stored_plans.get(name)}
        self.stored_plans = plans
        wanted = {spec.name: spec for spec in specs}
        to_start = [spec for name, spec in wanted.items()
                    if restart_all or name not in self.models or self.models[name].spec != spec
                    or name in changed_plans]
        recycled = await self._recycle_leaving(wanted, to_start, restart_all)
        # Models start side by side: a new one waits mostly for its stage actors' processes to come up, one that
        # takes over a dropped model's actors only for its weights.
        started = dict(zip([spec.name for spec in to_start], await asyncio.gather(*(
            asyncio.to_thread(self._start_model, spec, recycled.get(spec.name)) for spec in to_start))))
        dropped = [self.models[name] for name in self.models if name not in wanted or name in started]
        self.models = {**{n: m for n, m in self.models.items() if n in wanted and n not in started}, **started}
        runtime_lengths = user_config.get("runtime_lengths_tokens", {})
        batching = user_config.get("batching", {})
        for name, hosted in self.models.items():
            lengths = tuple(sorted(runtime_lengths.get(name, ())))
            if hosted.tokenizer is not None and (hosted.engine is None or lengths != hosted.runtime_lengths_tokens):
                hosted.runtime_lengths_tokens = lengths
                self._attach_text_engine(hosted, batching.get(name))
        for hosted in dropped:
            await self._drain(hosted)
            hosted.runtime.shutdown()
            logger.info("group %s: dropped %s", self.group_name, hosted.spec.name)
        self.placement_version = int(user_config.get("placement_version", self.placement_version + 1))
        metrics.placement_version().set(self.placement_version, tags={"group": self.group_name})

    async def _recycle_leaving(self, wanted: dict[str, ModelSpec], to_start: list[ModelSpec],
                               restart_all: bool) -> dict[str, list[list]]:
        """The stage actors of models that leave this group, drained and handed over for the models that arrive
        to reload in place (arriving model name -> one leaving model's actors): a swap then costs its weights, not the
        seconds of starting processes (on this project's 2-core machine those seconds also slow every group).
        Only a leaving model is recycled (the ingress no longer routes it here, so draining it first delays no
        request), only under an unchanged parallel configuration without tensor parallelism (a shard's process
        group is bound to its peers)."""
        if restart_all or self.config is None or self.config.intra_op_degree != 1:
            return {}
        arriving = [spec.name for spec in to_start if spec.name not in self.models]
        leaving = [name for name in self.models if name not in wanted]
        recycled = {}
        for arrives, leaves in zip(arriving, leaving):
            hosted = self.models.pop(leaves)
            await self._drain(hosted)
            recycled[arrives] = hosted.runtime.release()
            logger.info("group %s: dropped %s, its stage actors kept for %s", self.group_name, leaves, arrives)
        return recycled

    async def _drain(self, hosted: HostedModel) -> None:
        """Answer the model's queued and in-flight requests (at most DRAIN_TIMEOUT_S) and stop its engine."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        if hosted.engine is not None:
            await hosted.engine.drain(DRAIN_TIMEOUT_S)
        while hosted.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)

    def _attach_text_engine(self, hosted: HostedModel, batching_policy: dict | None) -> None:
        """The text model's serving engine: its TCB scheduler forms the batches, the stage actors run them, with as
        many batches in flight as the group has pipeline stages (AlpaServe §3: every stage busy)."""
        spec, tokenizer = hosted.spec, hosted.tokenizer
        limit = min(spec.max_input_length_tokens or tokenizer.max_length, tokenizer.max_length)
        if hosted.runtime_lengths_tokens:
            limit = min(limit, hosted.runtime_lengths_tokens[-1])
        scheduler = batching_scheduler_for(spec, batching_policy, limit)
        hosted.limit_tokens = min(limit, scheduler.max_request_tokens)
        record = text_batch_metrics(spec.name)

        def on_packed(batch: PackedBatch) -> None:
            record(batch)
            hosted.passes_by_width[int(batch.input_ids.shape[1])] += 1

        backend = StagedTextBackend(hosted.runtime, scheduler, tokenizer.pad_token_id, hosted.runtime_lengths_tokens,
                                    on_packed=on_packed, pooling=hosted.pooling)
        former = TextBatchFormer(spec.name, scheduler, spec.batch_wait_timeout_ms / 1000.0, spec.slo_ms)
        if hosted.engine is not None:  # the old engine answers what it holds; new requests go to the new one
            task = asyncio.get_running_loop().create_task(hosted.engine.drain(DRAIN_TIMEOUT_S))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)
        hosted.engine = ServingEngine(f"{self.group_name}/{spec.name}", former, backend,
                                      max_batches_in_flight=self.device_slots.num_stages,
                                      device_slots=self.device_slots)

    def _attach_vision_engine(self, hosted: HostedModel, otas_parts: tuple | None) -> None:
        """The vision model's serving engine, with the stage actors as backend and as many batches in flight as the
        group has pipeline stages: OTAS batches at a gamma (its task heads run here) for a token-adaptation model,
        FIFO batches of up to `max_batch_size` images otherwise."""
        spec = hosted.spec
        name = f"{self.group_name}/{spec.name}"
        in_flight = self.device_slots.num_stages
        if otas_parts is not None:
            otas, registry, profile = otas_parts
            hosted.otas = OtasExecutor(registry, profile, otas, spec.slo_ms, OtasMetrics(spec.name),
                                       backend=StagedOtasBackend(hosted.runtime, registry),
                                       max_batches_in_flight=in_flight, name=name,
                                       device_slots=self.device_slots)
            hosted.engine = hosted.otas.engine
            return
        former = ImageBatchFormer(spec.max_batch_size, spec.batch_wait_timeout_ms / 1000.0)
        hosted.engine = ServingEngine(name, former, StagedVisionBackend(hosted.runtime),
                                      max_batches_in_flight=in_flight, device_slots=self.device_slots,
                                      on_batch=lambda batch, _: metrics.batch_size().observe(
                                          len(batch.items), tags={"model": spec.name}))

    def _hosted(self, model: str) -> HostedModel:
        hosted = self.models.get(model)
        if hosted is None:
            raise ValueError(f"group {self.group_name} does not host model {model!r}; it hosts {sorted(self.models)}")
        return hosted

    def _rebuild_soon(self, hosted: HostedModel) -> None:
        if not hosted.ready.is_set():
            return  # a rebuild is already under way
        hosted.ready.clear()

        async def rebuild() -> None:
            try:
                await asyncio.to_thread(hosted.runtime.rebuild)
                hosted.rebuilds += 1
                logger.warning("group %s: rebuilt %s after a failure", self.group_name, hosted.spec.name)
            finally:
                hosted.ready.set()

        asyncio.get_running_loop().create_task(rebuild())

    def _failed_over(self, hosted: HostedModel, error: Exception) -> RuntimeError:
        """Only this model's in-flight batches fail: its stage actors are replaced in the background, and the
        request's error says to retry."""
        self._rebuild_soon(hosted)
        return RuntimeError(f"group {self.group_name}, model {hosted.spec.name!r}: {error}; its stage actors are "
                            "being rebuilt, retry the request")

    # ---- requests ----

    async def embed_batch(self, model: str, requests: list[list[list[int]]], budgets_s: list[float]) -> list:
        """Several requests of one text model at once (what the ingress sends): they join the model's engine queue
        and are batched with everything else waiting; per request its embeddings (float32 rows) or its error."""
        hosted = self._hosted(model)
        if hosted.engine is None:
            raise ValueError(f"model {model!r} is not a text model")
        hosted.in_flight += len(requests)
        self._queue_gauge.set(self.queue_length(), tags={"group": self.group_name})
        try:
            await hosted.ready.wait()
            outcomes = await answer_requests(hosted.engine, requests, budgets_s,
                                             lambda ids: check_text_request(ids, hosted.tokenizer, hosted.limit_tokens))
        finally:
            hosted.in_flight -= len(requests)
            self._queue_gauge.set(self.queue_length(), tags={"group": self.group_name})
        return [self._failed_over(hosted, o) if isinstance(o, GroupFailedError) else o for o in outcomes]

    async def embed_token_ids(self, model: str, token_ids: list[list[int]]) -> list[list[float]]:
        """One request's embeddings (handle callers, tests); ValueError for bad ids."""
        hosted = self._hosted(model)
        (outcome,) = await self.embed_batch(model, [token_ids], [hosted.spec.slo_ms / 1000.0])
        if isinstance(outcome, Exception):
            raise outcome
        return [row.tolist() for row in outcome]

    async def classify(self, model: str, images: np.ndarray, task_id: str | None = None, slo_ms: float | None = None,
                       utility: float | None = None) -> list[dict]:
        """One {'label', 'probabilities'} per image; the images join the model's engine queue and share batches
        with other requests'. A token-adaptation model takes OTAS' `task_id`, `slo_ms` and `utility`."""
        hosted = self._hosted(model)
        if hosted.spec.kind != "vision":
            raise ValueError(f"model {model!r} is not a vision model")
        tensor = torch.as_tensor(np.asarray(images, dtype=np.float32))
        if hosted.otas is None:
            if task_id is not None:
                raise ValueError(f"model {model!r} has no token_adaptation policy, so it takes no task_id")
            side = hosted.spec.image_size_px or 224
            check_image_batch(tensor, (hosted.spec.in_chans, side, side))
        hosted.in_flight += 1
        self._queue_gauge.set(self.queue_length(), tags={"group": self.group_name})
        try:
            await hosted.ready.wait()
            if hosted.otas is not None:
                return await hosted.otas.classify(tensor, task_id, slo_ms, utility)
            return await hosted.engine.answer(list(tensor), hosted.engine.clock() + hosted.spec.slo_ms / 1000.0)
        except GroupFailedError as error:
            raise self._failed_over(hosted, error) from None
        finally:
            hosted.in_flight -= 1
            self._queue_gauge.set(self.queue_length(), tags={"group": self.group_name})

    # ---- state for routers, tests and people ----

    def queue_length(self) -> int:
        return sum(hosted.in_flight for hosted in self.models.values())

    def record_routing_stats(self) -> dict[str, Any]:
        return {STATS_MODELS: sorted(self.models), STATS_QUEUE_LENGTH: self.queue_length()}

    async def info(self) -> dict[str, Any]:
        """Where and what this replica is: for `GET /v1/placement`, tests and people."""
        stage_pids: dict[str, list[list[int]]] = {}
        for name, hosted in self.models.items():
            await hosted.ready.wait()
            stage_pids[name] = [list(await asyncio.gather(*(actor.ping.remote() for actor in row)))
                                for row in hosted.runtime.actor_handles()]
        return {
            "group": self.group_name, "config": self.config.model_dump() if self.config else None,
            "models": sorted(self.models), "placement_version": self.placement_version, "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "started_at_s": self.started_at_s, "queue_length": self.queue_length(), "stage_actor_pids": stage_pids,
            "rebuilds": {name: hosted.rebuilds for name, hosted in self.models.items()},
            "stage_cuts": {name: {"origin": h.plan_origin,
                                  "stages": [[s.start_layer, s.end_layer] for s in h.runtime.plan.stages]}
                           for name, h in self.models.items()},
            "runtime_lengths_tokens": {name: list(h.runtime_lengths_tokens) for name, h in self.models.items()
                                       if h.runtime_lengths_tokens},
            "passes_by_width_tokens": {name: dict(h.passes_by_width) for name, h in self.models.items()
                                       if h.tokenizer is not None},
            "engines": {name: h.engine.totals.as_dict() for name, h in self.models.items() if h.engine is not None},
        }

    def check_health(self) -> None:
        for hosted in self.models.values():
            if not hosted.runtime.actors:
                raise RuntimeError(f"model {hosted.spec.name} of group {self.group_name} has no running stage actors")

    # ---- readiness, for the HTTP edge's /v2/health/ready ----

    def models_ready(self) -> dict[str, bool]:
        """Per hosted model, whether it can answer now (False while its stage actors are being rebuilt); never waits."""
        return {name: hosted.ready.is_set() for name, hosted in self.models.items()}

    def __del__(self):
        for hosted in getattr(self, "models", {}).values():
            hosted.runtime.shutdown()


def _num_layers(source: ModelSource) -> int:
    """Length of the model's layer view without loading weights: embeddings + blocks + head."""
    if source.kind == "text":
        from transformers import AutoConfig

        from models.text_encoder import resolve_text_source

        config = AutoConfig.from_pretrained(resolve_text_source(source.source), local_files_only=True)
        return config.num_hidden_layers + 2
    if source.adaptive_artifacts is not None:
        return artifacts_config(source.adaptive_artifacts).depth + 2
    depth = source.timm_kwargs.get("depth")
    if depth is None:
        import timm

        depth = len(timm.create_model(source.source.split(":", 1)[1], pretrained=False, num_classes=1,
                                      **source.timm_kwargs).blocks)
    return int(depth) + 2
