"""The KubeRay example (`deploy/rayservice.yaml`) and its image (`deploy/Dockerfile`) are deployable as written: the
RayService's `serveConfigV2` passes Serve's own deploy schema and plexserve's spec, its import paths exist in this
repository, the image is Ray's GPU image at the Ray version plexserve runs with. No Ray cluster needed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from placement.core.deployment_spec import parse_spec
from rayserve_apps.contracts import APP_IMPORT_PATH
from rayserve_apps.control.live_update import validate_config


def repo_root() -> Path:
    for folder in Path(__file__).resolve().parents:
        if (folder / "pyproject.toml").exists():
            return folder
    raise FileNotFoundError("no pyproject.toml above the tests")


DEPLOY = repo_root() / "deploy"


@pytest.fixture(scope="module")
def rayservice() -> dict:
    return yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())


@pytest.fixture(scope="module")
def serve_config(rayservice) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def test_the_rayservice_is_a_kuberay_v1_rayservice_with_a_gpu_worker_group(rayservice):
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"  # Serve's REST API, for KubeRay and the controller
    gpus = [group for group in cluster["workerGroupSpecs"]
            if any("nvidia.com/gpu" in c["resources"]["limits"] for c in group["template"]["spec"]["containers"])]
    assert gpus, "no GPU worker group"
    # Every pod runs the image deploy/Dockerfile builds.
    images = {c["image"] for group in [head, *cluster["workerGroupSpecs"]]
              for c in group["template"]["spec"]["containers"]}
    assert images == {"plexserve:0.1.0"}
    assert "-t plexserve:0.1.0" in (DEPLOY / "Dockerfile").read_text()


def test_the_serve_config_passes_serves_schema_and_plexserves_spec(serve_config, rayservice):
    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] == APP_IMPORT_PATH
    spec = parse_spec(app["args"])
    # The GPU workers hold the cluster's devices, and every group fits on one worker pod (STRICT_PACK).
    workers = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    per_pod = [int(c["resources"]["limits"]["nvidia.com/gpu"]) for g in workers
               for c in g["template"]["spec"]["containers"] if "nvidia.com/gpu" in c["resources"]["limits"]]
    assert spec.cluster.device_resource == "GPU"
    assert spec.cluster.num_devices == sum(n * g["replicas"] for n, g in zip(per_pod, workers))
    assert max(g.num_devices for g in spec.placement.groups) <= max(per_pod)
    assert spec.controller is not None and spec.controller.mode == "recommend"


def test_the_import_paths_exist_in_the_repository(serve_config):
    for app in serve_config["applications"]:
        module, attribute = app["import_path"].split(":")
        found = importlib.util.find_spec(module)
        assert found is not None and found.origin is not None, app["import_path"]
        path = Path(found.origin).resolve()
        assert path.is_relative_to(repo_root()), f"{module} is not this repository's ({path})"
        assert re.search(rf"^def {attribute}\(", path.read_text(), re.MULTILINE), app["import_path"]


def test_the_dockerfile_builds_on_rays_gpu_image_at_the_tested_ray_version():
    text = (DEPLOY / "Dockerfile").read_text()
    version = re.search(r"^ARG RAY_VERSION=(\S+)$", text, re.MULTILINE).group(1)
    assert version == ray.__version__
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-py311-gpu$", text, re.MULTILINE)
    for package in ("placement", "models", "ops", "parallel", "rayserve_apps"):
        assert f"COPY --chown=ray:users {package} ./{package}" in text


@pytest.mark.parametrize("change, field", [
    (lambda app: app["deployments"].append({"name": "Ingress", "num_replicas": -1}), "deployments.0.num_replicas"),
    (lambda app: app.pop("import_path"), "import_path"),
])
def test_a_serve_config_the_schema_refuses_names_the_field(serve_config, change, field):
    broken = yaml.safe_load(yaml.safe_dump(serve_config))
    broken["applications"][0].setdefault("deployments", [])
    change(broken["applications"][0])
    with pytest.raises(ValueError, match=rf"Serve's deploy schema refuses the config: .*applications\.0\.{field}"):
        validate_config(broken)
