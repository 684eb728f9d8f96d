"""Serve autoscaling of a single-model deployment (`models[].autoscaling`): the Serve options plexserve's builder
gives the deployment, checked against Serve's own schemas (`ray.serve.schema.DeploymentSchema`,
`ray.serve.config.AutoscalingConfig`) without Ray, and Serve adding a replica of a text model under load."""

from __future__ import annotations

import os
import threading
import time
from urllib.parse import urlparse

import pytest
import requests
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import DeploymentSchema

from placement.core.deployment_spec import parse_spec
from rayserve_apps.app import _bind_model, model_deployment_options

MINILM = {"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2"}
#: Seconds within which Serve must have added the replica (its metrics arrive every 10 s by default).
SCALE_UP_TIMEOUT_S = 90.0


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


def test_serve_adds_a_replica_of_an_autoscaled_text_model_under_load(ray_serve):
    from waiting import wait_until

    from rayserve_apps.control.live_update import DASHBOARD_ENV, application_config, apply_config

    url = urlparse(ray_serve)
    spec = parse_spec({"cluster": {"device_resource": "CPU"}, "models": [{
        **MINILM, "num_cpus_per_replica": 0.25,
        "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 1}}]})
    apply_config([application_config(spec)], {"host": url.hostname, "port": url.port})

    def deployment() -> dict:
        details = requests.get(f"{os.environ[DASHBOARD_ENV]}/api/serve/applications/", timeout=30).json()
        return details["applications"]["plexserve"]["deployments"]["model-minilm"]

    def running() -> int:
        return sum(replica["state"] == "RUNNING" for replica in deployment()["replicas"])

    assert deployment()["deployment_config"]["autoscaling_config"]["max_replicas"] == 2
    assert running() == 1
    scaled = threading.Event()
    statuses: list[int] = []

    def client() -> None:  # closed loop: 8 clients keep about 8 requests ongoing, past the target of 1
        deadline = time.monotonic() + SCALE_UP_TIMEOUT_S
        while not scaled.is_set() and time.monotonic() < deadline:
            statuses.append(requests.post(f"{ray_serve}/v1/models/minilm/embed", timeout=60,
                                          json={"texts": ["an autoscaled model embeds this text"] * 4}).status_code)

    clients = [threading.Thread(target=client) for _ in range(8)]
    for thread in clients:
        thread.start()
    try:
        wait_until(lambda: running() >= 2, SCALE_UP_TIMEOUT_S, message="Serve added no second replica under load")
    finally:
        scaled.set()
        for thread in clients:
            thread.join()
    assert statuses and set(statuses) == {200}
