"""The HTTP edge without Ray: error shapes, four malformed bodies as 4xx (not 5xx), body limits, schemas, images."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from PIL import Image

from placement.core.deployment_spec import ModelSpec
from rayserve_apps.edge.answer import answer
from rayserve_apps.edge.errors import input_errors, install_error_handlers
from rayserve_apps.edge.images import ImageDecoder, load_label_names, with_label_names
from rayserve_apps.edge.kserve import InferInput, input_array, split_body
from rayserve_apps.edge.openai_api import EmbeddingsRequest
from rayserve_apps.edge.schemas import ClassifyRequest, EmbedRequest, validate_body
from rayserve_apps.requests import (
    ImageContract,
    RequestError,
    check_images,
    check_query_options,
    check_texts,
    parse_json_body,
)

#: The issue's four bodies, each once a 503 "retry" with a stack trace.
DEEP_JSON = b'{"texts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
SURROGATE_JSON = b'{"texts": ["\\ud800"]}'
UNHASHABLE_DTYPE = {"images": np.zeros((1, 3, 4, 4)).tolist(), "dtype": ["float32"]}
HUGE_INTEGER_JSON = b'{"images": [[[[0]]]], "slo_ms": 1' + b"0" * 400 + b"}"
CONTRACT = ImageContract(3, 4, 4)


def raised(call, *args, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as info:
        call(*args, **kwargs)
    assert 400 <= info.value.status_code < 500
    return info.value


def test_the_four_bodies_are_client_errors_on_every_path():
    assert raised(parse_json_body, DEEP_JSON, len(DEEP_JSON)).error_type == "too_deeply_nested"
    texts = parse_json_body(SURROGATE_JSON, 1024)
    assert raised(check_texts, texts, 8).field == "texts[0]"
    assert raised(validate_body, EmbedRequest, texts).field == "texts[0]"
    assert raised(check_images, UNHASHABLE_DTYPE, CONTRACT, 8).field == "dtype"
    assert raised(validate_body, ClassifyRequest, UNHASHABLE_DTYPE).field == "dtype"
    huge = parse_json_body(HUGE_INTEGER_JSON, len(HUGE_INTEGER_JSON))
    assert raised(check_query_options, huge).field == "slo_ms"
    assert raised(validate_body, ClassifyRequest, huge).field == "slo_ms"


def test_an_integer_longer_than_python_converts_is_malformed_json():
    body = b'{"slo_ms": ' + b"9" * 5000 + b"}"
    assert raised(parse_json_body, body, len(body)).error_type == "malformed_json"


@pytest.mark.parametrize("exception, status, error_type", [
    (RecursionError(), 400, "too_deeply_nested"), (OverflowError("x"), 422, "invalid_value"),
    (TypeError("unhashable type: 'list'"), 422, "invalid_input"),
    (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogate"), 422, "invalid_text"),
    (RequestError(413, "too_many_items", "m", "texts"), 413, "too_many_items"),
])
def test_any_exception_while_validating_is_a_4xx(exception, status, error_type):
    with pytest.raises(RequestError) as info, input_errors("images"):
        raise exception
    assert (info.value.status_code, info.value.error_type) == (status, error_type)


def test_images_through_a_handle_may_be_numpy_or_torch():
    array = np.random.default_rng(0).normal(size=(2, 3, 4, 4)).astype(np.float32)
    for images in (array, torch.from_numpy(array)):
        assert np.array_equal(check_images({"images": images}, CONTRACT, 8), array)
    assert raised(check_images, {"images": np.float32(1.0)}, CONTRACT, 8).error_type == "invalid_shape"


def test_schemas_refuse_unknown_fields_and_name_the_field():
    assert raised(validate_body, EmbedRequest, {"texts": ["a"], "extra": 1}).field == "extra"
    assert raised(validate_body, EmbedRequest, {"texts": [1]}).field == "texts[0]"
    assert raised(validate_body, ClassifyRequest, {"dtype": "uint8"}).error_type == "invalid_field"
    assert raised(validate_body, ClassifyRequest, {"images": [[1]], "top_k": 0}).field == "top_k"
    assert validate_body(EmbeddingsRequest, {"model": "m", "input": "hi"}).input == "hi"
    assert validate_body(EmbeddingsRequest, {"model": "m", "input": [[101, 102]]}).input == [[101, 102]]
    assert (raised(validate_body, EmbeddingsRequest, {"model": "m", "input": "hi", "encoding_format": "int8"}).field
            == "encoding_format")


def edge_app(limit_bytes: int) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request):
        async def call(payload):
            return {"keys": sorted(payload)}

        return await answer(request, limit_bytes, call)

    @app.get("/items")
    def items(limit: int = 3):
        return {"limit": limit}

    return app


def test_fastapi_errors_and_body_limits_use_the_error_shape():
    client = TestClient(edge_app(limit_bytes=4096))
    for response, status, error_type in [
        (client.get("/nowhere"), 404, "not_found"), (client.get("/echo"), 405, "method_not_allowed"),
        (client.get("/items?limit=abc"), 422, "invalid_field"),
        (client.post("/echo", content=b"x" * 5000), 413, "request_too_large"),
        # chunked
        (client.post("/echo", content=iter([b"{" + b" " * 2600, b" " * 2600 + b"}"])), 413, "request_too_large"),
        (client.post("/echo", content=b"{\"texts\": [\"unterminated"), 400, "malformed_json"),
        (client.post("/echo", content=b"[" * 1000 + b"]" * 1000), 400, "too_deeply_nested"),
        (client.post("/echo", content=b"[1, 2]"), 400, "malformed_json"),
    ]:
        assert response.status_code == status, response.text
        assert (set(response.json()["error"]) == {"type", "message", "field"}
                and response.json()["error"]["type"] == error_type)
    assert client.get("/items?limit=abc").json()["error"]["field"] == "limit"
    assert client.post("/echo", content=iter([b'{"a": 1', b"}"])).json() == {"keys": ["a"]}


#: A small vision model whose timm architecture has a pretrained config (mean 0.5, std 0.5).
VISION = dict(name="vit", kind="vision", source="timm:vit_tiny_patch16_224", num_classes=4, image_size_px=16)


def encoded(image: Image.Image, fmt: str, **kwargs) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return base64.b64encode(buffer.getvalue()).decode()


def test_a_png_at_the_model_size_is_its_nested_list_form():
    pixels = np.random.default_rng(0).integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
    decoded = ImageDecoder(ModelSpec(**VISION)).decode([encoded(Image.fromarray(pixels), "PNG")])
    expected = (pixels.transpose(2, 0, 1).astype(np.float32) / 255.0 - 0.5) / 0.5
    assert decoded.shape == (1, 3, 16, 16) and np.allclose(decoded[0], expected, atol=1e-6)


def test_a_224px_jpeg_fits_100kb_and_is_resized_for_the_model():
    side = 224
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    pixels = np.stack([np.add.outer(ramp, ramp) / 2, np.tile(ramp, (side, 1)), np.tile(ramp[:, None], (1, side))],
                      axis=-1)
    body = json.dumps({"images_base64": [encoded(Image.fromarray(pixels.astype(np.uint8)), "JPEG",
                                                 quality=90)]}).encode()
    assert len(body) <= 100 * 1024
    decoded = ImageDecoder(ModelSpec(**VISION)).decode(json.loads(body)["images_base64"])
    assert decoded.shape == (1, 3, 16, 16) and np.isfinite(decoded).all()
    gray = ImageDecoder(ModelSpec(**{**VISION, "in_chans": 1})).decode(json.loads(body)["images_base64"])
    assert gray.shape == (1, 1, 16, 16)


@pytest.mark.parametrize("item, error_type",
                         [("not base64!", "invalid_image"), (base64.b64encode(b"GIF89a....").decode(), "invalid_image"),
                          (encoded(Image.new("RGB", (4, 4)), "GIF"), "invalid_image")])
def test_bad_image_files_are_refused_by_index(item, error_type):
    error = raised(ImageDecoder(ModelSpec(**VISION)).decode, [item])
    assert error.error_type == error_type and error.field == "images_base64[0]"


def test_label_names_from_the_checkpoint_directory_and_top_k(tmp_path):
    (tmp_path / "vit.pt").write_bytes(b"")
    (tmp_path / "labels.json").write_text(json.dumps(["cat", "dog", "fox", "owl"]))
    names = load_label_names(ModelSpec(**VISION, checkpoint_path=str(tmp_path / "vit.pt")))
    assert names == ["cat", "dog", "fox", "owl"] and load_label_names(ModelSpec(**VISION)) is None
    (answered,) = with_label_names([{"label": 2, "probabilities": [0.1, 0.3, 0.5, 0.1]}], names, top_k=2)
    assert answered["label_name"] == "fox" and [c["label_name"] for c in answered["top_k"]] == ["fox", "dog"]


def test_kserve_binary_and_json_inputs():
    array = np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
    header = json.dumps({"inputs": [{"name": "images", "shape": [2, 3, 4, 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": array.nbytes}}]}).encode()
    parsed, binary = split_body(header + array.tobytes(), str(len(header)))
    tensor = InferInput.model_validate(parsed["inputs"][0])
    assert np.array_equal(input_array(tensor, binary)[0], array)
    as_json = InferInput(name="images", shape=[2, 3, 4, 4], datatype="FP32", data=array.flatten().tolist())
    assert np.array_equal(input_array(as_json, b"")[0], array)
    short = InferInput(name="images", shape=[2, 3, 4, 4], datatype="FP32", parameters={"binary_data_size": 8})
    assert raised(input_array, short, array.tobytes()).error_type == "invalid_shape"
    assert raised(input_array, InferInput(name="x", shape=[1], datatype="FP32", data=[1]), b"").field == "inputs.x"


def test_slo_attainment_counts_refused_requests_over_a_window():
    from rayserve_apps.edge.attainment import SloAttainment

    now = [0.0]
    attainment = SloAttainment(window_s=10.0, clock=lambda: now[0])
    assert attainment.value("m") is None
    for met in (True, True, False, False):  # two answered in time, one refused, one late
        attainment.record("m", met)
    assert attainment.value("m") == 0.5
    now[0] = 11.0  # the first four aged out of the window
    assert attainment.record("m", True) == 1.0 and attainment.value("other") is None
    with pytest.raises(ValueError, match="window_s"):
        SloAttainment(window_s=0)


def test_raw_uint8_pixels_channels_first_or_last_equal_the_file():
    pixels = np.random.default_rng(4).integers(0, 256, size=(20, 24, 3), dtype=np.uint8)  # not the model's size
    decoder = ImageDecoder(ModelSpec(**VISION))
    from_file = decoder.decode([encoded(Image.fromarray(pixels), "PNG")])
    assert np.allclose(decoder.from_pixels(pixels[None]), from_file, atol=1e-6)
    assert np.allclose(decoder.from_pixels(pixels.transpose(2, 0, 1)[None]), from_file, atol=1e-6)
    assert raised(decoder.from_pixels, pixels[None, :, :, :2]).error_type == "invalid_shape"


def test_kserve_text_input_json_and_binary():
    from rayserve_apps.edge.kserve import text_input

    texts = ["héllo", "wörld"]
    raw = b"".join(len(t.encode()).to_bytes(4, "little") + t.encode() for t in texts)
    binary = InferInput(name="texts", shape=[2], datatype="BYTES", parameters={"binary_data_size": len(raw)})
    assert text_input(binary, raw) == texts
    assert text_input(InferInput(name="texts", shape=[2, 1], datatype="BYTES", data=texts), b"") == texts
    assert (raised(text_input, InferInput(name="texts", shape=[3], datatype="BYTES", data=texts), b"").error_type
            == "invalid_shape")
    assert (raised(text_input, InferInput(name="texts", shape=[1], datatype="BYTES", data=[7]), b"").error_type
            == "invalid_shape")


def test_a_lone_surrogate_quoted_back_in_an_error_still_encodes():
    from rayserve_apps.edge.errors import error_response

    response = error_response(RequestError(422, "invalid_field", "no field '\ud800'", field="\ud800"))
    assert response.status_code == 422 and json.loads(response.body)["error"]["field"] == "\\ud800"


class _FakeGroup:
    """A group replica's handle: `models_ready.remote()` answers its readiness, or never answers."""

    def __init__(self, ready: dict[str, bool] | None):
        self.ready = ready
        self.models_ready = self

    async def remote(self):
        if self.ready is None:
            await asyncio.sleep(3600)
        return self.ready


def test_a_grouped_model_is_ready_only_when_every_group_routed_to_it_answers(monkeypatch):
    from types import SimpleNamespace

    from rayserve_apps.edge import health

    monkeypatch.setattr(health, "READINESS_TIMEOUT_S", 0.05)

    def ingress(*groups):
        return SimpleNamespace(groups=SimpleNamespace(routes=[sorted(g or {"c"}) for g in groups]),
                               group_handles=[_FakeGroup(g) for g in groups])

    rebuilding = ingress({"a": True, "b": True}, {"b": False})  # b is being rebuilt in its second group
    assert asyncio.run(health._grouped_ready(rebuilding, {"a", "b"})) == {"a": True, "b": False}
    silent = ingress({"a": True}, None)  # the second group does not answer in time: what it hosts is not ready
    assert asyncio.run(health._grouped_ready(silent, {"a", "c"})) == {"a": True, "c": False}
    assert asyncio.run(health._grouped_ready(ingress({"a": True}), {"a", "moved"})) == {"a": True, "moved": False}
