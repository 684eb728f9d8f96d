"""The ingress's request clock: a request's deadline, latency and traffic record count from when the ingress received
it (before tokenization; for an HTTP route, before its body is read), not from when it calls the model."""

from __future__ import annotations

import asyncio
import time

import pytest

from models.text_encoder import load_text_tokenizer
from placement.core.deployment_spec import parse_spec
from rayserve_apps.edge.attainment import SloAttainment
from rayserve_apps.ingress.deployment import Ingress
from rayserve_apps.ingress.request_clock import Received, received_at, receiving
from rayserve_apps.requests import RequestError

SLO_MS = 200.0
SOURCE = "package:all-minilm-l6-v2"


class TimedTokenizer:
    """The real MiniLM tokenizer, noting when each encode began."""

    def __init__(self):
        self.inner = load_text_tokenizer(SOURCE)
        self.max_length = self.inner.max_length
        self.started: list[float] = []

    def encode(self, texts, **kwargs):
        self.started.append(time.monotonic())
        return self.inner.encode(texts, **kwargs)


class AnsweringBackend:
    """A backend that answers at once, keeping the deadline each call was given."""

    def __init__(self):
        self.deadlines: list[float] = []

    async def call(self, model, method, payload, deadline, options):
        self.deadlines.append(deadline)
        return [[0.0, 1.0] for _ in payload]


class Records:
    def __init__(self):
        self.records = []

    def add(self, record) -> None:
        self.records.append(record)


@pytest.fixture
def ingress():
    """The ingress's own class (not Serve's ASGI wrapper around it) with its request path: spec, tokenizer,
    attainment, traffic records; the backend answers at once."""
    ingress = object.__new__(Ingress.func_or_class.__mro__[1])
    ingress.spec = parse_spec({"models": [{"name": "minilm", "kind": "text", "source": SOURCE, "slo_ms": SLO_MS}]})
    ingress.tokenizers = {"minilm": TimedTokenizer()}
    ingress.text_limits = {"minilm": 128}
    ingress.attainment = SloAttainment()
    ingress.backend = AnsweringBackend()
    ingress.traffic = Records()
    return ingress


def test_a_handle_call_is_timed_from_its_start_tokenization_included(ingress):
    wall_before = time.time()
    answer = asyncio.run(ingress.embed("minilm", ["a first passage", "a second one"]))
    assert len(answer["embeddings"]) == 2
    (tokenized_s,) = ingress.tokenizers["minilm"].started
    (deadline_s,) = ingress.backend.deadlines
    # The clock started before the texts were tokenized (not when the model is called, in `_call`).
    assert deadline_s - SLO_MS / 1e3 <= tokenized_s
    (record,) = ingress.traffic.records
    assert record.outcome == "ok" and record.slo_met and wall_before <= record.arrival_s


def test_an_http_route_is_timed_from_its_arrival(ingress):
    async def route() -> Received:
        with receiving(Received.now()) as received:
            await asyncio.sleep(0.05)  # reading and parsing the body
            await ingress.embed("minilm", ["a passage"])
            return received

    received = asyncio.run(route())
    assert ingress.backend.deadlines == [received.monotonic_s + SLO_MS / 1e3]
    (record,) = ingress.traffic.records
    assert record.arrival_s == received.wall_s
    assert record.latency_ms >= 50.0  # the body's read counts


def test_the_answer_carries_the_latency_the_ingress_counted(ingress):
    async def client() -> tuple[dict, float]:
        sent = time.monotonic()
        await asyncio.sleep(0.03)  # the way to the ingress, which the ingress does not see
        with receiving(Received.now()):
            await asyncio.sleep(0.05)  # reading and parsing the body, which it counts
            answer = await ingress.embed("minilm", ["a passage"])
        await asyncio.sleep(0.02)  # the way back
        return answer, (time.monotonic() - sent) * 1e3

    answer, client_ms = asyncio.run(client())
    (record,) = ingress.traffic.records
    # What the records hold (and the SLO attainment counts), measured as the model answered; the client's latency
    # less it is the way to the ingress and back (`controller.calibration.client_round_trip_ms`).
    assert 50.0 <= record.latency_ms <= answer["ingress_latency_ms"] <= client_ms - 50.0


def test_a_handle_call_stamped_with_its_send_time_is_timed_from_it(ingress):
    sent_s = time.time() - 0.08  # the client sent it 80 ms ago
    called = time.monotonic()
    answer = asyncio.run(ingress.embed("minilm", ["a passage"], sent_at_s=sent_s))
    (record,) = ingress.traffic.records
    (deadline_s,) = ingress.backend.deadlines
    assert record.arrival_s == pytest.approx(sent_s, abs=1e-3)
    assert deadline_s - SLO_MS / 1e3 <= called - 0.08 + 1e-3  # the way to the ingress spent part of the SLO
    assert 80.0 <= record.latency_ms <= answer["ingress_latency_ms"]


@pytest.mark.parametrize("ahead_s, accepted", [(0.5, True), (5.0, False), (-7200.0, False), (float("nan"), False)])
def test_a_send_time_the_clocks_cannot_explain_is_refused_naming_the_argument(ingress, ahead_s, accepted):
    call = ingress.embed("minilm", ["a passage"], sent_at_s=time.time() + ahead_s)
    if accepted:  # a client's clock slightly ahead: timed from the arrival
        assert 0.0 <= asyncio.run(call)["ingress_latency_ms"] < 500.0
        return
    with pytest.raises(RequestError) as refused:
        asyncio.run(call)
    assert refused.value.status_code == 422 and refused.value.field == "sent_at_s"
    assert ingress.traffic.records == [] and ingress.backend.deadlines == []  # nothing reached a model


@pytest.mark.parametrize("scale, text", [(1.0, "t={:.3f}"), (1e3, "t={:.0f}"), (1e6, "t={:.0f}"), (1.0, "{:.6f}")])
def test_x_request_start_reads_seconds_milliseconds_and_microseconds(scale, text):
    sent_s = time.time() - 0.25
    received = Received.from_header(text.format(sent_s * scale))
    assert received.wall_s == pytest.approx(sent_s, abs=2e-3)
    assert received.elapsed_ms() >= 248.0
    assert Received.from_header(None).elapsed_ms() < 50.0
    with pytest.raises(RequestError) as bad:
        Received.from_header("t=12:00")
    assert bad.value.status_code == 400 and bad.value.field == "X-Request-Start"


def test_each_route_keeps_its_own_clock_and_a_handle_call_starts_a_new_one():
    async def route(delay_s: float) -> tuple[Received, Received]:
        await asyncio.sleep(delay_s)
        with receiving(Received.now()) as received:
            await asyncio.sleep(0.02)  # the other route starts meanwhile
            return received, received_at()

    async def both():
        return await asyncio.gather(route(0.0), route(0.01))

    (first, seen_first), (second, seen_second) = asyncio.run(both())
    assert seen_first is first and seen_second is second and first != second
    outside = received_at()
    assert outside not in (first, second) and outside.monotonic_s >= second.monotonic_s
