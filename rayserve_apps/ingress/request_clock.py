"""When a request's clock starts: the moment its deadline, its latency and its traffic record count from.

An HTTP route starts the clock before it reads the body (`receiving()` in `Ingress._on_clock`); a handle call starts
it when the Python API method begins (`received_at()`). Everything the ingress does for the request after that
counts, as it does for the client: reading and parsing the body, validation, tokenization (slower when the replicas
compete for the cores), the model call.

A clock started only when the ingress calls the model, after validation and tokenization, would give a deadline the
client's request has already spent part of, and a latency (on the dashboard, in the SLO attainment, in the records
the controller refits its simulator on) shorter than the one the client sees.

**The way to the ingress.** A client (or a proxy in front of the ingress) that says when it sent the request starts
the clock there: the HTTP header `X-Request-Start` (`t=` and a Unix time in seconds, milliseconds or microseconds, as
nginx's `t=${msec}` and Heroku's router write it), or `sent_at_s` (Unix seconds) on a handle call. The way from the
client to the ingress replica then counts too: the router's and the replica's queues, which grow in bursts, exactly
when requests come near their SLO (under load this way there is longer than the way back). The local job's HAProxy
stamps every request it receives (`rayserve_apps/haproxy_loopback.sh`), so that its queue counts; the ingress's
admission gate stamps an HTTP request that arrives without a stamp (`rayserve_apps/edge/admission.py`), so that its
wait for a turn counts. The
clocks of the client's host and the ingress's must agree (NTP): a send time up to MAX_CLOCK_AHEAD_S ahead of the
ingress's clock starts at the arrival, one further ahead or more than MAX_SENT_BEFORE_S before it is refused (422
naming the header or the argument). Only the way back stays outside. Each answer carries the ingress's count
(`ingress_latency_ms`), so a client can measure that rest itself: its latency less the ingress's, which is what the
controller's refits leave out of its simulator's request overhead (`controller.calibration.client_round_trip_ms`).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

from rayserve_apps.edge.admission import stamp_unix_s
from rayserve_apps.requests import RequestError

#: HTTP header in which a client or a proxy stamps when it sent the request on.
REQUEST_START_HEADER = "X-Request-Start"
#: Handle-call argument with the same meaning (Unix seconds).
SENT_AT_ARGUMENT = "sent_at_s"
#: Seconds a send time may lie ahead of the ingress's clock (hosts' clocks under NTP disagree by far less); such a
#: request's clock starts at its arrival.
MAX_CLOCK_AHEAD_S = 1.0
#: Seconds before its arrival a send time may lie; further back it is not when this request was sent.
MAX_SENT_BEFORE_S = 3600.0


@dataclass(frozen=True)
class Received:
    monotonic_s: float  # time.monotonic(): the deadline and the latency count from it
    wall_s: float  # time.time(): the arrival in the controller's traffic record

    @classmethod
    def now(cls) -> "Received":
        return cls(time.monotonic(), time.time())

    @classmethod
    def sent_at(cls, sent_at_s: float, field: str) -> "Received":
        """The clock of a request its client sent at `sent_at_s` (Unix seconds); a 422 naming `field` for a time
        that cannot be this request's send time (see the module doc)."""
        now = cls.now()
        before_s = now.wall_s - sent_at_s if isinstance(sent_at_s, (int, float)) else math.nan
        if not -MAX_CLOCK_AHEAD_S <= before_s <= MAX_SENT_BEFORE_S:
            raise RequestError(422, "invalid_field",
                               f"{field}: {sent_at_s!r} is not when this request was sent (Unix seconds at most "
                               f"{MAX_CLOCK_AHEAD_S:g} s ahead of the ingress's clock and {MAX_SENT_BEFORE_S:g} s "
                               f"behind it; it is {before_s:.3f} s behind)", field=field)
        before_s = max(0.0, before_s)
        return cls(now.monotonic_s - before_s, now.wall_s - before_s)

    @classmethod
    def from_header(cls, value: str | None) -> "Received":
        """The clock of an HTTP request with the header `X-Request-Start: value` (now without it)."""
        if value is None:
            return cls.now()
        sent_at_s = stamp_unix_s(value)
        if sent_at_s is None:
            raise RequestError(400, "invalid_header",
                               f"{REQUEST_START_HEADER}: {value[:40]!r} is not 't=' and a Unix time",
                               field=REQUEST_START_HEADER)
        return cls.sent_at(sent_at_s, REQUEST_START_HEADER)

    def elapsed_ms(self) -> float:
        """Milliseconds since the clock started: the request's latency as the ingress counts it."""
        return (time.monotonic() - self.monotonic_s) * 1000.0


#: The HTTP route's clock, while the ingress handles that route's request (None for a handle call).
_ROUTE_RECEIVED: ContextVar[Received | None] = ContextVar("plexserve_route_received", default=None)


@contextmanager
def receiving(received: Received) -> Iterator[Received]:
    """Start the clock of the request the current task handles (an HTTP route, before it reads the body) at
    `received` (`Received.from_header`: now, or the client's stamped send time)."""
    token = _ROUTE_RECEIVED.set(received)
    try:
        yield received
    finally:
        _ROUTE_RECEIVED.reset(token)


def received_at(sent_at_s: float | None = None) -> Received:
    """The current request's clock: its HTTP route's, else (a handle call) its client's send time `sent_at_s`, else
    now (the start of the call)."""
    route = _ROUTE_RECEIVED.get()
    if route is not None:
        return route
    return Received.now() if sent_at_s is None else Received.sent_at(sent_at_s, SENT_AT_ARGUMENT)
