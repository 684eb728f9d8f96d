"""Declarative updates of a running plexserve application, the way `serve deploy` applies a config.

A Serve application's code version is a hash of its import path, runtime env and `args`: changing `args`
restarts every deployment. A change of hosted models must not, so it is applied as per-deployment `user_config`
overrides in the application's config (the `deployments:` section), with `args` untouched: Serve then calls
`reconfigure()` on the running group replicas and on the ingress, in place.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray import serve
from ray.serve.schema import ServeDeploySchema

from placement.placement_plan import Placement
from placement.spec import DeploymentSpec
from rayserve_apps.app import APP_NAME, group_deployment_name, group_user_config, ingress_user_config

logger = logging.getLogger(__name__)

IMPORT_PATH = "rayserve_apps.app:build_app"
#: Seconds `apply_config` waits for the application to be RUNNING again.
APPLY_TIMEOUT_S = 300.0
#: Poll interval while waiting.
APPLY_POLL_S = 0.5


def application_config(spec: DeploymentSpec, name: str = APP_NAME, route_prefix: str = "/",
                       deployments: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One application of a Serve config: plexserve's builder with the spec as `args`."""
    app: dict[str, Any] = {"name": name, "route_prefix": route_prefix, "import_path": IMPORT_PATH,
                           "args": spec.model_dump(mode="json", exclude_none=True)}
    if deployments:
        app["deployments"] = deployments
    return app


def placement_overrides(spec: DeploymentSpec, placement: Placement, version: int) -> list[dict[str, Any]]:
    """`deployments:` overrides that move a running app to `placement` (same groups, other hosted models)."""
    assert spec.placement is not None
    if len(placement.groups) != len(spec.placement.groups) or any(
        new.config != old.config or new.num_devices != old.num_devices for new, old in zip(placement.groups, spec.placement.groups)
    ):
        raise ValueError("placement_overrides changes hosted models only; a change of groups or parallel configurations needs a new spec")
    overrides = [{"name": group_deployment_name(i), "user_config": group_user_config(spec, group, version)}
                 for i, group in enumerate(placement.groups)]
    overrides.append({"name": "Ingress", "user_config": ingress_user_config(placement, version)})
    return overrides


def apply_config(applications: list[dict[str, Any]], http_options: dict[str, Any] | None = None,
                 wait: bool = True) -> None:
    """Apply a multi-application Serve config to the running Serve instance (as `serve deploy` does)."""
    config: dict[str, Any] = {"applications": applications}
    if http_options:
        config["http_options"] = http_options
    client = serve.context._get_global_client()
    client.deploy_apps(ServeDeploySchema.model_validate(config))
    if not wait:
        return
    names = {app["name"] for app in applications}
    deadline = time.monotonic() + APPLY_TIMEOUT_S
    while time.monotonic() < deadline:
        statuses = serve.status().applications
        states = {name: statuses[name].status if name in statuses else None for name in names}
        if all(state == "RUNNING" for state in states.values()):
            return
        if any(state == "DEPLOY_FAILED" for state in states.values()):
            messages = {name: statuses[name].message for name in names if name in statuses}
            raise RuntimeError(f"Serve could not apply the config: {messages}")
        time.sleep(APPLY_POLL_S)
    raise TimeoutError(f"applications {sorted(names)} not RUNNING within {APPLY_TIMEOUT_S} s")
