"""How the ingress answers an HTTP call: the body read under the byte limit, then the route's work, with every
outcome in the error shape of the route's protocol (`errors.py`).

Status rules: a `RequestError` keeps its status (4xx for the client's input, 503 for load shedding); a `ValueError`
raised by a replica's own check is the input's fault (422); any other exception is a 5xx *only* because the routes
validate their input completely before they call a model, so what remains is the replica's failure.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Awaitable, Callable, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ray.serve.exceptions import BackPressureError

from rayserve_apps.edge.body_limit import read_json_object
from rayserve_apps.edge.errors import Protocol, error_response
from rayserve_apps.requests import RequestError

logger = logging.getLogger("ray.serve")

#: Status answered when a model replica fails while serving a valid request.
REPLICA_FAILURE_STATUS = 503
#: Seconds a shed client is asked to wait before retrying (`Retry-After`).
RETRY_AFTER_S = 1


async def answer(request: Request, limit_bytes: int, call: Callable[[dict[str, Any]], Awaitable[Any]],
                 protocol: Protocol = "native") -> Response:
    """Read the JSON body (413 as soon as it passes `limit_bytes`), run `call` on it, answer JSON or the error in
    `protocol`'s shape."""

    async def work() -> Any:
        return await call(await read_json_object(request, limit_bytes))

    return await guarded(work(), protocol)


def retry_later(message: str, protocol: Protocol = "native", error_type: str = "overloaded",
                retry_after_s: float = RETRY_AFTER_S) -> Response:
    """503 with `Retry-After` (whole seconds, rounded up) in `protocol`'s error shape."""
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    return error_response(RequestError(503, error_type, message), headers, protocol)


async def guarded(work: Awaitable[Any], protocol: Protocol = "native") -> Response:
    """`work`'s result as JSON (or as the Response it is), every exception as the error it stands for, in
    `protocol`'s error shape."""
    try:
        result = await work
        return result if isinstance(result, Response) else JSONResponse(result)
    except RequestError as error:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status_code == 503 else None
        return error_response(error, headers, protocol)
    except BackPressureError as error:  # the model's queue is full: shed load, never hang
        return retry_later(f"the model's replicas are saturated; retry later ({error.message})", protocol,
                           retry_after_s=error.retry_after_s or RETRY_AFTER_S)
    except ValueError as error:  # a replica's own check (e.g. a handle caller's bad ids) surfaced here
        return error_response(RequestError(422, "invalid_input", str(error)), protocol=protocol)
    except Exception as error:  # noqa: BLE001 - a failed replica must not become a 500 without a body
        logger.exception("request failed in a model replica")
        return error_response(RequestError(REPLICA_FAILURE_STATUS, "replica_failure",
                                           f"{type(error).__name__}: the model replica failed; retry"),
                              {"Retry-After": str(RETRY_AFTER_S)}, protocol)


def embedding_lists(rows: Sequence[Any]) -> list[list[float]]:
    """Embeddings as JSON-ready lists: replicas answer float32 numpy rows (batched calls) or lists (Arlo's router)."""
    return [row.tolist() if hasattr(row, "tolist") else list(row) for row in rows]
