"""The live placement controller: watches traffic, re-plans with the simulator, rolls out only what changed.

One replica of the deployment `PlacementController` runs beside the ingress (spec section `controller`). It has two
duties, each run every `period_s` when the application has something for it:

Group placement (an application with a placement; AlpaServe §4.2). Every period it
1. takes the traffic the ingress replicas reported (`report`, one record per request) for the last period,
2. asks `placement.alpaserve.replanning.ReplanPolicy` to keep or move: fit rate and CV per model, resample, simulate the
   running placement, a rehost on the running groups and a full AlpaServe re-plan (§4.2), and move only for a
   predicted attainment gain of at least `min_gain`,
3. rolls a move out in small steps (`placement.alpaserve.placement_rollout.plan_rollout`), each as three
   declarative Serve config updates (`live_update.py`): the ingress stops routing to what the step changes, the
   changed slots are reconfigured or replaced (other deployments untouched), the ingress routes to the new layout,
4. writes the decision to the decision log (`decision_log.py`).
Before each decision the policy refits its service-time factor from the latencies the ingress reported in the last
`calibration.window_s` (since the last placement change, or the caller's restart in `apply_placement`, at most;
`placement.alpaserve.service_calibration`; simulated with the request overhead less `calibration.client_round_trip_ms`,
which the ingress's clock does not see), unless
a rollout ran in the period just past; the factor is logged (`service_scale`, `service_calibration`). The first
decision after a rollout has settled also refits the loading slowdown its moves are priced with on the requests that
arrived during that rollout, replayed through its steps as they ran (`placement.alpaserve.transition_calibration`;
logged as `loading_slowdown`, `loading_calibration`). While an operator has paused the decisions the refit goes on
every period (the placement stays frozen; the factor stays current for when decisions resume).
Between two periods a two-window rate test on the reported traffic (`detect_rate_shifts`) may trigger the decision
early (trigger 'shift' in the log), at most once per `cooldown_s` after the last decision (the test runs within the
cool-down too: a shift it finds there triggers the decision when the cool-down ends; a period or a look falling due
while a shift is found is taken as a shift decision; `placement.alpaserve.shift_trigger`). Such a decision judges
the candidates on the traffic since the shift, not on the whole period: the seconds since the change's estimated
time (`estimate_change_s`; at least `shift_min_fit_s`, which it waits for, at most a shift window). A move predicted
below `shift_confirm_below_gain` there must also be confirmed by the policy's longer fit. If it keeps (its move not
confirmed, or no move worth `min_gain` in the few seconds since the shift), it gets up to `shift_looks` (2) more
decisions, a shift window apart, each on the last two shift windows or the seconds since the change if fewer
(trigger 'shift_recheck'; `placement.alpaserve.shift_looks`).

Runtime allocation (each text model with `policies.polymorphing: {name: arlo}` outside the groups; Arlo §3.3):
`runtime_allocations.py` re-solves the model's runtime counts from the input lengths of its last allocation period
(`allocation_period_s`, Arlo: 120 s) and the controller applies a changed allocation as the model deployment's
`num_replicas` and `user_config` override; each allocation is logged as a decision of its own. With `autoscaling`
in the policy params, Arlo's target tracking (§4) adds or releases a replica first, every period.

The controller keeps no state Serve does not have: on start (first deployment, or a restart after it died) it
reads the running layout back from the application's deployed overrides, and its history from the GCS.

Serve's public interface: every update reads the deployed config through Serve's REST API on the Ray dashboard
(`controller.dashboard_url`), sets only the controller's own fields and puts the whole config back
(`live_update.py`), so an operator's own settings stay in force. An update Serve refuses, or a dashboard that does not
answer, fails that decision with an error naming the URL and Serve's reason; the running layout keeps serving, and
the controller keeps the layout it last applied.

Coexisting with a deployer that re-applies its own config (a KubeRay RayService reconciling `serveConfigV2`):
with `controller.mode: recommend` the controller applies nothing. Each decision reads the running layout back from
Serve and a move becomes a recommendation: the deployed config with the move's final layout merged in, served at
`GET /v1/placement/recommended` and written to `controller.recommendation_path`, for the operator to apply.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import yaml
from ray import serve

from placement.alpaserve.deployment_planning import replan_policy
from placement.alpaserve.placement_rollout import Rollout, SlotLayout, plan_rollout, transition_routes
from placement.alpaserve.service_calibration import ServiceCalibration
from placement.alpaserve.shift_looks import ShiftLooks
from placement.alpaserve.shift_trigger import ShiftTrigger
from placement.alpaserve.transition import Span, serving_placement
from placement.alpaserve.transition_calibration import LoadingCalibration, RolloutRun
from placement.arlo.live_allocator import AllocationDecision
from placement.core.calibration_settings import calibration_settle_s
from placement.core.deployment_spec import DeploymentSpec, parse_spec
from placement.core.placement_plan import GroupPlacement, Placement
from placement.core.profiles import ParallelConfig
from placement.core.traffic_window import RequestRecord, TrafficWindow, detect_rate_shifts, estimate_change_s
from rayserve_apps import metrics
from rayserve_apps.contracts import (
    APP_NAME,
    INGRESS_DEPLOYMENT,
    group_deployment_name,
    initial_layout,
    profiles_base_dir,
)
from rayserve_apps.control.decision_log import DecisionLog
from rayserve_apps.control.live_update import (
    apply_overrides,
    deployed_overrides,
    layout_overrides,
    merged_config,
)
from rayserve_apps.control.runtime_allocations import RuntimeAllocations, ScalingUpdate

logger = logging.getLogger("ray.serve")

#: Seconds to wait for the replicas of a rollout step to report the step's placement version.
STEP_TIMEOUT_S = 300.0
#: Poll interval while waiting for a step.
STEP_POLL_S = 0.25
#: Seconds between two rate-shift tests within a period.
SHIFT_POLL_S = 1.0
#: Seconds a shift's estimated change keeps from either end of the shift test's two windows (`estimate_change_s`;
#: at most a quarter of a window).
CHANGE_MIN_SIDE_S = 0.5


def layout_from_overrides(spec: DeploymentSpec, overrides: list[dict[str, Any]],
                          num_slots: int) -> tuple[SlotLayout, list[int], int, list[list[str]]] | None:
    """The running slots, their versions, the ingress's version and routes, read back from deployed overrides."""
    by_name = {o["name"]: o for o in overrides}
    # An operator's override of a deployment (without the controller's user_config) holds no layout.
    if any("user_config" not in by_name.get(name, {})
           for name in [INGRESS_DEPLOYMENT, *(group_deployment_name(i) for i in range(num_slots))]):
        return None
    slots: list[GroupPlacement | None] = []
    versions = []
    for i in range(num_slots):
        user_config = by_name[group_deployment_name(i)]["user_config"]
        versions.append(int(user_config.get("placement_version", 0)))
        if not user_config.get("config"):
            slots.append(None)
            continue
        slots.append(GroupPlacement(num_devices=user_config["num_devices"],
                                    config=ParallelConfig.model_validate(user_config["config"]),
                                    models=[m["name"] for m in user_config["models"]]))
    ingress = by_name[INGRESS_DEPLOYMENT]["user_config"]
    return SlotLayout(slots=slots), versions, int(ingress.get("placement_version", 0)), ingress.get("routes", [])


#: Nice increment of the controller's planning thread (the simulations that judge candidate placements) over the
#: replica's own (Ray starts its workers at nice 15, so planning runs at 19, the lowest): the serving processes on
#: the same cores keep precedence, so a decision takes less of a core from the requests in flight; when the cores
#: are saturated the decision takes longer instead.
PLANNING_NICE_INCREMENT = 4


def _lower_thread_priority() -> None:
    """Initializer of the planning thread: Linux nice values are per thread (`setpriority` on the thread's id)."""
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread,
                       min(19, os.getpriority(os.PRIO_PROCESS, thread) + PLANNING_NICE_INCREMENT))
    except OSError as error:
        logger.warning("placement controller: planning runs at the replica's priority (%s)", error)


def planning_executor() -> ThreadPoolExecutor:
    """The one thread the controller plans on, PLANNING_NICE_INCREMENT nicer than the replica."""
    return ThreadPoolExecutor(1, thread_name_prefix="plexserve-planning", initializer=_lower_thread_priority)


@serve.deployment
class PlacementController:
    """Keeps the running placement matched to the traffic (see the module doc)."""

    def __init__(self, spec: dict, app_name: str = APP_NAME):
        self.spec = parse_spec(spec)
        started = time.time()
        self.runtimes = RuntimeAllocations(self.spec, start_s=started)
        if self.spec.controller is None or (self.spec.placement is None and not self.runtimes.models):
            raise ValueError("the placement controller needs the spec's `controller` section and a placement or a "
                             "model with policies.polymorphing")
        self.settings = self.spec.controller
        self.app_name = app_name
        self._planning = planning_executor()
        #: True: moves are only recommended (`controller.mode: recommend`), never applied.
        self.recommend_only = self.settings.mode == "recommend"
        #: The last recommendation (recommend mode): the Serve config, its placement version, why and when.
        self.recommended: dict[str, Any] | None = None
        #: Group placement is re-planned only for an application with a placement.
        self.groups_enabled = self.spec.placement is not None
        self.policy = replan_policy(self.spec, profiles_base_dir(self.spec)) if self.groups_enabled else None
        self.models = sorted(self.spec.placement.models()) if self.spec.placement is not None else []
        self.slo_s = [self.spec.model(name).slo_ms / 1000.0 for name in self.models]
        #: Seconds of records the service-time refit replays (`controller.calibration.window_s`, at least a period).
        self.calibration_window_s = max(self.settings.period_s, self.settings.calibration.window_s)
        #: The reported records, as long as the longest of their uses: a period (the group decisions and the shift
        #: test), the service-time refit's window and the allocators' longest period (Arlo's Q_i come from the input
        #: lengths seen in it). Each use queries its own seconds.
        self.traffic = TrafficWindow(max(self.calibration_window_s, self.runtimes.window_s))
        self.started_s = started
        self.log = DecisionLog(app_name, self.settings.history_size)
        self.layout = initial_layout(self.spec)
        self.slot_versions = [0] * len(self.layout.slots)
        self.version = 0
        self.routes = self.layout.routes()
        self.recovered = self._read_state()
        #: The shifts found since the last group decision (time.monotonic() seconds; the cool-down counts from it).
        self.shift_trigger = ShiftTrigger(self.settings.cooldown_s or self.settings.period_s / 2, time.monotonic(),
                                          min_fit_s=self.settings.shift_min_fit_s)
        #: Wall-clock time the last rollout ended (its window does not calibrate the service times).
        self.layout_changed_s = 0.0
        #: Wall-clock time of the last calibration restart (`apply_placement(..., restart_calibration=True)`): the
        #: service-time refit's window starts no earlier.
        self.calibration_restarted_s = 0.0
        #: The last rollout as it ran, until the loading slowdown has been refitted on the requests during it.
        self.last_rollout: RolloutRun | None = None
        #: The looks after a kept shift decision (time.monotonic() seconds).
        self.shift_looks = ShiftLooks(self.settings.shift_looks)
        #: While paused the periodic decisions are skipped (an operator freezing the placement); `replan_now` and
        #: `apply_placement` still work.
        self.paused = False
        self._lock = asyncio.Lock()
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        logger.info("placement controller: %d models in %d group slots, %d polymorphing models, period %.0f s, "
                    "version %d%s",
                    len(self.models), len(self.layout.slots), len(self.runtimes.models), self.settings.period_s,
                    self.version, " (state read back from Serve)" if self.recovered else "")

    # ---- state ----

    def _read_state(self) -> bool:
        """Adopt what Serve runs (after a restart, or after an earlier controller's re-placements)."""
        try:
            overrides = deployed_overrides(self.app_name, self.settings.dashboard_url)
        except RuntimeError as error:
            logger.warning("placement controller: cannot read the deployed config (%s); assuming the builder's layout",
                           error)
            return False
        adopted = self.runtimes.read_back(overrides)
        state = layout_from_overrides(self.spec, overrides, len(self.layout.slots)) if self.groups_enabled else None
        if state is None:
            return bool(adopted)
        self.layout, self.slot_versions, ingress_version, self.routes = state
        self.version = max([ingress_version, *self.slot_versions])
        return True

    def state(self) -> dict[str, Any]:
        """What the controller believes runs: for tests, people and `GET /v1/placement`."""
        return {"layout": self.layout.model_dump(mode="json"), "routes": self.routes, "version": self.version,
                "slot_versions": self.slot_versions, "models": self.models, "recovered": self.recovered,
                "period_s": self.settings.period_s, "paused": self.paused, "runtimes": self.runtimes.state(),
                "service_scale": self.policy.service_scale if self.policy is not None else None,
                "loading_slowdown": (self.policy.transition.loading_slowdown
                                     if self.policy is not None and self.policy.transition is not None else None),
                "last_rollout": _describe_rollout(self.last_rollout),
                "calibration_since_s": self._calibration_since_s(), "mode": self.settings.mode}

    def recommendation(self) -> dict[str, Any]:
        """The last recommended Serve config (recommend mode) with its version, reason and time; `config` is None
        until a decision recommends a move (and always in apply mode)."""
        return {"mode": self.settings.mode, **(self.recommended or {"config": None})}

    def pause(self, paused: bool = True) -> bool:
        """Stop (or resume) the periodic decisions; returns the new setting. Either way the shifts found and the
        looks due are forgotten (the test does not run while paused): resumed decisions start from the traffic then,
        not from before the pause, nor from a decision that was still running when it began."""
        self.paused = bool(paused)
        self.shift_trigger.forget()
        self.shift_looks.cancel()
        logger.info("placement controller: periodic decisions %s", "paused" if self.paused else "resumed")
        return self.paused

    def history(self, limit: int | None = None) -> list[dict[str, Any]]:
        return self.log.recent(limit)

    def report(self, records: list[dict[str, Any]]) -> int:
        """Traffic records from an ingress replica; returns how many were taken."""
        parsed = [RequestRecord.from_json(r) for r in records]
        self.traffic.add(parsed)
        self.runtimes.observe(parsed)
        return len(records)

    # ---- decisions ----

    async def _loop(self) -> None:
        if self.routes != self.layout.routes() and not self.recommend_only:
            # a predecessor died between two steps of a rollout: finish it
            await self._logged("recovery", self._finish_interrupted_step)
        while True:
            shifts = await self._wait_for_period_or_shift()
            if self.paused:
                if self.groups_enabled:
                    try:
                        await self._refit_loading_slowdown()
                        await self._recalibrate()
                    except Exception:  # noqa: BLE001 - a failed refit must not stop the controller
                        logger.exception("placement controller: refit failed")
                continue
            group_decision = (lambda: self._shift_decision(shifts)) if shifts else self.replan_now
            for enabled, decide in ((self.groups_enabled, group_decision),
                                    (bool(self.runtimes.models), self.reallocate_runtimes)):
                if not enabled:
                    continue
                try:
                    await decide()
                except Exception:  # noqa: BLE001 - one failed decision must not stop the controller
                    logger.exception("placement controller: decision failed")

    async def _wait_for_period_or_shift(self) -> list[dict[str, Any]]:
        """Sleep until the period ends; meanwhile, every SHIFT_POLL_S, a detected rate shift (once the cool-down
        after the last decision has ended) or a look after a kept shift decision triggers a group decision at once.
        Returns the shifts found or pending when the period ends: the period decision is then a shift decision (empty
        list: a period decision)."""
        deadline = time.monotonic() + self.settings.period_s
        while True:
            await asyncio.sleep(min(SHIFT_POLL_S, max(deadline - time.monotonic(), 0.0)))
            period_due = time.monotonic() >= deadline
            if self.paused or not (self.groups_enabled and self.settings.shift_detection):
                if period_due:
                    return []
                continue
            now_wall, now_s = time.time(), time.monotonic()
            found = detect_rate_shifts(self.traffic, now_wall, self.models, self._shift_window_s(),
                                       self.settings.shift_z, self.settings.shift_min_ratio,
                                       self.settings.shift_min_requests)  # within the cool-down too
            # When the rates changed, on the trigger's clock (the records' arrivals are wall clock).
            change_wall = (estimate_change_s(self.traffic, now_wall, [s.model for s in found],
                                             2 * self._shift_window_s(),
                                             min(CHANGE_MIN_SIDE_S, self._shift_window_s() / 4)) if found else None)
            look_window_s = self.shift_looks.take_due(now_s)  # taken even if the look fails
            shifts = self.shift_trigger.poll([s.to_json() for s in found], now_s,
                                             due=period_due or look_window_s is not None,
                                             change_s=None if change_wall is None else now_s - (now_wall - change_wall))
            if period_due:
                return shifts
            try:
                if shifts:
                    await self._shift_decision(shifts)
                elif look_window_s is not None:
                    # The look fits the seconds since the change, when it is known and more recent than its window.
                    fit_s = self.shift_trigger.fit_window_s(time.monotonic(), look_window_s)
                    await self._logged("shift_recheck", lambda: self._decide_and_apply(fit_window_s=fit_s, look=True))
                else:
                    continue
            except Exception:  # noqa: BLE001 - one failed decision must not stop the controller
                logger.exception("placement controller: decision failed")
            deadline = time.monotonic() + self.settings.period_s

    async def _shift_decision(self, shifts: list[dict[str, Any]]) -> dict[str, Any]:
        """A group decision on the traffic since a detected rate shift (the seconds since its estimated change, at
        most a shift window); returns the logged decision."""
        fit_s = self.shift_trigger.fit_window_s(time.monotonic(), self._shift_window_s())
        logger.info("placement controller: rate shift %s: deciding now on the last %.1f s", shifts, fit_s)
        return await self._logged("shift", lambda: self._decide_and_apply(shifts=shifts, fit_window_s=fit_s))

    async def replan_now(self) -> dict[str, Any]:
        """Decide (and apply) now instead of at the end of the period; returns the logged decision."""
        if not self.groups_enabled:
            raise ValueError("this application has no group placement to re-plan (spec field 'placement')")
        return await self._logged("period", self._decide_and_apply)

    async def reallocate_runtimes(self) -> list[dict[str, Any]]:
        """Apply the target-tracking actions (autoscaled models) and then the runtime allocations that are due
        (Arlo's period per model); returns their logged decisions."""
        logged = [await self._logged("autoscaling", lambda m=model, u=update: self._apply_runtime(m, u))
                  for model, update in self.runtimes.scale(time.time()).items()]
        now = time.time()
        records = self.traffic.recent(now, self.runtimes.window_s) if self.runtimes.models else []
        decisions = self.runtimes.decide(now, records, observed_s=now - self.started_s)
        return logged + [await self._logged("allocation_period", lambda m=model, d=decision: self._apply_runtime(m, d))
                         for model, decision in decisions.items()]

    async def apply_placement(self, placement: dict[str, Any], reason: str = "operator",
                              restart_calibration: bool = False) -> dict[str, Any]:
        """Roll out a given placement (an operator's, or a planner's run offline); returns the logged decision. With
        `restart_calibration` the service-time refit leaves out the records from before the call, as it does after a
        re-placement, even if the placement is the one running: for a caller who knows the traffic until then does
        not describe what follows (a benchmark starting a new trace, a client fleet replaced)."""
        target = Placement.model_validate(placement)
        unknown = sorted(target.models() - set(self.models))
        if unknown:
            raise ValueError(f"placement names models this application does not place in groups: {unknown}")
        try:
            return await self._logged(reason, lambda: self._apply(target))
        finally:
            if restart_calibration:
                self.calibration_restarted_s = time.time()

    async def _logged(self, trigger: str, action) -> dict[str, Any]:
        async with self._lock:
            started = time.time()
            entry: dict[str, Any] = {"time_s": started, "trigger": trigger, "version_before": self.version}
            try:
                entry.update(await action())
            except Exception as error:  # noqa: BLE001 - logged as a failed decision, then re-raised
                entry.update(outcome="failed", error=f"{type(error).__name__}: {error}")
                entry["duration_s"] = time.time() - started
                self.log.record(entry)
                raise
            entry.update(duration_s=time.time() - started, version_after=self.version)
            return self.log.record(entry)

    def _shift_window_s(self) -> float:
        """Seconds of each of the shift test's two windows (at most half a period)."""
        return min(self.settings.shift_window_s, self.settings.period_s / 2)

    async def _planned(self, fn, *args):
        """`fn(*args)` on the planning thread (at low CPU priority), awaited without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._planning, functools.partial(fn, *args))

    async def _decide_and_apply(self, shifts: list[dict[str, Any]] | None = None, fit_window_s: float | None = None,
                                look: bool = False) -> dict[str, Any]:
        """One group decision on the window just past; after a rate shift (`shifts`), the candidates are judged on
        the traffic since the shift (`fit_window_s`: the shift test's window); a `look` after a kept shift decision
        on the last `fit_window_s` (`placement.alpaserve.shift_looks`)."""
        if self.recommend_only:
            await asyncio.to_thread(self._read_state)  # what runs is what the operator applied
        now = time.time()
        self.shift_trigger.decided(time.monotonic())
        if shifts is None and not look:
            self.shift_looks.cancel()  # any other decision answers the pending looks
        period_s = self.settings.period_s
        traffic = self.traffic.observed(now, self.models, self.slo_s, window_s=period_s)
        observed = {name: {"requests": s.requests, "answered": s.answered, "slo_met": s.slo_met, "rejected": s.rejected,
                           "failed": s.failed, "attainment": s.attainment}
                    for name, s in self.traffic.stats(now, window_s=period_s).items()}
        current = self.layout.placement()
        # The records just past refit the loading slowdown (after a rollout) and the service times before the
        # candidates are judged.
        loading = await self._refit_loading_slowdown(now)
        calibration = await self._recalibrate(now)
        decision = await self._planned(self.policy.decide, current, traffic, fit_window_s)
        entry: dict[str, Any] = {"observed": observed, "reason": decision.reason, "chosen": decision.chosen,
                                 "in_sample_choice": decision.in_sample_choice, "horizon_s": decision.horizon_s,
                                 "predicted_gain": decision.predicted_gain, "planning_s": decision.planning_s,
                                 "confirmation_gain": decision.confirmation_gain,
                                 "traffic": {m: f.model_dump() for m, f in decision.traffic.items()},
                                 "candidates": [{"name": c.name, "predicted_attainment": c.predicted_attainment,
                                                 "in_sample_attainment": c.in_sample_attainment,
                                                 "through_rollout_attainment": c.through_rollout_attainment,
                                                 "transition_s": c.transition_s, "move": c.move,
                                                 "groups": _describe(c.placement)} for c in decision.candidates]}
        entry["service_scale"] = self.policy.service_scale
        if fit_window_s is not None:
            entry["fit_window_s"] = fit_window_s  # the seconds since a shift (its change) the candidates were fitted on
        if calibration is not None:
            entry["service_calibration"] = calibration.to_json()
        if self.policy.transition is not None:
            entry["loading_slowdown"] = self.policy.transition.loading_slowdown
        if loading is not None:
            entry["loading_calibration"] = loading.to_json()
        if shifts is not None:
            entry["shifts"] = shifts
            self.shift_looks.after_shift(decision, self._shift_window_s(), time.monotonic())
        elif look:
            self.shift_looks.after_look(decision, self._shift_window_s(), time.monotonic())
        if decision.chosen == "keep":
            entry["outcome"] = "idle" if not any(len(a) for a in traffic.arrival_s) else "kept"
            return entry
        entry.update(await self._apply(decision.placement))
        return entry

    async def _recalibrate(self, now: float | None = None) -> ServiceCalibration | None:
        """Refit the policy's service-time factor on the last `calibration.window_s` of records since the last
        placement change or calibration restart (its own simulator, on the placement that served them); not within a
        period of either (loading slows serving; a restarted window holds too few requests). The requests of the
        window's last seconds are left out until every one of them has ended and been reported
        (`calibration_settle_s`: two SLOs plus a report period): the window's newest records are its fast answers. Its
        first as many seconds only fill the simulated queues (the live ones held the earlier requests' backlog). None:
        nothing refitted."""
        now = time.time() if now is None else now
        since_s = self._calibration_since_s()
        if now - since_s < self.settings.period_s:
            return None
        settle_s = self._settle_s()
        traffic = self.traffic.observed(now, self.models, self.slo_s, settle_s=settle_s, since_s=since_s,
                                        window_s=self.calibration_window_s)
        calibration = await self._planned(self.policy.calibrate, self.layout.placement(), traffic, settle_s)
        if calibration is not None and self.paused:
            logger.info("placement controller (paused): service-time factor x%.3f", self.policy.service_scale)
        return calibration

    def _calibration_since_s(self) -> float:
        """Wall-clock time before which no record is refitted on: the last rollout's end or calibration restart."""
        return max(self.layout_changed_s, self.calibration_restarted_s)

    def _settle_s(self) -> float:
        """Seconds after a request's arrival by which it has ended and been reported (`calibration_settle_s`)."""
        return calibration_settle_s(max(self.slo_s), self.settings.stats_report_period_s, self.settings.period_s)

    async def _refit_loading_slowdown(self, now: float | None = None) -> LoadingCalibration | None:
        """Once the requests of the last rollout have all ended and been reported (`calibration_settle_s` after it),
        refit the policy's loading slowdown on them and the previous rollouts' (`ReplanPolicy.calibrate_transition`);
        a rollout whose start the calibration window no longer holds is dropped unfitted. None: nothing refitted."""
        now = time.time() if now is None else now
        rollout = self.last_rollout
        settle_s = self._settle_s()
        if rollout is None or now - rollout.end_s < settle_s:
            return None
        self.last_rollout = None
        if rollout.start_s < now - self.calibration_window_s:
            return None
        traffic = self.traffic.observed(now, self.models, self.slo_s, settle_s=now - rollout.end_s,
                                        since_s=rollout.start_s, window_s=self.calibration_window_s)
        loading = await self._planned(self.policy.calibrate_transition, rollout, traffic)
        if loading is not None:
            logger.info("placement controller: loading slowdown x%.2f fitted on %d requests of the last %d "
                        "rollouts, x%.2f in force", loading.slowdown, loading.requests, loading.rollouts,
                        self.policy.transition.loading_slowdown)
        return loading

    async def _apply(self, target: Placement) -> dict[str, Any]:
        rollout = plan_rollout(self.layout, target, self.spec.cluster.num_devices, self.settings.max_changes_per_step)
        if not rollout.steps:
            return {"outcome": "kept", "diff": []}
        diff = [[c.to_json() for c in step.changes] for step in rollout.steps]
        if self.recommend_only:
            final = rollout.steps[-1].layout
            changed = sorted({c.slot for step in rollout.steps for c in step.changes})
            version = self.version + 1
            slot_versions = [version if i in changed else v for i, v in enumerate(self.slot_versions)]
            overrides = self._overrides(final, final.routes(), version=version, slot_versions=slot_versions)
            await asyncio.to_thread(self._recommend, overrides, version, "placement")
            return {"outcome": "recommended", "diff": diff, "placement": _describe(final.placement())}
        try:
            await asyncio.to_thread(self._run_rollout, rollout)
        except Exception:
            # The step that failed left its slots as they ran; route to what the controller last applied.
            if self.routes != self.layout.routes():
                try:
                    await asyncio.to_thread(self._deploy, self.layout, self.layout.routes(), [])
                except Exception as error:  # noqa: BLE001 - the next rollout re-routes; the first error is raised
                    logger.error("placement controller: could not route back to the running layout: %s", error)
            raise
        finally:
            self.layout_changed_s = time.time()
        for change in rollout.changes:
            metrics.placement_changes_total().inc(tags={"kind": change.kind})
        return {"outcome": "applied", "diff": diff, "placement": _describe(self.layout.placement())}

    async def _apply_runtime(self, model: str, update: AllocationDecision | ScalingUpdate) -> dict[str, Any]:
        """Apply a runtime allocation or a scaling action of one polymorphing model as its deployment's override."""
        if isinstance(update, ScalingUpdate):
            entry: dict[str, Any] = {"duty": "autoscaling", "model": model, "scaling": update.model_dump(mode="json")}
            kind, replicas_changed = update.action, abs(update.num_replicas - update.previous_num_replicas)
        else:
            entry = {"duty": "runtime_allocation", "model": model, "allocation": update.model_dump(mode="json")}
            if not update.changed:
                return {**entry, "outcome": "kept"}
            kind, replicas_changed = "runtime", update.replicas_changed
        if self.recommend_only:
            await asyncio.to_thread(self._read_state)
            overrides = self._overrides(self.layout, self.routes, pending={model: update})
            await asyncio.to_thread(self._recommend, overrides, self.version, f"{entry['duty']} of {model}")
            return {**entry, "outcome": "recommended"}
        overrides = self._overrides(self.layout, self.routes, pending={model: update})
        await asyncio.to_thread(self._put, overrides)
        self.runtimes.commit({model: update})
        if replicas_changed:
            metrics.placement_changes_total().inc(replicas_changed, tags={"kind": kind})
        return {**entry, "outcome": "applied"}

    def _overrides(self, layout: SlotLayout, routes: list[list[str]],
                   pending: dict[str, AllocationDecision | ScalingUpdate] | None = None, version: int | None = None,
                   slot_versions: list[int] | None = None) -> list[dict[str, Any]]:
        """Every override the application runs with: group slots and ingress (with a placement), runtime allocations
        (the `pending` decisions instead of the running allocations of their models); at the running versions
        unless `version` / `slot_versions` say otherwise."""
        version = self.version if version is None else version
        slot_versions = self.slot_versions if slot_versions is None else slot_versions
        groups = (layout_overrides(self.spec, layout, routes, slot_versions, version) if self.groups_enabled else [])
        return groups + self.runtimes.overrides(pending)

    def _put(self, overrides: list[dict[str, Any]]) -> None:
        """Apply the controller's fields through Serve's REST API (the deployed config, merged); raise naming the
        URL and Serve's reason when the dashboard does not answer or Serve refuses."""
        try:
            apply_overrides(self.app_name, overrides, url=self.settings.dashboard_url,
                            timeout_s=self.settings.api_timeout_s)
        except Exception as error:
            logger.error("placement controller: update not applied, the running layout keeps serving: %s", error)
            raise

    def _recommend(self, overrides: list[dict[str, Any]], version: int, reason: str) -> None:
        """Recommend mode: keep (and write to `recommendation_path`) the deployed config with `overrides` merged in."""
        config = merged_config(self.app_name, overrides, self.settings.dashboard_url, self.settings.api_timeout_s)
        self.recommended = {"config": config, "version": version, "reason": reason, "time_s": time.time()}
        path = self.settings.recommendation_path
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".yaml", delete=False) as out:
                yaml.safe_dump(config, out, sort_keys=False)
            os.replace(out.name, path)  # a reader never sees half a file
        logger.info("placement controller: recommended placement version %d (%s)%s", version, reason,
                    f", written to {path}" if path else "")

    # ---- rollout (runs in a thread: Serve's config API and handles' .result() block) ----

    def _run_rollout(self, rollout: Rollout) -> None:
        """Run the rollout's steps, and keep them as they ran (`last_rollout`: each step's routes, its Serve updates
        at full speed, its slot changes loading where they load a model) for the loading-slowdown refit."""
        self.last_rollout = None
        started = time.time()
        spans: list[Span] = []
        for number, step in enumerate(rollout.steps, start=1):
            logger.info("placement controller: step %d/%d: %s", number, len(rollout.steps),
                        ", ".join(f"slot {c.slot} {c.kind}" for c in step.changes))
            during = transition_routes(self.layout, step.layout)
            serving = serving_placement(self.layout, step.layout, during)
            loads = any(c.after is not None for c in step.changes)
            marks = [time.time()]
            if during != self.routes:  # 1. stop routing to what this step drops
                self._deploy(self.layout, during, changed=[])
            marks.append(time.time())
            self._deploy(step.layout, during, changed=[c.slot for c in step.changes])  # 2. change the slots
            marks.append(time.time())
            self._deploy(step.layout, step.layout.routes(), changed=[])  # 3. route to the new layout
            marks.append(time.time())
            spans += [Span(begin - started, end - started, serving, loading=loads and phase == 1)
                      for phase, (begin, end) in enumerate(zip(marks, marks[1:])) if end > begin]
        self.last_rollout = RolloutRun(started, time.time(), tuple(spans))

    async def _finish_interrupted_step(self) -> dict[str, Any]:
        await asyncio.to_thread(self._deploy, self.layout, self.layout.routes(), [])
        return {"outcome": "applied", "diff": [],
                "reason": "finished a rollout step interrupted by a controller restart"}

    def _deploy(self, layout: SlotLayout, routes: list[list[str]], changed: list[int]) -> None:
        """One Serve update: `layout` routed as `routes`, the `changed` slots at a new version. The slots' versions
        are taken only once Serve accepted it (a refused update leaves them as they run); the placement version
        only grows, so that no two configs carry the same one."""
        self.version += 1
        slot_versions = [self.version if i in changed else v for i, v in enumerate(self.slot_versions)]
        self._put(self._overrides(layout, routes, slot_versions=slot_versions))
        self.slot_versions = slot_versions
        self._wait_for_version(changed)
        self.layout, self.routes = layout, routes

    def _wait_for_version(self, changed: list[int]) -> None:
        """Until the ingress routes by the new version and every changed slot runs it (Serve's application status
        can still read RUNNING from before an update has begun)."""
        ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=self.app_name)
        groups = {slot: serve.get_deployment_handle(group_deployment_name(slot), app_name=self.app_name)
                  for slot in changed}
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while time.monotonic() < deadline:
            done = ingress.placement_version.remote().result(timeout_s=STEP_TIMEOUT_S) >= self.version
            done = done and all(g.info.remote().result(timeout_s=STEP_TIMEOUT_S)["placement_version"]
                                >= self.slot_versions[s] for s, g in groups.items())
            if done:
                return
            time.sleep(STEP_POLL_S)
        raise TimeoutError(f"placement version {self.version} not running within {STEP_TIMEOUT_S} s")


def _describe_rollout(rollout: RolloutRun | None) -> dict[str, Any] | None:
    """The last rollout as it ran, while it awaits the loading-slowdown refit: its seconds and its steps' spans."""
    if rollout is None:
        return None
    return {"duration_s": rollout.end_s - rollout.start_s,
            "spans": [{"start_s": span.start_s, "end_s": span.end_s, "loading": span.loading,
                       "serving": [sorted(g.models) for g in span.placement.groups]} for span in rollout.spans]}


def _describe(placement: Placement) -> list[dict[str, Any]]:
    return [{"num_devices": g.num_devices, "config": g.config.key(), "models": sorted(g.models)}
            for g in placement.groups]
