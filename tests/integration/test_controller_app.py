"""The live placement controller end to end on a local Ray with 4 logical devices (a stand-in for GPUs).

Three tiny ViTs (random weights in a local checkpoint: a code-path stand-in) run in group slots. The controller
judges candidates on synthetic profiles (a stand-in, named so in the profile file). Re-placements are applied
while requests flow and none is lost; unchanged groups keep their processes; the controller moves models when
observed traffic outgrows their groups, survives its own restart, a killed group replica fails only its own
requests and comes back, and load past saturation gets 503 with a reason.
"""

import os
import signal
import threading
import time
from collections import Counter

import numpy as np
import pytest
import requests
import torch
from conftest import TEST_DEVICE_RESOURCE, free_port, restart_controller
from ray import serve
from waiting import wait_until

from models import load_vit
from placement.alpaserve.paper_profiles import model_profile
from placement.alpaserve.placement_rollout import SlotLayout
from placement.alpaserve.shift_looks import ShiftLooks
from placement.alpaserve.shift_trigger import ShiftTrigger
from placement.core.deployment_spec import parse_spec
from placement.core.profiles import ProfileSet
from rayserve_apps.contracts import group_max_ongoing_requests
from rayserve_apps.control.controller import PlacementController
from rayserve_apps.control.live_update import (
    DASHBOARD_ENV,
    application_config,
    apply_config,
    local_dashboard_options,
)

pytestmark = pytest.mark.ray

TINY_VIT = dict(patch_size=4, depth=2, embed_dim=32, num_heads=2)
MODELS = ["vit-a", "vit-b", "vit-c"]
NUM_DEVICES = 4
#: Stand-in profile: every model takes this long on one device (the real tiny ViTs take a few ms) ...
PROFILE_LATENCY_S = 0.1
#: ... but vit-c, whose traffic outgrows its groups in a test.
VIT_C_LATENCY_S = 0.2
#: The controller's rate/CV fit window, seconds.
FIT_WINDOW_S = 8
#: Requests a model's deployments may queue before the ingress answers 503 overloaded.
MAX_QUEUED = 4
#: Images per ViT batch: small, so that a group replica's max_ongoing_requests (two batches per vision model) and
#: the saturation test's client count stay small.
MAX_BATCH_SIZE = 2
#: Clients beyond what the groups hosting a model can hold, in the saturation test.
EXTRA_CLIENTS = 16
TIMEOUT_S = 120
#: Seconds the saturation test waits for its refusals before the paused stages resume: well within TIMEOUT_S, so that
#: the admitted requests, answered only after the resume, still come back within their clients' timeout on a slow
#: machine (with a wait as long as the timeout, slow refusals would leave the admitted requests no time after the
#: resume).
REFUSALS_WAIT_S = 40
#: Pause between two requests of one traffic thread (steady load that leaves the 2 cores room to re-place).
TRAFFIC_GAP_S = 0.05


#: An operator's own settings in the deployed config: a field of a group slot the controller does not own, and a
#: deployment it never writes. Both stay in force through the controller's moves.
OPERATOR_OVERRIDES = [{"name": "group-0", "health_check_period_s": 7.0},
                      {"name": "PlacementController", "graceful_shutdown_timeout_s": 9.0}]


def group(devices: int, models: list[str], stages: int = 1) -> dict:
    return {"num_devices": devices, "config": {"intra_op_degree": devices // stages, "pipeline_stages": stages},
            "models": models}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    import ray

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    ray.init(address="local", num_cpus=8, resources={TEST_DEVICE_RESOURCE: NUM_DEVICES}, **local_dashboard_options(),
             log_to_driver=False)
    port = free_port()
    http_options = {"host": "127.0.0.1", "port": port}
    serve.start(http_options=http_options)
    folder = tmp_path_factory.mktemp("controller")
    vit = load_vit("timm:vit_tiny_patch16_224", allow_random_init=True, num_classes=4, image_size_px=16, **TINY_VIT)
    torch.save(vit.model.state_dict(), folder / "vit.pt")
    profiles = ProfileSet(source="synthetic", device="stand-in: 0.1 s per request (vit-c 0.2 s) on any device",
                          models={m: model_profile(m, 64 * 1024**2,
                                                   VIT_C_LATENCY_S if m == "vit-c" else PROFILE_LATENCY_S)
                                  for m in MODELS})
    profiles.save(folder / "profiles.json")
    spec = parse_spec({
        "cluster": {"num_devices": NUM_DEVICES, "device_resource": TEST_DEVICE_RESOURCE},
        "models": [{"name": m, "kind": "vision", "source": "timm:vit_tiny_patch16_224",
                    "checkpoint_path": str(folder / "vit.pt"),
                    "num_classes": 4, "image_size_px": 16, "timm_kwargs": TINY_VIT, "num_cpus_per_replica": 0.25,
                    "slo_ms": 2000, "max_queued_requests": MAX_QUEUED,
                    "max_batch_size": MAX_BATCH_SIZE} for m in MODELS],
        "placement": {"groups": [group(2, ["vit-a", "vit-b"], stages=2), group(1, ["vit-c"])]},
        "planning": {"profiles": {"path": str(folder / "profiles.json")}, "planner": {"max_group_devices": 2}},
        # A long period: the tests trigger decisions themselves. The profiles are stand-ins far slower than the tiny
        # ViTs, and the tests rely on them: no recalibration from the measured latencies.
        "controller": {"period_s": 3600, "fit_window_s": FIT_WINDOW_S, "min_gain": 0.05, "max_changes_per_step": 1,
                       "shift_detection": False, "calibrate_service": False},
    })
    apply_config([application_config(spec, deployments=OPERATOR_OVERRIDES)], http_options)
    try:
        yield {"url": f"http://127.0.0.1:{port}", "spec": spec,
               "controller": serve.get_deployment_handle("PlacementController", app_name="plexserve")}
    finally:
        serve.shutdown()
        ray.shutdown()


def images() -> list:
    return np.random.default_rng(0).normal(size=(1, 3, 16, 16)).astype(np.float32).tolist()


def classify(app, model: str) -> requests.Response:
    return requests.post(f"{app['url']}/v1/models/{model}/classify", json={"images": images()}, timeout=TIMEOUT_S)


def classify_or_none(app, model: str) -> requests.Response | None:
    """`classify`, or None when the client timed out: a test counts it instead of stopping at the first one."""
    try:
        return classify(app, model)
    except requests.Timeout:
        return None


def slots(app) -> dict[str, dict]:
    return {g["group"]: g for g in requests.get(f"{app['url']}/v1/placement", timeout=TIMEOUT_S).json()["groups"]}


class Traffic:
    """Threads sending requests in a loop to each model until stopped; every status is kept."""

    def __init__(self, app, models: list[str]):
        self.app, self.models, self.stop, self.statuses = app, set(models), threading.Event(), Counter()
        self.bodies: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(m,)) for m in models]

    def _run(self, model: str) -> None:
        while not self.stop.wait(TRAFFIC_GAP_S):
            response = classify(self.app, model)
            self.statuses[(model, response.status_code)] += 1
            if response.status_code != 200:
                self.bodies.append(response.text)

    def __enter__(self) -> "Traffic":
        for thread in self.threads:
            thread.start()
        return self

    def wait_flowing(self, timeout_s: float = TIMEOUT_S) -> None:
        """Wait until every model has had an answer: the traffic flows before what the test does next."""
        wait_until(lambda: self.models <= {model for model, _ in list(self.statuses)}, timeout_s,
                   message=lambda: f"not every model answered: {dict(self.statuses)}")

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(TIMEOUT_S)


def test_slots_run_the_initial_placement_and_the_controller_reads_it(app):
    layout = slots(app)
    assert sorted(layout) == [f"group-{i}" for i in range(NUM_DEVICES)]
    assert layout["group-0"]["models"] == ["vit-a", "vit-b"] and layout["group-1"]["models"] == ["vit-c"]
    assert layout["group-2"]["models"] == [] and layout["group-2"]["config"] is None
    state = app["controller"].state.remote().result(timeout_s=TIMEOUT_S)
    assert state["version"] == 0 and state["models"] == MODELS
    assert all(classify(app, m).status_code == 200 for m in MODELS)


def test_replacement_while_requests_flow_loses_none_and_restarts_only_changed_slots(app):
    before = slots(app)
    first = {"groups": [group(2, ["vit-a", "vit-b"], stages=2), group(1, ["vit-a", "vit-c"]),
                        group(1, ["vit-b", "vit-c"])]}
    second = {"groups": [group(1, ["vit-a", "vit-c"]), group(1, ["vit-b", "vit-c"]), group(1, ["vit-a"]),
                         group(1, ["vit-b"])]}
    # (SLO admission may refuse a request with 503 while a model loads beside it; none may fail once accepted.)
    with Traffic(app, MODELS) as traffic:
        traffic.wait_flowing()
        applied = app["controller"].apply_placement.remote(first).result(timeout_s=600)
        middle = slots(app)
        applied_second = app["controller"].apply_placement.remote(second).result(timeout_s=600)
        time.sleep(1)
    after = slots(app)
    assert {status for (_, status) in traffic.statuses} <= {200, 503}, (traffic.statuses, traffic.bodies[:3])
    assert all('"slo_unattainable"' in body or '"overloaded"' in body for body in traffic.bodies), traffic.bodies[:3]
    answered = sum(n for (_, status), n in traffic.statuses.items() if status == 200)
    assert answered >= 20 and answered >= 0.9 * sum(traffic.statuses.values()), traffic.statuses
    # First step: slot 1 rehosted in place, slot 2 started; slot 0 untouched.
    assert applied["outcome"] == "applied"
    assert [c["kind"] for step in applied["diff"] for c in step] == ["rehost", "start"]
    assert middle["group-0"]["pid"] == before["group-0"]["pid"] and middle["group-1"]["pid"] == before["group-1"]["pid"]
    assert middle["group-1"]["models"] == ["vit-a", "vit-c"] and middle["group-2"]["models"] == ["vit-b", "vit-c"]
    # Second: the 2-device group gives its slot to a 1-device group (its models are hosted elsewhere meanwhile),
    # then one more 1-device group starts on the freed device.
    kinds = [[(c["slot"], c["kind"]) for c in step] for step in applied_second["diff"]]
    assert kinds == [[(0, "replace")], [(3, "start")]]
    # The controller kept that rollout as it ran, for the loading-slowdown refit: per step its Serve updates, then
    # its slot change, which loads models (a replace and a start both do), in order within the rollout's seconds.
    rollout = app["controller"].state.remote().result(timeout_s=TIMEOUT_S)["last_rollout"]
    assert sum(span["loading"] for span in rollout["spans"]) == 2, rollout
    bounds = [t for span in rollout["spans"] for t in (span["start_s"], span["end_s"])]
    assert bounds == sorted(bounds) and bounds[0] >= 0 and bounds[-1] <= rollout["duration_s"] + 1e-6, rollout
    assert all(span["serving"] for span in rollout["spans"])  # every model keeps a group throughout
    for name in ("group-1", "group-2"):  # untouched by the second re-placement: same processes
        assert after[name]["pid"] == middle[name]["pid"]
    assert (sorted(sorted(g["models"]) for g in after.values())
            == [["vit-a"], ["vit-a", "vit-c"], ["vit-b"], ["vit-b", "vit-c"]])


def deployment_configs(app) -> dict[str, dict]:
    """The configs the application's deployments run with, read through Serve's REST API."""
    details = requests.get(f"{os.environ[DASHBOARD_ENV]}/api/serve/applications/", timeout=TIMEOUT_S).json()
    return {name: d["deployment_config"] for name, d in details["applications"]["plexserve"]["deployments"].items()}


def test_the_operators_overrides_stay_in_force_through_the_moves(app):
    """The moves of the replacement test ran through the controller; the operator's settings survived them."""
    state = app["controller"].state.remote().result(timeout_s=TIMEOUT_S)
    assert state["version"] >= 2  # the controller has applied moves (the replacement test's two)
    configs = deployment_configs(app)
    assert configs["group-0"]["health_check_period_s"] == 7.0
    assert configs["PlacementController"]["graceful_shutdown_timeout_s"] == 9.0
    assert configs["group-1"]["health_check_period_s"] != 7.0  # only where the operator set it
    # Serve's deployed config holds the operator's fields beside the controller's.
    details = requests.get(f"{os.environ[DASHBOARD_ENV]}/api/serve/applications/", timeout=TIMEOUT_S).json()
    deployed = {d["name"]: d for d in details["applications"]["plexserve"]["deployed_app_config"]["deployments"]}
    assert deployed["group-0"]["health_check_period_s"] == 7.0 and "user_config" in deployed["group-0"]
    assert deployed["PlacementController"] == OPERATOR_OVERRIDES[1]
    # In apply mode the controller recommends nothing.
    recommended = requests.get(f"{app['url']}/v1/placement/recommended", timeout=TIMEOUT_S)
    assert recommended.status_code == 200 and recommended.json() == {"mode": "apply", "config": None}


def test_pausing_or_resuming_forgets_the_shifts_found_and_the_looks_due():
    """A shift found (or a look due) before an operator paused the controller triggers no decision when it resumes
    (e.g. after a static run, a shift found before it must not trigger a decision the moment it resumes). The
    controller's own `pause`, on an instance holding only what it touches."""
    controller = object.__new__(PlacementController.func_or_class)
    controller.shift_trigger = ShiftTrigger(cooldown_s=5.0, last_decision_s=100.0)
    controller.shift_looks = ShiftLooks(looks=2, due_s=104.0, window_s=10.0, left=1)
    shift = {"model": "vit-c", "before_per_s": 2.0, "after_per_s": 12.0}
    assert controller.shift_trigger.poll([shift], 102.0) == []  # within the cool-down: pending
    assert controller.pause(True) is True
    assert controller.shift_trigger.poll([], 200.0, due=True) == [] and controller.shift_looks.take_due(200.0) is None
    controller.shift_trigger.poll([shift], 201.0)  # found while a decision was still running at the pause
    controller.shift_looks.due_s, controller.shift_looks.window_s = 203.0, 10.0
    assert controller.pause(False) is False
    assert controller.shift_trigger.poll([], 300.0) == [] and controller.shift_looks.take_due(300.0) is None
    # Unpaused, a shift found after the cool-down triggers a decision as before.
    assert controller.shift_trigger.poll([shift], 301.0) == [shift]


def test_history_lists_decisions_newest_last(app):
    body = requests.get(f"{app['url']}/v1/placement/history", timeout=TIMEOUT_S).json()
    decisions = body["decisions"]
    assert [d["trigger"] for d in decisions][-2:] == ["operator", "operator"]
    assert decisions[-1]["id"] == decisions[-2]["id"] + 1 and decisions[-1]["duration_s"] > 0
    assert (requests.get(f"{app['url']}/v1/placement/history?limit=1", timeout=TIMEOUT_S).json()["decisions"]
            == decisions[-1:])
    bad = requests.get(f"{app['url']}/v1/placement/history?limit=0", timeout=TIMEOUT_S)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "limit"


def test_an_operator_restarts_the_service_time_calibration_without_a_move(app):
    state = app["controller"].state.remote().result(timeout_s=TIMEOUT_S)
    running = SlotLayout.model_validate(state["layout"]).placement().model_dump(mode="json")
    kept = app["controller"].apply_placement.remote(running, "operator", True).result(timeout_s=TIMEOUT_S)
    assert kept["outcome"] == "kept"
    after = app["controller"].state.remote().result(timeout_s=TIMEOUT_S)
    # The refit's window now starts at the call, though nothing moved.
    assert after["calibration_since_s"] > max(state["calibration_since_s"], kept["time_s"])
    assert (after["version"], after["layout"]) == (state["version"], state["layout"])


def test_controller_moves_a_model_whose_traffic_outgrows_its_groups(app):
    # vit-c at up to 40 requests/s; by its (stand-in) profile its two hosting groups serve 2 / VIT_C_LATENCY_S = 10/s,
    # so even a loaded machine that sends half the rate overloads them. The decision is taken while the traffic
    # still flows: the last fit window must hold traffic, not the idle seconds of draining the senders.
    hosts_before = sum("vit-c" in g["models"] for g in slots(app).values())
    with ThreadPoolRate(40) as pool:
        sender = threading.Thread(target=pool.run, args=(lambda: classify(app, "vit-c"),))
        sender.start()
        time.sleep(FIT_WINDOW_S + 2)
        pending = app["controller"].replan_now.remote()
        time.sleep(2)  # the decision reads the window when it starts; then the load may stop
        pool.stop.set()
        sender.join(TIMEOUT_S)
    decision = pending.result(timeout_s=600)
    assert decision["trigger"] == "period" and decision["outcome"] == "applied", decision
    assert decision["chosen"] in ("local", "rehost", "replan") and decision["predicted_gain"] >= 0.05
    assert decision["traffic"]["vit-c"]["rate_per_s"] > 2 / VIT_C_LATENCY_S, decision["traffic"]
    layout = slots(app).values()
    hosts_after = sum("vit-c" in g["models"] for g in layout)
    assert hosts_after > hosts_before
    assert {m for g in layout for m in g["models"]} == set(MODELS)  # models without traffic stay hosted


class ThreadPoolRate:
    """Submit calls at about `rate` per second on a small thread pool until `stop` is set."""

    def __init__(self, rate: float):
        from concurrent.futures import ThreadPoolExecutor

        self.pool, self.gap, self.stop = ThreadPoolExecutor(32), 1.0 / rate, threading.Event()

    def run(self, fn) -> None:
        next_s = time.monotonic()
        while not self.stop.is_set():
            next_s += self.gap
            self.stop.wait(max(0.0, next_s - time.monotonic()))
            self.pool.submit(fn)

    def __enter__(self) -> "ThreadPoolRate":
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.pool.shutdown(wait=True)


def test_controller_restart_reads_its_state_back_from_serve(app):
    before = app["controller"].state.remote().result(timeout_s=TIMEOUT_S)
    history = app["controller"].history.remote().result(timeout_s=TIMEOUT_S)
    after = restart_controller(app["controller"])
    assert after["recovered"] and after["layout"] == before["layout"] and after["version"] == before["version"]
    assert app["controller"].history.remote().result(timeout_s=TIMEOUT_S) == history


def test_killed_group_replica_fails_only_its_own_requests_and_comes_back(app):
    layout = slots(app)
    victim_slot = min((name for name, g in layout.items() if g["models"]), key=lambda name: len(layout[name]["models"]))
    victims = layout[victim_slot]["models"]
    # The planner fills device memory, so the slot may host every model; its models are then also hosted elsewhere
    # or come back with the replica, and only requests in flight at the killed replica may fail.
    with Traffic(app, MODELS) as traffic:
        traffic.wait_flowing()
        os.kill(layout[victim_slot]["pid"], signal.SIGKILL)
        time.sleep(3)
    # Models the killed replica did not host never noticed; its own in-flight requests got a 503 with a JSON reason.
    assert all(status == 200 for (model, status) in traffic.statuses
               if model not in victims), (victims, traffic.statuses, traffic.bodies[:3])
    assert {status for (model, status) in traffic.statuses if model in victims} <= {200, 503}, traffic.statuses
    assert all('"error"' in body for body in traffic.bodies)
    def replaced() -> dict | None:
        info = serve.get_deployment_handle(victim_slot, app_name="plexserve").info.remote().result(timeout_s=30)
        return info if info["pid"] != layout[victim_slot]["pid"] and info["models"] == victims else None

    # Any exception: Serve is replacing the replica.
    wait_until(replaced, 180, interval_s=1.0, ignore=(Exception,),
               message=f"{victim_slot} did not come back with {victims}")
    # Every model answers again once the ingress has measured the new replica (a request that waited through the
    # restart may have inflated its estimate for a moment, so each model gets a few seconds).

    refused: dict = {}

    def every_model_answers() -> bool:
        answers = {m: classify(app, m) for m in MODELS}
        refused.clear()
        refused.update({m: (r.status_code, r.text[:300]) for m, r in answers.items() if r.status_code != 200})
        return not refused

    wait_until(every_model_answers, 60, interval_s=1.0, message=lambda: f"models still refused: {refused}")


def test_load_past_saturation_gets_503_with_reasons_never_a_crash(app):
    """Saturation made certain on any machine: the stage actors of every group hosting vit-a are paused (SIGSTOP,
    a stand-in for a stalled device) while more clients than the groups can hold send requests. Each group
    deployment takes `max_ongoing_requests` and the ingress queues its `max_queued_requests` more, so the rest are
    refused at once with a reason; once the stages resume, the admitted ones are answered."""
    from concurrent.futures import ThreadPoolExecutor

    layout = slots(app)
    hosts = [name for name, g in layout.items() if "vit-a" in g["models"]]
    pids = [pid for name in hosts for row in layout[name]["stage_actor_pids"]["vit-a"] for pid in row]
    assert pids, layout
    capacity = sum(group_max_ongoing_requests(app["spec"], layout[name]["models"])
                   + MAX_QUEUED * len(layout[name]["models"])
                   for name in hosts)
    clients = capacity + EXTRA_CLIENTS
    with ThreadPoolExecutor(clients) as pool:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            pending = [pool.submit(classify_or_none, app, "vit-a") for _ in range(2 * clients)]
            started = time.monotonic()
            while (sum(f.done() for f in pending) < EXTRA_CLIENTS
                   and time.monotonic() - started < REFUSALS_WAIT_S):
                time.sleep(0.1)
            paused = {"paused_s": round(time.monotonic() - started, 1), "done": sum(f.done() for f in pending)}
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        responses = [f.result() for f in pending]
    codes = Counter(r.status_code if r is not None else "timed out" for r in responses)
    assert set(codes) <= {200, 503}, (codes, paused)
    answered = [r for r in responses if r is not None]
    assert codes[503] >= EXTRA_CLIENTS and codes[200] >= 1, (codes, paused, [r.text for r in answered[:2]])
    reasons = {r.json()["error"]["type"] for r in answered if r.status_code == 503}
    assert reasons <= {"overloaded", "slo_unattainable"}, reasons
    assert classify(app, "vit-a").status_code == 200
