"""Target-tracking autoscaling (Arlo §4) and the minimal instance replacement plan."""

from __future__ import annotations

import pytest

from placement.arlo.autoscaling import AutoscalingParams, TargetTrackingAutoscaler
from placement.arlo.instance_replacement import plan_replacement


def scaler(**kwargs) -> TargetTrackingAutoscaler:
    return TargetTrackingAutoscaler(AutoscalingParams(slo_ms=100.0, **kwargs), longest_max_length_tokens=512)


def test_scale_out_adds_longest_runtime_when_p98_reaches_95_percent():
    auto = scaler(scale_out_cooldown_s=0.0)
    loads = {"a": 3, "b": 1}
    assert auto.decide(0.0, [0.05] * 100, loads).action == "none"
    decision = auto.decide(1.0, [0.05] * 97 + [0.096] * 3, loads)  # p98 = 96 ms >= 95 ms
    assert decision.action == "scale_out" and decision.max_length_tokens == 512


def test_scale_in_needs_low_p98_for_a_whole_period_and_releases_least_busy():
    auto = scaler(scale_in_period_s=60.0)
    loads = {"a": 3, "b": 1, "c": 2}
    assert auto.decide(0.0, [0.01] * 50, loads).action == "none"
    assert auto.decide(30.0, [0.01] * 50, loads).action == "none"
    assert auto.decide(45.0, [0.07] * 50, loads).action == "none"  # 70 ms >= 50 ms: the period restarts
    assert auto.decide(90.0, [0.01] * 50, loads).action == "none"
    decision = auto.decide(150.0, [0.01] * 50, loads)
    assert decision.action == "scale_in" and decision.instance_id == "b"


def test_scaling_respects_bounds_and_cooldown():
    auto = scaler(min_instances=2, scale_in_period_s=1.0, scale_out_cooldown_s=10.0)
    assert auto.decide(0.0, [0.01], {"a": 0, "b": 0}).action == "none"
    assert auto.decide(5.0, [0.01], {"a": 0, "b": 0}).action == "none"  # never below min_instances
    assert auto.decide(6.0, [0.2], {"a": 0, "b": 0}).action == "scale_out"
    assert auto.decide(7.0, [0.2], {"a": 0, "b": 0, "c": 0}).action == "none"  # cooldown
    assert auto.decide(16.0, [0.2], {"a": 0, "b": 0, "c": 0}).action == "scale_out"


def test_bad_params_name_the_field():
    with pytest.raises(ValueError, match="scale_in_fraction"):
        AutoscalingParams(slo_ms=100.0, scale_in_fraction=1.5)


def test_replacement_changes_fewest_instances_least_busy_first():
    current = {"i0": 64, "i1": 64, "i2": 64, "i3": 128, "i4": 512}
    loads = {"i0": 5, "i1": 1, "i2": 3, "i3": 0, "i4": 2}
    plan = plan_replacement(current, {64: 1, 128: 2, 512: 2}, loads, batch_size=1)
    assert plan.num_changed == 2  # two of the three 64s must go; nothing else moves
    assert {c.instance_id for c in plan.changes} == {"i1", "i2"}  # the least busy 64s
    assert sorted(c.to_max_length_tokens for c in plan.changes) == [128, 512]
    assert plan.keep == {"i0": 64, "i3": 128, "i4": 512}
    assert [len(b) for b in plan.batches] == [1, 1]


def test_replacement_with_more_and_fewer_devices_is_still_minimal():
    current = {"a": 64, "b": 128}
    grow = plan_replacement(current, {64: 2, 128: 1, 512: 1})
    assert grow.num_changed == 2 and all(c.instance_id is None for c in grow.changes)
    shrink = plan_replacement({"a": 64, "b": 64, "c": 128}, {128: 1}, {"a": 2, "b": 0})
    assert shrink.num_changed == 2 and all(c.to_max_length_tokens is None for c in shrink.changes)
    for current_map, target in [({"a": 64, "b": 64, "c": 128, "d": 256}, {64: 1, 256: 3}),
                                ({"a": 64}, {64: 1})]:
        plan = plan_replacement(current_map, target)
        counts = {}
        for length in plan.keep.values():
            counts[length] = counts.get(length, 0) + 1
        for change in plan.changes:
            if change.to_max_length_tokens is not None:
                counts[change.to_max_length_tokens] = counts.get(change.to_max_length_tokens, 0) + 1
        assert {k: v for k, v in counts.items() if v} == {k: v for k, v in target.items() if v}
        lower = sum(max(target.get(n, 0) - sum(1 for v in current_map.values() if v == n), 0) for n in target)
        assert plan.num_changed == max(lower, len(current_map) - len(plan.keep))


def test_rank_assignment_keeps_surviving_ranks_and_fills_new_ones():
    from placement.arlo.instance_replacement import rank_assignment

    assert rank_assignment({}, {64: 2, 512: 1}) == {0: 64, 1: 64, 2: 512}
    assert rank_assignment({0: 64, 1: 64, 2: 512}, {64: 1, 128: 1, 512: 1}) == {0: 128, 1: 64, 2: 512}
    assert rank_assignment({0: 64}, {128: 1, 512: 1}) == {0: 128, 1: 512}  # a changed rank is never reused
    grown = rank_assignment({0: 64, 1: 512}, {64: 2, 512: 2})
    assert grown[0] == 64 and grown[1] == 512 and sorted(grown.values()) == [64, 64, 512, 512]
    with pytest.raises(ValueError, match="at least one instance"):
        rank_assignment({0: 64}, {64: 0})
