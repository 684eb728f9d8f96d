"""The direction of each simulated row of benchmarks/paper_claims.py, on small cases of the same functions.

No Ray and no model runs: Arlo and AlpaServe on their reproduction profiles, TCB on a fixed batch-latency model,
OTAS on the committed measured profile (graded by its profiled accuracy)."""

from __future__ import annotations

import logging

import pytest

from benchmarks import paper_claims as pc

#: A small Arlo case: 10 devices at about half ST's capacity (the benchmark: 90 devices at ST's 90 %-SLO load).
ARLO_DEVICES, ARLO_RATE_PER_S, ARLO_DURATION_S, ARLO_PERIOD_S = 10, 900.0, 6.0, 3.0


@pytest.mark.parametrize("kind", ["stable", "bursty"])
def test_arlo_mean_latency_below_st(kind):
    from placement.arlo.paper_profiles import paper_runtime_profiles

    profiles = paper_runtime_profiles("bert-base")
    result = pc.arlo_ratios(profiles, kind, ARLO_RATE_PER_S, ARLO_DURATION_S, ARLO_PERIOD_S, seed=5,
                            devices=ARLO_DEVICES, presets=("default",))
    assert result["mean_vs_st_default"] < 1.0
    assert result["mean_vs_infaas_default"] < 1.0
    assert set(result) >= {f"{m}_vs_{b}_default" for m in ("mean", "p98") for b in pc.ARLO_BASELINES}


def test_arlo_mean_latency_below_dt_on_a_steady_trace():
    from placement.arlo.paper_profiles import paper_runtime_profiles

    profiles = paper_runtime_profiles("bert-base")
    result = pc.arlo_ratios(profiles, "stable", ARLO_RATE_PER_S, ARLO_DURATION_S, ARLO_PERIOD_S, seed=6,
                            devices=ARLO_DEVICES, presets=("default",))
    assert result["mean_vs_dt_default"] < 1.0


def test_alpaserve_rate_at_99_above_selective_replication():
    from placement.alpaserve.paper_profiles import table1_model_set
    from placement.alpaserve.planner import PlannerConfig

    model_set = table1_model_set("S2")
    names = sorted(model_set.profiles.models)[:4]
    grid = pc.RATE_GRID[4::2]
    held = {system: pc.alpaserve_sustained("rate", system, PlannerConfig(), names, model_set.profiles, 4,
                                           windows=4, min_requests=600, grid=grid)[0]
            for system in ("ours", "sr")}
    assert held["ours"] is not None and held["sr"] is not None
    assert pc.alpaserve_ratio("rate", held["ours"], held["sr"]) > 1.0


def test_alpaserve_slo_ratio_reads_tighter_as_better():
    assert pc.alpaserve_ratio("slo_scale", 2.5, 5.0) == 2.0
    assert pc.alpaserve_ratio("rate", 4.0, 0.5) == 8.0
    assert pc.alpaserve_ratio("cv", None, 2.0) is None


def _latency_model():
    from benchmarks.concat_batching import LatencyModel

    # Seconds per computed token at each row width, the shape measured on MiniLM (flat within about 10 %).
    return LatencyModel({32: 12e-6, 64: 11e-6, 96: 11.5e-6, 128: 12e-6})


def test_tcb_utility_at_least_tnb_and_ttb_with_own_allowances():
    result = pc.tcb_utilities(_latency_model(), 20, seed=17, rate_multiples=(1.5,), duration_in_batches=20)
    assert result["utility_vs_tnb"] >= 1.0
    assert result["utility_vs_ttb"] >= 1.0
    # Each engine admits with its own batch latency: padded batches take longer than concatenated ones.
    assert result["allowance_ms"]["tnb"] > result["allowance_ms"]["tcb"]


def test_tnb_executes_the_das_batch_in_arrival_order():
    from benchmarks.concat_batching import PADDED_BATCH_SIZE
    from placement.tcb.batch_scheduler import BatchDecision, TextRequest

    latency = _latency_model()
    tnb = pc.tcb_executions(latency)["tnb"]
    # 64 short requests that arrived first, then 64 long ones; DAS's rows hold them interleaved.
    short = [TextRequest(k, 4, arrival_s=k, deadline_s=1e9) for k in range(PADDED_BATCH_SIZE)]
    long = [TextRequest(100 + k, 32, arrival_s=100 + k, deadline_s=1e9) for k in range(PADDED_BATCH_SIZE)]
    decision = BatchDecision(rows=[[a, b] for a, b in zip(long, short)])
    in_arrival_order = latency.rows_s(PADDED_BATCH_SIZE, 4) + latency.rows_s(PADDED_BATCH_SIZE, 32)
    assert tnb(decision) == pytest.approx(in_arrival_order)


def test_otas_utility_above_pets_and_the_switching_stand_in():
    from benchmarks.token_adaptation import policies, run_trace, workload_setup
    from models.adaptive_vit_profile import PROFILE_FILE
    from models.task_registry import DIGITS_ARTIFACTS_DIR
    from placement.otas.profile import OtasProfile

    profile = OtasProfile.load(DIGITS_ARTIFACTS_DIR / PROFILE_FILE)
    scale, types, traces = workload_setup(profile, sorted(profile.accuracy), quick=True)
    factories = policies(profile, scale, labels_per_cell=pc.profile_default_labels())
    factories = {name: factories[name] for name in ("otas", "fixed_+0", "infaas_like")}
    log = logging.getLogger("test_paper_claims")
    bursty = run_trace("bursty", traces["bursty"][:20], types, [3], profile, scale, log, factories)["utility"]
    assert bursty["otas"] > bursty["fixed_+0"]
    assert bursty["otas"] > bursty["infaas_like"]
    fluctuating = run_trace("fluctuating", traces["fluctuating"][:20], types, [3], profile, scale, log,
                            factories)["utility"]
    assert fluctuating["otas"] > fluctuating["infaas_like"]
    # On the fluctuating trace PetS misses few deadlines: OTAS ties it (the row's figure is about 1).
    assert fluctuating["otas"] >= 0.98 * fluctuating["fixed_+0"]


def test_claims_table_reports_median_range_and_direction():
    rows = {"tcb": {"terms": "t", "utility_vs_tnb": [1.2, 0.9, 1.5], "utility_vs_ttb": [0.8, 0.9, 1.1],
                    "throughput_vs_naive": [1.6], "throughput_vs_sorted": []}}
    table = pc.claims_table(rows)
    row = table["tcb_utility_vs_tnb"]
    assert (row["median"], row["min"], row["max"], row["n"]) == (1.2, 0.9, 1.5, 3)
    assert row["paper"] == pc.TCB_PAPER["utility_vs_tnb"]
    assert row["direction_met"] and not row["direction_met_every_run"]
    assert not table["tcb_utility_vs_ttb"]["direction_met"]
    assert table["tcb_throughput_vs_sorted"]["median"] is None
    assert "alpaserve_rate_at_99_vs_sr" not in table


def test_arlo_rows_read_the_bert_base_figures():
    assert pc.CLAIMS["arlo_mean_latency_vs_st"].paper_figure == pytest.approx(0.297)
    assert pc.CLAIMS["arlo_mean_latency_vs_dt"].paper_figure == pytest.approx(0.759)
    assert pc.CLAIMS["arlo_mean_latency_vs_infaas"].paper_figure == pytest.approx(0.687)
    assert "INFaaS-like model-variant switching stand-in" in pc.CLAIMS["otas_utility_vs_infaas_like"].claim
