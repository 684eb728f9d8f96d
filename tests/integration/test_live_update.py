"""The controller's updates through Serve's REST API, against a stand-in dashboard (no Ray).

A small HTTP server answers `GET /api/serve/applications/` with Serve's instance details (an operator's overrides in
the deployed config, a second application) and records every `PUT`. The tests check that an update changes only the
controller's own fields, that a dashboard that does not answer or a config Serve refuses ends in an error naming the
URL or the field while the controller keeps its running layout, and that the recommend mode applies nothing and
publishes a config Serve's deploy schema accepts.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from conftest import free_port
from ray.serve.schema import ServeDeploySchema

from placement.core.deployment_spec import parse_spec
from placement.core.placement_plan import Placement
from rayserve_apps.contracts import initial_layout
from rayserve_apps.control.controller import PlacementController
from rayserve_apps.control.live_update import (
    CONTROLLER_OWNED_FIELDS,
    ServeApiError,
    application_config,
    apply_overrides,
    deployed_config,
    placement_overrides,
    validate_config,
)
from rayserve_apps.control.runtime_allocations import RuntimeAllocations

MODELS = ["vit-a", "vit-b", "vit-c"]
#: The operator's own settings in the deployed config: fields of a group slot the controller does not own, and a
#: deployment it never writes.
OPERATOR_OVERRIDES = [
    {"name": "group-0", "health_check_period_s": 7.0, "ray_actor_options": {"num_cpus": 0.3}},
    {"name": "PlacementController", "graceful_shutdown_timeout_s": 9.0},
]
OTHER_APP = {"name": "other", "route_prefix": "/other", "import_path": "other.app:build"}


def group(devices: int, models: list[str]) -> dict:
    return {"num_devices": devices, "config": {"intra_op_degree": devices, "pipeline_stages": 1}, "models": models}


def make_spec(**controller):
    return parse_spec({
        "cluster": {"num_devices": 4, "device_resource": "plex_device"},
        "models": [{"name": m, "kind": "vision", "source": "timm:vit_tiny_patch16_224", "num_classes": 4,
                    "image_size_px": 16, "slo_ms": 2000} for m in MODELS],
        "placement": {"groups": [group(2, ["vit-a", "vit-b"]), group(1, ["vit-c"])]},
        "planning": {"profiles": {"path": "unused-profiles.json"}},  # read by the policy, which these tests skip
        "controller": {"period_s": 3600, **controller},
    })


class FakeDashboard:
    """Serve's REST API as the dashboard serves it: the deployed config, PUTs recorded (or refused)."""

    def __init__(self, spec):
        self.deployed = {"proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1", "port": 8000},
                         "applications": [application_config(spec, deployments=copy.deepcopy(OPERATOR_OVERRIDES)),
                                          OTHER_APP]}
        self.puts: list[dict] = []
        self.refuse: str | None = None
        dashboard = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if self.path != "/api/serve/applications/":
                    self.send_error(404)
                    return
                details = {"controller_info": {"node_id": "x"}, "proxies": {}, "target_capacity": None,
                           **{k: v for k, v in dashboard.deployed.items() if k != "applications"},
                           "applications": {a["name"]: {"name": a["name"], "status": "RUNNING",
                                                        "deployed_app_config": a, "deployments": {}}
                                            for a in dashboard.deployed["applications"]}}
                self._answer(200, json.dumps(details))

            def do_PUT(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if dashboard.refuse is not None:
                    self._answer(400, dashboard.refuse)
                    return
                dashboard.puts.append(body)
                dashboard.deployed = body
                self._answer(200, "")

            def _answer(self, status: int, text: str) -> None:
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def spec():
    return make_spec()


@pytest.fixture
def dashboard(spec):
    fake = FakeDashboard(spec)
    yield fake
    fake.close()


def plexserve_deployments(config: dict) -> dict[str, dict]:
    (app,) = [a for a in config["applications"] if a["name"] == "plexserve"]
    return {d["name"]: d for d in app["deployments"]}


def test_an_update_sets_only_the_controllers_fields_and_keeps_the_operators(spec, dashboard):
    moved = Placement.model_validate({"groups": [group(1, ["vit-a"]), group(1, ["vit-b"]), group(2, ["vit-c"])]})
    apply_overrides("plexserve", placement_overrides(spec, moved, version=1), wait=False, url=dashboard.url)
    (put,) = dashboard.puts
    ServeDeploySchema.model_validate(put)
    deployments = plexserve_deployments(put)
    # The operator's fields stay in force, on a deployment the controller writes and on one it never writes.
    assert deployments["group-0"]["health_check_period_s"] == 7.0
    assert deployments["group-0"]["ray_actor_options"] == {"num_cpus": 0.3}
    assert deployments["PlacementController"] == OPERATOR_OVERRIDES[1]
    # The controller's fields carry the move.
    assert [m["name"] for m in deployments["group-0"]["user_config"]["models"]] == ["vit-a"]
    hosted = sorted([m["name"] for m in deployments[f"group-{i}"]["user_config"]["models"]] for i in range(4))
    assert hosted == [[], ["vit-a"], ["vit-b"], ["vit-c"]]
    assert set(deployments["Ingress"]) == {"name", *CONTROLLER_OWNED_FIELDS["ingress"]}
    assert set(deployments["group-3"]) == {"name", *CONTROLLER_OWNED_FIELDS["group slot"]}
    # The application's own fields, the other application and the instance options as deployed.
    (app,) = [a for a in put["applications"] if a["name"] == "plexserve"]
    assert app["args"] == spec.model_dump(mode="json", exclude_none=True)
    assert OTHER_APP in put["applications"]
    assert put["proxy_location"] == "EveryNode" and put["http_options"] == {"host": "127.0.0.1", "port": 8000}
    # A second update replaces the controller's fields again and still keeps the operator's.
    apply_overrides("plexserve", placement_overrides(spec, spec.placement, version=2), wait=False, url=dashboard.url)
    again = plexserve_deployments(dashboard.puts[-1])
    assert again["group-0"]["health_check_period_s"] == 7.0
    assert [m["name"] for m in again["group-0"]["user_config"]["models"]] == ["vit-a", "vit-b"]


def test_a_dashboard_that_does_not_answer_is_an_error_naming_its_url(spec):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServeApiError, match=f"dashboard at {url}/api/serve/applications/ did not answer"):
        deployed_config(url, timeout_s=2)


def test_a_config_serve_refuses_is_an_error_with_serves_reason(spec, dashboard):
    dashboard.refuse = "1 validation error for ServeDeploySchema\napplications.0.deployments.2.num_replicas"
    with pytest.raises(ServeApiError, match="(?s)refused PUT .*HTTP 400.*num_replicas"):
        apply_overrides("plexserve", placement_overrides(spec, spec.placement, version=1), wait=False,
                        url=dashboard.url)
    assert dashboard.puts == []


def test_a_config_the_deploy_schema_refuses_names_the_field():
    with pytest.raises(ValueError, match=r"applications\.0\.deployments\.0\.num_replicas"):
        validate_config({"applications": [{"name": "a", "import_path": "m:app",
                                           "deployments": [{"name": "d", "num_replicas": -3}]}]})


def bare_controller(spec, url: str, **settings) -> PlacementController:
    """A controller holding only what its updates touch (no Ray, no policy)."""
    controller = object.__new__(PlacementController.func_or_class)
    controller.spec = spec
    controller.settings = spec.controller.model_copy(update={"dashboard_url": url, "api_timeout_s": 2, **settings})
    controller.app_name = "plexserve"
    controller.recommend_only = controller.settings.mode == "recommend"
    controller.recommended = None
    controller.groups_enabled = True
    controller.runtimes = RuntimeAllocations(spec, start_s=0.0)
    controller.layout = initial_layout(spec)
    controller.routes = controller.layout.routes()
    controller.slot_versions = [0] * len(controller.layout.slots)
    controller.version = 0
    controller.layout_changed_s = 0.0
    controller.last_rollout = None
    return controller


MOVE = Placement.model_validate({"groups": [group(1, ["vit-a"]), group(1, ["vit-b"]), group(2, ["vit-c"])]})


@pytest.mark.parametrize("failure", ["no answer", "refused"])
def test_a_failed_update_keeps_the_running_layout(spec, dashboard, failure, caplog):
    url = f"http://127.0.0.1:{free_port()}" if failure == "no answer" else dashboard.url
    dashboard.refuse = "deployments.0.user_config: not valid"
    controller = bare_controller(spec, url)
    before = (controller.layout, controller.routes, list(controller.slot_versions))
    with pytest.raises(ServeApiError, match=url if failure == "no answer" else "user_config"):
        asyncio.run(controller._apply(MOVE))
    assert (controller.layout, controller.routes, controller.slot_versions) == before
    assert dashboard.puts == []
    assert "update not applied, the running layout keeps serving" in caplog.text and url in caplog.text


def test_recommend_mode_applies_nothing_and_publishes_a_valid_config(spec, dashboard, tmp_path):
    path = tmp_path / "out" / "recommended.yaml"
    controller = bare_controller(spec, dashboard.url, mode="recommend", recommendation_path=str(path))
    assert controller.recommendation() == {"mode": "recommend", "config": None}
    before = (controller.layout, controller.routes, controller.version)
    entry = asyncio.run(controller._apply(MOVE))
    assert entry["outcome"] == "recommended" and entry["diff"]
    assert dashboard.puts == []  # nothing applied
    assert (controller.layout, controller.routes, controller.version) == before
    recommended = controller.recommendation()
    assert recommended["mode"] == "recommend" and recommended["version"] == 1
    ServeDeploySchema.model_validate(recommended["config"])
    assert yaml.safe_load(path.read_text()) == recommended["config"]
    deployments = plexserve_deployments(recommended["config"])
    # The move's final layout, routed to, with the operator's settings kept.
    hosted = sorted([m["name"] for m in deployments[f"group-{i}"]["user_config"]["models"]] for i in range(4))
    assert hosted == [[], ["vit-a"], ["vit-b"], ["vit-c"]]
    assert deployments["Ingress"]["user_config"]["routes"] == entry_routes(deployments)
    assert deployments["group-0"]["health_check_period_s"] == 7.0


def entry_routes(deployments: dict[str, dict]) -> list[list[str]]:
    """Where a layout routes each model: the slots hosting it (as `SlotLayout.routes`)."""
    from placement.alpaserve.placement_rollout import SlotLayout
    from placement.core.placement_plan import GroupPlacement
    from placement.core.profiles import ParallelConfig

    slots = []
    for i in range(4):
        config = deployments[f"group-{i}"]["user_config"]
        slots.append(None if not config["config"] else GroupPlacement(
            num_devices=config["num_devices"], config=ParallelConfig.model_validate(config["config"]),
            models=[m["name"] for m in config["models"]]))
    return SlotLayout(slots=slots).routes()


def test_the_dashboard_url_comes_from_the_spec_the_environment_or_the_head_node(monkeypatch):
    import ray

    from rayserve_apps.control.live_update import DASHBOARD_ENV, dashboard_url

    monkeypatch.setattr(ray, "nodes", lambda: [
        {"Alive": True, "NodeManagerAddress": "10.0.0.7", "Resources": {"CPU": 4.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.5", "Resources": {"node:__internal_head__": 1.0}}])
    monkeypatch.delenv(DASHBOARD_ENV, raising=False)
    assert dashboard_url() == "http://10.0.0.5:8265"
    monkeypatch.setenv(DASHBOARD_ENV, "10.1.1.1:9999/")
    assert dashboard_url() == "http://10.1.1.1:9999"
    assert dashboard_url("https://head-svc:8265") == "https://head-svc:8265"
    monkeypatch.delenv(DASHBOARD_ENV)
    monkeypatch.setattr(ray, "nodes", lambda: [])
    with pytest.raises(ServeApiError, match="controller.dashboard_url"):
        dashboard_url()
