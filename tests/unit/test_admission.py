"""The ingress's gate with turns that follow the load (`rayserve_apps/edge/admission.py`): the turns from the
measured answer rate and the SLO, the wait for a turn bounded by the request's clock, the refusal before the body is
read, and the gate's own clock stamp. A stand-in clock; no test times anything."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from rayserve_apps.edge.admission import MIN_TURNS, PEAK_HOLD_S, Admission, AdmissionGate, AnswerRate, stamped_age_s


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def following(running: int = 64, waiting: int = 64, clock: Clock | None = None, **slos: float) -> Admission:
    admission = Admission(clock=clock or Clock())
    admission.configure(running, waiting, 1.0, slo_s_by_model=slos or {"minilm": 1.0}, turns_slo_fraction=0.5,
                        wait_slo_fraction=0.25)
    return admission


def test_the_answer_rate_counts_the_last_window():
    rate = AnswerRate(window_s=2.0)
    for k in range(40):
        rate.add(10.0 + k * 0.05)  # 40 answers over 2 s
    assert rate.per_s(11.99) == pytest.approx(20.0)
    assert rate.per_s(12.99) == pytest.approx(10.0)  # half of them left the window
    assert rate.per_s(20.0) == 0.0
    with pytest.raises(ValueError, match="window_s"):
        AnswerRate(0.0)


def test_the_turns_are_the_answer_rate_times_the_slos_share_within_their_bounds():
    clock = Clock()
    admission = following(running=128, clock=clock, minilm=1.0, fast=0.2)
    assert admission.turns(1.0, clock.now) == MIN_TURNS  # nothing answered yet: the floor
    for k in range(400):  # 200 answers/s over the window
        clock.now = 100.0 + k * 0.005
        admission.answered(200)
        admission.answered(503)  # refusals are not answers
    assert admission.turns(1.0, clock.now) == 100  # 200/s x 1 s x 0.5
    assert admission.turns(admission.slo_s("/v1/models/fast/embed"), clock.now) == 20
    assert admission.slo_s("/v1/embeddings") == 1.0 and admission.slo_s("/v2/models/fast/infer") == 0.2
    small = following(running=20, clock=clock)
    for _ in range(400):
        small.answered(200)
    assert small.turns(1.0, clock.now) == 20  # never past ingress_max_ongoing_requests
    fixed = Admission()
    fixed.configure(32, 16, 1.0)
    assert not fixed.follows_load and fixed.turns(1.0, 0.0) == 32 and fixed.wait_until_s(1.0, 0.0) is None
    with pytest.raises(ValueError, match="turns_slo_fraction"):
        Admission().configure(8, 8, 1.0, turns_slo_fraction=1.5)


def test_the_turns_keep_the_highest_recent_rate_for_a_while():
    clock = Clock()
    admission = following(running=128, clock=clock)
    for k in range(400):  # 200 answers/s for 2 s
        clock.now = 100.0 + k * 0.005
        admission.answered(200)
    assert admission.turns(1.0, clock.now) == 100
    clock.now += 3.0  # no answers since: the rate is 0, the peak holds
    assert admission.answers.per_s(clock.now) == 0.0 and admission.turns(1.0, clock.now) == 100
    clock.now += PEAK_HOLD_S  # a lasting change: back to the floor
    assert admission.turns(1.0, clock.now) == MIN_TURNS


def test_the_wait_for_a_turn_counts_from_the_requests_clock():
    admission = following()
    assert admission.wait_until_s(1.0, now_s=100.0) == pytest.approx(100.25)
    assert admission.wait_until_s(1.0, now_s=100.0, age_s=0.2) == pytest.approx(100.05)  # 0.2 s in HAProxy's queue
    assert stamped_age_s(b"t=1700000000000000", now_wall_s=1700000000.5) == pytest.approx(0.5)  # microseconds
    assert stamped_age_s(b"1700000000000", now_wall_s=1700000000.25) == pytest.approx(0.25)  # milliseconds
    assert stamped_age_s(b"t=1700000002", now_wall_s=1700000000.0) == 0.0  # ahead of this clock: from now
    assert stamped_age_s(b"t=soon", 1.0) is None and stamped_age_s(None, 1.0) is None


def gated_app(admission: Admission):
    """A FastAPI app behind the gate: `/v1/models/minilm/embed` holds until released and reports the clock stamp it
    saw; `/read` counts the bodies read."""
    app = FastAPI()
    app.add_middleware(AdmissionGate, admission=admission)
    state = {"release": asyncio.Event(), "inside": 0, "bodies": 0, "stamps": []}

    @app.post("/v1/models/{name}/embed")
    async def embed(name: str, request: Request):
        state["bodies"] += 1
        await request.body()
        state["stamps"].append(request.headers.get("x-request-start"))
        state["inside"] += 1
        await state["release"].wait()
        state["inside"] -= 1
        return {"model": name}

    return app, state


def test_a_request_that_cannot_start_within_its_share_of_the_slo_is_refused_before_its_body_is_read():
    admission = following(running=2, waiting=8)  # two turns (the floor, capped by running)
    app, state = gated_app(admission)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            url = "/v1/models/minilm/embed"
            held = [asyncio.create_task(http.post(url, json={"texts": ["x"]})) for _ in range(2)]
            while state["inside"] < 2:
                await asyncio.sleep(0)
            # Stamped 0.3 s ago (HAProxy's queue): past the 0.25 x 1 s it may wait, with no turn free.
            import time

            stale = f"t={round((time.time() - 0.3) * 1e6)}"
            refused = await http.post(url, json={"texts": ["x"]}, headers={"X-Request-Start": stale})
            bodies_after_refusal = state["bodies"]
            # A fresh request waits for a turn (its budget is far off on this SLO) and runs when one frees.
            admission.slo_s_by_model["minilm"] = 1000.0
            waiting = asyncio.create_task(http.post(url, json={"texts": ["y"]}))
            while admission.in_flight < 3:
                await asyncio.sleep(0)
            assert admission.holding == 2 and state["bodies"] == 2
            state["release"].set()
            answers = await asyncio.gather(*held, waiting)
            return refused, bodies_after_refusal, answers

    refused, bodies_after_refusal, answers = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "overloaded"
    assert refused.headers["retry-after"] == "1" and "ingress_turns_slo_fraction" in refused.json()["error"]["message"]
    assert bodies_after_refusal == 2  # refused before its body was read
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert admission.in_flight == 0 and admission.holding == 0
    assert admission.answers.per_s(admission.clock()) == pytest.approx(3 / 2.0)  # three 200s in the window
    # Requests without a stamp get the gate's, so that the wait for a turn counts in their clock.
    assert all(stamp is not None and stamp.startswith("t=") for stamp in state["stamps"])


def test_turns_freed_go_to_the_waiters_in_arrival_order():
    admission = Admission()
    admission.configure(1, 4, 1.0)  # fixed turns: waits without a time bound
    order: list[int] = []

    async def scenario():
        release = asyncio.Event()

        async def job(k: int):
            async def call():
                order.append(k)
                if k == 0:
                    await release.wait()
            assert await admission.run(call)

        tasks = [asyncio.create_task(job(k)) for k in range(3)]
        while admission.in_flight < 3:
            await asyncio.sleep(0)
        assert admission.holding == 1 and order == [0]
        release.set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert order == [0, 1, 2] and admission.holding == 0 and admission.in_flight == 0
