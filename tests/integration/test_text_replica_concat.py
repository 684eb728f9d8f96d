"""The text replica batches with the configured TCB scheduler and runs the packed forward, end to end on Ray Serve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ray import serve

from models import load_text_encoder
from placement.core.deployment_spec import ModelSpec
from rayserve_apps.app import build_app
from rayserve_apps.engine import batching_scheduler_for

APP = "concat-test"
TEXTS = [
    "concatenated requests share a row",
    "each keeps its own positions",
    "short",
    "a block diagonal mask keeps them apart from one another in attention",
    "deadline aware scheduling picks which requests run next",
    "ok",
]
SLOTTED = {"name": "slotted_das", "params": {"num_rows": 2, "row_length_tokens": 32, "slot_granularity_tokens": 4}}


def test_batching_policy_is_validated_by_field():
    model = ModelSpec(name="m", kind="text", source="package:all-minilm-l6-v2")
    with pytest.raises(ValueError, match="policies.batching.*q: eta \\+ q must equal 1"):
        batching_scheduler_for(model, {"name": "das", "params": {"eta": 0.9, "q": 0.9}}, 256)
    with pytest.raises(ValueError, match="policies.batching.*num_rows"):
        batching_scheduler_for(model, {"name": "fcfs", "params": {"num_rows": -1}}, 256)
    with pytest.raises(ValueError, match="unknown batching policy name 'rr'"):
        batching_scheduler_for(model, {"name": "rr"}, 256)
    default = batching_scheduler_for(model, None, 256)
    assert default.name == "das" and default.params.row_length_tokens == 256
    own = ModelSpec(name="m", kind="text", source="package:all-minilm-l6-v2", policies={"batching": SLOTTED})
    assert batching_scheduler_for(own, None, 256).name == "slotted_das"


@pytest.fixture(scope="module")
def app(ray_serve):
    spec = {
        "models": [
            {"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2", "num_cpus_per_replica": 0.5,
             "batch_wait_timeout_ms": 50, "slo_ms": 60000, "policies": {"batching": SLOTTED}},
            {"name": "tight", "kind": "text", "source": "package:all-minilm-l6-v2", "num_cpus_per_replica": 0.5,
             "batch_wait_timeout_ms": 30, "slo_ms": 1,  # waits its batch wait even when idle: past its deadline
             "policies": {"batching": {"name": "das", "params": {"dispatch_when_idle": False}}}},
        ],
    }
    serve.run(build_app(spec), name=APP, route_prefix="/concat-test", blocking=False)
    yield {"minilm": serve.get_deployment_handle("model-minilm", app_name=APP),
           "tight": serve.get_deployment_handle("model-tight", app_name=APP)}
    serve.delete(APP)


@pytest.mark.ray
def test_concurrent_calls_are_concatenated_and_exact(app):
    encoder = load_text_encoder()
    token_ids = [encoder.tokenizer(text)["input_ids"] for text in TEXTS]
    calls = [app["minilm"].embed_token_ids.remote(token_ids[i:] + token_ids[:i]) for i in range(4)]
    results = [torch.tensor(call.result(timeout_s=120)) for call in calls]
    reference = encoder.embed(TEXTS)
    for i, result in enumerate(results):
        expected = torch.roll(reference, shifts=-i, dims=0)
        assert (result - expected).abs().max() <= 1e-4
        assert F.cosine_similarity(result, expected).min() >= 0.9999
    stats = app["minilm"].stats.remote().result(timeout_s=60)
    assert stats["batching"] == "slotted_das"
    assert stats["texts"] == 4 * len(TEXTS)
    assert stats["texts"] > stats["batches"]  # several texts share a forward pass
    assert stats["computed_tokens"] >= stats["real_tokens"]


@pytest.mark.ray
def test_text_longer_than_a_row_is_refused_and_replica_survives(app):
    with pytest.raises(ValueError, match="hold at most 32"):
        app["minilm"].embed_token_ids.remote([[101] + [2000] * 40 + [102]]).result(timeout_s=60)
    assert len(app["minilm"].embed_token_ids.remote([[101, 7592, 102]]).result(timeout_s=60)) == 1


@pytest.mark.ray
def test_texts_past_their_deadline_are_dropped_and_counted(app):
    with pytest.raises(ValueError, match="deadline_exceeded|within its 1 ms SLO"):
        app["tight"].embed_token_ids.remote([[101, 7592, 102]]).result(timeout_s=60)
    stats = app["tight"].stats.remote().result(timeout_s=60)
    assert stats["dropped"] >= 1 and stats["batching"] == "das"
