"""The live controller's Arlo Runtime Scheduler (placement.arlo.live_allocator): periods, moves, fewest changes."""

from __future__ import annotations

import numpy as np
import pytest

from placement.arlo.live_allocator import LiveRuntimeAllocator, profiles_from_capacities
from placement.arlo.runtimes import RuntimeProfile, RuntimeProfileSet

#: Runtime max length -> capacity within the SLO (Arlo M_i): shorter runtimes take more requests.
CAPACITIES = {64: 40, 128: 20, 512: 8}
SLO_S = 0.1
PERIOD_S = 120.0
SHORT, LONG = 20, 400
#: One instance of each runtime plus a second long one: the allocation at start.
START = {0: 64, 1: 128, 2: 512, 3: 512}


def allocator(**kwargs) -> LiveRuntimeAllocator:
    kwargs.setdefault("num_instances", 4)
    return LiveRuntimeAllocator(CAPACITIES, slo_s=SLO_S, period_s=PERIOD_S, start_s=0.0, **kwargs)


def test_nothing_is_decided_before_a_period_passes():
    alloc = allocator()
    for now in (0.0, 1.0, 60.0, PERIOD_S - 0.001):
        assert alloc.decide(now, [SHORT] * 500, 60.0, START) is None
    assert alloc.decide(PERIOD_S, [SHORT] * 500, 60.0, START) is not None
    assert alloc.decide(PERIOD_S + 1.0, [SHORT] * 500, 60.0, START) is None  # the next period starts now
    assert alloc.decide(2 * PERIOD_S, [SHORT] * 500, 60.0, START) is not None


def test_without_start_the_first_call_starts_the_clock():
    alloc = LiveRuntimeAllocator(CAPACITIES, slo_s=SLO_S, period_s=PERIOD_S, num_instances=4)
    assert alloc.decide(1000.0, [SHORT] * 500, 60.0, START) is None
    assert alloc.decide(1000.0 + PERIOD_S / 2, [SHORT] * 500, 60.0, START) is None
    assert alloc.decide(1000.0 + PERIOD_S, [SHORT] * 500, 60.0, START) is not None


def test_short_requests_move_instances_to_the_short_runtime_and_long_ones_move_them_back():
    alloc = allocator()
    short = alloc.decide(PERIOD_S, [SHORT] * 6000, PERIOD_S, START)
    assert short.requests_per_slo == pytest.approx({64: 6000 / PERIOD_S * SLO_S, 128: 0.0, 512: 0.0})  # Arlo Q_i
    assert short.changed and short.solver == "exact"
    assert short.counts[64] > 1 and short.counts[512] >= 1  # Eq. 7: the longest keeps an instance
    assert short.counts == {64: 3, 128: 0, 512: 1}
    long = alloc.decide(2 * PERIOD_S, [LONG] * 1200, PERIOD_S, short.assignment)
    assert long.previous_counts == short.counts
    assert long.changed and long.counts == {64: 0, 128: 0, 512: 4}
    assert long.user_config["version"] == short.user_config["version"] + 1


def test_counts_always_sum_to_num_instances_even_when_overloaded():
    rng = np.random.default_rng(7)
    alloc = allocator(num_instances=5)
    previous = {rank: 512 for rank in range(5)}
    solvers = set()
    for period in range(1, 41):
        rate_per_s = float(rng.choice([0.0, 5.0, 100.0, 3000.0]))  # 3000/s is beyond 5 instances: fallback
        lengths = rng.integers(1, 600, int(rate_per_s * 10)).tolist()  # beyond 512 counts in the longest bin
        decision = alloc.decide(period * PERIOD_S, lengths, 10.0, previous)
        solvers.add(decision.solver)
        assert sum(decision.counts.values()) == 5
        assert decision.counts[512] >= 1
        assert decision.num_replicas == 5 and sorted(decision.assignment) == list(range(5))
        assert sorted(decision.assignment.values()) == sorted(
            length for length, count in decision.counts.items() for _ in range(count))
        previous = decision.assignment
    assert {"exact", "proportional"} <= solvers


def test_assignment_changes_the_fewest_replicas():
    alloc = allocator()
    previous = {0: 512, 1: 512, 2: 128, 3: 64}
    decision = alloc.decide(PERIOD_S, [SHORT] * 6000, PERIOD_S, previous)
    assert decision.counts == {64: 3, 128: 0, 512: 1}
    # 128 loses its one instance and 512 one of two; 64 gains two: two ranks must change, no more.
    assert decision.replicas_changed == 2
    assert decision.assignment[3] == 64  # the short instance stays where it is
    assert [decision.assignment[rank] for rank in (0, 1)].count(512) == 1  # one long instance is kept
    kept = [rank for rank in previous if previous[rank] == decision.assignment[rank]]
    assert len(kept) == 4 - decision.replicas_changed
    assert (decision.num_replicas, decision.user_config) == decision.update()


def test_fewer_instances_release_the_highest_ranks_and_keep_the_rest():
    alloc = allocator()
    decision = alloc.decide(PERIOD_S, [LONG] * 1200, PERIOD_S, START, num_instances=3)
    assert decision.counts == {64: 0, 128: 0, 512: 3}
    assert decision.assignment == {0: 512, 1: 512, 2: 512}  # rank 3 released; ranks 0 and 1 switch
    assert decision.replicas_changed == 3 and decision.num_replicas == 3


def test_unchanged_or_tied_allocation_keeps_replicas_and_version():
    alloc = allocator(initial_version=5)
    balanced = {0: 64, 1: 64, 2: 128, 3: 512}
    idle = alloc.decide(PERIOD_S, [], PERIOD_S, balanced)  # no traffic: every allocation costs 0
    assert not idle.changed and idle.solver == "kept" and idle.counts == {64: 2, 128: 1, 512: 1}
    assert idle.replicas_changed == 0 and idle.user_config["version"] == 5
    moved = alloc.decide(2 * PERIOD_S, [LONG] * 1200, PERIOD_S, balanced, previous_version=9)
    assert moved.changed and moved.user_config["version"] == 10


def test_user_config_matches_the_deployment_format():
    alloc = allocator()
    decision = alloc.decide(PERIOD_S, [SHORT] * 6000, PERIOD_S, {str(rank): length for rank, length in START.items()})
    assert decision.user_config == {"assignment": {str(rank): length for rank, length in decision.assignment.items()},
                                    "version": 1}


def test_from_policy_params_reads_the_polymorphing_params():
    params = {"capacities": {"64": 40, "512": 8}, "initial_counts": {"64": 2, "512": 3}, "threshold": 0.85,
              "execution": "packed", "allocation_period_s": 30.0}  # as in a JSON/YAML spec
    alloc = LiveRuntimeAllocator.from_policy_params(params, slo_s=SLO_S, model="minilm", start_s=0.0)
    assert alloc.num_instances == 5 and alloc.period_s == 30.0 and alloc.max_lengths == [64, 512]
    assert alloc.decide(29.0, [], 30.0, {}) is None
    decision = alloc.decide(30.0, [SHORT] * 100, 30.0, {})
    assert sum(decision.counts.values()) == 5 and decision.num_replicas == 5
    one_each = LiveRuntimeAllocator.from_policy_params({"capacities": CAPACITIES}, slo_s=SLO_S)
    assert one_each.num_instances == 3 and one_each.period_s == 120.0  # Arlo §5's period by default


def test_profiles_derived_from_capacities_have_exactly_those_capacities():
    capacities = {16: 1, 32: 3, 64: 11, 128: 49, 256: 127}  # 0.1 / (0.1 / 11) floors to 10 in floating point
    for slo_s in (0.3, 0.1, 1.7):
        profiles = profiles_from_capacities(capacities, slo_s)
        assert {r.max_length_tokens: r.capacity_requests for r in profiles.runtimes} == capacities
        assert profiles.source.startswith("derived")


def test_measured_profiles_are_used_when_their_runtimes_match():
    measured = RuntimeProfileSet(model="m", source="measured:test", runtimes=[
        RuntimeProfile(max_length_tokens=64, batch_latency_s={1: 0.002, 2: 0.003}, max_batch_size=2, slo_s=SLO_S),
        RuntimeProfile(max_length_tokens=512, batch_latency_s={1: 0.010, 2: 0.018}, max_batch_size=2, slo_s=SLO_S)])
    alloc = LiveRuntimeAllocator({64: 66, 512: 10}, slo_s=SLO_S, num_instances=3, profiles=measured, start_s=0.0)
    assert alloc.profiles is measured
    decision = alloc.decide(PERIOD_S, [SHORT] * 6000, PERIOD_S, {})
    assert decision.counts == {64: 2, 512: 1}
    with pytest.raises(ValueError, match="profiles"):
        LiveRuntimeAllocator({64: 66, 128: 30, 512: 10}, slo_s=SLO_S, profiles=measured)


@pytest.mark.parametrize("kwargs, field", [
    ({"capacities": {64: 0, 512: 8}}, "capacities"),
    ({"capacities": {}}, "capacities"),
    ({"period_s": 0.0}, "allocation_period_s"),
    ({"num_instances": 0}, "num_instances"),
    ({"slo_s": 0.0}, "slo_s"),
    ({"initial_counts": {96: 1}, "num_instances": None}, "initial_counts"),
    ({"change_tolerance": -0.1}, "change_tolerance"),
])
def test_bad_params_name_the_field(kwargs, field):
    args = {"capacities": CAPACITIES, "slo_s": SLO_S, "num_instances": 4, **kwargs}
    with pytest.raises(ValueError, match=field):
        LiveRuntimeAllocator(**args)


def test_bad_decide_inputs_name_the_argument():
    alloc = allocator()
    with pytest.raises(ValueError, match="window_s"):
        alloc.decide(PERIOD_S, [SHORT], 0.0, START)
    with pytest.raises(ValueError, match="previous_assignment"):
        alloc.decide(PERIOD_S, [SHORT], PERIOD_S, {0: 96})
    with pytest.raises(ValueError, match="num_instances"):
        alloc.decide(PERIOD_S, [SHORT], PERIOD_S, START, num_instances=0)
    with pytest.raises(ValueError, match="allocation_period_s"):
        LiveRuntimeAllocator.from_policy_params({"capacities": CAPACITIES, "allocation_period_s": -1}, slo_s=SLO_S)


def test_scaling_adds_the_longest_runtime_and_releases_the_highest_rank_keeping_one_longest():
    from placement.arlo.live_allocator import apply_scaling

    assert apply_scaling({0: 16, 1: 64}, "scale_out", 64) == {0: 16, 1: 64, 2: 64}
    assert apply_scaling({0: 16, 1: 64, 2: 16}, "scale_in", 64) == {0: 16, 1: 64}
    assert apply_scaling({0: 16, 1: 64}, "scale_in", 64) == {0: 64}  # Eq. 7: the last instance runs the longest
    with pytest.raises(ValueError, match="at least two"):
        apply_scaling({0: 64}, "scale_in", 64)
    with pytest.raises(ValueError, match="0..N-1"):
        apply_scaling({0: 16, 2: 64}, "scale_out", 64)
