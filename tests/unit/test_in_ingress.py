"""`models[].in_ingress`: where the ingress sends a text model's requests (its engine in the ingress process, or its
own deployment) and what the ingress replica reserves for the engines it hosts. Stand-in engines and handles; the
live path is in tests/integration/test_local_config.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from placement.core.deployment_spec import parse_spec
from rayserve_apps.app import ingress_actor_options, ingress_device_resource
from rayserve_apps.ingress.backends import TEXT_METHOD, ModelDeploymentBackend

MINILM = {"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2", "num_cpus_per_replica": 0.5}


class _Engine:
    def __init__(self):
        self.queued = 0
        self.in_flight = 0


class _LocalServer:
    """Stands for a `TextModelServer` in the ingress: answers each request with ("here", payload)."""

    def __init__(self):
        self.engine = _Engine()
        self.budgets: list[float] = []

    async def embed_batch(self, model, requests, budgets_s):
        self.budgets.extend(budgets_s)
        return [ValueError("token_ids[0] is empty") if payload == "bad" else ("here", payload) for payload in requests]


class _Method:
    def __init__(self, release: asyncio.Event):
        self.release = release
        self.calls: list[list] = []

    def remote(self, model, payloads, budgets_s):
        self.calls.append(list(payloads))

        async def answer():
            await self.release.wait()
            return [("deployment", payload) for payload in payloads]

        return answer()


class _Handle:
    """Stands for the model deployment's handle: `embed_batch` calls wait until `release` is set."""

    def __init__(self):
        self.release = asyncio.Event()
        self.embed_batch = _Method(self.release)


def test_always_runs_every_request_in_the_ingress_and_raises_a_requests_own_error():
    async def scenario():
        server = _LocalServer()
        backend = ModelDeploymentBackend({}, {"minilm"}, {"minilm": server})
        server.engine.in_flight = 3  # busy or not, there is nowhere else to go
        deadline = time.monotonic() + 1.0
        assert await backend.call("minilm", TEXT_METHOD, "a", deadline, {}) == ("here", "a")
        assert 0.9 < server.budgets[0] <= 1.0  # what is left of the SLO
        with pytest.raises(ValueError, match="empty"):
            await backend.call("minilm", TEXT_METHOD, "bad", deadline, {})
        assert backend.serves("minilm") and backend.describe()["in_ingress"] == ["minilm"]

    asyncio.run(scenario())


def test_when_idle_runs_a_lone_request_in_the_ingress_and_load_in_the_deployment():
    async def scenario():
        server, handle = _LocalServer(), _Handle()
        backend = ModelDeploymentBackend({"minilm": handle}, {"minilm"}, {"minilm": server})
        deadline = time.monotonic() + 1.0
        assert await backend.call("minilm", TEXT_METHOD, "lone", deadline, {}) == ("here", "lone")
        # The ingress's engine is busy: the next request goes to the deployment ...
        server.engine.in_flight = 1
        first = asyncio.ensure_future(backend.call("minilm", TEXT_METHOD, "first", deadline, {}))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        # ... and while that call is on its way, so does the next, though the ingress's engine is idle again.
        server.engine.in_flight = 0
        second = asyncio.ensure_future(backend.call("minilm", TEXT_METHOD, "second", deadline, {}))
        await asyncio.sleep(0)
        handle.release.set()
        assert await first == ("deployment", "first") and await second == ("deployment", "second")
        # Nothing in flight any more: the next lone request runs in the ingress again.
        assert await backend.call("minilm", TEXT_METHOD, "later", deadline, {}) == ("here", "later")
        server.engine.queued = 2
        assert await backend.call("minilm", TEXT_METHOD, "queued", deadline, {}) == ("deployment", "queued")
        assert [p for call in handle.embed_batch.calls for p in call] == ["first", "second", "queued"]

    asyncio.run(scenario())


def test_the_ingress_reserves_the_cpus_of_always_models_and_the_device_share_of_both_modes():
    spec = parse_spec({"serving": {"num_cpus_ingress": 0.25},
                       "models": [{**MINILM, "in_ingress": "always"},
                                  {**MINILM, "name": "lone", "in_ingress": "when_idle"},
                                  {**MINILM, "name": "own"}]})
    assert ingress_actor_options(spec)["num_cpus"] == pytest.approx(0.75)
    assert "num_gpus" not in ingress_actor_options(spec) and ingress_device_resource(spec) == "CPU"
    on_gpus = parse_spec({"cluster": {"device_resource": "GPU"},
                          "models": [{**MINILM, "in_ingress": "when_idle", "device_share_per_replica": 0.2},
                                     {**MINILM, "name": "own", "device_share_per_replica": 0.3}]})
    assert ingress_actor_options(on_gpus)["num_gpus"] == pytest.approx(0.2)
    assert ingress_device_resource(on_gpus) == "GPU"
