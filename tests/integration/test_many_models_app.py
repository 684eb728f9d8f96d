"""configs/many_models.yaml, scaled down, on Ray Serve: planned at deploy time, every model answers.

Two MiniLM copies, one MPNet copy (where all-mpnet-base-v2's packages are installed) and the digits ViT, on the
spec's two CPU-share devices with its per-device memory, its measured profiles and its controller on. The app
builder plans the placement before deploying; each model then answers one request, text equal to the
single-process model's embedding.
"""

from __future__ import annotations

import numpy as np
import pytest
import requests
import torch
import torch.nn.functional as F
import yaml
from ray import serve
from repo_paths import REPO_ROOT
from waiting import wait_until

from models.packaged import packaged_model_available
from models.text_encoder import load_text_encoder
from placement.core.profiles import ProfileSet
from rayserve_apps.app import build_app

pytestmark = pytest.mark.ray

CONFIG = REPO_ROOT / "configs" / "many_models.yaml"
APP_NAME = "many-models"
HAS_MPNET = packaged_model_available("all-mpnet-base-v2")
TEXT_MODELS = ["minilm-a", "minilm-b"] + (["mpnet-a"] if HAS_MPNET else [])
TEXTS = ["many models share two devices", "a second sentence"]


def scaled_down_spec() -> dict:
    args = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    keep = set(TEXT_MODELS) | {"digits-vit"}
    args["models"] = [model for model in args["models"] if model["name"] in keep]
    for model in args["models"]:
        model["slo_ms"] = 120_000  # answers, not deadlines, are checked here
        model["num_cpus_per_replica"] = 0.25
    args["planning"]["profiles"]["path"] = str(REPO_ROOT / args["planning"]["profiles"]["path"])
    args["planning"]["workload"]["duration_s"] = 30
    return args


@pytest.fixture(scope="module")
def app(ray_serve):
    spec = scaled_down_spec()
    handle = serve.run(build_app(spec), name=APP_NAME, route_prefix="/", blocking=False)
    yield {"url": ray_serve, "handle": handle, "spec": spec}
    serve.delete(APP_NAME)


def test_the_planned_placement_hosts_every_model_within_device_memory(app):
    def reported() -> dict | None:
        # A group still loading its models may not report in time ("unavailable"): wait until every group does.
        layout = requests.get(f"{app['url']}/v1/placement", timeout=120).json()
        return layout if all("models" in group for group in layout["groups"]) else None

    layout = wait_until(reported, timeout_s=120, interval_s=1, message="a group never reported its models")
    placed = {name for group in layout["groups"] for name in group["models"]}
    assert placed == set(TEXT_MODELS) | {"digits-vit"}
    profiles = ProfileSet.load(app["spec"]["planning"]["profiles"]["path"])
    budget = app["spec"]["cluster"]["device_memory_bytes"]
    for group in layout["groups"]:
        config = group["config"]
        key = f"op{config.get('intra_op_degree', 1)}-pp{config.get('pipeline_stages', 1)}"
        per_device = sum(next(c for c in profiles.models[name].configs if c.config.key() == key)
                         .weight_bytes_per_device() for name in group["models"])
        assert per_device <= budget, (group, per_device)


@pytest.mark.parametrize("model", TEXT_MODELS)
def test_every_text_model_answers_as_the_single_process_model(app, model):
    response = requests.post(f"{app['url']}/v1/models/{model}/embed", json={"texts": TEXTS}, timeout=120)
    assert response.status_code == 200, response.text
    source = next(m["source"] for m in app["spec"]["models"] if m["name"] == model)
    direct = load_text_encoder(source, name=model)
    expected = direct.embed_token_ids(direct.text_tokenizer.encode(TEXTS))
    served = torch.tensor(response.json()["embeddings"])
    assert served.shape == expected.shape
    assert (F.cosine_similarity(served, expected, dim=1) >= 0.9999).all()


def test_the_vision_model_answers(app):
    images = np.random.default_rng(0).uniform(0, 16, size=(2, 1, 32, 32)).astype(np.float32)
    response = requests.post(f"{app['url']}/v1/models/digits-vit/classify", json={"images": images.tolist()},
                             timeout=120)
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    assert len(predictions) == 2 and all(0 <= int(p["label"]) < 10 for p in predictions)


def test_mpnet_is_skipped_only_where_its_packages_are_absent():
    if not HAS_MPNET:
        pytest.skip("all-mpnet-base-v2's packages are not installed (make install-bench)")
    assert "mpnet-a" in TEXT_MODELS
