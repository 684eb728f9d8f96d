"""The live part of `benchmarks/many_models.py` (issue 57, steps 1-4): one workload, three systems over HTTP.

Each system runs in a Ray of its own (a child process started by `run_system`), one after the other, behind the
ingress mode `make serve` uses (Serve's HAProxy ingress, `rayserve_apps/fast_ingress.py`), deployed through
Serve's REST API as a config (as `serve deploy` does), and driven by the same open-loop client:

* `plexserve`: the spec as a user writes it (`--spec`), placement planned from its `planning` profiles, the
  placement controller on;
* `serve_deployments`: one Serve deployment per model (`@serve.batch`, `autoscaling_config`),
  `benchmarks/_serve_many_models_apps.py`;
* `serve_multiplexed`: one `@serve.multiplexed` deployment per architecture, models loaded from local disk on
  demand, same module;
* `plexserve_per_model` (on request): the same spec without its planning, placement and controller, which plexserve
  serves as one single-model deployment per model (its text and vision replicas), autoscaled and bound by the
  memory budget as `serve_deployments` is: Serve's one-deployment-per-model layout on plexserve's request path,
  which tells the layout's share of a difference from the request path's.

The per-device memory budget of the spec binds all three: plexserve's planner places within it; the Serve setups'
replicas request the custom Ray resource `device_memory_bytes` (the node holds devices x budget) in proportion to
the weights they may hold.

The trace (`live_traffic`): per model open-loop Gamma arrivals with CV `cv`, power-law popularity whose ranks
rotate by half the models at mid-trace (`placement.core.workload.ShiftingPopularity`), each model's SLO `slo_scale`
x its single-request latency over HTTP (its profiled compute in the spec's profiles plus `HTTP_ROUND_TRIP_S`). Every
rate of the sweep replays one realisation of it, and the CPU the machine spent over each replay is read from /proc
by process role (`CPU_ROLES`: where a system's CPU per request goes); a fault phase (at the lowest rate) then kills
one replica a third of the way in.

The pure parts (trace, figures, fault accounting, rate at 99 %) import neither Ray nor torch; the session imports
them when it runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from placement.core.workload import ShiftingPopularity, Workload

log = logging.getLogger("many_models")

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = ("plexserve", "serve_deployments", "serve_multiplexed", "plexserve_per_model")
#: Serve applications' names in the sessions.
PLEXSERVE_APP, SERVE_APP = "plexserve", "serve-many"
#: The custom Ray resource that stands for device memory in the Serve setups' Rays (bytes).
MEMORY_RESOURCE = "device_memory_bytes"
#: Logical CPUs each session's Ray declares (the same for the three systems; they share the machine's cores).
RAY_NUM_CPUS = 8
#: HTTP statuses that refuse a request (not accepted; never counted as lost).
REFUSAL_STATUSES = (429, 503)
#: Seconds the client waits for one answer.
REQUEST_TIMEOUT_S = 60.0
#: Words the texts are drawn from (short English sentences of TEXT_WORDS words).
WORDS = ("the model serves many requests on shared devices while traffic shifts between popular and rare models "
         "every second a burst arrives and the system must answer within its objective or refuse early with a "
         "clear reason that names the limit").split()
TEXT_WORDS = 20
#: A request's round trip through HTTP and an ingress on this machine, seconds: a model's single-request latency
#: over HTTP is its profiled compute plus this (the SLO scale multiplies both).
HTTP_ROUND_TRIP_S = 0.03
#: The attainment each system must hold.
ATTAINMENT_GOAL = 0.99
#: Share of the fault phase at which one replica is killed.
KILL_AT_FRACTION = 1.0 / 3.0
#: Requests to the killed replica's models answered within their SLOs after the last miss that count as served
#: again.
RECOVERED_AFTER = 3
#: Processes whose CPU each rate attributes, by fragments of their command lines (Ray's process titles; the first
#: matching role counts): "models", the processes that run the models (plexserve's stage actors and single-model
#: replicas, Serve's model replicas); "group_replicas", plexserve's group replicas (batch forming, packing, pooling, the
#: stage transport's owner); "ingress", each system's HTTP ingress deployment. The load generator is the session's own
#: process; all else (Serve's controller, proxy and HAProxy, Ray's daemons, plexserve's placement controller, the rest
#: of the machine) is `CPU_OTHER`.
CPU_ROLES = {"models": ("StageShard", f"ServeReplica:{SERVE_APP}:model-", f"ServeReplica:{SERVE_APP}:mux-",
                        f"ServeReplica:{PLEXSERVE_APP}:model-"),
             "group_replicas": (f"ServeReplica:{PLEXSERVE_APP}:group-",),
             "ingress": (f"ServeReplica:{PLEXSERVE_APP}:Ingress", f"ServeReplica:{SERVE_APP}:ModelsIngress")}
CPU_OTHER = "other"
#: Order of the popularity ranks, and the seeds of the realisations replayed per rate / in the fault phase.
ORDER_SEED, TRACE_SEED, FAULT_SEED = 5, 2, 3


# ---- the case: models, budget, profiles ----

@dataclass(frozen=True)
class LiveModel:
    """One model of the spec as the load generator and the Serve setups see it."""

    name: str
    kind: str  # text | vision
    source: str
    weight_bytes: int
    single_latency_s: float
    fields: dict = field(default_factory=dict)  # the spec's model entry (vision shape, checkpoint)

    def body(self, rng: random.Random) -> bytes:
        """One request body: a short text, or one float32 image of the model's input shape."""
        if self.kind == "text":
            return json.dumps({"texts": [" ".join(rng.choice(WORDS) for _ in range(TEXT_WORDS))]}).encode()
        side, chans = int(self.fields.get("image_size_px") or 224), int(self.fields.get("in_chans") or 3)
        pixels = np.random.default_rng(rng.randrange(2 ** 31)).normal(size=(1, chans, side, side))
        return json.dumps({"images": np.round(pixels, 3).astype(np.float32).tolist()}).encode()

    @property
    def verb(self) -> str:
        return "embed" if self.kind == "text" else "classify"

    @property
    def architecture(self) -> str:
        """Models of one architecture share a checkpoint layout (a multiplexed deployment serves them together)."""
        return f"{self.kind}:{self.source}:{json.dumps(self.fields.get('timm_kwargs') or {}, sort_keys=True)}"


@dataclass(frozen=True)
class LiveCase:
    spec: dict  # the deployment spec (the Serve config's application args)
    models: tuple[LiveModel, ...]
    num_devices: int
    device_memory_bytes: int
    spec_path: str

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def model(self, name: str) -> LiveModel:
        return next(m for m in self.models if m.name == name)


def read_spec(path: Path) -> dict:
    """The deployment spec of a Serve config (its one application's `args`) or of a bare spec file."""
    if not path.exists():
        raise ValueError(f"--spec {path}: no such file")
    data = yaml.safe_load(path.read_text())
    if isinstance(data, dict) and "applications" in data:
        apps = data["applications"]
        if len(apps) != 1:
            raise ValueError(f"--spec {path}: the Serve config has {len(apps)} applications; expected one")
        data = apps[0].get("args") or {}
    if not isinstance(data, dict) or "models" not in data:
        raise ValueError(f"--spec {path}: no deployment spec (a 'models' list) in it")
    return data


def load_case(path: Path, base_dir: Path = REPO) -> LiveCase:
    """The spec at `path` with its models' weights and single-request latencies over HTTP (profiled compute plus
    HTTP_ROUND_TRIP_S) from its planning profiles;
    ValueError naming the model where one does not fit the per-device budget, where the models do not all fit the
    devices once, or where a model has no profile."""
    from placement.alpaserve.deployment_planning import parse_planning
    from placement.core.deployment_spec import parse_spec
    from placement.core.profiles import ParallelConfig

    raw = read_spec(path)
    spec = parse_spec(raw)
    if spec.planning is None:
        raise ValueError(f"--spec {path}: no 'planning' section (plexserve plans from its profiles)")
    profiles = parse_planning(spec.planning).profiles.load(base_dir)
    budget, devices = spec.cluster.device_memory_bytes, spec.cluster.num_devices
    models = []
    for m in spec.models:
        if m.name not in profiles.models:
            raise ValueError(f"model {m.name!r} has no profile in the spec's planning profiles "
                             f"(measure it with `python -m parallel profile-spec`)")
        profile = profiles.models[m.name]
        weight = profile.get(ParallelConfig()).weight_bytes_per_device()
        if weight > budget:
            raise ValueError(f"model {m.name!r} ({weight / 2**20:.0f} MiB) does not fit the per-device memory budget "
                             f"cluster.device_memory_bytes = {budget / 2**20:.0f} MiB")
        fields = m.model_dump(mode="json", exclude_none=True)
        models.append(LiveModel(m.name, m.kind, m.source, int(weight),
                                float(profile.single_device_latency()) + HTTP_ROUND_TRIP_S,
                                {k: fields[k] for k in ("image_size_px", "in_chans", "num_classes", "timm_kwargs",
                                                        "checkpoint_path", "policies") if k in fields}))
    total = sum(m.weight_bytes for m in models)
    if total > devices * budget:
        raise ValueError(f"the {len(models)} models ({total / 2**20:.0f} MiB) do not fit {devices} devices of "
                         f"{budget / 2**20:.0f} MiB once")
    return LiveCase(raw, tuple(models), devices, budget, str(path))


# ---- the trace ----

def live_traffic(case: LiveCase, rate: float, duration_s: float, cv: float, popularity_exponent: float,
                 slo_scale: float, shift_fraction: float = 0.5) -> ShiftingPopularity:
    """The case's traffic at total `rate` req/s: Gamma arrivals (CV `cv`), power-law popularity whose hot models
    change at `shift_fraction` of the trace, SLO = `slo_scale` x single-request latency."""
    if cv < 3:
        raise ValueError(f"--cv {cv}: the comparison needs bursty traffic, CV >= 3")
    return ShiftingPopularity.with_slo_scale(
        case.names, [m.single_latency_s for m in case.models], slo_scale, total_rate_per_s=rate, cv=cv,
        duration_s=duration_s, popularity_exponent=popularity_exponent, shift_at_s=shift_fraction * duration_s,
        order_seed=ORDER_SEED)


# ---- figures ----

@dataclass
class Outcomes:
    """What the client saw of one replayed trace: per request its model, arrival (s from the trace start), SLO,
    HTTP status (0: no answer: timeout or connection error) and latency (s; NaN without an answer)."""

    model: np.ndarray
    arrival_s: np.ndarray
    slo_s: np.ndarray
    status: np.ndarray
    latency_s: np.ndarray

    @classmethod
    def empty(cls, workload: Workload) -> "Outcomes":
        n = len(workload)
        return cls(workload.model.copy(), workload.arrival_s.copy(), workload.slo_s.copy(), np.zeros(n, np.int32),
                   np.full(n, np.nan))

    def to_json(self) -> dict:
        return {k: [None if isinstance(v, float) and not np.isfinite(v) else v for v in getattr(self, k).tolist()]
                for k in ("model", "arrival_s", "slo_s", "status", "latency_s")}

    @classmethod
    def from_json(cls, data: dict) -> "Outcomes":
        return cls(np.asarray(data["model"], np.int32), np.asarray(data["arrival_s"], float),
                   np.asarray(data["slo_s"], float), np.asarray(data["status"], np.int32),
                   np.asarray([np.nan if v is None else v for v in data["latency_s"]], float))

    @property
    def good(self) -> np.ndarray:
        return (self.status == 200) & (self.latency_s <= self.slo_s)


def figures(outcomes: Outcomes, duration_s: float) -> dict:
    """SLO attainment (answered 200 within the SLO over all requests), goodput (those per second), p50 / p99 of the
    answered, refusals (429/503) and other failures (5xx, timeouts, connection errors)."""
    n = len(outcomes.status)
    answered = outcomes.latency_s[outcomes.status == 200]
    refused = int(np.isin(outcomes.status, REFUSAL_STATUSES).sum())
    return {"requests": n, "attainment": float(outcomes.good.sum() / n) if n else None,
            "goodput_per_s": float(outcomes.good.sum() / duration_s),
            "p50_s": float(np.percentile(answered, 50)) if len(answered) else None,
            "p99_s": float(np.percentile(answered, 99)) if len(answered) else None,
            "refusals": refused, "failures": int(n - (outcomes.status == 200).sum() - refused)}


def cpu_figures(before: dict[str, float], after: dict[str, float], requests: int, wall_s: float) -> dict | None:
    """The CPU one replay cost, from two `benchmarks._common.cpu_seconds_by_role` readings around it: milliseconds
    per request of the trace by role, and the machine's busy cores (every role's CPU seconds over the replay's wall
    seconds). None without readings (no /proc) or without requests."""
    if not before or not after or requests <= 0 or wall_s <= 0:
        return None
    spent = {role: max(0.0, seconds - before.get(role, 0.0)) for role, seconds in after.items()}
    return {"ms_per_request": {role: 1e3 * seconds / requests for role, seconds in spent.items()},
            "busy_cores": sum(spent.values()) / wall_s}


def rate_at_goal(curve: list[dict], goal: float = ATTAINMENT_GOAL) -> float | None:
    """The highest rate up to which every rate of the (sorted) curve held `goal` attainment; None: not the lowest."""
    held = None
    for point in sorted(curve, key=lambda p: p["rate_per_s"]):
        if point["attainment"] is None or point["attainment"] < goal:
            break
        held = point["rate_per_s"]
    return held


def held_at_top_of_grid(rate_at_99: dict[str, float | None], top_rate_per_s: float | None) -> list[str]:
    """The systems whose rate at 99 % is the sweep's top rate: they may hold it higher, so that rate is a lower
    bound (and a ratio over it an upper bound)."""
    return [s for s, rate in rate_at_99.items()
            if rate is not None and top_rate_per_s is not None and rate >= top_rate_per_s]


def fault_figures(outcomes: Outcomes, kill_at_s: float, victims: set[int]) -> dict:
    """After one replica is killed at `kill_at_s` (s from the trace start; `victims`: indices of the models it
    hosted): `lost_accepted`, the requests neither answered nor refused, beyond those that were in flight for the
    victim's models at the kill; `in_flight_at_kill`; `recovery_s`, seconds from the kill to the arrival of the first
    victim-model request after the last one that was not answered within its SLO (0: none missed after the kill;
    None: fewer than RECOVERED_AFTER victim-model requests followed the last miss, the phase ended first)."""
    finish = outcomes.arrival_s + np.where(np.isfinite(outcomes.latency_s), outcomes.latency_s, np.inf)
    victim = np.isin(outcomes.model, sorted(victims))
    in_flight = victim & (outcomes.arrival_s <= kill_at_s) & (finish >= kill_at_s)
    failed = (outcomes.status != 200) & ~np.isin(outcomes.status, REFUSAL_STATUSES)
    after = np.flatnonzero(victim & (outcomes.arrival_s > kill_at_s))
    after = after[np.argsort(outcomes.arrival_s[after], kind="stable")]
    good = outcomes.good[after]
    missed = np.flatnonzero(~good)
    if not len(missed):
        recovery: float | None = 0.0
    elif len(good) - 1 - missed[-1] >= RECOVERED_AFTER:
        recovery = float(outcomes.arrival_s[after[missed[-1] + 1]] - kill_at_s)
    else:
        recovery = None  # censored: the phase ended before the victim's models were served again
    return {"lost_accepted": int((failed & ~in_flight).sum()), "in_flight_at_kill": int(in_flight.sum()),
            "failed_in_flight": int((failed & in_flight).sum()), "recovery_s": recovery,
            "fault_phase": figures(outcomes, float(outcomes.arrival_s.max(initial=0.0)) or 1.0)}


# ---- the load generator ----

class Client:
    """One open-loop HTTP client (aiohttp, keep-alive): sends each request of a trace at its arrival time."""

    def __init__(self, base_url: str, case: LiveCase, seed: int = 0):
        self.base_url = base_url.rstrip("/")
        self.case = case
        rng = random.Random(seed)
        self.bodies = {m.name: [m.body(rng) for _ in range(16)] for m in case.models}

    def url(self, model: str) -> str:
        return f"{self.base_url}/v1/models/{model}/{self.case.model(model).verb}"

    async def replay(self, workload: Workload, on_start=None, events: list | None = None) -> Outcomes:
        """Replay `workload` from now; `events`: (offset s, callable) run in a thread at that offset (the kill)."""
        import aiohttp

        outcomes = Outcomes.empty(workload)
        names = workload.model_names
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            start = time.perf_counter()

            async def one(i: int) -> None:
                name = names[int(workload.model[i])]
                body = self.bodies[name][i % len(self.bodies[name])]
                try:
                    async with session.post(self.url(name), data=body,
                                            headers={"content-type": "application/json"}) as response:
                        await response.read()
                        status = response.status
                except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
                    return
                outcomes.status[i] = status
                # Latency from the scheduled arrival: a late send (a busy client) counts against the system.
                outcomes.latency_s[i] = time.perf_counter() - start - workload.arrival_s[i]
            tasks = []
            for offset, action in sorted(events or [], key=lambda e: e[0]):
                tasks.append(asyncio.ensure_future(_at(start + offset, action)))
            for i in range(len(workload)):
                delay = start + workload.arrival_s[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.gather(*tasks)
        return outcomes


async def _at(when: float, action) -> None:
    delay = when - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    await asyncio.to_thread(action)


# ---- one system's session (a child process with a Ray of its own) ----

@dataclass
class SessionSettings:
    system: str
    spec_path: str
    rates: list[float]
    duration_s: float
    fault_duration_s: float
    cv: float
    popularity_exponent: float
    slo_scale: float
    fault: bool = True
    warmup_s: float = 3.0


def session_env() -> dict[str, str]:
    """The session process's environment: plexserve's serving mode (Serve's HAProxy ingress, every listener on
    127.0.0.1, free ports for HAProxy's stats and metrics)."""
    from rayserve_apps.control.live_update import free_port
    from rayserve_apps.fast_ingress import local_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    env.update(local_env(stats_port=free_port(), metrics_port=free_port()))
    env.update({"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_system(settings: SessionSettings, out: Path, timeout_s: float) -> dict:
    """Run one system's session in a child process (a Ray of its own) and return what it measured."""
    import subprocess

    out.write_text("")
    command = [sys.executable, "-m", "benchmarks._many_models_live", json.dumps(asdict(settings)), str(out)]
    try:
        subprocess.run(command, env=session_env(), cwd=REPO, check=True, timeout=timeout_s, stdout=sys.stderr)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the {settings.system} session ran past {timeout_s:.0f} s") from None
    except subprocess.CalledProcessError as error:
        raise RuntimeError(f"the {settings.system} session failed (exit {error.returncode}); its log is above") \
            from None
    return json.loads(out.read_text())


def per_model_spec(spec: dict) -> dict:
    """`spec` without its planning, placement and controller: plexserve then serves every model in a single-model
    deployment of its own (`rayserve_apps/app.py`)."""
    return {k: v for k, v in spec.items() if k not in ("planning", "placement", "controller")}


def per_model_application(case: LiveCase) -> dict:
    """plexserve_per_model's Serve config application: `per_model_spec`, each model autoscaled as the Serve
    baseline's deployments are (`_serve_many_models_apps.deployment_options`: from one replica up to as many as the
    devices' memory holds, Serve's target of ongoing requests), through the spec's `autoscaling`; each replica
    requests its model's weight bytes of the memory resource through the config's `deployments:` overrides, as an
    operator sets a field of Serve's own."""
    from benchmarks import _serve_many_models_apps as apps
    from placement.core.deployment_spec import MAX_REPLICAS, parse_spec
    from rayserve_apps.app import replica_actor_options
    from rayserve_apps.contracts import model_deployment_name
    from rayserve_apps.control.live_update import application_config

    raw = per_model_spec(case.spec)
    models = []
    for entry, model in zip(raw["models"], case.models):
        scaling = apps.deployment_options({"name": model.name, "weight_bytes": model.weight_bytes},
                                          case.num_devices, case.device_memory_bytes)["autoscaling_config"]
        models.append({**{k: v for k, v in entry.items() if k != "num_replicas"},
                       "autoscaling": {"min_replicas": scaling["min_replicas"],
                                       "initial_replicas": scaling["initial_replicas"],
                                       # The spec's bound; a small model's memory bound lies far past it.
                                       "max_replicas": min(scaling["max_replicas"], MAX_REPLICAS),
                                       "target_ongoing_requests": scaling["target_ongoing_requests"]}})
    spec = parse_spec({**raw, "models": models})
    overrides = [{"name": model_deployment_name(m.name), "ray_actor_options": {
        **replica_actor_options(m.num_cpus_per_replica), "resources": {MEMORY_RESOURCE: float(live.weight_bytes)}}}
        for m, live in zip(spec.models, case.models)]
    return application_config(spec, name=PLEXSERVE_APP, deployments=overrides)


def application(system: str, case: LiveCase, load_log: str) -> dict:
    """The Serve config application that deploys `system` for `case`."""
    from placement.core.deployment_spec import parse_spec
    from rayserve_apps.control.live_update import application_config

    if system == "plexserve":
        return application_config(parse_spec(case.spec), name=PLEXSERVE_APP)
    if system == "plexserve_per_model":
        return per_model_application(case)
    from benchmarks import _serve_many_models_apps as apps

    args = apps.app_args(case, multiplexed=system == "serve_multiplexed", load_log=load_log)
    builder = "build_multiplexed_app" if system == "serve_multiplexed" else "build_deployments_app"
    return {"name": SERVE_APP, "route_prefix": "/", "import_path": f"benchmarks._serve_many_models_apps:{builder}",
            "args": args}


def kill_one_replica(system: str, case: LiveCase, base_url: str, hottest: list[str]) -> tuple[str, set[str]]:
    """Kill one replica mid-run, one that hosts the hottest model it can (`hottest`: the models, hottest first):
    plexserve, a stage actor of a group (SIGKILL on a pid the app's `GET /v1/placement` lists); the Serve setups and
    plexserve_per_model, a model replica (`ray.kill` on the replica actor, found through Ray's public state API).
    Returns what was killed and the models it hosted."""
    import ray

    if system == "plexserve":
        import urllib.request

        with urllib.request.urlopen(f"{base_url}/v1/placement", timeout=30) as response:
            groups = json.loads(response.read())["groups"]
        hosting = [g for g in groups if g.get("models") and g.get("stage_actor_pids")]
        if not hosting:
            raise RuntimeError("plexserve runs no device group with stage actors to kill")
        group = min(hosting, key=lambda g: min(hottest.index(m) if m in hottest else len(hottest)
                                                for m in g["models"]))
        model = group["models"][0]
        pid = group["stage_actor_pids"][model][0][0]
        os.kill(int(pid), signal.SIGKILL)
        # A stage process of a group serves every model of the group.
        return f"stage actor pid {pid} of {group['group']}", set(group["models"])
    from ray.util.state import list_actors

    from benchmarks import _serve_many_models_apps as apps

    app = PLEXSERVE_APP if system == "plexserve_per_model" else SERVE_APP
    replicas = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
                if (a.class_name or "").startswith((f"ServeReplica:{app}:model-", f"ServeReplica:{app}:mux-"))]
    if not replicas:
        raise RuntimeError("no Serve model replica to kill")
    multiplexed = system == "serve_multiplexed"

    def rank(actor) -> tuple:
        hosted = apps.models_of_deployment(case, actor.class_name.split(":")[-1], multiplexed)
        return min((hottest.index(m) for m in hosted if m in hottest), default=len(hottest)), actor.class_name

    victim = min(replicas, key=rank)
    deployment = victim.class_name.split(":")[-1]
    ray.kill(ray.get_actor(victim.name, namespace="serve"), no_restart=True)
    hosted = apps.models_of_deployment(case, deployment, multiplexed)
    return f"Serve replica {victim.name}", hosted


def session_main(settings: SessionSettings, out: Path) -> None:
    """One system: start Ray and Serve (fast ingress), deploy, warm up, replay the trace at every rate, then the
    fault phase; write the outcomes as JSON to `out`."""
    import ray
    from ray import serve

    from benchmarks._common import cpu_seconds_by_role
    from rayserve_apps.control.live_update import apply_config, free_port, local_dashboard_options

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    case = load_case(Path(settings.spec_path))
    resources = {MEMORY_RESOURCE: float(case.num_devices * case.device_memory_bytes)}
    ray.init(address="local", num_cpus=RAY_NUM_CPUS, resources=resources, log_to_driver=False,
             **local_dashboard_options())
    port = free_port()
    http_options = {"host": "127.0.0.1", "port": port}
    base = f"http://127.0.0.1:{port}"
    load_log = str(out) + ".loads"
    result: dict[str, Any] = {"system": settings.system, "points": [], "names": case.names}
    try:
        serve.start(http_options=http_options)
        started = time.perf_counter()
        apply_config([application(settings.system, case, load_log)], http_options)
        result["deploy_s"] = time.perf_counter() - started
        log.info("[%s] deployed in %.0f s", settings.system, result["deploy_s"])
        client = Client(base, case)
        loop = asyncio.new_event_loop()
        # Warm-up: every model answers once (first calls initialise lazily loaded parts; multiplexed replicas load).
        warm = Workload(case.names, np.linspace(0, settings.warmup_s, 2 * len(case.names), endpoint=False),
                        np.tile(np.arange(len(case.names)), 2), np.full(2 * len(case.names), 60.0))
        warm_out = loop.run_until_complete(client.replay(warm))
        log.info("[%s] warm-up statuses %s", settings.system, np.unique(warm_out.status, return_counts=True))
        for rate in settings.rates:
            traffic = live_traffic(case, rate, settings.duration_s, settings.cv, settings.popularity_exponent,
                                   settings.slo_scale)
            cpu_before, replay_started = cpu_seconds_by_role(CPU_ROLES, CPU_OTHER), time.perf_counter()
            outcomes = loop.run_until_complete(client.replay(traffic.workload(TRACE_SEED)))
            cpu = cpu_figures(cpu_before, cpu_seconds_by_role(CPU_ROLES, CPU_OTHER), len(outcomes.status),
                              time.perf_counter() - replay_started)
            point = {"rate_per_s": rate, **figures(outcomes, settings.duration_s), "cpu": cpu}
            result["points"].append({**point, "outcomes": outcomes.to_json()})
            log.info("[%s] rate %.2f/s: %s", settings.system, rate,
                     {k: v for k, v in point.items() if k != "outcomes"})
        if settings.fault:
            rate = settings.rates[0]
            traffic = live_traffic(case, rate, settings.fault_duration_s, settings.cv, settings.popularity_exponent,
                                   settings.slo_scale)
            kill_at = KILL_AT_FRACTION * settings.fault_duration_s
            workload = traffic.workload(FAULT_SEED)
            counts = np.bincount(workload.model, minlength=len(case.names))
            hottest = [case.names[i] for i in np.argsort(-counts, kind="stable")]
            killed: dict = {}

            def kill() -> None:
                what, models = kill_one_replica(settings.system, case, base, hottest)
                killed.update(what=what, models=sorted(models), at_s=time.perf_counter())
                log.info("[%s] killed %s (models %s)", settings.system, what, sorted(models))

            outcomes = loop.run_until_complete(client.replay(workload, events=[(kill_at, kill)]))
            victims = {case.names.index(m) for m in killed.get("models", [])}
            result["fault"] = {"killed": killed.get("what"), "models": killed.get("models"), "kill_at_s": kill_at,
                               "rate_per_s": rate, **fault_figures(outcomes, kill_at, victims)}
            log.info("[%s] fault: %s", settings.system, {k: v for k, v in result["fault"].items()})
        loop.close()
        if Path(load_log).exists():
            result["loads"] = [json.loads(line) for line in Path(load_log).read_text().splitlines() if line.strip()]
    finally:
        serve.shutdown()
        ray.shutdown()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    session_main(SessionSettings(**json.loads(sys.argv[1])), Path(sys.argv[2]))


# ---- the driver side: sweeps, simulator predictions, figures across systems ----

@dataclass(frozen=True)
class SimContext:
    """What the simulator needs to predict plexserve on the live case: its planned placement, the profiles it was
    planned from, and the simulated system, batching as plexserve's replicas do and with every request paying the
    HTTP round trip that each SLO counts (`HTTP_ROUND_TRIP_S`)."""

    case: LiveCase
    placement: Any
    profiles: Any
    config: Any


def sim_context(case: LiveCase) -> SimContext:
    """Plan plexserve's placement for `case` as its application builder does, and the simulator to judge it."""
    import dataclasses

    from benchmarks import _serve_many_models_apps as apps
    from placement.alpaserve.batching import MaxBatchWithinSLO
    from placement.alpaserve.deployment_planning import planning_spec
    from placement.alpaserve.plan_spec import prepare, run_planner, simulator_config
    from placement.core.deployment_spec import parse_spec

    plan_spec = planning_spec(parse_spec(case.spec))
    profiles, names, planning = prepare(plan_spec, REPO)
    placement = run_planner(plan_spec, profiles, names, planning)
    # plexserve's replicas batch the requests that wait (ConcatBatching; the vision replicas' batches): the
    # prediction batches up to the Serve setups' `@serve.batch` size, within each request's SLO.
    config = dataclasses.replace(simulator_config(plan_spec), batching=MaxBatchWithinSLO(apps.MAX_BATCH_SIZE),
                                 request_overhead_s=HTTP_ROUND_TRIP_S)
    return SimContext(case=case, placement=placement, profiles=profiles, config=config)


def answered_latency_s(outcomes: Outcomes) -> np.ndarray:
    """Per request, its latency where it was answered (HTTP 200), else NaN (refused, failed, timed out)."""
    return np.where(outcomes.status == 200, outcomes.latency_s, np.nan)


def sim_predictions(context: SimContext, workload: Workload) -> dict:
    """The simulator's SLO attainment on `workload` (the live trace) for plexserve's planned placement and for one
    model per device (one Serve deployment per model, replicas in proportion to the load,
    `placement.alpaserve.serve_baselines`), both from the profiles as measured."""
    from benchmarks import _serve_many_models_apps as apps
    from placement.alpaserve.serve_baselines import ServeBatching, proportional_deployments, simulate_serve
    from placement.alpaserve.simulator import simulate

    case, placement, profiles = context.case, context.placement, context.profiles
    plex = simulate(placement, profiles, workload, context.config).slo_attainment()
    rates = np.bincount(workload.model, minlength=len(case.names)) / max(workload.duration_s, 1e-9)
    layout = proportional_deployments(case.names, profiles, rates, case.num_devices, case.device_memory_bytes)
    batching = ServeBatching(max_batch_size=apps.MAX_BATCH_SIZE, batch_wait_timeout_s=apps.BATCH_WAIT_TIMEOUT_S,
                             max_ongoing_requests=apps.MAX_ONGOING_REQUESTS)
    per_device = simulate_serve(layout, profiles, workload, batching, load_s=0.0).slo_attainment()
    return {"plexserve": float(plex), "one_per_device": float(per_device),
            "placement": [f"{g.num_devices} dev {g.config.key()}: {', '.join(g.models)}" for g in placement.groups]}


def calibrated_prediction(context: SimContext, workload: Workload, window: Workload,
                          window_latency_s: np.ndarray) -> dict:
    """The prediction plexserve's placement controller makes for `workload`: the profiled service times scaled by
    the factor at which its simulator reproduces an earlier `window` of live traffic (`window_latency_s`: plexserve's
    live latency of each of its requests, NaN where not answered), fitted by the controller's own calibration
    (`placement.alpaserve.service_calibration`) on requests other than those it predicts. Empty when the window
    pins no factor (too few answered)."""
    from placement.alpaserve.service_calibration import calibrate_service_scale
    from placement.alpaserve.simulator import simulate
    from placement.alpaserve.transition import scaled_profiles

    fitted = calibrate_service_scale(context.placement, context.profiles, window, window_latency_s, context.config)
    if fitted is None:
        return {}
    scaled = simulate(context.placement, scaled_profiles(context.profiles, fitted.scale), workload, context.config)
    return {"plexserve_calibrated": float(scaled.slo_attainment()), "service_scale": float(fitted.scale)}


def swap_rate(loads: list[dict]) -> dict | None:
    """The multiplexed replicas' measured model loads: median seconds and median bytes per second. A replica's
    first load also imports the model library; its later loads (the swaps) are used where there are any."""
    usable = [entry for entry in loads if entry.get("load_s", 0) > 0]
    seen: set = set()
    later = []
    for entry in usable:
        if entry.get("pid") in seen:
            later.append(entry)
        seen.add(entry.get("pid"))
    usable = later or usable
    if not usable:
        return None
    return {"loads": len(usable), "median_load_s": float(np.median([e["load_s"] for e in usable])),
            "bytes_per_s": float(np.median([e["weight_bytes"] / e["load_s"] for e in usable]))}


def combine(runs: dict[str, dict], case: LiveCase, settings: SessionSettings, with_sim: bool = True) -> dict:
    """Figures of one live run of every system: curves (with the simulator's predictions on the same traces), the
    rate at 99 %, the ratios and the fault figures."""
    curves: dict[str, list] = {}
    context = sim_context(case) if with_sim else None
    predictions: dict[float, dict] = {}  # per rate: the traces are the same for every system
    for system, result in runs.items():
        curve = []
        window = None  # plexserve's previous rate: its trace and live latencies
        for point in sorted(result["points"], key=lambda p: p["rate_per_s"]):
            outcomes = Outcomes.from_json(point["outcomes"])
            row = {k: v for k, v in point.items() if k != "outcomes"}
            if with_sim:
                workload = live_traffic(case, point["rate_per_s"], settings.duration_s, settings.cv,
                                        settings.popularity_exponent, settings.slo_scale).workload(TRACE_SEED)
                if point["rate_per_s"] not in predictions:
                    predictions[point["rate_per_s"]] = sim_predictions(context, workload)
                predicted = dict(predictions[point["rate_per_s"]])
                if system == "plexserve":
                    # The controller's prediction: fitted on the rate before (none before the first, where it
                    # predicts from the profiles alone, as the controller does before its first window).
                    if window is not None:
                        predicted.update(calibrated_prediction(context, workload, *window))
                    window = (workload, answered_latency_s(outcomes))
                row["sim"] = predicted
            del outcomes
            curve.append(row)
        curves[system] = curve
    held = {s: rate_at_goal(c) for s, c in curves.items()}

    def ratio(other: str) -> float | None:
        ours, theirs = held.get("plexserve"), held.get(other)
        return None if ours is None or not theirs else ours / theirs

    gains = []
    for point in curves.get("plexserve", []):
        others = [p["attainment"] for s in ("serve_deployments", "serve_multiplexed") for p in curves.get(s, [])
                  if p["rate_per_s"] == point["rate_per_s"]]
        if others:
            gains.append(point["attainment"] - max(others))
    faults = {s: r.get("fault") for s, r in runs.items() if r.get("fault")}
    swaps = swap_rate(runs.get("serve_multiplexed", {}).get("loads", []))
    top = max((p["rate_per_s"] for c in curves.values() for p in c), default=None)
    return {"curves": curves, "rate_at_99": held, "held_at_top_of_grid": held_at_top_of_grid(held, top),
            "rate_at_99_vs_serve_deployments": ratio("serve_deployments"),
            "rate_at_99_vs_serve_multiplexed": ratio("serve_multiplexed"),
            "attainment_gain_min": min(gains) if gains else None,
            **sim_live_gap_figures(curves),
            # The bounds are plexserve's: its own fault figures; every system's stay in `faults`.
            "lost_accepted": faults.get("plexserve", {}).get("lost_accepted"),
            "recovery_s": faults.get("plexserve", {}).get("recovery_s"),
            "faults": faults, "swap": swaps,
            "deploy_s": {s: r.get("deploy_s") for s, r in runs.items()}}


def median_curves(runs: list[dict], systems: list[str], rates: list[float]) -> tuple[dict[str, list], float | None]:
    """The curves of `runs` (each `combine`'s figures, CPU per request by role included) as medians over the runs at
    each rate, and the largest spread (max - min) of one system's attainment at one rate between the runs (None for
    one run): every run replays the same traces, so the spread is the machine's run-to-run noise."""
    curves: dict[str, list] = {}
    spreads = []
    for system in systems:
        curve = []
        for k, rate in enumerate(rates):
            points = [run["curves"][system][k] for run in runs if len(run["curves"][system]) > k]
            if len(points) > 1:
                spreads.append(max(p["attainment"] for p in points) - min(p["attainment"] for p in points))
            row = {key: median_of([p[key] for p in points])
                   for key in ("attainment", "goodput_per_s", "p50_s", "p99_s", "refusals", "failures", "requests")}
            cpus = [p["cpu"] for p in points if p.get("cpu")]
            if cpus:
                row["cpu"] = {"ms_per_request": {role: median_of([c["ms_per_request"].get(role) for c in cpus])
                                                 for role in cpus[0]["ms_per_request"]},
                              "busy_cores": median_of([c["busy_cores"] for c in cpus])}
            if points and "sim" in points[0]:
                row["sim"] = {key: median_of([p["sim"].get(key) for p in points])
                              for key in ("plexserve", "one_per_device", "plexserve_calibrated", "service_scale")}
                row["sim_placement"] = points[0]["sim"]["placement"]
            curve.append({"rate_per_s": rate, **row})
        curves[system] = curve
    return curves, max(spreads) if spreads else None


def sim_live_gap_figures(curves: dict[str, list]) -> dict[str, float | None]:
    """`sim_live_abs_gap_max` and `sim_live_abs_gap_max_uncalibrated` of `curves` (`sim_live_gaps`; None without
    predictions)."""
    gaps, uncalibrated = sim_live_gaps(curves)
    return {"sim_live_abs_gap_max": max(gaps) if gaps else None,
            "sim_live_abs_gap_max_uncalibrated": max(uncalibrated) if uncalibrated else None}


def sim_live_gaps(curves: dict[str, list]) -> tuple[list[float], list[float]]:
    """|predicted - live| attainment at each rate of `curves` (rows with the simulator's predictions under "sim"):
    plexserve against its controller's prediction (calibrated at the rate before; the profiles alone where there is
    none) and, uncalibrated, against the profiles alone; one deployment per model against one model per device in
    both. Returns (gaps, uncalibrated gaps)."""
    gaps, uncalibrated = [], []
    for system, curve in curves.items():
        for row in curve:
            sim = row.get("sim")
            if not sim or row.get("attainment") is None:
                continue
            if system == "plexserve":
                calibrated = sim.get("plexserve_calibrated")
                gaps.append(abs((sim["plexserve"] if calibrated is None else calibrated) - row["attainment"]))
                uncalibrated.append(abs(sim["plexserve"] - row["attainment"]))
            elif system == "serve_deployments":
                gaps.append(abs(sim["one_per_device"] - row["attainment"]))
                uncalibrated.append(gaps[-1])
    return gaps, uncalibrated


def no_rate_at_goal_message(rate_at_99: dict, lowest_rate: float) -> str | None:
    """The message for a sweep on which some system never held the goal (None: every system held it)."""
    missing = [system for system, rate in rate_at_99.items() if rate is None]
    if not missing:
        return None
    return (f"no rate of the live sweep holds {ATTAINMENT_GOAL:.0%} SLO attainment for {', '.join(missing)} "
            f"(lowest rate {lowest_rate:g} req/s); lower --live-rate-min (figures kept in the result file)")


def median_of(values: list, none_is: str | None = None) -> float | None:
    """The median of `values`. A None is left out, unless `none_is` says where it ranks: "lowest" (a rate at 99 %
    that lies below the sweep, and a ratio over it) or "highest" (a recovery the phase ended before); a median that
    falls on a None (either middle value, for an even count) is None."""
    if none_is is None:
        kept = [v for v in values if v is not None]
        return float(np.median(kept)) if kept else None
    if none_is not in ("lowest", "highest"):
        raise ValueError(f"none_is must be 'lowest' or 'highest', got {none_is!r}")
    if not values:
        return None
    low = none_is == "lowest"
    ranked = sorted(values, key=lambda v: ((v is not None) if low else (v is None), 0.0 if v is None else v))
    middle = ranked[(len(ranked) - 1) // 2: len(ranked) // 2 + 1]
    return None if any(v is None for v in middle) else float(np.mean(middle))


def plot(curves: dict[str, list], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"plexserve": "o-", "serve_deployments": "^--", "serve_multiplexed": "v--"}
    for system, curve in curves.items():
        if curve:
            ax.plot([p["rate_per_s"] for p in curve], [p["attainment"] for p in curve], styles.get(system, "x-"),
                    label=system)
    sim = curves.get("plexserve") or []
    if sim and "sim" in sim[0]:
        ax.plot([p["rate_per_s"] for p in sim], [p["sim"]["plexserve"] for p in sim], "o:", color="grey",
                label="simulator: plexserve's placement")
        ax.plot([p["rate_per_s"] for p in sim], [p["sim"]["one_per_device"] for p in sim], "^:", color="silver",
                label="simulator: one model per device")
        calibrated = [p for p in sim if p["sim"].get("plexserve_calibrated") is not None]
        if calibrated:
            ax.plot([p["rate_per_s"] for p in calibrated], [p["sim"]["plexserve_calibrated"] for p in calibrated],
                    "s-.", color="tab:blue", alpha=0.6, label="simulator: plexserve, calibrated at the rate before")
    ax.axhline(ATTAINMENT_GOAL, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("total rate (requests/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
