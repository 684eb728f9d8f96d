"""Planning a deployment spec's placement when the spec gives none (AlpaServe §4.2).

A deployment spec may carry a `planning` section instead of a `placement`: where the profiles come from
(measured by `parallel/`, or the paper's reproduction profiles), the traffic to plan for, and the planner's knobs,
in the planning spec's own vocabulary (`placement/alpaserve/plan_spec.py`). The models, their SLOs and the cluster
come from the deployment spec itself, so the two never disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from placement.alpaserve.plan_spec import (
    PlannerSpec,
    PlanSpec,
    ProfilesSpec,
    SimulationSpec,
    WorkloadSpec,
    model_names,
    planner_config,
    prepare,
    run_planner,
)
from placement.alpaserve.replanning import ReplanPolicy
from placement.core.deployment_spec import DeploymentSpec, format_validation_error
from placement.core.placement_plan import Placement


class DeploymentPlanning(BaseModel):
    """The `planning` section of a deployment spec."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profiles: ProfilesSpec = Field(description="Where the latency and memory profiles of the spec's models come from.")
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec, description="The traffic to plan for.")
    planner: PlannerSpec = Field(default_factory=PlannerSpec, description="The planner and its knobs.")
    simulation: SimulationSpec = Field(default_factory=SimulationSpec, description="The simulated system.")


def parse_planning(data: dict[str, Any]) -> DeploymentPlanning:
    try:
        return DeploymentPlanning.model_validate(data)
    except ValidationError as error:
        message = format_validation_error(error).replace("; ", "; planning.")
        raise ValueError(f"invalid deployment spec: planning.{message}") from None


def planning_spec(spec: DeploymentSpec, models: list[str] | None = None) -> PlanSpec:
    """The planning spec of a deployment spec's `planning` section, for `models` (default: the spec's models that
    run outside the ingress)."""
    if spec.planning is None:
        raise ValueError("the spec has neither a placement nor a planning section")
    planning = parse_planning(spec.planning)
    names = models if models is not None else [m.name for m in spec.models if m.in_ingress == "never"]
    return PlanSpec(
        profiles=planning.profiles, models=names, slo_ms={name: spec.model(name).slo_ms for name in names},
        workload=planning.workload, cluster=spec.cluster, planner=planning.planner, simulation=planning.simulation,
    )


def replan_policy(spec: DeploymentSpec, base_dir: str | Path = ".") -> ReplanPolicy:
    """The live controller's keep-or-move policy for `spec` (its `controller` and `planning` sections)."""
    if spec.controller is None:
        raise ValueError("the spec has no controller section")
    plan_spec = planning_spec(spec, sorted(spec.placement.models()) if spec.placement is not None else None)
    profiles = plan_spec.profiles.load(Path(base_dir))
    model_names(plan_spec, profiles)  # every placed model has a profile, or a ValueError names those without
    settings = spec.controller
    groups = len(spec.placement.groups) if spec.placement is not None else 0
    return ReplanPolicy(profiles=profiles, num_devices=spec.cluster.num_devices,
                        device_memory_bytes=spec.cluster.device_memory_bytes,
                        planner=planner_config(plan_spec), min_gain=settings.min_gain,
                        shift_confirm_below_gain=settings.shift_confirm_below_gain,
                        fit_window_s=settings.fit_window_s, held_out_resamples=settings.held_out_resamples,
                        horizon_s=settings.horizon_periods * settings.period_s,
                        transition=settings.transition if settings.price_transitions else None,
                        num_slots=max(groups, settings.group_slots or spec.cluster.num_devices),
                        max_changes_per_step=settings.max_changes_per_step,
                        calibration=settings.calibration if settings.calibrate_service else None)


def plan_deployment(spec: DeploymentSpec, base_dir: str | Path = ".") -> Placement:
    """The placement of `spec`'s models on its cluster, planned from its `planning` section."""
    plan_spec = planning_spec(spec)
    profiles, names, workload = prepare(plan_spec, Path(base_dir))
    placement = run_planner(plan_spec, profiles, names, workload)
    unplaced = sorted(set(plan_spec.models) - placement.models())
    if unplaced:
        raise ValueError(f"the planner placed no replica of {unplaced} on {spec.cluster.num_devices} devices; "
                         "add devices or give a placement")
    return placement
