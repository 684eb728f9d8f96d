"""Both custom Serve RequestRouters on fake replicas and a fake clock, as Ray Serve tests its own routers: no Ray
cluster. `ModelAwareRouter` (AlpaServe §4.3 shortest queue among a model's hosts) and `PolymorphRouter` (Arlo Alg. 1
over runtime replicas) are driven through Serve's router interface: `choose_replicas`, `on_send_request`,
`on_request_completed`."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest, RunningReplica

from rayserve_apps.contracts import (
    STATS_CAPACITY,
    STATS_MAX_LENGTH,
    STATS_MODELS,
    STATS_OUTSTANDING,
    STATS_QUEUE_LENGTH,
)
from rayserve_apps.routers.model_aware import ModelAwareRouter
from rayserve_apps.routers.polymorph import PolymorphRouter, request_length_tokens

DEPLOYMENT = DeploymentID(name="test-deployment", app_name="test-app")
#: Runtime max length (tokens) -> capacity within the SLO (requests), as PolymorphRouter's replicas report them.
SHORT, LONG = 16, 64
CAPACITIES = {SHORT: 2, LONG: 8}


class FakeReplica(RunningReplica):
    """A replica as a router sees it: an id, routing stats and start-up metadata (Ray Serve's own router tests use
    such a stand-in, `ray.serve._private.test_utils.FakeRunningReplica`)."""

    def __init__(self, name: str, routing_stats: dict[str, Any] | None = None,
                 metadata: dict[str, Any] | None = None):  # no super().__init__: there is no actor behind it
        self._replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self._routing_stats = routing_stats or {}
        self._metadata = metadata or {}

    @property
    def replica_id(self) -> ReplicaID:
        return self._replica_id

    @property
    def routing_stats(self) -> dict[str, Any]:
        return self._routing_stats

    @property
    def replica_metadata(self) -> dict[str, Any]:
        return dict(self._metadata)

    def __repr__(self) -> str:
        return self._replica_id.unique_id


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def request(*args: Any, **kwargs: Any) -> PendingRequest:
    metadata = RequestMetadata(request_id=str(uuid.uuid4()), internal_request_id=str(uuid.uuid4()))
    return PendingRequest(args=list(args), kwargs=kwargs, metadata=metadata, future=None)  # type: ignore[arg-type]


def make_router(cls, clock: FakeClock | None = None, **state: Any):
    router = cls(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                 use_replica_queue_len_cache=True, get_curr_time_s=clock or FakeClock())
    router.initialize_state(**state)
    return router


def ranks(router, replicas: list[FakeReplica], pending: PendingRequest | None) -> list[list[str]]:
    chosen = asyncio.run(router.choose_replicas(replicas, pending))
    return [[r.replica_id.unique_id for r in rank] for rank in chosen]


# ---- ModelAwareRouter ---------------------------------------------------------------------------------------------

def group(name: str, models: list[str], queue_length: int) -> FakeReplica:
    return FakeReplica(name, {STATS_MODELS: models, STATS_QUEUE_LENGTH: queue_length})


def test_model_aware_router_ranks_only_hosts_of_the_model_by_queue_length_and_silent_replicas_last():
    replicas = [group("busy-a", ["a"], 5), group("idle-b", ["b"], 0), group("idle-a", ["a", "b"], 1),
                group("mid-a", ["a"], 3), FakeReplica("silent")]
    router = make_router(ModelAwareRouter)
    assert ranks(router, replicas, request("a", [[1, 2]])) == [["idle-a"], ["mid-a"], ["busy-a"], ["silent"]]
    assert ranks(router, replicas, request(model="b")) == [["idle-b"], ["idle-a"], ["silent"]]


def test_model_aware_router_asks_for_backoff_and_answers_nothing_without_candidates():
    router = make_router(ModelAwareRouter)
    pending = request("a")
    assert ranks(router, [group("g", ["a"], 0)], pending) == [["g"]]
    assert pending.routing_context.should_backoff
    assert ranks(router, [], request("a")) == []


def test_model_aware_router_sends_a_model_no_replica_hosts_only_to_silent_replicas():
    router = make_router(ModelAwareRouter)
    assert ranks(router, [group("g", ["a"], 0), FakeReplica("silent")], request("unknown")) == [["silent"]]
    assert ranks(router, [group("g", ["a"], 0)], request("unknown")) == []


def test_model_aware_router_without_a_model_ranks_every_reporting_replica_by_queue():
    router = make_router(ModelAwareRouter)
    replicas = [group("long", ["a"], 4), group("short", ["b"], 1)]
    assert ranks(router, replicas, request(42)) == [["short"], ["long"]]  # first argument not a model name
    assert ranks(router, replicas, None) == [["short"], ["long"]]


def test_model_aware_router_counts_its_own_sends_until_the_cache_goes_stale():
    clock = FakeClock()
    router = make_router(ModelAwareRouter, clock)
    first, second = group("first", ["a"], 0), group("second", ["a"], 1)
    for _ in range(3):  # three requests sent to `first` since its last report (queue 0)
        router.on_send_request(first.replica_id)
    assert ranks(router, [first, second], request("a")) == [["second"], ["first"]]
    clock.now_s += 60.0  # Serve's queue-length cache entries time out: the replicas' reports count again
    assert ranks(router, [first, second], request("a")) == [["first"], ["second"]]


# ---- PolymorphRouter ----------------------------------------------------------------------------------------------

def runtime(name: str, max_length: int, outstanding: int | None = None, reported: bool = True) -> FakeReplica:
    """A runtime replica; `reported=False`: only its start-up metadata is known (no routing stats yet)."""
    stats = {STATS_MAX_LENGTH: max_length, STATS_CAPACITY: CAPACITIES[max_length]}
    if outstanding is not None:
        stats[STATS_OUTSTANDING] = outstanding
    return FakeReplica(name, stats if reported else {}, metadata=dict(stats))


def tokens(length: int, texts: int = 1) -> list[list[int]]:
    return [list(range(length)) for _ in range(texts)]


def test_request_length_is_the_longest_text_or_the_num_tokens_keyword():
    assert request_length_tokens(request([[1] * 3, [1] * 9])) == 9
    assert request_length_tokens(request(token_ids=[[1] * 5])) == 5
    assert request_length_tokens(request([[1] * 5], num_tokens=30)) == 30
    assert request_length_tokens(request("not tokens")) is None
    assert request_length_tokens(None) is None


def test_polymorph_router_sends_a_request_to_its_ideal_runtime_and_ranks_the_others_that_fit():
    short, long_ = runtime("short", SHORT), runtime("long", LONG)
    router = make_router(PolymorphRouter)
    assert ranks(router, [long_, short], request(tokens(10))) == [["short"], ["long"]]
    assert ranks(router, [long_, short], request(tokens(40))) == [["long"]]  # the short runtime cannot take it
    assert ranks(router, [long_, short], request("?")) == [["long"]]  # unknown length: only the longest is safe


def test_polymorph_router_demotes_to_a_longer_runtime_once_the_ideal_one_is_congested():
    # Arlo Alg. 1: the short runtime (capacity 2) takes requests while outstanding/capacity < lambda (0.85).
    short, long_ = runtime("short", SHORT), runtime("long", LONG)
    router = make_router(PolymorphRouter)
    chosen = []
    for _ in range(3):
        first = ranks(router, [short, long_], request(tokens(10)))[0][0]
        chosen.append(first)
        router.on_send_request((short if first == "short" else long_).replica_id)
    assert chosen == ["short", "short", "long"]
    router.on_request_completed(short.replica_id, "done")  # one short request finishes: room again
    assert ranks(router, [short, long_], request(tokens(10)))[0] == ["short"]


def test_polymorph_router_takes_outstanding_requests_other_routers_sent_from_the_replica_report():
    router = make_router(PolymorphRouter)
    short, long_ = runtime("short", SHORT, outstanding=2), runtime("long", LONG, outstanding=0)
    assert ranks(router, [short, long_], request(tokens(10)))[0] == ["long"]


def test_polymorph_router_falls_back_to_the_ideal_runtime_when_every_level_is_congested():
    router = make_router(PolymorphRouter, max_levels=2)
    short, long_ = runtime("short", SHORT, outstanding=2), runtime("long", LONG, outstanding=8)
    assert ranks(router, [short, long_], request(tokens(10))) == [["short"], ["long"]]


def test_polymorph_router_follows_a_runtime_swap_reported_in_routing_stats():
    router = make_router(PolymorphRouter)
    swapped = FakeReplica("swapped", {STATS_MAX_LENGTH: LONG, STATS_CAPACITY: CAPACITIES[LONG]},
                          metadata={STATS_MAX_LENGTH: SHORT, STATS_CAPACITY: CAPACITIES[SHORT]})
    other = runtime("other", SHORT)
    # started short, runs long now: a long request may go to it, and a short one prefers the short runtime
    assert ranks(router, [swapped, other], request(tokens(40))) == [["swapped"]]
    assert ranks(router, [swapped, other], request(tokens(10))) == [["other"], ["swapped"]]


def test_polymorph_router_uses_start_up_metadata_and_keeps_silent_replicas_last():
    router = make_router(PolymorphRouter)
    known = runtime("known", SHORT, reported=False)
    silent = FakeReplica("silent")
    assert ranks(router, [silent, known], request(tokens(10))) == [["known"], ["silent"]]
    assert ranks(router, [silent], request(tokens(10))) == [["silent"]]


def test_polymorph_router_lets_every_replica_answer_a_request_too_long_for_every_runtime():
    router = make_router(PolymorphRouter)
    short, long_ = runtime("short", SHORT), runtime("long", LONG)
    assert sorted(ranks(router, [short, long_], request(tokens(LONG + 1)))) == [["long"], ["short"]]


@pytest.mark.parametrize("bad", [{"threshold": 0.0}, {"decay": 1.5}, {"max_levels": 0}])
def test_polymorph_router_refuses_bad_alg1_parameters(bad):
    with pytest.raises(ValueError):
        make_router(PolymorphRouter, **bad)
