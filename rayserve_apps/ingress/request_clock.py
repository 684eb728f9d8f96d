"""When the ingress received a request: the moment its deadline, its latency and its traffic record count from.

An HTTP route starts the clock before it reads the body (`receiving()` in `Ingress._answer`); a handle call starts
it when the Python API method begins (`received_at()`). Everything the ingress does for the request after that
counts, as it does for the client: reading and parsing the body, validation, tokenization (0.75 ms for eight
passages on an idle core of the development VM, more when the replicas compete for the cores), the model call.

Until 2026-11-26 the clock started only when the ingress called the model, after validation and tokenization: a
deadline a client's request had already spent part of, and a latency (on the dashboard, in the SLO attainment, in the
records the controller refits its simulator on) shorter than the one the client saw. The way from the client to the
ingress replica and back stays outside: no ingress sees it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Received:
    monotonic_s: float  # time.monotonic(): the deadline and the latency count from it
    wall_s: float  # time.time(): the arrival in the controller's traffic record

    @classmethod
    def now(cls) -> "Received":
        return cls(time.monotonic(), time.time())


#: The HTTP route's arrival, while the ingress handles that route's request (None for a handle call).
_ROUTE_RECEIVED: ContextVar[Received | None] = ContextVar("plexserve_route_received", default=None)


@contextmanager
def receiving() -> Iterator[Received]:
    """Start the clock of the request the current task handles (an HTTP route, before it reads the body)."""
    received = Received.now()
    token = _ROUTE_RECEIVED.set(received)
    try:
        yield received
    finally:
        _ROUTE_RECEIVED.reset(token)


def received_at() -> Received:
    """The current request's arrival: its HTTP route's, else now (the start of a handle call)."""
    return _ROUTE_RECEIVED.get() or Received.now()
