"""OpenAI's embeddings API: `POST /v1/embeddings`, so OpenAI SDKs and the connectors built on them embed with
plexserve's text models.

Request: `model` (a served text model), `input` (a string, a list of strings, or token arrays: one list of ids or a list
of them, ids of the *model's own* tokenizer with its special tokens), `encoding_format` ("float" or "base64":
little-endian float32 bytes), `dimensions` (accepted only when equal to the model's own width, checked before anything
is computed; plexserve does not shorten embeddings), `user` (accepted, not used). Response: `{"object": "list", "data":
[{"object": "embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`, token counts as
the model ran them (after truncation when its spec truncates). `GET /v1/models` also answers in OpenAI's list shape, and
`GET /v1/models/{id}` with OpenAI's model object.

Errors are OpenAI's (`edge/errors.py`): `{"error": {"message", "type", "param", "code"}}`, 400
`invalid_request_error` naming the field in `param` for any bad input, 404 with code `model_not_found` for an unknown
model, 413 for a body past `serving.max_request_bytes`, 503 `server_error` with `Retry-After` when overloaded; the
`openai` SDK raises `BadRequestError`, `NotFoundError`, `APIStatusError` and `InternalServerError` on them.

Connectors that tokenize with tiktoken before sending (LangChain's `OpenAIEmbeddings` unless
`check_embedding_ctx_length=False`) send ids that mean nothing to these models: set that option off.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, Field, StrictInt

from placement.core.deployment_spec import DeploymentSpec
from rayserve_apps.edge.answer import embedding_lists
from rayserve_apps.edge.errors import input_errors
from rayserve_apps.edge.native import embed_texts
from rayserve_apps.edge.schemas import StrictBody, Text, validate_body
from rayserve_apps.requests import RequestError, find_model

#: What the served models' OpenAI model objects name as their owner.
OWNER = "plexserve"

if TYPE_CHECKING:
    from rayserve_apps.ingress.deployment import Ingress

#: Bytes of one float in a base64 embedding (OpenAI's format: little-endian float32).
BASE64_FLOAT = np.dtype("<f4")


class EmbeddingsRequest(StrictBody):
    """OpenAI's embeddings request."""

    input: Text | list[Text] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="A text, a list of texts, or token arrays (ids of the model's own tokenizer).")
    model: Text = Field(description="A served text model (GET /v1/models).")
    encoding_format: Literal["float", "base64"] = Field(default="float",
                                                        description="'float' lists or 'base64' little-endian float32.")
    dimensions: StrictInt | None = Field(default=None, ge=1,
                                         description="Only the model's own embedding width is supported.")
    user: Text | None = Field(default=None, description="An end-user id; accepted and not used.")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class ModelObject(BaseModel):
    """OpenAI's model object (`GET /v1/models/{id}`)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="Unix seconds the model was created; 0: not known.")
    owned_by: str


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(description="'invalid_request_error' for a client error, 'server_error' for a 5xx.")
    param: str | None = Field(description="The request field concerned (e.g. input[3], dimensions), or null.")
    code: str | None = Field(description="e.g. model_not_found, request_too_large, overloaded.")


class OpenAIErrorResponse(BaseModel):
    """Every 4xx and 5xx answer of the OpenAI routes."""

    error: OpenAIErrorDetail


#: Responses the OpenAI routes document besides their 200.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": OpenAIErrorResponse, "description": description} for status, description in (
        (400, "Bad input (the field in 'param')"), (404, "Unknown model (code model_not_found)"),
        (413, "Body past the byte limit"), (503, "Overloaded or not hosted right now; retry"))
}


async def _embed_texts(ingress: "Ingress", model: str, texts: list[str]) -> tuple[list[list[float]], int]:
    """Embeddings through the ingress's `embed`, and the tokens they ran on, counted beside them in a thread."""
    tokenizer, limit = ingress.tokenizers[model], ingress.text_limits[model]

    async def count() -> int:
        with input_errors("input"):
            return sum(len(ids) for ids in await asyncio.to_thread(tokenizer.encode, texts, truncate_to=limit))

    answer, tokens = await asyncio.gather(embed_texts(ingress, model, texts, field="input"), count())
    return answer["embeddings"], tokens


async def _embed_token_ids(ingress: "Ingress", model: str, token_ids: list[list[int]]) -> tuple[list[list[float]], int]:
    limit = ingress.spec.serving.max_items_per_request
    if len(token_ids) > limit:
        raise RequestError(413, "too_many_items", f"'input' has {len(token_ids)} token arrays; the limit is {limit}",
                           field="input")
    for index, ids in enumerate(token_ids):
        if len(ids) > ingress.text_limits[model]:
            raise RequestError(413, "input_too_long",
                               f"input[{index}] has {len(ids)} tokens; model {model!r} accepts at most "
                               f"{ingress.text_limits[model]} tokens", field=f"input[{index}]")
    with input_errors("input"):
        try:
            ingress.tokenizers[model].check_token_ids(token_ids, ingress.text_limits[model])
        except ValueError as error:
            raise RequestError(422, "invalid_field", str(error).replace("token_ids", "input"), field="input") from None
    spec = ingress.spec.model(model)
    rows = await ingress._call(spec, "embed_token_ids", token_ids)
    return embedding_lists(rows), sum(len(ids) for ids in token_ids)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype=BASE64_FLOAT).tobytes()).decode("ascii")


async def embeddings(ingress: "Ingress", payload: dict[str, Any]) -> dict[str, Any]:
    body = validate_body(EmbeddingsRequest, payload)
    model = find_model(ingress.spec, body.model, "text").name
    width = ingress.text_widths[model]
    if body.dimensions is not None and body.dimensions != width:
        raise RequestError(400, "unsupported_value",
                           f"model {model!r} answers {width}-dimensional embeddings and does not shorten them; "
                           f"omit 'dimensions' or set it to {width}", field="dimensions")
    items = body.input
    if isinstance(items, str) or (items and isinstance(items[0], str)):
        vectors, tokens = await _embed_texts(ingress, model, [items] if isinstance(items, str) else list(items))
    else:
        if not items:
            raise RequestError(422, "invalid_field", "'input' must not be empty", field="input")
        token_ids = [list(items)] if isinstance(items[0], int) else [list(ids) for ids in items]
        vectors, tokens = await _embed_token_ids(ingress, model, token_ids)
    data = [{"object": "embedding", "index": index, "embedding": _encode(vector, body.encoding_format)}
            for index, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def with_model_list(models: dict[str, Any]) -> dict[str, Any]:
    """`GET /v1/models` also in OpenAI's shape (`object: list`, `data: [{id, object: model, ...}]`), so that an
    OpenAI client's `models.list()` sees the served models; plexserve's own `models` key is kept."""
    data = [{"id": model["name"], "object": "model", "created": 0, "owned_by": OWNER} for model in models["models"]]
    return {**models, "object": "list", "data": data}


def model_object(spec: DeploymentSpec, name: str) -> dict[str, Any]:
    """OpenAI's model object of the served model `name` (of either kind); 404 `model_not_found` when unknown."""
    kind = next((m.kind for m in spec.models if m.name == name), "text")
    model = find_model(spec, name, kind)
    return {"id": model.name, "object": "model", "created": 0, "owned_by": OWNER}
