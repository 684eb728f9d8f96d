"""The ingress replica's own bound on what it holds, refusing the excess in the route's protocol.

Ray Serve refuses a request past a deployment's `max_ongoing_requests` + `max_queued_requests` itself, before the
application's code runs, with a plain-text 503 ("Request dropped due to backpressure"), in its proxy or, in the fast
ingress mode (`rayserve_apps/fast_ingress.py`), in the ingress replica's HTTP server. An OpenAI or KServe client
reads that body as no error it knows. So when the spec bounds the ingress's queue
(`serving.ingress_max_queued_requests` >= 0), the ingress deployment asks Serve for a bound it never reaches
(`serve_limits`) and this ASGI middleware, outermost in the ingress's FastAPI app, keeps the spec's bound: at most
`running` requests in the routes at once, at most `waiting` more waiting for a turn, and past that a 503 with
`Retry-After` in the route's error shape (`errors.protocol_of`) before the body is read. The same holds in both
ingress modes, since both hand every HTTP request to the replica's ASGI app.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from rayserve_apps.edge.answer import retry_later
from rayserve_apps.edge.errors import protocol_of

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Admission:
    """The bound one ingress replica keeps: `running` requests in the routes and `waiting` more; unbounded until
    `configure` is called with a `waiting` of 0 or more."""

    def __init__(self) -> None:
        self.running: int | None = None
        self.waiting = -1
        self.retry_after_s = 1.0
        self.in_flight = 0
        self._turns: asyncio.Semaphore | None = None

    @property
    def bounded(self) -> bool:
        return self.running is not None and self.waiting >= 0

    def configure(self, running: int, waiting: int, retry_after_s: float) -> None:
        """Keep at most `running` requests in the routes and `waiting` more (-1: no bound, Serve's own)."""
        if running < 1 or waiting < -1 or retry_after_s <= 0:
            raise ValueError(f"admission needs running >= 1, waiting >= -1 and retry_after_s > 0; got {running}, "
                             f"{waiting}, {retry_after_s}")
        self.running, self.waiting, self.retry_after_s = running, waiting, retry_after_s
        self._turns = asyncio.Semaphore(running)

    def full(self) -> bool:
        return self.bounded and self.in_flight >= self.running + self.waiting

    async def run(self, call: Callable[[], Awaitable[None]]) -> None:
        """`call()` once one of the `running` turns is free, counted in flight from now until it returns."""
        assert self._turns is not None
        self.in_flight += 1
        try:
            async with self._turns:
                await call()
        finally:
            self.in_flight -= 1


def serve_limits(running: int, waiting: int) -> dict[str, int]:
    """`max_ongoing_requests` / `max_queued_requests` of the ingress deployment for a spec bound of `running` +
    `waiting`: Serve's own as given when unbounded (`waiting` -1); else room for the bound and as many requests being
    refused at once, with Serve's queue unbounded, so that Serve's plain-text refusal never comes first."""
    if waiting < 0:
        return {"max_ongoing_requests": running, "max_queued_requests": -1}
    return {"max_ongoing_requests": 2 * (running + waiting), "max_queued_requests": -1}


class AdmissionGate:
    """ASGI middleware keeping `admission`'s bound over HTTP requests (`app.add_middleware(AdmissionGate,
    admission=...)`); other scopes (lifespan) pass untouched."""

    def __init__(self, app: ASGIApp, admission: Admission):
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        admission = self.admission
        if scope["type"] != "http" or not admission.bounded:
            await self.app(scope, receive, send)
            return
        if admission.full():
            refusal = retry_later(f"the ingress holds {admission.in_flight} requests, its bound "
                                  f"(serving.ingress_max_ongoing_requests {admission.running} + "
                                  f"ingress_max_queued_requests {admission.waiting}); retry later",
                                  protocol_of(scope.get("path", "/"), scope.get("method", "GET")),
                                  retry_after_s=admission.retry_after_s)
            await refusal(scope, receive, send)
            return
        await admission.run(lambda: self.app(scope, receive, send))
