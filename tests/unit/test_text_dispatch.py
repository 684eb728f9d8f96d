"""Text batch dispatch: an idle engine runs a text at once, a busy one lets the batch fill; a call that cannot finish
by its deadline behind the queue is refused on arrival; torch's threads follow the idle cores."""

from __future__ import annotations

import pytest

from placement.tcb.batch_scheduler import BatchingParams
from placement.tcb.dispatch import admits, batch_ready_at_s, predicted_finish_s
from rayserve_apps._threads import LoadFollowingThreads, read_cpu_idle_s, threads_for_load


def test_idle_engine_dispatches_at_once():
    assert batch_ready_at_s(10.0, 9.99, 20, 1000, 0.05, batches_running=0, dispatch_when_idle=True) == 10.0


def test_busy_engine_waits_for_the_batch_wait():
    assert batch_ready_at_s(10.0, 9.99, 20, 1000, 0.05, batches_running=1, dispatch_when_idle=True) == \
        pytest.approx(10.04)


def test_without_idle_dispatch_an_idle_engine_waits():
    assert batch_ready_at_s(10.0, 9.99, 20, 1000, 0.05, batches_running=0, dispatch_when_idle=False) == \
        pytest.approx(10.04)


def test_full_rows_dispatch_even_when_busy():
    assert batch_ready_at_s(10.0, 9.99, 1000, 1000, 0.05, batches_running=1, dispatch_when_idle=False) == 10.0


def test_policy_options_default_on_and_validate():
    params = BatchingParams()
    assert params.dispatch_when_idle and params.refuse_early
    assert not BatchingParams(dispatch_when_idle=False).dispatch_when_idle


def cost(tokens: int) -> float:
    return 0.01 + 0.001 * tokens


def test_predicted_finish_counts_full_batches_then_the_rest():
    # 2500 tokens in batches of 1000: two full batches (1.01 s each) and one of 500 (0.51 s)
    assert predicted_finish_s(0.0, 2000, 500, 1000, cost) == pytest.approx(2.53)
    assert predicted_finish_s(0.0, 0, 1000, 1000, cost) == pytest.approx(1.01)


def test_admission_refuses_only_what_cannot_meet_its_deadline():
    assert admits(0.0, 0.2, tokens_ahead=0, tokens=100, capacity_tokens=1000, batch_seconds=cost)
    assert not admits(0.0, 0.2, tokens_ahead=900, tokens=100, capacity_tokens=1000, batch_seconds=cost)
    with pytest.raises(ValueError, match="capacity_tokens"):
        predicted_finish_s(0.0, 0, 1, 0, cost)


def test_threads_take_every_idle_core_for_one_batch():
    assert threads_for_load(idle_cores=1.0, own_cores=1.0, total_cores=2, batches_running=1) == 2
    assert threads_for_load(idle_cores=15.95, own_cores=0.0, total_cores=16, batches_running=1) == 16


def test_threads_leave_a_core_that_others_use_in_part():
    # One thread busy, the other core half used by other processes: a second thread would wait at every barrier.
    assert threads_for_load(idle_cores=0.5, own_cores=1.0, total_cores=2, batches_running=1) == 1
    assert threads_for_load(idle_cores=0.92, own_cores=1.0, total_cores=2, batches_running=1) == 2
    assert threads_for_load(idle_cores=15.6, own_cores=0.0, total_cores=16, batches_running=1) == 15


def test_threads_shrink_when_busy_or_shared():
    assert threads_for_load(idle_cores=0.0, own_cores=0.0, total_cores=8, batches_running=1) == 1
    assert threads_for_load(idle_cores=8.0, own_cores=0.0, total_cores=8, batches_running=4) == 2
    assert threads_for_load(idle_cores=30.0, own_cores=2.0, total_cores=8, batches_running=1) == 8
    with pytest.raises(ValueError, match="total_cores"):
        threads_for_load(1.0, 0.0, 0, 1)


def test_threads_read_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8\n")
    idle, total = read_cpu_idle_s(str(stat))
    assert idle / total == pytest.approx(850 / 1000)
    assert read_cpu_idle_s(str(tmp_path / "missing")) is None
    threads = LoadFollowingThreads(total_cores=2, stat_path=str(stat))
    assert 1 <= threads.before_batch() <= 2  # an unchanged file shows no idle core: this process's own share


def test_text_former_refuses_early_and_answers_503_overloaded():
    import asyncio

    from placement.tcb.batch_scheduler import make_batch_scheduler
    from rayserve_apps.engine.engine import WorkItem
    from rayserve_apps.engine.text_batches import TextBatchFormer
    from rayserve_apps.requests import RequestError

    async def scenario():
        loop = asyncio.get_running_loop()
        former = TextBatchFormer("m", make_batch_scheduler("das", {"row_length_tokens": 100, "num_rows": 2}),
                                 0.01, slo_ms=100)
        for tokens in (50, 100, 150, 200):  # batches of 1 ms per token
            former.cost.add(tokens, 0.001 * tokens, ended_s=0.0)

        def call(now, tokens):
            return [WorkItem([1] * tokens, now, now + 0.1, loop.create_future(), {})]

        first = call(0.0, 60)
        former.add(first)  # 60 ms: within its 100 ms
        assert former.queued() == 1 and not first[0].future.done()
        late = call(0.0, 60)
        former.add(late)  # 120 ms behind the first: refused at once
        assert former.queued() == 1 and former.refused_early == 1
        error = late[0].future.exception()
        assert isinstance(error, RequestError) and error.status_code == 503 and error.error_type == "overloaded"

    asyncio.run(scenario())


def test_text_former_counts_the_batch_running_in_a_callers_wait():
    """TCB §5.2's deadline check on arrival: the batch on the device is work ahead of the new call."""
    import asyncio

    from placement.tcb.batch_scheduler import make_batch_scheduler
    from rayserve_apps.engine.engine import WorkItem
    from rayserve_apps.engine.text_batches import TextBatchFormer

    async def scenario():
        loop = asyncio.get_running_loop()
        former = TextBatchFormer("m", make_batch_scheduler("fcfs", {"row_length_tokens": 100, "num_rows": 2}),
                                 0.01, slo_ms=100)
        for tokens in (50, 100, 150, 200):  # batches of 1 ms per token
            former.cost.add(tokens, 0.001 * tokens, ended_s=0.0)

        def call(now, tokens, budget_s=0.1):
            return [WorkItem([1] * tokens, now, now + budget_s, loop.create_future(), {})]

        running = call(0.0, 80, budget_s=1.0)
        former.add(running)
        batch = former.form(0.0)  # 80 ms on the device from 0 s
        assert [item for item in batch.items] == running and former.free_at_s(0.01) == pytest.approx(0.08)
        late = call(0.01, 60)  # alone it would take 60 ms of its 100; behind the running batch it ends at 140 ms
        former.add(late)
        assert former.refused_early == 1 and late[0].future.done()
        fits = call(0.01, 10)  # ends at 90 ms: within its 110 ms deadline
        former.add(fits)
        assert former.queued() == 1 and not fits[0].future.done()
        former.completed(batch, 0.0, 0.08)
        assert former.free_at_s(0.08) == 0.08  # nothing running: the next batch starts now
        lost = former.form(0.08)  # a batch that fails never completes: forgotten once its predicted end passed
        assert former.free_at_s(0.081) > 0.081 and former.free_at_s(1.0) == 1.0
        assert lost.items == fits

    asyncio.run(scenario())
