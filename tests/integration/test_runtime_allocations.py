"""The controller's runtime-allocation duty (rayserve_apps.control.runtime_allocations) without Ray: which models it
allocates, the overrides it writes, periodic decisions from reported lengths, and adoption after a restart."""

from __future__ import annotations

from placement.core.deployment_spec import parse_spec
from placement.core.traffic_window import RequestRecord
from rayserve_apps.control.runtime_allocations import RuntimeAllocations

SHORT, LONG = 16, 64
PERIOD_S = 10.0
ARLO = {"polymorphing": {"name": "arlo",
                         "params": {"capacities": {SHORT: 2, LONG: 8}, "allocation_period_s": PERIOD_S}}}


def spec(**extra):
    text = {"kind": "text", "source": "package:all-minilm-l6-v2", "slo_ms": 100}
    return parse_spec({"models": [{"name": "poly", **text, "policies": ARLO}, {"name": "plain", **text}],
                       "controller": {"period_s": 1}, **extra})


def long_requests(count: int, model: str = "poly", tokens: int = 40) -> list[RequestRecord]:
    return [RequestRecord(model, arrival_s=k * PERIOD_S / count, outcome="ok", input_tokens=tokens)
            for k in range(count)]


def test_only_polymorphing_models_outside_groups_are_allocated():
    assert spec().polymorphing_models() == ["poly"]
    group = {"num_devices": 1, "config": {"intra_op_degree": 1, "pipeline_stages": 1}, "models": ["poly"]}
    grouped = spec(placement={"groups": [group]}, planning={"profiles": {"path": "p.json"}})
    assert grouped.polymorphing_models() == []


def test_overrides_start_from_the_builders_allocation():
    allocations = RuntimeAllocations(spec(), start_s=0.0)
    (override,) = allocations.overrides()
    assert override["name"] == "model-poly" and override["num_replicas"] == 2
    assert {int(k): v for k, v in override["user_config"]["assignment"].items()} == {0: SHORT, 1: LONG}
    assert allocations.window_s == PERIOD_S


def test_long_traffic_moves_the_short_instance_once_per_period_and_other_models_are_ignored():
    allocations = RuntimeAllocations(spec(), start_s=0.0)
    records = long_requests(50) + long_requests(50, model="plain", tokens=8)
    assert allocations.decide(PERIOD_S / 2, records, observed_s=PERIOD_S / 2) == {}  # the period has not passed
    decision = allocations.decide(PERIOD_S, records, observed_s=PERIOD_S)["poly"]
    assert decision.counts == {SHORT: 0, LONG: 2} and decision.changed and decision.replicas_changed == 1
    assert decision.num_requests == 50
    assert allocations.overrides()[0]["user_config"]["version"] == 0  # nothing changes before commit
    allocations.commit({"poly": decision})
    (override,) = allocations.overrides()
    assert {int(k): v for k, v in override["user_config"]["assignment"].items()} == {0: LONG, 1: LONG}
    assert override["user_config"]["version"] == 1 and override["num_replicas"] == 2
    # The next period sees the same traffic: the allocation is kept, nothing to apply.
    again = allocations.decide(2 * PERIOD_S, long_requests(50), observed_s=2 * PERIOD_S)["poly"]
    assert not again.changed and again.user_config["version"] == 1


def test_restarted_controller_adopts_the_deployed_allocation():
    first = RuntimeAllocations(spec(), start_s=0.0)
    first.commit(first.decide(PERIOD_S, long_requests(50), observed_s=PERIOD_S))
    deployed = first.overrides() + [{"name": "Ingress", "user_config": {"routes": []}}]
    second = RuntimeAllocations(spec(), start_s=100.0)
    assert second.read_back(deployed) == ["poly"]
    assert second.state() == first.state()
    assert second.allocators["poly"].version == 1
    assert RuntimeAllocations(spec(), start_s=0.0).read_back([]) == []


def autoscaled_spec(**autoscaling):
    params = {**ARLO["polymorphing"]["params"], "autoscaling": autoscaling}
    return parse_spec({"models": [{"name": "poly", "kind": "text", "source": "package:all-minilm-l6-v2", "slo_ms": 100,
                                   "policies": {"polymorphing": {"name": "arlo", "params": params}}}],
                       "controller": {"period_s": 1}})


def answered(latency_ms: float, count: int = 50, model: str = "poly") -> list[RequestRecord]:
    return [RequestRecord(model, arrival_s=0.0, outcome="ok", latency_ms=latency_ms, input_tokens=40)
            for _ in range(count)]


def test_target_tracking_adds_a_longest_replica_at_95_percent_and_releases_one_after_a_low_period():
    allocations = RuntimeAllocations(autoscaled_spec(scale_out_cooldown_s=0, scale_in_period_s=5, max_instances=3), 0.0)
    allocations.observe(answered(99.0) + answered(500.0, model="other")
                        + [RequestRecord("poly", 0.0, "rejected", input_tokens=40)])
    (update,) = allocations.scale(1.0).values()
    assert update.action == "scale_out" and update.p98_s >= 0.095 and update.num_replicas == 3
    assert {int(k): v for k, v in update.user_config["assignment"].items()} == {0: SHORT, 1: LONG, 2: LONG}
    allocations.commit({"poly": update})
    assert allocations.overrides()[0]["num_replicas"] == 3 and allocations.state()["poly"]["version"] == 1
    allocations.observe(answered(99.0))
    assert allocations.scale(2.0) == {}  # max_instances reached
    assert allocations.scale(2.5) == {}  # nothing answered since the last check: no decision
    allocations.observe(answered(10.0))
    assert allocations.scale(3.0) == {}  # low p98, but not yet for scale_in_period_s
    allocations.observe(answered(10.0))
    (release,) = allocations.scale(8.0).values()
    assert release.action == "scale_in" and release.num_replicas == 2 and release.user_config["version"] == 2
    # The next periodic allocation solves Eq. 1-7 for the new replica count.
    allocations.commit({"poly": release})
    decision = allocations.decide(PERIOD_S, long_requests(50), observed_s=PERIOD_S)["poly"]
    assert sum(decision.counts.values()) == 2


def test_bad_autoscaling_field_is_named():
    import pytest

    with pytest.raises(ValueError, match="scale_in_fraction"):
        RuntimeAllocations(autoscaled_spec(scale_in_fraction=2.0), 0.0)
    with pytest.raises(ValueError, match="slo_ms"):
        RuntimeAllocations(autoscaled_spec(slo_ms=5.0), 0.0)
