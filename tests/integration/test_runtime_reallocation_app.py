"""Arlo's periodic re-allocation in a real plexserve application (Ray Serve, real MiniLM runtimes).

One polymorphing model starts with a 16-token and a 64-token runtime replica. Only long texts arrive, so at the
end of an allocation period the controller re-solves Arlo's Eq. 1-7, moves the short replica to the long runtime
through a declarative config update while requests keep flowing (none fails), and a restarted controller adopts
the allocation from Serve's config. A text longer than the longest runtime is refused at the ingress (413).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import requests
from conftest import restart_controller
from ray import serve
from waiting import wait_until

from placement.core.deployment_spec import parse_spec
from rayserve_apps.control.live_update import application_config, apply_config, deployed_overrides

pytestmark = pytest.mark.ray

SHORT, LONG = 16, 64
#: Runtime capacities within the SLO (Arlo M_i): set by hand for the test (a short runtime serves more).
CAPACITIES = {SHORT: 40, LONG: 20}
ALLOCATION_PERIOD_S = 8.0
TIMEOUT_S = 120
#: A text of about 40 tokens: only the long runtime fits it.
LONG_TEXT = " ".join(["serving transformer models on shared devices"] * 6)
#: Pause between two requests of the traffic thread (a few requests per second: well within both capacities).
TRAFFIC_GAP_S = 0.2


@pytest.fixture(scope="module")
def app(ray_serve):
    port = int(ray_serve.rsplit(":", 1)[1])
    spec = parse_spec({
        "models": [{"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2", "num_cpus_per_replica": 0.5,
                    "slo_ms": 1000,
                    "policies": {"polymorphing": {"name": "arlo", "params": {
                        "capacities": CAPACITIES, "backend": "eager", "routing_stats_period_s": 0.5,
                        "allocation_period_s": ALLOCATION_PERIOD_S}}}}],
        "controller": {"period_s": 2, "stats_report_period_s": 0.5},
    })
    apply_config([application_config(spec)], {"host": "127.0.0.1", "port": port})
    yield {"url": ray_serve, "controller": serve.get_deployment_handle("PlacementController", app_name="plexserve"),
           "model": serve.get_deployment_handle("model-minilm", app_name="plexserve")}


def embed(app, text: str) -> requests.Response:
    return requests.post(f"{app['url']}/v1/models/minilm/embed", json={"texts": [text]}, timeout=TIMEOUT_S)


def runtimes(app) -> dict:
    state = app["controller"].state.remote().result(timeout_s=TIMEOUT_S)["runtimes"]["minilm"]
    return {"assignment": {int(k): v for k, v in state["assignment"].items()}, "version": state["version"]}


def test_controller_starts_from_the_builders_allocation(app):
    assert runtimes(app) == {"assignment": {0: SHORT, 1: LONG}, "version": 0}
    response = embed(app, LONG_TEXT)
    assert response.status_code == 200 and len(response.json()["embeddings"][0]) == 384


def test_text_longer_than_the_longest_runtime_gets_413_naming_the_limit(app):
    response = embed(app, LONG_TEXT * 3)  # ~120 tokens: within MiniLM's 256 but beyond the 64-token runtime
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["field"] == "texts[0]" and f"at most {LONG} tokens" in error["message"]


def test_long_traffic_moves_the_short_replica_to_the_long_runtime_without_failures(app):
    statuses: Counter = Counter()
    stop = threading.Event()

    def traffic() -> None:
        while not stop.wait(TRAFFIC_GAP_S):
            statuses[embed(app, LONG_TEXT).status_code] += 1

    def applied() -> list[dict]:
        history = app["controller"].history.remote().result(timeout_s=TIMEOUT_S)
        return [d for d in history if d.get("duty") == "runtime_allocation" and d["outcome"] == "applied"]

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        # Logged once Serve runs the new allocation.
        decisions = wait_until(applied, 6 * ALLOCATION_PERIOD_S + 120, interval_s=1.0,
                               message="no runtime allocation applied")
        time.sleep(2)  # requests keep flowing after the replicas' runtime swap
    finally:
        stop.set()
        thread.join(TIMEOUT_S)
    assert set(statuses) == {200}, statuses
    assert len(decisions) == 1 and decisions[0]["model"] == "minilm"
    assert runtimes(app) == {"assignment": {0: LONG, 1: LONG}, "version": 1}
    assert {int(k): v for k, v in decisions[0]["allocation"]["counts"].items()} == {SHORT: 0, LONG: 2}
    (override,) = [o for o in deployed_overrides("plexserve") if o["name"] == "model-minilm"]
    assert override["num_replicas"] == 2 and override["user_config"]["version"] == 1
    # Both replicas now run the long runtime: even a short text is served by it (once routing stats carry the swap).
    served: set = set()

    def served_by_long_only() -> bool:
        served.clear()
        served.update(app["model"].embed_with_runtime.remote([[101, 2000, 102]])
                      .result(timeout_s=60)["served_by_max_length_tokens"] for _ in range(4))
        return served == {LONG}

    wait_until(served_by_long_only, 60, interval_s=1.0, message=lambda: f"short texts served by {served}")


def test_restarted_controller_adopts_the_running_allocation(app):
    before = runtimes(app)
    state = restart_controller(app["controller"])
    assert state["recovered"]
    assert {int(k): v for k, v in state["runtimes"]["minilm"]["assignment"].items()} == before["assignment"]
    assert state["runtimes"]["minilm"]["version"] == before["version"]


def test_latency_over_95_percent_of_the_slo_adds_a_replica_with_the_longest_runtime(app):
    # The same application re-deployed with one replica, a 5 ms SLO (every MiniLM request takes longer) and
    # target tracking up to two replicas; the periodic re-allocation is kept out of the way (one-hour period).
    port = int(app["url"].rsplit(":", 1)[1])
    params = {"capacities": CAPACITIES, "initial_counts": {LONG: 1}, "backend": "eager", "routing_stats_period_s": 0.5,
              "allocation_period_s": 3600, "autoscaling": {"scale_out_cooldown_s": 0, "max_instances": 2}}
    spec = parse_spec({
        "models": [{"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2", "num_cpus_per_replica": 0.5,
                    "slo_ms": 5, "policies": {"polymorphing": {"name": "arlo", "params": params}}}],
        "controller": {"period_s": 2, "stats_report_period_s": 0.5},
    })
    apply_config([application_config(spec)], {"host": "127.0.0.1", "port": port})
    statuses: Counter = Counter()
    scaled: list = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not scaled:
        for _ in range(5):
            statuses[embed(app, LONG_TEXT).status_code] += 1
        history = app["controller"].history.remote().result(timeout_s=TIMEOUT_S)
        scaled = [d for d in history if d.get("duty") == "autoscaling" and d["outcome"] == "applied"]
    assert set(statuses) == {200}, statuses  # late answers are still answers
    assert scaled and scaled[0]["scaling"]["action"] == "scale_out" and scaled[0]["scaling"]["p98_s"] >= 0.95 * 0.005
    (override,) = [o for o in deployed_overrides("plexserve") if o["name"] == "model-minilm"]
    assert override["num_replicas"] == 2
    assert {int(k): v for k, v in override["user_config"]["assignment"].items()} == {0: LONG, 1: LONG}
    def running() -> int:
        return serve.status().applications["plexserve"].deployments["model-minilm"].replica_states.get("RUNNING", 0)

    wait_until(lambda: running() == 2, 120, interval_s=1.0, message=lambda: f"{running()} minilm replicas running")
