"""Every client error in the error shape of the protocol its route speaks, with a 4xx status.

- plexserve's own routes: `{"error": {"type", "message", "field"}}`, statuses as raised (400, 404, 413, 422, 503);
- OpenAI's (`POST /v1/embeddings`, `GET /v1/models/{id}`): `{"error": {"message", "type", "param", "code"}}` as
  OpenAI answers: 400 `invalid_request_error` for any bad input (the field in `param`), 404 with code
  `model_not_found`, 413 for a body past the byte limit, 503 `server_error` when overloaded;
- KServe v2 / Open Inference Protocol (`/v2/...`): `{"error": "<message>"}`, 400 for any bad input, 404 for an
  unknown model or version, 413, 503.

`protocol_of` tells a route's protocol from its path, so that `install_error_handlers` answers FastAPI's own errors
(unknown route 404, wrong method 405, query/path validation, body parse failures) in the same shape.
`input_errors` turns *any* exception raised while decoding or validating a client's input into a `RequestError`, so a
body that trips a parser or a check (RecursionError, OverflowError, TypeError of an unhashable value, UnicodeEncodeError
of a lone surrogate) is a 4xx and never a 5xx with "retry".
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Literal, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rayserve_apps.requests import RequestError

#: Error types of FastAPI's own HTTP errors, by status.
HTTP_ERROR_TYPES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                    415: "unsupported_media_type"}
#: Longest piece of a client's value quoted back in an error message, characters.
MAX_QUOTED_CHARS = 80


def _encodable(text: str | None) -> str | None:
    """Text safe to encode as UTF-8 (a client's lone surrogate quoted back in a message becomes an escape)."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


#: The error shapes: plexserve's own, OpenAI's, KServe v2's.
Protocol = Literal["native", "openai", "kserve"]
#: Statuses OpenAI and KServe keep as raised; any other 4xx is their 400 (bad request).
KEPT_STATUSES = frozenset({404, 405, 413, 415, 503})
#: Error type of a body past the byte limit (`body_limit.py`), the one 413 OpenAI and KServe answer.
BODY_TOO_LARGE = "request_too_large"
#: OpenAI's `code` for a plexserve error type where OpenAI has its own.
OPENAI_CODES = {"unknown_model": "model_not_found"}


def protocol_of(path: str, method: str = "GET") -> Protocol:
    """The protocol whose error shape a request's answer takes, from its path: OpenAI's for `/v1/embeddings` and
    `GET /v1/models/{id}`, KServe's for `/v2` and below, plexserve's own for the rest."""
    if path.rstrip("/") == "/v1/embeddings":
        return "openai"
    parts = path.strip("/").split("/")
    if len(parts) == 3 and parts[:2] == ["v1", "models"] and method in ("GET", "HEAD"):
        return "openai"
    if parts[0] == "v2":
        return "kserve"
    return "native"


def protocol_status(error: RequestError, protocol: Protocol) -> int:
    """The status `protocol` answers for `error`: plexserve's own as raised; OpenAI's and KServe's 400 for bad input,
    413 only for a body past the byte limit (too many items or tokens is bad input there)."""
    status = error.status_code
    if protocol == "native" or status >= 500 or (status in KEPT_STATUSES and status != 413):
        return status
    return 413 if error.error_type == BODY_TOO_LARGE else 400


def error_body(error: RequestError, protocol: Protocol = "native") -> dict[str, Any]:
    """`error` as the body of `protocol`'s error answer."""
    message, field = _encodable(error.message), _encodable(error.field)
    if protocol == "openai":
        kind = "server_error" if error.status_code >= 500 else "invalid_request_error"
        return {"error": {"message": message, "type": kind, "param": field,
                          "code": OPENAI_CODES.get(error.error_type, error.error_type)}}
    if protocol == "kserve":
        return {"error": message if not field or field in message else f"{field}: {message}"}
    return {"error": {"type": error.error_type, "message": message, "field": field}}


def error_response(error: RequestError, headers: dict[str, str] | None = None,
                   protocol: Protocol = "native") -> JSONResponse:
    """`error` as `protocol` answers it: its status and its error body."""
    return JSONResponse(error_body(error, protocol), status_code=protocol_status(error, protocol),
                        headers=headers)


#: Names pydantic gives a union's plain members in an error's location (not fields).
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _union_member(part: Any) -> bool:
    """Whether a location part names a union member (e.g. "list[int]", "function-after[...]"), not a field."""
    return isinstance(part, str) and (part in _TYPE_TAGS or not part.replace("-", "_").isidentifier())


def field_path(loc: Sequence[Any]) -> str | None:
    """A pydantic location as the field name clients read: ("texts", 3) -> "texts[3]"; "body" prefixes dropped."""
    parts = [part for part in loc if part not in ("body", "query", "path") and not _union_member(part)]
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or None


def from_validation_error(errors: list[dict[str, Any]]) -> RequestError:
    """The first pydantic error as a RequestError: malformed JSON is 400, everything else 422 naming the field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "invalid"}
    if first.get("type") == "json_invalid":
        return RequestError(400, "malformed_json", f"request body is not valid JSON: {first.get('msg')}")
    field = field_path(first.get("loc", ()))
    message = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
    return RequestError(422, "invalid_field", message, field=field)


@contextmanager
def input_errors(field: str | None = None) -> Iterator[None]:
    """Any exception raised inside is the client's input's fault: a RequestError (kept as is) or a 4xx naming
    `field`. Use it around decoding and validation only, never around a model call."""
    try:
        yield
    except RequestError:
        raise
    except ValidationError as error:
        raise from_validation_error(error.errors(include_url=False)) from None
    except RecursionError:
        raise RequestError(400, "too_deeply_nested", "the request nests arrays or objects too deeply",
                           field=field) from None
    except (MemoryError, OverflowError) as error:
        raise RequestError(422, "invalid_value", f"a number or size in the request is out of range ({error})"[:200],
                           field=field) from None
    except UnicodeError:
        raise RequestError(422, "invalid_text",
                           "the request holds a string that is not valid Unicode (e.g. a lone surrogate)",
                           field=field) from None
    except Exception as error:  # noqa: BLE001 - whatever a check trips over is still the input's fault
        raise RequestError(422, "invalid_input", f"{type(error).__name__}: {str(error)[:MAX_QUOTED_CHARS * 2]}",
                           field=field) from None


def install_error_handlers(app: FastAPI) -> None:
    """FastAPI's own errors in the error shape of the route's protocol (`protocol_of`)."""

    def protocol(request: Request) -> Protocol:
        return protocol_of(request.url.path, request.method)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, error: RequestError) -> JSONResponse:
        return error_response(error, protocol=protocol(request))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_error(list(error.errors())), protocol=protocol(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        error_type = HTTP_ERROR_TYPES.get(error.status_code, "http_error")
        message = str(error.detail)
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /docs for the API"
        elif error.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(RequestError(error.status_code, error_type, message), getattr(error, "headers", None),
                              protocol(request))
