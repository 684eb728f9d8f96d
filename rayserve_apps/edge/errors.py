"""One error shape for every client error: `{"error": {"type", "message", "field"}}` with a 4xx status.

`install_error_handlers` makes FastAPI's own answers (unknown route 404, wrong method 405, query/path validation
422, body parse failures) use that shape too. `input_errors` turns *any* exception raised while decoding or
validating a client's input into a `RequestError`, so a body that trips a parser or a check (RecursionError,
OverflowError, TypeError of an unhashable value, UnicodeEncodeError of a lone surrogate) is a 4xx and never a 5xx
with "retry".
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

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


def error_response(error: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"type": error.error_type, "message": _encodable(error.message), "field": _encodable(error.field)}}
    return JSONResponse(body, status_code=error.status_code, headers=headers)


def field_path(loc: Sequence[Any]) -> str | None:
    """A pydantic location as the field name clients read: ("texts", 3) -> "texts[3]"; "body" prefixes dropped."""
    parts = [part for part in loc if part not in ("body", "query", "path")]
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
    """FastAPI's own errors in plexserve's error shape."""

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, error: RequestError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_error(list(error.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        error_type = HTTP_ERROR_TYPES.get(error.status_code, "http_error")
        message = str(error.detail)
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /docs for the API"
        elif error.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse({"error": {"type": error_type, "message": message, "field": None}},
                            status_code=error.status_code, headers=getattr(error, "headers", None))
