"""Request schemas and validation at the edge: every problem becomes a `RequestError` naming the field or limit.

The ingress turns a `RequestError` into an HTTP 4xx with a JSON body `{"error": {"type", "message", "field"}}`;
through a Python handle the same error arrives as a `ValueError`. Validation happens before anything reaches a
model replica, so a bad request never costs a replica or another request.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from placement.core.deployment_spec import DeploymentSpec, ModelSpec

#: Image element types a client may send, and how they are scaled to the model's float input.
IMAGE_DTYPE_SCALES = {"float32": 1.0, "uint8": 1.0 / 255.0}


class RequestError(ValueError):
    """A client error: an HTTP status, a machine-readable type, and the field it concerns."""

    def __init__(self, status_code: int, error_type: str, message: str, field: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type
        self.message = message
        self.field = field

    def to_json(self) -> dict[str, Any]:
        return {"error": {"type": self.error_type, "message": self.message, "field": self.field}}

    def __reduce__(self):  # survives pickling across Ray processes with its fields
        return (RequestError, (self.status_code, self.error_type, self.message, self.field))


def parse_json_body(body: bytes, max_request_bytes: int) -> dict[str, Any]:
    """Bytes of an HTTP body -> a JSON object, or RequestError (413 when too large, 400 when malformed)."""
    if len(body) > max_request_bytes:
        raise RequestError(413, "request_too_large",
                           f"request body has {len(body)} bytes; the limit is {max_request_bytes} bytes")
    try:
        payload = json.loads(body)
    except RecursionError:
        raise RequestError(400, "too_deeply_nested", "request body nests arrays or objects too deeply") from None
    except ValueError as error:  # bad JSON, bad UTF-8, an integer literal longer than Python converts
        raise RequestError(400, "malformed_json", f"request body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise RequestError(400, "malformed_json", "request body must be a JSON object")
    return payload


def find_model(spec: DeploymentSpec, name: str, kind: str) -> ModelSpec:
    """The served model `name`, which must be of `kind`; 404 when unknown, 400 when of the other kind."""
    try:
        model = spec.model(name)
    except KeyError:
        known = ", ".join(m.name for m in spec.models)
        raise RequestError(404, "unknown_model", f"no model named {name!r}; served models: {known}",
                           field="model") from None
    if model.kind != kind:
        verb = "embed" if model.kind == "text" else "classify"
        raise RequestError(400, "wrong_model_kind",
                           f"model {name!r} is a {model.kind} model; use /v1/models/{name}/{verb}", field="model")
    return model


def check_texts(payload: Any, max_items: int) -> list[str]:
    """`payload["texts"]` must be a non-empty list of at most `max_items` non-empty strings."""
    if not isinstance(payload, dict) or "texts" not in payload:
        raise RequestError(422, "invalid_field", "body must have a field 'texts' (a list of strings)", field="texts")
    extra = sorted(set(payload) - {"texts"})
    if extra:
        raise RequestError(422, "invalid_field", f"unknown field(s) {extra}; expected only 'texts'", field=extra[0])
    texts = payload["texts"]
    if not isinstance(texts, list) or not texts:
        raise RequestError(422, "invalid_field", "'texts' must be a non-empty list of strings", field="texts")
    if len(texts) > max_items:
        raise RequestError(413, "too_many_items", f"'texts' has {len(texts)} items; the limit is {max_items}",
                           field="texts")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise RequestError(422, "invalid_field", f"texts[{index}] must be a string, got {type(text).__name__}",
                               field=f"texts[{index}]")
        if not text.strip():
            raise RequestError(422, "invalid_field", f"texts[{index}] is empty", field=f"texts[{index}]")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(422, "invalid_text",
                                   f"texts[{index}] holds a lone surrogate; strings must be valid Unicode",
                                   field=f"texts[{index}]") from None
    return texts


def check_token_counts(token_counts: Sequence[int], limit: int, model: str) -> None:
    """413 naming the first text longer than the model's limit (used when the spec says 'reject')."""
    for index, count in enumerate(token_counts):
        if count > limit:
            raise RequestError(
                413, "input_too_long",
                f"texts[{index}] has {count} tokens; model {model!r} accepts at most {limit} tokens "
                "(set on_too_long: truncate in the spec to cut instead)",
                field=f"texts[{index}]",
            )


@dataclass(frozen=True)
class ImageContract:
    """What a vision model accepts: [N, channels, height, width]."""

    channels: int
    height: int
    width: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.channels, self.height, self.width)


#: Optional per-request fields of a classify call, passed to token-adaptation (OTAS) replicas.
QUERY_OPTION_FIELDS = ("task", "slo_ms", "utility")


def check_query_options(payload: dict[str, Any]) -> dict[str, Any]:
    """The optional `task` (string), `slo_ms` (> 0) and `utility` (>= 0) of a classify body, as given."""
    options = {name: payload[name] for name in QUERY_OPTION_FIELDS if payload.get(name) is not None}
    if "task" in options and (not isinstance(options["task"], str) or not options["task"]):
        raise RequestError(422, "invalid_field", "'task' must be a non-empty string", field="task")
    for name, low, strict in (("slo_ms", 0.0, True), ("utility", 0.0, False)):
        value = options.get(name)
        if value is None:
            continue
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) or value < low
            or (strict and value == low)):
            raise RequestError(422, "invalid_field", f"'{name}' must be a number {'>' if strict else '>='} {low:g}",
                               field=name)
    return options


def _finite(value: int | float) -> bool:
    """Whether a JSON number is a finite float (an integer literal too long for a float is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_images(payload: Any, contract: ImageContract, max_items: int) -> np.ndarray:
    """`payload["images"]` (nested lists, a numpy array or a torch tensor [N, C, H, W]) with optional `dtype` -> float32
    array, or RequestError."""
    if not isinstance(payload, dict) or "images" not in payload:
        raise RequestError(422, "invalid_field", "body must have a field 'images' (nested lists [N, C, H, W])",
                           field="images")
    extra = sorted(set(payload) - {"images", "dtype", *QUERY_OPTION_FIELDS})
    if extra:
        raise RequestError(422, "invalid_field", f"unknown field(s) {extra}; expected 'images' and optional 'dtype', "
                           "'task', 'slo_ms', 'utility'", field=extra[0])
    dtype = payload.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in IMAGE_DTYPE_SCALES:
        raise RequestError(422, "invalid_dtype",
                           f"dtype {dtype!r} is not supported; use one of {sorted(IMAGE_DTYPE_SCALES)}", field="dtype")
    images = payload["images"]
    if not isinstance(images, list) and hasattr(images, "__array__"):  # a numpy array or a (CPU) torch tensor
        images = np.asarray(images)
        if images.ndim == 0:
            raise RequestError(422, "invalid_shape", "'images' must be an array [N, C, H, W], got a scalar",
                               field="images")
    if not isinstance(images, (list, np.ndarray)) or not len(images):
        raise RequestError(422, "invalid_field", "'images' must be a non-empty list", field="images")
    if len(images) > max_items:
        raise RequestError(413, "too_many_items", f"'images' has {len(images)} items; the limit is {max_items}",
                           field="images")
    try:
        array = np.asarray(images)
    except ValueError:
        raise RequestError(422, "invalid_shape", "'images' is ragged: every image must have the same shape",
                           field="images") from None
    expected = f"[N, {contract.channels}, {contract.height}, {contract.width}]"
    if array.dtype == object or array.ndim != 4 or tuple(array.shape[1:]) != contract.shape:
        raise RequestError(422, "invalid_shape", f"'images' must have shape {expected}, got {list(array.shape)}",
                           field="images")
    if array.dtype.kind not in "iuf":
        raise RequestError(422, "invalid_dtype", f"'images' must hold numbers, got {array.dtype.kind!r} values",
                           field="images")
    if dtype == "uint8" and (array.dtype.kind == "f" or array.min() < 0 or array.max() > 255):
        raise RequestError(422, "invalid_dtype", "dtype 'uint8' needs integers in [0, 255]", field="images")
    values = array.astype(np.float32) * np.float32(IMAGE_DTYPE_SCALES[dtype])
    if not np.isfinite(values).all() or (array.dtype.kind == "f" and not math.isfinite(float(np.abs(array).max()))):
        raise RequestError(422, "invalid_value", "'images' contains NaN or infinite values", field="images")
    return values
