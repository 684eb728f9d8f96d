"""The serving engine's shutdown (a drained engine answers what it holds, a stopped one fails what it runs) and the
device slots a group's engines share (its models take the devices in turn)."""

import asyncio
import time

import pytest

from rayserve_apps.engine import DeviceSlots, ImageBatchFormer, ServingEngine

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
    assert served.totals.busy_s > 2 * BATCH_S  # the three batches' seconds, summed
    assert served.totals.queued_s > 2 * BATCH_S  # items 3-5 waited for one batch or two


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


class SharedDevice:
    """A backend per engine over one shared device: records every batch's payloads in the order the batches start
    and the most batches that ever ran at once. Batches run (BATCH_S each) once `go` is set."""

    def __init__(self):
        self.running = 0
        self.most_at_once = 0
        self.started: list[list] = []
        self.go = asyncio.Event()

    def backend(self):
        device = self

        class Backend:
            async def execute(self, batch):
                device.running += 1
                device.most_at_once = max(device.most_at_once, device.running)
                device.started.append([item.payload for item in batch.items])
                try:
                    await device.go.wait()
                    await asyncio.sleep(BATCH_S)
                finally:
                    device.running -= 1
                return [item.payload * 2 for item in batch.items]

        return Backend()


def grouped_engines(device: SharedDevice, slots: DeviceSlots, count: int, max_batch: int = 2) -> list[ServingEngine]:
    return [ServingEngine(f"model-{k}", ImageBatchFormer(max_batch, 0.0), device.backend(),
                          max_batches_in_flight=slots.num_stages, device_slots=slots) for k in range(count)]


def test_a_groups_models_take_its_device_in_turn():
    async def scenario():
        device = SharedDevice()
        first, second = grouped_engines(device, DeviceSlots(1), 2, max_batch=4)
        deadline = time.monotonic() + 10.0
        futures = first.submit([1], deadline)
        await asyncio.sleep(BATCH_S / 5)  # model 0's batch holds the device
        futures += second.submit([10], deadline)  # waits for the device, not beside model 0's batch
        await asyncio.sleep(BATCH_S / 5)
        futures += first.submit([2, 3], deadline)  # model 1 has waited longer: it goes next
        futures += second.submit([20], deadline)  # formed with model 1's waiting request when the device frees
        await asyncio.sleep(BATCH_S / 5)
        device.go.set()
        answers = await asyncio.gather(*futures)
        return answers, device

    answers, device = asyncio.run(scenario())
    assert answers == [2, 20, 4, 6, 40]
    assert device.most_at_once == 1
    assert device.started == [[1], [10, 20], [2, 3]]


def test_a_pipelined_group_runs_one_batch_per_stage_over_all_its_models():
    async def scenario():
        device = SharedDevice()
        engines = grouped_engines(device, DeviceSlots(2), 3)
        deadline = time.monotonic() + 10.0
        futures = [f for k, served in enumerate(engines) for f in served.submit([k, k, k, k], deadline)]
        device.go.set()
        answers = await asyncio.gather(*futures)
        return answers, device

    answers, device = asyncio.run(scenario())
    assert answers == [2 * k for k in range(3) for _ in range(4)]
    assert device.most_at_once == 2  # three models, each with work for two stages: two batches at a time
    assert len(device.started) == 6


def test_a_stopped_models_batch_gives_its_device_slot_back():
    async def scenario():
        device = SharedDevice()
        slots = DeviceSlots(1)
        leaving, staying = grouped_engines(device, slots, 2)
        deadline = time.monotonic() + 10.0
        leaving.submit([1, 2], deadline)
        await asyncio.sleep(BATCH_S / 5)  # its batch holds the device
        waiting = staying.submit([3], deadline)
        await asyncio.sleep(BATCH_S / 5)
        leaving.stop()  # its batch in flight fails; the slot goes to the model still served
        device.go.set()
        return await asyncio.wait_for(asyncio.gather(*waiting), timeout=1.0)

    assert asyncio.run(scenario()) == [6]


def test_device_slots_need_a_stage():
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        DeviceSlots(0)


def test_batch_cost_estimate_fits_fixed_and_per_token_seconds_past_a_stall():
    from rayserve_apps.engine.batch_cost import MIN_BATCHES, BatchCostEstimate

    estimate = BatchCostEstimate()
    sizes = [100, 200, 400, 300, 100, 200]
    for k, tokens in enumerate(sizes[:MIN_BATCHES - 1]):
        estimate.add(tokens, 0.01 + 0.001 * tokens, ended_s=0.1 * k)
    assert not estimate.ready(1.0)
    for k, tokens in enumerate(sizes[MIN_BATCHES - 1:]):
        estimate.add(tokens, 0.01 + 0.001 * tokens, ended_s=0.5 + 0.1 * k)
    estimate.add(200, 5.0, ended_s=1.0)  # one batch stalled behind a loading neighbour
    assert estimate.ready(1.0)
    assert estimate.seconds(1000) == pytest.approx(1.01, rel=0.02)
    assert estimate.fixed_s == pytest.approx(0.01, abs=0.005)


def test_batch_cost_estimate_forgets_batches_older_than_its_age_limit():
    from rayserve_apps.engine.batch_cost import MAX_AGE_S, MIN_BATCHES, BatchCostEstimate

    estimate = BatchCostEstimate()
    for k in range(MIN_BATCHES):  # a slow spell: 1 s per 100 tokens
        estimate.add(100 * (k + 1), 0.01 * 100 * (k + 1), ended_s=float(k))
    assert estimate.ready(float(MIN_BATCHES))
    assert estimate.seconds(100) == pytest.approx(1.0)
    assert not estimate.ready(MIN_BATCHES + MAX_AGE_S)  # nothing ran since: no estimate, rather than a stale one
    for k in range(MIN_BATCHES):  # the device is fast again
        estimate.add(100 * (k + 1), 0.0001 * 100 * (k + 1), ended_s=MIN_BATCHES + MAX_AGE_S + k)
    assert estimate.ready(2 * MIN_BATCHES + MAX_AGE_S)
    assert estimate.seconds(100) == pytest.approx(0.01)


def test_text_former_refuses_a_request_its_batch_cannot_answer_in_time():
    from placement.tcb.batch_scheduler import make_batch_scheduler
    from rayserve_apps.engine import TextBatchFormer, WorkItem
    from rayserve_apps.engine.batch_cost import MAX_AGE_S, MIN_BATCHES
    from rayserve_apps.requests import RequestError

    async def scenario():
        loop = asyncio.get_running_loop()
        scheduler = make_batch_scheduler("das", {"row_length_tokens": 64, "refuse_early": False})  # form-time rule
        former = TextBatchFormer("m", scheduler, 0.0, 500.0)
        for k in range(MIN_BATCHES):  # batches of 20 tokens took 0.2 s: 0.01 s per token
            former.add([WorkItem([1] * 10, float(k), float(k) + 1.0, loop.create_future()) for _ in range(2)])
            batch = former.form(float(k))
            assert len(batch.items) == 2 and not batch.refused
            former.completed(batch, float(k), float(k) + 0.2)
        assert former.cost.seconds(20) == pytest.approx(0.2)
        now = float(MIN_BATCHES)
        doomed = [WorkItem([1] * 10, now, now + 0.15, loop.create_future()) for _ in range(2)]  # needs 0.2 s
        fine = [WorkItem([1] * 10, now + 0.01, now + 1.0, loop.create_future()) for _ in range(2)]
        former.add(doomed + fine)
        batch = former.form(now)
        assert batch.items == fine
        assert [item for item, _ in batch.refused] == doomed
        assert all(isinstance(error, RequestError) and error.status_code == 503 for _, error in batch.refused)
        assert former.queued() == 0
        # No batch ran for longer than the estimate's age limit: the same tight request now runs uncut, and its
        # batch refreshes the estimate (a stale estimate must not refuse every request forever).
        later = now + MAX_AGE_S + 1.0
        tight = [WorkItem([1] * 10, later, later + 0.15, loop.create_future()) for _ in range(2)]
        former.add(tight)
        batch = former.form(later)
        assert batch.items == tight and not batch.refused

    asyncio.run(scenario())
