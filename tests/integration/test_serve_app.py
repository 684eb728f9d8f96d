"""End to end on a local Ray: the spec becomes a Serve app; HTTP and handles answer; bad input never hurts."""

import numpy as np
import pytest
import requests
import torch
import torch.nn.functional as F
from ray import serve

from models import load_text_encoder, load_vit
from rayserve_apps.app import build_app
from rayserve_apps.contracts import APP_NAME

pytestmark = pytest.mark.ray

TEXTS = ["Ray Serve hosts many models.", "A second, somewhat longer sentence about concatenated batches of text."]
VIT_KWARGS = dict(num_classes=4, image_size_px=16, in_chans=3)
VIT_ARCH = "timm:vit_tiny_patch16_224"
#: A tiny ViT (random weights saved to a local checkpoint) exercises the vision path without a trained model.
TINY_VIT = dict(patch_size=4, depth=2, embed_dim=32, num_heads=2)


@pytest.fixture(scope="module")
def app(ray_serve, tmp_path_factory):
    vit = load_vit(VIT_ARCH, allow_random_init=True, **VIT_KWARGS, **TINY_VIT)
    checkpoint = tmp_path_factory.mktemp("vit") / "vit.pt"
    torch.save(vit.model.state_dict(), checkpoint)
    spec = {
        "models": [
            {"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2", "num_cpus_per_replica": 0.5},
            {"name": "minilm-short", "kind": "text", "source": "package:all-minilm-l6-v2",
             "max_input_length_tokens": 16, "on_too_long": "truncate", "num_cpus_per_replica": 0.5},
            {"name": "vit", "kind": "vision", "source": VIT_ARCH, "checkpoint_path": str(checkpoint),
             "num_cpus_per_replica": 0.5, "timm_kwargs": TINY_VIT, **VIT_KWARGS},
        ],
        "serving": {"max_request_bytes": 64 * 1024, "max_items_per_request": 8},
    }
    handle = serve.run(build_app(spec), name=APP_NAME, route_prefix="/", blocking=False)
    yield {"url": ray_serve, "handle": handle, "vit": vit, "spec": spec}
    serve.delete(APP_NAME)


def post(url, path, **kwargs):
    return requests.post(f"{url}{path}", timeout=60, **kwargs)


def test_http_embed_matches_direct_model(app):
    response = post(app["url"], "/v1/models/minilm/embed", json={"texts": TEXTS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "minilm"
    served = torch.tensor(body["embeddings"])
    direct = load_text_encoder()
    for text, embedding in zip(TEXTS, served):  # per request, no batching
        assert F.cosine_similarity(embedding, direct.embed([text])[0], dim=0) >= 0.9999


def test_handle_calls(app):
    handle = app["handle"]
    body = handle.embed.remote("minilm", TEXTS).result(timeout_s=60)
    assert len(body["embeddings"]) == 2 and len(body["embeddings"][0]) == 384
    models = handle.list_models.remote().result(timeout_s=60)["models"]
    assert {m["name"]: m["kind"] for m in models} == {"minilm": "text", "minilm-short": "text", "vit": "vision"}
    with pytest.raises(ValueError, match="no model named"):
        handle.embed.remote("absent", TEXTS).result(timeout_s=60)


def test_models_and_health(app):
    models = requests.get(f"{app['url']}/v1/models", timeout=30).json()["models"]
    minilm = next(m for m in models if m["name"] == "minilm")
    assert minilm["max_input_length_tokens"] == 256 and minilm["on_too_long"] == "reject"
    assert requests.get(f"{app['url']}/healthz", timeout=30).json() == {"status": "ok"}


def test_truncate_option_cuts_long_texts(app):
    long_text = "token " * 400
    response = post(app["url"], "/v1/models/minilm-short/embed", json={"texts": [long_text]})
    assert response.status_code == 200, response.text
    rejected = post(app["url"], "/v1/models/minilm/embed", json={"texts": ["ok", long_text]})
    assert rejected.status_code == 413
    assert rejected.json()["error"]["field"] == "texts[1]" and "256" in rejected.json()["error"]["message"]


def test_classify_over_http_and_handle(app):
    images = np.random.default_rng(0).normal(size=(2, 3, 16, 16)).astype(np.float32)
    response = post(app["url"], "/v1/models/vit/classify", json={"images": images.tolist()})
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    expected = torch.softmax(app["vit"].logits(torch.from_numpy(images)), dim=-1)
    assert [p["label"] for p in predictions] == expected.argmax(dim=1).tolist()
    assert np.allclose([p["probabilities"] for p in predictions], expected.numpy(), atol=1e-5)
    via_handle = app["handle"].classify.remote("vit", images.tolist()).result(timeout_s=60)
    assert [p["label"] for p in via_handle["predictions"]] == expected.argmax(dim=1).tolist()


BAD_REQUESTS = [
    ("/v1/models/nope/embed", {"json": {"texts": ["x"]}}, 404, "unknown_model"),
    ("/v1/models/vit/embed", {"json": {"texts": ["x"]}}, 400, "wrong_model_kind"),
    ("/v1/models/minilm/embed", {"json": {"texts": []}}, 422, "invalid_field"),
    ("/v1/models/minilm/embed", {"json": {"texts": ["fine", ""]}}, 422, "invalid_field"),
    ("/v1/models/minilm/embed", {"json": {"texts": [42]}}, 422, "invalid_field"),
    ("/v1/models/minilm/embed", {"json": {"texts": ["word " * 300]}}, 413, "input_too_long"),
    ("/v1/models/minilm/embed", {"data": b'{"texts": ["unterminated'}, 400, "malformed_json"),
    ("/v1/models/minilm/embed", {"data": b'{"texts": ["' + b"a" * 70000 + b'"]}'}, 413, "request_too_large"),
    ("/v1/models/minilm/embed", {"json": {"texts": ["a"] * 9}}, 413, "too_many_items"),
    ("/v1/models/vit/classify", {"json": {"images": np.zeros((1, 1, 16, 16)).tolist()}}, 422, "invalid_shape"),
    ("/v1/models/vit/classify", {"json": {"images": [[[["a"] * 16] * 16] * 3]}}, 422, "invalid_dtype"),
    ("/v1/models/vit/classify", {"json": {"images": np.zeros((1, 3, 16, 16)).tolist(), "dtype": "float64"}}, 422,
     "invalid_dtype"),
]


@pytest.mark.parametrize("path, kwargs, status, error_type", BAD_REQUESTS)
def test_bad_request_gets_4xx_json_and_service_survives(app, path, kwargs, status, error_type):
    response = post(app["url"], path, **kwargs)
    assert response.status_code == status, response.text
    assert response.json()["error"]["type"] == error_type
    good = post(app["url"], "/v1/models/minilm/embed", json={"texts": ["still alive"]})
    assert good.status_code == 200 and len(good.json()["embeddings"]) == 1


def test_handle_with_bad_token_ids_reaches_replica_check(app):
    model_handle = serve.get_deployment_handle("model-minilm", app_name=APP_NAME)
    with pytest.raises(ValueError, match="limit is 256"):
        model_handle.embed_token_ids.remote([[101] + [1000] * 300 + [102]]).result(timeout_s=60)
    assert len(model_handle.embed_token_ids.remote([[101, 7592, 102]]).result(timeout_s=60)) == 1
