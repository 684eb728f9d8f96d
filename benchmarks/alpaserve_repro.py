"""Reproduction of AlpaServe Fig. 12 (§6.2) in the simulator: SLO attainment of plexserve's planner against
Selective Replication and Clockwork++ as the number of devices, the rate, the CV and the SLO scale vary.

Stand-ins, named as such: the models are AlpaServe Table 1's reproduction profiles (placement.alpaserve.paper_profiles,
overhead model of §3.3), and the traffic is synthetic Gamma arrivals with power-law popularity (exponent 0.5, as
§6.3) rather than the MAF traces, which cannot ship with the project (placement.core.traces replays them when given).
The weight budget per device is 14 GB (the paper's "around 13 GB" must hold one 13.4 GB BERT-6.7B, or SR could not
serve S2 at all). Each point plans on a planning workload (seed PLAN_SEED) and is scored on held-out traffic of the
same rate, CV and popularity drawn with another seed (EVAL_SEED), as benchmarks/planner_speed.py does: the
placement must generalise rather than fit the arrivals it was planned on. Clockwork++ re-places with SR's
algorithm every window on that window's actual arrivals of the held-out traffic, at zero swap cost (an online
oracle, as in §6.2).

--quick: model sets S1 and S2, three points per row, short workloads (under 2 minutes on an idle machine).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks._common import emit_json, machine_description, make_parser, out_dir, setup_logging  # noqa: E402
from placement.alpaserve.baselines import clockwork_plus_plus, selective_replication  # noqa: E402
from placement.alpaserve.paper_profiles import GB, table1_model_set  # noqa: E402
from placement.alpaserve.planner import PlannerConfig, plan  # noqa: E402
from placement.alpaserve.simulator import simulate  # noqa: E402
from placement.core.workload import gamma_workload  # noqa: E402

REPRO_WEIGHT_BUDGET_BYTES = 14 * GB
POPULARITY_EXPONENT = 0.5
#: Per model set, the default setting each row varies one factor of (devices, total req/s, CV, SLO scale).
DEFAULTS = {
    "S1": dict(devices=16, rate=50.0, cv=4.0, slo_scale=5.0),
    "S2": dict(devices=32, rate=30.0, cv=4.0, slo_scale=5.0),
    "S3": dict(devices=32, rate=50.0, cv=4.0, slo_scale=5.0),
}
#: Row -> factors applied to the default (devices, rate) or absolute values (cv, slo_scale).
ROWS_FULL = {
    "devices": [0.5, 0.75, 1.0, 1.25, 1.5],
    "rate": [0.5, 1.0, 1.5, 2.0, 3.0],
    "cv": [1.0, 2.0, 4.0, 6.0, 8.0],
    "slo_scale": [1.0, 2.0, 3.0, 5.0, 10.0],
}
ROWS_QUICK = {"devices": [0.5, 1.0, 1.5], "rate": [0.5, 1.0, 2.0], "cv": [1.0, 4.0, 8.0], "slo_scale": [1.0, 3.0, 10.0]}
#: Planner settings for every point (see benchmarks/planner_speed.py).
PLANNER = dict(replicas_per_round=0, screen_fraction=0.25, fast_rank="unserved_per_byte")
#: Seeds of the planning workload and of the held-out workload every system is scored on.
PLAN_SEED, EVAL_SEED = 1, 2


def setting(row: str, value: float, defaults: dict) -> dict:
    s = dict(defaults)
    if row == "devices":
        s["devices"] = max(1, int(round(defaults["devices"] * value)))
    elif row == "rate":
        s["rate"] = defaults["rate"] * value
    else:
        s[row] = value
    return s


def run_point(model_set, s: dict, duration_s: float, window_s: float) -> dict:
    """Plan on the PLAN_SEED workload; score every system on the EVAL_SEED (held-out) workload."""
    profiles = model_set.profiles
    names = sorted(profiles.models)
    latency = [profiles.models[n].single_device_latency() for n in names]

    def traffic(seed: int):
        return gamma_workload(names, s["rate"], s["cv"], [s["slo_scale"] * lat for lat in latency], duration_s,
                              POPULARITY_EXPONENT, seed)

    planning, held_out = traffic(PLAN_SEED), traffic(EVAL_SEED)
    budget = REPRO_WEIGHT_BUDGET_BYTES
    ours = plan(names, profiles, planning, s["devices"], budget, PlannerConfig(**PLANNER))
    sr = selective_replication(names, profiles, planning, s["devices"], budget, PlannerConfig(**PLANNER))
    cw = clockwork_plus_plus(names, profiles, held_out, s["devices"], budget, window_s, PlannerConfig(**PLANNER))
    return {
        "alpaserve": simulate(ours, profiles, held_out).slo_attainment(),
        "sr": simulate(sr, profiles, held_out).slo_attainment(),
        "clockwork++": cw.slo_attainment,
    }


def main() -> None:
    args = make_parser(__doc__).parse_args()
    log = setup_logging("alpaserve_repro")
    sets = ["S1", "S2"] if args.quick else ["S1", "S2", "S3"]
    rows = ROWS_QUICK if args.quick else ROWS_FULL
    duration_s, window_s = (240.0, 120.0) if args.quick else (1200.0, 120.0)
    results: dict = {}
    for set_name in sets:
        model_set = table1_model_set(set_name)
        results[set_name] = {}
        for row, values in rows.items():
            series = {"x": [], "alpaserve": [], "sr": [], "clockwork++": []}
            for value in values:
                s = setting(row, value, DEFAULTS[set_name])
                point = run_point(model_set, s, duration_s, window_s)
                series["x"].append(s["devices"] if row == "devices" else value)
                for system, attainment in point.items():
                    series[system].append(attainment)
                log.info("%s %s=%s: alpaserve %.3f  sr %.3f  clockwork++ %.3f", set_name, row, series["x"][-1],
                         point["alpaserve"], point["sr"], point["clockwork++"])
            results[set_name][row] = series
    wins = [a >= max(b, c) - 1e-9 for rows_ in results.values() for series in rows_.values()
            for a, b, c in zip(series["alpaserve"], series["sr"], series["clockwork++"])]
    gains = [a - b for rows_ in results.values() for series in rows_.values()
             for a, b in zip(series["alpaserve"], series["sr"])]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(len(rows), len(sets), figsize=(3.6 * len(sets), 2.6 * len(rows)), squeeze=False)
        for j, set_name in enumerate(sets):
            for i, row in enumerate(rows):
                ax = axes[i][j]
                series = results[set_name][row]
                for system, style in (("alpaserve", "o-"), ("sr", "s--"), ("clockwork++", "^:")):
                    ax.plot(series["x"], series[system], style, label=system)
                ax.set_xlabel({"devices": "#devices", "rate": "rate scale", "cv": "CV", "slo_scale": "SLO scale"}[row])
                ax.set_ylabel("SLO attainment")
                ax.set_ylim(0, 1.02)
                if i == 0:
                    ax.set_title(f"{set_name} (synthetic Gamma traffic)")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir() / "alpaserve_repro.png", dpi=110)
    except ImportError:
        log.warning("matplotlib missing: no PNG")
    emit_json({
        "results": results, "points": len(wins), "alpaserve_best_or_tied_share": float(np.mean(wins)),
        "mean_gain_over_sr": float(np.mean(gains)), "model_sets": sets, "quick": args.quick,
        "plan_seed": PLAN_SEED, "eval_seed": EVAL_SEED,
        "machine": machine_description(),
    })


if __name__ == "__main__":
    main()
