"""Planning a deployment spec's placement when the spec gives none (AlpaServe §4.2).

A deployment spec may carry a `planning` section instead of a `placement`: where the profiles come from
(measured by `parallel/`, or the paper's reproduction profiles), the traffic to plan for, and the planner's knobs,
in the planning spec's own vocabulary (`placement/plan_spec.py`). The models, their SLOs and the cluster come from
the deployment spec itself, so the two never disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from placement.placement_plan import Placement
from placement.plan_spec import PlannerSpec, PlanSpec, ProfilesSpec, SimulationSpec, WorkloadSpec, prepare, run_planner
from placement.spec import DeploymentSpec, format_validation_error


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


def plan_deployment(spec: DeploymentSpec, base_dir: str | Path = ".") -> Placement:
    """The placement of `spec`'s models on its cluster, planned from its `planning` section."""
    if spec.planning is None:
        raise ValueError("the spec has neither a placement nor a planning section")
    planning = parse_planning(spec.planning)
    plan_spec = PlanSpec(
        profiles=planning.profiles, models=[m.name for m in spec.models], slo_ms={m.name: m.slo_ms for m in spec.models},
        workload=planning.workload, cluster=spec.cluster, planner=planning.planner, simulation=planning.simulation,
    )
    profiles, names, workload = prepare(plan_spec, Path(base_dir))
    placement = run_planner(plan_spec, profiles, names, workload)
    unplaced = sorted({m.name for m in spec.models} - placement.models())
    if unplaced:
        raise ValueError(f"the planner placed no replica of {unplaced} on {spec.cluster.num_devices} devices; "
                         "add devices or give a placement")
    return placement
