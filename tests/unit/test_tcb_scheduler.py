"""Batch schedulers of TCB §5 (placement/tcb/batch_scheduler.py) and their replay on a simulated clock."""

from __future__ import annotations

import random

import pytest

from placement.tcb.batch_scheduler import (
    BatchingParams,
    TextRequest,
    das_rows,
    make_batch_scheduler,
    parse_batching_params,
)
from placement.tcb.trace_replay import replay

ALL = ["das", "slotted_das", "fcfs", "sjf", "edf"]


def _queue(count: int, seed: int = 0, now: float = 0.0) -> list[TextRequest]:
    rng = random.Random(seed)
    return [TextRequest(request_id=i, length_tokens=rng.randint(3, 60), arrival_s=now - rng.random(),
                        deadline_s=now + rng.random()) for i in range(count)]


@pytest.mark.parametrize("name", ALL)
def test_rows_respect_capacity_and_take_each_request_once(name):
    scheduler = make_batch_scheduler(name, {"row_length_tokens": 100, "num_rows": 4})
    queue = _queue(60)
    decision = scheduler.form_batch(0.0, queue)
    assert len(decision.rows) <= 4
    assert all(sum(r.length_tokens for r in row) <= 100 for row in decision.rows)
    ids = [r.request_id for r in decision.requests]
    assert len(ids) == len(set(ids)) and ids
    if decision.slots is not None:
        z = decision.slot_size_tokens
        assert all(sum(r.length_tokens for r in slot) <= z for slot in decision.slots)
        assert sorted(r.request_id for s in decision.slots for r in s) == sorted(ids)
        assert len(decision.slots) <= 4 * (100 // z)
    remaining = decision.remaining(queue)
    assert len(remaining) + len(ids) == len(queue)


@pytest.mark.parametrize("name", ALL)
def test_requests_past_deadline_are_dropped_and_counted(name):
    scheduler = make_batch_scheduler(name, {"row_length_tokens": 100, "num_rows": 2})
    late = TextRequest("late", 5, arrival_s=0.0, deadline_s=0.9)
    fine = TextRequest("fine", 5, arrival_s=0.0, deadline_s=2.0)
    decision = scheduler.form_batch(1.0, [late, fine])
    assert [r.request_id for r in decision.dropped] == ["late"]
    assert [r.request_id for r in decision.requests] == ["fine"]
    assert decision.remaining([late, fine]) == []


def test_start_allowance_drops_requests_that_cannot_finish():
    scheduler = make_batch_scheduler("das", {"start_allowance_ms": 200})
    request = TextRequest(1, 5, arrival_s=0.0, deadline_s=1.1)
    assert scheduler.form_batch(1.0, [request]).dropped == [request]


def test_das_all_fit_goes_into_one_row():
    queue = _queue(5)
    rows = das_rows(queue, num_rows=4, row_length_tokens=1000, eta=0.5, q=0.5).rows
    assert len(rows) == 1 and len(rows[0]) == 5


def test_das_eta_q_split():
    """TCB Alg. 1: the p = eta * s highest-utility requests go in; then the deadline-aware set by deadline."""
    # Ten requests of 10 tokens fill a row of 100 (s = 10); eta = 0.3 takes the 3 shortest first.
    short = [TextRequest(f"s{i}", 10 - i % 2, arrival_s=0.0, deadline_s=50.0 + i) for i in range(12)]
    # Utility 1/12 >= q * mean utility of the dominant set: in the deadline-aware set, and urgent.
    urgent = [TextRequest(f"u{i}", 12, arrival_s=0.0, deadline_s=1.0 + i) for i in range(3)]
    # Utility 1/40 < q * v_bar: never in the deadline-aware set, however urgent.
    long_urgent = TextRequest("long", 40, arrival_s=0.0, deadline_s=0.5)
    result = das_rows(short + urgent + [long_urgent], num_rows=1, row_length_tokens=100, eta=0.3, q=0.7)
    row_ids = [r.request_id for r in result.rows[0]]
    dominant = result.utility_dominant[0]
    assert len(dominant) == 3 and all(r.length_tokens == 9 for r in dominant)
    assert row_ids[:3] == [r.request_id for r in dominant]
    # The deadline-aware set is taken by earliest deadline: the urgent 12-token requests come right after.
    assert row_ids[3:6] == ["u0", "u1", "u2"]
    assert "long" not in row_ids
    assert sum(r.length_tokens for r in result.rows[0]) <= 100
    # With eta = 0.9 the dominant set already fills most of the row with short requests.
    result = das_rows(short + urgent + [long_urgent], num_rows=1, row_length_tokens=100, eta=0.9, q=0.1)
    assert len(result.utility_dominant[0]) == 9


def test_das_prefers_utility_over_fcfs():
    """A full queue: DAS packs more requests (more utility) into a batch than arrival order does."""
    rng = random.Random(4)
    queue = [TextRequest(i, rng.choice([4, 60]), arrival_s=i * 0.001, deadline_s=10.0) for i in range(80)]
    params = {"row_length_tokens": 128, "num_rows": 4}
    das = make_batch_scheduler("das", params).form_batch(0.1, queue)
    fcfs = make_batch_scheduler("fcfs", params).form_batch(0.1, queue)
    assert das.utility > fcfs.utility


def test_slotted_das_slot_size_from_utility_dominant_set():
    queue = [TextRequest(i, length, arrival_s=0.0, deadline_s=5.0)
             for i, length in enumerate([5, 6, 7, 20, 30, 40] * 6)]
    scheduler = make_batch_scheduler("slotted_das",
                                     {"row_length_tokens": 64, "num_rows": 2, "slot_granularity_tokens": 4})
    decision = scheduler.form_batch(0.0, queue)
    dominant = das_rows(queue, 2, 64, 0.5, 0.5).utility_dominant
    longest = max(r.length_tokens for group in dominant for r in group)
    assert decision.slot_size_tokens == 4 * -(-longest // 4)
    assert all(r.length_tokens <= decision.slot_size_tokens for r in decision.requests)


def test_fixed_slot_size_for_ordered_schedulers():
    scheduler = make_batch_scheduler("fcfs", {"row_length_tokens": 64, "num_rows": 2, "slot_size_tokens": 32})
    decision = scheduler.form_batch(0.0, [TextRequest(i, 20, 0.0, 5.0) for i in range(10)])
    assert decision.slot_size_tokens == 32 and len(decision.slots) == 4 and len(decision.requests) == 4


@pytest.mark.parametrize("name", ["fcfs", "sjf", "edf"])
def test_order_of_ordered_schedulers(name):
    queue = [TextRequest("a", 30, arrival_s=0.0, deadline_s=9.0), TextRequest("b", 10, arrival_s=0.1, deadline_s=8.0),
             TextRequest("c", 20, arrival_s=0.2, deadline_s=1.0)]
    decision = make_batch_scheduler(name, {"row_length_tokens": 30, "num_rows": 1}).form_batch(0.5, queue)
    expected = {"fcfs": ["a"], "sjf": ["b", "c"], "edf": ["c", "b"]}[name]
    assert [r.request_id for r in decision.requests] == expected


def test_oversize_request_names_request_and_limit():
    scheduler = make_batch_scheduler("das", {"row_length_tokens": 50})
    with pytest.raises(ValueError, match=r"request 'big' has 51 tokens, more than row_length_tokens=50"):
        scheduler.form_batch(0.0, [TextRequest("big", 51, 0.0, 1.0)])


def test_params_are_validated_by_field():
    with pytest.raises(ValueError, match="q: eta \\+ q must equal 1"):
        parse_batching_params({"eta": 0.7, "q": 0.7})
    with pytest.raises(ValueError, match="num_rows"):
        parse_batching_params({"num_rows": 0})
    with pytest.raises(ValueError, match="row_lenght_tokens"):
        parse_batching_params({"row_lenght_tokens": 10})
    with pytest.raises(ValueError, match="unknown batching policy name 'lifo'"):
        make_batch_scheduler("lifo")
    assert parse_batching_params({"eta": 0.25, "q": 0.75}) == BatchingParams(eta=0.25, q=0.75)


def test_replay_accounts_for_every_request():
    rng = random.Random(7)
    now, trace = 0.0, []
    for i in range(300):
        now += rng.expovariate(400.0)
        trace.append(TextRequest(i, max(3, min(100, int(rng.gauss(20, 10)))), arrival_s=now, deadline_s=now + 0.1))
    for name in ALL:
        scheduler = make_batch_scheduler(name, {"row_length_tokens": 128, "num_rows": 2})
        result = replay(trace, scheduler, lambda decision: 0.05)
        assert result.completed + result.late + result.dropped + result.unserved == len(trace), name
        assert result.dropped > 0  # overloaded: 400 req/s x 20 tokens > 256 tokens / 50 ms
        assert 0 < result.utility <= sum(r.utility for r in trace)


def test_slotted_das_backfill_fills_slot_room():
    """Rows that DAS filled for L tokens leave room once cut into slots; backfill gives it to waiting requests."""
    queue = [TextRequest(i, length, arrival_s=0.0, deadline_s=5.0)
             for i, length in enumerate([6, 6, 7, 7, 9, 9, 10, 10] * 4)]
    base = {"row_length_tokens": 32, "num_rows": 2, "slot_granularity_tokens": 4}
    plain = make_batch_scheduler("slotted_das", {**base, "backfill_slots": False}).form_batch(0.0, queue)
    filled = make_batch_scheduler("slotted_das", {**base, "backfill_slots": True}).form_batch(0.0, queue)
    assert plain.slot_size_tokens == filled.slot_size_tokens
    assert filled.num_tokens >= plain.num_tokens and len(filled.requests) >= len(plain.requests)
    z = filled.slot_size_tokens
    assert all(sum(r.length_tokens for r in slot) <= z for slot in filled.slots)
    ids = [r.request_id for r in filled.requests]
    assert len(ids) == len(set(ids))


def test_paper_slotted_das_keeps_the_unrounded_slot_size_and_leaves_slot_room_empty():
    """TCB Alg. 2 as published (§5.3): z is the longest request of the utility-dominant sets (5 tokens here, where
    a granularity of 8 rounds it to 8), each 32-token row is cut into 32 // 5 = 6 slots, and only the requests DAS
    put in a row are placed, so slot room no DAS request fits stays empty. These are also the defaults."""
    queue = [TextRequest(i, length, arrival_s=0.0, deadline_s=5.0) for i, length in enumerate([3, 5, 7, 7] * 8)]
    paper = BatchingParams.paper(row_length_tokens=32, num_rows=2)
    assert (paper.slot_granularity_tokens, paper.backfill_slots) == (1, False)
    decision = make_batch_scheduler("slotted_das", paper).form_batch(0.0, queue)
    dominant = das_rows(queue, 2, 32, 0.5, 0.5)
    assert decision.slot_size_tokens == max(r.length_tokens for g in dominant.utility_dominant for r in g) == 5
    assert len(decision.slots) <= 2 * (32 // 5)
    assert all(sum(r.length_tokens for r in slot) <= 5 for slot in decision.slots)
    in_rows = {r.request_id for row in dominant.rows for r in row}
    assert {r.request_id for r in decision.requests} <= in_rows
    assert BatchingParams(row_length_tokens=32, num_rows=2) == paper  # the paper's values are the defaults
    rounded = make_batch_scheduler("slotted_das", BatchingParams(row_length_tokens=32, num_rows=2,
                                                                 slot_granularity_tokens=8)).form_batch(0.0, queue)
    assert rounded.slot_size_tokens == 8


# ---- a formed batch cut to its deadlines (placement/tcb/deadline_fit.py, AlpaServe §6.5) ----

def _call(arrival_s: float, deadlines_s: list[float], texts: int = 2, tokens: int = 10) -> list[TextRequest]:
    """One call from the ingress: `texts` texts per client request, one request per deadline."""
    return [TextRequest(f"{arrival_s}/{d}/{k}", tokens, arrival_s=arrival_s, deadline_s=d)
            for d in deadlines_s for k in range(texts)]


def _per_token(seconds: float):
    return lambda tokens: seconds * tokens


def test_deadline_fit_keeps_the_calls_whose_batch_ends_in_time_and_queues_the_rest():
    from placement.tcb.deadline_fit import fit_to_deadlines

    early, later = _call(0.0, [1.0]), _call(0.1, [1.1])  # 20 tokens each, 0.02 s per token: 0.4 s per call
    queue = early + later
    decision = make_batch_scheduler("das", {"row_length_tokens": 100}).form_batch(0.5, queue)
    assert len(decision.requests) == 4  # the scheduler takes both calls: together they would end at 1.3 s
    cut = fit_to_deadlines(decision, queue, 0.5, _per_token(0.02))
    assert [r.request_id for r in cut.requests] == [r.request_id for r in early]
    assert cut.dropped == []
    assert cut.remaining(queue) == later  # still waiting for the next batch, not dropped
    assert len(fit_to_deadlines(decision, queue, 0.5, _per_token(0.01)).requests) == 4  # both end at 0.9 s


def test_deadline_fit_drops_a_request_that_cannot_finish_even_alone_with_its_queued_texts():
    from placement.tcb.deadline_fit import fit_to_deadlines

    call = _call(0.0, [0.6, 2.0], texts=3)  # two client requests of 3 texts in one call
    queue = call + _call(0.2, [2.2])
    decision = make_batch_scheduler("fcfs", {"row_length_tokens": 50, "num_rows": 1}).form_batch(0.5, queue)
    assert len(decision.requests) == 5  # the row holds five of the call's six texts
    cut = fit_to_deadlines(decision, queue, 0.5, _per_token(0.02))
    assert {r.deadline_s for r in cut.dropped} == {0.6} and len(cut.dropped) == 3  # the unscheduled text too
    assert {r.deadline_s for r in cut.requests} == {2.0}
    assert all(r.deadline_s != 0.6 for r in cut.remaining(queue))


def test_deadline_fit_never_splits_a_call():
    from placement.tcb.deadline_fit import fit_to_deadlines

    call = _call(0.0, [1.0, 1.5, 3.0])  # 60 tokens: 0.6 s at 0.01 s per token
    decision = make_batch_scheduler("das", {"row_length_tokens": 100}).form_batch(0.2, call)
    cut = fit_to_deadlines(decision, call, 0.2, _per_token(0.01))
    assert len(cut.requests) == 6 and cut.dropped == []  # ends at 0.8 s: every deadline met
    cut = fit_to_deadlines(decision, call, 0.5, _per_token(0.01))  # would end at 1.1 s: the first request is late
    assert {r.deadline_s for r in cut.dropped} == {1.0}
    assert {r.deadline_s for r in cut.requests} == {1.5, 3.0}  # the rest of the call runs together


def test_deadline_fit_orders_calls_of_one_deadline_by_their_arrival():
    from placement.tcb.deadline_fit import fit_to_deadlines

    first, second, third = _call(0.0, [1.0]), _call(0.1, [1.0]), _call(0.2, [1.0])  # one SLO, one deadline
    queue = first + second + third
    decision = make_batch_scheduler("fcfs", {"row_length_tokens": 100}).form_batch(0.3, queue)
    assert len(decision.requests) == 6
    cut = fit_to_deadlines(decision, queue, 0.3, _per_token(0.015))  # two calls end at 0.9 s, three at 1.2 s
    assert [r.request_id for r in cut.requests] == [r.request_id for r in first + second]
    assert cut.remaining(queue) == third
