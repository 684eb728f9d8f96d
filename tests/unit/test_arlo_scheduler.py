"""Arlo Alg. 1 (multi-level queue with demotion) and its baselines ILB, IG and INFaaS-like bin packing."""

from __future__ import annotations

import pytest

from placement.arlo.request_scheduler import (
    ArloDispatch,
    BinPackingDispatch,
    InterGroupGreedy,
    IntraGroupLoadBalance,
    MultiLevelQueue,
)

# Arlo Fig. 5: four runtimes; a 200-token request has candidates Q2, Q3, Q4. The paper states the head loads of
# Q2 (54/60) and Q3 (28/48); the max lengths and the other instances' loads are this test's own choice.
FIG5_CAPACITIES = {128: 80, 256: 60, 384: 48, 512: 30}
FIG5_LOADS = {
    128: {"q1-a": 20, "q1-b": 35},
    256: {"q2-a": 54, "q2-b": 57, "q2-c": 59},
    384: {"q3-a": 28, "q3-b": 40},
    512: {"q4-a": 10},
}


def fig5_queue(policy=ArloDispatch, **kwargs) -> MultiLevelQueue:
    queue = policy(FIG5_CAPACITIES, **kwargs)
    for length, loads in FIG5_LOADS.items():
        for instance, outstanding in loads.items():
            queue.add_instance(instance, length, outstanding)
    return queue


def test_fig5_example_demotes_from_congested_q2_to_q3_head():
    queue = fig5_queue(threshold=0.85, decay=0.9, max_levels=3)
    assert queue.dispatch(200) == "q3-a"  # 54/60 = 0.9 >= 0.85; 28/48 = 0.58 < 0.85 * 0.9
    assert queue.outstanding("q3-a") == 29


def test_fig5_head_is_least_loaded_and_updates_after_dispatch():
    queue = fig5_queue(threshold=0.85, decay=0.9, max_levels=3)
    queue.set_outstanding("q3-a", 45)  # now q3-b (40) is the head: 40/48 = 0.83 >= 0.765 -> Q4 (10/30 < 0.6885)
    assert queue.dispatch(200) == "q4-a"
    queue.set_outstanding("q2-a", 10)  # the ideal runtime's head is no longer congested
    assert queue.dispatch(200) == "q2-a"


def test_fig5_falls_back_to_ideal_runtime_when_all_peeked_levels_congested():
    queue = fig5_queue(threshold=0.85, decay=0.9, max_levels=1)  # L = 1: only Q2 is peeked
    assert queue.dispatch(200) == "q2-a"
    queue = fig5_queue(threshold=0.5, decay=0.5, max_levels=3)  # every head is above its threshold
    assert queue.dispatch(200) == "q2-a"


def test_short_request_starts_at_shortest_runtime_and_completion_frees_capacity():
    queue = fig5_queue()
    assert queue.dispatch(100) == "q1-a"  # 20/80 below lambda
    queue.complete("q1-a")
    assert queue.outstanding("q1-a") == 20


def test_request_longer_than_longest_runtime_is_rejected_with_limit():
    with pytest.raises(ValueError, match="512 tokens"):
        fig5_queue().dispatch(513)


def test_runtime_without_instances_is_skipped_and_removed_instances_are_not_chosen():
    queue = ArloDispatch({64: 10, 128: 10})
    queue.add_instance("long", 128)
    assert queue.dispatch(10) == "long"
    queue.add_instance("short", 64)
    assert queue.dispatch(10) == "short"
    queue.remove_instance("short")
    assert queue.dispatch(10) == "long"
    queue.remove_instance("long")
    with pytest.raises(ValueError, match="no runtime instance"):
        queue.dispatch(10)


def test_ilb_stays_in_ideal_runtime_even_when_congested():
    queue = fig5_queue(IntraGroupLoadBalance)
    assert queue.dispatch(200) == "q2-a"
    assert queue.dispatch(200) == "q2-a"  # 55 < 57
    assert queue.dispatch(200) == "q2-a"  # 56 < 57
    for _ in range(4):
        assert queue.dispatch(200) in {"q2-a", "q2-b"}  # never demoted, never the fullest (59)
    assert abs(queue.outstanding("q2-a") - queue.outstanding("q2-b")) <= 1
    assert queue.outstanding("q2-c") == 59


def test_ig_takes_least_busy_among_all_candidates():
    queue = fig5_queue(InterGroupGreedy)
    assert queue.dispatch(200) == "q4-a"  # 10/30 is the lowest congestion among Q2..Q4 heads
    assert queue.dispatch(100) == "q1-a"  # 20/80 = 0.25 < 11/30


def test_bin_packing_fills_first_instance_under_capacity():
    queue = BinPackingDispatch({64: 2, 128: 2})
    queue.add_instance("a", 64)
    queue.add_instance("b", 128)
    assert [queue.dispatch(10) for _ in range(5)] == ["a", "a", "b", "b", "a"]


def test_alg1_matches_reference_on_random_states():
    """The heap-based Alg. 1 agrees with a direct transcription of its pseudo-code on random loads."""
    import random

    rng = random.Random(7)
    capacities = {64: 40, 128: 30, 192: 20, 256: 10}
    for _ in range(200):
        queue = ArloDispatch(capacities, threshold=0.85, decay=0.9, max_levels=rng.randint(1, 4))
        loads = {}
        for length in capacities:
            for k in range(rng.randint(0, 3)):
                loads[(length, k)] = rng.randint(0, capacities[length] + 5)
                queue.add_instance((length, k), length, loads[(length, k)])
        if not any(key[0] == 256 for key in loads):
            continue
        length = rng.randint(1, 256)
        candidates = [lv for lv in sorted(capacities) if lv >= length and any(key[0] == lv for key in loads)]
        candidates = candidates[:queue.max_levels]
        heads = {lv: min((loads[k], k[1]) for k in loads if k[0] == lv) for lv in candidates}
        expected, threshold = None, 0.85
        for lv in candidates:
            if heads[lv][0] / capacities[lv] < threshold:
                expected = (lv, heads[lv][1])
                break
            threshold *= 0.9
        if expected is None:
            expected = (candidates[0], heads[candidates[0]][1])
        assert queue.dispatch(length) == expected


def test_ideal_runtime_is_the_shortest_that_fits_and_names_the_longest_when_none_does():
    from placement.arlo.runtimes import ideal_runtime_length

    assert [ideal_runtime_length([64, 16, 128], n) for n in (1, 16, 17, 64, 65, 128)] == [16, 16, 64, 64, 128, 128]
    with pytest.raises(ValueError, match="longest runtime \\(128 tokens\\)"):
        ideal_runtime_length([16, 128], 129)
