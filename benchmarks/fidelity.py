"""Fidelity and load: the live system against the simulator on one trace whose popularity shifts halfway.

On this machine (2 logical devices on 2 shared cores, a stand-in for a GPU cluster), three text models with
MiniLM's real weights (minilm-a, -b, -c) serve a Gamma trace whose popularity moves from minilm-a to minilm-c at
half time. Steps, side by side in one run:

1. **Measure profiles** on the live system: one deployment hosting every model on both devices; lone requests
   through the ingress and straight to a group replica give each model's service time and the ingress overhead;
   timed loads of the weights give each model's load time (the controller prices rollouts with it). A closed-loop
   probe with every device busy sets the capacity, hence the offered load and the SLO. **Calibration**: a trace of
   its own seed (never scored), replayed on this deployment at the scored traces' rate; the lone-request service
   times are scaled by the factor at which the simulator reproduces that replay's p90 latency
   (`placement/alpaserve/service_calibration.py`; the engine batches queued requests, so under real traffic a
   request costs far less than at the probe's full load). The calibrated times become a `ProfileSet` (source
   'measured') for the planner, the controller (which refits the factor online from the ingress's records every
   decision) and the simulator.
2. **Deploy** the application with the placement the planner picks for the first half and the controller on.
3. **Static run**: the controller paused; the trace replayed through the ingress (Python handle API).
4. **Controller run**: the placement reset, the controller on (period `--period-s`); the same trace replayed.
5. **Simulate** both runs on the same requests with the calibrated profiles (and, for comparison, with the
   profiles scaled to the throughput probe, `attainment_sim_throughput_scaled`): the static run on its placement, the
   controller run piecewise on the placements in force (switching when each re-placement finished).
6. **Re-placement under steady load**: Poisson traffic to minilm-a (alone on its group) and minilm-b while an
   operator re-placement loads minilm-c beside minilm-b; the p99 latency of minilm-a, whose group does not change,
   during the rollout against the same span just before it (issue target: within 20%).
7. **Load past saturation**: a burst at several times the capacity; accepted, rejected (503) and failed counts.

Steps 2-5 run on NUM_TRACES (3) traces with different seeds in one run. Final JSON line: controller_gain_real_min
and controller_gain_real_mean (controller run minus static run, second half, per trace), abs_gap_max (controller
run, real vs simulated), transition_cost_predicted and transition_cost_real (attainment lost per request while a
rollout runs: the decision's prediction vs the live run against the target simulated as deployed), reaction_s (the
shift at half time to the first re-placement applied after it), failed_accepted, unchanged_p99_ratio (step 6), and
per trace its figures, decisions and re-placements. The profiles carry the measured weight load time (load_s). A PNG
timeline (rate per model, attainment per window, re-placements) goes to benchmarks/out/fidelity.png.

    python benchmarks/fidelity.py --quick
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from benchmarks._common import emit_json, machine_description, make_parser, out_dir, setup_logging  # noqa: E402

MODELS = ["minilm-a", "minilm-b", "minilm-c"]
DEVICE_RESOURCE = "plex_device"
NUM_DEVICES = 2
#: Logical CPUs declared to Ray (fractional replicas on 2 physical cores).
RAY_NUM_CPUS = 8
#: The request every client sends: one short sentence.
TEXT = "plexserve keeps a running deployment matched to its traffic"
#: Calibration replay (step 1): seconds of its trace, and the seed offset that keeps it apart from the scored traces.
CALIBRATION_S = 30.0
CALIBRATION_SEED_OFFSET = 1000
#: SLO of the profiling deployment, ms: nothing is refused there, so the calibration sees every request's latency.
PROFILING_SLO_MS = 10_000.0
#: Lone requests per model when profiling (the median is kept).
PROFILE_REQUESTS = 30
#: Timed loads of the model's weights (the median is the profile's load_s).
LOAD_REPEATS = 3
#: Repeated traces (different seeds) in one run.
NUM_TRACES = 3
#: Seconds and concurrent clients of the closed-loop throughput probe.
THROUGHPUT_PROBE_S = 10.0
THROUGHPUT_CONCURRENCY = 8
#: SLO = this many times the slowest model's profiled latency (AlpaServe §6.2 "SLO scale").
SLO_SCALE = 4.0
#: Offered load as a share of the measured throughput with every device busy.
LOAD_FACTOR = 0.6
#: Device memory in model weights: each device holds two of the three models, so the placement matters.
MODELS_PER_DEVICE_MEMORY = 2.2
#: Inter-arrival CV of the Gamma processes (bursty, as in AlpaServe §6.2).
TRACE_CV = 2.0
#: Popularity of the models before and after the shift.
SHARES_BEFORE = (0.75, 0.15, 0.1)
SHARES_AFTER = (0.1, 0.15, 0.75)
#: Load phase: offered rate as a multiple of capacity, and its length in seconds.
SATURATION_FACTOR = 4.0
SATURATION_S = 8.0
#: Width of the attainment windows in the timeline, seconds.
TIMELINE_BIN_S = 5.0
#: Steady re-placement phase: offered rate as a share of capacity (split over minilm-a and minilm-b), seconds of
#: traffic before the rollout and after it.
STEADY_LOAD_FACTOR = 0.4
STEADY_BEFORE_S = 25.0
STEADY_AFTER_S = 3.0
#: Shortest span before the rollout that the p99 baseline covers, seconds.
STEADY_MIN_BASELINE_S = 10.0

log = setup_logging("fidelity")


def measure_load_s() -> tuple[float, int]:
    """Seconds to load MiniLM's weights (median of LOAD_REPEATS, after one warm-up load) and its weight bytes: the
    load time of one model on one device, kept with its profile (`ConfigProfile.load_s`)."""
    from models.text_encoder import load_text_encoder

    encoder = load_text_encoder()
    times = []
    for _ in range(LOAD_REPEATS):
        started = time.perf_counter()
        load_text_encoder()
        times.append(time.perf_counter() - started)
    return float(np.median(times)), encoder.weight_bytes()


async def measure_step_s(spec: dict, load_s: float) -> float:
    """Seconds of one rollout step besides loading, measured on the profiling deployment (every model on both
    devices) as the controller runs a step: one override apply that loads a model into a running group (timed until
    the ingress and the group report the new version, the model loaded), minus the load itself, plus two
    ingress-only applies (routing before and after the change)."""
    from ray import serve

    from placement.alpaserve.placement_rollout import SlotLayout
    from placement.core.deployment_spec import parse_spec
    from placement.core.placement_plan import Placement
    from rayserve_apps.contracts import INGRESS_DEPLOYMENT, group_deployment_name
    from rayserve_apps.control.live_update import apply_overrides, layout_overrides

    parsed = parse_spec(spec)
    ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name="plexserve")
    group = serve.get_deployment_handle(group_deployment_name(1), app_name="plexserve")

    async def apply(groups: list[list[str]], slot_versions: list[int], version: int) -> float:
        layout = SlotLayout.from_placement(Placement.model_validate({"groups": [one_device_group(g) for g in groups]}),
                                           len(groups))
        started = time.perf_counter()
        await asyncio.to_thread(apply_overrides, "plexserve",
                                layout_overrides(parsed, layout, layout.routes(), slot_versions, version))
        while (await ingress.placement_version.remote() < version
               or (await group.info.remote())["placement_version"] < slot_versions[1]):
            await asyncio.sleep(0.1)
        return time.perf_counter() - started

    await apply([MODELS, MODELS[:2]], [1, 1], 1)  # minilm-c leaves group 1
    load_step_s = await apply([MODELS, MODELS], [1, 2], 2)  # and loads again: a rehost step
    route_s = await apply([MODELS, MODELS], [1, 2], 3)  # the ingress alone
    step_s = max(load_step_s - load_s, 0.0) + 2 * route_s
    log.info("rollout step: %.1f s to load a model into a running group, %.1f s to re-route; %.1f s per step "
             "besides loading",
             load_step_s, route_s, step_s)
    return step_s


def spec_dict(placement: dict | None, profiles_path: str | None, slo_ms: float, period_s: float, memory_bytes: int,
              step_overhead_s: float | None = None) -> dict:
    spec: dict = {
        "cluster": {"num_devices": NUM_DEVICES, "device_resource": DEVICE_RESOURCE,
                    "device_memory_bytes": memory_bytes},
        "models": [{"name": m, "kind": "text", "source": "package:all-minilm-l6-v2", "slo_ms": slo_ms,
                    "num_cpus_per_replica": 0.5, "max_queued_requests": 64} for m in MODELS],
        "placement": placement,
    }
    if profiles_path is not None:
        spec["planning"] = {"profiles": {"path": profiles_path}, "planner": {"max_group_devices": 1}}
        spec["controller"] = {"period_s": period_s, "fit_window_s": period_s, "min_gain": 0.02}
        if step_overhead_s is not None:
            spec["controller"]["transition"] = {"step_overhead_s": step_overhead_s}
    return spec


def one_device_group(models: list[str]) -> dict:
    return {"num_devices": 1, "config": {"intra_op_degree": 1, "pipeline_stages": 1}, "models": models}


def deploy(spec: dict, http_options: dict) -> None:
    from placement.core.deployment_spec import parse_spec
    from rayserve_apps.control.live_update import application_config, apply_config

    apply_config([application_config(parse_spec(spec))], http_options)


async def timed(call) -> float:
    started = time.perf_counter()
    await call
    return time.perf_counter() - started


async def profile_live(handle) -> tuple[dict[str, float], float]:
    """Per model: median service time straight to a group replica; and the median ingress overhead."""
    from ray import serve

    from models.text_encoder import load_text_tokenizer

    token_ids = load_text_tokenizer("package:all-minilm-l6-v2").encode([TEXT])
    group = serve.get_deployment_handle("group-0", app_name="plexserve")
    service, overhead = {}, []
    for model in MODELS:
        for _ in range(3):  # warm-up
            await handle.embed.remote(model, [TEXT])
        direct = [await timed(group.embed_token_ids.remote(model, token_ids)) for _ in range(PROFILE_REQUESTS)]
        through = [await timed(handle.embed.remote(model, [TEXT])) for _ in range(PROFILE_REQUESTS)]
        service[model] = float(np.median(direct))
        overhead.append(float(np.median(through)) - service[model])
        log.info("profile %s: %.1f ms in the group, %.1f ms through the ingress", model, 1e3 * service[model],
                 1e3 * np.median(through))
    return service, max(0.0, float(np.median(overhead)))


async def measure_throughput(handle, seconds: float, concurrency: int) -> float:
    """Requests per second the whole system answers with every device busy (closed loop over all models).

    The devices here are CPU shares of two cores that the ingress, the replicas and this driver share, so the
    system's throughput is below what lone-request service times promise; the profiles are scaled to it."""
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await handle.embed.remote(MODELS[(k + done) % len(MODELS)], [TEXT])
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return done / (time.perf_counter() - started)


def measured_profiles(service_s: dict[str, float], weight_bytes: int, load_s: float):
    from placement.core.profiles import ConfigProfile, ModelProfile, ParallelConfig, ProfileSet, StageProfile

    models = {m: ModelProfile(name=m, configs=[ConfigProfile(config=ParallelConfig(), load_s=load_s, stages=[
        StageProfile(latency_s={1: s}, weight_bytes_per_device=weight_bytes)])]) for m, s in service_s.items()}
    return ProfileSet(source="measured", device=f"1 logical device = 0.5 CPU share of {machine_description()}",
                      models=models)


def make_trace(total_rate: float, duration_s: float, slo_s: float, seed: int):
    from placement.core.arrivals import GammaProcess
    from placement.core.workload import ModelTraffic, Workload, generate_workload

    half = duration_s / 2
    parts = [generate_workload(MODELS,
                               [ModelTraffic(GammaProcess(total_rate * share, TRACE_CV), slo_s) for share in shares],
                               half, seed=seed + k, start_s=k * half)
             for k, shares in enumerate((SHARES_BEFORE, SHARES_AFTER))]
    return Workload.merge(parts)


async def replay(handle, workload, slo_s: float) -> dict[str, np.ndarray]:
    """Send every request at its arrival time; per request: latency (s, NaN if not answered) and outcome."""
    from ray.serve.exceptions import BackPressureError

    n = len(workload)
    latency = np.full(n, np.nan)
    outcome = np.zeros(n, dtype=np.int8)  # 0 ok, 1 rejected (503 / back pressure), 2 failed
    start = time.perf_counter()

    async def one(i: int) -> None:
        sent = time.perf_counter()
        try:
            await handle.embed.remote(workload.model_names[workload.model[i]], [TEXT])
            latency[i] = time.perf_counter() - sent
        except BackPressureError:
            outcome[i] = 1
        except Exception as error:  # noqa: BLE001 - sorted into rejected (503) and failed
            outcome[i] = 1 if getattr(error, "status_code", None) == 503 or "503" in str(error)[:200] else 2
            if outcome[i] == 2:
                log.warning("request %d failed: %s", i, str(error)[:200])

    tasks = []
    next_report = 0.0
    for i in range(n):
        delay = workload.arrival_s[i] - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
        if workload.arrival_s[i] >= next_report:
            log.info("replay: t=%.0f s, %d/%d requests sent", workload.arrival_s[i], i + 1, n)
            next_report += 10.0
    await asyncio.gather(*tasks)
    met = (outcome == 0) & (latency <= slo_s)
    return {"latency": latency, "outcome": outcome, "met": met,
            "start_wall": time.time() - (time.perf_counter() - start)}


def sim_config(overhead_s: float):
    """The simulated system of every simulation here: shortest-queue dispatch, the measured ingress overhead."""
    from placement.alpaserve.dispatch import make_dispatch
    from placement.alpaserve.simulator import SimulatorConfig

    return SimulatorConfig(dispatch=make_dispatch("shortest_queue"), request_overhead_s=overhead_s)


async def calibration_replay(handle, lone_profiles, overhead_s: float, total_rate: float, seed: int):
    """Step 1, service-time calibration: a trace of its own seed (never scored) replayed at the scored traces' rate
    on the profiling deployment (every model on both devices); the factor on the lone-request profiles at which the
    simulator reproduces the replay's latency quantile (`placement.alpaserve.service_calibration`, the fit the
    controller repeats online on the ingress's records)."""
    from placement.alpaserve.service_calibration import calibrate_service_scale
    from placement.core.placement_plan import Placement

    trace = make_trace(total_rate, CALIBRATION_S, PROFILING_SLO_MS / 1000.0, seed=seed)
    replayed = await replay(handle, trace, PROFILING_SLO_MS / 1000.0)
    everywhere = Placement.model_validate({"groups": [one_device_group(MODELS), one_device_group(MODELS)]})
    calibration = calibrate_service_scale(everywhere, lone_profiles, trace, replayed["latency"],
                                          sim_config(overhead_s))
    if calibration is None:
        raise RuntimeError(f"calibration replay: too few answered requests ({np.isfinite(replayed['latency']).sum()})")
    log.info("calibration replay (%d requests, %d answered): p%.0f latency %.1f ms measured, %.1f ms simulated at "
             "x%.3f of the lone-request service times", len(trace), calibration.answered, 100 * calibration.quantile,
             1e3 * calibration.observed_latency_s, 1e3 * calibration.simulated_latency_s, calibration.scale)
    return calibration


def simulate_piecewise(timeline: list[tuple], profiles, workload, overhead_s: float) -> np.ndarray:
    """SLO met per request, simulating each span of the trace on the placement in force during it; an entry
    (start, placement, span_profiles) simulates its span with its own profiles (a rollout step that loads)."""
    from placement.alpaserve.simulator import SERVED, simulate

    config = sim_config(overhead_s)
    met = np.zeros(len(workload), dtype=bool)
    bounds = [entry[0] for entry in timeline[1:]] + [np.inf]
    begin = -np.inf
    for entry, end in zip(timeline, bounds):
        placement = entry[1]
        index = np.flatnonzero((workload.arrival_s >= begin) & (workload.arrival_s < end))
        if len(index) and placement.groups:
            result = simulate(placement, entry[2] if len(entry) > 2 else profiles, workload.take(index), config)
            met[index] = result.status == SERVED
        begin = end
    return met


def through_rollouts(initial, rollouts: list[tuple], profiles, transition) -> list[tuple]:
    """The controller run's timeline as the controller predicts it: each re-placement from the moment its rollout
    began, step by step (`placement.alpaserve.transition.rollout_timeline`: what stays routed, loading slowdown)."""
    from placement.alpaserve.placement_rollout import SlotLayout
    from placement.alpaserve.transition import rollout_timeline, scaled_profiles

    loading = scaled_profiles(profiles, transition.loading_slowdown)
    timeline: list[tuple] = [(-np.inf, initial, profiles)]
    current = initial
    for begun, _, target, _, _ in rollouts:
        spans, _ = rollout_timeline(SlotLayout.from_placement(current, NUM_DEVICES), target, profiles, NUM_DEVICES,
                                    transition, horizon_s=0.0)
        timeline += [(begun + span.start_s, span.placement, loading if span.loading else profiles) for span in spans]
        current = target
    return timeline


def windowed(values: np.ndarray, arrival_s: np.ndarray, duration_s: float) -> tuple[np.ndarray, np.ndarray]:
    edges = np.arange(0.0, duration_s + TIMELINE_BIN_S, TIMELINE_BIN_S)
    idx = np.digitize(arrival_s, edges) - 1
    means = np.array([values[idx == k].mean() if np.any(idx == k) else np.nan for k in range(len(edges) - 1)])
    return edges[:-1] + TIMELINE_BIN_S / 2, means


def plot(path: Path, workload, runs: dict[str, np.ndarray], changes: list[float], duration_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    edges = np.arange(0.0, duration_s + TIMELINE_BIN_S, TIMELINE_BIN_S)
    for m, name in enumerate(workload.model_names):
        counts, _ = np.histogram(workload.arrival_s[workload.model == m], bins=edges)
        top.plot(edges[:-1] + TIMELINE_BIN_S / 2, counts / TIMELINE_BIN_S, label=name)
    top.set_ylabel("requests/s")
    top.legend()
    for label, met in runs.items():
        x, y = windowed(met.astype(float), workload.arrival_s, duration_s)
        bottom.plot(x, y, label=label, linestyle="--" if "sim" in label else "-")
    for t in changes:
        for axis in (top, bottom):
            axis.axvline(t, color="grey", linestyle=":")
    bottom.set_ylabel(f"SLO attainment per {TIMELINE_BIN_S:.0f} s")
    bottom.set_xlabel("trace time (s); dotted: re-placement applied")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path)
    log.info("wrote %s", path)


async def saturate(handle, capacity_per_s: float) -> dict[str, int]:
    """A burst at SATURATION_FACTOR x capacity spread over the models: count accepted, rejected, failed."""
    from ray.serve.exceptions import BackPressureError

    counts = {"accepted": 0, "rejected": 0, "failed": 0}

    async def one(model: str) -> None:
        try:
            await handle.embed.remote(model, [TEXT])
            counts["accepted"] += 1
        except BackPressureError:
            counts["rejected"] += 1
        except Exception as error:  # noqa: BLE001
            counts["rejected" if getattr(error, "status_code", None) == 503 else "failed"] += 1

    rate = SATURATION_FACTOR * capacity_per_s
    tasks = []
    for k in range(int(rate * SATURATION_S)):
        tasks.append(asyncio.ensure_future(one(MODELS[k % len(MODELS)])))
        await asyncio.sleep(1.0 / rate)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    log.info("saturation at %.0f requests/s: %s", rate, counts)
    return counts


async def steady_replacement(handle, controller, capacity_per_s: float, seed: int) -> dict:
    """Step 6: p99 latency of a model whose group does not change, before and during a re-placement that loads a
    model into the other group, under steady Poisson load; with the requests that failed after being accepted."""
    from ray.serve.exceptions import BackPressureError

    before = {"groups": [one_device_group(["minilm-a"]), one_device_group(["minilm-b"])]}
    after = {"groups": [one_device_group(["minilm-a"]), one_device_group(["minilm-b", "minilm-c"])]}
    await controller.apply_placement.remote(before, "benchmark steady phase")
    rng = np.random.default_rng(seed)
    records: list[tuple[str, float, float | None, str]] = []  # model, sent (perf_counter), latency, outcome
    stop = asyncio.Event()

    async def one(model: str) -> None:
        sent = time.perf_counter()
        try:
            await handle.embed.remote(model, [TEXT])
            records.append((model, sent, time.perf_counter() - sent, "ok"))
        except BackPressureError:
            records.append((model, sent, None, "rejected:back_pressure"))
        except Exception as error:  # noqa: BLE001 - sorted into rejected (503, with the reason) and failed
            rejected = getattr(error, "status_code", None) == 503
            records.append((model, sent, None,
                            f"rejected:{getattr(error, 'error_type', '?')}" if rejected else "failed"))

    async def traffic() -> None:
        rate, tasks = STEADY_LOAD_FACTOR * capacity_per_s, []
        while not stop.is_set():
            tasks.append(asyncio.ensure_future(one("minilm-a" if rng.random() < 0.5 else "minilm-b")))
            await asyncio.sleep(rng.exponential(1.0 / rate))
        await asyncio.gather(*tasks)

    sender = asyncio.ensure_future(traffic())
    await asyncio.sleep(STEADY_BEFORE_S)
    started = time.perf_counter()
    decision = await controller.apply_placement.remote(after, "benchmark steady phase")
    ended = time.perf_counter()
    await asyncio.sleep(STEADY_AFTER_S)
    stop.set()
    await sender
    rollout_s = ended - started
    baseline_from = started - max(rollout_s, STEADY_MIN_BASELINE_S)

    def p99(t0: float, t1: float) -> float:
        latencies = [lat for m, sent, lat, out in records if m == "minilm-a" and out == "ok" and t0 <= sent < t1]
        return float(np.percentile(latencies, 99)) if latencies else float("nan")

    before_p99, during_p99 = p99(baseline_from, started), p99(started, ended)
    outcomes = {k: sum(1 for r in records if r[3].split(":")[0] == k) for k in ("ok", "rejected", "failed")}
    by_model = {m: dict(Counter(r[3] for r in records if r[0] == m)) for m in ("minilm-a", "minilm-b")}
    log.info("steady re-placement (%s, %.1f s): minilm-a p99 %.0f ms before, %.0f ms during; %s", decision["outcome"],
             rollout_s, 1e3 * before_p99, 1e3 * during_p99, outcomes)
    return {"rollout_s": rollout_s, "unchanged_p99_before_ms": 1e3 * before_p99,
            "unchanged_p99_during_ms": 1e3 * during_p99,
            "unchanged_p99_ratio": during_p99 / before_p99, **outcomes, "outcomes_by_model": by_model}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def controller_trace(handle, controller, profiles, transition, overhead_s: float, slo_s: float, total_rate: float,
                           duration_s: float, period_s: float, memory_bytes: int, seed: int,
                           throughput_profiles=None) -> dict:
    """Steps 2-5 for one trace: plan for its first half, static run, controller run, both simulated."""
    from placement.alpaserve.planner import PlannerConfig, plan
    from placement.core.placement_plan import Placement

    trace = make_trace(total_rate, duration_s, slo_s, seed=seed)
    log.info("trace seed %d: %.0f requests/s over %.0f s (%d requests)", seed, total_rate, duration_s, len(trace))
    first_half = trace.window(0.0, duration_s / 2)
    initial = plan(MODELS, profiles, first_half, NUM_DEVICES, memory_bytes,
                   PlannerConfig(max_group_devices=1)).normalize()
    log.info("%s", initial.describe())
    initial_groups = {"groups": [g.model_dump(mode="json") for g in initial.groups]}
    await controller.pause.remote(True)
    await controller.apply_placement.remote(initial_groups, "benchmark reset")

    log.info("static run (controller paused), seed %d", seed)
    static = await replay(handle, trace, slo_s)

    log.info("controller run, seed %d", seed)
    await controller.apply_placement.remote(initial_groups, "benchmark reset")
    # The controller's window still holds the static run's last period (its c-heavy end): let it age out first.
    await asyncio.sleep(period_s)
    first_id = len(await controller.history.remote())
    await controller.pause.remote(False)
    dynamic = await replay(handle, trace, slo_s)
    await controller.pause.remote(True)
    decisions = (await controller.history.remote())[first_id:]
    applied = [d for d in decisions if d.get("outcome") == "applied"]
    timeline: list[tuple[float, Placement]] = [(-np.inf, initial)]
    changes, rollouts = [], []
    for d in applied:
        begun = d["time_s"] + d.get("planning_s", 0.0) - dynamic["start_wall"]
        at = d["time_s"] + d["duration_s"] - dynamic["start_wall"]
        target = Placement.model_validate({"groups": [one_device_group(g["models"]) for g in d["placement"]]})
        timeline.append((at, target))
        changes.append(at)
        chosen = next((c for c in d.get("candidates", []) if c["name"] == d.get("chosen")), None)
        rollouts.append((begun, at, target, chosen, d))
        log.info("re-placement (%s, trigger %s) applied at t=%.1f s (%.1f s to roll out): %s", d.get("chosen"),
                 d.get("trigger"), at, d["duration_s"], d["placement"])

    static_sim = simulate_piecewise([(-np.inf, initial)], profiles, trace, overhead_s)
    dynamic_sim = simulate_piecewise(timeline, profiles, trace, overhead_s)
    # For comparison: the profiles as this benchmark made them before calibration (scaled to the throughput probe).
    dynamic_sim_probe = (simulate_piecewise(timeline, throughput_profiles, trace, overhead_s)
                         if throughput_profiles is not None else None)
    scales = [d["service_scale"] for d in decisions if d.get("service_scale") is not None]
    # The transition model the controller was given (measured step time, stand-in slowdown) predicts here too.
    dynamic_through = simulate_piecewise(through_rollouts(initial, rollouts, profiles, transition), profiles, trace,
                                         overhead_s)
    # Transition cost, predicted: the chosen candidate's horizon loss (as deployed minus through its rollout) per
    # request of the rollout span; real: the attainment the target would have had over the rollout span's requests
    # (simulated as deployed) minus what the live system reached on them.
    predicted_costs, real_costs = [], []
    for begun, at, target, chosen, d in rollouts:
        if chosen is not None and chosen.get("transition_s"):
            predicted_costs.append((chosen["predicted_attainment"] - chosen["through_rollout_attainment"])
                                   * d.get("horizon_s", 2 * period_s) / chosen["transition_s"])
        span = np.flatnonzero((trace.arrival_s >= begun) & (trace.arrival_s < at))
        if len(span):
            deployed = simulate_piecewise([(-np.inf, target)], profiles, trace.take(span), overhead_s)
            real_costs.append(float(deployed.mean() - dynamic["met"][span].mean()))
    shift_s = duration_s / 2
    after_shift = [t for t in changes if t >= shift_s]
    second = trace.arrival_s >= shift_s
    return {
        "seed": seed, "requests": len(trace), "trace": trace, "initial": initial, "static": static, "dynamic": dynamic,
        "static_sim": static_sim, "dynamic_sim": dynamic_sim, "dynamic_through": dynamic_through, "changes": changes,
        "attainment_sim_through_rollout": float(dynamic_through.mean()),
        "abs_gap_through_rollout": abs(float(dynamic["met"].mean()) - float(dynamic_through.mean())),
        "attainment_real": float(dynamic["met"].mean()), "attainment_sim": float(dynamic_sim.mean()),
        "abs_gap": abs(float(dynamic["met"].mean()) - float(dynamic_sim.mean())),
        "attainment_sim_throughput_scaled": (float(dynamic_sim_probe.mean()) if dynamic_sim_probe is not None
                                             else None),
        "controller_service_scale": scales,
        "static_attainment_real": float(static["met"].mean()), "static_attainment_sim": float(static_sim.mean()),
        "static_abs_gap": abs(float(static["met"].mean()) - float(static_sim.mean())),
        "second_half_attainment_real": float(dynamic["met"][second].mean()),
        "static_second_half_attainment_real": float(static["met"][second].mean()),
        "controller_gain_real": float(dynamic["met"][second].mean() - static["met"][second].mean()),
        "controller_gain_sim": float(dynamic_sim[second].mean() - static_sim[second].mean()),
        "transition_cost_predicted": float(np.mean(predicted_costs)) if predicted_costs else None,
        "transition_cost_real": float(np.mean(real_costs)) if real_costs else None,
        "reaction_s": (after_shift[0] - shift_s) if after_shift else None,
        "decisions": [{"trigger": d.get("trigger"), "chosen": d.get("chosen"),
                       "in_sample_choice": d.get("in_sample_choice"),
                       "outcome": d.get("outcome"), "at_s": round(d["time_s"] - dynamic["start_wall"], 1),
                       "reason": d.get("reason")} for d in decisions],
        "replacements": [{"at_s": round(t, 1), "groups": d["placement"], "rollout_s": round(d["duration_s"], 1),
                          "chosen": d.get("chosen"), "trigger": d.get("trigger")} for t, d in zip(changes, applied)],
        "rejected_during_replay": int((static["outcome"] == 1).sum() + (dynamic["outcome"] == 1).sum()),
        "failed_during_replay": int((static["outcome"] == 2).sum() + (dynamic["outcome"] == 2).sum()),
    }


async def run(args) -> dict:
    from ray import serve

    from placement.alpaserve.planner import PlannerConfig, plan
    from placement.core.transition_costs import TransitionModel

    http_options = {"host": "127.0.0.1", "port": free_port()}
    serve.start(http_options=http_options)
    duration_s = args.duration_s or (75.0 if args.quick else 300.0)
    period_s = args.period_s or (10.0 if args.quick else 20.0)

    log.info("1/7 profiling: every model on both devices")
    everywhere = {"groups": [one_device_group(MODELS), one_device_group(MODELS)]}
    profiling_spec = spec_dict(everywhere, None, slo_ms=PROFILING_SLO_MS, period_s=period_s,
                               memory_bytes=16 * 1024**3)
    deploy(profiling_spec, http_options)
    handle = serve.get_app_handle("plexserve")
    lone_s, overhead_s = await profile_live(handle)
    throughput = await measure_throughput(handle, THROUGHPUT_PROBE_S, THROUGHPUT_CONCURRENCY)
    # Per-request device time at full load: the devices' share of the measured throughput, split by lone-time ratios.
    # It sets the SLO and the offered load (as in earlier runs); the simulator's service times are calibrated below.
    scale = (NUM_DEVICES / throughput) / float(np.mean(list(lone_s.values())))
    probe_s = {m: s * max(scale, 1.0) for m, s in lone_s.items()}
    log.info("throughput with every device busy: %.1f requests/s; per-request device time x%.2f of a lone request",
             throughput, scale)
    slo_s = SLO_SCALE * (max(probe_s.values()) + overhead_s)
    capacity = throughput
    total_rate = LOAD_FACTOR * capacity
    log.info("SLO %.0f ms, capacity %.0f/s, offered %.0f requests/s", 1e3 * slo_s, capacity, total_rate)
    load_s, weight_bytes = measure_load_s()
    log.info("loading one model's weights: %.2f s (%d bytes)", load_s, weight_bytes)
    calibration = await calibration_replay(handle, measured_profiles(lone_s, weight_bytes, load_s), overhead_s,
                                           total_rate, seed=args.seed + CALIBRATION_SEED_OFFSET)
    service_s = {m: s * calibration.scale for m, s in lone_s.items()}
    step_s = await measure_step_s(profiling_spec, load_s)
    transition = TransitionModel(step_overhead_s=step_s)
    memory_bytes = int(MODELS_PER_DEVICE_MEMORY * weight_bytes)
    profiles = measured_profiles(service_s, weight_bytes, load_s)
    throughput_profiles = measured_profiles(probe_s, weight_bytes, load_s)
    folder = Path(tempfile.mkdtemp(prefix="plexserve-fidelity-"))
    profiles.save(folder / "profiles.json")

    log.info("2/7 deploying, controller on (paused between runs)")
    first = make_trace(total_rate, duration_s, slo_s, seed=args.seed).window(0.0, duration_s / 2)
    initial = plan(MODELS, profiles, first, NUM_DEVICES, memory_bytes, PlannerConfig(max_group_devices=1)).normalize()
    initial_groups = {"groups": [g.model_dump(mode="json") for g in initial.groups]}
    deploy(spec_dict(initial_groups, str(folder / "profiles.json"), 1e3 * slo_s, period_s, memory_bytes, step_s),
           http_options)
    handle = serve.get_app_handle("plexserve")
    controller = serve.get_deployment_handle("PlacementController", app_name="plexserve")
    await controller.pause.remote(True)
    for model in MODELS:
        await handle.embed.remote(model, [TEXT])

    log.info("3-5/7 %d traces (static run, controller run, both simulated)", NUM_TRACES)
    traces = [await controller_trace(handle, controller, profiles, transition, overhead_s, slo_s, total_rate,
                                     duration_s, period_s, memory_bytes, seed=args.seed + k,
                                     throughput_profiles=throughput_profiles) for k in range(NUM_TRACES)]

    log.info("6/7 re-placement under steady load")
    steady = await steady_replacement(handle, controller, capacity, seed=args.seed)

    log.info("7/7 load past saturation")
    await controller.apply_placement.remote(initial_groups, "benchmark reset")
    burst = await saturate(handle, capacity)

    last = traces[0]
    plot(out_dir() / "fidelity.png", last["trace"],
         {"controller (real)": last["dynamic"]["met"], "controller (sim)": last["dynamic_sim"],
          "controller (sim through rollouts)": last["dynamic_through"],
          "static (real)": last["static"]["met"],
          "static (sim)": last["static_sim"]},
         last["changes"], duration_s)
    failed_accepted = int(sum(t["failed_during_replay"] for t in traces) + burst["failed"] + steady["failed"])
    per_trace = [{k: v for k, v in t.items()
                  if k not in ("trace", "initial", "static", "dynamic", "static_sim", "dynamic_sim", "dynamic_through",
                               "changes")}
                 for t in traces]
    gains = [t["controller_gain_real"] for t in traces]
    present = lambda key: [t[key] for t in traces if t[key] is not None]  # noqa: E731
    figures = {
        "controller_gain_real_min": min(gains), "controller_gain_real_mean": float(np.mean(gains)),
        "abs_gap_max": max(t["abs_gap"] for t in traces),
        "abs_gap_through_rollout_max": max(t["abs_gap_through_rollout"] for t in traces),
        "static_abs_gap_max": max(t["static_abs_gap"] for t in traces),
        "transition_cost_predicted": (float(np.mean(present("transition_cost_predicted")))
                                      if present("transition_cost_predicted") else None),
        "transition_cost_real": (float(np.mean(present("transition_cost_real"))) if present("transition_cost_real")
                                 else None),
        "reaction_s": float(np.mean(present("reaction_s"))) if present("reaction_s") else None,
        "attainment_real": float(np.mean([t["attainment_real"] for t in traces])),
        "attainment_sim": float(np.mean([t["attainment_sim"] for t in traces])),
        "traces": per_trace,
        "failed_accepted": failed_accepted, "saturation": burst,
        "unchanged_p99_ratio": steady["unchanged_p99_ratio"], "steady_replacement": steady,
        "slo_ms": 1e3 * slo_s, "service_ms": {m: 1e3 * s for m, s in service_s.items()},
        "lone_service_ms": {m: 1e3 * s for m, s in lone_s.items()},
        "throughput_scaled_service_ms": {m: 1e3 * s for m, s in probe_s.items()},
        "calibration": calibration.to_json(),
        "attainment_sim_throughput_scaled": float(np.mean([t["attainment_sim_throughput_scaled"] for t in traces])),
        "abs_gap_max_throughput_scaled": max(abs(t["attainment_real"] - t["attainment_sim_throughput_scaled"])
                                             for t in traces),
        "load_s": load_s, "step_overhead_s": step_s, "throughput_per_s": throughput,
        "ingress_overhead_ms": 1e3 * overhead_s,
        "duration_s": duration_s, "period_s": period_s, "machine": machine_description(),
    }
    return figures


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--duration-s", type=float, default=None, help="trace length (default 75 s quick, 300 s full)")
    parser.add_argument("--period-s", type=float, default=None,
                        help="controller period (default 10 s quick, 20 s full)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=RAY_NUM_CPUS, resources={DEVICE_RESOURCE: NUM_DEVICES}, include_dashboard=False,
             log_to_driver=False)
    try:
        figures = asyncio.run(run(args))
    finally:
        serve.shutdown()
        ray.shutdown()
    emit_json(figures)


if __name__ == "__main__":
    main()
