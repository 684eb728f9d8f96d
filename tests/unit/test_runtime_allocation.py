"""Arlo Eq. 1-7 runtime allocation: the DP against brute force, constraints, periodic re-allocation."""

from __future__ import annotations

import numpy as np
import pytest

from placement.arlo.paper_profiles import paper_runtime_profiles
from placement.arlo.runtime_allocation import (
    PeriodicRuntimeAllocator,
    allocation_lower_bounds,
    evaluate_allocation,
    solve_allocation,
    solve_allocation_brute_force,
)
from placement.arlo.runtimes import RuntimeProfile, RuntimeProfileSet


def random_case(rng: np.random.Generator):
    count = int(rng.integers(2, 5))
    lengths = sorted(int(x) * 32 for x in rng.choice(np.arange(1, 17), count, replace=False))
    base = rng.uniform(0.001, 0.003)
    batch = int(rng.integers(1, 3))
    runtimes = [RuntimeProfile(max_length_tokens=length,
                               batch_latency_s={1: base * (1 + k), 2: base * (1 + k) * 1.6}, max_batch_size=batch,
                               slo_s=0.03)
                for k, length in enumerate(lengths)]
    profiles = RuntimeProfileSet(model="synthetic", source="synthetic test case", runtimes=runtimes)
    requests = [float(x) for x in rng.uniform(0, 30, count)]
    devices = sum(allocation_lower_bounds(profiles, requests)) + int(rng.integers(0, 6))
    return profiles, requests, devices


def test_dp_matches_brute_force_on_random_small_cases():
    rng = np.random.default_rng(3)
    for _ in range(150):
        profiles, requests, devices = random_case(rng)
        exact = solve_allocation(profiles, requests, devices)
        brute = solve_allocation_brute_force(profiles, requests, devices)
        assert exact.total_latency_s == pytest.approx(brute.total_latency_s, rel=1e-9, abs=1e-12)


def test_solution_meets_every_constraint():
    rng = np.random.default_rng(4)
    for _ in range(50):
        profiles, requests, devices = random_case(rng)
        result = solve_allocation(profiles, requests, devices)
        assert sum(result.instances) == devices  # Eq. 2
        for n, bound in zip(result.instances, allocation_lower_bounds(profiles, requests)):
            assert n >= bound  # Eq. 3 and Eq. 7
        assert result.instances[-1] >= 1  # Eq. 7
        assert sum(result.served_requests) == pytest.approx(sum(requests))  # every request served somewhere


def test_overflow_is_demoted_to_longer_runtime_when_devices_are_tight():
    runtimes = [RuntimeProfile(max_length_tokens=64, batch_latency_s={1: 0.01}, max_batch_size=1, slo_s=0.1),
                RuntimeProfile(max_length_tokens=128, batch_latency_s={1: 0.02}, max_batch_size=1, slo_s=0.1)]
    profiles = RuntimeProfileSet(model="m", source="synthetic", runtimes=runtimes)  # M = 10 and 5
    result = evaluate_allocation(profiles, [15.0, 1.0], [1, 1])  # Eq. 4: 5 of the 15 short requests overflow
    assert result.overflow_requests[0] == pytest.approx(5.0)
    assert result.served_requests == pytest.approx([10.0, 6.0])
    best = solve_allocation(profiles, [15.0, 1.0], 2)
    assert best.instances == [1, 1]  # Eq. 7 forces one long instance, Eq. 3 one short


def test_infeasible_device_count_names_the_limit():
    profiles = paper_runtime_profiles("bert-base")
    requests = [1000.0] * len(profiles.runtimes)
    with pytest.raises(ValueError, match="num_devices=3"):
        solve_allocation(profiles, requests, 3)


def test_paper_scale_allocation_favours_short_runtimes_for_short_traffic():
    profiles = paper_runtime_profiles("bert-base")
    requests = [200.0, 50.0, 10.0, 5.0, 2.0, 1.0, 1.0, 1.0]
    result = solve_allocation(profiles, requests, 20)
    assert result.instances[0] == max(result.instances)
    assert sum(result.instances) == 20


def test_periodic_allocator_waits_for_its_period():
    profiles = paper_runtime_profiles("bert-base")
    allocator = PeriodicRuntimeAllocator(profiles, period_s=120.0)
    rng = np.random.default_rng(0)
    for k in range(12000):  # 100 requests/s, all within the 64-token runtime
        allocator.observe(k * 0.01, int(rng.integers(1, 64)))
    assert allocator.maybe_reallocate(60.0, 10) is None
    result = allocator.maybe_reallocate(120.0, 10)
    assert result is not None and sum(result.instances) == 10
    assert result.instances == [9, 0, 0, 0, 0, 0, 0, 1]  # Eq. 7 keeps one 512; the rest serve the short traffic
    assert allocator.maybe_reallocate(130.0, 10) is None


def test_paper_objective_reads_the_profiled_table_and_matches_a_hand_solved_case():
    """Arlo §3.4 Eq. 1 as published: L_i(B) is the profiled latency table (batch size -> latency) read at B.
    Two batch-1 runtimes of 1 ms and 2 ms, SLO 100 ms (M = 100 and 50), Q = (60, 20) requests per SLO period, 3
    devices. By hand: N = (0, 3) costs 80 x 2 ms x 80/3 = 4.27 s; (1, 2): 60 x 60 ms + 20 x 20 ms = 4.0 s;
    (2, 1): 60 x 30 ms + 20 x 40 ms = 2.6 s, the optimum."""
    runtimes = [RuntimeProfile(max_length_tokens=length, batch_latency_s={1: seconds}, max_batch_size=1, slo_s=0.1)
                for length, seconds in ((64, 0.001), (512, 0.002))]
    profiles = RuntimeProfileSet(model="hand", source="hand-solved test case", runtimes=runtimes)
    assert runtimes[0].profiled_latency_s(30.0) == pytest.approx(0.030)
    paper = solve_allocation(profiles, [60.0, 20.0], 3, objective="paper")
    assert paper.instances == [2, 1]
    assert paper.total_latency_s == pytest.approx(2.6)
    assert evaluate_allocation(profiles, [60.0, 20.0], [1, 2], "paper").total_latency_s == pytest.approx(4.0)
    # The project default prices the same allocation by the M/D/1 wait instead: a different objective value.
    assert solve_allocation(profiles, [60.0, 20.0], 3).total_latency_s < 1.0
    with pytest.raises(ValueError, match="objective"):
        solve_allocation(profiles, [60.0, 20.0], 3, objective="mean")


def test_paper_objective_dp_matches_brute_force():
    rng = np.random.default_rng(5)
    for _ in range(60):
        profiles, requests, devices = random_case(rng)
        exact = solve_allocation(profiles, requests, devices, objective="paper")
        brute = solve_allocation_brute_force(profiles, requests, devices, objective="paper")
        assert exact.total_latency_s == pytest.approx(brute.total_latency_s, rel=1e-9, abs=1e-12)
