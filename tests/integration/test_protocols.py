"""The edge's protocols to spec, without Ray: OpenAI's and KServe v2's error bodies and statuses, through the real
`openai` SDK and `tritonclient.http` against the edge's route functions on a stand-in ingress; `dimensions` refused
before any compute; KServe version routes, `extensions` and BYTES sizes; the ingress's admission bound answering
in each route's protocol."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import free_port
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from ray.serve.exceptions import BackPressureError

from placement.core.deployment_spec import parse_spec
from rayserve_apps.edge import kserve, native, openai_api
from rayserve_apps.edge.admission import Admission, AdmissionGate, serve_limits
from rayserve_apps.edge.answer import answer, guarded
from rayserve_apps.edge.errors import error_response, install_error_handlers, protocol_of
from rayserve_apps.requests import RequestError

WIDTH = 384
SPEC = {"models": [{"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2"}],
        "serving": {"max_request_bytes": 4096, "max_items_per_request": 4}}
OPENAI_KEYS = {"message", "type", "param", "code"}


class StandInIngress:
    """What the edge's route functions use of the ingress, with embeddings computed from the text's length and
    every model call counted."""

    def __init__(self) -> None:
        from models.text_encoder import load_text_tokenizer

        self.spec = parse_spec(SPEC)
        self.tokenizers = {"minilm": load_text_tokenizer("package:all-minilm-l6-v2")}
        self.text_limits = {"minilm": 128}
        self.text_widths = {"minilm": WIDTH}
        self.edge = native.Edge(self.spec)
        self.calls = 0
        self.fail_with: BaseException | None = None

    def _vectors(self, count: int) -> list[list[float]]:
        self.calls += 1
        if self.fail_with is not None:
            raise self.fail_with
        return [[float(i + 1)] * WIDTH for i in range(count)]

    async def embed(self, model: str, texts: list[str]) -> dict[str, Any]:
        return {"model": model, "embeddings": self._vectors(len(texts)), "ingress_latency_ms": 0.0}

    async def _call(self, spec, method: str, payload: Any, *args: Any, **kwargs: Any) -> Any:
        return self._vectors(len(payload))


def edge_app(ingress: StandInIngress, admission: Admission | None = None) -> FastAPI:
    """The ingress's HTTP routes over the edge's functions (as `ingress/deployment.py` wires them)."""
    app = FastAPI()
    install_error_handlers(app)
    if admission is not None:
        app.add_middleware(AdmissionGate, admission=admission)
    limit = ingress.spec.serving.max_request_bytes

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await answer(request, limit, lambda payload: openai_api.embeddings(ingress, payload), "openai")

    @app.get("/v1/models/{name}")
    async def model(name: str):
        async def work():
            return openai_api.model_object(ingress.spec, name)

        return await guarded(work(), "openai")

    @app.post("/v1/models/{name}/embed")
    async def embed(name: str, request: Request):
        return await answer(request, limit, lambda payload: native.embed(ingress, name, payload))

    @app.get("/v2")
    def server_metadata():
        return kserve.server_metadata()

    @app.get("/v2/health/live")
    def live():
        return {"live": True}

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def metadata(name: str, version: str | None = None):
        async def work():
            return kserve.model_metadata(ingress, name, version)

        return await guarded(work(), "kserve")

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str | None = None):
        return await guarded(kserve.infer(ingress, name, request, version), "kserve")

    return app


@pytest.fixture(scope="module")
def ingress() -> StandInIngress:
    return StandInIngress()


@pytest.fixture
def client(ingress) -> TestClient:
    ingress.calls, ingress.fail_with = 0, None
    return TestClient(edge_app(ingress))


def openai_client(client: TestClient):
    import openai

    return openai.OpenAI(base_url="http://testserver/v1", api_key="not-checked", max_retries=0, http_client=client)


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == OPENAI_KEYS, body
    return body["error"]


def kserve_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return body["error"]


# ---- OpenAI ----

def test_openai_sdk_raises_bad_request_and_not_found(client, ingress):
    import openai

    sdk = openai_client(client)
    answer = sdk.embeddings.create(model="minilm", input=["a", "b"], encoding_format="float", dimensions=WIDTH)
    assert [len(d.embedding) for d in answer.data] == [WIDTH, WIDTH] and ingress.calls == 1
    for bad in ({"dimensions": 8}, {"input": ""}, {"input": []}, {"input": ["ok", 7]}):
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.embeddings.create(**{"model": "minilm", "input": "hi", **bad})
        assert raised.value.status_code == 400 and raised.value.body["type"] == "invalid_request_error"
        assert raised.value.body["param"] is not None and raised.value.body["param"].split("[")[0] in bad, bad
    assert ingress.calls == 1  # none of the bad requests computed anything
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.embeddings.create(model="absent", input="hi")
    assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"
    assert sdk.models.retrieve("minilm").id == "minilm"
    assert client.get("/v1/models/minilm").json() == {"id": "minilm", "object": "model", "created": 0,
                                                      "owned_by": "plexserve"}
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.models.retrieve("absent")
    assert raised.value.body["code"] == "model_not_found"


def test_dimensions_is_refused_before_any_compute(client, ingress):
    for dimensions in (WIDTH - 1, WIDTH + 1, 1):
        error = openai_error(client.post("/v1/embeddings", json={"model": "minilm", "input": "x",
                                                                 "dimensions": dimensions}), 400)
        assert error["param"] == "dimensions" and str(WIDTH) in error["message"]
    # token arrays too: refused before the token ids are checked or sent
    error = openai_error(client.post("/v1/embeddings", json={"model": "minilm", "input": [[101, 102]],
                                                             "dimensions": 2}), 400)
    assert error["param"] == "dimensions" and ingress.calls == 0
    assert client.post("/v1/embeddings", json={"model": "minilm", "input": "x", "dimensions": WIDTH}).status_code == 200


def test_openai_statuses_and_bodies_for_every_kind_of_bad_input(client, ingress):
    for body, param in [(b"{not json", None), (b"[1, 2]", None), ({"model": "minilm"}, "input"),
                        ({"model": "minilm", "input": "x", "extra": 1}, "extra"),
                        ({"model": "minilm", "input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"model": "minilm", "input": ["a"] * 5}, "input"),  # past max_items_per_request: 400
                        ({"model": "minilm", "input": [[101] + [7] * 200 + [102]]}, "input[0]")]:  # too many tokens
        sent = client.post("/v1/embeddings", **({"content": body} if isinstance(body, bytes) else {"json": body}))
        error = openai_error(sent, 400)
        assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
    too_large = openai_error(client.post("/v1/embeddings", content=b"{" + b" " * 5000 + b"}"), 413)
    assert too_large["code"] == "request_too_large" and too_large["type"] == "invalid_request_error"
    assert openai_error(client.get("/v1/embeddings"), 405)["type"] == "invalid_request_error"
    assert ingress.calls == 0


def test_saturated_replicas_and_a_failed_replica_answer_503_in_the_routes_protocol(client, ingress):
    import openai

    ingress.fail_with = BackPressureError(num_queued_requests=8, max_queued_requests=8, retry_after_s=2)
    shed = client.post("/v1/embeddings", json={"model": "minilm", "input": "x"})
    error = openai_error(shed, 503)
    assert error["type"] == "server_error" and error["code"] == "overloaded" and shed.headers["retry-after"] == "2"
    with pytest.raises(openai.InternalServerError):
        openai_client(client).embeddings.create(model="minilm", input="x")
    texts = {"inputs": [{"name": "texts", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
    shed = client.post("/v2/models/minilm/infer", json=texts)
    assert "saturated" in kserve_error(shed, 503) and shed.headers["retry-after"] == "2"
    shed = client.post("/v1/models/minilm/embed", json={"texts": ["x"]})
    assert shed.status_code == 503 and shed.json()["error"]["type"] == "overloaded"
    ingress.fail_with = RuntimeError("replica died")
    failed = client.post("/v1/embeddings", json={"model": "minilm", "input": "x"})
    assert openai_error(failed, 503)["code"] == "replica_failure" and failed.headers["retry-after"] == "1"
    ingress.fail_with = None
    assert client.post("/v1/embeddings", json={"model": "minilm", "input": "x"}).status_code == 200


# ---- KServe v2 ----

def binary_texts(texts: list[bytes]) -> bytes:
    return b"".join(len(text).to_bytes(4, "little") + text for text in texts)


def infer_binary(client: TestClient, raw: bytes, declared: int, shape: list[int], path="/v2/models/minilm/infer"):
    header = json.dumps({"inputs": [{"name": "texts", "shape": shape, "datatype": "BYTES",
                                     "parameters": {"binary_data_size": declared}}]}).encode()
    return client.post(path, content=header + raw, headers={kserve.HEADER_LENGTH: str(len(header))})


def test_kserve_bytes_sizes_are_checked_against_the_body(client, ingress):
    raw = binary_texts([b"alpha", b"beta"])
    ok = infer_binary(client, raw, len(raw), [2])
    assert ok.status_code == 200 and ok.json()["outputs"][0]["shape"] == [2, WIDTH]
    calls = ingress.calls
    for sent, needle in [(infer_binary(client, raw[:-3], len(raw), [2]), "binary_data_size"),  # body shorter
                         (infer_binary(client, raw + b"xx", len(raw), [2]), "binary_data_size"),  # body longer
                         (infer_binary(client, raw[:-3], len(raw) - 3, [2]), "past"),  # element runs past the end
                         (infer_binary(client, raw + b"\x01\x00", len(raw) + 2, [3]), "length prefix"),  # torn prefix
                         (infer_binary(client, raw, len(raw), [3]), "3 strings")]:  # fewer elements than the shape
        assert "texts" in kserve_error(sent, 400) and needle in sent.json()["error"], sent.json()
    header = json.dumps({"inputs": [{"name": "texts", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}).encode()
    trailing = client.post("/v2/models/minilm/infer", content=header + b"junk",
                           headers={kserve.HEADER_LENGTH: str(len(header))})
    assert "texts" in kserve_error(trailing, 400)
    assert ingress.calls == calls


def test_kserve_errors_are_strings_with_the_specs_statuses_and_versions_route(client):
    assert kserve.MODEL_VERSION == "1"
    assert client.get("/v2/models/minilm/versions/1").json()["versions"] == ["1"]
    assert "version" in kserve_error(client.get("/v2/models/minilm/versions/2"), 404)
    assert "absent" in kserve_error(client.get("/v2/models/absent"), 404)
    texts = {"inputs": [{"name": "texts", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
    assert client.post("/v2/models/minilm/versions/1/infer", json=texts).json()["model_version"] == "1"
    kserve_error(client.post("/v2/models/minilm/versions/7/infer", json=texts), 404)
    kserve_error(client.post("/v2/models/absent/infer", json=texts), 404)
    kserve_error(client.post("/v2/models/minilm/infer", content=b"{oops"), 400)
    kserve_error(client.post("/v2/models/minilm/infer", json={"inputs": []}), 400)
    kserve_error(client.post("/v2/models/minilm/infer", json={"inputs": [{**texts["inputs"][0], "datatype": "FP32"}]}),
                 400)
    kserve_error(client.post("/v2/models/minilm/infer", content=b"{" + b" " * 5000 + b"}"), 413)
    kserve_error(client.get("/v2/nowhere"), 404)
    kserve_error(client.get("/v2/models/minilm/infer"), 405)
    assert "binary_tensor_data" in client.get("/v2").json()["extensions"]


@pytest.fixture(scope="module")
def served(ingress):
    """The stand-in app on a loopback port (tritonclient speaks HTTP itself)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(edge_app(ingress), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_tritonclient_lists_the_binary_extension_and_raises_on_bad_infers(served, ingress):
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url=served)
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    assert client.get_model_metadata("minilm", model_version="1")["versions"] == ["1"]
    texts = triton.InferInput("texts", [2], "BYTES")
    texts.set_data_from_numpy(np.asarray(["a", "b"], dtype=object))
    assert client.infer("minilm", [texts], model_version="1").as_numpy("embeddings").shape == (2, WIDTH)
    with pytest.raises(triton.InferenceServerException, match="absent"):
        client.infer("absent", [texts])
    with pytest.raises(triton.InferenceServerException, match="version"):
        client.infer("minilm", [texts], model_version="2")
    with pytest.raises(triton.InferenceServerException, match="absent"):
        client.get_model_metadata("absent")
    for binary in (True, False):
        numbers = triton.InferInput("texts", [2], "FP32")  # text models take BYTES
        numbers.set_data_from_numpy(np.zeros(2, dtype=np.float32), binary_data=binary)
        with pytest.raises(triton.InferenceServerException, match="BYTES"):
            client.infer("minilm", [numbers])
    assert client.is_server_live()


# ---- errors of FastAPI's own and the path -> protocol rule ----

def test_each_path_answers_in_its_protocols_shape(client):
    assert protocol_of("/v1/embeddings", "POST") == "openai" and protocol_of("/v1/models/m", "GET") == "openai"
    assert protocol_of("/v1/models/m/embed", "POST") == "native" and protocol_of("/v1/models", "GET") == "native"
    assert protocol_of("/v2/models/m/infer", "POST") == "kserve" and protocol_of("/healthz") == "native"
    native_error = client.get("/nowhere").json()["error"]
    assert client.get("/nowhere").status_code == 404 and set(native_error) == {"type", "message", "field"}
    unprocessable = client.post("/v1/models/minilm/embed", json={"texts": 3})
    assert unprocessable.status_code == 422 and unprocessable.json()["error"]["field"] == "texts"
    bad = error_response(RequestError(422, "invalid_field", "texts[3]: empty", field="texts[3]"), protocol="kserve")
    assert bad.status_code == 400 and json.loads(bad.body) == {"error": "texts[3]: empty"}
    named = error_response(RequestError(422, "invalid_field", "empty", field="texts[3]"), protocol="kserve")
    assert json.loads(named.body) == {"error": "texts[3]: empty"}


# ---- the ingress's admission bound ----

def test_admission_asks_serve_for_a_bound_it_never_reaches():
    assert serve_limits(56, -1) == {"max_ongoing_requests": 56, "max_queued_requests": -1}
    limits = serve_limits(56, 16)
    assert limits["max_queued_requests"] == -1 and limits["max_ongoing_requests"] > 56 + 16
    with pytest.raises(ValueError, match="running"):
        Admission().configure(0, 1, 1.0)


def test_past_the_bound_the_ingress_refuses_in_each_routes_protocol_and_serves_the_rest(ingress):
    running, waiting = 2, 1
    admission = Admission()
    admission.configure(running, waiting, retry_after_s=1.5)
    app = edge_app(ingress, admission)
    release, inside, most_inside = asyncio.Event(), [0], [0]

    @app.post("/hold")
    async def hold():
        inside[0] += 1
        most_inside[0] = max(most_inside[0], inside[0])
        await release.wait()
        inside[0] -= 1
        return {"held": True}

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            held = [asyncio.create_task(http.post("/hold")) for _ in range(running + waiting)]
            while admission.in_flight < running + waiting:
                await asyncio.sleep(0.01)
            refused = {
                "openai": await http.post("/v1/embeddings", json={"model": "minilm", "input": "x"}),
                "kserve": await http.post("/v2/models/minilm/infer", json={}),
                "native": await http.post("/v1/models/minilm/embed", json={"texts": ["x"]}),
            }
            release.set()
            answers = await asyncio.gather(*held)
            after = await http.post("/v1/embeddings", json={"model": "minilm", "input": "x"})
            return refused, answers, after

    calls = ingress.calls
    refused, answers, after = asyncio.run(scenario())
    assert all(response.headers["retry-after"] == "2" for response in refused.values())
    assert openai_error(refused["openai"], 503)["type"] == "server_error"
    assert "bound" in kserve_error(refused["kserve"], 503)
    assert refused["native"].status_code == 503 and refused["native"].json()["error"]["type"] == "overloaded"
    assert [response.status_code for response in answers] == [200] * (running + waiting)
    assert most_inside[0] == running and admission.in_flight == 0
    assert after.status_code == 200 and ingress.calls == calls + 1
