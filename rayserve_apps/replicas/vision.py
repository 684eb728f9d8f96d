"""The per-model vision deployment: a replica that classifies images with a ViT.

Images arrive as float32 arrays [N, C, H, W] already checked by the ingress; the replica checks them again (a
handle caller may skip the ingress) and answers the arg-max label with the class probabilities.

Two execution paths:

* plain (default): a timm ViT; `@serve.batch` batches concurrent requests.
* token adaptation (OTAS), when the model's spec names a policy for the role ``token_adaptation``: the unified
  adaptive ViT with its task registry (`models/task_registry.py`), driven by the OTAS policies of
  `placement/otas_*.py` on the wall clock: Alg. 1 batching, eviction of queries that cannot meet their deadline,
  Alg. 2/3 token allocation from the measured profile, and utility accounting. Every image is one OTAS query with
  a task, an SLO (the model's `slo_ms` unless the caller gives one) and a utility. Metrics: chosen gamma, batch
  size, utility and outcomes (`plexserve_otas_*`).

  Spec: ``policies: {token_adaptation: {name: otas, params: {artifacts: <dir>, default_task: digit, ...}}}``
  (see `OtasDeploymentParams`); `image_size_px` and `in_chans` must match the artefacts (32 and 1 for digits).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve

from models.task_registry import DIGITS_ARTIFACTS_DIR, TaskRegistry
from models.vit import load_vit
from placement.otas.adaptive_batching import AdaptiveBatchingParams, OtasRequest
from placement.otas.profile import OtasProfile
from placement.otas.replica_scheduler import Dispatch, OtasScheduler
from placement.otas.token_allocation import OtasTokenAllocator, TokenAllocationParams
from placement.core.deployment_spec import ModelSpec
from rayserve_apps._threads import set_torch_threads_for
from rayserve_apps.requests import RequestError

logger = logging.getLogger("ray.serve")

TOKEN_ADAPTATION_ROLE = "token_adaptation"
OTAS_POLICY_NAME = "otas"
#: How long the OTAS executor waits before re-planning when nothing is runnable but queries are queued, seconds.
OTAS_IDLE_RECHECK_S = 0.005
BATCH_SIZE_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128]


class OtasDeploymentParams(BaseModel):
    """Params of the ``token_adaptation`` policy ``otas`` of a vision model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    artifacts: str = Field(default=str(DIGITS_ARTIFACTS_DIR), description="Directory of the trained backbone and tasks (models/artifacts/digits_vit).")
    profile: str | None = Field(default=None, description="Measured OtasProfile JSON; default <artifacts>/profile.json.")
    default_task: str = Field(default="digit", description="Task of a query that names none (the ingress passes no task).")
    default_utility: float = Field(default=1.0, ge=0, description="Utility of a query that names none.")
    batching: AdaptiveBatchingParams = Field(default_factory=AdaptiveBatchingParams, description="OTAS Alg. 1 parameters.")
    allocation: TokenAllocationParams | None = Field(default=None, description="OTAS Alg. 2-3 parameters; gamma_list defaults to the artefacts'.")


def parse_otas_params(params: dict[str, Any]) -> OtasDeploymentParams:
    try:
        return OtasDeploymentParams(**params)
    except ValidationError as error:
        fields = "; ".join(".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in error.errors())
        raise ValueError(f"invalid token_adaptation params: {fields}") from None


@dataclass
class _Pending:
    image: torch.Tensor
    future: asyncio.Future


class OtasMetrics:
    """plexserve_otas_* metrics of one model (Ray Serve adds the replica tags)."""

    def __init__(self, model: str):
        from ray.serve.metrics import Counter, Gauge, Histogram

        self.tags = {"model": model}
        # Ray histograms need positive boundaries, so the gamma selection is a counter of batches per gamma.
        self.gamma = _metric(Counter, "plexserve_otas_batches_total", description="Batches run, by the gamma chosen (tokens per layer: <0 merged, >0 prompts).",
                             tag_keys=("model", "gamma"))
        self.last_gamma = _metric(Gauge, "plexserve_otas_gamma", description="Gamma of the latest batch.", tag_keys=("model",))
        self.batch_size = _metric(Histogram, "plexserve_otas_batch_size", description="Queries per OTAS batch.",
                                  boundaries=BATCH_SIZE_BOUNDARIES, tag_keys=("model",))
        self.utility = _metric(Counter, "plexserve_otas_utility_total", description="Expected utility earned (u_r x profiled accuracy, in time).",
                               tag_keys=("model",))
        self.outcomes = _metric(Counter, "plexserve_otas_queries_total", description="OTAS queries by outcome (in_time, late, evicted).",
                                tag_keys=("model", "outcome"))

    def batch(self, gamma: int, size: int) -> None:
        self.gamma.inc(1, tags={**self.tags, "gamma": str(gamma)})
        self.last_gamma.set(gamma, tags=self.tags)
        self.batch_size.observe(size, tags=self.tags)

    def outcome(self, outcome: str, count: int, utility: float = 0.0) -> None:
        if count:
            self.outcomes.inc(count, tags={**self.tags, "outcome": outcome})
        if utility > 0:
            self.utility.inc(utility, tags=self.tags)


_METRICS: dict[str, Any] = {}


def _metric(kind, name: str, **kwargs):
    """One metric object per name and process (a replica never redefines a metric with other tag keys)."""
    if name not in _METRICS:
        _METRICS[name] = kind(name, **kwargs)
    return _METRICS[name]


class OtasExecutor:
    """Runs the OTAS policies on the wall clock over the adaptive ViT; plain asyncio + torch (testable without Ray)."""

    def __init__(self, registry: TaskRegistry, profile: OtasProfile, params: OtasDeploymentParams, default_slo_ms: float,
                 metrics: OtasMetrics | None = None, clock: Callable[[], float] = time.monotonic):
        registry.task(params.default_task)
        self.registry = registry
        self.profile = profile
        self.params = params
        self.default_slo_ms = default_slo_ms
        self.metrics = metrics
        self.clock = clock
        allocation = params.allocation or TokenAllocationParams(gamma_list=registry.gamma_list)
        allocator = OtasTokenAllocator(profile, allocation, batch_cap=params.batching.epsilon)
        self.scheduler = OtasScheduler(allocator, params.batching, clock(), allocation.rate_window_s)
        self._wake: asyncio.Event | None = None
        self._runner: asyncio.Task | None = None

    async def classify(self, images: torch.Tensor, task_id: str | None = None, slo_ms: float | None = None,
                       utility: float | None = None) -> list[dict]:
        """One OTAS query per image; answers {'label', 'probabilities', 'task', 'gamma'} per image."""
        task_id = task_id or self.params.default_task
        slo_ms = self.default_slo_ms if slo_ms is None else slo_ms
        utility = self.params.default_utility if utility is None else utility
        self.registry.check_images(images)
        now = self.clock()
        loop = asyncio.get_running_loop()
        futures = []
        for image in images:
            query = self.registry.make_query(task_id, image, now, slo_ms, utility)  # ValueError names a bad field
            future = loop.create_future()
            self.scheduler.submit(OtasRequest(task_id, now, query.deadline_s, utility, payload=_Pending(query.image, future)))
            futures.append(future)
        self._ensure_running()
        self._wake.set()
        return list(await asyncio.gather(*futures))

    def _ensure_running(self) -> None:
        if self._runner is None or self._runner.done():
            self._wake = asyncio.Event()
            self._runner = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            if not self.scheduler.queue:
                self._wake.clear()
                await self._wake.wait()
            dispatch, evicted = self.scheduler.next_batch(self.clock())
            self._reject(evicted)
            if dispatch is None:
                await asyncio.sleep(OTAS_IDLE_RECHECK_S)
                continue
            try:
                await self._execute(dispatch)
            except Exception as error:  # noqa: BLE001 - a failed batch fails its own queries, not the replica
                logger.exception("OTAS batch failed")
                for request in dispatch.batch.requests:
                    if not request.payload.future.done():
                        request.payload.future.set_exception(error)

    def _reject(self, evicted: list[OtasRequest]) -> None:
        for request in evicted:
            if not request.payload.future.done():
                request.payload.future.set_exception(RequestError(
                    503, "deadline_unmeetable", f"query for task {request.task_id!r} cannot finish before its deadline; evicted"))
        if self.metrics is not None:
            self.metrics.outcome("evicted", len(evicted))

    async def _execute(self, dispatch: Dispatch) -> None:
        requests = dispatch.batch.requests
        images = torch.stack([r.payload.image for r in requests])
        task_ids = [r.task_id for r in requests]
        logits = await asyncio.to_thread(self.registry.logits, images, task_ids, dispatch.gamma)
        finish = self.clock()
        accuracy = [self.profile.task_accuracy(t, dispatch.gamma) for t in task_ids]
        ledger = self.scheduler.ledger
        counts_before, utility_before = dict(ledger.counts), ledger.utility
        self.scheduler.complete(dispatch, finish, expected_accuracy=accuracy)
        if self.metrics is not None:
            self.metrics.batch(dispatch.gamma, len(requests))
            self.metrics.outcome("in_time", ledger.counts["in_time"] - counts_before["in_time"], ledger.utility - utility_before)
            self.metrics.outcome("late", ledger.counts["late"] - counts_before["late"])
        for request, row, task_id in zip(requests, logits, task_ids):
            probabilities = torch.softmax(row, dim=-1)
            if not request.payload.future.done():
                request.payload.future.set_result({"label": int(probabilities.argmax()), "probabilities": probabilities.tolist(),
                                                   "task": task_id, "gamma": dispatch.gamma})


def load_otas_executor(spec: ModelSpec, params: dict[str, Any], metrics: OtasMetrics | None = None) -> OtasExecutor:
    """The OTAS path of a vision model from its spec and its token_adaptation params."""
    otas = parse_otas_params(params)
    registry = TaskRegistry.load(otas.artifacts)
    expected = (registry.config.in_chans, registry.config.image_size_px)
    if (spec.in_chans, spec.image_size_px) != expected:
        raise ValueError(f"model {spec.name!r}: in_chans/image_size_px must be {expected[0]}/{expected[1]} for the artefacts "
                         f"{otas.artifacts}, got {spec.in_chans}/{spec.image_size_px}")
    profile_path = Path(otas.profile) if otas.profile else Path(otas.artifacts) / "profile.json"
    if not profile_path.exists():
        raise ValueError(f"token_adaptation params.profile: {profile_path} does not exist (python -m models.adaptive_vit_profile)")
    return OtasExecutor(registry, OtasProfile.load(profile_path), otas, spec.slo_ms, metrics)


@serve.deployment
class VisionModelDeployment:
    """Hosts one ViT classifier; `classify` is its whole API."""

    def __init__(self, model_spec: dict):
        self.spec = ModelSpec.model_validate(model_spec)
        set_torch_threads_for(self.spec.num_cpus_per_replica)
        self.otas: OtasExecutor | None = None
        policy = self.spec.policies.get(TOKEN_ADAPTATION_ROLE)
        if policy is not None:
            if policy.name != OTAS_POLICY_NAME:
                raise ValueError(f"policies.{TOKEN_ADAPTATION_ROLE}.name must be {OTAS_POLICY_NAME!r}, got {policy.name!r}")
            self.otas = load_otas_executor(self.spec, policy.params, OtasMetrics(self.spec.name))
            return
        self.classifier = load_vit(
            self.spec.source, checkpoint_path=self.spec.checkpoint_path, num_classes=self.spec.num_classes or 1000,
            image_size_px=self.spec.image_size_px or 224, in_chans=self.spec.in_chans, name=self.spec.name,
            **self.spec.timm_kwargs,
        )
        self._classify_batch.set_max_batch_size(self.spec.max_batch_size)
        self._classify_batch.set_batch_wait_timeout_s(self.spec.batch_wait_timeout_ms / 1000.0)

    async def classify(self, images: np.ndarray, task_id: str | None = None, slo_ms: float | None = None,
                       utility: float | None = None) -> list[dict]:
        """One {'label', 'probabilities'} per image, in input order; ValueError for a bad array.

        With token adaptation each image is an OTAS query of `task_id` (default: the configured task) with `slo_ms`
        and `utility`; the answer also names the task and the gamma its batch ran at.
        """
        tensor = torch.as_tensor(np.asarray(images))
        if self.otas is not None:
            return await self.otas.classify(tensor.float() if tensor.dtype == torch.float64 else tensor, task_id, slo_ms, utility)
        if task_id is not None:
            raise ValueError(f"model {self.spec.name!r} has no token_adaptation policy, so it takes no task_id")
        self.classifier.check_images(tensor)
        return await self._classify_batch(tensor.float())

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def _classify_batch(self, requests: list[torch.Tensor]) -> list[list[dict]]:
        probabilities = torch.softmax(self.classifier.logits(torch.cat(requests)), dim=-1)
        results, start = [], 0
        for request in requests:
            chunk = probabilities[start : start + len(request)]
            results.append([{"label": int(p.argmax()), "probabilities": p.tolist()} for p in chunk])
            start += len(request)
        return results
