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
    # The clock started before the texts were tokenized (it used to start after, in `_call`).
    assert deadline_s - SLO_MS / 1e3 <= tokenized_s
    (record,) = ingress.traffic.records
    assert record.outcome == "ok" and record.slo_met and wall_before <= record.arrival_s


def test_an_http_route_is_timed_from_its_arrival(ingress):
    async def route() -> Received:
        with receiving() as received:
            await asyncio.sleep(0.05)  # reading and parsing the body
            await ingress.embed("minilm", ["a passage"])
            return received

    received = asyncio.run(route())
    assert ingress.backend.deadlines == [received.monotonic_s + SLO_MS / 1e3]
    (record,) = ingress.traffic.records
    assert record.arrival_s == received.wall_s
    assert record.latency_ms >= 50.0  # the body's read counts


def test_each_route_keeps_its_own_clock_and_a_handle_call_starts_a_new_one():
    async def route(delay_s: float) -> tuple[Received, Received]:
        await asyncio.sleep(delay_s)
        with receiving() as received:
            await asyncio.sleep(0.02)  # the other route starts meanwhile
            return received, received_at()

    async def both():
        return await asyncio.gather(route(0.0), route(0.01))

    (first, seen_first), (second, seen_second) = asyncio.run(both())
    assert seen_first is first and seen_second is second and first != second
    outside = received_at()
    assert outside not in (first, second) and outside.monotonic_s >= second.monotonic_s
