"""Polymorphing on real Ray Serve: two MiniLM runtime replicas behind the Arlo multi-level-queue router, their
runtimes packed with ConcatBatching (the default) or padded; and the replica's cross-request packing in-process."""

from __future__ import annotations

import pytest
from waiting import wait_until

pytestmark = pytest.mark.ray

SHORT_RUNTIME, LONG_RUNTIME = 16, 64
CAPACITIES = {SHORT_RUNTIME: 2, LONG_RUNTIME: 8}
APP = "polymorph-test"


def deploy(assignment: dict[int, int], version: int):
    from ray import serve

    from placement.core.deployment_spec import ModelSpec
    from rayserve_apps.app import bind_polymorph_model

    spec = ModelSpec(name="minilm", kind="text", source="package:all-minilm-l6-v2", num_cpus_per_replica=0.5)
    params = {"capacities": CAPACITIES, "backend": "eager", "routing_stats_period_s": 0.5}
    app = bind_polymorph_model(spec, params, "minilm-polymorph", assignment=assignment, version=version)
    return serve.run(app, name=APP, route_prefix=None)


def tokens(count: int, texts: int = 1) -> list[list[int]]:
    return [[101] + [2000 + k for k in range(count - 2)] + [102] for _ in range(texts)]


@pytest.fixture(scope="module")
def handle(ray_serve):
    return deploy({0: SHORT_RUNTIME, 1: LONG_RUNTIME}, version=1)


def test_short_requests_land_on_short_runtime_and_long_on_long(handle):
    for _ in range(4):
        result = handle.embed_with_runtime.remote(tokens(10)).result(timeout_s=60)
        assert result["served_by_max_length_tokens"] == SHORT_RUNTIME
        assert len(result["embeddings"][0]) == 384
    assert (handle.embed_with_runtime.remote(tokens(40)).result(timeout_s=60)["served_by_max_length_tokens"]
            == LONG_RUNTIME)


def test_packed_replica_puts_several_short_texts_in_one_row(handle):
    # 8 texts of 6 tokens, rows of one runtime length: 16 tokens hold two texts (4 passes instead of 8), 64 hold all
    # eight (1 pass); the router may demote to the long runtime while it still sees earlier requests outstanding.
    result = handle.embed_with_runtime.remote(tokens(6, texts=8)).result(timeout_s=60)
    runtime = result["served_by_max_length_tokens"]
    assert runtime in (SHORT_RUNTIME, LONG_RUNTIME)
    assert result["forward_passes"] == -(-8 // (runtime // 6))
    assert len(result["embeddings"]) == 8


def test_congested_short_runtime_demotes_to_long_runtime(handle):
    # Each request carries 16 short texts, run one by one on the batch-1 runtime, so requests overlap.
    import time

    responses = []
    for _ in range(8):
        responses.append(handle.embed_with_runtime.remote(tokens(10, texts=16)))
        time.sleep(0.05)  # arrivals 50 ms apart, each request runs far longer
    served = [r.result(timeout_s=120)["served_by_max_length_tokens"] for r in responses]
    assert served.count(SHORT_RUNTIME) >= 2  # the ideal runtime takes what it can ...
    assert served.count(LONG_RUNTIME) >= 1   # ... and the rest is demoted once its congestion reaches lambda


def test_too_long_request_is_rejected_with_limit(handle):
    with pytest.raises(Exception, match="exceeds the longest runtime"):
        handle.embed_with_runtime.remote(tokens(70)).result(timeout_s=60)


def test_allocation_update_keeps_in_flight_requests(handle):
    from rayserve_apps.contracts import PolymorphAssignmentParams, allocation_update

    in_flight = [handle.embed_with_runtime.remote(tokens(10, texts=6)) for _ in range(4)]
    num_replicas, user_config = allocation_update({0: SHORT_RUNTIME, 1: LONG_RUNTIME}, {LONG_RUNTIME: 2}, version=2)
    assignment = PolymorphAssignmentParams.model_validate(user_config).assignment
    assert num_replicas == 2 and assignment == {0: LONG_RUNTIME, 1: LONG_RUNTIME}
    new_handle = deploy(assignment, version=2)
    assert all(len(r.result(timeout_s=120)["embeddings"]) == 6 for r in in_flight)  # none dropped

    def served_by_long() -> bool:
        answer = new_handle.embed_with_runtime.remote(tokens(10)).result(timeout_s=60)
        return answer["served_by_max_length_tokens"] == LONG_RUNTIME

    # Routing stats (period 0.5 s) carry the new runtime to the router.
    wait_until(served_by_long, 30, message="the router still routes by the old runtime")
    for _ in range(3):
        assert (new_handle.embed_with_runtime.remote(tokens(10)).result(timeout_s=60)["served_by_max_length_tokens"]
                == LONG_RUNTIME)


def _local_replica(execution: str):
    """The replica class outside Serve (rank 0, no user_config: the longest runtime), eager backend."""
    from placement.core.deployment_spec import ModelSpec
    from rayserve_apps.replicas.polymorph import PolymorphRuntimeDeployment

    spec = ModelSpec(name="minilm", kind="text", source="package:all-minilm-l6-v2", num_cpus_per_replica=0.5)
    params = {"capacities": CAPACITIES, "backend": "eager", "execution": execution}
    return PolymorphRuntimeDeployment.func_or_class(spec.model_dump(mode="json"), params)


@pytest.fixture(scope="module")
def local_packed():
    return _local_replica("packed")


def test_waiting_requests_share_packed_forward_passes(local_packed):
    import asyncio

    import torch

    from models.runtimes.static_runtime import PackedStaticRuntime

    replica = local_packed
    assert isinstance(replica.runtime, PackedStaticRuntime) and replica.runtime.max_length_tokens == LONG_RUNTIME
    calls = [[[101] + [2000 + k + c for k in range(4)] + [102]] for c in range(6)]  # six requests of 6 tokens

    async def concurrently():
        return await asyncio.gather(*(replica.embed_with_runtime(ids) for ids in calls))

    results = asyncio.run(concurrently())
    # The first request runs alone; the five that waited meanwhile share one 64-token row.
    assert results[0]["requests_in_passes"] == 1
    assert [r["requests_in_passes"] for r in results[1:]] == [5] * 5
    assert all(r["forward_passes"] == 1 for r in results)
    expected = replica.dynamic.run_tokens([ids[0] for ids in calls])  # each request alone, padded, eager
    got = torch.tensor([r["embeddings"][0] for r in results])
    assert torch.allclose(got, expected, atol=1e-5)
    assert replica.outstanding == 0 and not replica._waiting


def test_packed_replica_falls_back_to_dynamic_for_longer_requests(local_packed):
    import asyncio

    replica = local_packed
    longest = replica.runtime
    replica.runtime = replica._build(SHORT_RUNTIME)  # as after a swap to the short runtime
    try:
        result = asyncio.run(replica.embed_with_runtime(tokens(40)))
        assert result["served_by_max_length_tokens"] == 0  # the dynamic path, not a failure
        assert asyncio.run(replica.embed_with_runtime(tokens(10)))["served_by_max_length_tokens"] == SHORT_RUNTIME
    finally:
        replica.runtime = longest


def test_padded_execution_keeps_one_text_per_row():
    import asyncio

    from models.runtimes.static_runtime import StaticRuntime

    replica = _local_replica("padded")
    assert isinstance(replica.runtime, StaticRuntime)
    result = asyncio.run(replica.embed_with_runtime(tokens(6, texts=4)))
    assert result["forward_passes"] == 4 and result["requests_in_passes"] == 1
    assert result["served_by_max_length_tokens"] == LONG_RUNTIME


def test_polymorphing_params_are_validated_by_field():
    from placement.core.deployment_spec import ModelSpec
    from rayserve_apps.app import bind_polymorph_model

    spec = ModelSpec(name="minilm", kind="text", source="package:all-minilm-l6-v2")
    with pytest.raises(ValueError, match="decay"):
        bind_polymorph_model(spec, {"capacities": CAPACITIES, "decay": 2.0}, "x")
    with pytest.raises(ValueError, match="initial_counts"):
        bind_polymorph_model(spec, {"capacities": CAPACITIES, "initial_counts": {32: 1}}, "x")
    with pytest.raises(ValueError, match="execution"):
        bind_polymorph_model(spec, {"capacities": CAPACITIES, "execution": "stacked"}, "x")
