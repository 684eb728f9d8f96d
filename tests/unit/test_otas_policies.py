"""OTAS policies: Alg. 1 batching constraints, Alg. 2 DP optimality against brute force, Alg. 3, eviction,
accounting."""

from __future__ import annotations

import itertools
import random

import pytest

from placement.otas.adaptive_batching import (
    AdaptiveBatcher,
    AdaptiveBatchingParams,
    OtasBatch,
    OtasRequest,
    parse_batching_params,
)
from placement.otas.baselines import FixedGammaAllocator, ModelSwitchingAllocator
from placement.otas.profile import OtasProfile
from placement.otas.replica_scheduler import OtasScheduler
from placement.otas.simulation import QueryType, fluctuating_poisson_trace, fluctuating_rates, simulate
from placement.otas.token_allocation import (
    BatchEstimate,
    OtasTokenAllocator,
    RateToGamma,
    TokenAllocationParams,
    allocate_by_load,
    allocate_dp,
    parse_allocation_params,
    profile_estimator,
)

GAMMAS = [-8, -4, 0, 2, 4]
BATCH_SIZES = [1, 2, 4, 8]


def make_profile(seed: int = 0) -> OtasProfile:
    """A small synthetic profile (a stand-in for tests): faster and less accurate as gamma decreases."""
    rng = random.Random(seed)
    latency = {}
    for g in GAMMAS:
        per_batch = 0.010 * (1 + 0.08 * g) * rng.uniform(0.9, 1.1)
        latency[g] = {b: per_batch * (0.5 + 0.5 * b) for b in BATCH_SIZES}
    accuracy = {
        "easy": {g: min(1.0, 0.9 + 0.01 * g) for g in GAMMAS},
        "hard": {g: max(0.1, 0.6 + 0.05 * g) for g in GAMMAS},
    }
    return OtasProfile(source="synthetic test stand-in", device="none", gamma_list=GAMMAS, batch_sizes=BATCH_SIZES,
                       latency_s=latency, accuracy=accuracy)


def request(task="easy", arrival=0.0, slo=1.0, utility=0.5) -> OtasRequest:
    return OtasRequest(task, arrival, arrival + slo, utility)


# ---- Alg. 1 -------------------------------------------------------------------------------------------------------
def test_batching_groups_similar_queries():
    batcher = AdaptiveBatcher(AdaptiveBatchingParams(delta_s=0.5, epsilon=3, eta_s=0.2, mu=0.3))
    queue: list[OtasBatch] = []
    for i in range(3):
        batcher.add(queue, request(arrival=0.01 * i))
    assert [len(b) for b in queue] == [3]


def test_batching_size_cap_epsilon():
    batcher = AdaptiveBatcher(AdaptiveBatchingParams(delta_s=0.5, epsilon=2, eta_s=1.0, mu=1.0))
    queue: list[OtasBatch] = []
    for i in range(5):
        batcher.add(queue, request(arrival=0.01 * i))
    assert [len(b) for b in queue] == [2, 2, 1]


def test_batching_first_request_wait_delta():
    batcher = AdaptiveBatcher(AdaptiveBatchingParams(delta_s=0.1, epsilon=64, eta_s=10.0, mu=10.0))
    queue: list[OtasBatch] = []
    batcher.add(queue, request(arrival=0.0, slo=5.0))
    batcher.add(queue, request(arrival=0.05, slo=5.0))
    batcher.add(queue, request(arrival=0.2, slo=5.0))  # first query of batch 0 waited 0.2 > delta
    assert [len(b) for b in queue] == [2, 1]


def test_batching_deadline_gap_eta_and_utility_gap_mu():
    batcher = AdaptiveBatcher(AdaptiveBatchingParams(delta_s=1.0, epsilon=64, eta_s=0.1, mu=0.2))
    queue: list[OtasBatch] = []
    batcher.add(queue, request(slo=1.0, utility=0.5))
    batcher.add(queue, request(slo=2.0, utility=0.5))  # deadline differs by 1.0 > eta
    batcher.add(queue, request(slo=1.05, utility=0.9))  # utility differs by 0.4 > mu
    batcher.add(queue, request(slo=1.05, utility=0.6))  # joins the first batch
    assert [len(b) for b in queue] == [2, 1, 1]
    assert queue[0].deadline_s == pytest.approx(1.0)  # d_b = min d_r


def test_batching_params_errors_name_the_field():
    with pytest.raises(ValueError, match="epsilon"):
        parse_batching_params({"epsilon": 0})
    with pytest.raises(ValueError, match="kappa"):
        parse_allocation_params({"kappa": -1})


# ---- Alg. 2 against brute force -----------------------------------------------------------------------------------
def brute_force(batches, now, gammas, estimate):
    """Problem (1) by enumeration: each batch in deadline order skipped or run at one gamma."""
    order = sorted(batches, key=lambda b: b.deadline_s)
    best = 0.0
    for choice in itertools.product([None] + gammas, repeat=len(order)):
        clock, total, feasible = now, 0.0, True
        for batch, gamma in zip(order, choice):
            if gamma is None:
                continue
            est = estimate(batch, gamma)
            clock += est.latency_s
            if clock >= batch.deadline_s:
                feasible = False
                break
            total += est.utility
        if feasible:
            best = max(best, total)
    return best


def random_batches(rng: random.Random, count: int) -> list[OtasBatch]:
    batches = []
    for _ in range(count):
        size = rng.randint(1, 8)
        slo = rng.uniform(0.005, 0.08)
        batches.append(OtasBatch([request(task=rng.choice(["easy", "hard"]), slo=slo * rng.uniform(1, 1.2),
                                          utility=rng.choice([0.01, 0.2, 0.3, 1.0])) for _ in range(size)]))
    return batches


@pytest.mark.parametrize("seed", range(25))
def test_dp_matches_brute_force_optimum(seed):
    rng = random.Random(seed)
    profile = make_profile(seed)
    estimate = profile_estimator(profile)
    batches = random_batches(rng, rng.randint(1, 5))
    plan = allocate_dp(batches, 0.0, GAMMAS, estimate, max_labels_per_cell=None)
    optimum = brute_force(batches, 0.0, GAMMAS, estimate)
    assert plan.expected_utility == pytest.approx(optimum)
    # The plan itself is feasible and achieves what it claims.
    clock, total = 0.0, 0.0
    for batch, gamma in zip(plan.batches, plan.gammas):
        if gamma is None:
            continue
        est = estimate(batch, gamma)
        clock += est.latency_s
        assert clock < batch.deadline_s
        total += est.utility
    assert total == pytest.approx(optimum)


def test_single_label_dp_can_miss_the_optimum_that_pareto_labels_find():
    """The paper's one label per cell keeps the higher-utility prefix even when it finishes too late for the rest."""
    profile = make_profile(0)
    estimate = profile_estimator(profile)
    found_gap = False
    for seed in range(200):
        rng = random.Random(seed)
        batches = random_batches(rng, 4)
        exact = allocate_dp(batches, 0.0, GAMMAS, estimate, max_labels_per_cell=None).expected_utility
        single = allocate_dp(batches, 0.0, GAMMAS, estimate, max_labels_per_cell=1).expected_utility
        assert single <= exact + 1e-12
        found_gap |= single < exact - 1e-9
    assert found_gap


def test_dp_prefers_prompts_with_slack_and_merging_under_pressure():
    profile = make_profile(0)
    estimate = profile_estimator(profile)
    relaxed = [OtasBatch([request("hard", slo=10.0, utility=1.0)]) for _ in range(6)]
    plan = allocate_dp(relaxed, 0.0, GAMMAS, estimate)
    assert plan.gammas == [max(GAMMAS)] * 6
    tight_slo = 6 * profile.batch_latency_s(-8, 1) * 1.05
    tight = [OtasBatch([request("easy", slo=tight_slo, utility=1.0)]) for _ in range(6)]
    plan = allocate_dp(tight, 0.0, GAMMAS, estimate)
    assert plan.gammas == [min(GAMMAS)] * 6  # only full merging serves all six in time


# ---- Alg. 3 -------------------------------------------------------------------------------------------------------
def test_rate_to_gamma_is_monotone_and_profiled():
    profile = make_profile(0)
    f = RateToGamma.from_profile(profile, batch_size=8)
    picks = [f(rate) for rate in (1, 100, 500, 700, 900, 1e6)]
    assert picks == sorted(picks, reverse=True)
    assert picks[0] == max(GAMMAS) and picks[-1] == min(GAMMAS)


def test_load_allocation_rules():
    profile = make_profile(0)
    estimate = profile_estimator(profile)
    f = RateToGamma.from_profile(profile, batch_size=8)
    doomed = OtasBatch([request(slo=0.001, utility=0.1)])
    critical = OtasBatch([request(slo=5.0, utility=0.95)])
    normal = OtasBatch([request(slo=6.0, utility=0.1)])
    plan = allocate_by_load([normal, critical, doomed], 0.0, GAMMAS, estimate, rate_rps=1e6, rate_to_gamma=f, kappa=0.8,
                            use_queue_slack=False)  # Alg. 3 as published
    by_batch = dict(zip(map(id, plan.batches), plan.gammas))
    assert by_batch[id(doomed)] == min(GAMMAS)  # would miss its deadline
    assert by_batch[id(critical)] == max(GAMMAS)  # mean utility > kappa
    assert by_batch[id(normal)] == f(1e6) == min(GAMMAS)


def test_load_allocation_gives_critical_batches_the_most_accurate_gamma_not_max_list():
    """Above kappa the published Alg. 3 takes max(L), the most accurate gamma where accuracy grows with gamma. On a
    profile where prompts lower the accuracy (here gamma 4 below gamma 0), the default takes the gamma of the
    highest estimated utility that meets the batch's deadline."""
    table = {-8: BatchEstimate(0.1, 0.7), 0: BatchEstimate(0.2, 0.9), 4: BatchEstimate(0.3, 0.8)}
    critical = [OtasBatch([request(slo=5.0, utility=0.95)])]
    args = (critical, 0.0, list(table), lambda batch, gamma: table[gamma], 1.0, lambda rate: -8, 0.8)
    assert allocate_by_load(*args, use_queue_slack=False).gammas == [4]
    assert allocate_by_load(*args).gammas == [0]


def test_load_allocation_does_not_merge_when_the_queue_meets_its_deadlines_at_gamma_0():
    """The arrival rate of the last window passes the gamma-0 throughput, so Alg. 3's f(q) picks a merged gamma;
    but the queue is short and every batch meets its deadline at every gamma. Problem (1) asks for the most utility
    subject to the deadlines: the scheduler runs the most accurate gamma, not the merged one. The published Alg. 3
    (`TokenAllocationParams.paper()`) takes f(q)'s merged gamma."""
    profile = make_profile(0)
    window_s, queries = 0.05, 15
    rate = queries / window_s
    assert RateToGamma.from_profile(profile, batch_size=8)(rate) < 0 < 0.9 * profile.throughput_rps(0, 8) < rate
    gammas = {}
    for name, params in {"default": TokenAllocationParams(gamma_list=GAMMAS, initial_stage_s=0.0),
                         "paper": TokenAllocationParams.paper(gamma_list=GAMMAS, initial_stage_s=0.0)}.items():
        scheduler = OtasScheduler(OtasTokenAllocator(profile, params, batch_cap=8), AdaptiveBatchingParams(epsilon=8),
                                  rate_window_s=window_s)
        for i in range(queries):
            scheduler.submit(request("hard", arrival=i * window_s / queries, slo=1.0, utility=0.5))
        now = window_s
        assert len(scheduler.queue) <= params.beta  # Alg. 3's regime
        # Every queued batch meets its deadline at gamma 0 (and at the slowest gamma) one after another.
        slowest = sum(profile.batch_latency_s(max(GAMMAS), len(b)) for b in scheduler.queue)
        assert now + slowest < min(b.deadline_s for b in scheduler.queue)
        picked = []
        while scheduler.queue:
            dispatch, evicted = scheduler.next_batch(now)
            assert not evicted
            picked.append(dispatch.gamma)
            now += profile.batch_latency_s(dispatch.gamma, len(dispatch.batch))
        gammas[name] = picked
    assert gammas["default"] == [max(GAMMAS)] * len(gammas["default"])  # the most accurate on this profile
    assert all(g < 0 for g in gammas["paper"])


def test_load_allocation_keeps_the_merged_gamma_when_the_deadlines_need_it():
    """Three batches due together, just after three runs at f(q)'s merged gamma: at any slower gamma the last one
    would be late, so the slack-aware Alg. 3 keeps f(q)'s gamma for all three."""
    profile = make_profile(0)
    estimate = profile_estimator(profile)
    f = RateToGamma.from_profile(profile, batch_size=8)
    merged = f(0.95 * profile.throughput_rps(-8, 8))
    assert merged < 0
    due = 3 * profile.batch_latency_s(merged, 1) * 1.02
    batches = [OtasBatch([request("hard", slo=due, utility=0.5)]) for _ in range(3)]
    plan = allocate_by_load(batches, 0.0, GAMMAS, estimate, rate_rps=0.95 * profile.throughput_rps(-8, 8),
                            rate_to_gamma=f, kappa=0.8)
    assert plan.gammas == [merged] * 3


def test_allocator_uses_load_fallback_for_short_queue_and_initial_stage():
    profile = make_profile(0)
    allocator = OtasTokenAllocator(profile, TokenAllocationParams(gamma_list=GAMMAS, beta=2, initial_stage_s=1.0),
                                   batch_cap=8)
    batches = [OtasBatch([request(slo=1.0)]) for _ in range(4)]
    assert allocator.allocate(batches, 0.0, 10.0, since_start_s=0.5).method == "load"
    assert allocator.allocate(batches[:2], 0.0, 10.0, since_start_s=5.0).method == "load"
    assert allocator.allocate(batches, 0.0, 10.0, since_start_s=5.0).method == "dp"


def test_allocator_rejects_unprofiled_gammas():
    with pytest.raises(ValueError, match="gamma_list"):
        OtasTokenAllocator(make_profile(0), TokenAllocationParams(gamma_list=[-20, 0]), batch_cap=8)


# ---- scheduler: eviction and accounting -----------------------------------------------------------------------------
def test_scheduler_evicts_queries_that_cannot_meet_their_deadline():
    profile = make_profile(0)
    scheduler = OtasScheduler(FixedGammaAllocator(profile, 0))
    scheduler.submit(request(arrival=0.0, slo=0.001))
    scheduler.submit(request(arrival=0.0, slo=1.0, utility=0.5))
    dispatch, evicted = scheduler.next_batch(0.0)
    assert len(evicted) == 1 and scheduler.ledger.counts["evicted"] == 1
    assert dispatch is not None and len(dispatch.batch) == 1 and dispatch.gamma == 0


def test_scheduler_accounts_utility_by_outcome():
    profile = make_profile(0)
    scheduler = OtasScheduler(FixedGammaAllocator(profile, 0), AdaptiveBatchingParams(epsilon=8))
    for utility in (0.3, 0.3, 0.3):
        scheduler.submit(request(arrival=0.0, slo=1.0, utility=utility))
    dispatch, _ = scheduler.next_batch(0.0)
    scheduler.complete(dispatch, finish_s=0.5, correct=[True, False, True])
    assert scheduler.ledger.counts["correct"] == 2 and scheduler.ledger.counts["wrong"] == 1
    assert scheduler.ledger.utility == pytest.approx(0.6)
    scheduler.submit(request(arrival=1.0, slo=0.5, utility=1.0))
    dispatch, _ = scheduler.next_batch(1.0)
    scheduler.complete(dispatch, finish_s=2.0, correct=[True])
    assert scheduler.ledger.counts["late"] == 1 and scheduler.ledger.utility == pytest.approx(0.6)


def test_model_switching_pays_the_load_delay_once_per_switch():
    profile = make_profile(0)
    allocator = ModelSwitchingAllocator(profile, [-8, 0, 4], switch_delay_s=0.3, batch_cap=8, min_dwell_s=0.0)
    batches = [OtasBatch([request()])]
    assert allocator.allocate(batches, 0.0, rate_rps=1.0, since_start_s=0.0).setup_s == 0.0  # already the largest
    switched = allocator.allocate(batches, 1.0, rate_rps=1e6, since_start_s=1.0)
    assert switched.setup_s == 0.3 and switched.gammas == [-8]
    assert allocator.allocate(batches, 2.0, rate_rps=1e6, since_start_s=2.0).setup_s == 0.0


def test_simulation_accounts_every_query_and_otas_beats_fixed_plain_under_overload():
    profile = make_profile(0)
    types = [QueryType("easy", 0.06, 0.3), QueryType("hard", 0.06, 1.0), QueryType("hard", 0.12, 0.2)]
    capacity = profile.throughput_rps(0, 8)
    trace = fluctuating_poisson_trace(fluctuating_rates(6, 0.5 * capacity, 1.6 * capacity, seed=1), types, seed=2)
    params = TokenAllocationParams(gamma_list=GAMMAS, initial_stage_s=0.5)
    results = {}
    for name, allocator in {"otas": OtasTokenAllocator(profile, params, batch_cap=8),
                            "fixed0": FixedGammaAllocator(profile, 0)}.items():
        result = simulate(trace, OtasScheduler(allocator, AdaptiveBatchingParams(epsilon=8, delta_s=0.05, eta_s=0.05)),
                          profile)
        assert result.ledger.total == len(trace)
        results[name] = result.ledger.utility
    assert results["otas"] > results["fixed0"]


def test_paper_single_label_dp_returns_the_hand_solved_paper_optimum():
    """OTAS Alg. 2 as published keeps one label per cell, the highest utility. Hand case: gammas 'fast' (1 s,
    utility 1) and 'slow' (2.5 s, utility 1.5); batches A, B, C due at 2.6, 3.6 and 3.7 s. Row B's 'fast' cell keeps
    (clock 3.5, utility 2.5) from A slow + B fast over (2.0, 2.0) from A fast + B fast, so C (1 s more) no longer
    fits after it: the paper's DP returns 2.5, while A, B, C all fast earn 3 (the Pareto labels find it)."""
    fast, slow = 0, 4
    table = {fast: BatchEstimate(1.0, 1.0), slow: BatchEstimate(2.5, 1.5)}
    batches = [OtasBatch([request(slo=deadline)]) for deadline in (2.6, 3.6, 3.7)]
    params = TokenAllocationParams.paper(gamma_list=[fast, slow])
    assert params.max_labels_per_cell == 1
    paper = allocate_dp(batches, 0.0, params.gamma_list, lambda batch, gamma: table[gamma], params.max_labels_per_cell)
    assert paper.expected_utility == pytest.approx(2.5)
    assert paper.gammas[2] is None and slow in paper.gammas  # C left out after a slow prefix
    exact = allocate_dp(batches, 0.0, params.gamma_list, lambda batch, gamma: table[gamma], None)
    assert exact.expected_utility == pytest.approx(3.0) and exact.gammas == [fast, fast, fast]


def test_simulation_grades_with_the_given_grader_instead_of_the_profile():
    """Held-out grading: correctness comes from the grader (here: only gamma 0 answers right), not the profile."""
    profile = make_profile(0)
    types = [QueryType("easy", 0.5, 1.0)]
    trace = fluctuating_poisson_trace([0.3 * profile.throughput_rps(0, 8)] * 2, types, seed=3)
    seen = []

    def grade(query, task_id, gamma):
        seen.append(gamma)
        return gamma == 0

    for gamma in (0, -8):
        scheduler = OtasScheduler(FixedGammaAllocator(profile, gamma),
                                  AdaptiveBatchingParams(epsilon=8, delta_s=0.05, eta_s=0.05))
        result = simulate(trace, scheduler, profile, grade)
        counts = result.ledger.counts
        assert counts["correct" if gamma == 0 else "wrong"] == len(trace) - counts["late"] - counts["evicted"] > 0
    assert set(seen) == {0, -8}
