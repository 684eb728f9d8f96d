"""Fidelity and load: the live system against the simulator on one trace whose popularity shifts halfway.

On this machine (2 logical devices on 2 shared cores, a stand-in for a GPU cluster), three text models with
MiniLM's real weights (minilm-a, -b, -c) serve a Gamma trace whose popularity moves from minilm-a to minilm-c at
half time. Each request embeds a batch of passages, so that its model compute outweighs Serve's per-request overhead
(as on a GPU cluster) and a model hosted on one device is bounded by that device. Steps, side by side in one run:

1. **Measure profiles** on the live system: one deployment hosting every model on both devices; lone requests through
   the ingress and straight to a group replica, the models in turn, give each model's service time and the ingress
   overhead; timed rollout steps give each model's load time into running stage actors (a swap), the seconds to start
   new actors (an added model), the step's other seconds and how much slower the other group serves meanwhile (the
   controller prices rollouts with them); one device's closed-loop throughput with the other idle and at full load
   gives the host contention (the simulator's `host_contention_per_busy_device`: both devices share two cores). A
   closed-loop probe with every device busy sets the capacity, hence the offered load and the SLO. The lone
   requests and that probe's also give, from each answer's `ingress_latency_ms`, the part of a request's latency
   that the ingress's records do not hold (the way back to this driver: its requests carry their send time, so the
   way there counts; `answered`): the simulator's request overhead is the lone requests' overhead with that way as
   long as under load, and the controller's refits leave the way under load out
   (`controller.calibration.client_round_trip_ms`).
2. **Deploy** the application with the placement the planner picks for the first half and the controller on (its
   profiles: the lone-request times, which it recalibrates online from the ingress's records every decision).
   **Calibration**: a trace of its own seed (never scored) replayed on that deployment; the lone-request times are
   scaled by the factor at which the simulator reproduces the replay's SLO attainment
   (`placement/alpaserve/service_calibration.py`, the fit the controller repeats online).
3. **Static run**: the controller paused; the trace replayed through the ingress (Python handle API).
4. **Controller run**: the placement reset; a warm-up (`WARMUP_S` of traffic at the opening shares, its own seed,
   the controller paused, not scored) so that it starts as the static run does; then the controller on (period
   `--period-s`) and the same trace replayed.
5. **Simulate** both runs on the same requests. The controller run piecewise through its rollouts: the placement in
   force until each re-placement began, then each rollout step's routes, with the loading slowdown while a step
   loads (`placement.alpaserve.transition`, the transition model the controller prices moves with), then the new
   placement; each span with the controller's service-time factor in force (fitted on the records before it: the
   simulator as the controller recalibrates it online; `abs_gap`). For comparison: the same with each re-placement
   switched in at once when it finished (`abs_gap_at_rollout_end`), with the offline calibration alone
   (`abs_gap_offline`, also switched at the end) and with the profiles scaled to the throughput probe
   (`attainment_sim_throughput_scaled`). The static run with the offline calibration.
6. **Re-placement under steady load**: Poisson traffic to minilm-a (alone on its group) and minilm-b while an
   operator re-placement loads minilm-c beside minilm-b; the p99 latency of minilm-a, whose group does not change,
   during the rollout against the same span just before it (issue target: within 20%).
7. **Load past saturation**: a burst at several times the capacity; accepted, rejected (503) and failed counts.

Steps 3-5 run on NUM_TRACES (3) traces with different seeds in one run. Final JSON line: controller_gain_real_min
and controller_gain_real_mean (controller run minus static run, second half, per trace), abs_gap_max (controller
run, real vs simulated through its rollouts), transition_cost_predicted and transition_cost_real (attainment lost
per request while a rollout runs: the decision's prediction vs the live run against the target simulated as
deployed), reaction_s (the shift at half time to the first re-placement applied after it), real_repeat_diff_max_abs
(the live system's own repeatability: controller run minus static run, real, on the requests before the first
re-placement began, where trace and placement are the same) and real_repeat_speed_ratio_range (on the same
requests, the controller run's 10th-percentile latency over the static run's, per trace: the machine's speed in one
replay against the other), failed_accepted, unchanged_p99_ratio (step 6),
host_contention_probe (step 1's throughputs and the host's busy CPU share with one and with both devices at full load),
client_round_trip_ms (the way back from the ingress to this driver, the requests' latency less the ingress's: median
lone, mean at full load and during step 2's replay at the traces' load) and request_overhead_ms (the simulator's),
send_lag_p99_ms_max (how late this driver sent requests against the trace's times, worst p99 of the replays), and per
trace its figures (among them host_cpu_busy_share: the host's busy CPU share in each half of the static run, and in
the controller run before the shift and after its move; device_time: per group in the same stretches, the share of the
time its engines ran a batch, requests per batch, device ms per request and ms a request waited in the group's engine,
from the engines' totals read every CPU_READING_S), decisions and re-placements. A PNG timeline (rate per model,
attainment per window, real and simulated through the rollouts, re-placements) goes to benchmarks/out/fidelity.png,
every replayed request with the placements and factors in force to benchmarks/out/fidelity_records.json (to score
other simulator settings offline).

    python benchmarks/fidelity.py --quick
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from benchmarks._common import emit_json, machine_description, make_parser, out_dir, setup_logging  # noqa: E402

if TYPE_CHECKING:
    from placement.alpaserve.service_calibration import ServiceCalibration
    from placement.alpaserve.simulator import SimulatorConfig
    from placement.core.transition_costs import TransitionModel

MODELS = ["minilm-a", "minilm-b", "minilm-c"]
DEVICE_RESOURCE = "plex_device"
NUM_DEVICES = 2
#: Logical CPUs declared to Ray (fractional replicas on 2 physical cores).
RAY_NUM_CPUS = 8
#: The request every client sends: a batch of passages to embed (as an indexing client sends them), so that a
#: request's model compute outweighs Serve's per-request overhead, as on a GPU cluster: one device's thread then
#: bounds a model hosted on one device, and where models are placed decides what they can serve.
TEXTS = [f"passage {k}: plexserve keeps a running deployment matched to its traffic; when the popularity of its "
         f"models shifts, the controller prices every candidate move through its rollout before it acts"
         for k in range(8)]
#: Calibration replay (step 2): seconds of its trace, and the seed offset that keeps it apart from the scored traces.
CALIBRATION_S = 25.0
CALIBRATION_SEED_OFFSET = 1000
#: Warm-up before each controller run (controller paused, never scored): seconds of traffic at the trace's opening
#: shares, and the seed offset of that traffic. The static run follows the previous trace's controller run, whose
#: end keeps both devices busy as the trace's opening does; the controller run would follow the static run's end, one
#: device saturated and the other nearly idle, and its service-time refit (a window of
#: `ServiceCalibrationSettings.window_s`, 30 s) would carry that end into its first half. The warm-up gives both runs
#: the same kind of start. Its own seed: the refit must not see the scored requests before they are scored.
WARMUP_S = 20.0
WARMUP_SEED_OFFSET = 2000
#: Percentile of the answered requests' latencies taken as the machine's speed in a run (`real_repeat_speed_ratio`).
REPEAT_SPEED_PERCENTILE = 10
#: SLO of the profiling deployment, ms: nothing is refused there, so the profiles see every request's latency.
PROFILING_SLO_MS = 10_000.0
#: Lone requests per model when profiling (the median is kept).
PROFILE_REQUESTS = 20
#: Batch sizes (requests) whose service time is profiled, and calls timed per size (the median is kept).
PROFILED_BATCHES = (2, 4)
PROFILE_BATCH_REQUESTS = 8
#: Most requests the simulated engine batches: the group's text engine packs a batch of 8 rows of 256 tokens
#: (TCB's default rows, MiniLM's input limit), which holds six of these requests' passages; beyond the profiled
#: sizes the simulator extrapolates the last slope.
MAX_BATCH_REQUESTS = 6
#: Loading slowdown under load: closed-loop clients that keep both devices busy, seconds of their throughput timed
#: before any load, and the swaps timed meanwhile (back and forth, each reloading the leaving model's actors).
LOADED_CLIENTS = 8
LOADED_BASELINE_S = 3.0
LOADED_SWAPS = 3
#: Host-contention probe: seconds of each closed-loop phase (one device at full load, then both), rounds of the two
#: phases (alternated, so that a drift of the VM's speed falls on both), and requests in flight per busy device.
CONTENTION_PHASE_S = 2.5
CONTENTION_ROUNDS = 2
CONTENTION_LOAD = 2
#: Decisions the controller's log keeps (`controller.history_size`): well above what a full run's controller run takes.
HISTORY_SIZE = 1000
#: Repeated traces (different seeds) in one run.
NUM_TRACES = 3
#: Seconds and concurrent clients of the closed-loop throughput probe.
THROUGHPUT_PROBE_S = 10.0
THROUGHPUT_CONCURRENCY = 8
#: SLO = this many times the slowest model's profiled latency (AlpaServe §6.2 "SLO scale").
SLO_SCALE = 4.0
#: Offered load as a share of the measured throughput with every device busy.
LOAD_FACTOR = 0.75
#: Device memory in model weights: each device holds two of the three models, so the placement matters.
MODELS_PER_DEVICE_MEMORY = 2.2
#: Inter-arrival CV of the Gamma processes (bursty, as in AlpaServe §6.2).
TRACE_CV = 2.0
#: Popularity of the models before and after the shift.
SHARES_BEFORE = (0.75, 0.15, 0.1)
SHARES_AFTER = (0.1, 0.15, 0.75)
#: Load phase: offered rate as a multiple of capacity, and its length in seconds (short, to keep --quick short).
SATURATION_FACTOR = 4.0
SATURATION_S = 6.0
#: Seconds between the host CPU readings of a replay (its progress reports).
CPU_READING_S = 10.0
#: Width of the attainment windows in the timeline, seconds.
TIMELINE_BIN_S = 5.0
#: Steady re-placement phase: offered rate as a share of capacity (split over minilm-a and minilm-b), seconds of
#: traffic before the rollout (the phase's own placement settles, then the p99 baseline) and after it.
STEADY_LOAD_FACTOR = 0.4
STEADY_BEFORE_S = 20.0
STEADY_AFTER_S = 3.0
#: Shortest span before the rollout that the p99 baseline covers, seconds.
STEADY_MIN_BASELINE_S = 10.0

log = setup_logging("fidelity")


def model_weight_bytes() -> int:
    """Bytes of one model's weights (every model here is MiniLM)."""
    from models.text_encoder import load_text_encoder

    return load_text_encoder().weight_bytes()


async def measure_transition(spec: dict) -> tuple[float, TransitionModel]:
    """What a rollout step costs, measured on the profiling deployment (every model on both devices) as the
    controller runs a step: the seconds of a step besides loading (`step_overhead_s`: two ingress-only applies,
    routing before and after the change), the seconds to start a model's stage actor processes (`actor_start_s`: a
    model added with none leaving, minus an unloaded swap), and, with both devices kept busy by closed-loop clients
    (the controller moves when traffic is high), the seconds to load a model's weights into a running group's stage
    actors (`load_s`, kept with the profiles: a swap, whose arriving model reloads the leaving model's actors, from
    its apply until the group reports the new version: the step's slot change, which the controller times as its
    loading span) and the loading slowdown: the share of the clients' answers the swaps lost against the throughput
    just before them, charged to that span as the transition model charges it (`loading_slowdown`). Lone requests
    beside an idle group understate it: loading and serving then have a core each. A step is priced as two
    routes (`step_overhead_s`) around the slot change (`load_s`), the three applies it runs: priced one route short,
    it would charge the answers a route loses to a loading span barely longer than a route, and inflate the
    slowdown."""
    from ray import serve

    from placement.alpaserve.placement_rollout import SlotLayout
    from placement.alpaserve.transition_calibration import MAX_LOADING_SLOWDOWN  # reported at most: the refit's bound
    from placement.core.deployment_spec import parse_spec
    from placement.core.placement_plan import Placement
    from placement.core.transition_costs import TransitionModel
    from rayserve_apps.contracts import INGRESS_DEPLOYMENT, group_deployment_name
    from rayserve_apps.control.live_update import apply_overrides, layout_overrides

    parsed = parse_spec(spec)
    ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name="plexserve")
    loading_group = serve.get_deployment_handle(group_deployment_name(1), app_name="plexserve")
    versions = {"ingress": 0, "group": 0, "models": None}

    async def apply(groups: list[list[str]]) -> tuple[float, float]:
        """Apply a placement (group 0 keeps every model; group 1's version moves only when its models change, else
        the apply re-routes the ingress alone); its (start, end) on perf_counter."""
        versions["ingress"] += 1
        if groups[1] != versions["models"]:
            versions["group"] += 1
            versions["models"] = groups[1]
        layout = SlotLayout.from_placement(Placement.model_validate({"groups": [one_device_group(g) for g in groups]}),
                                           len(groups))
        started = time.perf_counter()
        await asyncio.to_thread(apply_overrides, "plexserve", layout_overrides(
            parsed, layout, layout.routes(), [1, versions["group"]], versions["ingress"]))
        while (await ingress.placement_version.remote() < versions["ingress"]
               or (await loading_group.info.remote())["placement_version"] < versions["group"]):
            await asyncio.sleep(0.1)
        return started, time.perf_counter()

    def seconds(span: tuple[float, float]) -> float:
        return span[1] - span[0]

    a, b, c = MODELS
    await apply([MODELS, [a, b]])  # minilm-c leaves group 1
    swap_step_s = seconds(await apply([MODELS, [a, c]]))  # a swap: c reloads b's stage actors
    add_step_s = seconds(await apply([MODELS, MODELS]))  # b arrives with none leaving: new actor processes
    route_s = seconds(await apply([MODELS, MODELS]))  # the ingress alone
    await apply([MODELS, [a, b]])

    # Under load: the clients' answers (perf_counter at each) through the baseline and the swaps.
    answered: list[float] = []
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            await ingress.embed.remote(a, TEXTS)  # minilm-a stays on both groups through every swap
            answered.append(time.perf_counter())

    clients = [asyncio.ensure_future(client()) for _ in range(LOADED_CLIENTS)]
    await asyncio.sleep(1.0)  # the clients' first answers (queues filled)
    baseline = (time.perf_counter(), time.perf_counter() + LOADED_BASELINE_S)
    await asyncio.sleep(LOADED_BASELINE_S)
    swaps = [await apply([MODELS, [a, c] if k % 2 == 0 else [a, b]]) for k in range(LOADED_SWAPS)]
    stop.set()
    await asyncio.gather(*clients)

    def answers(span: tuple[float, float]) -> int:
        return sum(span[0] <= t < span[1] for t in answered)

    throughput = answers(baseline) / seconds(baseline)
    load_s = float(np.median([seconds(span) for span in swaps]))
    # The model's step: two routes at full speed around the slot change, which loads at 1/slowdown for `load_s`. The
    # answers the swaps lost against the baseline all go to the slot change (its Serve update's own cost included).
    lost = sum(throughput * seconds(span) - answers(span) for span in swaps) / len(swaps)
    kept = 1.0 - lost / (throughput * load_s) if throughput > 0 and load_s > 0 else 1.0
    slowdown = min(max(1.0 / kept, 1.0), MAX_LOADING_SLOWDOWN) if kept > 0 else MAX_LOADING_SLOWDOWN
    transition = TransitionModel(step_overhead_s=2 * route_s, actor_start_s=max(add_step_s - swap_step_s, 0.0),
                                 loading_slowdown=slowdown)
    log.info("rollout step: %.1f s to re-route; %.1f s to load a model's weights into a running group's actors, "
             "its Serve update included (%.1f s with the devices idle), %.1f s to start its actors first; with every "
             "device busy (%.1f answers/s before the swaps) a load loses %.1f answers: serving %.2fx slower while it "
             "loads", route_s, load_s, swap_step_s, transition.actor_start_s, throughput, lost, slowdown)
    return load_s, transition


def spec_dict(placement: dict | None, profiles_path: str | None, slo_ms: float, period_s: float, memory_bytes: int,
              transition: TransitionModel | None = None, simulated: SimulatorConfig | None = None,
              client_round_trip_s: float = 0.0) -> dict:
    """The application's spec; with `profiles_path`, the controller on, simulating the system as this benchmark does
    (`simulated`, from `sim_config`: batches of up to MAX_BATCH_REQUESTS, the request overhead as this driver sees it,
    host contention), its refits leaving out `client_round_trip_s` of that overhead (the ingress's records do not
    hold it)."""
    spec: dict = {
        "cluster": {"num_devices": NUM_DEVICES, "device_resource": DEVICE_RESOURCE,
                    "device_memory_bytes": memory_bytes},
        "models": [{"name": m, "kind": "text", "source": "package:all-minilm-l6-v2", "slo_ms": slo_ms,
                    "num_cpus_per_replica": 0.5, "max_queued_requests": 64} for m in MODELS],
        "placement": placement,
    }
    if profiles_path is not None:
        simulated = simulated or sim_config(0.0)
        spec["planning"] = {"profiles": {"path": profiles_path}, "planner": {"max_group_devices": 1},
                            "simulation": {"max_batch_size": MAX_BATCH_REQUESTS,
                                           "request_overhead_ms": 1e3 * simulated.request_overhead_s,
                                           "host_contention_per_busy_device":
                                               simulated.host_contention_per_busy_device}}
        spec["controller"] = {"period_s": period_s, "fit_window_s": period_s, "min_gain": 0.02,
                              "history_size": HISTORY_SIZE,
                              "calibration": {"client_round_trip_ms": 1e3 * client_round_trip_s}}
        if transition is not None:
            spec["controller"]["transition"] = transition.model_dump()
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


async def answered(handle, model: str) -> tuple[float, float]:
    """Send `model` an `embed` of TEXTS stamped with its send time (`sent_at_s`: the ingress's clock, its deadline and
    its records start there, the way to the ingress included); the seconds until the answer, and the part of them that
    the ingress did not count (the answer's `ingress_latency_ms`): the way back from the ingress replica to this driver
    (the client), the wait of this driver's event loop included, which the ingress's records do not hold
    (`rayserve_apps/ingress/request_clock.py`). The requests themselves are stamped, rather than a call that does no
    work timed apart: requests come in bursts, when both event loops are busiest, so under load a lone probe call's
    way there and back is well below the requests' own."""
    started = time.perf_counter()
    answer = await handle.embed.remote(model, TEXTS, sent_at_s=time.time())
    latency = time.perf_counter() - started
    return latency, latency - answer["ingress_latency_ms"] / 1e3


def token_ids_of_request() -> list[list[int]]:
    from models.text_encoder import load_text_tokenizer

    return load_text_tokenizer("package:all-minilm-l6-v2").encode(TEXTS)


def in_turn(models: list[str], k: int) -> list[str]:
    """The models in round `k` of an interleaved measurement: each once, the first rotating round by round."""
    return models[k % len(models):] + models[:k % len(models)]


@dataclass(frozen=True)
class LiveProfile:
    """What `profile_live` measures on lone requests."""

    service_s: dict[str, float]  # per model: median service time of one request straight to a group replica
    overhead_s: float  # median time a request spends outside the group: the ingress and the way to it and back
    batch_ratio: dict[int, float]  # per batch size: a batch's service time over one request's
    client_leg_s: float  # median way back from the ingress to this driver (`answered`)


async def profile_live(handle) -> LiveProfile:
    """Per model: median service time of one request straight to a group replica; the median ingress overhead, and
    of it the way back from the ingress to this driver (`answered`); and per batch size in PROFILED_BATCHES, a
    batch's service time over one request's (the engine batches the requests queued for a model: several requests'
    passages in one call, median over the models).

    The models' requests are interleaved (one of each in turn, the first rotating round by round), so that a drift
    of the VM's speed while profiling falls on every model alike. Measured one model after the other, the three
    copies of the same MiniLM would differ by the drift between their turns, and the controller's online refit, one
    factor for every model, keeps such a difference: its simulator would be slower than the live system wherever one
    model dominates and faster wherever another does."""
    from ray import serve

    token_ids = token_ids_of_request()
    group = serve.get_deployment_handle("group-0", app_name="plexserve")
    for model in MODELS:
        for _ in range(3):  # warm-up
            await handle.embed.remote(model, TEXTS)
    direct: dict[str, list[float]] = {m: [] for m in MODELS}
    through: dict[str, list[float]] = {m: [] for m in MODELS}
    legs: list[float] = []
    batched: dict[tuple[str, int], list[float]] = {(m, b): [] for m in MODELS for b in PROFILED_BATCHES}
    for k in range(PROFILE_REQUESTS):
        for model in in_turn(MODELS, k):
            direct[model].append(await timed(group.embed_token_ids.remote(model, token_ids)))
            latency, leg = await answered(handle, model)
            through[model].append(latency)
            legs.append(leg)
    for k in range(PROFILE_BATCH_REQUESTS):
        for model in in_turn(MODELS, k):
            for b in PROFILED_BATCHES:
                batched[model, b].append(await timed(group.embed_token_ids.remote(model, token_ids * b)))
    service = {m: float(np.median(direct[m])) for m in MODELS}
    overhead = [float(np.median(through[m])) - service[m] for m in MODELS]
    ratios = {b: [float(np.median(batched[m, b])) / service[m] for m in MODELS] for b in PROFILED_BATCHES}
    for k, model in enumerate(MODELS):
        log.info("profile %s: %.1f ms in the group, %.1f ms through the ingress; batches of %s: x%s", model,
                 1e3 * service[model], 1e3 * np.median(through[model]), list(PROFILED_BATCHES),
                 [round(ratios[b][k], 2) for b in PROFILED_BATCHES])
    batch_ratio = {1: 1.0, **{b: float(np.median(r)) for b, r in ratios.items()}}
    return LiveProfile(service, max(0.0, float(np.median(overhead))), batch_ratio, float(np.median(legs)))


def host_cpu_times() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole host since boot, from /proc/stat (None where there is none): the share
    busy between two readings says whether the host's cores ran out."""
    try:
        with open("/proc/stat") as stat:
            # user nice system idle iowait irq softirq steal (guest time is counted in user and nice again)
            fields = [float(v) for v in stat.readline().split()[1:9]]
    except OSError:
        return None
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def host_cpu_busy_share(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Share of the host's CPU time busy between two `host_cpu_times()` readings (1.0: every core busy)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


async def measure_host_contention() -> tuple[float, dict]:
    """The simulator's `host_contention_per_busy_device`, measured at full load on the profiling deployment (every
    model on both devices): requests straight to group 1 (CONTENTION_LOAD in flight, closed loop) answered per second
    with group 0 idle against with group 0 at full load too, alternated CONTENTION_ROUNDS times; the ratio minus one.
    Also the host's CPU share busy in each phase. The two devices are shares of the same two cores, which the ingress
    and this driver use too; on a GPU cluster the figure would be 0. Closed loops, rather than lone requests timed
    beside others in flight, keep the figure steady from run to run."""
    token_ids = token_ids_of_request()
    groups = group_handles()

    async def closed_loop(busy_groups: list[int]) -> tuple[float, float | None]:
        """Group 1's answers per second with `busy_groups` at full load; the host's busy CPU share meanwhile."""
        done = 0
        stop = time.perf_counter() + CONTENTION_PHASE_S

        async def client(g: int) -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await groups[g].embed_token_ids.remote(MODELS[g], token_ids)
                done += g == 1

        cpu_before, started = host_cpu_times(), time.perf_counter()
        await asyncio.gather(*(client(g) for g in busy_groups for _ in range(CONTENTION_LOAD)))
        return done / (time.perf_counter() - started), host_cpu_busy_share(cpu_before, host_cpu_times())

    alone, beside = [], []
    for _ in range(CONTENTION_ROUNDS):
        alone.append(await closed_loop([1]))
        beside.append(await closed_loop([0, 1]))
    alone_per_s = float(np.mean([rate for rate, _ in alone]))
    beside_per_s = float(np.mean([rate for rate, _ in beside]))
    contention = max(0.0, alone_per_s / beside_per_s - 1.0)
    cpu = {"one_device_busy": mean_or_none([share for _, share in alone]),
           "both_devices_busy": mean_or_none([share for _, share in beside])}
    log.info("host contention: group 1 answers %.2f/s with group 0 idle, %.2f/s with it at full load (+%.2f per busy "
             "device); host CPU busy %s / %s", alone_per_s, beside_per_s, contention,
             cpu["one_device_busy"], cpu["both_devices_busy"])
    return contention, {"group_answers_per_s_alone": alone_per_s, "group_answers_per_s_beside_busy": beside_per_s,
                        "host_cpu_busy_share": cpu}


def mean_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


async def measure_throughput(handle, seconds: float, concurrency: int) -> tuple[float, float]:
    """Requests per second the whole system answers with every device busy (closed loop over all models), and the
    mean way back from the ingress to this driver of those requests (`answered`).

    The devices here are CPU shares of two cores that the ingress, the replicas and this driver share, so the
    system's throughput is below what lone-request service times promise; the profiles are scaled to it."""
    legs: list[float] = []
    stop = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        while time.perf_counter() < stop:
            _, leg = await answered(handle, MODELS[(k + len(legs)) % len(MODELS)])
            legs.append(leg)

    started = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return len(legs) / (time.perf_counter() - started), float(np.mean(legs))


def measured_profiles(service_s: dict[str, float], batch_ratio: dict[int, float], weight_bytes: int, load_s: float):
    """A `ProfileSet` (source 'measured') of one-device configurations: per model its service time per batch size
    (`service_s` times `batch_ratio`), weight bytes and load time."""
    from placement.core.profiles import ConfigProfile, ModelProfile, ParallelConfig, ProfileSet, StageProfile

    models = {m: ModelProfile(name=m, configs=[ConfigProfile(config=ParallelConfig(), load_s=load_s, stages=[
        StageProfile(latency_s={b: s * r for b, r in batch_ratio.items()}, weight_bytes_per_device=weight_bytes)])])
        for m, s in service_s.items()}
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


def group_handles() -> list:
    """Handles to the application's group replicas, one per device (every group here is one device)."""
    from ray import serve

    from rayserve_apps.contracts import group_deployment_name

    return [serve.get_deployment_handle(group_deployment_name(g), app_name="plexserve") for g in range(NUM_DEVICES)]


async def engine_totals(groups) -> dict[str, dict[str, dict]]:
    """Per group replica, per hosted model: what its engine has done since it started (batches, passages, the
    seconds its batches ran and its passages waited: `rayserve_apps.engine.engine.EngineTotals`)."""
    infos = await asyncio.gather(*(group.info.remote() for group in groups))
    return {info["group"]: info["engines"] for info in infos}


def device_time_between(run: dict, start_s: float, end_s: float) -> dict[str, dict[str, float]] | None:
    """Per group, over a replay's engine readings from the first at or after `start_s` to the last at or before
    `end_s`: the share of the time its engines ran a batch, the requests per batch, the device milliseconds per
    request (a request is len(TEXTS) passages) and the milliseconds a request waited in the group's engine for its
    batch to start. Models whose engine started in between (a move) are left out (a group with none left: None
    throughout). None with fewer than two readings."""
    inside = [(at, totals) for at, totals in run.get("engine_readings", []) if start_s <= at <= end_s]
    if len(inside) < 2:
        return None
    (first_s, first), (last_s, last) = inside[0], inside[-1]
    out = {}
    for group, engines in last.items():
        before = first.get(group, {})
        kept = [(engines[m], before[m]) for m in engines
                if m in before and engines[m]["batches"] >= before[m]["batches"]]
        batches = sum(now["batches"] - then["batches"] for now, then in kept)
        requests = sum(now["items"] - then["items"] for now, then in kept) / len(TEXTS)
        busy_s = sum(now["busy_s"] - then["busy_s"] for now, then in kept)
        queued_s = sum(now["queued_s"] - then["queued_s"] for now, then in kept) / len(TEXTS)
        out[group] = {"busy_share": busy_s / (last_s - first_s) if kept else None,
                      "requests_per_batch": requests / batches if batches else None,
                      "device_ms_per_request": 1e3 * busy_s / requests if requests else None,
                      "engine_wait_ms_per_request": 1e3 * queued_s / requests if requests else None}
    return out


async def replay(handle, workload, slo_s: float, groups=None) -> dict[str, np.ndarray]:
    """Send every request at its arrival time; per request: latency (s, from its send, NaN if not answered), the
    part of it outside the ingress (`client_leg`, `answered`), outcome, and its send lag (s: how late this driver
    sent it against the trace's arrival time; the simulator replays the trace's times, so a lagging driver would
    smooth the bursts the live system sees). With `groups` (group replica handles), their engines' totals are read
    at every progress report (`engine_readings`)."""
    from ray.serve.exceptions import BackPressureError

    n = len(workload)
    latency = np.full(n, np.nan)
    client_leg = np.full(n, np.nan)
    send_lag = np.full(n, np.nan)
    outcome = np.zeros(n, dtype=np.int8)  # 0 ok, 1 rejected (503 / back pressure), 2 failed
    start = time.perf_counter()

    async def one(i: int) -> None:
        sent = time.perf_counter()
        send_lag[i] = sent - start - workload.arrival_s[i]
        try:
            latency[i], client_leg[i] = await answered(handle, workload.model_names[workload.model[i]])
        except BackPressureError:
            outcome[i] = 1
        except Exception as error:  # noqa: BLE001 - sorted into rejected (503) and failed
            outcome[i] = 1 if getattr(error, "status_code", None) == 503 or "503" in str(error)[:200] else 2
            if outcome[i] == 2:
                log.warning("request %d failed: %s", i, str(error)[:200])

    tasks = []
    next_report = 0.0
    cpu_readings = []  # (seconds into the trace, the host's CPU times then): its busy share per stretch
    engine_tasks = []  # (seconds into the trace, the groups' engine totals then, being read)

    def take_readings() -> None:
        at = time.perf_counter() - start
        cpu_readings.append((at, host_cpu_times()))
        if groups:  # not awaited here: the next request's send must not wait for the reading
            engine_tasks.append((at, asyncio.ensure_future(engine_totals(groups))))

    for i in range(n):
        delay = workload.arrival_s[i] - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
        if workload.arrival_s[i] >= next_report:
            log.info("replay: t=%.0f s, %d/%d requests sent", workload.arrival_s[i], i + 1, n)
            take_readings()
            next_report += CPU_READING_S
    await asyncio.gather(*tasks)
    take_readings()
    engine_readings = [(at, await task) for at, task in engine_tasks]
    met = (outcome == 0) & (latency <= slo_s)
    return {"latency": latency, "outcome": outcome, "met": met, "cpu_readings": cpu_readings, "send_lag": send_lag,
            "client_leg": client_leg,
            "engine_readings": engine_readings, "start_wall": time.time() - (time.perf_counter() - start)}


def send_lag_ms(run: dict) -> dict[str, float]:
    """Median, p99 and largest send lag of a replay, milliseconds."""
    lag = 1e3 * run["send_lag"]
    return {"p50": float(np.median(lag)), "p99": float(np.quantile(lag, 0.99)), "max": float(lag.max())}


def host_cpu_share_between(run: dict, start_s: float, end_s: float) -> float | None:
    """The host's busy CPU share over a replay's readings from the first at or after `start_s` to the last at or
    before `end_s` (None with fewer than two)."""
    inside = [cpu for at, cpu in run["cpu_readings"] if start_s <= at <= end_s]
    return host_cpu_busy_share(inside[0], inside[-1]) if len(inside) >= 2 else None


def sim_config(overhead_s: float, host_contention: float = 0.0) -> SimulatorConfig:
    """The simulated system of every simulation here (and of the controller, through the spec): shortest-queue
    dispatch with SLO admission, batches of up to MAX_BATCH_REQUESTS queued requests of a model, the measured ingress
    overhead and host contention."""
    from placement.alpaserve.batching import MaxBatchWithinSLO
    from placement.alpaserve.dispatch import make_dispatch
    from placement.alpaserve.simulator import SimulatorConfig

    return SimulatorConfig(dispatch=make_dispatch("shortest_queue"), batching=MaxBatchWithinSLO(MAX_BATCH_REQUESTS),
                           request_overhead_s=overhead_s, host_contention_per_busy_device=host_contention)


async def calibration_replay(handle, placement, lone_profiles, simulated: SimulatorConfig, total_rate: float,
                             slo_s: float, seed: int) -> tuple[ServiceCalibration, float]:
    """Step 2, service-time calibration: a trace of its own seed (never scored) replayed at the scored traces' rate
    and SLO on the deployed application (`placement`, the controller paused); the factor on the lone-request profiles
    at which the simulator reproduces the replay's SLO attainment, or its latency quantile if every SLO was met
    (`placement.alpaserve.service_calibration`, the fit the controller repeats online on the ingress's records), and
    the mean way back from the ingress to this driver of the replay's answered requests (`answered`)."""
    from placement.alpaserve.service_calibration import calibrate_service_scale

    trace = make_trace(total_rate, CALIBRATION_S, slo_s, seed=seed)
    replayed = await replay(handle, trace, slo_s)
    calibration = calibrate_service_scale(placement, lone_profiles, trace, replayed["latency"], simulated)
    if calibration is None:
        raise RuntimeError(f"calibration replay: too few answered requests ({np.isfinite(replayed['latency']).sum()})")
    log.info("calibration replay (%d requests, %d answered): attainment %.3f measured, %.3f simulated at x%.3f of the "
             "lone-request service times (fitted on the %s)", len(trace), calibration.answered,
             calibration.observed_attainment, calibration.simulated_attainment, calibration.scale,
             calibration.target.replace("_", " "))
    return calibration, float(np.nanmean(replayed["client_leg"]))


def simulate_piecewise(timeline: list[tuple], profiles, workload, config: SimulatorConfig) -> np.ndarray:
    """SLO met per request, simulating each span of the trace on the placement in force during it; an entry
    (start, placement, factor) simulates its span with the profiles' latencies times `factor` (the service-time
    factor in force, times the loading slowdown while a rollout step loads). A new placement starts with empty
    queues; a new factor on the same placement does not (the live system ran on): its span is simulated from the
    placement's first span on, and only its own requests are scored."""
    from placement.alpaserve.simulator import SERVED, simulate
    from placement.alpaserve.transition import scaled_profiles

    scaled: dict[float, object] = {}
    met = np.zeros(len(workload), dtype=bool)
    bounds = [entry[0] for entry in timeline[1:]] + [np.inf]
    begin = stretch_begin = -np.inf
    previous = None
    for (_, placement, factor), end in zip(timeline, bounds):
        if placement != previous:
            stretch_begin, previous = begin, placement
        run = np.flatnonzero((workload.arrival_s >= stretch_begin) & (workload.arrival_s < end))
        scored = workload.arrival_s[run] >= begin
        if scored.any() and placement.groups:
            if factor not in scaled:
                scaled[factor] = scaled_profiles(profiles, factor) if factor != 1.0 else profiles
            served = simulate(placement, scaled[factor], workload.take(run), config).status == SERVED
            met[run[scored]] = served[scored]
        begin = end
    return met


def through_rollouts(initial, rollouts: list[tuple], profiles, transition) -> list[tuple]:
    """The controller run's timeline as the controller predicts it: each re-placement from the moment its rollout
    began, step by step (`placement.alpaserve.transition.rollout_timeline`: what stays routed, loading slowdown),
    with the loading slowdown the controller had in force when it decided (refitted online after each rollout)."""
    from placement.alpaserve.placement_rollout import SlotLayout
    from placement.alpaserve.transition import rollout_timeline

    timeline: list[tuple] = [(-np.inf, initial, 1.0)]
    current = initial
    for begun, _, target, _, decision in rollouts:
        in_force = transition.model_copy(
            update={"loading_slowdown": decision.get("loading_slowdown", transition.loading_slowdown)})
        spans, _ = rollout_timeline(SlotLayout.from_placement(current, NUM_DEVICES), target, profiles, NUM_DEVICES,
                                    in_force, horizon_s=0.0)
        timeline += [(begun + span.start_s, span.placement, in_force.loading_slowdown if span.loading else 1.0)
                     for span in spans]
        current = target
    return timeline


def with_online_scales(timeline: list[tuple], scales: list[tuple[float, float]]) -> list[tuple]:
    """`timeline` (start, placement, factor) with every span's factor also multiplied by the controller's service-time
    factor in force (`scales`: (start, factor) from each decision on, fitted on the window before it): the simulator
    as the controller recalibrates it online, each span predicted from the ingress's records before it."""
    def in_force(entries: list[tuple], t: float) -> tuple:
        return [e for e in entries if e[0] <= t][-1]

    starts = sorted({entry[0] for entry in timeline} | {start for start, _ in scales})
    return [(t, in_force(timeline, t)[1], in_force(timeline, t)[2] * in_force(scales, t)[1]) for t in starts]


def write_records(path: Path, traces: list[dict], lone_s: dict[str, float], batch_ratio: dict[int, float],
                  simulated: SimulatorConfig, client_round_trip_s: float, period_s: float, duration_s: float) -> None:
    """Every replayed request of both runs of each trace and of its warm-up (arrival, model, SLO; latency, its part
    outside the ingress and outcome, real) with the placements and factors in force, so that other simulator settings
    can be scored on this run's records offline (`benchmarks/fidelity_replay.py`)."""
    import json

    def nullable(values: np.ndarray) -> list[float | None]:  # JSON has no NaN: null where not answered
        return [None if np.isnan(x) else float(x) for x in values]

    def run_records(run: dict) -> dict:
        return {"latency_s": nullable(run["latency"]), "client_leg_s": nullable(run["client_leg"]),
                "outcome": run["outcome"].tolist(), "send_lag_s": run["send_lag"].tolist()}

    def requests(workload) -> dict:
        return {"model_names": list(workload.model_names), "arrival_s": workload.arrival_s.tolist(),
                "model": workload.model.tolist(), "slo_s": workload.slo_s.tolist()}

    records = {
        "lone_service_s": lone_s, "batch_ratio": batch_ratio, "request_overhead_s": simulated.request_overhead_s,
        "host_contention_per_busy_device": simulated.host_contention_per_busy_device,
        "client_round_trip_s": client_round_trip_s, "period_s": period_s, "duration_s": duration_s,
        "warmup_s": WARMUP_S,
        "traces": [{"seed": t["seed"], **requests(t["trace"]), "static": run_records(t["static"]),
                    "warmup": {**requests(t["warmup_trace"]), **run_records(t["warmup"])},
                    "dynamic": run_records(t["dynamic"]),
                    "initial": [g.models for g in t["initial"].groups],
                    "placements": [(at, [g.models for g in placement.groups])
                                   for at, placement, _ in t["timeline"][1:]],
                    "online_scales": t["online_scales"][1:], "scale_before": t["online_scales"][0][1]}
                   for t in traces],
    }
    path.write_text(json.dumps(records))
    log.info("per-request records: %s", path)


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
            await handle.embed.remote(model, TEXTS)
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
            await handle.embed.remote(model, TEXTS)
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
    """A free loopback port that is none of Ray's default ports."""
    from rayserve_apps.control.live_update import free_port as free_loopback_port

    return free_loopback_port("127.0.0.1")


async def controller_trace(handle, controller, profile_sets: dict, transition, simulated: SimulatorConfig, slo_s: float,
                           total_rate: float, duration_s: float, period_s: float, memory_bytes: int, seed: int) -> dict:
    """Steps 3-5 for one trace: plan for its first half, static run, controller run, both simulated. `profile_sets`:
    "lone" (the controller's base), "calibrated" (offline) and "throughput_scaled"."""
    lone_profiles, throughput_profiles = profile_sets["lone"], profile_sets["throughput_scaled"]
    profiles = profile_sets["calibrated"]
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
    # Each replay starts a new trace: the records before it do not describe what follows, so the controller's
    # service-time refit restarts its window (the refit goes on while paused).
    await controller.apply_placement.remote(initial_groups, "benchmark reset", True)

    groups = group_handles()
    log.info("static run (controller paused), seed %d", seed)
    static = await replay(handle, trace, slo_s, groups)

    await controller.apply_placement.remote(initial_groups, "benchmark reset", True)
    log.info("warm-up (controller paused, not scored), seed %d: %.0f s at the opening shares", seed, WARMUP_S)
    warmup_trace = make_trace(total_rate, 2 * WARMUP_S, slo_s, seed=seed + WARMUP_SEED_OFFSET).window(0.0, WARMUP_S)
    warmup = await replay(handle, warmup_trace, slo_s)
    log.info("controller run, seed %d", seed)
    # The controller's service-time factor when the run starts (refitted every period while paused too, on the
    # warm-up), on its base profiles.
    scale_before = (await controller.state.remote())["service_scale"]
    resumed_s = time.time()
    await controller.pause.remote(False)
    dynamic = await replay(handle, trace, slo_s, groups)
    await controller.pause.remote(True)
    # By time, not by position: the log keeps its last `history_size` entries, so once it is full, its length
    # before the run does not mark where this run's entries start.
    decisions = [d for d in await controller.history.remote() if d["time_s"] >= resumed_s]
    applied = [d for d in decisions if d.get("outcome") == "applied"]
    timeline: list[tuple] = [(-np.inf, initial, 1.0)]
    changes, rollouts = [], []
    for d in applied:
        begun = d["time_s"] + d.get("planning_s", 0.0) - dynamic["start_wall"]
        at = d["time_s"] + d["duration_s"] - dynamic["start_wall"]
        target = Placement.model_validate({"groups": [one_device_group(g["models"]) for g in d["placement"]]})
        timeline.append((at, target, 1.0))
        changes.append(at)
        chosen = next((c for c in d.get("candidates", []) if c["name"] == d.get("chosen")), None)
        rollouts.append((begun, at, target, chosen, d))
        log.info("re-placement (%s, trigger %s) applied at t=%.1f s (%.1f s to roll out): %s", d.get("chosen"),
                 d.get("trigger"), at, d["duration_s"], d["placement"])

    # The simulator as the controller recalibrates it online (the primary figure): the controller's base profiles
    # (the lone-request times) times the factor in force at each moment, fitted on the ingress's records before it.
    scales = [(d["time_s"] - dynamic["start_wall"], d["service_scale"]) for d in decisions
              if d.get("service_scale") is not None]
    online = [(-np.inf, scale_before)] + scales
    static_sim = simulate_piecewise([(-np.inf, initial, 1.0)], profiles, trace, simulated)
    # Through the rollouts, with the transition model the controller was given (measured step time and load time)
    # and the loading slowdown it had in force at each move (refitted online): the primary figure.
    dynamic_sim = simulate_piecewise(with_online_scales(through_rollouts(initial, rollouts, profiles, transition),
                                                        online), lone_profiles, trace, simulated)
    # For comparison: each re-placement switched in when it finished (no rollout), also with the offline calibration
    # alone, and with the profiles scaled to the throughput probe.
    dynamic_at_end = simulate_piecewise(with_online_scales(timeline, online), lone_profiles, trace, simulated)
    dynamic_sim_offline = simulate_piecewise(timeline, profiles, trace, simulated)
    dynamic_sim_probe = simulate_piecewise(timeline, throughput_profiles, trace, simulated)
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
            deployed = simulate_piecewise([(-np.inf, target, 1.0)], profiles, trace.take(span), simulated)
            real_costs.append(float(deployed.mean() - dynamic["met"][span].mean()))
    # The live system's own repeatability: both runs on the requests before the first re-placement began (same
    # trace, same placement; only the controller's decisions and the run's moment differ).
    before_move = trace.arrival_s < (rollouts[0][0] if rollouts else duration_s)
    repeat_diff = (float(dynamic["met"][before_move].mean() - static["met"][before_move].mean())
                   if before_move.any() else None)
    # Whether the machine ran at the same speed in both: the fastest answers (REPEAT_SPEED_PERCENTILE of the requests
    # answered in both runs before the move: those that met no queue) of the controller run over the static run's.
    both = before_move & np.isfinite(static["latency"]) & np.isfinite(dynamic["latency"])
    speed_ratio = (float(np.percentile(dynamic["latency"][both], REPEAT_SPEED_PERCENTILE)
                         / np.percentile(static["latency"][both], REPEAT_SPEED_PERCENTILE)) if both.any() else None)
    shift_s = duration_s / 2
    after_shift = [t for t in changes if t >= shift_s]
    second = trace.arrival_s >= shift_s
    def per_stretch(between) -> dict:
        """`between(run, start_s, end_s)` in each half of the static run, and in the controller run before the shift
        and after its first re-placement after it (None without one)."""
        return {"static_first_half": between(static, 0.0, shift_s),
                "static_second_half": between(static, shift_s, np.inf),
                "controller_first_half": between(dynamic, 0.0, shift_s),
                "controller_after_move": between(dynamic, after_shift[0], np.inf) if after_shift else None}

    # What the groups' engines did in those stretches (the simulator's service-time factor times its host contention
    # stands for device_ms_per_request over the lone-request time).
    device_time = per_stretch(device_time_between)
    for stretch, groups_time in device_time.items():
        log.info("device time, %s: %s", stretch, {g: {k: None if v is None else round(v, 2) for k, v in t.items()}
                                                   for g, t in (groups_time or {}).items()})
    return {
        "seed": seed, "requests": len(trace), "trace": trace, "initial": initial, "static": static, "dynamic": dynamic,
        "warmup_trace": warmup_trace, "warmup": warmup, "real_repeat_diff": repeat_diff,
        "real_repeat_speed_ratio": speed_ratio,
        "static_sim": static_sim, "dynamic_sim": dynamic_sim, "dynamic_at_end": dynamic_at_end, "changes": changes,
        "timeline": timeline, "online_scales": online,
        "attainment_sim_at_rollout_end": float(dynamic_at_end.mean()),
        "abs_gap_at_rollout_end": abs(float(dynamic["met"].mean()) - float(dynamic_at_end.mean())),
        "attainment_real": float(dynamic["met"].mean()), "attainment_sim": float(dynamic_sim.mean()),
        "abs_gap": abs(float(dynamic["met"].mean()) - float(dynamic_sim.mean())),
        "attainment_sim_offline": float(dynamic_sim_offline.mean()),
        "abs_gap_offline": abs(float(dynamic["met"].mean()) - float(dynamic_sim_offline.mean())),
        "attainment_sim_throughput_scaled": float(dynamic_sim_probe.mean()),
        "controller_service_scale": [round(scale, 3) for _, scale in online],
        "static_attainment_real": float(static["met"].mean()), "static_attainment_sim": float(static_sim.mean()),
        "static_abs_gap": abs(float(static["met"].mean()) - float(static_sim.mean())),
        "second_half_attainment_real": float(dynamic["met"][second].mean()),
        "static_second_half_attainment_real": float(static["met"][second].mean()),
        # Whether this driver sent the requests when the trace says (the simulator replays the trace's times).
        "send_lag_ms": {"static": send_lag_ms(static), "controller": send_lag_ms(dynamic)},
        # Whether the host's two cores ran out: its busy CPU share in the static run's halves, and in the controller
        # run before the shift and after its first re-placement after it (both devices at full load).
        "host_cpu_busy_share": per_stretch(host_cpu_share_between),
        "device_time": device_time,
        "controller_gain_real": float(dynamic["met"][second].mean() - static["met"][second].mean()),
        "controller_gain_sim": float(dynamic_sim[second].mean() - static_sim[second].mean()),
        "transition_cost_predicted": float(np.mean(predicted_costs)) if predicted_costs else None,
        "transition_cost_real": float(np.mean(real_costs)) if real_costs else None,
        "reaction_s": (after_shift[0] - shift_s) if after_shift else None,
        "loading_slowdown_at_moves": [d.get("loading_slowdown") for d in applied],
        "loading_slowdown_fits": [d["loading_calibration"]["slowdown"] for d in decisions
                                  if "loading_calibration" in d],
        "decisions": [{"trigger": d.get("trigger"), "chosen": d.get("chosen"), "fit_window_s": d.get("fit_window_s"),
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

    http_options = {"host": "127.0.0.1", "port": free_port()}
    serve.start(http_options=http_options)
    duration_s = args.duration_s or (90.0 if args.quick else 300.0)
    period_s = args.period_s or (10.0 if args.quick else 20.0)

    log.info("1/7 profiling: every model on both devices")
    everywhere = {"groups": [one_device_group(MODELS), one_device_group(MODELS)]}
    profiling_spec = spec_dict(everywhere, None, slo_ms=PROFILING_SLO_MS, period_s=period_s,
                               memory_bytes=16 * 1024**3)
    deploy(profiling_spec, http_options)
    handle = serve.get_app_handle("plexserve")
    profile = await profile_live(handle)
    lone_s, overhead_s, batch_ratio = profile.service_s, profile.overhead_s, profile.batch_ratio
    lone_round_trip_s = profile.client_leg_s
    contention, contention_probe = await measure_host_contention()
    throughput, loaded_round_trip_s = await measure_throughput(handle, THROUGHPUT_PROBE_S, THROUGHPUT_CONCURRENCY)
    # The simulator's request overhead counts from the client: the lone requests' overhead through the ingress, its
    # way back from the ingress as long as under load. The controller's refits leave that way out: the ingress's
    # records do not hold it (`controller.calibration.client_round_trip_ms`).
    simulated = sim_config(overhead_s + max(0.0, loaded_round_trip_s - lone_round_trip_s), contention)
    client_round_trip_s = min(loaded_round_trip_s, simulated.request_overhead_s)
    log.info("way back from the ingress: %.1f ms lone, %.1f ms at full load; simulated request overhead %.1f ms "
             "(%.1f ms lone)", 1e3 * lone_round_trip_s, 1e3 * loaded_round_trip_s, 1e3 * simulated.request_overhead_s,
             1e3 * overhead_s)
    # Per-request device time at full load: the devices' share of the measured throughput, split by lone-time ratios.
    # It sets the SLO and the offered load; the simulator's service times are calibrated below.
    scale = (NUM_DEVICES / throughput) / float(np.mean(list(lone_s.values())))
    probe_s = {m: s * max(scale, 1.0) for m, s in lone_s.items()}
    log.info("throughput with every device busy: %.1f requests/s; per-request device time x%.2f of a lone request",
             throughput, scale)
    slo_s = SLO_SCALE * (max(probe_s.values()) + overhead_s)
    capacity = throughput
    total_rate = LOAD_FACTOR * capacity
    log.info("SLO %.0f ms, capacity %.0f/s, offered %.0f requests/s", 1e3 * slo_s, capacity, total_rate)
    weight_bytes = model_weight_bytes()
    load_s, transition = await measure_transition(profiling_spec)
    memory_bytes = int(MODELS_PER_DEVICE_MEMORY * weight_bytes)
    lone_profiles = measured_profiles(lone_s, batch_ratio, weight_bytes, load_s)
    throughput_profiles = measured_profiles(probe_s, batch_ratio, weight_bytes, load_s)
    folder = Path(tempfile.mkdtemp(prefix="plexserve-fidelity-"))
    # The controller starts from the lone-request times and recalibrates them online from the ingress's records.
    lone_profiles.save(folder / "profiles.json")

    log.info("2/7 deploying, controller on (paused between runs); service-time calibration")
    first = make_trace(total_rate, duration_s, slo_s, seed=args.seed).window(0.0, duration_s / 2)
    initial = plan(MODELS, throughput_profiles, first, NUM_DEVICES, memory_bytes,
                   PlannerConfig(max_group_devices=1)).normalize()
    initial_groups = {"groups": [g.model_dump(mode="json") for g in initial.groups]}
    deploy(spec_dict(initial_groups, str(folder / "profiles.json"), 1e3 * slo_s, period_s, memory_bytes, transition,
                     simulated, client_round_trip_s), http_options)
    handle = serve.get_app_handle("plexserve")
    controller = serve.get_deployment_handle("PlacementController", app_name="plexserve")
    await controller.pause.remote(True)
    for model in MODELS:
        await handle.embed.remote(model, TEXTS)
    calibration, trace_round_trip_s = await calibration_replay(handle, initial, lone_profiles, simulated, total_rate,
                                                               slo_s, seed=args.seed + CALIBRATION_SEED_OFFSET)
    log.info("way back from the ingress at the traces' load: %.1f ms (the controller's refits leave out %.1f ms)",
             1e3 * trace_round_trip_s, 1e3 * client_round_trip_s)
    service_s = {m: s * calibration.scale for m, s in lone_s.items()}
    profile_sets = {"lone": lone_profiles,
                    "calibrated": measured_profiles(service_s, batch_ratio, weight_bytes, load_s),
                    "throughput_scaled": throughput_profiles}

    log.info("3-5/7 %d traces (static run, controller run, both simulated)", NUM_TRACES)
    traces = [await controller_trace(handle, controller, profile_sets, transition, simulated, slo_s, total_rate,
                                     duration_s, period_s, memory_bytes, seed=args.seed + k) for k in range(NUM_TRACES)]

    log.info("6/7 re-placement under steady load")
    steady = await steady_replacement(handle, controller, capacity, seed=args.seed)

    log.info("7/7 load past saturation")
    await controller.apply_placement.remote(initial_groups, "benchmark reset")
    burst = await saturate(handle, capacity)

    last = traces[0]
    plot(out_dir() / "fidelity.png", last["trace"],
         {"controller (real)": last["dynamic"]["met"], "controller (sim through rollouts)": last["dynamic_sim"],
          "controller (sim, switched at rollout end)": last["dynamic_at_end"],
          "static (real)": last["static"]["met"],
          "static (sim)": last["static_sim"]},
         last["changes"], duration_s)
    write_records(out_dir() / "fidelity_records.json", traces, lone_s, batch_ratio, simulated, client_round_trip_s,
                  period_s, duration_s)
    failed_accepted = int(sum(t["failed_during_replay"] for t in traces) + burst["failed"] + steady["failed"])
    per_trace = [{k: v for k, v in t.items()
                  if k not in ("trace", "initial", "static", "dynamic", "static_sim", "dynamic_sim", "dynamic_at_end",
                               "changes", "timeline", "online_scales", "warmup_trace", "warmup")}
                 for t in traces]
    gains = [t["controller_gain_real"] for t in traces]
    present = lambda key: [t[key] for t in traces if t[key] is not None]  # noqa: E731
    figures = {
        "controller_gain_real_min": min(gains), "controller_gain_real_mean": float(np.mean(gains)),
        "abs_gap_max": max(t["abs_gap"] for t in traces),
        "abs_gap_at_rollout_end_max": max(t["abs_gap_at_rollout_end"] for t in traces),
        "abs_gap_offline_max": max(t["abs_gap_offline"] for t in traces),
        "static_abs_gap_max": max(t["static_abs_gap"] for t in traces),
        "real_repeat_diff_max_abs": max(abs(d) for d in present("real_repeat_diff")) if present("real_repeat_diff")
        else None,
        "real_repeat_speed_ratio_range": ([min(present("real_repeat_speed_ratio")),
                                           max(present("real_repeat_speed_ratio"))]
                                          if present("real_repeat_speed_ratio") else None),
        "transition_cost_predicted": (float(np.mean(present("transition_cost_predicted")))
                                      if present("transition_cost_predicted") else None),
        "transition_cost_real": (float(np.mean(present("transition_cost_real"))) if present("transition_cost_real")
                                 else None),
        "reaction_s": float(np.mean(present("reaction_s"))) if present("reaction_s") else None,
        "send_lag_p99_ms_max": max(max(t["send_lag_ms"]["static"]["p99"], t["send_lag_ms"]["controller"]["p99"])
                                   for t in traces),
        "attainment_real": float(np.mean([t["attainment_real"] for t in traces])),
        "attainment_sim": float(np.mean([t["attainment_sim"] for t in traces])),
        "traces": per_trace,
        "failed_accepted": failed_accepted, "saturation": burst,
        "unchanged_p99_ratio": steady["unchanged_p99_ratio"], "steady_replacement": steady,
        "slo_ms": 1e3 * slo_s, "service_ms": {m: 1e3 * s for m, s in service_s.items()},
        "lone_service_ms": {m: 1e3 * s for m, s in lone_s.items()}, "batch_ratio": batch_ratio,
        "throughput_scaled_service_ms": {m: 1e3 * s for m, s in probe_s.items()},
        "calibration": calibration.to_json(),
        "attainment_sim_throughput_scaled": float(np.mean([t["attainment_sim_throughput_scaled"] for t in traces])),
        "abs_gap_max_throughput_scaled": max(abs(t["attainment_real"] - t["attainment_sim_throughput_scaled"])
                                             for t in traces),
        "load_s": load_s, "transition": transition.model_dump(), "throughput_per_s": throughput,
        "ingress_overhead_ms": 1e3 * overhead_s,
        "request_overhead_ms": 1e3 * simulated.request_overhead_s,
        "client_round_trip_ms": {"lone": 1e3 * lone_round_trip_s, "full_load": 1e3 * loaded_round_trip_s,
                                 "calibration_replay": 1e3 * trace_round_trip_s},
        "host_contention_per_busy_device": simulated.host_contention_per_busy_device,
        "host_contention_probe": contention_probe,
        "duration_s": duration_s, "period_s": period_s, "machine": machine_description(),
    }
    return figures


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--duration-s", type=float, default=None, help="trace length (default 90 s quick, 300 s full)")
    parser.add_argument("--period-s", type=float, default=None,
                        help="controller period (default 10 s quick, 20 s full)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import ray
    from ray import serve

    from rayserve_apps.control.live_update import local_dashboard_options

    # The dashboard serves Serve's REST API, through which the benchmark and the controller apply configs.
    ray.init(address="local", num_cpus=RAY_NUM_CPUS, resources={DEVICE_RESOURCE: NUM_DEVICES},
             log_to_driver=False, **local_dashboard_options())
    try:
        figures = asyncio.run(run(args))
    finally:
        serve.shutdown()
        ray.shutdown()
    emit_json(figures)


if __name__ == "__main__":
    main()
