"""configs/local.yaml end to end: every model answers over HTTP and through handles, as `make serve` deploys it.

The config is applied declaratively (as `serve run CONFIG` and `serve deploy` do) onto a local Ray started as
`make serve` starts it (`rayserve_apps.fast_ingress`: Serve's HAProxy ingress, every listener on 127.0.0.1), whose
CPUs stand in for the config's CPU-share devices. Text outputs equal the single-process model's; the adaptive ViT
answers with its profiled gamma and the label the unified model gives at that gamma.
"""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
import torch.nn.functional as F
import yaml
from ray import serve
from repo_paths import REPO_ROOT

from models import load_text_encoder
from models.task_registry import DIGITS_ARTIFACTS_DIR, TaskRegistry
from placement.core.deployment_spec import parse_spec
from rayserve_apps.control.live_update import apply_config
from rayserve_apps.edge.admission import MIN_TURNS

pytestmark = pytest.mark.ray

CONFIG = REPO_ROOT / "configs" / "local.yaml"
TEXTS = ["plexserve serves many transformer models", "word " * 100]


@pytest.fixture(scope="module")
def local_app(ray_serve_fast_ingress):
    ray_serve = ray_serve_fast_ingress
    config = yaml.safe_load(CONFIG.read_text())
    app = config["applications"][0]
    # Generous SLOs: this test checks answers, not deadlines, and CI machines may be busy.
    for model in app["args"]["models"]:
        model["slo_ms"] = 120_000
    apply_config([app], {"host": "127.0.0.1", "port": int(ray_serve.rsplit(":", 1)[1])})
    yield {"url": ray_serve, "spec": parse_spec(app["args"]), "handle": serve.get_app_handle(app["name"])}
    serve.delete(app["name"])


def test_every_model_is_listed_and_placed(local_app):
    models = requests.get(f"{local_app['url']}/v1/models", timeout=60).json()["models"]
    assert {m["name"] for m in models} == {"minilm", "minilm-64", "digits-vit"}
    layout = requests.get(f"{local_app['url']}/v1/placement", timeout=60).json()
    assert layout["groups"][0]["models"] == ["minilm-64"]
    assert sorted(layout["single_model_deployments"]) == ["digits-vit", "minilm"]
    assert layout["in_ingress"] == ["minilm"]


def test_a_lone_request_runs_in_the_ingress_and_a_burst_reaches_the_deployment(local_app):
    """minilm has `in_ingress: when_idle`: requests one after another never reach its text replica; requests at
    once do, and every one is answered."""
    replica = serve.get_deployment_handle("model-minilm", "plexserve")
    url = f"{local_app['url']}/v1/models/minilm/embed"
    before = replica.stats.remote().result(timeout_s=60)["texts"]
    for index in range(3):
        lone = requests.post(url, json={"texts": [f"a lone request {index}"]}, timeout=120)
        assert lone.status_code == 200, lone.text
    assert replica.stats.remote().result(timeout_s=60)["texts"] == before
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: requests.post(url, json={"texts": [f"one of a burst {i}"]}, timeout=300),
                                range(16)))
    assert [a.status_code for a in answers] == [200] * 16
    assert replica.stats.remote().result(timeout_s=60)["texts"] > before


def test_text_models_equal_the_single_process_model(local_app):
    direct = load_text_encoder()
    for model, truncate_to in (("minilm", None), ("minilm-64", 64)):
        http = requests.post(f"{local_app['url']}/v1/models/{model}/embed", json={"texts": TEXTS}, timeout=120)
        assert http.status_code == 200, http.text
        by_handle = local_app["handle"].embed.remote(model, TEXTS).result(timeout_s=120)["embeddings"]
        expected = direct.embed_token_ids(direct.text_tokenizer.encode(TEXTS, truncate_to=truncate_to))
        for served in (torch.tensor(http.json()["embeddings"]), torch.tensor(by_handle)):
            assert (F.cosine_similarity(served, expected, dim=1) >= 0.9999).all()


def test_adaptive_vit_answers_over_http_and_handle(local_app):
    from models.train_adaptive_vit import load_digits_splits

    _, held_out = load_digits_splits()
    images = held_out.images[:4]
    registry = TaskRegistry.load(DIGITS_ARTIFACTS_DIR)
    http = requests.post(f"{local_app['url']}/v1/models/digits-vit/classify", json={"images": images.tolist()},
                         timeout=120)
    assert http.status_code == 200, http.text
    by_handle = local_app["handle"].classify.remote("digits-vit", np.asarray(images).tolist()).result(timeout_s=120)
    for predictions in (http.json()["predictions"], by_handle["predictions"]):
        for prediction, image in zip(predictions, images):
            assert prediction["gamma"] in registry.gamma_list
            assert prediction["label"] == registry.predict(image[None], ["digit"], prediction["gamma"])[0]


def test_adaptive_vit_takes_task_slo_and_utility_and_names_bad_ones(local_app):
    from models.train_adaptive_vit import load_digits_splits

    _, held_out = load_digits_splits()
    url = f"{local_app['url']}/v1/models/digits-vit/classify"
    images = held_out.images[:2].tolist()
    ok = requests.post(url, json={"images": images, "task": "parity", "slo_ms": 60_000, "utility": 2.0}, timeout=120)
    assert ok.status_code == 200, ok.text
    assert {p["task"] for p in ok.json()["predictions"]} == {"parity"}
    # The SLO reaches the replica's scheduler: a deadline no batch can meet is evicted, not answered late.
    hopeless = requests.post(url, json={"images": images, "task": "parity", "slo_ms": 0.001}, timeout=60)
    assert hopeless.status_code == 503 and hopeless.json()["error"]["type"] == "deadline_unmeetable", hopeless.text
    bad_utility = requests.post(url, json={"images": images, "task": "parity", "utility": -1.0}, timeout=60)
    assert bad_utility.status_code == 422 and bad_utility.json()["error"]["field"] == "utility", bad_utility.text
    unknown = requests.post(url, json={"images": images, "task": "colour"}, timeout=60)
    assert unknown.status_code == 422 and "colour" in unknown.json()["error"]["message"]
    negative = requests.post(url, json={"images": images, "slo_ms": -1}, timeout=60)
    assert negative.status_code == 422 and negative.json()["error"]["field"] == "slo_ms"
    grouped = requests.post(f"{local_app['url']}/v1/models/minilm-64/embed", json={"texts": ["still fine"]},
                            timeout=60)
    assert grouped.status_code == 200


def test_past_the_ingress_bound_the_ingress_refuses_with_retry_after_and_nothing_fails(local_app):
    """More requests at once than the config lets wait (`ingress_max_ongoing_requests` running in the ingress plus
    `ingress_max_queued_requests` waiting for it): the ingress refuses the excess with 503 and Retry-After before
    reading their bodies, in the route's protocol's JSON error body (OpenAI's on /v1/embeddings, plexserve's on its
    own routes), every other request is answered, and the app keeps answering afterwards."""
    serving = local_app["spec"].serving
    bound = serving.ingress_max_ongoing_requests + serving.ingress_max_queued_requests
    assert serving.ingress_max_queued_requests >= 0, "local.yaml bounds what waits for the ingress"
    url = f"{local_app['url']}/v1/models/minilm/embed"

    openai_url = f"{local_app['url']}/v1/embeddings"

    def send(index: int) -> requests.Response:
        text = f"request number {index} of a burst"
        if index % 2:
            return requests.post(openai_url, json={"model": "minilm", "input": [text]}, timeout=300)
        return requests.post(url, json={"texts": [text]}, timeout=300)

    with ThreadPoolExecutor(max_workers=3 * bound) as pool:
        answers = list(pool.map(send, range(3 * bound)))
    statuses = [answer.status_code for answer in answers]
    assert set(statuses) <= {200, 503}, sorted(set(statuses))
    refused = [answer for answer in answers if answer.status_code == 503]
    # The turns follow the answer rate (at least MIN_TURNS): a burst on an idle app gets the floor's share at least.
    assert refused and statuses.count(200) >= min(MIN_TURNS, serving.ingress_max_ongoing_requests) // 2, statuses
    assert all(answer.headers.get("retry-after") == f"{serving.ingress_retry_after_s:.0f}" for answer in refused)
    for answer in refused:
        error = answer.json()["error"]
        if answer.url.endswith("/v1/embeddings"):
            assert error["type"] == "server_error" and error["code"] == "overloaded", error
        else:
            assert error["type"] == "overloaded" and set(error) == {"type", "message", "field"}, error
    assert send(-1).status_code == 200


def test_every_listener_of_the_ingress_binds_the_loopback_interface(local_app, fast_ingress_ports):
    """HAProxy's HTTP, stats and Prometheus listeners (Serve binds the last two on all interfaces;
    `rayserve_apps/haproxy_loopback.sh` moves them) listen on 127.0.0.1 only, and HAProxy answers on the HTTP one."""
    http_port = int(local_app["url"].rsplit(":", 1)[1])
    ports = {http_port, *fast_ingress_ports.values()}
    listening: dict[int, set[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # LISTEN
                address, port = local.rsplit(":", 1)
                listening.setdefault(int(port, 16), set()).add(address)
    assert ports <= set(listening), sorted(ports - set(listening))
    assert all(listening[port] == {"0100007F"} for port in ports), {port: listening[port] for port in ports}
    assert requests.get(f"{local_app['url']}/v1/models", timeout=60).status_code == 200
