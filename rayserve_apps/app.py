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

from placement.placement_plan import GroupPlacement, Placement
from placement.spec import DeploymentSpec, ModelSpec, parse_spec
from rayserve_apps.cluster_fit import check_placement_fits
from rayserve_apps.group_deployment import GroupReplica, group_bundles
from rayserve_apps.ingress import Ingress
from rayserve_apps.model_router import ModelAwareRouter
from models.text_encoder import load_text_tokenizer
from rayserve_apps.polymorph_runtime_deployment import bind_polymorph_model
from rayserve_apps.text_deployment import TextModelDeployment, batching_scheduler_for
from rayserve_apps.vision_deployment import VisionModelDeployment

logger = logging.getLogger(__name__)

#: The application name used by configs and by `serve.get_app_handle`.
APP_NAME = "plexserve"


#: Logical CPUs the group replica itself (bundle 0) reserves; its stage actors run in the device bundles.
GROUP_REPLICA_NUM_CPUS = 0.25
#: Seconds between a group replica's routing-stats reports (hosted models, queue length) to the router.
ROUTING_STATS_PERIOD_S = 1.0


def model_deployment_name(model: str) -> str:
    return f"model-{model}"


def group_deployment_name(index: int) -> str:
    return f"group-{index}"


def group_user_config(spec: DeploymentSpec, group: GroupPlacement, version: int) -> dict[str, Any]:
    """The part of a group replica that can change without a restart: its hosted models."""
    return {"models": [spec.model(name).model_dump(mode="json") for name in group.models], "placement_version": version}


def ingress_user_config(placement: Placement | None, version: int) -> dict[str, Any]:
    """The part of the ingress that can change without a restart: the placement it dispatches over."""
    return {"placement": placement.model_dump(mode="json") if placement is not None else None, "placement_version": version}


def _bundles(spec: DeploymentSpec, group: GroupPlacement) -> list[dict[str, float]]:
    num_cpus_per_device = max(spec.model(name).num_cpus_per_replica for name in group.models)
    return group_bundles(group.num_devices, spec.cluster.device_resource, GROUP_REPLICA_NUM_CPUS, num_cpus_per_device)


def _bind_group(spec: DeploymentSpec, index: int, group: GroupPlacement, version: int) -> Application:
    return GroupReplica.options(
        name=group_deployment_name(index),
        num_replicas=1,
        max_queued_requests=sum(spec.model(name).max_queued_requests for name in group.models),
        ray_actor_options={"num_cpus": GROUP_REPLICA_NUM_CPUS},
        placement_group_bundles=_bundles(spec, group),
        # A group's stages exchange activations every request: keep all its devices on one node.
        placement_group_strategy="STRICT_PACK",
        user_config=group_user_config(spec, group, version),
        request_router_config=RequestRouterConfig(request_router_class=ModelAwareRouter,
                                                  request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
    ).bind(group_deployment_name(index), group.num_devices, group.config.model_dump(), spec.cluster.device_resource)


def _bind_model(spec: DeploymentSpec, model: ModelSpec) -> Application:
    """The single-model deployment of `model`: Arlo's polymorphing runtimes if its spec asks for them, else the
    ConcatBatching text replica or the vision replica."""
    name = model_deployment_name(model.name)
    polymorphing = spec.policy("polymorphing", model.name)
    if polymorphing is not None:
        if model.kind != "text" or polymorphing.name != "arlo":
            raise ValueError(f"models.{model.name}.policies.polymorphing: only 'arlo' for text models is available")
        return bind_polymorph_model(model, polymorphing.params, name)
    options = dict(name=name, num_replicas=model.num_replicas, max_queued_requests=model.max_queued_requests,
                   ray_actor_options={"num_cpus": model.num_cpus_per_replica})
    if model.kind == "text":
        batching = spec.policy("batching", model.name)
        limit = model.max_input_length_tokens or load_text_tokenizer(model.source).max_length
        batching_scheduler_for(model, batching, limit)  # a bad batching parameter fails here, before deploying
        return TextModelDeployment.options(**options).bind(model.model_dump(mode="json"),
                                                           batching.model_dump(mode="json") if batching else None)
    return VisionModelDeployment.options(**options).bind(model.model_dump(mode="json"))


def resolve_placement(spec: DeploymentSpec) -> DeploymentSpec:
    """The spec with its placement: given, or planned from its `planning` section (paths relative to the cwd)."""
    if spec.placement is not None or spec.planning is None:
        return spec
    from placement.deployment_planning import plan_deployment

    placement = plan_deployment(spec)
    logger.info("planned placement:\n%s", placement.describe())
    return parse_spec({**spec.model_dump(mode="json", exclude_none=True), "placement": placement.model_dump(mode="json")})


def build_app(args: dict[str, Any] | DeploymentSpec) -> Application:
    """Ray Serve application builder: `import_path: rayserve_apps.app:build_app`, `args:` a deployment spec."""
    spec = resolve_placement(parse_spec(args))
    ingress = Ingress.options(ray_actor_options={"num_cpus": spec.serving.num_cpus_ingress},
                              user_config=ingress_user_config(spec.placement, version=0))
    groups = []
    if spec.placement is not None:
        resource = spec.cluster.device_resource
        check_placement_fits(spec, [sum(b.get(resource, 0.0) for b in _bundles(spec, g)) for g in spec.placement.groups])
        groups = [_bind_group(spec, i, group, version=0) for i, group in enumerate(spec.placement.groups)]
    grouped = spec.placement.models() if spec.placement is not None else set()
    handles = {model.name: _bind_model(spec, model) for model in spec.models if model.name not in grouped}
    logger.info("plexserve app: %d models, %d device groups, %d single-model deployments", len(spec.models), len(groups), len(handles))
    return ingress.bind(spec.model_dump(mode="json"), model_handles=handles, group_handles=groups)
