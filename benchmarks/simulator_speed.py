"""Simulator speed: simulated requests per second on one core, without and with batching.

Case (issue 3): 64 devices in 16 groups of 4 (4-stage pipelines), 48 models (the six Table 1 models that fit a
V100, 8 instances each, reproduction profiles) with 4 replicas each, Gamma arrivals (CV 4) with power-law
popularity, SLO 5x the single-device latency; at least 10^6 requests (--quick) or 5 x 10^6.

Rates are per CPU-second of this single-threaded process (the machine is shared). Also measured, side by side: the
same kernel as plain Python (NUMBA_DISABLE_JIT=1 in a child process) on a smaller case, to show what the compiled
kernel buys. Writes benchmarks/out/simulator_speed.png (requests/s against workload size).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks._common import emit_json, machine_description, make_parser, out_dir, setup_logging  # noqa: E402
from placement.alpaserve import simulator as sim  # noqa: E402
from placement.alpaserve.batching import MaxBatchWithinSLO  # noqa: E402
from placement.alpaserve.paper_profiles import replicate_profiles, table1_profiles  # noqa: E402
from placement.core.placement_plan import GroupPlacement, Placement  # noqa: E402
from placement.core.profiles import ParallelConfig  # noqa: E402
from placement.core.workload import gamma_workload  # noqa: E402

MODELS = ("bert-1.3b", "bert-2.7b", "bert-6.7b", "moe-1.3b", "moe-2.4b", "moe-5.3b")
INSTANCES_PER_MODEL = 8
NUM_GROUPS, DEVICES_PER_GROUP, REPLICAS_PER_MODEL = 16, 4, 4
TOTAL_RATE_PER_S, CV, SLO_SCALE, POPULARITY_EXPONENT = 300.0, 4.0, 5.0, 0.5
MAX_BATCH_SIZE = 8
REPEATS = 3
PURE_PYTHON_REQUESTS = 50_000


def build_case(num_requests: int):
    profiles = replicate_profiles(table1_profiles(), {m: INSTANCES_PER_MODEL for m in MODELS}).profiles
    names = sorted(profiles.models)
    groups = [[] for _ in range(NUM_GROUPS)]
    for replica in range(REPLICAS_PER_MODEL):
        for i, name in enumerate(names):
            groups[(i + replica * (NUM_GROUPS // REPLICAS_PER_MODEL)) % NUM_GROUPS].append(name)
    placement = Placement(groups=[GroupPlacement(num_devices=DEVICES_PER_GROUP,
                                                 config=ParallelConfig(pipeline_stages=DEVICES_PER_GROUP),
                                                 models=sorted(set(g))) for g in groups])
    latency = [profiles.models[n].single_device_latency() for n in names]
    duration = num_requests / TOTAL_RATE_PER_S
    workload = gamma_workload(names, TOTAL_RATE_PER_S, CV, [SLO_SCALE * lat for lat in latency], duration,
                              POPULARITY_EXPONENT, seed=0)
    return placement, profiles, workload


@dataclass
class Rate:
    requests_per_cpu_s: float  # CPU time of this single-threaded process (the machine is shared)
    requests_per_wall_s: float
    slo_attainment: float


def best_rate(placement, profiles, workload, config) -> Rate:
    """Requests per second of the best of REPEATS runs (tables included), by CPU time and by wall time."""
    best_cpu = best_wall = np.inf
    for _ in range(REPEATS):
        cpu, wall = time.process_time(), time.perf_counter()
        result = sim.simulate(placement, profiles, workload, config)
        best_cpu = min(best_cpu, time.process_time() - cpu)
        best_wall = min(best_wall, time.perf_counter() - wall)
    return Rate(len(workload) / best_cpu, len(workload) / best_wall, result.slo_attainment())


def pure_python_rate() -> float:
    """The compiled path run as plain Python: a child process with NUMBA_DISABLE_JIT=1 (every kernel helper
    interpreted) simulates a PURE_PYTHON_REQUESTS-request case of the same shape."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    code = "from benchmarks.simulator_speed import interpreted_rate; print(interpreted_rate())"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def interpreted_rate() -> float:
    """Requests per CPU-second of `simulate` in this process (run by `pure_python_rate` without numba)."""
    placement, profiles, workload = build_case(PURE_PYTHON_REQUESTS)
    started = time.process_time()
    sim.simulate(placement, profiles, workload, sim.SimulatorConfig())
    return len(workload) / (time.process_time() - started)


def main() -> None:
    args = make_parser(__doc__).parse_args()
    log = setup_logging("simulator_speed")
    num_requests = 1_000_000 if args.quick else 5_000_000
    log.info("building the case: %d requests, 48 models, 64 devices", num_requests)
    placement, profiles, workload = build_case(num_requests)
    log.info("workload: %d requests over %.0f s; compiling kernels", len(workload), workload.duration_s)
    small = workload.take(np.arange(1000))
    sim.simulate(placement, profiles, small)
    sim.simulate(placement, profiles, small, sim.SimulatorConfig(batching=MaxBatchWithinSLO(MAX_BATCH_SIZE)))

    log.info("timing without batching")
    plain = best_rate(placement, profiles, workload, sim.SimulatorConfig())
    log.info("  %.2f M requests per CPU-second, %.2f M per wall-second (attainment %.4f)",
             plain.requests_per_cpu_s / 1e6, plain.requests_per_wall_s / 1e6, plain.slo_attainment)
    log.info("timing with batching (max batch %d)", MAX_BATCH_SIZE)
    batched = best_rate(placement, profiles, workload, sim.SimulatorConfig(batching=MaxBatchWithinSLO(MAX_BATCH_SIZE)))
    log.info("  %.2f M requests per CPU-second, %.2f M per wall-second (attainment %.4f)",
             batched.requests_per_cpu_s / 1e6, batched.requests_per_wall_s / 1e6, batched.slo_attainment)
    log.info("timing the same kernel as plain Python on %d requests", PURE_PYTHON_REQUESTS)
    rate_py = pure_python_rate()
    log.info("  %.3f M requests per CPU-second", rate_py / 1e6)

    sizes = [10_000, 100_000, len(workload)]
    curve = []
    for size in sizes:
        part = workload.take(np.arange(min(size, len(workload))))
        curve.append(best_rate(placement, profiles, part, sim.SimulatorConfig()).requests_per_cpu_s)
        log.info("  %d requests: %.2f M requests per CPU-second", size, curve[-1] / 1e6)
    rate, rate_b = plain.requests_per_cpu_s, batched.requests_per_cpu_s
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.semilogx(sizes, np.asarray(curve) / 1e6, marker="o", label="no batching")
        ax.axhline(rate_b / 1e6, color="tab:orange", linestyle="--", label=f"batching (max {MAX_BATCH_SIZE})")
        ax.axhline(3.0, color="grey", linestyle=":", label="target 3 M/s")
        ax.set_xlabel("requests simulated")
        ax.set_ylabel("million requests / CPU-second")
        ax.set_title("plexserve simulator speed (one core)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir() / "simulator_speed.png", dpi=120)
    except ImportError:
        log.warning("matplotlib missing: no PNG")
    emit_json({
        "requests": len(workload), "requests_per_s": rate, "requests_per_s_batching": rate_b,
        "requests_per_s_wall": plain.requests_per_wall_s, "requests_per_s_batching_wall": batched.requests_per_wall_s,
        "requests_per_s_pure_python": rate_py, "numba": sim.HAVE_NUMBA, "slo_attainment": plain.slo_attainment,
        "slo_attainment_batching": batched.slo_attainment, "rates_are": "requests per CPU-second of one process",
        "machine": machine_description(),
    })


if __name__ == "__main__":
    main()
