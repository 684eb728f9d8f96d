"""The inter-op DP and the intra-op ILP against brute force on random small instances (no Ray, no torch)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from parallel.comm_model import AlphaBeta, CommModel, fit_alpha_beta
from parallel.inter_op import slice_stages, summed_stage_latency
from parallel.intra_op import (
    BlockCost,
    BlockShape,
    IntraOpProblem,
    LinearNode,
    Segment,
    StageCost,
    enumerate_optimum,
    evaluate,
    solve_intra_op,
    stage_problem,
)
from parallel.tensor_parallel import SHARDINGS

NUM_RANDOM_INSTANCES = 25


def brute_force_partition(latencies, receive, weights, budget, num_stages):
    n = len(latencies)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = list(zip((0, *cuts), (*cuts, n)))
        value = 0.0
        for i, k in bounds:
            stage = math.inf if sum(weights[i:k]) > budget else receive[i] + sum(latencies[i:k])
            value = max(value, stage)
        best = min(best, value)
    return best


def test_inter_op_dp_matches_brute_force_on_random_instances():
    rng = random.Random(1)
    for _ in range(NUM_RANDOM_INSTANCES):
        n = rng.randint(1, 8)
        latencies = [rng.uniform(0.1, 5.0) for _ in range(n)]
        receive = [rng.uniform(0.0, 0.5) for _ in range(n)]
        weights = [rng.randint(1, 10) for _ in range(n)]
        budget = rng.choice([math.inf, rng.randint(5, 30)])
        for num_stages in range(1, n + 1):
            expected = brute_force_partition(latencies, receive, weights, budget, num_stages)
            partition = slice_stages(n, num_stages, summed_stage_latency(latencies, receive, weights, budget))
            if math.isinf(expected):
                assert partition is None
                continue
            assert partition is not None
            assert partition.max_stage_latency_s == pytest.approx(expected)
            assert partition.num_stages == num_stages
            assert partition.bounds[0][0] == 0 and partition.bounds[-1][1] == n
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(partition.bounds, partition.bounds[1:]))


def test_inter_op_rejects_bad_stage_counts():
    with pytest.raises(ValueError, match="num_stages"):
        slice_stages(3, 4, lambda i, k: 1.0)


def test_alpha_beta_fit_recovers_a_line():
    sizes = [1e3, 1e4, 1e5, 1e6]
    fit = fit_alpha_beta(sizes, [2e-4 + 3e-9 * s for s in sizes])
    assert fit.alpha_s == pytest.approx(2e-4, rel=1e-6)
    assert fit.beta_s_per_byte == pytest.approx(3e-9, rel=1e-6)


def _random_problem(rng: random.Random, degree: int, budget_fraction: float | None) -> IntraOpProblem:
    comm = CommModel(send=AlphaBeta(alpha_s=1e-4, beta_s_per_byte=1e-9),
                     all_reduce={degree: AlphaBeta(alpha_s=rng.uniform(0, 2e-3), beta_s_per_byte=rng.uniform(0, 5e-9))},
                     all_gather={degree: AlphaBeta(alpha_s=rng.uniform(0, 2e-3), beta_s_per_byte=rng.uniform(0, 5e-9))})
    segments = []
    count = 0
    for _ in range(rng.randint(1, 3)):
        nodes = []
        for _ in range(rng.randint(1, 3)):
            allowed = tuple(s for s in SHARDINGS if s == "replicated" or rng.random() < 0.8)
            nodes.append(LinearNode(name=f"n{count}", compute_s=rng.uniform(1e-4, 5e-3),
                                    follow_compute_s=rng.uniform(0, 1e-3),
                                    weight_bytes=rng.randint(1_000, 100_000), bias_bytes=rng.randint(0, 1_000),
                                    output_bytes=rng.randint(1_000, 1_000_000), allowed=allowed))
            count += 1
        segments.append(Segment(nodes=tuple(nodes)))
    full = sum(n.weight_bytes + n.bias_bytes for s in segments for n in s.nodes)
    budget = math.inf if budget_fraction is None else full * budget_fraction
    return IntraOpProblem(segments=segments, degree=degree, comm=comm, memory_budget_bytes=budget)


def test_intra_op_ilp_matches_enumeration_on_random_instances():
    rng = random.Random(7)
    for _ in range(NUM_RANDOM_INSTANCES):
        problem = _random_problem(rng, degree=rng.choice([2, 4]),
                                  budget_fraction=rng.choice([None, 0.9, 0.6, 0.4, 0.1]))
        expected = enumerate_optimum(problem)
        solved = solve_intra_op(problem)
        if expected is None:
            assert solved is None
            continue
        assert solved is not None
        assert solved.latency_s == pytest.approx(expected.latency_s, rel=1e-6, abs=1e-12)
        assert solved.memory_bytes <= problem.memory_budget_bytes + 1e-6
        assert evaluate(problem, solved.choices).latency_s == pytest.approx(solved.latency_s)


def _minilm_like_stage(num_blocks: int = 2) -> StageCost:
    shape = BlockShape(hidden_size=384, num_heads=12, head_dim=32, intermediate_size=1536)
    return StageCost(blocks=[BlockCost(prefix=f"layer{i}.", shape=shape, latency_s=2e-3, other_weight_bytes=3072,
                                       batch_size=1, tokens_per_sequence=32) for i in range(num_blocks)])


def test_tight_memory_budget_forces_sharding():
    degree = 2
    # Collectives far dearer than the compute they save: unconstrained, everything stays replicated.
    expensive = AlphaBeta(alpha_s=1.0, beta_s_per_byte=0.0)
    comm = CommModel(send=expensive, all_reduce={degree: expensive}, all_gather={degree: expensive})
    stage = _minilm_like_stage()
    loose = solve_intra_op(stage_problem(stage, degree, comm, memory_budget_bytes=math.inf))
    assert loose is not None and set(loose.choices.values()) == {"replicated"}
    full_bytes = loose.memory_bytes
    tight = solve_intra_op(stage_problem(stage, degree, comm, memory_budget_bytes=0.6 * full_bytes))
    assert tight is not None
    assert tight.memory_bytes <= 0.6 * full_bytes
    assert any(choice != "replicated" for choice in tight.choices.values())
    assert tight.latency_s > loose.latency_s
    impossible = solve_intra_op(stage_problem(stage, degree, comm, memory_budget_bytes=0.1 * full_bytes))
    assert impossible is None


def test_cheap_collectives_give_megatron_sharding():
    degree = 2
    free = AlphaBeta(alpha_s=0.0, beta_s_per_byte=0.0)
    comm = CommModel(send=free, all_reduce={degree: free}, all_gather={degree: free})
    solution = solve_intra_op(stage_problem(_minilm_like_stage(1), degree, comm, memory_budget_bytes=math.inf))
    assert solution is not None
    # With free communication every linear splits; the minimum memory among optimal plans is not asked for,
    # but no linear may stay replicated since that doubles its compute.
    assert all(choice != "replicated" for choice in solution.choices.values())


def _megatron(stage: StageCost) -> dict[str, str]:
    from parallel.tensor_parallel import BlockShardingPlan

    return {f"{block.prefix}{name}": choice for block in stage.blocks
            for name, choice in BlockShardingPlan.megatron().as_dict().items()}


def test_a_block_run_sharded_prices_its_megatron_plan_at_what_it_measured():
    degree = 2
    fit = AlphaBeta(alpha_s=1e-4, beta_s_per_byte=1e-10)
    comm = CommModel(send=fit, all_reduce={degree: fit}, all_gather={degree: fit})
    composed_stage = _minilm_like_stage(2)
    composed = evaluate(stage_problem(composed_stage, degree, comm, math.inf), _megatron(composed_stage)).latency_s
    measured_per_block = 3.1e-3  # dearer than half the block plus two back-to-back all-reduces
    measured_stage = StageCost(blocks=[BlockCost(**{**vars(block), "sharded_latency_s": measured_per_block})
                                       for block in composed_stage.blocks])
    problem = stage_problem(measured_stage, degree, comm, math.inf)
    assert evaluate(problem, _megatron(measured_stage)).latency_s == pytest.approx(2 * measured_per_block)
    assert 2 * measured_per_block > composed
    # The replicated plan has no collective, so it keeps the block's own measured latency.
    replicated = {name: "replicated" for name in _megatron(measured_stage)}
    assert evaluate(problem, replicated).latency_s == pytest.approx(evaluate(
        stage_problem(composed_stage, degree, comm, math.inf), replicated).latency_s)
    # Sharding that measured slower than the block whole on one device is not chosen; measured faster, it is.
    assert set(solve_intra_op(problem).choices.values()) == {"replicated"}
    cheap_stage = StageCost(blocks=[BlockCost(**{**vars(block), "sharded_latency_s": 1.2e-3})
                                    for block in composed_stage.blocks])
    chosen = solve_intra_op(stage_problem(cheap_stage, degree, comm, math.inf))
    assert chosen.latency_s == pytest.approx(2 * 1.2e-3) and chosen.choices == _megatron(cheap_stage)


def test_every_collective_of_a_calibrated_block_pays_the_measured_extra():
    from parallel.intra_op import block_segments

    degree = 2
    fit = AlphaBeta(alpha_s=1e-4, beta_s_per_byte=0.0)
    comm = CommModel(send=fit, all_reduce={degree: fit}, all_gather={degree: fit})
    block = BlockCost(prefix="layer1.", shape=BlockShape(hidden_size=384, num_heads=12, head_dim=32,
                                                         intermediate_size=1536),
                      latency_s=2e-3, other_weight_bytes=0, batch_size=1, tokens_per_sequence=32,
                      sharded_latency_s=2e-3)
    extras = [node.collective_extra_s for segment in block_segments(block, degree, comm) for node in segment.nodes]
    # Megatron composed: half the block (1 ms) plus two all-reduces of 0.1 ms; measured 2 ms: 0.4 ms more each.
    assert extras == pytest.approx([0.4e-3] * 4)
    # Not run sharded, or without a communication model: the alpha-beta fit alone.
    uncalibrated = BlockCost(**{**vars(block), "sharded_latency_s": None})
    assert {n.collective_extra_s for s in block_segments(uncalibrated, degree, comm) for n in s.nodes} == {0.0}
