"""A token-adaptation (OTAS) model on the serving engine: its params, its metrics and its query front.

Spec: ``policies: {token_adaptation: {name: otas, params: {artifacts: <dir>, default_task: digit, ...}}}``
(`OtasDeploymentParams`); `image_size_px` and `in_chans` must match the artefacts (32 and 1 for digits).

`OtasExecutor.classify` turns every image into one OTAS query (a task, an SLO -- the model's `slo_ms` unless the
caller gives one -- and a utility), validated as OTAS' "Make Query" does, and hands them to a `ServingEngine`
whose former is `OtasBatchFormer` (Alg. 1 batching, eviction, Alg. 2/3 token allocation on the wall clock). The
backend is what differs: the adaptive ViT in this process (the vision replica) or a device group's stage actors
(the group replica). Metrics: chosen gamma, batch size, utility and outcomes (`plexserve_otas_*`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.serve.metrics import Counter, Gauge, Histogram

from models.task_registry import DIGITS_ARTIFACTS_DIR, TaskRegistry
from placement.core.deployment_spec import ModelSpec, PolicySpec
from placement.otas.adaptive_batching import AdaptiveBatchingParams
from placement.otas.profile import OtasProfile
from placement.otas.replica_scheduler import Dispatch, OtasScheduler
from placement.otas.token_allocation import OtasTokenAllocator, TokenAllocationParams
from rayserve_apps.contracts import TOKEN_ADAPTATION_ROLE
from rayserve_apps.engine.engine import BatchBackend, DeviceSlots, ServingEngine
from rayserve_apps.engine.vision_batches import TASK_ATTR, UTILITY_ATTR, InProcessOtasBackend, OtasBatchFormer

OTAS_POLICY_NAME = "otas"
BATCH_SIZE_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128]


class OtasDeploymentParams(BaseModel):
    """Params of the ``token_adaptation`` policy ``otas`` of a vision model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    artifacts: str = Field(default=str(DIGITS_ARTIFACTS_DIR),
                           description="Directory of the trained backbone and tasks (models/artifacts/digits_vit).")
    profile: str | None = Field(default=None,
                                description="Measured OtasProfile JSON; default <artifacts>/profile.json.")
    default_task: str = Field(default="digit",
                              description="Task of a query that names none (the ingress passes no task).")
    default_utility: float = Field(default=1.0, ge=0, description="Utility of a query that names none.")
    batching: AdaptiveBatchingParams = Field(default_factory=AdaptiveBatchingParams,
                                             description="OTAS Alg. 1 parameters.")
    allocation: TokenAllocationParams | None = Field(default=None,
                                                     description="OTAS Alg. 2-3 parameters; gamma_list defaults to the "
                                                                 "artefacts'.")


def parse_otas_params(params: dict[str, Any]) -> OtasDeploymentParams:
    try:
        return OtasDeploymentParams(**params)
    except ValidationError as error:
        fields = "; ".join(".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in error.errors())
        raise ValueError(f"invalid token_adaptation params: {fields}") from None


def token_adaptation_params(spec: ModelSpec) -> OtasDeploymentParams | None:
    """The model's OTAS params when its spec names a token_adaptation policy, else None; ValueError for another name."""
    policy: PolicySpec | None = spec.policies.get(TOKEN_ADAPTATION_ROLE)
    if policy is None:
        return None
    if policy.name != OTAS_POLICY_NAME:
        raise ValueError(f"policies.{TOKEN_ADAPTATION_ROLE}.name must be {OTAS_POLICY_NAME!r}, got {policy.name!r}")
    return parse_otas_params(policy.params)


class OtasMetrics:
    """plexserve_otas_* metrics of one model (Ray Serve adds the replica tags)."""

    def __init__(self, model: str):
        self.tags = {"model": model}
        # Ray histograms need positive boundaries, so the gamma selection is a counter of batches per gamma.
        self.gamma = _metric(Counter, "plexserve_otas_batches_total",
                             description="Batches run, by the gamma chosen (tokens per layer: <0 merged, >0 prompts).",
                             tag_keys=("model", "gamma"))
        self.last_gamma = _metric(Gauge, "plexserve_otas_gamma", description="Gamma of the latest batch.",
                                  tag_keys=("model",))
        self.batch_size = _metric(Histogram, "plexserve_otas_batch_size", description="Queries per OTAS batch.",
                                  boundaries=BATCH_SIZE_BOUNDARIES, tag_keys=("model",))
        self.utility = _metric(Counter, "plexserve_otas_utility_total",
                               description="Expected utility earned (u_r x profiled accuracy, in time).",
                               tag_keys=("model",))
        self.outcomes = _metric(Counter, "plexserve_otas_queries_total",
                                description="OTAS queries by outcome (in_time, late, evicted).",
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
    """OTAS queries of one adaptive ViT on a serving engine; the backend runs the batches (default: in process)."""

    def __init__(self, registry: TaskRegistry, profile: OtasProfile, params: OtasDeploymentParams,
                 default_slo_ms: float, metrics: OtasMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 backend: BatchBackend | None = None, max_batches_in_flight: int = 1, name: str = "otas",
                 device_slots: DeviceSlots | None = None):
        registry.task(params.default_task)
        self.registry = registry
        self.profile = profile
        self.params = params
        self.default_slo_ms = default_slo_ms
        self.metrics = metrics
        allocation = params.allocation or TokenAllocationParams(gamma_list=registry.gamma_list)
        allocator = OtasTokenAllocator(profile, allocation, batch_cap=params.batching.epsilon)
        self.scheduler = OtasScheduler(allocator, params.batching, clock(), allocation.rate_window_s)
        self._reported: dict[str, float] = {}
        former = OtasBatchFormer(self.scheduler, profile, on_completed=self._record)
        self.engine = ServingEngine(name, former, backend or InProcessOtasBackend(registry),
                                    max_batches_in_flight=max_batches_in_flight, clock=clock,
                                    device_slots=device_slots)

    async def classify(self, images: torch.Tensor, task_id: str | None = None, slo_ms: float | None = None,
                       utility: float | None = None) -> list[dict]:
        """One OTAS query per image; answers {'label', 'probabilities', 'task', 'gamma'} per image."""
        task_id = task_id or self.params.default_task
        slo_ms = self.default_slo_ms if slo_ms is None else slo_ms
        utility = self.params.default_utility if utility is None else utility
        self.registry.check_images(images)
        now = self.engine.clock()
        # ValueError names a bad field
        queries = [self.registry.make_query(task_id, image, now, slo_ms, utility) for image in images]
        return await self.engine.answer([q.image for q in queries], now + slo_ms / 1000.0,
                                        attrs={TASK_ATTR: task_id, UTILITY_ATTR: utility})

    def _record(self, dispatch: Dispatch, finish_s: float) -> None:
        """Metrics of a finished batch and of every outcome the ledger counted since the last one."""
        if self.metrics is None:
            return
        ledger = self.scheduler.ledger
        self.metrics.batch(dispatch.gamma, len(dispatch.batch.requests))
        for outcome in ("in_time", "late", "evicted"):
            count = ledger.counts[outcome]
            self.metrics.outcome(outcome, int(count - self._reported.get(outcome, 0)))
            self._reported[outcome] = count
        self.metrics.outcome("in_time", 0, ledger.utility - self._reported.get("utility", 0.0))
        self._reported["utility"] = ledger.utility


def load_otas_parts(spec: ModelSpec, otas: OtasDeploymentParams) -> tuple[TaskRegistry, OtasProfile]:
    """The task registry and the measured profile of a token-adaptation model; ValueError when they do not fit it."""
    registry = TaskRegistry.load(otas.artifacts)
    expected = (registry.config.in_chans, registry.config.image_size_px)
    if (spec.in_chans, spec.image_size_px) != expected:
        raise ValueError(f"model {spec.name!r}: in_chans/image_size_px must be {expected[0]}/{expected[1]} for the "
                         f"artefacts {otas.artifacts}, got {spec.in_chans}/{spec.image_size_px}")
    profile_path = Path(otas.profile) if otas.profile else Path(otas.artifacts) / "profile.json"
    if not profile_path.exists():
        raise ValueError(f"token_adaptation params.profile: {profile_path} does not exist "
                         "(python -m models.adaptive_vit_profile)")
    return registry, OtasProfile.load(profile_path)
