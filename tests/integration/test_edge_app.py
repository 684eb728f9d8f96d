"""The HTTP edge end to end on a local Ray: no 5xx for any input (a hypothesis fuzz), the issue's four bodies,
OpenAI's embeddings API through the official `openai` client, the KServe v2 protocol through `tritonclient.http`,
and image files. One application, deployed once for the module."""

from __future__ import annotations

import base64
import io
import json
import time

import numpy as np
import pytest
import requests
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image
from ray import serve

from models import load_vit
from models.text_encoder import load_text_tokenizer
from rayserve_apps.app import build_app
from rayserve_apps.contracts import APP_NAME
from rayserve_apps.edge.errors import protocol_of

pytestmark = pytest.mark.ray

TEXTS = ["Ray Serve hosts many models.", "Edges should never answer 5xx to a client's bad input."]
TINY_VIT = dict(patch_size=4, depth=2, embed_dim=32, num_heads=2)
VIT = dict(num_classes=4, image_size_px=16, in_chans=3)
VIT_ARCH = "timm:vit_tiny_patch16_224"
LABELS = ["cat", "dog", "fox", "owl"]
#: Large enough that a 1 MB text reaches the tokenizer (and is refused there as too long, never a 5xx).
MAX_REQUEST_BYTES = 3 * 1024 * 1024 // 2
ONE_MB_TEXT = "word " * (1024 * 1024 // 5)
#: Examples the fuzz test sends (bounded so that it stays well under a minute on two cores).
FUZZ_EXAMPLES = 300


@pytest.fixture(scope="module")
def app(ray_serve, tmp_path_factory):
    vit = load_vit(VIT_ARCH, allow_random_init=True, **VIT, **TINY_VIT)
    directory = tmp_path_factory.mktemp("vit")
    torch.save(vit.model.state_dict(), directory / "vit.pt")
    (directory / "labels.json").write_text(json.dumps(LABELS))
    spec = {
        "models": [
            {"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2", "num_cpus_per_replica": 0.5},
            {"name": "vit", "kind": "vision", "source": VIT_ARCH, "checkpoint_path": str(directory / "vit.pt"),
             "num_cpus_per_replica": 0.5, "timm_kwargs": TINY_VIT, **VIT},
        ],
        "serving": {"max_request_bytes": MAX_REQUEST_BYTES, "max_items_per_request": 8},
    }
    handle = serve.run(build_app(spec), name=APP_NAME, route_prefix="/", blocking=False)
    session = requests.Session()
    yield {"url": ray_serve, "handle": handle, "vit": vit, "session": session}
    session.close()
    serve.delete(APP_NAME)


def post(app, path, **kwargs):
    return app["session"].post(f"{app['url']}{path}", timeout=60, **kwargs)


def embed(app, texts):
    response = post(app, "/v1/models/minilm/embed", json={"texts": texts})
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["embeddings"])


def classify(app, images):
    response = post(app, "/v1/models/vit/classify", json={"images": np.asarray(images).tolist()})
    assert response.status_code == 200, response.text
    return response.json()["predictions"]


def images(count=2, seed=0):
    return np.random.default_rng(seed).normal(size=(count, 3, 16, 16)).astype(np.float32)


def replica_actors() -> set[str]:
    from ray.util import list_named_actors

    return {a["name"] for a in list_named_actors(all_namespaces=True) if f"{APP_NAME}#" in a["name"]}


FOUR_BODIES = [
    ("/v1/models/minilm/embed", b'{"texts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too_deeply_nested"),
    ("/v1/models/minilm/embed", b'{"texts": ["\\ud800"]}', "invalid_field"),
    ("/v1/models/vit/classify", json.dumps({"images": images(1).tolist(), "dtype": ["float32"]}).encode(),
     "invalid_field"),
    ("/v1/models/vit/classify",
     b'{"images": ' + json.dumps(images(1).tolist()).encode() + b', "slo_ms": 1' + b"0" * 400 + b"}", "invalid_field"),
]


@pytest.mark.parametrize("path, body, error_type", FOUR_BODIES)
def test_the_issues_four_bodies_get_4xx(app, path, body, error_type):
    response = post(app, path, data=body, headers={"Content-Type": "application/json"})
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["type"] == error_type


def test_a_stamped_send_time_starts_the_clock_and_a_bad_one_gets_a_4xx(app):
    sent_ms = int((time.time() - 0.3) * 1000)  # a proxy's X-Request-Start, in milliseconds, 0.3 s ago
    stamped = post(app, "/v1/models/minilm/embed", json={"texts": ["a"]}, headers={"X-Request-Start": f"t={sent_ms}"})
    assert stamped.status_code == 200, stamped.text
    assert stamped.json()["ingress_latency_ms"] >= 300.0  # the way to the ingress counts
    for value, status in [("t=yesterday", 400), (f"t={time.time() + 60:.3f}", 422)]:
        refused = post(app, "/v1/models/minilm/embed", json={"texts": ["a"]}, headers={"X-Request-Start": value})
        assert refused.status_code == status and refused.json()["error"]["field"] == "X-Request-Start", refused.text
    assert embed(app, ["still served"]).shape == (1, 384)


def test_fastapi_errors_health_and_docs(app):
    url, session = app["url"], app["session"]
    for response, status, error_type in [(session.get(f"{url}/v1/nowhere"), 404, "not_found"),
                                         (session.get(f"{url}/v1/models/minilm/embed"), 405, "method_not_allowed"),
                                         (session.get(f"{url}/v1/placement/history?limit=abc"), 422, "invalid_field")]:
        assert response.status_code == status and response.json()["error"]["type"] == error_type, response.text
    assert session.get(f"{url}/healthz").json() == {"status": "ok"}
    assert session.get(f"{url}/v2/health/ready").json()["ready"] is True
    paths = session.get(f"{url}/openapi.json").json()["paths"]
    schema = paths["/v1/models/{name}/classify"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"images", "images_base64", "top_k"} <= set(schema["properties"])
    assert "/v1/embeddings" in paths and "/v2/models/{name}/infer" in paths


def test_chunked_body_over_the_limit_is_refused(app):
    def chunks():
        yield b'{"texts": ["'
        for _ in range(2 * MAX_REQUEST_BYTES // 4096):
            yield b"a" * 4096
        yield b'"]}'

    response = post(app, "/v1/models/minilm/embed", data=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["type"] == "request_too_large"


#: Strings clients send: surrogates, zero-width and right-to-left marks, combining marks, NUL, emoji, long ones.
NASTY_TEXTS = st.sampled_from(["\ud800", "a\udfffb", "\u200b", "\u200b\u200d\ufeff", "\u202eabc", "e\u0301" * 50,
                               "\x00", "😀" * 100, "word " * 600, ONE_MB_TEXT, "a" * (MAX_REQUEST_BYTES + 1), " ", ""])
NUMBERS = st.one_of(st.integers(), st.sampled_from([10**400, -(10**400), 2**63, -1, 0, 1e308, -0.0, 5e-324]),
                    st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=20), NASTY_TEXTS)
JSON_VALUES = st.recursive(SCALARS,
                           lambda inner: (st.lists(inner, max_size=4)
                                          | st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
GOOD_IMAGE = images(1).tolist()
FIELDS = {
    "/v1/models/minilm/embed": {"texts": st.one_of(JSON_VALUES,
                                                   st.lists(st.one_of(st.text(max_size=30), NASTY_TEXTS),
                                                            max_size=10))},
    "/v1/models/vit/classify": {"images": st.one_of(JSON_VALUES, st.just(GOOD_IMAGE)),
                                "images_base64": st.one_of(JSON_VALUES, st.lists(st.text(max_size=20), max_size=3)),
                                "dtype": st.one_of(JSON_VALUES, st.sampled_from(["float32", "uint8"])),
                                "slo_ms": JSON_VALUES,
                                "utility": JSON_VALUES, "task": JSON_VALUES, "top_k": JSON_VALUES},
    "/v1/embeddings": {"model": st.one_of(st.just("minilm"), JSON_VALUES),
                       "input": st.one_of(JSON_VALUES, NASTY_TEXTS, st.lists(st.integers(), max_size=5)),
                       "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), JSON_VALUES),
                       "dimensions": JSON_VALUES},
    "/v2/models/vit/infer": {"inputs": st.one_of(JSON_VALUES, st.lists(st.fixed_dictionaries(
        {"name": st.sampled_from(["images", "x"]), "shape": st.lists(st.integers(-2, 20), max_size=5),
         "datatype": st.sampled_from(["FP32", "UINT8", "BYTES", "x"]), "data": JSON_VALUES}), max_size=2)),
                             "outputs": JSON_VALUES},
}


def bodies(path: str):
    fields = FIELDS[path]
    structured = st.fixed_dictionaries({}, optional=fields).map(lambda body: json.dumps(body).encode())
    raw = st.one_of(st.binary(max_size=200), JSON_VALUES.map(lambda value: json.dumps(value).encode()),
                    st.sampled_from([body for _, body, _ in FOUR_BODIES]))
    return st.tuples(st.just(path), st.one_of(structured, structured, raw))


#: The keys of an error body by protocol: plexserve's own, OpenAI's, KServe's (a string under "error").
ERROR_KEYS = {"native": {"type", "message", "field"}, "openai": {"message", "type", "param", "code"},
              "kserve": {"<str>"}}


def error_keys(response: requests.Response) -> set[str]:
    body = response.json()
    assert set(body) == {"error"}, body
    return {"<str>"} if isinstance(body["error"], str) else set(body["error"])


def test_fuzzed_bodies_never_get_5xx_and_leave_the_replicas_answering(app):
    before = replica_actors()
    expected = embed(app, TEXTS)

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=st.one_of(*(bodies(path) for path in FIELDS)))
    @example(request=("/v1/models/minilm/embed", json.dumps({"texts": [ONE_MB_TEXT]}).encode()))
    @example(request=("/v1/embeddings", json.dumps({"model": "minilm", "input": ONE_MB_TEXT}).encode()))
    @example(request=("/v1/models/minilm/embed", json.dumps({"texts": ["\u200b", "\u202eabc", "a\udfffb"]}).encode()))
    def fuzz(request):
        path, body = request
        response = post(app, path, data=body, headers={"Content-Type": "application/json"})
        assert response.status_code < 500, (path, body[:300], response.text[:300])
        if response.status_code >= 400:
            assert error_keys(response) == ERROR_KEYS[protocol_of(path, "POST")], path

    fuzz()
    assert replica_actors() == before  # no replica died and was replaced
    assert np.allclose(embed(app, TEXTS), expected, atol=1e-5)
    assert len(classify(app, images())) == 2


def test_openai_client_gets_the_native_vectors(app):
    import openai

    client = openai.OpenAI(base_url=f"{app['url']}/v1", api_key="not-checked", max_retries=0)
    native = embed(app, TEXTS)
    default = client.embeddings.create(model="minilm", input=TEXTS, user="someone")  # the client asks for base64
    floats = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    for answer in (default, floats):
        assert [d.index for d in answer.data] == [0, 1] and answer.model == "minilm"
        assert np.allclose([d.embedding for d in answer.data], native, atol=1e-6)
    tokenizer = load_text_tokenizer("package:all-minilm-l6-v2")
    token_ids = tokenizer.encode(TEXTS)
    assert default.usage.prompt_tokens == default.usage.total_tokens == sum(len(ids) for ids in token_ids)
    single = client.embeddings.create(model="minilm", input=TEXTS[0])
    assert np.allclose(single.data[0].embedding, native[0], atol=1e-6)
    by_ids = client.embeddings.create(model="minilm", input=token_ids, encoding_format="float")
    assert np.allclose([d.embedding for d in by_ids.data], native, atol=1e-5)
    assert {"minilm", "vit"} <= {model.id for model in client.models.list()}
    assert client.embeddings.create(model="minilm", input="hi", dimensions=384).data[0].embedding
    with pytest.raises(openai.BadRequestError, match="dimensions") as wrong_width:
        client.embeddings.create(model="minilm", input="hi", dimensions=8)
    assert wrong_width.value.body["param"] == "dimensions"  # the client unwraps {"error": ...}
    for empty in ("", []):
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model="minilm", input=empty)
        assert refused.value.body["type"] == "invalid_request_error" and refused.value.body["param"].startswith("input")
    with pytest.raises(openai.NotFoundError) as absent:
        client.embeddings.create(model="absent", input="hi")
    assert absent.value.body["code"] == "model_not_found"
    assert client.models.retrieve("minilm").id == "minilm" and client.models.retrieve("vit").object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("absent")
    with pytest.raises(openai.BadRequestError) as too_long:
        client.embeddings.create(model="minilm", input=[[101] + [1000] * 300 + [102]])
    error = too_long.value.body
    assert error["param"] == "input[0]" and error["code"] == "input_too_long" and set(error) == {
        "message", "type", "param", "code"}


def test_tritonclient_sees_the_server_and_infers_like_classify(app):
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url=app["url"].removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("vit")
    metadata = client.get_model_metadata("vit")
    assert (metadata["inputs"][0]["shape"] == [-1, 3, 16, 16]
            and {o["name"] for o in metadata["outputs"]} == {"probabilities", "label"})
    batch = images(3, seed=1)
    expected = classify(app, batch)
    for binary in (True, False):
        tensor = triton.InferInput("images", list(batch.shape), "FP32")
        tensor.set_data_from_numpy(batch, binary_data=binary)
        outputs = (None if binary
                   else [triton.InferRequestedOutput(name, binary_data=False) for name in ("label", "probabilities")])
        result = client.infer("vit", [tensor], outputs=outputs)
        assert result.as_numpy("label").tolist() == [p["label"] for p in expected]
        assert np.allclose(result.as_numpy("probabilities"), [p["probabilities"] for p in expected], atol=1e-6)
    pixels = np.random.default_rng(5).integers(0, 256, size=(2, 20, 20, 3), dtype=np.uint8)  # raw, channels last
    tensor = triton.InferInput("images", list(pixels.shape), "UINT8")
    tensor.set_data_from_numpy(pixels)
    as_pixels = post(app, "/v1/models/vit/classify",
                     json={"images": pixels.tolist(), "dtype": "uint8"}).json()["predictions"]
    assert client.infer("vit", [tensor]).as_numpy("label").tolist() == [p["label"] for p in as_pixels]
    texts = triton.InferInput("texts", [len(TEXTS)], "BYTES")
    texts.set_data_from_numpy(np.asarray(TEXTS, dtype=object))
    assert np.allclose(client.infer("minilm", [texts]).as_numpy("embeddings"), embed(app, TEXTS), atol=1e-6)
    with pytest.raises(triton.InferenceServerException, match="absent"):
        client.get_model_metadata("absent")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    assert client.is_model_ready("vit", model_version="1") and not session_ok(app, "/v2/models/vit/versions/2/ready")
    assert client.infer("vit", [tensor], model_version="1").as_numpy("label").tolist() == [p["label"] for p in
                                                                                         as_pixels]
    with pytest.raises(triton.InferenceServerException, match="version"):
        client.infer("vit", [tensor], model_version="2")
    with pytest.raises(triton.InferenceServerException, match="absent"):
        client.infer("absent", [texts])
    raw = b"".join(len(t.encode()).to_bytes(4, "little") + t.encode() for t in TEXTS)
    for sent, declared, shape in [(raw[:-2], len(raw), [2]), (raw + b"x", len(raw), [2]),
                                  (raw[:-2], len(raw) - 2, [2])]:
        header = json.dumps({"inputs": [{"name": "texts", "shape": shape, "datatype": "BYTES",
                                         "parameters": {"binary_data_size": declared}}]}).encode()
        refused = post(app, "/v2/models/minilm/infer", data=header + sent,
                       headers={"Inference-Header-Content-Length": str(len(header))})
        assert refused.status_code == 400 and "texts" in refused.json()["error"], refused.text
    assert np.allclose(client.infer("minilm", [texts]).as_numpy("embeddings"), embed(app, TEXTS), atol=1e-6)


def session_ok(app, path: str) -> bool:
    response = app["session"].get(f"{app['url']}{path}", timeout=60)
    assert response.status_code in (200, 404, 503) and ("error" in response.json()) == (response.status_code == 404)
    return response.status_code == 200


def png_base64(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_image_files_label_names_top_k_and_arrays_through_the_handle(app):
    pixels = np.random.default_rng(2).integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
    nested = (pixels.transpose(2, 0, 1)[None].astype(np.float32) / 255.0 - 0.5) / 0.5  # timm's config: mean = std = 0.5
    (as_list,) = classify(app, nested)
    response = post(app, "/v1/models/vit/classify", json={"images_base64": [png_base64(pixels)], "top_k": 2})
    assert response.status_code == 200, response.text
    (as_png,) = response.json()["predictions"]
    assert (as_png["label"] == as_list["label"]
            and np.allclose(as_png["probabilities"], as_list["probabilities"], atol=1e-5))
    as_pixels = post(app, "/v1/models/vit/classify", json={"images": pixels[None].tolist(), "dtype": "uint8"})
    assert np.allclose(as_pixels.json()["predictions"][0]["probabilities"], as_png["probabilities"], atol=1e-6)
    assert (as_png["label_name"] == LABELS[as_png["label"]] and as_png["top_k"][0]["label"] == as_png["label"]
            and len(as_png["top_k"]) == 2)
    jpeg = io.BytesIO()
    Image.fromarray(np.full((224, 224, 3), 128, dtype=np.uint8)).save(jpeg, format="JPEG", quality=90)
    body = json.dumps({"images_base64": [base64.b64encode(jpeg.getvalue()).decode()]}).encode()
    assert len(body) <= 100 * 1024
    assert post(app, "/v1/models/vit/classify", data=body).status_code == 200
    batch = images(2, seed=3)
    labels = [p["label"] for p in classify(app, batch)]
    for array in (batch, torch.from_numpy(batch)):
        answer = app["handle"].classify.remote("vit", array).result(timeout_s=60)
        assert [p["label"] for p in answer["predictions"]] == labels
