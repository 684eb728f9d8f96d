"""Ingress -> replica hops paid per batch of requests, not per request (the hop into the batching step).

A `BatchForwarder` stands for one destination (a device group slot, or a model's own deployment) and one model.
Requests that the ingress accepted for it are queued; while fewer than `max_calls_in_flight` calls are on their
way, everything queued leaves at the next turn of the event loop as one `embed_batch` call, so under load a call
carries every request that arrived while the previous calls were out, and at low load a request leaves at once.
Each request keeps its own outcome: its result, or its own error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from rayserve_apps.contracts import TEXT_CALLS_IN_FLIGHT

logger = logging.getLogger("ray.serve")

#: Calls one forwarder keeps on their way at once: enough that the replica's engine always has the next requests
#: queued while a batch runs, few enough that a call carries many requests under load.
DEFAULT_MAX_CALLS_IN_FLIGHT = TEXT_CALLS_IN_FLIGHT
#: Most requests one call carries (a bound on the message size).
MAX_REQUESTS_PER_CALL = 256

#: send(payloads, budgets_s) -> one outcome per payload (a result, or an exception instance).
Send = Callable[[list[Any], list[float]], Awaitable[Sequence[Any]]]


@dataclass
class _Waiting:
    payload: Any
    deadline_s: float
    future: asyncio.Future


class BatchForwarder:
    """Forwards the requests of one (destination, model) in batched calls."""

    def __init__(self, send: Send, max_calls_in_flight: int = DEFAULT_MAX_CALLS_IN_FLIGHT,
                 clock: Callable[[], float] = time.monotonic):
        if max_calls_in_flight < 1:
            raise ValueError(f"max_calls_in_flight must be >= 1, got {max_calls_in_flight}")
        self.send = send
        self.max_calls_in_flight = max_calls_in_flight
        self.clock = clock
        self.calls = 0
        self.requests = 0
        self._waiting: list[_Waiting] = []
        self._in_flight = 0
        self._flush_scheduled = False

    @property
    def idle(self) -> bool:
        """Nothing waits here and no call is on its way."""
        return not self._waiting and self._in_flight == 0

    async def forward(self, payload: Any, deadline_s: float) -> Any:
        """Send one request (with its deadline on `clock`) in the next batched call; its own result or error."""
        loop = asyncio.get_running_loop()
        waiting = _Waiting(payload, deadline_s, loop.create_future())
        self._waiting.append(waiting)
        self._schedule(loop)
        return await waiting.future

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._flush_scheduled and self._waiting and self._in_flight < self.max_calls_in_flight:
            self._flush_scheduled = True
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._waiting or self._in_flight >= self.max_calls_in_flight:
            return
        batch = [w for w in self._waiting[:MAX_REQUESTS_PER_CALL] if not w.future.done()]
        self._waiting = self._waiting[MAX_REQUESTS_PER_CALL:]
        if batch:
            self._in_flight += 1
            asyncio.get_running_loop().create_task(self._call(batch))
        self._schedule(asyncio.get_running_loop())

    async def _call(self, batch: list[_Waiting]) -> None:
        now = self.clock()
        try:
            outcomes = await self.send([w.payload for w in batch], [w.deadline_s - now for w in batch])
            if len(outcomes) != len(batch):
                raise RuntimeError(f"the replica answered {len(outcomes)} outcomes for {len(batch)} requests")
            for waiting, outcome in zip(batch, outcomes):
                if waiting.future.done():
                    continue
                if isinstance(outcome, BaseException):
                    waiting.future.set_exception(outcome)
                else:
                    waiting.future.set_result(outcome)
        except Exception as error:  # noqa: BLE001 - the call failed as a whole: each of its requests fails
            for waiting in batch:
                if not waiting.future.done():
                    waiting.future.set_exception(error)
        finally:
            self.calls += 1
            self.requests += len(batch)
            self._in_flight -= 1
            self._schedule(asyncio.get_running_loop())
