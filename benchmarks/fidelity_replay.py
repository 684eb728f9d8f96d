"""Fidelity offline: the controller's online service-time refit replayed on a `fidelity.py` run's records.

`benchmarks/fidelity.py` writes every request it replayed (arrival, model, SLO, real latency and outcome, for the
static and the controller run of each trace) with the placements in force to `benchmarks/out/fidelity_records.json`.
This script scores other refit settings on those records without the live system (a live run is long and differs
run to run by more than the settings do): for each setting it replays the controller's refits on the records
(the policy's own `ReplanPolicy.calibrate`, every period while paused through the static run and the warm-up, then at
each recorded decision of the controller run, never within a period of a re-placement, no earlier than it nor than
the warm-up, where the benchmark restarts the refit's window), and simulates the
controller run piecewise on the placements in force with the factor in force (as `fidelity.py`'s
`abs_gap_at_rollout_end`: the records keep no rollout steps). Settings: the calibration window
(`controller.calibration.window_s`), the blend of each fit into the factor in force (`controller.calibration.
smoothing`) and the simulator's host contention (`planning.simulation.host_contention_per_busy_device`; "recorded" is
what the run measured).

Which latencies the refits fit (`clock`): "client", this driver's, with the simulator's whole request overhead; or
"ingress", as the live controller does, the ingress's (each request's latency less its part outside the ingress, which
the records carry when the run stamped its requests) with that overhead less the client's round trip the run gave the
controller (`controller.calibration.client_round_trip_ms`). Either way the controller run is scored on the client's
latencies. Approximations, named: the chain starts at factor 1.0 with the first trace's static run (the live controller
had also refitted on the calibration replay, whose records are not kept); the warm-up follows the static run at once and
the controller run follows the warm-up at once (the benchmark also waits for the placement reset and for the last
answers). Records without a warm-up: the controller run follows its static run after one period.

    python benchmarks/fidelity_replay.py --quick [--records benchmarks/out/fidelity_records.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks._common import emit_json, make_parser, out_dir, setup_logging  # noqa: E402
from benchmarks.fidelity import (  # noqa: E402
    NUM_DEVICES,
    measured_profiles,
    one_device_group,
    sim_config,
    simulate_piecewise,
    with_online_scales,
)
from placement.core.calibration_settings import DEFAULT_SMOOTHING  # noqa: E402

#: Calibration windows (seconds), smoothings (both runs) and contentions scored: --quick, and the full run
#: ("recorded": the run's own).
QUICK_WINDOWS_S = (30.0,)
FULL_WINDOWS_S = (10.0, 30.0, 60.0, 90.0)
SMOOTHINGS = (0.0, 0.5)
QUICK_CONTENTIONS = ("recorded",)
FULL_CONTENTIONS = (0.0, "recorded")
#: Latencies the refits fit (the ingress's where the records carry them).
CLOCKS = ("client", "ingress")
#: Defaults for records written before they carried the run's period and report period.
DEFAULT_PERIOD_S = 10.0
REPORT_PERIOD_S = 1.0

log = setup_logging("fidelity_replay")


def placement_of(groups: list[list[str]]):
    from placement.core.placement_plan import Placement

    return Placement.model_validate({"groups": [one_device_group(models) for models in groups]})


def workload_of(trace: dict):
    from placement.core.workload import Workload

    return Workload(trace["model_names"], np.asarray(trace["arrival_s"], dtype=float),
                    np.asarray(trace["model"], dtype=np.int32), np.asarray(trace["slo_s"], dtype=float))


def latencies_of(run: dict, clock: str = "client") -> np.ndarray:
    """Per request: latency in seconds, NaN where not answered (refused or failed); this driver's, or with `clock`
    "ingress" the ingress's (less the request's part outside it)."""
    def floats(values: list[float | None]) -> np.ndarray:  # the records' nulls (not answered) as NaN
        return np.array([np.nan if x is None else x for x in values], dtype=float)

    latency = floats(run["latency_s"])
    if clock == "ingress":
        latency -= floats(run["client_leg_s"])
    latency[np.asarray(run["outcome"]) != 0] = np.nan
    return latency


class RefitReplay:
    """One chain of refits over a run's records, as the live controller made them."""

    def __init__(self, records: dict, window_s: float, contention: float, smoothing: float = DEFAULT_SMOOTHING,
                 clock: str = "client"):
        from placement.alpaserve.planner import PlannerConfig
        from placement.alpaserve.replanning import ReplanPolicy
        from placement.core.calibration_settings import ServiceCalibrationSettings, calibration_settle_s

        self.period_s = float(records.get("period_s", DEFAULT_PERIOD_S))
        self.simulated = sim_config(records["request_overhead_s"], contention)
        self.clock = clock
        round_trip_ms = 1e3 * records["client_round_trip_s"] if clock == "ingress" else 0.0
        self.profiles = measured_profiles(records["lone_service_s"],
                                          {int(b): r for b, r in records["batch_ratio"].items()}, 1, 0.0)
        self.policy = ReplanPolicy(profiles=self.profiles, num_devices=NUM_DEVICES, device_memory_bytes=1 << 40,
                                   planner=PlannerConfig(max_group_devices=1, simulator=self.simulated),
                                   calibration=ServiceCalibrationSettings(window_s=window_s, smoothing=smoothing,
                                                                          client_round_trip_ms=round_trip_ms))
        self.window_s = max(window_s, self.period_s)
        self.warmup_s = float(records.get("warmup_s", 0.0))
        slo = max(max(t["slo_s"]) for t in records["traces"])
        self.settle_s = calibration_settle_s(slo, REPORT_PERIOD_S, self.period_s)

    def refit(self, placement, workload, latency: np.ndarray, now_s: float, since_s: float) -> float:
        """Refit at `now_s` on the requests of [max(now - window, since), now - settle); the factor in force after."""
        from placement.core.traffic_window import ObservedTraffic

        start = max(now_s - self.window_s, since_s)
        if now_s - start <= self.settle_s:
            return self.policy.service_scale
        inside = (workload.arrival_s >= start) & (workload.arrival_s < now_s - self.settle_s)
        per_model = [np.flatnonzero(inside & (workload.model == m)) for m in range(len(workload.model_names))]
        slo = [float(workload.slo_s[workload.model == m][0]) if np.any(workload.model == m) else 1.0
               for m in range(len(workload.model_names))]
        traffic = ObservedTraffic(list(workload.model_names), [workload.arrival_s[i] - start for i in per_model],
                                  now_s - start - self.settle_s, slo, [latency[i] for i in per_model])
        self.policy.calibrate(placement, traffic, self.settle_s)
        return self.policy.service_scale

    def trace_gap(self, trace: dict) -> float:
        """Refit through the trace's static run (and warm-up), then its controller run; simulated minus real
        attainment of the controller run."""
        from placement.core.workload import Workload

        workload = workload_of(trace)
        duration = float(workload.arrival_s.max()) + 1e-9
        initial = placement_of(trace["initial"])
        static_latency = latencies_of(trace["static"], self.clock)
        for now in np.arange(self.period_s, duration + self.period_s, self.period_s):
            self.refit(initial, workload, static_latency, float(now), 0.0)
        # One clock for the static run, the warm-up (or, in records without one, one idle period) and the controller
        # run: the records before the controller run stay in its refit's window.
        parts = [(workload, static_latency, 0.0)]
        offset = duration + self.period_s
        if "warmup" in trace:
            warmup = workload_of(trace["warmup"])
            parts.append((warmup, latencies_of(trace["warmup"], self.clock), duration))
            offset = duration + self.warmup_s
        parts.append((workload, latencies_of(trace["dynamic"], self.clock), offset))
        both = Workload.merge([Workload(w.model_names, w.arrival_s + at, w.model, w.slo_s) for w, _, at in parts])
        order = np.argsort(np.concatenate([w.arrival_s + at for w, _, at in parts]), kind="stable")
        latency = np.concatenate([lat for _, lat, _ in parts])[order]
        # The benchmark restarts the refit's window when the warm-up begins (records without a warm-up: no restart).
        restarted = duration if "warmup" in trace else 0.0
        for now in np.arange(duration + self.period_s, offset, self.period_s):  # paused through the warm-up
            self.refit(initial, both, latency, float(now), restarted)
        changes = [(float(at), placement_of(groups)) for at, groups in trace["placements"]]
        scales = [(-np.inf, self.policy.service_scale)]
        for decided_s, _ in trace["online_scales"]:
            applied = [at for at, _ in changes if at <= decided_s]
            since = offset + applied[-1] if applied else restarted
            if applied and decided_s - applied[-1] < self.period_s:
                continue
            current = next((p for at, p in reversed(changes) if at <= decided_s), initial)
            scales.append((decided_s, self.refit(current, both, latency, offset + decided_s, since)))
        timeline = [(-np.inf, initial, 1.0)] + [(at, p, 1.0) for at, p in changes]
        met_real = latencies_of(trace["dynamic"]) <= workload.slo_s  # NaN (not answered) compares False
        met_sim = simulate_piecewise(with_online_scales(timeline, scales), self.profiles, workload, self.simulated)
        return float(met_sim.mean() - met_real.mean())


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--records", type=Path, default=out_dir() / "fidelity_records.json")
    args = parser.parse_args()
    if not args.records.exists():
        raise SystemExit(f"--records {args.records}: no such file (run benchmarks/fidelity.py first)")
    records = json.loads(args.records.read_text())
    recorded = float(records["host_contention_per_busy_device"])
    clocks = CLOCKS if "client_leg_s" in records["traces"][0]["dynamic"] else ("client",)
    settings = [(w, recorded if c == "recorded" else float(c), smoothing, clock)
                for w in (QUICK_WINDOWS_S if args.quick else FULL_WINDOWS_S)
                for smoothing in SMOOTHINGS
                for c in (QUICK_CONTENTIONS if args.quick else FULL_CONTENTIONS)
                for clock in clocks]
    results = []
    for k, (window_s, contention, smoothing, clock) in enumerate(settings):
        replay = RefitReplay(records, window_s, contention, smoothing, clock)
        gaps = [replay.trace_gap(trace) for trace in records["traces"]]
        results.append({"window_s": window_s, "smoothing": smoothing, "host_contention_per_busy_device": contention,
                        "clock": clock, "signed_gap_per_trace": gaps, "abs_gap_max": max(abs(g) for g in gaps)})
        log.info("%d/%d window %.0f s, smoothing %.2f, contention %.2f, %s clock: simulated - real per trace %s "
                 "(abs_gap_max %.3f)", k + 1, len(settings), window_s, smoothing, contention, clock,
                 [round(g, 3) for g in gaps], results[-1]["abs_gap_max"])
    best = min(results, key=lambda r: r["abs_gap_max"])
    emit_json({"records": str(args.records), "settings": results, "best_window_s": best["window_s"],
               "best_smoothing": best["smoothing"],
               "best_host_contention_per_busy_device": best["host_contention_per_busy_device"],
               "best_abs_gap_max": best["abs_gap_max"]})


if __name__ == "__main__":
    main()
