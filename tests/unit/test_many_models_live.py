"""The live many-model comparison's pure parts (benchmarks/_many_models_live.py, _serve_many_models_apps.py): the
trace, the figures, the fault accounting, the Serve setups' memory reservations and the bad-input messages. No Ray,
no timing."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from repo_paths import REPO_ROOT

from benchmarks import _serve_many_models_apps as apps
from benchmarks._many_models_live import (
    MEMORY_RESOURCE,
    TRACE_SEED,
    Outcomes,
    answered_latency_s,
    calibrated_prediction,
    fault_figures,
    figures,
    live_traffic,
    load_case,
    no_rate_at_goal_message,
    rate_at_goal,
    sim_context,
)
from placement.core.workload import Workload

SPEC = REPO_ROOT / "benchmarks" / "fixtures" / "many_models_dev.yaml"
MIB = 2**20


@pytest.fixture(scope="module")
def case():
    return load_case(SPEC)


def test_case_reads_weights_and_latencies_from_the_profiles(case):
    assert case.names == ["minilm-a", "minilm-b", "minilm-c", "minilm-d"]
    assert all(m.weight_bytes > 80 * MIB and 0 < m.single_latency_s < 1 for m in case.models)
    # Every model fits a device once, not every device holds every model.
    assert max(m.weight_bytes for m in case.models) <= case.device_memory_bytes
    assert sum(m.weight_bytes for m in case.models) > case.device_memory_bytes


def test_trace_is_bursty_skewed_and_its_hot_models_change(case):
    traffic = live_traffic(case, rate=40.0, duration_s=600.0, cv=3.0, popularity_exponent=1.0, slo_scale=10.0)
    workload = traffic.workload(2)
    assert abs(len(workload) / 600.0 - 40.0) < 12.0
    assert set(traffic.hot_models(1)) != set(traffic.hot_models(1, after_shift=True))
    # Each model's SLO is the scale times its single-request latency.
    assert np.allclose(workload.slo_s, 10.0 * case.models[0].single_latency_s)
    gaps = np.diff(workload.arrival_s[workload.model == workload.model[0]])
    assert np.std(gaps) / np.mean(gaps) > 1.5  # CV well above Poisson's 1
    first, second = (np.bincount(workload.model[part], minlength=4) for part in
                     (workload.arrival_s < 300, workload.arrival_s >= 300))
    assert np.argmax(first) != np.argmax(second)


def test_trace_refuses_unbursty_traffic(case):
    with pytest.raises(ValueError, match="CV >= 3"):
        live_traffic(case, rate=4.0, duration_s=10.0, cv=1.0, popularity_exponent=1.0, slo_scale=5.0)


def outcomes(status, latency, slo=0.5, arrival=None, model=None) -> Outcomes:
    n = len(status)
    arrival = np.arange(n, dtype=float) if arrival is None else np.asarray(arrival, float)
    return Outcomes(np.zeros(n, np.int32) if model is None else np.asarray(model, np.int32), arrival,
                    np.full(n, slo), np.asarray(status, np.int32), np.asarray(latency, float))


def test_figures_count_attainment_refusals_and_failures():
    got = figures(outcomes([200, 200, 200, 503, 500, 0], [0.1, 0.2, 0.9, 0.01, 0.02, np.nan]), duration_s=2.0)
    assert got["requests"] == 6 and got["attainment"] == pytest.approx(2 / 6)
    assert got["goodput_per_s"] == pytest.approx(1.0)
    assert got["refusals"] == 1 and got["failures"] == 2
    assert got["p50_s"] == pytest.approx(0.2)


def test_rate_at_goal_walks_up_until_the_first_miss():
    curve = [{"rate_per_s": r, "attainment": a} for r, a in ((1.0, 1.0), (1.2, 0.995), (1.44, 0.97), (1.73, 0.999))]
    assert rate_at_goal(curve) == 1.2
    assert rate_at_goal([{"rate_per_s": 1.0, "attainment": 0.5}]) is None


def test_a_sweep_without_a_rate_at_99_gets_a_message_naming_the_system():
    assert no_rate_at_goal_message({"plexserve": 4.0, "serve_multiplexed": 4.8}, 4.0) is None
    message = no_rate_at_goal_message({"plexserve": 4.0, "serve_deployments": None}, 4.0)
    assert "serve_deployments" in message and "--live-rate-min" in message and "4 req/s" in message


def test_fault_counts_losses_beyond_the_killed_replicas_in_flight_requests():
    # Kill at t=5 of the replica hosting model 1. Request 2 (model 1) was in flight then and failed: not counted.
    # Request 3 (model 0) failed although its replica lived: lost. Request 4 (model 1) was refused: not accepted.
    # Model 1's last miss after the kill is request 6 (t=9): it is served again from request 7, at t=10.
    got = fault_figures(outcomes(status=[200, 200, 500, 0, 503, 200, 200, 200, 200, 200],
                                 latency=[0.1, 0.1, 3.0, np.nan, 0.01, 0.1, 2.0, 0.1, 0.1, 0.1],
                                 arrival=[1, 2, 4, 6, 7, 8, 9, 10, 11, 12], model=[0, 1, 1, 0, 1, 1, 1, 1, 1, 1]),
                        kill_at_s=5.0, victims={1})
    assert got["lost_accepted"] == 1 and got["in_flight_at_kill"] == 1 and got["failed_in_flight"] == 1
    assert got["recovery_s"] == pytest.approx(5.0)


def test_recovery_is_zero_without_a_miss_and_censored_without_a_recovery():
    fine = fault_figures(outcomes([200] * 4, [0.1] * 4, arrival=[1, 6, 7, 8], model=[1] * 4), 5.0, {1})
    assert fine["recovery_s"] == 0.0 and fine["lost_accepted"] == 0
    never = fault_figures(outcomes([200, 503, 503], [0.1, 0.01, 0.01], arrival=[1, 6, 7], model=[1] * 3), 5.0, {1})
    assert never["recovery_s"] is None and never["lost_accepted"] == 0


def test_outcomes_survive_json(case):
    workload = Workload(case.names, [0.0, 1.0], [0, 1], [0.5, 0.5])
    original = Outcomes.empty(workload)
    original.status[0], original.latency_s[0] = 200, 0.1
    back = Outcomes.from_json(original.to_json())
    assert back.status.tolist() == [200, 0] and np.isnan(back.latency_s[1])


def test_each_serve_deployment_requests_its_models_weight_in_device_memory(case):
    args = apps.app_args(case, multiplexed=False)
    for model in args["models"]:
        options = apps.deployment_options(model, args["num_devices"], args["device_memory_bytes"])
        assert options["ray_actor_options"]["resources"] == {MEMORY_RESOURCE: float(model["weight_bytes"])}
        scaling = options["autoscaling_config"]
        assert scaling["min_replicas"] == 1
        assert scaling["max_replicas"] * model["weight_bytes"] <= args["num_devices"] * args["device_memory_bytes"]


def test_multiplexed_replicas_request_k_models_and_fit_the_devices(case):
    args = apps.app_args(case, multiplexed=True)
    layout = apps.multiplexed_layout(args["models"], args["num_devices"], args["device_memory_bytes"])
    (entry,) = layout  # four copies of one architecture
    weight = max(m["weight_bytes"] for m in args["models"])
    assert entry["multiplexed"] and entry["k"] == args["device_memory_bytes"] // weight
    assert entry["replica_bytes"] == entry["k"] * weight
    assert entry["num_replicas"] * entry["replica_bytes"] <= args["num_devices"] * args["device_memory_bytes"]
    options = apps.multiplexed_options(entry)
    assert options["ray_actor_options"]["resources"] == {MEMORY_RESOURCE: float(entry["replica_bytes"])}
    assert apps.models_of_deployment(case, entry["name"], multiplexed=True) == set(case.names)


def test_a_model_alone_in_its_architecture_gets_a_plain_deployment():
    models = [{"name": f"t{i}", "weight_bytes": 100, "architecture": "text"} for i in range(3)]
    models.append({"name": "v", "weight_bytes": 50, "architecture": "vision"})
    layout = {e["name"]: e for e in apps.multiplexed_layout(models, num_devices=2, device_memory_bytes=250)}
    assert layout["model-v"]["multiplexed"] is False and layout["model-v"]["num_replicas"] == 1
    mux = next(e for e in layout.values() if e["multiplexed"])
    assert mux["k"] == 2 and mux["num_replicas"] == 2  # 2 x 200 + 50 <= 2 x 250


def test_a_model_beyond_the_budget_is_refused_by_name():
    with pytest.raises(ValueError, match="'big'.*does not fit the per-device memory budget"):
        apps.deployment_options({"name": "big", "weight_bytes": 300}, 2, 250)
    with pytest.raises(ValueError, match="'big'"):
        apps.multiplexed_layout([{"name": "big", "weight_bytes": 300, "architecture": "a"}], 2, 250)


def shrunk_spec(tmp_path: Path, memory_bytes: int) -> Path:
    config = yaml.safe_load(SPEC.read_text())
    args = config["applications"][0]["args"]
    args["cluster"]["device_memory_bytes"] = memory_bytes
    args["planning"]["profiles"]["path"] = str(REPO_ROOT / args["planning"]["profiles"]["path"])
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_load_case_names_a_model_beyond_the_budget(tmp_path):
    with pytest.raises(ValueError, match="minilm-a.*does not fit the per-device memory budget"):
        load_case(shrunk_spec(tmp_path, 50 * MIB))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.many_models", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_ends_bad_input_with_a_message_not_a_traceback(tmp_path):
    for args, message in ((["--spec", str(shrunk_spec(tmp_path, 50 * MIB))], "does not fit the per-device memory"),
                          (["--spec", str(tmp_path / "missing.yaml")], "no such file"),
                          (["--spec", str(SPEC), "--live-rate-step", "1.5"], "--live-rate-step 1.5"),
                          (["--spec", str(SPEC), "--cv", "1"], "CV >= 3")):
        result = run_cli(*args)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def session_result(attainments: dict[float, float], lost: int = 0, recovery: float | None = 1.0) -> dict:
    """A session's result with one outcome per 100 requests: `attainment` of them answered within the SLO."""
    points = []
    for rate, attainment in attainments.items():
        good = round(100 * attainment)
        got = outcomes([200] * 100, [0.1] * good + [2.0] * (100 - good))
        points.append({"rate_per_s": rate, **figures(got, 10.0), "outcomes": got.to_json()})
    return {"points": points, "fault": {"lost_accepted": lost, "recovery_s": recovery}, "deploy_s": 1.0}


def test_combine_compares_rates_at_99_and_attainment_across_systems(case):
    from benchmarks._many_models_live import SessionSettings, combine

    settings = SessionSettings("plexserve", str(SPEC), [4.0, 4.8, 5.76], 10.0, 10.0, 3.0, 1.0, 10.0)
    runs = {"plexserve": session_result({4.0: 1.0, 4.8: 1.0, 5.76: 0.99}),
            "serve_deployments": session_result({4.0: 1.0, 4.8: 0.9, 5.76: 0.8}, lost=2, recovery=3.0),
            "serve_multiplexed": session_result({4.0: 0.95, 4.8: 0.9, 5.76: 0.95}, recovery=None)}
    got = combine(runs, case, settings, with_sim=False)
    assert got["rate_at_99"] == {"plexserve": 5.76, "serve_deployments": 4.0, "serve_multiplexed": None}
    assert got["held_at_top_of_grid"] == ["plexserve"]  # its rate at 99 % is a lower bound
    assert got["rate_at_99_vs_serve_deployments"] == pytest.approx(1.44)
    assert got["rate_at_99_vs_serve_multiplexed"] is None  # no rate at 99 % to divide by
    assert got["attainment_gain_min"] == pytest.approx(0.0)  # at 4 req/s plexserve ties the better Serve setup
    # The headline fault figures are plexserve's own; every system's stay beside them.
    assert got["lost_accepted"] == 0 and got["recovery_s"] == pytest.approx(1.0)
    assert got["faults"]["serve_deployments"]["lost_accepted"] == 2
    assert got["faults"]["serve_multiplexed"]["recovery_s"] is None


def test_a_median_counts_a_rate_below_the_sweep_as_the_lowest_and_a_censored_recovery_as_the_highest():
    from benchmarks._many_models_live import median_of

    assert median_of([None, 20.0, 24.0]) == 22.0  # left out
    assert median_of([None, 20.0, 24.0], "lowest") == 20.0
    assert median_of([None, None, 24.0], "lowest") is None
    assert median_of([None, 1.0, 2.0, 3.0], "lowest") == 1.5
    assert median_of([None, 1.0, 2.0, 3.0], "highest") == 2.5
    assert median_of([None, None, 2.0], "highest") is None
    assert median_of([], "lowest") is None
    with pytest.raises(ValueError, match="none_is"):
        median_of([1.0], "middle")


def test_calibrated_prediction_recovers_the_live_service_time_factor(case):
    """A live system whose batches take 2.5x the profiled times: fitted on one rate's answers, the controller's
    calibration predicts the next rate as that system, where the profiles alone predict far more."""
    from placement.alpaserve.simulator import SERVED, simulate
    from placement.alpaserve.transition import scaled_profiles

    context = sim_context(case)
    slow = scaled_profiles(context.profiles, 2.5)

    def live_at(rate):
        workload = live_traffic(case, rate, 20.0, 3.0, 1.0, 10.0).workload(TRACE_SEED)
        result = simulate(context.placement, slow, workload, context.config)
        latency = np.where(result.status == SERVED, result.finish_s - workload.arrival_s, np.nan)
        return workload, latency, result.slo_attainment()

    window, window_latency, _ = live_at(40.0)
    workload, _, live_attainment = live_at(48.0)
    got = calibrated_prediction(context, workload, window, window_latency)
    alone = simulate(context.placement, context.profiles, workload, context.config).slo_attainment()
    assert 2.0 < got["service_scale"] < 3.1
    assert abs(got["plexserve_calibrated"] - live_attainment) <= 0.03
    assert alone - live_attainment > 0.05


def test_answered_latency_leaves_out_refused_and_failed_requests():
    outcomes = Outcomes(np.zeros(3, np.int32), np.zeros(3), np.ones(3), np.array([200, 503, 0], np.int32),
                        np.array([0.2, 0.01, np.nan]))
    got = answered_latency_s(outcomes)
    assert got[0] == 0.2 and np.isnan(got[1]) and np.isnan(got[2])


def test_the_simulator_is_judged_on_the_median_curves_beside_the_runs_spread():
    """Three runs of the same traces: the gap is taken on the medians per rate, so one run's noise does not pick the
    largest gap; the spread between the runs is reported beside it."""
    from benchmarks._many_models_live import median_curves, sim_live_gap_figures, sim_live_gaps

    def run(plex: list[float], deployments: list[float]) -> dict:
        def row(attainment, sim):
            return {"attainment": attainment, "goodput_per_s": 1.0, "p50_s": 0.1, "p99_s": 0.2, "refusals": 0,
                    "failures": 0, "requests": 100, "sim": {**sim, "placement": ["one group"]}}
        return {"curves": {
            "plexserve": [row(plex[0], {"plexserve": 1.0, "one_per_device": 1.0}),
                          row(plex[1], {"plexserve": 1.0, "one_per_device": 0.98, "plexserve_calibrated": 0.9,
                                        "service_scale": 2.0})],
            "serve_deployments": [row(a, {"plexserve": 1.0, "one_per_device": p})
                                  for a, p in zip(deployments, (1.0, 0.98))]}}

    runs = [run([0.97, 0.90], [1.0, 0.97]), run([0.99, 0.80], [1.0, 0.99]), run([0.98, 0.92], [0.99, 0.98])]
    curves, spread = median_curves(runs, ["plexserve", "serve_deployments"], [10.0, 12.0])
    assert [p["attainment"] for p in curves["plexserve"]] == pytest.approx([0.98, 0.90])
    assert curves["plexserve"][1]["sim"]["plexserve_calibrated"] == pytest.approx(0.9)
    assert spread == pytest.approx(0.12)  # plexserve at 12 req/s: 0.80 to 0.92
    gaps, uncalibrated = sim_live_gaps(curves)
    assert max(gaps) == pytest.approx(0.02)  # the first rate from the profiles alone: 1.0 against 0.98
    assert max(uncalibrated) == pytest.approx(0.10)  # the profiles alone at 12 req/s: 1.0 against 0.90
    assert sim_live_gap_figures(curves) == pytest.approx({"sim_live_abs_gap_max": 0.02,
                                                          "sim_live_abs_gap_max_uncalibrated": 0.10})
    one_run_gaps, _ = sim_live_gaps(runs[1]["curves"])
    assert max(one_run_gaps) == pytest.approx(0.10)  # the noisiest run alone: 0.9 against 0.80


def test_cpu_is_attributed_to_the_first_matching_role_and_the_rest_to_other(tmp_path, monkeypatch):
    """Stage actors and Serve's model replicas count as the models; plexserve's group replicas and each system's
    ingress have roles of their own; this process is the load generator; anything else is "other"."""
    import os

    from benchmarks import _common
    from benchmarks._many_models_live import CPU_OTHER, CPU_ROLES
    from parallel import profiler

    proc = tmp_path / "proc"
    monkeypatch.setattr(profiler, "PROC_ROOT", proc)
    monkeypatch.setattr(profiler, "_clock_ticks_per_s", lambda: 100)
    titles = {11: "ray::StageShard", 12: "ray::ServeReplica:serve-many:model-minilm-a",
              13: "ray::ServeReplica:plexserve:group-0.handle_request_with_rejection",
              14: "ray::ServeReplica:plexserve:Ingress", 15: "ray::ServeReplica:serve-many:ModelsIngress",
              16: "ray::ServeController", os.getpid(): "python -m benchmarks._many_models_live"}
    for pid, title in titles.items():
        (proc / str(pid)).mkdir(parents=True)
        fields = ["S", "1"] + ["0"] * 9 + [str(100 * pid if pid != os.getpid() else 50), "0"] + ["0"] * 10
        (proc / str(pid) / "stat").write_text(f"{pid} (python) " + " ".join(fields) + "\n")
        (proc / str(pid) / "cmdline").write_bytes(title.replace(" ", "\0").encode() + b"\0")
    got = _common.cpu_seconds_by_role(CPU_ROLES, CPU_OTHER)
    assert got == pytest.approx({"models": 11.0 + 12.0, "group_replicas": 13.0, "ingress": 14.0 + 15.0,
                                 "load_generator": 0.5, "other": 16.0})
    assert "other" not in _common.cpu_seconds_by_role(CPU_ROLES)
    monkeypatch.setattr(profiler, "PROC_ROOT", tmp_path / "absent")
    assert _common.cpu_seconds_by_role(CPU_ROLES, CPU_OTHER) == {}


def test_cpu_figures_give_milliseconds_per_request_and_busy_cores_and_their_medians():
    from benchmarks._many_models_live import cpu_figures, median_curves

    before = {"models": 10.0, "ingress": 2.0, "other": 5.0}
    after = {"models": 16.0, "ingress": 3.0, "other": 7.0}
    cpu = cpu_figures(before, after, requests=200, wall_s=5.0)
    assert cpu["ms_per_request"] == pytest.approx({"models": 30.0, "ingress": 5.0, "other": 10.0})
    assert cpu["busy_cores"] == pytest.approx(9.0 / 5.0)
    assert cpu_figures({}, after, 200, 5.0) is None  # no /proc: no figures
    assert cpu_figures(before, after, 0, 5.0) is None

    def run(models_ms: float, cores: float) -> dict:
        row = {"attainment": 1.0, "goodput_per_s": 1.0, "p50_s": 0.1, "p99_s": 0.2, "refusals": 0, "failures": 0,
               "requests": 100, "cpu": {"ms_per_request": {"models": models_ms, "ingress": 5.0}, "busy_cores": cores}}
        return {"curves": {"plexserve": [row]}}

    curves, _ = median_curves([run(30.0, 1.2), run(40.0, 1.5), run(35.0, 1.4)], ["plexserve"], [10.0])
    median = curves["plexserve"][0]["cpu"]
    assert median["ms_per_request"] == pytest.approx({"models": 35.0, "ingress": 5.0})
    assert median["busy_cores"] == pytest.approx(1.4)


def test_plexserve_per_model_serves_the_spec_without_planning_as_one_deployment_per_model(case):
    """The optional system drops the spec's planning, placement and controller, so that plexserve's builder binds a
    single-model deployment per model, autoscaled and memory-bound as the Serve baseline's deployments are."""
    from benchmarks import _serve_many_models_apps as apps
    from benchmarks._many_models_live import MEMORY_RESOURCE, application, per_model_spec
    from placement.core.deployment_spec import MAX_REPLICAS, parse_spec

    config = application("plexserve_per_model", case, load_log="")
    args = config["args"]
    assert not {"planning", "placement", "controller"} & set(per_model_spec(case.spec))
    assert not {"planning", "placement", "controller"} & set(args)
    spec = parse_spec(args)
    assert spec.placement is None and spec.planning is None and not spec.controller_enabled()
    assert [m.name for m in spec.models] == list(case.names)
    assert spec.cluster.device_memory_bytes == case.device_memory_bytes
    overrides = {d["name"]: d for d in config["deployments"]}
    for model, live_model in zip(spec.models, case.models):
        serve = apps.deployment_options({"name": model.name, "weight_bytes": live_model.weight_bytes},
                                        case.num_devices, case.device_memory_bytes)
        assert model.autoscaling.max_replicas == min(serve["autoscaling_config"]["max_replicas"], MAX_REPLICAS)
        assert model.autoscaling.target_ongoing_requests == apps.TARGET_ONGOING_REQUESTS
        actor = overrides[f"model-{model.name}"]["ray_actor_options"]
        assert actor["resources"] == {MEMORY_RESOURCE: float(live_model.weight_bytes)}
        assert actor["num_cpus"] == model.num_cpus_per_replica
    assert "planning" in application("plexserve", case, load_log="")["args"]
