"""The ingress replica's own bound on what it holds, following the load, refusing the excess in the route's protocol.

Ray Serve refuses a request past a deployment's `max_ongoing_requests` + `max_queued_requests` itself, before the
application's code runs, with a plain-text 503 ("Request dropped due to backpressure"), in its proxy or, in the fast
ingress mode (`rayserve_apps/fast_ingress.py`), in the ingress replica's HTTP server. An OpenAI or KServe client
reads that body as no error it knows. So when the spec bounds the ingress's queue
(`serving.ingress_max_queued_requests` >= 0), the ingress deployment asks Serve for a bound it never reaches
(`serve_limits`) and this ASGI middleware, outermost in the ingress's FastAPI app, keeps the spec's bound: at most
`running` requests in the routes at once, at most `waiting` more waiting for a turn, and past that a 503 with
`Retry-After` in the route's error shape (`errors.protocol_of`) before the body is read. The same holds in both
ingress modes, since both hand every HTTP request to the replica's ASGI app.

**Turns that follow the load** (`serving.ingress_turns_slo_fraction` > 0). By Little's law the requests an app holds
are its answer rate times the time each spends in it; which count keeps that time within the SLO differs several-fold
between short and long texts, so no fixed `running` fits both. The replica counts its 200 answers over the last
`ANSWER_RATE_WINDOW_S` (`AnswerRate`; the highest of the last `PEAK_HOLD_S`) and lets at most answers/s x SLO x the
fraction requests into the routes at once (at least `MIN_TURNS`, at most `running`): past saturation a request then
spends about that share of its SLO in the routes, whatever the texts. A request that finds no turn free waits for
one in arrival order, at most until `serving.ingress_wait_slo_fraction` of its SLO has passed since its clock
started (HAProxy's stamp, which counts HAProxy's queue, or the gate's own); then it is refused, still before its
body is read. The wait is bounded in time
rather than refused at once so that clients without back-off (a closed loop retrying at once) pace themselves
instead of spinning on refusals that cost the cores the model computes on. Below saturation the rate is the offered
load and the floor of turns is never reached: nothing waits and the bookkeeping is a counter and a deque. The text
replica's engine then refuses what its queued tokens cannot finish by the deadline (TCB §5.2's drops, applied on
arrival: `placement.tcb.dispatch.admits`) with the same clock, so past saturation what is answered is answered in
time.

A request whose clock has no start stamp (no `X-Request-Start` from a client or from HAProxy) gets the gate's, so
that its wait for a turn counts in its deadline and latency (`rayserve_apps/ingress/request_clock.py`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from typing import Any, Awaitable, Callable

from rayserve_apps.edge.answer import retry_later
from rayserve_apps.edge.errors import protocol_of

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Seconds of 200 answers the answer rate counts: long enough to smooth batch bursts, short enough to follow a
#: change of texts within a few seconds.
ANSWER_RATE_WINDOW_S = 2.0
#: Seconds for which the turns keep the highest answer rate measured: past saturation the CPU that refusals take
#: lowers the rate a little, and fewer turns would then batch less and lower it further; a lasting change of load
#: lowers the turns once it has lasted this long (the text engine's deadline check covers the meantime).
PEAK_HOLD_S = 10.0
#: Seconds between the rate samples the peak is taken over.
PEAK_SAMPLE_S = 0.25
#: Fewest turns when the turns follow the load: a burst at low load (or a replica that has not answered yet) runs,
#: and a model's batches fill (16 long texts at once is where the text engine's answers/s level off on 2 cores).
MIN_TURNS = 16
#: The header in which HAProxy (or a client) stamps when the request arrived (`request_clock.REQUEST_START_HEADER`).
START_HEADER = b"x-request-start"


class AnswerRate:
    """200 answers per second over the last `window_s` seconds, and the highest such rate over the last `hold_s`
    seconds (sampled every `sample_s`)."""

    def __init__(self, window_s: float = ANSWER_RATE_WINDOW_S, hold_s: float = PEAK_HOLD_S,
                 sample_s: float = PEAK_SAMPLE_S):
        if window_s <= 0 or hold_s < 0 or sample_s <= 0:
            raise ValueError(f"window_s and sample_s must be > 0 and hold_s >= 0, got {window_s}, {hold_s}, "
                             f"{sample_s}")
        self.window_s, self.hold_s, self.sample_s = window_s, hold_s, sample_s
        self._times: deque[float] = deque()
        self._samples: deque[tuple[float, float]] = deque()  # (at, rate)

    def add(self, now_s: float) -> None:
        self._times.append(now_s)

    def per_s(self, now_s: float) -> float:
        times = self._times
        while times and times[0] <= now_s - self.window_s:
            times.popleft()
        return len(times) / self.window_s

    def peak_per_s(self, now_s: float) -> float:
        """The highest rate of the last `hold_s` seconds, the current one included."""
        rate = self.per_s(now_s)
        samples = self._samples
        if not samples or samples[-1][0] <= now_s - self.sample_s:
            samples.append((now_s, rate))
        while samples and samples[0][0] <= now_s - self.hold_s:
            samples.popleft()
        return max(rate, max((r for _, r in samples), default=0.0))


#: `X-Request-Start` values above these are microseconds, else milliseconds, else seconds (Unix times of this
#: century: about 1.7e9 s, 1.7e12 ms, 1.7e15 us).
MICROSECONDS_ABOVE = 1e14
MILLISECONDS_ABOVE = 1e11


def stamp_unix_s(value: str) -> float | None:
    """The Unix seconds an `X-Request-Start` value names (`t=` and a Unix time in seconds, milliseconds or
    microseconds); None when it is not a number."""
    text = value.strip()
    text = text[2:] if text.startswith("t=") else text
    try:
        stamp = float(text)
    except ValueError:
        return None
    return stamp * (1e-6 if stamp > MICROSECONDS_ABOVE else 1e-3 if stamp > MILLISECONDS_ABOVE else 1.0)


def stamped_age_s(value: bytes | None, now_wall_s: float) -> float | None:
    """Seconds since an `X-Request-Start` stamp (`stamp_unix_s`), at least 0; None when there is none
    or it is not a number (the route answers that)."""
    sent_at_s = None if value is None else stamp_unix_s(value.decode("latin-1"))
    if sent_at_s is None:
        return None
    age = now_wall_s - sent_at_s
    return max(0.0, age) if math.isfinite(age) else None


class Admission:
    """The bound one ingress replica keeps: `running` requests in the routes and `waiting` more; unbounded until
    `configure` is called with a `waiting` of 0 or more. With `turns_slo_fraction` > 0 the turns follow the
    measured answer rate (see the module doc)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.running: int | None = None
        self.waiting = -1
        self.retry_after_s = 1.0
        self.turns_slo_fraction = 0.0
        self.wait_slo_fraction = 0.0
        self.slo_s_by_model: dict[str, float] = {}
        self.default_slo_s = 1.0
        self.answers = AnswerRate()
        #: Requests counted by the gate: in the routes and waiting for a turn.
        self.in_flight = 0
        #: Requests in the routes.
        self.holding = 0
        self._waiters: deque[tuple[asyncio.Future, float]] = deque()

    @property
    def bounded(self) -> bool:
        return self.running is not None and self.waiting >= 0

    @property
    def follows_load(self) -> bool:
        return self.turns_slo_fraction > 0

    def configure(self, running: int, waiting: int, retry_after_s: float, *,
                  slo_s_by_model: dict[str, float] | None = None, turns_slo_fraction: float = 0.0,
                  wait_slo_fraction: float = 0.0) -> None:
        """Keep at most `running` requests in the routes and `waiting` more (-1: no bound, Serve's own); with
        `turns_slo_fraction` > 0, at most answers/s x SLO x that fraction in the routes (the SLO of the model a path
        names, from `slo_s_by_model`, else their largest), each waiting at most `wait_slo_fraction` of its SLO."""
        if running < 1 or waiting < -1 or retry_after_s <= 0:
            raise ValueError(f"admission needs running >= 1, waiting >= -1 and retry_after_s > 0; got {running}, "
                             f"{waiting}, {retry_after_s}")
        if not (0 <= turns_slo_fraction <= 1 and 0 <= wait_slo_fraction <= 1):
            raise ValueError(f"admission needs turns_slo_fraction and wait_slo_fraction in [0, 1]; got "
                             f"{turns_slo_fraction}, {wait_slo_fraction}")
        slo_s_by_model = dict(slo_s_by_model or {})
        if any(not slo > 0 for slo in slo_s_by_model.values()):
            raise ValueError(f"admission needs SLOs > 0 s; got {slo_s_by_model}")
        self.running, self.waiting, self.retry_after_s = running, waiting, retry_after_s
        self.turns_slo_fraction, self.wait_slo_fraction = turns_slo_fraction, wait_slo_fraction
        self.slo_s_by_model = slo_s_by_model
        self.default_slo_s = max(slo_s_by_model.values(), default=1.0)

    def full(self) -> bool:
        return self.bounded and self.in_flight >= self.running + self.waiting

    def slo_s(self, path: str) -> float:
        """The SLO of the model `path` names (`/v1/models/NAME/...`, `/v2/models/NAME/...`), else the largest."""
        parts = path.split("/", 5)
        if len(parts) > 3 and parts[2] == "models":
            return self.slo_s_by_model.get(parts[3], self.default_slo_s)
        return self.default_slo_s

    def turns(self, slo_s: float, now_s: float) -> int:
        """Requests the routes may hold at once for a request of SLO `slo_s`: `running`, or (following the load)
        answers/s x `slo_s` x `turns_slo_fraction` between `MIN_TURNS` and `running`."""
        assert self.running is not None
        if not self.follows_load:
            return self.running
        wanted = math.floor(self.answers.peak_per_s(now_s) * slo_s * self.turns_slo_fraction)
        return max(min(MIN_TURNS, self.running), min(self.running, wanted))

    def wait_until_s(self, slo_s: float, now_s: float, age_s: float = 0.0) -> float | None:
        """Until when (on `clock`) a request whose clock started `age_s` ago may wait for a turn; None: no limit."""
        if not self.follows_load:
            return None
        return now_s - age_s + self.wait_slo_fraction * slo_s

    def answered(self, status: int) -> None:
        """A route's answer went out with `status`: a 200 counts in the answer rate."""
        if status == 200:
            self.answers.add(self.clock())

    async def run(self, call: Callable[[], Awaitable[None]], slo_s: float | None = None,
                  wait_until_s: float | None = None) -> bool:
        """`call()` once a turn is free, counted in flight from now until it returns; False (and no call) when no
        turn came by `wait_until_s`."""
        self.in_flight += 1
        try:
            if not await self._turn(self.default_slo_s if slo_s is None else slo_s, wait_until_s):
                return False
            try:
                await call()
            finally:
                self.holding -= 1
                self._wake()
            return True
        finally:
            self.in_flight -= 1

    async def _turn(self, slo_s: float, wait_until_s: float | None) -> bool:
        now = self.clock()
        self._wake()  # earlier waiters first (the turns may have grown since the last answer)
        if not self._waiters and self.holding < self.turns(slo_s, now):
            self.holding += 1
            return True
        if wait_until_s is not None and wait_until_s <= now:
            return False
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((waiter, slo_s))
        try:
            if wait_until_s is None:
                await waiter
            else:
                await asyncio.wait_for(waiter, wait_until_s - now)
            return True  # `_wake` counted this request's turn
        except asyncio.TimeoutError:
            return False
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # the turn came as the caller went away: pass it on
                self.holding -= 1
                self._wake()
            raise

    def _wake(self) -> None:
        """Hand free turns to the waiters, in arrival order."""
        waiters = self._waiters
        now = self.clock()
        while waiters:
            waiter, slo_s = waiters[0]
            if waiter.done():  # timed out or gone
                waiters.popleft()
                continue
            if self.holding >= self.turns(slo_s, now):
                return
            waiters.popleft()
            self.holding += 1
            waiter.set_result(True)


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
        path = scope.get("path", "/")
        if admission.full():
            await self._refuse(scope, receive, send,
                               f"the ingress holds {admission.in_flight} requests, its bound "
                               f"(serving.ingress_max_ongoing_requests {admission.running} + "
                               f"ingress_max_queued_requests {admission.waiting}); retry later")
            return
        slo_s = admission.slo_s(path)
        wait_until_s = None
        if admission.follows_load:
            now_wall = time.time()
            stamp = next((value for name, value in scope.get("headers", ()) if name == START_HEADER), None)
            age_s = stamped_age_s(stamp, now_wall)
            if stamp is None:  # the clock starts here: the wait for a turn counts in the deadline
                scope = {**scope, "headers": [*scope.get("headers", ()),
                                              (START_HEADER, b"t=%d" % round(now_wall * 1e6))]}
            wait_until_s = admission.wait_until_s(slo_s, admission.clock(), age_s or 0.0)

        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                admission.answered(message["status"])
            await send(message)

        if not await admission.run(lambda: self.app(scope, receive, counted), slo_s, wait_until_s):
            await self._refuse(scope, receive, send,
                               f"the ingress could not start this request within "
                               f"{admission.wait_slo_fraction:g} of its {slo_s * 1000:g} ms SLO (it runs "
                               f"{admission.holding} requests, its answer rate x SLO x "
                               f"serving.ingress_turns_slo_fraction {admission.turns_slo_fraction:g}); retry later")

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, message: str) -> None:
        refusal = retry_later(message, protocol_of(scope.get("path", "/"), scope.get("method", "GET")),
                              retry_after_s=self.admission.retry_after_s)
        await refusal(scope, receive, send)
