"""The serving engine's shutdown: a drained engine answers what it holds, a stopped one fails what it runs."""

import asyncio
import time

import pytest

from rayserve_apps.engine import ImageBatchFormer, ServingEngine

BATCH_S = 0.05


class SlowBackend:
    """Answers each item with its payload doubled after BATCH_S."""

    async def execute(self, batch):
        await asyncio.sleep(BATCH_S)
        return [item.payload * 2 for item in batch.items]


def engine() -> ServingEngine:
    return ServingEngine("test", ImageBatchFormer(2, 0.0), SlowBackend())


def test_drain_answers_what_is_queued_and_in_flight_then_stops():
    async def scenario():
        served = engine()
        futures = served.submit([1, 2, 3, 4, 5], time.monotonic() + 10.0)  # three batches of at most two
        await asyncio.sleep(BATCH_S / 2)  # the first batch is in flight, the rest queued
        await served.drain(timeout_s=10.0)
        return [f.result() for f in futures], served

    answers, served = asyncio.run(scenario())
    assert answers == [2, 4, 6, 8, 10]
    assert served.totals.batches == 3 and served.queued == 0 and served.in_flight == 0


def test_stop_fails_the_batch_in_flight_instead_of_leaving_it_unanswered():
    async def scenario():
        served = engine()
        futures = served.submit([1, 2], time.monotonic() + 10.0)
        await asyncio.sleep(BATCH_S / 2)
        served.stop()
        done, _ = await asyncio.wait(futures, timeout=1.0)
        return futures, done

    futures, done = asyncio.run(scenario())
    assert len(done) == 2
    for future in futures:
        with pytest.raises(RuntimeError, match="stopped; retry"):
            future.result()
