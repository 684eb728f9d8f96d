"""Declarative updates of a running plexserve application through Serve's REST API, the way `serve deploy` applies a
config.

Every update goes through the Ray dashboard's Serve REST API, Serve's public interface for declarative configs:
`GET /api/serve/applications/` reads the config as deployed (each application's `deployed_app_config`) and
`PUT /api/serve/applications/` applies a full `ServeDeploySchema` config.

A Serve application's code version is a hash of its import path, runtime env and `args`: changing `args`
restarts every deployment, so a re-placement never touches them. It is applied as per-deployment overrides in
the application's config (the `deployments:` section) instead. The placement controller owns these fields and no
other (`CONTROLLER_OWNED_FIELDS`):
- a group slot (`group-<i>`): `user_config` (parallel configuration and hosted models; Serve calls `reconfigure()`
  on the running replica, in place), `placement_group_bundles` and `placement_group_strategy` (its devices; Serve
  replaces that slot's replica, and only it), `max_ongoing_requests` and `max_queued_requests` (derived from the
  models it hosts);
- the ingress: `user_config` (the slots' groups and where it may route each model; reconfigured in place);
- a polymorphing model's deployment (`model-<name>`, Arlo): `num_replicas` and `user_config` (its runtimes).

An update reads the deployed config, sets only these fields on the deployments the controller writes
(`merge_overrides`) and puts the whole config back: every other field of every deployment (an operator's
`ray_actor_options`, `health_check_period_s`, an override of a deployment the controller never writes), the
application's own fields and the other applications of the Serve instance stay as deployed.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any

import ray
from pydantic import ValidationError
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
#: Keys of Serve's instance details that are also fields of a deploy config: kept when plexserve re-deploys it.
INSTANCE_CONFIG_KEYS = ("proxy_location", "http_options", "grpc_options", "target_capacity")
#: The environment variable naming the Ray dashboard (as Serve's CLI reads it).
DASHBOARD_ENV = "RAY_DASHBOARD_ADDRESS"
#: The Ray dashboard's default port (`ray start --dashboard-port`; KubeRay's head service exposes it too).
DEFAULT_DASHBOARD_PORT = 8265
#: The Serve REST API's route on the dashboard.
SERVE_APPLICATIONS_ROUTE = "/api/serve/applications/"
#: Seconds one REST call may take.
REST_TIMEOUT_S = 30.0
#: Attempts of a REST call that got no answer (the dashboard starting or restarting), a second apart.
REST_ATTEMPTS = 3
#: The deployment fields the placement controller sets, by kind of deployment (see the module doc).
CONTROLLER_OWNED_FIELDS = {
    "group slot": ("user_config", "placement_group_bundles", "placement_group_strategy", "max_ongoing_requests",
                   "max_queued_requests"),
    "ingress": ("user_config",),
    "polymorphing model": ("num_replicas", "user_config"),
}


class ServeApiError(RuntimeError):
    """Serve's REST API did not answer, or refused a config; the message names the URL and Serve's reason."""


def dashboard_url(explicit: str | None = None) -> str:
    """The Ray dashboard's base URL: `explicit` (the spec's `controller.dashboard_url`), else the environment's
    RAY_DASHBOARD_ADDRESS, else the head node's address (`ray.nodes()`) on the default port 8265."""
    url = explicit or os.environ.get(DASHBOARD_ENV)
    if not url:
        heads = [n["NodeManagerAddress"] for n in ray.nodes()
                 if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})]
        if not heads:
            raise ServeApiError(f"cannot find the Ray head node to reach its dashboard; set controller.dashboard_url "
                                f"or {DASHBOARD_ENV}")
        url = f"{heads[0]}:{DEFAULT_DASHBOARD_PORT}"
    url = url.rstrip("/")
    return url if "://" in url else f"http://{url}"


#: The ports a local Ray and Serve take by default (GCS, Serve's HTTP proxy, dashboard, Ray Client, the dashboard
#: agent's HTTP server): a port handed to `ray.init` must not be one of them, or Ray refuses to start.
RAY_DEFAULT_PORTS = frozenset({6379, 8000, 8265, 10001, 52365})


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` that is free now and none of `RAY_DEFAULT_PORTS`."""
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in RAY_DEFAULT_PORTS:
            return port


def local_dashboard_options(host: str = "127.0.0.1") -> dict[str, Any]:
    """`ray.init` options for a local Ray whose dashboard (and so Serve's REST API) listens on a free port of
    `host`; sets RAY_DASHBOARD_ADDRESS in this process's environment, which the Ray processes it starts inherit, so
    that `dashboard_url()` finds it here and in the replicas."""
    port = free_port(host)
    os.environ[DASHBOARD_ENV] = f"http://{host}:{port}"
    return {"include_dashboard": True, "dashboard_host": host, "dashboard_port": port}


def _rest(method: str, url: str, body: dict[str, Any] | None = None, timeout_s: float = REST_TIMEOUT_S) -> str:
    """One call to Serve's REST API; retried while the dashboard does not answer. Raises `ServeApiError` naming the
    URL and Serve's reason."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    for attempt in range(1, REST_ATTEMPTS + 1):
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.read().decode()
        except urllib.error.HTTPError as error:  # Serve answered: a refusal is not retried
            reason = error.read().decode(errors="replace").strip()
            raise ServeApiError(f"Serve's REST API refused {method} {url} (HTTP {error.code}): {reason}") from error
        except (urllib.error.URLError, OSError) as error:
            if attempt == REST_ATTEMPTS:
                reason = getattr(error, "reason", error)
                raise ServeApiError(f"the Ray dashboard at {url} did not answer {method} ({reason}); set "
                                    f"controller.dashboard_url or {DASHBOARD_ENV} to the dashboard's address")
            time.sleep(1.0)
    raise AssertionError("unreachable")


def validate_config(config: dict[str, Any]) -> ServeDeploySchema:
    """`config` as Serve's deploy schema; a config it refuses raises ValueError naming each field and why."""
    try:
        return ServeDeploySchema.model_validate(config)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())
        raise ValueError(f"Serve's deploy schema refuses the config: {problems}") from error


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
    """`deployments:` overrides (the controller's fields only) that run `layout` with the ingress routing as
    `routes` says.

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


def deployed_config(url: str | None = None, timeout_s: float = REST_TIMEOUT_S) -> dict[str, Any]:
    """The Serve config as deployed now (`GET /api/serve/applications/` on the dashboard at `url`, default
    `dashboard_url()`): instance options and every application's config, overrides included."""
    base = dashboard_url(url)
    text = _rest("GET", base + SERVE_APPLICATIONS_ROUTE, timeout_s=timeout_s)
    try:
        details = json.loads(text)
    except json.JSONDecodeError as error:
        raise ServeApiError(f"GET {base + SERVE_APPLICATIONS_ROUTE} did not answer JSON: {text[:200]!r}") from error
    config = {key: details[key] for key in INSTANCE_CONFIG_KEYS if details.get(key) is not None}
    applications = []
    for name, app in (details.get("applications") or {}).items():
        deployed = app.get("deployed_app_config")
        if deployed is None:
            raise ServeApiError(f"application {name!r} was not deployed from a config (serve run/deploy, the REST "
                                "API or a RayService); plexserve updates applications declaratively only")
        applications.append(deployed)
    config["applications"] = applications
    return config


def deployed_overrides(app_name: str = APP_NAME, url: str | None = None) -> list[dict[str, Any]]:
    """The `deployments:` overrides of `app_name` as deployed now (empty when it runs the builder's defaults)."""
    for app in deployed_config(url)["applications"]:
        if app["name"] == app_name:
            return list(app.get("deployments") or [])
    raise ServeApiError(f"application {app_name!r} is not deployed")


def merge_overrides(config: dict[str, Any], app_name: str, overrides: list[dict[str, Any]]) -> dict[str, Any]:
    """A copy of the Serve `config` in which `app_name`'s deployments carry the fields `overrides` set (the
    controller's own fields), every other field of every deployment, application and the instance as in `config`.
    A deployment the config does not list yet is added with the override's fields only."""
    merged = copy.deepcopy(config)
    for app in merged["applications"]:
        if app["name"] == app_name:
            break
    else:
        raise ServeApiError(f"application {app_name!r} is not deployed")
    deployments = app.setdefault("deployments", [])
    by_name = {d["name"]: d for d in deployments}
    for override in overrides:
        target = by_name.get(override["name"])
        if target is None:
            target = {"name": override["name"]}
            deployments.append(target)
            by_name[target["name"]] = target
        target.update(copy.deepcopy(override))
    return merged


def merged_config(app_name: str, overrides: list[dict[str, Any]], url: str | None = None,
                  timeout_s: float = REST_TIMEOUT_S) -> dict[str, Any]:
    """The deployed Serve config with `app_name`'s overrides merged in (`merge_overrides`), checked against Serve's
    deploy schema (ValueError naming the field it refuses)."""
    config = merge_overrides(deployed_config(url, timeout_s), app_name, overrides)
    validate_config(config)
    return config


def apply_overrides(app_name: str, overrides: list[dict[str, Any]], wait: bool = True, url: str | None = None,
                    timeout_s: float = REST_TIMEOUT_S) -> dict[str, Any]:
    """Merge `app_name`'s overrides into the deployed config and put it back (other fields and applications as
    deployed); returns the config applied."""
    config = merged_config(app_name, overrides, url, timeout_s)
    put_config(config, url, timeout_s)
    if wait:
        wait_running({app["name"] for app in config["applications"]})
    return config


def put_config(config: dict[str, Any], url: str | None = None, timeout_s: float = REST_TIMEOUT_S) -> None:
    """`PUT /api/serve/applications/` with a full Serve config (checked against the deploy schema first)."""
    validate_config(config)
    _rest("PUT", dashboard_url(url) + SERVE_APPLICATIONS_ROUTE, body=config, timeout_s=timeout_s)


def apply_config(applications: list[dict[str, Any]], http_options: dict[str, Any] | None = None,
                 wait: bool = True, extra: dict[str, Any] | None = None, url: str | None = None) -> None:
    """Apply a multi-application Serve config to the running Serve instance (as `serve deploy` does)."""
    config: dict[str, Any] = {**(extra or {}), "applications": applications}
    if http_options:
        config["http_options"] = http_options
    put_config(config, url)
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
