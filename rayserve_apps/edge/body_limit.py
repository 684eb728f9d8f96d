"""Reading a request body under a byte limit, chunked or not, and decoding it as a JSON object.

The limit is enforced while the body streams in: a `Content-Length` above it is refused before anything is read,
and a chunked (or lying) body is refused as soon as the bytes received pass it, so a large upload never sits whole
in the ingress's memory.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from rayserve_apps.requests import RequestError, parse_json_body


def too_large(size: int, limit: int, what: str = "request body has") -> RequestError:
    return RequestError(413, "request_too_large", f"{what} {size} bytes; the limit is {limit} bytes")


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The whole body, or 413 as soon as it passes `limit_bytes` (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise RequestError(400, "bad_request", f"Content-Length {declared[:40]!r} is not a byte count")
        if int(declared) > limit_bytes:
            raise too_large(int(declared), limit_bytes)
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit_bytes:
            raise too_large(received, limit_bytes, "request body passed")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_object(request: Request, limit_bytes: int) -> dict[str, Any]:
    return parse_json_body(await read_body(request, limit_bytes), limit_bytes)
