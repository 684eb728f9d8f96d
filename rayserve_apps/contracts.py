"""What the parts of the Serve application agree on: names, routing-stats keys and `user_config` shapes.

The builder (`app.py`), the placement controller (`control/`), the ingress, the routers and the replicas all import
this module and nothing of each other for these facts, so no import has to hide inside a function to dodge a cycle.
It imports only `placement/` and pydantic (never ray or torch):
- names: the application, its deployments (`Ingress`, `PlacementController`, `group-<i>`, `model-<name>`) and the
  builder's import path, which the controller writes into every config it re-deploys;
- routing-stats keys: what a group replica reports to `ModelAwareRouter` and a runtime replica to `PolymorphRouter`;
- `user_config` shapes of the deployments that change in place, and the functions that build them from a spec —
  the builder deploys them and the controller re-deploys them as overrides, so both must write the same bytes:
  a group slot (`group_user_config`, with its bundles and queue bound), the ingress's routes
  (`ingress_user_config`) and a polymorphing model's runtime assignment (`allocation_update`).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from placement.alpaserve.placement_rollout import SlotLayout
from placement.arlo.autoscaling import AutoscalingParams
from placement.arlo.instance_replacement import rank_assignment
from placement.arlo.request_scheduler import ARLO_ALPHA, ARLO_LAMBDA, ARLO_MAX_LEVELS
from placement.arlo.runtime_allocation import ARLO_ALLOCATION_PERIOD_S
from placement.core.deployment_spec import DeploymentSpec, ModelSpec
from placement.core.placement_plan import GroupPlacement
from placement.core.profiles import ParallelConfig, ProfileSet

#: The repository root: a relative `planning.profiles.path` not found from the working directory is read from here.
REPO_ROOT = Path(__file__).resolve().parents[1]

# ---- names ---------------------------------------------------------------------------------------------------------

#: The application name used by configs and by `serve.get_app_handle`.
APP_NAME = "plexserve"
#: The builder as a Serve config names it (`import_path`); the controller re-deploys the application with it.
APP_IMPORT_PATH = "rayserve_apps.app:build_app"
#: Deployment name of the ingress and of the placement controller.
INGRESS_DEPLOYMENT = "Ingress"
CONTROLLER_DEPLOYMENT = "PlacementController"


def model_deployment_name(model: str) -> str:
    """The single-model deployment of `model` (a model outside the device groups)."""
    return f"model-{model}"


def group_deployment_name(index: int) -> str:
    """The deployment of group slot `index`."""
    return f"group-{index}"


# ---- routing stats -------------------------------------------------------------------------------------------------

#: A group replica's routing stats (`GroupReplica.record_routing_stats`), read by `ModelAwareRouter`: the models it
#: hosts and its queue length.
STATS_MODELS = "models"
STATS_QUEUE_LENGTH = "queue_length"
#: A runtime replica's metadata and routing stats (`PolymorphRuntimeDeployment`), read by `PolymorphRouter`: its
#: runtime's max length, the runtime's capacity within the SLO (Arlo M_i), its outstanding requests, its execution.
STATS_MAX_LENGTH = "max_length_tokens"
STATS_CAPACITY = "capacity_requests"
STATS_OUTSTANDING = "outstanding_requests"
STATS_EXECUTION = "execution"

# ---- group slots ---------------------------------------------------------------------------------------------------

#: Logical CPUs the group replica itself (bundle 0) reserves; its stage actors run in the device bundles.
GROUP_REPLICA_NUM_CPUS = 0.1


def num_group_slots(spec: DeploymentSpec) -> int:
    """Group deployments of the application: one per group, or with the controller a fixed number of slots, so that
    a re-placement changes slots (restarting only those) and never the application's shape."""
    if spec.placement is None:
        return 0
    groups = len(spec.placement.groups)
    if not spec.controller_enabled():
        return groups
    return max(groups, spec.controller.group_slots or spec.cluster.num_devices)  # type: ignore[union-attr]


def initial_layout(spec: DeploymentSpec) -> SlotLayout:
    """The slots as the builder deploys them: group i of the spec's placement in slot i, the rest empty."""
    return SlotLayout.from_placement(spec.placement, num_group_slots(spec))


def group_user_config(spec: DeploymentSpec, group: GroupPlacement | None, version: int) -> dict[str, Any]:
    """The part of a group slot that changes in place: its parallel configuration and hosted models."""
    if group is None:
        return {"num_devices": 0, "config": None, "models": [], "placement_version": version}
    batching = {name: policy.model_dump(mode="json") for name in group.models
                if (policy := spec.policy("batching", name)) is not None}
    return {"num_devices": group.num_devices, "config": group.config.model_dump(),
            "models": [spec.model(name).model_dump(mode="json") for name in group.models], "batching": batching,
            "runtime_lengths_tokens": grouped_runtime_lengths(spec, group.models),
            "plans": stored_plans(spec, group.models, group.config), "placement_version": version}


def _profiles_entry(spec: DeploymentSpec) -> str | None:
    return (spec.planning or {}).get("profiles", {}).get("path")


def profiles_base_dir(spec: DeploymentSpec) -> Path:
    """The directory a relative `planning.profiles.path` is read from: the working directory, or the repository root
    when only the root has the file (`serve run` started elsewhere)."""
    path = _profiles_entry(spec)
    if path and not Path(path).is_absolute() and not Path(path).is_file() and (REPO_ROOT / path).is_file():
        return REPO_ROOT
    return Path.cwd()


def profiles_path(spec: DeploymentSpec) -> Path | None:
    """The spec's measured profile file (`planning.profiles.path`, found as `profiles_base_dir` says); None when the
    spec names none or the file does not exist."""
    path = _profiles_entry(spec)
    if not path:
        return None
    candidate = profiles_base_dir(spec) / path
    return candidate.resolve() if candidate.is_file() else None


@lru_cache(maxsize=4)
def _load_profiles(path: Path, mtime_ns: int) -> ProfileSet:
    return ProfileSet.load(path)


def stored_plans(spec: DeploymentSpec, models: list[str], config: ParallelConfig) -> dict[str, dict[str, Any]]:
    """Model -> the plan `python -m parallel configs` stored for it under `config` in the spec's profile file (stage
    layer boundaries, shard layout; `parallel.plan.ParallelPlan` JSON). Models without one are absent: their group
    replica cuts them evenly."""
    path = profiles_path(spec)
    if path is None:
        return {}
    profiles = _load_profiles(path, path.stat().st_mtime_ns)
    plans = {}
    for name in models:
        model = profiles.models.get(name)
        if model is not None and model.has(config) and (plan := model.get(config).plan) is not None:
            plans[name] = plan
    return plans


def grouped_runtime_lengths(spec: DeploymentSpec, models: list[str]) -> dict[str, list[int]]:
    """Arlo runtime max lengths of the polymorphing models among `models`: in a group their packed rows take the
    shortest of these that fits (`GroupReplica.embed_token_ids`)."""
    lengths = {}
    for name in models:
        params = polymorphing_params(spec, name)
        if params is not None:
            lengths[name] = sorted(params.capacities)
    return lengths


def ingress_user_config(layout: SlotLayout, routes: list[list[str]], version: int) -> dict[str, Any]:
    """The part of the ingress that changes in place: the slots' groups and where it may route each model."""
    return {"layout": layout.model_dump(mode="json"), "routes": routes, "placement_version": version}


def group_bundles(num_devices: int, device_resource: str, replica_num_cpus: float,
                  num_cpus_per_device: float) -> list[dict[str, float]]:
    """The placement-group bundles of a group replica: the replica, then one bundle per device."""
    # With 'CPU' as the device resource (a single machine without accelerators), a device is a CPU share.
    device_bundle = ({"CPU": num_cpus_per_device} if device_resource == "CPU"
                     else {device_resource: 1.0, "CPU": num_cpus_per_device})
    return [{"CPU": replica_num_cpus}] + [dict(device_bundle) for _ in range(num_devices)]


def group_bundles_for(spec: DeploymentSpec, group: GroupPlacement | None) -> list[dict[str, float]]:
    """Placement-group bundles of a slot's replica: the replica, then one per device (an empty slot: the replica)."""
    if group is None:
        return group_bundles(0, spec.cluster.device_resource, GROUP_REPLICA_NUM_CPUS, 0.0)
    # The same for every slot of a shape, so that rehosting models never changes a slot's bundles (a restart).
    grouped = spec.placement.models() if spec.placement is not None else set(group.models)
    num_cpus_per_device = max(spec.model(name).num_cpus_per_replica for name in grouped | set(group.models))
    return group_bundles(group.num_devices, spec.cluster.device_resource, GROUP_REPLICA_NUM_CPUS, num_cpus_per_device)


def group_max_queued_requests(spec: DeploymentSpec, group: GroupPlacement | None) -> int:
    """Requests a slot's deployment queues before refusing (503 overloaded): its models' bounds summed; -1 (no
    bound) for an empty slot, which is never routed to."""
    models = group.models if group is not None else []
    return sum(spec.model(name).max_queued_requests for name in models) if models else -1


# ---- requests a replica runs at once (`max_ongoing_requests`) -------------------------------------------------------

#: Serve's own default, kept where nothing asks for more.
SERVE_DEFAULT_MAX_ONGOING_REQUESTS = 5
#: The policy role that turns a vision model into an OTAS token-adaptation model.
TOKEN_ADAPTATION_ROLE = "token_adaptation"
#: A plain ViT replica admits this many batches' worth of requests (one running, one filling), so that batches can
#: reach `max_batch_size` (Serve's default of 5 ongoing requests would cap them at 5); the rest queue at the caller.
VISION_BATCHES_ADMITTED = 2
#: A token-adaptation model admits this many: OTAS chooses each batch's gamma from the whole queue and evicts the
#: queries that can no longer meet their deadline, so its queue belongs in the replica.
OTAS_MAX_ONGOING_REQUESTS = 256
#: Text calls from the ingress carry batches of requests; at most this many are on their way per model and
#: destination (`ingress/forwarding.py`).
TEXT_CALLS_IN_FLIGHT = 2


def vision_max_ongoing_requests(model: ModelSpec) -> int:
    """Requests a vision model's replica (or its share of a group replica) runs at once."""
    if model.policies.get(TOKEN_ADAPTATION_ROLE) is not None:
        return OTAS_MAX_ONGOING_REQUESTS
    return VISION_BATCHES_ADMITTED * model.max_batch_size


def group_max_ongoing_requests(spec: DeploymentSpec, models: list[str]) -> int:
    """Requests a group slot's replica runs at once: each vision model's share and each text model's calls in
    flight, at least Serve's default."""
    shares = [vision_max_ongoing_requests(spec.model(m)) if spec.model(m).kind == "vision" else TEXT_CALLS_IN_FLIGHT
              for m in models]
    return max(SERVE_DEFAULT_MAX_ONGOING_REQUESTS, sum(shares))


# ---- polymorphing models (Arlo) ------------------------------------------------------------------------------------

#: How a runtime instance executes its fixed shape: ConcatBatching rows (TCB §4.1) or one padded text per row (Arlo).
Execution = Literal["packed", "padded"]


class PolymorphAssignmentParams(BaseModel):
    """The live allocation of a polymorphing model's deployment (its `user_config`, written by the builder and the
    controller): which runtime each replica rank runs; ranks it does not name run the longest runtime."""

    model_config = ConfigDict(extra="forbid")

    assignment: dict[int, int] = Field(default_factory=dict,
                                       description="Replica rank -> runtime max length in tokens.")
    version: int = Field(default=0, ge=0, description="Allocation version, increasing with every update.")


def allocation_update(previous_assignment: dict[int, int], counts: dict[int, int], version: int) -> tuple[int, dict]:
    """(num_replicas, user_config) realising `counts` (max length -> instances) with the fewest replica changes
    (`placement.arlo.instance_replacement.rank_assignment`)."""
    assignment = rank_assignment(previous_assignment, counts)
    return len(assignment), PolymorphAssignmentParams(assignment=assignment, version=version).model_dump(mode="json")


class PolymorphRuntimeParams(BaseModel):
    """What every runtime replica of a polymorphing model shares (its init args): the runtimes and how they run."""

    model_config = ConfigDict(extra="forbid")

    capacities: dict[int, int] = Field(description="Runtime max length in tokens -> capacity within the SLO (Arlo "
                                                   "M_i), in requests; from a measured RuntimeProfileSet "
                                                   "(benchmarks/polymorphing.py) or set by hand.")
    batch_size: int = Field(default=1, ge=1,
                            description="Batch size (rows) each static runtime is compiled for (Arlo: small, fixed).")
    backend: str = Field(default="trace", pattern="^(eager|trace|compile)$", description="Static compilation backend.")
    execution: Execution = Field(default="packed", description="packed: ConcatBatching rows of the runtime's length "
                                                               "(TCB §4.1); padded: one text per row padded to it "
                                                               "(Arlo).")


class PolymorphingPolicyParams(PolymorphRuntimeParams):
    """`policies: {polymorphing: {name: arlo, params: ...}}` of a text model in the deployment spec: the replicas'
    runtimes, the router's Alg. 1 parameters and the controller's allocation period and target tracking."""

    initial_counts: dict[int, int] | None = Field(default=None,
                                                  description="Runtime max length -> replicas at start; default: one "
                                                              "of each.")
    threshold: float = Field(default=ARLO_LAMBDA, gt=0, description="Arlo Alg. 1 lambda.")
    decay: float = Field(default=ARLO_ALPHA, gt=0, le=1, description="Arlo Alg. 1 alpha.")
    max_levels: int = Field(default=ARLO_MAX_LEVELS, ge=1, description="Arlo Alg. 1 L.")
    routing_stats_period_s: float = Field(default=1.0, gt=0,
                                          description="How often replicas report outstanding requests, in seconds.")
    allocation_period_s: float = Field(default=ARLO_ALLOCATION_PERIOD_S, gt=0,
                                       description="Seconds between runtime re-allocations (Arlo §5: 120 s; "
                                                   "placement.arlo.live_allocator).")
    autoscaling: dict[str, Any] | None = Field(
        default=None, description="Arlo §4 target tracking applied by the controller: the fields of "
                                  "placement.arlo.autoscaling.AutoscalingParams but slo_ms (the model's); null: a "
                                  "fixed replica count.")

    def autoscaling_params(self, slo_ms: float) -> AutoscalingParams | None:
        """The target-tracking parameters with the model's SLO (ValueError naming a bad field)."""
        if self.autoscaling is None:
            return None
        if "slo_ms" in self.autoscaling:
            raise ValueError("polymorphing.params.autoscaling.slo_ms: the SLO is the model's own slo_ms")
        return AutoscalingParams.model_validate({**self.autoscaling, "slo_ms": slo_ms})


def polymorphing_params(spec: DeploymentSpec, model: str) -> PolymorphingPolicyParams | None:
    """The validated Arlo params of `model` (its own policy or the spec-wide one), or None when it has none;
    ValueError naming the field for a policy plexserve cannot run."""
    policy = spec.policy("polymorphing", model)
    if policy is None:
        return None
    if spec.model(model).kind != "text" or policy.name != "arlo":
        raise ValueError(f"models.{model}.policies.polymorphing: only 'arlo' for text models is available")
    params = PolymorphingPolicyParams.model_validate(policy.params)
    params.autoscaling_params(spec.model(model).slo_ms)  # a bad autoscaling field fails here, before deploying
    return params
