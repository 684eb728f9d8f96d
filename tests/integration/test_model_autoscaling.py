"""Serve autoscaling of a single-model deployment (`models[].autoscaling`): the Serve options plexserve's builder
gives the deployment, checked against Serve's own schemas (`ray.serve.schema.DeploymentSchema`,
`ray.serve.config.AutoscalingConfig`). No Ray is started."""

from __future__ import annotations

import pytest
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import DeploymentSchema

from placement.core.deployment_spec import parse_spec
from rayserve_apps.app import _bind_model, model_deployment_options

MINILM = {"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2"}


def test_an_autoscaled_model_gets_serves_autoscaling_config_in_place_of_num_replicas():
    spec = parse_spec({"models": [{**MINILM, "autoscaling": {"min_replicas": 1, "max_replicas": 4,
                                                             "initial_replicas": 2, "target_ongoing_requests": 3}}]})
    options = model_deployment_options(spec.models[0], spec.cluster.device_resource)
    assert "num_replicas" not in options
    config = AutoscalingConfig(**options["autoscaling_config"])  # Serve accepts every field as given
    assert (config.min_replicas, config.max_replicas, config.initial_replicas) == (1, 4, 2)
    assert config.target_ongoing_requests == 3
    DeploymentSchema(name=options["name"], autoscaling_config=options["autoscaling_config"],
                     max_queued_requests=options["max_queued_requests"])


def test_a_model_without_autoscaling_keeps_its_fixed_replicas():
    spec = parse_spec({"models": [{**MINILM, "num_replicas": 3}]})
    options = model_deployment_options(spec.models[0], spec.cluster.device_resource)
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options


def test_a_polymorphing_model_refuses_autoscaling_by_name():
    arlo = {"name": "arlo", "params": {"capacities": {"64": 10.0, "128": 5.0}}}
    spec = parse_spec({"models": [{**MINILM, "autoscaling": {"max_replicas": 2}, "policies": {"polymorphing": arlo}}]})
    with pytest.raises(ValueError, match="'minilm': autoscaling does not apply to a polymorphing model"):
        _bind_model(spec, spec.models[0])
