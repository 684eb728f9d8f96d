"""The AlpaServe planner (§4.2) and its baselines: memory feasibility, the paper preset against Selective
Replication on held-out traffic, consistent predictions, bucket enumeration, and the placement's JSON form."""

import pytest

from placement.alpaserve.baselines import clockwork_plus_plus, round_robin, selective_replication
from placement.alpaserve.paper_profiles import GB, alpaserve_test_profiles, replicate_profiles, table1_profiles
from placement.alpaserve.planner import (
    PlannerConfig,
    device_buckets,
    group_partitions,
    model_buckets,
    parallel_configs,
    plan,
    select_models,
    uneven_partitions,
)
from placement.alpaserve.serve_baselines import proportional_deployments
from placement.alpaserve.simulator import simulate
from placement.core.placement_plan import GroupPlacement, Placement
from placement.core.profiles import ParallelConfig
from placement.core.workload import gamma_workload

BUDGET = 13 * GB


def case(counts, total_rate, cv, duration_s=120.0, slo_scale=5.0, seed=0, popularity_exponent=0.5):
    """Copies of Table 1's models under Gamma traffic; `popularity_exponent` None gives every model the same rate."""
    model_set = replicate_profiles(table1_profiles(), counts)
    names = sorted(model_set.profiles.models)
    latency = [model_set.profiles.models[n].single_device_latency() for n in names]
    workload = gamma_workload(names, total_rate, cv, [slo_scale * lat for lat in latency], duration_s,
                              popularity_exponent=popularity_exponent, seed=seed)
    return names, model_set.profiles, workload


def assert_feasible(placement: Placement, profiles, num_devices: int, budget: int):
    assert placement.num_devices <= num_devices
    placement.check_memory(profiles, budget)
    for group in placement.groups:
        assert group.config.num_devices == group.num_devices
        assert group.weight_bytes_per_device(profiles) <= budget


@pytest.mark.parametrize("counts,devices,rate,cv", [
    ({"bert-2.7b": 4}, 4, 12.0, 4.0),  # §3.1/§3.2-like: bursty, models that fill most of a device
    ({"bert-1.3b": 4, "bert-6.7b": 2}, 6, 10.0, 3.0),  # two buckets, a model that fits no single device
])
def test_planner_and_selective_replication_are_feasible_and_predict_what_the_simulator_says(counts, devices, rate, cv):
    names, profiles, workload = case(counts, rate, cv)
    ours = plan(names, profiles, workload, devices, BUDGET)
    sr = selective_replication(names, profiles, workload, devices, BUDGET)
    assert_feasible(ours, profiles, devices, BUDGET)
    assert_feasible(sr, profiles, devices, BUDGET)
    assert all(g.num_devices == 1 for g in sr.groups)
    # The prediction is what the simulator says of the returned placement.
    assert simulate(ours, profiles, workload).slo_attainment() == pytest.approx(ours.predicted_slo_attainment)
    assert simulate(sr, profiles, workload).slo_attainment() == pytest.approx(sr.predicted_slo_attainment)
    assert ours.stats.simulations > 0 and ours.stats.candidates > 0


def test_paper_search_chooses_another_placement_than_sr_and_wins_on_held_out_traffic():
    """AlpaServe §3.2 / §6.2: four 5.4 GB models on four devices under bursty (CV 4) traffic. SR can only
    replicate whole models on single devices; the paper's search (Alg. 1 greedy inside Alg. 2) must choose
    2-stage pipelines that each host every model, and that choice must serve more of traffic it never saw
    (another seed, five times longer) than SR's."""
    names, profiles, workload = case({"bert-2.7b": 4}, 12.0, 4.0, seed=1)
    _, _, held_out = case({"bert-2.7b": 4}, 12.0, 4.0, duration_s=600.0, seed=2)
    config = PlannerConfig.paper()
    ours = plan(names, profiles, workload, 4, BUDGET, config)
    sr = selective_replication(names, profiles, workload, 4, BUDGET, config)
    assert_feasible(ours, profiles, 4, BUDGET)
    assert ours.normalize().groups != sr.normalize().groups
    assert any(g.num_devices > 1 and g.config.pipeline_stages > 1 for g in ours.groups)
    ours_held, sr_held = (simulate(p, profiles, held_out).slo_attainment() for p in (ours, sr))
    assert ours_held > sr_held + 0.05


def test_paper_preset_enumerates_every_divisor_and_forms_no_unprofiled_remainder_group():
    """AlpaServe §4.2 (Alg. 2 as published): group sizes that divide the devices, so 6 devices give equal groups
    of 1, 2, 3 and 6, no remainder group; the project default's power-of-two sizes leave a remainder group that,
    without a profile for its size, is not formed rather than formed empty."""
    paper = PlannerConfig.paper()
    assert group_partitions(6, paper) == [[1] * 6, [2] * 3, [3] * 2, [6]]
    assert (paper.fast, paper.beam_size, paper.screen_keep, paper.uneven_partitions, paper.stress_factors,
            paper.fill_memory, paper.lookahead, paper.refine_simulations) == (False, 1, 0, False, (), False, 0, 0)
    profiles = table1_profiles()
    names = ["bert-1.3b"]
    assert group_partitions(7, PlannerConfig(max_group_devices=4))[-1] == [4, 3]
    options = parallel_configs(profiles, names, [4, 3], True)
    assert options and all(configs[-1] is None for configs in options)  # 3 devices: no profiled configuration
    with pytest.raises(ValueError, match="group_size_rule"):
        PlannerConfig(group_size_rule="primes")


def test_model_parallelism_wins_when_models_barely_fit():
    """§3.1: two models of 5.4 GB on two 6 GB devices; bursty traffic favours one 2-stage group hosting both."""
    names, profiles, workload = case({"bert-2.7b": 2}, 4.0, 4.0, duration_s=300.0, slo_scale=3.0)
    budget = 6 * GB
    ours = plan(names, profiles, workload, 2, budget)
    sr = selective_replication(names, profiles, workload, 2, budget)
    assert_feasible(ours, profiles, 2, budget)
    assert any(group.num_devices == 2 and set(group.models) == set(names) for group in ours.groups)
    assert ours.predicted_slo_attainment > sr.predicted_slo_attainment


def serve_deployments_placement(names, profiles, workload, num_devices: int, budget: int) -> Placement:
    """Serve's one-deployment-per-model layout (replicas in proportion to offered load) as single-device groups,
    so AlpaServe's simulator scores it on the same trace as the planner's placement."""
    rate = dict(zip(workload.model_names, workload.rates()))
    layout = proportional_deployments(names, profiles, [rate[n] for n in names], num_devices, budget)
    hosted = [[] for _ in range(num_devices)]
    for deployment in layout.deployments:
        for device in deployment.replica_devices:
            hosted[device] += deployment.models
    return Placement(groups=[GroupPlacement(num_devices=1, config=ParallelConfig(), models=m) for m in hosted if m])


@pytest.mark.parametrize("rate,cv", [(25.0, 1.0), (30.0, 0.5)])
def test_steady_unskewed_traffic_gets_one_model_per_device(rate, cv):
    """Where Serve's one deployment per model is built for: steady (Poisson or smoother) traffic, every model at
    the same rate, and memory for every model on every device (four 2.6 GB models on 13 GB devices). Model
    parallelism buys nothing without bursts (AlpaServe §3.1-§3.2), so Alg. 2's search (§4.2) keeps single-device
    groups, each model replicated where its traffic is, and serves at least as much of the trace as Selective
    Replication and as Serve's replicas-in-proportion-to-load layout. The contrast, bursty traffic on models that
    barely fit, is :func:`test_model_parallelism_wins_when_models_barely_fit`."""
    names, profiles, workload = case({"bert-1.3b": 4}, rate, cv, duration_s=60.0, popularity_exponent=None)
    ours = plan(names, profiles, workload, 4, BUDGET)
    sr = selective_replication(names, profiles, workload, 4, BUDGET)
    serve = serve_deployments_placement(names, profiles, workload, 4, BUDGET)
    assert_feasible(ours, profiles, 4, BUDGET)
    assert all(group.num_devices == 1 and group.config == ParallelConfig() for group in ours.groups)
    assert {n for group in ours.groups for n in group.models} == set(names)
    assert ours.predicted_slo_attainment >= sr.predicted_slo_attainment
    assert ours.predicted_slo_attainment >= simulate(serve, profiles, workload).slo_attainment()


def test_steady_traffic_on_half_full_devices_gets_at_least_serves_layout():
    """Poisson traffic at equal rates, four 5.4 GB models on 13 GB devices (each fits every device, two at a
    time). Alg. 1's greedy on single devices (SR) ends below Serve's replicas-in-proportion-to-load layout on this
    trace; the planner scores that layout as a candidate of Alg. 2 (§4.2), so it returns single-device groups that
    serve at least as much as Serve's layout, and more than SR."""
    names, profiles, workload = case({"bert-2.7b": 4}, 14.0, 1.0, duration_s=60.0, popularity_exponent=None)
    ours = plan(names, profiles, workload, 4, BUDGET)
    sr = selective_replication(names, profiles, workload, 4, BUDGET)
    serve = simulate(serve_deployments_placement(names, profiles, workload, 4, BUDGET), profiles, workload)
    assert_feasible(ours, profiles, 4, BUDGET)
    assert all(group.num_devices == 1 for group in ours.groups)
    assert ours.predicted_slo_attainment >= serve.slo_attainment()
    assert ours.predicted_slo_attainment > sr.predicted_slo_attainment
    assert simulate(ours, profiles, workload).slo_attainment() == pytest.approx(ours.predicted_slo_attainment)
    assert not PlannerConfig.paper().load_proportional_candidate


def test_beam_search_and_fast_variant():
    names, profiles, workload = case({"bert-1.3b": 3}, 8.0, 3.0, duration_s=60.0)
    beam = plan(names, profiles, workload, 2, 6 * GB, PlannerConfig(fast=False, beam_size=2, max_group_devices=2))
    fast = plan(names, profiles, workload, 2, 6 * GB, PlannerConfig(max_group_devices=2))
    for placement in (beam, fast):
        assert_feasible(placement, profiles, 2, 6 * GB)
        assert placement.models() == set(names)
    assert beam.stats.simulations > fast.stats.simulations


def test_memory_constraint_leaves_out_what_cannot_fit():
    names, profiles, workload = case({"bert-6.7b": 2}, 4.0, 1.0, duration_s=30.0)
    # 13.4 GB models, 8 GB devices: a single device cannot hold one; SR places nothing, we split them.
    sr = selective_replication(names, profiles, workload, 4, 8 * GB)
    ours = plan(names, profiles, workload, 4, 8 * GB)
    assert sr.models() == set()
    assert sr.predicted_slo_attainment == 0.0
    assert ours.models() == set(names)
    assert_feasible(ours, profiles, 4, 8 * GB)


def test_round_robin_and_clockwork():
    names, profiles, workload = case({"bert-1.3b": 4}, 8.0, 2.0, duration_s=240.0)
    rr = round_robin(names, profiles, workload, 2, 6 * GB)
    assert_feasible(rr, profiles, 2, 6 * GB)
    assert rr.models() == set(names)
    assert all(len(group.models) == 2 for group in rr.groups)  # 2.4 GB models, 6 GB devices
    dynamic = clockwork_plus_plus(names, profiles, workload, 2, 6 * GB, window_s=60.0)
    assert len(dynamic.windows) == 4
    assert sum(w.requests for w in dynamic.windows) == len(workload)
    assert 0 < dynamic.slo_attainment <= 1
    for window in dynamic.windows:
        assert_feasible(window.placement, profiles, 2, 6 * GB)


def test_model_buckets_separate_distant_latencies():
    names, profiles, _ = case({"bert-1.3b": 2, "moe-1.3b": 1, "bert-6.7b": 2}, 1.0, 1.0, duration_s=10.0)
    options = model_buckets(profiles, names, latency_ratio=2.0, max_buckets=3)
    assert options
    for buckets in options:
        assert sorted(n for b in buckets for n in b) == sorted(names)
        for bucket in buckets:
            assert not ({"bert-1.3b-0", "bert-6.7b-0"} <= set(bucket))
    loose = model_buckets(profiles, names, latency_ratio=10.0, max_buckets=3)
    assert any(len(buckets) == 1 for buckets in loose)  # a loose threshold allows one bucket for all


def test_device_buckets_and_group_partitions():
    splits = device_buckets(8, [1.0, 3.0], discrepancy=2.0, max_splits=3, minimum=[1, 1])
    assert splits[0] == (2, 6)
    assert all(sum(s) == 8 for s in splits)
    assert group_partitions(6, PlannerConfig(max_group_devices=4)) == [[1] * 6, [2, 2, 2], [4, 2]]
    assert group_partitions(3, PlannerConfig(allow_model_parallelism=False)) == [[1, 1, 1]]


def test_placement_json_round_trip_and_normalize(tmp_path):
    placement = Placement(groups=[
        GroupPlacement(num_devices=1, config=ParallelConfig(), models=["b", "a"]),
        GroupPlacement(num_devices=2, config=ParallelConfig(pipeline_stages=2), models=["c"]),
    ], predicted_slo_attainment=0.5)
    path = tmp_path / "placement.json"
    placement.save(path)
    loaded = Placement.load(path)
    assert loaded == placement
    normal = loaded.normalize()
    assert normal.groups[0].num_devices == 2 and normal.groups[1].models == ["a", "b"]
    assert normal.normalize() == normal
    with pytest.raises(ValueError, match="num_devices"):
        GroupPlacement(num_devices=3, config=ParallelConfig(pipeline_stages=2), models=[])


def test_bad_input_is_named():
    names, profiles, workload = case({"bert-1.3b": 1}, 1.0, 1.0, duration_s=10.0)
    with pytest.raises(ValueError, match="profile"):
        plan(names + ["nope"], profiles, workload, 1, BUDGET)
    with pytest.raises(ValueError, match="beam_size"):
        PlannerConfig(beam_size=0)
    too_big = Placement(groups=[GroupPlacement(num_devices=1, config=ParallelConfig(), models=names)])
    with pytest.raises(ValueError, match="device_memory_bytes"):
        too_big.check_memory(profiles, 1 * GB)


def test_large_case_settings_give_feasible_consistent_placements():
    """The speed settings of benchmarks/planner_speed.py (auto replicas per round, per-byte ranking, screening)."""
    names, profiles, workload = case({"bert-1.3b": 3, "moe-5.3b": 2, "bert-6.7b": 1}, 20.0, 4.0, duration_s=120.0)
    config = PlannerConfig(replicas_per_round=0, screen_fraction=0.25, fast_rank="unserved_per_byte")
    ours = plan(names, profiles, workload, 8, BUDGET, config)
    assert_feasible(ours, profiles, 8, BUDGET)
    assert simulate(ours, profiles, workload).slo_attainment() == pytest.approx(ours.predicted_slo_attainment)
    with pytest.raises(ValueError, match="fast_rank"):
        PlannerConfig(fast_rank="random")


def test_fewer_devices_than_buckets_still_plans():
    names, profiles, workload = case({"bert-1.3b": 1, "bert-6.7b": 1}, 2.0, 1.0, duration_s=30.0)
    placement = plan(names, profiles, workload, 1, 16 * GB)  # latencies 2.6x apart want two buckets; one device
    assert_feasible(placement, profiles, 1, 16 * GB)
    assert placement.models()


def alpaserve_test_case(duration_s: float, seed: int):
    """Issue 15's case: 48 copies of AlpaServe's own bert-1.3b test profile, 300 req/s, CV 4, SLO 5 x 0.099 s."""
    profiles = alpaserve_test_profiles(48)
    names = sorted(profiles.models)
    workload = gamma_workload(names, 300.0, 4.0, 5 * 0.099, duration_s, popularity_exponent=0.5, seed=seed)
    return names, profiles, workload


def test_alpaserve_test_case_chooses_a_pipeline_and_holds_on_held_out_traffic():
    """Regression (issue 15): one-device groups serve the 100 s planning sample fully, as do pipelines, but miss
    many more SLOs on held-out traffic; the planner must pick multi-device pipelines and fill the memory."""
    names, profiles, workload = alpaserve_test_case(100.0, seed=1)
    _, _, held_out = alpaserve_test_case(600.0, seed=2)
    ours = plan(names, profiles, workload, 64, BUDGET)
    assert_feasible(ours, profiles, 64, BUDGET)
    assert ours.groups and all(g.num_devices > 1 and g.config.pipeline_stages > 1 for g in ours.groups)
    assert simulate(ours, profiles, held_out).slo_attainment() >= 0.999
    sr = selective_replication(names, profiles, workload, 64, BUDGET)
    assert simulate(ours, profiles, held_out).slo_attainment() > simulate(sr, profiles, held_out).slo_attainment()


def test_enumeration_holds_every_uniform_configuration_and_uneven_partitions():
    profiles = alpaserve_test_profiles(2)
    names = sorted(profiles.models)
    config = PlannerConfig()
    uniform = [list(zip(sizes, configs)) for sizes in group_partitions(64, config)
               for configs in parallel_configs(profiles, names, sizes, True)]
    assert [(4, ParallelConfig(pipeline_stages=4))] * 16 in uniform
    assert {groups[0][0] for groups in uniform} == {1, 2, 4, 8}  # the profile has no 16-device configuration
    uneven = uneven_partitions(8, PlannerConfig(max_group_devices=4))
    assert ((4, 1), (2, 2)) in uneven and ((2, 2), (1, 4)) in uneven
    assert all(large * n_large + small * n_small <= 8 for (large, n_large), (small, n_small) in uneven)
    assert uneven_partitions(8, PlannerConfig(uneven_partitions=False)) == []
    with pytest.raises(ValueError, match="stress_factors"):
        PlannerConfig(stress_factors=(0.5,))
    with pytest.raises(ValueError, match="screen_keep"):
        PlannerConfig(screen_keep=-1)


def test_warm_start_never_returns_less_than_the_running_placement():
    """The running placement is a candidate: a search restricted to one-device groups keeps a running pipeline
    placement that serves more of the planning traffic, and the prediction stays the simulator's figure."""
    names, profiles, workload = case({"bert-2.7b": 2}, 4.0, 4.0, duration_s=300.0, slo_scale=3.0)
    budget = 6 * GB  # §3.1: two 5.4 GB models on two 6 GB devices; only a 2-stage group hosts both
    running = Placement(groups=[GroupPlacement(num_devices=2, config=ParallelConfig(pipeline_stages=2), models=names)])
    single = PlannerConfig(allow_model_parallelism=False)
    cold = plan(names, profiles, workload, 2, budget, single)
    warm = plan(names, profiles, workload, 2, budget, single, warm_start=running)
    keep = simulate(running, profiles, workload).slo_attainment()
    assert keep > cold.predicted_slo_attainment
    assert warm.predicted_slo_attainment >= keep
    assert [g.num_devices for g in warm.groups] == [2]
    assert simulate(warm, profiles, workload).slo_attainment() == pytest.approx(warm.predicted_slo_attainment)
    # A running placement that no longer fits the cluster, or hosts a model without a profile, is ignored.
    assert plan(names, profiles, workload, 1, budget, single, warm_start=running).num_devices == 1
    ghost = Placement(groups=[GroupPlacement(num_devices=1, config=ParallelConfig(), models=["ghost"])])
    assert plan(names, profiles, workload, 2, budget, single, warm_start=ghost).models() <= set(names)


SIX_MODELS = ("bert-1.3b", "bert-2.7b", "bert-6.7b", "moe-1.3b", "moe-2.4b", "moe-5.3b")


def test_fast_variant_stays_within_beam_search_on_the_small_mixed_case():
    """Issue 15: on 12 models (two of each Table 1 model that fits a V100) and four 2-device groups, the plain
    fast variant ends about 0.02 below beam search of size 3 on held-out traffic; with its look-ahead it must stay
    within 0.005, and spend far fewer simulations."""
    names, profiles, workload = case({m: 2 for m in SIX_MODELS}, 37.5, 4.0, duration_s=60.0, seed=1)
    groups = [(2, ParallelConfig(pipeline_stages=2))] * 4
    fast = select_models(names, profiles, workload, groups, BUDGET)
    beam = select_models(names, profiles, workload, groups, BUDGET, PlannerConfig(fast=False, beam_size=3))
    plain = select_models(names, profiles, workload, groups, BUDGET, PlannerConfig(lookahead=0, refine_simulations=0))
    _, _, held_out = case({m: 2 for m in SIX_MODELS}, 37.5, 4.0, duration_s=600.0, seed=2)
    score = {label: simulate(p, profiles, held_out).slo_attainment()
             for label, p in (("fast", fast), ("beam", beam), ("plain", plain))}
    assert score["fast"] >= score["beam"] - 0.005
    assert score["plain"] < score["beam"] - 0.005  # what the look-ahead is for
    assert fast.stats.simulations * 5 < beam.stats.simulations
    for placement in (fast, beam, plain):
        assert_feasible(placement, profiles, 8, BUDGET)
