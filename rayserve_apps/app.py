"""The application builder: a deployment spec becomes a Ray Serve application.

`serve run configs/local.yaml` imports `rayserve_apps.app:build_app` and passes the application's `args` (a
deployment spec) to it. The builder validates the spec (a bad field fails before anything is deployed, with
the field named) and binds, behind one ingress:
- with a placement in the spec: one group deployment per device group (`group-<i>`, `replicas/group.py`),
  whose replica reserves the group's devices as a placement group and runs the hosted models model-parallel;
  before anything is deployed the placement is checked against the cluster's nodes (`control/cluster_fit.py`);
- without one: one replicated single-device deployment per model (`model-<name>`);
- a text model with `in_ingress: always` gets no deployment: its engine runs in every ingress replica
  (`when_idle`: both).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from models.device import CPU_RESOURCE, device_reservation
from models.text_encoder import load_text_tokenizer
from placement.alpaserve.deployment_planning import plan_deployment
from placement.core.deployment_spec import DeploymentSpec, ModelSpec, parse_spec
from placement.core.placement_plan import GroupPlacement
from rayserve_apps.contracts import (
    CONTROLLER_DEPLOYMENT,
    GROUP_REPLICA_NUM_CPUS,
    PolymorphAssignmentParams,
    PolymorphingPolicyParams,
    PolymorphRuntimeParams,
    allocation_update,
    group_bundles_for,
    group_deployment_name,
    group_max_ongoing_requests,
    group_max_queued_requests,
    group_user_config,
    ingress_user_config,
    initial_layout,
    model_deployment_name,
    polymorphing_params,
    vision_max_ongoing_requests,
)
from rayserve_apps.control.cluster_fit import check_placement_fits
from rayserve_apps.control.controller import PlacementController
from rayserve_apps.edge.admission import serve_limits
from rayserve_apps.engine import batching_scheduler_for
from rayserve_apps.ingress.deployment import Ingress
from rayserve_apps.replicas.group import GroupReplica
from rayserve_apps.replicas.polymorph import PolymorphRuntimeDeployment
from rayserve_apps.replicas.text import TextModelDeployment
from rayserve_apps.replicas.vision import VisionModelDeployment
from rayserve_apps.routers.model_aware import ModelAwareRouter
from rayserve_apps.routers.polymorph import PolymorphRouter

logger = logging.getLogger(__name__)

#: Ray Serve settings of every plexserve replica (the ones Serve's own RAY_SERVE_THROUGHPUT_OPTIMIZED mode picks for
#: a replica): user code runs on the replica's event loop and a handle's router on the caller's loop, which saves
#: two thread hand-offs per request and per call; plexserve's replicas never block their loop (model work runs in
#: worker threads or stage actors).
REPLICA_ENV_VARS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def replica_actor_options(num_cpus: float) -> dict[str, Any]:
    """`ray_actor_options` of a plexserve replica reserving `num_cpus`."""
    return {"num_cpus": num_cpus, "runtime_env": {"env_vars": dict(REPLICA_ENV_VARS)}}


def model_actor_options(model: ModelSpec, device_resource: str) -> dict[str, Any]:
    """`ray_actor_options` of a single-model replica: its CPUs and, on a GPU cluster where the model names a
    `device_share_per_replica`, that share of a GPU (`models.device.device_reservation`). Without one (the
    default), and on CPU-only clusters, no device is reserved: a spec without a `cluster` section (device resource
    'GPU' by default) must still deploy on a machine without GPUs."""
    options = replica_actor_options(model.num_cpus_per_replica)
    if model.device_share_per_replica is None:
        return options
    return {**options, **device_reservation(device_resource, model.device_share_per_replica, logical=False)}


def model_device_resource(model: ModelSpec, device_resource: str) -> str:
    """The device resource a single-model replica computes on: the cluster's when the replica reserves a share of
    it (`model_actor_options`), else the CPU (`models.device.select_device` then keeps the model there)."""
    return device_resource if model.device_share_per_replica is not None else CPU_RESOURCE


def _in_ingress_share(spec: DeploymentSpec) -> float | None:
    shares = [m.device_share_per_replica for m in spec.models
              if m.in_ingress != "never" and m.device_share_per_replica]
    return sum(shares) if shares else None


def ingress_actor_options(spec: DeploymentSpec) -> dict[str, Any]:
    """`ray_actor_options` of an ingress replica: `serving.num_cpus_ingress`, plus the CPUs of every model that runs
    only there (`in_ingress: always`), and the device share of every model whose engine runs there (`always` or
    `when_idle`), as that model's own replica reserves them. A `when_idle` engine adds no CPUs: it computes only
    while the model's own deployment has nothing to do."""
    always = [m for m in spec.models if m.in_ingress == "always"]
    options = replica_actor_options(spec.serving.num_cpus_ingress + sum(m.num_cpus_per_replica for m in always))
    share = _in_ingress_share(spec)
    if share is None:
        return options
    return {**options, **device_reservation(spec.cluster.device_resource, min(1.0, share), logical=False)}


def ingress_device_resource(spec: DeploymentSpec) -> str:
    """What the engines of `in_ingress` models compute on: the cluster's device when the ingress reserves a share."""
    return spec.cluster.device_resource if _in_ingress_share(spec) is not None else CPU_RESOURCE


#: Seconds between a group replica's routing-stats reports (hosted models, queue length) to the router.
ROUTING_STATS_PERIOD_S = 1.0
#: Seconds Serve waits for a stopping group replica's in-flight requests (a group stopped by a re-placement).
GROUP_GRACEFUL_SHUTDOWN_TIMEOUT_S = 60.0
#: Serve's cap on requests in a runtime replica; Arlo's own congestion threshold decides long before it is reached.
POLYMORPH_MAX_ONGOING_REQUESTS = 64


def _bind_group(spec: DeploymentSpec, index: int, group: GroupPlacement | None, version: int) -> Application:
    return GroupReplica.options(
        name=group_deployment_name(index),
        num_replicas=1,
        max_queued_requests=group_max_queued_requests(spec, group),
        max_ongoing_requests=group_max_ongoing_requests(spec, group.models if group is not None else []),
        ray_actor_options=replica_actor_options(GROUP_REPLICA_NUM_CPUS),
        placement_group_bundles=group_bundles_for(spec, group),
        # A group's stages exchange activations every request: keep all its devices on one node.
        placement_group_strategy="STRICT_PACK",
        graceful_shutdown_timeout_s=GROUP_GRACEFUL_SHUTDOWN_TIMEOUT_S,
        user_config=group_user_config(spec, group, version),
        request_router_config=RequestRouterConfig(request_router_class=ModelAwareRouter,
                                                  request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
    ).bind(group_deployment_name(index), spec.cluster.device_resource)


def model_deployment_options(model: ModelSpec, device_resource: str) -> dict[str, Any]:
    """Serve options of `model`'s single-model deployment (text or vision replica): its name, queue bound, actor
    resources, and either its fixed `num_replicas` or Serve's `autoscaling_config` from `model.autoscaling`."""
    options: dict[str, Any] = dict(name=model_deployment_name(model.name),
                                   max_queued_requests=model.max_queued_requests,
                                   ray_actor_options=model_actor_options(model, device_resource))
    if model.autoscaling is not None:
        options["autoscaling_config"] = model.autoscaling.serve_config()
    else:
        options["num_replicas"] = model.num_replicas
    return options


def _bind_model(spec: DeploymentSpec, model: ModelSpec) -> Application:
    """The single-model deployment of `model`: Arlo's polymorphing runtimes if its spec asks for them, else the
    ConcatBatching text replica or the vision replica, with `num_replicas` or Serve's autoscaling."""
    name = model_deployment_name(model.name)
    if polymorphing_params(spec, model.name) is not None:
        if model.autoscaling is not None:
            raise ValueError(f"model {model.name!r}: autoscaling does not apply to a polymorphing model (Arlo sizes "
                             "its runtimes; see polymorphing.params.autoscaling)")
        return bind_polymorph_model(model, spec.policy("polymorphing", model.name).params, name,  # type: ignore[union-attr]
                                    device_resource=spec.cluster.device_resource)
    options = model_deployment_options(model, spec.cluster.device_resource)
    if model.kind == "text":
        batching = spec.policy("batching", model.name)
        limit = model.max_input_length_tokens or load_text_tokenizer(model.source).max_length
        batching_scheduler_for(model, batching, limit)  # a bad batching parameter fails here, before deploying
        return TextModelDeployment.options(**options).bind(model.model_dump(mode="json"),
                                                           batching.model_dump(mode="json") if batching else None,
                                                           model_device_resource(model, spec.cluster.device_resource))
    return VisionModelDeployment.options(**options, max_ongoing_requests=vision_max_ongoing_requests(model)).bind(
        model.model_dump(mode="json"), model_device_resource(model, spec.cluster.device_resource))


def bind_polymorph_model(model: ModelSpec, params: dict, deployment_name: str, assignment: dict[int, int] | None = None,
                         version: int = 0, max_ongoing_requests: int = POLYMORPH_MAX_ONGOING_REQUESTS,
                         device_resource: str = CPU_RESOURCE) -> Application:
    """The bound Serve application of one polymorphing text model: its runtime replicas behind `PolymorphRouter`.

    `assignment` (replica rank -> max length, from `allocation_update`) replaces `initial_counts`; re-running
    `serve.run` with a new assignment and version is the declarative allocation update.
    """
    policy = PolymorphingPolicyParams.model_validate(params)
    policy.autoscaling_params(model.slo_ms)  # a bad autoscaling field fails here, before deploying
    counts = policy.initial_counts or {length: 1 for length in policy.capacities}
    unknown = set(counts) - set(policy.capacities)
    if unknown:
        raise ValueError(f"initial_counts names runtimes without a capacity: {sorted(unknown)}")
    if assignment is not None:
        unknown |= set(assignment.values()) - set(policy.capacities)
        if unknown:
            raise ValueError(f"assignment names runtimes without a capacity: {sorted(unknown)}")
        num_replicas = len(assignment)
        user_config = PolymorphAssignmentParams(assignment=assignment, version=version).model_dump(mode="json")
    else:
        num_replicas, user_config = allocation_update({}, counts, version=version)
    return PolymorphRuntimeDeployment.options(
        name=deployment_name,
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options=model_actor_options(model, device_resource),
        user_config=user_config,
        request_router_config=RequestRouterConfig(
            request_router_class=PolymorphRouter,
            request_router_kwargs={"threshold": policy.threshold, "decay": policy.decay,
                                   "max_levels": policy.max_levels},
            request_routing_stats_period_s=policy.routing_stats_period_s),
    ).bind(model.model_dump(mode="json"), policy.model_dump(include=set(PolymorphRuntimeParams.model_fields)))


def resolve_placement(spec: DeploymentSpec) -> DeploymentSpec:
    """The spec with its placement: given, or planned from its `planning` section (paths relative to the cwd)."""
    if spec.placement is not None or spec.planning is None:
        return spec
    placement = plan_deployment(spec)
    logger.info("planned placement:\n%s", placement.describe())
    return parse_spec({**spec.model_dump(mode="json", exclude_none=True),
                       "placement": placement.model_dump(mode="json")})


def build_app(args: dict[str, Any] | DeploymentSpec) -> Application:
    """Ray Serve application builder: `import_path: rayserve_apps.app:build_app`, `args:` a deployment spec."""
    spec = resolve_placement(parse_spec(args))
    layout = initial_layout(spec)
    # The ingress keeps the spec's bound itself (`edge/admission.py`), so that a refusal speaks the route's protocol.
    ingress = Ingress.options(ray_actor_options=ingress_actor_options(spec),
                              **serve_limits(spec.serving.ingress_max_ongoing_requests,
                                             spec.serving.ingress_max_queued_requests),
                              backpressure_config=BackpressureConfig(
                                  retry_after_s=spec.serving.ingress_retry_after_s),
                              user_config=ingress_user_config(layout, layout.routes(), version=0))
    groups = []
    if spec.placement is not None:
        resource = spec.cluster.device_resource
        check_placement_fits(spec,
                             [sum(b.get(resource, 0.0) for b in group_bundles_for(spec, g))
                              for g in spec.placement.groups])
        groups = [_bind_group(spec, i, group, version=0) for i, group in enumerate(layout.slots)]
    grouped = spec.placement.models() if spec.placement is not None else set()
    handles = {model.name: _bind_model(spec, model) for model in spec.models
               if model.name not in grouped and model.in_ingress != "always"}
    controller = None
    if spec.controller_enabled():
        controller = PlacementController.options(
            name=CONTROLLER_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": spec.controller.num_cpus},  # type: ignore[union-attr]
        ).bind(spec.model_dump(mode="json"))
    logger.info("plexserve app: %d models, %d group slots, %d single-model deployments, controller %s",
                len(spec.models), len(groups), len(handles), "on" if controller is not None else "off")
    return ingress.bind(spec.model_dump(mode="json"), model_handles=handles, group_handles=groups,
                        controller=controller, device_resource=ingress_device_resource(spec))
