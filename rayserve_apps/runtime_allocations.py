"""Arlo's periodic runtime re-allocation in the live app: the placement controller's second duty (Arlo §3.3, §5).

A text model served with `policies.polymorphing: {name: arlo}` outside any group is one deployment `model-<name>`
whose replicas run static-shape runtimes; its user_config maps replica rank -> runtime max length
(`PolymorphUserConfig`). Every controller period, `RuntimeAllocations.decide` hands each such model's
`placement.arlo_live.LiveRuntimeAllocator` the input lengths the ingress reported over the model's last allocation
period (Arlo §5: 120 s, `allocation_period_s`); once per period the allocator re-solves Eq. 1-7 for the model's
current number of replicas and returns the fewest ranks to switch. The controller applies a changed allocation as the
deployment's override (`num_replicas`, `user_config`) in the application's Serve config (`overrides`): Serve calls
`reconfigure` on the running replicas, which build their new runtime before swapping it in, so no request is dropped.

The running allocation lives in Serve's config, not here: after a controller restart `read_back` adopts it.
"""

from __future__ import annotations

from typing import Any, Iterable

from placement.arlo_live import AllocationDecision, LiveRuntimeAllocator
from placement.spec import DeploymentSpec
from placement.traffic_window import RequestRecord
from rayserve_apps.app import model_deployment_name
from rayserve_apps.polymorph_runtime_deployment import PolymorphingPolicyParams, PolymorphUserConfig, allocation_update


class RuntimeAllocations:
    """The allocators and the running allocation (rank -> max length, version) of every polymorphing model."""

    def __init__(self, spec: DeploymentSpec, start_s: float):
        self.allocators: dict[str, LiveRuntimeAllocator] = {}
        self.running: dict[str, PolymorphUserConfig] = {}
        for name in spec.polymorphing_models():
            params = spec.policy("polymorphing", name).params  # type: ignore[union-attr]
            policy = PolymorphingPolicyParams.model_validate(params)
            counts = policy.initial_counts or {length: 1 for length in policy.capacities}
            num_replicas, user_config = allocation_update({}, counts, version=0)  # what the app builder deploys
            self.running[name] = PolymorphUserConfig.model_validate(user_config)
            self.allocators[name] = LiveRuntimeAllocator.from_policy_params(
                params, slo_s=spec.model(name).slo_ms / 1000.0, num_instances=num_replicas, model=name, start_s=start_s)
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
            self.running[name] = PolymorphUserConfig.model_validate(override["user_config"])
            self.allocators[name].version = self.running[name].version
            adopted.append(name)
        return adopted

    def overrides(self, pending: dict[str, AllocationDecision] | None = None) -> list[dict[str, Any]]:
        """`deployments:` overrides that run the current allocations, or the `pending` ones for the models they name
        (written with every config apply)."""
        configs = {**self.running, **{name: PolymorphUserConfig.model_validate(d.user_config) for name, d in (pending or {}).items()}}
        return [{"name": model_deployment_name(name), "num_replicas": len(config.assignment),
                 "user_config": config.model_dump(mode="json")} for name, config in configs.items()]

    def decide(self, now_s: float, records: Iterable[RequestRecord], observed_s: float) -> dict[str, AllocationDecision]:
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

    def commit(self, decisions: dict[str, AllocationDecision]) -> None:
        """Record applied decisions as the running allocations."""
        for name, decision in decisions.items():
            self.running[name] = PolymorphUserConfig.model_validate(decision.user_config)

    def state(self) -> dict[str, Any]:
        return {name: config.model_dump(mode="json") for name, config in self.running.items()}
