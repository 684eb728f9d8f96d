"""The application builder: a deployment spec becomes a Ray Serve application.

`serve run configs/local.yaml` imports `rayserve_apps.app:build_app` and passes the application's `args` (a
deployment spec) to it. The builder validates the spec (a bad field fails before anything is deployed, with
the field named) and binds one deployment per model behind one ingress.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve import Application

from placement.spec import DeploymentSpec, ModelSpec, parse_spec
from rayserve_apps.ingress import Ingress
from rayserve_apps.text_deployment import TextModelDeployment
from rayserve_apps.vision_deployment import VisionModelDeployment

logger = logging.getLogger(__name__)

#: The application name used by configs and by `serve.get_app_handle`.
APP_NAME = "plexserve"


def model_deployment_name(model: str) -> str:
    return f"model-{model}"


def _bind_model(model: ModelSpec) -> Application:
    deployment = TextModelDeployment if model.kind == "text" else VisionModelDeployment
    return deployment.options(
        name=model_deployment_name(model.name),
        num_replicas=model.num_replicas,
        ray_actor_options={"num_cpus": model.num_cpus_per_replica},
    ).bind(model.model_dump(mode="json"))


def build_app(args: dict[str, Any] | DeploymentSpec) -> Application:
    """Ray Serve application builder: `import_path: rayserve_apps.app:build_app`, `args:` a deployment spec."""
    spec = parse_spec(args)
    handles = {model.name: _bind_model(model) for model in spec.models}
    logger.info("plexserve app: %d models (%s)", len(spec.models), ", ".join(handles))
    return Ingress.options(ray_actor_options={"num_cpus": spec.serving.num_cpus_ingress}).bind(
        spec.model_dump(mode="json"), handles
    )
