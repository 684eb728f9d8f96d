"""The application builder: a deployment spec becomes a Ray Serve application.

`serve run configs/local.yaml` imports `rayserve_apps.app:build_app` and passes the application's `args` (a
deployment spec) to it. The builder validates the spec (a bad field fails before anything is deployed, with
the field named) and binds, behind one ingress:
- with a placement in the spec: one group deployment per device group (`group-<i>`, `group_deployment.py`),
  whose replica reserves the group's devices as a placement group and runs the hosted models model-parallel;
  before anything is deployed the placement is checked against the cluster's nodes (`cluster_fit.py`);
- without one: one replicated single-device deployment per model (`model-<name>`).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from placement.core.placement_plan import GroupPlacement
from placement.alpaserve.placement_rollout import SlotLayout
from placement.core.deployment_spec import DeploymentSpec, ModelSpec, parse_spec
from rayserve_apps.cluster_fit import check_placement_fits
from rayserve_apps.group_deployment import GroupReplica, group_bundles
from rayserve_apps.ingress import Ingress
from rayserve_apps.model_router import ModelAwareRouter
from models.text_encoder import load_text_tokenizer
from rayserve_apps.polymorph_runtime_deployment import bind_polymorph_model, polymorphing_params
from rayserve_apps.engine import batching_scheduler_for
from rayserve_apps.text_deployment import TextModelDeployment
from rayserve_apps.vision_deployment import VisionModelDeployment, vision_max_ongoing_requests

logger = logging.getLogger(__name__)

#: The application name used by configs and by `serve.get_app_handle`.
APP_NAME = "plexserve"
#: Deployment name of the ingress and of the placement controller.
INGRESS_DEPLOYMENT = "Ingress"
CONTROLLER_DEPLOYMENT = "PlacementController"


#: Logical CPUs the group replica itself (bundle 0) reserves; its stage actors run in the device bundles.
GROUP_REPLICA_NUM_CPUS = 0.1
#: Seconds between a group replica's routing-stats reports (hosted models, queue length) to the router.
ROUTING_STATS_PERIOD_S = 1.0
#: Seconds Serve waits for a stopping group replica's in-flight requests (a group stopped by a re-placement).
GROUP_GRACEFUL_SHUTDOWN_TIMEOUT_S = 60.0


def model_deployment_name(model: str) -> str:
    return f"model-{model}"


def group_deployment_name(index: int) -> str:
    return f"group-{index}"


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
    return SlotLayout.from_placement(spec.placement, num_group_slots(spec))


def group_user_config(spec: DeploymentSpec, group: GroupPlacement | None, version: int) -> dict[str, Any]:
    """The part of a group slot that changes in place: its parallel configuration and hosted models."""
    if group is None:
        return {"num_devices": 0, "config": None, "models": [], "placement_version": version}
    batching = {name: policy.model_dump(mode="json") for name in group.models
                if (policy := spec.policy("batching", name)) is not None}
    return {"num_devices": group.num_devices, "config": group.config.model_dump(),
            "models": [spec.model(name).model_dump(mode="json") for name in group.models], "batching": batching,
            "runtime_lengths_tokens": grouped_runtime_lengths(spec, group.models), "placement_version": version}


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


def _bind_group(spec: DeploymentSpec, index: int, group: GroupPlacement | None, version: int) -> Application:
    return GroupReplica.options(
        name=group_deployment_name(index),
        num_replicas=1,
        max_queued_requests=group_max_queued_requests(spec, group),
        ray_actor_options={"num_cpus": GROUP_REPLICA_NUM_CPUS},
        placement_group_bundles=group_bundles_for(spec, group),
        # A group's stages exchange activations every request: keep all its devices on one node.
        placement_group_strategy="STRICT_PACK",
        graceful_shutdown_timeout_s=GROUP_GRACEFUL_SHUTDOWN_TIMEOUT_S,
        user_config=group_user_config(spec, group, version),
        request_router_config=RequestRouterConfig(request_router_class=ModelAwareRouter,
                                                  request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
    ).bind(group_deployment_name(index), spec.cluster.device_resource)


def _bind_model(spec: DeploymentSpec, model: ModelSpec) -> Application:
    """The single-model deployment of `model`: Arlo's polymorphing runtimes if its spec asks for them, else the
    ConcatBatching text replica or the vision replica."""
    name = model_deployment_name(model.name)
    if polymorphing_params(spec, model.name) is not None:
        return bind_polymorph_model(model, spec.policy("polymorphing", model.name).params, name)  # type: ignore[union-attr]
    options = dict(name=name, num_replicas=model.num_replicas, max_queued_requests=model.max_queued_requests,
                   ray_actor_options={"num_cpus": model.num_cpus_per_replica})
    if model.kind == "text":
        batching = spec.policy("batching", model.name)
        limit = model.max_input_length_tokens or load_text_tokenizer(model.source).max_length
        batching_scheduler_for(model, batching, limit)  # a bad batching parameter fails here, before deploying
        return TextModelDeployment.options(**options).bind(model.model_dump(mode="json"),
                                                           batching.model_dump(mode="json") if batching else None)
    return VisionModelDeployment.options(**options, max_ongoing_requests=vision_max_ongoing_requests(model)).bind(
        model.model_dump(mode="json"))


def resolve_placement(spec: DeploymentSpec) -> DeploymentSpec:
    """The spec with its placement: given, or planned from its `planning` section (paths relative to the cwd)."""
    if spec.placement is not None or spec.planning is None:
        return spec
    from placement.alpaserve.deployment_planning import plan_deployment

    placement = plan_deployment(spec)
    logger.info("planned placement:\n%s", placement.describe())
    return parse_spec({**spec.model_dump(mode="json", exclude_none=True), "placement": placement.model_dump(mode="json")})


def build_app(args: dict[str, Any] | DeploymentSpec) -> Application:
    """Ray Serve application builder: `import_path: rayserve_apps.app:build_app`, `args:` a deployment spec."""
    spec = resolve_placement(parse_spec(args))
    layout = initial_layout(spec)
    ingress = Ingress.options(ray_actor_options={"num_cpus": spec.serving.num_cpus_ingress},
                              max_ongoing_requests=spec.serving.ingress_max_ongoing_requests,
                              user_config=ingress_user_config(layout, layout.routes(), version=0))
    groups = []
    if spec.placement is not None:
        resource = spec.cluster.device_resource
        check_placement_fits(spec, [sum(b.get(resource, 0.0) for b in group_bundles_for(spec, g)) for g in spec.placement.groups])
        groups = [_bind_group(spec, i, group, version=0) for i, group in enumerate(layout.slots)]
    grouped = spec.placement.models() if spec.placement is not None else set()
    handles = {model.name: _bind_model(spec, model) for model in spec.models if model.name not in grouped}
    controller = None
    if spec.controller_enabled():
        from rayserve_apps.controller import PlacementController

        controller = PlacementController.options(
            name=CONTROLLER_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": spec.controller.num_cpus},  # type: ignore[union-attr]
        ).bind(spec.model_dump(mode="json"))
    logger.info("plexserve app: %d models, %d group slots, %d single-model deployments, controller %s",
                len(spec.models), len(groups), len(handles), "on" if controller is not None else "off")
    return ingress.bind(spec.model_dump(mode="json"), model_handles=handles, group_handles=groups, controller=controller)
