"""Request and response bodies of the HTTP API as pydantic models: FastAPI shows them at `/docs`, and the routes
validate a decoded body with them (`validate_body`) before anything reaches a model.

Limits that come from the deployment spec (items per request, tokens per text, image shape) are checked after these
models by `rayserve_apps.requests`; the models check types, unknown fields and value ranges.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from rayserve_apps.edge.errors import input_errors


def _unicode_text(text: str) -> str:
    """A string JSON can carry but UTF-8 cannot (a lone surrogate such as "\\ud800") is refused by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a lone surrogate; strings must be valid Unicode") from None
    return text


#: A client string: strictly a string, and valid Unicode.
Text = Annotated[StrictStr, AfterValidator(_unicode_text)]
#: A finite JSON number (int or float, never a bool or a numeric string).
FiniteNumber = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(BaseModel):
    type: str = Field(description="Machine-readable error type, e.g. invalid_field, unknown_model, request_too_large.")
    message: str = Field(description="What is wrong, naming the limit or the expected form.")
    field: str | None = Field(description="The request field concerned (e.g. texts[3]), or null.")


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer of plexserve."""

    error: ErrorDetail


#: What an answer's `ingress_latency_ms` is (`rayserve_apps/ingress/request_clock.py`).
INGRESS_LATENCY_DESCRIPTION = ("Milliseconds from when the request's clock started (its arrival at the ingress, or the "
                               "send time its client stamped in X-Request-Start) until the model answered: the latency "
                               "its SLO attainment and the placement controller's records count. A client's own "
                               "latency less this is what the ingress did not see: the way back, and the way there "
                               "unless the client stamped its send time.")


class EmbedRequest(StrictBody):
    texts: list[Text] = Field(min_length=1, description="Texts to embed, in order; each non-empty.")


class EmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]] = Field(description="One vector per text, in input order.")
    ingress_latency_ms: float = Field(description=INGRESS_LATENCY_DESCRIPTION)


class ClassifyRequest(StrictBody):
    """Images as nested lists (`images`: float32 [N, C, H, W] already transformed for the model, or uint8 raw pixels)
    or as base64 PNG/JPEG files (`images_base64`); pixels and files are resized and normalised with the checkpoint's
    timm data config."""

    images: list[Any] | None = Field(default=None, min_length=1, description="Nested lists [N, C, H, W] of numbers.")
    images_base64: list[Text] | None = Field(default=None, min_length=1,
                                             description="Base64 PNG or JPEG files, one per image.")
    dtype: Text = Field(default="float32",
                        description="Element type of `images`: 'float32' (the model's input, [N, C, H, W]) or "
                                    "'uint8' (raw pixels 0..255, [N, C, H, W] or [N, H, W, C] of any size, resized "
                                    "and normalised like a file).")
    task: Text | None = Field(default=None, min_length=1,
                              description="Token-adaptation (OTAS) models: the task of every image.")
    slo_ms: FiniteNumber | None = Field(default=None, gt=0,
                                        description="Token-adaptation (OTAS) models: the query's latency objective, "
                                                    "ms.")
    utility: FiniteNumber | None = Field(default=None, ge=0,
                                         description="Token-adaptation (OTAS) models: the query's utility.")
    top_k: StrictInt | None = Field(default=None, ge=1,
                                    description="Also answer the k most probable classes of each image.")

    @model_validator(mode="after")
    def _one_image_field(self) -> "ClassifyRequest":
        if (self.images is None) == (self.images_base64 is None):
            raise ValueError("give exactly one of 'images' (nested lists) and 'images_base64' (PNG/JPEG files)")
        return self

    def query_options(self) -> dict[str, Any]:
        return {"task": self.task, "slo_ms": self.slo_ms, "utility": self.utility}


class RankedClass(BaseModel):
    label: int
    probability: float
    label_name: str | None = None


class Prediction(BaseModel):
    label: int = Field(description="The most probable class.")
    probabilities: list[float] = Field(description="Softmax over the model's classes.")
    label_name: str | None = Field(default=None, description="The class's name when the model's metadata has names.")
    top_k: list[RankedClass] | None = Field(default=None,
                                            description="The `top_k` most probable classes, when asked for.")
    task: str | None = Field(default=None, description="Token-adaptation models: the task the image was answered for.")
    gamma: int | None = Field(default=None, description="Token-adaptation models: tokens per layer its batch ran at.")


class ClassifyResponse(BaseModel):
    model: str
    predictions: list[Prediction]
    ingress_latency_ms: float = Field(description=INGRESS_LATENCY_DESCRIPTION)


BodyModel = TypeVar("BodyModel", bound=BaseModel)


def validate_body(model: type[BodyModel], payload: Any) -> BodyModel:
    """`payload` as `model`, or a RequestError (4xx) naming the first bad field; never another exception."""
    with input_errors():
        return model.model_validate(payload)


def _inline_refs(schema: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inline_refs(definitions[schema["$ref"].rsplit("/", 1)[-1]], definitions)
        return {key: _inline_refs(value, definitions) for key, value in schema.items() if key != "$defs"}
    if isinstance(schema, list):
        return [_inline_refs(item, definitions) for item in schema]
    return schema


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route that reads its body itself (to stream it under the byte limit): `/docs` shows
    `model` as the request body."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": _inline_refs(schema, schema.get("$defs", {}))}}}}


#: Responses every POST route documents besides its 200.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description} for status, description in (
        (400, "Malformed body"), (404, "Unknown model"), (413, "Body, item count or text too large"),
        (422, "Invalid field"), (503, "Overloaded or not hosted right now; retry"))
}
