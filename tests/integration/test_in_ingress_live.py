"""`in_ingress: always` deployed: the model gets no deployment of its own, its engine in the ingress answers what
its own replica would, and bad input fails alone (the engine keeps answering)."""

from __future__ import annotations

import os
from urllib.parse import urlparse

import pytest
import requests
import torch
import torch.nn.functional as F

from models import load_text_encoder
from placement.core.deployment_spec import parse_spec

pytestmark = pytest.mark.ray

TEXTS = ["plexserve serves this text in its ingress", "a second text " * 20]


def test_an_always_in_ingress_model_has_no_deployment_and_answers_as_the_model_does(ray_serve):
    from rayserve_apps.control.live_update import DASHBOARD_ENV, application_config, apply_config

    url = urlparse(ray_serve)
    spec = parse_spec({"cluster": {"device_resource": "CPU"}, "models": [{
        "name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2", "num_cpus_per_replica": 0.25,
        "max_input_length_tokens": 64, "in_ingress": "always"}]})
    apply_config([application_config(spec)], {"host": url.hostname, "port": url.port})
    details = requests.get(f"{os.environ[DASHBOARD_ENV]}/api/serve/applications/", timeout=30).json()
    assert sorted(details["applications"]["plexserve"]["deployments"]) == ["Ingress"]
    layout = requests.get(f"{ray_serve}/v1/placement", timeout=60).json()
    assert layout["in_ingress"] == ["minilm"] and layout["single_model_deployments"] == {}

    embed = f"{ray_serve}/v1/models/minilm/embed"
    answer = requests.post(embed, json={"texts": TEXTS}, timeout=120)
    assert answer.status_code == 200, answer.text
    direct = load_text_encoder()
    expected = direct.embed_token_ids(direct.text_tokenizer.encode(TEXTS))
    assert (F.cosine_similarity(torch.tensor(answer.json()["embeddings"]), expected, dim=1) >= 0.9999).all()

    too_long = requests.post(embed, json={"texts": ["word " * 200]}, timeout=60)
    assert too_long.status_code == 413 and "64" in too_long.json()["error"]["message"], too_long.text
    again = requests.post(embed, json={"texts": TEXTS[:1]}, timeout=60)
    assert again.status_code == 200, again.text
