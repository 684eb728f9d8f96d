"""Arlo's periodic runtime re-allocation in the live app: the placement controller's second duty (Arlo §3.3, §5).

A text model served with `policies.polymorphing: {name: arlo}` outside any group is one deployment `model-<name>`
whose replicas run static-shape runtimes; its user_config maps replica rank -> runtime max length
(`PolymorphAssignmentParams`). Every controller period, `RuntimeAllocations.decide` hands each such model's
`placement.arlo.live_allocator.LiveRuntimeAllocator` the input lengths the ingress reported over the model's last
allocation period (Arlo §5: 120 s, `allocation_period_s`); once per period the allocator re-solves Eq. 1-7 for the
model's current number of replicas and returns the fewest ranks to switch. The controller applies a changed allocation
as the deployment's override (`num_replicas`, `user_config`) in the application's Serve config (`overrides`): Serve
calls `reconfigure` on the running replicas, which build their new runtime before swapping it in, so no request is
dropped.

With `autoscaling` in the policy params, `scale` also applies Arlo's target tracking (§4) every controller period:
one more replica with the longest runtime when the p98 latency of the requests answered since the last check
reaches 95% of the SLO, one fewer when it stays under 50% for `scale_in_period_s`
(`placement.arlo.autoscaling.TargetTrackingAutoscaler`, `placement.arlo.live_allocator.apply_scaling`); the allocator
then re-solves Eq. 1-7 for the new replica count at its next period.

The running allocation lives in Serve's config, not here: after a controller restart `read_back` adopts it.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field

from placement.arlo.autoscaling import TargetTrackingAutoscaler
from placement.arlo.live_allocator import AllocationDecision, LiveRuntimeAllocator, apply_scaling
from placement.core.deployment_spec import DeploymentSpec
from placement.core.traffic_window import RequestRecord
from rayserve_apps.contracts import (
    PolymorphAssignmentParams,
    allocation_update,
    model_deployment_name,
    polymorphing_params,
)

#: Latencies kept per model between two autoscaling checks (older ones are dropped first).
MAX_PENDING_LATENCIES = 100_000


class ScalingUpdate(BaseModel):
    """One target-tracking action on a polymorphing model's deployment and the update realising it."""

    model_config = ConfigDict(frozen=True)

    action: Literal["scale_out", "scale_in"] = Field(description="Add a replica (longest runtime) or release one.")
    p98_s: float = Field(description="p98 latency of the requests answered since the last check, in seconds.")
    previous_num_replicas: int = Field(description="Replicas before the action.")
    num_replicas: int = Field(description="Serve num_replicas after the action.")
    user_config: dict[str, Any] = Field(description="Serve user_config: PolymorphAssignmentParams as JSON (assignment, "
                                                    "version).")


class RuntimeAllocations:
    """The allocators and the running allocation (rank -> max length, version) of every polymorphing model."""

    def __init__(self, spec: DeploymentSpec, start_s: float):
        self.allocators: dict[str, LiveRuntimeAllocator] = {}
        self.running: dict[str, PolymorphAssignmentParams] = {}
        self.autoscalers: dict[str, TargetTrackingAutoscaler] = {}
        self._latencies_s: dict[str, deque[float]] = {}
        for name in spec.polymorphing_models():
            policy = polymorphing_params(spec, name)  # not None: polymorphing_models() names models with the policy
            assert policy is not None
            scaling = policy.autoscaling_params(spec.model(name).slo_ms)
            if scaling is not None:
                self.autoscalers[name] = TargetTrackingAutoscaler(scaling, max(policy.capacities))
                self._latencies_s[name] = deque(maxlen=MAX_PENDING_LATENCIES)
            counts = policy.initial_counts or {length: 1 for length in policy.capacities}
            num_replicas, user_config = allocation_update({}, counts, version=0)  # what the app builder deploys
            self.running[name] = PolymorphAssignmentParams.model_validate(user_config)
            self.allocators[name] = LiveRuntimeAllocator.from_policy_params(
                policy.model_dump(), slo_s=spec.model(name).slo_ms / 1000.0, num_instances=num_replicas, model=name,
                start_s=start_s)
        #: Seconds of request records the controller keeps for the allocators (their longest period).
        self.window_s = max((a.period_s for a in self.allocators.values()), default=0.0)

    @property
    def models(self) -> list[str]:
        return list(self.allocators)

    def read_back(self, overrides: Iterable[dict[str, Any]]) -> list[str]:
        """Adopt the allocations found in the application's deployed overrides; returns the models adopted."""
        by_name = {o["name"]: o for o in overrides}
        adopted = []
        for name in self.models:
            override = by_name.get(model_deployment_name(name))
            if override is None or not override.get("user_config"):
                continue
            self.running[name] = PolymorphAssignmentParams.model_validate(override["user_config"])
            self.allocators[name].version = self.running[name].version
            adopted.append(name)
        return adopted

    def overrides(self, pending: dict[str, AllocationDecision | ScalingUpdate] | None = None) -> list[dict[str, Any]]:
        """`deployments:` overrides that run the current allocations, or the `pending` ones for the models they name
        (written with every config apply)."""
        configs = {**self.running,
                   **{name: PolymorphAssignmentParams.model_validate(d.user_config)
                      for name, d in (pending or {}).items()}}
        return [{"name": model_deployment_name(name), "num_replicas": len(config.assignment),
                 "user_config": config.model_dump(mode="json")} for name, config in configs.items()]

    def decide(self, now_s: float, records: Iterable[RequestRecord],
               observed_s: float) -> dict[str, AllocationDecision]:
        """The allocators' decisions due now (each once per its period), from `records` covering the last
        `observed_s` seconds; the running allocations are not changed until `commit`."""
        records = list(records)
        decisions = {}
        for name, allocator in self.allocators.items():
            running = self.running[name]
            lengths = [r.input_tokens for r in records if r.model == name and r.arrival_s >= now_s - allocator.period_s]
            decision = allocator.decide(now_s, lengths, window_s=max(min(allocator.period_s, observed_s), 1e-9),
                                        previous_assignment=running.assignment, previous_version=running.version,
                                        num_instances=len(running.assignment))
            if decision is not None:
                decisions[name] = decision
        return decisions

    def observe(self, records: Iterable[RequestRecord]) -> None:
        """Take the latencies of answered requests of autoscaled models, for the next `scale` check."""
        for record in records:
            pending = self._latencies_s.get(record.model)
            if pending is not None and record.outcome == "ok" and record.latency_ms is not None:
                pending.append(record.latency_ms / 1000.0)

    def scale(self, now_s: float) -> dict[str, ScalingUpdate]:
        """Arlo §4 target tracking over the latencies observed since the last check; the running allocations are
        not changed until `commit`."""
        updates = {}
        for name, scaler in self.autoscalers.items():
            latencies = list(self._latencies_s[name])
            self._latencies_s[name].clear()
            running = self.running[name]
            # The controller does not see per-replica load: every rank counts as equally busy (see apply_scaling).
            decision = scaler.decide(now_s, latencies, {rank: 0 for rank in running.assignment})
            if decision.action == "none":
                continue
            assignment = apply_scaling(running.assignment, decision.action, scaler.longest_max_length_tokens)
            updates[name] = ScalingUpdate(
                action=decision.action, p98_s=decision.p98_s or 0.0, previous_num_replicas=len(running.assignment),
                num_replicas=len(assignment),
                user_config=PolymorphAssignmentParams(assignment=assignment,
                                                      version=running.version + 1).model_dump(mode="json"))
        return updates

    def commit(self, decisions: dict[str, AllocationDecision | ScalingUpdate]) -> None:
        """Record applied decisions (allocations or scaling updates) as the running allocations."""
        for name, decision in decisions.items():
            self.running[name] = PolymorphAssignmentParams.model_validate(decision.user_config)

    def state(self) -> dict[str, Any]:
        return {name: config.model_dump(mode="json") for name, config in self.running.items()}
