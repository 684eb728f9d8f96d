"""Declarative updates of a running plexserve application, the way `serve deploy` applies a config.

A Serve application's code version is a hash of its import path, runtime env and `args`: changing `args`
restarts every deployment, so a re-placement never touches them. It is applied as per-deployment overrides in
the application's config (the `deployments:` section) instead:
- a group slot's `user_config` (parallel configuration and hosted models): Serve calls `reconfigure()` on the
  running replica, in place;
- a group slot's `placement_group_bundles` (its devices): Serve replaces that slot's replica, and only it;
- the ingress's `user_config` (the slots' groups and where it may route each model): reconfigured in place.

Every apply writes the overrides of every slot (an override left out would fall back to the builder's default)
and keeps the other applications of the Serve instance as they are deployed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray import serve
from ray.serve.schema import ServeDeploySchema

from placement.alpaserve.placement_rollout import SlotLayout
from placement.core.deployment_spec import DeploymentSpec
from placement.core.placement_plan import Placement
from rayserve_apps.contracts import (
    APP_IMPORT_PATH,
    APP_NAME,
    INGRESS_DEPLOYMENT,
    group_bundles_for,
    group_deployment_name,
    group_max_ongoing_requests,
    group_max_queued_requests,
    group_user_config,
    ingress_user_config,
    num_group_slots,
)

logger = logging.getLogger(__name__)

#: Seconds `apply_config` waits for the application to be RUNNING again.
APPLY_TIMEOUT_S = 300.0
#: Poll interval while waiting.
APPLY_POLL_S = 0.5
#: Keys of a deployed Serve config kept when plexserve re-deploys it with new overrides.
INSTANCE_CONFIG_KEYS = ("proxy_location", "http_options", "grpc_options")


def application_config(spec: DeploymentSpec, name: str = APP_NAME, route_prefix: str = "/",
                       deployments: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One application of a Serve config: plexserve's builder with the spec as `args`."""
    app: dict[str, Any] = {"name": name, "route_prefix": route_prefix, "import_path": APP_IMPORT_PATH,
                           "args": spec.model_dump(mode="json", exclude_none=True)}
    if deployments:
        app["deployments"] = deployments
    return app


def slot_override(spec: DeploymentSpec, index: int, layout: SlotLayout, version: int) -> dict[str, Any]:
    """The override of group slot `index`: its devices (bundles) and its user_config (config and models)."""
    group = layout.slots[index]
    return {"name": group_deployment_name(index), "user_config": group_user_config(spec, group, version),
            "placement_group_bundles": group_bundles_for(spec, group), "placement_group_strategy": "STRICT_PACK",
            "max_queued_requests": group_max_queued_requests(spec, group),
            "max_ongoing_requests": group_max_ongoing_requests(spec, group.models if group is not None else [])}


def layout_overrides(spec: DeploymentSpec, layout: SlotLayout, routes: list[list[str]], slot_versions: list[int],
                     version: int) -> list[dict[str, Any]]:
    """`deployments:` overrides that run `layout` with the ingress routing as `routes` says.

    `slot_versions[i]` is the placement version at which slot i last changed: an unchanged slot keeps its override
    byte for byte, so Serve leaves it alone."""
    if len(layout.slots) != num_group_slots(spec):
        raise ValueError(f"layout has {len(layout.slots)} slots; the application has {num_group_slots(spec)}")
    overrides = [slot_override(spec, i, layout, slot_versions[i]) for i in range(len(layout.slots))]
    overrides.append({"name": INGRESS_DEPLOYMENT, "user_config": ingress_user_config(layout, routes, version)})
    return overrides


def placement_overrides(spec: DeploymentSpec, placement: Placement, version: int) -> list[dict[str, Any]]:
    """Overrides that run `placement`, group i in slot i (for operators and tests; the controller rolls out)."""
    layout = SlotLayout.from_placement(placement, num_group_slots(spec))
    return layout_overrides(spec, layout, layout.routes(), [version] * len(layout.slots), version)


def deployed_config() -> dict[str, Any]:
    """The Serve config as deployed now: instance options and every application's config, overrides included."""
    details = serve.context._get_global_client().get_serve_details()
    config = {key: details[key] for key in INSTANCE_CONFIG_KEYS if details.get(key) is not None}
    applications = []
    for name, app in details.get("applications", {}).items():
        deployed = app.get("deployed_app_config")
        if deployed is None:
            raise RuntimeError(f"application {name!r} was not deployed from a config (serve run/deploy); "
                               "plexserve updates applications declaratively only")
        applications.append(deployed)
    config["applications"] = applications
    return config


def deployed_overrides(app_name: str = APP_NAME) -> list[dict[str, Any]]:
    """The `deployments:` overrides of `app_name` as deployed now (empty when it runs the builder's defaults)."""
    for app in deployed_config()["applications"]:
        if app["name"] == app_name:
            return list(app.get("deployments") or [])
    raise RuntimeError(f"application {app_name!r} is not deployed")


def apply_overrides(app_name: str, overrides: list[dict[str, Any]], wait: bool = True) -> None:
    """Re-deploy the running Serve config with `app_name`'s overrides replaced; other applications unchanged."""
    config = deployed_config()
    for app in config["applications"]:
        if app["name"] == app_name:
            app["deployments"] = overrides
            break
    else:
        raise RuntimeError(f"application {app_name!r} is not deployed")
    apply_config(config["applications"], config.get("http_options"), wait=wait,
                 extra={k: v for k, v in config.items() if k not in ("applications", "http_options")})


def apply_config(applications: list[dict[str, Any]], http_options: dict[str, Any] | None = None,
                 wait: bool = True, extra: dict[str, Any] | None = None) -> None:
    """Apply a multi-application Serve config to the running Serve instance (as `serve deploy` does)."""
    config: dict[str, Any] = {**(extra or {}), "applications": applications}
    if http_options:
        config["http_options"] = http_options
    client = serve.context._get_global_client()
    client.deploy_apps(ServeDeploySchema.model_validate(config))
    if wait:
        wait_running({app["name"] for app in applications})


def wait_running(names: set[str], timeout_s: float = APPLY_TIMEOUT_S) -> None:
    """Wait until every named application is RUNNING; raise naming Serve's message if one fails to deploy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        statuses = serve.status().applications
        states = {name: statuses[name].status if name in statuses else None for name in names}
        if all(state == "RUNNING" for state in states.values()):
            return
        if any(state == "DEPLOY_FAILED" for state in states.values()):
            messages = {name: statuses[name].message for name in names if name in statuses}
            raise RuntimeError(f"Serve could not apply the config: {messages}")
        time.sleep(APPLY_POLL_S)
    raise TimeoutError(f"applications {sorted(names)} not RUNNING within {timeout_s} s")
