"""Rollout planning: which group slots change how, make-before-break, in small steps."""

import pytest

from placement.alpaserve.placement_rollout import SlotLayout, match_slots, plan_rollout, transition_routes
from placement.core.placement_plan import GroupPlacement, Placement
from placement.core.profiles import ParallelConfig


def group(devices: int, models: list[str], stages: int | None = None) -> GroupPlacement:
    stages = devices if stages is None else stages
    return GroupPlacement(num_devices=devices,
                          config=ParallelConfig(intra_op_degree=devices // stages, pipeline_stages=stages),
                          models=models)


def layout(*groups, slots: int = 4) -> SlotLayout:
    return SlotLayout.from_placement(Placement(groups=list(groups)), slots)


def test_identical_placement_needs_no_step():
    current = layout(group(2, ["a", "b"]), group(1, ["c"]))
    assert plan_rollout(current, current.placement(), total_devices=4).steps == []


def test_same_shape_other_models_is_a_rehost_in_its_own_slot():
    current = layout(group(2, ["a", "b"]), group(1, ["c"]))
    target = Placement(groups=[group(2, ["a", "b"]), group(1, ["a", "c"])])
    rollout = plan_rollout(current, target, total_devices=4)
    assert [(c.slot, c.kind) for c in rollout.changes] == [(1, "rehost")]
    assert rollout.final.slots[1].models == ["a", "c"] and rollout.final.slots[0] == current.slots[0]


def test_new_group_starts_on_free_devices_before_anything_stops():
    current = layout(group(2, ["a", "b"]), group(1, ["c"]))
    target = Placement(groups=[group(2, ["a", "b"]), group(1, ["c"]), group(1, ["a"])])
    rollout = plan_rollout(current, target, total_devices=4)
    assert [(c.slot, c.kind) for c in rollout.changes] == [(2, "start")]


def test_break_before_make_only_when_devices_run_out_and_prefers_groups_hosted_elsewhere():
    current = layout(group(2, ["a", "b"]), group(1, ["a", "c"]), group(1, ["b", "c"]))
    target = Placement(groups=[group(1, ["a", "c"]), group(1, ["b", "c"]), group(1, ["a"]), group(1, ["b"])])
    rollout = plan_rollout(current, target, total_devices=4, max_changes_per_step=1)
    kinds = [[(c.slot, c.kind) for c in step.changes] for step in rollout.steps]
    # No free device: the 2-device group goes first (its models are hosted elsewhere), its slot taking a new group.
    assert kinds == [[(0, "replace")], [(3, "start")]]
    final = rollout.final
    assert sorted(sorted(g.models) for g in final.slots if g) == [["a"], ["a", "c"], ["b"], ["b", "c"]]
    for step in rollout.steps:  # never over the cluster's devices, and at most one change per step
        assert step.layout.num_devices <= 4 and len(step.changes) == 1


def test_a_stop_whose_devices_no_new_group_needs_stays_a_stop():
    current = layout(group(2, ["a", "b"]), group(1, ["a"]), group(1, ["b"]))
    rollout = plan_rollout(current, Placement(groups=[group(1, ["a"]), group(1, ["b"])]), total_devices=4)
    assert [(c.slot, c.kind) for c in rollout.changes] == [(0, "stop")]
    assert rollout.final.slots[0] is None


def test_steps_batch_up_to_max_changes():
    current = layout(group(1, ["a"]), slots=4)
    target = Placement(groups=[group(1, ["a"]), group(1, ["b"]), group(1, ["c"]), group(1, ["d"])])
    rollout = plan_rollout(current, target, total_devices=4, max_changes_per_step=2)
    assert [len(step.changes) for step in rollout.steps] == [2, 1]


def test_rehost_matches_the_slot_with_most_models_in_common():
    current = layout(group(1, ["a", "b"]), group(1, ["c", "d"]))
    target = Placement(groups=[group(1, ["c", "d", "e"]), group(1, ["a"])])
    matched, to_start = match_slots(current, target)
    assert matched[1].models == ["c", "d", "e"] and matched[0].models == ["a"] and to_start == []


def test_transition_routes_keep_only_models_served_before_and_after():
    before = layout(group(2, ["a", "b"]), group(1, ["c"]))
    after = SlotLayout(slots=[group(2, ["a"]), None, group(1, ["c"]), None])
    assert transition_routes(before, after) == [["a"], [], [], []]


def test_unreachable_targets_are_refused_with_the_limit():
    current = layout(group(1, ["a"]), slots=2)
    with pytest.raises(ValueError, match="cluster has 2"):
        plan_rollout(current, Placement(groups=[group(2, ["a"]), group(1, ["b"])]), total_devices=2)
    with pytest.raises(ValueError, match="2 group slots"):
        plan_rollout(current, Placement(groups=[group(1, ["a"])] * 3), total_devices=3)
    with pytest.raises(ValueError, match="max_changes_per_step"):
        plan_rollout(current, current.placement(), total_devices=2, max_changes_per_step=0)
