"""The KServe / Triton v2 inference protocol over plexserve's models ("Open Inference Protocol", REST).

- `GET /v2` (its `extensions` list `binary_tensor_data`), `/v2/health/live`, `/v2/health/ready` (503 unless every
  model is ready, see `health.py`);
- `GET /v2/models/{name}` metadata and `/v2/models/{name}/ready`, and the same under
  `/v2/models/{name}/versions/{version}` (every model is served at version `MODEL_VERSION`; another version is 404);
- `POST /v2/models/{name}[/versions/{version}]/infer`: for a text model one BYTES input `texts` [N] -> `embeddings` FP32
  [N, width]; for a vision model one input `images`, FP32 [N, C, H, W] in the model's input normalisation, or UINT8 raw
  pixels [N, C, H, W] or [N, H, W, C] of any size (resized and normalised like an image file, as `dtype: uint8` on
  classify), as JSON `data` or as binary data after the JSON header (`Inference-Header-Content-Length`); outputs
  `probabilities` FP32 [N, classes] and `label` INT64 [N], as JSON or binary (`binary_data_output`, or per output
  `binary_data`). What `tritonclient.http` sends and reads.

Errors are the protocol's `{"error": "<message>"}` (`edge/errors.py`): 400 for any bad input (the message names the
input, e.g. a binary body shorter or longer than the input's `binary_data_size`, or a BYTES element's length prefix
running past its end), 404 for an unknown model or version, 413 for a body past `serving.max_request_bytes`, 503
with `Retry-After` when overloaded.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from placement.core.deployment_spec import ModelSpec
from rayserve_apps.edge.body_limit import read_body
from rayserve_apps.edge.errors import input_errors
from rayserve_apps.edge.health import models_ready
from rayserve_apps.edge.native import checked_images, embed_texts, from_pixels
from rayserve_apps.edge.schemas import Text, validate_body
from rayserve_apps.requests import RequestError, find_model, parse_json_body

if TYPE_CHECKING:
    from rayserve_apps.ingress.deployment import Ingress

#: Header giving the length of the JSON part of a request or response that carries binary tensors.
HEADER_LENGTH = "Inference-Header-Content-Length"
#: The one version every model is served at.
MODEL_VERSION = "1"
#: KServe datatypes accepted for vision input, with their numpy type and the `dtype` of plexserve's classify.
INPUT_DATATYPES = {"FP32": (np.float32, "float32"), "UINT8": (np.uint8, "uint8")}
#: Name of the one vision input and of the outputs.
IMAGES_INPUT = "images"
PROBABILITIES_OUTPUT = "probabilities"
LABEL_OUTPUT = "label"
TEXTS_INPUT = "texts"
EMBEDDINGS_OUTPUT = "embeddings"
OUTPUT_DATATYPES = {PROBABILITIES_OUTPUT: "FP32", LABEL_OUTPUT: "INT64", EMBEDDINGS_OUTPUT: "FP32"}
#: Bytes of the length before each element of a binary BYTES tensor.
BYTES_LENGTH_PREFIX = 4
#: Largest tensor rank accepted (an image batch is rank 4).
MAX_RANK = 8
#: Protocol extensions the server supports, as its metadata lists them (the binary tensor data extension's name).
EXTENSIONS = ["binary_tensor_data"]


class KServeErrorResponse(BaseModel):
    """Every 4xx and 5xx answer of the v2 routes."""

    error: StrictStr = Field(description="What is wrong, naming the input, model or limit.")


#: Responses the v2 routes document besides their 200.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": KServeErrorResponse, "description": description} for status, description in (
        (400, "Bad input"), (404, "Unknown model or version"), (413, "Body past the byte limit"),
        (503, "Overloaded or not hosted right now; retry"))
}


class InferParameters(BaseModel):
    model_config = ConfigDict(extra="allow")

    binary_data_size: StrictInt | None = Field(default=None, ge=0)
    binary_data: StrictBool | None = None
    binary_data_output: StrictBool | None = None


class InferInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Text
    shape: list[StrictInt] = Field(max_length=MAX_RANK)
    datatype: Text
    data: list[Any] | None = None
    parameters: InferParameters = Field(default_factory=InferParameters)


class InferOutputRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Text
    parameters: InferParameters = Field(default_factory=InferParameters)


class InferRequest(BaseModel):
    """A KServe v2 inference request."""

    model_config = ConfigDict(extra="forbid")

    id: Text | None = None
    inputs: list[InferInput] = Field(min_length=1)
    outputs: list[InferOutputRequest] | None = None
    parameters: InferParameters = Field(default_factory=InferParameters)


def server_metadata() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        server_version = version("plexserve")
    except PackageNotFoundError:  # pragma: no cover - run from a checkout without installing
        server_version = "0"
    return {"name": "plexserve", "version": server_version, "extensions": list(EXTENSIONS)}


def served_model(ingress: "Ingress", name: str, version: str | None = None) -> ModelSpec:
    """The served model `name` of either kind, at `version` when one is named; 404 naming the served models when
    unknown, and naming the served version for another version."""
    kind = next((m.kind for m in ingress.spec.models if m.name == name), "vision")
    model = find_model(ingress.spec, name, kind)
    if version is not None and version != MODEL_VERSION:
        raise RequestError(404, "unknown_version",
                           f"model {name!r} has no version {version[:40]!r}; it is served at version {MODEL_VERSION}",
                           field="version")
    return model


def model_metadata(ingress: "Ingress", name: str, version: str | None = None) -> dict[str, Any]:
    model = served_model(ingress, name, version)
    if model.kind == "vision":
        side = model.image_size_px or 224
        inputs = [{"name": IMAGES_INPUT, "datatype": "FP32", "shape": [-1, model.in_chans, side, side]}]
        outputs = [{"name": PROBABILITIES_OUTPUT, "datatype": "FP32", "shape": [-1, model.num_classes or -1]},
                   {"name": LABEL_OUTPUT, "datatype": "INT64", "shape": [-1]}]
    else:
        inputs = [{"name": TEXTS_INPUT, "datatype": "BYTES", "shape": [-1]}]
        outputs = [{"name": EMBEDDINGS_OUTPUT, "datatype": "FP32", "shape": [-1, -1]}]
    return {"name": name, "versions": [MODEL_VERSION], "platform": f"plexserve_{model.kind}", "inputs": inputs,
            "outputs": outputs}


async def server_ready(ingress: "Ingress") -> tuple[bool, dict[str, bool]]:
    ready = await models_ready(ingress)
    return all(ready.values()), ready


async def model_ready(ingress: "Ingress", name: str, version: str | None = None) -> bool:
    served_model(ingress, name, version)
    return (await models_ready(ingress, [name]))[name]


def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """The JSON header of an inference request and the binary tensor data after it."""
    if header_length is None:
        return parse_json_body(body, len(body)), b""
    if not header_length.strip().isdigit() or int(header_length) > len(body):
        raise RequestError(400, "bad_request",
                           f"{HEADER_LENGTH} {header_length[:40]!r} is not a length within the body")
    split = int(header_length)
    return parse_json_body(body[:split], split), body[split:]


def input_array(tensor: InferInput, binary: bytes) -> tuple[np.ndarray, str]:
    """The (one) input tensor as a numpy array and the classify dtype it stands for."""
    field = f"inputs.{tensor.name}"
    if tensor.name != IMAGES_INPUT:
        raise RequestError(422, "invalid_field",
                           f"unknown input {tensor.name!r}; vision models take one input {IMAGES_INPUT!r}", field=field)
    if tensor.datatype not in INPUT_DATATYPES:
        raise RequestError(422, "invalid_dtype",
                           f"datatype {tensor.datatype!r} is not supported; use one of {sorted(INPUT_DATATYPES)}",
                           field=field)
    numpy_type, dtype = INPUT_DATATYPES[tensor.datatype]
    if any(size < 0 for size in tensor.shape):
        raise RequestError(422, "invalid_shape", f"shape {tensor.shape} has a negative size", field=field)
    count = math.prod(tensor.shape)
    size = tensor.parameters.binary_data_size
    if size is not None:
        if size != count * np.dtype(numpy_type).itemsize:
            raise RequestError(400, "invalid_shape",
                               f"input {tensor.name!r}: binary_data_size {size} bytes does not hold shape "
                               f"{tensor.shape} of {tensor.datatype} ({count * np.dtype(numpy_type).itemsize} bytes)",
                               field=field)
        check_binary_size(tensor, binary)
        return np.frombuffer(binary, dtype=numpy_type, count=count).reshape(tensor.shape), dtype
    if tensor.data is None:
        raise RequestError(422, "invalid_field", "an input needs 'data' or parameters.binary_data_size", field=field)
    with input_errors(field):
        values = np.asarray(tensor.data)
        if values.dtype == object or values.dtype.kind not in "iuf" or values.size != count:
            raise RequestError(422, "invalid_shape", f"'data' must hold {count} numbers for shape {tensor.shape}",
                               field=field)
        if dtype == "uint8" and (values.dtype.kind == "f" or values.min() < 0 or values.max() > np.iinfo(np.uint8).max):
            raise RequestError(422, "invalid_dtype", "UINT8 data must be integers in [0, 255]", field=field)
        return values.reshape(tensor.shape).astype(numpy_type), dtype


def output_tensors(predictions: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    return {PROBABILITIES_OUTPUT: np.asarray([p["probabilities"] for p in predictions], dtype=np.float32),
            LABEL_OUTPUT: np.asarray([p["label"] for p in predictions], dtype=np.int64)}


def infer_response(name: str, request: InferRequest, tensors: dict[str, np.ndarray]) -> Response:
    """JSON outputs, or the JSON header followed by the binary outputs when asked for."""
    wanted = request.outputs if request.outputs is not None else [InferOutputRequest(name=n) for n in tensors]
    unknown = [o.name for o in wanted if o.name not in tensors]
    if unknown:
        raise RequestError(422, "invalid_field", f"unknown output(s) {unknown}; outputs are {sorted(tensors)}",
                           field="outputs")
    binary_default = bool(request.parameters.binary_data_output)
    outputs, chunks = [], []
    for output in wanted:
        array = tensors[output.name]
        entry: dict[str, Any] = {"name": output.name, "datatype": OUTPUT_DATATYPES[output.name],
                                 "shape": list(array.shape)}
        binary = output.parameters.binary_data if output.parameters.binary_data is not None else binary_default
        if binary:
            raw = np.ascontiguousarray(array).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = array.flatten().tolist()
        outputs.append(entry)
    header: dict[str, Any] = {"model_name": name, "model_version": MODEL_VERSION, "outputs": outputs}
    if request.id is not None:
        header["id"] = request.id
    if not chunks:
        return JSONResponse(header)
    encoded = JSONResponse(header).body
    return Response(encoded + b"".join(chunks), media_type="application/octet-stream",
                    headers={HEADER_LENGTH: str(len(encoded))})


def check_binary_size(tensor: InferInput, binary: bytes) -> None:
    """The binary part of the body must be exactly the input's `binary_data_size` bytes (plexserve's models take
    one input): 400 naming the input when it is shorter or longer."""
    size = tensor.parameters.binary_data_size
    if size is not None and size != len(binary):
        raise RequestError(400, "invalid_binary_size",
                           f"input {tensor.name!r} declares binary_data_size {size} bytes but the body holds "
                           f"{len(binary)} bytes after its JSON header", field=f"inputs.{tensor.name}")


def bytes_elements(name: str, raw: bytes) -> list[bytes]:
    """The elements of a binary BYTES tensor (each a 4-byte little-endian length, then that many bytes); 400 naming
    the input when a length prefix, or the length it gives, runs past the tensor's end."""
    elements, offset = [], 0
    while offset < len(raw):
        if offset + BYTES_LENGTH_PREFIX > len(raw):
            raise RequestError(400, "invalid_binary_size",
                               f"input {name!r}: element {len(elements)}'s length prefix at byte {offset} runs past "
                               f"the tensor's {len(raw)} bytes", field=f"inputs.{name}")
        length = int.from_bytes(raw[offset : offset + BYTES_LENGTH_PREFIX], "little")
        start = offset + BYTES_LENGTH_PREFIX
        if start + length > len(raw):
            raise RequestError(400, "invalid_binary_size",
                               f"input {name!r}: element {len(elements)} declares {length} bytes at byte {start}, "
                               f"past the tensor's {len(raw)} bytes", field=f"inputs.{name}")
        elements.append(raw[start : start + length])
        offset = start + length
    return elements


def text_input(tensor: InferInput, binary: bytes) -> list[str]:
    """A BYTES input of texts: JSON `data` strings, or binary elements (each a 4-byte little-endian length and the
    UTF-8 bytes, Triton's layout), their sizes checked against the body."""
    field = f"inputs.{tensor.name}"
    if tensor.name != TEXTS_INPUT or tensor.datatype != "BYTES":
        raise RequestError(422, "invalid_field",
                           f"text models take one BYTES input {TEXTS_INPUT!r}, got {tensor.name!r} of "
                           f"{tensor.datatype}", field=field)
    count = math.prod(tensor.shape) if all(size >= 0 for size in tensor.shape) else -1
    check_binary_size(tensor, binary)
    with input_errors(field):
        if tensor.parameters.binary_data_size is not None:
            texts = [element.decode("utf-8") for element in bytes_elements(tensor.name, binary)]
        else:
            texts = np.asarray(tensor.data if tensor.data is not None else [], dtype=object).flatten().tolist()
        if count != len(texts) or not all(isinstance(text, str) for text in texts):
            raise RequestError(422, "invalid_shape",
                               f"'{TEXTS_INPUT}' must hold {max(count, 0)} strings for shape {tensor.shape}",
                               field=field)
    return texts


async def infer(ingress: "Ingress", name: str, request: Request, version: str | None = None) -> Response:
    model = served_model(ingress, name, version)
    kind = model.kind
    header, binary = split_body(await read_body(request, ingress.spec.serving.max_request_bytes),
                                request.headers.get(HEADER_LENGTH))
    body = validate_body(InferRequest, header)
    if len(body.inputs) != 1:
        raise RequestError(422, "invalid_field", f"{kind} models take one input, got {len(body.inputs)}",
                           field="inputs")
    if binary and body.inputs[0].parameters.binary_data_size is None:
        raise RequestError(400, "invalid_binary_size",
                           f"the body holds {len(binary)} bytes after its JSON header but input "
                           f"{body.inputs[0].name!r} declares no binary_data_size",
                           field=f"inputs.{body.inputs[0].name}")
    if kind == "text":
        texts = text_input(body.inputs[0], binary)
        answer = await embed_texts(ingress, name, texts, field=f"inputs.{TEXTS_INPUT}")
        return infer_response(name, body, {EMBEDDINGS_OUTPUT: np.asarray(answer["embeddings"], dtype=np.float32)})
    array, dtype = input_array(body.inputs[0], binary)
    field = f"inputs.{IMAGES_INPUT}"
    images = (await from_pixels(ingress, model, array, field) if dtype == "uint8"
              else checked_images(ingress, model, array, dtype, field))
    answer = await ingress.classify(name, images, "float32")
    return infer_response(name, body, output_tensors(answer["predictions"]))
