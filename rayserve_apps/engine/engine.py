"""The serving engine of every replica: a queue per model, a batch former, a backend, and the answers.

The batching step of a request's path: one implementation of queue -> scheduler -> batch -> execute -> answer
serves the text replica, the vision replica and the group replica. What differs is plugged in:

* a `BatchFormer` holds the waiting items of one model and decides what runs next: TCB's ConcatBatching
  schedulers for text (`text_batches.py`), OTAS' adaptive batching and token allocation for the adaptive ViT
  (`vision_batches.py`);
* a `BatchBackend` executes a formed batch: in this process (a single-device replica) or through a device group's
  stage actors, with several batches in flight so the stages overlap (AlpaServe §3: the pipeline must stay full).

The engine never blocks its event loop: backends compute in a worker thread or wait on Ray object references, so
new items keep arriving while a batch runs, and the next batch is formed from everything that waited meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

logger = logging.getLogger("ray.serve")

#: Seconds the loop sleeps when items wait but the former could run none of them yet (e.g. OTAS waiting for a
#: batch to fill), before it asks again.
IDLE_RECHECK_S = 0.005
#: Poll interval of `ServingEngine.drain`, seconds.
DRAIN_POLL_S = 0.02


@dataclass(eq=False)
class WorkItem:
    """One unit of work (a text, an image) waiting for its batch; its caller awaits `future`."""

    payload: Any
    arrival_s: float
    deadline_s: float
    future: asyncio.Future
    #: Former-specific attributes (OTAS: task and utility).
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class FormedBatch:
    """What the former chose to run now, and the items it refused (each with the error its caller gets)."""

    items: list[WorkItem]
    #: Former-specific execution plan (TCB: the `BatchDecision`; OTAS: the gamma `Dispatch`).
    plan: Any = None
    refused: list[tuple[WorkItem, Exception]] = field(default_factory=list)


class BatchFormer(Protocol):
    """The queue and scheduling policy of one model."""

    def add(self, items: Sequence[WorkItem]) -> None: ...

    def queued(self) -> int: ...

    def ready_at_s(self, now_s: float, batches_running: int = 0) -> float:
        """When a batch should be formed: `now_s` or earlier when it should run now, later to let it fill;
        `batches_running`: the model's batches executing now."""
        ...

    def form(self, now_s: float) -> FormedBatch: ...

    def completed(self, batch: FormedBatch, started_s: float, finish_s: float) -> None:
        """`batch` ran from `started_s` to `finish_s` (the engine's clock)."""
        ...


class BatchBackend(Protocol):
    """Executes a formed batch; returns one result per item, in the batch's order."""

    async def execute(self, batch: FormedBatch) -> list[Any]: ...


class DeviceSlots(asyncio.Semaphore):
    """The batches a device group runs at once, over all its models: one per pipeline stage.

    AlpaServe §4.3: a group serves the requests of all the models it hosts from one queue, first come first served,
    each batch through its pipeline; its simulator (`placement/alpaserve/simulator.py`) runs them so. Without these
    slots every hosted model's engine would run its own batches beside the others', each model's stage actors
    contending for the same devices (on CPUs, for the same cores: every batch slower, none first). The engines of
    one group share one `DeviceSlots`; an engine takes a slot before it forms a batch and gives it back when the
    batch is answered. Waiting engines get slots in the order they began to wait, and an engine starts waiting when
    it has a batch to run and its own batches in flight are fewer than its limit: an engine whose batch just ended
    waits behind those already waiting, so the models with queued requests take turns (the simulator's group takes
    the model of its oldest queued request instead; the two orders differ when one model's requests queue while
    its own batch runs)."""

    def __init__(self, num_stages: int):
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        super().__init__(num_stages)
        self.num_stages = num_stages


@dataclass
class EngineTotals:
    """What an engine has done since it started (for `info()`, tests and people)."""

    batches: int = 0
    items: int = 0
    refused: int = 0
    failed_batches: int = 0
    largest_batch: int = 0
    #: Seconds its batches ran, summed (batches in flight at once, one per pipeline stage, each count).
    busy_s: float = 0.0
    #: Seconds its items waited from their submission to their batch's start, summed over the items.
    queued_s: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        return dict(self.__dict__)


class ServingEngine:
    """Runs one model: items are submitted, batches are formed and executed, answers are delivered.

    max_batches_in_flight: batches executing at once (1 for a single process; the number of pipeline stages for
    a device group, so that every stage has work).
    device_slots: shared by the engines of one device group's models (`DeviceSlots`): a batch forms only when a
    slot is free, so the models take the group's devices in turn, as AlpaServe's groups and its simulator do.
    on_batch: called with each executed batch and its duration in seconds (metrics).
    """

    def __init__(self, name: str, former: BatchFormer, backend: BatchBackend, max_batches_in_flight: int = 1,
                 clock: Callable[[], float] = time.monotonic,
                 on_batch: Callable[[FormedBatch, float], None] | None = None,
                 device_slots: DeviceSlots | None = None):
        if max_batches_in_flight < 1:
            raise ValueError(f"max_batches_in_flight must be >= 1, got {max_batches_in_flight}")
        self.name = name
        self.former = former
        self.backend = backend
        self.max_batches_in_flight = max_batches_in_flight
        self.clock = clock
        self.on_batch = on_batch
        self.device_slots = device_slots
        self.totals = EngineTotals()
        self._in_flight = 0
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._batch_tasks: set[asyncio.Task] = set()

    # ---- submitting ----

    def submit(self, payloads: Sequence[Any], deadline_s: float, attrs: dict[str, Any] | None = None,
               arrival_s: float | None = None) -> list[asyncio.Future]:
        """Queue one item per payload; returns their futures (await them, or `answer(...)` for all at once)."""
        loop = asyncio.get_running_loop()
        now = self.clock() if arrival_s is None else arrival_s
        items = [WorkItem(payload, now, deadline_s, loop.create_future(), dict(attrs or {})) for payload in payloads]
        self.former.add(items)
        self._ensure_loop()
        self._wake.set()
        return [item.future for item in items]

    async def answer(self, payloads: Sequence[Any], deadline_s: float,
                     attrs: dict[str, Any] | None = None) -> list[Any]:
        """Submit and wait: the results in order, or the first item's error."""
        return list(await asyncio.gather(*self.submit(payloads, deadline_s, attrs)))

    @property
    def queued(self) -> int:
        return self.former.queued()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def healthy(self) -> bool:
        """False when the batch loop died (it never should: a failed batch fails only its own items)."""
        return not (self._loop_task is not None and self._loop_task.done() and not self._loop_task.cancelled())

    def stop(self) -> None:
        """Stop at once: batches in flight fail with an error saying so, queued items are left unanswered (`drain`
        first to answer both)."""
        for task in [self._loop_task, *self._batch_tasks]:
            if task is not None:
                task.cancel()

    async def drain(self, timeout_s: float) -> None:
        """Answer what is queued and in flight, then stop; after `timeout_s` stop anyway (batches still in flight
        then fail with an error saying so). The model's router must already have stopped sending it requests."""
        deadline = time.monotonic() + timeout_s
        while (self.former.queued() or self._in_flight) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        self.stop()

    # ---- the loop ----

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name=f"engine-{self.name}")

    async def _wait(self, timeout_s: float | None) -> None:
        self._wake.clear()
        if timeout_s is None:
            await self._wake.wait()
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass

    async def _run(self) -> None:
        while True:
            if self.former.queued() == 0 or self._in_flight >= self.max_batches_in_flight:
                await self._wait(None)  # an arrival, or a batch finishing, sets the event
                continue
            now = self.clock()
            ready = self.former.ready_at_s(now, self._in_flight)
            if ready > now:
                await self._wait(ready - now)
                continue
            if self.device_slots is not None:
                # The batch forms when the devices take it, from everything that queued while they were busy.
                await self.device_slots.acquire()
                now = self.clock()
            batch = self.former.form(now)
            self._refuse(batch.refused)
            if not batch.items:
                if self.device_slots is not None:
                    self.device_slots.release()
                if self.former.queued():
                    await self._wait(IDLE_RECHECK_S)
                continue
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(self._execute(batch))
            self._batch_tasks.add(task)
            task.add_done_callback(self._batch_tasks.discard)
            if self.device_slots is not None:
                # A callback, not a `finally` in `_execute`: a task cancelled before it starts runs no finally.
                task.add_done_callback(lambda _: self.device_slots.release())

    def _refuse(self, refused: list[tuple[WorkItem, Exception]]) -> None:
        self.totals.refused += len(refused)
        for item, error in refused:
            if not item.future.done():
                item.future.set_exception(error)

    async def _execute(self, batch: FormedBatch) -> None:
        started = self.clock()
        try:
            results = await self.backend.execute(batch)
            if len(results) != len(batch.items):
                raise RuntimeError(f"backend returned {len(results)} results for {len(batch.items)} items")
        except asyncio.CancelledError:
            for item in batch.items:
                if not item.future.done():
                    item.future.set_exception(RuntimeError(f"engine {self.name} was stopped; retry the request"))
            raise
        except Exception as error:  # noqa: BLE001 - a failed batch fails its own items, never the replica
            logger.exception("engine %s: a batch of %d items failed", self.name, len(batch.items))
            self.totals.failed_batches += 1
            for item in batch.items:
                if not item.future.done():
                    item.future.set_exception(error if isinstance(error, RuntimeError | ValueError)
                                              else RuntimeError(str(error)))
            return
        finally:
            self._in_flight -= 1
            if self._wake is not None:
                self._wake.set()
        finish = self.clock()
        self.former.completed(batch, started, finish)
        self.totals.batches += 1
        self.totals.items += len(batch.items)
        self.totals.largest_batch = max(self.totals.largest_batch, len(batch.items))
        self.totals.busy_s += finish - started
        self.totals.queued_s += sum(started - item.arrival_s for item in batch.items)
        for item, result in zip(batch.items, results):
            if not item.future.done():
                item.future.set_result(result)
        if self.on_batch is not None:
            self.on_batch(batch, finish - started)



async def answer_requests(engine: ServingEngine, requests: Sequence[Sequence[Any]], budgets_s: Sequence[float],
                          check: Callable[[Sequence[Any]], None]) -> list[list[Any] | Exception]:
    """Serve a batched call: several requests (each a list of payloads, with its remaining SLO budget in seconds)
    enter the engine together; each gets its results in order, or its own error (a bad request fails alone)."""
    if len(budgets_s) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(budgets_s)} budgets")
    now = engine.clock()
    submitted: list[list[asyncio.Future] | Exception] = []
    for payloads, budget_s in zip(requests, budgets_s):
        try:
            check(payloads)
            submitted.append(engine.submit(payloads, now + budget_s, arrival_s=now))
        except ValueError as error:
            submitted.append(error)
    outcomes: list[list[Any] | Exception] = []
    for entry in submitted:
        if isinstance(entry, Exception):
            outcomes.append(entry)
            continue
        results = await asyncio.gather(*entry, return_exceptions=True)
        error = next((r for r in results if isinstance(r, BaseException)), None)
        outcomes.append(error if error is not None else list(results))
    return outcomes
