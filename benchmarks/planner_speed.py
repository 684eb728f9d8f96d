"""Planner speed: wall time of the AlpaServe planner on 48 models x 64 devices, and what its placement attains.

Case (issue 3): the six Table 1 models that fit a V100 (8 instances each, reproduction profiles), 64 devices with
a 13 GB weight budget (V100-like), power-law popularity (exponent 0.5) with rates summing to 300 req/s, Gamma
arrivals with CV 4, SLO 5x the single-device latency. The planner sees a planning workload; attainment is then
simulated on a held-out workload drawn with another seed, for our placement and for Selective Replication's.

Side by side (same run): Alg. 1 with beam search of size 3 against the fast variant, on the groups our planner
chose, on a reduced case (`--beam-models` models x `--beam-devices` devices; beam search on the full 48 x 64 case
needs ~10^5 simulations per candidate).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import emit_json, machine_description, make_parser, out_dir, setup_logging  # noqa: E402
from placement.alpaserve.baselines import selective_replication  # noqa: E402
from placement.alpaserve.paper_profiles import (  # noqa: E402
    V100_WEIGHT_BUDGET_BYTES,
    replicate_profiles,
    table1_profiles,
)
from placement.alpaserve.planner import PlannerConfig, _Problem, greedy_selection, plan  # noqa: E402
from placement.alpaserve.simulator import simulate  # noqa: E402
from placement.core.placement_plan import SearchStats  # noqa: E402
from placement.core.workload import gamma_workload  # noqa: E402

MODELS = ("bert-1.3b", "bert-2.7b", "bert-6.7b", "moe-1.3b", "moe-2.4b", "moe-5.3b")
INSTANCES = 8
NUM_DEVICES = 64
TOTAL_RATE_PER_S, CV, SLO_SCALE, POPULARITY_EXPONENT = 300.0, 4.0, 5.0, 0.5
PLAN_SEED, EVAL_SEED = 1, 2
#: plexserve's settings for large cases: about 1/8 of the replicas that fit placed per simulation, models ranked by
#: unserved requests per weight byte, candidates screened on the first quarter of the workload (see PlannerConfig).
FAST_SETTINGS = dict(replicas_per_round=0, screen_fraction=0.25, fast_rank="unserved_per_byte")


def build(instances: int, num_devices: int, duration_s: float, seed: int):
    profiles = replicate_profiles(table1_profiles(), {m: instances for m in MODELS}).profiles
    names = sorted(profiles.models)
    latency = [profiles.models[n].single_device_latency() for n in names]
    rate = TOTAL_RATE_PER_S * num_devices / NUM_DEVICES
    workload = gamma_workload(names, rate, CV, [SLO_SCALE * lat for lat in latency], duration_s, POPULARITY_EXPONENT,
                              seed)
    return names, profiles, workload


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--beam-instances", type=int, default=None,
                        help="instances per model in the beam comparison (default 2 with --quick, else 3)")
    parser.add_argument("--beam-devices", type=int, default=None,
                        help="devices in the beam comparison (default 8 with --quick, else 16)")
    args = parser.parse_args()
    args.beam_instances = args.beam_instances or (2 if args.quick else 3)
    args.beam_devices = args.beam_devices or (8 if args.quick else 16)
    log = setup_logging("planner_speed")
    plan_duration, eval_duration = (60.0, 600.0) if args.quick else (120.0, 1800.0)
    names, profiles, workload = build(INSTANCES, NUM_DEVICES, plan_duration, PLAN_SEED)
    _, _, held_out = build(INSTANCES, NUM_DEVICES, eval_duration, EVAL_SEED)
    log.info("48 x 64 case: planning workload %d requests, held-out %d", len(workload), len(held_out))
    # Compile (or load) the simulator kernels outside the timed region.
    plan(names[:1], profiles, workload.for_models(names[:1]), 1, V100_WEIGHT_BUDGET_BYTES)

    config = PlannerConfig(**FAST_SETTINGS)
    wall, cpu = time.perf_counter(), time.process_time()
    ours = plan(names, profiles, workload, NUM_DEVICES, V100_WEIGHT_BUDGET_BYTES, config)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    log.info("plexserve planner: %.2f s wall, %.2f s CPU, %d simulations, predicted %.4f", wall, cpu,
             ours.stats.simulations, ours.predicted_slo_attainment)
    log.info("\n%s", ours.normalize().describe())
    paper_wall = time.perf_counter()
    paper = plan(names, profiles, workload, NUM_DEVICES, V100_WEIGHT_BUDGET_BYTES, PlannerConfig())
    paper_wall = time.perf_counter() - paper_wall
    log.info("paper-faithful settings (1 replica per simulation, no screening): %.2f s wall, predicted %.4f",
             paper_wall, paper.predicted_slo_attainment)
    sr_wall = time.perf_counter()
    sr = selective_replication(names, profiles, workload, NUM_DEVICES, V100_WEIGHT_BUDGET_BYTES)
    sr_wall = time.perf_counter() - sr_wall
    attainment = simulate(ours, profiles, held_out).slo_attainment()
    paper_attainment = simulate(paper, profiles, held_out).slo_attainment()
    sr_attainment = simulate(sr, profiles, held_out).slo_attainment()
    log.info("held-out attainment: ours %.4f, paper settings %.4f, SR %.4f", attainment, paper_attainment,
             sr_attainment)

    # Beam search of size 3 vs the fast variant (Alg. 1) on the groups the planner picks for a reduced case.
    b_names, b_profiles, b_workload = build(args.beam_instances, args.beam_devices, plan_duration, PLAN_SEED)
    _, _, b_held_out = build(args.beam_instances, args.beam_devices, eval_duration, EVAL_SEED)
    reduced = plan(b_names, b_profiles, b_workload, args.beam_devices, V100_WEIGHT_BUDGET_BYTES, config)
    groups = [(g.num_devices, g.config) for g in reduced.groups]
    log.info("beam comparison: %d models on groups %s", len(b_names), [f"{n}:{c.key()}" for n, c in groups])
    scores = {}
    # The fast variant with the planner's defaults: on a case this small it affords its look-ahead (issue 15).
    for label, cfg in (("fast", PlannerConfig()), ("beam3", PlannerConfig(fast=False, beam_size=3))):
        problem = _Problem(b_profiles, b_workload, V100_WEIGHT_BUDGET_BYTES, cfg, SearchStats())
        started = time.perf_counter()
        sel = greedy_selection(problem, b_names, groups, b_workload)
        scores[label] = (sel.attainment, simulate(sel.placement(), b_profiles, b_held_out).slo_attainment(),
                         time.perf_counter() - started, problem.stats.simulations)
        log.info("  %s: planning %.4f, held-out %.4f, %.2f s, %d simulations", label, *scores[label])

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
        labels = ["plexserve", "paper settings", "SR"]
        left.bar(labels, [attainment, paper_attainment, sr_attainment], color=["tab:blue", "tab:cyan", "tab:grey"])
        left.set_ylabel("held-out SLO attainment")
        left.set_ylim(0, 1)
        left.set_title("48 models x 64 devices")
        right.bar(labels, [wall, paper_wall, sr_wall], color=["tab:blue", "tab:cyan", "tab:grey"])
        right.axhline(4.0, color="red", linestyle=":", label="target 4 s")
        right.set_ylabel("planning wall time (s)")
        right.legend()
        fig.tight_layout()
        fig.savefig(out_dir() / "planner_speed.png", dpi=110)
    except ImportError:
        log.warning("matplotlib missing: no PNG")
    emit_json({
        "plan_s": wall, "plan_cpu_s": cpu, "slo_attainment": attainment,
        "predicted_slo_attainment": ours.predicted_slo_attainment, "baseline_sr_attainment": sr_attainment,
        "baseline_sr_plan_s": sr_wall, "paper_settings_plan_s": paper_wall,
        "paper_settings_slo_attainment": paper_attainment, "simulations": ours.stats.simulations,
        "planning_requests": len(workload), "held_out_requests": len(held_out),
        "beam_case": f"{len(b_names)} models x {args.beam_devices} devices, groups fixed to the planner's choice",
        "beam3_attainment": scores["beam3"][1], "fast_attainment_beam_case": scores["fast"][1],
        "beam3_s": scores["beam3"][2], "fast_s_beam_case": scores["fast"][2], "settings": FAST_SETTINGS,
        "machine": machine_description(),
    })


if __name__ == "__main__":
    main()
