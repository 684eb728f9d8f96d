"""OpenAI's embeddings API: `POST /v1/embeddings`, so OpenAI SDKs and the connectors built on them embed with
plexserve's text models.

Request: `model` (a served text model), `input` (a string, a list of strings, or token arrays: one list of ids or a
list of them, ids of the *model's own* tokenizer with its special tokens), `encoding_format` ("float" or "base64":
little-endian float32 bytes), `dimensions` (accepted only when equal to the model's own width; plexserve does not
shorten embeddings), `user` (accepted, not used). Response: `{"object": "list", "data": [{"object": "embedding",
"index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`, token counts as the model ran them
(after truncation when its spec truncates). `GET /v1/models` also answers in OpenAI's list shape.

Connectors that tokenize with tiktoken before sending (LangChain's `OpenAIEmbeddings` unless
`check_embedding_ctx_length=False`) send ids that mean nothing to these models: set that option off.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, Field, StrictInt

from rayserve_apps.edge.answer import embedding_lists
from rayserve_apps.edge.errors import input_errors
from rayserve_apps.edge.native import embed_texts
from rayserve_apps.edge.schemas import StrictBody, Text, validate_body
from rayserve_apps.requests import RequestError, find_model

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
    items = body.input
    if isinstance(items, str) or (items and isinstance(items[0], str)):
        vectors, tokens = await _embed_texts(ingress, model, [items] if isinstance(items, str) else list(items))
    else:
        if not items:
            raise RequestError(422, "invalid_field", "'input' must not be empty", field="input")
        token_ids = [list(items)] if isinstance(items[0], int) else [list(ids) for ids in items]
        vectors, tokens = await _embed_token_ids(ingress, model, token_ids)
    if body.dimensions is not None and vectors and body.dimensions != len(vectors[0]):
        raise RequestError(422, "unsupported_field",
                           f"model {model!r} answers {len(vectors[0])}-dimensional embeddings and "
                           f"does not shorten them; omit 'dimensions' or set it to {len(vectors[0])}",
                           field="dimensions")
    data = [{"object": "embedding", "index": index, "embedding": _encode(vector, body.encoding_format)}
            for index, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def with_model_list(models: dict[str, Any]) -> dict[str, Any]:
    """`GET /v1/models` also in OpenAI's shape (`object: list`, `data: [{id, object: model, ...}]`), so that an
    OpenAI client's `models.list()` sees the served models; plexserve's own `models` key is kept."""
    data = [{"id": model["name"], "object": "model", "created": 0, "owned_by": "plexserve"}
            for model in models["models"]]
    return {**models, "object": "list", "data": data}
