"""Shared test set-up: offline models, Ray without auth, and a module-scoped local Ray + Serve."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest

#: `tests/` on the import path, so that test files here and in subfolders import its helpers (`from waiting import
#: wait_until`, `from conftest import ...`) under any pytest import mode; the repository's root too, so that tests
#: import the benchmarks' modules (`from benchmarks import serve_e2e`), which are not an installed package.
TESTS_DIR = str(Path(__file__).resolve().parent)
REPO_DIR = str(Path(TESTS_DIR).parent)
for _folder in (REPO_DIR, TESTS_DIR):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

from waiting import wait_until  # noqa: E402

#: Logical CPUs declared to Ray in tests: more than the 2 physical cores so that fractional replicas fit.
TEST_RAY_NUM_CPUS = 8
#: Logical devices declared to Ray in tests: a stand-in for GPUs on this CPU-only machine.
TEST_DEVICE_RESOURCE = "plex_device"
TEST_NUM_DEVICES = 4


def free_port() -> int:
    """A free loopback port that is none of Ray's default ports (a `ray.init` port must not clash with them)."""
    from rayserve_apps.control.live_update import free_port as free_loopback_port

    return free_loopback_port("127.0.0.1")


def _local_ray_serve(env: dict[str, str]):
    """A local Ray with logical devices and Ray Serve on a free loopback port, its processes started with `env`
    added to this process's environment (restored afterwards); yields the HTTP base URL."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        from rayserve_apps.control.live_update import DASHBOARD_ENV, local_dashboard_options

        saved.setdefault(DASHBOARD_ENV, os.environ.get(DASHBOARD_ENV))
        # The dashboard serves Serve's REST API, through which configs are applied (tests and the controller).
        ray.init(address="local", num_cpus=TEST_RAY_NUM_CPUS, resources={TEST_DEVICE_RESOURCE: TEST_NUM_DEVICES},
                 log_to_driver=False, **local_dashboard_options())
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def ray_serve():
    """A local Ray with Serve's defaults (its Python HTTP proxy); yields the HTTP base URL."""
    yield from _local_ray_serve({})


@pytest.fixture(scope="module")
def fast_ingress_ports() -> dict[str, int]:
    """Free ports for HAProxy's stats and Prometheus listeners (fixed per machine by default)."""
    return {"stats_port": free_port(), "metrics_port": free_port()}


@pytest.fixture(scope="module")
def ray_serve_fast_ingress(fast_ingress_ports):
    """A local Ray in plexserve's serving mode, as `make serve` starts it (`rayserve_apps.fast_ingress`: HAProxy in
    front, HTTP served by the ingress replica); yields the HTTP base URL (HAProxy's)."""
    from rayserve_apps.fast_ingress import local_env

    yield from _local_ray_serve(local_env(**fast_ingress_ports))


#: Seconds a restarted placement controller may take to come back and read its state from Serve.
CONTROLLER_RESTART_TIMEOUT_S = 180.0


def restart_controller(handle, app_name: str = "plexserve") -> dict:
    """Kill the placement controller's replica (Serve starts a new one) and return the state the new replica
    reports once it has read the running application back from Serve (`recovered`); AssertionError if it does not
    within CONTROLLER_RESTART_TIMEOUT_S."""
    import ray
    from ray.util import list_named_actors

    (actor,) = [a for a in list_named_actors(all_namespaces=True) if f"{app_name}#PlacementController#" in a["name"]]
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)

    def recovered() -> dict | None:
        state = handle.state.remote().result(timeout_s=30)
        return state if state["recovered"] else None

    # Any exception: the replacement replica is starting.
    return wait_until(recovered, CONTROLLER_RESTART_TIMEOUT_S, interval_s=1.0, ignore=(Exception,),
                      message="the restarted placement controller did not recover its state")
